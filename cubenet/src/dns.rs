//! Host names of a policy resolved with the host's resolver, when the
//! policy is applied (both backends).

use std::net::{IpAddr, ToSocketAddrs};

use crate::policy::{Policy, ResolvedPolicy};

/// The policy with its host names resolved now; names without an IPv4
/// address admit nothing and are logged.
pub fn resolve(policy: &Policy) -> ResolvedPolicy {
    let resolved = policy.resolve(|host| {
        (host, 0)
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
    });
    if !resolved.unresolved.is_empty() {
        tracing::warn!(hosts = ?resolved.unresolved, "allowed host names resolved to no IPv4 address");
    }
    resolved
}
