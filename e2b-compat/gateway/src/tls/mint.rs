//! `copse tls init`: a local certificate authority and, signed by it, a
//! certificate for `{domain}` and `*.{domain}` — enough for domain mode on a
//! machine that trusts the CA. The CA is name-constrained to the domain, so
//! trusting it vouches for nothing else.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, GeneralSubtree, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, NameConstraints,
};
use time::{Duration, OffsetDateTime};

/// What `init` wrote.
#[derive(Debug)]
pub struct Minted {
    /// The CA certificate to trust.
    pub ca: PathBuf,
    /// The server's certificate chain and key, for `copse up --tls-cert/--tls-key`.
    pub cert: PathBuf,
    pub key: PathBuf,
}

const CA_FILE: &str = "ca.pem";
const CERT_FILE: &str = "cert.pem";
const KEY_FILE: &str = "key.pem";

/// Writes a new CA and server certificate for `domain` into `dir`. The CA's
/// key is not kept: a new certificate means a new CA.
pub fn init(domain: &str, dir: &Path) -> anyhow::Result<Minted> {
    let domain = validate(domain)?;
    let minted = Minted { ca: dir.join(CA_FILE), cert: dir.join(CERT_FILE), key: dir.join(KEY_FILE) };
    if let Some(existing) = [&minted.ca, &minted.cert, &minted.key].into_iter().find(|p| p.exists()) {
        bail!("{} exists; remove {} first to mint a new CA", existing.display(), dir.display());
    }
    let mut ca = ca_params(&format!("copse local CA for {domain}"))?;
    ca.name_constraints = Some(NameConstraints {
        permitted_subtrees: vec![GeneralSubtree::DnsName(domain.clone())],
        excluded_subtrees: Vec::new(),
    });
    let ca_key = KeyPair::generate()?;
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca, ca_key);

    let leaf =
        leaf_params(vec![domain.clone(), format!("*.{domain}")], &domain, vec![ExtendedKeyUsagePurpose::ServerAuth])?;
    let leaf_key = KeyPair::generate()?;
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;

    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write(&minted.ca, &ca_cert.pem(), 0o644)?;
    write(&minted.cert, &format!("{}{}", leaf_cert.pem(), ca_cert.pem()), 0o644)?;
    write(&minted.key, &leaf_key.serialize_pem(), 0o600)?;
    Ok(minted)
}

/// A CA's fields: it signs leaf certificates (no intermediate below it)
/// for ten years. A signer rebuilt from them and the CA's kept key issues
/// certificates that chain to the CA certificate made from them earlier.
pub(super) fn ca_params(common_name: &str) -> anyhow::Result<CertificateParams> {
    let now = OffsetDateTime::now_utc();
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, common_name);
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = now - Duration::days(1);
    ca.not_after = now + Duration::days(3650);
    Ok(ca)
}

/// A leaf certificate's fields: `names` (DNS names or addresses), signed
/// by a CA, for `usages`.
pub(super) fn leaf_params(
    names: Vec<String>,
    common_name: &str,
    usages: Vec<ExtendedKeyUsagePurpose>,
) -> anyhow::Result<CertificateParams> {
    let now = OffsetDateTime::now_utc();
    let mut leaf = CertificateParams::new(names).context("a name is neither a DNS name nor an address")?;
    leaf.distinguished_name.push(DnType::CommonName, common_name);
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = usages;
    leaf.use_authority_key_identifier_extension = true;
    leaf.not_before = now - Duration::days(1);
    // The longest life some clients (Apple's) still accept for a server
    // certificate.
    leaf.not_after = now + Duration::days(825);
    Ok(leaf)
}

/// What to do next, for the person who ran `copse tls init`.
pub fn instructions(domain: &str, minted: &Minted) -> String {
    let domain = domain.trim_end_matches('.').to_ascii_lowercase();
    let (ca, cert, key) = (minted.ca.display(), minted.cert.display(), minted.key.display());
    format!(
        "wrote {ca} (the CA), {cert} and {key} (for {domain} and *.{domain})

serve the E2B API on it (port 443 of a loopback address of your choice):
  sudo copse up --listen 127.0.0.2:443 --domain {domain} --tls-cert {cert} --tls-key {key}

make the names resolve, either with wildcard DNS (dnsmasq: address=/{domain}/127.0.0.2)
or with /etc/hosts lines, one for the API and one per sandbox port you use:
  127.0.0.2 api.{domain} 49983-<sandboxID>.{domain}

trust the CA, for the E2B SDKs:
  Python:  export SSL_CERT_FILE={ca}   (replaces the system bundle for that process)
  Node.js: export NODE_EXTRA_CA_CERTS={ca}
  system-wide (Debian): cp {ca} /usr/local/share/ca-certificates/copse-{domain}.crt && update-ca-certificates
then point the SDK at the domain instead of at URLs:
  export E2B_DOMAIN={domain}
  unset E2B_API_URL E2B_SANDBOX_URL
"
    )
}

/// A wildcard needs a parent of at least two labels: TLS clients refuse
/// `*.localhost`-style names.
fn validate(domain: &str) -> anyhow::Result<String> {
    let domain = domain.trim_end_matches('.').to_ascii_lowercase();
    let labels: Vec<&str> = domain.split('.').collect();
    let label_ok = |l: &&str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
    };
    if labels.len() < 2 || !labels.iter().all(label_ok) {
        bail!("{domain:?} is not a usable domain: give at least two labels, e.g. copse.test");
    }
    Ok(domain)
}

pub(super) fn write(path: &Path, contents: &str, mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(contents.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_files_serve_tls_for_the_domain_and_its_subdomains() {
        let dir = tempfile::tempdir().unwrap();
        let minted = init("Copse.Test", dir.path()).unwrap();
        // The pair loads as the listener would load it.
        super::super::acceptor(&minted.cert, &minted.key).unwrap();
        let key_mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&minted.key).unwrap().permissions());
        assert_eq!(key_mode & 0o077, 0, "the private key is readable by others");
        // A second run refuses to replace a CA someone may already trust.
        assert!(init("copse.test", dir.path()).unwrap_err().to_string().contains("exists"));
    }

    #[test]
    fn single_label_and_malformed_domains_are_refused() {
        for bad in ["localhost", "", ".test", "a..test", "-a.test", "a b.test"] {
            assert!(validate(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(validate("Copse.Test.").unwrap(), "copse.test");
    }
}
