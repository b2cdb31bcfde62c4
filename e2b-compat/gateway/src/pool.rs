//! Warm pool: sandboxes booted ahead of demand for one template, so a
//! create only hands one over (token and environment via the agent's
//! `/init`) instead of booting.
//!
//! Pooled sandboxes belong to no user and are not in the database; after a
//! crash, recovery finds them resident but unknown and destroys them.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use copse_jails::{Limits, Placement, SandboxSpec, Substrate};
use tokio::sync::Notify;

/// A booted sandbox that no one has been given yet.
#[derive(Debug)]
pub struct Booted {
    pub id: String,
    pub placement: Placement,
    pub agent_socket: PathBuf,
}

pub struct WarmPool {
    pub template: String,
    target: usize,
    ready: Mutex<VecDeque<Booted>>,
    wanted: Notify,
}

impl WarmPool {
    pub fn new(template: String, target: usize) -> Arc<Self> {
        Arc::new(Self { template, target, ready: Mutex::new(VecDeque::new()), wanted: Notify::new() })
    }

    pub fn take(&self, template: &str) -> Option<Booted> {
        if template != self.template {
            return None;
        }
        let booted = self.lock().pop_front();
        self.wanted.notify_one();
        booted
    }

    /// Keeps the pool at its target size until the task is aborted.
    pub fn spawn_refill(
        self: &Arc<Self>,
        substrate: Arc<dyn Substrate>,
        limits: Limits,
        boot: impl Fn() -> (String, PathBuf) + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let pool = self.clone();
        tokio::spawn(async move {
            loop {
                while pool.lock().len() < pool.target {
                    let (id, agent_socket) = boot();
                    let spec = SandboxSpec { id: id.clone(), template: pool.template.clone(), limits, agent_socket };
                    let substrate = substrate.clone();
                    match tokio::task::spawn_blocking(move || substrate.create(&spec).map(|p| (p, spec))).await {
                        Ok(Ok((placement, spec))) => {
                            pool.lock().push_back(Booted { id, placement, agent_socket: spec.agent_socket })
                        }
                        Ok(Err(e)) => {
                            tracing::error!("warm pool for {}: {e:#}", pool.template);
                            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        }
                        Err(e) => tracing::error!("warm pool task: {e}"),
                    }
                }
                pool.wanted.notified().await;
            }
        })
    }

    /// Everything still waiting in the pool, for destruction on shutdown.
    pub fn drain(&self) -> Vec<Booted> {
        self.lock().drain(..).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Booted>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }
}
