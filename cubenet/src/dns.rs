//! Host names of a policy resolved by the host, when the policy is applied
//! (both backends) and when the egress proxy checks that an allowed name
//! really leads to the address a sandbox connected to.
//!
//! The operator's static names ([`NetConfig::static_hosts`], hosts(5)
//! lines) come first: private names the host's resolver does not know, and
//! test hosts.

use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs};

use crate::net::NetConfig;
use crate::policy::{Policy, ResolvedPolicy};

/// The IPv4 addresses of `host`: the operator's static entries if any
/// name it, else the host's resolver.
pub fn lookup(cfg: &NetConfig, host: &str) -> Vec<Ipv4Addr> {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    let fixed: Vec<Ipv4Addr> = cfg.static_hosts.iter().filter(|(n, _)| *n == host).map(|(_, a)| *a).collect();
    if !fixed.is_empty() {
        return fixed;
    }
    (host.as_str(), 0)
        .to_socket_addrs()
        .map(|addrs| {
            addrs
                .filter_map(|a| match a.ip() {
                    IpAddr::V4(v4) => Some(v4),
                    IpAddr::V6(_) => None,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The policy with its host names resolved now; names without an IPv4
/// address admit nothing and are logged.
pub fn resolve(cfg: &NetConfig, policy: &Policy) -> ResolvedPolicy {
    let resolved = policy.resolve(|host| lookup(cfg, host));
    if !resolved.unresolved.is_empty() {
        tracing::warn!(hosts = ?resolved.unresolved, "allowed host names resolved to no IPv4 address");
    }
    resolved
}

/// hosts(5) text as (lowercase name, IPv4 address) pairs; IPv6 lines and
/// comments are skipped.
pub fn parse_hosts(text: &str) -> Result<Vec<(String, Ipv4Addr)>, String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let mut fields = line.split_whitespace();
        let Some(addr) = fields.next() else { continue };
        let addr: IpAddr = addr.parse().map_err(|_| format!("invalid address '{addr}' in a hosts line"))?;
        let IpAddr::V4(addr) = addr else { continue };
        for name in fields {
            out.push((name.trim_end_matches('.').to_ascii_lowercase(), addr));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_names_come_before_the_resolver() {
        let hosts = parse_hosts("# test hosts\n198.51.100.10 allowed.test Other.Test.\n::1 v6.test\n\n").unwrap();
        assert_eq!(hosts.len(), 2);
        let cfg = NetConfig::default().with_static_hosts(hosts);
        assert_eq!(lookup(&cfg, "other.test"), vec![Ipv4Addr::new(198, 51, 100, 10)]);
        assert!(lookup(&cfg, "v6.test").is_empty());
        assert!(parse_hosts("nonsense name").is_err());
    }
}
