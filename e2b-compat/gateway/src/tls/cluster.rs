//! Mutual TLS between the nodes of a shared database. `copse tls cluster-ca`
//! makes the cluster's CA; `copse tls node-cert` signs each node a
//! certificate good for both ends of a connection. A node serves forwarded
//! calls on a listener of its own (`--cluster-listen`) that completes a
//! handshake only with a client showing a certificate of that CA, and
//! forwards to other nodes only over TLS that verifies theirs. Only such a
//! connection can carry a call another node has already forwarded.
//!
//! The CA vouches for nothing outside the cluster: only the nodes' peer
//! listeners and forwarding clients trust it, never a system trust store.
//!
//! `copse tls revoke` adds node certificates to the CA's revocation list
//! (`crl.pem`, signed by the CA) and, given the cluster's database,
//! publishes it there. A node takes a newer list from the database or its
//! own directory at each heartbeat (and from its directory at start), and
//! then refuses those certificates at both ends: a revoked node can neither
//! forward to it nor be forwarded to by it, and its open connections are
//! closed ([`super::revocation`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use rcgen::{
    CertificateRevocationListParams, ExtendedKeyUsagePurpose, Issuer, KeyIdMethod, KeyPair, RevocationReason,
    RevokedCertParams, SerialNumber,
};
use time::{Duration, OffsetDateTime};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ClientConfig, ServerConfig};

use super::revocation::Revocations;

/// The CA's certificate, in the CA's directory and in each node's.
pub const CA_CERT: &str = "ca.pem";
/// The CA's key: only where node certificates are signed.
const CA_KEY: &str = "ca-key.pem";
const NODE_CERT: &str = "node.pem";
const NODE_KEY: &str = "node-key.pem";
const CA_NAME: &str = "copse cluster CA";
/// The CA's revocation list, signed by it: written beside the CA key by
/// `copse tls revoke`, copied into each node's directory.
pub const CRL: &str = "crl.pem";
/// The revoked serials (hex) and when each was revoked (Unix seconds), one
/// per line: what each new list is made from.
const REVOKED: &str = "revoked";

/// Writes a new cluster CA (certificate and key) into `dir`.
pub fn init_ca(dir: &Path) -> anyhow::Result<PathBuf> {
    let (cert, key) = (dir.join(CA_CERT), dir.join(CA_KEY));
    refuse_existing(&[cert.clone(), key.clone()], dir)?;
    let ca_key = KeyPair::generate()?;
    let ca_cert = super::mint::ca_params(CA_NAME)?.self_signed(&ca_key)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    super::mint::write(&key, &ca_key.serialize_pem(), 0o600)?;
    super::mint::write(&cert, &ca_cert.pem(), 0o644)?;
    Ok(cert)
}

/// Signs a node certificate for `hosts` (the names or addresses other
/// nodes reach it by) with the CA in `ca_dir`, and writes it, its key and
/// the CA's certificate into `out`: what `copse up --cluster-tls` reads.
pub fn issue(ca_dir: &Path, hosts: &[String], out: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(!hosts.is_empty(), "name at least one host other nodes reach this one by");
    let read = |name: &str| {
        let path = ca_dir.join(name);
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
    };
    let (ca_pem, ca_key) = (read(CA_CERT)?, read(CA_KEY)?);
    let ca_key = KeyPair::from_pem(&ca_key).context("parsing the cluster CA's key")?;
    let issuer = Issuer::new(super::mint::ca_params(CA_NAME)?, ca_key);
    let files = [out.join(CA_CERT), out.join(NODE_CERT), out.join(NODE_KEY)];
    refuse_existing(&files, out)?;

    // One certificate for both ends: a node serves forwarded calls and
    // forwards them.
    let both = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    let leaf = super::mint::leaf_params(hosts.to_vec(), &format!("copse node {}", hosts[0]), both)?;
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;

    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    super::mint::write(&files[2], &leaf_key.serialize_pem(), 0o600)?;
    super::mint::write(&files[1], &leaf_cert.pem(), 0o644)?;
    super::mint::write(&files[0], &ca_pem, 0o644)?;
    // A new node starts with the certificates revoked so far.
    if let Ok(crl) = std::fs::read_to_string(ca_dir.join(CRL)) {
        super::mint::write(&out.join(CRL), &crl, 0o644)?;
    }
    Ok(())
}

