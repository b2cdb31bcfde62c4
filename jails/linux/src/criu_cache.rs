//! CRIU's cache of what the kernel supports. Every CRIU run first probes
//! the kernel's features (about 35 ms of a restore on the reference host)
//! unless it finds the answers in `/run/criu.kdat`, a file CRIU writes
//! itself only where `/run` is a tmpfs, so that a reboot (maybe into
//! another kernel) clears it. Where `/run` is on a disk, as in some
//! containers, CRIU never keeps it and every restore and dump probes again.
//!
//! There copse writes the cache for it: `criu check`, run in a private
//! mount namespace over a tmpfs `/run`, writes it there, and copse copies
//! it out. A marker beside it names the boot it was made in, so a cache
//! that outlived a reboot is made again, never read. CRIU reads the file
//! wherever it is (it checks the file system only when it writes), and
//! drops one it cannot use (another CRIU's), which copse then makes again.

use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, ensure};

const CACHE: &str = "/run/criu.kdat";
const MARKER: &str = "/run/criu.kdat.copse-boot";
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, PartialEq, Eq)]
enum Action {
    /// CRIU keeps the cache itself, or copse's is of this boot.
    Leave,
    Make,
}

fn decide(run_is_tmpfs: bool, cache_exists: bool, marked_boot: Option<&str>, boot: &str) -> Action {
    match (run_is_tmpfs, cache_exists, marked_boot) {
        (true, _, _) => Action::Leave,
        (false, true, Some(marked)) if marked == boot => Action::Leave,
        _ => Action::Make,
    }
}

/// Makes sure CRIU (`binary`) finds its cache on a host whose `/run` is
/// not a tmpfs. A failure costs only speed: the caller logs it.
pub fn ensure(binary: &Path) -> anyhow::Result<()> {
    use nix::sys::statfs::{TMPFS_MAGIC, statfs};
    let run_is_tmpfs = statfs("/run").context("statfs /run")?.filesystem_type() == TMPFS_MAGIC;
    let boot = fs::read_to_string(BOOT_ID).with_context(|| format!("reading {BOOT_ID}"))?;
    let boot = boot.trim();
    let marked = fs::read_to_string(MARKER).ok();
    let exists = Path::new(CACHE).is_file();
    if decide(run_is_tmpfs, exists, marked.as_deref().map(str::trim), boot) == Action::Leave {
        return Ok(());
    }
    let cache = make(binary)?;
    let partial = format!("/run/.copse-criu-kdat.{}", std::process::id());
    fs::write(&partial, &cache).with_context(|| format!("writing {partial}"))?;
    fs::rename(&partial, CACHE).with_context(|| format!("renaming {partial} to {CACHE}"))?;
    fs::write(MARKER, format!("{boot}\n")).with_context(|| format!("writing {MARKER}"))?;
    tracing::info!(cache = CACHE, "wrote CRIU's kernel feature cache (/run is not a tmpfs, so CRIU keeps none)");
    Ok(())
}

/// The cache `criu check` writes where `/run` is a tmpfs, made in a mount
/// namespace of its own (util-linux's `unshare`) so the host's `/run` is
/// untouched.
fn make(binary: &Path) -> anyhow::Result<Vec<u8>> {
    let script = "mount -t tmpfs -o mode=0755 tmpfs /run && \"$0\" check >/dev/null 2>&1; exec cat /run/criu.kdat";
    let output = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", script])
        .arg(binary)
        .output()
        .context("running criu check in a mount namespace of its own")?;
    ensure!(
        output.status.success() && !output.stdout.is_empty(),
        "criu check left no cache: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    Ok(output.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_is_made_where_criu_keeps_none_and_only_once_a_boot() {
        assert_eq!(decide(true, false, None, "b1"), Action::Leave, "CRIU keeps it on a tmpfs");
        assert_eq!(decide(false, false, None, "b1"), Action::Make);
        assert_eq!(decide(false, true, Some("b1"), "b1"), Action::Leave);
        assert_eq!(decide(false, true, Some("b0"), "b1"), Action::Make, "made before a reboot");
        assert_eq!(decide(false, true, None, "b1"), Action::Make, "not copse's: its boot is unknown");
        assert_eq!(decide(false, false, Some("b1"), "b1"), Action::Make, "CRIU dropped it");
    }
}
