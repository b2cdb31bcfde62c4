//! The egress policy of one sandbox, in E2B's terms.
//!
//! E2B's semantics, which both backends implement:
//! - with no rules, all egress is allowed (besides what
//!   [`crate::linux::nft`] and [`crate::freebsd::pf`] always block: other
//!   sandboxes, the host, loopback, multicast, and the operator's protected
//!   ranges of [`crate::neighbourhood`], which no tenant policy reopens);
//! - `deny_out` blocks the listed networks; `0.0.0.0/0` blocks everything,
//!   and `allow_internet_access: false` means exactly that;
//! - `allow_out` entries win over `deny_out` ones, so "deny 0.0.0.0/0 plus an
//!   allow list" admits only the listed targets;
//! - host names (and wildcards, `*.example.com`: any name under it, not
//!   the apex) in either list are matched by name, on TCP ports 80 and 443,
//!   by the host's egress proxy ([`crate::egress`]): against the HTTP
//!   `Host` or the TLS SNI, whatever address they resolve to. Exact names
//!   in `allow_out` are also resolved when the policy is applied (and
//!   re-resolved on every refresh) and admitted by address on the other
//!   ports. When `allow_out` names any host, the `dns_servers` (8.8.8.8
//!   unless given) are allowed too, on port 53 (TCP and UDP) only: E2B
//!   opens every port of them, which would make "a DNS server" a way to
//!   name any host.
//!
//! Sandboxes have IPv4 only, so IPv6 entries are accepted and have nothing
//! to act on: every IPv6 packet from a sandbox is dropped anyway.

use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net};
use serde::{Deserialize, Serialize};

use crate::egress::rules::HeaderRules;
use crate::upstream::Upstream;

/// E2B's default resolver, allowed when `allow_out` names a host and the
/// caller gave no `dns_servers`.
pub const DEFAULT_DNS: Ipv4Addr = Ipv4Addr::new(8, 8, 8, 8);

/// E2B's bound on `dns_servers`.
pub const MAX_DNS_SERVERS: usize = 10;

/// The one port a DNS server is reachable on.
pub const DNS_PORT: u16 = 53;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("invalid {0} entry '{1}': expected an IP address, a CIDR block, a host name or *.<host name>")]
    InvalidTarget(&'static str, String),
    #[error("invalid DNS server '{0}': expected an IPv4 address")]
    InvalidDnsServer(String),
    #[error("at most {MAX_DNS_SERVERS} DNS servers are allowed, got {0}")]
    TooManyDnsServers(usize),
}

/// One entry of an allow or deny list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Net(Ipv4Net),
    Host(String),
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Admitted even when a deny entry covers them.
    pub allow: Vec<Target>,
    /// Blocked unless an allow entry admits them.
    pub deny: Vec<Ipv4Net>,
    /// Host names (or `*.` wildcards) refused by name at the egress proxy
    /// unless an allow entry names them too.
    #[serde(default)]
    pub deny_hosts: Vec<String>,
    /// Resolvers admitted on port 53 when `allow` names a host.
    pub dns_servers: Vec<Ipv4Addr>,
    /// The SOCKS5 server all the sandbox's TCP is tunnelled through, after
    /// this policy admitted it (E2B's `egress_proxy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream: Option<Upstream>,
    /// Headers the egress proxy sets on requests to some hosts (E2B's
    /// `network.rules`), placeholders unresolved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rules: Option<HeaderRules>,
}

impl Policy {
    /// What a sandbox gets when nobody asked for anything: open egress, and
    /// E2B's default resolver. Equal to what an empty create body asks for,
    /// so handing out a pre-booted sandbox needs no policy change.
    pub fn open() -> Self {
        Self { dns_servers: vec![DEFAULT_DNS], ..Self::default() }
    }