/// Revokes the node certificates in `certs` (PEM files) with the CA in
/// `ca_dir`: adds them to its list and writes a new revocation list signed
/// by the CA (`ca_dir/crl.pem`), whose path it returns. A certificate
/// another CA signed is refused, and revoking one twice keeps its date.
pub fn revoke(ca_dir: &Path, certs: &[PathBuf]) -> anyhow::Result<PathBuf> {
    anyhow::ensure!(!certs.is_empty(), "name at least one node certificate to revoke");
    let read = |path: &Path| std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    let ca_der = CertificateDer::from_pem_slice(&read(&ca_dir.join(CA_CERT))?).context("parsing the CA certificate")?;
    let (_, ca) = x509_parser::parse_x509_certificate(&ca_der).context("parsing the CA certificate")?;
    let ca_key = String::from_utf8(read(&ca_dir.join(CA_KEY))?).context("the CA key is not PEM")?;
    let list = ca_dir.join(REVOKED);
    let mut revoked = match std::fs::read_to_string(&list) {
        Ok(text) => parse_revoked(&text).with_context(|| format!("reading {}", list.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", list.display())),
    };
    let now = OffsetDateTime::now_utc();
    for path in certs {
        let der =
            CertificateDer::from_pem_slice(&read(path)?).with_context(|| format!("parsing {}", path.display()))?;
        let (_, cert) =
            x509_parser::parse_x509_certificate(&der).with_context(|| format!("parsing {}", path.display()))?;
        if cert.verify_signature(Some(ca.public_key())).is_err() {
            bail!("{} was not signed by the cluster CA in {}", path.display(), ca_dir.display());
        }
        revoked.entry(hex(cert.raw_serial())).or_insert(now.unix_timestamp());
    }
    let issuer = Issuer::new(super::mint::ca_params(CA_NAME)?, KeyPair::from_pem(&ca_key)?);
    let crl = CertificateRevocationListParams {
        this_update: now,
        next_update: now + Duration::days(3650),
        // Each list supersedes the one before: nodes take only a higher
        // number, even from two revokes in one second.
        crl_number: SerialNumber::from(next_number(&ca_dir.join(CRL), now)?),
        issuing_distribution_point: None,
        revoked_certs: revoked
            .iter()
            .map(|(serial, at)| {
                Ok(RevokedCertParams {
                    serial_number: SerialNumber::from_slice(&unhex(serial)?),
                    revocation_time: OffsetDateTime::from_unix_timestamp(*at)?,
                    reason_code: Some(RevocationReason::KeyCompromise),
                    invalidity_date: None,
                })
            })
            .collect::<anyhow::Result<_>>()?,
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(&issuer)?;
    let lines: String = revoked.iter().map(|(serial, at)| format!("{serial} {at}\n")).collect();
    replace(&list, &lines)?;
    let path = ca_dir.join(CRL);
    replace(&path, &crl.pem()?)?;
    Ok(path)
}

/// The CRL number for a list made `now`: its Unix time, or one past the
/// last list's number if that is not below it.
fn next_number(last: &Path, now: OffsetDateTime) -> anyhow::Result<u64> {
    let now = now.unix_timestamp().unsigned_abs();
    let Some(pem) = read_list(last)? else {
        return Ok(now);
    };
    let der = CertificateRevocationListDer::from_pem_slice(pem.as_bytes())
        .with_context(|| format!("parsing {}", last.display()))?;
    let (_, crl) = x509_parser::parse_x509_crl(&der).with_context(|| format!("parsing {}", last.display()))?;
    let previous = crl.crl_number().and_then(|n| u64::try_from(n).ok()).unwrap_or(0);
    Ok(now.max(previous + 1))
}

/// The lines of the CA's `revoked` file: serial (hex) → revocation time.
fn parse_revoked(text: &str) -> anyhow::Result<BTreeMap<String, i64>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let (serial, at) = line.split_once(' ').with_context(|| format!("odd line {line:?}"))?;
            unhex(serial)?;
            Ok((serial.to_string(), at.trim().parse().with_context(|| format!("odd time in {line:?}"))?))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> anyhow::Result<Vec<u8>> {
    anyhow::ensure!(
        !text.is_empty() && text.len().is_multiple_of(2) && text.bytes().all(|b| b.is_ascii_hexdigit()),
        "{text:?} is not a serial number in hex"
    );
    (0..text.len()).step_by(2).map(|i| Ok(u8::from_str_radix(&text[i..i + 2], 16)?)).collect()
}

/// Writes `contents` to `path` whole (a reader sees the old file or the
/// new one, never part of it).
fn replace(path: &Path, contents: &str) -> anyhow::Result<()> {
    let staged = path.with_extension("new");
    std::fs::write(&staged, contents).with_context(|| format!("writing {}", staged.display()))?;
    std::fs::rename(&staged, path).with_context(|| format!("replacing {}", path.display()))
}

fn refuse_existing(files: &[PathBuf], dir: &Path) -> anyhow::Result<()> {
    if let Some(existing) = files.iter().find(|p| p.exists()) {
        bail!("{} exists; choose another directory than {} or remove it first", existing.display(), dir.display());
    }
    Ok(())
}

/// A node's side of the cluster's TLS, from the directory `issue` wrote.
#[derive(Clone)]
pub struct NodeTls {
    /// For the peer listener: the node certificate, and client
    /// certificates required and verified against the cluster CA.
    pub acceptor: TlsAcceptor,
    /// For forwarding: the node certificate shown, servers verified
    /// against the cluster CA alone.
    pub client: Arc<ClientConfig>,
    /// The revocation list both ends check, replaced while running.
    pub revocations: Arc<Revocations>,
    dir: PathBuf,
}

impl NodeTls {
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let context = || format!("the cluster TLS files in {} (see `copse tls node-cert`)", dir.display());
        Self::from_files(dir).with_context(context)
    }

    fn from_files(dir: &Path) -> anyhow::Result<Self> {
        let certs = |name: &str| -> anyhow::Result<Vec<CertificateDer<'static>>> {
            let path = dir.join(name);
            let certs = CertificateDer::pem_file_iter(&path)
                .with_context(|| format!("reading {}", path.display()))?
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("parsing {}", path.display()))?;
            anyhow::ensure!(!certs.is_empty(), "{} holds no certificate", path.display());
            Ok(certs)
        };
        let [ca] = <[_; 1]>::try_from(certs(CA_CERT)?)
            .map_err(|_| anyhow::anyhow!("{} must hold the cluster CA alone", dir.join(CA_CERT).display()))?;
        let chain = certs(NODE_CERT)?;
        let key_path = dir.join(NODE_KEY);
        let key = PrivateKeyDer::from_pem_file(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let revocations = Revocations::new(ca, provider.clone())?;
        if let Some(pem) = read_list(&dir.join(CRL))? {
            revocations.adopt(&pem).with_context(|| format!("{}", dir.join(CRL).display()))?;
        }

        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(revocations.client_verifier())
            .with_single_cert(chain.clone(), key.clone_key())
            .context("the node certificate and key do not form a usable pair")?;
        // Forwarded upgrades (command streams, WebSockets) need HTTP/1.1.
        server.alpn_protocols = vec![b"http/1.1".to_vec()];
        // A resumed session skips the certificate check: a node revoked
        // since its first handshake would get back in with its ticket.
        server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        server.send_tls13_tickets = 0;
        // No ALPN here: the forwarding client's connector sets it.
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .dangerous()
            .with_custom_certificate_verifier(revocations.server_verifier())
            .with_client_auth_cert(chain, key)
            .context("the node certificate and key do not form a usable pair")?;
        client.resumption = rustls::client::Resumption::disabled();
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            client: Arc::new(client),
            revocations,
            dir: dir.to_path_buf(),
        })
    }

    /// Adopts the newest good list among `published` (the one the shared
    /// database carries) and the node directory's own `crl.pem` (copied
    /// there by hand), and keeps it in the directory for the next start.
    /// A list the CA did not sign is refused; an older one is ignored.
    /// `Ok(true)`: a newer list is now in force.
    pub fn refresh(&self, published: Option<&str>) -> anyhow::Result<bool> {
        let path = self.dir.join(CRL);
        // Each source is tried whatever the other holds: a bad list in the
        // database must not hide a good one in the directory.
        let from_dir = read_list(&path).and_then(|pem| match pem {
            Some(pem) => self.revocations.adopt(&pem).with_context(|| format!("{}", path.display())),
            None => Ok(false),
        });
        let from_database: anyhow::Result<bool> = published.map_or(Ok(false), |pem| {
            let adopted = self.revocations.adopt(pem).context("the revocation list published in the database")?;
            if adopted {
                replace(&path, pem)?;
            }
            Ok(adopted)
        });
        Ok(from_dir? | from_database?)
    }
}

