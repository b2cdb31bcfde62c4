//! The commands that move the guest NIC to the identity's MAC, address and
//! default route. Both systems' lines are plain data so they are
//! golden-tested wherever the tests run.

use copse_identity_line::GuestNet;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetCmd {
    pub argv: Vec<String>,
    /// Removing a route that may not exist.
    pub may_fail: bool,
}

/// virtio-net in a FreeBSD guest; `eth0` is only a guess for Linux guests.
pub const DEFAULT_NIC: &str = if cfg!(target_os = "freebsd") { "vtnet0" } else { "eth0" };

pub fn commands(nic: &str, net: &GuestNet) -> Vec<NetCmd> {
    if cfg!(target_os = "freebsd") { freebsd(nic, net) } else { linux(nic, net) }
}

/// `ifconfig … inet` without `alias` replaces the first IPv4 address, which
/// takes the routes through the old one with it; the default route is
/// therefore put back after the address.
pub fn freebsd(nic: &str, net: &GuestNet) -> Vec<NetCmd> {
    vec![
        cmd(&["ifconfig", nic, "ether", &net.mac]),
        cmd(&["ifconfig", nic, "inet", &net.address]),
        NetCmd { may_fail: true, ..cmd(&["route", "-q", "-n", "delete", "default"]) },
        cmd(&["route", "-q", "-n", "add", "default", &net.gateway]),
    ]
}

pub fn linux(nic: &str, net: &GuestNet) -> Vec<NetCmd> {
    vec![
        cmd(&["ip", "link", "set", "dev", nic, "address", &net.mac]),
        cmd(&["ip", "-4", "addr", "flush", "dev", nic]),
        cmd(&["ip", "addr", "add", &net.address, "dev", nic]),
        cmd(&["ip", "route", "replace", "default", "via", &net.gateway, "dev", nic]),
    ]
}

fn cmd(argv: &[&str]) -> NetCmd {
    NetCmd { argv: argv.iter().map(|a| a.to_string()).collect(), may_fail: false }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(cmds: Vec<NetCmd>) -> Vec<String> {
        cmds.iter().map(|c| format!("{}{}", if c.may_fail { "-" } else { "" }, c.argv.join(" "))).collect()
    }

    fn net() -> GuestNet {
        GuestNet { mac: "58:9c:fc:00:00:11".into(), address: "10.78.0.3/16".into(), gateway: "10.78.0.1".into() }
    }

    #[test]
    fn freebsd_lines() {
        assert_eq!(
            lines(freebsd("vtnet0", &net())),
            [
                "ifconfig vtnet0 ether 58:9c:fc:00:00:11",
                "ifconfig vtnet0 inet 10.78.0.3/16",
                "-route -q -n delete default",
                "route -q -n add default 10.78.0.1",
            ]
        );
    }

    #[test]
    fn linux_lines() {
        assert_eq!(
            lines(linux("eth0", &net())),
            [
                "ip link set dev eth0 address 58:9c:fc:00:00:11",
                "ip -4 addr flush dev eth0",
                "ip addr add 10.78.0.3/16 dev eth0",
                "ip route replace default via 10.78.0.1 dev eth0",
            ]
        );
    }
}
