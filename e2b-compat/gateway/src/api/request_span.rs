//! One tracing span per request: a fresh `request_id` (also sent back as
//! `x-request-id`, so a caller can quote it) and, once known, the
//! `sandbox_id` the request is about, from the control-plane path here or
//! from the data-plane switch (`proxy.rs`) or a create. Every line logged
//! while the request is served carries both.
//!
//! The id is always the gateway's own: a caller's `x-request-id` is not
//! taken, so nothing a caller sends is written into the log as an id.

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use rand::Rng;
use tracing::Instrument;

pub const REQUEST_ID_HEADER: &str = "x-request-id";

pub async fn request_span(request: Request, next: Next) -> Response {
    let request_id = new_request_id();
    let span = tracing::info_span!(
        "request",
        request_id = %request_id,
        method = %request.method(),
        path = %request.uri().path(),
        sandbox_id = tracing::field::Empty,
    );
    if let Some(id) = sandbox_in_path(request.uri().path()) {
        span.record("sandbox_id", id);
    }
    let mut response = next.run(request).instrument(span).await;
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert(REQUEST_ID_HEADER, value);
    }
    response
}

fn new_request_id() -> String {
    let bytes: [u8; 8] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The sandbox a control-plane path names: `/sandboxes/{id}/…`,
/// `/v2/sandboxes/{id}/…`, `/copse/sandboxes/{id}/…`; only a plausible id
/// (letters and digits) is taken.
fn sandbox_in_path(path: &str) -> Option<&str> {
    let mut parts = path.trim_start_matches('/').split('/');
    let mut first = parts.next()?;
    if first == "v2" || first == "copse" {
        first = parts.next()?;
    }
    let id = parts.next().filter(|_| first == "sandboxes")?;
    let plausible = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_alphanumeric());
    (plausible && id != "metrics").then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_paths_name_their_sandbox() {
        assert_eq!(sandbox_in_path("/sandboxes/abc123/pause"), Some("abc123"));
        assert_eq!(sandbox_in_path("/v2/sandboxes/abc123/logs"), Some("abc123"));
        assert_eq!(sandbox_in_path("/copse/sandboxes/abc123/clone"), Some("abc123"));
        assert_eq!(sandbox_in_path("/sandboxes/abc123"), Some("abc123"));
        assert_eq!(sandbox_in_path("/sandboxes/metrics"), None);
        assert_eq!(sandbox_in_path("/sandboxes"), None);
        assert_eq!(sandbox_in_path("/v2/sandboxes"), None);
        assert_eq!(sandbox_in_path("/sandboxes/a%0Ab/pause"), None);
        assert_eq!(sandbox_in_path("/templates/base"), None);
    }

    #[test]
    fn request_ids_are_distinct_hex() {
        let a = new_request_id();
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, new_request_id());
    }
}
