//! [`JailSubstrate`]: the FreeBSD [`Substrate`] over the host. Observes
//! the host, asks `plan` what to do, and hands the result to `exec`.
//! Nothing in this module has run on a FreeBSD host yet; see
//! docs/freebsd.md.

use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};

use crate::exec::{Executor, run_cmd, run_from, run_into, succeeds};
use crate::plan::lifecycle::{self, SnapshotSource, StoredSnapshot};
use crate::plan::recover::{self as reconcile, HostTraces};
use crate::plan::template::{self as tpl, BuildInputs};
use crate::plan::{Layout, devfs, host, jail_name, layers, mounts, rctl, sandbox, validate_id, volume, zfs};
use crate::{plan, sys};
use copse_substrate::template::{Backend, check_backend, validate_name};
use copse_substrate::{
    Capabilities, Placement, Progress, Recipe, Recovery, SandboxSpec, SnapshotInfo, Substrate, SubstrateError,
    TemplateInfo, Usage,
};

pub struct JailSubstrate {
    layout: Layout,
    /// The sandbox network (epairs on a bridge, pf anchors); `None`: jails
    /// keep loopback only.
    network: Option<copse_cubenet::freebsd::HostNetwork>,
    /// One template build at a time: builds are long, share the dist
    /// cache, and two builds of one name must not interleave.
    building: Mutex<()>,
}

impl JailSubstrate {
    /// Checks the host can run sandboxes and prepares it (idempotent).
    pub fn open(state_dir: &Path, agent_binary: &Path) -> anyhow::Result<Self> {
        let layout = Layout::from_env(state_dir, |k| std::env::var(k).ok()).map_err(|e| anyhow!(e))?;
        if !racct_enabled()? {
            bail!("rctl limits need kern.racct.enable=1 in /boot/loader.conf (and a reboot); see docs/freebsd.md");
        }
        if !agent_binary.is_file() {
            bail!("agent binary {} not found", agent_binary.display());
        }
        let found = host::Found {
            existing_datasets: zfs::parents(&layout).into_iter().filter(|d| succeeds(&zfs::exists(d))).collect(),
            ruleset_loaded: run_cmd(&devfs::show(layout.devfs_ruleset), None).is_ok_and(|out| devfs::is_loaded(&out)),
        };
        Executor::new(None).run_all(&host::prepare(&layout, agent_binary, &found)).context("preparing the host")?;
        Ok(Self { layout, network: None, building: Mutex::new(()) })
    }

    /// Puts every sandbox created from now on on the sandbox network
    /// `config` (bridge created unless it exists; pf must evaluate its
    /// anchors, see docs/freebsd.md).
    pub fn with_network(mut self, config: copse_cubenet::NetConfig) -> anyhow::Result<Self> {
        self.network = Some(copse_cubenet::freebsd::open(config)?);
        Ok(self)
    }

    fn template_snapshots(&self) -> anyhow::Result<Vec<zfs::TemplateSnapshot>> {
        let out = run_cmd(&zfs::list_templates(&self.layout), None)?;
        zfs::parse_templates(&self.layout, &out).map_err(|e| anyhow!(e))
    }

    /// One look at everything of copse's on the host.
    fn observe(&self) -> anyhow::Result<HostTraces> {
        let datasets = run_cmd(&zfs::list_sandboxes(&self.layout), None)?;
        let rules = run_cmd(&rctl::list(), None)?;
        let mount_table = run_cmd(&mounts::list(), None)?;
        Ok(HostTraces {
            datasets: zfs::parse_sandboxes(&self.layout, &datasets).map_err(|e| anyhow!(e))?,
            jails: sys::list()?,
            rctl_owners: rctl::parse_rule_owners(&rules),
            mounts: mounts::parse(&mount_table),
        })
    }

    fn destroy_with(&self, id: &str, host: &HostTraces) -> anyhow::Result<()> {
        let steps = sandbox::destroy(id, &host.of(&self.layout, id));
        Executor::new(None).run_all(&steps).with_context(|| format!("destroying sandbox {id}"))
    }

    /// The jid of sandbox `id`'s live jail.
    fn jid(&self, id: &str) -> anyhow::Result<i32> {
        validate_id(id).map_err(SubstrateError::Invalid)?;
        sys::find(&jail_name(id))?
            .ok_or_else(|| SubstrateError::NotFound(format!("sandbox {id} is not running")).into())
    }

