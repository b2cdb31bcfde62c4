//! Pause and resume, snapshots, create-from-snapshot (in `sandboxes`),
//! fork/clone and rollback: the sandbox service's lifecycle operations,
//! composed from the substrate's primitives (freeze, thaw, filesystem
//! snapshot, boot from a snapshot).
//!
//! What a fork or clone child shares with its source: files (as of the
//! fork), template, metadata and environment variables, and, for a fork
//! with memory (E2B's fork where the substrate can), the memory and running
//! processes. What is new: id, hostname (the id), access token, address,
//! cgroup, and lifetime (the fork request's timeout). See docs/lifecycle.md.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::future::join_all;

use copse_substrate::Support;

use crate::agent_link;
use crate::sandboxes::{
    Paused, Result, SandboxError, SandboxRecord, Sandboxes, SnapshotRecord, State, new_id, new_token, now_ms,
    validate_timeout,
};

/// E2B's bounds for one fork request.
pub const MAX_FORKS: u32 = 20;
/// copse's own clone takes more at once (CubeSandbox clones 100 in its
/// report).
pub const MAX_CLONES: u32 = 1000;

/// How `connect` found the sandbox: E2B answers 200 and 201 respectively.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connected {
    AlreadyRunning,
    Resumed,
}

/// Per-sandbox locks, so two state changes of one sandbox (say, two
/// requests auto-resuming it at once) never interleave.
#[derive(Default)]
pub struct Transitions(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl Transitions {
    async fn lock(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self.0.lock().unwrap_or_else(|p| p.into_inner()).entry(id.to_string()).or_default().clone();
        lock.lock_owned().await
    }

    /// The lock of `id` if no state change holds it (one under way may
    /// have the sandbox between two placements).
    pub fn try_lock(&self, id: &str) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        let lock = self.0.lock().unwrap_or_else(|p| p.into_inner()).entry(id.to_string()).or_default().clone();
        lock.try_lock_owned().ok()
    }

    pub fn forget(&self, id: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }
}

impl Sandboxes {
    /// Pauses a running sandbox. `memory`: keep its processes frozen in
    /// place; otherwise keep only its files and stop its processes.
    pub async fn pause(&self, id: &str, memory: bool) -> Result<()> {
        let _transition = self.transitions.lock(id).await;
        let mut record = self.get(id)?;
        if record.state == State::Paused {
            return Err(SandboxError::Conflict(format!("sandbox {id} is already paused")));
        }
        let files_only = if memory {
            self.blocking({
                let id = id.to_string();
                move |s| s.pause(&id)
            })
            .await?;
            None
        } else {
            Some(self.stash_files(id).await?)
        };
        record.paused = Some(Paused { remaining_ms: (record.end_at_ms - now_ms()).max(0), files_only });
        record.state = State::Paused;
        // The clock stops while paused: a paused sandbox never expires.
        record.end_at_ms = i64::MAX;
        self.store.put(&record)?;
        Ok(())
    }

    /// E2B's connect: a running sandbox gets its life extended; a paused one
    /// is resumed (`memory: Some(false)` asks to start it afresh from its
    /// files even if its memory was kept).
    pub async fn connect(
        &self,
        id: &str,
        timeout_s: Option<i64>,
        memory: Option<bool>,
    ) -> Result<(SandboxRecord, Connected)> {
        let _transition = self.transitions.lock(id).await;
        let record = self.get(id)?;
        let Some(paused) = record.paused.clone() else {
            return Ok((self.extend(id, timeout_s)?, Connected::AlreadyRunning));
        };
        let lifetime = match timeout_s {
            Some(t) => validate_timeout(t)? * 1000,
            None => paused.remaining_ms.max(1000),
        };
        let mut record = match (&paused.files_only, memory) {
            (None, Some(false)) => self.restart_from_own_files(record).await?,
            (None, _) => {
                self.blocking({
                    let id = id.to_string();
                    move |s| s.resume(&id)
                })
                .await?;
                record
            }
            (Some(key), _) => self.reboot_from(record, key).await?,
        };
        record.paused = None;
        record.state = State::Running;
        record.end_at_ms = now_ms() + lifetime;
        self.store.put(&record)?;
        Ok((record, Connected::Resumed))
    }

