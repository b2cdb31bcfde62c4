//! A sandbox's SOCKS5 upstream (E2B's `network.egress_proxy`), in the
//! policy model: where the host's egress proxy tunnels every TCP
//! connection of that sandbox, after the sandbox's own filtering.
//!
//! The host dials the upstream, never the sandbox, so an upstream address
//! is held to what the sandbox could reach itself: an IP literal in a range
//! no sandbox reaches (loopback, the sandbox subnet, the host's protected
//! neighbourhood the operator has not opened) is refused when the policy
//! is made ([`Upstream::check_reachable`]), and every dial carries the
//! proxy's fwmark, so nftables refuses the same ranges and the host's own
//! addresses for names that resolve there.
//!
//! The password is a credential: it is kept with the policy (so in the
//! gateway's store, beside the sandbox's other secrets, such as its envd
//! token), sent only to the upstream, and never shown: `Debug` redacts it
//! and nothing serialises it for a reader.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

use crate::neighbourhood::always_blocked;
use crate::net::NetConfig;

/// RFC 1929's bound on a username and a password, in bytes.
pub const MAX_CREDENTIAL: usize = 255;

/// A DNS name (253) plus `:65535`.
pub const MAX_ADDRESS: usize = 253 + 6;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UpstreamError {
    #[error("egress_proxy address '{0}': expected host:port with a host name or IPv4 address and a port 1-65535")]
    Address(String),
    #[error("egress_proxy {0} must be 1-{MAX_CREDENTIAL} bytes without control characters")]
    Credential(&'static str),
    #[error("egress_proxy password is only valid together with a username")]
    PasswordWithoutUser,
    #[error("egress_proxy username needs a password (RFC 1929 has no empty password)")]
    UserWithoutPassword,
    #[error(
        "egress_proxy address {0} is in a range sandboxes may not reach (loopback, the sandbox network or the host's protected neighbourhood)"
    )]
    Unreachable(Ipv4Addr),
}

/// Where to tunnel, and how to authenticate (RFC 1929) if at all.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Upstream {
    pub host: String,
    pub port: u16,
    pub credentials: Option<Credentials>,
}

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let user = self.credentials.as_ref().map(|c| c.username.as_str());
        f.debug_struct("Upstream")
            .field("address", &self.address())
            .field("username", &user)
            .field("password", &self.credentials.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials").field("username", &self.username).field("password", &"<redacted>").finish()
    }
}

impl Upstream {
    /// E2B's `egress_proxy` fields, validated.
    pub fn from_e2b(address: &str, username: Option<&str>, password: Option<&str>) -> Result<Self, UpstreamError> {
        let bad = || UpstreamError::Address(address.chars().take(MAX_ADDRESS).collect());
        if address.len() > MAX_ADDRESS || address.chars().any(char::is_control) {
            return Err(bad());
        }
        let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
        let port: u16 = port.parse().ok().filter(|p| *p != 0).ok_or_else(bad)?;
        let host = match host.parse::<IpAddr>() {
            Ok(IpAddr::V4(ip)) => ip.to_string(),
            Ok(IpAddr::V6(_)) => return Err(bad()),
            Err(_) if crate::policy::is_host_name(host) => host.trim_end_matches('.').to_ascii_lowercase(),
            Err(_) => return Err(bad()),
        };
        let credentials = match (username, password) {
            (None, None) => None,
            (None, Some(_)) => return Err(UpstreamError::PasswordWithoutUser),
            (Some(_), None) => return Err(UpstreamError::UserWithoutPassword),
            (Some(username), Some(password)) => {
                check_credential("username", username)?;
                check_credential("password", password)?;
                Some(Credentials { username: username.to_string(), password: password.to_string() })
            }
        };
        Ok(Self { host, port, credentials })
    }

