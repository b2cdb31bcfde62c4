//! The data plane: requests whose host names a sandbox port
//! (`{port}-{id}.{domain}`, see `host_routing.rs`), requests carrying
//! `E2b-Sandbox-Id` (what the SDK sends when `E2B_SANDBOX_URL` points here),
//! and signed `/files` links that carry no headers at all, are forwarded
//! to the sandbox's agent, which strips the tokens before relaying to any
//! other in-sandbox port (`agent/src/ports.rs`). A sandbox created with
//! `allowPublicTraffic: false` answers on its ports only requests carrying
//! its traffic token. Bodies stream both ways and WebSocket
//! upgrades are spliced through.
//!
//! The data plane carries no API key: a sandbox's access token is what
//! admits a caller. A request that names a sandbox but carries another
//! sandbox's token (say, another team's), or a signed link another
//! sandbox's token signed, is answered as if the sandbox did not exist:
//! holding one sandbox's token never confirms what else lives on the
//! gateway.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, Version, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::host_routing::Exposure;
use crate::agent_link;
use crate::model::{self, Caller, SandboxRecord};
use crate::service::{Owner, Sandboxes};
use crate::store::{AccessTokens, SignedLink};

pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
const SANDBOX_PORT_HEADER: &str = copse_protocol::headers::SANDBOX_PORT;
const ACCESS_TOKEN_HEADER: &str = copse_protocol::headers::ACCESS_TOKEN;
const TRAFFIC_TOKEN_HEADER: &str = copse_protocol::headers::TRAFFIC_ACCESS_TOKEN;
const PORT_TLS_HEADER: &str = copse_protocol::headers::PORT_TLS;
const AGENT_PORT: u16 = copse_protocol::headers::AGENT_PORT;

pub async fn switch(State(svc): State<Arc<Sandboxes>>, mut request: Request, next: Next) -> Response {
    let (record, port) = match target(&svc, &request) {
        Target::Sandbox(record, port) => (record, port),
        Target::Missing(id) => return not_found(&id),
        Target::BadSignature => {
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid or expired signature").into_response();
        }
        Target::ControlPlane => return next.run(request).await,
    };
    tracing::Span::current().record("sandbox_id", record.id.as_str());
    // Another node's sandbox: its gateway checks the caller. Traffic that
    // resumes a paused one may move it (`service/relocate.rs`).
    let forwarded = super::forward::take_mark(&mut request);
    let owner = match record.paused.is_some() && record.auto_resume {
        true => svc.place_resume(&record, forwarded),
        false => svc.owner(record.node.as_deref()),
    };
    match owner {
        Ok(Owner::Here) => {}
        Ok(owner) => {
            return super::forward::to_owner(&svc, owner, &format!("sandbox {}", record.id), forwarded, request).await;
        }
        Err(e) => return ApiError::from(model::SandboxError::from(e)).into_response(),
    }
    match credentials(&record, &request) {
        Credentials::Foreign => return not_found(&record.id),
        Credentials::Wrong => {
            return ApiError::new(StatusCode::UNAUTHORIZED, "invalid access token for this sandbox").into_response();
        }
        Credentials::OwnOrNone => {}
    }
    if !traffic_allowed(record.traffic_access_token.as_deref(), port, request.headers()) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "this sandbox does not allow public traffic: missing or invalid e2b-traffic-access-token",
        )
        .into_response();
    }
    // A frozen agent would hold the request forever: resume first (if the
    // sandbox asked for that) or say it is paused.
    let record = match svc.resume_for_traffic(*record).await {
        Ok(record) => record,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let call = envd_call(port, &request);
    let response = forward(&record, port, request).await;
    if let Some((what, fields)) = call {
        svc.note_traffic(&record, &what, &fields, response.status().as_u16());
    }
    response
}

