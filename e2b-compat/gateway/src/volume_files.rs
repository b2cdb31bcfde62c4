//! Files inside one volume, as the content API reaches them from the host.
//!
//! A volume is writable by every sandbox mounting it, so nothing in it is
//! trusted: every path is walked from the volume's root one component at a
//! time with `O_NOFOLLOW` (a link planted anywhere on the way fails the
//! request, it is never followed out of the volume), `.`/`..` are refused
//! before any lookup, and only regular files are opened for content
//! (`O_NONBLOCK` first, then `fstat`, so a FIFO never blocks the gateway and
//! a device is never read). Plain POSIX `*at` calls: the same code serves
//! every substrate's volume directory.
//!
//! Ids: the sandboxes see the volume's files through their user namespace,
//! so a file's uid as the API reports and takes it is the host's minus the
//! substrate's id base.

use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat, mkdirat};
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, unlinkat};

/// The ids a new entry gets when the caller names none: the templates'
/// `user`, who owns the volume's root.
pub const DEFAULT_OWNER: u32 = 1000;
/// Ids a sandbox can hold (its user namespace maps this many).
const ID_RANGE: u32 = 65536;
const MAX_PATH_BYTES: usize = 4096;
/// Entries one listing returns at most, whatever its depth.
const MAX_ENTRIES: usize = 10_000;
/// Directories a walk descends at most (each level holds a descriptor).
const MAX_WALK_DEPTH: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("path {0} not found")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("path {0} already exists")]
    Exists(String),
    #[error("the volume is full (its quota is reached)")]
    Full,
    #[error("{0}: {1}")]
    Io(String, Errno),
}

pub type Result<T> = std::result::Result<T, FileError>;

/// One volume's root on the host and how its ids map.
#[derive(Debug, Clone)]
pub struct VolumeFiles {
    root: PathBuf,
    id_base: u32,
    /// Held as long as these files are in use by a content call: a volume
    /// leaving its node waits for it (`service/volume_moves.rs`).
    call: Option<std::sync::Arc<tokio::sync::OwnedRwLockReadGuard<()>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Directory,
    Symlink,
    Other,
}

/// What a walk found at one entry.
#[derive(Debug)]
pub enum Walked {
    Directory,
    /// Opened for reading, already checked to be the entry listed.
    File(std::fs::File),
    Symlink(String),
    /// Not read, with why (a FIFO, socket or device; nesting too deep).
    Skipped(&'static str),
}

/// What `stat` says about one entry, ids as the sandboxes see them.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    /// From the volume's root, starting with `/`.
    pub path: String,
    pub kind: Kind,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: i64,
    pub mtime: i64,
    pub ctime: i64,
    pub target: Option<String>,
}

/// Ids and mode for something the API creates or changes.
#[derive(Debug, Clone, Copy, Default)]
pub struct Owner {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

impl VolumeFiles {
    pub fn new(root: PathBuf, id_base: u32) -> Self {
        Self { root, id_base, call: None }
    }

    /// These files, kept from leaving their node while `call` is held.
    pub fn during(mut self, call: tokio::sync::OwnedRwLockReadGuard<()>) -> Self {
        self.call = Some(std::sync::Arc::new(call));
        self
    }

    fn open_root(&self) -> Result<OwnedFd> {
        nix::fcntl::open(&self.root, dir_flags(), Mode::empty())
            .map_err(|e| FileError::Io(format!("opening volume root {}", self.root.display()), e))
    }

    /// The directory holding `path`'s last component, and that component
    /// (`None` for the root itself). `make_parents`: missing directories on
    /// the way are made (owned as `owner` says).
    fn parent(&self, path: &str, make_parents: Option<Owner>) -> Result<(OwnedFd, Option<String>, String)> {
        let parts = split(path)?;
        let shown = format!("/{}", parts.join("/"));
        let mut dir = self.open_root()?;
        let Some((last, ancestors)) = parts.split_last() else { return Ok((dir, None, shown)) };
        for name in ancestors {
            dir = match openat(&dir, name.as_str(), dir_flags(), Mode::empty()) {
                Ok(next) => next,
                Err(Errno::ENOENT) if make_parents.is_some() => {
                    self.make_dir_at(&dir, name, make_parents.unwrap_or_default(), &shown)?;
                    openat(&dir, name.as_str(), dir_flags(), Mode::empty()).map_err(|e| walk_error(e, &shown))?
                }
                Err(e) => return Err(walk_error(e, &shown)),
            };
        }
        Ok((dir, Some(last.clone()), shown))
    }

