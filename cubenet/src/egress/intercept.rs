//! HTTPS to a host with `network.rules`: the egress proxy terminates the
//! sandbox's TLS with a leaf of the copse egress CA ([`super::ca`]) for the
//! name the sandbox asked for (its SNI), sets the rule's headers on the
//! request ([`super::rules::transform`], as on port 80) and sends it on
//! over TLS of its own to the destination the sandbox chose, verified
//! against the host's trust store (plus the operator's extra roots) for
//! that same name. An upstream that does not verify gets the sandbox a 502,
//! never the request in plaintext or to an unverified server.
//!
//! Inside, the connection is served request by request as on port 80
//! ([`super::http`]): every request's `Host` (and an absolute-form target's
//! authority) must be the SNI name, since a server shared by several names
//! (a CDN) routes by them and a rule's secret must not reach another name
//! on it; a request that names another host is answered 421 or 400 (an
//! HTTP/1.1 connection is then closed). ALPN offers the sandbox HTTP/2 and HTTP/1.1, and
//! the upstream HTTP/1.1 only: each of the client's streams goes upstream
//! as one HTTP/1.1 request ([`super::http`] says how).
//!
//! Blocking callers (the proxy's thread per connection) call
//! [`Interceptor::serve`], which runs the connection on the runtime its upstream lives in.

use std::io;
use std::net::TcpStream as StdTcpStream;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, bail};
use hyper::StatusCode;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use tokio::time::timeout;
use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::ca::EgressCa;
use super::http::ClientProtocol;
use super::rules::{Intercept, SecretResolver};

/// How long each side's TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The proxy's half of TLS interception: the CA it mints leaves from and
/// the roots it verifies upstreams against.
pub struct Interceptor {
    ca: Arc<EgressCa>,
    upstream: Arc<ClientConfig>,
}

impl Interceptor {
    /// `extra_roots`: a PEM file of CA certificates trusted for upstreams
    /// besides the host's trust store (`copse up --egress-upstream-ca`).
    pub fn new(ca: Arc<EgressCa>, extra_roots: Option<&Path>) -> anyhow::Result<Self> {
        let roots = upstream_roots(extra_roots)?;
        let mut upstream = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        upstream.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self { ca, upstream: Arc::new(upstream) })
    }

    pub fn ca(&self) -> &EgressCa {
        &self.ca
    }

    /// Serves `target`, a connection whose ClientHello asks for a host with
    /// rules, on `runtime`; `upstream` (living in that runtime) reaches the
    /// destination the sandbox chose, directly or through its SOCKS5
    /// upstream's tunnel (TLS to the host then runs inside that one). Blocks
    /// until the connection ends.
    pub fn serve<U>(
        &self,
        runtime: &Runtime,
        client: StdTcpStream,
        upstream: U,
        mut target: Intercept<'_>,
        resolve: Option<&SecretResolver>,
    ) -> anyhow::Result<()>
    where
        U: AsyncRead + AsyncWrite + Unpin,
    {
        let hello = std::mem::take(&mut target.hello);
        super::http::block_on_client(runtime, client, hello, |client| async move {
            self.intercept(client, upstream, &target, resolve).await
        })
    }

    async fn intercept<U>(
        &self,
        client: Prefixed,
        upstream: U,
        target: &Intercept<'_>,
        resolve: Option<&SecretResolver>,
    ) -> anyhow::Result<()>
    where
        U: AsyncRead + AsyncWrite + Unpin,
    {
        let name = target.name.as_deref().context("TLS without a server name")?;
        let server_name = ServerName::try_from(name.to_string()).context("the SNI is no host name")?;
        let leaf = self.ca.leaf(name)?;
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(leaf.chain.clone(), leaf.key.clone_key())?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let accept = timeout(HANDSHAKE_TIMEOUT, TlsAcceptor::from(Arc::new(config)).accept(client));
        let connect =
            timeout(HANDSHAKE_TIMEOUT, TlsConnector::from(self.upstream.clone()).connect(server_name, upstream));
        let (client, upstream) = tokio::join!(accept, connect);
        let client = client.context("the client's TLS handshake timed out")?.context("the client's TLS handshake")?;
        let protocol = match client.get_ref().1.alpn_protocol() {
            Some(b"h2") => ClientProtocol::Http2,
            _ => ClientProtocol::Http1,
        };
        let (status, why) = match upstream {
            Ok(Ok(upstream)) => return super::http::serve(client, protocol, upstream, target, resolve).await,
            Ok(Err(e)) => (StatusCode::BAD_GATEWAY, format!("TLS to {name} failed: {e}")),
            Err(_) => (StatusCode::GATEWAY_TIMEOUT, format!("TLS to {name} timed out")),
        };
        let _ = super::http::refuse(client, protocol, status, &why).await;
        bail!("{why}")
    }
}

fn provider() -> Arc<CryptoProvider> {
    // Named explicitly so the choice never depends on which crypto features
    // other crates happen to switch on.
    Arc::new(ring::default_provider())
}

/// The host's trust store (what its own clients trust), and `extra`'s
/// certificates.
fn upstream_roots(extra: Option<&Path>) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::warn!("the host's trust store, for the egress proxy's upstreams: {e}");
    }
    roots.add_parsable_certificates(native.certs);
    if let Some(path) = extra {
        let mut added = 0;
        for cert in CertificateDer::pem_file_iter(path).with_context(|| format!("reading {}", path.display()))? {
            let cert = cert.with_context(|| format!("parsing {}", path.display()))?;
            roots.add(cert).with_context(|| format!("a certificate in {}", path.display()))?;
            added += 1;
        }
        anyhow::ensure!(added > 0, "{} holds no certificate", path.display());
    }
    Ok(roots)
}

/// A stream that first yields bytes already read from it (the ClientHello
/// the proxy peeked at).
pub(super) struct Prefixed {
    head: Vec<u8>,
    at: usize,
    inner: TcpStream,
}

impl Prefixed {
    pub(super) fn new(head: Vec<u8>, inner: TcpStream) -> Self {
        Self { head, at: 0, inner }
    }
}

impl AsyncRead for Prefixed {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.at < self.head.len() {
            let n = buf.remaining().min(self.head.len() - self.at);
            let at = self.at;
            buf.put_slice(&self.head[at..at + n]);
            self.at += n;
            if self.at == self.head.len() {
                self.head = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn the_peeked_bytes_are_read_first_then_the_stream() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let writer = tokio::spawn(async move {
            let (mut peer, _) = listener.accept().await.unwrap();
            peer.write_all(b" world").await.unwrap();
        });
        let inner = TcpStream::connect(address).await.unwrap();
        let mut prefixed = Prefixed { head: b"hello".to_vec(), at: 0, inner };
        let mut all = String::new();
        prefixed.read_to_string(&mut all).await.unwrap();
        writer.await.unwrap();
        assert_eq!(all, "hello world");
    }
}
