//! The volumes routes (`/volumes`, as the SDK's `Volume` class calls them):
//! a volume's record and the token its content API demands.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};

use super::error::ApiError;
use super::wire;
use crate::model::{VolumeError, VolumeRecord};
use crate::service::Volumes;
use crate::tenancy::Principal;

type ApiResult<T> = Result<T, ApiError>;

pub fn routes<S>(volumes: Arc<Volumes>) -> Router<S> {
    Router::new()
        .route("/volumes", post(create).get(list))
        .route("/volumes/{id}", get(detail).delete(delete))
        .with_state(volumes)
}

async fn create(
    State(volumes): State<Arc<Volumes>>,
    Extension(who): Extension<Principal>,
    body: Option<Json<wire::NewVolume>>,
) -> ApiResult<Response> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be {name}"))?;
    let record = blocking(move || volumes.create(&who.caller, &body.name)).await?;
    Ok((StatusCode::CREATED, Json(with_token(&record))).into_response())
}

async fn detail(
    State(volumes): State<Arc<Volumes>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::VolumeAndToken>> {
    Ok(Json(with_token(&blocking(move || volumes.get(&who.caller, &id)).await?)))
}

async fn list(
    State(volumes): State<Arc<Volumes>>,
    Extension(who): Extension<Principal>,
) -> ApiResult<Json<Vec<wire::VolumeInfo>>> {
    let all = blocking(move || volumes.list(&who.caller)).await?;
    Ok(Json(all.into_iter().map(|r| wire::VolumeInfo { volume_id: r.id, name: r.name }).collect()))
}

async fn delete(
    State(volumes): State<Arc<Volumes>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    blocking(move || volumes.delete(&who.caller, &id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// SQLite and the substrate's ioctls block: off the async workers.
async fn blocking<T: Send + 'static>(call: impl FnOnce() -> Result<T, VolumeError> + Send + 'static) -> ApiResult<T> {
    match tokio::task::spawn_blocking(call).await {
        Ok(result) => Ok(result?),
        Err(panicked) => Err(VolumeError::Internal(panicked.into()).into()),
    }
}

fn with_token(record: &VolumeRecord) -> wire::VolumeAndToken {
    wire::VolumeAndToken { volume_id: record.id.clone(), name: record.name.clone(), token: record.token.clone() }
}
