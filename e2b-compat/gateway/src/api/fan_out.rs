//! `GET /sandboxes/metrics?sandbox_ids=…` may name sandboxes on several
//! nodes of a cluster. The ids are split by node: this node's share is
//! served here, each other node is asked for its own (a forwarded call,
//! the caller's key going along, so that node checks the team), and the
//! answers are merged into one. Sandboxes on a lost node are left out, as
//! sandboxes that do not run are; a node that cannot be reached fails the
//! call with its error rather than dropping its sandboxes unsaid.

use std::collections::BTreeMap;

use axum::Json;
use axum::body::Body;
use axum::extract::{MatchedPath, Query, Request};
use axum::http::{Method, StatusCode, Uri, request::Parts};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::control::MAX_METRICS_IDS;
use super::error::ApiError;
use super::forward::{Peers, send};
use super::wire::ManyMetricsQuery;
use crate::model::{NodeRecord, SandboxError};
use crate::service::{Owner, Sandboxes};

/// A reply is a few hundred bytes per sandbox.
const MAX_REPLY: usize = 1 << 20;

pub(super) fn is_many_metrics(request: &Request) -> bool {
    request.method() == Method::GET
        && request.extensions().get::<MatchedPath>().map(MatchedPath::as_str) == Some("/sandboxes/metrics")
}

/// Serves `request` (not forwarded) across the nodes its ids are on.
pub(super) async fn many_metrics(svc: &Sandboxes, request: Request, next: Next) -> Response {
    let ids = Query::<ManyMetricsQuery>::try_from_uri(request.uri()).map(|q| q.ids()).unwrap_or_default();
    // A query the handler refuses is its to answer.
    if ids.is_empty() || ids.len() > MAX_METRICS_IDS {
        return next.run(request).await;
    }
    let mut here = Vec::new();
    let mut there: BTreeMap<String, (NodeRecord, Vec<String>)> = BTreeMap::new();
    for id in ids {
        match svc.owner_of_sandbox(&id) {
            Ok(Owner::Here) => here.push(id),
            Ok(Owner::There(node)) => there.entry(node.id.clone()).or_insert_with(|| (node, Vec::new())).1.push(id),
            Ok(Owner::Lost { .. }) => {}
            Err(e) => return ApiError::from(SandboxError::from(e)).into_response(),
        }
    }
    if there.is_empty() {
        return next.run(with_ids(request, &here)).await;
    }
    let Some(peers) = request.extensions().get::<Peers>().cloned() else {
        return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "no way to reach other nodes").into_response();
    };
    let (parts, _) = request.into_parts();
    let from = svc.node().unwrap_or_default();
    let asked = there.into_values().map(|(node, ids)| {
        let request = with_ids(Request::from_parts(strip(&parts), Body::empty()), &ids);
        let peers = peers.clone();
        async move { send(&peers, from, &node, request).await }
    });
    let local = async {
        match here.is_empty() {
            true => None,
            false => Some(next.run(with_ids(Request::from_parts(parts.clone(), Body::empty()), &here)).await),
        }
    };
    let (local, remote) = tokio::join!(local, futures::future::join_all(asked));
    let mut merged = serde_json::Map::new();
    for response in local.into_iter().chain(remote) {
        if response.status() != StatusCode::OK {
            return response;
        }
        match sandboxes_of(response).await {
            Ok(sandboxes) => merged.extend(sandboxes),
            Err(e) => return ApiError::new(StatusCode::BAD_GATEWAY, e).into_response(),
        }
    }
    Json(serde_json::json!({ "sandboxes": merged })).into_response()
}

/// `parts` with only what a call to another node carries: method, URI and
/// headers (its credentials among them), none of this gateway's extensions.
fn strip(parts: &Parts) -> Parts {
    let mut copy = Request::new(());
    *copy.method_mut() = parts.method.clone();
    *copy.uri_mut() = parts.uri.clone();
    *copy.headers_mut() = parts.headers.clone();
    copy.into_parts().0
}

/// `request` asking for `ids` only.
fn with_ids(mut request: Request, ids: &[String]) -> Request {
    let query =
        url::form_urlencoded::Serializer::new(String::new()).append_pair("sandbox_ids", &ids.join(",")).finish();
    let path = request.uri().path().to_string();
    if let Ok(uri) = format!("{path}?{query}").parse::<Uri>() {
        *request.uri_mut() = uri;
    }
    request
}

async fn sandboxes_of(response: Response) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let body = axum::body::to_bytes(response.into_body(), MAX_REPLY)
        .await
        .map_err(|e| format!("reading a node's metrics: {e}"))?;
    let mut reply: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| format!("a node's metrics are not JSON: {e}"))?;
    match reply.get_mut("sandboxes").map(serde_json::Value::take) {
        Some(serde_json::Value::Object(sandboxes)) => Ok(sandboxes),
        _ => Err("a node's metrics name no sandboxes".into()),
    }
}
