//! The run-code rig's requests, the decoding of the code interpreter's
//! `/execute` NDJSON stream (pure, unit-tested) and the lean create → first
//! result scenario, which `copse-rig-run-code` and `copse-rig-template` both
//! time. Gateways, the SDK and the result file live in the binaries.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use copse_protocol::headers;
use http_body_util::{BodyExt, Full};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::report::{Scenario, pool_miss_counters, server_timing, server_timing_series};
use crate::{Conn, ms};

/// The template `Sandbox.create()` of `e2b-code-interpreter` uses by default.
pub const TEMPLATE: &str = "code-interpreter-v1";
/// `POST /v2/sandboxes` body, as the SDK sends it for that template.
pub const CREATE_BODY: &str = r#"{"templateID":"code-interpreter-v1","metadata":{},"envVars":{}}"#;
/// The port the SDK addresses the code interpreter on (`E2b-Sandbox-Port`).
pub const JUPYTER_PORT: &str = "49999";
/// `POST /execute` body of `run_code("1+1")`: all keys present, as the SDK sends them.
pub const EXECUTE_BODY: &str = r#"{"code":"1+1","context_id":null,"language":null,"env_vars":null}"#;
/// The same call in a JavaScript context (`runCode("1+1", {language: "js"})`).
pub const EXECUTE_BODY_JS: &str = r#"{"code":"1+1","context_id":null,"language":"js","env_vars":null}"#;
/// The `text` of the main result `1+1` must produce.
pub const EXPECTED_TEXT: &str = "2";

/// Splits a byte stream into `\n`-terminated lines (a trailing `\r` is
/// dropped); feed body chunks as they arrive, take whole lines out.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
}

impl LineSplitter {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete line without its terminator, `None` if more bytes are needed.
    pub fn next_line(&mut self) -> Option<Vec<u8>> {
        let end = self.buf.iter().position(|b| *b == b'\n')?;
        let mut line: Vec<u8> = self.buf.drain(..=end).collect();
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        Some(line)
    }

    /// Bytes received but not yet part of a complete line (an unterminated
    /// last line, which the server should never send).
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }
}

/// What one `/execute` output line means to the rig.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecLine {
    /// `type: result`; `main` is `is_main_result` (an `execute_result`, not a `display_data`).
    Result {
        main: bool,
        text: Option<String>,
    },
    /// `type: error` (`name: value`).
    Error(String),
    Stdout,
    Stderr,
    ExecutionCount(Option<u64>),
    Keepalive,
    EndOfExecution,
    /// Any other `type` (kept so oddities can be reported).
    Other(String),
}

/// Interprets one NDJSON line; blank lines are `None`.
pub fn classify_line(line: &[u8]) -> anyhow::Result<Option<ExecLine>> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(line)
        .with_context(|| format!("execute output line is not JSON: {}", String::from_utf8_lossy(line)))?;
    let ty = v.get("type").and_then(Value::as_str).context("execute output line without a `type`")?;
    let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    Ok(Some(match ty {
        "result" => ExecLine::Result {
            main: v.get("is_main_result").and_then(Value::as_bool).unwrap_or(false),
            text: text("text"),
        },
        "error" => {
            ExecLine::Error(format!("{}: {}", text("name").unwrap_or_default(), text("value").unwrap_or_default()))
        }
        "stdout" => ExecLine::Stdout,
        "stderr" => ExecLine::Stderr,
        "number_of_executions" => ExecLine::ExecutionCount(v.get("execution_count").and_then(Value::as_u64)),
        "keepalive" => ExecLine::Keepalive,
        "end_of_execution" => ExecLine::EndOfExecution,
        other => ExecLine::Other(other.to_string()),
    }))
}

/// Checks a finished execution of `1+1`: no error, and a main result `2`.
pub fn check_outcome(main_text: Option<&str>, error: Option<&str>) -> anyhow::Result<()> {
    if let Some(e) = error {
        anyhow::bail!("run_code(\"1+1\") raised {e}");
    }
    match main_text {
        Some(EXPECTED_TEXT) => Ok(()),
        Some(t) => anyhow::bail!("run_code(\"1+1\") returned {t:?}, expected {EXPECTED_TEXT:?}"),
        None => anyhow::bail!("run_code(\"1+1\") ended without a main result"),
    }
}

// ---------------------------------------------------------------- lean client

/// One create → first result sample.
pub struct CreateSample {
    pub first_result_ms: f64,
    pub create_ms: f64,
    /// Create response read → main result line.
    pub execute_ms: f64,
    /// Create response read → `end_of_execution` line.
    pub execute_end_ms: f64,
    pub delete_ms: f64,
    pub server: Vec<(String, f64)>,
}

