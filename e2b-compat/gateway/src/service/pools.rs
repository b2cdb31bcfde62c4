//! The service's side of the warm pools (`crate::pool`): keeping them
//! filled, handing a pooled sandbox to a create, draining them on shutdown.
//!
//! Pooled sandboxes are booted before anyone asks, under [`POOL_POLICY`]:
//! open egress, which is what a create that asks for nothing gets, so the
//! common hand-out needs no policy change. A caller who asks for another
//! policy gets it applied on hand-out (attach, then update) — but only if
//! nothing of the template runs yet: a template's service started under the
//! pool's policy would have run under a looser one than asked, so such a
//! caller gets a sandbox booted under their policy instead.

use std::sync::Arc;
use std::time::Duration;

use copse_substrate::Policy;

use super::Sandboxes;
use crate::pool::{Booted, WarmPool};
use crate::{services, templates};

/// The policy pooled sandboxes are booted under: what an empty create body
/// asks for.
pub(super) static POOL_POLICY: std::sync::LazyLock<Policy> = std::sync::LazyLock::new(Policy::open);

impl Sandboxes {
    /// Keeps every warm pool filled until [`Self::drain_pools`].
    pub fn spawn_pools(self: &Arc<Self>) -> Vec<tokio::task::JoinHandle<()>> {
        self.pools
            .iter()
            .map(|pool| {
                let (this, pool) = (self.clone(), pool.clone());
                tokio::spawn(async move {
                    // A boot in flight finishes before the task ends, so
                    // the drain on shutdown finds every pooled sandbox.
                    while !pool.is_stopping() {
                        while pool.missing() > 0 {
                            match this.boot(&pool.template, &POOL_POLICY).await {
                                Ok(booted) => pool.put(booted),
                                Err(e) => {
                                    tracing::error!("warm pool for {}: {e:#}", pool.template);
                                    tokio::time::sleep(Duration::from_secs(1)).await;
                                }
                            }
                        }
                        pool.wanted().await;
                    }
                })
            })
            .collect()
    }

    /// (template, ready, target) of each warm pool.
    pub fn pool_status(&self) -> Vec<(String, usize, usize)> {
        self.pools.iter().map(|p| (p.template.clone(), p.ready(), p.target())).collect()
    }

    /// Stops the refill tasks, waits for them, and destroys the pooled
    /// sandboxes no one was given (on shutdown).
    pub async fn drain_pools(&self, refills: Vec<tokio::task::JoinHandle<()>>) {
        for pool in &self.pools {
            pool.stop();
        }
        for refill in refills {
            let _ = refill.await;
        }
        for booted in self.pools.iter().flat_map(|p| p.drain()) {
            self.discard(&booted.id).await;
        }
    }

    /// A pooled sandbox for a caller asking for `policy` that is still
    /// whole (its init alive, its service answering); broken ones are
    /// destroyed on the way. `None` if the template's service would have
    /// run under a policy other than `policy` (see the module header).
    pub(super) async fn take_pooled(&self, template: &str, policy: &Policy) -> Option<Booted> {
        let pool = self.pools.iter().find(|p| p.template == template)?;
        let taken = self.take_from(pool, template, policy).await;
        let m = crate::telemetry::metrics();
        let family = if taken.is_some() { &m.pool_hits } else { &m.pool_misses };
        family.get_or_create(&crate::telemetry::TemplateLabels { template: template.to_string() }).inc();
        taken
    }

    async fn take_from(&self, pool: &WarmPool, template: &str, policy: &Policy) -> Option<Booted> {
        if templates::service(template).is_some() && *policy != *POOL_POLICY {
            return None;
        }
        while let Some(booted) = pool.take() {
            let alive = self.substrate.is_alive(&booted.id, &booted.placement);
            let serving = match templates::service(template) {
                Some(service) => alive && services::is_ready(&booted.agent_socket, &service).await,
                None => alive,
            };
            if serving {
                return Some(booted);
            }
            tracing::warn!("pooled sandbox {} broke while waiting; destroying it", booted.id);
            self.discard(&booted.id).await;
        }
        None
    }
}
