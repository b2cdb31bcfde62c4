//! HTTPS for domain mode: the SDK without URL overrides reaches
//! `https://api.{domain}` and `https://{port}-{id}.{domain}`, so one TLS
//! listener with a certificate for `{domain}` and `*.{domain}` serves the
//! control plane and every sandbox port; the router tells them apart by host.
//! The listener itself (handshake timeout included) is `serve`'s.

pub mod cluster;
pub mod mint;
pub mod revocation;

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};

/// The certificate chain and key (PEM files) the listener presents.
pub fn acceptor(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    let chain = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading certificates from {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing certificates in {}", cert.display()))?;
    anyhow::ensure!(!chain.is_empty(), "{} holds no certificate", cert.display());
    let key =
        PrivateKeyDer::from_pem_file(key).with_context(|| format!("reading a private key from {}", key.display()))?;
    // Named explicitly so the choice never depends on which crypto features
    // other crates happen to switch on.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("the certificate and key do not form a usable pair")?;
    // HTTP/2 for the SDK (its client prefers it on TLS); HTTP/1.1 for
    // WebSocket upgrades and simple clients.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
