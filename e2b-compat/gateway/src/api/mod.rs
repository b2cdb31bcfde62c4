//! The HTTP surface: E2B's control plane, and the data-plane switch that
//! sends sandbox traffic to the right agent. One listener serves both.

pub mod control;
pub mod error;
pub mod host_routing;
pub mod proxy;
pub mod wire;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Extension, Router};

use crate::service::Sandboxes;
use crate::tenancy::{Directory, Principal, RateLimiter};
use error::ApiError;
pub use host_routing::Exposure;

/// Who may call the control plane, and how often.
#[derive(Clone)]
pub struct Gate {
    pub directory: Arc<Directory>,
    pub rates: Arc<RateLimiter>,
}

pub fn router(svc: Arc<Sandboxes>, gate: Gate, exposure: Exposure) -> Router {
    let control = Router::new()
        .route("/v2/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes/{id}", get(control::detail).delete(control::kill))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/refreshes", post(control::refresh))
        .route("/sandboxes/{id}/metrics", get(control::metrics))
        .route("/sandboxes/{id}/network", put(control::update_network))
        .route("/templates", get(control::templates))
        .route("/copse/pools", get(control::pools))
        .route("/sandboxes/{id}/pause", post(control::pause))
        .route("/sandboxes/{id}/resume", post(control::resume))
        .route("/sandboxes/{id}/snapshots", post(control::create_snapshot))
        .route("/sandboxes/{id}/fork", post(control::fork))
        .route("/snapshots", get(control::list_snapshots))
        .route("/templates/{id}", delete(control::delete_template))
        .route("/copse/sandboxes/{id}/clone", post(control::clone))
        .route("/copse/sandboxes/{id}/rollback", post(control::rollback))
        .fallback(control::no_route)
        .route_layer(middleware::from_fn_with_state(gate, require_api_key))
        .with_state(svc.clone());
    // The data-plane switch runs first: a request meant for a sandbox never
    // reaches the control plane, whatever its path.
    control.layer(middleware::from_fn_with_state(svc, proxy::switch)).layer(Extension(exposure))
}

/// Finds the key's team (handlers take it as `Extension<Principal>`) and
/// holds the key to its team's request rate.
async fn require_api_key(State(gate): State<Gate>, mut request: Request, next: Next) -> Response {
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
    next.run(request).await
}

/// The team a handler acts for.
pub type Caller = Extension<Principal>;