/// The revocation list at `path`, if there is one.
fn read_list(path: &Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(pem) => Ok(Some(pem)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::TlsConnector;
    use tokio_rustls::rustls::RootCertStore;
    use tokio_rustls::rustls::pki_types::ServerName;

    fn node(ca: &Path, dir: &Path, host: &str) -> NodeTls {
        issue(ca, &[host.to_string()], dir).unwrap();
        NodeTls::load(dir).unwrap()
    }

    /// A handshake from `client` to `server` for `name`, and one byte each way.
    async fn talk(client: Arc<ClientConfig>, server: TlsAcceptor, name: &str) -> anyhow::Result<()> {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let served = tokio::spawn(async move {
            let mut stream = server.accept(far).await?;
            let mut byte = [0u8];
            stream.read_exact(&mut byte).await?;
            stream.write_all(&byte).await?;
            stream.flush().await?;
            anyhow::Ok(())
        });
        let name = ServerName::try_from(name.to_string())?;
        let mut stream = TlsConnector::from(client).connect(name, near).await?;
        stream.write_all(b"x").await?;
        stream.flush().await?;
        let mut byte = [0u8];
        stream.read_exact(&mut byte).await?;
        served.await??;
        Ok(())
    }

    #[tokio::test]
    async fn nodes_of_one_ca_talk_and_nothing_else_gets_through() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, other_ca) = (dir.path().join("ca"), dir.path().join("other-ca"));
        init_ca(&ca).unwrap();
        init_ca(&other_ca).unwrap();
        let key_mode = |p: &Path| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions());
        assert_eq!(key_mode(&ca.join(CA_KEY)) & 0o077, 0, "the CA key is readable by others");
        let one = node(&ca, &dir.path().join("one"), "127.0.0.1");
        let two = node(&ca, &dir.path().join("two"), "node2.cluster");
        assert_eq!(key_mode(&dir.path().join("one").join(NODE_KEY)) & 0o077, 0);
        let stranger = node(&other_ca, &dir.path().join("stranger"), "127.0.0.1");

        talk(one.client.clone(), two.acceptor.clone(), "node2.cluster").await.unwrap();
        talk(two.client.clone(), one.acceptor.clone(), "127.0.0.1").await.unwrap();
        // The server's name is checked: node two's certificate is not one's.
        assert!(talk(one.client.clone(), two.acceptor.clone(), "127.0.0.1").await.is_err());
        // Another CA's node is refused either way.
        assert!(talk(stranger.client.clone(), one.acceptor.clone(), "127.0.0.1").await.is_err());
        assert!(talk(one.client.clone(), stranger.acceptor.clone(), "127.0.0.1").await.is_err());
        // So is a client with no certificate that trusts the cluster CA.
        let mut roots = RootCertStore::empty();
        roots.add(CertificateDer::from_pem_file(ca.join(CA_CERT)).unwrap()).unwrap();
        let anonymous = ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        assert!(talk(Arc::new(anonymous), one.acceptor.clone(), "127.0.0.1").await.is_err());
        // A second certificate never overwrites a node's files.
        assert!(issue(&ca, &["127.0.0.1".into()], &dir.path().join("one")).is_err());
        assert!(init_ca(&ca).is_err());
    }

    #[tokio::test]
    async fn a_revoked_node_is_refused_at_both_ends_by_a_node_that_loaded_the_list() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, other_ca) = (dir.path().join("ca"), dir.path().join("other-ca"));
        init_ca(&ca).unwrap();
        init_ca(&other_ca).unwrap();
        let at = |name: &str| dir.path().join(name);
        node(&ca, &at("one"), "127.0.0.1");
        let two = node(&ca, &at("two"), "node2.cluster");
        let three = node(&ca, &at("three"), "node3.cluster");
        node(&other_ca, &at("stranger"), "127.0.0.1");

        let crl = revoke(&ca, &[at("two").join(NODE_CERT)]).unwrap();
        std::fs::copy(&crl, at("one").join(CRL)).unwrap();
        let one = NodeTls::load(&at("one")).unwrap();
        assert!(talk(two.client.clone(), one.acceptor.clone(), "127.0.0.1").await.is_err(), "two forwards to one");
        assert!(talk(one.client.clone(), two.acceptor.clone(), "node2.cluster").await.is_err(), "one forwards to two");
        talk(three.client.clone(), one.acceptor.clone(), "127.0.0.1").await.unwrap();
        talk(one.client.clone(), three.acceptor.clone(), "node3.cluster").await.unwrap();

        // Revoking it again changes nothing; another CA's certificate is
        // not this CA's to revoke.
        revoke(&ca, &[at("two").join(NODE_CERT)]).unwrap();
        assert_eq!(std::fs::read_to_string(ca.join(REVOKED)).unwrap().lines().count(), 1);
        let refused = revoke(&ca, &[at("stranger").join(NODE_CERT)]).unwrap_err();
        assert!(refused.to_string().contains("not signed by the cluster CA"), "{refused}");
        // A node issued later starts with the list.
        issue(&ca, &["node4.cluster".into()], &at("four")).unwrap();
        let four = NodeTls::load(&at("four")).unwrap();
        assert!(talk(two.client.clone(), four.acceptor.clone(), "node4.cluster").await.is_err());
        talk(three.client.clone(), four.acceptor.clone(), "node4.cluster").await.unwrap();
    }

    #[tokio::test]
    async fn a_running_node_takes_up_a_newer_list_and_never_an_older_or_forged_one() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, other_ca) = (dir.path().join("ca"), dir.path().join("other-ca"));
        init_ca(&ca).unwrap();
        init_ca(&other_ca).unwrap();
        let at = |name: &str| dir.path().join(name);
        let one = node(&ca, &at("one"), "127.0.0.1");
        let two = node(&ca, &at("two"), "node2.cluster");
        let three = node(&ca, &at("three"), "node3.cluster");
        node(&other_ca, &at("stranger"), "127.0.0.1");
        let chain = |name: &str| CertificateDer::pem_file_iter(at(name).join(NODE_CERT)).unwrap().map(Result::unwrap);
        talk(two.client.clone(), one.acceptor.clone(), "127.0.0.1").await.unwrap();

        // Two lists in one second: the second still supersedes the first.
        let older = std::fs::read_to_string(revoke(&ca, &[at("three").join(NODE_CERT)]).unwrap()).unwrap();
        let newer = std::fs::read_to_string(revoke(&ca, &[at("two").join(NODE_CERT)]).unwrap()).unwrap();
        let mut changes = one.revocations.changes();
        assert!(one.refresh(Some(&newer)).unwrap());
        assert!(changes.has_changed().unwrap());
        // The configs made at start now refuse two, both ways, and three;
        // the session of two's first handshake is not resumed around it.
        assert!(talk(two.client.clone(), one.acceptor.clone(), "127.0.0.1").await.is_err());
        assert!(talk(one.client.clone(), two.acceptor.clone(), "node2.cluster").await.is_err());
        assert!(talk(three.client.clone(), one.acceptor.clone(), "127.0.0.1").await.is_err());
        assert!(!one.revocations.trusts_peer(&chain("two").collect::<Vec<_>>()));
        assert!(one.revocations.trusts_peer(&chain("one").collect::<Vec<_>>()));
        // Kept for the next start.
        assert_eq!(std::fs::read_to_string(at("one").join(CRL)).unwrap(), newer);
        assert!(NodeTls::load(&at("one")).unwrap().revocations.pem() == newer);

        // The same list again, an older one, or another CA's list changes
        // nothing: three stays refused.
        changes.mark_unchanged();
        assert!(!one.refresh(Some(&newer)).unwrap());
        assert!(!one.refresh(Some(&older)).unwrap());
        let forged = std::fs::read_to_string(revoke(&other_ca, &[at("stranger").join(NODE_CERT)]).unwrap()).unwrap();
        let refused = one.refresh(Some(&forged)).unwrap_err();
        assert!(format!("{refused:#}").contains("not signed by the cluster CA"), "{refused:#}");
        assert!(!changes.has_changed().unwrap());
        assert_eq!(one.revocations.pem(), newer);
        assert!(talk(three.client.clone(), one.acceptor.clone(), "127.0.0.1").await.is_err());

        // A list copied into the directory by hand is taken up too.
        std::fs::write(at("three").join(CRL), &newer).unwrap();
        assert!(three.refresh(None).unwrap());
        assert!(talk(two.client.clone(), three.acceptor.clone(), "node3.cluster").await.is_err());
    }
}