    pub fn stat(&self, path: &str) -> Result<Entry> {
        let (dir, name, shown) = self.parent(path, None)?;
        match name {
            None => {
                let stat = fstat(&dir).map_err(|e| FileError::Io(shown.clone(), e))?;
                Ok(self.entry(&dir, "", "/", &stat))
            }
            Some(name) => {
                let stat =
                    fstatat(&dir, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW).map_err(|e| walk_error(e, &shown))?;
                Ok(self.entry(&dir, &name, &shown, &stat))
            }
        }
    }

    /// A regular file, opened for reading; anything else is refused.
    pub fn open_read(&self, path: &str) -> Result<std::fs::File> {
        let (dir, name, shown) = self.parent(path, None)?;
        let name = name.ok_or_else(|| FileError::Invalid("the volume's root is a directory".into()))?;
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
        let fd = openat(&dir, name.as_str(), flags, Mode::empty()).map_err(|e| walk_error(e, &shown))?;
        regular(&fd, &shown)?;
        Ok(std::fs::File::from(fd))
    }

    /// A regular file, created or truncated, for writing; parent
    /// directories are made as needed.
    pub fn open_write(&self, path: &str, owner: Owner) -> Result<std::fs::File> {
        let (dir, name, shown) = self.parent(path, Some(Owner { mode: None, ..owner }))?;
        let name = name.ok_or_else(|| FileError::Invalid("the volume's root is a directory".into()))?;
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let mode = mode_bits(owner.mode.unwrap_or(0o644));
        let fd = openat(&dir, name.as_str(), flags | OFlag::O_NOCTTY, mode).map_err(|e| walk_error(e, &shown))?;
        // Checked before a byte is written or truncated: a FIFO or device
        // planted under this name is refused untouched.
        regular(&fd, &shown)?;
        nix::unistd::ftruncate(&fd, 0).map_err(|e| FileError::Io(shown.clone(), e))?;
        self.own(&fd, owner, &shown)?;
        Ok(std::fs::File::from(fd))
    }

    pub fn make_dir(&self, path: &str, owner: Owner, parents: bool) -> Result<Entry> {
        let (dir, name, shown) = self.parent(path, parents.then_some(Owner { mode: None, ..owner }))?;
        let name = name.ok_or_else(|| FileError::Exists("/".into()))?;
        match self.make_dir_at(&dir, &name, owner, &shown) {
            Err(FileError::Exists(_)) if parents => {}
            other => other?,
        }
        self.stat(path)
    }

    fn make_dir_at(&self, dir: &OwnedFd, name: &str, owner: Owner, shown: &str) -> Result<()> {
        let mode = mode_bits(owner.mode.unwrap_or(0o755));
        match mkdirat(dir, name, mode) {
            Ok(()) => {}
            Err(Errno::EEXIST) => return Err(FileError::Exists(shown.to_string())),
            Err(e) => return Err(walk_error(e, shown)),
        }
        let made = openat(dir, name, dir_flags(), Mode::empty()).map_err(|e| walk_error(e, shown))?;
        self.own(&made, owner, shown)
    }