    /// `host:port`, as E2B reports it.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    pub fn username(&self) -> Option<&str> {
        self.credentials.as_ref().map(|c| c.username.as_str())
    }

    /// Refuses an IP literal no sandbox on `cfg` may reach. Names are
    /// checked when dialled (the fwmark; see the module header).
    pub fn check_reachable(&self, cfg: &NetConfig) -> Result<(), UpstreamError> {
        match self.host.parse::<Ipv4Addr>() {
            Ok(ip) if destination_blocked(cfg, ip) => Err(UpstreamError::Unreachable(ip)),
            _ => Ok(()),
        }
    }
}

/// Whether `ip` is in a range no sandbox on `cfg` reaches whatever its
/// policy says: the always-blocked ranges and what the operator has not
/// opened of the host's neighbourhood. The host's own addresses on other
/// interfaces are not known here; the executor checks those.
pub fn destination_blocked(cfg: &NetConfig, ip: Ipv4Addr) -> bool {
    always_blocked(cfg.subnet).iter().chain(cfg.neighbourhood.blocked().iter()).any(|n| n.contains(&ip))
}

fn check_credential(what: &'static str, value: &str) -> Result<(), UpstreamError> {
    if value.is_empty() || value.len() > MAX_CREDENTIAL || value.chars().any(char::is_control) {
        return Err(UpstreamError::Credential(what));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_host_port() {
        let up = Upstream::from_e2b("Proxy.Example.com:1080", Some("u"), Some("p")).unwrap();
        assert_eq!(up.address(), "proxy.example.com:1080");
        assert_eq!(up.username(), Some("u"));
        assert_eq!(Upstream::from_e2b("192.0.2.1:1080", None, None).unwrap().address(), "192.0.2.1:1080");
        for bad in ["proxy", "proxy:", "proxy:0", "proxy:65536", ":1080", "[::1]:1080", "a b:1", "x\n.y:1", "1.2.3:80"]
        {
            assert!(matches!(Upstream::from_e2b(bad, None, None), Err(UpstreamError::Address(_))), "{bad:?}");
        }
        let long = format!("{}:1", "a".repeat(300));
        assert!(Upstream::from_e2b(&long, None, None).is_err());
    }

    #[test]
    fn credentials_follow_rfc_1929() {
        assert_eq!(Upstream::from_e2b("p:1", None, Some("x")), Err(UpstreamError::PasswordWithoutUser));
        assert_eq!(Upstream::from_e2b("p:1", Some("u"), None), Err(UpstreamError::UserWithoutPassword));
        assert_eq!(Upstream::from_e2b("p:1", Some(""), Some("x")), Err(UpstreamError::Credential("username")));
        let long = "x".repeat(256);
        assert_eq!(Upstream::from_e2b("p:1", Some("u"), Some(&long)), Err(UpstreamError::Credential("password")));
        assert_eq!(Upstream::from_e2b("p:1", Some("u"), Some("a\0b")), Err(UpstreamError::Credential("password")));
    }

    #[test]
    fn debug_never_shows_the_password() {
        let up = Upstream::from_e2b("p:1", Some("user"), Some("hunter2-secret")).unwrap();
        let shown = format!("{up:?} {:?}", up.credentials);
        assert!(shown.contains("user") && !shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn literals_sandboxes_cannot_reach_are_refused() {
        let cfg = NetConfig::new("t", "10.9.0.0/16").unwrap();
        for blocked in ["127.0.0.1", "10.9.0.1", "169.254.169.254", "192.168.1.1", "224.0.0.1"] {
            let up = Upstream::from_e2b(&format!("{blocked}:1080"), None, None).unwrap();
            assert!(up.check_reachable(&cfg).is_err(), "{blocked}");
        }
        assert!(Upstream::from_e2b("192.0.2.10:1080", None, None).unwrap().check_reachable(&cfg).is_ok());
        assert!(Upstream::from_e2b("proxy.test:1080", None, None).unwrap().check_reachable(&cfg).is_ok());
    }
}
