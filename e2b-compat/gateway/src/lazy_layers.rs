//! Lazy fetch: a snapshot another node took (or a paused sandbox's files,
//! or a built template's image) starts here before all of it has arrived.
//!
//! Beside the snapshot's stream (`snapshot_file`), its node uploads each of
//! its layers as a filesystem image (the substrate makes it:
//! `Substrate::layer_images`), under [`layer_object_key`], and keeps the
//! SHA-256 of each image's manifest in the database ([`LazyFiles`]: in
//! the snapshot's record, the paused sandbox's, or the template's
//! labels). A node asked to start the snapshot then does not fetch it:
//! for each layer it starts `copse lazy-image DIR` ([`serve`]), a
//! process of its own that serves the image as a file whose ranges are
//! fetched from the object store on their first read (and the rest in the
//! background), and the substrate mounts those files as the snapshot's
//! layers (`Substrate::import_lazy`). The sandbox boots at once; what it
//! reads first arrives first.
//!
//! The server outlives the gateway (a gateway crash does not cut the files
//! from under running sandboxes) and ends when the substrate removes its
//! layer. The bucket is not trusted: the record's hash vouches for each
//! manifest, and the manifest for each chunk (`copse_objects::LazyFile`).
//! Memory arrives the same way: a snapshot with memory also sends an
//! image of its checkpoint ([`memory_image_key`]), served and mounted like
//! a layer's, and the node's checkpoint links its page images there, so a
//! restore (lazy from 128 MiB of pages, `copse_namespaces::lazy_pages`)
//! reads each page from the object store as the sandbox touches it.
//! Records stored before that name a checkpoint stream instead
//! ([`memory_object_key`]), which the node fetches whole.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use copse_objects::{Bucket, BucketConfig, LazyFile};
use copse_substrate::{ImageSource, LazyMemory, Substrate};
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;

use crate::model::{LazyFiles, SnapshotRecord};

/// How long a server may take to mount its image (its manifest is one
/// request away).
const READY_WITHIN: Duration = Duration::from_secs(30);
/// Between rounds of the background fetch while the object store fails.
const RETRY_AFTER: Duration = Duration::from_secs(2);
/// All of the gateway's environment a server gets: the bucket's keys and
/// how to log. Nothing else the gateway was given (a database URL with its
/// password, say) reaches a process that does not need it.
const SERVER_ENV: &[&str] =
    &["PATH", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "COPSE_LOG", "COPSE_LOG_FORMAT"];

/// Where layer `index` (top first) of the snapshot stored under
/// `object_key` is kept as an image. `@` is in no snapshot name (and an
/// S3 key keeps it as it is, where it would escape `~`), so no snapshot's
/// own key is ever one of these.
pub fn layer_object_key(object_key: &str, index: usize) -> String {
    format!("{object_key}@layer{index}")
}

/// Where layer blob `index` (bottom first) of the OCI image under the
/// files stored under `object_key` is kept (`service/image_objects.rs`).
pub fn base_object_key(object_key: &str, index: usize) -> String {
    format!("{object_key}@base{index}")
}

/// Where the memory checkpoint of the snapshot stored under `object_key`
/// is kept alone, as a stream (records stored before memory images).
pub fn memory_object_key(object_key: &str) -> String {
    format!("{object_key}@memory")
}

/// Where the image of the memory checkpoint of the snapshot stored under
/// `object_key` is kept.
pub fn memory_image_key(object_key: &str) -> String {
    format!("{object_key}@memimage")
}

