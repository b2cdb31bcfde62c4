//! Volumes that move between the nodes of a cluster, through the object
//! store, so that a drain with `--move-sandboxes` takes sandboxes with
//! volumes away too.
//!
//! A volume's bytes live on one node (`VolumeRecord::node`). On a node
//! drained with `--move-sandboxes`, once every sandbox mounting a volume is
//! paused on its files, the volume leaves: its record is marked
//! `Uploading` (from then on no content call and no create or resume
//! touches it here), its export (`volume_archive.rs`) is streamed to the
//! object store under `volumes/<team>/<id>`, and the record is marked
//! `Stored` with the SHA-256 of that stream's manifest. The next node that
//! needs it (a resume of one of its sandboxes, a create mounting it, a
//! content call) fetches that stream, checked against the hash the record
//! keeps and against the volume's id and team, into a new copy, then takes
//! the record over by a swap that holds only while the record still names
//! the old node and the same upload, so two nodes never both own it. The
//! old node removes its copy once a record names another node. A node
//! undrained before anyone took its volume takes it back as it was.

use std::path::PathBuf;
use std::sync::{Arc, LazyLock, Mutex};

use anyhow::Context;
use copse_objects::Bucket;
use copse_substrate::Substrate;
use tokio::runtime::Handle;
use tokio::sync::{OwnedRwLockReadGuard, RwLock};

use super::Sandboxes;
use super::nodes::Owner;
use crate::import_claims::Claim;
use crate::model::{SandboxRecord, VolumeError, VolumeMove, VolumeRecord, VolumeStore};
use crate::volume_files::VolumeFiles;
use crate::{snapshot_file, volume_archive};

/// Held by each content call for its whole length; a volume is marked as
/// leaving only while no call holds it, so no write lands after its export
/// started.
static CONTENT_CALLS: LazyLock<Arc<RwLock<()>>> = LazyLock::new(Default::default);

/// How long a volume leaving waits for content calls in flight to end.
const CALLS_END_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// One volume fetched, or copies removed, at a time on this node: a copy
/// being fetched is never taken for a stale one.
static LOCAL_COPIES: Mutex<()> = Mutex::new(());

/// What a content call holds while it runs (see [`CONTENT_CALLS`]).
pub async fn content_call() -> OwnedRwLockReadGuard<()> {
    CONTENT_CALLS.clone().read_owned().await
}

impl Sandboxes {
    /// Each heartbeat on a node with an object store: moves volumes out
    /// when a drain asks, takes its own back when no drain asks any more,
    /// and removes the copies of volumes other nodes took over.
    pub(super) async fn tend_volumes(&self, moving_out: bool) -> anyhow::Result<()> {
        let (Some(here), Some(bucket), Some(store)) =
            (self.node().map(str::to_string), self.objects(), self.volume_store.get())
        else {
            return Ok(());
        };
        let volumes = store.volumes()?;
        let (own, others): (Vec<_>, Vec<_>) = volumes.into_iter().partition(|v| v.node.as_deref() == Some(&here));
        for volume in own {
            let result = match (moving_out, &volume.moved_out) {
                (true, Some(VolumeMove::Stored { .. })) | (false, None) => continue,
                (true, _) => self.move_out(volume.clone(), &bucket).await,
                (false, Some(_)) => self.keep(&volume, &bucket).await,
            };
            if let Err(e) = result {
                tracing::warn!(volume_id = %volume.id, "moving a volume out: {e:#}");
            }
        }
        // A record naming no node is from before the cluster: its bytes are
        // wherever that host was, maybe here.
        let taken: Vec<String> = others.into_iter().filter(|v| v.node.is_some()).map(|v| v.id).collect();
        self.blocking(move |s| {
            let _copies = LOCAL_COPIES.lock().unwrap_or_else(|e| e.into_inner());
            for id in taken.iter().filter(|id| s.volume_location(id).is_ok()) {
                s.delete_volume(id)?;
                tracing::info!(volume_id = %id, "removed the copy of a volume another node took over");
            }
            Ok(())
        })
        .await?;
        Ok(())
    }

