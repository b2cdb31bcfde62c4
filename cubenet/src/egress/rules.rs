//! Per-host request transforms (E2B's `network.rules`): which rules apply
//! to a connection the egress proxy admitted, and the headers they set on
//! each request on it, with `${e2b.secrets.<name>}` placeholders resolved
//! there and nowhere else.
//!
//! A connection a rule matches is served as HTTP/1.1, request by request
//! ([`super::http`]): on port 80 directly, and TLS to a host with rules once
//! terminated ([`super::intercept`]). Every request on it, kept-alive ones
//! included, must be [`addressed`] to the name the connection was admitted
//! for, and gets the rule's headers ([`apply`]).

use std::net::Ipv4Addr;
use std::sync::Arc;

use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Uri};
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::policy::{Target, name_matches, parse_target};

/// Bounds on what a caller may register, so one sandbox's rules cannot
/// make every request head the proxy builds arbitrarily large.
pub const MAX_HOSTS: usize = 64;
pub const MAX_RULES_PER_HOST: usize = 16;
pub const MAX_HEADERS_PER_RULE: usize = 32;
pub const MAX_HEADER_NAME: usize = 256;
pub const MAX_HEADER_VALUE: usize = 8 * 1024;

const SECRET_PREFIX: &str = "e2b.secrets.";
const IDENTITY_PREFIX: &str = "e2b.identity.";

/// A secret's current value by its owner and name (the owner is whatever
/// [`HeaderRules::owner`] says: the gateway's team). Lives in the process
/// that holds the secrets; cubenet only calls it.
pub type SecretResolver = Arc<dyn Fn(&str, &str) -> Option<String> + Send + Sync>;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RuleError {
    #[error("network.rules: invalid host '{0}': expected a host name, *.<host name>, an IP address or a CIDR block")]
    InvalidHost(String),
    #[error("network.rules: host '{0}' is given twice (keys are compared in lower case)")]
    DuplicateHost(String),
    #[error(
        "network.rules: at most {MAX_HOSTS} hosts, {MAX_RULES_PER_HOST} rules per host and \
         {MAX_HEADERS_PER_RULE} headers per rule"
    )]
    TooMany,
    #[error(
        "network.rules['{0}']: invalid header name '{1}': expected an RFC 7230 token of at most {MAX_HEADER_NAME} bytes"
    )]
    InvalidHeaderName(String, String),
    #[error(
        "network.rules['{0}']: the value of header '{1}' must be at most {MAX_HEADER_VALUE} bytes without CR, LF or NUL"
    )]
    InvalidHeaderValue(String, String),
    #[error("network.rules['{0}']: workload identity is not supported (header '{1}' uses ${{e2b.identity...}})")]
    Identity(String, String),
    #[error("network.rules['{0}']: header '{1}' has an unknown placeholder; only ${{e2b.secrets.<name>}} is resolved")]
    UnknownPlaceholder(String, String),
}

/// A sandbox's rules, as asked for (placeholders unresolved).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeaderRules {
    /// Whose secrets the placeholders name.
    pub owner: String,
    pub hosts: Vec<HostRules>,
}

/// The ordered rules of one host key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRules {
    /// Lower-cased, as E2B normalizes keys.
    pub host: String,
    pub rules: Vec<Rule>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// `None`: a rule without a transform (E2B accepts one; it does nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<Vec<(String, String)>>,
}

