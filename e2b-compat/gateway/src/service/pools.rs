//! The service's side of the warm pools (`crate::pool`): keeping them
//! filled, handing a pooled sandbox to a create, draining them on shutdown.

use std::sync::Arc;
use std::time::Duration;

use super::Sandboxes;
use crate::pool::Booted;
use crate::{services, templates};

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
                            match this.boot(&pool.template).await {
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

    /// A pooled sandbox that is still whole (its init alive, its service
    /// answering); broken ones are destroyed on the way.
    pub(super) async fn take_pooled(&self, template: &str) -> Option<Booted> {
        let pool = self.pools.iter().find(|p| p.template == template)?;
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
