//! The copse egress CA in the sandbox's trust store: a sandbox with
//! `network.rules` has its HTTPS to those hosts terminated by the host's
//! egress proxy, with leaves of that CA (the gateway hands the certificate
//! over in `/init`; its key never enters a sandbox).
//!
//! Clients find trust in different places, so the certificate goes to:
//! - `/usr/local/share/ca-certificates/copse-egress.crt`, where Debian's
//!   `update-ca-certificates` looks, so the CA survives a later run of it
//!   (an `apt install` that updates `ca-certificates`);
//! - the end of the system bundle `/etc/ssl/certs/ca-certificates.crt`
//!   (OpenSSL's default on Debian and Alpine: curl, wget, Python's `ssl`
//!   and `urllib`), which is what `update-ca-certificates` would produce,
//!   without the second it takes;
//! - the environment of every process: `SSL_CERT_FILE` and
//!   `REQUESTS_CA_BUNDLE` name that bundle (OpenSSL builds with other
//!   defaults, and Python `requests`, which trusts certifi's own bundle
//!   otherwise), `NODE_EXTRA_CA_CERTS` the CA's file (Node.js trusts its
//!   compiled-in roots plus that). A value the caller set is kept.
//!
//! Installing again is a no-op; a rotated CA is appended next to the old.

use std::fs::{self, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

pub const CA_FILE: &str = "usr/local/share/ca-certificates/copse-egress.crt";
pub const BUNDLE: &str = "etc/ssl/certs/ca-certificates.crt";

/// A system bundle larger than this is not read (Debian's is ~200 KiB).
const MAX_BUNDLE: u64 = 16 * 1024 * 1024;

/// Installs `pem` under `root` (`/` in a sandbox); returns the environment
/// every process should get unless the caller set it.
pub fn install(root: &Path, pem: &str) -> io::Result<Vec<(&'static str, String)>> {
    let pem = pem.trim();
    if !pem.starts_with("-----BEGIN CERTIFICATE-----") || !pem.ends_with("-----END CERTIFICATE-----") {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "egressCa is not a PEM certificate"));
    }
    let ca_file = root.join(CA_FILE);
    write_whole(&ca_file, format!("{pem}\n").as_bytes())?;
    let bundle = root.join(BUNDLE);
    append_once(&bundle, pem)?;
    let (bundle, ca_file) = (format!("/{BUNDLE}"), format!("/{CA_FILE}"));
    Ok(vec![("SSL_CERT_FILE", bundle.clone()), ("REQUESTS_CA_BUNDLE", bundle), ("NODE_EXTRA_CA_CERTS", ca_file)])
}

fn write_whole(path: &Path, content: &[u8]) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let temporary = path.with_extension("new");
    let _ = fs::remove_file(&temporary);
    let mut file = OpenOptions::new().write(true).create_new(true).mode(0o644).open(&temporary)?;
    file.write_all(content)?;
    fs::rename(&temporary, path)
}

/// Appends `pem` to the bundle at `path` unless it holds it already
/// (making the bundle if there is none). Root in the sandbox may have put
/// anything there: only a regular file is read, and opening never blocks.
fn append_once(path: &Path, pem: &str) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let mut file = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(0o644)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() > MAX_BUNDLE {
        return Err(io::Error::other(format!("{} is not a trust bundle", path.display())));
    }
    let mut held = String::new();
    file.read_to_string(&mut held)?;
    if held.contains(pem) {
        return Ok(());
    }
    let separator = if held.is_empty() || held.ends_with('\n') { "" } else { "\n" };
    file.write_all(format!("{separator}{pem}\n").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";

    #[test]
    fn the_ca_is_installed_once_next_to_the_system_roots() {
        let root = tempfile::tempdir().unwrap();
        let bundle = root.path().join(BUNDLE);
        fs::create_dir_all(bundle.parent().unwrap()).unwrap();
        fs::write(&bundle, "-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----").unwrap();
        let env = install(root.path(), PEM).unwrap();
        install(root.path(), PEM).unwrap();
        let held = fs::read_to_string(&bundle).unwrap();
        assert!(held.starts_with("-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----\n"));
        assert_eq!(held.matches("MIIB").count(), 1, "{held}");
        assert_eq!(fs::read_to_string(root.path().join(CA_FILE)).unwrap(), PEM);
        assert!(env.contains(&("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt".into())));
        assert!(env.contains(&("NODE_EXTRA_CA_CERTS", "/usr/local/share/ca-certificates/copse-egress.crt".into())));
    }

    #[test]
    fn a_fifo_for_a_bundle_or_a_non_certificate_is_refused_without_blocking() {
        let root = tempfile::tempdir().unwrap();
        let bundle = root.path().join(BUNDLE);
        fs::create_dir_all(bundle.parent().unwrap()).unwrap();
        nix::unistd::mkfifo(&bundle, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        assert!(install(root.path(), PEM).is_err());
        assert!(install(root.path(), "not a certificate").is_err());
    }
}
