//! Starting a template's service (e.g. the code interpreter) inside a
//! freshly booted sandbox, through the agent like any command (as the
//! service's own account), and
//! waiting until it answers — so whoever gets the sandbox can use it at once.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use axum::body::Body;
use copse_protocol::client::AGENT_HOST;
use copse_protocol::headers::SANDBOX_PORT;
use copse_protocol::{ProcessStream, StartProcess};
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
    let start = StartProcess::shell("/bin/bash", &service.command).cwd("/").user(&service.user).tag(SERVICE_TAG);
    let request = start.request(AGENT_HOST)?.map(Body::new);
    let response = agent_link::send(agent_socket, request).await?;
    if !response.status().is_success() {
        bail!("agent answered {} to Process.Start", response.status());
    }
    match ProcessStream::new(response.into_body()).next().await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => bail!("service did not start: the agent ended the stream"),
        Err(e) => bail!("service did not start: {e}"),
    }
}

pub async fn wait_ready(agent_socket: &Path, service: &Service) -> anyhow::Result<()> {
    wait_for(agent_socket, service, &service.health_path).await
}

async fn wait_for(agent_socket: &Path, service: &Service, path: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let status = probe(agent_socket, service, path).await?;
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
    probe(agent_socket, service, &service.health_path).await.is_ok_and(|status| status.is_success())
}

async fn probe(agent_socket: &Path, service: &Service, path: &str) -> anyhow::Result<hyper::StatusCode> {
    let request = Request::get(path)
        .header("host", AGENT_HOST)
        .header(SANDBOX_PORT, service.port.to_string())
        .body(Body::empty())?;
    Ok(agent_link::send(agent_socket, request).await.context("asking the agent")?.status())
}
