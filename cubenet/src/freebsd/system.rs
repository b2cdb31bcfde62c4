//! The FreeBSD backend's effects: [`System`] runs the command lines of
//! [`super::vnet`] and [`super::pf`] for [`super::jailnet::JailNetwork`].
//! Compiled for FreeBSD only; **never run on a FreeBSD host yet**.

use std::process::Command;

use anyhow::{Context, anyhow};

use crate::freebsd::cmd::Cmd;
use crate::freebsd::jailnet::{JailNetwork, Runner};
use crate::net::NetConfig;
use crate::process;

/// The only `PATH` the tools see; plans name them by absolute path anyway.
const HOST_PATH: &str = "/sbin:/bin:/usr/sbin:/usr/bin";

pub struct System;

impl Runner for System {
    fn run(&self, cmd: &Cmd) -> anyhow::Result<String> {
        let (program, args) = cmd.argv.split_first().ok_or_else(|| anyhow!("empty command"))?;
        let mut command = Command::new(program);
        command.args(args).env_clear().env("PATH", HOST_PATH);
        process::run(&mut command, cmd.stdin.as_deref()).with_context(|| format!("`{}`", cmd.argv.join(" ")))
    }
}

pub type HostNetwork = JailNetwork<System>;

/// Opens the host's sandbox network; see [`JailNetwork::open`].
pub fn open(cfg: NetConfig) -> anyhow::Result<HostNetwork> {
    JailNetwork::open(cfg, System)
}
