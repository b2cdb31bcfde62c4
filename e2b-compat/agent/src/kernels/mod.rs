//! Kernels for the code interpreter: processes started as the sandbox's
//! user for a caller that is *not* that user.
//!
//! The interpreter runs under its own account (`copse-interp`), so code
//! running as `user` can neither take over its port nor read its state, yet
//! the code it runs must still run as `user`, as in E2B. It cannot switch
//! users itself (no capabilities), and it never holds the access token, so
//! it asks here: a unix socket only the sandbox's processes can reach, on
//! which the agent serves a connection only if its peer's uid (the kernel's
//! record of who connected, `SO_PEERCRED`) is `copse-interp`'s.
//!
//! One connection is one kernel. The interpreter sends a JSON line
//! ([`request::KernelRequest`]) with the child's stdin, stdout and stderr
//! attached as descriptors; the agent starts the program as its default
//! user, confined, leading a session of its own, and answers
//! `{"pid":N}` (or `{"error":…}`). Then the interpreter may send
//! `{"signal":N}` lines (interrupt, terminate, kill: delivered to the
//! kernel's process group), and the agent sends `{"exit":CODE}` or
//! `{"signal":N}` when the kernel ends and closes. If the interpreter goes
//! away first, its kernel is killed: nothing it started outlives it.

pub mod request;

use std::io;
use std::os::fd::OwnedFd;
use std::process::ExitStatus;

use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;

use crate::process::signal_group;
use crate::process::spawn::{SpawnPlan, environment};
use crate::state::SharedState;
use request::{KernelRequest, STDIO_FDS};

/// The account the code interpreter runs as; the one caller served here.
pub use copse_protocol::kernels::INTERPRETER_USER;

/// The signals a kernel's owner may send: interrupt a cell, stop or kill.
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGKILL];

/// Binds the kernel socket (see [`copse_protocol::kernels`] for where).
pub fn bind() -> io::Result<tokio::net::UnixListener> {
    let listener = bind_std()?;
    listener.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(listener)
}

#[cfg(target_os = "linux")]
fn bind_std() -> io::Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    // An abstract name: no file for a sandbox's writer to replace, nothing
    // for a snapshot to carry, and it is the sandbox's own (per network
    // namespace). The agent binds it before anything else runs there.
    let name = copse_protocol::kernels::SOCKET_ABSTRACT_NAME;
    std::os::unix::net::UnixListener::bind_addr(&std::os::unix::net::SocketAddr::from_abstract_name(name)?)
}

#[cfg(not(target_os = "linux"))]
fn bind_std() -> io::Result<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    // A file in a root-owned directory (not run on FreeBSD). World-writable
    // so the interpreter can connect; who may use it is decided per peer.
    let path = std::path::Path::new(copse_protocol::kernels::SOCKET_PATH);
    let _ = std::fs::remove_file(path);
    let listener = std::os::unix::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