/// When the lines of one `/execute` stream arrived, relative to nothing (instants).
pub struct Execution {
    pub result_at: Instant,
    pub end_at: Instant,
    pub body_done_at: Instant,
}

/// `POST /execute` of `1+1` (`body`: Python's or JavaScript's), read to the
/// end of the body; checks the result.
pub async fn execute(conn: &mut Conn, id: &str, token: &str, body: &'static str) -> anyhow::Result<Execution> {
    let req = conn
        .request(Method::POST, "/execute")
        .header(headers::SANDBOX_ID, id)
        .header(headers::SANDBOX_PORT, JUPYTER_PORT)
        .header(headers::ACCESS_TOKEN, token)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))?;
    let resp = conn.send(req).await?;
    if resp.status() != StatusCode::OK {
        let st = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        bail!("execute: HTTP {st}: {}", String::from_utf8_lossy(&body));
    }
    let mut body = resp.into_body();
    let mut lines = LineSplitter::default();
    let (mut result_at, mut end_at) = (None, None);
    let (mut text, mut error) = (None::<String>, None::<String>);
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else { continue };
        lines.push(data);
        while let Some(line) = lines.next_line() {
            match classify_line(&line)? {
                Some(ExecLine::Result { main: true, text: t }) if result_at.is_none() => {
                    result_at = Some(Instant::now());
                    text = t;
                }
                Some(ExecLine::Error(e)) => error = Some(e),
                Some(ExecLine::EndOfExecution) => end_at = end_at.or(Some(Instant::now())),
                _ => {}
            }
        }
    }
    let body_done_at = Instant::now();
    if !lines.pending().is_empty() {
        bail!("execute: unterminated last line {:?}", String::from_utf8_lossy(lines.pending()));
    }
    check_outcome(text.as_deref(), error.as_deref())?;
    let end_at = end_at.context("execute: stream ended without end_of_execution")?;
    Ok(Execution { result_at: result_at.context("no main result")?, end_at, body_done_at })
}

/// create → first result → (untimed) delete.
pub async fn one_create(conn: &mut Conn, key: &str, body: &'static str) -> anyhow::Result<CreateSample> {
    let t0 = Instant::now();
    let created = conn.create_sandbox(key, CREATE_BODY).await?;
    let t_created = Instant::now();
    let exec = execute(conn, &created.id, &created.token, body).await;
    let t_del = Instant::now();
    let deleted = conn.delete_sandbox(key, &created.id).await;
    let delete_ms = ms(t_del.elapsed());
    let exec = exec?;
    deleted?;
    Ok(CreateSample {
        first_result_ms: ms(exec.result_at - t0),
        create_ms: ms(t_created - t0),
        execute_ms: ms(exec.result_at - t_created),
        execute_end_ms: ms(exec.end_at - t_created),
        delete_ms,
        server: created.server_timing,
    })
}

/// A scenario's name and the `/execute` body it sends.
#[derive(Clone, Copy)]
pub struct Calls<'a> {
    pub name: &'a str,
    pub body: &'static str,
}

