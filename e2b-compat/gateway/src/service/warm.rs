//! Templates whose service is kept warm in a memory snapshot (the code
//! interpreter, its default Python kernel started).
//!
//! Starting the interpreter and its kernel is most of a code-interpreter
//! create (~2 s) when no pooled sandbox is left. Where the substrate keeps
//! memory, the first time a template with a service is asked for (by the
//! warm pool's first refill, or a create), a background task boots one
//! sandbox of it, waits until its service is ready, snapshots it with its
//! memory and removes it (the service must keep out of that snapshot what
//! each sandbox needs its own of, such as a process whose random state
//! cannot be reseeded: the interpreter starts Node.js only after it). Every boot of the template (a create the pool cannot serve, a pool
//! refill) restores that snapshot, its service already running, instead
//! of booting and starting it. Boots that arrive while the snapshot is
//! being taken wait for it rather than start a second interpreter beside
//! it.
//!
//! The warm-up sandbox is nobody's: no token, no environment, no egress (it
//! runs under a deny-all policy, so a restored service never ran under a
//! looser policy than its caller asked for). A restored sandbox gets what a
//! freshly booted one gets: the substrate gives it its own id, hostname,
//! address and policy, the hand-over its own token and environment.
//!
//! Where memory snapshots are missing, or the warm-up fails, the template
//! boots and starts its service at each boot as before, and the log says
//! why once. The snapshot lives while the gateway runs; it is retaken on
//! the next start (a gateway update may bring a new interpreter).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use copse_substrate::{Policy, Support};
use tokio::sync::{mpsc, watch};

use super::Sandboxes;
use super::create::Network;
use crate::model::new_id;
use crate::pool::Booted;
use crate::{agent_link, services, templates};

/// How many times the warm snapshot is tried before the template stays cold.
const DUMP_ATTEMPTS: u32 = 4;
/// How long a boot waits for a warm-up in progress before it boots cold.
const WARM_WAIT: Duration = Duration::from_secs(60);

/// A template's warm snapshot, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Warmth {
    Warming,
    Ready { substrate_template: String, snapshot_key: String },
    Cold,
}

/// A warm-up asked of the warmer: the template, and where to say how it went.
type WarmRequest = (String, watch::Sender<Warmth>);

/// Each template's warmth, and the channel to the task that warms them.
#[derive(Default)]
pub(super) struct Warmer {
    slots: Mutex<HashMap<String, watch::Receiver<Warmth>>>,
    requests: Mutex<Option<mpsc::UnboundedSender<WarmRequest>>>,
}

/// The snapshot key of `template`'s warm image: one per template, so a
/// start finds (and replaces) the one a previous run left.
fn warm_key(template: &str) -> String {
    format!("warm-{template}")
}

impl Sandboxes {
    /// The task that takes warm snapshots when a boot first asks for one;
    /// without it (unit tests) every boot is cold.
    pub fn spawn_warmer(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let (tx, mut rx) = mpsc::unbounded_channel::<WarmRequest>();
        *self.warmer.requests.lock().expect("warmer lock") = Some(tx);
        let this = self.clone();
        tokio::spawn(async move {
            while let Some((template, slot)) = rx.recv().await {
                let warmth = this.warm_up(&template).await;
                slot.send_replace(warmth);
            }
        })
    }

    /// Lets a warm-up in progress finish (so its sandbox is removed), then
    /// deletes the warm snapshots (on shutdown).
    pub async fn stop_warmer(&self, warmer: tokio::task::JoinHandle<()>) {
        self.warmer.requests.lock().expect("warmer lock").take();
        let _ = warmer.await;
        let slots: Vec<(String, watch::Receiver<Warmth>)> =
            self.warmer.slots.lock().expect("warmer lock").drain().collect();
        for (template, slot) in slots {
            let warmth = slot.borrow().clone();
            if let Warmth::Ready { snapshot_key, .. } = warmth
                && let Err(e) = self.blocking(move |s| s.delete_snapshot(&snapshot_key)).await
            {
                tracing::warn!("deleting the warm snapshot of {template}: {e}");
            }
        }
    }

