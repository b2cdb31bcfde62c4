//! The HTTP surface: which path goes where. Handlers here only extract and
//! delegate.

use std::collections::HashMap;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use crate::auth::{self, json_error};
use crate::rpc::{filesystem, process};
use crate::state::SharedState;
use crate::transfer;

pub fn router(state: SharedState) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .route("/init", post(init))
        .route("/envs", get(envs))
        .route("/files", get(transfer::download).post(transfer::upload))
        .route("/process.Process/{method}", post(process_rpc))
        .route("/filesystem.Filesystem/{method}", post(filesystem_rpc))
        .layer(middleware::from_fn_with_state(state.clone(), auth::require_token))
        .layer(middleware::from_fn_with_state(state.clone(), crate::ports::relay_other_ports))
        .layer(middleware::map_request(crate::drain::request_bodies))
        .with_state(state)
}

async fn process_rpc(
    State(state): State<SharedState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    process::handle(state, &method, headers, body).await
}

async fn filesystem_rpc(
    State(state): State<SharedState>,
    Path(method): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    filesystem::handle(state, &method, headers, body).await
}

/// `POST /init` body; every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
struct InitRequest {
    #[serde(alias = "env_vars")]
    env_vars: Option<HashMap<String, String>>,
    #[serde(alias = "access_token")]
    access_token: Option<String>,
    #[serde(alias = "default_user")]
    default_user: Option<String>,
    #[serde(alias = "default_workdir")]
    default_workdir: Option<String>,
    /// copse's own: the egress CA (PEM) to trust ([`crate::trust`]).
    egress_ca: Option<String>,
}

/// Hands a (possibly pre-booted) sandbox its settings. Allowed while no
/// token is set, or with the current one.
async fn init(State(state): State<SharedState>, headers: HeaderMap, body: Bytes) -> Response {
    if !auth::token_ok(&state, &headers) {
        return json_error(StatusCode::UNAUTHORIZED, "unauthorized access, invalid access token");
    }
    let req: InitRequest = if body.iter().all(u8::is_ascii_whitespace) {
        InitRequest::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => return json_error(StatusCode::BAD_REQUEST, format!("invalid init request: {e}")),
        }
    };
    let trust_env = match req.egress_ca {
        Some(pem) => match tokio::task::spawn_blocking(move || crate::trust::install(std::path::Path::new("/"), &pem))
            .await
            .map_err(std::io::Error::other)
            .and_then(|r| r)
        {
            Ok(env) => env,
            Err(e) => {
                return json_error(StatusCode::INTERNAL_SERVER_ERROR, format!("installing the egress CA: {e}"));
            }
        },
        None => Vec::new(),
    };
    state.update_settings(|s| {
        if let Some(env) = req.env_vars {
            s.env_vars.extend(env);
        }
        for (name, value) in trust_env {
            s.env_vars.entry(name.to_string()).or_insert(value);
        }
        if let Some(token) = req.access_token {
            s.access_token = Some(token).filter(|t| !t.is_empty());
        }
        if let Some(user) = req.default_user.filter(|u| !u.is_empty()) {
            s.default_user = user;
        }
        if let Some(dir) = req.default_workdir.filter(|d| !d.is_empty()) {
            s.default_workdir = Some(dir);
        }
    });
    StatusCode::NO_CONTENT.into_response()
}

/// The agent-wide environment (envd's `GET /envs`).
async fn envs(State(state): State<SharedState>) -> Response {
    axum::Json(state.settings().env_vars).into_response()
}
