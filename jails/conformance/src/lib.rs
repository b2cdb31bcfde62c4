//! Harness of the substrate conformance suite (`tests/substrate.rs`): the
//! host's substrate opened on a state directory of the suite's own, and a
//! small client that drives the in-sandbox agent over its unix socket.
//!
//! Nothing here knows which substrate it runs on; the suite passes on a
//! host exactly when that host's substrate keeps the trait's promises.
//! Needs root, the agent binary (`COPSE_AGENT`) and a network for the first
//! template build; see docs/freebsd.md ("Verifying a host").

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use copse_agent::connect::{EnvelopeDecoder, FLAG_END_STREAM, encode_envelope};
use copse_substrate::template::{PackageSystem, builtin};
use copse_substrate::{Limits, Placement, SandboxSpec, Substrate};

/// State directory of the suite, apart from any gateway's: `recover`
/// destroys every sandbox it does not know.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/copse-conformance";
pub const ENV_STATE_DIR: &str = "COPSE_CONFORMANCE_DIR";
pub const TEMPLATE: &str = "base";

/// The substrate, opened once per test binary with the `base` template
/// built (a no-op once the state directory has it).
pub fn substrate() -> &'static dyn Substrate {
    static SUBSTRATE: OnceLock<Box<dyn Substrate>> = OnceLock::new();
    SUBSTRATE.get_or_init(|| open().unwrap_or_else(|e| panic!("opening the substrate: {e:#}"))).as_ref()
}

fn open() -> anyhow::Result<Box<dyn Substrate>> {
    if !is_root() {
        bail!("the conformance suite needs root (it creates real sandboxes)");
    }
    check_dedicated_dataset()?;
    let state_dir = state_dir();
    std::fs::create_dir_all(&state_dir).with_context(|| format!("creating {}", state_dir.display()))?;
    let agent = std::env::var_os("COPSE_AGENT")
        .map(PathBuf::from)
        .context("set COPSE_AGENT to the agent binary (mise does)")?;
    // Loopback only: the network has its own suite (tests/test_network.py).
    let substrate = copse_host::host_substrate(&state_dir, &agent, None)?;
    let recipe = builtin(PackageSystem::host()).into_iter().find(|r| r.name == TEMPLATE).context("no base recipe")?;
    substrate.ensure_template(&recipe, &|line| eprintln!("template: {line}"))?;
    Ok(substrate)
}

/// On FreeBSD the substrate's datasets come from `COPSE_ZFS_DATASET`; the
/// suite must never share them with a production gateway.
fn check_dedicated_dataset() -> anyhow::Result<()> {
    #[cfg(target_os = "freebsd")]
    {
        let dataset = std::env::var("COPSE_ZFS_DATASET").unwrap_or_default();
        if !dataset.contains("conformance") {
            bail!(
                "set COPSE_ZFS_DATASET to a dataset for this suite only, with `conformance` in its name \
                 (`mise run conformance` uses zroot/copse-conformance)"
            );
        }
    }
    Ok(())
}

pub fn state_dir() -> PathBuf {
    std::env::var_os(ENV_STATE_DIR).map(PathBuf::from).unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR))
}

