//! `copse-agent`: the daemon inside every sandbox. It speaks the API of
//! E2B's envd (Connect-RPC `process.Process` and `filesystem.Filesystem`
//! with the JSON codec, plus `/files`, `/health` and `/init`) on a unix
//! socket that the gateway forwards HTTP/1.1 requests to unchanged.
//!
//! The agent keeps its privileges: it switches to the requesting user and
//! confines (`copse_jailer::confine`) every process it starts, and it chowns
//! what it creates on a user's behalf.
//!
//! Code map:
//! - `routes`: the HTTP surface, which path goes where.
//! - `auth`: who may call, as which user (token, signatures, Basic user).
//! - `connect`: the server side of Connect: error codes, request decoding,
//!   unary and streaming responses. The wire pieces it shares with clients
//!   (envelopes, the protobuf-JSON codec, signatures, header names) are in
//!   `copse-protocol`.
//! - `rpc/`: the Connect services `process.Process` and
//!   `filesystem.Filesystem`: request shapes and handlers.
//! - `process/`: the process supervisor behind them: spawning (confined),
//!   streaming output, signals, the table of running processes.
//! - `filesystem/`: the filesystem operations behind them: entries, stat,
//!   list, move, watch, metadata.
//! - `transfer`: `GET`/`POST /files`, raw file transfer streamed to and
//!   from disk.
//! - `kernels`: starts the code interpreter's kernels as the sandbox's
//!   user, for the interpreter's account alone (peer credentials).
//! - `ports/`: relays traffic for other sandbox ports to its loopback, over
//!   TLS to the ports the sandbox's `httpsPorts` lists (`ports/tls.rs`).
//! - `paths`, `users`: path resolution and sandbox users as envd does them.
//! - `state`: settings `/init` can change, shared by every handler.
//! - `guest/`: `copse-agent guest`, the agent inside a bhyve guest.

pub mod auth;
pub mod connect;
mod drain;
pub mod filesystem;
pub mod guest;
pub mod kernels;
pub mod paths;
pub mod ports;
pub mod process;
pub mod routes;
pub mod rpc;
pub mod state;
pub mod transfer;
pub mod trust;
pub mod users;

use std::collections::HashMap;
use std::path::PathBuf;

pub use state::AgentState;

/// How the agent starts; `/init` may change the first three later.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// When set, every request but `/health` needs `X-Access-Token` (or a
    /// valid signature on `/files`).
    pub access_token: Option<String>,
    /// Environment applied to every process before per-request variables.
    pub env_vars: HashMap<String, String>,
    /// User for requests that name none (the SDK's default is "user").
    pub default_user: String,
    /// Where `passwd` and `group` live; `/etc` inside a sandbox, a scratch
    /// directory in tests.
    pub etc_dir: PathBuf,
    /// Confine started processes (seccomp, no capabilities). Only tests that
    /// need a capability in the child turn this off.
    pub confine: bool,
    /// Also listen on this port of the sandbox's loopback, where envd lives
    /// in an E2B sandbox (services inside, such as the code interpreter,
    /// call `/envs` there). The token guards it like the socket, but for
    /// `/envs` (`auth::require_token`).
    pub loopback_port: Option<u16>,
    /// Serve the code interpreter's kernel socket (`kernels`): inside a
    /// sandbox only.
    pub kernels: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            access_token: None,
            env_vars: HashMap::new(),
            default_user: "user".into(),
            etc_dir: PathBuf::from("/etc"),
            confine: true,
            loopback_port: None,
            kernels: false,
        }
    }
}

/// Where the agent is reached: a unix socket the gateway forwards to (jails,
/// tests) or a TCP port (a bhyve guest, behind the host's relay).
pub enum Listener {
    Unix(std::os::unix::net::UnixListener),
    Tcp(std::net::TcpListener),
}

impl From<std::os::unix::net::UnixListener> for Listener {
    fn from(l: std::os::unix::net::UnixListener) -> Self {
        Self::Unix(l)
    }
}

impl From<std::net::TcpListener> for Listener {
    fn from(l: std::net::TcpListener) -> Self {
        Self::Tcp(l)
    }
}

/// Serves the agent on an already-bound listener until the process dies.
/// Runs in a freshly forked, single-threaded process (PID 2 of the sandbox),
/// so it builds its own small runtime and assumes nothing about the host.
pub fn serve_blocking(listener: impl Into<Listener>, config: AgentConfig) -> anyhow::Result<()> {
    serve_blocking_with(listener, config, |_| ())
}

/// [`serve_blocking`], handing `started` the agent's state before the first
/// request: for helpers that change its settings from outside HTTP (the
/// console identity of a bhyve guest).
pub fn serve_blocking_with(
    listener: impl Into<Listener>,
    config: AgentConfig,
    started: impl FnOnce(state::SharedState),
) -> anyhow::Result<()> {
    let listener = listener.into();
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).max_blocking_threads(16).enable_all().build()?;
    runtime.block_on(async move {
        let (loopback_port, kernels) = (config.loopback_port, config.kernels);
        let state = AgentState::new(config)?;
        started(state.clone());
        if kernels {
            tokio::spawn(kernels::serve(kernels::bind()?, state.clone()));
        }
        serve_state(listener, state, loopback_port).await
    })
}

/// Serves on a tokio unix listener; the async form of [`serve_blocking`].
pub async fn serve(listener: tokio::net::UnixListener, config: AgentConfig) -> anyhow::Result<()> {
    let loopback_port = config.loopback_port;
    serve_state(Listener::Unix(listener.into_std()?), AgentState::new(config)?, loopback_port).await
}

async fn serve_state(listener: Listener, state: state::SharedState, loopback_port: Option<u16>) -> anyhow::Result<()> {
    let app = routes::router(state);
    if let Some(port) = loopback_port {
        let tcp = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let inside = app.clone().layer(axum::Extension(auth::Loopback));
        tokio::spawn(axum::serve(tcp, inside).into_future());
    }
    match listener {
        Listener::Unix(l) => {
            l.set_nonblocking(true)?;
            axum::serve(tokio::net::UnixListener::from_std(l)?, app).await?;
        }
        Listener::Tcp(l) => {
            l.set_nonblocking(true)?;
            axum::serve(tokio::net::TcpListener::from_std(l)?, app).await?;
        }
    }
    Ok(())
}
