//! Built templates' images in a cluster's object store. A template's image
//! is a substrate snapshot on the node that built it; that node uploads it
//! as it uploads snapshots (the same stream, under
//! `snapshot_file::image_object_key`) and lists it in the template's
//! labels as stored. When the template's node takes no new sandboxes
//! (draining, lost), placement sends a create of the template to another
//! node that has its base template, which fetches the image first
//! ([`Sandboxes::fetch_image`]). Before this, a built template lived and
//! died with the node that built it.
//!
//! The marker lives in the labels, not the template's record: a build
//! rewrites that record wholesale as its log grows, and would undo it.
//!
//! Images of templates built from OCI images sit on the image's own
//! template (`image-<digest>`), which another node may not have; so do
//! snapshots and paused sandboxes of such templates. Their node uploads
//! the image's layer blobs first, as they came from the registry, beside
//! the files (`…@base<i>`, bottom first, [`BaseBlobs`]); a node without
//! that template fetches them, checks each against the digest the files'
//! record keeps ([`OciBase`]), and unpacks them as a pull would
//! ([`Sandboxes::remake_image_template`], called by `fetch_files`). No
//! registry, and no credential a build was given, is needed there.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use copse_images::BlobCache;
use copse_objects::Bucket;
use copse_substrate::template::TemplateInfo;
use tokio::runtime::Handle;

use super::builds::template_name;
use super::{Sandboxes, is_image_template};
use crate::model::{Image, LazyFiles, OciBase, Result, SandboxError, SnapshotRecord, TemplateRecord};
use crate::{lazy_layers, snapshot_file};

impl Sandboxes {
    /// Uploads the images of this node's built templates that are not in
    /// the object store yet; whether one failed (to be tried again).
    pub(super) async fn store_images(&self, bucket: &Arc<Bucket>) -> anyhow::Result<bool> {
        let mut failed = false;
        for record in self.store.built_templates()? {
            let ours = record.node.is_some() && self.holds(record.node.as_deref());
            // An image's template stored before its blobs were recorded
            // could not be remade elsewhere: such an image stays here.
            let movable = |i: &Image| !is_image_template(&i.substrate_template) || i.oci.is_some();
            let Some(image) = record.image.clone().filter(|i| ours && movable(i)) else {
                continue;
            };
            if self.template_labels(&record)?.stored_images.contains(&image.snapshot_key) {
                continue;
            }
            let Ok(object) = snapshot_file::image_object_key(&image.snapshot_key) else { continue };
            let started = Instant::now();
            let (files, bucket, runtime) =
                (image_files(&record, &image, false, None), bucket.clone(), Handle::current());
            let scratch = self.run_dir.clone();
            let blobs = self.base_blobs(files.oci.clone(), &image.substrate_template)?;
            if files.oci.is_some() && blobs.oci().is_none() {
                // Another node could not make its image's template.
                continue;
            }
            let pushed = self
                .blocking(move |s| {
                    blobs.push(&object, &bucket, &runtime)?;
                    let sent = snapshot_file::push_under(s, &files, &object, &bucket, &runtime)?;
                    let lazy = lazy_layers::push_layers(s, &files, &object, &bucket, &runtime, &scratch)?;
                    Ok((sent, lazy))
                })
                .await;
            let (sent, lazy) = match pushed {
                Ok(sent) => sent,
                Err(e) => {
                    tracing::warn!(template = %record.id, "storing a template's image in the object store: {e}");
                    failed = true;
                    continue;
                }
            };
            if !self.mark_stored(&record, &image, lazy)? {
                // Deleted or rebuilt while it was uploaded: the image it
                // had is no template's any more.
                self.forget_stored_images(std::slice::from_ref(&image)).await;
                continue;
            }
            tracing::info!(
                template = %record.id,
                team = %record.team,
                kib = sent.bytes >> 10,
                sent_kib = sent.new_bytes >> 10,
                sent_compressed_kib = sent.new_stored_bytes >> 10,
                ms = started.elapsed().as_millis() as u64,
                "stored a template's image in the object store"
            );
        }
        Ok(failed)
    }