/// What one header value is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part<'a> {
    Literal(&'a str),
    Secret(&'a str),
}

impl HeaderRules {
    /// Validates E2B's `rules` map (host → ordered rules).
    pub fn from_e2b(owner: &str, hosts: Vec<(String, Vec<Rule>)>) -> Result<Self, RuleError> {
        if hosts.len() > MAX_HOSTS {
            return Err(RuleError::TooMany);
        }
        let mut checked = Vec::with_capacity(hosts.len());
        for (host, rules) in hosts {
            let key = host.trim().trim_end_matches('.').to_ascii_lowercase();
            // An IPv6 key is accepted, as in allow_out, and never matches:
            // sandboxes have no IPv6.
            if key.is_empty() || key == "*" || parse_target(&key).is_err() {
                return Err(RuleError::InvalidHost(host));
            }
            if checked.iter().any(|h: &HostRules| h.host == key) {
                return Err(RuleError::DuplicateHost(host));
            }
            if rules.len() > MAX_RULES_PER_HOST {
                return Err(RuleError::TooMany);
            }
            for headers in rules.iter().filter_map(|r| r.headers.as_ref()) {
                if headers.len() > MAX_HEADERS_PER_RULE {
                    return Err(RuleError::TooMany);
                }
                for (name, value) in headers {
                    check_header(&key, name, value)?;
                }
            }
            checked.push(HostRules { host: key, rules });
        }
        Ok(Self { owner: owner.to_string(), hosts: checked })
    }

    /// Every secret a placeholder names, once each.
    pub fn secret_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .hosts
            .iter()
            .flat_map(|h| &h.rules)
            .filter_map(|r| r.headers.as_ref())
            .flatten()
            .flat_map(|(_, value)| parts(value).unwrap_or_default())
            .filter_map(|part| match part {
                Part::Secret(name) => Some(name),
                Part::Literal(_) => None,
            })
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    }

    /// The rules for a connection to `dst` that asked for `name`, if any.
    ///
    /// A name key applies only when the destination is an address the
    /// name resolves to (`lookup`, the host's view): the sandbox picks
    /// both the `Host` and the address, and the secret must not follow a
    /// rule host's name to an address of the sandbox's choosing. Exact
    /// names win over wildcards, longer wildcards over shorter ones, and
    /// address keys (the longest prefix) come last; rule sets never merge.
    pub fn matching(
        &self,
        name: Option<&str>,
        dst: Ipv4Addr,
        lookup: impl FnOnce(&str) -> Vec<Ipv4Addr>,
    ) -> Option<&HostRules> {
        let by_name = name.and_then(|name| {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            let exact = self.hosts.iter().find(|h| h.host == name);
            let wildcard = || {
                self.hosts
                    .iter()
                    .filter(|h| h.host.starts_with("*.") && name_matches(&h.host, &name))
                    .max_by_key(|h| h.host.len())
            };
            exact.or_else(wildcard).filter(|_| lookup(&name).contains(&dst))
        });
        by_name.or_else(|| {
            self.hosts
                .iter()
                .filter_map(|h| match parse_target(&h.host) {
                    Ok(Some(Target::Net(net))) if net.contains(&dst) => Some((net, h)),
                    _ => None,
                })
                .max_by_key(|(net, _): &(Ipv4Net, _)| net.prefix_len())
                .map(|(_, h)| h)
        })
    }
}

fn check_header(host: &str, name: &str, value: &str) -> Result<(), RuleError> {
    let invalid_name = || RuleError::InvalidHeaderName(host.to_string(), name.to_string());
    if name.is_empty() || name.len() > MAX_HEADER_NAME || !name.bytes().all(is_token_byte) {
        return Err(invalid_name());
    }
    // The proxy owns the framing and the connection's fate: a rule that
    // set these could smuggle a second request, steer the request to
    // another host, or hold the connection open against either side.
    let framing = ["host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te"];
    if framing.iter().any(|f| name.eq_ignore_ascii_case(f)) {
        return Err(invalid_name());
    }
    if value.len() > MAX_HEADER_VALUE || value.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
        return Err(RuleError::InvalidHeaderValue(host.to_string(), name.to_string()));
    }
    parts(value).map(|_| ()).map_err(|kind| match kind {
        PlaceholderError::Identity => RuleError::Identity(host.to_string(), name.to_string()),
        PlaceholderError::Unknown => RuleError::UnknownPlaceholder(host.to_string(), name.to_string()),
    })
}

/// RFC 7230 `tchar`.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[derive(Debug, PartialEq, Eq)]
enum PlaceholderError {
    Identity,
    Unknown,
}