    /// Resumes a paused sandbox for traffic addressed to it, if it asked for
    /// that at create; otherwise says it is paused.
    pub async fn resume_for_traffic(&self, record: SandboxRecord) -> Result<SandboxRecord> {
        if record.paused.is_none() {
            return Ok(record);
        }
        if !record.auto_resume {
            return Err(SandboxError::Conflict(format!(
                "sandbox {} is paused; connect to it (Sandbox.connect) to resume it",
                record.id
            )));
        }
        Ok(self.connect(&record.id, None, None).await?.0)
    }

    /// Boots the sandbox again, under its id, from the files in substrate
    /// snapshot `key` (then dropped), and hands it back to its owner.
    async fn reboot_from(&self, mut record: SandboxRecord, key: &str) -> Result<SandboxRecord> {
        let booted = self
            .boot_from(record.id.clone(), &record.template, Some(key.to_string()), record.network.clone(), false)
            .await?;
        record.placement = booted.placement;
        if let Err(e) = self.hand_over(&record, None).await {
            self.destroy_quietly(&record.id).await;
            return Err(e.into());
        }
        self.blocking({
            let key = key.to_string();
            move |s| s.delete_snapshot(&key)
        })
        .await?;
        Ok(record)
    }

    async fn restart_from_own_files(&self, mut record: SandboxRecord) -> Result<SandboxRecord> {
        let key = self.stash_files(&record.id).await?;
        // Recorded before the reboot: if that fails, the sandbox stays
        // paused on its files instead of pointing at processes now gone.
        if let Some(paused) = record.paused.as_mut() {
            paused.files_only = Some(key.clone());
        }
        self.store.put(&record)?;
        self.reboot_from(record, &key).await
    }

    /// Keeps the sandbox's files in a new substrate snapshot and ends its
    /// processes; returns the snapshot's key.
    async fn stash_files(&self, id: &str) -> Result<String> {
        let key = snapshot_key();
        self.blocking({
            let (id, key) = (id.to_string(), key.clone());
            move |s| {
                s.snapshot(&id, &key, false)?;
                s.destroy(&id)
            }
        })
        .await?;
        Ok(key)
    }

    /// A snapshot of a running (or frozen) sandbox, with its memory if
    /// `memory` asks for it, kept under `name` if given (replacing an older
    /// snapshot of that name).
    pub async fn create_snapshot(
        &self,
        id: &str,
        name: Option<String>,
        memory: Option<bool>,
    ) -> Result<SnapshotRecord> {
        let record = self.get(id)?;
        // E2B's default is "full"; where memory cannot be kept, an
        // unspecified mode gets the filesystem (docs/lifecycle.md).
        let memory = self.memory_wanted(&record.template, memory, true, "snapshots with memory (mode 'full')")?;
        if record.has_no_processes() {
            return Err(SandboxError::Conflict(format!(
                "sandbox {id} is paused without memory; resume it before taking a snapshot"
            )));
        }
        if let Some(name) = &name {
            validate_snapshot_name(name)?;
        }
        let key = snapshot_key();
        let info = self.take_snapshot(&record, &key, memory).await?;
        let public = name.clone().unwrap_or_else(|| key.clone());
        let replaced = self.store.snapshot(&public)?;
        let snapshot = SnapshotRecord {
            id: public.clone(),
            names: vec![public],
            key,
            template: info.template,
            source_sandbox: id.to_string(),
            created_at_ms: now_ms(),
            size_bytes: info.size_bytes,
            memory: info.memory,
            agent_token: info.memory.then(|| record.access_token.clone()),
        };
        self.store.put_snapshot(&snapshot)?;
        if let Some(old) = replaced {
            self.blocking(move |s| s.delete_snapshot(&old.key)).await?;
        }
        Ok(snapshot)
    }

    /// Whether a fork of `id` carries memory. An explicit `requested` the
    /// substrate cannot honour is an error, never a silent downgrade; with
    /// none, `default` applies where the substrate can (a substrate without
    /// memory snapshots forks files only, as docs/lifecycle.md says).
    pub fn fork_memory(&self, id: &str, requested: Option<bool>, default: bool) -> Result<bool> {
        let record = self.get(id)?;
        self.memory_wanted(&record.template, requested, default, "forks with memory")
    }

