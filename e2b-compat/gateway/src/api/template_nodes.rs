//! Template builds on a cluster. A build runs on the node that received
//! its `POST /v3/templates` (`TemplateRecord::node`): its copy steps' files
//! are uploaded there, its steps run in a sandbox there, and its image and
//! layers stay there. So the calls that feed or start a build, and a
//! delete (which removes the image), are passed to that node by whichever
//! gateway receives them (`forward.rs`), the upload link too: a load
//! balancer may spread one `Template.build` over several gateways. A
//! snapshot deleted as a template (E2B's way) goes to its node the same
//! way. Status, logs, lists, tags and aliases read records, which any
//! gateway has.

use std::sync::Arc;

use axum::extract::{MatchedPath, Query, Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::Response;

use super::error::ApiError;
use super::forward::where_token_says;
use crate::model::Caller;
use crate::service::Sandboxes;

/// For a call about one template that must run where it is built: its id
/// as the path gives it, and the node building it.
pub(super) fn build_call_owner(
    svc: &Sandboxes,
    request: &Request,
    caller: &Caller,
) -> Option<(String, Option<String>)> {
    let matched = request.extensions().get::<MatchedPath>()?.as_str();
    let build_call = matches!(
        (request.method(), matched),
        (&Method::GET, "/templates/{id}/files/{hash}")
            | (&Method::POST, "/v2/templates/{id}/builds/{build_id}")
            | (&Method::DELETE, "/templates/{id}")
    );
    if !build_call {
        return None;
    }
    let at = matched.split('/').position(|segment| segment == "{id}")?;
    let id = request.uri().path().split('/').nth(at)?.to_string();
    let node = match svc.built_template(caller, &id) {
        Ok(built) => built.node,
        // E2B deletes a snapshot as a template: its files are on its node.
        Err(_) if request.method() == Method::DELETE => svc.snapshot_node(caller, &id)?,
        Err(_) => return None,
    };
    Some((id, node))
}

#[derive(serde::Deserialize)]
struct UploadQuery {
    token: String,
}

/// The upload link's part: files for a build another node runs go to that
/// node. The upload token is checked first, so a caller without it learns
/// nothing of where a template is built.
pub async fn upload(State(svc): State<Arc<Sandboxes>>, request: Request, next: Next) -> Response {
    where_token_says(&svc, request, next, |request| {
        let id = request.uri().path().split('/').nth(3).unwrap_or_default();
        let Query(query) = Query::<UploadQuery>::try_from_uri(request.uri()).ok()?;
        Some((format!("template {id}"), svc.upload_node(id, &query.token).map_err(ApiError::from)))
    })
    .await
}
