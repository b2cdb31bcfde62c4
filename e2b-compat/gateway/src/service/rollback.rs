//! Rollback: a sandbox's files go back to one of its snapshots and its
//! processes restart; id, token and lifetime stay.

use super::Sandboxes;
use crate::model::{Caller, Result, SandboxError, SandboxRecord, State, now_ms};

impl Sandboxes {
    /// Puts the files of one of the sandbox's snapshots back in place and
    /// restarts its processes; id, token and lifetime stay.
    pub async fn rollback(&self, caller: &Caller, id: &str, snapshot: &str) -> Result<SandboxRecord> {
        let transition = self.transitions.lock(id).await;
        let mut record = self.get(caller, id)?;
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
        let spec = self.spec(id, &record.template, None, record.network.clone(), &record.volume_mounts);
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
            self.kill(&Caller::operator(), id).await.ok();
            return Err(e.into());
        }
        Ok(record)
    }
}