    fn stored_snapshots(&self) -> anyhow::Result<Vec<StoredSnapshot>> {
        let out = run_cmd(&lifecycle::list_snapshots(&self.layout), None)?;
        lifecycle::parse_snapshots(&self.layout, &out).map_err(|e| anyhow!(e))
    }

    fn check_snapshot_free(&self, snapshot_id: &str) -> anyhow::Result<()> {
        if succeeds(&zfs::exists(&self.layout.snapshot_dataset(snapshot_id))) {
            bail!("snapshot {snapshot_id} already exists");
        }
        Ok(())
    }

    /// Every copse snapshot's guid and clones.
    fn snapshot_uses(&self) -> anyhow::Result<Vec<layers::Use>> {
        layers::parse_uses(&run_cmd(&layers::list_uses(&self.layout), None)?).map_err(|e| anyhow!(e))
    }

    /// The copse snapshot of sandbox `id` its next snapshot stacks on.
    fn stack_parent(&self, id: &str) -> anyhow::Result<Option<String>> {
        let marks = run_cmd(&layers::list_bookmarks(&self.layout, id), None)?;
        let marks = layers::parse_bookmarks(&self.layout, id, &marks).map_err(|e| anyhow!(e))?;
        if marks.is_empty() {
            return Ok(None);
        }
        Ok(layers::stack_parent(&marks, &self.stored_snapshots()?, &self.snapshot_uses()?))
    }

    fn property(&self, dataset: &str, property: &str) -> anyhow::Result<String> {
        Ok(run_cmd(&zfs::get_number(dataset, property), None)?.trim().to_string())
    }

    /// Where `spec`'s dataset is cloned from: its template, or the copse
    /// snapshot it names (which must be of that template).
    fn origin(&self, spec: &SandboxSpec) -> anyhow::Result<zfs::Origin> {
        if let Some(snapshot_id) = &spec.snapshot {
            validate_id(snapshot_id).map_err(SubstrateError::Invalid)?;
            let stored = self.stored_snapshots()?;
            let found = lifecycle::find(&stored, snapshot_id)
                .ok_or_else(|| SubstrateError::NotFound(format!("snapshot {snapshot_id} does not exist")))?;
            if found.template.as_deref() != Some(spec.template.as_str()) {
                return Err(SubstrateError::Invalid(format!(
                    "snapshot {snapshot_id} is of template {:?}, not {}",
                    found.template, spec.template
                ))
                .into());
            }
            return Ok(zfs::Origin::snapshot(&self.layout, snapshot_id, found.template_guid.unwrap_or(0)));
        }
        let template = self
            .template_snapshots()?
            .into_iter()
            .find(|t| t.template == spec.template)
            .ok_or_else(|| SubstrateError::NotFound(format!("template {} is not built", spec.template)))?;
        Ok(zfs::Origin::template(&self.layout, &spec.template, template.guid))
    }

    /// Runs a create-shaped plan and reads the new placement; on failure
    /// removes whatever of the sandbox exists.
    fn boot(&self, spec: &SandboxSpec, steps: &[plan::Step]) -> anyhow::Result<Placement> {
        let mut executor = Executor::new(None);
        let created = executor.run_all(steps).and_then(|()| {
            let jid = executor.jid().ok_or_else(|| anyhow!("no jail was created"))?;
            let txg = run_cmd(&zfs::get_number(&self.layout.sandbox_dataset(&spec.id), "createtxg"), None)?;
            Ok(reconcile::placement(jid, zfs::parse_number(&txg).map_err(|e| anyhow!(e))?))
        });
        if let Err(e) = &created {
            tracing::warn!(sandbox = %spec.id, "create failed, cleaning up: {e:#}");
            if let Err(cleanup) = self.destroy(&spec.id) {
                tracing::error!(sandbox = %spec.id, "cleanup after failed create: {cleanup:#}");
            }
        }
        created.with_context(|| format!("creating sandbox {}", spec.id))
    }

