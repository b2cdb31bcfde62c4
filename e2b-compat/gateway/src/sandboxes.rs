//! The sandbox service: create, find, expire and destroy sandboxes, keeping
//! SQLite and the substrate in step. Knows nothing of HTTP shapes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use copse_substrate::{Limits, Placement, Policy, SandboxNetwork, SandboxSpec, Substrate};
use rand::Rng;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::agent_link;
use crate::network::{Addresses, NetworkRequest};
use crate::pool::{Booted, WarmPool};
use crate::store::Store;
use crate::{services, templates};

/// The envd version copse's agent implements (every SDK feature gate on).
pub const ENVD_VERSION: &str = "0.6.4";
pub const DEFAULT_TIMEOUT_S: i64 = 300;
/// E2B's ceiling for a sandbox's lifetime on its largest plan.
pub const MAX_TIMEOUT_S: i64 = 24 * 3600;
/// Allowed host names are re-resolved every minute (600 reaper ticks).
const HOST_REFRESH_TICKS: u64 = 600;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("template '{name}' not found; available templates: {available}")]
    UnknownTemplate { name: String, available: String },
    #[error("{0}")]
    Invalid(String),
    /// The sandbox is not in a state that allows the operation (E2B's 409).
    #[error("{0}")]
    Conflict(String),
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    /// This host lacks something the operation needs (E2B's 503); the
    /// message says what and how to install it.
    #[error("{0}")]
    Unavailable(String),
    /// The substrate refused, saying why (a missing sandbox, snapshot or
    /// template; an operation this kind of sandbox lacks; bad input);
    /// `api::error` maps its kind to E2B's status.
    #[error(transparent)]
    Substrate(copse_substrate::SubstrateError),
    #[error(transparent)]
    Internal(anyhow::Error),
}

impl From<anyhow::Error> for SandboxError {
    /// A substrate's typed refusal keeps its kind (anywhere in the chain
    /// of causes); anything else is a fault.
    fn from(err: anyhow::Error) -> Self {
        match copse_substrate::SubstrateError::find(&err) {
            Some(copse_substrate::SubstrateError::Unavailable(what)) => SandboxError::Unavailable(what.clone()),
            Some(refusal) => SandboxError::Substrate(refusal.clone()),
            None => SandboxError::Internal(err),
        }
    }
}

pub type Result<T> = std::result::Result<T, SandboxError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Running,
    Paused,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    pub template: String,
    pub access_token: String,
    pub metadata: HashMap<String, String>,
    pub env_vars: HashMap<String, String>,
    pub limits: Limits,
    pub started_at_ms: i64,
    pub end_at_ms: i64,
    pub state: State,
    pub allow_internet_access: bool,
    pub auto_pause: bool,
    /// Whether an automatic pause keeps memory (E2B's `autoPauseMemory`).
    #[serde(default = "yes")]
    pub auto_pause_memory: bool,
    /// Whether traffic to the paused sandbox resumes it.
    #[serde(default)]
    pub auto_resume: bool,
    #[serde(default)]
    pub paused: Option<Paused>,
    pub placement: Placement,
    pub agent_socket: PathBuf,
    /// Address and current egress policy; `None` without a sandbox network.
    /// Kept while paused, so a resumed sandbox has the same address.
    #[serde(default)]
    pub network: Option<SandboxNetwork>,
}

/// How a paused sandbox is held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Paused {
    /// Lifetime left when it was paused; the clock stops while paused.
    pub remaining_ms: i64,
    /// `None`: its processes are frozen in place, memory kept. `Some(key)`:
    /// it was paused without memory; its processes are gone and its files
    /// wait in the substrate snapshot `key` until it is resumed.
    pub files_only: Option<String>,
}

fn yes() -> bool {
    true
}

/// A snapshot as the API knows it: the public id and names the SDK sees,
/// and the substrate's own key for its files.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: String,
    pub names: Vec<String>,
    pub key: String,
    pub template: String,
    pub source_sandbox: String,
    pub created_at_ms: i64,
    pub size_bytes: u64,
    /// It holds memory and processes ("full" in E2B's terms).
    #[serde(default)]
    pub memory: bool,
    /// The access token the checkpointed agent demands, so a sandbox
    /// restored from it can be handed its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_token: Option<String>,
}