    /// The policy E2B's create and `update_network` bodies describe. Absent
    /// lists are empty; an absent `dns_servers` is E2B's default.
    pub fn from_e2b(
        allow_internet_access: Option<bool>,
        allow_out: &[String],
        deny_out: &[String],
        dns_servers: Option<&[String]>,
    ) -> Result<Self, PolicyError> {
        let mut allow = Vec::new();
        for entry in allow_out {
            if let Some(target) = parse_target(entry).map_err(|e| e.in_list("allow_out"))? {
                allow.push(target);
            }
        }
        let (mut deny, mut deny_hosts) = (Vec::new(), Vec::new());
        for entry in deny_out {
            match parse_target(entry).map_err(|e| e.in_list("deny_out"))? {
                Some(Target::Net(net)) => deny.push(net),
                Some(Target::Host(host)) => deny_hosts.push(host),
                None => {}
            }
        }
        if allow_internet_access == Some(false) {
            deny.push(Ipv4Net::default());
        }
        let dns_servers = match dns_servers {
            None => vec![DEFAULT_DNS],
            Some(list) if list.len() > MAX_DNS_SERVERS => return Err(PolicyError::TooManyDnsServers(list.len())),
            Some(list) => list
                .iter()
                .map(|s| s.trim().parse::<Ipv4Addr>().map_err(|_| PolicyError::InvalidDnsServer(s.clone())))
                .collect::<Result<_, _>>()?,
        };
        Ok(Self { allow, deny, deny_hosts, dns_servers, upstream: None, rules: None })
    }

    /// Whether the sandbox may reach the internet at large, as E2B reports
    /// it (`allow_internet_access`).
    pub fn internet_access(&self) -> bool {
        !self.deny.iter().any(|n| n.prefix_len() == 0)
    }

    pub fn has_hosts(&self) -> bool {
        self.allow.iter().any(|t| matches!(t, Target::Host(_)))
    }

    /// Whether some entry is a name, so the sandbox's web traffic must go
    /// through the egress proxy to be matched by name, or some request
    /// gets a rule's headers there.
    pub fn proxied(&self) -> bool {
        self.has_hosts() || !self.deny_hosts.is_empty() || self.rules.as_ref().is_some_and(|r| !r.hosts.is_empty())
    }

    /// What the name entries say about `name` (a Host or SNI): admitted,
    /// refused, or `None` when no name entry matches and the destination
    /// address decides. Allow entries win, as they do for addresses.
    pub fn name_verdict(&self, name: &str) -> Option<bool> {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let allowed = self.allow.iter().any(|t| matches!(t, Target::Host(p) if name_matches(p, &name)));
        if allowed {
            return Some(true);
        }
        self.deny_hosts.iter().any(|p| name_matches(p, &name)).then_some(false)
    }

    /// The policy's plain-address part only: what decides a connection
    /// whose name no entry matches (addresses that allowed names resolve
    /// to do not admit other names).
    pub fn addresses_only(&self) -> ResolvedPolicy {
        Policy { allow: self.allow.iter().filter(|t| matches!(t, Target::Net(_))).cloned().collect(), ..self.clone() }
            .resolve(|_| Vec::new())
    }

    /// Turns host names into addresses with `lookup`. A name that does not
    /// resolve admits nothing (allow entries only ever widen), and is
    /// reported in [`ResolvedPolicy::unresolved`].
    pub fn resolve(&self, lookup: impl Fn(&str) -> Vec<Ipv4Addr>) -> ResolvedPolicy {
        let mut allow = Vec::new();
        let mut unresolved = Vec::new();
        for target in &self.allow {
            match target {
                Target::Net(net) => allow.push(*net),
                // A wildcard names no address; the proxy matches it.
                Target::Host(host) if host.starts_with("*.") => {}
                Target::Host(host) => {
                    let addrs = lookup(host);
                    if addrs.is_empty() {
                        unresolved.push(host.clone());
                    }
                    allow.extend(addrs.into_iter().map(Ipv4Net::from));
                }
            }
        }
        let dns: Vec<Ipv4Net> = match self.has_hosts() {
            true => self.dns_servers.iter().copied().map(Ipv4Net::from).collect(),
            false => Vec::new(),
        };
        let deny_all = !self.internet_access();
        let deny = if deny_all { Vec::new() } else { Ipv4Net::aggregate(&self.deny) };
        ResolvedPolicy {
            allow: Ipv4Net::aggregate(&allow),
            dns: Ipv4Net::aggregate(&dns),
            deny,
            deny_all,
            unresolved,
            proxied: self.proxied(),
            tunnelled: self.upstream.is_some(),
        }
    }
}

