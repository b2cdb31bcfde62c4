//! One copse process per bridge. A second gateway on the same bridge would
//! rewrite the rules for its own sandboxes only (pointing the redirects at
//! its own proxy) and take the first one's interfaces for strays; it is
//! refused at start instead. The claim is an exclusive `flock` on a file
//! named after the bridge, in a directory the host empties at boot; the
//! kernel drops it with the process, however that ends.

use std::fs::File;
use std::path::Path;

use anyhow::Context;

/// Where each platform keeps the claims.
#[cfg(target_os = "freebsd")]
pub const CLAIMS_DIR: &str = "/var/run/copse/networks";
#[cfg(not(target_os = "freebsd"))]
pub const CLAIMS_DIR: &str = "/run/copse/networks";

/// Holds the bridge until dropped.
#[derive(Debug)]
pub struct BridgeClaim {
    _lock: File,
}

/// Claims `bridge` for this process in `dir` (see the module's doc).
pub fn claim(dir: &Path, bridge: &str) -> anyhow::Result<BridgeClaim> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(format!("{bridge}.lock"));
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(BridgeClaim { _lock: file }),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "bridge {bridge} is in use by another copse process; give this one its own --bridge and --subnet"
        ),
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("locking {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bridge_is_claimed_once_until_its_claim_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let first = claim(dir.path(), "copse0").unwrap();
        let second = claim(dir.path(), "copse0").unwrap_err();
        assert!(second.to_string().contains("in use by another copse process"), "{second:#}");
        claim(dir.path(), "copse1").expect("another bridge is free");
        drop(first);
        claim(dir.path(), "copse0").expect("free again once dropped");
    }
}
