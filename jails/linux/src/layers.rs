//! Filesystem snapshots as stacks of read-only overlay layers.
//!
//! A snapshot copies a sandbox's upper directory once, into a new layer;
//! the layers beneath it (its template and the layers of the snapshot it
//! was itself started from) are shared, not copied. A sandbox started from
//! a snapshot stacks the snapshot's layers under a fresh upper directory, so
//! starting one costs the same whatever the snapshot's size.
//!
//! Host layout under the state directory:
//! - `layers/<layer>/`: one frozen upper directory (overlay whiteouts and
//!   opaque-directory xattrs included, so it works as a lower layer);
//! - `snapshots/<id>.json`: a snapshot: its template and layers, top first;
//! - `sandboxes/<id>/base.json`: what a sandbox stacks on (written at boot).
//!
//! A snapshot fetched lazily from another node may also name a memory
//! layer: an image of its checkpoint served from the object store and
//! mounted like the others, never stacked under a sandbox's files; its
//! checkpoint directory is a link to it (`Base::memory`).
//!
//! Layers are immutable and are removed when no snapshot or sandbox names
//! them any more.

use std::collections::HashSet;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use copse_substrate::{LayerImages, SnapshotInfo};

/// What a sandbox or a snapshot stacks on: a template and layers, top first.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Base {
    pub template: String,
    pub layers: Vec<String>,
    /// The lazy layer whose image the snapshot's checkpoint reads its
    /// pages from; a sandbox restored from it names it too, which keeps it
    /// while the restore may still read it ([`sandbox_layers`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
}