    /// Lists `image` as stored in its template's labels (with its layers'
    /// images, if stored too), keeping only the images the template still
    /// boots (its own and those tags keep); false when the template no
    /// longer has `image`.
    fn mark_stored(&self, record: &TemplateRecord, image: &Image, lazy: Option<LazyFiles>) -> Result<bool> {
        let current = self.store.template(&record.id)?;
        if current.and_then(|t| t.image).is_none_or(|now| now.snapshot_key != image.snapshot_key) {
            return Ok(false);
        }
        self.change_labels(record, |labels| {
            let booted: Vec<&str> = labels.kept_images.iter().map(|k| k.image.snapshot_key.as_str()).collect();
            let kept: Vec<String> =
                labels.stored_images.iter().filter(|k| booted.contains(&k.as_str())).cloned().collect();
            labels.stored_images = kept;
            labels.stored_images.push(image.snapshot_key.clone());
            labels.lazy_images.retain(|key, _| booted.contains(&key.as_str()));
            if let Some(lazy) = lazy.clone() {
                labels.lazy_images.insert(image.snapshot_key.clone(), lazy);
            }
            Ok(())
        })?;
        Ok(true)
    }

    /// Makes sure the image of the built template `record` (the one a
    /// create resolved, maybe a tag's older one) is on this host, fetching
    /// it from the object store when another node built it.
    pub(super) async fn fetch_image(&self, record: &TemplateRecord) -> Result<()> {
        let Some(image) = &record.image else { return Ok(()) };
        if self.holds(record.node.as_deref()) {
            return Ok(());
        }
        let mut labels = self.template_labels(record)?;
        let stored = labels.stored_images.contains(&image.snapshot_key);
        let lazy = labels.lazy_images.remove(&image.snapshot_key);
        let files = image_files(record, image, stored, lazy);
        let key = snapshot_file::image_object_key(&image.snapshot_key)?;
        self.fetch_copy(&files, &key, &format!("template {}", record.name)).await
    }

    /// The OCI image under substrate template `template`, if it is an
    /// image's: as a built template standing on it recorded it (the image's
    /// digest names the template, so any such record will do). For a
    /// snapshot or paused sandbox, whose records keep none until stored.
    fn oci_base_of(&self, template: &str) -> anyhow::Result<Option<OciBase>> {
        if !is_image_template(template) {
            return Ok(None);
        }
        for record in self.store.built_templates()? {
            let kept = self.template_labels(&record)?.kept_images.into_iter().map(|k| k.image);
            let found = record.image.into_iter().chain(kept).find(|i| i.substrate_template == template);
            if let Some(oci) = found.and_then(|i| i.oci) {
                return Ok(Some(oci));
            }
        }
        Ok(None)
    }

    /// The blobs to store beside files on substrate template `template`:
    /// none unless it is an OCI image's.
    pub(super) fn base_blobs_of(&self, template: &str) -> anyhow::Result<BaseBlobs> {
        self.base_blobs(self.oci_base_of(template)?, template)
    }

    /// The blobs of `oci`, the image under `template`. Without all of them
    /// in this node's cache (collected after a week unused), none: files
    /// are then stored alone, to start only where the template is.
    fn base_blobs(&self, oci: Option<OciBase>, template: &str) -> anyhow::Result<BaseBlobs> {
        let Some(oci) = oci else { return Ok(BaseBlobs::default()) };
        let cache = self.images.blob_cache()?;
        if let Some(missing) = oci.layers.iter().find(|d| !cache.has(d).unwrap_or(false)) {
            tracing::warn!(template, blob = %missing, "an image's blob is no longer in this node's cache: what stands on it is stored without it");
            return Ok(BaseBlobs::default());
        }
        Ok(BaseBlobs { oci: Some(oci), cache: Some(cache) })
    }

    /// Makes the substrate template `name` of the OCI image `oci` from the
    /// layer blobs stored beside the files under `object`, unless this
    /// host has it; each blob is checked against its digest before it is
    /// unpacked.
    pub(super) async fn remake_image_template(
        &self,
        name: &str,
        oci: &OciBase,
        object: &str,
        what: &str,
    ) -> Result<()> {
        if name != template_name(&oci.digest) {
            return Err(anyhow::anyhow!("{what}: its record names template {name} for image {}", oci.digest).into());
        }
        let lock = self.images.import_lock(name);
        let _making = lock.lock().await;
        let has = |t: &TemplateInfo| t.name == name && t.recipe == oci.digest;
        if self.substrate_templates().await?.iter().any(has) {
            return Ok(());
        }
        let Some(bucket) = self.objects() else {
            return Err(SandboxError::Unavailable(format!("{what} sits on image {}: no object store", oci.digest)));
        };
        let started = Instant::now();
        let (name, oci, object, runtime) = (name.to_string(), oci.clone(), object.to_string(), Handle::current());
        let cache = self.images.blob_cache()?;
        let made = self
            .blocking(move |s| {
                let layers = fetch_base(&oci, &cache, &object, &bucket, &runtime)?;
                let progress = |line: &str| tracing::debug!(template = %name, "{line}");
                let unpack = &mut |root: &Path| copse_images::unpack_layers(&layers, root, &progress).map(drop);
                s.import_template(&name, &oci.digest, unpack, &progress)
            })
            .await
            .map_err(|e| {
                SandboxError::Unavailable(format!("{what}: remaking its image's template from the object store: {e:#}"))
            })?;
        self.images.collect_later();
        tracing::info!(template = %made.name, ms = started.elapsed().as_millis() as u64, "made an image's template from the object store");
        Ok(())
    }

