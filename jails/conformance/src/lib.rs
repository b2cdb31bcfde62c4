//! Harness of the substrate conformance suite (`tests/substrate.rs`): the
//! host's substrate opened on a state directory of the suite's own, and a
//! blocking wrapper around `copse_protocol::AgentClient` that drives the
//! in-sandbox agent over its unix socket.
//!
//! Nothing here knows which substrate it runs on; the suite passes on a
//! host exactly when that host's substrate keeps the trait's promises.
//! Needs root, the agent binary (`COPSE_AGENT`) and a network for the first
//! template build; see docs/freebsd.md ("Verifying a host").

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use anyhow::{Context, bail};
pub use copse_protocol::Output;
use copse_protocol::{AgentClient, StartProcess};
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
    let recipe = copse_templates::host_recipe(TEMPLATE)?;
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
        volumes: Vec::new(),
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

/// Speaks to one sandbox's agent over its socket, as the gateway does.
pub struct Agent {
    pub socket: PathBuf,
}

impl Agent {
    fn client(&self) -> AgentClient {
        AgentClient::new(&self.socket)
    }

    /// Runs `/bin/sh -c script` as the sandbox user and waits for its end.
    pub fn sh(&self, script: &str) -> anyhow::Result<Output> {
        Ok(block_on(self.client().run(&StartProcess::shell("/bin/sh", script)))?)
    }

    /// As [`Agent::sh`], but `None` if no answer came within `limit` (a
    /// paused sandbox's agent is stopped too and answers nothing).
    pub fn sh_within(&self, script: &str, limit: std::time::Duration) -> anyhow::Result<Option<Output>> {
        let (client, start) = (self.client(), StartProcess::shell("/bin/sh", script));
        Ok(block_on(async { tokio::time::timeout(limit, client.run(&start)).await.ok().transpose() })?)
    }

    /// Writes a file through the agent's upload endpoint.
    pub fn write_file(&self, path: &str, content: &[u8]) -> anyhow::Result<()> {
        Ok(block_on(self.client().upload(path, USER, content))?)
    }

    pub fn read_file(&self, path: &str) -> anyhow::Result<Vec<u8>> {
        Ok(block_on(self.client().download(path, USER))?)
    }
}

/// The user files are written and read as.
const USER: &str = "user";

fn block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime").block_on(future)
}
