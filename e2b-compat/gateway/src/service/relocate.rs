//! Paused sandboxes that move between the nodes of a cluster.
//!
//! A node with an object store uploads the files of each sandbox it holds
//! paused on its files (`Paused::files_only`), as it does its snapshots
//! (`objects.rs`), and marks the record. A connect or resume of such a
//! sandbox whose node takes no new sandboxes (draining or lost) is placed
//! as a create of its template would be; the node it lands on claims the
//! record (a swap that holds only while the record still names the old node
//! and the same files, so two gateways never both resume it), fetches the
//! files (or mounts their layers as they arrive, `lazy_layers.rs`), and
//! boots it there on an address of its own subnet.
//!
//! `copse node drain ID --move-sandboxes` makes a node pause its sandboxes
//! that way on its own: each is checkpointed with its memory where CRIU
//! can, else kept as its files, so the next connect resumes it on another
//! node. Their volumes follow once all their sandboxes are paused
//! (`volume_moves.rs`).
//! Frozen sandboxes (paused with memory in place) are thawed first.

use std::collections::HashSet;

use copse_objects::Bucket;
use tokio::runtime::Handle;

use super::Sandboxes;
use super::nodes::Owner;
use super::quota::Kind;
use crate::model::{
    Caller, Change, Paused, Result, SandboxError, SandboxRecord, SnapshotRecord, VolumeError, now_ms, snapshot_key,
};
use crate::{lazy_layers, snapshot_file};

impl Sandboxes {
    /// Where a connect (or resume) of sandbox `id` runs: on its own node
    /// while that takes sandboxes, else, for a sandbox whose files are in
    /// the object store, here if this node was sent the call or takes
    /// sandboxes, else where a create of its template would go.
    pub fn owner_for_resume(&self, id: &str, forwarded: bool) -> anyhow::Result<Owner> {
        match self.store.get(id)? {
            Some(record) => self.place_resume(&record, forwarded),
            None => Ok(Owner::Here),
        }
    }

    /// [`Self::owner_for_resume`] of a record already read.
    pub fn place_resume(&self, record: &SandboxRecord, forwarded: bool) -> anyhow::Result<Owner> {
        let owner = self.owner(record.node.as_deref())?;
        let Some(membership) = &self.node else { return Ok(owner) };
        if !self.movable(record) {
            return Ok(owner);
        }
        // A sandbox goes where its volumes are, unless they wait in the
        // object store for a node to take them.
        if let Some(node) = self.volumes_home(record)? {
            return self.owner(node.as_deref());
        }
        if self.takes_sandboxes(&owner)? {
            return Ok(owner);
        }
        if forwarded && self.takes_sandboxes(&Owner::Here)? {
            return Ok(Owner::Here);
        }
        let placed = match self.place_by_room(membership, Some(&record.template))? {
            // Its image's template travels with its files.
            None if record.paused.as_ref().is_some_and(|p| p.oci.is_some()) => self.place_by_room(membership, None)?,
            placed => placed,
        };
        Ok(placed.unwrap_or(owner))
    }

    /// Where describing or killing sandbox `id` runs: on its node, except
    /// for a sandbox whose files are in the object store and whose node is
    /// lost. Those calls need nothing of that node (the record, and the
    /// object store for a kill), so any gateway answers them.
    pub fn owner_for_record_call(&self, id: &str) -> anyhow::Result<Owner> {
        let Some(record) = self.store.get(id)? else { return Ok(Owner::Here) };
        Ok(match self.owner(record.node.as_deref())? {
            Owner::Lost { .. } if self.movable(&record) => Owner::Here,
            owner => owner,
        })
    }

    /// Whether `record` is paused on files that any node of the cluster can
    /// fetch from the object store.
    fn movable(&self, record: &SandboxRecord) -> bool {
        self.objects().is_some() && record.paused.as_ref().is_some_and(|p| p.files_only.is_some() && p.in_object_store)
    }

    /// The node holding the volumes `record` mounts (they are all on one),
    /// or `None` when it mounts none or they wait in the object store for
    /// a node to take them.
    fn volumes_home(&self, record: &SandboxRecord) -> anyhow::Result<Option<Option<String>>> {
        let Some(volumes) = self.volume_store.get() else { return Ok(None) };
        for mount in &record.volume_mounts {
            match volumes.volume(&mount.volume_id)? {
                Some(volume) if volume.waits_in_object_store() => {}
                Some(volume) => return Ok(Some(volume.node)),
                // Gone: the resume reports it.
                None => return Ok(Some(record.node.clone())),
            }
        }
        Ok(None)
    }

    /// Takes paused sandbox `record` over from the node that holds it, as
    /// long as no other gateway has resumed, moved or killed it meanwhile.
    pub(super) fn claim(&self, mut record: SandboxRecord) -> Result<SandboxRecord> {
        let from = record.node.clone();
        if !self.movable(&record) {
            return Err(SandboxError::Unavailable(format!(
                "sandbox {} is on node {}, and its files are not in the object store",
                record.id,
                from.as_deref().unwrap_or("-")
            )));
        }
        record.node = self.node().map(str::to_string);
        if !self.store.swap_paused(&record, from.as_deref())? {
            return Err(SandboxError::Conflict(format!(
                "sandbox {} was resumed, moved or killed by another node meanwhile",
                record.id
            )));
        }
        tracing::info!(sandbox_id = %record.id, from = from.as_deref().unwrap_or("-"), "took over a paused sandbox");
        Ok(record)
    }

