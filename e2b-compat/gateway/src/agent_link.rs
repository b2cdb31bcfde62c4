//! HTTP/1.1 to a sandbox's agent over its unix socket.
//!
//! One connection per request: connecting a unix socket costs microseconds,
//! and it keeps a dead sandbox from poisoning a pool. Every connect goes
//! through `copse_host::AgentSocket`, which pins the socket the substrate
//! made, so a sandbox cannot point the gateway at another host socket.
//!
//! Every connection is registered under its socket, so a memory snapshot
//! can [`quiesce`] a sandbox: a checkpoint cannot hold a connection whose
//! other end is the gateway.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// Per socket: a gate new connections pass (closed while quiesced) and the
/// tasks driving the open ones.
#[derive(Default)]
struct Links {
    gate: Arc<tokio::sync::RwLock<()>>,
    open: Vec<tokio::task::AbortHandle>,
}

static LINKS: LazyLock<Mutex<HashMap<PathBuf, Links>>> = LazyLock::new(Default::default);

fn links<T>(socket: &Path, f: impl FnOnce(&mut Links) -> T) -> T {
    let mut all = LINKS.lock().unwrap_or_else(|p| p.into_inner());
    let links = all.entry(socket.to_path_buf()).or_default();
    links.open.retain(|task| !task.is_finished());
    let out = f(links);
    if links.open.is_empty() && Arc::strong_count(&links.gate) == 1 {
        all.remove(socket);
    }
    out
}

pub async fn send(socket: &Path, request: Request<Body>) -> anyhow::Result<Response<Incoming>> {
    let gate = links(socket, |l| l.gate.clone());
    let passed = gate.read().await;
    // The socket's directory is the sandbox's to write: never connect to
    // whatever it names there (a symlink to a host socket).
    let pinned = copse_host::AgentSocket::open(socket)?;
    let stream = UnixStream::connect(pinned.path()).await?;
    drop(pinned);
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let task = tokio::spawn(async move {
        // Upgrades (WebSocket to a sandbox port) keep the connection open
        // as a raw byte stream once the agent answers 101.
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!("agent connection ended: {e}");
        }
    });
    links(socket, |l| l.open.push(task.abort_handle()));
    drop(passed);
    Ok(sender.send_request(request).await?)
}

/// Closes every connection to `socket` and holds new ones back until the
/// returned guard is dropped. Streams in flight (a command's output, a
/// watch) end for their clients.
pub async fn quiesce(socket: &Path) -> tokio::sync::OwnedRwLockWriteGuard<()> {
    let gate = links(socket, |l| l.gate.clone());
    let closed = gate.write_owned().await;
    for task in links(socket, |l| std::mem::take(&mut l.open)) {
        task.abort();
    }
    closed
}

/// A small JSON call, for the gateway's own requests to the agent.
/// `token`: the access token the agent demands, if it has one.
pub async fn post_json(socket: &Path, path: &str, body: &serde_json::Value, token: Option<&str>) -> anyhow::Result<()> {
    let request = copse_protocol::client::json_request(path, body, token)?.map(Body::new);
    let response = send(socket, request).await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        anyhow::bail!("agent answered {status} to {path}: {}", String::from_utf8_lossy(&text));
    }
    Ok(())
}
