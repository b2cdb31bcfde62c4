//! One [`Substrate`] made of several backends, chosen per template.
//!
//! The gateway holds a single `dyn Substrate`; on a host with more than one
//! kind of sandbox (FreeBSD: jails and bhyve microVMs) that substrate is a
//! [`Router`]. Every call goes to the backend that owns what it names: a
//! template belongs to the backend that lists it, a sandbox to the backend
//! of the template (or snapshot) it was created from, a snapshot to the
//! backend of the sandbox it was taken of. Sandbox and snapshot owners are
//! persisted (`routes.json` in the state directory), so a restarted gateway
//! routes `recover`, `destroy` and snapshot calls without asking anyone.
//! Anything with no route belongs to the first (default) backend: that is
//! where everything lived before routing existed.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::template::{Backend, check_backend};
use crate::{
    Capabilities, LayerImages, LazyMemory, Phases, Placement, Policy, Progress, Recipe, Recovery, SandboxNetwork,
    SandboxSpec, SnapshotInfo, Substrate, SubstrateError, Support, TemplateInfo, Usage,
};

/// First line of a snapshot exported through a router: which backend's
/// stream follows. Streams without it are the default backend's.
const EXPORT_MAGIC: &[u8] = b"copse-backend ";

#[derive(Debug, Default, Serialize, Deserialize)]
struct Routes {
    #[serde(default)]
    sandboxes: BTreeMap<String, Backend>,
    #[serde(default)]
    snapshots: BTreeMap<String, Backend>,
    /// Filled from the backends' own template lists; not persisted, since
    /// the backends are the truth about what is built.
    #[serde(skip)]
    templates: BTreeMap<String, Backend>,
}

pub struct Router {
    name: &'static str,
    backends: Vec<(Backend, Box<dyn Substrate>)>,
    routes: Mutex<Routes>,
    file: PathBuf,
}

