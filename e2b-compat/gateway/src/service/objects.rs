//! A cluster's snapshots in its object store. Each node uploads in the
//! background the snapshots it takes, its paused sandboxes' files
//! (`relocate.rs`), its built templates' images (`image_objects.rs`) and
//! its build cache entries (`layer_objects.rs`):
//! `cluster.rs` runs [`Sandboxes::store_snapshots`] as soon as one is
//! taken, at start, and on a timer only while an upload the store refused
//! waits to be tried again. Each is marked stored once all of it is there.
//! A node asked to start a snapshot it does not hold fetches the files
//! first ([`Sandboxes::fetch_snapshot`]); placement sends it such a create
//! only when the snapshot is stored and its own node takes no new
//! sandboxes (`nodes.rs`).
//!
//! A fetched copy stays on the node under the snapshot's key while a
//! record names it; at the first heartbeat after its snapshot or template
//! is deleted (through any gateway), the node removes it
//! ([`Sandboxes::release_fetched`]).

use std::sync::Arc;
use std::time::Instant;

use copse_objects::Bucket;
use tokio::runtime::Handle;

use super::Sandboxes;
use crate::model::{Result, SandboxError, SnapshotRecord};
use crate::{lazy_layers, snapshot_file};

impl Sandboxes {
    pub(super) fn objects(&self) -> Option<Arc<Bucket>> {
        self.node.as_ref()?.objects.clone()
    }

    /// Waits until this node takes a snapshot (for ever without an object
    /// store).
    pub async fn snapshot_taken(&self) {
        match self.node.as_ref().filter(|m| m.objects.is_some()) {
            Some(membership) => membership.snapshot_taken.notified().await,
            None => std::future::pending().await,
        }
    }

    /// Starts the upload of the snapshot just taken.
    pub(super) fn upload_soon(&self) {
        if let Some(membership) = &self.node {
            membership.snapshot_taken.notify_one();
        }
    }

    /// Uploads this node's snapshots, and the files of its sandboxes paused
    /// on their files, that are not in the object store yet; one that
    /// fails stays unmarked, for the next round. Whether any stays
    /// unmarked.
    pub async fn store_snapshots(&self) -> anyhow::Result<bool> {
        let Some(bucket) = self.objects() else { return Ok(false) };
        let pending: Vec<SnapshotRecord> = self
            .store
            .snapshots()?
            .into_iter()
            .filter(|s| !s.in_object_store && s.node.is_some() && self.holds(s.node.as_deref()))
            .filter(|s| snapshot_file::object_key(&s.team, &s.id).is_ok())
            .collect();
        let mut failed = false;
        for mut snapshot in pending {
            let (record, bucket, runtime) = (snapshot.clone(), bucket.clone(), Handle::current());
            let scratch = self.run_dir.clone();
            let started = Instant::now();
            let blobs = self.base_blobs_of(&snapshot.template)?;
            let oci = blobs.oci();
            let pushed = self
                .blocking(move |s| {
                    let key = snapshot_file::object_key(&record.team, &record.id)?;
                    blobs.push(&key, &bucket, &runtime)?;
                    let sent = snapshot_file::push_record(s, &record, &bucket, &runtime)?;
                    let lazy = lazy_layers::push_layers(s, &record, &key, &bucket, &runtime, &scratch)?;
                    Ok((sent, lazy))
                })
                .await;
            let (sent, lazy) = match pushed {
                Ok(pushed) => pushed,
                Err(e) => {
                    tracing::warn!(snapshot = %snapshot.id, team = %snapshot.team, "storing a snapshot in the object store: {e}");
                    failed = true;
                    continue;
                }
            };
            snapshot.in_object_store = true;
            snapshot.lazy = lazy;
            snapshot.oci = oci;
            if self.store.update_snapshot(&snapshot)? {
                tracing::info!(
                    snapshot = %snapshot.id,
                    team = %snapshot.team,
                    chunks = sent.chunks,
                    kib = sent.bytes >> 10,
                    sent_kib = sent.new_bytes >> 10,
                    sent_compressed_kib = sent.new_stored_bytes >> 10,
                    ms = started.elapsed().as_millis() as u64,
                    "stored a snapshot in the object store"
                );
            } else if self.store.snapshot(&snapshot.team, &snapshot.id)?.is_none() {
                // Deleted while it was uploaded. (One replaced meanwhile is
                // uploaded in its turn, over this manifest.)
                self.forget_stored(&snapshot).await;
            }
        }
        let paused_failed = self.store_paused(&bucket).await?;
        let images_failed = self.store_images(&bucket).await?;
        Ok(self.store_layers(&bucket).await? || images_failed || paused_failed || failed)
    }

    /// Makes sure the files of `snapshot` are on this host, fetching them
    /// from the object store when another node took it.
    pub(super) async fn fetch_snapshot(&self, snapshot: &SnapshotRecord) -> Result<()> {
        if self.holds(snapshot.node.as_deref()) {
            return Ok(());
        }
        let key = snapshot_file::object_key(&snapshot.team, &snapshot.id)?;
        self.fetch_copy(snapshot, &key, &format!("snapshot {}", snapshot.id)).await
    }

    /// [`Self::fetch_files`] for a copy this node keeps only while a record
    /// names its files ([`Self::release_fetched`]).
    pub(super) async fn fetch_copy(&self, files: &SnapshotRecord, key: &str, what: &str) -> Result<()> {
        self.fetch_files(files, key, what).await?;
        self.keep_as_copy(&files.key);
        Ok(())
    }

