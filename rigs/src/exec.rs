//! The first command of a new sandbox: `process.Process/Start` of
//! `/bin/true` through the gateway to the agent, as `copse-rig-create` and
//! `copse-rig-template` time it.

use std::time::Instant;

use anyhow::bail;
use copse_protocol::{ProcessEvent, ProcessStream, StartProcess, headers};
use http_body_util::BodyExt;
use hyper::StatusCode;
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
    let mut req = true_command().request(&conn.host())?;
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
    let mut stream = ProcessStream::new(resp.into_body());
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
