//! Layers whose files arrive as they are read: an EROFS image of a layer,
//! mounted read-only where the layer's directory would be, over a file
//! that something else (the gateway's `copse lazy-image`, reading the
//! object store) serves and fills in as the kernel reads it.
//!
//! Under the state directory, `lazy/<layer>/` belongs to the layer of that
//! name: `fuse/image` is the served image (a FUSE mount made by the
//! server), `image` the server's local copy, `complete` written once every
//! byte of it is there, `mounted-local` while the copy itself is mounted
//! (a restart has nothing to redo). The layer's own `layers/<layer>` is
//! the image mounted. Removing the layer unmounts both, which ends the server.
//!
//! An image is made from a frozen layer by `mkfs.erofs`, uncompressed (the
//! object store compresses its chunks), holes kept, with a fixed build
//! time and UUID so one layer always makes the same image.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{Context, bail};
use copse_substrate::ImageSource;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, MountOption,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};
use nix::mount::{MntFlags, MsFlags};

/// The served image, under a layer's lazy directory.
const SERVED: &str = "fuse/image";
/// The server's local copy, and the mark that it is whole.
const LOCAL: &str = "image";
const COMPLETE: &str = "complete";
/// Written by [`mount`] when it mounts the local copy.
const MOUNTED_LOCAL: &str = "mounted-local";
const IMAGE_UUID: &str = "c0b5e000-0000-4000-8000-000000000001";
/// The image's build time, fixed (2100-01-01): mkfs.erofs clamps file
/// times above it, so every time a sandbox can set is kept as it is.
const BUILD_TIME: &str = "4102444800";

pub fn root(state_dir: &Path) -> PathBuf {
    state_dir.join("lazy")
}

pub fn dir(state_dir: &Path, layer: &str) -> PathBuf {
    root(state_dir).join(layer)
}

/// Writes an EROFS image of `layer_dir` to `out`, keeping ownership,
/// modes, times, device nodes (overlay's whiteouts) and xattrs (its opaque
/// directories).
pub fn make_image(layer_dir: &Path, out: &Path) -> anyhow::Result<()> {
    let output = Command::new("mkfs.erofs")
        .arg("--quiet")
        // Not -T, which would give every file that time.
        .env("SOURCE_DATE_EPOCH", BUILD_TIME)
        .arg(format!("-U{IMAGE_UUID}"))
        // Holes stay holes: without chunks a sparse file is written out
        // whole, and a tenant's small sparse file would be a huge image.
        .arg("--chunksize=4096")
        .arg(out)
        .arg(layer_dir)
        .stdin(Stdio::null())
        .output()
        .context("running mkfs.erofs (Debian's erofs-utils)")?;
    if !output.status.success() {
        let _ = fs::remove_file(out);
        bail!("mkfs.erofs {} failed: {}", layer_dir.display(), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(())
}

/// Mounts layer `layer`'s image at `at`: the served one, or the local copy
/// once whole (after a restart, with no server needed any more).
pub fn mount(state_dir: &Path, layer: &str, at: &Path) -> anyhow::Result<()> {
    let dir = dir(state_dir, layer);
    let local = dir.join(COMPLETE).exists();
    let source = if local { dir.join(LOCAL) } else { dir.join(SERVED) };
    fs::create_dir_all(at)?;
    // nodev/nosuid: the image holds a tenant's files; overlay reads its
    // whiteouts (0/0 character devices) without opening them.
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NODEV | MsFlags::MS_NOSUID;
    nix::mount::mount(Some(&source), at, Some("erofs"), flags, None::<&str>)
        .with_context(|| format!("mounting the image of layer {layer} ({})", source.display()))?;
    match local {
        true => fs::write(dir.join(MOUNTED_LOCAL), b"")?,
        false => remove_if_there(&dir.join(MOUNTED_LOCAL))?,
    }
    Ok(())
}

/// Whether layer `layer` is mounted at `at` from its local copy, needing
/// no server.
pub fn is_mounted_locally(state_dir: &Path, layer: &str, at: &Path) -> bool {
    is_mounted(at) && dir(state_dir, layer).join(MOUNTED_LOCAL).exists()
}

fn remove_if_there(path: &Path) -> std::io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Whether `path` is the root of a mount (its device differs from its
/// parent's).
pub fn is_mounted(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let (Ok(own), Some(Ok(parent))) = (fs::symlink_metadata(path), path.parent().map(fs::symlink_metadata)) else {
        return false;
    };
    own.dev() != parent.dev()
}

/// Unmounts layer `layer`'s image from `at` and its server's mount, which
/// ends the server. Detached: a sandbox still on the image keeps it, and a
/// server that died must not hold the directory.
pub fn unmount(state_dir: &Path, layer: &str, at: &Path) {
    let _ = nix::mount::umount2(at, MntFlags::MNT_DETACH);
    let _ = nix::mount::umount2(&dir(state_dir, layer).join("fuse"), MntFlags::MNT_DETACH);
}

/// Unmounts layer `layer` ([`unmount`]), then removes its lazy directory.
pub fn remove(state_dir: &Path, layer: &str, at: &Path) -> anyhow::Result<()> {
    let dir = dir(state_dir, layer);
    unmount(state_dir, layer, at);
    if dir.join("fuse").exists() && is_mounted(&dir.join("fuse")) {
        bail!("the server of layer {layer} is still mounted");
    }
    match fs::remove_dir_all(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
}

/// The layers that are lazy here.
pub fn layers(state_dir: &Path) -> Vec<String> {
    fs::read_dir(root(state_dir))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !name.starts_with('.'))
        .collect()
}

/// Serves `source` as the file `fuse/image` in lazy directory `dir` until
/// that mount is removed ([`remove`]); `ready` runs once the file can be
/// read. Requests are served on a few threads, so a read waiting for the
/// object store does not hold up reads of chunks already here.
pub fn serve(dir: &Path, source: Arc<dyn ImageSource>, ready: impl FnOnce()) -> anyhow::Result<()> {
    let mountpoint = dir.join("fuse");
    let mut config = fuser::Config::default();
    config.mount_options =
        vec![MountOption::RO, MountOption::NoDev, MountOption::NoSuid, MountOption::FSName("copse-lazy".into())];
    // The kernel's reads of the image come from whichever task touches a
    // file in it: a sandbox's processes too.
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(4);
    let session = fuser::Session::new(ImageFs { source }, &mountpoint, &config)
        .with_context(|| format!("mounting {}", mountpoint.display()))?;
    let background = session.spawn()?;
    ready();
    background.join().map_err(|e| anyhow::anyhow!("serving {}: {e:?}", mountpoint.display()))?;
    Ok(())
}

/// One read-only file, `image`, in an otherwise empty root.
struct ImageFs {
    source: Arc<dyn ImageSource>,
}

const IMAGE_INO: INodeNo = INodeNo(2);
/// Nothing here ever changes.
const TTL: Duration = Duration::from_secs(24 * 3600);

impl ImageFs {
    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, size, nlink) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o500, 0, 2),
            IMAGE_INO => (FileType::RegularFile, 0o400, self.source.size(), 1),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }
}