fn is_root() -> bool {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Tests run one at a time: `recover` in one test would otherwise take
/// the sandboxes of another for orphans.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh id with `tag` (the test's name) in it, for sandboxes and
/// snapshots alike.
pub fn fresh_id(tag: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("conf-{tag}-{:x}", nanos % 0xffff_ffff)
}

/// A sandbox spec with a fresh id.
pub fn spec(tag: &str, limits: Limits) -> SandboxSpec {
    let id = fresh_id(tag);
    SandboxSpec {
        // Where the gateway puts it (`<data>/run/<id>.sock`): the Linux
        // substrate's destroy removes the socket there, whatever the spec said.
        agent_socket: state_dir().join("run").join(format!("{id}.sock")),
        id,
        template: TEMPLATE.into(),
        limits,
        snapshot: None,
        network: None,
    }
}

/// A created sandbox, destroyed when dropped (also when a test fails).
pub struct Sandbox {
    pub spec: SandboxSpec,
    pub placement: Placement,
}

impl Sandbox {
    pub fn create(tag: &str, limits: Limits) -> anyhow::Result<Self> {
        Self::create_from(spec(tag, limits))
    }

    /// A sandbox whose files start as those of `snapshot_id`.
    pub fn from_snapshot(tag: &str, limits: Limits, snapshot_id: &str) -> anyhow::Result<Self> {
        Self::create_from(SandboxSpec { snapshot: Some(snapshot_id.to_string()), ..spec(tag, limits) })
    }

    fn create_from(spec: SandboxSpec) -> anyhow::Result<Self> {
        if let Some(dir) = spec.agent_socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let placement = substrate().create(&spec)?;
        Ok(Self { spec, placement })
    }

    pub fn id(&self) -> &str {
        &self.spec.id
    }

    pub fn agent(&self) -> Agent {
        Agent { socket: self.spec.agent_socket.clone() }
    }
}

/// A snapshot the substrate holds, deleted when dropped.
pub struct Snapshot(pub String);

impl Drop for Snapshot {
    fn drop(&mut self) {
        if let Err(e) = substrate().delete_snapshot(&self.0) {
            eprintln!("deleting snapshot {}: {e:#}", self.0);
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if let Err(e) = substrate().destroy(&self.spec.id) {
            eprintln!("destroying {}: {e:#}", self.spec.id);
        }
    }
}

/// What a finished command printed and how it ended.
#[derive(Debug, Default)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i64,
}

/// Speaks to one sandbox's agent over its socket, as the gateway does.
pub struct Agent {
    pub socket: PathBuf,
}

impl Agent {
    /// Runs `/bin/sh -c script` as the sandbox user and waits for its end.
    pub fn sh(&self, script: &str) -> anyhow::Result<Output> {
        block_on(run(&self.socket, script))
    }

    /// As [`Agent::sh`], but `None` if no answer came within `limit` (a
    /// paused sandbox's agent is stopped too and answers nothing).
    pub fn sh_within(&self, script: &str, limit: std::time::Duration) -> anyhow::Result<Option<Output>> {
        block_on(async { tokio::time::timeout(limit, run(&self.socket, script)).await.ok().transpose() })
    }

    /// Writes a file through the agent's upload endpoint.
    pub fn write_file(&self, path: &str, content: &[u8]) -> anyhow::Result<()> {
        let request = Request::post(format!("/files?path={path}&username=user"))
            .header("host", "agent")
            .header("content-type", "application/octet-stream")
            .body(Full::new(Bytes::copy_from_slice(content)))?;
        let (status, body) = block_on(send(&self.socket, request))?;
        if status != StatusCode::OK {
            bail!("upload answered {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(())
    }

    pub fn read_file(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        let request = Request::get(format!("/files?path={path}&username=user"))
            .header("host", "agent")
            .body(Full::new(Bytes::new()))?;
        let (status, body) = block_on(send(&self.socket, request))?;
        if status != StatusCode::OK {
            bail!("download answered {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(body.to_vec())
    }
}

fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime").block_on(future)
}

async fn send(socket: &Path, request: Request<Full<Bytes>>) -> anyhow::Result<(StatusCode, Bytes)> {
    let stream = UnixStream::connect(socket).await.with_context(|| format!("connecting {}", socket.display()))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let response = sender.send_request(request).await?;
    let status = response.status();
    Ok((status, response.into_body().collect().await?.to_bytes()))
}

/// `Process.Start`, reading the event stream to the end event.
async fn run(socket: &Path, script: &str) -> anyhow::Result<Output> {
    let start = serde_json::json!({
        "process": { "cmd": "/bin/sh", "args": ["-c", script] },
        "stdin": false,
    });
    let request = Request::post("/process.Process/Start")
        .header("host", "agent")
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(Full::new(encode_envelope(0, &serde_json::to_vec(&start)?)))?;
    let (status, body) = send(socket, request).await?;
    if !status.is_success() {
        bail!("Process.Start answered {status}: {}", String::from_utf8_lossy(&body));
    }
    let mut decoder = EnvelopeDecoder::default();
    decoder.push(&body);
    let mut output = Output::default();
    let mut ended = false;
    while let Some(envelope) = decoder.next_envelope().map_err(|e| anyhow::anyhow!("{}", e.to_json()))? {
        let message: serde_json::Value = serde_json::from_slice(&envelope.payload)?;
        if envelope.flags & FLAG_END_STREAM != 0 {
            if let Some(error) = message.get("error") {
                bail!("process stream failed: {error}");
            }
            break;
        }
        let event = &message["event"];
        for (key, out) in [("stdout", &mut output.stdout), ("stderr", &mut output.stderr)] {
            if let Some(data) = event["data"][key].as_str() {
                out.push_str(&String::from_utf8_lossy(
                    &copse_agent::wire::decode_base64(data).map_err(|e| anyhow::anyhow!(e))?,
                ));
            }
        }
        if let Some(end) = event.get("end") {
            output.exit_code = end["exitCode"].as_i64().unwrap_or(-1);
            ended = true;
        }
    }
    if !ended {
        bail!("the process stream ended without an end event");
    }
    Ok(output)
}
