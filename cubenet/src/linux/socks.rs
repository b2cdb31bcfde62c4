//! Dialling a sandbox's SOCKS5 upstream: CONNECT to the original
//! destination, with RFC 1929 username/password when the policy has them.
//!
//! The protocol is `tokio-socks`'s, run once per connection on a
//! current-thread runtime over a socket made here, so the socket carries
//! [`PROXY_MARK`] (nftables then refuses it the host's own addresses and
//! the ranges no sandbox reaches, for upstream names resolving there too).
//! After the handshake the socket goes back to blocking std I/O for the
//! proxy's splice.

use std::net::{SocketAddr, SocketAddrV4, TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, bail};
use socket2::{Domain, Socket, Type};

use crate::linux::nft::PROXY_MARK;
use crate::upstream::Upstream;

/// Connecting to the upstream and its answering the handshake together.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A stream to `dst` through `upstream`; fails closed (no direct fallback).
pub fn dial(upstream: &Upstream, dst: SocketAddrV4) -> anyhow::Result<TcpStream> {
    // Resolved per dial and pinned for this connection, as E2B does.
    let server = (upstream.host.as_str(), upstream.port)
        .to_socket_addrs()
        .with_context(|| format!("resolving the egress proxy {}", upstream.address()))?
        .find(SocketAddr::is_ipv4)
        .with_context(|| format!("the egress proxy {} has no IPv4 address", upstream.address()))?;
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    socket.set_mark(PROXY_MARK).context("marking the upstream socket")?;
    socket
        .connect_timeout(&server.into(), HANDSHAKE_TIMEOUT)
        .with_context(|| format!("connecting to the egress proxy {server}"))?;
    let stream: TcpStream = socket.into();
    stream.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build()?;
    let stream = runtime.block_on(async {
        let stream = tokio::net::TcpStream::from_std(stream)?;
        let connect = async {
            match &upstream.credentials {
                Some(c) => {
                    tokio_socks::tcp::Socks5Stream::connect_with_password_and_socket(
                        stream,
                        dst,
                        &c.username,
                        &c.password,
                    )
                    .await
                }
                None => tokio_socks::tcp::Socks5Stream::connect_with_socket(stream, dst).await,
            }
        };
        let Ok(tunnel) = tokio::time::timeout(HANDSHAKE_TIMEOUT, connect).await else {
            bail!("the egress proxy {server} did not answer the SOCKS5 handshake in time");
        };
        let tunnel = tunnel.with_context(|| format!("SOCKS5 CONNECT to {dst} via {server}"))?;
        anyhow::Ok(tunnel.into_inner().into_std()?)
    })?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}
