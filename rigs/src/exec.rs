//! Commands in a sandbox through the gateway (`process.Process/Start`):
//! the first command of a new sandbox, `/bin/true`, as `copse-rig-create`
//! and `copse-rig-template` time it, and a command run to its end for what
//! it prints (`copse-rig-egress`'s probes).

use std::time::Instant;

use anyhow::bail;
use copse_protocol::{Output, ProcessEvent, ProcessStream, StartProcess, headers};
use http_body_util::BodyExt;
use hyper::StatusCode;
use hyper::body::Incoming;
use hyper::header::HeaderValue;

use crate::Conn;

/// The command every sample runs: `/bin/true`, no stdin.
pub fn true_command() -> StartProcess {
    StartProcess::new("/bin/true", Vec::<String>::new())
}

/// `process.Process/Start` of `/bin/true`. Returns the instant its `end`
/// event arrived; the rest of the stream (the end-of-stream envelope) is read
/// after that instant so the connection stays reusable.
pub async fn first_exec(conn: &mut Conn, id: &str, token: &str) -> anyhow::Result<(Instant, Instant)> {
    let mut stream = start(conn, id, token, &true_command()).await?;
    let mut started: Option<Instant> = None;
    let mut ended: Option<(i64, Option<String>)> = None;
    while ended.is_none() {
        match stream.next().await.map_err(|e| anyhow::anyhow!("Process/Start stream: {e}"))? {
            Some(ProcessEvent::Start { .. }) => started = started.or(Some(Instant::now())),
            Some(ProcessEvent::End { exit_code, error }) => ended = Some((exit_code, error)),
            Some(_) => {}
            None => break,
        }
    }
    let t_end = Instant::now();
    let Some((code, error)) = ended else { bail!("Process/Start stream ended without an end event") };
    let Some(t_start) = started else { bail!("Process/Start: end event without a start event") };
    if code != 0 || error.is_some() {
        bail!("/bin/true exited {code} (error {error:?})");
    }
    stream.drain().await?;
    Ok((t_start, t_end))
}

/// Runs `command` in sandbox `id` to its end and returns what it printed.
pub async fn output(conn: &mut Conn, id: &str, token: &str, command: &StartProcess) -> anyhow::Result<Output> {
    Ok(start(conn, id, token, command).await?.output().await?)
}

/// `process.Process/Start` of `command` through the gateway, its stream
/// ready to read.
async fn start(
    conn: &mut Conn,
    id: &str,
    token: &str,
    command: &StartProcess,
) -> anyhow::Result<ProcessStream<Incoming>> {
    let mut req = command.request(&conn.host())?;
    for (name, value) in [
        (headers::SANDBOX_ID, id),
        (headers::SANDBOX_PORT, &headers::AGENT_PORT.to_string()),
        (headers::ACCESS_TOKEN, token),
        ("connect-content-encoding", "identity"),
        ("connect-accept-encoding", "identity"),
    ] {
        req.headers_mut().insert(name, HeaderValue::from_str(value)?);
    }
    let resp = conn.send(req).await?;
    if resp.status() != StatusCode::OK {
        let st = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        bail!("Process/Start: HTTP {st}: {}", String::from_utf8_lossy(&body));
    }
    Ok(ProcessStream::new(resp.into_body()))
}
