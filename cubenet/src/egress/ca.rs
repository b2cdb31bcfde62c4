//! The copse egress CA: the authority sandboxes with `network.rules` trust,
//! so the egress proxy can terminate their TLS to a rule's host
//! ([`super::intercept`]).
//!
//! Two files in a directory of their own under the data dir: `ca.pem` (the
//! certificate sandboxes get) and `ca-key.pem` (0600, in a 0700 directory;
//! it never leaves the host). The first gateway start on a data dir makes
//! them, later starts reuse them; [`EgressCa::rotate`] replaces both.
//!
//! Leaf certificates are minted in memory, one per host name, valid for a
//! day; their keys never leave the proxy, so a leaf a sandbox sees vouches
//! for nothing on its own.

use std::collections::HashMap;
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration as StdDuration, Instant};

use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

pub const CERT_FILE: &str = "ca.pem";
pub const KEY_FILE: &str = "ca-key.pem";

/// How long a leaf is valid, and how long before its end a new one is
/// minted instead.
const LEAF_LIFETIME: Duration = Duration::hours(24);
const LEAF_RENEW_BEFORE: StdDuration = StdDuration::from_secs(3600);

/// Leaves kept at most; past it the cache starts over (a sandbox cycling
/// through names must not grow the host's memory without bound).
const MAX_CACHED_LEAVES: usize = 4096;

/// A leaf certificate (then the CA's) and its key.
#[derive(Debug)]
pub struct Leaf {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

pub struct EgressCa {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    leaves: Mutex<HashMap<String, (Arc<Leaf>, Instant)>>,
}

impl std::fmt::Debug for EgressCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressCa").field("cert_pem", &self.cert_pem).finish_non_exhaustive()
    }
}

impl EgressCa {
    /// The CA in `dir`, made there first if the directory holds neither file.
    pub fn load_or_create(dir: &Path) -> anyhow::Result<Self> {
        private_dir(dir)?;
        let (cert, key) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
        match (cert.exists(), key.exists()) {
            (true, true) => {}
            (false, false) => write_new(dir)?,
            _ => bail!(
                "{} holds one of {CERT_FILE} and {KEY_FILE} without the other; delete both to make a new egress CA",
                dir.display()
            ),
        }
        let key_pem = fs::read_to_string(&key).with_context(|| format!("reading {}", key.display()))?;
        // The key is the CA's secret: it stays private whoever made it.
        fs::set_permissions(&key, fs::Permissions::from_mode(0o600))?;
        let cert_pem = fs::read_to_string(&cert).with_context(|| format!("reading {}", cert.display()))?;
        Self::from_pem(&cert_pem, &key_pem).with_context(|| format!("the egress CA in {}", dir.display()))
    }

    /// Replaces the CA in `dir` with a new one. A running gateway keeps
    /// the CA it loaded until it restarts.
    pub fn rotate(dir: &Path) -> anyhow::Result<PathBuf> {
        private_dir(dir)?;
        write_new(dir)?;
        Ok(dir.join(CERT_FILE))
    }

    fn from_pem(cert_pem: &str, key_pem: &str) -> anyhow::Result<Self> {
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        let key = KeyPair::from_pem(key_pem).context("parsing the CA key")?;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).context("parsing the CA certificate")?;
        let issuer = Issuer::new(ca_params(&key)?, key);
        let ca = Self { cert_pem: cert_pem.to_string(), cert_der, issuer, leaves: Mutex::default() };
        Ok(ca)
    }

    /// The certificate sandboxes trust (PEM).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for `name` signed by the CA, minted on first use and
    /// cached until shortly before it expires.
    pub fn leaf(&self, name: &str) -> anyhow::Result<Arc<Leaf>> {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let mut leaves = self.leaves.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((leaf, renew_at)) = leaves.get(&name)
            && Instant::now() < *renew_at
        {
            return Ok(leaf.clone());
        }
        let leaf = Arc::new(self.mint(&name)?);
        if leaves.len() >= MAX_CACHED_LEAVES {
            leaves.clear();
        }
        let renew_at = Instant::now() + (StdDuration::try_from(LEAF_LIFETIME)? - LEAF_RENEW_BEFORE);
        leaves.insert(name, (leaf.clone(), renew_at));
        Ok(leaf)
    }

    fn mint(&self, name: &str) -> anyhow::Result<Leaf> {
        let now = OffsetDateTime::now_utc();
        let mut params =
            CertificateParams::new(vec![name.to_string()]).with_context(|| format!("a leaf for {name}"))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        // Clocks in sandboxes are the host's; the hour covers a host clock
        // stepped back a little.
        params.not_before = now - Duration::hours(1);
        params.not_after = now + LEAF_LIFETIME;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Ok(Leaf { chain: vec![cert.der().clone(), self.cert_der.clone()], key })
    }
}