    /// Claims paused sandbox `record` for this node if another holds it,
    /// and fetches its files (substrate snapshot `key`) unless they are
    /// here. The record as claimed, and whether it moved.
    pub(super) async fn bring_here(&self, mut record: SandboxRecord, key: &str) -> Result<(SandboxRecord, bool)> {
        let moved = !self.holds(record.node.as_deref());
        // Its volumes first: a sandbox runs only where they are (on a
        // single host, always here).
        if self.node.is_some() && !record.volume_mounts.is_empty() {
            let limit = super::team_volume_limit(self.store.as_ref(), &record.team)?;
            for mount in &record.volume_mounts {
                let arrival = self.volume_arrival(&mount.volume_id, limit).map_err(from_volume)?;
                tokio::task::spawn_blocking(move || arrival.bring())
                    .await
                    .map_err(|e| SandboxError::Internal(e.into()))?
                    .map_err(from_volume)?;
            }
        }
        if moved {
            record = self.claim(record)?;
        }
        if let Some(paused) = record.paused.as_ref().filter(|p| p.in_object_store) {
            let files = stand_in(&record, key, paused);
            let object = snapshot_file::paused_object_key(&record.team, &record.id)?;
            self.fetch_files(&files, &object, &format!("paused sandbox {}", record.id)).await?;
        }
        Ok((record, moved))
    }

    /// Uploads the files of this node's sandboxes paused on their files
    /// that are not in the object store yet; whether any upload failed.
    pub(super) async fn store_paused(&self, bucket: &std::sync::Arc<Bucket>) -> anyhow::Result<bool> {
        let pending: Vec<(SandboxRecord, Paused, String)> = self
            .own_records()?
            .into_iter()
            .filter(|r| r.node.is_some())
            .filter_map(|r| {
                let paused = r.paused.clone().filter(|p| !p.in_object_store)?;
                let key = paused.files_only.clone()?;
                Some((r, paused, key))
            })
            .collect();
        let mut failed = false;
        for (record, paused, key) in pending {
            let Ok(object) = snapshot_file::paused_object_key(&record.team, &record.id) else { continue };
            let (files, bucket, runtime) = (stand_in(&record, &key, &paused), bucket.clone(), Handle::current());
            let scratch = self.run_dir.clone();
            let blobs = self.base_blobs_of(&record.template)?;
            let oci = blobs.oci();
            let pushed = self
                .blocking(move |s| {
                    blobs.push(&object, &bucket, &runtime)?;
                    snapshot_file::push_under(s, &files, &object, &bucket, &runtime)?;
                    lazy_layers::push_layers(s, &files, &object, &bucket, &runtime, &scratch)
                })
                .await;
            let lazy = match pushed {
                Ok(lazy) => lazy,
                Err(e) => {
                    tracing::warn!(sandbox_id = %record.id, "storing a paused sandbox's files in the object store: {e}");
                    failed = true;
                    continue;
                }
            };
            // Marked only while it is still paused here on these files.
            let _transition = self.transitions.lock(&record.id).await;
            let Some(mut now) = self.store.get(&record.id)? else {
                self.forget_paused(&record).await;
                continue;
            };
            match now.paused.as_mut() {
                Some(p) if p.files_only.as_deref() == Some(key.as_str()) && self.holds(now.node.as_deref()) => {
                    p.in_object_store = true;
                    p.lazy = lazy;
                    p.oci = oci;
                }
                _ => continue,
            }
            if self.store.swap_paused(&now, now.node.as_deref())? {
                tracing::info!(sandbox_id = %record.id, memory = paused.memory, "stored a paused sandbox in the object store");
            }
        }
        Ok(failed)
    }

    /// Removes a paused sandbox's files from the object store once it runs
    /// again or is gone (their chunks stay, as a deleted snapshot's do).
    pub(super) async fn forget_paused(&self, record: &SandboxRecord) {
        let Some(bucket) = self.objects() else { return };
        let Ok(key) = snapshot_file::paused_object_key(&record.team, &record.id) else { return };
        if let Err(e) = bucket.delete(&key).await {
            tracing::warn!(sandbox_id = %record.id, "removing a paused sandbox's files from the object store: {e:#}");
        }
        if let Err(e) = lazy_layers::forget_layers(&bucket, &key).await {
            tracing::warn!(sandbox_id = %record.id, "removing a paused sandbox's layer images from the object store: {e:#}");
        }
    }

