//! The egress proxy's executor: a listener on the bridge address that the
//! host's firewall redirects proxied sandboxes' web connections to
//! (nftables `redirect`, see [`crate::linux::nft`]; pf `rdr`, see
//! [`crate::freebsd::pf`]), one thread pair per connection. The same code
//! on both OSes; **not run on FreeBSD**.
//!
//! Per connection: the sandbox is known by its source address (the
//! spoofing guard makes that trustworthy), the destination it chose by
//! [`original_destination`]; the first bytes are peeked and kept, the
//! policy decides ([`crate::egress::decide`]), and an admitted connection
//! is spliced to that destination from a socket of [`outbound`], which
//! refuses the host and the ranges no sandbox may reach, whatever the
//! proxy decided. A sandbox
//! with a SOCKS5 upstream has all its TCP here, and the admitted
//! connection goes through that upstream instead ([`super::socks`]).
//! A request a rule of the sandbox matches goes out with the rule's headers
//! ([`crate::egress::rules`]); TLS to a rule's host is intercepted
//! ([`crate::egress::intercept`]).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::dns;
use crate::egress::http;
use crate::egress::intercept::Interceptor;
use crate::egress::rules::{self, Outbound, SecretResolver};
use crate::egress::sniff::{Sniffed, sniff};
use crate::egress::socks::{self, Tunnel};
use crate::egress::{MAX_PEEK, Verdict, decide, original_destination, outbound};
use crate::net::NetConfig;

pub use crate::egress::Policies;

/// How long a client may take to send its request head or ClientHello;
/// one that sends nothing in that time is decided by address alone (a
/// protocol whose server speaks first).
const PEEK_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Open connections one sandbox may hold through the proxy (two threads
/// each), so one tenant cannot exhaust the host's threads.
const MAX_PER_SANDBOX: usize = 256;

pub struct EgressProxy {
    port: u16,
    stop: Arc<AtomicBool>,
    address: SocketAddrV4,
    secrets: Arc<OnceLock<SecretResolver>>,
    interceptor: Arc<OnceLock<Arc<Interceptor>>>,
}

impl EgressProxy {
    /// Listens on the bridge address of `cfg` (an ephemeral port) and
    /// serves until dropped.
    pub fn start(cfg: NetConfig, policies: Policies) -> anyhow::Result<Self> {
        let listener = TcpListener::bind((cfg.gateway(), 0)).context("binding the egress proxy")?;
        let address = match listener.local_addr()? {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(_) => bail!("the egress proxy bound an IPv6 address"),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (secrets, interceptor) = (Arc::new(OnceLock::new()), Arc::new(OnceLock::new()));
        let shared = Arc::new(Shared {
            cfg,
            policies,
            open: Mutex::new(HashMap::new()),
            secrets: secrets.clone(),
            interceptor: interceptor.clone(),
        });
        let stopping = stop.clone();
        std::thread::Builder::new().name("egress-proxy".into()).spawn(move || {
            for client in listener.incoming() {
                if stopping.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(client) = client else { continue };
                let shared = shared.clone();
                let spawned = std::thread::Builder::new().name("egress-conn".into()).spawn(move || {
                    if let Err(e) = shared.serve(client) {
                        tracing::debug!("egress proxy connection: {e:#}");
                    }
                });
                if let Err(e) = spawned {
                    tracing::warn!("egress proxy: no thread for a connection: {e}");
                }
            }
        })?;
        Ok(Self { port: address.port(), stop, address, secrets, interceptor })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Where the placeholders of `network.rules` are resolved; until it is
    /// set, a request a rule matches is refused. Set once: later calls are
    /// ignored.
    pub fn set_secret_resolver(&self, resolver: SecretResolver) {
        let _ = self.secrets.set(resolver);
    }

    /// What TLS to a rule's host is terminated with; until it is set, such
    /// a connection is refused. Set once: later calls are ignored.
    pub fn set_interceptor(&self, interceptor: Arc<Interceptor>) {
        let _ = self.interceptor.set(interceptor);
    }
}

impl Drop for EgressProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.address.into(), Duration::from_secs(1));
    }
}

struct Shared {
    cfg: NetConfig,
    policies: Policies,
    open: Mutex<HashMap<Ipv4Addr, usize>>,
    secrets: Arc<OnceLock<SecretResolver>>,
    interceptor: Arc<OnceLock<Arc<Interceptor>>>,
}

