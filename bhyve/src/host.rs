//! Everything [`crate::substrate::BhyveSubstrate`] does to the host, as one
//! trait: the FreeBSD implementation is `exec::FreeBsdHost`; tests use a
//! recording double, so the substrate's sequences run on Linux as command
//! transcripts.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use crate::command::Cmd;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    Stop,
    Cont,
    Kill,
}

pub trait Host: Send + Sync + 'static {
    /// Run commands in order; stop at the first failure not allowed to fail.
    fn run(&self, cmds: &[Cmd]) -> anyhow::Result<()>;
    /// Start a long-lived bhyve; the host reaps it when it exits.
    fn spawn(&self, cmd: &Cmd) -> anyhow::Result<u32>;
    fn signal(&self, pid: u32, signal: Signal) -> anyhow::Result<()>;
    fn alive(&self, pid: u32) -> bool;
    /// Wait for a bhyve that was told to suspend to exit.
    fn wait_exit(&self, pid: u32, timeout: Duration) -> anyhow::Result<()>;
    /// `(pid, vm name)` of every running bhyve.
    fn bhyve_processes(&self) -> anyhow::Result<Vec<(u32, String)>>;
    /// Names under `/dev/vmm`.
    fn vmm_devices(&self) -> anyhow::Result<Vec<String>>;
    /// Write one control line to a guest's console (host end of its nmdm).
    fn send_console(&self, console: &str, line: &str) -> anyhow::Result<()>;
    /// Wait until the guest agent at `addr` answers `GET /health`.
    fn wait_agent(&self, addr: SocketAddr, timeout: Duration) -> anyhow::Result<()>;
    fn pipe(&self, from: &Cmd, to: &Cmd) -> anyhow::Result<()>;
    fn run_into(&self, cmd: &Cmd, out: &mut dyn Write) -> anyhow::Result<()>;
    fn run_from(&self, cmd: &Cmd, input: &mut dyn Read) -> anyhow::Result<()>;
}

/// `ps -ax -o pid= -o command=` lines of bhyve processes: bhyve sets its
/// title to `bhyve: <vm name>`.
pub fn parse_bhyve_processes(ps: &str) -> Vec<(u32, String)> {
    ps.lines()
        .filter_map(|line| {
            let (pid, command) = line.trim().split_once(char::is_whitespace)?;
            let name = command.trim().strip_prefix("bhyve: ")?;
            Some((pid.parse().ok()?, name.split_whitespace().next()?.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn bhyve_titles() {
        let ps = "  1 /sbin/init\n 812 bhyve: copse-python-3 (bhyve)\n 900 bhyve: copse-python-tpl\n  x bhyve: y\n";
        assert_eq!(
            super::parse_bhyve_processes(ps),
            [(812, "copse-python-3".to_string()), (900, "copse-python-tpl".to_string())]
        );
    }
}
