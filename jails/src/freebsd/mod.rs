//! FreeBSD substrate: each sandbox is a VNET jail rooted at a ZFS clone of
//! a template snapshot, limited by rctl, with the agent nullfs-mounted
//! read-only and started inside via `jail_attach`.
//!
//! Shape: `plan` computes every privileged action as data (pure, golden-
//! tested on Linux); `exec` applies it; `sys` wraps the jail system calls;
//! this file observes the host, asks `plan` what to do, and hands the
//! result to `exec`. Nothing in this module has run on a FreeBSD host yet;
//! see docs/freebsd.md.

mod boot;
pub mod confine;
mod exec;
pub mod plan;
mod sys;

use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};

use self::exec::{Executor, run_cmd, succeeds};
use self::plan::recover::{self as reconcile, HostTraces};
use self::plan::template::{self as tpl, BuildInputs};
use self::plan::{Layout, devfs, host, jail_name, mounts, rctl, sandbox, validate_id, zfs};
use crate::template::validate_name;
use crate::{Placement, Progress, Recipe, Recovery, SandboxSpec, Substrate, TemplateInfo, Usage};

/// Entry point of `copse-agent boot` inside a jail; see [`boot`].
pub fn boot_agent(serve: impl FnOnce(std::os::unix::net::UnixListener) -> anyhow::Result<()>) -> ! {
    boot::run(serve)
}

pub struct JailSubstrate {
    layout: Layout,
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
        Ok(Self { layout, building: Mutex::new(()) })
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
        validate_name(&recipe.name).map_err(|e| anyhow!(e))?;
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
        validate_id(&spec.id).map_err(|e| anyhow!(e))?;
        validate_name(&spec.template).map_err(|e| anyhow!(e))?;
        let template = self
            .template_snapshots()?
            .into_iter()
            .find(|t| t.template == spec.template)
            .ok_or_else(|| anyhow!("template {} is not built", spec.template))?;
        let mut executor = Executor::new(None);
        let created = executor.run_all(&sandbox::create(&self.layout, spec, template.guid)).and_then(|()| {
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

    fn destroy(&self, id: &str) -> anyhow::Result<()> {
        if validate_id(id).is_err() {
            // No sandbox can have such an id, so there is nothing to remove.
            return Ok(());
        }
        self.destroy_with(id, &self.observe()?)
    }

    fn is_alive(&self, id: &str, placement: &Placement) -> bool {
        sys::find(&jail_name(id)).is_ok_and(|jid| jid == Some(placement.init_pid))
    }

    fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        validate_id(id).map_err(|e| anyhow!(e))?;
        let mut usage = rctl::parse_usage(&run_cmd(&rctl::usage(id), None)?).map_err(|e| anyhow!(e))?;
        let used = run_cmd(&zfs::get_number(&self.layout.sandbox_dataset(id), "used"), None)?;
        usage.disk_bytes = zfs::parse_number(&used).map_err(|e| anyhow!(e))?;
        Ok(usage)
    }

    fn capabilities(&self) -> crate::Capabilities {
        crate::Capabilities { memory_snapshots: false }
    }

    // Lifecycle on jails (SIGSTOP/SIGCONT, zfs snapshot/clone/rollback/send)
    // is the FreeBSD issue's remaining work; until it lands these refuse.
    fn pause(&self, _id: &str) -> anyhow::Result<()> {
        bail!("pause is not implemented on the FreeBSD substrate yet")
    }

    fn resume(&self, _id: &str) -> anyhow::Result<()> {
        bail!("resume is not implemented on the FreeBSD substrate yet")
    }

    fn snapshot(&self, _id: &str, _snapshot_id: &str) -> anyhow::Result<crate::SnapshotInfo> {
        bail!("snapshots are not implemented on the FreeBSD substrate yet")
    }

    fn snapshots(&self) -> anyhow::Result<Vec<crate::SnapshotInfo>> {
        Ok(Vec::new())
    }

    fn delete_snapshot(&self, _snapshot_id: &str) -> anyhow::Result<()> {
        Ok(())
    }

    fn rollback(&self, _spec: &SandboxSpec, _snapshot_id: &str) -> anyhow::Result<Placement> {
        bail!("rollback is not implemented on the FreeBSD substrate yet")
    }

    fn export_snapshot(&self, _snapshot_id: &str, _out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        bail!("snapshot export is not implemented on the FreeBSD substrate yet")
    }

    fn import_snapshot(
        &self,
        _snapshot_id: &str,
        _input: &mut dyn std::io::Read,
    ) -> anyhow::Result<crate::SnapshotInfo> {
        bail!("snapshot import is not implemented on the FreeBSD substrate yet")
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
        Ok(Recovery { adopted: decision.adopt, removed: decision.destroy })
    }
}

fn info(t: zfs::TemplateSnapshot) -> TemplateInfo {
    TemplateInfo { name: t.template, built_at: t.built_at, size_bytes: t.referenced }
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