/// A policy with addresses only: what the backends render.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedPolicy {
    /// Non-overlapping networks (aggregated), admitted before any deny.
    pub allow: Vec<Ipv4Net>,
    /// DNS servers, admitted before any deny on [`DNS_PORT`] only.
    #[serde(default)]
    pub dns: Vec<Ipv4Net>,
    /// Non-overlapping networks; empty when `deny_all`.
    pub deny: Vec<Ipv4Net>,
    /// Everything not in `allow` is blocked.
    pub deny_all: bool,
    /// Host names that resolved to no IPv4 address.
    #[serde(default)]
    pub unresolved: Vec<String>,
    /// TCP to ports 80 and 443 goes to the egress proxy (the policy names
    /// hosts).
    #[serde(default)]
    pub proxied: bool,
    /// All TCP goes to the egress proxy, which tunnels it through the
    /// policy's upstream.
    #[serde(default)]
    pub tunnelled: bool,
}

impl ResolvedPolicy {
    pub fn open() -> Self {
        Self::default()
    }

    /// Whether TCP or UDP egress to `addr`, `port` passes this policy
    /// (before the rules every sandbox gets regardless).
    pub fn admits(&self, addr: Ipv4Addr, port: u16) -> bool {
        if self.allow.iter().any(|n| n.contains(&addr)) {
            return true;
        }
        if port == DNS_PORT && self.dns.iter().any(|n| n.contains(&addr)) {
            return true;
        }
        !(self.deny_all || self.deny.iter().any(|n| n.contains(&addr)))
    }

    /// Whether some destination `previous` admitted is refused now, so flows
    /// opened under `previous` must be cut.
    pub fn tightens(&self, previous: &ResolvedPolicy) -> bool {
        if self.deny_all && !previous.deny_all {
            return true;
        }
        // A new deny range, or a lost allow range, can only narrow.
        let new_deny = self.deny.iter().any(|d| !previous.deny.iter().any(|p| p.contains(d)));
        let lost = |now: &[Ipv4Net], then: &[Ipv4Net]| then.iter().any(|p| !now.iter().any(|a| a.contains(p)));
        let lost_allow = lost(&self.allow, &previous.allow) || lost(&self.dns, &previous.dns);
        (new_deny && !previous.deny_all) || ((self.deny_all || !self.deny.is_empty()) && lost_allow)
    }
}

/// `Ok(None)` for IPv6 entries, which sandboxes cannot use anyway.
pub(crate) fn parse_target(entry: &str) -> Result<Option<Target>, PolicyError> {
    let entry = entry.trim();
    if let Ok(net) = entry.parse::<IpNet>() {
        return Ok(match net {
            IpNet::V4(net) => Some(Target::Net(net.trunc())),
            IpNet::V6(_) => None,
        });
    }
    if let Ok(addr) = entry.parse::<IpAddr>() {
        return Ok(match addr {
            IpAddr::V4(addr) => Some(Target::Net(Ipv4Net::from(addr))),
            IpAddr::V6(_) => None,
        });
    }
    if let Some(rest) = entry.strip_prefix("*.")
        && is_host_name(rest)
    {
        return Ok(Some(Target::Host(format!("*.{}", rest.trim_end_matches('.').to_ascii_lowercase()))));
    }
    if is_host_name(entry) {
        return Ok(Some(Target::Host(entry.trim_end_matches('.').to_ascii_lowercase())));
    }
    Err(PolicyError::InvalidTarget("", entry.to_string()))
}

impl PolicyError {
    fn in_list(self, list: &'static str) -> Self {
        match self {
            PolicyError::InvalidTarget(_, entry) => PolicyError::InvalidTarget(list, entry),
            other => other,
        }
    }
}

