//! The sandbox service: every verb the API offers on sandboxes and
//! snapshots, keeping the store and the substrate in step. Knows nothing of
//! HTTP shapes; the API calls only its public methods.
//!
//! One file per verb (or family of verbs); this file holds the service's
//! state and the plain reads. Substrate calls that block go through
//! [`Sandboxes::blocking`] (`blocking.rs`).

mod blocking;
mod builds;
mod create;
mod egress;
mod expiry;
mod fork;
mod image_objects;
mod journal;
mod kill;
mod layer_objects;
mod metrics;
mod nodes;
mod objects;
mod observe;
mod other_links;
mod pause;
mod pools;
mod quota;
mod recover;
mod relocate;
mod rollback;
mod secrets;
mod snapshot;
mod transitions;
mod volume_moves;
mod volumes;
mod warm;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use copse_substrate::{Limits, SandboxNetwork, SandboxSpec, Substrate, TemplateInfo};

use crate::model::{Caller, Result, SandboxError, SandboxRecord, State, Store, VolumeMount, now_ms, validate_timeout};
use crate::network::Addresses;
use crate::pool::WarmPool;

pub use builds::labels::{page, sort_tags};
pub use builds::logs::{LogWindow, window as log_window};
/// For the check that the builder accepts the shipped definitions.
#[cfg(test)]
pub use builds::steps::parse as parse_steps;
pub use builds::{BuildSpec, MAX_UPLOAD_BYTES, RawStep, is_image_template};
pub use create::{CreateRequest, Timings};
pub use fork::{MAX_CLONES, MAX_FORKS};
pub use metrics::Metric;
pub use nodes::{Membership, Owner};
pub use pause::Connected;
pub use secrets::Secrets;
pub use volume_moves::content_call;
pub use volumes::{DEFAULT_VOLUME_GB, Volumes, team_volume_limit};

#[derive(Debug, Default)]
pub struct ListFilter {
    pub metadata: HashMap<String, String>,
    pub states: Vec<State>,
    pub template: Option<String>,
}

pub struct Sandboxes {
    substrate: Arc<dyn Substrate>,
    store: Box<dyn Store>,
    run_dir: PathBuf,
    limits: Limits,
    pools: Vec<Arc<WarmPool>>,
    /// The last CPU reading per sandbox, to turn CPU time into a percentage.
    cpu_samples: metrics::CpuSamples,
    /// A bounded ring of metric samples per sandbox (`get_metrics(start, end)`).
    metric_history: metrics::History,
    /// Each sandbox's own log (E2B's sandbox logs); see `observe.rs`.
    sandbox_log: crate::sandbox_log::SandboxLog,
    /// One state change (pause, resume, rollback) at a time per sandbox.
    transitions: transitions::Transitions,
    /// One fetch from the object store at a time per snapshot (`objects.rs`).
    fetching: transitions::Transitions,
    /// Snapshots and template images this node fetched (and, from its
    /// start, those an earlier run fetched: `recover.rs`), removed once
    /// no record names them (`objects.rs`).
    fetched: Mutex<HashSet<String>>,
    addresses: Addresses,
    quota: quota::Quota,
    /// Copy steps' uploaded archives (`builds/uploads.rs`).
    template_files: PathBuf,
    /// Registries and blob cache of builds from images (`builds/image.rs`).
    images: builds::ImageSource,
    /// Templates whose service is restored running (`warm.rs`).
    warmer: warm::Warmer,
    /// What `network.rules` placeholders may name.
    secrets: Option<Arc<Secrets>>,
    /// The egress CA's certificate (PEM), which a sandbox with
    /// `network.rules` trusts (`egress.rs`).
    egress_ca: Option<Arc<str>>,
    /// This gateway's node on a shared database (`nodes.rs`); `None` on a
    /// single host, where every record is its own.
    node: Option<nodes::Membership>,
    /// The volume records, given by the volumes service when it is made
    /// (`Volumes::new`): a drain moves volumes too (`volume_moves.rs`).
    volume_store: std::sync::OnceLock<Arc<dyn crate::model::VolumeStore>>,
}

/// Whether callers may name `template`: not an image's (see
/// [`Sandboxes::templates`]).
fn nameable(template: &TemplateInfo) -> bool {
    !is_image_template(&template.name)
}