    /// Whether an operation on a sandbox of `template` keeps memory: what
    /// was `requested`, or `default` where the substrate can. A request the
    /// substrate cannot honour is refused by name — 400 where this kind of
    /// sandbox never can, 503 with what to install where this host lacks it.
    fn memory_wanted(&self, template: &str, requested: Option<bool>, default: bool, what: &str) -> Result<bool> {
        let support = self.substrate.capabilities_for(template).memory_snapshots;
        match (requested, support) {
            (Some(true), Support::No) => Err(SandboxError::Invalid(format!(
                "{what} are not supported by the {} substrate; use mode 'filesystem'",
                self.substrate.name()
            ))),
            (Some(true), Support::Missing(why)) => Err(SandboxError::Unavailable(why)),
            (Some(wanted), _) => Ok(wanted),
            (None, support) => Ok(default && support.is_yes()),
        }
    }

    /// The substrate's snapshot of a sandbox as `key`. With memory, the
    /// gateway's connections to the sandbox are closed and held back while
    /// it is taken (a checkpoint cannot hold them); a connection that was
    /// just closing can still be in the way, so one failure is retried.
    async fn take_snapshot(
        &self,
        record: &SandboxRecord,
        key: &str,
        memory: bool,
    ) -> Result<copse_substrate::SnapshotInfo> {
        let take = || {
            let (id, key) = (record.id.clone(), key.to_string());
            self.blocking(move |s| s.snapshot(&id, &key, memory))
        };
        if !memory {
            return take().await;
        }
        let _quiet = agent_link::quiesce(&record.agent_socket).await;
        match take().await {
            Ok(info) => Ok(info),
            Err(e) => {
                tracing::info!(sandbox = %record.id, "memory snapshot retried after: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                take().await
            }
        }
    }

    /// Snapshots, optionally only those taken of one sandbox, oldest first.
    pub fn snapshots(&self, sandbox: Option<&str>, name: Option<&str>) -> Result<Vec<SnapshotRecord>> {
        let mut all: Vec<SnapshotRecord> = self
            .store
            .snapshots()?
            .into_iter()
            .filter(|s| sandbox.is_none_or(|id| s.source_sandbox == id))
            .filter(|s| name.is_none_or(|n| s.names.iter().any(|x| x == n)))
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all)
    }

    /// Deletes a snapshot. Sandboxes created from it keep their files.
    pub async fn delete_snapshot(&self, id: &str) -> Result<()> {
        let snapshot = self.store.snapshot(id)?.ok_or_else(|| SandboxError::SnapshotNotFound(id.to_string()))?;
        self.store.remove_snapshot(id)?;
        self.blocking(move |s| s.delete_snapshot(&snapshot.key)).await
    }

    /// Puts the files of one of the sandbox's snapshots back in place and
    /// restarts its processes; id, token and lifetime stay.
    pub async fn rollback(&self, id: &str, snapshot: &str) -> Result<SandboxRecord> {
        let transition = self.transitions.lock(id).await;
        let mut record = self.get(id)?;
        let snapshot =
            self.store.snapshot(snapshot)?.ok_or_else(|| SandboxError::SnapshotNotFound(snapshot.to_string()))?;
        if snapshot.template != record.template {
            return Err(SandboxError::Invalid(format!(
                "snapshot {} is of template {}, sandbox {id} of {}",
                snapshot.id, snapshot.template, record.template
            )));
        }
        let spec = self.spec(id, &record.template, None, record.network.clone());
        let leftover = record.paused.as_ref().and_then(|p| p.files_only.clone());
        let placement = self
            .blocking(move |s| {
                let placement = s.rollback(&spec, &snapshot.key)?;
                if let Some(key) = leftover {
                    s.delete_snapshot(&key)?;
                }
                Ok(placement)
            })
            .await?;
        record.placement = placement;
        if let Some(paused) = record.paused.take() {
            record.end_at_ms = now_ms() + paused.remaining_ms.max(1000);
        }
        record.state = State::Running;
        let ready = match self.start_service(&record.template, &record.agent_socket, snapshot.memory).await {
            Ok(()) => self.hand_over(&record, snapshot.agent_token.as_deref()).await,
            Err(e) => Err(e),
        };
        drop(transition);
        if let Err(e) = ready {
            self.kill(id).await.ok();
            return Err(e.into());
        }
        Ok(record)
    }

