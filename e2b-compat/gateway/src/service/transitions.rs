//! Per-sandbox locks, so two state changes of one sandbox (say, two
//! requests auto-resuming it at once) never interleave.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub(super) struct Transitions(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl Transitions {
    pub(super) async fn lock(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self.0.lock().unwrap_or_else(|p| p.into_inner()).entry(id.to_string()).or_default().clone();
        lock.lock_owned().await
    }

    /// The lock of `id` if no state change holds it (one under way may
    /// have the sandbox between two placements).
    pub(super) fn try_lock(&self, id: &str) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        let lock = self.0.lock().unwrap_or_else(|p| p.into_inner()).entry(id.to_string()).or_default().clone();
        lock.try_lock_owned().ok()
    }

    pub(super) fn forget(&self, id: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }
}
