//! copse's resolver: one UDP and one TCP listener on the bridge address,
//! on one port, that the host's firewall redirects every sandbox's port-53
//! traffic to, whatever server it named (nftables, see
//! [`crate::linux::nft`]; pf, see [`crate::freebsd::pf`]). What a query
//! gets is [`crate::dnsfilter`]'s decision; this is its executor, the same
//! on both OSes (**not run on FreeBSD**).
//!
//! The sandbox is known by its source address (the spoofing guard makes
//! that trustworthy). Bounded per sandbox and in all: queries in flight
//! ([`PER_SANDBOX`], [`TOTAL`]; past them a query is dropped and the
//! client retries), query size ([`crate::dnsfilter::MAX_QUERY`]), and time
//! (per upstream and per TCP connection). nftables also caps each
//! sandbox's packet rate to the resolver, so a flood never fills the
//! socket's queue for the others (pf too, where it has `max-pkt-rate`).
//!
//! Queries to a tenant's `dns_servers` leave from a socket of
//! [`outbound`], which refuses them the host and the ranges no sandbox
//! may reach, as it does the egress proxy's connections.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::time::timeout;

use crate::dnsfilter::{self, Decision, MAX_ANSWER, MAX_QUERY, Upstreams};
use crate::egress::{Policies, outbound};
use crate::net::NetConfig;
use crate::policy::DNS_PORT;

/// Queries (UDP) or connections (TCP) one sandbox may have in flight.
pub const PER_SANDBOX: usize = 32;
/// The same over all sandboxes of the network.
const TOTAL: usize = 1024;
/// How long one upstream has to answer, and all of them together.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a TCP client has to send its query and take the answer.
const TCP_TIMEOUT: Duration = Duration::from_secs(5);

pub struct DnsProxy {
    port: u16,
    /// Dropping it stops the listeners.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl DnsProxy {
    /// Listens on the bridge address of `cfg` (an ephemeral port, the same
    /// for UDP and TCP) and serves until dropped.
    pub fn start(cfg: NetConfig, policies: Policies) -> anyhow::Result<Self> {
        let (udp, tcp) = bind_pair(cfg.gateway())?;
        let port = udp.local_addr()?.port();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shared = Arc::new(Shared { cfg, policies, in_flight: Mutex::new(InFlight::default()) });
        std::thread::Builder::new().name("dns-proxy".into()).spawn(move || {
            runtime.block_on(async move {
                let (udp, tcp) = match (UdpSocket::from_std(udp), TcpListener::from_std(tcp)) {
                    (Ok(udp), Ok(tcp)) => (Arc::new(udp), tcp),
                    (Err(e), _) | (_, Err(e)) => return tracing::error!("dns proxy: {e}"),
                };
                tokio::select! {
                    _ = stopped => {}
                    _ = serve_udp(shared.clone(), udp) => {}
                    _ = serve_tcp(shared, tcp) => {}
                }
            })
        })?;
        Ok(Self { port, _stop: stop })
    }

    pub fn port(&self) -> u16 {
        self.port
    }
}

/// A UDP socket and a TCP listener on one ephemeral port of `addr`.
fn bind_pair(addr: Ipv4Addr) -> anyhow::Result<(std::net::UdpSocket, std::net::TcpListener)> {
    for _ in 0..16 {
        let udp = std::net::UdpSocket::bind((addr, 0)).context("binding the DNS proxy (UDP)")?;
        let port = udp.local_addr()?.port();
        if let Ok(tcp) = std::net::TcpListener::bind((addr, port)) {
            udp.set_nonblocking(true)?;
            tcp.set_nonblocking(true)?;
            return Ok((udp, tcp));
        }
    }
    bail!("no port of {addr} is free for both UDP and TCP")
}

#[derive(Default)]
struct InFlight {
    total: usize,
    by_sandbox: HashMap<Ipv4Addr, usize>,
}

struct Shared {
    cfg: NetConfig,
    policies: Policies,
    in_flight: Mutex<InFlight>,
}

impl Shared {
    /// What the sandbox at `source` gets for `packet`, if anything.
    async fn answer(&self, source: Ipv4Addr, packet: &[u8]) -> Option<Vec<u8>> {
        let policy = (self.policies)(source)?;
        let resolvers = &self.cfg.neighbourhood.resolvers;
        match dnsfilter::decide(&policy, &self.cfg.static_hosts, resolvers, packet) {
            Decision::Ignore => None,
            Decision::Reply(answer) => Some(answer),
            Decision::Forward(upstreams) => {
                match timeout(FORWARD_TIMEOUT, forward(&self.cfg, &upstreams, packet)).await {
                    Ok(Some(answer)) => Some(answer),
                    _ => {
                        tracing::debug!(%source, servers = ?upstreams.servers(), "no upstream answered");
                        dnsfilter::server_failure(packet)
                    }
                }
            }
        }
    }
}