    /// `template`'s warm snapshot, after waiting for it if it is being
    /// taken; the first call for a template with a service asks the warmer
    /// to take it (and waits too: a boot beside the warm-up would start a
    /// second interpreter for nothing).
    async fn warmth(&self, template: &str) -> Option<(String, String)> {
        templates::service(template)?;
        let mut slot = {
            let mut slots = self.warmer.slots.lock().expect("warmer lock");
            match slots.get(template) {
                Some(slot) => slot.clone(),
                None => {
                    let requests = self.warmer.requests.lock().expect("warmer lock");
                    let (tx, rx) = watch::channel(Warmth::Warming);
                    let sent = requests.as_ref().is_some_and(|r| r.send((template.to_string(), tx)).is_ok());
                    if !sent {
                        return None;
                    }
                    slots.insert(template.to_string(), rx.clone());
                    rx
                }
            }
        };
        let settled = tokio::time::timeout(WARM_WAIT, slot.wait_for(|w| *w != Warmth::Warming)).await;
        match settled {
            Ok(Ok(warmth)) => match &*warmth {
                Warmth::Ready { substrate_template, snapshot_key } => {
                    Some((substrate_template.clone(), snapshot_key.clone()))
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// A new sandbox of `template` on `network`, its service running:
    /// restored from the warm snapshot where there is one, else booted and
    /// the service started. A restore that fails falls back to a boot.
    pub(super) async fn boot_warm_or_cold(&self, template: &str, policy: &Policy) -> crate::model::Result<Booted> {
        if let Some((substrate_template, key)) = self.warmth(template).await {
            let network = Network::New(policy.clone());
            match self.boot_from(new_id(), &substrate_template, Some(key), network, true, &[]).await {
                Ok(booted) => return Ok(booted),
                Err(e) => tracing::warn!("restoring the warm {template}: {e}; booting it instead"),
            }
        }
        self.boot_from(new_id(), template, None, Network::New(policy.clone()), false, &[]).await
    }

    /// Boots a sandbox of `template`, waits until its service is ready,
    /// snapshots it with its memory, removes it.
    async fn warm_up(&self, template: &str) -> Warmth {
        let support = self.substrate.capabilities_for(template).memory_snapshots;
        if !support.is_yes() {
            let why = match support {
                Support::Missing(why) => why,
                _ => format!("the {} substrate has no memory snapshots", self.substrate.name()),
            };
            tracing::info!("{template} starts its service at each create (no warm snapshot): {why}");
            return Warmth::Cold;
        }
        let started = Instant::now();
        match self.take_warm(template).await {
            Ok((substrate_template, snapshot_key)) => {
                tracing::info!(
                    "{template} is warm after {:.1?}: creates restore its running service",
                    started.elapsed()
                );
                Warmth::Ready { substrate_template, snapshot_key }
            }
            Err(e) => {
                tracing::warn!("{template} starts its service at each create: its warm snapshot failed: {e:#}");
                Warmth::Cold
            }
        }
    }

    async fn take_warm(&self, template: &str) -> anyhow::Result<(String, String)> {
        let service = templates::service(template).ok_or_else(|| anyhow::anyhow!("{template} has no service"))?;
        let key = warm_key(template);
        let stale = key.clone();
        // A previous run's (gone already if it ended cleanly).
        let _ = self.blocking(move |s| s.delete_snapshot(&stale)).await;
        let sealed = Policy::from_e2b(Some(false), &[], &[], Some(&[])).map_err(|e| anyhow::anyhow!("{e}"))?;
        let id = new_id();
        let booted = self.boot_from(id.clone(), template, None, Network::New(sealed), false, &[]).await?;
        let taken = async {
            services::wait_ready(&booted.agent_socket, &service).await?;
            let _quiet = agent_link::quiesce(&booted.agent_socket).await;
            let mut attempt = 1;
            loop {
                let (id, key) = (id.clone(), key.clone());
                let started = Instant::now();
                let taken = self.blocking(move |s| s.snapshot(&id, &key, true)).await;
                self.observe_checkpoint(false, taken.is_ok(), started.elapsed());
                match taken {
                    Ok(info) => break Ok::<_, anyhow::Error>(info),
                    // CRIU now and then finds a socket mid-close; a moment
                    // later it does not.
                    Err(e) if attempt < DUMP_ATTEMPTS => {
                        tracing::info!("the warm snapshot of {template} is retried after: {e}");
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    Err(e) => break Err(e.into()),
                }
            }
        }
        .await;
        self.discard(&id).await;
        let info = taken?;
        anyhow::ensure!(info.memory, "the substrate kept no memory");
        Ok((info.template, key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warm_snapshot_per_template() {
        assert_eq!(warm_key(templates::CODE_INTERPRETER), "warm-code-interpreter-v1");
        copse_substrate::template::validate_name(&warm_key(templates::CODE_INTERPRETER)).unwrap();
    }
}
