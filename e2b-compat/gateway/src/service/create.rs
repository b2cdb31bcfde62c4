//! Creating a sandbox: from a snapshot, from a warm pool, or booted for
//! the caller; then the hand-over to the agent (its token and environment)
//! that makes the sandbox theirs.
//!
//! The caller's egress policy is part of the boot: the substrate attaches
//! the sandbox's network under it in one step, before any process of the
//! sandbox (the template's service among them) starts. Only a pooled
//! sandbox, booted before anyone asked, gets its policy afterwards — and
//! one whose service already runs goes only to a caller who asked for the
//! policy it was booted under (see `pools.rs`).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use copse_substrate::{Phases, Policy, SandboxNetwork};
use tracing::Instrument;

use super::Sandboxes;
use super::quota::Kind;
use crate::model::{
    Caller, DEFAULT_TIMEOUT_S, Image, Result, SandboxError, SandboxRecord, State, VolumeMount, new_id, new_token,
    now_ms, validate_timeout,
};
use crate::network::NetworkRequest;
use crate::pool::Booted;
use crate::telemetry::Source;
use crate::{agent_link, services, templates};

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
    /// Its ports answer only requests carrying its traffic token (E2B's
    /// `allowPublicTraffic: false`).
    pub private_traffic: bool,
    /// E2B's `maskRequestHost`, already validated.
    pub mask_request_host: Option<String>,
    /// E2B's `httpsPorts`, already validated.
    pub https_ports: Vec<u16>,
    /// Volumes to mount, already found in the caller's team.
    pub volumes: Vec<VolumeMount>,
    /// A template build's own sandbox: a built base's start command is
    /// not started in it.
    pub for_build: bool,
    /// A build's own sandbox starting from a cached build layer: these
    /// files and settings instead of whatever `template` names.
    pub build_layer: Option<Image>,
}

/// Where a created sandbox came from, for its metrics and log. `template`
/// is set only once the template is known to exist: a label must never
/// take a caller's arbitrary string (each would be a new series, held for
/// ever).
pub(super) struct Origin {
    pub(super) source: Source,
    pub(super) template: Option<String>,
}

/// Where a create spent its time, for the `Server-Timing` header.
#[derive(Debug, Clone)]
pub struct Timings {
    /// Booting a sandbox (near zero when the warm pool had one).
    pub boot: Duration,
    /// The boot's steps (none when the warm pool had one).
    pub boot_phases: Phases,
    /// Handing it to the caller: the agent's `/init` and the database row.
    pub handover: Duration,
    /// Checking the team's quotas (the sandbox's lifetime, room for one
    /// more running sandbox and its disk).
    pub quota: Duration,
}

/// The network a booting sandbox is attached to.
pub(super) enum Network {
    /// The address and policy it already holds (a resume from files, a
    /// rollback).
    Kept(SandboxNetwork),
    /// A new address, under this policy from the first packet.
    New(Policy),
}

impl Network {
    /// What a sandbox record holds; a record without a network (none was
    /// configured when it was made) gets a new address, open as before.
    pub(super) fn kept(network: Option<SandboxNetwork>) -> Self {
        network.map_or_else(|| Network::New(Policy::open()), Network::Kept)
    }
}

impl Sandboxes {
    /// A new sandbox owned by `caller`'s team.
    pub async fn create(&self, caller: &Caller, request: CreateRequest) -> Result<(SandboxRecord, Timings)> {
        let started = Instant::now();
        let mut origin = Origin { source: Source::Boot, template: None };
        let result = self.create_for(caller, request, &mut origin).await;
        self.observe_create(&origin, &result, started.elapsed());
        result
    }