/// One of a sandbox's [`PER_SANDBOX`] places, given back on drop.
struct Slot {
    shared: Arc<Shared>,
    source: Ipv4Addr,
}

impl Slot {
    fn take(shared: &Arc<Shared>, source: Ipv4Addr) -> Option<Self> {
        let mut in_flight = shared.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let count = in_flight.by_sandbox.get(&source).copied().unwrap_or_default();
        if count >= PER_SANDBOX || in_flight.total >= TOTAL {
            return None;
        }
        in_flight.by_sandbox.insert(source, count + 1);
        in_flight.total += 1;
        Some(Self { shared: shared.clone(), source })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut in_flight = self.shared.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        in_flight.total -= 1;
        if let Some(count) = in_flight.by_sandbox.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                in_flight.by_sandbox.remove(&self.source);
            }
        }
    }
}

async fn serve_udp(shared: Arc<Shared>, socket: Arc<UdpSocket>) {
    // One byte more than a query may have, so an oversized one is seen.
    let mut buf = vec![0u8; MAX_QUERY + 1];
    loop {
        let (n, from) = match socket.recv_from(&mut buf).await {
            Ok((n, SocketAddr::V4(from))) => (n, from),
            Ok(_) => continue,
            Err(e) => {
                tracing::debug!("dns proxy: {e}");
                continue;
            }
        };
        let Some(slot) = Slot::take(&shared, *from.ip()) else {
            tracing::debug!(source = %from.ip(), "dns proxy: too many queries in flight; dropped");
            continue;
        };
        let packet = buf[..n].to_vec();
        let (shared, socket) = (shared.clone(), socket.clone());
        tokio::spawn(async move {
            let _slot = slot;
            if let Some(answer) = shared.answer(*from.ip(), &packet).await {
                let _ = socket.send_to(&answer, from).await;
            }
        });
    }
}

async fn serve_tcp(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let (stream, source) = match listener.accept().await {
            Ok((stream, SocketAddr::V4(from))) => (stream, *from.ip()),
            Ok(_) => continue,
            Err(e) => {
                // Out of descriptors: give the others time to finish.
                tracing::debug!("dns proxy: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = Slot::take(&shared, source) else { continue };
        let shared = shared.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _ = timeout(TCP_TIMEOUT, serve_stream(&shared, stream, source)).await;
        });
    }
}

/// One length-prefixed query on a TCP connection, and its answer.
async fn serve_stream(shared: &Shared, mut stream: TcpStream, source: Ipv4Addr) -> std::io::Result<()> {
    let len = usize::from(stream.read_u16().await?);
    if len > MAX_QUERY {
        return Ok(());
    }
    let mut packet = vec![0u8; len];
    stream.read_exact(&mut packet).await?;
    if let Some(answer) = shared.answer(source, &packet).await
        && let Ok(len) = u16::try_from(answer.len())
    {
        stream.write_u16(len).await?;
        stream.write_all(&answer).await?;
    }
    Ok(())
}

/// Asks each server in turn; the first matching answer wins.
async fn forward(cfg: &NetConfig, upstreams: &Upstreams, query: &[u8]) -> Option<Vec<u8>> {
    let tenant = matches!(upstreams, Upstreams::Tenant(_)).then_some(cfg);
    for server in upstreams.servers() {
        match timeout(UPSTREAM_TIMEOUT, ask(SocketAddrV4::new(*server, DNS_PORT), tenant, query)).await {
            Ok(Ok(answer)) => return Some(answer),
            Ok(Err(e)) => tracing::debug!(%server, "dns upstream: {e:#}"),
            Err(_) => tracing::debug!(%server, "dns upstream: timed out"),
        }
    }
    None
}

/// Asks `server`; for a `tenant`'s own server (the config of its network),
/// through [`outbound`]. The host's resolvers are the operator's and may
/// sit in a protected range.
async fn ask(server: SocketAddrV4, tenant: Option<&NetConfig>, query: &[u8]) -> anyhow::Result<Vec<u8>> {
    let socket = match tenant {
        Some(cfg) => UdpSocket::from_std(outbound::udp(cfg, server)?)?,
        None => {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).await?;
            // Connected: the kernel drops datagrams from anyone but `server`.
            socket.connect(server).await?;
            socket
        }
    };
    socket.send(query).await?;
    let mut buf = vec![0u8; MAX_ANSWER];
    loop {
        let n = socket.recv(&mut buf).await?;
        if dnsfilter::answers(query, &buf[..n]) {
            return Ok(buf[..n].to_vec());
        }
    }
}
