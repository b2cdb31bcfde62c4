//! Volume imports in flight, so that an import a crash cut short is undone
//! and one still running is left alone.
//!
//! `copse volume import` fills a volume that no record names until the
//! end. If its process dies in between (kill -9, power loss), its files
//! stay on disk, and nothing else tells them from a live import's. So an
//! import first claims its volume id: a file named after the id under
//! `<data dir>/volume-imports`, exclusively `flock`ed for the importing
//! process's life. The kernel drops the lock when that process dies, so a
//! claim file whose lock can be taken belongs to an import that will never
//! finish; a gateway start removes its volume (unless a record names it:
//! the crash came after the record was written) and the claim.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};

const DIR: &str = "volume-imports";

/// Names a claim has before it is in place; never a volume id.
const PRIVATE_PREFIX: &str = ".";

/// A volume id held by this process's import.
pub struct Claim {
    path: PathBuf,
    _lock: Flock<File>,
}

impl Claim {
    /// Claims `volume_id` for an import starting now.
    ///
    /// The claim appears under its name already locked: it is made and
    /// locked under a private name first and then linked into place. Made
    /// in place, a gateway starting between the create and the lock would
    /// take the lock itself and call the import abandoned.
    pub fn take(data_dir: &Path, volume_id: &str) -> anyhow::Result<Self> {
        let dir = data_dir.join(DIR);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(volume_id);
        let unlinked = dir.join(format!("{PRIVATE_PREFIX}{volume_id}.{}", std::process::id()));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&unlinked)
            .with_context(|| format!("creating {}", unlinked.display()))?;
        let lock = Flock::lock(file, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, errno)| anyhow::anyhow!("locking {}: {errno}", unlinked.display()));
        // `link` fails if the name exists: one import per id.
        let placed = lock.and_then(|lock| {
            fs::hard_link(&unlinked, &path).with_context(|| format!("claiming {}", path.display()))?;
            Ok(lock)
        });
        let _ = fs::remove_file(&unlinked);
        Ok(Self { path, _lock: placed? })
    }

    pub fn volume_id(&self) -> &str {
        self.path.file_name().and_then(|n| n.to_str()).unwrap_or_default()
    }

    /// The import finished, or undid itself: nothing is left to clean up.
    pub fn release(self) {
        if let Err(e) = fs::remove_file(&self.path) {
            tracing::warn!("removing the import claim {}: {e}", self.path.display());
        }
    }
}

/// Claims whose import process is gone, each now held by the caller.
/// One still locked is a live import, and is skipped.
pub fn abandoned(data_dir: &Path) -> anyhow::Result<Vec<Claim>> {
    let dir = data_dir.join(DIR);
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut claims = Vec::new();
    for entry in entries {
        let path = entry?.path();
        let Ok(file) = OpenOptions::new().read(true).custom_flags(nix::libc::O_NOFOLLOW).open(&path) else {
            continue;
        };
        let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else { continue };
        let private = path.file_name().and_then(|n| n.to_str()).is_none_or(|n| n.starts_with(PRIVATE_PREFIX));
        if private {
            // An import that died before its claim was in place made nothing yet.
            let _ = fs::remove_file(&path);
            drop(lock);
        } else {
            claims.push(Claim { path, _lock: lock });
        }
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_claim_is_not_abandoned_and_a_dropped_one_is() {
        let dir = tempfile::tempdir().unwrap();
        let live = Claim::take(dir.path(), "vol-live").unwrap();
        assert!(Claim::take(dir.path(), "vol-live").is_err(), "one import per id");
        // What a process that died mid-import leaves: the file, unlocked.
        drop(Claim::take(dir.path(), "vol-dead").unwrap());

        let found: Vec<String> = abandoned(dir.path()).unwrap().iter().map(|c| c.volume_id().to_string()).collect();
        assert_eq!(found, ["vol-dead"]);
        assert_eq!(fs::read_dir(dir.path().join(DIR)).unwrap().count(), 2, "no private names left behind");
        live.release();
        for claim in abandoned(dir.path()).unwrap() {
            claim.release();
        }
        assert!(abandoned(dir.path()).unwrap().is_empty());
        assert_eq!(fs::read_dir(dir.path().join(DIR)).unwrap().count(), 0);
    }

    #[test]
    fn a_claim_dropped_before_it_was_in_place_is_removed_and_names_no_volume() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join(DIR)).unwrap();
        fs::write(dir.path().join(DIR).join(".vol-x.4242"), b"").unwrap();
        assert!(abandoned(dir.path()).unwrap().is_empty());
        assert_eq!(fs::read_dir(dir.path().join(DIR)).unwrap().count(), 0);
    }
}
