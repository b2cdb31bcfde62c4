//! The few rtnetlink requests the Linux executor makes, sent synchronously
//! on a socket of the calling thread's network namespace.
//!
//! Spawning `ip` cost a fork/exec per step on every create; a request here
//! costs one round trip. Only what `ip` sent is sent, so the resulting
//! links, addresses and routes are the same.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use anyhow::{Context, bail};

// From <linux/if_link.h>, <linux/veth.h>, <linux/if_addr.h>,
// <linux/rtnetlink.h>; libc does not carry every one of them.
const IFLA_IFNAME: u16 = 3;
const IFLA_MASTER: u16 = 10;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_PID: u16 = 19;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const IFLA_INFO_SLAVE_KIND: u16 = 4;
const IFLA_INFO_SLAVE_DATA: u16 = 5;
const VETH_INFO_PEER: u16 = 1;
const IFLA_BRPORT_LEARNING: u16 = 8;
const IFLA_BRPORT_ISOLATED: u16 = 33;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_GATEWAY: u16 = 5;

/// A route netlink socket, bound to the network namespace of the thread
/// that opened it for as long as it lives.
pub struct Rtnl {
    fd: OwnedFd,
    seq: u32,
}

impl Rtnl {
    pub fn open() -> anyhow::Result<Self> {
        // SAFETY: plain socket(2); the descriptor is owned right away.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("opening a netlink socket");
        }
        // SAFETY: fd is a fresh descriptor nothing else owns.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd) }, seq: 0 })
    }

    /// A veth `host_if` whose peer `eth0` is created straight in the
    /// network namespace of `netns_pid`, enslaved to the bridge `master`
    /// (down: it comes up once it is an isolated port under the sandbox's
    /// rules).
    pub fn add_veth(&mut self, host_if: &str, netns_pid: i32, master: u32) -> anyhow::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWLINK, libc::NLM_F_CREATE | libc::NLM_F_EXCL);
        m.ifinfo(0, 0, 0);
        m.attr_str(IFLA_IFNAME, host_if);
        m.attr(IFLA_MASTER, &master.to_ne_bytes());
        let info = m.begin(IFLA_LINKINFO);
        m.attr_str(IFLA_INFO_KIND, "veth");
        let data = m.begin(IFLA_INFO_DATA);
        let peer = m.begin(VETH_INFO_PEER);
        m.ifinfo(0, 0, 0);
        m.attr_str(IFLA_IFNAME, "eth0");
        m.attr(IFLA_NET_NS_PID, &(netns_pid as u32).to_ne_bytes());
        m.end(peer);
        m.end(data);
        m.end(info);
        self.request(m).with_context(|| format!("creating veth {host_if}"))
    }

    /// Makes bridge port `index` isolated and without MAC learning; leaves
    /// it down.
    pub fn isolate_port(&mut self, index: u32) -> anyhow::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWLINK, 0);
        m.ifinfo(index, 0, 0);
        let info = m.begin(IFLA_LINKINFO);
        m.attr_str(IFLA_INFO_SLAVE_KIND, "bridge");
        let data = m.begin(IFLA_INFO_SLAVE_DATA);
        m.attr(IFLA_BRPORT_ISOLATED, &[1]);
        m.attr(IFLA_BRPORT_LEARNING, &[0]);
        m.end(data);
        m.end(info);
        self.request(m).context("making the bridge port isolated")
    }

    pub fn set_up(&mut self, index: u32) -> anyhow::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWLINK, 0);
        m.ifinfo(index, libc::IFF_UP as u32, libc::IFF_UP as u32);
        self.request(m).with_context(|| format!("bringing link {index} up"))
    }

    pub fn add_address(&mut self, index: u32, address: Ipv4Addr, prefix_len: u8) -> anyhow::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWADDR, libc::NLM_F_CREATE | libc::NLM_F_EXCL);
        // struct ifaddrmsg: family, prefixlen, flags, scope, index.
        m.push(&[libc::AF_INET as u8, prefix_len, 0, libc::RT_SCOPE_UNIVERSE]);
        m.push(&index.to_ne_bytes());
        m.attr(IFA_LOCAL, &address.octets());
        m.attr(IFA_ADDRESS, &address.octets());
        self.request(m).with_context(|| format!("adding address {address}/{prefix_len}"))
    }

    pub fn add_default_route(&mut self, gateway: Ipv4Addr) -> anyhow::Result<()> {
        let mut m = Msg::new(libc::RTM_NEWROUTE, libc::NLM_F_CREATE | libc::NLM_F_EXCL);
        // struct rtmsg: family, dst_len, src_len, tos, table, protocol,
        // scope, type, flags.
        m.push(&[
            libc::AF_INET as u8,
            0,
            0,
            0,
            libc::RT_TABLE_MAIN,
            libc::RTPROT_BOOT,
            libc::RT_SCOPE_UNIVERSE,
            libc::RTN_UNICAST,
        ]);
        m.push(&0u32.to_ne_bytes());
        m.attr(RTA_GATEWAY, &gateway.octets());
        self.request(m).with_context(|| format!("adding the default route via {gateway}"))
    }

    pub fn delete_link(&mut self, index: u32) -> anyhow::Result<()> {
        let mut m = Msg::new(libc::RTM_DELLINK, 0);
        m.ifinfo(index, 0, 0);
        self.request(m).with_context(|| format!("deleting link {index}"))
    }

    /// Sends `m` and waits for its acknowledgement.
    fn request(&mut self, mut m: Msg) -> anyhow::Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        m.finish(seq);
        let fd = self.fd.as_raw_fd();
        let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        kernel.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: the buffer and address outlive the call.
        let sent = unsafe {
            libc::sendto(
                fd,
                m.buf.as_ptr().cast(),
                m.buf.len(),
                0,
                (&raw const kernel).cast(),
                size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error().into());
        }
        let mut reply = [0u8; 4096];
        loop {
            // SAFETY: reply is writable for its length.
            let n = unsafe { libc::recv(fd, reply.as_mut_ptr().cast(), reply.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e.into());
            }
            if let Some(result) = ack(&reply[..n as usize], seq) {
                return result;
            }
        }
    }
}