#[derive(Debug, Default)]
pub struct CreateRequest {
    pub template: String,
    pub timeout_s: Option<i64>,
    pub metadata: HashMap<String, String>,
    pub env_vars: HashMap<String, String>,
    pub network: NetworkRequest,
    pub auto_pause: bool,
    pub auto_pause_memory: bool,
    pub auto_resume: bool,
}

#[derive(Debug, Default)]
pub struct ListFilter {
    pub metadata: HashMap<String, String>,
    pub states: Vec<State>,
    pub template: Option<String>,
}

pub struct Sandboxes {
    pub(crate) substrate: Arc<dyn Substrate>,
    pub(crate) store: Store,
    run_dir: PathBuf,
    pub(crate) limits: Limits,
    pools: Vec<Arc<WarmPool>>,
    /// Last (time, cpu ns) per sandbox, to turn CPU time into a percentage.
    cpu_samples: Mutex<HashMap<String, (Instant, u64)>>,
    /// One state change (pause, resume, rollback) at a time per sandbox.
    pub(crate) transitions: crate::lifecycle::Transitions,
    pub(crate) addresses: Addresses,
}

impl Sandboxes {
    /// `pools`: (template, size) pairs of sandboxes to keep booted ahead.
    pub fn new(substrate: Arc<dyn Substrate>, store: Store, run_dir: PathBuf, pools: &[(String, usize)]) -> Self {
        Self {
            substrate,
            store,
            run_dir,
            limits: Limits::default(),
            pools: pools
                .iter()
                .filter(|(_, size)| *size > 0)
                .map(|(t, size)| WarmPool::new(t.clone(), *size))
                .collect(),
            cpu_samples: Mutex::new(HashMap::new()),
            transitions: Default::default(),
            addresses: Addresses::new(None),
        }
    }

    /// Sandboxes get an address on `network` (and pooled ones an open policy
    /// until hand-out).
    pub fn with_network(mut self, network: Option<&copse_substrate::NetConfig>) -> Self {
        self.addresses = Addresses::new(network);
        self
    }

    pub fn substrate(&self) -> &Arc<dyn Substrate> {
        &self.substrate
    }

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

    /// Re-adopt what survived a gateway restart; destroy the rest.
    pub async fn recover(&self) -> anyhow::Result<copse_substrate::Recovery> {
        let records = self.store.all()?;
        // A sandbox paused without memory has no processes to find; its
        // files live in a snapshot, reconciled below.
        let known: Vec<(String, Placement)> =
            records.iter().filter(|r| !r.has_no_processes()).map(|r| (r.id.clone(), r.placement.clone())).collect();
        let substrate = self.substrate.clone();
        let recovery = tokio::task::spawn_blocking(move || substrate.recover(&known)).await??;
        for id in &recovery.removed {
            self.store.remove(id)?;
        }
        // Sandboxes paused without memory have no interface now but keep
        // their address for when they resume.
        for record in records.iter().filter(|r| recovery.adopted.contains(&r.id) || r.has_no_processes()) {
            if let Some(network) = &record.network {
                self.addresses.hold(&record.id, network.address);
            }
        }
        let attached: Vec<(String, SandboxNetwork)> = records
            .into_iter()
            .filter(|r| recovery.adopted.contains(&r.id))
            .filter_map(|r| Some((r.id, r.network?)))
            .collect();
        let substrate = self.substrate.clone();
        tokio::task::spawn_blocking(move || substrate.recover_network(&attached)).await??;
        self.reconcile_snapshots().await?;
        Ok(recovery)
    }