impl Shared {
    fn serve(&self, client: TcpStream) -> anyhow::Result<()> {
        let SocketAddr::V4(source) = client.peer_addr()? else { bail!("IPv6 client") };
        let source = *source.ip();
        let Some(policy) = (self.policies)(source) else { bail!("{source} is no attached sandbox") };
        let dst = original_destination(&client)?;
        // A relay must not hold back a small write (the tail of a response
        // head, say) for an ACK the sandbox delays: 40 ms per request.
        client.set_nodelay(true)?;
        let _slot = Slot::take(self, source)?;
        // A tunnelled connection never crosses `forward`, where the blocks
        // every sandbox gets live, and the host's connection goes to the
        // upstream, not `dst`: the blocks are checked here instead.
        if policy.upstream.is_some() && outbound::refused(&self.cfg, *dst.ip()) {
            tracing::info!(%source, %dst, "tunnelled egress refused: a blocked destination");
            let _ = client.shutdown(Shutdown::Both);
            return Ok(());
        }
        // Only names in the policy need the client's first bytes; a
        // tunnelled protocol whose server speaks first is not held up.
        let (name, head) = match policy.proxied() {
            true => peek(&client)?,
            false => (None, Vec::new()),
        };
        match decide(&policy, name.as_deref(), dst, |n| dns::lookup(&self.cfg, n)) {
            Verdict::Refuse(why) => {
                tracing::info!(%source, %dst, ?name, why, "egress refused");
                let _ = client.shutdown(Shutdown::Both);
                Ok(())
            }
            Verdict::Splice => {
                let lookup = |n: &str| dns::lookup(&self.cfg, n);
                let outbound = match rules::prepare(policy.rules.as_ref(), name.as_deref(), *dst.ip(), head, lookup) {
                    Ok(outbound) => outbound,
                    Err(why) => {
                        tracing::info!(%source, %dst, ?name, "egress refused: {why}");
                        let _ = client.shutdown(Shutdown::Both);
                        return Ok(());
                    }
                };
                let upstream = match &policy.upstream {
                    Some(upstream) => socks::dial(&self.cfg, upstream, dst),
                    None => outbound::tcp(&self.cfg, dst, CONNECT_TIMEOUT).map(Tunnel::Plain),
                };
                let upstream = upstream.inspect_err(|e| {
                    tracing::info!(%source, %dst, "egress failed: {e:#}");
                    let _ = client.shutdown(Shutdown::Both);
                })?;
                match (outbound, upstream) {
                    (Outbound::Forward(head), Tunnel::Plain(upstream)) => splice(client, upstream, &head),
                    (Outbound::Forward(head), Tunnel::Tls(tunnel)) => tunnel.splice(client, &head),
                    (Outbound::Serve(target), upstream) => {
                        let (runtime, upstream) = upstream.into_async()?;
                        http::serve_blocking(&runtime, client, upstream, target, self.secrets.get())
                    }
                    (Outbound::Intercept(target), upstream) => match self.interceptor.get() {
                        Some(interceptor) => {
                            let (runtime, upstream) = upstream.into_async()?;
                            interceptor.serve(&runtime, client, upstream, target, self.secrets.get())
                        }
                        None => {
                            tracing::info!(%source, %dst, ?name, "egress refused: TLS to a rule's host, no egress CA");
                            let _ = client.shutdown(Shutdown::Both);
                            Ok(())
                        }
                    },
                }
            }
        }
    }
}

/// One of a sandbox's [`MAX_PER_SANDBOX`] connections, given back on drop.
struct Slot<'a> {
    shared: &'a Shared,
    source: Ipv4Addr,
}

impl<'a> Slot<'a> {
    fn take(shared: &'a Shared, source: Ipv4Addr) -> anyhow::Result<Self> {
        let mut open = shared.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(source).or_default();
        if *count >= MAX_PER_SANDBOX {
            bail!("{source} holds {MAX_PER_SANDBOX} proxied connections already");
        }
        *count += 1;
        Ok(Self { shared, source })
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut open = self.shared.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.source);
            }
        }
    }
}

/// The name the client asks for and the bytes read to learn it.
fn peek(client: &TcpStream) -> anyhow::Result<(Option<String>, Vec<u8>)> {
    client.set_read_timeout(Some(PEEK_TIMEOUT))?;
    let mut head = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    let name = loop {
        match sniff(&head) {
            Sniffed::Name(name) => break Some(name),
            Sniffed::Nameless => break None,
            Sniffed::NeedMore if head.len() >= MAX_PEEK => break None,
            Sniffed::NeedMore => {}
        }
        match (&*client).read(&mut chunk) {
            Ok(0) => bail!("the client closed before naming a host"),
            Ok(n) => head.extend_from_slice(&chunk[..n]),
            Err(e) if head.is_empty() && matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                break None;
            }
            Err(e) => return Err(e).context("reading the client's first bytes"),
        }
    };
    client.set_read_timeout(None)?;
    Ok((name, head))
}

/// Copies both ways until both sides are done, after sending `head`.
fn splice(client: TcpStream, mut upstream: TcpStream, head: &[u8]) -> anyhow::Result<()> {
    upstream.write_all(head)?;
    let (mut from_client, mut to_upstream) = (client.try_clone()?, upstream.try_clone()?);
    let outbound = std::thread::Builder::new().name("egress-up".into()).spawn(move || {
        let _ = relay(&mut from_client, &mut to_upstream);
        let _ = to_upstream.shutdown(Shutdown::Write);
    })?;
    let (mut from_upstream, mut to_client) = (upstream, client);
    let _ = relay(&mut from_upstream, &mut to_client);
    let _ = to_client.shutdown(Shutdown::Write);
    let _ = outbound.join();
    Ok(())
}

/// What one direction of a relay moves per read.
const RELAY_CHUNK: usize = 64 * 1024;

/// Copies `from` to `to` until `from` ends. Not `io::copy`: between two
/// sockets it moves 8 KiB per read and write, which held a relay to about
/// a fifth of a direct connection's throughput (`bench:egress`).
fn relay(from: &mut TcpStream, to: &mut TcpStream) -> io::Result<()> {
    let mut chunk = vec![0; RELAY_CHUNK];
    loop {
        match from.read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(n) => to.write_all(&chunk[..n])?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}
