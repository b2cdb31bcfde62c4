//! The host tools the Linux backend still spawns: `nft` for every rule
//! change (one script, one transaction) and `ip -batch` for the bridge's
//! set-up and the removal of stray veths.

use std::process::{Command, Stdio};

use anyhow::Context;

use crate::process;

/// Applies one nft script as one transaction.
pub fn nft_apply(script: &str) -> anyhow::Result<()> {
    process::run(Command::new("nft").args(["-f", "-"]), Some(script)).map(drop).context("nft")
}

/// Whether nftables has the `inet` table `table`.
pub fn nft_table_exists(table: &str) -> bool {
    Command::new("nft")
        .args(["list", "table", "inet", table])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs `ip -batch -` in the host's network namespace.
pub fn ip_batch(script: &str) -> anyhow::Result<()> {
    process::run(Command::new("ip").args(["-batch", "-"]), Some(script))
        .map(drop)
        .with_context(|| format!("ip -batch: {}", script.lines().next().unwrap_or_default()))
}
