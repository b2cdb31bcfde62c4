//! Warm pools: sandboxes booted ahead of demand for one template, so a
//! create only hands one over (token and environment via the agent's
//! `/init`) instead of booting — and, for templates with a service such as
//! the code interpreter, instead of waiting for it to start.
//!
//! Pooled sandboxes belong to no user and are not in the database; after a
//! crash, recovery finds them resident but unknown and destroys them.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use copse_substrate::Placement;
use tokio::sync::Notify;

/// A booted sandbox that no one has been given yet.
#[derive(Debug)]
pub struct Booted {
    pub id: String,
    pub placement: Placement,
    pub agent_socket: PathBuf,
    pub network: Option<copse_substrate::SandboxNetwork>,
    /// Where its boot's time went.
    pub phases: copse_substrate::Phases,
}

pub struct WarmPool {
    pub template: String,
    target: usize,
    ready: Mutex<VecDeque<Booted>>,
    wanted: Notify,
    stopping: std::sync::atomic::AtomicBool,
}

impl WarmPool {
    pub fn new(template: String, target: usize) -> Arc<Self> {
        Arc::new(Self {
            template,
            target,
            ready: Mutex::new(VecDeque::new()),
            wanted: Notify::new(),
            stopping: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn take(&self) -> Option<Booted> {
        let booted = self.lock().pop_front();
        self.wanted.notify_one();
        booted
    }

    pub fn put(&self, booted: Booted) {
        self.lock().push_back(booted);
    }

    pub fn ready(&self) -> usize {
        self.lock().len()
    }

    pub fn target(&self) -> usize {
        self.target
    }

    /// How many sandboxes the pool lacks (none once it is stopping).
    pub fn missing(&self) -> usize {
        if self.is_stopping() { 0 } else { self.target.saturating_sub(self.lock().len()) }
    }

    /// Asks the refill task to finish the boot in flight and end.
    pub fn stop(&self) {
        self.stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        self.wanted.notify_one();
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until a sandbox is taken.
    pub async fn wanted(&self) {
        self.wanted.notified().await;
    }

    /// Everything still waiting in the pool, for destruction on shutdown.
    pub fn drain(&self) -> Vec<Booted> {
        self.lock().drain(..).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Booted>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Parses `--pool` values: `TEMPLATE=N`, or a bare `N` for `base`.
pub fn parse_pool_arg(arg: &str) -> Result<(String, usize), String> {
    let (template, size) = arg.split_once('=').unwrap_or(("base", arg));
    let size = size.trim().parse().map_err(|_| format!("pool size in {arg:?} is not a number"))?;
    if template.is_empty() {
        return Err(format!("pool {arg:?} names no template"));
    }
    Ok((template.to_string(), size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_arguments_name_a_template_or_default_to_base() {
        assert_eq!(parse_pool_arg("3"), Ok(("base".into(), 3)));
        assert_eq!(parse_pool_arg("code-interpreter-v1=2"), Ok(("code-interpreter-v1".into(), 2)));
        assert!(parse_pool_arg("base=x").is_err());
        assert!(parse_pool_arg("=2").is_err());
    }

    #[test]
    fn taking_makes_room_for_a_refill() {
        let pool = WarmPool::new("base".into(), 2);
        assert_eq!(pool.missing(), 2);
        pool.put(Booted {
            network: None,
            id: "a".into(),
            placement: Placement { init_pid: 1, init_start: 1 },
            agent_socket: "/x".into(),
            phases: Default::default(),
        });
        assert_eq!(pool.missing(), 1);
        assert_eq!(pool.take().map(|b| b.id), Some("a".into()));
        assert!(pool.take().is_none());
    }
}