impl Base {
    /// Every layer a snapshot keeps: its files' and its memory's.
    fn named(self) -> impl Iterator<Item = String> {
        self.layers.into_iter().chain(self.memory)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapshotFile {
    #[serde(flatten)]
    base: Base,
    size_bytes: u64,
    /// In an export only: the host id its layers' sandbox ids start at
    /// (absent: 0, an export from before user namespaces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    id_base: Option<u32>,
}

pub struct LayerStore {
    state_dir: PathBuf,
    layers: PathBuf,
    snapshots: PathBuf,
    /// Serializes every change to the set of layers and who names them, so
    /// a collection never races a snapshot or a boot that adds a name.
    lock: Mutex<()>,
}

impl LayerStore {
    pub fn open(state_dir: &Path) -> anyhow::Result<Self> {
        let layers = state_dir.join("layers");
        let snapshots = state_dir.join("snapshots");
        for dir in [&layers, &snapshots] {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        Ok(Self { state_dir: state_dir.to_path_buf(), layers, snapshots, lock: Mutex::new(()) })
    }

    pub fn layer_dir(&self, layer: &str) -> PathBuf {
        self.layers.join(layer)
    }

    fn snapshot_file(&self, id: &str) -> PathBuf {
        self.snapshots.join(format!("{id}.json"))
    }

    /// Held while the set of layers or their names changes: the mutex
    /// orders this process's threads, the `flock` other processes (`copse
    /// snapshot import` beside a running gateway).
    fn guard(&self) -> (std::sync::MutexGuard<'_, ()>, Option<Flock<fs::File>>) {
        let threads = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let file = fs::OpenOptions::new().create(true).append(true).open(self.layers.join(".lock"));
        let processes = file.ok().and_then(|f| Flock::lock(f, FlockArg::LockExclusive).ok());
        (threads, processes)
    }

    pub fn get(&self, id: &str) -> anyhow::Result<Option<Base>> {
        Ok(self.read(id)?.map(|f| f.base))
    }

    fn read(&self, id: &str) -> anyhow::Result<Option<SnapshotFile>> {
        match fs::read(self.snapshot_file(id)) {
            Ok(bytes) => Ok(Some(serde_json::from_slice(&bytes).with_context(|| format!("corrupt snapshot {id}"))?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading snapshot {id}")),
        }
    }

    /// Records what a sandbox stacks on, under the lock, so the layers it
    /// names cannot be collected between lookup and boot.
    pub fn pin(&self, sandbox_dir: &Path, snapshot: Option<&str>, template: &str) -> anyhow::Result<Base> {
        let _guard = self.guard();
        let base = match snapshot {
            Some(id) => self.get(id)?.with_context(|| format!("snapshot {id} not found"))?,
            None => Base { template: template.to_string(), layers: Vec::new(), memory: None },
        };
        // Not synced: it matters only while the sandbox runs, and a host
        // crash ends every sandbox (this keeps fsyncs off the create path).
        write_json_unsynced(&sandbox_dir.join("base.json"), &base)?;
        Ok(base)
    }

    /// Copies `upper` (whose writers the caller has stopped) into a new
    /// layer on top of `below`, and records it as snapshot `id`. An existing
    /// snapshot of that id is replaced.
    pub fn capture(&self, id: &str, upper: &Path, below: &Base) -> anyhow::Result<SnapshotInfo> {
        let _guard = self.guard();
        let layer = new_layer_name(id);
        let staging = self.layers.join(format!(".staging-{layer}"));
        copy_tree(upper, &staging)?;
        sync_filesystem(&staging)?;
        fs::rename(&staging, self.layer_dir(&layer)).context("publishing the layer")?;
        sync_dir(&self.layers)?;
        let mut layers = vec![layer];
        layers.extend(below.layers.iter().cloned());
        let size_bytes = layers.iter().map(|l| super::rootfs::tree_size(&self.layer_dir(l))).sum();
        let base = Base { template: below.template.clone(), layers, memory: None };
        let file = SnapshotFile { base, size_bytes, id_base: None };
        write_json(&self.snapshot_file(id), &file)?;
        Ok(info(id, &file))
    }

    pub fn list(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        Ok(self.files()?.iter().map(|(id, file)| info(id, file)).collect())
    }

    /// Every snapshot's id and record, by id.
    fn files(&self) -> anyhow::Result<Vec<(String, SnapshotFile)>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.snapshots)?.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_suffix(".json")
                && let Some(file) = self.read(id)?
            {
                out.push((id.to_string(), file));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Forgets a snapshot; its layers go once nothing else names them.
    pub fn delete(&self, id: &str, sandboxes: &Path) -> anyhow::Result<()> {
        let _guard = self.guard();
        match fs::remove_file(self.snapshot_file(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        self.collect(sandboxes)
    }

    /// Removes every layer no snapshot and no sandbox under `sandboxes`
    /// names, and staging directories a crash left behind: a layer's, and
    /// an export's or import's whose process is gone (`copse snapshot
    /// import` runs beside the gateway).
    pub fn collect_garbage(&self, sandboxes: &Path) -> anyhow::Result<()> {
        let _guard = self.guard();
        for entry in fs::read_dir(&self.state_dir)?.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(pid) = stream_staging_owner(&name)
                && !Path::new(&format!("/proc/{pid}")).exists()
            {
                fs::remove_dir_all(entry.path()).with_context(|| format!("removing {name}"))?;
            }
        }
        self.collect(sandboxes)
    }

    /// Runs `remove` (template `template`'s removal) unless a snapshot or a
    /// sandbox under `sandboxes` stacks on the template: `Ok(false)` then.
    /// Under the lock [`Self::pin`] takes, so no boot starts stacking on it
    /// between the look and the removal.
    pub fn unless_stacked_on(
        &self,
        template: &str,
        sandboxes: &Path,
        remove: impl FnOnce() -> anyhow::Result<()>,
    ) -> anyhow::Result<bool> {
        let _guard = self.guard();
        let in_snapshot = self.files()?.iter().any(|(_, f)| f.base.template == template);
        if in_snapshot || sandbox_bases(sandboxes).any(|b| b.template == template) {
            return Ok(false);
        }
        remove()?;
        Ok(true)
    }

    fn collect(&self, sandboxes: &Path) -> anyhow::Result<()> {
        let mut named: HashSet<String> = self.files()?.into_iter().flat_map(|(_, f)| f.base.named()).collect();
        named.extend(sandbox_layers(sandboxes));
        for entry in fs::read_dir(&self.layers)?.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !named.contains(&name) && name != ".lock" {
                if crate::lazy::dir(&self.state_dir, &name).exists() {
                    crate::lazy::remove(&self.state_dir, &name, &entry.path())?;
                }
                fs::remove_dir_all(entry.path()).with_context(|| format!("removing layer {name}"))?;
            }
        }
        Ok(())
    }

    /// Images of snapshot `id`'s layers, top first, written under `into`
    /// (`crate::lazy::make_image`), the template they sit on, and an image
    /// of its memory `checkpoint` directory if it has one.
    pub fn images(&self, id: &str, checkpoint: Option<&Path>, into: &Path) -> anyhow::Result<LayerImages> {
        let file = self.read(id)?.with_context(|| format!("snapshot {id} not found"))?;
        let mut images = Vec::new();
        for (i, layer) in file.base.layers.iter().enumerate() {
            let image = into.join(format!("{i}.erofs"));
            crate::lazy::make_image(&self.layer_dir(layer), &image)?;
            images.push(image);
        }
        let memory = match checkpoint {
            Some(dir) => {
                let image = into.join("memory.erofs");
                crate::lazy::make_image(dir, &image)?;
                Some(image)
            }
            None => None,
        };
        Ok(LayerImages { template: file.base.template, images, memory })
    }

    /// Where snapshot `id`'s checkpoint is, if it was fetched lazily: its
    /// memory layer, which its checkpoint directory links to.
    pub fn memory_layer_dir(&self, id: &str) -> anyhow::Result<Option<PathBuf>> {
        Ok(self.read(id)?.and_then(|f| f.base.memory).map(|layer| self.layer_dir(&layer)))
    }

    /// Mounts lazy layer `layer` (from [`Self::new_lazy_layer`], its image
    /// served by now) where its directory is, and returns that.
    fn mount_lazy(&self, layer: &str) -> anyhow::Result<PathBuf> {
        copse_substrate::template::validate_name(layer).map_err(copse_substrate::SubstrateError::Invalid)?;
        let at = self.layer_dir(layer);
        crate::lazy::mount(&self.state_dir, layer, &at)?;
        Ok(at)
    }

    /// A new layer name for snapshot `id`, and the directory in which its
    /// image is to be served (`crate::lazy`) before [`Self::import_lazy`].
    pub fn new_lazy_layer(&self, id: &str) -> anyhow::Result<(String, PathBuf)> {
        let name = new_layer_name(id);
        let dir = crate::lazy::dir(&self.state_dir, &name);
        fs::create_dir_all(dir.join("fuse")).with_context(|| format!("creating {}", dir.display()))?;
        Ok((name, dir))
    }

    /// Removes lazy layer `layer` that no snapshot took in, and its server.
    pub fn discard_lazy(&self, layer: &str) -> anyhow::Result<()> {
        let _guard = self.guard();
        let at = self.layer_dir(layer);
        crate::lazy::remove(&self.state_dir, layer, &at)?;
        match fs::remove_dir(&at) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// Keeps snapshot `id` as `layers` (top first, each from
    /// [`Self::new_lazy_layer`], its image served by now) on `template`.
    /// With `memory`, a lazy layer serving an image of its checkpoint and
    /// where its checkpoint goes: a link to the mounted image there, so a
    /// restore reads the pages as they arrive. (CRIU resolves the link once,
    /// opening its image directory; each restored task then opens its page
    /// images in that directory itself, after moving into the sandbox's
    /// root, so links inside the directory would name nothing.) On failure
    /// the caller discards the layers ([`Self::discard_lazy`]), mounted or
    /// not, the memory's too.
    pub fn import_lazy(
        &self,
        id: &str,
        template: &str,
        layers: &[String],
        memory: Option<(&str, &Path)>,
        size_bytes: u64,
    ) -> anyhow::Result<SnapshotInfo> {
        let _guard = self.guard();
        for layer in layers {
            self.mount_lazy(layer)?;
        }
        // Under the lock, like the layers: a collection never sees the
        // memory layer mounted and named by no snapshot.
        if let Some((layer, checkpoint)) = memory {
            let mounted = self.mount_lazy(layer)?;
            fs::create_dir_all(checkpoint.parent().unwrap_or(Path::new("/")))?;
            std::os::unix::fs::symlink(&mounted, checkpoint).context("linking the memory checkpoint")?;
        }
        let memory = memory.map(|(layer, _)| layer.to_string());
        let base = Base { template: template.to_string(), layers: layers.to_vec(), memory };
        let file = SnapshotFile { base, size_bytes, id_base: None };
        write_json(&self.snapshot_file(id), &file)?;
        Ok(info(id, &file))
    }

    /// As the gateway stops: unmounts the lazy layers no sandbox stacks on,
    /// which ends their servers. The next start mounts each again from its
    /// local copy if whole, or drops its snapshots to be fetched again
    /// ([`Self::recover_lazy`]). Layers under kept sandboxes stay served.
    pub fn release_lazy(&self, sandboxes: &Path) -> anyhow::Result<()> {
        let _guard = self.guard();
        let in_use: HashSet<String> = sandbox_layers(sandboxes).collect();
        for layer in crate::lazy::layers(&self.state_dir).into_iter().filter(|l| !in_use.contains(l)) {
            crate::lazy::unmount(&self.state_dir, &layer, &self.layer_dir(&layer));
        }
        Ok(())
    }

    /// At start: mounts again the lazy layers a host restart unmounted,
    /// from their local copy when it is whole. A snapshot on one whose
    /// copy is not (its server is gone with the restart, or died) is
    /// dropped, to be fetched again; lazy directories of no layer (a fetch
    /// cut short) are removed.
    pub fn recover_lazy(&self, sandboxes: &Path) -> anyhow::Result<()> {
        let _guard = self.guard();
        let mut broken = HashSet::new();
        for layer in crate::lazy::layers(&self.state_dir) {
            let at = self.layer_dir(&layer);
            if !at.is_dir() {
                crate::lazy::remove(&self.state_dir, &layer, &at)?;
                continue;
            }
            let served = crate::lazy::dir(&self.state_dir, &layer).join("fuse/image");
            let whole = crate::lazy::dir(&self.state_dir, &layer).join("complete").exists();
            let served_live = crate::lazy::is_mounted(&at) && fs::metadata(&served).is_ok();
            if served_live || crate::lazy::is_mounted_locally(&self.state_dir, &layer, &at) {
                continue;
            }
            // Sandboxes still on a mount whose server died keep it; later
            // ones get the local copy.
            crate::lazy::unmount(&self.state_dir, &layer, &at);
            if !(whole && crate::lazy::mount(&self.state_dir, &layer, &at).is_ok()) {
                broken.insert(layer);
            }
        }
        for (id, file) in self.files()? {
            if file.base.clone().named().any(|l| broken.contains(&l)) {
                tracing::warn!(snapshot = %id, "a lazily fetched layer of this snapshot is incomplete and unserved: dropped, to be fetched again");
                fs::remove_file(self.snapshot_file(&id))?;
            }
        }
        self.collect(sandboxes)
    }

    /// One tar stream: `snapshot.json` (template, layers), the memory
    /// `checkpoint` directory if there is one, then each layer, with the
    /// xattrs and device nodes overlay relies on.
    /// `id_base` is recorded, so an importer with another shifts the layers.
    pub fn export(&self, id: &str, checkpoint: Option<&Path>, id_base: u32, out: &mut dyn Write) -> anyhow::Result<()> {
        let mut file = self.read(id)?.with_context(|| format!("snapshot {id} not found"))?;
        file.id_base = Some(id_base);
        // The checkpoint travels inside the export, not as a layer.
        file.base.memory = None;
        let staging = tempdir_in(&self.state_dir, "export")?;
        let result = (|| {
            write_json(&staging.join("snapshot.json"), &file)?;
            // The same snapshot exports to the same bytes (an object store
            // keeps chunks by content): no export-time mtime, no tar pid
            // or access times in the pax headers, entries in name order.
            fs::File::options().write(true).open(staging.join("snapshot.json"))?.set_modified(std::time::UNIX_EPOCH)?;
            let mut tar = Command::new("tar");
            tar.args(TAR_FLAGS)
                .args(REPEATABLE_TAR_FLAGS)
                .arg("-cf")
                .arg("-")
                .arg("-C")
                .arg(&staging)
                .arg("snapshot.json");
            if let Some(checkpoint) = checkpoint {
                tar.arg("-C").arg(checkpoint.parent().unwrap_or(Path::new("/")));
                let name = checkpoint_name(checkpoint)?;
                // Exact matches only: a layer's name may start with it.
                tar.arg(format!("--transform=s,^{name}$,{CHECKPOINT},;s,^{name}/,{CHECKPOINT}/,"));
                tar.arg(name);
            }
            tar.arg("-C").arg(&self.layers).args(&file.base.layers);
            tar_into(&mut tar, out).with_context(|| format!("exporting snapshot {id}"))
        })();
        let _ = fs::remove_dir_all(&staging);
        result
    }

    /// Reads an [`Self::export`] stream into snapshot `id`, and its memory
    /// checkpoint (if any) into `checkpoint`. Layers get new names here, so
    /// imports never collide with layers already present. Layers exported
    /// with another id base than `id_base` are shifted to it, and their
    /// memory is dropped (its images map the other base's ids).
    pub fn import(
        &self,
        id: &str,
        checkpoint: &Path,
        id_base: u32,
        input: &mut dyn Read,
    ) -> anyhow::Result<SnapshotInfo> {
        let staging = tempdir_in(&self.state_dir, "import")?;
        let result = (|| {
            untar(input, &staging).context("not a copse snapshot export")?;
            let bytes = fs::read(staging.join("snapshot.json")).context("the export has no snapshot.json")?;
            let mut file: SnapshotFile = serde_json::from_slice(&bytes).context("corrupt snapshot.json")?;
            let exported_base = file.id_base.take().unwrap_or(0);
            file.base.memory = None;
            let same_ids = exported_base == id_base;
            for layer in &file.base.layers {
                copse_substrate::template::validate_name(layer).map_err(copse_substrate::SubstrateError::Invalid)?;
                if !same_ids && staging.join(layer).is_dir() {
                    crate::ids::shift_tree(&staging.join(layer), exported_base, id_base)?;
                }
            }
            sync_filesystem(&staging)?;
            let _guard = self.guard();
            let mut renamed = Vec::new();
            for layer in &file.base.layers {
                copse_substrate::template::validate_name(layer).map_err(copse_substrate::SubstrateError::Invalid)?;
                let name = new_layer_name(id);
                fs::rename(staging.join(layer), self.layer_dir(&name))
                    .with_context(|| format!("the export lacks layer {layer}"))?;
                renamed.push(name);
            }
            file.base.layers = renamed;
            let memory = same_ids && staging.join(CHECKPOINT).is_dir();
            if memory {
                fs::create_dir_all(checkpoint.parent().unwrap_or(Path::new("/")))?;
                fs::rename(staging.join(CHECKPOINT), checkpoint).context("keeping the memory checkpoint")?;
                sync_dir(checkpoint.parent().unwrap_or(Path::new("/")))?;
            }
            sync_dir(&self.layers)?;
            write_json(&self.snapshot_file(id), &file)?;
            Ok(SnapshotInfo { memory, ..info(id, &file) })
        })();
        let _ = fs::remove_dir_all(&staging);
        result
    }

    /// Memory checkpoint `checkpoint` alone as a tar stream, for lazy
    /// fetch (which sends the layers apart, as images).
    pub fn export_checkpoint(&self, checkpoint: &Path, out: &mut dyn Write) -> anyhow::Result<()> {
        let mut tar = Command::new("tar");
        tar.args(TAR_FLAGS).args(REPEATABLE_TAR_FLAGS).arg("-cf").arg("-").arg("-C").arg(checkpoint).arg(".");
        tar_into(&mut tar, out).with_context(|| format!("exporting checkpoint {}", checkpoint.display()))
    }

    /// Reads an [`Self::export_checkpoint`] stream into `checkpoint`, which
    /// appears only once whole.
    pub fn import_checkpoint(&self, checkpoint: &Path, input: &mut dyn Read) -> anyhow::Result<()> {
        let staging = tempdir_in(&self.state_dir, "import")?;
        let result = (|| {
            let images = staging.join(CHECKPOINT);
            fs::create_dir(&images)?;
            untar(input, &images).context("not a checkpoint")?;
            sync_filesystem(&images)?;
            let parent = checkpoint.parent().unwrap_or(Path::new("/"));
            fs::create_dir_all(parent)?;
            fs::rename(&images, checkpoint).context("keeping the memory checkpoint")?;
            sync_dir(parent)
        })();
        let _ = fs::remove_dir_all(&staging);
        result
    }
}

/// Runs `tar` (writing an archive to its stdout) and copies the archive
/// to `out`.
fn tar_into(tar: &mut Command, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut child = tar.stdout(Stdio::piped()).spawn().context("running tar")?;
    std::io::copy(child.stdout.as_mut().expect("piped"), out).context("writing the stream")?;
    let status = child.wait()?;
    if !status.success() {
        bail!("tar failed ({status})");
    }
    Ok(())
}

/// Extracts tar stream `input` into `into`, keeping what overlay needs.
fn untar(input: &mut dyn Read, into: &Path) -> anyhow::Result<()> {
    let mut child = Command::new("tar")
        .args(TAR_FLAGS)
        .arg("-xf")
        .arg("-")
        .arg("-C")
        .arg(into)
        .stdin(Stdio::piped())
        .spawn()
        .context("running tar")?;
    std::io::copy(input, child.stdin.as_mut().expect("piped")).context("reading the stream")?;
    drop(child.stdin.take());
    let status = child.wait()?;
    if !status.success() {
        bail!("tar failed ({status})");
    }
    Ok(())
}

/// Where an export holds a memory checkpoint's images.
const CHECKPOINT: &str = "checkpoint";

/// What each sandbox under `sandboxes` stacks on, as its boot pinned it.
fn sandbox_bases(sandboxes: &Path) -> impl Iterator<Item = Base> {
    sandbox_dirs_and_bases(sandboxes).map(|(_, base)| base)
}

fn sandbox_dirs_and_bases(sandboxes: &Path) -> impl Iterator<Item = (PathBuf, Base)> {
    fs::read_dir(sandboxes).into_iter().flatten().filter_map(Result::ok).filter_map(|entry| {
        let bytes = fs::read(entry.path().join("base.json")).ok()?;
        Some((entry.path(), serde_json::from_slice::<Base>(&bytes).ok()?))
    })
}

/// The layers the sandboxes under `sandboxes` keep: those they stack on,
/// and the memory layer of one whose restore may still read it. Once its
/// pager is done a sandbox needs its checkpoint no more, so a sandbox that
/// lives on (a paused one resumed on this node) does not hold its
/// memory's image, which the next collection removes once no snapshot
/// names it either.
fn sandbox_layers(sandboxes: &Path) -> impl Iterator<Item = String> {
    sandbox_dirs_and_bases(sandboxes).flat_map(|(dir, base)| {
        let memory = base.memory.filter(|_| crate::lazy_pages::may_read_checkpoint(&dir));
        base.layers.into_iter().chain(memory)
    })
}

/// A checkpoint directory's own name, safe inside a tar `--transform`.
fn checkpoint_name(dir: &Path) -> anyhow::Result<&str> {
    dir.file_name()
        .and_then(|n| n.to_str())
        .filter(|n| copse_substrate::template::validate_name(n).is_ok())
        .with_context(|| format!("checkpoint directory {} has no plain name", dir.display()))
}

/// Overlay marks whiteouts with device nodes and opaque directories with
/// `trusted.overlay.*` xattrs; a layer that loses either shows deleted
/// files again.
const TAR_FLAGS: &[&str] = &["--xattrs", "--xattrs-include=*", "--numeric-owner", "--acls"];
/// GNU tar names each pax header after its own pid and records access and
/// change times; without them, and in name order, a tree writes the same
/// stream every time.
const REPEATABLE_TAR_FLAGS: &[&str] =
    &["--sort=name", "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime"];

fn info(id: &str, file: &SnapshotFile) -> SnapshotInfo {
    SnapshotInfo {
        id: id.to_string(),
        template: file.base.template.clone(),
        size_bytes: file.size_bytes,
        memory: false,
    }
}

fn new_layer_name(snapshot: &str) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    format!("{snapshot}-{nanos:x}")
}

/// The process that made export or import staging directory `name` (see
/// [`tempdir_in`]), if that is what it is.
fn stream_staging_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(".export-").or_else(|| name.strip_prefix(".import-"))?;
    rest.split_once('-')?.0.parse().ok()
}

fn tempdir_in(parent: &Path, what: &str) -> anyhow::Result<PathBuf> {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    let dir = parent.join(format!(".{what}-{}-{nanos:x}", std::process::id()));
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Atomically and durably: a crash (of the gateway or of the host) leaves
/// the old file or the new one, never a torn or empty one.
fn write_json(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = fs::File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
    file.write_all(&serde_json::to_vec(value)?).with_context(|| format!("writing {}", tmp.display()))?;
    file.sync_all().with_context(|| format!("syncing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

fn write_json_unsynced(path: &Path, value: &impl Serialize) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, serde_json::to_vec(value)?).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

/// Flushes every file of the file system `path` is on: a layer is many
/// files, and one `syncfs` costs less than an `fsync` per file. It runs
/// before a layer is published, so a record never names a layer whose
/// files a host crash could still lose.
pub(crate) fn sync_filesystem(path: &Path) -> anyhow::Result<()> {
    let dir = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    nix::unistd::syncfs(&dir).with_context(|| format!("syncing the file system of {}", path.display()))
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    fs::File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", dir.display()))
}

/// `cp -a` keeps ownership, modes, times, device nodes and xattrs (overlay's
/// `trusted.*` ones too, as root); `--reflink=auto` shares extents on file
/// systems that can (btrfs, XFS) and copies elsewhere.
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    let output = Command::new("cp")
        .arg("-a")
        .arg("--reflink=auto")
        .arg("--no-target-directory")
        .arg(from)
        .arg(to)
        .stdin(Stdio::null())
        .output()
        .context("running cp")?;
    if !output.status.success() {
        let _ = fs::remove_dir_all(to);
        bail!("copying {} failed: {}", from.display(), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, LayerStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = LayerStore::open(dir.path()).unwrap();
        fs::create_dir_all(dir.path().join("sandboxes")).unwrap();
        (dir, store)
    }

    #[test]
    fn a_dead_importers_staging_is_collected_and_a_live_ones_kept() {
        let (dir, store) = store();
        let live = tempdir_in(dir.path(), "import").unwrap();
        // No process has the largest pid the kernel can hand out (2^22).
        let dead = dir.path().join(".import-4194304-1f");
        fs::create_dir_all(dead.join("layer")).unwrap();
        let other = dir.path().join(".import-notes");
        fs::create_dir_all(&other).unwrap();
        store.collect_garbage(&dir.path().join("sandboxes")).unwrap();
        assert!(live.is_dir() && other.is_dir());
        assert!(!dead.exists());
    }

    fn upper(root: &Path, name: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = root.join(name);
        for (path, body) in files {
            let path = dir.join(path);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, body).unwrap();
        }
        dir
    }

    #[test]
    fn snapshots_stack_on_what_they_were_taken_from() {
        let (dir, store) = store();
        let first = upper(dir.path(), "u1", &[("a.txt", "one")]);
        let s1 = store.capture("s1", &first, &Base { template: "base".into(), layers: vec![], memory: None }).unwrap();
        assert_eq!(s1.template, "base");
        assert_eq!(s1.size_bytes, 3);
        let below = store.get("s1").unwrap().unwrap();
        let second = upper(dir.path(), "u2", &[("b.txt", "two!")]);
        store.capture("s2", &second, &below).unwrap();
        let s2 = store.get("s2").unwrap().unwrap();
        assert_eq!(s2.layers.len(), 2);
        assert_eq!(s2.layers[1], below.layers[0]);
        assert_eq!(fs::read_to_string(store.layer_dir(&s2.layers[0]).join("b.txt")).unwrap(), "two!");
        assert_eq!(store.list().unwrap().iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), ["s1", "s2"]);
    }

    #[test]
    fn layers_live_while_a_snapshot_or_sandbox_names_them() {
        let (dir, store) = store();
        let sandboxes = dir.path().join("sandboxes");
        let u = upper(dir.path(), "u", &[("f", "x")]);
        store.capture("s1", &u, &Base { template: "base".into(), layers: vec![], memory: None }).unwrap();
        let layer = store.get("s1").unwrap().unwrap().layers[0].clone();
        let sandbox = sandboxes.join("sbx");
        fs::create_dir_all(&sandbox).unwrap();
        store.pin(&sandbox, Some("s1"), "base").unwrap();

        store.delete("s1", &sandboxes).unwrap();
        assert!(store.get("s1").unwrap().is_none());
        assert!(store.layer_dir(&layer).exists(), "the sandbox still stacks on it");

        fs::remove_dir_all(&sandbox).unwrap();
        store.collect_garbage(&sandboxes).unwrap();
        assert!(!store.layer_dir(&layer).exists());
    }

    #[test]
    fn a_template_is_removed_only_once_no_snapshot_or_sandbox_stacks_on_it() {
        let (dir, store) = store();
        let sandboxes = dir.path().join("sandboxes");
        let removed = std::cell::Cell::new(0);
        let remove = || {
            removed.set(removed.get() + 1);
            Ok(())
        };
        let u = upper(dir.path(), "u", &[("f", "x")]);
        store.capture("s1", &u, &Base { template: "image-a".into(), layers: vec![], memory: None }).unwrap();
        let sandbox = sandboxes.join("sbx");
        fs::create_dir_all(&sandbox).unwrap();
        store.pin(&sandbox, None, "image-a").unwrap();

        assert!(!store.unless_stacked_on("image-a", &sandboxes, remove).unwrap(), "a snapshot and a sandbox");
        store.delete("s1", &sandboxes).unwrap();
        assert!(!store.unless_stacked_on("image-a", &sandboxes, remove).unwrap(), "a sandbox");
        assert!(store.unless_stacked_on("base", &sandboxes, remove).unwrap(), "another template's");
        fs::remove_dir_all(&sandbox).unwrap();
        assert!(store.unless_stacked_on("image-a", &sandboxes, remove).unwrap());
        assert_eq!(removed.get(), 2);
    }

    /// A snapshot whose memory is served as a layer (no mount here: the
    /// layer's directory stands in for its mounted image).
    fn snapshot_with_memory_layer(store: &LayerStore, id: &str, memory: &str) {
        fs::create_dir_all(store.layer_dir(memory)).unwrap();
        let files = format!("{id}-files");
        fs::create_dir_all(store.layer_dir(&files)).unwrap();
        let base = Base { template: "base".into(), layers: vec![files], memory: Some(memory.into()) };
        write_json(&store.snapshot_file(id), &SnapshotFile { base, size_bytes: 0, id_base: None }).unwrap();
    }

    #[test]
    fn a_memory_layer_lives_while_its_snapshot_or_a_sandbox_restored_from_it_names_it() {
        let (dir, store) = store();
        let sandboxes = dir.path().join("sandboxes");
        snapshot_with_memory_layer(&store, "s1", "mem1");
        store.collect_garbage(&sandboxes).unwrap();
        assert!(store.layer_dir("mem1").exists());
        assert_eq!(store.memory_layer_dir("s1").unwrap(), Some(store.layer_dir("mem1")));
        let sandbox = sandboxes.join("sbx");
        fs::create_dir_all(&sandbox).unwrap();
        assert_eq!(store.pin(&sandbox, Some("s1"), "base").unwrap().memory.as_deref(), Some("mem1"));

        store.delete("s1", &sandboxes).unwrap();
        assert!(store.layer_dir("mem1").exists(), "its restore has not put the tree back yet");
        let work_dir = sandbox.join(crate::lazy_pages::WORK_DIR);
        fs::create_dir_all(&work_dir).unwrap();
        fs::write(work_dir.join(crate::lazy_pages::RESTORED_PID), "1").unwrap();
        let me = std::process::id() as i32;
        let started = crate::process_start_time(me).unwrap();
        fs::write(work_dir.join("lazy-pages.pid"), format!("{me} {started}")).unwrap();
        store.collect_garbage(&sandboxes).unwrap();
        assert!(store.layer_dir("mem1").exists(), "its pager still copies");
        fs::remove_file(work_dir.join("lazy-pages.pid")).unwrap();
        store.collect_garbage(&sandboxes).unwrap();
        assert!(!store.layer_dir("mem1").exists(), "a restored sandbox needs its checkpoint no more");
        assert!(store.layer_dir("s1-files").exists(), "but still stacks on its files");
    }

    #[test]
    fn a_snapshot_of_a_sandbox_restored_from_a_memory_layer_does_not_name_it() {
        let (dir, store) = store();
        snapshot_with_memory_layer(&store, "s1", "mem1");
        let below = store.get("s1").unwrap().unwrap();
        let u = upper(dir.path(), "u", &[("f", "x")]);
        store.capture("s2", &u, &below).unwrap();
        assert_eq!(store.get("s2").unwrap().unwrap().memory, None, "its own dump is its memory");
    }

    #[test]
    fn an_export_of_a_snapshot_with_a_memory_layer_names_no_layer_of_this_host() {
        let (_dir, store) = store();
        snapshot_with_memory_layer(&store, "s1", "mem1");
        fs::write(store.layer_dir("mem1").join("pages-1.img"), b"pages").unwrap();
        let mut stream = Vec::new();
        store.export("s1", Some(&store.layer_dir("mem1")), 7, &mut stream).unwrap();
        let (other_dir, other) = self::store();
        let checkpoint = other_dir.path().join("checkpoints/moved");
        let imported = other.import("moved", &checkpoint, 7, &mut stream.as_slice()).unwrap();
        assert!(imported.memory);
        assert_eq!(other.get("moved").unwrap().unwrap().memory, None);
        assert_eq!(fs::read(checkpoint.join("pages-1.img")).unwrap(), b"pages", "the pages travel in the export");
    }

    #[test]
    fn pinning_an_unknown_snapshot_fails() {
        let (dir, store) = store();
        let sandbox = dir.path().join("sandboxes/x");
        fs::create_dir_all(&sandbox).unwrap();
        assert!(store.pin(&sandbox, Some("nope"), "base").is_err());
    }

    #[test]
    fn export_then_import_gives_the_same_files_under_new_layer_names() {
        let (dir, store) = store();
        let u = upper(dir.path(), "u", &[("d/f.txt", "payload")]);
        store.capture("s1", &u, &Base { template: "base".into(), layers: vec![], memory: None }).unwrap();
        let mut stream = Vec::new();
        store.export("s1", None, 7, &mut stream).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let mut again = Vec::new();
        store.export("s1", None, 7, &mut again).unwrap();
        assert!(stream == again, "an export a second later (another tar pid, mtime) is the same bytes");

        let (_other_dir, other) = self::store();
        let imported = other.import("moved", Path::new("/nonexistent/ckpt"), 7, &mut stream.as_slice()).unwrap();
        assert_eq!(imported.template, "base");
        let base = other.get("moved").unwrap().unwrap();
        assert_eq!(fs::read_to_string(other.layer_dir(&base.layers[0]).join("d/f.txt")).unwrap(), "payload");
        assert!(other.import("bad", Path::new("/nonexistent/ckpt"), 7, &mut &b"not a tar"[..]).is_err());
    }
}
