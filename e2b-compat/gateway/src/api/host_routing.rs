//! Routing by host name, as E2B's edge does it: `{port}-{sandboxID}.{domain}`
//! names one port of one sandbox. This is what `sandbox.get_host(port)`
//! returns, and the only way the SDK reaches a sandbox once no
//! `E2B_SANDBOX_URL` is set (domain mode).

use axum::extract::Request;
use axum::http::header;

/// How the gateway names sandbox ports to the outside.
#[derive(Debug, Clone, Default)]
pub struct Exposure {
    /// Reported as each sandbox's `domain`, so the SDK builds its host
    /// names from it. Without one, the SDK falls back to its own
    /// (`E2B_DOMAIN`), and any domain suffix is accepted here.
    pub domain: Option<String>,
}

/// One port of one sandbox, as named by a request's host.
#[derive(Debug, PartialEq, Eq)]
pub struct SandboxAddress {
    pub port: u16,
    pub sandbox_id: String,
}

impl Exposure {
    /// The sandbox port a request is addressed to by its host name, if any.
    /// Other hosts (`api.{domain}`, an IP address) belong to the control
    /// plane.
    pub fn sandbox_address(&self, request: &Request) -> Option<SandboxAddress> {
        // HTTP/2 carries the host in the URI's authority, HTTP/1.1 in `Host`.
        let host = match request.headers().get(header::HOST) {
            Some(value) => value.to_str().ok()?,
            None => request.uri().authority()?.as_str(),
        };
        parse(host, self.domain.as_deref())
    }
}

fn parse(host: &str, domain: Option<&str>) -> Option<SandboxAddress> {
    let (label, rest) = host.split_once('.')?;
    let (port, sandbox_id) = label.split_once('-')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port = port.parse().ok()?;
    if sandbox_id.is_empty() || !sandbox_id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return None;
    }
    let suffix_matches = match domain {
        // The domain may carry a port (`localhost:3000`) or not, and the
        // client may add the listener's port to the host or not.
        Some(domain) => rest.eq_ignore_ascii_case(domain) || without_port(rest).eq_ignore_ascii_case(domain),
        None => !without_port(rest).is_empty(),
    };
    suffix_matches.then(|| SandboxAddress { port, sandbox_id: sandbox_id.to_ascii_lowercase() })
}

fn without_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((name, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn address(port: u16, id: &str) -> Option<SandboxAddress> {
        Some(SandboxAddress { port, sandbox_id: id.into() })
    }

    #[test]
    fn sandbox_hosts_name_a_port_and_a_sandbox() {
        let domain = Some("copse.test");
        assert_eq!(parse("49983-abc123.copse.test", domain), address(49983, "abc123"));
        assert_eq!(parse("8000-ABC123.Copse.Test", domain), address(8000, "abc123"));
        assert_eq!(parse("8000-abc123.copse.test:443", domain), address(8000, "abc123"));
        assert_eq!(parse("8000-abc123.localhost:3000", Some("localhost:3000")), address(8000, "abc123"));
    }

    #[test]
    fn other_hosts_belong_to_the_control_plane() {
        let domain = Some("copse.test");
        assert_eq!(parse("api.copse.test", domain), None);
        assert_eq!(parse("copse.test", domain), None);
        assert_eq!(parse("8000-abc123.other.test", domain), None);
        assert_eq!(parse("8000-abc123.copse.test.evil", domain), None);
        assert_eq!(parse("70000-abc123.copse.test", domain), None);
        assert_eq!(parse("-abc123.copse.test", domain), None);
        assert_eq!(parse("8000-.copse.test", domain), None);
        assert_eq!(parse("8000-a_b.copse.test", domain), None);
        assert_eq!(parse("127.0.0.1:3000", None), None);
        assert_eq!(parse("[::1]:3000", None), None);
        assert_eq!(parse("localhost", None), None);
    }

    #[test]
    fn without_a_domain_any_suffix_is_accepted() {
        assert_eq!(parse("8000-abc123.localhost:3000", None), address(8000, "abc123"));
        assert_eq!(parse("8000-abc123.e2b.app", None), address(8000, "abc123"));
        assert_eq!(parse("8000-abc123.", None), None);
        assert_eq!(parse("8000-abc123.:3000", None), None);
    }
}