    /// New ids and mode for an entry (not a link: those are refused).
    pub fn set_metadata(&self, path: &str, owner: Owner) -> Result<Entry> {
        let (dir, name, shown) = self.parent(path, None)?;
        let fd = match &name {
            None => dir,
            Some(name) => {
                let flags =
                    OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
                let fd = openat(&dir, name.as_str(), flags, Mode::empty()).map_err(|e| walk_error(e, &shown))?;
                let stat = fstat(&fd).map_err(|e| FileError::Io(shown.clone(), e))?;
                let kind = SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT;
                if kind != SFlag::S_IFREG && kind != SFlag::S_IFDIR {
                    return Err(FileError::Invalid(format!("{shown} is neither a file nor a directory")));
                }
                fd
            }
        };
        if let Some(mode) = owner.mode {
            nix::sys::stat::fchmod(&fd, mode_bits(mode)).map_err(|e| FileError::Io(shown.clone(), e))?;
        }
        if owner.uid.is_some() || owner.gid.is_some() {
            let uid = owner.uid.map(|u| self.host_id(u)).transpose()?;
            let gid = owner.gid.map(|g| self.host_id(g)).transpose()?;
            fchown(fd.as_fd(), uid.map(Uid::from_raw), gid.map(Gid::from_raw))
                .map_err(|e| FileError::Io(shown.clone(), e))?;
        }
        self.stat(path)
    }

    /// Removes a file, link or whole directory tree; never the root.
    pub fn remove(&self, path: &str) -> Result<()> {
        let (dir, name, shown) = self.parent(path, None)?;
        let name = name.ok_or_else(|| FileError::Invalid("the volume's root cannot be removed".into()))?;
        remove_at(&dir, &name, &shown)
    }

    /// The entries under directory `path`, `depth` levels down (1: its own).
    pub fn list(&self, path: &str, depth: u32) -> Result<Vec<Entry>> {
        let (parent, name, shown) = self.parent(path, None)?;
        let dir = match name {
            None => parent,
            Some(name) => {
                openat(&parent, name.as_str(), dir_flags(), Mode::empty()).map_err(|e| walk_error(e, &shown))?
            }
        };
        let mut out = Vec::new();
        self.list_into(dir, if shown == "/" { String::new() } else { shown }, depth.max(1), &mut out)?;
        Ok(out)
    }