/// `pattern` is a lowercase name or `*.suffix`, which matches names under
/// `suffix` at any depth but not `suffix` itself.
pub(crate) fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => name.strip_suffix(suffix).is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        None => pattern == name,
    }
}

pub(crate) fn is_host_name(s: &str) -> bool {
    let s = s.trim_end_matches('.');
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        })
        // All-numeric names are malformed addresses, not hosts.
        && !s.split('.').all(|l| l.chars().all(|c| c.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn no_rules_admit_everything() {
        let p = Policy::from_e2b(None, &[], &[], None).unwrap().resolve(|_| vec![]);
        assert!(p.admits(ip("198.51.100.10"), 443));
        assert!(!p.deny_all);
    }

    #[test]
    fn no_internet_access_blocks_everything_but_the_allow_list() {
        let policy = Policy::from_e2b(Some(false), &strings(&["203.0.113.7"]), &[], None).unwrap();
        assert!(!policy.internet_access());
        let p = policy.resolve(|_| vec![]);
        assert!(p.deny_all);
        assert!(p.admits(ip("203.0.113.7"), 443));
        assert!(!p.admits(ip("203.0.113.8"), 443));
    }

    #[test]
    fn allow_wins_over_deny() {
        let policy =
            Policy::from_e2b(None, &strings(&["198.51.100.10/32"]), &strings(&["198.51.100.0/24"]), None).unwrap();
        let p = policy.resolve(|_| vec![]);
        assert!(p.admits(ip("198.51.100.10"), 443));
        assert!(!p.admits(ip("198.51.100.11"), 443));
        assert!(p.admits(ip("192.0.2.1"), 443));
    }

    #[test]
    fn host_names_resolve_and_bring_their_dns_servers() {
        let policy = Policy::from_e2b(Some(false), &strings(&["Example.com."]), &[], None).unwrap();
        assert_eq!(policy.allow, vec![Target::Host("example.com".into())]);
        let p = policy.resolve(|h| if h == "example.com" { vec![ip("93.184.216.34")] } else { vec![] });
        assert!(p.admits(ip("93.184.216.34"), 443));
        assert!(p.admits(DEFAULT_DNS, 53), "the DNS server on port 53");
        assert!(!p.admits(DEFAULT_DNS, 443), "a DNS server is reachable on port 53 only");
        assert!(!p.admits(ip("1.1.1.1"), 53));

        let no_dns = Policy::from_e2b(Some(false), &strings(&["nowhere.test"]), &[], Some(&[])).unwrap();
        let p = no_dns.resolve(|_| vec![]);
        assert_eq!(p.unresolved, vec!["nowhere.test".to_string()]);
        assert!(p.allow.is_empty());
    }

    #[test]
    fn bad_entries_are_refused_with_the_offending_text() {
        assert_eq!(
            Policy::from_e2b(None, &strings(&["10.0.0.0/33"]), &[], None),
            Err(PolicyError::InvalidTarget("allow_out", "10.0.0.0/33".into()))
        );
        assert!(matches!(Policy::from_e2b(None, &strings(&["*.a b"]), &[], None), Err(PolicyError::InvalidTarget(..))));
        assert!(matches!(Policy::from_e2b(None, &strings(&["a.*.b"]), &[], None), Err(PolicyError::InvalidTarget(..))));
        assert!(matches!(Policy::from_e2b(None, &strings(&["a b"]), &[], None), Err(PolicyError::InvalidTarget(..))));
        assert!(matches!(
            Policy::from_e2b(None, &[], &[], Some(&strings(&["x"]))),
            Err(PolicyError::InvalidDnsServer(_))
        ));
        let eleven: Vec<String> = (1..=11).map(|i| format!("192.0.2.{i}")).collect();
        assert_eq!(Policy::from_e2b(None, &[], &[], Some(&eleven)), Err(PolicyError::TooManyDnsServers(11)));
    }

    #[test]
    fn names_are_matched_by_name_with_allow_winning_and_wildcards_below_the_apex() {
        let policy = Policy::from_e2b(
            Some(false),
            &strings(&["api.example.com", "*.Allowed.test", "198.51.100.10"]),
            &strings(&["*.example.com", "evil.test"]),
            None,
        )
        .unwrap();
        assert!(policy.proxied());
        assert_eq!(policy.name_verdict("API.example.com."), Some(true), "allow wins over the deny wildcard");
        assert_eq!(policy.name_verdict("www.example.com"), Some(false));
        assert_eq!(policy.name_verdict("a.b.allowed.test"), Some(true));
        assert_eq!(policy.name_verdict("allowed.test"), None, "a wildcard does not match its apex");
        assert_eq!(policy.name_verdict("xallowed.test"), None);
        assert_eq!(policy.name_verdict("evil.test"), Some(false));
        assert_eq!(policy.name_verdict("other.test"), None);
        // Names do not widen the address part, and wildcards resolve to nothing.
        let addresses = policy.addresses_only();
        assert!(addresses.admits(ip("198.51.100.10"), 443));
        assert!(!addresses.admits(ip("93.184.216.34"), 443));
        let resolved = policy.resolve(|h| {
            assert!(!h.starts_with('*'), "wildcards are never resolved");
            vec![ip("93.184.216.34")]
        });
        assert!(resolved.proxied && resolved.unresolved.is_empty());
        assert!(resolved.admits(ip("93.184.216.34"), 22), "exact allowed names still open other ports by address");
        assert!(!Policy::from_e2b(None, &[], &strings(&["10.0.0.0/8"]), None).unwrap().proxied());
        assert!(Policy::from_e2b(None, &[], &strings(&["evil.test"]), None).unwrap().proxied());
    }

    #[test]
    fn an_empty_create_body_asks_for_the_open_policy() {
        // Pooled sandboxes boot open; anything else costs a ruleset change
        // at hand-out.
        assert_eq!(Policy::from_e2b(None, &[], &[], None).unwrap(), Policy::open());
        assert_eq!(Policy::from_e2b(Some(true), &[], &[], None).unwrap(), Policy::open());
    }

    #[test]
    fn ipv6_entries_are_accepted_and_inert() {
        let policy = Policy::from_e2b(None, &strings(&["2001:db8::/32"]), &strings(&["::1"]), None).unwrap();
        assert_eq!(policy, Policy::open());
    }

    #[test]
    fn overlapping_ranges_are_merged_for_interval_sets() {
        let policy = Policy::from_e2b(None, &[], &strings(&["10.1.0.0/16", "10.1.2.3", "10.0.0.0/16"]), None).unwrap();
        assert_eq!(policy.resolve(|_| vec![]).deny, vec!["10.0.0.0/15".parse::<Ipv4Net>().unwrap()]);
    }

    #[test]
    fn tightening_is_detected_and_widening_is_not() {
        let open = ResolvedPolicy::open();
        let closed = ResolvedPolicy { deny_all: true, ..ResolvedPolicy::default() };
        let deny_one = ResolvedPolicy { deny: vec!["198.51.100.0/24".parse().unwrap()], ..ResolvedPolicy::default() };
        assert!(closed.tightens(&open));
        assert!(deny_one.tightens(&open));
        assert!(!open.tightens(&closed));
        assert!(!open.tightens(&deny_one));
        let allow_a =
            ResolvedPolicy { allow: vec!["192.0.2.1/32".parse().unwrap()], deny_all: true, ..Default::default() };
        let allow_none = ResolvedPolicy { deny_all: true, ..Default::default() };
        assert!(allow_none.tightens(&allow_a));
        assert!(!allow_a.tightens(&allow_none));
        let dns_a =
            ResolvedPolicy { dns: vec!["192.0.2.53/32".parse().unwrap()], deny_all: true, ..Default::default() };
        assert!(allow_none.tightens(&dns_a), "losing a DNS server narrows");
        assert!(!dns_a.tightens(&allow_none));
    }
}