/// The CA's own parameters, all derived from its key, so the issuer a leaf
/// names is the same after a restart as in the certificate on disk (which
/// is not parsed back). The name carries the key's fingerprint: a rotated
/// CA is told apart from the one before it in a trust bundle holding both.
fn ca_params(key: &KeyPair) -> anyhow::Result<CertificateParams> {
    let digest = ring::digest::digest(&ring::digest::SHA256, key.public_key_raw());
    let fingerprint: String = digest.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::OrganizationName, "copse");
    params.distinguished_name.push(DnType::CommonName, format!("copse egress CA {fingerprint}"));
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(params)
}

fn write_new(dir: &Path) -> anyhow::Result<()> {
    let key = KeyPair::generate()?;
    let mut params = ca_params(&key)?;
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::days(1);
    params.not_after = now + Duration::days(3650);
    let cert = params.self_signed(&key)?;
    // Each file appears whole (a temporary name, then a rename): a crash
    // leaves the old pair, a new pair, or a pair `load_or_create` refuses.
    replace(&dir.join(KEY_FILE), key.serialize_pem().as_bytes(), 0o600)?;
    replace(&dir.join(CERT_FILE), cert.pem().as_bytes(), 0o644)
}

fn replace(path: &Path, content: &[u8], mode: u32) -> anyhow::Result<()> {
    let temporary = path.with_extension("new");
    let _ = fs::remove_file(&temporary);
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&temporary)
        .with_context(|| format!("creating {}", temporary.display()))?;
    file.write_all(content)?;
    file.sync_all()?;
    fs::rename(&temporary, path).with_context(|| format!("writing {}", path.display()))
}

fn private_dir(dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).with_context(|| format!("securing {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_rustls::rustls::client::WebPkiServerVerifier;
    use tokio_rustls::rustls::client::danger::ServerCertVerifier;
    use tokio_rustls::rustls::pki_types::{ServerName, UnixTime};
    use tokio_rustls::rustls::{RootCertStore, crypto::ring::default_provider};

    fn verify(ca: &EgressCa, leaf: &Leaf, name: &str) -> Result<(), String> {
        let mut roots = RootCertStore::empty();
        roots.add(ca.cert_der.clone()).unwrap();
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::new(default_provider())).build().unwrap();
        let server = ServerName::try_from(name.to_string()).unwrap();
        verifier
            .verify_server_cert(&leaf.chain[0], &leaf.chain[1..], &server, &[], UnixTime::now())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_ca_is_made_once_private_and_signs_leaves_that_verify_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("egress-ca");
        let first = EgressCa::load_or_create(&at).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&at), 0o700);
        assert_eq!(mode(&at.join(KEY_FILE)), 0o600);
        assert!(first.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));

        let again = EgressCa::load_or_create(&at).unwrap();
        assert_eq!(again.cert_pem(), first.cert_pem(), "a restart reuses the CA");
        let leaf = again.leaf("API.example.test.").unwrap();
        verify(&first, &leaf, "api.example.test").unwrap();
        assert!(verify(&first, &leaf, "other.example.test").is_err(), "the SAN is the one name");
        assert!(Arc::ptr_eq(&leaf, &again.leaf("api.example.test").unwrap()), "leaves are cached");

        let rotated_cert = EgressCa::rotate(&at).unwrap();
        let rotated = EgressCa::load_or_create(&at).unwrap();
        assert_eq!(fs::read_to_string(rotated_cert).unwrap(), rotated.cert_pem());
        assert_ne!(rotated.cert_pem(), first.cert_pem());
        let new_leaf = rotated.leaf("api.example.test").unwrap();
        assert!(verify(&first, &new_leaf, "api.example.test").is_err(), "the old CA vouches for nothing new");
        verify(&rotated, &new_leaf, "api.example.test").unwrap();
    }

    #[test]
    fn half_a_ca_is_refused_and_a_loose_key_is_made_private() {
        let dir = tempfile::tempdir().unwrap();
        EgressCa::load_or_create(dir.path()).unwrap();
        let key = dir.path().join(KEY_FILE);
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
        EgressCa::load_or_create(dir.path()).unwrap();
        assert_eq!(fs::metadata(&key).unwrap().permissions().mode() & 0o777, 0o600);
        fs::remove_file(dir.path().join(CERT_FILE)).unwrap();
        let refused = EgressCa::load_or_create(dir.path()).unwrap_err();
        assert!(format!("{refused:#}").contains("delete both"), "{refused:#}");
    }
}
