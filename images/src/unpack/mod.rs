//! Applying an image's layers, in order, to a root directory: the OCI
//! changeset rules (whiteouts `.wh.NAME`, opaque directories
//! `.wh..wh..opq`, hard links, symlinks) with every write made beneath the
//! root by [`beneath`], whatever the layer's paths and links say.

pub mod beneath;

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{Mode, fchmod, mkdirat};
use nix::unistd::{Gid, Uid, fchown, fchownat, linkat, mkfifoat, symlinkat};

use beneath::{Kind, Root, kind_at, remove_at};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";
/// Ids a sandbox has (its user namespace maps 0..65536); an entry owned by
/// an id past them would land on a host id, so it goes to `nobody`.
const ID_RANGE: u64 = 65536;
const NOBODY: u32 = 65534;

/// What applying one layer did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub entries: u64,
    pub whiteouts: u64,
    /// Device nodes are not made: a sandbox's `/dev` is its own.
    pub devices_skipped: u64,
}

/// Applies one layer blob (a tar, gzip-compressed or not) to `root`.
pub fn apply_layer_file(root: &Path, blob: &Path) -> anyhow::Result<Applied> {
    let file = File::open(blob).with_context(|| format!("opening {}", blob.display()))?;
    let mut input = BufReader::with_capacity(1 << 16, file);
    let magic = input.fill_buf()?;
    if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        bail!("zstd-compressed layers are not supported yet (gzip and plain tar are)");
    }
    if magic.starts_with(&[0x1f, 0x8b]) {
        apply_layer(root, flate2::read::GzDecoder::new(input))
    } else {
        apply_layer(root, input)
    }
}

