//! HTTP/1.1 to a sandbox's agent over its unix socket.
//!
//! One connection per request: connecting a unix socket costs microseconds,
//! and it keeps a dead sandbox from poisoning a pool.

use std::path::Path;

use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

pub async fn send(socket: &Path, request: Request<Body>) -> anyhow::Result<Response<Incoming>> {
    let stream = UnixStream::connect(socket).await?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(async move {
        // Upgrades (WebSocket to a sandbox port) keep the connection open
        // as a raw byte stream once the agent answers 101.
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!("agent connection ended: {e}");
        }
    });
    Ok(sender.send_request(request).await?)
}

/// A small JSON call, for the gateway's own requests to the agent.
pub async fn post_json(socket: &Path, path: &str, body: &serde_json::Value) -> anyhow::Result<()> {
    let request = Request::post(path)
        .header("host", "agent")
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body)?))?;
    let response = send(socket, request).await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        anyhow::bail!("agent answered {status} to {path}: {}", String::from_utf8_lossy(&text));
    }
    Ok(())
}
