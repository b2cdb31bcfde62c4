//! The few btrfs ioctls a sandbox's disk needs: a subvolume per sandbox,
//! a qgroup limit on it, its deletion, and where the kernel reports its use.
//!
//! Struct layouts and numbers are the kernel's UAPI (`linux/btrfs.h`); the
//! sizes are checked by the tests below.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// Inode number of every subvolume's root directory.
const FIRST_FREE_OBJECTID: u64 = 256;

const PATH_NAME_MAX: usize = 4087;

#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; PATH_NAME_MAX + 1],
}

#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

#[repr(C)]
#[derive(Default)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}

#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    nodesize: u32,
    sectorsize: u32,
    clone_alignment: u32,
    csum_type: u16,
    csum_size: u16,
    flags: u64,
    generation: u64,
    metadata_uuid: [u8; 16],
    reserved: [u8; 944],
}

const QUOTA_CTL_ENABLE: u64 = 1;
const QGROUP_LIMIT_MAX_RFER: u64 = 1;

const MAGIC: u8 = 0x94;
nix::ioctl_write_ptr!(subvol_create, MAGIC, 14, VolArgs);
nix::ioctl_write_ptr!(snap_destroy, MAGIC, 15, VolArgs);
nix::ioctl_readwrite!(ino_lookup, MAGIC, 18, InoLookupArgs);
nix::ioctl_read!(fs_info, MAGIC, 31, FsInfoArgs);
nix::ioctl_readwrite!(quota_ctl, MAGIC, 40, QuotaCtlArgs);
// The kernel declares it _IOR though it only reads the argument.
nix::ioctl_read!(qgroup_limit, MAGIC, 43, QgroupLimitArgs);

fn vol_args(name: &str) -> anyhow::Result<VolArgs> {
    if name.is_empty() || name.len() > PATH_NAME_MAX || name.contains('/') || name.contains('\0') {
        bail!("{name:?} is not a subvolume name");
    }
    let mut args = VolArgs { fd: 0, name: [0; PATH_NAME_MAX + 1] };
    args.name[..name.len()].copy_from_slice(name.as_bytes());
    Ok(args)
}

fn open_dir(path: &Path) -> anyhow::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))
}

/// A btrfs file system, named by the directory copse keeps volumes in.
#[derive(Debug)]
pub struct Filesystem {
    dir: PathBuf,
    /// Where the kernel reports qgroup use: `/sys/fs/btrfs/<fsid>/qgroups`.
    qgroups: PathBuf,
}