impl Sandboxes {
    /// `pools`: (template, size) pairs of sandboxes to keep booted ahead.
    pub fn new(
        substrate: Arc<dyn Substrate>,
        store: Box<dyn Store>,
        run_dir: PathBuf,
        pools: &[(String, usize)],
    ) -> Self {
        let template_files = run_dir.with_file_name("template-files");
        let blob_dir = run_dir.with_file_name("images").join("blobs");
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
            cpu_samples: Default::default(),
            metric_history: Default::default(),
            sandbox_log: crate::sandbox_log::SandboxLog::disabled(),
            transitions: Default::default(),
            fetching: Default::default(),
            fetched: Default::default(),
            addresses: Addresses::new(None),
            quota: Default::default(),
            template_files,
            images: builds::ImageSource::new(Default::default(), blob_dir),
            warmer: Default::default(),
            secrets: None,
            egress_ca: None,
            node: None,
            volume_store: Default::default(),
        }
    }

    /// Sandboxes' `network.rules` may name `secrets` (without, none).
    pub fn with_secrets(mut self, secrets: Arc<Secrets>) -> Self {
        self.secrets = Some(secrets);
        self
    }

    /// Sandboxes with `network.rules` trust this CA (a PEM certificate);
    /// without one, their HTTPS to rule hosts fails.
    pub fn with_egress_ca(mut self, cert_pem: Option<&str>) -> Self {
        self.egress_ca = cert_pem.map(Into::into);
        self
    }

    /// Sandboxes get an address on `network` (and pooled ones an open policy
    /// until hand-out).
    pub fn with_network(mut self, network: Option<&copse_substrate::NetConfig>) -> Self {
        self.addresses = Addresses::new(network);
        self
    }

    /// Team limits from `directory`, counted against `usage` (which the
    /// store must keep: see `store::Indexed`).
    pub fn with_tenancy(mut self, usage: Arc<crate::store::Usage>, directory: Arc<crate::tenancy::Directory>) -> Self {
        self.quota = quota::Quota::new(usage, directory);
        self
    }

    /// Builds from images pull through the operator's mirrors, with its
    /// credentials, into the blob cache under `data_dir`.
    pub fn with_registries(mut self, registries: copse_images::Registries, data_dir: &Path) -> Self {
        self.images = builds::ImageSource::new(registries, crate::images::blob_dir(data_dir));
        self
    }

    /// Every sandbox's disk quota from now on.
    pub fn with_disk_mb(mut self, disk_mb: u64) -> Self {
        self.limits.disk_mb = disk_mb;
        self
    }

    /// Keeps each sandbox's log (lifecycle and forwarded envd calls) there.
    pub fn with_sandbox_log(mut self, log: crate::sandbox_log::SandboxLog) -> Self {
        self.sandbox_log = log;
        self
    }

    /// The substrate's name, for logs and the startup banner.
    pub fn substrate_name(&self) -> &'static str {
        self.substrate.name()
    }

    /// The templates built on this host (on an API front, the cluster's
    /// nodes) that callers may name. An image's
    /// template is only ever a build's base: the image may come from one
    /// team's private registry, so no listing shows it and no create or
    /// `from_template` reaches it; a team reaches its files through its own
    /// built template.
    pub async fn templates(&self) -> Result<Vec<TemplateInfo>> {
        if !self.substrate.runs_sandboxes() {
            return Ok(self.cluster_templates()?);
        }
        Ok(self.substrate_templates().await?.into_iter().filter(nameable).collect())
    }

    /// Every template the substrate holds, images' included.
    pub(super) async fn substrate_templates(&self) -> Result<Vec<TemplateInfo>> {
        self.blocking(|s| s.templates()).await
    }

    /// Lets the substrate finish background work (network teardown) before
    /// the gateway exits.
    pub async fn settle(&self) {
        if let Err(e) = self
            .blocking(|s| {
                s.settle();
                Ok(())
            })
            .await
        {
            tracing::error!("settling the substrate: {e:#}");
        }
    }

    /// The sandbox, if `caller` may see it; another team's is as missing
    /// as one that never existed.
    pub fn get(&self, caller: &Caller, id: &str) -> Result<SandboxRecord> {
        self.store
            .get(id)?
            .filter(|record| caller.sees(&record.team))
            .ok_or_else(|| SandboxError::NotFound(id.to_string()))
    }

    pub fn list(&self, caller: &Caller, filter: &ListFilter) -> Result<Vec<SandboxRecord>> {
        let mut records: Vec<SandboxRecord> = self
            .store
            .all()?
            .into_iter()
            .filter(|r| caller.sees(&r.team))
            .filter(|r| filter.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v)))
            .filter(|r| filter.states.is_empty() || filter.states.contains(&r.state))
            .filter(|r| filter.template.as_ref().is_none_or(|t| &r.template == t))
            .collect();
        records.sort_by(|a, b| (a.started_at_ms, &a.id).cmp(&(b.started_at_ms, &b.id)));
        Ok(records)
    }

    /// Sets the sandbox to expire `timeout_s` from now.
    pub fn set_timeout(&self, caller: &Caller, id: &str, timeout_s: i64) -> Result<SandboxRecord> {
        let timeout = validate_timeout(timeout_s)?;
        let mut record = self.get(caller, id)?;
        self.quota.check_timeout(caller, &record.team, timeout)?;
        match &mut record.paused {
            // Paused, the clock is stopped; the new lifetime starts at resume.
            Some(paused) => paused.remaining_ms = timeout * 1000,
            None => record.end_at_ms = now_ms() + timeout * 1000,
        }
        self.store.put(&record)?;
        Ok(record)
    }

    /// Connecting never shortens a running sandbox's life, only extends it.
    pub fn extend(&self, caller: &Caller, id: &str, timeout_s: Option<i64>) -> Result<SandboxRecord> {
        let mut record = self.get(caller, id)?;
        if record.paused.is_some() {
            return Ok(record);
        }
        if let Some(timeout) = timeout_s {
            let timeout = validate_timeout(timeout)?;
            self.quota.check_timeout(caller, &record.team, timeout)?;
            let end = now_ms() + timeout * 1000;
            if end > record.end_at_ms {
                record.end_at_ms = end;
                self.store.put(&record)?;
            }
        }
        Ok(record)
    }

    /// The spec of sandbox `id`; `snapshot` is a substrate snapshot key.
    fn spec(
        &self,
        id: &str,
        template: &str,
        snapshot: Option<String>,
        network: Option<SandboxNetwork>,
        volumes: &[VolumeMount],
    ) -> SandboxSpec {
        SandboxSpec {
            id: id.to_string(),
            template: template.to_string(),
            limits: self.limits,
            agent_socket: socket_path(&self.run_dir, id),
            snapshot,
            network,
            volumes: volumes
                .iter()
                .map(|m| copse_substrate::VolumeMount { volume: m.volume_id.clone(), path: m.path.clone() })
                .collect(),
        }
    }
}

fn socket_path(run_dir: &Path, id: &str) -> PathBuf {
    run_dir.join(format!("{id}.sock"))
}
