//! `process.Process` over Connect: request/response shapes (proto
//! `spec/envd/process/process.proto` in its JSON form) and the handlers.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::read_body;
use crate::auth::rpc_user;
use crate::process::handle::{Event, InputError, Output, Process, ProcessConfig};
use crate::process::spawn::{SpawnPlan, environment};
use crate::process::status::EndInfo;
use crate::process::{Selector, signal_group};
use copse_protocol::envelope::{EnvelopeDecoder, FLAG_END_STREAM, encode_envelope};
use copse_protocol::headers::CONTENT_TYPE_STREAM;

use crate::connect::{self, Code, RpcError, StreamItem, StreamLimits};
use crate::state::SharedState;
use copse_protocol::json as protojson;

// ---- requests ----

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ProcessConfigMsg {
    #[serde(deserialize_with = "protojson::string_field")]
    cmd: String,
    #[serde(deserialize_with = "protojson::strings_field")]
    args: Vec<String>,
    #[serde(deserialize_with = "protojson::string_map_field")]
    envs: HashMap<String, String>,
    cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PtySize {
    #[serde(deserialize_with = "protojson::u32_field")]
    cols: u32,
    #[serde(deserialize_with = "protojson::u32_field")]
    rows: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct PtyMsg {
    size: Option<PtySize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StartRequest {
    process: Option<ProcessConfigMsg>,
    pty: Option<PtyMsg>,
    tag: Option<String>,
    #[serde(deserialize_with = "protojson::opt_bool_field")]
    stdin: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SelectorMsg {
    #[serde(deserialize_with = "protojson::opt_u32_field")]
    pid: Option<u32>,
    tag: Option<String>,
}

impl SelectorMsg {
    fn selector(&self) -> Result<Selector, RpcError> {
        match (self.pid, &self.tag) {
            (Some(pid), _) => Ok(Selector::Pid(pid)),
            (None, Some(tag)) => Ok(Selector::Tag(tag.clone())),
            (None, None) => Err(RpcError::invalid("process selector needs a pid or a tag")),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct ProcessOnly {
    process: Option<SelectorMsg>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct InputMsg {
    #[serde(deserialize_with = "protojson::bytes_field")]
    stdin: Option<Vec<u8>>,
    #[serde(deserialize_with = "protojson::bytes_field")]
    pty: Option<Vec<u8>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendInputRequest {
    process: Option<SelectorMsg>,
    input: Option<InputMsg>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputRequest {
    start: Option<ProcessOnly>,
    data: Option<StreamInputData>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct StreamInputData {
    input: Option<InputMsg>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct SendSignalRequest {
    process: Option<SelectorMsg>,
    #[serde(deserialize_with = "signal_field")]
    signal: i32,
}

fn signal_field<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    let v = Value::deserialize(d)?;
    protojson::enum_value(&v, &[("SIGNAL_UNSPECIFIED", 0), ("SIGNAL_SIGTERM", 15), ("SIGNAL_SIGKILL", 9)])
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct UpdateRequest {
    process: Option<SelectorMsg>,
    pty: Option<PtyMsg>,
}

// ---- responses ----

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ProcessConfigOut<'a> {
    cmd: &'a str,
    args: &'a [String],
    envs: &'a HashMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cwd: Option<&'a str>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ProcessInfoOut<'a> {
    config: ProcessConfigOut<'a>,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tag: Option<&'a str>,
}

/// A `ProcessEvent` wrapped as Start/Connect responses carry it.
fn event_message(event: Value) -> Value {
    json!({ "event": event })
}

fn data_event(output: &Output) -> Value {
    let (key, bytes) = match output {
        Output::Stdout(b) => ("stdout", b),
        Output::Stderr(b) => ("stderr", b),
        Output::Pty(b) => ("pty", b),
    };
    json!({ "data": { key: protojson::encode_base64(bytes) } })
}

fn end_event(end: &EndInfo) -> Value {
    let mut e = json!({ "exitCode": end.exit_code, "exited": end.exited, "status": end.status });
    if let Some(err) = &end.error {
        e["error"] = Value::from(err.clone());
    }
    json!({ "end": e })
}

fn keepalive_message() -> Value {
    event_message(json!({ "keepalive": {} }))
}

// ---- dispatch ----

/// Serves `/process.Process/<method>`.
pub async fn handle(state: SharedState, method: &str, headers: HeaderMap, body: Body) -> Response {
    match method {
        "Start" | "Connect" => {
            let limits = StreamLimits::from_headers(&headers);
            let result = async {
                let bytes = read_body(body).await?;
                if method == "Start" {
                    start(&state, &headers, connect::decode_request(true, &bytes)?, limits)
                } else {
                    attach(&state, connect::decode_request::<ProcessOnly>(true, &bytes)?)
                }
            }
            .await;
            match result {
                Ok((pid, events)) => stream_events(pid, events, limits),
                Err(e) => connect::stream_error(e),
            }
        }
        "StreamInput" => match stream_input(&state, body).await {
            Ok(()) => stream_input_ok(),
            Err(e) => connect::stream_error(e),
        },
        _ => {
            let result = async {
                let bytes = read_body(body).await?;
                match method {
                    "List" => Ok(list(&state)),
                    "SendInput" => send_input(&state, connect::decode_request(false, &bytes)?).await,
                    "SendSignal" => send_signal(&state, connect::decode_request(false, &bytes)?),
                    "CloseStdin" => close_stdin(&state, connect::decode_request(false, &bytes)?).await,
                    "Update" => update(&state, connect::decode_request(false, &bytes)?),
                    _ => Err(RpcError::new(Code::Unimplemented, format!("unknown method process.Process/{method}"))),
                }
            }
            .await;
            match result {
                Ok(v) => connect::unary_ok(&v),
                Err(e) => e.into_response(),
            }
        }
    }
}

fn find(state: &SharedState, sel: &Option<SelectorMsg>) -> Result<Arc<Process>, RpcError> {
    let sel = sel.as_ref().ok_or_else(|| RpcError::invalid("missing process selector"))?.selector()?;
    state.processes.get(&sel).ok_or_else(|| {
        RpcError::not_found(match sel {
            Selector::Pid(pid) => format!("process with pid {pid} not found"),
            Selector::Tag(tag) => format!("process with tag {tag} not found"),
        })
    })
}

fn start(
    state: &SharedState,
    headers: &HeaderMap,
    req: StartRequest,
    limits: StreamLimits,
) -> Result<(u32, mpsc::Receiver<Event>), RpcError> {
    let user = rpc_user(state, headers)?;
    let cfg = req.process.unwrap_or_default();
    if cfg.cmd.is_empty() {
        return Err(RpcError::invalid("process.cmd is required"));
    }
    let settings = state.settings();
    let asked = cfg.cwd.as_deref().filter(|c| !c.is_empty());
    let default = settings.default_workdir.as_deref().map(|d| crate::paths::resolve(d, &user));
    let cwd = match (asked, default) {
        (Some(c), _) => crate::paths::resolve(c, &user).map_err(RpcError::invalid)?,
        // The template's WORKDIR, while it is there.
        (None, Some(Ok(dir))) if dir.is_dir() => dir,
        // A home that does not exist (yet) must not make every command fail.
        (None, _) if user.home.is_dir() => user.home.clone(),
        (None, _) => "/".into(),
    };
    if !cwd.is_dir() {
        return Err(RpcError::invalid(format!("cwd '{}' does not exist", cwd.display())));
    }
    let env = environment(&user, &cwd, &settings.env_vars, &cfg.envs);
    let pty = req.pty.map(|p| {
        let size = p.size.unwrap_or_default();
        (clamp_u16(size.cols, 80), clamp_u16(size.rows, 24))
    });
    let plan = SpawnPlan {
        cmd: cfg.cmd.clone(),
        args: cfg.args.clone(),
        env,
        cwd,
        user,
        // envd keeps stdin open unless the request says `stdin: false`.
        stdin: req.stdin.unwrap_or(true),
        pty,
    };
    let config = ProcessConfig { cmd: cfg.cmd, args: cfg.args, envs: cfg.envs, cwd: cfg.cwd };
    let (process, events) =
        crate::process::start(&state.launcher, &state.processes, &plan, config, req.tag, limits.deadline)
            .map_err(|e| RpcError::invalid(format!("error starting process '{}': {e}", plan.cmd)))?;
    Ok((process.pid, events))
}

fn clamp_u16(v: u32, default: u16) -> u16 {
    if v == 0 { default } else { v.min(u16::MAX as u32) as u16 }
}

fn attach(state: &SharedState, req: ProcessOnly) -> Result<(u32, mpsc::Receiver<Event>), RpcError> {
    let process = find(state, &req.process)?;
    Ok((process.pid, process.subscribe()))
}

/// Start/Connect response stream: `start`, output as it comes, `end`.
fn stream_events(pid: u32, mut events: mpsc::Receiver<Event>, limits: StreamLimits) -> Response {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let start = event_message(json!({ "start": { "pid": pid } }));
        if tx.send(StreamItem::Message(start)).await.is_err() {
            return;
        }
        while let Some(event) = events.recv().await {
            let (msg, last) = match &event {
                Event::Data(out) => (event_message(data_event(out)), false),
                Event::End(end) => (event_message(end_event(end)), true),
            };
            // A failed send means the client went away; dropping `events`
            // detaches us while the process keeps running.
            if tx.send(StreamItem::Message(msg)).await.is_err() || last {
                return;
            }
        }
    });
    connect::stream_response(rx, limits, keepalive_message())
}

fn list(state: &SharedState) -> Value {
    let processes = state.processes.list();
    let infos: Vec<ProcessInfoOut<'_>> = processes
        .iter()
        .map(|p| ProcessInfoOut {
            config: ProcessConfigOut {
                cmd: &p.config.cmd,
                args: &p.config.args,
                envs: &p.config.envs,
                cwd: p.config.cwd.as_deref(),
            },
            pid: p.pid,
            tag: p.tag.as_deref(),
        })
        .collect();
    json!({ "processes": infos })
}

fn input_error(e: InputError) -> RpcError {
    match e {
        InputError::Io(e) => RpcError::internal(format!("error writing input: {e}")),
        other => RpcError::new(Code::FailedPrecondition, other.to_string()),
    }
}

async fn write_input(process: &Process, input: InputMsg) -> Result<(), RpcError> {
    match (input.pty, input.stdin) {
        (Some(bytes), _) => process.write_pty(&bytes).await,
        (None, Some(bytes)) => process.write_stdin(&bytes).await,
        (None, None) => Ok(()),
    }
    .map_err(input_error)
}

async fn send_input(state: &SharedState, req: SendInputRequest) -> Result<Value, RpcError> {
    let process = find(state, &req.process)?;
    write_input(&process, req.input.unwrap_or_default()).await?;
    Ok(json!({}))
}

fn send_signal(state: &SharedState, req: SendSignalRequest) -> Result<Value, RpcError> {
    let process = find(state, &req.process)?;
    let signal = match req.signal {
        9 => libc::SIGKILL,
        15 => libc::SIGTERM,
        other => return Err(RpcError::invalid(format!("unsupported signal {other}"))),
    };
    signal_group(process.pid, signal).map_err(|e| RpcError::internal(format!("error sending signal: {e}")))?;
    Ok(json!({}))
}

async fn close_stdin(state: &SharedState, req: ProcessOnly) -> Result<Value, RpcError> {
    let process = find(state, &req.process)?;
    process.close_stdin().await.map_err(input_error)?;
    Ok(json!({}))
}

fn update(state: &SharedState, req: UpdateRequest) -> Result<Value, RpcError> {
    let process = find(state, &req.process)?;
    if let Some(size) = req.pty.and_then(|p| p.size) {
        process
            .resize(clamp_u16(size.cols, 80), clamp_u16(size.rows, 24))
            .map_err(|e| RpcError::invalid(e.to_string()))?;
    }
    Ok(json!({}))
}

/// Client stream: a `start` naming the process, then `data` events, each
/// written as it arrives.
async fn stream_input(state: &SharedState, body: Body) -> Result<(), RpcError> {
    let mut chunks = body.into_data_stream();
    let mut decoder = EnvelopeDecoder::default();
    let mut process: Option<Arc<Process>> = None;
    loop {
        while let Some(env) = decoder.next_envelope()? {
            if env.flags & FLAG_END_STREAM != 0 {
                continue;
            }
            let msg: StreamInputRequest = connect::decode_json(&env.payload)?;
            if let Some(start) = msg.start {
                process = Some(find(state, &start.process)?);
            } else if let Some(data) = msg.data {
                let p = process.as_ref().ok_or_else(|| RpcError::invalid("data before start event"))?;
                write_input(p, data.input.unwrap_or_default()).await?;
            }
        }
        match chunks.next().await {
            Some(Ok(chunk)) => decoder.push(&chunk),
            Some(Err(e)) => return Err(RpcError::new(Code::Canceled, format!("reading input stream: {e}"))),
            None => break,
        }
    }
    if decoder.is_empty() { Ok(()) } else { Err(RpcError::invalid("truncated input stream")) }
}

fn stream_input_ok() -> Response {
    let mut body = encode_envelope(0, b"{}").to_vec();
    body.extend_from_slice(&connect::end_stream_frame(None));
    ([(axum::http::header::CONTENT_TYPE, CONTENT_TYPE_STREAM)], body).into_response()
}
