//! The secrets routes (`/secrets`, as the SDK's `Secret` class calls them).
//! Every answer is a [`wire::SecretInfo`]: values go in and never come out.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json};

use super::control::{next_token_header, paginate, rfc3339_ms};
use super::error::ApiError;
use super::wire;
use crate::model::{SecretError, SecretRecord};
use crate::service::Secrets;
use crate::tenancy::Principal;

type ApiResult<T> = Result<T, ApiError>;

pub fn routes<S>(secrets: Arc<Secrets>) -> Router<S> {
    Router::new()
        .route("/secrets", post(create).get(list))
        .route("/secrets/{id}", get(detail).post(update).delete(delete))
        .with_state(secrets)
}

async fn create(
    State(secrets): State<Arc<Secrets>>,
    Extension(who): Extension<Principal>,
    body: Option<Json<wire::NewSecret>>,
) -> ApiResult<Response> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be {name, value[, metadata]}"))?;
    let record =
        blocking(move || secrets.create(&who.caller, &body.name, &body.value, body.metadata.unwrap_or_default()))
            .await?;
    Ok((StatusCode::CREATED, Json(info(&record))).into_response())
}

async fn update(
    State(secrets): State<Arc<Secrets>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::SecretUpdate>>,
) -> ApiResult<Json<wire::SecretInfo>> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be {value[, metadata]}"))?;
    let record = blocking(move || secrets.update(&who.caller, &id, &body.value, body.metadata)).await?;
    Ok(Json(info(&record)))
}

async fn detail(
    State(secrets): State<Arc<Secrets>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::SecretInfo>> {
    Ok(Json(info(&blocking(move || secrets.get(&who.caller, &id)).await?)))
}

async fn list(
    State(secrets): State<Arc<Secrets>>,
    Extension(who): Extension<Principal>,
    Query(query): Query<wire::SecretsQuery>,
) -> ApiResult<Response> {
    let all = blocking(move || secrets.list(&who.caller)).await?;
    let (page, next) = paginate(&all, |r| &r.id, query.limit, query.next_token.as_deref());
    let page: Vec<wire::SecretInfo> = page.iter().map(info).collect();
    Ok((next_token_header(next), Json(page)).into_response())
}

async fn delete(
    State(secrets): State<Arc<Secrets>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    blocking(move || secrets.delete(&who.caller, &id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// SQLite and the keyring's lock block: off the async workers.
async fn blocking<T: Send + 'static>(call: impl FnOnce() -> Result<T, SecretError> + Send + 'static) -> ApiResult<T> {
    match tokio::task::spawn_blocking(call).await {
        Ok(result) => Ok(result?),
        Err(panicked) => Err(SecretError::Internal(panicked.into()).into()),
    }
}

fn info(record: &SecretRecord) -> wire::SecretInfo {
    wire::SecretInfo {
        secret_id: record.id.clone(),
        name: record.name.clone(),
        current_version: record.current_version(),
        metadata: record.metadata.clone(),
        created_at: rfc3339_ms(record.created_at_ms),
        updated_at: rfc3339_ms(record.updated_at_ms),
    }
}
