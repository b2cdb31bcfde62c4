//! Detaches removed in the background, in batches.
//!
//! An `nft` transaction that deletes objects returns only after an RCU
//! grace period (the kernel frees them before the netlink socket's close
//! completes), 10–20 ms here; on a kill's critical path, and once per kill
//! in a round of kills. Queued, a round's detaches share one transaction
//! and one grace period, and nobody waits for them, except a change that
//! must come after them: an attach reusing an id (rollbacks) or an address,
//! or a rewrite of the whole table.
//!
//! The worker also deletes each host veth: the kernel would delete it with
//! its sandbox's namespace, but tears namespaces down in a shared work
//! queue that, on a loaded host, lags seconds behind the kill.

use std::sync::{Arc, Condvar, Mutex};

use crate::linux::host_network::delete_link;
use crate::linux::tools::nft_apply;
use crate::linux::{netlink, nft};
use crate::net::{Attachment, NetConfig};

#[derive(Default)]
struct Queue {
    /// Waiting for the worker.
    waiting: Vec<Attachment>,
    /// Being removed by the worker now.
    removing: Vec<Attachment>,
}

pub struct Janitor {
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl Janitor {
    /// Starts the worker thread, which lives as long as the process.
    pub fn start(cfg: NetConfig) -> anyhow::Result<Arc<Self>> {
        let janitor = Arc::new(Self { queue: Mutex::new(Queue::default()), changed: Condvar::new() });
        let worker = janitor.clone();
        std::thread::Builder::new().name("cubenet-detach".into()).spawn(move || worker.run(&cfg))?;
        Ok(janitor)
    }

    pub fn push(&self, attachment: Attachment) {
        self.lock().waiting.push(attachment);
        self.changed.notify_all();
    }

    /// Returns once no queued detach concerns `id` or `attachment`'s address.
    pub fn wait_for(&self, attachment: &Attachment) {
        let clashes = |a: &Attachment| a.id == attachment.id || a.address == attachment.address;
        let mut queue = self.lock();
        while queue.waiting.iter().chain(&queue.removing).any(clashes) {
            queue = self.changed.wait(queue).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Returns once every queued detach is done.
    pub fn wait_all(&self) {
        let mut queue = self.lock();
        while !(queue.waiting.is_empty() && queue.removing.is_empty()) {
            queue = self.changed.wait(queue).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn run(&self, cfg: &NetConfig) {
        loop {
            let batch = {
                let mut queue = self.lock();
                while queue.waiting.is_empty() {
                    queue = self.changed.wait(queue).unwrap_or_else(|p| p.into_inner());
                }
                let batch = std::mem::take(&mut queue.waiting);
                queue.removing.clone_from(&batch);
                batch
            };
            let script: String = batch.iter().map(|a| nft::detach(cfg, a)).collect();
            if let Err(e) = nft_apply(&script) {
                // Something of it was already gone, which fails the whole
                // transaction: remove what is left, object by object.
                tracing::warn!(
                    "detaching {} sandbox(es) in one transaction failed ({e:#}); retrying each",
                    batch.len()
                );
                for line in script.lines() {
                    let _ = nft_apply(line);
                }
            }
            for attachment in &batch {
                // Losing the race with the kernel's own deletion is fine.
                if let Err(e) = delete_link(&attachment.host_if)
                    && netlink::index_of(&attachment.host_if).is_ok()
                {
                    tracing::warn!("deleting veth {}: {e:#}", attachment.host_if);
                }
            }
            self.lock().removing.clear();
            self.changed.notify_all();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}
