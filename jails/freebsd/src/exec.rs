//! The executor: applies plan steps to the host, one at a time, stopping
//! at the first failure. It makes no decisions of its own beyond what each
//! [`Step`] says; ordering and content come from `plan`.

use std::ffi::CString;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Component, Path};
use std::process::{Command, Stdio};

use anyhow::{Context, anyhow, bail};

use crate::plan::jail::AgentLaunch;
use crate::plan::lifecycle::JailSignal;
use crate::plan::{Cmd, Step, template};
use crate::{streams, sys};
use copse_substrate::Progress;

/// The only `PATH` host tools see (their environment is otherwise empty
/// but for what the plan adds), so package scripts find the base system.
const HOST_PATH: &str = "/sbin:/bin:/usr/sbin:/usr/bin:/usr/local/sbin:/usr/local/bin";

pub struct Executor<'a> {
    progress: Option<Progress<'a>>,
    /// Jid of the jail created by this plan, for the agent launch.
    jid: Option<i32>,
    /// The agent's listening socket between bind and launch.
    listener: Option<UnixListener>,
}

impl<'a> Executor<'a> {
    pub fn new(progress: Option<Progress<'a>>) -> Self {
        Self { progress, jid: None, listener: None }
    }

    pub fn jid(&self) -> Option<i32> {
        self.jid
    }

    pub fn run_all(&mut self, steps: &[Step]) -> anyhow::Result<()> {
        for step in steps {
            tracing::debug!(%step, "freebsd step");
            self.run(step).with_context(|| format!("step `{step}`"))?;
        }
        Ok(())
    }

    fn say(&self, line: &str) {
        if let Some(p) = self.progress {
            p(line);
        }
    }

    fn run(&mut self, step: &Step) -> anyhow::Result<()> {
        match step {
            Step::Progress(line) => {
                tracing::info!("{line}");
                self.say(line);
                Ok(())
            }
            Step::Run(cmd) => match run_cmd(cmd, self.progress) {
                Err(e) if cmd.may_fail => {
                    tracing::warn!("ignored: {e:#}");
                    Ok(())
                }
                other => other.map(drop),
            },
            Step::RealDir { path, below, mode } => real_dir(path, below, *mode),
            Step::CopyFile { from, to, mode } => copy_file(from, to, *mode),
            Step::RemoveFile { path } => match fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
                _ => Ok(()),
            },
            Step::VerifySha256 { file, manifest, entry } => verify_sha256(file, manifest, entry),
            Step::CreateJail(params) => {
                self.jid = Some(sys::create(params)?);
                Ok(())
            }
            Step::RemoveJail { name, jid } => {
                // Only the jail we observed: a name re-used since is not ours.
                if sys::find(name)? == Some(*jid) {
                    sys::remove(*jid)?;
                }
                Ok(())
            }
            Step::BindAgentSocket { path } => {
                self.listener = Some(bind_socket(path)?);
                Ok(())
            }
            Step::StartAgent(launch) => {
                let listener = self.listener.take().ok_or_else(|| anyhow!("agent socket was not bound"))?;
                let jid = match self.jid {
                    Some(jid) => jid,
                    None => {
                        sys::find(&launch.jail_name)?.ok_or_else(|| anyhow!("jail {} is gone", launch.jail_name))?
                    }
                };
                start_agent(launch, jid, &listener)
                // `listener` drops here: the agent holds the only copy.
            }
            Step::SignalJail { name, jid, signal } => {
                // Only the jail we observed: a name re-used since is not ours.
                if sys::find(name)? != Some(*jid) {
                    bail!("jail {name} is no longer jid {jid}");
                }
                signal_jail(*jid, *signal)
            }
            Step::Pipe { from, to } => pipe(from, to),
        }
    }
}

