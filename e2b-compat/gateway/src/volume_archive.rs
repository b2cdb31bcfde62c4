//! `copse volume export|import`: a volume as one tar stream, to back it up
//! or move it to another host. The first entry is `copse-volume.json` (the
//! record: name, team, created, the quota it had); the tree follows under
//! `data/`, with ids as the sandboxes see them (0–65535).
//!
//! Both directions go through `VolumeFiles`, so they trust the volume's
//! contents no more than the content API does: export stores a symlink as
//! a link (never its target), never opens a FIFO, socket or device (they
//! are skipped and reported), and reads each regular file from one
//! descriptor opened without following links. Import refuses an archive
//! holding `..` or absolute names, device nodes, FIFOs, links that lead
//! out of the volume, or more bytes than the volume's quota; it fills a
//! volume no record names yet (so no sandbox can mount it meanwhile) and
//! writes the record last, removing the files if anything fails.
//!
//! Consistency of an export taken while sandboxes write: each file is read
//! from one open descriptor up to the size it had when opened (a file that
//! grows meanwhile is cut there, one that shrinks is padded with zeros and
//! reported), and nothing holds across files. Pause or kill the sandboxes
//! mounting the volume for a point-in-time copy.

use std::io::{Read, Write};
use std::path::{Component, Path};

use anyhow::{Context, bail};
use copse_substrate::Substrate;
use serde::{Deserialize, Serialize};

use crate::import_claims::{self, Claim};
use crate::model::{VolumeRecord, new_id, new_token, now_ms, validate_team_name, validate_volume_name};
use crate::service::team_volume_limit;
use crate::store::Database;
use crate::volume_files::{Entry, FileError, Owner, VolumeFiles, Walked};

const FORMAT: &str = "copse-volume 1";
const MANIFEST: &str = "copse-volume.json";
const DATA: &str = "data";
/// Ids a sandbox can hold; others become `nobody` on import.
const ID_RANGE: u64 = 65536;
const NOBODY: u32 = 65534;

/// The record as the archive carries it. Never the token: an archive is a
/// file that travels, and the token is the content API's credential (the
/// import makes a new one).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub id: String,
    pub name: String,
    pub team: String,
    pub created_at_ms: i64,
    /// The volume's size limit where it was exported.
    pub quota_bytes: u64,
    pub exported_at_ms: i64,
}

/// What an export wrote, and what it left out.
#[derive(Debug, Default)]
pub struct ExportReport {
    pub files: u64,
    pub directories: u64,
    pub symlinks: u64,
    pub bytes: u64,
    /// Paths not stored (FIFOs, sockets, devices, too deep), with why.
    pub skipped: Vec<(String, &'static str)>,
    /// Files that shrank while read (their tail is zeros).
    pub changed: Vec<String>,
}

/// Writes volume `record` to `out`.
pub fn export(
    store: &dyn Database,
    substrate: &dyn Substrate,
    record: &VolumeRecord,
    out: &mut dyn Write,
) -> anyhow::Result<ExportReport> {
    export_with(substrate, record, team_volume_limit(store, &record.team)?, out)
}

/// [`export`], with the volume's size limit `quota_bytes` known.
pub fn export_with(
    substrate: &dyn Substrate,
    record: &VolumeRecord,
    quota_bytes: u64,
    out: &mut dyn Write,
) -> anyhow::Result<ExportReport> {
    let location = substrate.volume_location(&record.id)?;
    let files = VolumeFiles::new(location.root, location.id_base);
    let manifest = Manifest {
        format: FORMAT.into(),
        id: record.id.clone(),
        name: record.name.clone(),
        team: record.team.clone(),
        created_at_ms: record.created_at_ms,
        quota_bytes,
        exported_at_ms: now_ms(),
    };
    let mut tar = tar::Builder::new(out);
    let json = serde_json::to_vec_pretty(&manifest)?;
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(json.len() as u64);
    header.set_mode(0o600);
    header.set_mtime((manifest.exported_at_ms / 1000).max(0) as u64);
    tar.append_data(&mut header, MANIFEST, &json[..])?;

    let mut report = ExportReport::default();
    let mut root = tar::Header::new_gnu();
    root.set_entry_type(tar::EntryType::Directory);
    root.set_mode(0o755);
    root.set_uid(u64::from(crate::volume_files::DEFAULT_OWNER));
    root.set_gid(u64::from(crate::volume_files::DEFAULT_OWNER));
    root.set_size(0);
    tar.append_data(&mut root, DATA, std::io::empty())?;
    files.walk(&mut |entry, walked| {
        append(&mut tar, entry, walked, &mut report).map_err(|e| FileError::Invalid(format!("{}: {e}", entry.path)))
    })?;
    tar.into_inner()?.flush()?;
    Ok(report)
}

fn append<W: Write>(
    tar: &mut tar::Builder<W>,
    entry: &Entry,
    walked: Walked,
    report: &mut ExportReport,
) -> std::io::Result<()> {
    let name = format!("{DATA}{}", entry.path);
    let mut header = tar::Header::new_gnu();
    header.set_mode(entry.mode);
    header.set_uid(u64::from(entry.uid));
    header.set_gid(u64::from(entry.gid));
    header.set_mtime(entry.mtime.max(0) as u64);
    header.set_size(0);
    match walked {
        Walked::Directory => {
            header.set_entry_type(tar::EntryType::Directory);
            tar.append_data(&mut header, name, std::io::empty())?;
            report.directories += 1;
        }
        Walked::Symlink(target) => {
            header.set_entry_type(tar::EntryType::Symlink);
            tar.append_link(&mut header, name, target)?;
            report.symlinks += 1;
        }
        Walked::File(file) => {
            header.set_entry_type(tar::EntryType::Regular);
            header.set_size(entry.size);
            let mut body = Exactly { inner: file, left: entry.size, padded: false };
            tar.append_data(&mut header, name, &mut body)?;
            if body.padded {
                report.changed.push(entry.path.clone());
            }
            report.files += 1;
            report.bytes += entry.size;
        }
        Walked::Skipped(why) => report.skipped.push((entry.path.clone(), why)),
    }
    Ok(())
}

/// Exactly `left` bytes of a file a sandbox may be writing: cut where it
/// grew, zeros where it shrank (a tar entry's size is fixed in its header).
struct Exactly<R> {
    inner: R,
    left: u64,
    padded: bool,
}

impl<R: Read> Read for Exactly<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        if want == 0 {
            return Ok(0);
        }
        let mut got = if self.padded { 0 } else { self.inner.read(&mut buf[..want])? };
        if got == 0 {
            buf[..want].fill(0);
            self.padded = true;
            got = want;
        }
        self.left -= got as u64;
        Ok(got)
    }
}