    /// [`Self::boot`], then the sandbox's network (its jail exists and the
    /// agent is up, but nothing has been asked of it yet). On failure
    /// removes everything of the sandbox, network included.
    fn boot_attached(&self, spec: &SandboxSpec, steps: &[plan::Step]) -> anyhow::Result<Placement> {
        let placement = self.boot(spec, steps)?;
        if let (Some(network), Some(wanted)) = (&self.network, &spec.network)
            && let Err(e) = network.attach(&spec.id, placement.init_pid, wanted)
        {
            if let Err(cleanup) = self.destroy(&spec.id) {
                tracing::error!(sandbox = %spec.id, "cleanup after failed network attach: {cleanup:#}");
            }
            return Err(e.context(format!("creating sandbox {}", spec.id)));
        }
        Ok(placement)
    }

    /// The sandbox's epair and anchor go first: with the epair destroyed
    /// while its jail still holds one end, no end returns to the host.
    fn detach(&self, id: &str) -> anyhow::Result<()> {
        self.network.as_ref().map_or(Ok(()), |network| network.detach(id))
    }

    /// Destroys deleted snapshots no sandbox or live snapshot is cloned
    /// from any more, later layers first.
    fn collect_snapshots(&self) -> anyhow::Result<()> {
        let steps = layers::collect(&self.stored_snapshots()?, &self.snapshot_uses()?);
        Executor::new(None).run_all(&steps)
    }

    /// Runs a snapshot plan; on failure removes whatever of it exists.
    fn take_snapshot(&self, source: &SnapshotSource, snapshot_id: &str) -> anyhow::Result<()> {
        let taken = Executor::new(None).run_all(&lifecycle::snapshot(&self.layout, source, snapshot_id));
        if taken.is_err() {
            // One step at a time, so a jail gone meanwhile (its SIGCONT
            // fails) does not keep the copies from being removed.
            for step in lifecycle::snapshot_undo(&self.layout, source, snapshot_id) {
                if let Err(undo) = Executor::new(None).run_all(std::slice::from_ref(&step)) {
                    tracing::error!(sandbox = %source.id, "after a failed snapshot: {undo:#}");
                }
            }
        }
        taken
    }