/// Uploads the images of `record`'s layers (and its checkpoint, if it has
/// memory) next to its stream under `object_key`; `None` for a substrate
/// that mounts no images. `scratch` holds the images while they are sent.
pub fn push_layers(
    substrate: &dyn Substrate,
    record: &SnapshotRecord,
    object_key: &str,
    bucket: &Bucket,
    runtime: &Handle,
    scratch: &Path,
) -> anyhow::Result<Option<LazyFiles>> {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    let dir = scratch.join(format!(".layer-images-{}-{nanos:x}", std::process::id()));
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let result = (|| {
        let Some(images) = substrate.layer_images(&record.key, &dir)? else { return Ok(None) };
        let mut layers = Vec::new();
        for (index, image) in images.images.iter().enumerate() {
            let file = fs::File::open(image).with_context(|| format!("opening {}", image.display()))?;
            let key = layer_object_key(object_key, index);
            let sent = runtime.block_on(copse_objects::push(bucket, &key, file, || Ok(())))?;
            layers.push(sent.manifest_sha256);
        }
        let (memory, memory_image) = match (&images.memory, record.memory) {
            (Some(image), _) => {
                let file = fs::File::open(image).with_context(|| format!("opening {}", image.display()))?;
                let sent =
                    runtime.block_on(copse_objects::push(bucket, &memory_image_key(object_key), file, || Ok(())))?;
                (None, Some(sent.manifest_sha256))
            }
            (None, true) => {
                let produce = |out: &mut dyn Write| substrate.export_checkpoint(&record.key, out);
                let key = memory_object_key(object_key);
                (Some(crate::snapshot_file::push_stream(bucket, &key, runtime, produce)?.manifest_sha256), None)
            }
            (None, false) => (None, None),
        };
        Ok(Some(LazyFiles { template: images.template, layers, memory, memory_image }))
    })();
    let _ = fs::remove_dir_all(&dir);
    result
}

/// Removes the images of the layers (and the checkpoint, and the blobs of
/// the OCI image beneath) of a deleted snapshot stored under `object_key`
/// (their chunks stay for `copse snapshot gc`, like the stream's). They
/// are found by their keys, which their pushes use in order, so none needs
/// a record to be found;
/// removed last first, so what a failure leaves is found by the next try.
pub async fn forget_layers(bucket: &Bucket, object_key: &str) -> anyhow::Result<()> {
    bucket.delete(&memory_image_key(object_key)).await?;
    bucket.delete(&memory_object_key(object_key)).await?;
    forget_numbered(bucket, |index| layer_object_key(object_key, index)).await?;
    forget_numbered(bucket, |index| base_object_key(object_key, index)).await
}

/// Removes the objects `key_of` names from 0 up to the first missing one,
/// last first.
async fn forget_numbered(bucket: &Bucket, key_of: impl Fn(usize) -> String) -> anyhow::Result<()> {
    let mut count = 0;
    while bucket.has(&key_of(count)).await? {
        count += 1;
    }
    for index in (0..count).rev() {
        bucket.delete(&key_of(index)).await?;
    }
    Ok(())
}

/// What a server reads to find its image.
#[derive(Serialize, Deserialize)]
struct Source {
    object_store: String,
    manifest: String,
    sha256: String,
}

/// Takes in `record`'s snapshot (stored under `object_key`) as layers
/// served from the object store, each by a server of its own, its
/// checkpoint's image too (or, for a record from before those, its
/// checkpoint fetched whole); `Ok(false)` where the substrate mounts no
/// images, for the caller to fetch it whole.
pub fn fetch_lazily(
    substrate: &dyn Substrate,
    record: &SnapshotRecord,
    lazy: &LazyFiles,
    object_key: &str,
    bucket: &Bucket,
    runtime: &Handle,
) -> anyhow::Result<bool> {
    // Every layer served for it, the memory's too: discarded on failure.
    let mut served = Vec::new();
    let result = (|| {
        let mut serve = |manifest: String, sha256: &str| -> anyhow::Result<Option<String>> {
            let Some((layer, dir)) = substrate.new_lazy_layer(&record.key)? else { return Ok(None) };
            served.push(layer.clone());
            let source = Source { object_store: bucket.address().to_string(), manifest, sha256: sha256.to_string() };
            fs::write(dir.join("source.json"), serde_json::to_vec(&source)?)?;
            start_server(&dir)?;
            Ok(Some(layer))
        };
        let mut layers = Vec::new();
        for (index, sha256) in lazy.layers.iter().enumerate() {
            let Some(layer) = serve(layer_object_key(object_key, index), sha256)? else { return Ok(false) };
            layers.push(layer);
        }
        let memory_layer = match &lazy.memory_image {
            Some(sha256) => match serve(memory_image_key(object_key), sha256)? {
                Some(layer) => Some(layer),
                None => return Ok(false),
            },
            None => None,
        };
        let import = |memory: LazyMemory<'_>| {
            substrate.import_lazy(&record.key, &lazy.template, &layers, record.size_bytes, memory)
        };
        match (memory_layer, &lazy.memory) {
            (Some(layer), _) => import(LazyMemory::Served(layer))?,
            (None, None) => import(LazyMemory::None)?,
            (None, Some(sha256)) => {
                let key = memory_object_key(object_key);
                let manifest = runtime.block_on(copse_objects::verified_manifest(bucket, &key, sha256))?;
                let consume = |input: &mut dyn std::io::BufRead| import(LazyMemory::Whole(input));
                crate::snapshot_file::stream_manifest(bucket, &manifest, runtime, consume)?.0
            }
        };
        Ok(true)
    })();
    if !matches!(result, Ok(true)) {
        for layer in &served {
            if let Err(e) = substrate.discard_lazy_layer(layer) {
                tracing::warn!(layer, "removing a lazy layer that was not taken in: {e:#}");
            }
        }
    }
    result
}

