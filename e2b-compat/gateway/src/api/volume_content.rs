//! The volume content API (`/volumecontent/{id}/...`, what the SDK's
//! `E2B_VOLUME_API_URL` client calls), on the same listener. Its credential
//! is the volume's own token (`Authorization: Bearer`), not an API key; a
//! wrong token is answered as an unknown volume. Works whether or not a
//! sandbox mounts the volume: it is the same directory. File bodies are
//! streamed both ways, never held whole.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::control::rfc3339_ms;
use super::error::ApiError;
use crate::model::VolumeError;
use crate::service::Volumes;
use crate::volume_files::{Entry, FileError, Kind, Owner, VolumeFiles, write_error};

type ApiResult<T> = Result<T, ApiError>;

const READ_CHUNK: usize = 64 * 1024;

pub fn routes<S>(volumes: Arc<Volumes>) -> Router<S> {
    Router::new()
        .route("/volumecontent/{id}/file", get(read_file).put(write_file))
        .route("/volumecontent/{id}/dir", get(list_dir).post(make_dir))
        .route("/volumecontent/{id}/path", get(stat).patch(set_metadata).delete(remove))
        .with_state(volumes)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathQuery {
    path: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DirQuery {
    path: String,
    depth: Option<u32>,
}

/// Query of a write or a make-dir: ids and mode as the sandboxes see them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateQuery {
    path: String,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

impl CreateQuery {
    fn owner(&self) -> Owner {
        Owner { uid: self.uid, gid: self.gid, mode: self.mode }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MetadataBody {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

/// The SDK's `VolumeEntryStat`.
#[derive(Debug, Serialize)]
struct EntryStat {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    size: u64,
    mode: u32,
    uid: u32,
    gid: u32,
    atime: String,
    mtime: String,
    ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<String>,
}

fn wire(entry: Entry) -> EntryStat {
    EntryStat {
        name: entry.name,
        kind: match entry.kind {
            Kind::File => "file",
            Kind::Directory => "directory",
            Kind::Symlink => "symlink",
            Kind::Other => "unknown",
        },
        path: entry.path,
        size: entry.size,
        mode: entry.mode,
        uid: entry.uid,
        gid: entry.gid,
        atime: rfc3339_ms(entry.atime * 1000),
        mtime: rfc3339_ms(entry.mtime * 1000),
        ctime: rfc3339_ms(entry.ctime * 1000),
        target: entry.target,
    }
}

impl From<FileError> for ApiError {
    fn from(err: FileError) -> Self {
        let status = match &err {
            FileError::NotFound(_) => StatusCode::NOT_FOUND,
            FileError::Invalid(_) => StatusCode::BAD_REQUEST,
            FileError::Exists(_) => StatusCode::CONFLICT,
            FileError::Full => StatusCode::INSUFFICIENT_STORAGE,
            FileError::Io(..) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("volume content: {err}");
        }
        ApiError::new(status, err.to_string())
    }
}

/// The volume the request's bearer token opens.
async fn open(volumes: Arc<Volumes>, id: String, headers: &HeaderMap) -> ApiResult<VolumeFiles> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string)
        .ok_or_else(|| ApiError::new(StatusCode::UNAUTHORIZED, "missing 'Authorization: Bearer <volume token>'"))?;
    let call = crate::service::content_call().await;
    run(move || volumes.files(&id, &token).map(|files| files.during(call)).map_err(ApiError::from)).await
}

/// Directory walks and metadata calls block: off the async workers.
async fn run<T: Send + 'static>(call: impl FnOnce() -> ApiResult<T> + Send + 'static) -> ApiResult<T> {
    match tokio::task::spawn_blocking(call).await {
        Ok(result) => result,
        Err(panicked) => Err(VolumeError::Internal(panicked.into()).into()),
    }
}

async fn read_file(
    State(volumes): State<Arc<Volumes>>,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let files = open(volumes, id, &headers).await?;
    let file = run(move || Ok(files.open_read(&query.path)?)).await?;
    let length = file.metadata().map(|m| m.len()).ok();
    let file = tokio::fs::File::from_std(file);
    let chunks = futures::stream::unfold(Some(file), |file| async move {
        let mut file = file?;
        let mut buffer = vec![0; READ_CHUNK];
        match file.read(&mut buffer).await {
            Ok(0) => None,
            Ok(n) => {
                buffer.truncate(n);
                Some((Ok(bytes::Bytes::from(buffer)), Some(file)))
            }
            Err(e) => Some((Err(e), None)),
        }
    });
    let mut response = Response::new(Body::from_stream(chunks));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, "application/octet-stream".parse().expect("static"));
    if let Some(length) = length {
        headers.insert(header::CONTENT_LENGTH, length.into());
    }
    Ok(response)
}

async fn write_file(
    State(volumes): State<Arc<Volumes>>,
    Path(id): Path<String>,
    Query(query): Query<CreateQuery>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let files = open(volumes, id, &headers).await?;
    let mut stream = body.into_data_stream();
    let written = write_into(files, query, &mut stream).await;
    if written.is_err() {
        discard_rest(&mut stream).await;
    }
    written
}

/// The upload into its file; a refusal (a full volume refuses even the
/// file's creation) leaves the rest of the body to the caller to drain.
async fn write_into(
    files: VolumeFiles,
    query: CreateQuery,
    stream: &mut axum::body::BodyDataStream,
) -> ApiResult<Response> {
    let path = query.path.clone();
    let owner = query.owner();
    let (file, files) = run(move || Ok((files.open_write(&path, owner)?, files))).await?;
    let mut file = tokio::fs::File::from_std(file);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::bad_request(format!("reading the request body: {e}")))?;
        file.write_all(&chunk).await.map_err(|e| write_error(e, &query.path))?;
    }
    file.flush().await.map_err(|e| write_error(e, &query.path))?;
    file.sync_data().await.map_err(|e| write_error(e, &query.path))?;
    let entry = run(move || Ok(files.stat(&query.path)?)).await?;
    Ok((StatusCode::CREATED, Json(wire(entry))).into_response())
}