/// Runs a host command and returns its stdout; fails on a non-zero exit
/// with the command line and its stderr in the error.
pub fn run_cmd(cmd: &Cmd, progress: Option<Progress<'_>>) -> anyhow::Result<String> {
    let mut command = host_command(cmd);
    command.stdin(Stdio::null());
    let (status, stdout, stderr) = if cmd.stream {
        let mut child =
            command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().with_context(|| format!("spawn `{cmd}`"))?;
        let mut err_pipe = child.stderr.take().expect("stderr is piped");
        // Drain stderr on the side so neither pipe can fill and stall the tool.
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err_pipe.read_to_string(&mut s);
            s
        });
        let mut stdout = String::new();
        for line in BufReader::new(child.stdout.take().expect("stdout is piped")).lines() {
            let line = line?;
            if let Some(p) = progress {
                p(&line);
            }
            stdout.push_str(&line);
            stdout.push('\n');
        }
        let status = child.wait()?;
        (status, stdout, err_reader.join().unwrap_or_default())
    } else {
        let out = command.output().with_context(|| format!("spawn `{cmd}`"))?;
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    if !status.success() {
        bail!("`{cmd}` failed ({status}): {}", stderr.trim());
    }
    Ok(stdout)
}

/// A host tool with an environment of only `PATH` and what the plan adds.
fn host_command(cmd: &Cmd) -> Command {
    let mut command = Command::new(&cmd.program);
    command.args(&cmd.args).env_clear().env("PATH", HOST_PATH);
    for (k, v) in &cmd.env {
        command.env(k, v);
    }
    command
}

/// `from | to` without a shell (`zfs send | zfs recv`).
fn pipe(from: &Cmd, to: &Cmd) -> anyhow::Result<()> {
    streams::pipe((&mut host_command(from), &from.to_string()), (&mut host_command(to), &to.to_string()))
}

/// Runs `cmd` with its stdout copied into `out` (`zfs send` for export).
pub fn run_into(cmd: &Cmd, out: &mut dyn Write) -> anyhow::Result<()> {
    streams::run_into((&mut host_command(cmd), &cmd.to_string()), out)
}

/// Runs `cmd` with `input` as its stdin (`zfs recv` for import).
pub fn run_from(cmd: &Cmd, input: &mut dyn Read) -> anyhow::Result<()> {
    streams::run_from((&mut host_command(cmd), &cmd.to_string()), input)
}

/// fork; in the child `jail_attach(jid)` and `kill(-1, signal)`, which
/// reaches every process of the jail but the child itself, then exit with
/// the errno (0 on success). ESRCH means the jail had no process left,
/// which leaves nothing to stop or continue.
fn signal_jail(jid: i32, signal: JailSignal) -> anyhow::Result<()> {
    let signo = match signal {
        JailSignal::Stop => libc::SIGSTOP,
        JailSignal::Cont => libc::SIGCONT,
    };
    // SAFETY: the child makes only async-signal-safe system calls
    // (jail_attach, kill, _exit) and touches no memory it shares.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error()).context("fork");
    }
    if pid == 0 {
        // SAFETY: plain system calls in the forked child; see above.
        unsafe {
            let errno_of = || *libc::__error();
            if libc::jail_attach(jid) < 0 {
                libc::_exit(errno_of());
            }
            if libc::kill(-1, signo) < 0 && errno_of() != libc::ESRCH {
                libc::_exit(errno_of());
            }
            libc::_exit(0);
        }
    }
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: `status` is valid for a write.
        let ret = unsafe { libc::waitpid(pid, &raw mut status, 0) };
        if ret >= 0 {
            break;
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err).context("waitpid");
        }
    }
    if !libc::WIFEXITED(status) {
        bail!("signalling jail {jid}: helper died (wait status {status})");
    }
    match libc::WEXITSTATUS(status) {
        0 => Ok(()),
        errno => Err(std::io::Error::from_raw_os_error(errno)).with_context(|| format!("SIG{signal} to jail {jid}")),
    }
}

/// Whether a command exits 0 (existence checks such as `zfs list NAME`).
pub fn succeeds(cmd: &Cmd) -> bool {
    run_cmd(cmd, None).is_ok()
}

fn real_dir(path: &Path, below: &Path, mode: u32) -> anyhow::Result<()> {
    let rest =
        path.strip_prefix(below).with_context(|| format!("{} is not below {}", path.display(), below.display()))?;
    let mut current = below.to_path_buf();
    check_not_symlink(&current)?;
    for component in rest.components() {
        let Component::Normal(part) = component else {
            bail!("{} has a non-plain component", path.display());
        };
        current.push(part);
        match fs::symlink_metadata(&current) {
            Ok(meta) if meta.file_type().is_symlink() => bail!("{} is a symlink", current.display()),
            Ok(meta) if !meta.is_dir() => bail!("{} is not a directory", current.display()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                fs::DirBuilder::new()
                    .mode(mode)
                    .create(&current)
                    .with_context(|| format!("mkdir {}", current.display()))?;
            }
            Err(e) => return Err(e).with_context(|| format!("lstat {}", current.display())),
        }
    }
    Ok(())
}

