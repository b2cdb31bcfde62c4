//! Pausing and resuming: freeze a sandbox in place or keep only its files,
//! and bring it back (E2B's pause and connect), on request or for traffic
//! addressed to it.

use super::Sandboxes;
use super::create::Network;
use super::quota::Kind;
use crate::fault;
use crate::model::{
    Caller, Change, Paused, Result, SandboxError, SandboxRecord, State, now_ms, snapshot_key, validate_timeout,
};

/// How `connect` found the sandbox: E2B answers 200 and 201 respectively.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Connected {
    AlreadyRunning,
    Resumed,
}

impl Sandboxes {
    /// Pauses a running sandbox. `memory`: keep its processes frozen in
    /// place; otherwise keep only its files and stop its processes.
    pub async fn pause(&self, caller: &Caller, id: &str, memory: bool) -> Result<()> {
        let result = self.pause_now(caller, id, memory).await;
        self.observe_pause(id, memory, &result);
        result
    }

    async fn pause_now(&self, caller: &Caller, id: &str, memory: bool) -> Result<()> {
        let _transition = self.transitions.lock(id).await;
        let mut record = self.get(caller, id)?;
        if record.state == State::Paused {
            return Err(SandboxError::Conflict(format!("sandbox {id} is already paused")));
        }
        let _place = self.quota.reserve_for(caller, &record.team, Kind::Paused, 1, 0)?;
        let files = (!memory).then(snapshot_key);
        let _intent = self.journal(id, Change::Pause { files: files.clone() })?;
        fault::point("pause:journaled");
        match &files {
            None => {
                self.blocking({
                    let id = id.to_string();
                    move |s| s.pause(&id)
                })
                .await?;
                fault::point("pause:after-freeze");
            }
            Some(key) => {
                self.stash_files(id, key, false, ["pause-files:after-snapshot", "pause-files:after-destroy"]).await?;
            }
        }
        let on_files = files.is_some();
        record.set_paused(files, false, now_ms());
        self.store.put(&record)?;
        if on_files {
            // In a cluster, its files go to the object store, so it may
            // resume on another node (`relocate.rs`).
            self.upload_soon();
        }
        fault::point(if memory { "pause:after-record" } else { "pause-files:after-record" });
        Ok(())
    }

    /// E2B's connect: a running sandbox gets its life extended; a paused one
    /// is resumed (`memory: Some(false)` asks to start it afresh from its
    /// files even if its memory was kept).
    pub async fn connect(
        &self,
        caller: &Caller,
        id: &str,
        timeout_s: Option<i64>,
        memory: Option<bool>,
    ) -> Result<(SandboxRecord, Connected)> {
        let _transition = self.transitions.lock(id).await;
        let record = self.get(caller, id)?;
        let Some(paused) = record.paused.clone() else {
            return Ok((self.extend(caller, id, timeout_s)?, Connected::AlreadyRunning));
        };
        let lifetime = match timeout_s {
            Some(t) => {
                let t = validate_timeout(t)?;
                self.quota.check_timeout(caller, &record.team, t)?;
                t * 1000
            }
            None => paused.remaining_ms.max(1000),
        };
        let _place = self.quota.reserve_for(caller, &record.team, Kind::Running, 1, 0)?;
        let resumed = self.resume_paused(record, &paused, memory, lifetime).await;
        self.observe_resume(id, &resumed);
        Ok((resumed?, Connected::Resumed))
    }

    async fn resume_paused(
        &self,
        record: SandboxRecord,
        paused: &Paused,
        memory: Option<bool>,
        lifetime: i64,
    ) -> Result<SandboxRecord> {
        let id = record.id.clone();
        // The files' snapshot is named before anything is touched, so a
        // crash's recovery knows where they may be.
        let restart = paused.files_only.is_none() && memory == Some(false);
        let files = if restart { Some(snapshot_key()) } else { paused.files_only.clone() };
        let _intent = self.journal(&id, Change::Resume { files: files.clone() })?;
        let mut record = match (&files, restart) {
            (Some(key), true) => self.restart_from_own_files(record, key).await?,
            (None, _) => {
                self.blocking(move |s| s.resume(&id)).await?;
                fault::point("resume:after-thaw");
                record
            }
            (Some(key), false) => {
                let (record, moved) = self.bring_here(record, key).await?;
                self.reboot_from(record, key, paused.memory, moved).await?
            }
        };
        record.set_running(lifetime, now_ms());
        self.store.put(&record)?;
        match files {
            None => fault::point("resume:after-record"),
            Some(key) => {
                fault::point("resume-files:after-record");
                // Only now, with the record saying it runs on them, are the
                // kept files no longer needed.
                self.blocking(move |s| s.delete_snapshot(&key)).await?;
                fault::point("resume-files:after-delete");
                if paused.in_object_store {
                    self.forget_paused(&record).await;
                }
            }
        }
        Ok(record)
    }