/// After a refused write (a full volume), what is left of the upload is
/// read and dropped, within bounds: answered early, a client still sending
/// sees its connection closed (a broken pipe) instead of the error.
async fn discard_rest(stream: &mut axum::body::BodyDataStream) {
    const LIMIT: usize = 256 << 20;
    const TIME: std::time::Duration = std::time::Duration::from_secs(10);
    let _ = tokio::time::timeout(TIME, async {
        let mut read = 0usize;
        while let Some(Ok(chunk)) = stream.next().await {
            read += chunk.len();
            if read >= LIMIT {
                break;
            }
        }
    })
    .await;
}

async fn list_dir(
    State(volumes): State<Arc<Volumes>>,
    Path(id): Path<String>,
    Query(query): Query<DirQuery>,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<EntryStat>>> {
    let files = open(volumes, id, &headers).await?;
    let entries = run(move || Ok(files.list(&query.path, query.depth.unwrap_or(1))?)).await?;
    Ok(Json(entries.into_iter().map(wire).collect()))
}

async fn make_dir(
    State(volumes): State<Arc<Volumes>>,
    Path(id): Path<String>,
    Query(query): Query<CreateQuery>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    let files = open(volumes, id, &headers).await?;
    let entry = run(move || Ok(files.make_dir(&query.path, query.owner(), query.force.unwrap_or(false))?)).await?;
    Ok((StatusCode::CREATED, Json(wire(entry))).into_response())
}

async fn stat(
    State(volumes): State<Arc<Volumes>>,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
) -> ApiResult<Json<EntryStat>> {
    let files = open(volumes, id, &headers).await?;
    Ok(Json(wire(run(move || Ok(files.stat(&query.path)?)).await?)))
}

async fn set_metadata(
    State(volumes): State<Arc<Volumes>>,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
    body: Option<Json<MetadataBody>>,
) -> ApiResult<Json<EntryStat>> {
    let files = open(volumes, id, &headers).await?;
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let owner = Owner { uid: body.uid, gid: body.gid, mode: body.mode };
    Ok(Json(wire(run(move || Ok(files.set_metadata(&query.path, owner)?)).await?)))
}

async fn remove(
    State(volumes): State<Arc<Volumes>>,
    Path(id): Path<String>,
    Query(query): Query<PathQuery>,
    headers: HeaderMap,
) -> ApiResult<StatusCode> {
    let files = open(volumes, id, &headers).await?;
    run(move || Ok(files.remove(&query.path)?)).await?;
    Ok(StatusCode::NO_CONTENT)
}