    fn list_into(&self, dir: OwnedFd, prefix: String, depth: u32, out: &mut Vec<Entry>) -> Result<()> {
        let names = names(&dir, &prefix)?;
        for name in names {
            if out.len() >= MAX_ENTRIES {
                return Ok(());
            }
            let path = format!("{prefix}/{name}");
            let Ok(stat) = fstatat(&dir, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else { continue };
            let entry = self.entry(&dir, &name, &path, &stat);
            let is_dir = entry.kind == Kind::Directory;
            out.push(entry);
            if is_dir && depth > 1 {
                // A directory swapped for a link since the stat fails here.
                if let Ok(child) = openat(&dir, name.as_str(), dir_flags(), Mode::empty()) {
                    self.list_into(child, path, depth - 1, out)?;
                }
            }
        }
        Ok(())
    }

    /// Every entry under the root, parents before children, in name order;
    /// `visit` gets each with what it is. Links are reported, never
    /// followed; only a regular file is opened (its `fstat` must match
    /// what the listing saw, so nothing swapped in since is read); FIFOs,
    /// sockets and devices are reported as skipped, never opened. An entry
    /// that vanishes mid-walk (a sandbox removed it) is left out.
    pub fn walk(&self, visit: &mut dyn FnMut(&Entry, Walked) -> Result<()>) -> Result<()> {
        self.walk_dir(self.open_root()?, "", 0, visit)
    }

    fn walk_dir(
        &self,
        dir: OwnedFd,
        prefix: &str,
        depth: usize,
        visit: &mut dyn FnMut(&Entry, Walked) -> Result<()>,
    ) -> Result<()> {
        for name in names(&dir, if prefix.is_empty() { "/" } else { prefix })? {
            let path = format!("{prefix}/{name}");
            let Ok(stat) = fstatat(&dir, name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) else { continue };
            let entry = self.entry(&dir, &name, &path, &stat);
            match entry.kind {
                Kind::Directory if depth >= MAX_WALK_DEPTH => visit(&entry, Walked::Skipped("nested too deep"))?,
                Kind::Directory => {
                    // Swapped for a link since the stat: the open refuses it.
                    let Ok(child) = openat(&dir, name.as_str(), dir_flags(), Mode::empty()) else { continue };
                    visit(&entry, Walked::Directory)?;
                    self.walk_dir(child, &path, depth + 1, visit)?;
                }
                Kind::File => {
                    let flags =
                        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
                    let Ok(fd) = openat(&dir, name.as_str(), flags, Mode::empty()) else { continue };
                    let Ok(opened) = fstat(&fd) else { continue };
                    if (opened.st_dev, opened.st_ino) != (stat.st_dev, stat.st_ino) {
                        continue;
                    }
                    let entry = self.entry(&dir, &name, &path, &opened);
                    visit(&entry, Walked::File(std::fs::File::from(fd)))?;
                }
                Kind::Symlink => match entry.target.clone() {
                    Some(target) => visit(&entry, Walked::Symlink(target))?,
                    None => continue,
                },
                Kind::Other => visit(&entry, Walked::Skipped("not a file, directory or link"))?,
            }
        }
        Ok(())
    }

    /// A symlink at `path` to `target`, stored as given (the caller vets
    /// it); parent directories are made as needed.
    pub fn symlink(&self, path: &str, target: &str, owner: Owner) -> Result<()> {
        let (dir, name, shown) = self.parent(path, Some(Owner { mode: None, ..owner }))?;
        let name = name.ok_or_else(|| FileError::Exists("/".into()))?;
        nix::unistd::symlinkat(target, &dir, name.as_str()).map_err(|e| walk_error(e, &shown))?;
        let uid = self.host_id(owner.uid.unwrap_or(DEFAULT_OWNER))?;
        let gid = self.host_id(owner.gid.unwrap_or(DEFAULT_OWNER))?;
        nix::unistd::fchownat(
            &dir,
            name.as_str(),
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| FileError::Io(shown, e))
    }

    /// A second name `path` for the regular file at `existing`, both in
    /// this volume; neither is followed if it is a link.
    pub fn hard_link(&self, existing: &str, path: &str) -> Result<()> {
        let (from_dir, from_name, from_shown) = self.parent(existing, None)?;
        let from_name = from_name.ok_or_else(|| FileError::Invalid("the volume's root cannot be linked".into()))?;
        let stat = fstatat(&from_dir, from_name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| walk_error(e, &from_shown))?;
        if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
            return Err(FileError::Invalid(format!("{from_shown} is not a regular file")));
        }
        let (dir, name, shown) = self.parent(path, Some(Owner::default()))?;
        let name = name.ok_or_else(|| FileError::Exists("/".into()))?;
        nix::unistd::linkat(&from_dir, from_name.as_str(), &dir, name.as_str(), AtFlags::empty())
            .map_err(|e| walk_error(e, &shown))
    }

    // `mode_t` is 32 bits on Linux, 16 on FreeBSD: the cast is needed there.
    #[allow(clippy::unnecessary_cast)]
    fn entry(&self, dir: &OwnedFd, name: &str, path: &str, stat: &FileStat) -> Entry {
        let kind = match SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT {
            SFlag::S_IFREG => Kind::File,
            SFlag::S_IFDIR => Kind::Directory,
            SFlag::S_IFLNK => Kind::Symlink,
            _ => Kind::Other,
        };
        let target = (kind == Kind::Symlink)
            .then(|| nix::fcntl::readlinkat(dir, name).ok().map(|t| t.to_string_lossy().into_owned()))
            .flatten();
        Entry {
            name: name.to_string(),
            path: path.to_string(),
            kind,
            size: stat.st_size as u64,
            mode: (stat.st_mode as u32) & 0o7777,
            uid: self.sandbox_id(stat.st_uid),
            gid: self.sandbox_id(stat.st_gid),
            atime: stat.st_atime,
            mtime: stat.st_mtime,
            ctime: stat.st_ctime,
            target,
        }
    }