/// What an import made.
#[derive(Debug)]
pub struct Imported {
    pub record: VolumeRecord,
    pub files: u64,
    pub bytes: u64,
}

/// Reads an archive into a new volume of `team` (default: the archive's),
/// named `name` (default: the archive's). A volume of that name in the
/// team is refused, never overwritten.
pub fn import(
    data_dir: &Path,
    store: &dyn Database,
    substrate: &dyn Substrate,
    input: &mut dyn Read,
    name: Option<String>,
    team: Option<String>,
) -> anyhow::Result<Imported> {
    let mut archive = tar::Archive::new(input);
    let mut entries = archive.entries()?;
    let manifest = read_manifest(&mut entries)?;
    let name = name.unwrap_or(manifest.name);
    let team = team.unwrap_or(manifest.team);
    validate_volume_name(&name)?;
    validate_team_name(&team)?;
    if store.volume_named(&team, &name)?.is_some() {
        bail!("team {team} has a volume named {name} already; import under another name with --name");
    }
    let record = VolumeRecord {
        id: new_id(),
        team,
        name,
        token: new_token(),
        created_at_ms: manifest.created_at_ms,
        node: crate::cluster::existing_node_id(data_dir)?,
        moved_out: None,
    };
    let limit = team_volume_limit(store, &record.team)?;
    let claim = Claim::take(data_dir, &record.id)?;
    if let Err(err) = substrate.create_volume(&record.id, limit) {
        undo(substrate, claim);
        return Err(err);
    }
    // Files first, the record last: until the record exists no sandbox
    // can mount the volume, so nothing races the unpacking.
    let filled = (|| -> anyhow::Result<(u64, u64)> {
        let location = substrate.volume_location(&record.id)?;
        let files = VolumeFiles::new(location.root, location.id_base);
        let (files_made, bytes) = unpack(entries, &files, limit)?;
        anyhow::ensure!(
            store.insert_volume(&record)?,
            "team {} has a volume named {} already",
            record.team,
            record.name
        );
        Ok((files_made, bytes))
    })();
    match filled {
        Ok((files, bytes)) => {
            claim.release();
            Ok(Imported { record, files, bytes })
        }
        Err(err) => {
            undo(substrate, claim);
            Err(err)
        }
    }
}

/// Reads the export of volume `record` that its node wrote when the volume
/// left it (`service/volume_moves.rs`) into `files`, the volume's new and
/// empty copy on this host. An archive of any other volume is refused.
pub fn unpack_moved(
    input: &mut dyn Read,
    record: &VolumeRecord,
    files: &VolumeFiles,
    limit: u64,
) -> anyhow::Result<()> {
    let mut archive = tar::Archive::new(input);
    let mut entries = archive.entries()?;
    let manifest = read_manifest(&mut entries)?;
    if (manifest.id.as_str(), manifest.team.as_str()) != (record.id.as_str(), record.team.as_str()) {
        bail!("the object store holds another volume than {} of team {}; it was not fetched", record.id, record.team);
    }
    unpack(entries, files, limit).map(drop)
}

