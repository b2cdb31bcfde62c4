//! The host's egress proxy, platform-neutral part: what a sandbox's web
//! connection asks for ([`sniff`]), whether its policy admits it
//! ([`decide`]), and where it was going (`original_destination`, the one
//! platform-specific lookup). The executor that accepts the redirected
//! connections and splices them is [`proxy::EgressProxy`] (Linux and
//! FreeBSD; **not run on FreeBSD**), dialling a SOCKS5 upstream through
//! [`socks`], every host socket it opens for a sandbox made by
//! [`outbound`], which refuses what no sandbox may reach.
//!
//! A sandbox whose policy names hosts has its TCP to ports 80 and 443
//! redirected to the proxy (nftables or pf, per sandbox). The proxy peeks the
//! HTTP `Host` or the TLS SNI, and connects to the address the sandbox
//! itself connected to (the original destination), never to one it
//! resolved for the name: a name only ever decides whether a connection
//! passes, not where it goes. TLS is spliced untouched, except to a host
//! the sandbox has `network.rules` for: that is terminated with a leaf of
//! the copse egress CA ([`ca`]) and re-originated ([`intercept`]). HTTP to
//! such a host, plain or intercepted, is served request by request
//! ([`http`]), so each request on a kept-alive connection gets the rule.

pub mod ca;
pub mod http;
pub mod intercept;
#[cfg(any(target_os = "linux", target_os = "freebsd"))]
mod origin;
#[cfg(any(target_os = "linux", target_os = "freebsd"))]
pub mod outbound;
#[cfg(any(target_os = "linux", target_os = "freebsd"))]
pub mod proxy;
pub mod rules;
pub mod sniff;
#[cfg(any(target_os = "linux", target_os = "freebsd"))]
pub mod socks;

#[cfg(any(target_os = "linux", target_os = "freebsd"))]
pub use origin::original_destination;

use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;

use crate::policy::Policy;

/// The policy of the sandbox at an address, if one is attached there: how
/// the proxy and the resolver learn who is asking.
pub type Policies = Arc<dyn Fn(Ipv4Addr) -> Option<Policy> + Send + Sync>;

/// Web ports whose connections are matched by name.
pub const PORTS: [u16; 2] = [80, 443];

/// How many bytes the proxy reads at most before deciding; a ClientHello
/// or request head longer than this names nothing.
pub const MAX_PEEK: usize = 16 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Splice,
    Refuse(&'static str),
}

/// Whether `policy` admits a connection to `dst` that asked for `name`.
///
/// - A name an allow entry matches passes, but only to an address that name
///   resolves to (`lookup`, the host's view) or that the policy admits by
///   address: otherwise "Host: allowed.example" would carry anything to any
///   address.
/// - A name a deny entry matches is refused, even to an admitted address.
/// - Otherwise (no entry matches, or no name) the policy's plain-address
///   entries decide; addresses that allowed names resolve to do not admit
///   other names.
pub fn decide(
    policy: &Policy,
    name: Option<&str>,
    dst: SocketAddrV4,
    lookup: impl FnOnce(&str) -> Vec<Ipv4Addr>,
) -> Verdict {
    let by_address = policy.addresses_only().admits(*dst.ip(), dst.port());
    match name.map(|n| (n, policy.name_verdict(n))) {
        Some((_, Some(false))) => Verdict::Refuse("denied by name"),
        Some((name, Some(true))) => {
            if by_address || lookup(name).contains(dst.ip()) {
                Verdict::Splice
            } else {
                Verdict::Refuse("allowed name sent to an address it does not resolve to")
            }
        }
        _ if by_address => Verdict::Splice,
        _ => Verdict::Refuse("denied by address"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn dst(s: &str) -> SocketAddrV4 {
        SocketAddrV4::new(s.parse().unwrap(), 443)
    }

    fn lookup(name: &str) -> Vec<Ipv4Addr> {
        match name {
            "allowed.test" | "denied.test" => vec!["198.51.100.10".parse().unwrap()],
            _ => vec![],
        }
    }

    #[test]
    fn names_decide_by_name_and_addresses_decide_the_rest() {
        let policy = Policy::from_e2b(
            Some(false),
            &strings(&["allowed.test", "198.51.100.20"]),
            &strings(&["denied.test"]),
            None,
        )
        .unwrap();
        let d = |name: Option<&str>, to: &str| decide(&policy, name, dst(to), lookup);
        assert_eq!(d(Some("allowed.test"), "198.51.100.10"), Verdict::Splice);
        assert_eq!(d(Some("allowed.test"), "198.51.100.20"), Verdict::Splice, "an admitted address");
        assert!(matches!(d(Some("allowed.test"), "203.0.113.9"), Verdict::Refuse(_)), "a forged Host/SNI");
        assert!(matches!(d(Some("denied.test"), "198.51.100.20"), Verdict::Refuse(_)), "denied by name");
        assert!(
            matches!(d(Some("other.test"), "198.51.100.10"), Verdict::Refuse(_)),
            "the allowed name's address does not admit another name"
        );
        assert_eq!(d(Some("other.test"), "198.51.100.20"), Verdict::Splice);
        assert_eq!(d(None, "198.51.100.20"), Verdict::Splice);
        assert!(matches!(d(None, "198.51.100.10"), Verdict::Refuse(_)));
    }

    #[test]
    fn a_denied_name_is_refused_under_an_open_policy() {
        let policy = Policy::from_e2b(None, &[], &strings(&["*.denied.test"]), None).unwrap();
        assert!(matches!(decide(&policy, Some("a.denied.test"), dst("198.51.100.10"), lookup), Verdict::Refuse(_)));
        assert_eq!(decide(&policy, Some("denied.test"), dst("198.51.100.10"), lookup), Verdict::Splice);
        assert_eq!(decide(&policy, None, dst("198.51.100.10"), lookup), Verdict::Splice);
    }
}
