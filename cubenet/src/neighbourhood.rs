//! The host's neighbourhood: address ranges a sandbox never reaches unless
//! the operator opens them, whatever its tenant's policy says.
//!
//! A sandbox runs code nobody has read, and the host usually sits on
//! networks the internet cannot see: a LAN or VPC (RFC 1918), a carrier's
//! or a cloud's internal range (CGNAT, which also holds Alibaba's metadata
//! service at 100.100.100.200), link-local (the cloud metadata service at
//! 169.254.169.254 and AWS's resolver at 169.254.169.253), 192.0.0.0/24
//! (Oracle's metadata service at 192.0.0.192) and the benchmarking range
//! 198.18.0.0/15 that some fabrics use internally. NAT would carry a
//! sandbox's packets into all of them from the host's own addresses.
//!
//! These ranges are blocked before a tenant's policy is consulted, so a
//! tenant's `allow_out` cannot reopen them: only the operator can, per
//! range (`copse up --allow-egress-range`). What stays blocked even then is
//! not here but in the renderers' always-blocked list (loopback, "this
//! network", multicast and broadcast, the sandbox subnet) and the host's
//! own addresses, which no forwarded packet reaches.
//!
//! One exception keeps name resolution working where the host's resolver
//! lives in such a range (templates copy the host's `/etc/resolv.conf`):
//! the host's resolvers are reachable on port 53, TCP and UDP, and only
//! there, and then only as far as the tenant's policy admits them.

use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Serialize};

/// Blocked unless the operator opens them (see the module header).
pub const PROTECTED: &[&str] = &[
    "10.0.0.0/8",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
];

/// Destinations neither a tenant's policy nor the operator can open: "this
/// network", loopback, multicast, the reserved block and broadcast.
pub const ALWAYS_BLOCKED: &[&str] = &["0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/3"];

/// [`ALWAYS_BLOCKED`] and the sandbox subnet (other sandboxes, the
/// network and broadcast addresses, the host's bridge address), aggregated.
pub fn always_blocked(subnet: Ipv4Net) -> Vec<Ipv4Net> {
    let mut blocked: Vec<Ipv4Net> = ALWAYS_BLOCKED.iter().map(|s| s.parse().expect("valid constant")).collect();
    blocked.push(subnet);
    Ipv4Net::aggregate(&blocked)
}

/// Where the host's resolvers are read from at start-up.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";

/// What the operator decided about the host's neighbourhood.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Neighbourhood {
    /// Ranges the operator opened to every sandbox (still subject to each
    /// tenant's policy).
    pub opened: Vec<Ipv4Net>,
    /// The host's resolvers: reachable on port 53 even inside a protected
    /// range.
    pub resolvers: Vec<Ipv4Addr>,
}

impl Neighbourhood {
    /// The operator's opened ranges (`--allow-egress-range`: an IPv4
    /// address or CIDR block each) and the host's resolvers as
    /// `resolv_conf` lists them.
    pub fn new(opened: &[String], resolv_conf: &str) -> Result<Self, String> {
        let opened = opened.iter().map(|s| parse_range(s)).collect::<Result<Vec<_>, _>>()?;
        Ok(Self { opened: Ipv4Net::aggregate(&opened), resolvers: nameservers(resolv_conf) })
    }

    /// [`Self::new`] with this host's [`RESOLV_CONF`] (none if unreadable).
    pub fn of_host(opened: &[String]) -> Result<Self, String> {
        Self::new(opened, &std::fs::read_to_string(RESOLV_CONF).unwrap_or_default())
    }

    /// What stays blocked: [`PROTECTED`] less the opened ranges, aggregated.
    pub fn blocked(&self) -> Vec<Ipv4Net> {
        let protected: Vec<Ipv4Net> = PROTECTED.iter().map(|s| s.parse().expect("valid constant")).collect();
        Ipv4Net::aggregate(&exclude(&protected, &self.opened))
    }

    /// The host's resolvers that a blocked range holds: the only addresses
    /// of those ranges a sandbox may reach, on port 53.
    pub fn exempt_resolvers(&self) -> Vec<Ipv4Net> {
        let blocked = self.blocked();
        let inside = self.resolvers.iter().filter(|r| blocked.iter().any(|b| b.contains(*r)));
        Ipv4Net::aggregate(&inside.copied().map(Ipv4Net::from).collect::<Vec<_>>())
    }
}

fn parse_range(s: &str) -> Result<Ipv4Net, String> {
    let s = s.trim();
    let net = match s.parse::<IpNet>() {
        Ok(net) => net,
        Err(_) => s.parse::<IpAddr>().map(IpNet::from).map_err(|_| {
            format!("egress range '{s}' is not an IPv4 address or CIDR block (e.g. 10.1.0.0/16 or 169.254.169.254)")
        })?,
    };
    match net {
        IpNet::V4(net) => Ok(net.trunc()),
        IpNet::V6(_) => Err(format!("egress range '{s}' is IPv6; sandboxes have IPv4 only")),
    }
}