    /// Lists snapshot `key` among the copies removed at the first
    /// heartbeat that finds no record naming them.
    pub(super) fn keep_as_copy(&self, key: &str) {
        self.fetched.lock().unwrap_or_else(|e| e.into_inner()).insert(key.to_string());
    }

    /// Takes snapshot `key` off that list, once this node removed it
    /// itself.
    pub(super) fn forget_copy(&self, key: &str) {
        self.fetched.lock().unwrap_or_else(|e| e.into_inner()).remove(key);
    }

    /// Removes the copies this node fetched of snapshots and template
    /// images that no record names any more, and then the image templates
    /// nothing stands on. Sandboxes started from one
    /// keep their files: the substrate removes a layer only once nothing
    /// stacks on it.
    pub async fn release_fetched(&self) -> anyhow::Result<()> {
        let fetched: Vec<String> = self.fetched.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
        if fetched.is_empty() {
            return Ok(());
        }
        let named = self.named_snapshots(self.store.snapshots()?, self.store.build_layers()?)?;
        let released: Vec<String> = fetched.into_iter().filter(|k| !named.contains(k)).collect();
        for key in &released {
            // Not while a create fetches it again (its record came back
            // under another name: an import).
            let _fetching = self.fetching.lock(key).await;
            let gone = key.clone();
            match self.blocking(move |s| s.delete_snapshot(&gone)).await {
                Ok(()) => tracing::info!(snapshot = %key, "removed a fetched copy no record names any more"),
                // The next start's reconcile removes what is left.
                Err(e) => tracing::warn!(snapshot = %key, "removing a fetched copy no record names: {e}"),
            }
            self.forget_copy(key);
        }
        if !released.is_empty() {
            // A fetched template image may have stood on an image's
            // template this node made from the object store.
            self.collect_image_templates().await;
        }
        Ok(())
    }

    /// Fetches the files `files` names (a snapshot's, or a paused
    /// sandbox's stand-in) from the object store's `key` unless this host
    /// has them; `what` names them in errors.
    pub(super) async fn fetch_files(&self, files: &SnapshotRecord, key: &str, what: &str) -> Result<()> {
        // Two creates of one snapshot fetch it once.
        let _fetching = self.fetching.lock(&files.key).await;
        // A copy this run fetched is known without listing every snapshot
        // on the host.
        if self.fetched.lock().unwrap_or_else(|e| e.into_inner()).contains(&files.key)
            || self.has_snapshot(&files.key).await?
        {
            return Ok(());
        }
        let node = files.node.as_deref().unwrap_or("-");
        let Some(bucket) = self.objects() else {
            return Err(SandboxError::Unavailable(format!(
                "{what} is on node {node}, and this node has no object store to fetch it from"
            )));
        };
        if !files.in_object_store {
            return Err(SandboxError::Unavailable(format!(
                "{what} is on node {node} and not in the object store yet; try again shortly"
            )));
        }
        let oci = files.oci.as_ref().filter(|_| super::is_image_template(&files.template));
        // No image template is collected between its making and the files
        // it takes in (`builds/image_gc.rs`).
        let _building = match oci {
            Some(_) => Some(self.images.building().await),
            None => None,
        };
        if let Some(oci) = oci {
            self.remake_image_template(&files.template, oci, key, what).await?;
        }
        let (record, runtime, started) = (files.clone(), Handle::current(), Instant::now());
        if let Some(lazy) = files.lazy.clone().filter(|_| self.node.as_ref().is_some_and(|m| m.lazy_fetch)) {
            let (record, object, bucket, runtime) = (record.clone(), key.to_string(), bucket.clone(), runtime.clone());
            match self.blocking(move |s| lazy_layers::fetch_lazily(s, &record, &lazy, &object, &bucket, &runtime)).await
            {
                Ok(true) => {
                    self.fetching.forget(&files.key);
                    tracing::info!(
                        files = what,
                        from = node,
                        ms = started.elapsed().as_millis() as u64,
                        "mounted from the object store, to arrive as read"
                    );
                    return Ok(());
                }
                Ok(false) => {}
                // The stream is checked on its own: a bad image (or a store
                // that failed meanwhile) is no reason not to try it.
                Err(e) => {
                    tracing::warn!(files = what, "mounting from the object store as it arrives: {e}; fetching it whole")
                }
            }
        }
        let object = key.to_string();
        let fetched = self.blocking(move |s| snapshot_file::fetch_under(s, &record, &object, &bucket, &runtime)).await;
        self.fetching.forget(&files.key);
        let got =
            fetched.map_err(|e| SandboxError::Unavailable(format!("fetching {what} from the object store: {e}")))?;
        tracing::info!(
            files = what,
            from = node,
            chunks = got.chunks,
            kib = got.bytes >> 10,
            ms = started.elapsed().as_millis() as u64,
            "fetched from the object store"
        );
        Ok(())
    }

    /// Removes a deleted snapshot's manifest from the object store (chunks
    /// that other snapshots may share stay); a failure leaves an object no
    /// record names, which is logged.
    pub(super) async fn forget_stored(&self, snapshot: &SnapshotRecord) {
        let Some(bucket) = self.objects() else { return };
        let Ok(key) = snapshot_file::object_key(&snapshot.team, &snapshot.id) else { return };
        if let Err(e) = bucket.delete(&key).await {
            tracing::warn!(snapshot = %snapshot.id, "removing a deleted snapshot from the object store: {e:#}");
        }
        if let Err(e) = lazy_layers::forget_layers(&bucket, &key).await {
            tracing::warn!(snapshot = %snapshot.id, "removing a deleted snapshot's layer images from the object store: {e:#}");
        }
    }
}