    /// `origin`: where the sandbox came from, filled in as it is known.
    async fn create_for(
        &self,
        caller: &Caller,
        request: CreateRequest,
        origin: &mut Origin,
    ) -> Result<(SandboxRecord, Timings)> {
        self.refuse_on_a_front(&format!("a sandbox of {}", request.template))?;
        let timeout = validate_timeout(request.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S))?;
        let checking = Instant::now();
        self.quota.check_timeout(caller, &caller.team, timeout)?;
        let _place = self.quota.reserve_for(caller, &caller.team, Kind::Running, 1, self.limits.disk_mb << 20)?;
        let quota = checking.elapsed();
        let policy = self.checked_policy(&caller.team, &request.network)?;
        let started = Instant::now();
        let mut template = request.template.clone();
        let mut agent_token = None;
        let mut built = None;
        // A team's snapshot names are its own; another team's are unknown.
        // No snapshot or build takes a shipped template's name.
        let own_files = request.build_layer.is_none() && !crate::templates::is_shipped(&request.template);
        let snapshot = match own_files {
            true => self.store.snapshot(&caller.team, &request.template)?,
            false => None,
        };
        let built_template = match own_files {
            true => self.ready_template(&caller.team, &request.template)?,
            false => None,
        };
        let image = match request.build_layer.clone() {
            Some(layer) => Some(layer),
            None => built_template.as_ref().and_then(|t| t.image.clone()),
        };
        let booted = if let Some(snapshot) = snapshot {
            template = snapshot.template.clone();
            agent_token = snapshot.agent_token.clone();
            *origin = Origin { source: Source::Snapshot, template: Some(snapshot.template.clone()) };
            if snapshot.memory && !request.volumes.is_empty() {
                return Err(SandboxError::Invalid(format!(
                    "snapshot {} holds memory, which cannot be restored with volume mounts",
                    request.template
                )));
            }
            self.fetch_snapshot(&snapshot).await?;
            let network = Network::New(policy.clone());
            let volumes = &request.volumes;
            self.boot_from(new_id(), &snapshot.template, Some(snapshot.key), network, snapshot.memory, volumes).await?
        } else if let Some(image) = image {
            // A team's built template: its image's layers under a new
            // sandbox, as a snapshot's are; with its memory, the start
            // command's process is restored running.
            template = image.substrate_template.clone();
            *origin = Origin { source: Source::Snapshot, template: Some(image.substrate_template.clone()) };
            if image.memory && !request.volumes.is_empty() {
                return Err(SandboxError::Invalid(format!(
                    "template {} holds memory (its start command runs in it), which cannot be restored with volume mounts",
                    request.template
                )));
            }
            agent_token = image.agent_token.clone();
            if let Some(record) = &built_template {
                self.fetch_image(record).await?;
            }
            let network = Network::New(policy.clone());
            let volumes = &request.volumes;
            let booted = self.boot_from(
                new_id(),
                &image.substrate_template,
                Some(image.snapshot_key.clone()),
                network,
                image.memory,
                volumes,
            );
            let booted = booted.await?;
            built = Some(image);
            booted
        } else {
            // A pooled sandbox booted without volumes; mounts are made at boot.
            let pooled = match request.volumes.is_empty() {
                true => self.take_pooled(&request.template, &policy).await,
                false => None,
            };
            match pooled {
                Some(booted) => {
                    *origin = Origin { source: Source::Pool, template: Some(request.template.clone()) };
                    booted
                }
                None => {
                    self.check_template(&request.template, request.for_build).await?;
                    origin.template = Some(request.template.clone());
                    match request.volumes.is_empty() {
                        // A warm snapshot holds memory: no mounts under it.
                        true => self.boot_warm_or_cold(&request.template, &policy).await?,
                        false => {
                            let network = Network::New(policy.clone());
                            self.boot_from(new_id(), &request.template, None, network, false, &request.volumes).await?
                        }
                    }
                }
            }
        };
        let boot = started.elapsed();
        let Booted { id, placement, agent_socket, network, phases } = booted;
        // A pooled sandbox's boot happened before this request.
        let boot_phases = match origin.source {
            Source::Pool => Phases::default(),
            _ => phases,
        };
        tracing::Span::current().record("sandbox_id", id.as_str());
        let network = match self.with_policy(&id, network, &policy).await {
            Ok(network) => network,
            Err(e) => {
                self.discard(&id).await;
                return Err(e);
            }
        };
        let now = now_ms();
        // The template's environment, under the caller's own.
        let mut env_vars: HashMap<String, String> =
            built.as_ref().map(|image| image.envs.iter().cloned().collect()).unwrap_or_default();
        env_vars.extend(request.env_vars);
        let record = SandboxRecord {
            id,
            team: caller.team.clone(),
            template,
            access_token: new_token(),
            traffic_access_token: request.private_traffic.then(new_token),
            metadata: request.metadata,
            env_vars,
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
            volume_mounts: request.volumes,
            mask_request_host: request.mask_request_host,
            https_ports: request.https_ports,
            sealed_upstream_password: None,
            node: self.node().map(str::to_string),
        };
        if let Err(e) = self.hand_over(&record, agent_token.as_deref()).await {
            self.discard(&record.id).await;
            return Err(e.into());
        }
        if let Some(image) = &built
            && let Err(e) = self.start_template(&record, image, !request.for_build).await
        {
            if let Err(end) = self.end(&record.id, crate::telemetry::KillReason::Request).await {
                tracing::warn!(sandbox = %record.id, "removing a sandbox whose template did not start: {end}");
            }
            return Err(e.context(format!("starting template {}", request.template)).into());
        }
        Ok((record, Timings { boot, boot_phases, handover: started.elapsed() - boot, quota }))
    }

    /// A new sandbox of `template` under `policy`, booted and its service
    /// started.
    pub(super) async fn boot(&self, template: &str, policy: &Policy) -> Result<Booted> {
        self.check_template(template, false).await?;
        self.boot_warm_or_cold(template, policy).await
    }

    /// Gives a booted sandbox the caller's policy if it was booted under
    /// another (a pooled one); otherwise nothing to do.
    pub(super) async fn with_policy(
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

    /// Boots sandbox `id` (from a snapshot's files if given) on `network`,
    /// then starts its template's service; on failure nothing of it is
    /// left. `restored`: the snapshot holds memory, so its processes (the
    /// service among them) are restored, not started.
    pub(super) async fn boot_from(
        &self,
        id: String,
        template: &str,
        snapshot: Option<String>,
        network: Network,
        restored: bool,
        volumes: &[VolumeMount],
    ) -> Result<Booted> {
        // Lines logged while it boots name it, whoever asked (a create, a
        // fork's child, a pool's refill).
        let span = tracing::info_span!("sandbox", sandbox_id = %id);
        self.boot_sandbox(id, template, snapshot, network, restored, volumes).instrument(span).await
    }

    async fn boot_sandbox(
        &self,
        id: String,
        template: &str,
        snapshot: Option<String>,
        network: Network,
        restored: bool,
        volumes: &[VolumeMount],
    ) -> Result<Booted> {
        let allocated = matches!(network, Network::New(_));
        let network = match network {
            Network::Kept(network) => Some(network),
            Network::New(policy) => self.addresses.take(&id)?.map(|address| SandboxNetwork { address, policy }),
        };
        let release = |id: &str| {
            if allocated {
                self.addresses.release(id)
            }
        };
        let spec = self.spec(&id, template, snapshot, network, volumes);
        let attaching = spec.network.is_some();
        let started = Instant::now();
        let created = self
            .blocking(move |s| {
                let mut phases = Phases::default();
                s.create_timed(&spec, &mut phases).map(|p| (p, spec, phases))
            })
            .await;
        if restored {
            self.observe_checkpoint(true, created.is_ok(), started.elapsed());
        }
        if attaching {
            self.observe_network(true, created.is_ok());
        }
        let (placement, spec, mut phases) = created.inspect_err(|_| release(&id))?;
        let serving = Instant::now();
        let started_service = self.start_service(template, &spec.agent_socket, restored).await;
        phases.note("service", serving.elapsed());
        tracing::debug!(?phases, "booted");
        let booted = Booted { id, placement, agent_socket: spec.agent_socket, network: spec.network, phases };
        if let Err(e) = started_service {
            self.destroy_quietly(&booted.id).await;
            release(&booted.id);
            return Err(e.into());
        }
        Ok(booted)
    }

    /// Starts the template's long-running service (the code interpreter),
    /// if it has one, and waits until it answers; `restored`: it already
    /// runs (restored from memory), only wait.
    pub(super) async fn start_service(
        &self,
        template: &str,
        agent_socket: &Path,
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
    pub(super) async fn hand_over(&self, record: &SandboxRecord, agent_token: Option<&str>) -> anyhow::Result<()> {
        let mut init = serde_json::json!({ "accessToken": record.access_token, "envVars": record.env_vars });
        if let Some(ca) = record.network.as_ref().and_then(|n| self.egress_ca_for(&n.policy)) {
            init["egressCa"] = ca.into();
        }
        agent_link::post_json(&record.agent_socket, "/init", &init, agent_token).await?;
        self.store.put(record)
    }

    pub(super) async fn check_template(&self, name: &str, for_build: bool) -> Result<()> {
        let all = self.substrate_templates().await?;
        // An image's template is a build's to boot, and no one else's.
        if all.iter().any(|t| t.name == name && (for_build || super::nameable(t))) {
            return Ok(());
        }
        let available: Vec<String> = all.into_iter().filter(super::nameable).map(|t| t.name).collect();
        Err(SandboxError::UnknownTemplate { name: name.to_string(), available: available.join(", ") })
    }
}
