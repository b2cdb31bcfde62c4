//! The TLS hop to an in-sandbox port listed in `network.httpsPorts`: E2B
//! re-encrypts to such a port rather than passing TLS through, and does not
//! verify the server's certificate, so self-signed ones work. Nothing is
//! gained by verifying it here either: the server is the sandbox's own
//! code, reached over the sandbox's loopback, which no one else can sit on.
//! The handshake itself is still checked (the server must hold the key of
//! the certificate it presents), so a broken server fails as it would for
//! any TLS client.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::crypto::{self, WebPkiSupportedAlgorithms};
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::rustls::{ClientConfig, DigitallySignedStruct, Error, SignatureScheme};

/// How long the in-sandbox server may take to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One config for every relay: building it loads the provider's tables.
static CONNECTOR: LazyLock<TlsConnector> = LazyLock::new(|| TlsConnector::from(Arc::new(client_config())));

/// TLS over `stream`, a connection to an in-sandbox port, as a client that
/// accepts whatever certificate the server presents.
pub async fn connect(stream: TcpStream) -> std::io::Result<TlsStream<TcpStream>> {
    // What a server asks of an SNI is a name; the sandbox's servers are
    // reached as localhost, so that is the name they are told.
    let name = ServerName::try_from("localhost").expect("a valid DNS name");
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, CONNECTOR.connect(name, stream)).await {
        Ok(result) => result,
        Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the TLS handshake timed out")),
    }
}

fn client_config() -> ClientConfig {
    // Named explicitly, as in the gateway and cubenet, so the choice never
    // depends on which crypto features other crates switch on.
    let provider = Arc::new(crypto::ring::default_provider());
    let verifier = AnyCertificate { algorithms: provider.signature_verification_algorithms };
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    // The relay speaks HTTP/1.1 to the port (upgrades included); a server
    // that prefers h2 must be told so.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    config
}

/// Accepts any certificate chain and name, but verifies the handshake's
/// signatures with the provider's algorithms.
#[derive(Debug)]
struct AnyCertificate {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
