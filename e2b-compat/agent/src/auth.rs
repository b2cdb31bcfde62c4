//! Who may call the agent, and as which user (envd `api/auth.go`,
//! `permissions/authenticate.go`).
//!
//! - With an access token set, every request needs `X-Access-Token` except
//!   `GET /health`, `/files` (which accepts a signature instead) and
//!   `POST /init` (which checks the token itself), and `GET /envs` on the
//!   sandbox's own loopback: what it returns every process in the sandbox
//!   already has in its environment, and the code interpreter must read it
//!   without holding the token.
//! - RPCs pick their user from `Authorization: Basic base64("<user>:")`,
//!   falling back to the default user.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use copse_protocol::headers::ACCESS_TOKEN;
use copse_protocol::signature;

use crate::connect::{Code, RpcError};
use crate::state::SharedState;
use crate::users::User;

/// envd's plain-HTTP error body: `{"code": <status>, "message": "..."}`.
pub fn json_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({ "code": status.as_u16(), "message": message.into() });
    (status, [("content-type", "application/json; charset=utf-8")], body.to_string()).into_response()
}

fn header_token(headers: &HeaderMap) -> Option<&str> {
    // An empty header counts as absent, as in envd.
    headers.get(ACCESS_TOKEN).and_then(|v| v.to_str().ok()).filter(|t| !t.is_empty())
}

/// Whether `headers` carry the current token (always true when none is set).
pub fn token_ok(state: &SharedState, headers: &HeaderMap) -> bool {
    match state.access_token() {
        None => true,
        Some(expected) => header_token(headers).is_some_and(|t| signature::equal(t, &expected)),
    }
}

/// Marks requests that came in on the sandbox's loopback listener, i.e.
/// from a process inside the sandbox.
#[derive(Debug, Clone, Copy)]
pub struct Loopback;

/// Middleware enforcing the access token on everything but the exempt paths.
pub async fn require_token(State(state): State<SharedState>, req: Request, next: Next) -> Response {
    let exempt = match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") | (&Method::GET | &Method::POST, "/files") | (&Method::POST, "/init") => true,
        (&Method::GET, "/envs") => req.extensions().get::<Loopback>().is_some(),
        _ => false,
    };
    if exempt || token_ok(&state, req.headers()) {
        return next.run(req).await;
    }
    json_error(
        StatusCode::UNAUTHORIZED,
        "unauthorized access, please provide a valid access token or method signing if supported",
    )
}

/// The username of a `Basic` authorization header (password ignored).
pub fn basic_username(headers: &HeaderMap) -> Option<String> {
    let value = headers.get("authorization")?.to_str().ok()?;
    let (scheme, encoded) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    Some(text.split_once(':').map_or(text.as_str(), |(u, _)| u).to_string())
}

/// The user an RPC runs as.
pub fn rpc_user(state: &SharedState, headers: &HeaderMap) -> Result<User, RpcError> {
    match basic_username(headers).filter(|u| !u.is_empty()) {
        Some(name) => state
            .user(Some(&name))
            .map_err(|_| RpcError::new(Code::Unauthenticated, format!("invalid username: '{name}'"))),
        None => {
            state.user(None).map_err(|e| RpcError::new(Code::Unauthenticated, format!("invalid default user: {e}")))
        }
    }
}

/// Signature parameters of a `/files` URL.
#[derive(Debug, Default, Clone, serde::Deserialize)]
pub struct SignedQuery {
    pub path: Option<String>,
    pub username: Option<String>,
    pub signature: Option<String>,
    pub signature_expiration: Option<i64>,
}

/// `/files` access: the token header, or a valid unexpired signature for
/// `operation` ("read"/"write") over the exact query values.
pub fn check_files_access(
    state: &SharedState,
    headers: &HeaderMap,
    q: &SignedQuery,
    operation: &str,
) -> Result<(), String> {
    let Some(token) = state.access_token() else { return Ok(()) };
    if let Some(given) = header_token(headers) {
        return if signature::equal(given, &token) {
            Ok(())
        } else {
            Err("access token present in header but does not match".into())
        };
    }
    let Some(signature) = q.signature.as_deref() else {
        return Err("missing signature query parameter".into());
    };
    let expiration = q.signature_expiration.map(|e| e.max(0) as u64);
    let expected = signature::sign(
        q.path.as_deref().unwrap_or(""),
        operation,
        q.username.as_deref().unwrap_or(""),
        &token,
        expiration,
    );
    if !signature::equal(&expected, signature) {
        return Err("invalid signature".into());
    }
    if let Some(exp) = q.signature_expiration {
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
        if exp < now {
            return Err("signature is already expired".into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_username_ignores_the_password() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "Basic dXNlcjo=".parse().unwrap()); // "user:"
        assert_eq!(basic_username(&h).as_deref(), Some("user"));
        h.insert("authorization", "basic cm9vdDpzZWNyZXQ=".parse().unwrap()); // "root:secret"
        assert_eq!(basic_username(&h).as_deref(), Some("root"));
        h.insert("authorization", "Bearer abc".parse().unwrap());
        assert_eq!(basic_username(&h), None);
    }
}
