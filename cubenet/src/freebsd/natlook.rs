//! Where a connection pf redirected to the egress proxy was going: pf's
//! `DIOCNATLOOK` ioctl on `/dev/pf`, FreeBSD's counterpart of Linux's
//! `SO_ORIGINAL_DST`.
//!
//! The request names the accepted connection as the proxy sees it (the
//! sandbox's address and port, then the proxy's own) and pf answers with
//! the state's other side: the address and port the sandbox connected to.
//! Building the request and reading the answer are pure and tested on
//! Linux; the ioctl itself ([`lookup`]) is FreeBSD only and **not run on
//! FreeBSD**.
//!
//! Layout: `struct pfioc_natlook` of FreeBSD's `sys/net/pfvar.h` (the
//! OpenBSD 4.x layout FreeBSD kept, without OpenBSD's later `rdomain`
//! fields), `DIOCNATLOOK = _IOWR('D', 23, struct pfioc_natlook)`. Addresses
//! and ports are in network byte order, as every pf ioctl takes them.

use std::net::{Ipv4Addr, SocketAddrV4};

/// FreeBSD's `AF_INET`.
const AF_INET: u8 = 2;
const IPPROTO_TCP: u8 = 6;
/// pf's `PF_OUT`: look the state up by its stack-side key (the redirected
/// one the proxy accepted on) and answer with its wire side.
const PF_OUT: u8 = 2;

/// `struct pf_addr`: a 16-byte union of an IPv4 or IPv6 address, aligned
/// like the `u_int32_t addr32[4]` member it has.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PfAddr {
    pub addr32: [u32; 4],
}

impl PfAddr {
    fn v4(ip: Ipv4Addr) -> Self {
        // The first four bytes in memory are the address, network order.
        Self { addr32: [u32::from_ne_bytes(ip.octets()), 0, 0, 0] }
    }

    fn to_v4(self) -> Ipv4Addr {
        Ipv4Addr::from(self.addr32[0].to_ne_bytes())
    }
}

/// `struct pfioc_natlook`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PfiocNatlook {
    pub saddr: PfAddr,
    pub daddr: PfAddr,
    pub rsaddr: PfAddr,
    pub rdaddr: PfAddr,
    pub sport: u16,
    pub dport: u16,
    pub rsport: u16,
    pub rdport: u16,
    pub af: u8,
    pub proto: u8,
    pub direction: u8,
    /// The tail padding C leaves implicit, named so every byte is set.
    pub pad: u8,
}

/// The request for the TCP connection the proxy accepted from `peer` on
/// its own address `local`.
pub fn request(peer: SocketAddrV4, local: SocketAddrV4) -> PfiocNatlook {
    PfiocNatlook {
        saddr: PfAddr::v4(*peer.ip()),
        daddr: PfAddr::v4(*local.ip()),
        sport: peer.port().to_be(),
        dport: local.port().to_be(),
        af: AF_INET,
        proto: IPPROTO_TCP,
        direction: PF_OUT,
        ..PfiocNatlook::default()
    }
}

/// The original destination in pf's answer. An unset one (no address or
/// port) is an error rather than a destination: the proxy must never
/// connect to `0.0.0.0`.
pub fn reply(answer: &PfiocNatlook) -> Result<SocketAddrV4, &'static str> {
    let (ip, port) = (answer.rdaddr.to_v4(), u16::from_be(answer.rdport));
    if ip.is_unspecified() || port == 0 {
        return Err("pf answered without an original destination");
    }
    Ok(SocketAddrV4::new(ip, port))
}

#[cfg(target_os = "freebsd")]
mod ioctl {
    use super::PfiocNatlook;
    nix::ioctl_readwrite!(diocnatlook, b'D', 23, PfiocNatlook);
}

