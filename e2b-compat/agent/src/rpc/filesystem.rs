//! `filesystem.Filesystem` over Connect: request shapes (proto
//! `spec/envd/filesystem/filesystem.proto`, JSON form) and handlers.

use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::read_body;
use crate::auth::rpc_user;
use crate::connect::{self, Code, RpcError, StreamItem, StreamLimits};
use crate::filesystem::as_user;
use crate::filesystem::entry::entry_info;
use crate::filesystem::ops;
use crate::filesystem::watch::{self, FsEvent};
use crate::state::SharedState;
use crate::users::User;
use copse_protocol::json as protojson;

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PathRequest {
    #[serde(deserialize_with = "protojson::string_field")]
    path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ListDirRequest {
    #[serde(deserialize_with = "protojson::string_field")]
    path: String,
    #[serde(deserialize_with = "protojson::u32_field")]
    depth: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct MoveRequest {
    #[serde(deserialize_with = "protojson::string_field")]
    source: String,
    #[serde(deserialize_with = "protojson::string_field")]
    destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WatchRequest {
    #[serde(deserialize_with = "protojson::string_field")]
    path: String,
    #[serde(deserialize_with = "protojson::bool_field")]
    recursive: bool,
    #[serde(alias = "include_entry", rename = "includeEntry", deserialize_with = "protojson::bool_field")]
    include_entry: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WatcherIdRequest {
    #[serde(alias = "watcher_id", rename = "watcherId", deserialize_with = "protojson::string_field")]
    watcher_id: String,
}

/// Serves `/filesystem.Filesystem/<method>`.
pub async fn handle(state: SharedState, method: &str, headers: HeaderMap, body: Body) -> Response {
    if method == "WatchDir" {
        let limits = StreamLimits::from_headers(&headers);
        let result = async {
            let bytes = read_body(body).await?;
            let user = rpc_user(&state, &headers)?;
            let req: WatchRequest = connect::decode_request(true, &bytes)?;
            let root = resolve(&req.path, &user)?;
            // The watcher's inotify thread is started here, so it inherits
            // the user's credentials for its (recursive) watches.
            let (dir, recursive) = (root.clone(), req.recursive);
            let w = as_user::run(&user, move || watch::stream(&dir, recursive)).await.map_err(worker_failed)??;
            Ok::<_, RpcError>((w, root, req.include_entry))
        }
        .await;
        return match result {
            Ok((w, root, include)) => watch_stream(state, w, root, include, limits),
            Err(e) => connect::stream_error(e),
        };
    }
    let result = async {
        let bytes = read_body(body).await?;
        let user = rpc_user(&state, &headers)?;
        unary(&state, method, &user, &bytes).await
    }
    .await;
    match result {
        Ok(v) => connect::unary_ok(&v),
        Err(e) => e.into_response(),
    }
}

/// The user's credentials could not be taken, or the worker died.
fn worker_failed(e: std::io::Error) -> RpcError {
    RpcError::from_io(&e, "error accessing the filesystem as the user")
}

fn resolve(path: &str, user: &User) -> Result<PathBuf, RpcError> {
    crate::paths::resolve(path, user).map_err(RpcError::invalid)
}

async fn unary(state: &SharedState, method: &str, user: &User, body: &[u8]) -> Result<Value, RpcError> {
    let names = state.user_db().names();
    let decode_path = |body: &[u8]| -> Result<PathBuf, RpcError> {
        let req: PathRequest = connect::decode_request(false, body)?;
        resolve(&req.path, user)
    };
    let user = user.clone();
    let as_user = user.clone();
    let blocking = |f: Box<dyn FnOnce() -> Result<Value, RpcError> + Send>| async move {
        as_user::run(&as_user, f).await.map_err(worker_failed)?
    };
    match method {
        "Stat" => {
            let path = decode_path(body)?;
            blocking(Box::new(move || Ok(json!({ "entry": ops::stat(&path, &names)? })))).await
        }
        "ListDir" => {
            let req: ListDirRequest = connect::decode_request(false, body)?;
            let path = resolve(&req.path, &user)?;
            blocking(Box::new(move || Ok(json!({ "entries": ops::list_dir(&path, req.depth, &names)? })))).await
        }
        "MakeDir" => {
            let path = decode_path(body)?;
            blocking(Box::new(move || Ok(json!({ "entry": ops::make_dir(&path, &user, &names)? })))).await
        }
        "Move" => {
            let req: MoveRequest = connect::decode_request(false, body)?;
            let (src, dst) = (resolve(&req.source, &user)?, resolve(&req.destination, &user)?);
            blocking(Box::new(move || Ok(json!({ "entry": ops::rename(&src, &dst, &user, &names)? })))).await
        }
        "Remove" => {
            let path = decode_path(body)?;
            blocking(Box::new(move || ops::remove(&path).map(|()| json!({})))).await
        }
        "CreateWatcher" => {
            let req: WatchRequest = connect::decode_request(false, body)?;
            let root = resolve(&req.path, &user)?;
            let (state, recursive) = (state.clone(), req.recursive);
            let id =
                as_user::run(&user, move || state.watchers.create(&root, recursive)).await.map_err(worker_failed)??;
            Ok(json!({ "watcherId": id }))
        }
        "GetWatcherEvents" => {
            let req: WatcherIdRequest = connect::decode_request(false, body)?;
            let (_, events) = state.watchers.take(&req.watcher_id)?;
            let events: Vec<Value> = events.iter().map(|e| event_json(e, false, &names)).collect();
            Ok(json!({ "events": events }))
        }
        "RemoveWatcher" => {
            let req: WatcherIdRequest = connect::decode_request(false, body)?;
            state.watchers.remove(&req.watcher_id)?;
            Ok(json!({}))
        }
        _ => Err(RpcError::new(Code::Unimplemented, format!("unknown method filesystem.Filesystem/{method}"))),
    }
}

/// A `FilesystemEvent`, with the entry when asked for and still present.
fn event_json(e: &FsEvent, include_entry: bool, names: &crate::users::OwnerNames) -> Value {
    let mut v = json!({ "name": e.name, "type": e.kind });
    if include_entry && let Ok(entry) = entry_info(Path::new(&e.path), names) {
        v["entry"] = json!(entry);
    }
    v
}

/// WatchDir: `start`, then one `filesystem` message per change.
fn watch_stream(
    state: SharedState,
    mut w: watch::WatchStream,
    _root: PathBuf,
    include_entry: bool,
    limits: StreamLimits,
) -> Response {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        if tx.send(StreamItem::Message(json!({ "start": {} }))).await.is_err() {
            return;
        }
        let names = state.user_db().names();
        loop {
            tokio::select! {
                ev = w.next() => match ev {
                    Some(Ok(ev)) => {
                        let msg = json!({ "filesystem": event_json(&ev, include_entry, &names) });
                        if tx.send(StreamItem::Message(msg)).await.is_err() {
                            return;
                        }
                    }
                    Some(Err(msg)) => {
                        let _ = tx.send(StreamItem::Error(RpcError::internal(msg))).await;
                        return;
                    }
                    None => return,
                },
                // The client left: drop the watch.
                _ = tx.closed() => return,
            }
        }
    });
    connect::stream_response(rx, limits, json!({ "keepalive": {} }))
}