/// What the sandbox's log says of an envd call (processes started and
/// signalled, filesystem operations, file transfers); `None` for the
/// rest (process input and output streams, other ports' traffic), which
/// would drown it.
fn envd_call(host_port: Option<u16>, request: &Request) -> Option<(String, Vec<(&'static str, String)>)> {
    let port = named_port(host_port, request.headers());
    if port.unwrap_or(AGENT_PORT) != AGENT_PORT {
        return None;
    }
    let path = request.uri().path();
    match path {
        "/process.Process/Start" => Some(("process started".into(), Vec::new())),
        "/process.Process/SendSignal" => Some(("process signalled".into(), Vec::new())),
        "/files" => {
            let file = request
                .uri()
                .query()
                .and_then(|q| url::form_urlencoded::parse(q.as_bytes()).find(|(k, _)| k == "path"))
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default();
            let what = if request.method() == Method::GET { "file downloaded" } else { "file uploaded" };
            Some((what.into(), vec![("path", file)]))
        }
        _ => path
            .strip_prefix("/filesystem.Filesystem/")
            .filter(|op| op.len() <= 32 && op.bytes().all(|b| b.is_ascii_alphanumeric()))
            .map(|op| (format!("filesystem {op}"), Vec::new())),
    }
}

/// Whether a sandbox that does not allow public traffic lets this request
/// through: it carries the traffic token, or it is for the agent's own
/// port. E2B exempts envd traffic that carries the envd access token; the
/// agent demands that token (or a signature made with it) on every route
/// but `/health` itself, so the gateway lets the agent judge — which also
/// keeps signed `/files` links working, as they carry no headers.
/// The sandbox port a request is for: its host name's, else the port
/// header's; `None` means the agent's.
fn named_port(host_port: Option<u16>, headers: &HeaderMap) -> Option<u16> {
    host_port.or_else(|| headers.get(SANDBOX_PORT_HEADER)?.to_str().ok()?.parse().ok())
}

fn traffic_allowed(expected: Option<&str>, host_port: Option<u16>, headers: &HeaderMap) -> bool {
    let Some(expected) = expected else { return true };
    let port = named_port(host_port, headers);
    if port.unwrap_or(AGENT_PORT) == AGENT_PORT {
        return true;
    }
    let given = headers.get(TRAFFIC_TOKEN_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
    copse_protocol::signature::equal(given, expected)
}

enum Credentials {
    /// The sandbox's own token or link, or none (the agent judges).
    OwnOrNone,
    /// Another live sandbox's token or link.
    Foreign,
    /// A token that is no sandbox's.
    Wrong,
}

/// Whose credentials the request carries: the named sandbox's own (its
/// access token, or a link signed with it), another sandbox's, or nobody's.
fn credentials(record: &SandboxRecord, request: &Request) -> Credentials {
    let tokens = request.extensions().get::<Arc<AccessTokens>>();
    if let Some(token) = request.headers().get(ACCESS_TOKEN_HEADER) {
        let token = token.to_str().unwrap_or("");
        if copse_protocol::signature::equal(token, &record.access_token) {
            return Credentials::OwnOrNone;
        }
        return match tokens.and_then(|t| t.holder_of(token)) {
            Some(_) => Credentials::Foreign,
            None => Credentials::Wrong,
        };
    }
    let claims = if request.uri().path() == "/files" { LinkClaims::of(request) } else { None };
    match (claims, tokens) {
        (Some(claims), Some(tokens)) => match tokens.signer_of(&claims.link()) {
            Some(signer) if signer != record.id => Credentials::Foreign,
            // A signature no sandbox made: the agent refuses it.
            _ => Credentials::OwnOrNone,
        },
        _ => Credentials::OwnOrNone,
    }
}

enum Target {
    /// The sandbox, and the port its host name gave (the port header
    /// names it otherwise).
    Sandbox(Box<SandboxRecord>, Option<u16>),
    Missing(String),
    /// A signed `/files` link that no live sandbox signed, or expired.
    BadSignature,
    ControlPlane,
}

fn target(svc: &Sandboxes, request: &Request) -> Target {
    let exposure = request.extensions().get::<Exposure>();
    if let Some(address) = exposure.and_then(|e| e.sandbox_address(request)) {
        return match svc.get(&Caller::operator(), &address.sandbox_id) {
            Ok(record) => Target::Sandbox(Box::new(record), Some(address.port)),
            Err(_) => Target::Missing(address.sandbox_id),
        };
    }
    if let Some(id) = request.headers().get(SANDBOX_ID_HEADER).and_then(|v| v.to_str().ok()) {
        return match svc.get(&Caller::operator(), id) {
            Ok(record) => Target::Sandbox(Box::new(record), None),
            Err(_) => Target::Missing(id.to_string()),
        };
    }
    if request.uri().path() == "/files"
        && let Some(target) = signed_link_owner(svc, request)
    {
        return target;
    }
    Target::ControlPlane
}

/// A signed link names no sandbox; the one whose token produced the
/// signature is its owner (found by the in-memory index of tokens, never by
/// reading the store). The agent verifies the signature again. `None`: not
/// a signed link.
fn signed_link_owner(svc: &Sandboxes, request: &Request) -> Option<Target> {
    let claims = LinkClaims::of(request)?;
    let refused = || Some(Target::BadSignature);
    if claims.expiration.is_some_and(|exp| exp < unix_now()) {
        return refused();
    }
    let tokens = request.extensions().get::<Arc<AccessTokens>>()?;
    let link = claims.link();
    let signer = tokens.signer_of(&link).or_else(|| svc.signer_elsewhere(&link));
    match signer.map(|id| svc.get(&Caller::operator(), &id)) {
        Some(Ok(record)) => Some(Target::Sandbox(Box::new(record), None)),
        _ => refused(),
    }
}

/// A signed `/files` link's query, as the agent reads it.
struct LinkClaims {
    path: String,
    username: String,
    operation: &'static str,
    expiration: Option<u64>,
    signature: String,
}

impl LinkClaims {
    /// `None`: the request carries no signature.
    fn of(request: &Request) -> Option<Self> {
        let query = request.uri().query()?;
        let (mut path, mut username, mut signature, mut expiration) = (String::new(), String::new(), None, None);
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            match key.as_ref() {
                "path" => path = value.into_owned(),
                "username" => username = value.into_owned(),
                "signature" => signature = Some(value.into_owned()),
                // As the agent reads it: a negative expiration is 0.
                "signature_expiration" => expiration = value.parse::<i64>().ok().map(|e| e.max(0) as u64),
                _ => {}
            }
        }
        let operation = if request.method() == Method::GET { "read" } else { "write" };
        Some(Self { path, username, operation, expiration, signature: signature? })
    }

    fn link(&self) -> SignedLink<'_> {
        SignedLink {
            path: &self.path,
            operation: self.operation,
            username: &self.username,
            expiration: self.expiration,
            signature: &self.signature,
        }
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

async fn forward(record: &SandboxRecord, port: Option<u16>, mut request: Request) -> Response {
    // A server in the sandbox sees the name the client used, as on E2B
    // (HTTP/2 carries it in the URI, which becomes origin-form below),
    // unless the sandbox was created with a mask for it.
    let named = named_port(port, request.headers());
    mark_tls(record, named, request.headers_mut());
    let masked = match (named, &record.mask_request_host) {
        (Some(port), Some(mask)) if port != AGENT_PORT => HeaderValue::from_str(&model::masked_host(mask, port)).ok(),
        _ => None,
    };
    let host = match (masked, request.headers().get(header::HOST)) {
        (Some(masked), _) => masked,
        (None, Some(host)) => host.clone(),
        (None, None) => request
            .uri()
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            .unwrap_or(HeaderValue::from_static("agent")),
    };
    request.headers_mut().insert(header::HOST, host);
    if let Some(port) = port {
        request.headers_mut().insert(SANDBOX_PORT_HEADER, HeaderValue::from(port));
    }
    origin_form(&mut request);
    let client_upgrade = copse_protocol::upgrade::take(&mut request);
    match agent_link::send(&record.agent_socket, request).await {
        Ok(mut response) => {
            copse_protocol::upgrade::splice(client_upgrade, &mut response);
            response.map(Body::new)
        }
        Err(e) => {
            tracing::warn!("sandbox {} unreachable: {e:#}", record.id);
            ApiError::new(StatusCode::BAD_GATEWAY, format!("sandbox {} is not reachable: {e}", record.id))
                .into_response()
        }
    }
}

/// Makes `request` an HTTP/1.1 request in origin form, for a hop that
/// speaks HTTP/1.1 (the agent, another node's gateway): a request that came
/// in over HTTP/2 carries an absolute URI, which HTTP/1.1 origin servers
/// need not accept.
pub(super) fn origin_form(request: &mut Request) {
    *request.version_mut() = Version::HTTP_11;
    if let Some(path) = request.uri().path_and_query().cloned() {
        *request.uri_mut() = Uri::from(path);
    }
}

/// Tells the agent to speak TLS to `port` when the sandbox lists it in
/// `httpsPorts`. Only the gateway decides: a client's own copy of the
/// header is always removed, or anyone could make the agent speak TLS to a
/// plain port (or plain HTTP to a TLS one).
fn mark_tls(record: &SandboxRecord, port: Option<u16>, headers: &mut HeaderMap) {
    headers.remove(PORT_TLS_HEADER);
    if port.is_some_and(|port| record.https_ports.binary_search(&port).is_ok()) {
        headers.insert(PORT_TLS_HEADER, HeaderValue::from_static("1"));
    }
}

/// The SDK recognises a gone sandbox by a 502 whose message says it "was
/// not found".
fn not_found(id: &str) -> Response {
    ApiError::new(StatusCode::BAD_GATEWAY, format!("The sandbox {id} was not found")).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (axum::http::HeaderName::from_static(k), HeaderValue::from_static(v))).collect()
    }

    #[test]
    fn public_sandboxes_need_no_traffic_token() {
        assert!(traffic_allowed(None, Some(8000), &headers(&[])));
    }

    #[test]
    fn private_ports_need_the_traffic_token() {
        let token = Some("t0k3n");
        assert!(!traffic_allowed(token, Some(8000), &headers(&[])));
        assert!(!traffic_allowed(token, Some(8000), &headers(&[(TRAFFIC_TOKEN_HEADER, "wrong")])));
        assert!(traffic_allowed(token, Some(8000), &headers(&[(TRAFFIC_TOKEN_HEADER, "t0k3n")])));
        // The port header route is held to the same rule.
        assert!(!traffic_allowed(token, None, &headers(&[(SANDBOX_PORT_HEADER, "49999")])));
        // The access token is no traffic token.
        assert!(!traffic_allowed(token, Some(49999), &headers(&[(ACCESS_TOKEN_HEADER, "t0k3n")])));
    }

    #[test]
    fn only_listed_https_ports_are_marked_for_tls_whatever_the_client_sends() {
        let mut json = serde_json::json!({
            "id": "s", "template": "base", "access_token": "t", "metadata": {}, "env_vars": {},
            "started_at_ms": 0, "end_at_ms": 0, "state": "running", "allow_internet_access": true,
            "auto_pause": false, "agent_socket": "/nonexistent",
            "placement": { "init_pid": 0, "init_start": 0 }, "https_ports": [3000, 8443],
        });
        json["limits"] = serde_json::to_value(copse_substrate::Limits::default()).unwrap();
        let record: SandboxRecord = serde_json::from_value(json).unwrap();
        let marked = |port: Option<u16>, sent: &[(&'static str, &'static str)]| {
            let mut headers = headers(sent);
            mark_tls(&record, port, &mut headers);
            headers.get_all(PORT_TLS_HEADER).iter().map(|v| v.to_str().unwrap().to_string()).collect::<Vec<_>>()
        };
        assert_eq!(marked(Some(3000), &[]), ["1"]);
        assert_eq!(marked(Some(8443), &[(PORT_TLS_HEADER, "0")]), ["1"]);
        assert!(marked(Some(3001), &[(PORT_TLS_HEADER, "1")]).is_empty(), "a client cannot ask for TLS");
        assert!(marked(None, &[(PORT_TLS_HEADER, "1")]).is_empty());
        assert!(marked(Some(3001), &[(PORT_TLS_HEADER, "1"), (PORT_TLS_HEADER, "1")]).is_empty());
    }

    #[test]
    fn the_agents_port_is_left_to_the_agents_own_check() {
        let token = Some("t0k3n");
        assert!(traffic_allowed(token, Some(AGENT_PORT), &headers(&[])));
        assert!(traffic_allowed(token, None, &headers(&[])));
        assert!(traffic_allowed(token, None, &headers(&[(SANDBOX_PORT_HEADER, "49983")])));
    }
}