    /// Removes the manifests of images no template boots any more from
    /// the object store (their chunks go with the next `copse snapshot
    /// gc`); a failure leaves an object no record names, which is logged.
    pub(super) async fn forget_stored_images(&self, images: &[Image]) {
        let Some(bucket) = self.objects() else { return };
        for image in images {
            let Ok(key) = snapshot_file::image_object_key(&image.snapshot_key) else { continue };
            if let Err(e) = bucket.delete(&key).await {
                tracing::warn!(image = %image.snapshot_key, "removing a template's image from the object store: {e:#}");
            }
            if let Err(e) = lazy_layers::forget_layers(&bucket, &key).await {
                tracing::warn!(image = %image.snapshot_key, "removing a template's layer images from the object store: {e:#}");
            }
        }
    }
}

/// The layer blobs of the OCI image files stand on, from this node's blob
/// cache (open, so not collected meanwhile), to store beside them.
#[derive(Default)]
pub(super) struct BaseBlobs {
    oci: Option<OciBase>,
    cache: Option<BlobCache>,
}

impl BaseBlobs {
    /// The image they are, for the files' record once stored.
    pub(super) fn oci(&self) -> Option<OciBase> {
        self.oci.clone()
    }

    /// Stores them beside the files under `object`.
    pub(super) fn push(&self, object: &str, bucket: &Bucket, runtime: &Handle) -> anyhow::Result<()> {
        let (Some(oci), Some(cache)) = (&self.oci, &self.cache) else { return Ok(()) };
        for (index, digest) in oci.layers.iter().enumerate() {
            let path = cache.path(digest)?;
            let blob = std::fs::File::open(&path)
                .with_context(|| format!("blob {digest} of image {} is no longer in this node's cache", oci.digest))?;
            cache.touch(digest)?;
            let key = lazy_layers::base_object_key(object, index);
            runtime.block_on(copse_objects::push(bucket, &key, blob, || Ok(())))?;
        }
        Ok(())
    }
}

/// The layer blobs of `oci` in this node's blob cache, bottom first,
/// fetched from beside the files under `object` where missing.
fn fetch_base(
    oci: &OciBase,
    cache: &BlobCache,
    object: &str,
    bucket: &Bucket,
    runtime: &Handle,
) -> anyhow::Result<Vec<PathBuf>> {
    let mut layers = Vec::new();
    for (index, digest) in oci.layers.iter().enumerate() {
        if cache.has(digest)? {
            cache.touch(digest)?;
            layers.push(cache.path(digest)?);
            continue;
        }
        let key = lazy_layers::base_object_key(object, index);
        let manifest = runtime
            .block_on(copse_objects::manifest(bucket, &key))?
            .with_context(|| format!("{key} is not in the object store"))?;
        let (path, _) = snapshot_file::stream_manifest(bucket, &manifest, runtime, |mut input| {
            cache.insert(digest, &mut input).with_context(|| key.clone())
        })?;
        layers.push(path);
    }
    Ok(layers)
}

/// A template's image as the object store's stream names it: a snapshot
/// record of the template's id and team, which the fetching node checks
/// against the database's. `lazy`: its layers' images, if stored too.
fn image_files(record: &TemplateRecord, image: &Image, stored: bool, lazy: Option<LazyFiles>) -> SnapshotRecord {
    SnapshotRecord {
        id: record.id.clone(),
        team: record.team.clone(),
        names: Vec::new(),
        key: image.snapshot_key.clone(),
        template: image.substrate_template.clone(),
        source_sandbox: String::new(),
        created_at_ms: record.created_at_ms,
        size_bytes: 0,
        memory: image.memory,
        agent_token: image.agent_token.clone(),
        volume_mounts: Vec::new(),
        node: record.node.clone(),
        in_object_store: stored,
        lazy,
        oci: image.oci.clone().filter(|_| is_image_template(&image.substrate_template)),
    }
}