/// Applies one uncompressed layer stream to `root`.
pub fn apply_layer(root: &Path, stream: impl Read) -> anyhow::Result<Applied> {
    let root = Root::open(root)?;
    let mut archive = tar::Archive::new(stream);
    let mut done = Applied::default();
    // A whiteout or an opaque directory hides what lower layers had, never
    // what this layer itself brings, whichever comes first in the stream.
    let mut ours: HashSet<PathBuf> = HashSet::new();
    for entry in archive.entries().context("reading the layer")? {
        let mut entry = entry.context("reading the layer")?;
        let path = entry.path().context("an entry's path")?.into_owned();
        let parts = beneath::components(&path).with_context(|| format!("layer entry {}", path.display()))?;
        let Some(name) = parts.last().cloned() else { continue };
        let rel: PathBuf = parts.iter().collect();
        let parent_rel: PathBuf = parts[..parts.len() - 1].iter().collect();
        let name_bytes = name.as_bytes();
        if name_bytes == OPAQUE.as_bytes() {
            let dir = open_or_make_dir(&root, &parent_rel)?;
            clear_lower(&dir, &parent_rel, &ours)?;
            done.whiteouts += 1;
            continue;
        }
        if let Some(hidden) = name_bytes.strip_prefix(WHITEOUT.as_bytes()) {
            let (dir, _) = root.parent_of(&rel)?.expect("a whiteout has a name");
            remove_at(&dir, OsStr::from_bytes(hidden))?;
            done.whiteouts += 1;
            continue;
        }
        let header = entry.header();
        let owner = ids(header)?;
        let mode = Mode::from_bits_truncate((header.mode().context("an entry's mode")? & 0o7777) as _);
        let kind = header.entry_type();
        let (dir, name) = root.parent_of(&rel)?.expect("an entry has a name");
        use tar::EntryType as T;
        match kind {
            T::Directory => {
                if !matches!(kind_at(&dir, &name)?, Some(Kind::Dir)) {
                    remove_at(&dir, &name)?;
                    mkdirat(&dir, name.as_os_str(), Mode::from_bits_truncate(0o700))
                        .with_context(|| format!("creating {}", rel.display()))?;
                }
                let fd = openat(&dir, name.as_os_str(), dir_flags(), Mode::empty())?;
                own(&fd, owner, mode)?;
            }
            T::Regular | T::Continuous => {
                remove_at(&dir, &name)?;
                let fd = openat(
                    &dir,
                    name.as_os_str(),
                    OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .with_context(|| format!("creating {}", rel.display()))?;
                let mut file = File::from(fd);
                std::io::copy(&mut entry, &mut file).with_context(|| format!("writing {}", rel.display()))?;
                own(&OwnedFd::from(file), owner, mode)?;
            }
            T::Symlink => {
                let target = entry.link_name().context("a symlink's target")?.context("a symlink without target")?;
                remove_at(&dir, &name)?;
                symlinkat(target.as_os_str(), &dir, name.as_os_str())
                    .with_context(|| format!("creating symlink {}", rel.display()))?;
                fchownat(&dir, name.as_os_str(), Some(owner.0), Some(owner.1), AtFlags::AT_SYMLINK_NOFOLLOW)
                    .with_context(|| format!("changing the owner of {}", rel.display()))?;
            }
            T::Link => {
                let target = entry.link_name().context("a hard link's target")?.context("a link without target")?;
                let target_rel: PathBuf = beneath::components(&target)
                    .with_context(|| format!("hard link {} to {}", rel.display(), target.display()))?
                    .iter()
                    .collect();
                let (target_dir, target_name) = locate(&root, &target_rel)?;
                match kind_at(&target_dir, &target_name)? {
                    None => bail!("hard link {} to {}: no such file", rel.display(), target.display()),
                    Some(Kind::Dir) => bail!("hard link {} to a directory", rel.display()),
                    Some(_) => {}
                }
                remove_at(&dir, &name)?;
                // No AT_SYMLINK_FOLLOW: a link to a symlink links the
                // symlink itself, never what it points at.
                linkat(&target_dir, target_name.as_os_str(), &dir, name.as_os_str(), AtFlags::empty())
                    .with_context(|| format!("hard link {}", rel.display()))?;
            }
            T::Fifo => {
                remove_at(&dir, &name)?;
                mkfifoat(&dir, name.as_os_str(), mode).with_context(|| format!("creating fifo {}", rel.display()))?;
                fchownat(&dir, name.as_os_str(), Some(owner.0), Some(owner.1), AtFlags::AT_SYMLINK_NOFOLLOW)?;
            }
            T::Char | T::Block => {
                done.devices_skipped += 1;
                continue;
            }
            // Global PAX headers and other metadata: nothing to write.
            _ => continue,
        }
        ours.insert(rel);
        done.entries += 1;
    }
    Ok(done)
}

fn dir_flags() -> OFlag {
    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC
}

fn ids(header: &tar::Header) -> anyhow::Result<(Uid, Gid)> {
    let clamp = |id: u64| if id < ID_RANGE { id as u32 } else { NOBODY };
    Ok((Uid::from_raw(clamp(header.uid()?)), Gid::from_raw(clamp(header.gid()?))))
}

/// Owner first: changing it clears set-id bits that the mode then restores.
fn own(fd: &OwnedFd, (uid, gid): (Uid, Gid), mode: Mode) -> anyhow::Result<()> {
    fchown(fd, Some(uid), Some(gid)).context("changing an owner")?;
    fchmod(fd, mode).context("changing a mode")
}

/// The directory holding an existing entry, and its name, without making
/// anything.
fn locate(root: &Root, rel: &Path) -> anyhow::Result<(OwnedFd, OsString)> {
    let name = rel.file_name().context("an empty link target")?.to_os_string();
    let parent = rel.parent().unwrap_or(Path::new(""));
    Ok((root.open_dir(parent)?, name))
}

fn open_or_make_dir(root: &Root, rel: &Path) -> anyhow::Result<OwnedFd> {
    match root.parent_of(rel)? {
        None => root.open_dir(Path::new("")),
        Some((parent, name)) => {
            if !matches!(kind_at(&parent, &name)?, Some(Kind::Dir)) {
                remove_at(&parent, &name)?;
                mkdirat(&parent, name.as_os_str(), Mode::from_bits_truncate(0o755))?;
            }
            Ok(openat(&parent, name.as_os_str(), dir_flags(), Mode::empty())?)
        }
    }
}

/// Removes what lower layers left in the directory `rel`, keeping what this
/// layer wrote (and, inside directories this layer wrote, again only that).
fn clear_lower(dir: &OwnedFd, rel: &Path, ours: &HashSet<PathBuf>) -> anyhow::Result<()> {
    for name in beneath::list(dir)? {
        let child = rel.join(&name);
        if !ours.contains(&child) {
            remove_at(dir, &name)?;
        } else if matches!(kind_at(dir, &name)?, Some(Kind::Dir)) {
            let sub = openat(dir, name.as_os_str(), dir_flags(), Mode::empty())?;
            clear_lower(&sub, &child, ours)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