    fn build_template(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<()> {
        let name = &recipe.name;
        let dist = std::env::var(tpl::ENV_DIST).ok();
        let version = run_cmd(&tpl::host_release(), None)?;
        let release = match (tpl::release_of(&version), &dist) {
            (Ok(r), _) => r,
            // Operator-supplied sets: label the build with the version as is.
            (Err(_), Some(_)) => version.trim().to_string(),
            (Err(e), None) => bail!(e),
        };
        let arch = tpl::dist_arch(std::env::consts::ARCH)
            .ok_or_else(|| anyhow!("no FreeBSD release sets for {}", std::env::consts::ARCH))?;
        let input = BuildInputs {
            recipe,
            source: tpl::dist_source(dist.as_deref(), &release, arch),
            release,
            unfinished: succeeds(&zfs::exists(&self.layout.template_dataset(name))),
            built_at: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        };
        let result = Executor::new(Some(progress)).run_all(&tpl::build(&self.layout, &input));
        if result.is_err() {
            // Leave no half-built template that a later call would mistake
            // for a base; undo steps never fail.
            let _ = Executor::new(None).run_all(&tpl::undo(&self.layout, name));
        }
        result
    }
}

impl Substrate for JailSubstrate {
    fn name(&self) -> &'static str {
        "freebsd-jail"
    }

    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        Ok(self.template_snapshots()?.into_iter().map(info).collect())
    }

    fn ensure_template(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        validate_name(&recipe.name).map_err(SubstrateError::Invalid)?;
        check_backend(recipe, &[Backend::Jail])?;
        let _guard = self.building.lock().unwrap_or_else(|e| e.into_inner());
        let find = || -> anyhow::Result<Option<zfs::TemplateSnapshot>> {
            Ok(self.template_snapshots()?.into_iter().find(|t| t.template == recipe.name))
        };
        if let Some(found) = find()? {
            return Ok(info(found));
        }
        self.build_template(recipe, progress)?;
        let built = find()?.ok_or_else(|| anyhow!("template {} finished but has no @base snapshot", recipe.name))?;
        progress(&format!("template {}: ready, snapshot guid {}", recipe.name, built.guid));
        Ok(info(built))
    }

    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        validate_id(&spec.id).map_err(SubstrateError::Invalid)?;
        validate_name(&spec.template).map_err(SubstrateError::Invalid)?;
        let origin = self.origin(spec)?;
        self.boot_attached(spec, &sandbox::create(&self.layout, spec, &origin))
    }

    fn destroy(&self, id: &str) -> anyhow::Result<()> {
        if validate_id(id).is_err() {
            // No sandbox can have such an id, so there is nothing to remove.
            return Ok(());
        }
        // A network step that failed must not keep the jail alive: its
        // leftovers are found again by `recover_network`.
        let detached = self.detach(id);
        self.destroy_with(id, &self.observe()?)?;
        detached?;
        // A deleted snapshot this sandbox was the last clone of can go now.
        if let Err(e) = self.collect_snapshots() {
            tracing::warn!("collecting deleted snapshots: {e:#}");
        }
        Ok(())
    }

    fn is_alive(&self, id: &str, placement: &Placement) -> bool {
        sys::find(&jail_name(id)).is_ok_and(|jid| jid == Some(placement.init_pid))
    }

    fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        validate_id(id).map_err(SubstrateError::Invalid)?;
        let mut usage = rctl::parse_usage(&run_cmd(&rctl::usage(id), None)?).map_err(|e| anyhow!(e))?;
        let used = run_cmd(&zfs::get_number(&self.layout.sandbox_dataset(id), "used"), None)?;
        usage.disk_bytes = zfs::parse_number(&used).map_err(|e| anyhow!(e))?;
        Ok(usage)
    }

    fn host_memory(&self) -> Option<copse_substrate::HostMemory> {
        host_memory()
    }

    fn capabilities(&self) -> Capabilities {
        // Jails have no way to save a process's memory; snapshots are of
        // files only.
        Capabilities { memory_snapshots: copse_substrate::Support::No }
    }

    fn pause(&self, id: &str) -> anyhow::Result<()> {
        let jid = self.jid(id)?;
        Executor::new(None).run_all(&lifecycle::pause(id, jid)).with_context(|| format!("pausing sandbox {id}"))
    }

    fn resume(&self, id: &str) -> anyhow::Result<()> {
        let jid = self.jid(id)?;
        Executor::new(None).run_all(&lifecycle::resume(id, jid)).with_context(|| format!("resuming sandbox {id}"))
    }

    fn snapshot(&self, id: &str, snapshot_id: &str, memory: bool) -> anyhow::Result<SnapshotInfo> {
        if memory {
            return Err(SubstrateError::Unsupported("jails keep no memory snapshots; bhyve templates do".into()).into());
        }
        validate_id(snapshot_id).map_err(SubstrateError::Invalid)?;
        let jid = self.jid(id)?;
        // Any dataset of that name, tagged or not: the undo below destroys
        // it, so it must be one this call made.
        self.check_snapshot_free(snapshot_id)?;
        let dataset = self.layout.sandbox_dataset(id);
        let source = SnapshotSource {
            id: id.to_string(),
            jid,
            origin: self.property(&dataset, "origin")?,
            parent: self.stack_parent(id)?,
            template: self.property(&dataset, plan::PROP_TEMPLATE)?,
            template_guid: zfs::parse_number(&self.property(&dataset, plan::PROP_TEMPLATE_GUID)?)
                .map_err(|e| anyhow!(e))?,
            paused: lifecycle::is_paused(&run_cmd(&lifecycle::processes(jid), None)?),
        };
        let mut taken = self.take_snapshot(&source, snapshot_id);
        if let (Err(e), Some(parent)) = (&taken, &source.parent) {
            // The layer it stacked on was deleted since it was looked up:
            // the same snapshot, sent from the origin, only holds more.
            tracing::warn!(sandbox = %id, "snapshot {snapshot_id} on {parent} failed, retrying from the origin: {e:#}");
            taken = self.take_snapshot(&SnapshotSource { parent: None, ..source.clone() }, snapshot_id);
        }
        taken.with_context(|| format!("snapshot {snapshot_id} of sandbox {id}"))?;
        self.stored_snapshots()?
            .iter()
            .find(|s| s.id.as_deref() == Some(snapshot_id) && !s.deleted)
            .and_then(StoredSnapshot::info)
            .ok_or_else(|| anyhow!("snapshot {snapshot_id} was taken but is not listed"))
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        Ok(self.stored_snapshots()?.iter().filter_map(StoredSnapshot::info).collect())
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> anyhow::Result<()> {
        if validate_id(snapshot_id).is_err() {
            // No snapshot can have such an id, so there is nothing to remove.
            return Ok(());
        }
        let stored = self.stored_snapshots()?;
        let Some(found) = lifecycle::find(&stored, snapshot_id) else {
            return Ok(());
        };
        let has_clones = layers::cloned(&self.snapshot_uses()?).contains(&found.dataset);
        Executor::new(None)
            .run_all(&lifecycle::delete(found, has_clones))
            .with_context(|| format!("deleting snapshot {snapshot_id}"))?;
        // The last layer of a deleted built template frees the ones it
        // stacked on.
        if let Err(e) = self.collect_snapshots() {
            tracing::warn!("collecting deleted snapshots: {e:#}");
        }
        Ok(())
    }

    fn rollback(&self, spec: &SandboxSpec, snapshot_id: &str) -> anyhow::Result<Placement> {
        validate_id(&spec.id).map_err(SubstrateError::Invalid)?;
        let spec = SandboxSpec { snapshot: Some(snapshot_id.to_string()), ..spec.clone() };
        // Looked up before anything is torn down: a rollback to a snapshot
        // that does not exist leaves the sandbox as it was.
        let origin = self.origin(&spec)?;
        self.detach(&spec.id)?;
        let host = self.observe()?;
        let steps = lifecycle::rollback(&self.layout, &spec, &host.of(&self.layout, &spec.id), &origin);
        self.boot_attached(&spec, &steps).with_context(|| format!("rolling sandbox {} back to {snapshot_id}", spec.id))
    }

    fn export_snapshot(&self, snapshot_id: &str, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        validate_id(snapshot_id).map_err(SubstrateError::Invalid)?;
        if lifecycle::find(&self.stored_snapshots()?, snapshot_id).is_none() {
            return Err(SubstrateError::NotFound(format!("snapshot {snapshot_id} does not exist")).into());
        }
        run_into(&lifecycle::send_stream(&self.layout, snapshot_id), out)
            .with_context(|| format!("exporting snapshot {snapshot_id}"))
    }

    fn import_snapshot(&self, snapshot_id: &str, input: &mut dyn std::io::Read) -> anyhow::Result<SnapshotInfo> {
        validate_id(snapshot_id).map_err(SubstrateError::Invalid)?;
        self.check_snapshot_free(snapshot_id)?;
        let imported = run_from(&lifecycle::receive_stream(&self.layout, snapshot_id), input).and_then(|()| {
            self.stored_snapshots()?
                .iter()
                .find(|s| s.id.as_deref() == Some(snapshot_id))
                .and_then(StoredSnapshot::info)
                .ok_or_else(|| anyhow!("the stream is not a copse snapshot (no {} property)", plan::PROP_TEMPLATE))
        });
        if imported.is_err() {
            let _ = Executor::new(None).run_all(&lifecycle::import_undo(&self.layout, snapshot_id));
        }
        imported.with_context(|| format!("importing snapshot {snapshot_id}"))
    }

    fn recover(&self, known: &[(String, Placement)]) -> anyhow::Result<Recovery> {
        let host = self.observe()?;
        let decision = reconcile::reconcile(&self.layout, known, &host);
        let mut failed = Vec::new();
        for id in &decision.destroy {
            if let Err(e) = self.destroy_with(id, &host) {
                tracing::error!(sandbox = %id, "recovery could not remove it: {e:#}");
                failed.push(id.clone());
            }
        }
        if !failed.is_empty() {
            bail!("could not remove sandboxes {failed:?}; see the log");
        }
        // Leftover snapshot datasets only cost space: never block a start.
        if let Err(e) = self.collect_snapshots() {
            tracing::warn!("collecting deleted snapshots: {e:#}");
        }
        Ok(Recovery { adopted: decision.adopt, removed: decision.destroy })
    }

    fn update_network(&self, id: &str, policy: &copse_substrate::Policy) -> anyhow::Result<()> {
        match &self.network {
            Some(network) => network.update(id, policy),
            None => Err(SubstrateError::Unsupported(format!("sandbox {id}: no sandbox network configured")))?,
        }
    }

    // Not run on FreeBSD: the proxy is the Linux one's code (cubenet).
    fn set_secret_resolver(&self, resolver: copse_substrate::SecretResolver) {
        if let Some(network) = &self.network {
            network.set_secret_resolver(resolver);
        }
    }

    fn set_interceptor(&self, interceptor: std::sync::Arc<copse_substrate::Interceptor>) {
        if let Some(network) = &self.network {
            network.set_interceptor(interceptor);
        }
    }

    /// Stray epairs (of sandboxes [`Substrate::recover`] removed, whose
    /// jail ends came back to the host with their jails) and anchors go here.
    // Not run on FreeBSD: the plans are golden-tested (`plan::volume`).
    fn create_volume(&self, id: &str, limit_bytes: u64) -> anyhow::Result<()> {
        validate_id(id).map_err(SubstrateError::Invalid)?;
        if succeeds(&zfs::exists(&volume::volume_dataset(&self.layout, id))) {
            return Ok(());
        }
        let parent_exists = succeeds(&zfs::exists(&volume::volumes_dataset(&self.layout)));
        Executor::new(None).run_all(&volume::create(&self.layout, id, limit_bytes, parent_exists))
    }

    fn delete_volume(&self, id: &str) -> anyhow::Result<()> {
        validate_id(id).map_err(SubstrateError::Invalid)?;
        if !succeeds(&zfs::exists(&volume::volume_dataset(&self.layout, id))) {
            return Ok(());
        }
        Executor::new(None).run_all(&volume::destroy(&self.layout, id))
    }

    fn volume_location(&self, id: &str) -> anyhow::Result<copse_substrate::VolumeLocation> {
        validate_id(id).map_err(SubstrateError::Invalid)?;
        let root = volume::volume_root(&self.layout, id);
        if !root.is_dir() {
            return Err(SubstrateError::NotFound(format!("volume {id} not found")).into());
        }
        // Jails share the host's ids.
        Ok(copse_substrate::VolumeLocation { root, id_base: 0 })
    }

    fn recover_network(&self, known: &[(String, copse_substrate::SandboxNetwork)]) -> anyhow::Result<()> {
        self.network.as_ref().map_or(Ok(()), |network| network.reconcile(known))
    }
}