    fn own(&self, fd: &OwnedFd, owner: Owner, shown: &str) -> Result<()> {
        let uid = self.host_id(owner.uid.unwrap_or(DEFAULT_OWNER))?;
        let gid = self.host_id(owner.gid.unwrap_or(DEFAULT_OWNER))?;
        fchown(fd.as_fd(), Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .map_err(|e| FileError::Io(shown.to_string(), e))
    }

    fn host_id(&self, id: u32) -> Result<u32> {
        if id >= ID_RANGE {
            return Err(FileError::Invalid(format!("id {id} is outside a sandbox's range (0 to {})", ID_RANGE - 1)));
        }
        Ok(self.id_base + id)
    }

    /// As a sandbox sees host id `id`; one outside its range is `nobody`.
    fn sandbox_id(&self, id: u32) -> u32 {
        match id.checked_sub(self.id_base) {
            Some(inside) if inside < ID_RANGE => inside,
            _ => 65534,
        }
    }
}

/// `mode_t` is 32 bits on Linux, 16 on FreeBSD: the cast is needed there.
#[allow(clippy::unnecessary_cast)]
fn mode_bits(mode: u32) -> Mode {
    Mode::from_bits_truncate((mode & 0o7777) as libc::mode_t)
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// A path's components, refusing anything that is not plain names.
fn split(path: &str) -> Result<Vec<String>> {
    if path.len() > MAX_PATH_BYTES || path.contains('\0') {
        return Err(FileError::Invalid(format!("invalid path: at most {MAX_PATH_BYTES} bytes, no NUL")));
    }
    let parts: Vec<String> = path.split('/').filter(|p| !p.is_empty()).map(String::from).collect();
    if parts.iter().any(|p| p == "." || p == "..") {
        return Err(FileError::Invalid(format!("invalid path {path:?}: '.' and '..' are not allowed")));
    }
    Ok(parts)
}

fn regular(fd: &OwnedFd, shown: &str) -> Result<()> {
    let stat = fstat(fd).map_err(|e| FileError::Io(shown.to_string(), e))?;
    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFREG {
        return Err(FileError::Invalid(format!("{shown} is not a regular file")));
    }
    Ok(())
}

/// What a failed lookup means to the caller: a missing entry is a 404, a
/// link (or a file) where a directory was needed is refused by name.
fn walk_error(err: Errno, shown: &str) -> FileError {
    match err {
        Errno::ENOENT => FileError::NotFound(shown.to_string()),
        Errno::ELOOP | Errno::ENOTDIR | Errno::EMLINK => {
            FileError::Invalid(format!("{shown}: a link or a non-directory is on the way (links are not followed)"))
        }
        Errno::ENXIO | Errno::EISDIR => FileError::Invalid(format!("{shown} is not a regular file")),
        Errno::EEXIST => FileError::Exists(shown.to_string()),
        Errno::EDQUOT | Errno::ENOSPC => FileError::Full,
        e => FileError::Io(shown.to_string(), e),
    }
}

/// Names in directory `dir` (without `.` and `..`).
fn names(dir: &OwnedFd, shown: &str) -> Result<Vec<String>> {
    let copy = openat(dir, ".", dir_flags(), Mode::empty()).map_err(|e| FileError::Io(shown.to_string(), e))?;
    let mut listing = nix::dir::Dir::from_fd(copy).map_err(|e| FileError::Io(shown.to_string(), e))?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry.map_err(|e| FileError::Io(shown.to_string(), e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != "." && name != ".." {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Removes `name` in `dir`: a directory's contents first, each opened
/// without following links, so a link swapped in mid-walk is removed as
/// a link, never followed.
fn remove_at(dir: &OwnedFd, name: &str, shown: &str) -> Result<()> {
    match unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) => return Ok(()),
        Err(Errno::EISDIR | Errno::EPERM) => {}
        Err(e) => return Err(walk_error(e, shown)),
    }
    let child = openat(dir, name, dir_flags(), Mode::empty()).map_err(|e| walk_error(e, shown))?;
    for entry in names(&child, shown)? {
        remove_at(&child, &entry, &format!("{shown}/{entry}"))?;
    }
    unlinkat(dir, name, UnlinkatFlags::RemoveDir).map_err(|e| walk_error(e, shown))
}

/// Maps a write's failure: a full volume is its own answer.
pub fn write_error(err: std::io::Error, shown: &str) -> FileError {
    match err.raw_os_error().map(Errno::from_raw) {
        Some(Errno::EDQUOT | Errno::ENOSPC) => FileError::Full,
        Some(e) => FileError::Io(shown.to_string(), e),
        None => FileError::Invalid(format!("{shown}: {err}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn volume() -> (tempfile::TempDir, VolumeFiles) {
        let dir = tempfile::tempdir().unwrap();
        let files = VolumeFiles::new(dir.path().to_path_buf(), 0);
        (dir, files)
    }

    #[test]
    fn dot_dot_and_links_never_lead_out_of_the_volume() {
        let (dir, files) = volume();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "host").unwrap();
        symlink(outside.path(), dir.path().join("escape")).unwrap();
        symlink(outside.path().join("secret"), dir.path().join("file-link")).unwrap();
        for path in ["../secret", "/a/../../secret", "./x"] {
            assert!(matches!(files.open_read(path), Err(FileError::Invalid(_))), "{path}");
        }
        assert!(matches!(files.open_read("/escape/secret"), Err(FileError::Invalid(_))));
        assert!(matches!(files.open_read("/file-link"), Err(FileError::Invalid(_))));
        assert!(matches!(files.open_write("/file-link", Owner::default()), Err(FileError::Invalid(_))));
        assert!(matches!(files.open_write("/escape/new", Owner::default()), Err(FileError::Invalid(_))));
        assert!(matches!(files.list("/escape", 1), Err(FileError::Invalid(_))));
        assert_eq!(std::fs::read_to_string(outside.path().join("secret")).unwrap(), "host");
        assert!(!outside.path().join("new").exists());
        // The link itself is listed, stat'ed and removed as a link.
        assert_eq!(files.stat("/escape").unwrap().kind, Kind::Symlink);
        files.remove("/escape").unwrap();
        assert!(outside.path().join("secret").exists());
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let (dir, files) = volume();
        nix::unistd::mkfifo(&dir.path().join("pipe"), Mode::from_bits_truncate(0o644)).unwrap();
        assert!(matches!(files.open_read("/pipe"), Err(FileError::Invalid(_))));
        assert!(matches!(files.open_write("/pipe", Owner::default()), Err(FileError::Invalid(_))));
    }

    #[test]
    fn files_and_directories_round_trip() {
        use std::io::{Read, Write};
        let (_dir, files) = volume();
        let owner = Owner { uid: Some(0), gid: Some(0), mode: None };
        files.open_write("/a/b/c.txt", owner).unwrap().write_all(b"hello").unwrap();
        let mut text = String::new();
        files.open_read("a/b/c.txt").unwrap().read_to_string(&mut text).unwrap();
        assert_eq!(text, "hello");
        let stat = files.stat("/a/b/c.txt").unwrap();
        assert_eq!(
            (stat.kind, stat.size, stat.name.as_str(), stat.path.as_str()),
            (Kind::File, 5, "c.txt", "/a/b/c.txt")
        );
        assert!(matches!(files.make_dir("/a", owner, false), Err(FileError::Exists(_))));
        files.make_dir("/a/d/e", owner, true).unwrap();
        let listed: Vec<String> = files.list("/", 3).unwrap().into_iter().map(|e| e.path).collect();
        assert_eq!(listed, ["/a", "/a/b", "/a/b/c.txt", "/a/d", "/a/d/e"]);
        assert_eq!(files.list("/a", 1).unwrap().len(), 2);
        files.set_metadata("/a/b/c.txt", Owner { mode: Some(0o600), ..Owner::default() }).unwrap();
        assert_eq!(files.stat("/a/b/c.txt").unwrap().mode, 0o600);
        files.remove("/a").unwrap();
        assert!(matches!(files.stat("/a"), Err(FileError::NotFound(_))));
        assert!(files.remove("/").is_err());
        assert!(matches!(files.open_read("/nope"), Err(FileError::NotFound(_))));
    }
}