/// The outcome carried by the acknowledgement of `seq` in `datagram`, if
/// it holds one.
fn ack(datagram: &[u8], seq: u32) -> Option<anyhow::Result<()>> {
    let mut rest = datagram;
    while rest.len() >= 16 {
        let len = u32::from_ne_bytes(rest[0..4].try_into().ok()?) as usize;
        let kind = u16::from_ne_bytes(rest[4..6].try_into().ok()?);
        let msg_seq = u32::from_ne_bytes(rest[8..12].try_into().ok()?);
        if len < 16 || len > rest.len() {
            return Some(Err(anyhow::anyhow!("malformed netlink reply")));
        }
        if kind == libc::NLMSG_ERROR as u16 && msg_seq == seq && len >= 20 {
            let errno = -i32::from_ne_bytes(rest[16..20].try_into().ok()?);
            return Some(if errno == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(errno).into()) });
        }
        rest = &rest[align(len).min(rest.len())..];
    }
    None
}

const fn align(len: usize) -> usize {
    (len + 3) & !3
}

/// One request: header, fixed part, attributes (nested ones through
/// [`Msg::begin`] / [`Msg::end`]).
struct Msg {
    buf: Vec<u8>,
}

impl Msg {
    fn new(kind: u16, flags: i32) -> Self {
        let mut buf = vec![0u8; 16];
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK | flags) as u16;
        buf[6..8].copy_from_slice(&flags.to_ne_bytes());
        Self { buf }
    }

    /// struct ifinfomsg: family, pad, type, index, flags, change.
    fn ifinfo(&mut self, index: u32, flags: u32, change: u32) {
        self.push(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
        self.push(&index.to_ne_bytes());
        self.push(&flags.to_ne_bytes());
        self.push(&change.to_ne_bytes());
    }

    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    fn attr(&mut self, kind: u16, value: &[u8]) {
        let start = self.begin(kind);
        self.push(value);
        self.end(start);
    }

    fn attr_str(&mut self, kind: u16, value: &str) {
        let start = self.begin(kind);
        self.push(value.as_bytes());
        self.push(&[0]);
        self.end(start);
    }

    fn begin(&mut self, kind: u16) -> usize {
        let start = self.buf.len();
        self.push(&[0, 0]);
        self.push(&kind.to_ne_bytes());
        start
    }

    fn end(&mut self, start: usize) {
        let len = (self.buf.len() - start) as u16;
        self.buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
        self.buf.resize(align(self.buf.len()), 0);
    }

    fn finish(&mut self, seq: u32) {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
    }
}

/// The interfaces of the calling thread's network namespace. Not
/// `/sys/class/net`: that shows the namespace sysfs was mounted in, the
/// host's when the gateway runs in a namespace of its own under the host's
/// mounts (`nsenter --net`, `scripts/cluster`).
pub fn link_names() -> Vec<String> {
    match nix::net::if_::if_nameindex() {
        Ok(links) => links.iter().filter_map(|l| l.name().to_str().ok().map(str::to_owned)).collect(),
        Err(_) => Vec::new(),
    }
}

/// Index of interface `name` in the calling thread's network namespace.
pub fn index_of(name: &str) -> anyhow::Result<u32> {
    let c = std::ffi::CString::new(name)?;
    // SAFETY: c is a valid C string.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        bail!("no interface {name}: {}", io::Error::last_os_error());
    }
    Ok(index)
}
