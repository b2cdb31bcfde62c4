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
//!
//! With E2B's `tls`, the hop to the upstream is TLS (1.2 or newer), the
//! SOCKS5 handshake and the tunnelled bytes inside it, and the upstream's
//! certificate is always verified: against `ca_cert` alone when given
//! (it replaces the system trust store, as E2B documents), else against
//! the host's trust store. There is no plaintext fallback. The CA
//! certificate is public and kept with the policy, but, as E2B does,
//! never reported back.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};
use tokio_rustls::rustls::RootCertStore;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

use crate::neighbourhood::always_blocked;
use crate::net::NetConfig;

/// RFC 1929's bound on a username and a password, in bytes.
pub const MAX_CREDENTIAL: usize = 255;

/// A DNS name (253) plus `:65535`.
pub const MAX_ADDRESS: usize = 253 + 6;

/// E2B's bound on `tls.ca_cert`, in bytes of PEM.
pub const MAX_CA_CERT: usize = 8192;

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
    #[error("egress_proxy.tls.server_name must be a DNS name of at most 253 characters")]
    TlsServerName,
    #[error("egress_proxy.tls takes server_name and ca_cert only when enabled")]
    TlsDisabled,
    #[error("egress_proxy.tls.ca_cert must be 1-{MAX_CA_CERT} bytes of PEM CA certificates: {0}")]
    TlsCaCert(&'static str),
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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<UpstreamTls>,
}

/// TLS to the upstream. Both fields validated by [`Upstream::with_tls`].
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpstreamTls {
    /// Verified against and sent as SNI; `None`: the host of the address.
    pub server_name: Option<String>,
    /// PEM; the only trust anchors when set.
    pub ca_cert: Option<String>,
}

impl fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("server_name", &self.server_name)
            .field("ca_cert", &self.ca_cert.as_ref().map(|pem| format!("<{} bytes of PEM>", pem.len())))
            .finish()
    }
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
            .field("tls", &self.tls)
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
        Ok(Self { host, port, credentials, tls: None })
    }

    /// E2B's `tls` fields, validated: the upstream is then dialled over TLS.
    pub fn with_tls(mut self, server_name: Option<&str>, ca_cert: Option<&str>) -> Result<Self, UpstreamError> {
        let server_name = match server_name {
            Some(name) if name.len() <= 253 && crate::policy::is_host_name(name) => {
                Some(name.trim_end_matches('.').to_ascii_lowercase())
            }
            Some(_) => return Err(UpstreamError::TlsServerName),
            None => None,
        };
        let tls = UpstreamTls { server_name, ca_cert: ca_cert.map(str::to_string) };
        if ca_cert.is_some() {
            tls.trust_anchors()?;
        }
        self.tls = Some(tls);
        Ok(self)
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

impl UpstreamTls {
    /// The name the certificate must carry: `server_name`, else `host`
    /// (a name or an IPv4 literal, matched against the certificate's IP
    /// addresses).
    pub fn verified_name(&self, host: &str) -> Result<ServerName<'static>, UpstreamError> {
        let name = self.server_name.as_deref().unwrap_or(host);
        ServerName::try_from(name.to_string()).map_err(|_| UpstreamError::TlsServerName)
    }

    /// `ca_cert` as a trust store; `None` when the system's is meant.
    pub fn trust_anchors(&self) -> Result<Option<RootCertStore>, UpstreamError> {
        let Some(pem) = &self.ca_cert else { return Ok(None) };
        if pem.is_empty() || pem.len() > MAX_CA_CERT {
            return Err(UpstreamError::TlsCaCert("too long or empty"));
        }
        let mut store = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            let cert = cert.map_err(|_| UpstreamError::TlsCaCert("not PEM"))?;
            store.add(cert).map_err(|_| UpstreamError::TlsCaCert("a certificate does not parse"))?;
        }
        if store.is_empty() {
            return Err(UpstreamError::TlsCaCert("no CERTIFICATE block"));
        }
        Ok(Some(store))
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

    /// A self-signed CA made with `openssl req -x509` (P-256).
    const TEST_CA: &str = "-----BEGIN CERTIFICATE-----\nMIIBhzCCAS2gAwIBAgIUfGikaqIUjN4N6UWPrAo1KKZBnpMwCgYIKoZIzj0EAwIw\nGDEWMBQGA1UEAwwNY29wc2UgdGVzdCBDQTAgFw0yNjExMjcwOTMzNTRaGA8yMTI2\nMTEwMzA5MzM1NFowGDEWMBQGA1UEAwwNY29wc2UgdGVzdCBDQTBZMBMGByqGSM49\nAgEGCCqGSM49AwEHA0IABLBOz2mIygCOjQRmxZoLYcxdvmRjl14VOyPT0sGmYdS2\nAeMEQO+sLa2aYXQasOeqY4LHZx8uNBmBRYANq6qEoV6jUzBRMB0GA1UdDgQWBBSk\n1RBJTqXlmSnKfeMeagKP4QKiCTAfBgNVHSMEGDAWgBSk1RBJTqXlmSnKfeMeagKP\n4QKiCTAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0gAMEUCIC0mN88jhDTX\neYCYEsjp7O+Cb2DflFZard4LbW8CcMhLAiEA2UnNLzTUQDWIdiNhs3tWjkfQxMGJ\nWC33pftt2B2sYLE=\n-----END CERTIFICATE-----";

    #[test]
    fn tls_names_and_ca_certificates_are_checked() {
        let up = || Upstream::from_e2b("10.0.0.1:1080", None, None).unwrap();
        let tls = up().with_tls(Some("Proxy.Test."), Some(TEST_CA)).unwrap().tls.unwrap();
        assert_eq!(tls.server_name.as_deref(), Some("proxy.test"));
        assert_eq!(tls.trust_anchors().unwrap().unwrap().len(), 1);
        assert!(format!("{tls:?}").contains("bytes of PEM") && !format!("{tls:?}").contains("MIIB"));
        let two = format!("{TEST_CA}\n{TEST_CA}");
        assert_eq!(up().with_tls(None, Some(&two)).unwrap().tls.unwrap().trust_anchors().unwrap().unwrap().len(), 2);
        for bad in ["", "a b", "-x.test", "1.2.3.4", &"a".repeat(254), "x\n.test"] {
            assert_eq!(up().with_tls(Some(bad), None), Err(UpstreamError::TlsServerName), "{bad:?}");
        }
        let garbage_b64 = "-----BEGIN CERTIFICATE-----\nAAAAAAAA\n-----END CERTIFICATE-----\n";
        let huge = TEST_CA.repeat(MAX_CA_CERT / TEST_CA.len() + 1);
        for bad in
            ["", "not pem at all", garbage_b64, "-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----\n", &huge]
        {
            assert!(matches!(up().with_tls(None, Some(bad)), Err(UpstreamError::TlsCaCert(_))), "{bad:?}");
        }
    }

    #[test]
    fn tls_verifies_the_address_host_unless_named() {
        let tls = |address: &str, name: Option<&str>| {
            let up = Upstream::from_e2b(address, None, None).unwrap().with_tls(name, None).unwrap();
            format!("{:?}", up.tls.as_ref().unwrap().verified_name(&up.host).unwrap())
        };
        assert!(tls("proxy.test:1080", None).contains("proxy.test"));
        assert!(tls("192.0.2.1:1080", None).contains("IpAddress"));
        assert!(tls("192.0.2.1:1080", Some("proxy.test")).contains("proxy.test"));
    }
}
