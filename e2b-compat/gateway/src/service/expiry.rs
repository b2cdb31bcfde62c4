//! Sandboxes that end without a request: expired ones (killed, or paused
//! if they asked for that at create) and ones whose init died on its own.
//! `crate::reaper` calls these on its ticks.

use tracing::Instrument;

use super::Sandboxes;
use crate::model::{Caller, now_ms};
use crate::telemetry::{self, KillReason};

impl Sandboxes {
    /// Kills (or, if asked at create, pauses) expired sandboxes.
    pub async fn reap(&self) -> anyhow::Result<()> {
        let mut expired = self.store.expired(now_ms())?;
        // Another node's expire on their own host (a single host's are all
        // its own: no record is read for nothing).
        if self.node().is_some() {
            expired.retain(|id| self.store.get(id).ok().flatten().is_some_and(|r| self.holds(r.node.as_deref())));
        }
        telemetry::metrics().reaper_queue.set(expired.len() as i64);
        for id in expired {
            let span = tracing::info_span!("sandbox", sandbox_id = %id);
            self.expire(&id).instrument(span).await?;
        }
        Ok(())
    }

    /// Kills (or pauses) one expired sandbox.
    async fn expire(&self, id: &str) -> anyhow::Result<()> {
        let auto_pause = self.store.get(id)?.map(|r| (r.auto_pause, r.auto_pause_memory));
        let outcome = match auto_pause {
            Some((true, memory)) => {
                tracing::info!("sandbox {id} timed out; pausing it");
                self.pause(&Caller::operator(), id, memory).await
            }
            _ => {
                tracing::info!("sandbox {id} timed out");
                self.end(id, KillReason::Timeout).await
            }
        };
        if let Err(e) = outcome {
            tracing::error!("expiring sandbox {id}: {e:#}");
            if auto_pause.is_some_and(|(pause, _)| pause) {
                self.end(id, KillReason::Timeout).await.ok();
            }
        }
        Ok(())
    }

    /// Deletes, with their files, sandboxes paused for longer than their
    /// team's paused retention.
    pub async fn reap_paused(&self) -> anyhow::Result<()> {
        let now = now_ms();
        for record in self.own_records()? {
            let Some(paused_at) = record.paused.as_ref().and_then(|p| p.paused_at_ms) else { continue };
            let Some(retention) = self.quota.paused_retention_ms(&record.team) else { continue };
            if paused_at.saturating_add(retention) > now {
                continue;
            }
            // A resume under way wins: checked again next time.
            let Some(_quiet) = self.transitions.try_lock(&record.id) else { continue };
            if self.store.get(&record.id)?.is_none_or(|r| r.paused.is_none()) {
                continue;
            }
            let span = tracing::info_span!("sandbox", sandbox_id = %record.id);
            async {
                tracing::info!(team = %record.team, "sandbox {} outlived its team's paused retention; deleting it", record.id);
                if let Err(e) = self.end(&record.id, KillReason::Retention).await {
                    tracing::error!("deleting sandbox {} after its paused retention: {e:#}", record.id);
                }
            }
            .instrument(span)
            .await;
        }
        Ok(())
    }

    /// Forgets sandboxes whose init died on its own.
    pub async fn reap_dead(&self) -> anyhow::Result<()> {
        for record in self.own_records()? {
            // A rollback or restart in progress has no live placement yet.
            let Some(_quiet) = self.transitions.try_lock(&record.id) else { continue };
            let Some(record) = self.store.get(&record.id)? else { continue };
            if !record.has_no_processes() && !self.substrate.is_alive(&record.id, &record.placement) {
                let span = tracing::info_span!("sandbox", sandbox_id = %record.id);
                async {
                    tracing::warn!("sandbox {} died on its own; cleaning up", record.id);
                    self.end(&record.id, KillReason::Died).await.ok();
                }
                .instrument(span)
                .await;
            }
        }
        Ok(())
    }
}