    /// Uploads volume `volume` of this node once every sandbox mounting it
    /// is paused on its files.
    async fn move_out(&self, mut volume: VolumeRecord, bucket: &Arc<Bucket>) -> anyhow::Result<()> {
        let here = volume.node.clone();
        if volume.moved_out.is_none() {
            if !self.all_paused_on_files(&volume.id)? {
                return Ok(());
            }
            // A call streaming to a slow client must not stall the others
            // for long: the move waits for a quieter moment instead.
            let Ok(_no_calls) = tokio::time::timeout(CALLS_END_WITHIN, CONTENT_CALLS.write()).await else {
                anyhow::bail!("content calls still running after {CALLS_END_WITHIN:?}; trying again later");
            };
            volume.moved_out = Some(VolumeMove::Uploading);
            if !self.volumes()?.swap_volume(&volume, here.as_deref(), None)? {
                return Ok(());
            }
        }
        // A resume may have mounted it between the check and the mark: one
        // still under way holds its sandbox's transition lock, so waiting
        // for those locks lets it finish (later ones see the mark and stop).
        let mut waited = Vec::new();
        for id in self.mounting(&volume.id)? {
            waited.push(self.transitions.lock(&id).await);
        }
        let paused = self.all_paused_on_files(&volume.id)?;
        drop(waited);
        if !paused {
            return self.keep(&volume, bucket).await;
        }
        let key = snapshot_file::volume_object_key(&volume.team, &volume.id)?;
        let quota = super::team_volume_limit(self.store.as_ref(), &volume.team)?;
        let (record, bucket_, runtime) = (volume.clone(), bucket.clone(), Handle::current());
        let pushed = self
            .blocking(move |s| {
                snapshot_file::push_stream(&bucket_, &key, &runtime, |out| {
                    volume_archive::export_with(s, &record, quota, out).map(drop)
                })
            })
            .await;
        let report = match pushed {
            Ok(report) => report,
            Err(e) => {
                self.keep(&volume, bucket).await?;
                anyhow::bail!("uploading it: {e}");
            }
        };
        let mut stored = volume.clone();
        stored.moved_out = Some(VolumeMove::Stored { manifest_sha256: report.manifest_sha256 });
        if self.volumes()?.swap_volume(&stored, here.as_deref(), Some(&VolumeMove::Uploading))? {
            tracing::info!(volume_id = %volume.id, bytes = report.bytes, "stored a volume in the object store to move it");
        }
        Ok(())
    }

    /// Takes this node's volume `volume` back from a move no other node
    /// completed: its bytes here are as they were when it left.
    async fn keep(&self, volume: &VolumeRecord, bucket: &Bucket) -> anyhow::Result<()> {
        let kept = VolumeRecord { moved_out: None, ..volume.clone() };
        if self.volumes()?.swap_volume(&kept, volume.node.as_deref(), volume.moved_out.as_ref())? {
            bucket.delete(&snapshot_file::volume_object_key(&volume.team, &volume.id)?).await?;
            tracing::info!(volume_id = %volume.id, "kept a volume on this node");
        }
        Ok(())
    }

    fn volumes(&self) -> anyhow::Result<&Arc<dyn VolumeStore>> {
        self.volume_store.get().context("no volumes on this gateway")
    }

    /// Whether every sandbox mounting volume `volume_id` is paused on files
    /// the object store holds: they travel first, so that whichever node
    /// takes the volume can resume them.
    fn all_paused_on_files(&self, volume_id: &str) -> anyhow::Result<bool> {
        let paused_on_files =
            |r: &SandboxRecord| r.paused.as_ref().is_some_and(|p| p.files_only.is_some() && p.in_object_store);
        Ok(self
            .store
            .all()?
            .iter()
            .filter(|r| r.volume_mounts.iter().any(|m| m.volume_id == volume_id))
            .all(paused_on_files))
    }

    /// Where a call that needs volume `volume` must run: on its node,
    /// unless it waits in the object store for a node to take it (then
    /// here if this node takes sandboxes, else a node with room).
    pub fn volume_owner(&self, volume: &VolumeRecord) -> anyhow::Result<Owner> {
        let owner = self.owner(volume.node.as_deref())?;
        if !volume.waits_in_object_store() || self.takes_sandboxes(&owner)? {
            return Ok(owner);
        }
        let Some(membership) = &self.node else { return Ok(owner) };
        if self.substrate.runs_sandboxes() && self.takes_sandboxes(&Owner::Here)? {
            return Ok(Owner::Here);
        }
        Ok(self.place_by_room(membership, None)?.unwrap_or(owner))
    }

    /// Makes volume `id` this node's, fetching it from the object store if
    /// it waits there, and returns its record; `limit` is its size limit.
    /// Blocks: call it off the async workers.
    pub fn bring_volume_here(&self, id: &str, limit: u64) -> Result<VolumeRecord, VolumeError> {
        self.volume_arrival(id, limit)?.bring()
    }