impl Filesystem {
    /// `dir` must be on btrfs; turns quotas on (a no-op when they are).
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let handle = open_dir(dir)?;
        let stat = nix::sys::statfs::fstatfs(&handle).context("statfs")?;
        if stat.filesystem_type() != nix::sys::statfs::BTRFS_SUPER_MAGIC {
            bail!("{} is not on btrfs", dir.display());
        }
        let mut args = QuotaCtlArgs { cmd: QUOTA_CTL_ENABLE, status: 0 };
        // SAFETY: a valid fd and a struct of the layout the ioctl expects.
        unsafe { quota_ctl(handle.as_raw_fd(), &mut args) }.context("enabling btrfs quotas")?;
        // SAFETY: as above; the struct is plain data, zero is a valid value.
        let mut info: FsInfoArgs = unsafe { std::mem::zeroed() };
        unsafe { fs_info(handle.as_raw_fd(), &mut info) }.context("reading the btrfs file system's id")?;
        let qgroups = PathBuf::from(format!("/sys/fs/btrfs/{}/qgroups", uuid(&info.fsid)));
        Ok(Self { dir: dir.to_path_buf(), qgroups })
    }

    /// Makes subvolume `name` in the directory, with at most `limit_bytes`
    /// referenced by it (data and metadata). Writes past it fail with EDQUOT,
    /// whoever writes, root included.
    pub fn create(&self, name: &str, limit_bytes: u64) -> anyhow::Result<PathBuf> {
        let parent = open_dir(&self.dir)?;
        let args = vol_args(name)?;
        // SAFETY: a valid fd and a NUL-terminated name in the kernel's layout.
        unsafe { subvol_create(parent.as_raw_fd(), &args) }.with_context(|| format!("creating subvolume {name}"))?;
        let path = self.dir.join(name);
        let limited = (|| -> anyhow::Result<()> {
            let volume = open_dir(&path)?;
            // qgroupid 0: the qgroup of the subvolume the fd is in.
            let mut args = QgroupLimitArgs {
                qgroupid: 0,
                lim: QgroupLimit { flags: QGROUP_LIMIT_MAX_RFER, max_rfer: limit_bytes, ..Default::default() },
            };
            // SAFETY: a valid fd and a struct of the layout the ioctl expects.
            unsafe { qgroup_limit(volume.as_raw_fd(), &mut args) }.context("setting the qgroup limit")?;
            Ok(())
        })();
        if let Err(e) = limited {
            let _ = self.remove(name);
            return Err(e).with_context(|| format!("limiting subvolume {name}"));
        }
        Ok(path)
    }

    /// Deletes subvolume `name` whatever it holds; the kernel frees its
    /// blocks and drops its qgroup (with its limit) in the background.
    /// A plain directory of that name (not a subvolume) is removed as one.
    pub fn remove(&self, name: &str) -> anyhow::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let path = self.dir.join(name);
        let meta = match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            other => other.with_context(|| format!("reading {}", path.display()))?,
        };
        if !meta.is_dir() || meta.ino() != FIRST_FREE_OBJECTID {
            return std::fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()));
        }
        let parent = open_dir(&self.dir)?;
        let args = vol_args(name)?;
        // SAFETY: a valid fd and a NUL-terminated name in the kernel's layout.
        match unsafe { snap_destroy(parent.as_raw_fd(), &args) } {
            // Another removal of the same sandbox (its DELETE, and the
            // reaper seeing its init die of that) got there first.
            Err(nix::errno::Errno::ENOENT) => Ok(()),
            done => done.map(drop).with_context(|| format!("deleting subvolume {name}")),
        }
    }

    /// Bytes the subvolume `name` holds now: what its qgroup has committed
    /// plus what writes in flight have reserved (committed figures lag by up
    /// to a transaction, 30 s).
    pub fn used(&self, name: &str) -> anyhow::Result<u64> {
        let volume = open_dir(&self.dir.join(name))?;
        let mut args = InoLookupArgs { treeid: 0, objectid: FIRST_FREE_OBJECTID, name: [0; 4080] };
        // SAFETY: a valid fd and a struct of the layout the ioctl expects.
        unsafe { ino_lookup(volume.as_raw_fd(), &mut args) }.context("finding the subvolume's id")?;
        let qgroup = self.qgroups.join(format!("0_{}", args.treeid));
        let read = |field: &str| -> anyhow::Result<u64> {
            let path = qgroup.join(field);
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            text.trim().parse().with_context(|| format!("parsing {}", path.display()))
        };
        Ok(read("referenced")? + read("rsv_data")?)
    }
}

fn uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
}

/// Whether `path`'s file system is btrfs.
pub fn is_btrfs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::BTRFS_SUPER_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_layouts_match_the_kernel() {
        assert_eq!(std::mem::size_of::<VolArgs>(), 4096);
        assert_eq!(std::mem::size_of::<InoLookupArgs>(), 4096);
        assert_eq!(std::mem::size_of::<FsInfoArgs>(), 1024);
        assert_eq!(std::mem::size_of::<QgroupLimitArgs>(), 48);
        assert_eq!(std::mem::size_of::<QuotaCtlArgs>(), 16);
    }

    #[test]
    fn ioctl_numbers_match_the_kernel() {
        // From linux/btrfs.h as compiled for x86-64.
        assert_eq!(nix::request_code_write!(MAGIC, 14, std::mem::size_of::<VolArgs>()), 0x5000_940e);
        assert_eq!(nix::request_code_readwrite!(MAGIC, 40, std::mem::size_of::<QuotaCtlArgs>()), 0xc010_9428);
        assert_eq!(nix::request_code_read!(MAGIC, 43, std::mem::size_of::<QgroupLimitArgs>()), 0x8030_942b);
        assert_eq!(nix::request_code_read!(MAGIC, 31, std::mem::size_of::<FsInfoArgs>()), 0x8400_941f);
    }

    #[test]
    fn names_that_are_paths_are_refused() {
        for bad in ["", "a/b", "x\0y"] {
            assert!(vol_args(bad).is_err(), "{bad:?}");
        }
        assert_eq!(&vol_args("sbx").unwrap().name[..4], b"sbx\0");
    }

    #[test]
    fn fsid_reads_as_sysfs_names_it() {
        let bytes = [0xa1, 0xf2, 0xd1, 0x27, 0xee, 0x2f, 0x40, 0x3c, 0xa9, 0xfa, 0xe2, 0xbf, 0x4c, 0xfe, 0x87, 0x20];
        assert_eq!(uuid(&bytes), "a1f2d127-ee2f-403c-a9fa-e2bf4cfe8720");
    }
}
