//! Snapshots: taking one (with memory where the substrate can), listing
//! and deleting them. Creating a sandbox from one is in `create.rs`.

use copse_substrate::Support;

use super::Sandboxes;
use super::quota::Kind;
use crate::agent_link;
use crate::fault;
use crate::model::{
    Caller, Change, Result, SandboxError, SandboxRecord, SnapshotRecord, now_ms, snapshot_key, validate_snapshot_name,
};

impl Sandboxes {
    /// A snapshot of a running (or frozen) sandbox, with its memory if
    /// `memory` asks for it, kept under `name` if given (replacing an older
    /// snapshot of that name).
    pub async fn create_snapshot(
        &self,
        caller: &Caller,
        id: &str,
        name: Option<String>,
        memory: Option<bool>,
    ) -> Result<SnapshotRecord> {
        let result = self.snapshot_now(caller, id, name, memory).await;
        self.observe_snapshot(id, memory.unwrap_or(false), &result);
        result
    }

    async fn snapshot_now(
        &self,
        caller: &Caller,
        id: &str,
        name: Option<String>,
        memory: Option<bool>,
    ) -> Result<SnapshotRecord> {
        let record = self.get(caller, id)?;
        // E2B's default is "full"; where memory cannot be kept, an
        // unspecified mode gets the filesystem (docs/lifecycle.md).
        let memory = self.memory_for(&record, memory, true, "snapshots with memory (mode 'full')")?;
        if record.has_no_processes() {
            return Err(SandboxError::Conflict(format!(
                "sandbox {id} is paused without memory; resume it before taking a snapshot"
            )));
        }
        if let Some(name) = &name {
            validate_snapshot_name(name)?;
            self.refuse_template_names(name).await?;
        }
        let team = record.team.clone();
        let replaced = match &name {
            Some(name) => self.store.snapshot(&team, name)?,
            None => None,
        };
        // Replacing a snapshot of the same name holds no more.
        let _place = match replaced {
            Some(_) => None,
            None => self.quota.reserve_for(caller, &team, Kind::Snapshots, 1, 0)?,
        };
        self.quota.check_disk(caller, &team)?;
        let key = snapshot_key();
        let _intent = self.journal(id, Change::Snapshot { key: key.clone() })?;
        let info = self.take_snapshot(&record, &key, memory).await?;
        fault::point("snapshot:after-take");
        let public = name.clone().unwrap_or_else(|| key.clone());
        // Read again: another request may have taken the name meanwhile.
        let replaced = self.store.snapshot(&team, &public)?;
        let snapshot = SnapshotRecord {
            id: public.clone(),
            team,
            names: vec![public],
            key,
            template: info.template,
            source_sandbox: id.to_string(),
            created_at_ms: now_ms(),
            size_bytes: info.size_bytes,
            memory: info.memory,
            agent_token: info.memory.then(|| record.access_token.clone()),
            volume_mounts: record.volume_mounts.clone(),
            node: self.node().map(str::to_string),
            in_object_store: false,
            lazy: None,
            oci: None,
        };
        self.store.put_snapshot(&snapshot)?;
        fault::point("snapshot:after-record");
        self.upload_soon();
        if let Some(old) = replaced {
            self.blocking(move |s| s.delete_snapshot(&old.key)).await?;
        }
        Ok(snapshot)
    }

    /// As [`Self::memory_wanted`] for sandbox `record`: one with volume
    /// mounts is never checkpointed with memory (its mounts are the host's,
    /// outside what a checkpoint holds), so asking for it is a 400 and
    /// leaving the mode unset gets its files.
    pub(super) fn memory_for(
        &self,
        record: &SandboxRecord,
        requested: Option<bool>,
        default: bool,
        what: &str,
    ) -> Result<bool> {
        if record.volume_mounts.is_empty() {
            return self.memory_wanted(&record.template, requested, default, what);
        }
        match requested {
            Some(true) => Err(SandboxError::Invalid(format!(
                "{what} of a sandbox with volume mounts are not supported; use mode 'filesystem'"
            ))),
            _ => Ok(false),
        }
    }

    /// Whether an operation on a sandbox of `template` keeps memory: what
    /// was `requested`, or `default` where the substrate can. A request the
    /// substrate cannot honour is refused by name — 400 where this kind of
    /// sandbox never can, 503 with what to install where this host lacks it.
    pub(super) fn memory_wanted(
        &self,
        template: &str,
        requested: Option<bool>,
        default: bool,
        what: &str,
    ) -> Result<bool> {
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
    pub(super) async fn take_snapshot(
        &self,
        record: &SandboxRecord,
        key: &str,
        memory: bool,
    ) -> Result<copse_substrate::SnapshotInfo> {
        let take = || async {
            let (id, key) = (record.id.clone(), key.to_string());
            let started = std::time::Instant::now();
            let taken = self.blocking(move |s| s.snapshot(&id, &key, memory)).await;
            if memory {
                self.observe_checkpoint(false, taken.is_ok(), started.elapsed());
            }
            taken
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

    /// A snapshot name may not shadow a template: a create naming it must
    /// keep meaning the template, for every team.
    async fn refuse_template_names(&self, name: &str) -> Result<()> {
        if crate::templates::is_shipped(name) || self.templates().await?.iter().any(|t| t.name == name) {
            return Err(SandboxError::Invalid(format!("snapshot name {name:?} is a template's name; choose another")));
        }
        Ok(())
    }

    /// The snapshots `caller` may see, optionally only those taken of one
    /// sandbox, oldest first.
    pub fn snapshots(&self, caller: &Caller, sandbox: Option<&str>, name: Option<&str>) -> Result<Vec<SnapshotRecord>> {
        let mut all: Vec<SnapshotRecord> = self
            .store
            .snapshots()?
            .into_iter()
            .filter(|s| caller.sees(&s.team))
            .filter(|s| sandbox.is_none_or(|id| s.source_sandbox == id))
            .filter(|s| name.is_none_or(|n| s.names.iter().any(|x| x == n)))
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all)
    }

    /// Deletes a snapshot. Sandboxes created from it keep their files.
    pub async fn delete_snapshot(&self, caller: &Caller, id: &str) -> Result<()> {
        let snapshot = self.snapshot(caller, id)?;
        self.store.remove_snapshot(&snapshot.team, id)?;
        if snapshot.in_object_store {
            self.forget_stored(&snapshot).await;
        }
        self.blocking(move |s| s.delete_snapshot(&snapshot.key)).await?;
        self.collect_waiting_image_templates().await;
        Ok(())
    }

    /// The caller's own snapshot `id`; an admin's, else the first of that
    /// id in any team.
    /// The node holding the files of the caller's snapshot `id`; `None`
    /// when it is no snapshot of the caller's.
    pub fn snapshot_node(&self, caller: &Caller, id: &str) -> Option<Option<String>> {
        self.snapshot(caller, id).ok().map(|s| s.node)
    }

    pub(super) fn snapshot(&self, caller: &Caller, id: &str) -> Result<SnapshotRecord> {
        if let Some(own) = self.store.snapshot(&caller.team, id)? {
            return Ok(own);
        }
        if caller.admin
            && let Some(any) = self.store.snapshots()?.into_iter().find(|s| s.id == id)
        {
            return Ok(any);
        }
        Err(SandboxError::SnapshotNotFound(id.to_string()))
    }
}
