//! Rollback: a sandbox's files go back to one of its snapshots and its
//! processes restart; id, token and lifetime stay.

use super::Sandboxes;
use crate::fault;
use crate::model::{Caller, Change, Result, SandboxError, SandboxRecord, SnapshotRecord, State, now_ms};

impl Sandboxes {
    /// Puts the files of one of the sandbox's snapshots back in place and
    /// restarts its processes; id, token and lifetime stay.
    pub async fn rollback(&self, caller: &Caller, id: &str, snapshot: &str) -> Result<SandboxRecord> {
        let transition = self.transitions.lock(id).await;
        let record = self.get(caller, id)?;
        let snapshot = self
            .store
            .snapshot(&record.team, snapshot)?
            .ok_or_else(|| SandboxError::SnapshotNotFound(snapshot.to_string()))?;
        if snapshot.template != record.template {
            return Err(SandboxError::Invalid(format!(
                "snapshot {} is of template {}, sandbox {id} of {}",
                snapshot.id, snapshot.template, record.template
            )));
        }
        let intent = self.journal(id, Change::Rollback { key: snapshot.key.clone() })?;
        let record = self.rollback_files(record, &snapshot).await?;
        let ready = self.rollback_start(&record, &snapshot).await;
        drop(intent);
        drop(transition);
        if let Err(e) = ready {
            self.kill(&Caller::operator(), id).await.ok();
            return Err(e);
        }
        Ok(record)
    }

    /// A whole rollback; how recovery redoes one a crash cut short.
    pub(super) async fn rollback_to(&self, record: SandboxRecord, snapshot: SnapshotRecord) -> Result<SandboxRecord> {
        let record = self.rollback_files(record, &snapshot).await?;
        self.rollback_start(&record, &snapshot).await?;
        Ok(record)
    }

    /// The host's part: the snapshot's files in place, processes started
    /// afresh; the record as it will be once they are handed over.
    async fn rollback_files(&self, mut record: SandboxRecord, snapshot: &SnapshotRecord) -> Result<SandboxRecord> {
        let spec = self.spec(&record.id, &record.template, None, record.network.clone(), &record.volume_mounts);
        let leftover = record.paused.as_ref().and_then(|p| p.files_only.clone());
        let key = snapshot.key.clone();
        let placement = self
            .blocking(move |s| {
                let placement = s.rollback(&spec, &key)?;
                fault::point("rollback:after-rollback");
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
        Ok(record)
    }

    async fn rollback_start(&self, record: &SandboxRecord, snapshot: &SnapshotRecord) -> Result<()> {
        self.start_service(&record.template, &record.agent_socket, snapshot.memory).await?;
        self.hand_over(record, snapshot.agent_token.as_deref()).await?;
        fault::point("rollback:after-record");
        Ok(())
    }
}
