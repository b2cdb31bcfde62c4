//! The one platform-specific question the egress proxy asks of an
//! accepted connection: where was the sandbox connecting before the host
//! redirected it here? Linux answers from conntrack (`SO_ORIGINAL_DST`,
//! for nftables' `redirect`), FreeBSD from pf's state table
//! (`DIOCNATLOOK`, for the anchor's `rdr`; **not run on FreeBSD**).

use std::net::{SocketAddrV4, TcpStream};

#[cfg(target_os = "linux")]
pub fn original_destination(client: &TcpStream) -> anyhow::Result<SocketAddrV4> {
    use anyhow::Context;

    let original = socket2::SockRef::from(client).original_dst_v4().context("SO_ORIGINAL_DST")?;
    original.as_socket_ipv4().context("the original destination is not IPv4")
}

#[cfg(target_os = "freebsd")]
pub fn original_destination(client: &TcpStream) -> anyhow::Result<SocketAddrV4> {
    use std::net::SocketAddr;

    let (SocketAddr::V4(peer), SocketAddr::V4(local)) = (client.peer_addr()?, client.local_addr()?) else {
        anyhow::bail!("the redirected connection is not IPv4");
    };
    crate::freebsd::natlook::lookup(peer, local)
}