    /// `count` new sandboxes with the source's files (and, with `memory`,
    /// its memory and processes) as of now; the source keeps running
    /// untouched (frozen only while the snapshot is taken). One result per
    /// child, in order.
    pub async fn fork(
        &self,
        id: &str,
        count: u32,
        max: u32,
        timeout_s: i64,
        memory: bool,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        if !(1..=max).contains(&count) {
            return Err(SandboxError::Invalid(format!("count must be between 1 and {max}, got {count}")));
        }
        let timeout = validate_timeout(timeout_s)?;
        let source = self.get(id)?;
        if source.has_no_processes() {
            return Err(SandboxError::Conflict(format!("sandbox {id} is paused without memory; resume it first")));
        }
        let key = snapshot_key();
        let memory = self.take_snapshot(&source, &key, memory).await?.memory;
        let children = join_all((0..count).map(|_| self.child_of(&source, &key, timeout, memory))).await;
        // Each child pinned the snapshot's layers at boot; the snapshot
        // itself was only the way to get there.
        self.blocking(move |s| s.delete_snapshot(&key)).await?;
        Ok(children)
    }

    async fn child_of(&self, source: &SandboxRecord, key: &str, timeout_s: i64, memory: bool) -> Result<SandboxRecord> {
        let booted = self.boot_from(new_id(), &source.template, Some(key.to_string()), None, memory).await?;
        // A child gets its own address, under its source's policy.
        let policy = source.network.as_ref().map(|n| n.policy.clone()).unwrap_or_else(copse_substrate::Policy::open);
        let network = match self.with_policy(&booted.id, booted.network.clone(), &policy).await {
            Ok(network) => network,
            Err(e) => {
                self.discard(&booted.id).await;
                return Err(e);
            }
        };
        let now = now_ms();
        let record = SandboxRecord {
            id: booted.id,
            access_token: new_token(),
            started_at_ms: now,
            end_at_ms: now + timeout_s * 1000,
            state: State::Running,
            paused: None,
            placement: booted.placement,
            agent_socket: booted.agent_socket,
            network,
            ..source.clone()
        };
        let agent_token = memory.then_some(source.access_token.as_str());
        if let Err(e) = self.hand_over(&record, agent_token).await {
            self.discard(&record.id).await;
            return Err(e.into());
        }
        Ok(record)
    }

    /// After a restart: snapshot rows whose files are gone are dropped, and
    /// substrate snapshots no row (and no paused sandbox) names are deleted.
    pub(crate) async fn reconcile_snapshots(&self) -> anyhow::Result<()> {
        let on_host = self.blocking(|s| s.snapshots()).await?;
        let rows = self.store.snapshots()?;
        for row in &rows {
            if !on_host.iter().any(|s| s.id == row.key) {
                tracing::warn!("snapshot {} lost its files; forgetting it", row.id);
                self.store.remove_snapshot(&row.id)?;
            }
        }
        let mut named: Vec<String> = rows.into_iter().map(|r| r.key).collect();
        named.extend(self.store.all()?.into_iter().filter_map(|r| r.paused.and_then(|p| p.files_only)));
        for orphan in on_host.into_iter().filter(|s| !named.contains(&s.id)) {
            tracing::info!("removing snapshot {} that no record names", orphan.id);
            self.blocking(move |s| s.delete_snapshot(&orphan.id)).await?;
        }
        Ok(())
    }

    /// Runs a substrate call on a blocking thread.
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&dyn copse_substrate::Substrate) -> anyhow::Result<T> + Send + 'static,
    ) -> Result<T> {
        let substrate = self.substrate.clone();
        Ok(tokio::task::spawn_blocking(move || call(substrate.as_ref())).await.map_err(anyhow::Error::from)??)
    }
}

/// Substrate snapshot keys: plain names every substrate accepts.
fn snapshot_key() -> String {
    format!("snap-{}", new_id())
}

/// Public snapshot names may carry E2B's `namespace/alias:tag` shape.
fn validate_snapshot_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:".contains(c))
        && !name.contains("..");
    if ok {
        Ok(())
    } else {
        Err(SandboxError::Invalid(format!(
            "invalid snapshot name {name:?}: use letters, digits and - _ . / : (at most 128)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_names_take_e2b_shapes_and_refuse_paths() {
        assert!(validate_snapshot_name("team/my-snap:default").is_ok());
        assert!(validate_snapshot_name("plain_name.v2").is_ok());
        assert!(validate_snapshot_name("../etc").is_err());
        assert!(validate_snapshot_name("").is_err());
        assert!(validate_snapshot_name("a b").is_err());
    }

    #[test]
    fn snapshot_keys_are_valid_substrate_names() {
        let key = snapshot_key();
        assert!(copse_substrate::template::validate_name(&key).is_ok(), "{key}");
    }
}
