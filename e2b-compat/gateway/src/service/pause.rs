//! Pausing and resuming: freeze a sandbox in place or keep only its files,
//! and bring it back (E2B's pause and connect), on request or for traffic
//! addressed to it.

use super::Sandboxes;
use super::create::Network;
use super::quota::Kind;
use crate::model::{
    Caller, Paused, Result, SandboxError, SandboxRecord, State, now_ms, snapshot_key, validate_timeout,
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
        let mut record = match (&paused.files_only, memory) {
            (None, Some(false)) => self.restart_from_own_files(record).await?,
            (None, _) => {
                self.blocking(move |s| s.resume(&id)).await?;
                record
            }
            (Some(key), _) => self.reboot_from(record, key).await?,
        };
        record.paused = None;
        record.state = State::Running;
        record.end_at_ms = now_ms() + lifetime;
        self.store.put(&record)?;
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
    /// snapshot `key` (then dropped), and hands it back to its owner.
    async fn reboot_from(&self, mut record: SandboxRecord, key: &str) -> Result<SandboxRecord> {
        let booted = self
            .boot_from(
                record.id.clone(),
                &record.template,
                Some(key.to_string()),
                Network::kept(record.network.clone()),
                false,
                &record.volume_mounts,
            )
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
        let attached = self.store.get(id).ok().flatten().is_some_and(|r| r.network.is_some());
        let stashed = self
            .blocking({
                let (id, key) = (id.to_string(), key.clone());
                move |s| {
                    s.snapshot(&id, &key, false)?;
                    s.destroy(&id)
                }
            })
            .await;
        if attached {
            self.observe_network(false, stashed.is_ok());
        }
        stashed?;
        Ok(key)
    }
}
