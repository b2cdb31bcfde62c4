//! The journal in the service: each state change that touches both the
//! store and the host holds an [`Entry`] while it runs, and at start
//! [`Sandboxes::replay_journal`] finishes or undoes every change a crash cut
//! short, before the substrate's own recovery looks at what is left.
//!
//! The rule each replay follows: the sandbox ends up in its old state or
//! its new one, with its files, and nothing frozen that its record says is
//! running. Snapshot files no record names, and sandboxes no record names,
//! are left to `recover.rs` (they are removed there).

use crate::model::{Change, Intent, SandboxRecord, State, Store, new_id, now_ms};

use super::Sandboxes;

/// An intent in the journal; dropped, it is cleared. A crash (or an
/// injected fault, which aborts) never drops it, which is the point.
pub(super) struct Entry<'a> {
    store: &'a dyn Store,
    id: String,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.store.remove_intent(&self.id) {
            tracing::error!(intent = %self.id, "clearing a journal intent: {e:#}");
        }
    }
}

impl Sandboxes {
    /// Writes the intent to make `change` on `sandbox`; hold the entry
    /// until the store says what the host now holds.
    pub(super) fn journal(&self, sandbox: &str, change: Change) -> anyhow::Result<Entry<'_>> {
        let intent = Intent {
            id: new_id(),
            sandbox: sandbox.to_string(),
            change,
            started_at_ms: now_ms(),
            node: self.node().map(str::to_string),
        };
        self.store.put_intent(&intent)?;
        Ok(Entry { store: self.store.as_ref(), id: intent.id })
    }

    /// Finishes or undoes every change the journal says was under way.
    /// One that cannot be settled is logged and cleared: the substrate's
    /// recovery then removes whatever no record names.
    pub(super) async fn replay_journal(&self) -> anyhow::Result<()> {
        let mut intents: Vec<Intent> =
            self.store.intents()?.into_iter().filter(|i| self.holds(i.node.as_deref())).collect();
        intents.sort_by_key(|i| i.started_at_ms);
        for intent in intents {
            let record = self.store.get(&intent.sandbox)?;
            tracing::warn!(sandbox = %intent.sandbox, op = intent.change.name(), "settling a state change a crash cut short");
            if let Some(record) = record
                && let Err(e) = self.settle_intent(record, &intent.change).await
            {
                tracing::error!(sandbox = %intent.sandbox, op = intent.change.name(), "could not settle: {e:#}");
            }
            if let Change::Kill { files } = &intent.change {
                self.finish_kill(&intent.sandbox, files.clone()).await;
            }
            self.store.remove_intent(&intent.id)?;
        }
        Ok(())
    }

    async fn settle_intent(&self, mut record: SandboxRecord, change: &Change) -> anyhow::Result<()> {
        let id = record.id.clone();
        let alive = self.substrate.is_alive(&id, &record.placement);
        match change {
            // A freeze (a pause's, or the one a snapshot holds while it is
            // taken) that the record does not show is undone.
            Change::Pause { files: None } | Change::Snapshot { .. } | Change::Fork { .. } => {
                if record.state == State::Running && alive {
                    self.thaw(&id).await?;
                }
            }
            Change::Pause { files: Some(key) } => {
                if record.state != State::Running {
                    return Ok(());
                }
                if alive {
                    // Not yet destroyed: still running as recorded; the new
                    // snapshot is an orphan, removed by `recover.rs`.
                    self.thaw(&id).await?;
                } else if self.has_snapshot(key).await? {
                    // Its processes are gone but its files were kept: paused.
                    record.set_paused(Some(key.clone()), false, now_ms());
                    self.store.put(&record)?;
                }
            }
            Change::Resume { files: None } => {
                // Thawed or not, it runs now, as the resume asked.
                if alive {
                    self.thaw(&id).await?;
                    if let Some(paused) = record.paused.take() {
                        self.mark_running(record, paused.remaining_ms)?;
                    }
                }
            }
            Change::Resume { files: Some(key) } => self.settle_resume_from_files(record, key, alive).await?,
            Change::Rollback { key } => {
                if !alive || record.has_no_processes() {
                    self.redo_rollback(record, key).await?;
                }
            }
            Change::Kill { .. } => {}
        }
        Ok(())
    }

    /// A resume from files (or a restart that first kept the files): the
    /// files are in snapshot `key` until the record says it runs again.
    async fn settle_resume_from_files(&self, mut record: SandboxRecord, key: &str, alive: bool) -> anyhow::Result<()> {
        let Some(paused) = record.paused.clone() else {
            // Running as recorded: only the snapshot it booted from is left.
            return self.drop_snapshot(key).await;
        };
        match &paused.files_only {
            // Booted and handed over (the record names the new processes).
            Some(files) if files == key && alive => {
                self.mark_running(record, paused.remaining_ms)?;
                self.drop_snapshot(key).await
            }
            // Not booted, or not handed over: paused on its files, as before;
            // a half-booted sandbox is destroyed by `recover.rs`.
            Some(_) => Ok(()),
            // A restart from its own files: the files were being kept.
            None if !alive && self.has_snapshot(key).await? => {
                record.paused = Some(crate::model::Paused { files_only: Some(key.to_string()), ..paused });
                self.store.put(&record)?;
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn mark_running(&self, mut record: SandboxRecord, remaining_ms: i64) -> anyhow::Result<()> {
        record.set_running(remaining_ms.max(1000), now_ms());
        self.store.put(&record)
    }

    async fn redo_rollback(&self, record: SandboxRecord, key: &str) -> anyhow::Result<()> {
        let snapshot = self.store.snapshots()?.into_iter().find(|s| s.key == key && s.team == record.team);
        let Some(snapshot) = snapshot else {
            anyhow::bail!("the snapshot it was rolling back to is gone");
        };
        self.rollback_to(record, snapshot).await?;
        Ok(())
    }

    /// The rest of a kill: destroy (idempotent), its kept files, its record.
    async fn finish_kill(&self, id: &str, files: Option<String>) {
        let owned = id.to_string();
        let destroyed = self
            .blocking(move |s| {
                s.destroy(&owned)?;
                files.map_or(Ok(()), |key| s.delete_snapshot(&key))
            })
            .await;
        if let Err(e) = destroyed {
            tracing::error!(sandbox = %id, "finishing a kill: {e:#}");
        }
        if let Err(e) = self.store.remove(id) {
            tracing::error!(sandbox = %id, "finishing a kill: {e:#}");
        }
    }

    async fn thaw(&self, id: &str) -> anyhow::Result<()> {
        let id = id.to_string();
        Ok(self.blocking(move |s| s.resume(&id)).await?)
    }

    pub(super) async fn has_snapshot(&self, key: &str) -> anyhow::Result<bool> {
        Ok(self.blocking(|s| s.snapshots()).await?.iter().any(|s| s.id == key))
    }

    async fn drop_snapshot(&self, key: &str) -> anyhow::Result<()> {
        let key = key.to_string();
        Ok(self.blocking(move |s| s.delete_snapshot(&key)).await?)
    }
}
