//! Ending a sandbox: on request (kill), or one that never reached its
//! caller (discard).

use super::Sandboxes;
use crate::fault;
use crate::model::{Caller, Change, Result, SandboxError, SandboxRecord};
use crate::telemetry::KillReason;

impl Sandboxes {
    pub async fn kill(&self, caller: &Caller, id: &str) -> Result<()> {
        let record = self.get(caller, id)?;
        // Routed here from another node only when that node is lost and the
        // sandbox's files are in the object store: the record is taken over
        // first, so a resume elsewhere and this kill never both happen.
        if !self.holds(record.node.as_deref()) {
            self.claim(record)?;
        }
        self.end(id, KillReason::Request).await
    }

    /// Ends sandbox `id`, counted and logged under `reason`.
    pub(super) async fn end(&self, id: &str, reason: KillReason) -> Result<()> {
        // One read: the record says both what to destroy and whose log it is.
        let record = self.store.get(id)?;
        let team = record.as_ref().map(|r| r.team.clone());
        let result = match record {
            Some(record) => self.destroy_record(record).await,
            None => Err(SandboxError::NotFound(id.to_string())),
        };
        self.observe_kill(id, team.as_deref(), reason, &result);
        result
    }

    async fn destroy_record(&self, record: SandboxRecord) -> Result<()> {
        let id = record.id.as_str();
        let owned = id.to_string();
        let attached = record.network.is_some() && !record.has_no_processes();
        let stored = record.paused.as_ref().is_some_and(|p| p.in_object_store);
        let files = record.paused.clone().and_then(|p| p.files_only);
        let _intent = self.journal(id, Change::Kill { files: files.clone() })?;
        let destroyed = self
            .blocking(move |s| {
                s.destroy(&owned)?;
                fault::point("kill:after-destroy");
                match files {
                    Some(key) => s.delete_snapshot(&key),
                    None => Ok(()),
                }
            })
            .await;
        if attached {
            self.observe_network(false, destroyed.is_ok());
        }
        destroyed?;
        self.addresses.release(id);
        self.store.remove(id)?;
        fault::point("kill:after-record");
        if stored {
            self.forget_paused(&record).await;
        }
        self.cpu_samples.forget(id);
        self.metric_history.forget(id);
        self.transitions.forget(id);
        self.collect_waiting_image_templates().await;
        Ok(())
    }

    /// Destroys a sandbox that never reached its caller and frees its
    /// address.
    pub(super) async fn discard(&self, id: &str) {
        self.destroy_quietly(id).await;
        self.addresses.release(id);
    }

    /// Destroys a sandbox, logging failure; its address stays with it (a
    /// sandbox paused without memory keeps its address).
    pub(super) async fn destroy_quietly(&self, id: &str) {
        let owned = id.to_string();
        if let Err(e) = self.blocking(move |s| s.destroy(&owned)).await {
            tracing::error!("destroying sandbox {id}: {e:#}");
        }
    }
}
