//! Ending a sandbox: on request (kill), or one that never reached its
//! caller (discard).

use super::Sandboxes;
use crate::model::{Caller, Result};

impl Sandboxes {
    pub async fn kill(&self, caller: &Caller, id: &str) -> Result<()> {
        let record = self.get(caller, id)?;
        let owned = id.to_string();
        let files = record.paused.and_then(|p| p.files_only);
        self.blocking(move |s| {
            s.destroy(&owned)?;
            match files {
                Some(key) => s.delete_snapshot(&key),
                None => Ok(()),
            }
        })
        .await?;
        self.addresses.release(id);
        self.store.remove(id)?;
        self.cpu_samples.forget(id);
        self.transitions.forget(id);
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