/// Splits a header value into literals and secret placeholders. `${...}`
/// that does not start with `e2b.` is literal text; an unknown `e2b.`
/// placeholder is an error rather than text sent as it is.
fn parts(value: &str) -> Result<Vec<Part<'_>>, PlaceholderError> {
    let mut out = Vec::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        let Some(len) = rest[start + 2..].find('}') else { break };
        let inner = &rest[start + 2..start + 2 + len];
        let part = if let Some(name) = inner.strip_prefix(SECRET_PREFIX).filter(|n| !n.is_empty()) {
            Part::Secret(name)
        } else if inner.starts_with(IDENTITY_PREFIX) {
            return Err(PlaceholderError::Identity);
        } else if inner.starts_with("e2b.") {
            return Err(PlaceholderError::Unknown);
        } else {
            out.push(Part::Literal(&rest[..start + 3 + len]));
            rest = &rest[start + 3 + len..];
            continue;
        };
        if start > 0 {
            out.push(Part::Literal(&rest[..start]));
        }
        out.push(part);
        rest = &rest[start + 3 + len..];
    }
    if !rest.is_empty() {
        out.push(Part::Literal(rest));
    }
    Ok(out)
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TransformError {
    #[error("TLS without a server name to an address with rules (interception needs the name)")]
    NamelessTls,
    #[error("a rule's header value, its secrets resolved, is no valid header value")]
    BadRule,
    #[error("secret '{0}' is not available")]
    MissingSecret(String),
    #[error("secret '{0}' has a value a header cannot carry (CR, LF or NUL)")]
    UnsafeSecret(String),
}

/// What the proxy does with an admitted connection.
#[derive(Debug, PartialEq, Eq)]
pub enum Outbound<'a> {
    /// No rule applies: send these bytes, then splice the rest.
    Forward(Vec<u8>),
    /// Plain HTTP to a host with rules: serve it request by request
    /// ([`super::http`]), after replaying `hello` (the head peeked).
    Serve(Intercept<'a>),
    /// TLS to a host with rules: terminate it, then serve the HTTP inside
    /// ([`super::intercept`]).
    Intercept(Intercept<'a>),
}

/// A connection to a host with rules.
#[derive(Debug, PartialEq, Eq)]
pub struct Intercept<'a> {
    /// The name the connection was admitted for: the server name the client
    /// asked for (its leaf's), or the first request's `Host`. Every request
    /// on the connection must name it ([`addressed`]).
    pub name: Option<String>,
    pub owner: &'a str,
    pub rules: &'a HostRules,
    /// What was read of the ClientHello or the first request.
    pub hello: Vec<u8>,
}

/// What becomes of an admitted connection: the client's first bytes as
/// they were when no rule applies (see [`HeaderRules::matching`]), TLS to
/// intercept, or HTTP to serve with the rules.
pub fn prepare<'a>(
    rules: Option<&'a HeaderRules>,
    name: Option<&str>,
    dst: Ipv4Addr,
    head: Vec<u8>,
    lookup: impl FnOnce(&str) -> Vec<Ipv4Addr>,
) -> Result<Outbound<'a>, TransformError> {
    let Some((rules, host)) = rules.and_then(|r| r.matching(name, dst, lookup).map(|h| (r, h))) else {
        return Ok(Outbound::Forward(head));
    };
    let target = Intercept { name: name.map(canonical), owner: &rules.owner, rules: host, hello: head };
    if target.hello.first() == Some(&0x16) {
        if target.name.is_none() {
            return Err(TransformError::NamelessTls);
        }
        return Ok(Outbound::Intercept(target));
    }
    Ok(Outbound::Serve(target))
}

/// A host name as requests are compared by: no port, no trailing dot,
/// lower case.
fn canonical(name: &str) -> String {
    name.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// Why a request on a connection to a host with rules is not sent on.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Misdirected {
    #[error("a request needs at most one Host header, with a host name")]
    BadHost,
    #[error("the Host header names another host than the one this connection was admitted for")]
    OtherHost,
    #[error("the request target names another host than the one this connection was admitted for")]
    OtherTarget,
    #[error("CONNECT and protocol upgrades are not relayed to a host with rules")]
    Tunnel,
}