/// The archive's first entry, checked.
fn read_manifest<R: Read>(entries: &mut tar::Entries<'_, R>) -> anyhow::Result<Manifest> {
    let mut first = entries.next().context("an empty archive: no copse-volume.json")??;
    if first.path()?.as_ref() != Path::new(MANIFEST) || first.header().entry_type() != tar::EntryType::Regular {
        bail!("not a copse volume export (its first entry must be {MANIFEST})");
    }
    anyhow::ensure!(first.size() <= 64 << 10, "{MANIFEST} is too large");
    let mut json = Vec::new();
    first.read_to_end(&mut json)?;
    let manifest: Manifest = serde_json::from_slice(&json).context("corrupt copse-volume.json")?;
    if manifest.format != FORMAT {
        bail!("unsupported volume export format {:?} (this copse reads {FORMAT:?})", manifest.format);
    }
    Ok(manifest)
}

/// The rest of the archive into `files`; the files and bytes written.
fn unpack<R: Read>(entries: tar::Entries<'_, R>, files: &VolumeFiles, limit: u64) -> anyhow::Result<(u64, u64)> {
    let mut unpack = Unpack { files, limit, files_made: 0, bytes: 0 };
    for entry in entries {
        unpack.entry(entry?)?;
    }
    Ok((unpack.files_made, unpack.bytes))
}

/// Removes the half-imported volume of `claim`; the claim stays if that
/// fails, for the next gateway start to try again.
fn undo(substrate: &dyn Substrate, claim: Claim) {
    match substrate.delete_volume(claim.volume_id()) {
        Ok(()) => claim.release(),
        Err(e) => tracing::warn!("removing the half-imported volume {}: {e:#}", claim.volume_id()),
    }
}

/// Removes what imports that died before their end left (their volumes no
/// record names); returns those volumes' ids. Live imports are left alone.
pub fn remove_abandoned_imports(
    data_dir: &Path,
    store: &dyn Database,
    substrate: &dyn Substrate,
) -> anyhow::Result<Vec<String>> {
    let mut removed = Vec::new();
    let here = crate::cluster::existing_node_id(data_dir)?;
    for claim in import_claims::abandoned(data_dir)? {
        // The crash came after the record: the import is whole. A volume
        // fetched from another node is whole once its record names this one.
        if store.volume(claim.volume_id())?.is_some_and(|r| r.node == here) {
            claim.release();
            continue;
        }
        removed.push(claim.volume_id().to_string());
        undo(substrate, claim);
    }
    Ok(removed)
}

struct Unpack<'a> {
    files: &'a VolumeFiles,
    limit: u64,
    files_made: u64,
    bytes: u64,
}

impl Unpack<'_> {
    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> anyhow::Result<()> {
        let raw = entry.path()?.into_owned();
        let path = inside(&raw)?;
        let header = entry.header();
        let owner = Owner {
            uid: Some(sandbox_id(header.uid()?)),
            gid: Some(sandbox_id(header.gid()?)),
            mode: Some(header.mode()? & 0o7777),
        };
        let kind = header.entry_type();
        let shown = raw.display().to_string();
        let Some(path) = path else {
            // `data/` itself: the volume's root, which exists.
            anyhow::ensure!(kind.is_dir(), "{shown}: the volume's root must be a directory");
            return Ok(());
        };
        match kind {
            tar::EntryType::Directory => {
                self.files.make_dir(&path, owner, true).map_err(|e| refused(&shown, e))?;
                self.files.set_metadata(&path, owner).map_err(|e| refused(&shown, e))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let size = entry.size();
                self.bytes = self.bytes.saturating_add(size);
                if self.bytes > self.limit {
                    bail!("the archive holds more than the volume's quota ({} bytes): refused at {shown}", self.limit);
                }
                let mut file = self.files.open_write(&path, owner).map_err(|e| refused(&shown, e))?;
                std::io::copy(&mut entry, &mut file)
                    .map_err(|e| refused(&shown, crate::volume_files::write_error(e, &path)))?;
                // The create's mode went through the umask.
                self.files.set_metadata(&path, owner).map_err(|e| refused(&shown, e))?;
                if let Ok(mtime) = entry.header().mtime() {
                    // Best effort: a copy with the time of its import is still a copy.
                    let _ = set_mtime(&file, mtime);
                }
                self.files_made += 1;
            }
            tar::EntryType::Symlink => {
                let target = entry.link_name()?.context("a symlink without a target")?.into_owned();
                link_stays_inside(&path, &target).with_context(|| format!("{shown} -> {}", target.display()))?;
                let target = target.to_str().with_context(|| format!("{shown}: a target that is not UTF-8"))?;
                self.files.symlink(&path, target, owner).map_err(|e| refused(&shown, e))?;
            }
            tar::EntryType::Link => {
                let target = entry.link_name()?.context("a hard link without a target")?.into_owned();
                let existing =
                    inside(&target)?.with_context(|| format!("{shown}: a hard link to the volume's root"))?;
                self.files.hard_link(&existing, &path).map_err(|e| refused(&shown, e))?;
            }
            other => bail!("{shown}: {other:?} entries are refused (only directories, files and links)"),
        }
        Ok(())
    }
}