    pub async fn create(&self, request: CreateRequest) -> Result<(SandboxRecord, Timings)> {
        let timeout = validate_timeout(request.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S))?;
        let policy = request.network.policy()?;
        let started = Instant::now();
        let mut template = request.template.clone();
        let mut agent_token = None;
        let booted = if let Some(snapshot) = self.store.snapshot(&request.template)? {
            template = snapshot.template.clone();
            agent_token = snapshot.agent_token.clone();
            self.boot_from(new_id(), &snapshot.template, Some(snapshot.key), None, snapshot.memory).await?
        } else {
            match self.take_pooled(&request.template).await {
                Some(booted) => booted,
                None => self.boot(&request.template).await?,
            }
        };
        let boot = started.elapsed();
        let Booted { id, placement, agent_socket, network } = booted;
        let network = match self.with_policy(&id, network, &policy).await {
            Ok(network) => network,
            Err(e) => {
                self.discard(&id).await;
                return Err(e);
            }
        };
        let now = now_ms();
        let record = SandboxRecord {
            id,
            template,
            access_token: new_token(),
            metadata: request.metadata,
            env_vars: request.env_vars,
            limits: self.limits,
            started_at_ms: now,
            end_at_ms: now + timeout * 1000,
            state: State::Running,
            allow_internet_access: policy.internet_access(),
            auto_pause: request.auto_pause,
            auto_pause_memory: request.auto_pause_memory,
            auto_resume: request.auto_resume,
            paused: None,
            placement,
            agent_socket,
            network,
        };
        if let Err(e) = self.hand_over(&record, agent_token.as_deref()).await {
            self.discard(&record.id).await;
            return Err(e.into());
        }
        Ok((record, Timings { boot, handover: started.elapsed() - boot }))
    }

    /// A pooled sandbox that is still whole (its init alive, its service
    /// answering); broken ones are destroyed on the way.
    async fn take_pooled(&self, template: &str) -> Option<Booted> {
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

    async fn boot(&self, template: &str) -> Result<Booted> {
        self.check_template(template).await?;
        self.boot_from(new_id(), template, None, None, false).await
    }

    /// Booted sandboxes (pooled ones included) start with an open policy;
    /// this applies the caller's before the sandbox is handed out.
    pub(crate) async fn with_policy(
        &self,
        id: &str,
        network: Option<SandboxNetwork>,
        policy: &Policy,
    ) -> Result<Option<SandboxNetwork>> {
        match network {
            Some(network) if &network.policy != policy => {
                self.apply_policy(id, policy).await?;
                Ok(Some(SandboxNetwork { policy: policy.clone(), ..network }))
            }
            other => Ok(other),
        }
    }

    /// The spec of sandbox `id`; `snapshot` is a substrate snapshot key.
    pub(crate) fn spec(
        &self,
        id: &str,
        template: &str,
        snapshot: Option<String>,
        network: Option<SandboxNetwork>,
    ) -> SandboxSpec {
        SandboxSpec {
            id: id.to_string(),
            template: template.to_string(),
            limits: self.limits,
            agent_socket: socket_path(&self.run_dir, id),
            snapshot,
            network,
        }
    }

    /// Boots sandbox `id` (from a snapshot's files if given) and starts its
    /// template's service; on failure nothing of it is left. `network`: the
    /// address (and policy) it keeps; without one it gets a new address and
    /// an open policy. `restored`: the snapshot holds memory, so its
    /// processes (the service among them) are restored, not started.
    pub(crate) async fn boot_from(
        &self,
        id: String,
        template: &str,
        snapshot: Option<String>,
        network: Option<SandboxNetwork>,
        restored: bool,
    ) -> Result<Booted> {
        let allocated = network.is_none();
        let network = match network {
            Some(network) => Some(network),
            None => self.addresses.take(&id)?.map(|address| SandboxNetwork { address, policy: Policy::open() }),
        };
        let release = |id: &str| {
            if allocated {
                self.addresses.release(id)
            }
        };
        let spec = self.spec(&id, template, snapshot, network);
        let substrate = self.substrate.clone();
        let created = tokio::task::spawn_blocking(move || substrate.create(&spec).map(|p| (p, spec)))
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r);
        let (placement, spec) = created.inspect_err(|_| release(&id))?;
        let booted = Booted { id, placement, agent_socket: spec.agent_socket, network: spec.network };
        if let Err(e) = self.start_service(template, &booted.agent_socket, restored).await {
            self.destroy_quietly(&booted.id).await;
            release(&booted.id);
            return Err(e.into());
        }
        Ok(booted)
    }

    /// Starts the template's long-running service (the code interpreter),
    /// if it has one, and waits until it answers; `restored`: it already
    /// runs (restored from memory), only wait.
    pub(crate) async fn start_service(
        &self,
        template: &str,
        agent_socket: &std::path::Path,
        restored: bool,
    ) -> anyhow::Result<()> {
        let Some(service) = templates::service(template) else { return Ok(()) };
        let started = if restored {
            services::wait_ready(agent_socket, &service).await
        } else {
            services::start(agent_socket, &service).await
        };
        started.map_err(|e| e.context(format!("starting the {template} service")))
    }

    /// Tells the agent who its user is: the token it must demand and the
    /// environment every process gets; then makes the sandbox durable.
    /// `agent_token`: the token the agent demands now (one restored from a
    /// memory snapshot still has its source's).
    pub(crate) async fn hand_over(&self, record: &SandboxRecord, agent_token: Option<&str>) -> anyhow::Result<()> {
        let init = serde_json::json!({ "accessToken": record.access_token, "envVars": record.env_vars });
        agent_link::post_json(&record.agent_socket, "/init", &init, agent_token).await?;
        self.store.put(record)
    }

    async fn check_template(&self, name: &str) -> Result<()> {
        let substrate = self.substrate.clone();
        let templates =
            tokio::task::spawn_blocking(move || substrate.templates()).await.map_err(anyhow::Error::from)??;
        if templates.iter().any(|t| t.name == name) {
            return Ok(());
        }
        let available: Vec<String> = templates.into_iter().map(|t| t.name).collect();
        Err(SandboxError::UnknownTemplate { name: name.to_string(), available: available.join(", ") })
    }

    pub fn get(&self, id: &str) -> Result<SandboxRecord> {
        self.store.get(id)?.ok_or_else(|| SandboxError::NotFound(id.to_string()))
    }

    pub fn list(&self, filter: &ListFilter) -> Result<Vec<SandboxRecord>> {
        let mut records: Vec<SandboxRecord> = self
            .store
            .all()?
            .into_iter()
            .filter(|r| filter.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
            .filter(|r| filter.states.is_empty() || filter.states.contains(&r.state))
            .filter(|r| filter.template.as_ref().is_none_or(|t| &r.template == t))
            .collect();
        records.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        Ok(records)
    }

    /// Sets the sandbox to expire `timeout_s` from now.
    pub fn set_timeout(&self, id: &str, timeout_s: i64) -> Result<SandboxRecord> {
        let timeout = validate_timeout(timeout_s)?;
        let mut record = self.get(id)?;
        match &mut record.paused {
            // Paused, the clock is stopped; the new lifetime starts at resume.
            Some(paused) => paused.remaining_ms = timeout * 1000,
            None => record.end_at_ms = now_ms() + timeout * 1000,
        }
        self.store.put(&record)?;
        Ok(record)
    }

    /// Connecting never shortens a running sandbox's life, only extends it.
    pub fn extend(&self, id: &str, timeout_s: Option<i64>) -> Result<SandboxRecord> {
        let mut record = self.get(id)?;
        if record.paused.is_some() {
            return Ok(record);
        }
        if let Some(timeout) = timeout_s {
            let end = now_ms() + validate_timeout(timeout)? * 1000;
            if end > record.end_at_ms {
                record.end_at_ms = end;
                self.store.put(&record)?;
            }
        }
        Ok(record)
    }

    pub async fn kill(&self, id: &str) -> Result<()> {
        let Some(record) = self.store.get(id)? else {
            return Err(SandboxError::NotFound(id.to_string()));
        };
        let substrate = self.substrate.clone();
        let owned = id.to_string();
        let files = record.paused.and_then(|p| p.files_only);
        tokio::task::spawn_blocking(move || {
            substrate.destroy(&owned)?;
            match files {
                Some(key) => substrate.delete_snapshot(&key),
                None => Ok(()),
            }
        })
        .await
        .map_err(anyhow::Error::from)??;
        self.addresses.release(id);
        self.store.remove(id)?;
        self.cpu_samples.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        self.transitions.forget(id);
        Ok(())
    }

    /// Destroys a sandbox that never reached its caller and frees its
    /// address.
    pub(crate) async fn discard(&self, id: &str) {
        self.destroy_quietly(id).await;
        self.addresses.release(id);
    }

    /// Destroys a sandbox, logging failure; its address stays with it (a
    /// sandbox paused without memory keeps its address).
    pub(crate) async fn destroy_quietly(&self, id: &str) {
        let substrate = self.substrate.clone();
        let owned = id.to_string();
        if let Ok(Err(e)) = tokio::task::spawn_blocking(move || substrate.destroy(&owned)).await {
            tracing::error!("destroying sandbox {id}: {e:#}");
        }
    }

    /// Replaces the sandbox's egress policy (E2B's `update_network`). A
    /// sandbox paused without memory gets it when it resumes.
    pub async fn update_network(&self, id: &str, request: NetworkRequest) -> Result<SandboxRecord> {
        let policy = request.policy()?;
        let mut record = self.get(id)?;
        let attached = !record.has_no_processes();
        // Without a network the sandbox has no egress at all, which every
        // policy admits; the policy is kept for when it is asked about.
        if let Some(network) = record.network.as_mut() {
            if attached {
                self.apply_policy(id, &policy).await?;
            }
            network.policy = policy.clone();
        }
        record.allow_internet_access = policy.internet_access();
        self.store.put(&record)?;
        Ok(record)
    }

    pub(crate) async fn apply_policy(&self, id: &str, policy: &Policy) -> Result<()> {
        let (substrate, owned, policy) = (self.substrate.clone(), id.to_string(), policy.clone());
        tokio::task::spawn_blocking(move || substrate.update_network(&owned, &policy))
            .await
            .map_err(anyhow::Error::from)??;
        Ok(())
    }

    /// Re-applies policies that name hosts, so their addresses follow DNS.
    pub async fn refresh_host_names(&self) -> anyhow::Result<()> {
        for record in self.store.all()?.into_iter().filter(|r| !r.has_no_processes()) {
            if let Some(network) = record.network.as_ref().filter(|n| n.policy.has_hosts())
                && let Err(e) = self.apply_policy(&record.id, &network.policy).await
            {
                tracing::warn!("refreshing the host names of {}: {e:#}", record.id);
            }
        }
        Ok(())
    }

    /// Resource use now; `None` for a sandbox paused without memory, which
    /// has nothing running to measure.
    pub async fn metrics(&self, id: &str) -> Result<Option<Metric>> {
        let record = self.get(id)?;
        if record.has_no_processes() {
            return Ok(None);
        }
        let substrate = self.substrate.clone();
        let owned = id.to_string();
        let usage =
            tokio::task::spawn_blocking(move || substrate.usage(&owned)).await.map_err(anyhow::Error::from)??;
        let now = Instant::now();
        let previous =
            self.cpu_samples.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_string(), (now, usage.cpu_ns));
        let (cpu_before, wall) = match previous {
            Some((at, cpu)) => (cpu, now.duration_since(at)),
            None => (0, Duration::from_millis((now_ms() - record.started_at_ms).max(1) as u64)),
        };
        let cores = f64::from(record.limits.cpu_count.max(1));
        let cpu_pct = (usage.cpu_ns.saturating_sub(cpu_before) as f64 / wall.as_nanos().max(1) as f64) * 100.0 / cores;
        Ok(Some(Metric {
            cpu_count: record.limits.cpu_count,
            cpu_used_pct: (cpu_pct * 100.0).round() / 100.0,
            mem_used: usage.memory_bytes,
            mem_total: record.limits.memory_mb * 1024 * 1024,
            mem_cache: usage.memory_cache_bytes,
            disk_used: usage.disk_bytes,
            disk_total: record.limits.disk_mb * 1024 * 1024,
        }))
    }

    /// Kills (or, if asked at create, pauses) expired sandboxes.
    pub async fn reap(&self) -> anyhow::Result<()> {
        for id in self.store.expired(now_ms())? {
            let auto_pause = self.store.get(&id)?.map(|r| (r.auto_pause, r.auto_pause_memory));
            let outcome = match auto_pause {
                Some((true, memory)) => {
                    tracing::info!("sandbox {id} timed out; pausing it");
                    self.pause(&id, memory).await
                }
                _ => {
                    tracing::info!("sandbox {id} timed out");
                    self.kill(&id).await
                }
            };
            if let Err(e) = outcome {
                tracing::error!("expiring sandbox {id}: {e:#}");
                if auto_pause.is_some_and(|(pause, _)| pause) {
                    self.kill(&id).await.ok();
                }
            }
        }
        Ok(())
    }

    /// Forgets sandboxes whose init died on its own.
    pub async fn reap_dead(&self) -> anyhow::Result<()> {
        for record in self.store.all()? {
            // A rollback or restart in progress has no live placement yet.
            let Some(_quiet) = self.transitions.try_lock(&record.id) else { continue };
            let Some(record) = self.store.get(&record.id)? else { continue };
            if !record.has_no_processes() && !self.substrate.is_alive(&record.id, &record.placement) {
                tracing::warn!("sandbox {} died on its own; cleaning up", record.id);
                self.kill(&record.id).await.ok();
            }
        }
        Ok(())
    }

    pub fn spawn_reaper(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = 0u64;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if let Err(e) = this.reap().await {
                    tracing::error!("reaper: {e:#}");
                }
                tick += 1;
                if tick.is_multiple_of(20)
                    && let Err(e) = this.reap_dead().await
                {
                    tracing::error!("reaper: {e:#}");
                }
                if tick.is_multiple_of(HOST_REFRESH_TICKS)
                    && let Err(e) = this.refresh_host_names().await
                {
                    tracing::error!("host name refresh: {e:#}");
                }
            }
        })
    }
}

