//! Each sandbox's disk quota, enforced by the kernel.
//!
//! A sandbox's writable layer (overlay `upper` and `work`) is a btrfs
//! subvolume, `<state>/disk/<id>`, whose qgroup is limited to the sandbox's
//! `disk_mb`: a write past it fails with EDQUOT for every writer, root in
//! the sandbox and the agent included (overlayfs writes with its mounter's
//! credentials, and btrfs qgroups have no capability that bypasses them).
//! Creating one is two ioctls; deleting one is one, and the kernel drops
//! the qgroup and its limit with the subvolume, so nothing is left to reset.
//!
//! Why btrfs: XFS project quotas (Docker's overlay2 choice) and ext4 project
//! quotas need the kernel's quota support, which this host's kernel is built
//! without (`XFS: quota support not available in this kernel`, `EXT4: The
//! kernel was not built with CONFIG_QUOTA`); btrfs qgroups are part of btrfs
//! itself. A host whose state directory is already on btrfs uses it
//! directly; otherwise copse makes `<state>/disk.img` once (see [`image`]).
//!
//! The subvolumes are reached by the sandbox only through overlayfs, which
//! passes no btrfs ioctl through, so code in a sandbox cannot create a
//! subvolume of its own (which would have its own, unlimited, qgroup).

pub mod btrfs;
pub mod image;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context;

const MIB: u64 = 1 << 20;

/// Where the sandboxes' writable layers live.
pub fn volumes_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("disk")
}

/// Where persistent volumes live on the same file system, each its own
/// subvolume and qgroup like a sandbox's layer. A name no sandbox id can
/// take (ids never start with a dot), so recovery never mistakes it for one.
const PERSISTENT: &str = ".volumes";

pub struct Disk {
    fs: btrfs::Filesystem,
    dir: PathBuf,
}

impl Disk {
    /// Finds or makes the btrfs file system under `<state>/disk` and turns
    /// its quotas on. Idempotent: a mount a previous run left is reused.
    pub fn open(state_dir: &Path) -> anyhow::Result<Self> {
        let dir = volumes_dir(state_dir);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        if !btrfs::is_btrfs(&dir) {
            let image = state_dir.join("disk.img");
            let free = nix::sys::statvfs::statvfs(state_dir).context("statvfs")?;
            let available = free.blocks_available() as u64 * free.fragment_size() as u64;
            if image::ensure_image(&image, image::default_size(available))? {
                tracing::info!(image = %image.display(), "made the sandboxes' disk image");
            }
            image::mount(&image, &dir)?;
        }
        let fs = btrfs::Filesystem::open(&dir)?;
        Ok(Self { fs, dir })
    }

    pub fn volume(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// A fresh writable layer for sandbox `id`, limited to `disk_mb`.
    pub fn create(&self, id: &str, disk_mb: u64) -> anyhow::Result<PathBuf> {
        self.fs.create(id, disk_mb.saturating_mul(MIB))
    }

    pub fn remove(&self, id: &str) -> anyhow::Result<()> {
        self.fs.remove(id)
    }

    /// Bytes sandbox `id`'s writable layer holds, as the quota counts them.
    pub fn used(&self, id: &str) -> anyhow::Result<u64> {
        self.fs.used(id)
    }

    /// Persistent volume `id`'s directory (which may not exist).
    pub fn persistent(&self, id: &str) -> PathBuf {
        self.dir.join(PERSISTENT).join(id)
    }

    /// Persistent volumes' parent: host root's alone (0700), so only a
    /// bind mount made by the host reaches a volume.
    fn persistent_fs(&self) -> anyhow::Result<btrfs::Filesystem> {
        let dir = self.dir.join(PERSISTENT);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        btrfs::Filesystem::open(&dir)
    }

    /// A new persistent volume limited to `limit_bytes`; an existing one
    /// is kept as it is.
    pub fn create_persistent(&self, id: &str, limit_bytes: u64) -> anyhow::Result<PathBuf> {
        let path = self.persistent(id);
        if path.is_dir() {
            return Ok(path);
        }
        self.persistent_fs()?.create(id, limit_bytes)
    }

    pub fn remove_persistent(&self, id: &str) -> anyhow::Result<()> {
        if !self.persistent(id).exists() {
            return Ok(());
        }
        self.persistent_fs()?.remove(id)
    }

    pub fn persistent_used(&self, id: &str) -> anyhow::Result<u64> {
        self.persistent_fs()?.used(id)
    }

    /// Ids of every sandbox with a writable layer here.
    pub fn ids(&self) -> Vec<String> {
        ids_in(&self.dir)
    }
}

pub fn ids_in(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().map(String::from))
        .filter(|name| !name.starts_with('.'))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Unmounts the test's file system however the test ends.
    struct Mounted(PathBuf);
    impl Drop for Mounted {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }

    fn write_until_error(path: &Path, limit: usize) -> (usize, Option<std::io::Error>) {
        let mut file = fs::File::create(path).unwrap();
        let chunk = vec![7u8; 1 << 20];
        let mut written = 0;
        while written < limit {
            if let Err(e) = file.write_all(&chunk).and_then(|()| file.sync_data()) {
                return (written, Some(e));
            }
            written += chunk.len();
        }
        (written, None)
    }

    /// Needs root (loop devices, mount) and mkfs.btrfs, as copse itself does.
    #[test]
    fn a_volume_holds_no_more_than_its_limit_and_others_still_write() {
        let state = tempfile::tempdir().unwrap();
        let disk = Disk::open(state.path()).expect("the quota file system (run as root with btrfs-progs)");
        let _mounted = Mounted(volumes_dir(state.path()));
        // A second open finds the mount and reuses it.
        drop(Disk::open(state.path()).unwrap());

        let small = disk.create("small", 16).unwrap();
        let other = disk.create("other", 16).unwrap();
        let (written, err) = write_until_error(&small.join("fill"), 64 << 20);
        let err = err.expect("writing 64 MiB into a 16 MiB volume must fail");
        assert_eq!(err.raw_os_error(), Some(libc::EDQUOT), "{err}");
        assert!(written <= 16 << 20, "{written} bytes written past the limit");
        let used = disk.used("small").unwrap();
        assert!(used > 8 << 20 && used <= 16 << 20, "used {used}");

        let (_, err) = write_until_error(&other.join("some"), 4 << 20);
        assert!(err.is_none(), "a full neighbour stopped this one: {err:?}");

        // Space is handed back: after deleting the file, writing works again.
        fs::remove_file(small.join("fill")).unwrap();
        let (_, err) = write_until_error(&small.join("again"), 4 << 20);
        assert!(err.is_none(), "{err:?}");

        disk.remove("small").unwrap();
        assert!(!small.exists());
        assert_eq!(disk.ids(), ["other"]);
        disk.remove("small").unwrap();
    }
}