/// `n` sequential create → first result samples on one connection
/// (after `warmup` untimed ones), `pace_ms` apart: the create scenario of
/// `copse-rig-run-code`, also timed by `copse-rig-template`.
pub async fn lean_create(
    Calls { name, body }: Calls<'_>,
    addr: SocketAddr,
    key: &str,
    pool: usize,
    n: usize,
    warmup: usize,
    pace_ms: Option<f64>,
) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(addr).await?;
    let pause = || async {
        if let Some(p) = pace_ms {
            tokio::time::sleep(Duration::from_secs_f64(p / 1000.0)).await;
        }
    };
    for _ in 0..warmup {
        if let Err(e) = one_create(&mut conn, key, body).await {
            eprintln!("{name}: warm-up sample failed: {e:#}");
        }
        pause().await;
    }
    let (mut samples, mut errors) = (Vec::new(), Vec::new());
    for i in 0..n {
        match one_create(&mut conn, key, body).await {
            Ok(s) => samples.push(s),
            Err(e) => errors.push(format!("sample {i}: {e:#}")),
        }
        pause().await;
    }
    let col = |f: &dyn Fn(&CreateSample) -> f64| samples.iter().map(|s| Some(f(s))).collect::<Vec<_>>();
    let mut series = BTreeMap::new();
    series.insert("first_result_ms".into(), col(&|s| s.first_result_ms));
    series.insert("create_ms".into(), col(&|s| s.create_ms));
    series.insert("execute_ms".into(), col(&|s| s.execute_ms));
    series.insert("execute_end_ms".into(), col(&|s| s.execute_end_ms));
    series.insert("delete_ms".into(), col(&|s| s.delete_ms));
    series.extend(server_timing_series(&samples.iter().map(|s| s.server.clone()).collect::<Vec<_>>()));
    series.insert(
        "api_overhead_ms".into(),
        samples.iter().map(|s| server_timing(&s.server, "total").map(|t| s.create_ms - t)).collect(),
    );
    let mut counters = serde_json::Map::new();
    counters.insert("ok".into(), json!(samples.len()));
    counters.insert("with_server_timing".into(), json!(samples.iter().filter(|s| !s.server.is_empty()).count()));
    counters.extend(pool_miss_counters(series.get("server_boot_ms").map_or(&[][..], Vec::as_slice)));
    Ok(Scenario {
        name: name.into(),
        client: "lean-rust".into(),
        concurrency: 1,
        pool: Some(pool),
        pace_ms,
        series,
        counters,
        errors,
        ..Scenario::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = "{\"type\": \"number_of_executions\", \"execution_count\": 1}\n\
                          {\"type\": \"result\", \"text\": \"2\", \"extra\": {}, \"is_main_result\": true}\n\
                          {\"type\": \"end_of_execution\"}\n";

    #[test]
    fn lines_across_chunks() {
        let mut s = LineSplitter::default();
        let mut items = Vec::new();
        for chunk in STREAM.as_bytes().chunks(7) {
            s.push(chunk);
            while let Some(line) = s.next_line() {
                items.extend(classify_line(&line).unwrap());
            }
        }
        assert!(s.pending().is_empty());
        assert_eq!(
            items,
            vec![
                ExecLine::ExecutionCount(Some(1)),
                ExecLine::Result { main: true, text: Some("2".into()) },
                ExecLine::EndOfExecution,
            ]
        );
    }

    #[test]
    fn crlf_blank_and_partial_lines() {
        let mut s = LineSplitter::default();
        s.push(b"{\"type\": \"keepalive\"}\r\n\n{\"type\": \"std");
        assert_eq!(classify_line(&s.next_line().unwrap()).unwrap(), Some(ExecLine::Keepalive));
        assert_eq!(classify_line(&s.next_line().unwrap()).unwrap(), None);
        assert_eq!(s.next_line(), None);
        assert_eq!(s.pending(), b"{\"type\": \"std");
        s.push(b"out\", \"text\": \"hi\\n\", \"timestamp\": \"t\"}\n");
        assert_eq!(classify_line(&s.next_line().unwrap()).unwrap(), Some(ExecLine::Stdout));
    }

    #[test]
    fn line_kinds() {
        let c = |s: &str| classify_line(s.as_bytes()).unwrap().unwrap();
        assert_eq!(
            c(r#"{"type":"result","png":"AAA","is_main_result":false}"#),
            ExecLine::Result { main: false, text: None }
        );
        assert_eq!(
            c(r#"{"type":"error","name":"NameError","value":"x","traceback":"..."}"#),
            ExecLine::Error("NameError: x".into())
        );
        assert_eq!(c(r#"{"type":"stderr","text":"w","timestamp":"t"}"#), ExecLine::Stderr);
        assert_eq!(c(r#"{"type":"number_of_executions"}"#), ExecLine::ExecutionCount(None));
        assert_eq!(c(r#"{"type":"surprise"}"#), ExecLine::Other("surprise".into()));
        assert!(classify_line(b"not json").is_err());
        assert!(classify_line(br#"{"text":"2"}"#).is_err());
    }

    #[test]
    fn outcomes() {
        assert!(check_outcome(Some("2"), None).is_ok());
        assert!(check_outcome(Some("3"), None).is_err());
        assert!(check_outcome(None, None).is_err());
        assert!(check_outcome(Some("2"), Some("KeyboardInterrupt: ")).is_err());
    }

    #[test]
    fn request_bodies_are_the_sdks() {
        let create: Value = serde_json::from_str(CREATE_BODY).unwrap();
        assert_eq!(create["templateID"], TEMPLATE);
        let exec: Value = serde_json::from_str(EXECUTE_BODY).unwrap();
        assert_eq!(exec["code"], "1+1");
        for k in ["context_id", "language", "env_vars"] {
            assert!(exec[k].is_null() && exec.get(k).is_some(), "{k}");
        }
    }
}
