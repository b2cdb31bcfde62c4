//! Starting a template's service (e.g. the code interpreter) inside a
//! freshly booted sandbox, through the agent like any user command, and
//! waiting until it answers — so whoever gets the sandbox can use it at once.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::body::Body;
use http_body_util::BodyExt;
use hyper::Request;

use crate::agent_link;
use crate::templates::Service;

/// Tag under which the service shows up in `commands.list()`.
const SERVICE_TAG: &str = "copse-service";
const READY_TIMEOUT: Duration = Duration::from_secs(120);

pub async fn start(agent_socket: &Path, service: &Service) -> anyhow::Result<()> {
    launch(agent_socket, service).await?;
    wait_ready(agent_socket, service).await
}

/// `Process.Start` as a background command: once the agent reports the
/// process started, the stream is dropped and the process lives on.
async fn launch(agent_socket: &Path, service: &Service) -> anyhow::Result<()> {
    let start = serde_json::json!({
        "process": { "cmd": "/bin/bash", "args": ["-c", service.command], "cwd": "/home/user" },
        "tag": SERVICE_TAG,
        "stdin": false,
    });
    let request = Request::post("/process.Process/Start")
        .header("host", "agent")
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(Body::from(envelope(&serde_json::to_vec(&start)?)))?;
    let response = agent_link::send(agent_socket, request).await?;
    if !response.status().is_success() {
        bail!("agent answered {} to Process.Start", response.status());
    }
    let mut body = response.into_body();
    let mut buffer = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            buffer.extend_from_slice(&data);
        }
        if let Some((flags, message)) = first_message(&buffer) {
            if flags & 0x02 != 0 {
                bail!("service did not start: {}", String::from_utf8_lossy(message));
            }
            return Ok(());
        }
    }
    bail!("agent closed the stream before the service started")
}

async fn wait_ready(agent_socket: &Path, service: &Service) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let status = probe(agent_socket, service).await?;
        if status.is_success() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("service on port {} not ready after {READY_TIMEOUT:?} (last status {status})", service.port);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether the service answers its health check right now.
pub async fn is_ready(agent_socket: &Path, service: &Service) -> bool {
    probe(agent_socket, service).await.is_ok_and(|status| status.is_success())
}

async fn probe(agent_socket: &Path, service: &Service) -> anyhow::Result<hyper::StatusCode> {
    let request = Request::get(service.health_path)
        .header("host", "agent")
        .header("e2b-sandbox-port", service.port.to_string())
        .body(Body::empty())?;
    Ok(agent_link::send(agent_socket, request).await.context("asking the agent")?.status())
}

/// A Connect streaming envelope: flags, big-endian length, message.
fn envelope(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn first_message(buffer: &[u8]) -> Option<(u8, &[u8])> {
    let length = u32::from_be_bytes(buffer.get(1..5)?.try_into().ok()?) as usize;
    Some((buffer[0], buffer.get(5..5 + length)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_round_trip() {
        let framed = envelope(b"{\"a\":1}");
        assert_eq!(&framed[..5], &[0, 0, 0, 0, 7]);
        assert_eq!(first_message(&framed), Some((0, &b"{\"a\":1}"[..])));
        assert_eq!(first_message(&framed[..6]), None);
    }
}
