//! The build cache's entries in a cluster's object store. The node that
//! made an entry uploads its files with the snapshots it takes (under
//! `snapshot_file::layer_object_key`) and marks the entry stored; a build
//! on another node whose chain of keys reaches a stored entry fetches its
//! files ([`Sandboxes::fetch_layer`]) and stacks on them, running only the
//! steps after it. An entry not stored yet ends the chain there: the steps
//! from it run again, as on a node without an object store.
//!
//! Keys chain from the base's identity, which for a substrate template
//! includes when it was built: nodes that each built `base` themselves
//! share no entries stacked directly on it (their files may differ), only
//! those stacked on a built template's image, which is one for the whole
//! cluster, or on an OCI image's template, known by the image's digest.
//! An entry on an image's template is stacked on only where that template
//! is: a build from the image pulls it first; a build from a built
//! template on it runs its steps again on a node without it, as the entry
//! carries no blobs to make it from.
//!
//! A fetched copy stays while the entry's record names it, and goes at
//! the first heartbeat after (`objects.rs`, `release_fetched`); so do the
//! files of an entry this node stored, once another node collected it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use copse_objects::Bucket;
use tokio::runtime::Handle;

use super::{Sandboxes, is_image_template};
use crate::model::{BuildLayer, Result, SnapshotRecord};
use crate::snapshot_file;

impl Sandboxes {
    /// Uploads this node's cache entries that are not in the object store
    /// yet; whether one failed (to be tried again).
    pub(super) async fn store_layers(&self, bucket: &Arc<Bucket>) -> anyhow::Result<bool> {
        let mut failed = false;
        for layer in self.store.build_layers()? {
            let ours = layer.node.is_some() && self.holds(layer.node.as_deref());
            if layer.in_object_store || !ours {
                continue;
            }
            let Ok(object) = snapshot_file::layer_object_key(&layer.key) else { continue };
            let (files, bucket, runtime, started) =
                (layer_files(&layer), bucket.clone(), Handle::current(), Instant::now());
            let pushed = self.blocking(move |s| snapshot_file::push_under(s, &files, &object, &bucket, &runtime)).await;
            let sent = match pushed {
                Ok(sent) => sent,
                Err(e) => {
                    tracing::warn!(layer = %layer.key, team = %layer.team, "storing a build cache entry in the object store: {e}");
                    failed = true;
                    continue;
                }
            };
            // Read again: another build may have added its template to the
            // entry meanwhile (a rewrite of the whole record), or the last
            // template using it may have been deleted.
            match self.store.build_layer(&layer.team, &layer.key)? {
                Some(mut current) if current.snapshot_key == layer.snapshot_key => {
                    current.in_object_store = true;
                    self.store.put_build_layer(&current)?;
                    // Any node may now collect the entry; this one lets
                    // go of its files when it sees no record naming them.
                    self.keep_as_copy(&layer.snapshot_key);
                    tracing::info!(
                        layer = %layer.key,
                        team = %layer.team,
                        kib = sent.bytes >> 10,
                        sent_kib = sent.new_bytes >> 10,
                        ms = started.elapsed().as_millis() as u64,
                        "stored a build cache entry in the object store"
                    );
                }
                _ => self.forget_stored_layer(&layer).await,
            }
        }
        Ok(failed)
    }

    /// Makes sure the files of cache entry `layer` are on this host,
    /// fetching them from the object store when another node made it.
    pub(super) async fn fetch_layer(&self, layer: &BuildLayer) -> Result<()> {
        if self.holds(layer.node.as_deref()) {
            return Ok(());
        }
        let key = snapshot_file::layer_object_key(&layer.key)?;
        let what = format!("build cache entry {}", &layer.key[..12.min(layer.key.len())]);
        self.fetch_copy(&layer_files(layer), &key, &what).await
    }

    /// Whether a build here may stack on `layer`: its files are here, or
    /// can be fetched onto a template this node has (`here`).
    pub(super) fn reachable(&self, layer: &BuildLayer, here: &HashSet<String>) -> bool {
        let template_here = !is_image_template(&layer.substrate_template) || here.contains(&layer.substrate_template);
        self.holds(layer.node.as_deref()) || (layer.in_object_store && template_here && self.objects().is_some())
    }

    /// Removes a collected entry's files from the object store (chunks
    /// that others share stay); a failure leaves an object no record
    /// names, which is logged.
    pub(super) async fn forget_stored_layer(&self, layer: &BuildLayer) {
        let Some(bucket) = self.objects() else { return };
        let Ok(key) = snapshot_file::layer_object_key(&layer.key) else { return };
        if let Err(e) = bucket.delete(&key).await {
            tracing::warn!(layer = %layer.key, "removing a build cache entry from the object store: {e:#}");
        }
    }
}

/// An entry's files as the object store's stream names them: a snapshot
/// record of the entry's key and team, which the fetching node checks
/// against the database's.
fn layer_files(layer: &BuildLayer) -> SnapshotRecord {
    SnapshotRecord {
        id: layer.key.clone(),
        team: layer.team.clone(),
        names: Vec::new(),
        key: layer.snapshot_key.clone(),
        template: layer.substrate_template.clone(),
        source_sandbox: String::new(),
        created_at_ms: layer.created_at_ms,
        size_bytes: 0,
        memory: false,
        agent_token: None,
        volume_mounts: Vec::new(),
        node: layer.node.clone(),
        in_object_store: layer.in_object_store,
        lazy: None,
        oci: None,
    }
}
