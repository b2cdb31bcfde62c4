//! Sandbox ids on the host: every sandbox's uids and gids 0..65535 are host
//! ids [`BASE`].., in its user namespace (see `copse_jailer::linux::boot`).
//!
//! Every file in the state directory that a sandbox sees (template roots,
//! snapshot layers, upper directories) is stored in that range, so layers
//! move between sandboxes unchanged. A template's root is shifted once when
//! it is built; state directories from before user namespaces are shifted
//! once by [`migrate`], keyed by a marker file holding the base.
//!
//! Each sandbox's user namespace is owned by a host uid of its own, claimed
//! from a host-wide pool ([`Owners`]) and given back when it is destroyed.

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;

use copse_jailer::linux::boot::IdMap;

/// Host id of a sandbox's uid and gid 0.
pub const BASE: u32 = 1 << 31;

/// Host uids that own sandboxes' user namespaces: just below [`BASE`], far
/// from ordinary users' and from every sandbox's ids.
pub const OWNER_FIRST: u32 = BASE - (1 << 24);
pub const OWNER_COUNT: u32 = 1 << 24;

/// The marker, in the state directory, holding the base its files are in.
const MARKER: &str = "id-base";

/// Host directory of owner claims: one file per claimed uid, naming the
/// sandbox that holds it. Under `/run`, so a reboot (which ends every
/// sandbox) frees them all.
pub const OWNERS_DIR: &str = "/run/copse/owners";

/// Host directory holding every sandbox's stage (see
/// `copse_jailer::linux::boot::BootPlan::stage`): traversable by anyone,
/// writable only by host root, and empty outside the private mount
/// namespaces where boots and restores mount on it.
pub const STAGE_DIR: &str = "/run/copse/stage";

/// Makes sure the stage's mount points exist, with modes that let every
/// sandbox's ids through.
pub fn ensure_stage() -> anyhow::Result<PathBuf> {
    let stage = PathBuf::from(STAGE_DIR);
    for dir in [Path::new("/run/copse"), &stage] {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o711))?;
    }
    use copse_jailer::linux::boot::{STAGE_AGENT, STAGE_ROOT, STAGE_SOCKET, STAGE_VOLUMES};
    for name in [STAGE_ROOT, STAGE_AGENT, STAGE_SOCKET, STAGE_VOLUMES] {
        let dir = stage.join(name);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
    }
    Ok(stage)
}

/// The pool of namespace owners.
pub struct Owners {
    dir: PathBuf,
}

impl Owners {
    pub fn new(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf() }
    }

    /// Claims a free owner uid for `holder` (the state directory and the
    /// sandbox's id). Claims are files made with `O_EXCL`, so gateways on
    /// one host never hand out the same uid.
    pub fn claim(&self, holder: &str) -> anyhow::Result<u32> {
        fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        // Start at a spot that depends on the holder, so claims rarely
        // collide and a scan stays short.
        let start = holder.bytes().fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(u32::from(b))) % OWNER_COUNT;
        for step in 0..OWNER_COUNT {
            let uid = OWNER_FIRST + (start + step) % OWNER_COUNT;
            match fs::OpenOptions::new().write(true).create_new(true).open(self.dir.join(uid.to_string())) {
                Ok(mut file) => {
                    file.write_all(holder.as_bytes())?;
                    return Ok(uid);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("claiming an owner uid in {}", self.dir.display())),
            }
        }
        anyhow::bail!("every sandbox owner uid is taken")
    }

    /// Gives `uid` back, if `holder` still holds it.
    pub fn release(&self, uid: u32, holder: &str) {
        let path = self.dir.join(uid.to_string());
        if fs::read_to_string(&path).is_ok_and(|h| h == holder) {
            let _ = fs::remove_file(path);
        }
    }
}

/// The ids of a sandbox whose namespace `owner` owns.
pub fn map(owner: u32) -> IdMap {
    IdMap { base: BASE, owner }
}

/// Moves every inode under `root` (itself included, links not followed)
/// whose uid or gid is in `from..from+65536` to the same offset from `to`.
/// Ids outside that range stay, so shifting twice is shifting once.
/// Setuid and setgid bits, which a change of owner clears, are put back.
pub fn shift_tree(root: &Path, from: u32, to: u32) -> anyhow::Result<u64> {
    let mut changed = 0;
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = fs::symlink_metadata(&path).with_context(|| format!("reading {}", path.display()))?;
        if meta.is_dir() {
            for entry in fs::read_dir(&path).with_context(|| format!("listing {}", path.display()))? {
                stack.push(entry?.path());
            }
        }
        let (uid, gid) = (shift(meta.uid(), from, to), shift(meta.gid(), from, to));
        if uid.is_none() && gid.is_none() {
            continue;
        }
        std::os::unix::fs::lchown(&path, uid, gid).with_context(|| format!("changing owner of {}", path.display()))?;
        let special = meta.mode() & 0o6000;
        if special != 0 && meta.is_file() {
            fs::set_permissions(&path, fs::Permissions::from_mode(meta.mode() & 0o7777))
                .with_context(|| format!("restoring the mode of {}", path.display()))?;
        }
        changed += 1;
    }
    Ok(changed)
}