/// The IPv4 `nameserver` lines of a resolv.conf.
pub fn nameservers(resolv_conf: &str) -> Vec<Ipv4Addr> {
    resolv_conf
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver")).then(|| words.next()?.parse().ok())?
        })
        .collect()
}

/// `nets` with every address of `holes` taken out, as CIDR blocks.
fn exclude(nets: &[Ipv4Net], holes: &[Ipv4Net]) -> Vec<Ipv4Net> {
    let mut out = Vec::new();
    let mut pending: Vec<Ipv4Net> = nets.to_vec();
    while let Some(net) = pending.pop() {
        if holes.iter().any(|h| h.contains(&net)) {
            continue;
        }
        // A hole strictly inside: halve until each part is whole or gone.
        if holes.iter().any(|h| net.contains(h)) {
            pending.extend(net.subnets(net.prefix_len() + 1).expect("a hole inside means a prefix below 32"));
        } else {
            out.push(net);
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(v: &[&str]) -> Vec<Ipv4Net> {
        v.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn by_default_every_protected_range_is_blocked() {
        let n = Neighbourhood::default();
        assert_eq!(
            n.blocked(),
            nets(&[
                "10.0.0.0/8",
                "100.64.0.0/10",
                "169.254.0.0/16",
                "172.16.0.0/12",
                "192.0.0.0/24",
                "192.168.0.0/16",
                "198.18.0.0/15"
            ])
        );
        let blocked = |a: &str| n.blocked().iter().any(|b| b.contains(&a.parse::<Ipv4Addr>().unwrap()));
        for metadata in ["169.254.169.254", "100.100.100.200", "192.0.0.192", "169.254.169.253"] {
            assert!(blocked(metadata), "{metadata}");
        }
        for public in ["8.8.8.8", "198.51.100.10", "100.128.0.1", "172.32.0.1", "192.0.2.1"] {
            assert!(!blocked(public), "{public}");
        }
    }

    #[test]
    fn opened_ranges_are_cut_out_of_the_protected_ones() {
        let n = Neighbourhood::new(&strings(&["169.254.169.254", "10.128.0.0/9", "192.168.0.0/16"]), "").unwrap();
        let blocked = n.blocked();
        let contains = |a: &str| blocked.iter().any(|b| b.contains(&a.parse::<Ipv4Addr>().unwrap()));
        assert!(!contains("169.254.169.254"));
        assert!(contains("169.254.169.253") && contains("169.254.169.255") && contains("169.254.0.1"));
        assert!(!contains("10.200.0.1") && contains("10.1.0.1"));
        assert!(!contains("192.168.1.1"));
        assert!(contains("172.16.0.1"));
        // 169.254/16 less one address: one block per prefix length 17..=32.
        assert_eq!(blocked.iter().filter(|b| b.network().octets()[0] == 169).count(), 16);
        // Opening everything leaves nothing protected.
        assert!(Neighbourhood::new(&strings(&["0.0.0.0/0"]), "").unwrap().blocked().is_empty());
    }

    #[test]
    fn bad_ranges_are_refused_with_the_offending_text() {
        assert!(Neighbourhood::new(&strings(&["10.0.0.0/33"]), "").unwrap_err().contains("10.0.0.0/33"));
        assert!(Neighbourhood::new(&strings(&["fd00:ec2::254"]), "").unwrap_err().contains("IPv6"));
        assert!(Neighbourhood::new(&strings(&["example.com"]), "").is_err());
        assert_eq!(Neighbourhood::new(&strings(&[" 10.1.2.3/16 "]), "").unwrap().opened, nets(&["10.1.0.0/16"]));
    }

    #[test]
    fn resolvers_come_from_resolv_conf_and_only_protected_ones_are_exempt() {
        let conf = "# generated\nsearch example.internal\nnameserver 10.255.255.53\nnameserver 8.8.8.8\n\
                    nameserver fe80::1%eth0\nnameserver 127.0.0.53\noptions edns0\n";
        let n = Neighbourhood::new(&[], conf).unwrap();
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert_eq!(n.resolvers, vec![ip("10.255.255.53"), ip("8.8.8.8"), ip("127.0.0.53")]);
        assert_eq!(n.exempt_resolvers(), nets(&["10.255.255.53/32"]));
        let opened = Neighbourhood::new(&strings(&["10.0.0.0/8"]), conf).unwrap();
        assert!(opened.exempt_resolvers().is_empty());
    }
}