    /// E2B's pre-connect resume: only a paused sandbox may be resumed.
    pub async fn resume(
        &self,
        caller: &Caller,
        id: &str,
        timeout_s: Option<i64>,
        memory: Option<bool>,
    ) -> Result<SandboxRecord> {
        if self.get(caller, id)?.paused.is_none() {
            return Err(SandboxError::Conflict(format!("sandbox {id} is not paused")));
        }
        Ok(self.connect(caller, id, timeout_s, memory).await?.0)
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
        // Resumed on its team's behalf, within its team's limits.
        Ok(self.connect(&Caller::team(&record.team), &record.id, None, None).await?.0)
    }

    /// Boots the sandbox again, under its id, from the files in substrate
    /// snapshot `key` (kept: the caller drops it once the record says the
    /// sandbox runs), and hands it back to its owner. `memory`: the files
    /// hold a checkpoint, restored running; `moved`: it was paused on
    /// another node. Either way it gets an address of this node's subnet
    /// (one it held here is kept otherwise).
    async fn reboot_from(
        &self,
        mut record: SandboxRecord,
        key: &str,
        memory: bool,
        moved: bool,
    ) -> Result<SandboxRecord> {
        let kept_here = record.network.as_ref().is_some_and(|n| self.addresses.is_local(n.address));
        let fresh = memory || moved || !kept_here;
        let network = match (&record.network, fresh) {
            (Some(network), true) => Network::New(network.policy.clone()),
            (network, _) => Network::kept(network.clone()),
        };
        let booted = self
            .boot_from(
                record.id.clone(),
                &record.template,
                Some(key.to_string()),
                network,
                memory,
                &record.volume_mounts,
            )
            .await?;
        fault::point("resume-files:after-boot");
        record.placement = booted.placement;
        record.agent_socket = booted.agent_socket;
        record.network = booted.network;
        // A checkpointed agent demands the token it was handed before.
        let token = memory.then(|| record.access_token.clone());
        if let Err(e) = self.hand_over(&record, token.as_deref()).await {
            match fresh {
                true => self.discard(&record.id).await,
                false => self.destroy_quietly(&record.id).await,
            }
            return Err(e.into());
        }
        Ok(record)
    }

    async fn restart_from_own_files(&self, mut record: SandboxRecord, key: &str) -> Result<SandboxRecord> {
        self.stash_files(&record.id, key, false, ["restart:after-snapshot", "restart:after-destroy"]).await?;
        // Recorded before the reboot: if that fails, the sandbox stays
        // paused on its files instead of pointing at processes now gone.
        if let Some(paused) = record.paused.as_mut() {
            paused.files_only = Some(key.to_string());
        }
        self.store.put(&record)?;
        self.reboot_from(record, key, false, false).await
    }

    /// Keeps the sandbox's files in new substrate snapshot `key` and ends
    /// its processes; `memory`: with a checkpoint of them where one can be
    /// taken (else the files alone). Whether memory was kept; `faults` are
    /// the fault points after each step.
    pub(super) async fn stash_files(
        &self,
        id: &str,
        key: &str,
        memory: bool,
        faults: [&'static str; 2],
    ) -> Result<bool> {
        let attached = self.store.get(id).ok().flatten().is_some_and(|r| r.network.is_some());
        let stashed = self
            .blocking({
                let (id, key) = (id.to_string(), key.to_string());
                move |s| {
                    let kept = match memory.then(|| s.snapshot(&id, &key, true)) {
                        Some(Ok(_)) => true,
                        Some(Err(e)) => {
                            tracing::warn!(sandbox_id = %id, "checkpointing its memory failed, keeping its files only: {e:#}");
                            s.snapshot(&id, &key, false)?;
                            false
                        }
                        None => {
                            s.snapshot(&id, &key, false)?;
                            false
                        }
                    };
                    fault::point(faults[0]);
                    s.destroy(&id)?;
                    fault::point(faults[1]);
                    Ok(kept)
                }
            })
            .await;
        if attached {
            self.observe_network(false, stashed.is_ok());
        }
        stashed
    }
}