/// Whether a request on a connection admitted for `name` stays with that
/// name, and the origin-form target it goes out with.
///
/// The verdict and the rule were made for one name, and a server shared by
/// several (a CDN, a virtual host, a proxy) routes by `Host` or by an
/// absolute-form target, which takes precedence over `Host` (RFC 9112
/// 3.2.2): a request naming another host, in either, would carry the rule's
/// secret, or a denied name, past the verdict. An absolute-form target for
/// the name itself is sent on in origin form, so the upstream never sees
/// an authority the proxy did not check.
pub fn addressed(method: &Method, uri: &Uri, headers: &HeaderMap, name: Option<&str>) -> Result<Uri, Misdirected> {
    if method == Method::CONNECT || headers.contains_key(header::UPGRADE) {
        return Err(Misdirected::Tunnel);
    }
    let mut hosts = headers.get_all(header::HOST).iter();
    let host = match (hosts.next(), hosts.next()) {
        (None, _) => None,
        (Some(host), None) => {
            let host = host.to_str().map_err(|_| Misdirected::BadHost)?;
            match host_name(host) {
                Some(host) => Some(host),
                None => return Err(Misdirected::BadHost),
            }
        }
        (Some(_), Some(_)) => return Err(Misdirected::BadHost),
    };
    let name = name.map(canonical);
    if host != name {
        return Err(Misdirected::OtherHost);
    }
    if let Some(authority) = uri.authority()
        && (Some(canonical(authority.host())) != name || authority.as_str().contains('@'))
    {
        return Err(Misdirected::OtherTarget);
    }
    let origin = uri.path_and_query().map_or("/", |p| p.as_str());
    let origin = if uri.authority().is_none() && origin == "*" { "*" } else { origin };
    origin.parse().map_err(|_| Misdirected::OtherTarget)
}

/// A `Host` value's host name, as [`super::sniff`] reads it; `None` for an
/// IPv6 literal or a bad port.
fn host_name(host: &str) -> Option<String> {
    let host = host.trim();
    if host.starts_with('[') || host.is_empty() {
        return None;
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        Some(_) => return None,
        None => host,
    };
    Some(canonical(name))
}

/// Headers that belong to one hop, never forwarded as the client sent
/// them; `Connection: close` is set again by the caller if asked for.
const HOP_BY_HOP: [&str; 5] = ["connection", "keep-alive", "proxy-connection", "te", "trailer"];

/// Removes the hop-by-hop headers (and those `Connection` lists) of a
/// message the proxy passes on: they belong to the connection it came on.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in listed.iter().chain(&HOP_BY_HOP.map(HeaderName::from_static)) {
        // `Host` and the framing stay hyper's to check.
        if name != header::HOST && name != header::CONTENT_LENGTH && name != header::TRANSFER_ENCODING {
            headers.remove(name);
        }
    }
}

/// `headers` with the hop-by-hop ones removed ([`strip_hop_by_hop`]) and the
/// rules' headers set, in order (a later rule's header replaces an earlier
/// one of the same name, and both replace the client's).
pub fn apply(
    headers: &mut HeaderMap,
    rules: &HostRules,
    owner: &str,
    resolve: &dyn Fn(&str, &str) -> Option<String>,
) -> Result<(), TransformError> {
    strip_hop_by_hop(headers);
    for set in rules.rules.iter().filter_map(|r| r.headers.as_ref()) {
        for (name, value) in set {
            let resolved = resolve_value(value, owner, resolve)?;
            let name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| TransformError::BadRule)?;
            let value = HeaderValue::from_bytes(resolved.as_bytes()).map_err(|_| TransformError::BadRule)?;
            headers.insert(name, value);
        }
    }
    Ok(())
}

