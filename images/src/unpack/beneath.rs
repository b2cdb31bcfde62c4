//! File operations on paths inside a root directory, resolved one
//! component at a time from the root's descriptor.
//!
//! A layer's paths and link targets are the image author's: a symlink
//! planted by one entry (`etc -> /etc`, `x -> ../../..`) must never take a
//! later entry's write onto the host. So nothing here hands a whole path to
//! the kernel: every directory is opened with `O_NOFOLLOW` relative to its
//! parent, a symlink met on the way is interpreted as the sandbox will see
//! it (an absolute target restarts at the root, `..` stops at the root) and
//! the last component is never followed. The same calls exist on Linux and
//! FreeBSD, so this needs no platform code.

use std::ffi::{OsStr, OsString};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use anyhow::{Context, bail};
use nix::errno::Errno;
use nix::fcntl::{OFlag, openat, readlinkat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstatat, mkdirat};
use nix::unistd::{UnlinkatFlags, unlinkat};

/// Symlinks followed while resolving one path, as the kernel's own limit.
const MAX_LINKS: usize = 40;

/// A directory the operations below stay beneath.
pub struct Root {
    fd: OwnedFd,
}

/// The kind of an existing entry, never following a symlink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Dir,
    Symlink,
    Other,
}

impl Root {
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let fd = openat(nix::fcntl::AT_FDCWD, path, dir_flags(), Mode::empty())
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { fd })
    }

    /// The directory that holds `path`'s last component, created (0755,
    /// owned by whoever runs this) where missing, and that component's name.
    /// `None` for the root itself.
    pub fn parent_of(&self, path: &Path) -> anyhow::Result<Option<(OwnedFd, OsString)>> {
        let mut parts = components(path)?;
        let Some(name) = parts.pop() else { return Ok(None) };
        let dir = self.walk(parts, true)?;
        Ok(Some((dir, name)))
    }

    /// Opens an existing directory beneath the root.
    pub fn open_dir(&self, path: &Path) -> anyhow::Result<OwnedFd> {
        self.walk(components(path)?, false)
    }

    fn walk(&self, parts: Vec<OsString>, create: bool) -> anyhow::Result<OwnedFd> {
        // Every directory on the way stays open, so `..` is a pop: it can
        // never climb above the first entry, the root.
        let mut stack = vec![self.fd.try_clone()?];
        let mut pending: Vec<OsString> = parts.into_iter().rev().collect();
        let mut links = 0;
        while let Some(part) = pending.pop() {
            if part == ".." {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            let here = stack.last().expect("the root is never popped");
            match kind_at(here, &part)? {
                Some(Kind::Dir) => {}
                Some(Kind::Symlink) => {
                    links += 1;
                    if links > MAX_LINKS {
                        bail!("too many symbolic links resolving {:?}", part);
                    }
                    let target = readlinkat(here, part.as_os_str()).context("reading a symlink")?;
                    let target = Path::new(&target);
                    if target.is_absolute() {
                        stack.truncate(1);
                    }
                    for p in components_with_dots(target).into_iter().rev() {
                        pending.push(p);
                    }
                    continue;
                }
                Some(Kind::Other) => bail!("{:?} is not a directory", part),
                None if create => match mkdirat(here, part.as_os_str(), Mode::from_bits_truncate(0o755)) {
                    Ok(()) | Err(Errno::EEXIST) => {}
                    Err(e) => return Err(e).with_context(|| format!("creating directory {part:?}")),
                },
                None => bail!("{:?} does not exist", part),
            }
            let next = openat(here, part.as_os_str(), dir_flags(), Mode::empty())
                .with_context(|| format!("opening directory {part:?}"))?;
            stack.push(next);
        }
        Ok(stack.pop().expect("the root is never popped"))
    }
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

/// The entry `name` in `dir`, not following it.
pub fn stat_at(dir: impl AsFd, name: &OsStr) -> anyhow::Result<Option<FileStat>> {
    match fstatat(dir, name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW) {
        Ok(st) => Ok(Some(st)),
        Err(Errno::ENOENT) => Ok(None),
        Err(e) => Err(e).with_context(|| format!("inspecting {name:?}")),
    }
}

pub fn kind_at(dir: impl AsFd, name: &OsStr) -> anyhow::Result<Option<Kind>> {
    Ok(stat_at(dir, name)?.map(|st| kind_of(&st)))
}

pub fn kind_of(st: &FileStat) -> Kind {
    match SFlag::from_bits_truncate(st.st_mode as _) & SFlag::S_IFMT {
        SFlag::S_IFDIR => Kind::Dir,
        SFlag::S_IFLNK => Kind::Symlink,
        _ => Kind::Other,
    }
}

/// Removes `name` from `dir` whatever it is, a whole tree included, without
/// following any link inside it.
pub fn remove_at(dir: &OwnedFd, name: &OsStr) -> anyhow::Result<()> {
    match kind_at(dir, name)? {
        None => Ok(()),
        Some(Kind::Dir) => {
            let child = openat(dir, name, dir_flags(), Mode::empty()).with_context(|| format!("opening {name:?}"))?;
            empty_dir(&child, &|_| false)?;
            unlinkat(dir, name, UnlinkatFlags::RemoveDir).with_context(|| format!("removing {name:?}"))
        }
        Some(_) => unlinkat(dir, name, UnlinkatFlags::NoRemoveDir).with_context(|| format!("removing {name:?}")),
    }
}

/// Removes every entry of `dir` for which `keep` says no.
pub fn empty_dir(dir: &OwnedFd, keep: &dyn Fn(&OsStr) -> bool) -> anyhow::Result<()> {
    for name in list(dir)? {
        if !keep(&name) {
            remove_at(dir, &name)?;
        }
    }
    Ok(())
}

/// The names in `dir`, without `.` and `..`.
pub fn list(dir: &OwnedFd) -> anyhow::Result<Vec<OsString>> {
    // A fresh open, not a dup: a dup would share (and move) the offset of
    // the descriptor the caller keeps using.
    let mut listing = nix::dir::Dir::openat(dir, ".", dir_flags(), Mode::empty()).context("listing a directory")?;
    let mut names = Vec::new();
    for entry in listing.iter() {
        let entry = entry.context("listing a directory")?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name != "." && name != ".." {
            names.push(name.to_os_string());
        }
    }
    Ok(names)
}

/// A path's normal components. `..` is refused outright: a layer entry
/// that names one is malformed or an attack, and no honest image needs it.
pub fn components(path: &Path) -> anyhow::Result<Vec<OsString>> {
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p.to_os_string()),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir => bail!("{} climbs out with '..'", path.display()),
            Component::Prefix(_) => bail!("{} is not a POSIX path", path.display()),
        }
    }
    Ok(out)
}

/// A symlink target's components, `..` kept (the walk stops it at the root).
fn components_with_dots(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(p) => Some(p.to_os_string()),
            Component::ParentDir => Some(OsString::from("..")),
            _ => None,
        })
        .collect()
}
