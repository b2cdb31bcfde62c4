//! Volumes on a cluster. A volume's bytes live on the node that made it
//! (`VolumeRecord::node`), so a sandbox mounting it runs there, its content
//! API is served there, and deleting it happens there: any gateway passes
//! those calls on (`forward.rs`). A volume that left a drained node and
//! waits in the object store goes with the first node that needs it
//! (`service/volume_moves.rs`). Reading and listing volume records needs
//! no particular node.

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::Response;

use super::error::ApiError;
use super::forward::where_token_says;
use crate::model::{Caller, SandboxError};
use crate::service::{Owner, Sandboxes, Volumes};

/// Where a create whose body is `body` must run because of the volumes it
/// mounts; `None` when it mounts none of the caller's (placement decides,
/// and the create refuses a volume it does not find).
pub(super) fn create_owner(
    svc: &Sandboxes,
    volumes: &Volumes,
    caller: &Caller,
    body: &serde_json::Value,
) -> Result<Option<Owner>, ApiError> {
    let names: Vec<String> = body
        .get("volumeMounts")
        .and_then(|m| m.as_array())
        .into_iter()
        .flatten()
        .filter_map(|m| m.get("name")?.as_str().map(str::to_string))
        .collect();
    if names.is_empty() {
        return Ok(None);
    }
    let nodes: Vec<String> = volumes.nodes_of(caller, &names)?.into_iter().collect();
    let node = match nodes.as_slice() {
        [] => return Ok(None),
        [node] => node.clone(),
        _ => {
            return Err(ApiError::bad_request(format!(
                "the volumes to mount are on different nodes ({}); a sandbox mounts volumes of one node only",
                nodes.join(", ")
            )));
        }
    };
    let owner = svc.owner(Some(&node)).map_err(SandboxError::from)?;
    if !svc.takes_sandboxes(&owner).map_err(SandboxError::from)? && !matches!(owner, Owner::Lost { .. }) {
        return Err(SandboxError::Unavailable(format!(
            "its volumes are on node {node}, which is draining and takes no new sandboxes"
        ))
        .into());
    }
    Ok(Some(owner))
}

/// Where `DELETE /volumes/{id}` runs: the node holding the volume.
pub(super) fn delete_owner(request: &Request, volumes: &Volumes, caller: &Caller) -> Option<(String, Option<String>)> {
    let matched = request.extensions().get::<MatchedPath>()?.as_str();
    if request.method() != Method::DELETE || matched != "/volumes/{id}" {
        return None;
    }
    let id = request.uri().path().rsplit('/').next()?.to_string();
    let node = volumes.get(caller, &id).ok()?.node;
    Some((id, node))
}

/// The content API's part: a call for a volume another node holds goes to
/// that node. The token is checked first, so a caller without it learns
/// nothing, not even which node a volume is on.
pub async fn content(State(svc): State<Arc<Sandboxes>>, request: Request, next: Next) -> Response {
    where_token_says(&svc, request, next, |request| {
        let id = request.uri().path().split('/').nth(2).unwrap_or_default();
        let token = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        let volumes = request.extensions().get::<Arc<Volumes>>()?;
        Some((format!("volume {id}"), volumes.node_for_content(id, token).map_err(ApiError::from)))
    })
    .await
}
