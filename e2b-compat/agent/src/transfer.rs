//! `GET /files` and `POST /files` (envd `api/download.go`, `api/upload.go`):
//! raw file transfer, streamed in both directions — a file is never held in
//! memory whole. Errors use envd's `{"code": <status>, "message": ...}`.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::TryStreamExt;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::io::{ReaderStream, StreamReader};

use crate::auth::{SignedQuery, check_files_access, json_error};
use crate::filesystem::{as_user, open, xattr};
use crate::state::SharedState;
use crate::users::User;

const METADATA_HEADER_PREFIX: &str = "x-metadata-";

/// A failed transfer: HTTP status and message.
#[derive(Debug)]
pub struct FileError(StatusCode, String);

impl IntoResponse for FileError {
    fn into_response(self) -> Response {
        json_error(self.0, self.1)
    }
}

fn bad_request(msg: impl Into<String>) -> FileError {
    FileError(StatusCode::BAD_REQUEST, msg.into())
}

fn internal(msg: impl Into<String>) -> FileError {
    FileError(StatusCode::INTERNAL_SERVER_ERROR, msg.into())
}

/// Access check and user lookup shared by both directions.
fn authorize(state: &SharedState, headers: &HeaderMap, q: &SignedQuery, operation: &str) -> Result<User, FileError> {
    check_files_access(state, headers, q, operation).map_err(|m| FileError(StatusCode::UNAUTHORIZED, m))?;
    state.user(q.username.as_deref()).map_err(|m| FileError(StatusCode::UNAUTHORIZED, m))
}

fn resolve(path: &str, user: &User) -> Result<PathBuf, FileError> {
    crate::paths::resolve(path, user).map_err(|e| bad_request(format!("error resolving path '{path}': {e}")))
}

pub async fn download(State(state): State<SharedState>, Query(q): Query<SignedQuery>, headers: HeaderMap) -> Response {
    match download_inner(&state, &q, &headers).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn download_inner(state: &SharedState, q: &SignedQuery, headers: &HeaderMap) -> Result<Response, FileError> {
    let user = authorize(state, headers, q, "read")?;
    let path = resolve(q.path.as_deref().unwrap_or(""), &user)?;
    let target = path.clone();
    let file = as_user::run(&user, move || open::regular_for_reading(&target))
        .await
        .map_err(|e| file_error("error accessing the file as the user", &e))?
        .map_err(|e| file_error(&format!("error opening file '{}'", path.display()), &e))?;
    let len = file.metadata().map_err(|e| internal(format!("error reading file '{}': {e}", path.display())))?.len();
    let body = Body::from_stream(ReaderStream::with_capacity(tokio::fs::File::from_std(file), 64 << 10));
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream".to_string()), (header::CONTENT_LENGTH, len.to_string())],
        body,
    )
        .into_response())
}

/// An I/O failure as envd's status: missing 404, not the user's to open
/// 403, not a regular file or not a directory 400, disk full 507.
fn file_error(what: &str, e: &io::Error) -> FileError {
    let status = match e.kind() {
        io::ErrorKind::NotFound => StatusCode::NOT_FOUND,
        io::ErrorKind::PermissionDenied => StatusCode::FORBIDDEN,
        io::ErrorKind::IsADirectory | io::ErrorKind::NotADirectory | io::ErrorKind::InvalidInput => {
            StatusCode::BAD_REQUEST
        }
        // A full disk or a spent quota is E2B's 507, which its SDKs raise as
        // `NotEnoughSpaceException`.
        _ if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) => StatusCode::INSUFFICIENT_STORAGE,
        _ if e.raw_os_error() == Some(libc::ELOOP) => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let msg = match status {
        StatusCode::INSUFFICIENT_STORAGE => format!("not enough disk space available: {e}"),
        _ => format!("{what}: {e}"),
    };
    FileError(status, msg)
}

/// One written file, as the SDK's `WriteInfo` expects it.
#[derive(Debug, Serialize)]
struct Written {
    name: String,
    #[serde(rename = "type")]
    kind: &'static str,
    path: String,
    #[serde(skip_serializing_if = "HashMap::is_empty")]
    metadata: HashMap<String, String>,
}

