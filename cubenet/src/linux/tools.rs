//! The host tools the Linux backend still spawns: `nft` for a rule change
//! libnftables cannot take in-process (see `libnft`) and for queries, and
//! `ip -batch` for the bridge's set-up and the removal of stray veths.

use std::process::{Command, Stdio};

use anyhow::Context;

use super::libnft::LibNft;
use crate::process;

/// Applies one nft script as one transaction: in this process through
/// libnftables when the calling thread is in the namespace its context
/// writes to, else (no library, or a thread in another namespace) with the
/// `nft` program.
pub fn nft_apply(script: &str) -> anyhow::Result<()> {
    match LibNft::shared() {
        Some(lib) if lib.serves_this_thread() => lib.apply(script).context("nft"),
        _ => process::run(Command::new("nft").args(["-f", "-"]), Some(script)).map(drop).context("nft"),
    }
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
