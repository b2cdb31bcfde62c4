//! The HTTP surface: E2B's control plane, and the data-plane switch that
//! sends sandbox traffic to the right agent. One listener serves both.

pub mod control;
pub mod error;
mod fan_out;
pub mod forward;
pub mod host_routing;
pub mod proxy;
pub mod request_span;
pub mod secrets;
mod template_nodes;
pub mod templates;
pub mod volume_content;
mod volume_nodes;
pub mod volumes;
pub mod wire;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Extension, Router};

use crate::service::{Sandboxes, Secrets, Volumes};
use crate::tenancy::{Directory, Principal, RateLimiter};
use error::ApiError;
pub use host_routing::Exposure;

/// Who may call the control plane, and how often.
#[derive(Clone)]
pub struct Gate {
    pub directory: Arc<Directory>,
    pub rates: Arc<RateLimiter>,
}

pub fn router(
    svc: Arc<Sandboxes>,
    secrets: Arc<Secrets>,
    volumes: Arc<Volumes>,
    gate: Gate,
    exposure: Exposure,
) -> Router {
    let control = Router::new()
        .route("/v2/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes/{id}", get(control::detail).delete(control::kill))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(control::refresh))
        .route("/sandboxes/{id}/metrics", get(control::metrics))
        .route("/sandboxes/metrics", get(control::many_metrics))
        .route("/sandboxes/{id}/logs", get(control::logs))
        .route("/v2/sandboxes/{id}/logs", get(control::logs_v2))
        .route("/sandboxes/{id}/network", put(control::update_network))
        .route("/templates", get(control::templates))
        .route("/copse/pools", get(control::pools))
        .route("/sandboxes/{id}/pause", post(control::pause))
        .route("/sandboxes/{id}/resume", post(control::resume))
        .route("/sandboxes/{id}/snapshots", post(control::create_snapshot))
        .route("/sandboxes/{id}/fork", post(control::fork))
        .route("/snapshots", get(control::list_snapshots))
        .route("/copse/sandboxes/{id}/clone", post(control::clone))
        .route("/copse/sandboxes/{id}/rollback", post(control::rollback))
        .merge(secrets::routes(secrets))
        .merge(volumes::routes(volumes.clone()))
        .merge(templates::routes())
        .fallback(control::no_route)
        // After the key's check: a create's team decides where it runs.
        .route_layer(middleware::from_fn_with_state(svc.clone(), forward::control_plane))
        .route_layer(middleware::from_fn_with_state(gate, require_api_key))
        // The volume's own token is the credential here, not an API key.
        .merge(
            volume_content::routes(volumes.clone())
                .route_layer(middleware::from_fn_with_state(svc.clone(), volume_nodes::content)),
        )
        .merge(
            templates::upload_routes().route_layer(middleware::from_fn_with_state(svc.clone(), template_nodes::upload)),
        )
        .layer(middleware::map_response(json_errors))
        .with_state(svc.clone());
    // The data-plane switch runs first: a request meant for a sandbox never
    // reaches the control plane, whatever its path.
    // Outermost: every line logged while serving a request names it.
    control
        .layer(middleware::from_fn_with_state(svc, proxy::switch))
        .layer(Extension(exposure))
        .layer(Extension(volumes))
        .layer(middleware::from_fn(request_span::request_span))
}

/// axum's own rejections (a body that is not the JSON a route expects, a
/// bad query or path) are plain text, and the SDK parses every error body
/// as E2B's `{code, message}`; E2B calls all of them a bad request.
async fn json_errors(response: Response) -> Response {
    let plain_text =
        response.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/plain"));
    if !(response.status().is_client_error() && plain_text) {
        return response;
    }
    let status = match response.status() {
        StatusCode::UNPROCESSABLE_ENTITY | StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::BAD_REQUEST,
        other => other,
    };
    let text = axum::body::to_bytes(response.into_body(), 16 * 1024).await.unwrap_or_default();
    ApiError::new(status, String::from_utf8_lossy(&text).trim().to_string()).into_response()
}

/// Finds the key's team (handlers take it as `Extension<Principal>`) and
/// holds the key to its team's request rate.
async fn require_api_key(State(gate): State<Gate>, mut request: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let Some(presented) = request.headers().get("x-api-key").and_then(|v| v.to_str().ok()) else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "missing X-API-KEY header").into_response();
    };
    let Some(principal) = gate.directory.authenticate(presented) else {
        return ApiError::new(StatusCode::UNAUTHORIZED, "invalid API key").into_response();
    };
    if let Some(per_second) = gate.directory.quotas(&principal.caller.team).requests_per_second
        && let Err(wait) = gate.rates.check(&principal.key, per_second)
    {
        return error::rate_limited(per_second, wait);
    }
    request.extensions_mut().insert(principal);
    request.extensions_mut().insert(Admission(started.elapsed()));
    next.run(request).await
}

/// How long finding the key's team and checking its request rate took:
/// the tenancy part of a request's cost, reported in a create's
/// `Server-Timing`.
#[derive(Debug, Clone, Copy)]
pub struct Admission(pub std::time::Duration);

/// The team a handler acts for.
pub type Caller = Extension<Principal>;