pub async fn upload(
    State(state): State<SharedState>,
    Query(q): Query<SignedQuery>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match upload_inner(&state, &q, &headers, body).await {
        Ok(written) => (StatusCode::OK, axum::Json(written)).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn upload_inner(
    state: &SharedState,
    q: &SignedQuery,
    headers: &HeaderMap,
    body: Body,
) -> Result<Vec<Written>, FileError> {
    let user = authorize(state, headers, q, "write")?;
    let metadata = metadata_headers(headers);
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let gzip = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("gzip"));
    let stream = body.into_data_stream().map_err(io::Error::other);
    let reader = StreamReader::new(stream);
    let reader: Box<dyn AsyncRead + Send + Unpin> =
        if gzip { Box::new(async_compression::tokio::bufread::GzipDecoder::new(reader)) } else { Box::new(reader) };
    let media = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();

    if media == "application/octet-stream" {
        let target =
            q.path.as_deref().ok_or_else(|| bad_request("path query parameter is required for raw body upload"))?;
        let path = resolve(target, &user)?;
        write_file(&path, &user, reader, &metadata).await?;
        return Ok(vec![written(&path, metadata)]);
    }
    if !media.starts_with("multipart/") {
        return Err(bad_request(format!(
            "unsupported content type: {content_type}, expected multipart/form-data or application/octet-stream"
        )));
    }
    let boundary =
        multer::parse_boundary(content_type).map_err(|e| bad_request(format!("error parsing multipart form: {e}")))?;
    let mut form = multer::Multipart::new(ReaderStream::new(reader), boundary);
    let mut out: Vec<Written> = Vec::new();
    while let Some(field) = form.next_field().await.map_err(|e| bad_request(format!("error reading form: {e}")))? {
        if field.name() != Some("file") {
            continue;
        }
        // `?path=` wins (single-file uploads); otherwise the part's filename
        // carries the full target path.
        let target = match (&q.path, field.file_name()) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) => f.replace("%22", "\""),
            (None, None) => return Err(bad_request("multipart part has no filename")),
        };
        let path = resolve(&target, &user)?;
        if out.iter().any(|w| Path::new(&w.path) == path) {
            return Err(bad_request(format!(
                "you cannot upload multiple files to the same path '{}' in one upload request",
                path.display()
            )));
        }
        let part = StreamReader::new(field.map_err(io::Error::other));
        write_file(&path, &user, part, &metadata).await?;
        out.push(written(&path, metadata.clone()));
    }
    if out.is_empty() {
        return Err(bad_request("no file parts in the multipart form"));
    }
    Ok(out)
}

fn written(path: &Path, metadata: HashMap<String, String>) -> Written {
    Written {
        name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        kind: "file",
        path: path.display().to_string(),
        metadata,
    }
}

/// `X-Metadata-<key>: <value>` headers, keys lowercased.
fn metadata_headers(headers: &HeaderMap) -> HashMap<String, String> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            let key = name.as_str().strip_prefix(METADATA_HEADER_PREFIX)?;
            Some((key.to_string(), value.to_str().ok()?.to_string()))
        })
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

/// Streams `data` into `path` (created or truncated, a regular file only),
/// opened as `user` so that it is theirs and so that a planted symlink
/// reaches only what they may write, with missing parent directories
/// created for them.
async fn write_file<R: AsyncRead + Unpin>(
    path: &Path,
    user: &User,
    mut data: R,
    metadata: &HashMap<String, String>,
) -> Result<(), FileError> {
    let (target, uid, gid) = (path.to_path_buf(), user.uid, user.gid);
    let file = as_user::run(user, move || {
        let parent = target.parent().unwrap_or(Path::new("/"));
        crate::paths::ensure_dirs(parent, uid, gid).map_err(|e| file_error("error ensuring directories", &e))?;
        open::regular_for_writing(&target).map_err(|e| file_error("error opening file", &e))
    })
    .await
    .map_err(|e| file_error("error accessing the file as the user", &e))??;
    let mut file = tokio::fs::File::from_std(file);

    if let Err(e) = stream_into(&mut file, &mut data).await {
        // A half-written file is of no use to anyone, and one cut short by
        // the disk quota would leave the sandbox's disk full.
        // Removed as the user, so a directory swapped for a symlink meanwhile
        // cannot point root's unlink elsewhere.
        drop(file);
        let target = path.to_path_buf();
        let _ = as_user::run(user, move || std::fs::remove_file(&target)).await;
        return Err(e);
    }
    if !metadata.is_empty() {
        let (target, metadata) = (path.to_path_buf(), metadata.clone());
        let stored = as_user::run(user, move || xattr::write_metadata(&target, &metadata)).await;
        if let Err(e) = stored.and_then(|r| r) {
            // Filesystems without user xattrs: the file is written, only its
            // metadata is lost; say so in the log rather than fail the upload.
            tracing::warn!(path = %path.display(), error = %e, "could not store file metadata");
        }
    }
    Ok(())
}

async fn stream_into<R: AsyncRead + Unpin>(file: &mut tokio::fs::File, data: &mut R) -> Result<(), FileError> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = data.read(&mut buf).await.map_err(|e| bad_request(format!("error reading upload: {e}")))?;
        if n == 0 {
            break;
        }
        file.write_all(&buf[..n]).await.map_err(|e| file_error("error writing file", &e))?;
    }
    file.flush().await.map_err(|e| file_error("error writing file", &e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_comes_from_x_metadata_headers() {
        let mut h = HeaderMap::new();
        h.insert("X-Metadata-Owner", "alice".parse().unwrap());
        h.insert("x-other", "no".parse().unwrap());
        let m = metadata_headers(&h);
        assert_eq!(m.len(), 1);
        assert_eq!(m["owner"], "alice");
    }

    #[test]
    fn a_spent_quota_or_a_full_disk_is_insufficient_storage() {
        for errno in [libc::EDQUOT, libc::ENOSPC] {
            let FileError(status, message) = file_error("error writing file", &io::Error::from_raw_os_error(errno));
            assert_eq!(status, StatusCode::INSUFFICIENT_STORAGE, "{message}");
        }
        let FileError(status, _) = file_error("x", &io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[tokio::test]
    async fn a_write_that_fails_midway_reports_the_disk() {
        // /dev/full fails every write with ENOSPC, as a full disk does.
        let mut file = tokio::fs::OpenOptions::new().write(true).open("/dev/full").await.unwrap();
        let mut data = &vec![1u8; 1 << 20][..];
        let FileError(status, _) = stream_into(&mut file, &mut data).await.unwrap_err();
        assert_eq!(status, StatusCode::INSUFFICIENT_STORAGE);
    }
}