impl SandboxRecord {
    /// Paused without memory: nothing of it runs on the host.
    pub fn has_no_processes(&self) -> bool {
        self.paused.as_ref().is_some_and(|p| p.files_only.is_some())
    }
}

/// Where a create spent its time, for the `Server-Timing` header.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    /// Booting a sandbox (near zero when the warm pool had one).
    pub boot: Duration,
    /// Handing it to the caller: the agent's `/init` and the database row.
    pub handover: Duration,
}

#[derive(Debug, Clone, Copy)]
pub struct Metric {
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

pub(crate) fn validate_timeout(timeout_s: i64) -> Result<i64> {
    if !(0..=MAX_TIMEOUT_S).contains(&timeout_s) {
        return Err(SandboxError::Invalid(format!(
            "timeout must be between 0 and {MAX_TIMEOUT_S} seconds, got {timeout_s}"
        )));
    }
    Ok(timeout_s)
}

fn socket_path(run_dir: &std::path::Path, id: &str) -> PathBuf {
    run_dir.join(format!("{id}.sock"))
}

pub fn now_ms() -> i64 {
    (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

/// Ids look like E2B's: 20 lowercase letters and digits.
pub(crate) fn new_id() -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..20).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

pub(crate) fn new_token() -> String {
    let bytes: [u8; 24] = rand::rng().random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_e2b_shaped_and_distinct() {
        let a = new_id();
        assert_eq!(a.len(), 20);
        assert!(a.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()));
        assert_ne!(a, new_id());
    }

    #[test]
    fn timeouts_outside_the_allowed_range_are_refused() {
        assert!(validate_timeout(-1).is_err());
        assert!(validate_timeout(MAX_TIMEOUT_S + 1).is_err());
        assert_eq!(validate_timeout(30).unwrap(), 30);
    }
}
