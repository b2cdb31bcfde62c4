//! Processes started through `process.Process`: the table of running ones
//! and the supervisor that forwards their output and reports their end.

pub mod handle;
pub mod pty;
pub mod spawn;
pub mod status;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, watch};

use handle::{Event, Output, Process, ProcessConfig};
use spawn::{ChildIo, SpawnPlan};
use status::EndInfo;

/// Running processes by pid. A process leaves the table once its end has
/// been delivered.
#[derive(Default, Clone)]
pub struct Processes {
    inner: Arc<Mutex<HashMap<u32, Arc<Process>>>>,
}

/// How a request names a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selector {
    Pid(u32),
    Tag(String),
}

impl Processes {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<Process>>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn get(&self, selector: &Selector) -> Option<Arc<Process>> {
        let map = self.map();
        match selector {
            Selector::Pid(pid) => map.get(pid).cloned(),
            Selector::Tag(tag) => map.values().find(|p| p.tag.as_deref() == Some(tag)).cloned(),
        }
    }

    pub fn list(&self) -> Vec<Arc<Process>> {
        let mut all: Vec<_> = self.map().values().cloned().collect();
        all.sort_by_key(|p| p.pid);
        all
    }

    fn insert(&self, p: Arc<Process>) {
        self.map().insert(p.pid, p);
    }

    fn remove(&self, pid: u32) {
        self.map().remove(&pid);
    }
}

/// Starts `plan` and returns the process with a stream already attached, so
/// the caller misses no output. With `kill_at`, the process is killed when
/// that instant passes (envd ties a command's life to the Start timeout).
pub fn start(
    launcher: &spawn::Launcher,
    processes: &Processes,
    plan: &SpawnPlan,
    config: ProcessConfig,
    tag: Option<String>,
    kill_at: Option<tokio::time::Instant>,
) -> std::io::Result<(Arc<Process>, mpsc::Receiver<Event>)> {
    let spawned = launcher.spawn(plan)?;
    let mut child = spawned.child;
    let pid = child.id().ok_or_else(|| std::io::Error::other("process exited before it got a pid"))?;

    let (process, pipes) = match spawned.io {
        ChildIo::Pty(master) => (Process::with_pty(pid, tag, config, master), None),
        ChildIo::Pipes { stdin, stdout, stderr } => {
            (Process::with_pipe(pid, tag, config, stdin), Some((stdout, stderr)))
        }
    };
    let process = Arc::new(process);
    let events = process.subscribe();
    processes.insert(process.clone());

    let (exited_tx, exited_rx) = watch::channel(false);
    let pumps = {
        let p = process.clone();
        tokio::spawn(async move {
            match pipes {
                Some((stdout, stderr)) => {
                    tokio::join!(
                        p.pump_pipe(stdout, Output::Stdout, exited_rx.clone()),
                        p.pump_pipe(stderr, Output::Stderr, exited_rx),
                    );
                }
                None => p.pump_pty(exited_rx).await,
            }
        })
    };

    let processes = processes.clone();
    let p = process.clone();
    tokio::spawn(async move {
        let deadline = async {
            match kill_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let status = tokio::select! {
            s = child.wait() => s,
            _ = deadline => {
                let _ = signal_group(pid, libc::SIGKILL);
                child.wait().await
            }
        };
        let _ = exited_tx.send(true);
        let _ = pumps.await;
        let end = match status {
            Ok(s) => EndInfo::from_status(s),
            Err(e) => EndInfo::failed(format!("error waiting for process: {e}")),
        };
        p.finish(end).await;
        processes.remove(pid);
    });

    Ok((process, events))
}

/// Signals the process group led by `pid` (every process we start leads
/// one), falling back to the process alone.
pub fn signal_group(pid: u32, signal: libc::c_int) -> std::io::Result<()> {
    let pid = pid as libc::pid_t;
    // SAFETY: kill(2) with plain integers.
    if unsafe { libc::kill(-pid, signal) } == 0 {
        return Ok(());
    }
    // SAFETY: as above.
    if unsafe { libc::kill(pid, signal) } == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}
