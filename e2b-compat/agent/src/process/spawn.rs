//! Starting a user's process: environment, working directory, stdio or a
//! terminal, then — between fork and exec — a new session or process group,
//! the switch to the user's uid/gid/groups, and the sandbox confinement.

use std::collections::HashMap;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;

use copse_jailer::confine::Confinement;
use tokio::process::{Child, ChildStderr, ChildStdin, ChildStdout, Command};

use super::pty::{self, PtyMaster};
use crate::users::User;

/// PATH for every process; the agent's own environment comes from the host
/// and means nothing inside the sandbox.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Everything needed to start one process, computed up front.
#[derive(Debug, Clone)]
pub struct SpawnPlan {
    pub cmd: String,
    pub args: Vec<String>,
    /// Final environment (see [`environment`]).
    pub env: HashMap<String, String>,
    pub cwd: PathBuf,
    pub user: User,
    /// Keep a stdin pipe open (otherwise stdin is /dev/null).
    pub stdin: bool,
    /// Run on a terminal of this size (cols, rows) instead of pipes.
    pub pty: Option<(u16, u16)>,
}

/// The environment of a process, lowest precedence first: the fixed base,
/// the agent-wide variables from `/init`, the request's own.
pub fn environment(
    user: &User,
    cwd: &std::path::Path,
    agent_env: &HashMap<String, String>,
    request_env: &HashMap<String, String>,
) -> HashMap<String, String> {
    let mut env = HashMap::new();
    env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
    env.insert("HOME".to_string(), user.home.display().to_string());
    env.insert("USER".to_string(), user.name.clone());
    env.insert("LOGNAME".to_string(), user.name.clone());
    env.insert("PWD".to_string(), cwd.display().to_string());
    env.extend(agent_env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env.extend(request_env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

/// The parent's ends of a started process's stdio.
pub enum ChildIo {
    Pipes { stdin: Option<ChildStdin>, stdout: ChildStdout, stderr: ChildStderr },
    Pty(PtyMaster),
}

pub struct Spawned {
    pub child: Child,
    pub io: ChildIo,
}

/// Starts processes; owns the prepared confinement so the child only issues
/// system calls.
pub struct Launcher {
    confinement: Option<Arc<Confinement>>,
}

impl Launcher {
    pub fn new(confine: bool) -> anyhow::Result<Self> {
        let confinement = if confine { Some(Arc::new(Confinement::new()?)) } else { None };
        Ok(Self { confinement })
    }

    pub fn spawn(&self, plan: &SpawnPlan) -> io::Result<Spawned> {
        let mut cmd = Command::new(&plan.cmd);
        cmd.args(&plan.args).env_clear().envs(&plan.env).current_dir(&plan.cwd).kill_on_drop(false);

        let mut master = None;
        if let Some((cols, rows)) = plan.pty {
            let (m, slave) = pty::open(cols, rows)?;
            cmd.stdin(Stdio::from(slave.try_clone()?))
                .stdout(Stdio::from(slave.try_clone()?))
                .stderr(Stdio::from(slave));
            master = Some(m);
        } else {
            cmd.stdin(if plan.stdin { Stdio::piped() } else { Stdio::null() })
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                // Its own group, so a kill reaches the whole pipeline.
                .process_group(0);
        }

        self.confine(&mut cmd, &plan.user, if plan.pty.is_some() { Session::WithTerminal } else { Session::Inherit })?;

        let mut child = cmd.spawn()?;
        // Our copies of the slave ends live in `cmd`; drop them so the master
        // sees EOF once the child's side is gone.
        drop(cmd);
        let io = match master {
            Some(m) => ChildIo::Pty(m),
            None => ChildIo::Pipes {
                stdin: child.stdin.take(),
                stdout: child.stdout.take().ok_or_else(|| io::Error::other("no stdout pipe"))?,
                stderr: child.stderr.take().ok_or_else(|| io::Error::other("no stderr pipe"))?,
            },
        };
        Ok(Spawned { child, io })
    }

    /// Starts `plan` on descriptors the caller provides (stdin, stdout,
    /// stderr), leading a new session, so a signal to its group reaches
    /// everything it runs in the foreground. The caller reaps it.
    pub fn spawn_attached(&self, plan: &SpawnPlan, stdio: [OwnedFd; 3]) -> io::Result<Child> {
        let [stdin, stdout, stderr] = stdio;
        let mut cmd = Command::new(&plan.cmd);
        cmd.args(&plan.args)
            .env_clear()
            .envs(&plan.env)
            .current_dir(&plan.cwd)
            .kill_on_drop(false)
            .stdin(Stdio::from(stdin))
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr));
        self.confine(&mut cmd, &plan.user, Session::New)?;
        cmd.spawn()
    }

    /// Between fork and exec: the session, the switch to `user`, the
    /// sandbox confinement.
    fn confine(&self, cmd: &mut Command, user: &User, session: Session) -> io::Result<()> {
        let ids = self.identity_switch(user)?;
        let confinement = self.confinement.clone();
        // SAFETY: the hook only makes system calls on data prepared above
        // (no allocation, no locks), as required between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                match session {
                    Session::Inherit => {}
                    Session::New => {
                        check(libc::setsid())?;
                    }
                    Session::WithTerminal => {
                        // A terminal process leads its own session with the
                        // pty as controlling terminal (job control, ^C,
                        // SIGWINCH).
                        check(libc::setsid())?;
                        check(libc::ioctl(0, libc::TIOCSCTTY as _, 0))?;
                    }
                }
                if let Some((uid, gid, groups)) = &ids {
                    check(libc::setgroups(groups.len() as _, groups.as_ptr()))?;
                    check(libc::setgid(*gid))?;
                    check(libc::setuid(*uid))?;
                }
                if let Some(c) = &confinement {
                    c.apply()?;
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// The ids to switch to in the child, or `None` to stay as we are. As
    /// root we always switch (dropping our supplementary groups); otherwise
    /// we can only run as ourselves.
    fn identity_switch(&self, user: &User) -> io::Result<Option<(libc::uid_t, libc::gid_t, Vec<libc::gid_t>)>> {
        // SAFETY: getters without arguments.
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        if euid == 0 {
            return Ok(Some((user.uid, user.gid, user.groups.clone())));
        }
        if user.uid == euid && user.gid == egid {
            return Ok(None);
        }
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("cannot run as '{}': the agent is not running as root", user.name),
        ))
    }
}

/// What a child does about its session before exec.
#[derive(Debug, Clone, Copy)]
enum Session {
    /// Stays in the agent's (pipes: `process_group(0)` gives it a group).
    Inherit,
    /// Leads a new one, without a terminal.
    New,
    /// Leads a new one with its stdin, a pty, as controlling terminal.
    WithTerminal,
}

fn check(rc: libc::c_int) -> io::Result<()> {
    if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_env_overrides_agent_env_overrides_base() {
        let user = User { name: "u".into(), uid: 1, gid: 1, home: "/home/u".into(), groups: vec![1] };
        let agent: HashMap<_, _> = [("A".to_string(), "agent".to_string()), ("PATH".into(), "/x".into())].into();
        let req: HashMap<_, _> = [("A".to_string(), "req".to_string())].into();
        let env = environment(&user, std::path::Path::new("/w"), &agent, &req);
        assert_eq!(env["A"], "req");
        assert_eq!(env["PATH"], "/x");
        assert_eq!(env["HOME"], "/home/u");
        assert_eq!(env["USER"], "u");
        assert_eq!(env["PWD"], "/w");
    }
}