pub async fn serve(listener: tokio::net::UnixListener, state: SharedState) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let state = state.clone();
                tokio::spawn(async move {
                    if let Err(e) = connection(stream, state).await {
                        tracing::debug!("kernel connection: {e}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("kernel socket accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    }
}

/// Whether a peer with this uid may start kernels: only the interpreter's
/// account, looked up in the sandbox's own passwd (no such account, no
/// caller).
fn allowed(state: &SharedState, uid: u32) -> bool {
    state.user_db().user(INTERPRETER_USER).is_some_and(|account| account.uid == uid)
}

async fn connection(stream: UnixStream, state: SharedState) -> io::Result<()> {
    let uid = stream.peer_cred()?.uid();
    if !allowed(&state, uid) {
        tracing::warn!("kernel socket: refused a peer with uid {uid}");
        let (_, mut writer) = stream.into_split();
        return reply(&mut writer, json!({"error": format!("only {INTERPRETER_USER} may start kernels")})).await;
    }
    let (line, fds) = request::receive(&stream).await?;
    let (reader, mut writer) = stream.into_split();
    let started = KernelRequest::parse(&line).and_then(|request| start(&state, request, fds));
    let mut child = match started {
        Ok(child) => child,
        Err(message) => return reply(&mut writer, json!({ "error": message })).await,
    };
    let pid = child.id().ok_or_else(|| io::Error::other("the kernel has no pid"))?;
    reply(&mut writer, json!({ "pid": pid })).await?;

    let mut lines = BufReader::new(reader).lines();
    loop {
        tokio::select! {
            status = child.wait() => return reply(&mut writer, ended(status?)).await,
            line = lines.next_line() => match line {
                Ok(Some(line)) => {
                    if let Some(signal) = parse_signal(&line) {
                        let _ = signal_group(pid, signal);
                    }
                }
                // The interpreter is gone: its kernel goes too.
                _ => {
                    let _ = signal_group(pid, libc::SIGKILL);
                    child.wait().await?;
                    return Ok(());
                }
            },
        }
    }
}

fn start(state: &SharedState, request: KernelRequest, fds: Vec<OwnedFd>) -> Result<tokio::process::Child, String> {
    let Ok(stdio) = <[OwnedFd; STDIO_FDS]>::try_from(fds) else {
        return Err(format!("a kernel request carries exactly {STDIO_FDS} descriptors: stdin, stdout, stderr"));
    };
    let user = state.user(None)?;
    let (cmd, args) = request.argv.split_first().expect("parse checked argv");
    let env = environment(&user, &request.cwd, &state.settings().env_vars, &request.env);
    let plan = SpawnPlan { cmd: cmd.clone(), args: args.to_vec(), env, cwd: request.cwd, user, stdin: true, pty: None };
    state.launcher.spawn_attached(&plan, stdio).map_err(|e| format!("starting {cmd}: {e}"))
}

fn parse_signal(line: &str) -> Option<libc::c_int> {
    let value: serde_json::Value = serde_json::from_str(line).ok()?;
    let signal = libc::c_int::try_from(value.get("signal")?.as_i64()?).ok()?;
    SIGNALS.contains(&signal).then_some(signal)
}

fn ended(status: ExitStatus) -> serde_json::Value {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => json!({ "exit": code }),
        (None, Some(signal)) => json!({ "signal": signal }),
        (None, None) => json!({ "exit": -1 }),
    }
}

async fn reply(writer: &mut OwnedWriteHalf, message: serde_json::Value) -> io::Result<()> {
    let mut line = message.to_string().into_bytes();
    line.push(b'\n');
    writer.write_all(&line).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, Read, Write};
    use std::os::unix::net::UnixStream as StdStream;

    use crate::AgentConfig;
    use crate::state::AgentState;

    /// An agent state whose passwd gives `copse-interp` the uid `interp`
    /// and `user` our own ids (so no switch is needed to run as it).
    fn state(interp: u32) -> (tempfile::TempDir, SharedState) {
        let dir = tempfile::tempdir().unwrap();
        let etc = dir.path().join("etc");
        std::fs::create_dir_all(&etc).unwrap();
        // SAFETY: getters without arguments.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let passwd = format!("user:x:{uid}:{gid}::/tmp:/bin/sh\n{INTERPRETER_USER}:x:{interp}:{interp}::/:/bin/sh\n");
        std::fs::write(etc.join("passwd"), passwd).unwrap();
        std::fs::write(etc.join("group"), format!("user:x:{gid}:\n")).unwrap();
        let config = AgentConfig { etc_dir: etc, confine: false, ..AgentConfig::default() };
        (dir, AgentState::new(config).unwrap())
    }

    /// Serves one connection of a socket pair; returns the client's end.
    fn connect(state: SharedState) -> StdStream {
        let (client, server) = StdStream::pair().unwrap();
        server.set_nonblocking(true).unwrap();
        let server = UnixStream::from_std(server).unwrap();
        tokio::spawn(async move { connection(server, state).await });
        client
    }

    fn ask(client: &StdStream, argv: &[&str], fds: &[std::os::fd::RawFd]) -> serde_json::Value {
        let line = json!({"argv": argv, "cwd": "/", "env": {"GREETING": "hi"}}).to_string() + "\n";
        let iov = [std::io::IoSlice::new(line.as_bytes())];
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(fds)];
        use std::os::fd::AsRawFd;
        let _ =
            nix::sys::socket::sendmsg::<()>(client.as_raw_fd(), &iov, &cmsg, nix::sys::socket::MsgFlags::empty(), None);
        read_line(client)
    }

    fn read_line(client: &StdStream) -> serde_json::Value {
        let mut line = String::new();
        std::io::BufReader::new(client).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or(serde_json::Value::Null)
    }

    fn pipe() -> (std::fs::File, std::fs::File) {
        let (r, w) = nix::unistd::pipe().unwrap();
        (r.into(), w.into())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_interpreters_account_starts_a_kernel_with_its_pipes_and_hears_its_end() {
        use std::os::fd::AsRawFd;
        // SAFETY: a getter without arguments.
        let (_dir, state) = state(unsafe { libc::geteuid() });
        let client = connect(state);
        let ((in_r, mut in_w), (mut out_r, out_w)) = (pipe(), pipe());
        let client = tokio::task::spawn_blocking(move || {
            let started = ask(
                &client,
                &["/bin/sh", "-c", "read x; echo \"$x $GREETING $USER\""],
                &[in_r.as_raw_fd(), out_w.as_raw_fd(), out_w.as_raw_fd()],
            );
            assert!(started["pid"].as_u64().is_some(), "{started}");
            drop((in_r, out_w));
            in_w.write_all(b"kernel\n").unwrap();
            let mut out = String::new();
            out_r.read_to_string(&mut out).unwrap();
            assert_eq!(out, "kernel hi user\n");
            assert_eq!(read_line(&client), json!({"exit": 0}));
        });
        client.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn anyone_else_is_refused_and_nothing_starts() {
        use std::os::fd::AsRawFd;
        // SAFETY: a getter without arguments.
        let other = unsafe { libc::geteuid() } + 4242;
        let (dir, state) = state(other);
        let marker = dir.path().join("started");
        let client = connect(state);
        let (r, w) = pipe();
        let answer = tokio::task::spawn_blocking(move || {
            let touch = format!("touch {}", marker.display());
            let answer = ask(&client, &["/bin/sh", "-c", &touch], &[r.as_raw_fd(), w.as_raw_fd(), w.as_raw_fd()]);
            (answer, marker.exists())
        })
        .await
        .unwrap();
        assert!(answer.0["error"].as_str().unwrap().contains(INTERPRETER_USER), "{}", answer.0);
        assert!(!answer.1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kernel_dies_with_its_connection() {
        use std::os::fd::AsRawFd;
        // SAFETY: a getter without arguments.
        let (_dir, state) = state(unsafe { libc::geteuid() });
        let client = connect(state);
        let ((in_r, _in_w), (mut out_r, out_w)) = (pipe(), pipe());
        tokio::task::spawn_blocking(move || {
            let started =
                ask(&client, &["/bin/sleep", "600"], &[in_r.as_raw_fd(), out_w.as_raw_fd(), out_w.as_raw_fd()]);
            assert!(started["pid"].as_u64().is_some(), "{started}");
            drop((in_r, out_w));
            drop(client);
            // EOF once the kernel, the last holder of the pipe's write end, is gone.
            let mut rest = Vec::new();
            out_r.read_to_end(&mut rest).unwrap();
        })
        .await
        .unwrap();
    }

    #[test]
    fn only_interrupt_terminate_and_kill_pass() {
        assert_eq!(parse_signal(r#"{"signal":2}"#), Some(libc::SIGINT));
        assert_eq!(parse_signal(r#"{"signal":9}"#), Some(libc::SIGKILL));
        assert_eq!(parse_signal(r#"{"signal":19}"#), None);
        assert_eq!(parse_signal(r#"{"signal":"2"}"#), None);
        assert_eq!(parse_signal("garbage"), None);
    }
}