    /// Lets go of what this node still holds of sandboxes another node
    /// took over (a move, or a kill from elsewhere while this node was
    /// thought lost): their place in their team's counts, their token,
    /// their address and their files here. Nothing else would until a
    /// restart, as only this node's own writes keep its index in step.
    pub async fn release_moved(&self) -> anyhow::Result<()> {
        if self.node.is_none() {
            return Ok(());
        }
        // Listed before the records are read, so a sandbox indexed after
        // that read (a create, a claim) is never judged by it.
        let indexed = self.store.indexed();
        if indexed.is_empty() {
            return Ok(());
        }
        let here: HashSet<String> = self.own_records()?.into_iter().map(|r| r.id).collect();
        let mut released = false;
        for (id, files) in indexed.into_iter().filter(|(id, _)| !here.contains(id)) {
            let _transition = self.transitions.lock(&id).await;
            // A connect here may have claimed it back meanwhile.
            if self.store.get(&id)?.is_some_and(|r| self.holds(r.node.as_deref())) {
                continue;
            }
            self.store.unindex(&id);
            self.addresses.release(&id);
            if let Some(key) = files {
                self.blocking(move |s| s.delete_snapshot(&key)).await?;
                released = true;
            }
            tracing::info!(sandbox_id = %id, "let go of a sandbox another node took over");
        }
        if released {
            // Its files may have been the last to stand on an image's template.
            self.collect_waiting_image_templates().await;
        }
        Ok(())
    }

    /// When the operator drained this node with `--move-sandboxes`, pauses
    /// each of its sandboxes into the object store (see the module's doc).
    pub async fn move_out_if_asked(&self) -> anyhow::Result<()> {
        let Some(membership) = self.node.as_ref().filter(|m| m.objects.is_some()) else { return Ok(()) };
        // The node table as placement last read it: no query of its own.
        let asked = membership.node_record(&membership.id)?.is_some_and(|n| n.draining && n.moving_out);
        if asked {
            self.pause_all_to_move().await?;
        }
        self.tend_volumes(asked).await
    }

    async fn pause_all_to_move(&self) -> anyhow::Result<()> {
        for record in self.own_records()? {
            if record.paused.as_ref().is_some_and(|p| p.files_only.is_some()) {
                continue;
            }
            match self.pause_to_move(&record.id).await {
                Ok(memory) => tracing::info!(sandbox_id = %record.id, memory, "paused to move to another node"),
                Err(e) => tracing::warn!(sandbox_id = %record.id, "pausing to move to another node: {e}"),
            }
        }
        Ok(())
    }

    /// Pauses sandbox `id` on a checkpoint of its files and memory (or its
    /// files alone when the checkpoint fails); whether memory was kept.
    async fn pause_to_move(&self, id: &str) -> Result<bool> {
        let _transition = self.transitions.lock(id).await;
        let Some(mut record) = self.store.get(id)? else { return Ok(false) };
        if !self.holds(record.node.as_deref()) || record.paused.as_ref().is_some_and(|p| p.files_only.is_some()) {
            return Ok(false);
        }
        if let Some(frozen) = record.paused.clone() {
            // A checkpoint is of running processes.
            let _intent = self.journal(id, Change::Resume { files: None })?;
            self.blocking({
                let id = id.to_string();
                move |s| s.resume(&id)
            })
            .await?;
            record.set_running(frozen.remaining_ms.max(1000), now_ms());
            self.store.put(&record)?;
        }
        let _place = self.quota.reserve_for(&Caller::team(&record.team), &record.team, Kind::Paused, 1, 0)?;
        let key = snapshot_key();
        let _intent = self.journal(id, Change::Pause { files: Some(key.clone()) })?;
        // Mounts of host volumes are outside what a checkpoint holds.
        let memory = record.volume_mounts.is_empty();
        let memory =
            self.stash_files(id, &key, memory, ["pause-files:after-snapshot", "pause-files:after-destroy"]).await?;
        // Restored processes get a new address wherever they resume.
        if memory {
            self.addresses.release(id);
        }
        record.set_paused(Some(key), memory, now_ms());
        self.store.put(&record)?;
        self.upload_soon();
        Ok(memory)
    }
}

/// A paused sandbox's files as the object store's stream names them: a
/// snapshot record of the sandbox's own id, which the fetching node checks
/// against the database's.
fn stand_in(record: &SandboxRecord, key: &str, paused: &Paused) -> SnapshotRecord {
    SnapshotRecord {
        id: record.id.clone(),
        team: record.team.clone(),
        names: Vec::new(),
        key: key.to_string(),
        template: record.template.clone(),
        source_sandbox: record.id.clone(),
        created_at_ms: paused.paused_at_ms.unwrap_or_default(),
        size_bytes: 0,
        memory: paused.memory,
        agent_token: None,
        volume_mounts: Vec::new(),
        node: record.node.clone(),
        in_object_store: paused.in_object_store,
        lazy: paused.lazy.clone(),
        oci: paused.oci.clone(),
    }
}

/// A volume that could not come here, as the resume's error.
fn from_volume(e: VolumeError) -> SandboxError {
    match e {
        VolumeError::Moving(why) => SandboxError::Unavailable(why),
        VolumeError::NotFound(id) => SandboxError::Unavailable(format!("its volume {id} no longer exists")),
        other => SandboxError::Internal(anyhow::anyhow!("{other}")),
    }
}