impl Router {
    /// `backends[0]` is the default. Routes are kept in
    /// `state_dir/routes.json`.
    pub fn open(
        state_dir: &Path,
        name: &'static str,
        backends: Vec<(Backend, Box<dyn Substrate>)>,
    ) -> anyhow::Result<Self> {
        if backends.is_empty() {
            bail!("a router needs at least one backend");
        }
        let file = state_dir.join("routes.json");
        let routes = match std::fs::read(&file) {
            Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| format!("reading {}", file.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Routes::default(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
        };
        Ok(Self { name, backends, routes: Mutex::new(routes), file })
    }

    fn routes(&self) -> MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Written before the call it describes takes effect where a crash in
    /// between must not orphan anything (create), after it otherwise.
    fn save(&self, routes: &Routes) -> anyhow::Result<()> {
        let tmp = self.file.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(routes)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.file).with_context(|| format!("writing {}", self.file.display()))
    }

    fn update(&self, change: impl FnOnce(&mut Routes)) -> anyhow::Result<()> {
        let mut routes = self.routes();
        change(&mut routes);
        self.save(&routes)
    }

    fn default_backend(&self) -> Backend {
        self.backends[0].0
    }

    fn get(&self, backend: Backend) -> Option<&dyn Substrate> {
        self.backends.iter().find(|(b, _)| *b == backend).map(|(_, s)| s.as_ref())
    }

    fn served(&self) -> Vec<Backend> {
        self.backends.iter().map(|(b, _)| *b).collect()
    }

    fn substrate(&self, backend: Backend) -> anyhow::Result<&dyn Substrate> {
        self.get(backend)
            .ok_or_else(|| SubstrateError::Unsupported(format!("this host has no {backend} backend")).into())
    }

    fn sandbox_backend(&self, id: &str) -> Option<Backend> {
        self.routes().sandboxes.get(id).copied()
    }

    fn snapshot_backend(&self, id: &str) -> Backend {
        self.routes().snapshots.get(id).copied().unwrap_or_else(|| self.default_backend())
    }

    fn for_sandbox(&self, id: &str) -> anyhow::Result<&dyn Substrate> {
        self.substrate(self.sandbox_backend(id).unwrap_or_else(|| self.default_backend()))
    }

    /// The backend that lists `template`, asking the backends again on a
    /// miss (a template built by another process since); unknown templates
    /// go to the default backend, whose own error then names them.
    fn template_backend(&self, template: &str) -> anyhow::Result<Backend> {
        if let Some(b) = self.routes().templates.get(template) {
            return Ok(*b);
        }
        self.templates()?;
        Ok(self.routes().templates.get(template).copied().unwrap_or_else(|| self.default_backend()))
    }
}

impl Substrate for Router {
    fn name(&self) -> &'static str {
        self.name
    }

    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        let mut all = Vec::new();
        for (backend, substrate) in &self.backends {
            for mut info in substrate.templates()? {
                info.backend = *backend;
                all.push(info);
            }
        }
        self.routes().templates = all.iter().map(|t| (t.name.clone(), t.backend)).collect();
        Ok(all)
    }

    fn ensure_template(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        check_backend(recipe, &self.served())?;
        let mut info = self.substrate(recipe.backend)?.ensure_template(recipe, progress)?;
        info.backend = recipe.backend;
        self.routes().templates.insert(info.name.clone(), recipe.backend);
        Ok(info)
    }

    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        self.create_timed(spec, &mut Phases::default())
    }

    fn create_timed(&self, spec: &SandboxSpec, phases: &mut Phases) -> anyhow::Result<Placement> {
        let backend = match &spec.snapshot {
            Some(snapshot) => self.snapshot_backend(snapshot),
            None => self.template_backend(&spec.template)?,
        };
        let substrate = self.substrate(backend)?;
        // Routed first: a crash during create leaves a route that recover
        // sends to the right backend, which then removes the remains.
        self.update(|r| {
            r.sandboxes.insert(spec.id.clone(), backend);
        })?;
        substrate.create_timed(spec, phases).inspect_err(|_| {
            let _ = self.update(|r| {
                r.sandboxes.remove(&spec.id);
            });
        })
    }

    fn destroy(&self, id: &str) -> anyhow::Result<()> {
        match self.sandbox_backend(id) {
            Some(backend) => self.substrate(backend)?.destroy(id)?,
            // Destroy is idempotent everywhere, and an unrouted id may be the
            // remains of anything.
            None => {
                for (_, substrate) in &self.backends {
                    substrate.destroy(id)?;
                }
            }
        }
        self.update(|r| {
            r.sandboxes.remove(id);
        })
    }

    fn is_alive(&self, id: &str, placement: &Placement) -> bool {
        self.for_sandbox(id).is_ok_and(|s| s.is_alive(id, placement))
    }

    fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        self.for_sandbox(id)?.usage(id)
    }

    /// What every template on this host offers, whatever its backend.
    fn capabilities(&self) -> Capabilities {
        // Missing on one backend is worth telling the operator over "no"
        // on another, whose sandboxes could never have it.
        let answers: Vec<Support> = self.backends.iter().map(|(_, s)| s.capabilities().memory_snapshots).collect();
        let memory_snapshots = answers
            .iter()
            .find(|a| matches!(a, Support::Missing(_)))
            .or_else(|| answers.iter().find(|a| !a.is_yes()))
            .cloned()
            .unwrap_or(Support::Yes);
        Capabilities { memory_snapshots }
    }

    fn capabilities_for(&self, template: &str) -> Capabilities {
        match self.template_backend(template).ok().and_then(|b| self.get(b)) {
            Some(substrate) => substrate.capabilities_for(template),
            None => self.capabilities(),
        }
    }

    fn pause(&self, id: &str) -> anyhow::Result<()> {
        self.for_sandbox(id)?.pause(id)
    }

    fn resume(&self, id: &str) -> anyhow::Result<()> {
        self.for_sandbox(id)?.resume(id)
    }

    fn snapshot(&self, id: &str, snapshot_id: &str, memory: bool) -> anyhow::Result<SnapshotInfo> {
        let backend = self.sandbox_backend(id).unwrap_or_else(|| self.default_backend());
        let info = self.substrate(backend)?.snapshot(id, snapshot_id, memory)?;
        self.update(|r| {
            r.snapshots.insert(snapshot_id.to_string(), backend);
        })?;
        Ok(info)
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        let mut all = Vec::new();
        for (_, substrate) in &self.backends {
            all.extend(substrate.snapshots()?);
        }
        Ok(all)
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> anyhow::Result<()> {
        self.substrate(self.snapshot_backend(snapshot_id))?.delete_snapshot(snapshot_id)?;
        self.update(|r| {
            r.snapshots.remove(snapshot_id);
        })
    }

    fn rollback(&self, spec: &SandboxSpec, snapshot_id: &str) -> anyhow::Result<Placement> {
        let backend = self.sandbox_backend(&spec.id).unwrap_or_else(|| self.default_backend());
        let of_snapshot = self.snapshot_backend(snapshot_id);
        if of_snapshot != backend {
            return Err(SubstrateError::Invalid(format!(
                "snapshot {snapshot_id} is a {of_snapshot} snapshot; sandbox {} runs on {backend}",
                spec.id
            ))
            .into());
        }
        self.substrate(backend)?.rollback(spec, snapshot_id)
    }

    fn export_snapshot(&self, snapshot_id: &str, out: &mut dyn Write) -> anyhow::Result<()> {
        let backend = self.snapshot_backend(snapshot_id);
        out.write_all(EXPORT_MAGIC)?;
        writeln!(out, "{backend}")?;
        self.substrate(backend)?.export_snapshot(snapshot_id, out)
    }

    fn import_snapshot(&self, snapshot_id: &str, input: &mut dyn Read) -> anyhow::Result<SnapshotInfo> {
        let (backend, prefix) = read_export_header(input)?;
        let backend = backend.unwrap_or_else(|| self.default_backend());
        let substrate = self.substrate(backend)?;
        let info = substrate.import_snapshot(snapshot_id, &mut std::io::Cursor::new(prefix).chain(input))?;
        self.update(|r| {
            r.snapshots.insert(snapshot_id.to_string(), backend);
        })?;
        Ok(info)
    }

    fn layer_images(&self, snapshot_id: &str, into: &Path) -> anyhow::Result<Option<LayerImages>> {
        self.substrate(self.snapshot_backend(snapshot_id))?.layer_images(snapshot_id, into)
    }

    fn new_lazy_layer(&self, snapshot_id: &str) -> anyhow::Result<Option<(String, PathBuf)>> {
        self.substrate(self.default_backend())?.new_lazy_layer(snapshot_id)
    }

    fn discard_lazy_layer(&self, layer: &str) -> anyhow::Result<()> {
        self.substrate(self.default_backend())?.discard_lazy_layer(layer)
    }

    fn export_checkpoint(&self, snapshot_id: &str, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        self.substrate(self.snapshot_backend(snapshot_id))?.export_checkpoint(snapshot_id, out)
    }

    fn import_lazy(
        &self,
        snapshot_id: &str,
        template: &str,
        layers: &[String],
        size_bytes: u64,
        memory: LazyMemory<'_>,
    ) -> anyhow::Result<SnapshotInfo> {
        let backend = self.default_backend();
        let info = self.substrate(backend)?.import_lazy(snapshot_id, template, layers, size_bytes, memory)?;
        self.update(|r| {
            r.snapshots.insert(snapshot_id.to_string(), backend);
        })?;
        Ok(info)
    }

    fn recover(&self, known: &[(String, Placement)]) -> anyhow::Result<Recovery> {
        let mut recovery = Recovery::default();
        for (backend, substrate) in &self.backends {
            let mine: Vec<(String, Placement)> = known
                .iter()
                .filter(|(id, _)| self.sandbox_backend(id).unwrap_or_else(|| self.default_backend()) == *backend)
                .cloned()
                .collect();
            // Every backend recovers, even with nothing known: that is how
            // its orphans are found.
            let found = substrate.recover(&mine)?;
            recovery.adopted.extend(found.adopted);
            recovery.removed.extend(found.removed);
        }
        let adopted = recovery.adopted.clone();
        self.update(|r| r.sandboxes.retain(|id, _| adopted.contains(id)))?;
        Ok(recovery)
    }

    fn update_network(&self, id: &str, policy: &Policy) -> anyhow::Result<()> {
        self.for_sandbox(id)?.update_network(id, policy)
    }

    fn recover_network(&self, known: &[(String, SandboxNetwork)]) -> anyhow::Result<()> {
        for (backend, substrate) in &self.backends {
            let mine: Vec<(String, SandboxNetwork)> = known
                .iter()
                .filter(|(id, _)| self.sandbox_backend(id).unwrap_or_else(|| self.default_backend()) == *backend)
                .cloned()
                .collect();
            substrate.recover_network(&mine)?;
        }
        Ok(())
    }

    fn host_memory(&self) -> Option<crate::HostMemory> {
        self.backends.first().and_then(|(_, s)| s.host_memory())
    }

    fn settle(&self) {
        for (_, substrate) in &self.backends {
            substrate.settle();
        }
    }

    // Volumes live on the default backend: the one sandboxes boot on
    // unless a template says otherwise.
    fn create_volume(&self, id: &str, limit_bytes: u64) -> anyhow::Result<()> {
        self.substrate(self.default_backend())?.create_volume(id, limit_bytes)
    }

    fn delete_volume(&self, id: &str) -> anyhow::Result<()> {
        self.substrate(self.default_backend())?.delete_volume(id)
    }

    fn volume_location(&self, id: &str) -> anyhow::Result<crate::VolumeLocation> {
        self.substrate(self.default_backend())?.volume_location(id)
    }

    fn volume_used(&self, id: &str) -> anyhow::Result<u64> {
        self.substrate(self.default_backend())?.volume_used(id)
    }
}

/// The backend named by an export header, and the bytes read to find out
/// (to be replayed when there was no header).
fn read_export_header(input: &mut dyn Read) -> anyhow::Result<(Option<Backend>, Vec<u8>)> {
    let mut prefix = Vec::with_capacity(EXPORT_MAGIC.len());
    input.take(EXPORT_MAGIC.len() as u64).read_to_end(&mut prefix)?;
    if prefix != EXPORT_MAGIC {
        return Ok((None, prefix));
    }
    let mut name = Vec::new();
    let mut byte = [0u8];
    while input.read(&mut byte)? == 1 && byte[0] != b'\n' {
        if name.len() > 32 {
            return Err(SubstrateError::Invalid("snapshot stream: backend header too long".into()).into());
        }
        name.push(byte[0]);
    }
    let name = String::from_utf8_lossy(&name);
    let backend = name.parse::<Backend>().map_err(|e| SubstrateError::Invalid(format!("snapshot stream: {e}")))?;
    Ok((Some(backend), Vec::new()))
}

#[cfg(test)]
mod tests;