fn shift(id: u32, from: u32, to: u32) -> Option<u32> {
    id.checked_sub(from).filter(|offset| *offset < IdMap::RANGE).map(|offset| to + offset)
}

/// Base the state directory's files are in: [`BASE`] once migrated, 0 for
/// a state directory from before user namespaces.
fn recorded_base(state_dir: &Path) -> u32 {
    fs::read_to_string(state_dir.join(MARKER)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// One-time migration of a state directory whose files are not in
/// [`BASE`]'s range: template roots and snapshot layers are shifted, and
/// memory checkpoints are dropped (their images hold no user namespace, or
/// another base's, and CRIU would restore them as host-root processes or
/// with the wrong ids); their snapshots keep their files.
pub fn migrate(state_dir: &Path) -> anyhow::Result<()> {
    let from = recorded_base(state_dir);
    if from == BASE {
        return Ok(());
    }
    for parent in ["templates", "layers"] {
        let Ok(entries) = fs::read_dir(state_dir.join(parent)) else { continue };
        for entry in entries.filter_map(Result::ok) {
            let path = entry.path();
            let tree = if parent == "templates" { path.join("rootfs") } else { path };
            if tree.is_dir() {
                let changed = shift_tree(&tree, from, BASE)?;
                tracing::info!(tree = %tree.display(), changed, "moved files into the sandbox id range");
            }
        }
    }
    if let Ok(entries) = fs::read_dir(state_dir.join("checkpoints")) {
        for entry in entries.filter_map(Result::ok) {
            tracing::warn!(checkpoint = %entry.path().display(), "dropping a memory checkpoint from before user namespaces");
            fs::remove_dir_all(entry.path()).with_context(|| format!("removing {}", entry.path().display()))?;
        }
    }
    let marker = state_dir.join(MARKER);
    fs::write(&marker, BASE.to_string()).with_context(|| format!("writing {}", marker.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_ids_in_the_old_range_move() {
        assert_eq!(shift(0, 0, BASE), Some(BASE));
        assert_eq!(shift(1000, 0, BASE), Some(BASE + 1000));
        assert_eq!(shift(65535, 0, BASE), Some(BASE + 65535));
        assert_eq!(shift(65536, 0, BASE), None);
        assert_eq!(shift(BASE + 5, 0, BASE), None);
        assert_eq!(shift(BASE + 5, BASE, 1 << 30), Some((1 << 30) + 5));
    }

    #[test]
    fn owners_differ_and_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let owners = Owners::new(dir.path());
        let a = owners.claim("/d:a").unwrap();
        let b = owners.claim("/d:a").unwrap();
        assert_ne!(a, b);
        for uid in [a, b] {
            assert!((OWNER_FIRST..BASE).contains(&uid));
        }
        owners.release(a, "/d:other");
        assert!(dir.path().join(a.to_string()).exists(), "only the holder releases");
        owners.release(a, "/d:a");
        assert_eq!(owners.claim("/d:a").unwrap(), a);
    }

    /// Needs root (chown); the suite runs as root.
    #[test]
    fn shifting_keeps_setuid_bits_and_is_idempotent() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("su");
        fs::write(&file, "x").unwrap();
        fs::set_permissions(&file, fs::Permissions::from_mode(0o4755)).unwrap();
        std::os::unix::fs::symlink("/nowhere", dir.path().join("link")).unwrap();
        assert_eq!(shift_tree(dir.path(), 0, BASE).unwrap(), 3);
        assert_eq!(shift_tree(dir.path(), 0, BASE).unwrap(), 0);
        let meta = fs::metadata(&file).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o7777), (BASE, BASE, 0o4755));
        assert_eq!(fs::symlink_metadata(dir.path().join("link")).unwrap().uid(), BASE);
    }

    #[test]
    fn migration_runs_once_and_drops_checkpoints() {
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let rootfs = dir.path().join("templates/base/rootfs");
        fs::create_dir_all(rootfs.join("etc")).unwrap();
        fs::create_dir_all(dir.path().join("checkpoints/s1")).unwrap();
        migrate(dir.path()).unwrap();
        assert_eq!(fs::metadata(rootfs.join("etc")).unwrap().uid(), BASE);
        assert!(!dir.path().join("checkpoints/s1").exists());
        fs::create_dir_all(dir.path().join("checkpoints/s2")).unwrap();
        migrate(dir.path()).unwrap();
        assert!(dir.path().join("checkpoints/s2").exists(), "a migrated state directory is left alone");
    }
}