    /// What bringing volume `id` here needs, owned, for a blocking task.
    pub(super) fn volume_arrival(&self, id: &str, limit: u64) -> Result<Arrival, VolumeError> {
        Ok(Arrival {
            id: id.to_string(),
            limit,
            substrate: self.substrate.clone(),
            store: self.volumes()?.clone(),
            bucket: self.objects(),
            data_dir: self.run_dir.parent().context("the data dir")?.to_path_buf(),
            here: self.node().map(str::to_string),
            takes_work: self.substrate.runs_sandboxes() && self.takes_sandboxes(&Owner::Here)?,
        })
    }
}

/// A volume to make this node's ([`Sandboxes::bring_volume_here`]).
pub(super) struct Arrival {
    id: String,
    limit: u64,
    substrate: Arc<dyn Substrate>,
    store: Arc<dyn VolumeStore>,
    bucket: Option<Arc<Bucket>>,
    data_dir: PathBuf,
    here: Option<String>,
    /// This node takes new sandboxes (not draining, not an API front).
    takes_work: bool,
}

impl Arrival {
    pub(super) fn bring(self) -> Result<VolumeRecord, VolumeError> {
        let _copies = LOCAL_COPIES.lock().unwrap_or_else(|e| e.into_inner());
        let record = self.store.volume(&self.id)?.ok_or_else(|| VolumeError::NotFound(self.id.clone()))?;
        let manifest_sha256 = match &record.moved_out {
            None if record.node == self.here => return Ok(record),
            None => {
                let node = record.node.as_deref().unwrap_or("-");
                return Err(VolumeError::Moving(format!("volume {} is on node {node}; try again", record.name)));
            }
            Some(VolumeMove::Uploading) => {
                return Err(VolumeError::Moving(format!(
                    "volume {} is moving to another node; try again in a few seconds",
                    record.name
                )));
            }
            Some(VolumeMove::Stored { manifest_sha256 }) => manifest_sha256.clone(),
        };
        let taken = VolumeRecord { node: self.here.clone(), moved_out: None, ..record.clone() };
        let key = snapshot_file::volume_object_key(&record.team, &record.id)?;
        let runtime = Handle::current();
        let swap = || self.store.swap_volume(&taken, record.node.as_deref(), record.moved_out.as_ref());
        if record.node == self.here {
            // Back on the node it left, whose copy is as it was then.
            if swap()? {
                forget_upload(self.bucket.as_deref(), &key, &runtime, &record.id);
                return Ok(taken);
            }
            return self.store.volume(&self.id)?.ok_or_else(|| VolumeError::NotFound(self.id.clone()));
        }
        let refuse =
            |why: &str| VolumeError::Moving(format!("volume {} waits in the object store: {why}", record.name));
        if !self.takes_work {
            return Err(refuse("this node takes no new work"));
        }
        let bucket = self.bucket.as_ref().ok_or_else(|| refuse("this node has no object store"))?;
        let claim = Claim::take(&self.data_dir, &record.id)?;
        // A copy left from when it was here before is stale: no record names it here.
        if self.substrate.volume_location(&record.id).is_ok() {
            self.substrate.delete_volume(&record.id)?;
        }
        self.substrate.create_volume(&record.id, self.limit)?;
        let fetched = (|| -> anyhow::Result<bool> {
            let location = self.substrate.volume_location(&record.id)?;
            let files = VolumeFiles::new(location.root, location.id_base);
            let manifest = runtime.block_on(copse_objects::verified_manifest(bucket, &key, &manifest_sha256))?;
            snapshot_file::stream_manifest(bucket, &manifest, &runtime, |input| {
                volume_archive::unpack_moved(input, &record, &files, self.limit)
            })?;
            swap()
        })();
        if !matches!(fetched, Ok(true)) {
            self.substrate.delete_volume(&record.id)?;
        }
        claim.release();
        match fetched {
            Ok(true) => {
                forget_upload(Some(bucket), &key, &runtime, &record.id);
                let from = record.node.as_deref().unwrap_or("-");
                tracing::info!(volume_id = %record.id, from, "took over a volume");
                Ok(taken)
            }
            Ok(false) => Err(VolumeError::Moving(format!(
                "volume {} was taken by another node meanwhile; try again",
                record.name
            ))),
            Err(e) => Err(refuse(&format!("{e:#}"))),
        }
    }
}

/// Removes a moved volume's manifest from the object store (its chunks
/// go at the next garbage collection, as a deleted snapshot's do).
fn forget_upload(bucket: Option<&Bucket>, key: &str, runtime: &Handle, volume_id: &str) {
    let Some(bucket) = bucket else { return };
    if let Err(e) = runtime.block_on(bucket.delete(key)) {
        tracing::warn!(volume_id, "removing a moved volume from the object store: {e:#}");
    }
}
