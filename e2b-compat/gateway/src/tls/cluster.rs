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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use rcgen::{ExtendedKeyUsagePurpose, Issuer, KeyPair};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

/// The CA's certificate, in the CA's directory and in each node's.
pub const CA_CERT: &str = "ca.pem";
/// The CA's key: only where node certificates are signed.
const CA_KEY: &str = "ca-key.pem";
const NODE_CERT: &str = "node.pem";
const NODE_KEY: &str = "node-key.pem";
const CA_NAME: &str = "copse cluster CA";

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
    Ok(())
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
        let mut roots = RootCertStore::empty();
        for ca in certs(CA_CERT)? {
            roots.add(ca).context("the cluster CA certificate")?;
        }
        let roots = Arc::new(roots);
        let chain = certs(NODE_CERT)?;
        let key_path = dir.join(NODE_KEY);
        let key = PrivateKeyDer::from_pem_file(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());

        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone()).build()?;
        let mut server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .context("the node certificate and key do not form a usable pair")?;
        // Forwarded upgrades (command streams, WebSockets) need HTTP/1.1.
        server.alpn_protocols = vec![b"http/1.1".to_vec()];

        // No ALPN here: the forwarding client's connector sets it.
        let client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .context("the node certificate and key do not form a usable pair")?;
        Ok(Self { acceptor: TlsAcceptor::from(Arc::new(server)), client: Arc::new(client) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::TlsConnector;
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
}
