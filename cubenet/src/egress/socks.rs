//! Dialling a sandbox's SOCKS5 upstream: CONNECT to the original
//! destination, with RFC 1929 username/password when the policy has them,
//! over TLS when the policy asks for it.
//!
//! The protocol is `tokio-socks`'s, run once per connection on a
//! current-thread runtime over a socket of [`outbound`], so the upstream's
//! address, for a name too, is refused if it is the host's own or in a
//! range no sandbox reaches.
//! Without TLS, the socket goes back to blocking std I/O after the
//! handshake, for the proxy's splice; with TLS, the session lives in that
//! runtime, which then runs the splice too ([`TlsTunnel::splice`]).

use std::net::{SocketAddr, SocketAddrV4, TcpStream, ToSocketAddrs};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::runtime::Runtime;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

use crate::egress::outbound;
use crate::net::NetConfig;
use crate::upstream::{Upstream, UpstreamTls};

/// Connecting to the upstream and its answering the handshakes together.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection through the upstream, ready for the client's bytes.
pub enum Tunnel {
    Plain(TcpStream),
    Tls(Box<TlsTunnel>),
}

/// The TLS session to the upstream, inside which CONNECT succeeded.
pub struct TlsTunnel {
    runtime: Runtime,
    stream: Box<TlsStream<tokio::net::TcpStream>>,
}

/// A byte stream the async code speaking over a tunnel takes, whichever
/// kind the tunnel is.
pub trait AsyncStream: AsyncRead + AsyncWrite + Unpin + Send {}

impl<S: AsyncRead + AsyncWrite + Unpin + Send> AsyncStream for S {}

impl Tunnel {
    /// The tunnel as an async stream, and the runtime it lives in, for a
    /// caller that speaks over it itself (the rules' HTTP, `super::http`,
    /// and intercepted TLS, `super::intercept`, which then runs inside the
    /// TLS to the upstream).
    pub fn into_async(self) -> anyhow::Result<(Runtime, Box<dyn AsyncStream>)> {
        match self {
            Tunnel::Tls(tunnel) => {
                let TlsTunnel { runtime, stream } = *tunnel;
                Ok((runtime, stream))
            }
            Tunnel::Plain(stream) => {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
                stream.set_nonblocking(true)?;
                let stream = {
                    let _inside = runtime.enter();
                    tokio::net::TcpStream::from_std(stream)?
                };
                Ok((runtime, Box::new(stream)))
            }
        }
    }
}

/// What the handshakes leave, before the tunnel takes its runtime.
enum Opened {
    Plain(tokio::net::TcpStream),
    Tls(Box<TlsStream<tokio::net::TcpStream>>),
}

/// A stream to `dst` through `upstream`; fails closed (no direct fallback,
/// no plaintext when TLS is asked for).
pub fn dial(cfg: &NetConfig, upstream: &Upstream, dst: SocketAddrV4) -> anyhow::Result<Tunnel> {
    // Made before any byte goes out: a bad CA or name stops here.
    let tls = upstream.tls.as_ref().map(|tls| connector(upstream, tls)).transpose()?;
    // Resolved per dial and pinned for this connection, as E2B does.
    let server = (upstream.host.as_str(), upstream.port)
        .to_socket_addrs()
        .with_context(|| format!("resolving the egress proxy {}", upstream.address()))?
        .find_map(|a| match a {
            SocketAddr::V4(a) => Some(a),
            SocketAddr::V6(_) => None,
        })
        .with_context(|| format!("the egress proxy {} has no IPv4 address", upstream.address()))?;
    let stream: TcpStream =
        outbound::tcp(cfg, server, HANDSHAKE_TIMEOUT).with_context(|| format!("the egress proxy {server}"))?;
    stream.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
    let handshakes = async {
        let stream = tokio::net::TcpStream::from_std(stream)?;
        match tls {
            None => anyhow::Ok(Opened::Plain(connect(upstream, stream, dst).await?)),
            Some((connector, name)) => {
                let session = connector.connect(name, stream).await.with_context(|| format!("TLS to {server}"))?;
                Ok(Opened::Tls(Box::new(connect(upstream, session, dst).await?)))
            }
        }
    };
    let opened = runtime.block_on(async {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshakes).await {
            Ok(opened) => opened.with_context(|| format!("SOCKS5 CONNECT to {dst} via {server}")),
            Err(_) => bail!("the egress proxy {server} did not answer the handshakes in time"),
        }
    })?;
    Ok(match opened {
        Opened::Tls(stream) => Tunnel::Tls(Box::new(TlsTunnel { runtime, stream })),
        Opened::Plain(plain) => {
            let plain = plain.into_std()?;
            plain.set_nonblocking(false)?;
            Tunnel::Plain(plain)
        }
    })
}

/// SOCKS5 CONNECT over `socket`, authenticating if the policy says so.
async fn connect<S>(upstream: &Upstream, socket: S, dst: SocketAddrV4) -> anyhow::Result<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let tunnel = match &upstream.credentials {
        Some(c) => {
            tokio_socks::tcp::Socks5Stream::connect_with_password_and_socket(socket, dst, &c.username, &c.password)
                .await?
        }
        None => tokio_socks::tcp::Socks5Stream::connect_with_socket(socket, dst).await?,
    };
    Ok(tunnel.into_inner())
}

impl TlsTunnel {
    /// Copies both ways, after sending `head`, until both sides are done. A
    /// half-close from the client reaches the upstream as close_notify.
    pub fn splice(self, client: TcpStream, head: &[u8]) -> anyhow::Result<()> {
        let Self { runtime, mut stream } = self;
        runtime.block_on(async move {
            stream.write_all(head).await?;
            client.set_nonblocking(true)?;
            let mut client = tokio::net::TcpStream::from_std(client)?;
            // An upstream that closes without close_notify ends it with an
            // error; what it sent has been passed on by then.
            let _ = tokio::io::copy_bidirectional(&mut client, &mut stream).await;
            Ok(())
        })
    }
}

/// The TLS client for `tls`, and the name the certificate must carry.
fn connector(
    upstream: &Upstream,
    tls: &UpstreamTls,
) -> anyhow::Result<(TlsConnector, rustls::pki_types::ServerName<'static>)> {
    let name = tls.verified_name(&upstream.host)?;
    let config = match tls.trust_anchors()? {
        Some(anchors) => client_config(anchors)?,
        None => system_config()?,
    };
    Ok((TlsConnector::from(config), name))
}

/// The host's trust store, loaded once (it is read from disk).
fn system_config() -> anyhow::Result<Arc<ClientConfig>> {
    static SYSTEM: OnceLock<Result<Arc<ClientConfig>, String>> = OnceLock::new();
    let config = SYSTEM.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        let mut roots = RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err(format!("the host's trust store has no usable certificate ({:?})", found.errors));
        }
        client_config(roots).map_err(|e| format!("{e:#}"))
    });
    config.clone().map_err(anyhow::Error::msg)
}

/// TLS 1.2 and 1.3 only (all rustls speaks), verification always on.
fn client_config(roots: RootCertStore) -> anyhow::Result<Arc<ClientConfig>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