fn resolve_value(
    value: &str,
    owner: &str,
    resolve: &dyn Fn(&str, &str) -> Option<String>,
) -> Result<String, TransformError> {
    // Checked when the rule was accepted; a rule read back from an older
    // record is held to the same.
    let parts = parts(value).map_err(|_| TransformError::BadRule)?;
    let mut out = String::with_capacity(value.len());
    for part in parts {
        match part {
            Part::Literal(text) => out.push_str(text),
            Part::Secret(name) => {
                let secret = resolve(owner, name).ok_or_else(|| TransformError::MissingSecret(name.to_string()))?;
                if secret.bytes().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
                    return Err(TransformError::UnsafeSecret(name.to_string()));
                }
                out.push_str(&secret);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(headers: &[(&str, &str)]) -> Rule {
        Rule { headers: Some(headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()) }
    }

    fn rules(hosts: &[(&str, Vec<Rule>)]) -> Result<HeaderRules, RuleError> {
        HeaderRules::from_e2b("team-a", hosts.iter().map(|(h, r)| (h.to_string(), r.clone())).collect())
    }

    fn lookup(name: &str) -> Vec<Ipv4Addr> {
        match name {
            "api.test" | "a.wild.test" | "b.a.wild.test" => vec!["198.51.100.10".parse().unwrap()],
            _ => vec![],
        }
    }

    const RULE_HOST: &str = "198.51.100.10";

    #[test]
    fn rules_are_validated_when_accepted() {
        let bearer = rule(&[("Authorization", "Bearer ${e2b.secrets.key}")]);
        let ok =
            rules(&[("API.test.", vec![bearer.clone()]), ("*.wild.test", vec![]), ("10.0.0.0/8", vec![])]).unwrap();
        assert_eq!(ok.hosts[0].host, "api.test", "keys are normalized");
        assert_eq!(ok.secret_names(), ["key"]);
        let refused = |host: &str, headers: &[(&str, &str)]| rules(&[(host, vec![rule(headers)])]).unwrap_err();
        assert!(matches!(refused("*", &[]), RuleError::InvalidHost(_)));
        assert!(matches!(refused("not a host", &[]), RuleError::InvalidHost(_)));
        assert!(matches!(refused("api.test", &[("Bad Name", "v")]), RuleError::InvalidHeaderName(..)));
        assert!(matches!(refused("api.test", &[("X-A:", "v")]), RuleError::InvalidHeaderName(..)));
        assert!(matches!(refused("api.test", &[("Host", "evil.test")]), RuleError::InvalidHeaderName(..)));
        assert!(matches!(refused("api.test", &[("Transfer-Encoding", "chunked")]), RuleError::InvalidHeaderName(..)));
        for value in ["a\r\nX-Injected: 1", "a\nb", "a\0b"] {
            assert!(matches!(refused("api.test", &[("X-A", value)]), RuleError::InvalidHeaderValue(..)), "{value:?}");
        }
        let long = "v".repeat(MAX_HEADER_VALUE + 1);
        assert!(matches!(refused("api.test", &[("X-A", &long)]), RuleError::InvalidHeaderValue(..)));
        assert!(matches!(refused("api.test", &[("X-A", "${e2b.identity.tokens.aws}")]), RuleError::Identity(..)));
        assert!(matches!(refused("api.test", &[("X-A", "${e2b.other}")]), RuleError::UnknownPlaceholder(..)));
        assert!(matches!(refused("api.test", &[("X-A", "${e2b.secrets.}")]), RuleError::UnknownPlaceholder(..)));
        let twice = rules(&[("api.test", vec![]), ("API.test", vec![])]).unwrap_err();
        assert!(matches!(twice, RuleError::DuplicateHost(_)));
        let many: Vec<(String, Vec<Rule>)> = (0..=MAX_HOSTS).map(|i| (format!("h{i}.test"), vec![])).collect();
        assert_eq!(HeaderRules::from_e2b("t", many).unwrap_err(), RuleError::TooMany);
    }

    #[test]
    fn placeholders_split_values_and_other_braces_are_text() {
        let got = parts("a ${e2b.secrets.one}-${HOME}${e2b.secrets.two} ${unclosed").unwrap();
        use Part::*;
        assert_eq!(got, [Literal("a "), Secret("one"), Literal("-${HOME}"), Secret("two"), Literal(" ${unclosed")]);
    }

    #[test]
    fn exact_names_win_then_the_longest_wildcard_then_addresses() {
        let set = rules(&[
            ("*.wild.test", vec![rule(&[("X-Which", "short")])]),
            ("*.a.wild.test", vec![rule(&[("X-Which", "long")])]),
            ("a.wild.test", vec![rule(&[("X-Which", "exact")])]),
            ("198.51.100.0/24", vec![rule(&[("X-Which", "net")])]),
        ])
        .unwrap();
        let dst: Ipv4Addr = RULE_HOST.parse().unwrap();
        let which = |name: Option<&str>, dst: Ipv4Addr| set.matching(name, dst, lookup).map(|h| h.host.as_str());
        assert_eq!(which(Some("a.wild.test"), dst), Some("a.wild.test"));
        assert_eq!(which(Some("b.a.wild.test"), dst), Some("*.a.wild.test"));
        assert_eq!(which(Some("other.test"), dst), Some("198.51.100.0/24"), "no name rule: the address's");
        assert_eq!(which(None, "203.0.113.1".parse().unwrap()), None);
    }

    #[test]
    fn a_rule_name_sent_to_an_address_it_does_not_resolve_to_gets_no_rule() {
        let set = rules(&[("api.test", vec![rule(&[("Authorization", "${e2b.secrets.key}")])])]).unwrap();
        assert!(set.matching(Some("api.test"), RULE_HOST.parse().unwrap(), lookup).is_some());
        assert!(set.matching(Some("api.test"), "203.0.113.66".parse().unwrap(), lookup).is_none(), "a forged Host");
    }

    fn resolver(owner: &str, name: &str) -> Option<String> {
        match (owner, name) {
            ("team-a", "key") => Some("s3cr3t".into()),
            ("team-a", "crlf") => Some("x\r\nX-Evil: 1".into()),
            ("team-a", "bell") => Some("x\x07".into()),
            _ => None,
        }
    }

    fn request(head: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in head {
            headers.append(HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn a_request_gets_the_rules_headers_resolved_and_loses_its_hop_by_hop_ones() {
        let set = rules(&[(
            "api.test",
            vec![
                rule(&[("Authorization", "Bearer ${e2b.secrets.key}"), ("X-Team", "one")]),
                rule(&[("x-team", "two")]),
            ],
        )])
        .unwrap();
        let mut headers = request(&[
            ("Host", "api.test"),
            ("authorization", "forged"),
            ("Connection", "keep-alive, X-Hop"),
            ("X-Hop", "1"),
            ("Keep-Alive", "timeout=5"),
            ("Content-Length", "4"),
        ]);
        apply(&mut headers, &set.hosts[0], &set.owner, &resolver).unwrap();
        let mut got: Vec<(String, String)> =
            headers.iter().map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string())).collect();
        got.sort();
        let want =
            [("authorization", "Bearer s3cr3t"), ("content-length", "4"), ("host", "api.test"), ("x-team", "two")];
        assert_eq!(got, want.map(|(n, v)| (n.to_string(), v.to_string())));
    }

    #[test]
    fn only_connections_a_rule_matches_are_touched_and_tls_to_them_is_intercepted() {
        let set = rules(&[("api.test", vec![rule(&[("X-Key", "${e2b.secrets.key}")])])]).unwrap();
        let dst: Ipv4Addr = RULE_HOST.parse().unwrap();
        let head = b"GET / HTTP/1.1\r\nHost: other.test\r\n\r\n".to_vec();
        let untouched = prepare(Some(&set), Some("other.test"), dst, head.clone(), lookup);
        assert_eq!(untouched.unwrap(), Outbound::Forward(head.clone()));
        let no_rules = prepare(None, Some("api.test"), dst, head.clone(), lookup);
        assert_eq!(no_rules.unwrap(), Outbound::Forward(head));
        let hello = vec![0x16, 3, 1, 0, 0];
        let target = |hello: &[u8]| Intercept {
            name: Some("api.test".into()),
            owner: "team-a",
            rules: &set.hosts[0],
            hello: hello.to_vec(),
        };
        assert_eq!(
            prepare(Some(&set), Some("API.test."), dst, hello.clone(), lookup),
            Ok(Outbound::Intercept(target(&hello)))
        );
        let by_address = rules(&[(RULE_HOST, vec![rule(&[("X-Key", "v")])])]).unwrap();
        assert_eq!(
            prepare(Some(&by_address), None, dst, hello, lookup),
            Err(TransformError::NamelessTls),
            "no name, no leaf: refused rather than passed without the rule"
        );
        let head = b"GET / HTTP/1.1\r\nHost: api.test\r\n\r\n".to_vec();
        assert_eq!(
            prepare(Some(&set), Some("api.test"), dst, head.clone(), lookup),
            Ok(Outbound::Serve(target(&head)))
        );
    }

    #[test]
    fn a_missing_or_unsafe_secret_is_an_error() {
        let with = |value: &str| rules(&[("api.test", vec![rule(&[("X-Key", value)])])]).unwrap();
        let headers = request(&[("Host", "api.test")]);
        let apply = |set: &HeaderRules, resolve: &dyn Fn(&str, &str) -> Option<String>| {
            apply(&mut headers.clone(), &set.hosts[0], &set.owner, resolve)
        };
        assert_eq!(apply(&with("${e2b.secrets.gone}"), &resolver), Err(TransformError::MissingSecret("gone".into())));
        assert_eq!(apply(&with("${e2b.secrets.crlf}"), &resolver), Err(TransformError::UnsafeSecret("crlf".into())));
        let other_team = HeaderRules { owner: "team-b".into(), ..with("${e2b.secrets.key}") };
        assert!(apply(&other_team, &resolver).is_err(), "owners do not share");
        assert_eq!(
            apply(&with("${e2b.secrets.key}"), &|_, _| None),
            Err(TransformError::MissingSecret("key".into())),
            "no resolver yet: refused, not sent without the header"
        );
        assert_eq!(apply(&with("${e2b.secrets.bell}"), &resolver), Err(TransformError::BadRule));
    }

    #[test]
    fn each_request_must_name_the_host_its_connection_was_admitted_for() {
        let check = |method: Method, target: &str, head: &[(&str, &str)], name: Option<&str>| {
            addressed(&method, &target.parse().unwrap(), &request(head), name).map(|uri| uri.to_string())
        };
        let get = |target: &str, head: &[(&str, &str)]| check(Method::GET, target, head, Some("api.test"));
        assert_eq!(get("/v1?a=b", &[("Host", "api.test")]), Ok("/v1?a=b".into()));
        assert_eq!(get("/", &[("Host", "API.test.:80")]), Ok("/".into()));
        assert_eq!(check(Method::OPTIONS, "*", &[("Host", "api.test")], Some("api.test")), Ok("*".into()));
        assert_eq!(
            get("http://api.test/v1?a=b", &[("Host", "api.test")]),
            Ok("/v1?a=b".into()),
            "an absolute-form target for the name goes out in origin form"
        );
        assert_eq!(get("http://API.test:80", &[("Host", "api.test")]), Ok("/".into()));
        assert_eq!(get("http://other.test/", &[("Host", "api.test")]), Err(Misdirected::OtherTarget));
        assert_eq!(get("https://other.test/", &[("Host", "api.test")]), Err(Misdirected::OtherTarget));
        assert_eq!(get("http://user@api.test/", &[("Host", "api.test")]), Err(Misdirected::OtherTarget));
        assert_eq!(
            get("/", &[("Host", "other.test")]),
            Err(Misdirected::OtherHost),
            "a kept-alive connection's next Host"
        );
        assert_eq!(get("/", &[("Host", "api.test.other.test")]), Err(Misdirected::OtherHost));
        assert_eq!(get("/", &[]), Err(Misdirected::OtherHost), "no Host");
        assert_eq!(get("/", &[("Host", "api.test"), ("Host", "api.test")]), Err(Misdirected::BadHost));
        assert_eq!(get("/", &[("Host", "[::1]")]), Err(Misdirected::BadHost));
        assert_eq!(get("/", &[("Host", "api.test"), ("Upgrade", "websocket")]), Err(Misdirected::Tunnel));
        assert_eq!(
            check(Method::CONNECT, "api.test:443", &[("Host", "api.test")], Some("api.test")),
            Err(Misdirected::Tunnel)
        );
        let nameless = |target: &str, head: &[(&str, &str)]| check(Method::GET, target, head, None);
        assert_eq!(nameless("/", &[]), Ok("/".into()), "admitted by address, and stays nameless");
        assert_eq!(nameless("/", &[("Host", "api.test")]), Err(Misdirected::OtherHost));
        assert_eq!(nameless("http://api.test/", &[]), Err(Misdirected::OtherTarget));
    }
}