/// Starts `copse lazy-image DIR` in a process group of its own (signals
/// meant for the gateway's do not reach it), and waits until it serves.
fn start_server(dir: &Path) -> anyhow::Result<()> {
    let log = fs::File::options().create(true).append(true).open(dir.join("server.log"))?;
    let mut child = Command::new(std::env::current_exe().context("finding the copse binary")?)
        .arg("lazy-image")
        .arg(dir)
        .env_clear()
        .envs(std::env::vars().filter(|(name, _)| SERVER_ENV.contains(&name.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting copse lazy-image")?;
    let stdout = child.stdout.take().expect("piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = tx.send(BufReader::new(stdout).read_line(&mut line).map(|_| line));
    });
    match rx.recv_timeout(READY_WITHIN) {
        Ok(Ok(line)) if line.trim() == "ready" => {
            // Reaped whenever it ends: at its layer's removal.
            std::thread::spawn(move || child.wait());
            Ok(())
        }
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            let log = fs::read_to_string(dir.join("server.log")).unwrap_or_default();
            bail!("the lazy layer's server did not start: {}", log.lines().last().unwrap_or("no output"))
        }
    }
}

/// `copse lazy-image DIR`: serves the image `DIR/source.json` names until
/// its layer is removed, fetching each range on its first read and the
/// rest in the background, then marks the local copy whole
/// (`DIR/complete`), from which a restart mounts it with no server.
pub fn serve(dir: &Path) -> anyhow::Result<()> {
    let source: Source = serde_json::from_slice(&fs::read(dir.join("source.json"))?).context("reading source.json")?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let bucket = Bucket::open(&BucketConfig::parse(&source.object_store, |name| std::env::var(name).ok())?)?;
    let manifest = runtime.block_on(copse_objects::verified_manifest(&bucket, &source.manifest, &source.sha256))?;
    let file = Arc::new(LazyFile::open(bucket, manifest, &dir.join("image"))?);
    let background = {
        let (file, complete) = (file.clone(), dir.join("complete"));
        async move {
            while let Err(e) = file.fetch_all().await {
                tracing::warn!("fetching the rest of a lazy layer: {e:#}");
                tokio::time::sleep(RETRY_AFTER).await;
            }
            if let Err(e) = mark_complete(&complete) {
                tracing::warn!("marking a lazy layer whole: {e:#}");
            }
        }
    };
    runtime.spawn(background);
    let served = Arc::new(Served { file, runtime: runtime.handle().clone() });
    copse_host::serve_layer_image(dir, served, || {
        let mut out = std::io::stdout();
        let _ = writeln!(out, "ready").and_then(|()| out.flush());
    })
}

/// Durably, since a restart mounts the local copy on its word.
fn mark_complete(path: &PathBuf) -> anyhow::Result<()> {
    let parent = path.parent().context("no parent")?;
    fs::File::open(parent.join("image"))?.sync_all()?;
    fs::File::create(path)?.sync_all()?;
    fs::File::open(parent)?.sync_all()?;
    Ok(())
}

struct Served {
    file: Arc<LazyFile>,
    runtime: Handle,
}

impl ImageSource for Served {
    fn size(&self) -> u64 {
        self.file.size()
    }

    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
        self.runtime.block_on(self.file.read_at(offset, len)).map_err(std::io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_key_is_no_snapshots_key() {
        let key = crate::snapshot_file::object_key("acme", "a/b").unwrap();
        let layer = layer_object_key(&key, 0);
        assert_eq!(layer, "snapshots/acme/a/b@layer0");
        assert!(crate::snapshot_file::object_key("acme", "a/b@layer0").is_err(), "no snapshot name holds @");
    }
}
