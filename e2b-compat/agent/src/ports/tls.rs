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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio_rustls::TlsAcceptor;
    use tokio_rustls::rustls::ServerConfig;
    use tokio_rustls::rustls::pki_types::PrivatePkcs8KeyDer;

    use super::*;

    /// A TLS server with a fresh self-signed certificate for `name`, which
    /// offers h2 before http/1.1.
    fn self_signed_acceptor(name: &str) -> TlsAcceptor {
        let certified = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        let key = PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der());
        let mut config = ServerConfig::builder_with_provider(Arc::new(crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![certified.cert.der().clone()], key.into())
            .unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        TlsAcceptor::from(Arc::new(config))
    }

    #[tokio::test]
    async fn a_self_signed_server_for_another_name_is_reached_as_localhost_over_http_1_1() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let acceptor = self_signed_acceptor("not-localhost.test");
        let server = tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let mut tls = acceptor.accept(stream).await.unwrap();
            let (_, session) = tls.get_ref();
            let seen = (session.server_name().map(str::to_string), session.alpn_protocol().map(<[u8]>::to_vec));
            let mut asked = [0u8; 4];
            tls.read_exact(&mut asked).await.unwrap();
            tls.write_all(b"pong").await.unwrap();
            tls.flush().await.unwrap();
            (seen, asked)
        });
        let mut client = connect(TcpStream::connect(address).await.unwrap()).await.unwrap();
        client.write_all(b"ping").await.unwrap();
        let mut reply = [0u8; 4];
        client.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"pong");
        let ((sni, alpn), asked) = server.await.unwrap();
        assert_eq!(&asked, b"ping");
        assert_eq!(sni.as_deref(), Some("localhost"));
        assert_eq!(alpn.as_deref(), Some(&b"http/1.1"[..]));
    }

    #[tokio::test]
    async fn a_plain_server_fails_the_handshake_promptly() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n").await;
        });
        let started = std::time::Instant::now();
        assert!(connect(TcpStream::connect(address).await.unwrap()).await.is_err());
        assert!(started.elapsed() < HANDSHAKE_TIMEOUT / 2);
    }
}
