//! Runs plans on a FreeBSD host. Compiled and linted for
//! `x86_64-unknown-freebsd`; not run on FreeBSD.

use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::command::Cmd;
use crate::host::parse_bhyve_processes;

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

/// [`crate::host::Host`] on a FreeBSD host.
pub struct FreeBsdHost;

fn std_command(cmd: &Cmd) -> Command {
    let mut c = Command::new(cmd.program);
    c.args(&cmd.args);
    c
}

impl crate::host::Host for FreeBsdHost {
    fn run(&self, cmds: &[Cmd]) -> anyhow::Result<()> {
        run_all(cmds)
    }

    fn spawn(&self, cmd: &Cmd) -> anyhow::Result<u32> {
        let mut child = spawn(cmd)?;
        let pid = child.id();
        // Reaped here so an exited bhyve never lingers as a zombie that
        // `alive` would count.
        std::thread::spawn(move || child.wait());
        Ok(pid)
    }

    fn signal(&self, pid: u32, signal: crate::host::Signal) -> anyhow::Result<()> {
        use crate::host::Signal as S;
        let sig = match signal {
            S::Stop => Signal::SIGSTOP,
            S::Cont => Signal::SIGCONT,
            S::Kill => Signal::SIGKILL,
        };
        self::signal(pid, sig)
    }

    fn alive(&self, pid: u32) -> bool {
        i32::try_from(pid).is_ok_and(|pid| kill(Pid::from_raw(pid), None).is_ok())
    }

    fn wait_exit(&self, pid: u32, timeout: std::time::Duration) -> anyhow::Result<()> {
        let start = std::time::Instant::now();
        while self.alive(pid) {
            if start.elapsed() > timeout {
                bail!("bhyve {pid} still running after {timeout:?}");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        Ok(())
    }

    fn bhyve_processes(&self) -> anyhow::Result<Vec<(u32, String)>> {
        let out = Command::new("ps").args(["-ax", "-o", "pid=", "-o", "command="]).output()?;
        Ok(parse_bhyve_processes(&String::from_utf8_lossy(&out.stdout)))
    }

    fn vmm_devices(&self) -> anyhow::Result<Vec<String>> {
        match std::fs::read_dir("/dev/vmm") {
            Ok(dir) => Ok(dir.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    }

    fn send_console(&self, console: &str, line: &str) -> anyhow::Result<()> {
        use std::io::Write;
        let mut tty =
            std::fs::OpenOptions::new().write(true).open(console).with_context(|| format!("opening {console}"))?;
        tty.write_all(line.as_bytes()).with_context(|| format!("writing to {console}"))
    }

    fn wait_agent(&self, addr: std::net::SocketAddr, timeout: std::time::Duration) -> anyhow::Result<()> {
        crate::relay::wait_health(addr, timeout)
    }

    fn pipe(&self, from: &Cmd, to: &Cmd) -> anyhow::Result<()> {
        let (from_name, to_name) = (from.to_string(), to.to_string());
        copse_freebsd_jails::streams::pipe((&mut std_command(from), &from_name), (&mut std_command(to), &to_name))
    }

    fn run_into(&self, cmd: &Cmd, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        copse_freebsd_jails::streams::run_into((&mut std_command(cmd), &cmd.to_string()), out)
    }

    fn run_from(&self, cmd: &Cmd, input: &mut dyn std::io::Read) -> anyhow::Result<()> {
        copse_freebsd_jails::streams::run_from((&mut std_command(cmd), &cmd.to_string()), input)
    }
}