/// Asks pf where the redirected connection from `peer` to the proxy at
/// `local` was going. `/dev/pf` is opened per call: a lookup per accepted
/// connection, and no descriptor to the packet filter is kept open in the
/// gateway between them.
#[cfg(target_os = "freebsd")]
pub fn lookup(peer: SocketAddrV4, local: SocketAddrV4) -> anyhow::Result<SocketAddrV4> {
    use std::os::fd::AsRawFd;

    use anyhow::Context;

    // _IOWR ioctls need the device open for writing.
    let pf = std::fs::OpenOptions::new().read(true).write(true).open("/dev/pf").context("opening /dev/pf")?;
    let mut natlook = request(peer, local);
    // SAFETY: `natlook` is a live, exclusively borrowed `pfioc_natlook`
    // of the size the ioctl number encodes, on an open descriptor.
    unsafe { ioctl::diocnatlook(pf.as_raw_fd(), &mut natlook) }
        .with_context(|| format!("DIOCNATLOOK for {peer} -> {local}"))?;
    reply(&natlook).map_err(|e| anyhow::anyhow!("DIOCNATLOOK for {peer} -> {local}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddrV4 {
        s.parse().unwrap()
    }

    /// The struct's bytes, as the kernel reads them.
    fn bytes(n: &PfiocNatlook) -> Vec<u8> {
        // SAFETY: a `repr(C)` struct of integers without implicit padding,
        // read as the bytes it occupies.
        unsafe { std::slice::from_raw_parts((n as *const PfiocNatlook).cast::<u8>(), size_of::<PfiocNatlook>()) }
            .to_vec()
    }

    #[test]
    fn the_struct_has_pfvar_h_layout() {
        // 4 × 16-byte addresses, 4 × u16 ports, af, proto, direction,
        // padded to the 4-byte alignment of pf_addr: the 76 bytes
        // `_IOWR('D', 23, ...)` encodes.
        assert_eq!(size_of::<PfiocNatlook>(), 76);
        assert_eq!(align_of::<PfiocNatlook>(), 4);
        assert_eq!(std::mem::offset_of!(PfiocNatlook, rdaddr), 48);
        assert_eq!(std::mem::offset_of!(PfiocNatlook, sport), 64);
        assert_eq!(std::mem::offset_of!(PfiocNatlook, rdport), 70);
        assert_eq!(std::mem::offset_of!(PfiocNatlook, af), 72);
        assert_eq!(std::mem::offset_of!(PfiocNatlook, direction), 74);
    }

    #[test]
    fn the_request_names_the_accepted_connection_in_network_order() {
        let n = request(addr("10.88.0.7:40312"), addr("10.88.0.1:5080"));
        let b = bytes(&n);
        assert_eq!(&b[0..4], &[10, 88, 0, 7], "saddr: the sandbox");
        assert_eq!(&b[16..20], &[10, 88, 0, 1], "daddr: the proxy's address");
        assert!(b[4..16].iter().chain(&b[20..64]).all(|&x| x == 0), "the rest of the addresses is zero");
        assert_eq!(&b[64..66], &40312u16.to_be_bytes(), "sport");
        assert_eq!(&b[66..68], &5080u16.to_be_bytes(), "dport");
        assert_eq!(&b[68..72], &[0, 0, 0, 0], "the answer's ports start unset");
        assert_eq!(&b[72..76], &[AF_INET, IPPROTO_TCP, PF_OUT, 0]);
    }

    #[test]
    fn the_reply_is_the_original_destination() {
        let mut n = request(addr("10.88.0.7:40312"), addr("10.88.0.1:5080"));
        n.rsaddr = PfAddr::v4("10.88.0.7".parse().unwrap());
        n.rsport = 40312u16.to_be();
        // What the kernel writes: bytes in network order.
        n.rdaddr = PfAddr { addr32: [u32::from_ne_bytes([93, 184, 216, 34]), 0, 0, 0] };
        n.rdport = u16::from_ne_bytes(443u16.to_be_bytes());
        assert_eq!(reply(&n), Ok(addr("93.184.216.34:443")));
    }

    #[test]
    fn an_unset_reply_is_refused() {
        let n = request(addr("10.88.0.7:40312"), addr("10.88.0.1:5080"));
        assert!(reply(&n).is_err());
        let mut no_port = n;
        no_port.rdaddr = PfAddr::v4("93.184.216.34".parse().unwrap());
        assert!(reply(&no_port).is_err());
    }
}