fn info(t: zfs::TemplateSnapshot) -> TemplateInfo {
    TemplateInfo {
        name: t.template,
        built_at: t.built_at,
        size_bytes: t.referenced,
        backend: Backend::Jail,
        recipe: String::new(),
    }
}

/// `hw.physmem`, and the free plus inactive pages (what the page daemon
/// hands out without swapping), in MiB.
fn host_memory() -> Option<copse_substrate::HostMemory> {
    let physmem: u64 = sysctl_number(c"hw.physmem")?;
    let page: u64 = sysctl_number::<libc::c_int>(c"hw.pagesize")?.try_into().ok()?;
    let free: u32 = sysctl_number(c"vm.stats.vm.v_free_count")?;
    let inactive: u32 = sysctl_number(c"vm.stats.vm.v_inactive_count")?;
    let mib = 1024 * 1024;
    Some(copse_substrate::HostMemory {
        total_mb: physmem / mib,
        available_mb: (u64::from(free) + u64::from(inactive)) * page / mib,
    })
}

/// A sysctl whose value is one plain number of type `T`.
fn sysctl_number<T: Copy + Default>(name: &std::ffi::CStr) -> Option<T> {
    let mut value = T::default();
    let mut len = std::mem::size_of::<T>();
    // SAFETY: `value` and `len` are valid for writes of the sizes given.
    let ret = unsafe { libc::sysctlbyname(name.as_ptr(), (&raw mut value).cast(), &raw mut len, std::ptr::null(), 0) };
    (ret == 0 && len == std::mem::size_of::<T>()).then_some(value)
}

/// `kern.racct.enable` is a boot-time tunable; without it rctl refuses
/// every rule and sandboxes would run unlimited.
fn racct_enabled() -> anyhow::Result<bool> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>();
    let name = c"kern.racct.enable";
    // SAFETY: `value` and `len` are valid for writes of the sizes given.
    let ret = unsafe { libc::sysctlbyname(name.as_ptr(), (&raw mut value).cast(), &raw mut len, std::ptr::null(), 0) };
    if ret < 0 {
        let err = std::io::Error::last_os_error();
        // The node does not exist in a kernel built without RACCT.
        if err.raw_os_error() == Some(libc::ENOENT) {
            return Ok(false);
        }
        return Err(err).context("sysctl kern.racct.enable");
    }
    Ok(value != 0)
}