fn check_not_symlink(path: &Path) -> anyhow::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => bail!("{} is a symlink", path.display()),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            fs::create_dir_all(path).with_context(|| format!("mkdir -p {}", path.display()))
        }
        Err(e) => Err(e).with_context(|| format!("lstat {}", path.display())),
    }
}

fn copy_file(from: &Path, to: &Path, mode: u32) -> anyhow::Result<()> {
    let name = to.file_name().ok_or_else(|| anyhow!("{} has no file name", to.display()))?;
    let tmp = to.with_file_name(format!(".{}.new", name.to_string_lossy()));
    fs::copy(from, &tmp).with_context(|| format!("copy {} to {}", from.display(), tmp.display()))?;
    fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))?;
    fs::rename(&tmp, to).with_context(|| format!("rename to {}", to.display()))?;
    Ok(())
}

fn verify_sha256(file: &Path, manifest: &Path, entry: &str) -> anyhow::Result<()> {
    let text = fs::read_to_string(manifest).with_context(|| format!("read {}", manifest.display()))?;
    let want = template::manifest_sha256(&text, entry)
        .ok_or_else(|| anyhow!("{} lists no sha256 for {entry}", manifest.display()))?;
    let got = run_cmd(&template::sha256_of(file), None)?.trim().to_ascii_lowercase();
    if got != want {
        bail!("{} has sha256 {got}, MANIFEST says {want}", file.display());
    }
    Ok(())
}

fn bind_socket(path: &Path) -> anyhow::Result<UnixListener> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => fs::remove_file(path)?,
        Ok(_) => bail!("{} exists and is not a socket", path.display()),
        Err(_) => {}
    }
    if let Some(parent) = path.parent() {
        fs::DirBuilder::new().recursive(true).mode(0o700).create(parent)?;
    }
    let listener = UnixListener::bind(path).with_context(|| format!("bind {}", path.display()))?;
    // Only the gateway (same uid) may connect.
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// fork; in the child: new session, `jail_attach`, chdir inside the jail,
/// the listening socket onto fd 3, exec. The child is reaped on a thread.
fn start_agent(launch: &AgentLaunch, jid: i32, listener: &UnixListener) -> anyhow::Result<()> {
    let socket_fd = listener.as_raw_fd();
    let target_fd = launch.socket_fd;
    let cwd = CString::new(launch.cwd.as_str())?;
    let mut command = Command::new(&launch.program);
    command.args(&launch.args).env_clear().stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    for (k, v) in &launch.env {
        command.env(k, v);
    }
    // SAFETY: the closure only makes async-signal-safe system calls
    // (setsid, jail_attach, chdir, dup2, fcntl) and allocates nothing.
    unsafe {
        command.pre_exec(move || {
            libc::setsid();
            copse_jailer::check(libc::jail_attach(jid))?;
            // jail_attach changes the root but not the working directory.
            copse_jailer::check(libc::chdir(cwd.as_ptr()))?;
            if socket_fd == target_fd {
                // Already in place; just let it survive exec.
                copse_jailer::check(libc::fcntl(target_fd, libc::F_SETFD, 0))?;
            } else {
                // dup2 leaves the new descriptor without FD_CLOEXEC.
                copse_jailer::check(libc::dup2(socket_fd, target_fd))?;
            }
            Ok(())
        });
    }
    // The program path is resolved after jail_attach, inside the jail.
    let mut child = command.spawn().with_context(|| format!("start agent in jail {}", launch.jail_name))?;
    let name = launch.jail_name.clone();
    std::thread::Builder::new().name(format!("reap-{name}")).spawn(move || match child.wait() {
        Ok(status) => tracing::info!(jail = %name, %status, "agent exited"),
        Err(e) => tracing::warn!(jail = %name, "waiting for agent: {e}"),
    })?;
    Ok(())
}
