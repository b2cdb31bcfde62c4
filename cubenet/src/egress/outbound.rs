//! The sockets the host opens on a sandbox's behalf: the egress proxy's
//! connections to where a sandbox was going, its dials to a SOCKS5
//! upstream, and the resolver's queries to a tenant's `dns_servers`.
//!
//! Such a socket must not reach what the sandbox could not reach itself:
//! the always-blocked ranges (loopback, the sandbox subnet, multicast…),
//! what the operator has not opened of the host's neighbourhood, and the
//! host's own addresses. Two guards hold that line:
//! - [`refused`], in user space, before any byte leaves, on every OS: the
//!   same ranges as [`crate::upstream::destination_blocked`] (which the
//!   renderers' `always_blocked` and `protected` sets are built from) plus
//!   the host's own addresses. It is the only guard on FreeBSD, where pf
//!   cannot match a socket mark (and the proxy's connections leave from the
//!   host, outside every sandbox's anchor); **not run on FreeBSD**.
//! - On Linux, also the kernel's: each socket carries [`PROXY_MARK`], and
//!   nftables' `output` chain refuses a marked socket the same destinations
//!   (see [`crate::linux::nft`]), so a check missed here still fails closed.
//!
//! The address checked is the one connected to, never a name: there is no
//! window between the check and the connect for a resolver to change it.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::time::Duration;

use anyhow::{Context, bail};
use socket2::{Domain, Socket, Type};

use crate::net::NetConfig;
use crate::upstream::destination_blocked;

pub use crate::linux::nft::PROXY_MARK;

/// Whether a host socket acting for a sandbox must not reach `ip`: a range
/// no sandbox on `cfg` reaches, or one of the host's own addresses.
pub fn refused(cfg: &NetConfig, ip: Ipv4Addr) -> bool {
    destination_blocked(cfg, ip) || is_local(ip)
}

/// Whether `ip` is one of the host's own addresses, on any interface
/// (binding to it works: the kernel's own answer, current at each call).
pub fn is_local(ip: Ipv4Addr) -> bool {
    UdpSocket::bind((ip, 0)).is_ok()
}

/// A TCP connection to `dst` for a sandbox, unless [`refused`].
pub fn tcp(cfg: &NetConfig, dst: SocketAddrV4, timeout: Duration) -> anyhow::Result<TcpStream> {
    if refused(cfg, *dst.ip()) {
        bail!("{dst} is the host's or in a range no sandbox may reach");
    }
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    mark(&socket)?;
    // A relay must not hold back a small write (the tail of a response
    // head, say) for an ACK the other end delays: 40 ms per request.
    socket.set_tcp_nodelay(true)?;
    socket.connect_timeout(&SocketAddr::V4(dst).into(), timeout).with_context(|| format!("connecting to {dst}"))?;
    Ok(socket.into())
}

/// A non-blocking UDP socket connected to `server` for a sandbox, unless
/// [`refused`] (connected: the kernel drops datagrams from anyone else).
pub fn udp(cfg: &NetConfig, server: SocketAddrV4) -> anyhow::Result<UdpSocket> {
    if refused(cfg, *server.ip()) {
        bail!("{server} is the host's or in a range no sandbox may reach");
    }
    let socket = Socket::new(Domain::IPV4, Type::DGRAM, None)?;
    mark(&socket)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)).into())?;
    socket.connect(&SocketAddr::V4(server).into())?;
    Ok(socket.into())
}

#[cfg(target_os = "linux")]
fn mark(socket: &Socket) -> anyhow::Result<()> {
    socket.set_mark(PROXY_MARK).context("marking a socket acting for a sandbox")
}

/// pf matches no socket mark; [`refused`] is the guard here.
#[cfg(not(target_os = "linux"))]
fn mark(_socket: &Socket) -> anyhow::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;
    use crate::neighbourhood::Neighbourhood;

    fn cfg() -> NetConfig {
        NetConfig::new("t", "10.9.0.0/16").unwrap()
    }

    #[test]
    fn what_no_sandbox_reaches_is_refused() {
        for ip in ["127.0.0.1", "10.9.0.1", "10.9.3.4", "0.0.0.0", "224.0.0.251", "255.255.255.255"] {
            assert!(refused(&cfg(), ip.parse().unwrap()), "always blocked: {ip}");
        }
        for ip in ["169.254.169.254", "192.168.1.1", "10.1.2.3", "100.100.100.200"] {
            assert!(refused(&cfg(), ip.parse().unwrap()), "protected: {ip}");
        }
        // TEST-NET addresses: public as far as the guard knows, and no
        // address of this host.
        for ip in ["192.0.2.77", "198.51.100.10", "203.0.113.9"] {
            assert!(!refused(&cfg(), ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn the_operators_opened_ranges_pass_but_the_subnet_never_does() {
        let opened = ["169.254.169.254".to_string(), "10.9.0.0/16".to_string()];
        let cfg = cfg().with_neighbourhood(Neighbourhood::new(&opened, "").unwrap());
        assert!(!refused(&cfg, "169.254.169.254".parse().unwrap()));
        assert!(refused(&cfg, "169.254.169.253".parse().unwrap()));
        assert!(refused(&cfg, "10.9.0.7".parse().unwrap()), "other sandboxes stay blocked");
    }

    #[test]
    fn the_hosts_own_addresses_are_local() {
        assert!(is_local(Ipv4Addr::LOCALHOST));
        assert!(!is_local("192.0.2.77".parse().unwrap()));
        // An address of this host outside every blocked range is refused
        // for being the host's: every address a socket here was given.
        let probe = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        if probe.connect((Ipv4Addr::new(192, 0, 2, 1), 9)).is_ok()
            && let SocketAddr::V4(own) = probe.local_addr().unwrap()
        {
            assert!(is_local(*own.ip()), "{own}");
            assert!(refused(&cfg(), *own.ip()), "{own}");
        }
    }

    #[test]
    fn a_refused_destination_gets_no_connection_attempt() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let SocketAddr::V4(at) = listener.local_addr().unwrap() else { unreachable!() };
        let err = tcp(&cfg(), at, Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("no sandbox may reach"), "{err:#}");
        listener.set_nonblocking(true).unwrap();
        assert_eq!(
            listener.accept().map(|_| ()).unwrap_err().kind(),
            std::io::ErrorKind::WouldBlock,
            "the guard connected anyway"
        );
        let dns = udp(&cfg(), SocketAddrV4::new(Ipv4Addr::LOCALHOST, 53)).unwrap_err();
        assert!(dns.to_string().contains("no sandbox may reach"), "{dns:#}");
    }

    #[test]
    fn an_admitted_destination_is_connected() {
        // Loopback is refused by the guard, so a real connection needs a
        // network where it is neither blocked nor the host's: only the
        // socket's construction is checked here (no traffic leaves).
        let socket = udp(&cfg(), SocketAddrV4::new("192.0.2.77".parse().unwrap(), 53)).unwrap();
        assert_eq!(socket.peer_addr().unwrap(), SocketAddr::from(([192, 0, 2, 77], 53)));
    }
}
