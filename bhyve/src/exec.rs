//! Runs plans on a FreeBSD host. Compiled and linted for
//! `x86_64-unknown-freebsd`; not run on FreeBSD.

use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::command::Cmd;

/// Run commands in order; stop at the first failure that is not allowed.
pub fn run_all(cmds: &[Cmd]) -> anyhow::Result<()> {
    for cmd in cmds {
        match run(cmd) {
            Err(e) if cmd.may_fail => eprintln!("ignored: {e:#}"),
            other => other?,
        }
    }
    Ok(())
}

/// Run a short command to completion; its stderr becomes the error.
pub fn run(cmd: &Cmd) -> anyhow::Result<()> {
    let out = Command::new(cmd.program)
        .args(&cmd.args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("spawning {cmd}"))?;
    if !out.status.success() {
        bail!("{cmd}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Start a long-lived bhyve; the caller owns the child and reaps it.
pub fn spawn(cmd: &Cmd) -> anyhow::Result<Child> {
    Command::new(cmd.program)
        .args(&cmd.args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("spawning {cmd}"))
}

/// Hold a restored guest still: every bhyve thread, vCPUs included, stops.
pub fn stop(pid: u32) -> anyhow::Result<()> {
    signal(pid, Signal::SIGSTOP)
}

/// Hand a stopped guest out.
pub fn resume(pid: u32) -> anyhow::Result<()> {
    signal(pid, Signal::SIGCONT)
}

fn signal(pid: u32, sig: Signal) -> anyhow::Result<()> {
    let pid = i32::try_from(pid).context("pid out of range")?;
    kill(Pid::from_raw(pid), sig).with_context(|| format!("{sig} to {pid}"))
}