impl Filesystem for ImageFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (parent, name.to_str()) {
            (INodeNo::ROOT, Some("image")) => reply.entry(&TTL, &self.attr(IMAGE_INO).expect("known"), Generation(0)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(attr) => reply.attr(&TTL, &attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (IMAGE_INO, FileType::RegularFile, "image"),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok()
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match ino {
            // The page cache may keep what it read: the bytes never change.
            IMAGE_INO => reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE),
            _ => reply.error(Errno::EACCES),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != IMAGE_INO {
            return reply.error(Errno::ENOENT);
        }
        match self.source.read_at(offset, size as usize) {
            Ok(data) => reply.data(&data),
            Err(e) => {
                tracing::warn!("serving a lazily fetched layer image at {offset}: {e}");
                reply.error(Errno::EIO)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_makes_the_same_image_each_time() {
        if Command::new("mkfs.erofs").arg("--help").output().is_err() {
            eprintln!("skipped: no mkfs.erofs (scripts/bootstrap installs it)");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let layer = tmp.path().join("layer");
        fs::create_dir_all(layer.join("d")).unwrap();
        fs::write(layer.join("d/file"), "contents").unwrap();
        std::os::unix::fs::symlink("d/file", layer.join("link")).unwrap();
        // A tenant's sparse file costs the image what it holds.
        fs::File::create(layer.join("hole")).unwrap().set_len(256 << 20).unwrap();
        let (one, two) = (tmp.path().join("one"), tmp.path().join("two"));
        make_image(&layer, &one).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        make_image(&layer, &two).unwrap();
        assert_eq!(fs::read(&one).unwrap(), fs::read(&two).unwrap());
        assert!(fs::metadata(&one).unwrap().len() < 4 << 20, "{} bytes", fs::metadata(&one).unwrap().len());
        assert!(make_image(&tmp.path().join("missing"), &tmp.path().join("three")).is_err());
    }
}