fn refused(shown: &str, err: FileError) -> anyhow::Error {
    anyhow::anyhow!("{shown}: refused: {err}")
}

/// An entry's path inside the volume (`None` for `data/` itself), or a
/// refusal: only plain names under `data/` (a `./` prefix is ignored).
fn inside(raw: &Path) -> anyhow::Result<Option<String>> {
    let mut parts = Vec::new();
    for part in raw.components() {
        match part {
            Component::CurDir => {}
            Component::Normal(name) => {
                parts.push(name.to_str().with_context(|| format!("{}: a name that is not UTF-8", raw.display()))?)
            }
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                bail!("{}: absolute names and '..' are refused", raw.display())
            }
        }
    }
    match parts.split_first() {
        Some((&first, rest)) if first == DATA => Ok((!rest.is_empty()).then(|| format!("/{}", rest.join("/")))),
        _ => bail!("{}: every entry after {MANIFEST} must be under {DATA}/", raw.display()),
    }
}

/// A symlink at `path` (from the volume's root) may point only within the
/// volume: relative, with its `..` all leading and no more of them than
/// the link has directories above it. A `..` after a name could climb out
/// through another link (`up -> ..`, then `x -> up/..`); an absolute
/// target names the sandbox's own tree, not the volume.
fn link_stays_inside(path: &str, target: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(!target.as_os_str().is_empty(), "an empty link target is refused");
    let above = path.split('/').filter(|p| !p.is_empty()).count().saturating_sub(1);
    let (mut ups, mut named) = (0, false);
    for part in target.components() {
        match part {
            Component::CurDir => {}
            Component::Normal(_) => named = true,
            Component::ParentDir if named => {
                bail!("a link with '..' after a name is refused (it may lead out through another link)")
            }
            Component::ParentDir => {
                ups += 1;
                if ups > above {
                    bail!("a link leading out of the volume is refused");
                }
            }
            Component::RootDir | Component::Prefix(_) => {
                bail!("an absolute link is refused (it leads out of the volume)")
            }
        }
    }
    Ok(())
}

fn set_mtime(file: &std::fs::File, seconds: u64) -> nix::Result<()> {
    use nix::sys::time::TimeSpec;
    let mtime = TimeSpec::new(i64::try_from(seconds).unwrap_or(i64::MAX) as _, 0);
    nix::sys::stat::futimens(file, &TimeSpec::UTIME_OMIT, &mtime)
}

fn sandbox_id(id: u64) -> u32 {
    if id < ID_RANGE { id as u32 } else { NOBODY }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_under_data_are_taken() {
        assert_eq!(inside(Path::new("data")).unwrap(), None);
        assert_eq!(inside(Path::new("./data/")).unwrap(), None);
        assert_eq!(inside(Path::new("data/a/b.txt")).unwrap().as_deref(), Some("/a/b.txt"));
        for bad in ["../data/x", "/data/x", "data/../../etc/passwd", "data/a/../../x", "other/x", "copse-volume.json"] {
            assert!(inside(Path::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn links_may_not_lead_out_of_the_volume() {
        for (path, target) in [("/a", "b"), ("/d/a", "../b"), ("/d/e/a", "../../b/c"), ("/a", "./b")] {
            assert!(link_stays_inside(path, Path::new(target)).is_ok(), "{path} -> {target}");
        }
        for (path, target) in [
            ("/a", "/etc/shadow"),
            ("/a", ".."),
            ("/d/a", "../../x"),
            ("/d/a", "x/../../../y"),
            ("/d/x", "up/.."),
            ("/a", ""),
        ] {
            assert!(link_stays_inside(path, Path::new(target)).is_err(), "{path} -> {target}");
        }
    }

    #[test]
    fn a_shrinking_file_is_padded_and_a_growing_one_cut() {
        let mut out = Vec::new();
        let mut short = Exactly { inner: &b"abc"[..], left: 5, padded: false };
        short.read_to_end(&mut out).unwrap();
        assert_eq!((out.as_slice(), short.padded), (&b"abc\0\0"[..], true));
        out.clear();
        let mut long = Exactly { inner: &b"abcdef"[..], left: 4, padded: false };
        long.read_to_end(&mut out).unwrap();
        assert_eq!((out.as_slice(), long.padded), (&b"abcd"[..], false));
    }
}
