//! The Linux substrate: namespaces, overlayfs and cgroups.
//!
//! Builds nothing on other hosts: everything below is Linux-only, and
//! `copse-host` depends on this crate only on Linux. The boot sequence that
//! runs inside a sandbox is `copse_jailer::linux::boot`; this crate plans
//! it and starts it.
//!
//! Host layout under the state directory:
//! - `templates/<name>/rootfs`: read-only lower layers (see [`rootfs`]);
//! - `sandboxes/<id>/owner`: the host uid owning the sandbox's user
//!   namespace (see [`ids`]);
//! - `disk/<id>/{upper,work}`: each sandbox's private layer, a btrfs
//!   subvolume limited to the sandbox's `disk_mb` (see [`disk`]), owned by
//!   the sandbox's root (host uid [`ids::BASE`]);
//! - `id-base`: the host id every file a sandbox sees is shifted by
//!   (see [`ids::migrate`]);
//! - `criu-action`: CRIU's action script for restores (see [`checkpoint`]);
//! - `sandboxes/<id>/run/agent.sock`: the agent's socket, bound from inside
//!   the sandbox on this directory (mounted there at `/.copse/run`); the
//!   gateway's socket path (`run/<id>.sock`) is a symlink to it, and the
//!   gateway reaches it only through [`agent_socket`], which never follows
//!   what the sandbox puts there;
//! - `checkpoints/<snapshot>`: CRIU images of a memory snapshot, beside
//!   its file layers (see [`checkpoint`]);
//! - `agent/copse-agent`: the agent binary every sandbox mounts read-only
//!   at `/.copse/bin`, so its processes run from a file inside the sandbox;
//! - cgroup `copse-<hash of the state dir>/<id>` in every hierarchy.
//!
//! Mounts exist only inside each sandbox's mount namespace (or the private
//! one its boot or restore makes on the host stage, `/run/copse/stage`),
//! with one exception made once per state directory and kept: the btrfs
//! file system at `disk/` (see [`disk`]).

#![cfg(target_os = "linux")]

pub mod agent_socket;
pub mod cgroup;
pub mod checkpoint;
mod criu_cache;
pub mod disk;
pub mod ids;
pub mod layers;
pub mod lazy;
pub mod lazy_pages;
pub mod rootfs;

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

use cgroup::{Cgroups, Hierarchy};
use checkpoint::{Criu, RestorePaths};
use copse_jailer::handoff::{AGENT_NAME, SOCKET_NAME};
use copse_jailer::linux::boot::{BootPlan, Launch, RestorePlan, VolumeBind};
use copse_jailer::linux::boot_report::BootReport;
use copse_substrate::{
    Capabilities, LayerImages, LazyMemory, Phases, Placement, Progress, Recipe, Recovery, SandboxSpec, SnapshotInfo,
    Substrate, SubstrateError, Support, TemplateInfo, Usage,
};
use disk::Disk;
use layers::{Base, LayerStore};
use rootfs::TemplateStore;

pub struct LinuxSubstrate {
    sandboxes: PathBuf,
    run: PathBuf,
    agent_binary: PathBuf,
    agent_dir: PathBuf,
    checkpoints: PathBuf,
    state_dir: PathBuf,
    /// Where the sandboxes' writable layers live (see [`disk`]).
    volumes: PathBuf,
    /// Found or made on first use, so opening a substrate to build
    /// templates or to list snapshots mounts nothing.
    disk: std::sync::OnceLock<Result<Disk, String>>,
    /// Found on first use: probing runs `criu check`.
    criu: std::sync::OnceLock<Result<Criu, String>>,
    templates: TemplateStore,
    layers: LayerStore,
    cgroups: Cgroups,
    owners: ids::Owners,
    network: Option<copse_cubenet::linux::HostNetwork>,
}

impl LinuxSubstrate {
    pub fn open(state_dir: &Path, agent_binary: &Path) -> anyhow::Result<Self> {
        let sandboxes = state_dir.join("sandboxes");
        let run = state_dir.join("run");
        for dir in [&sandboxes, &run] {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        ids::migrate(state_dir).context("moving the state directory's files into the sandbox id range")?;
        let agent_dir = state_dir.join("agent");
        // Template builds need no agent, so they can run while it compiles;
        // booting a sandbox without one fails in `launch`.
        if agent_binary.is_file() {
            install_agent(agent_binary, &agent_dir)?;
        }
        // Sandbox inits are orphaned by their short-lived boot process; as
        // subreaper the gateway inherits them and can reap them on kill.
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        Ok(Self {
            sandboxes,
            run,
            agent_binary: agent_binary.to_path_buf(),
            agent_dir,
            checkpoints: state_dir.join("checkpoints"),
            state_dir: state_dir.to_path_buf(),
            volumes: disk::volumes_dir(state_dir),
            disk: std::sync::OnceLock::new(),
            criu: std::sync::OnceLock::new(),
            templates: TemplateStore::new(state_dir),
            layers: LayerStore::open(state_dir)?,
            cgroups: Cgroups::new(Hierarchy::detect()?, state_dir),
            owners: ids::Owners::new(Path::new(ids::OWNERS_DIR)),
            network: None,
        })
    }

    /// Sandboxes whose spec asks for a network join `config`'s bridge.
    pub fn with_network(mut self, config: copse_cubenet::NetConfig) -> anyhow::Result<Self> {
        self.network = Some(copse_cubenet::linux::HostNetwork::open(config)?);
        Ok(self)
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.sandboxes.join(id)
    }

    /// The sandbox's writable layer (overlay upper and work directories).
    fn volume(&self, id: &str) -> PathBuf {
        self.volumes.join(id)
    }

    fn disk(&self) -> anyhow::Result<&Disk> {
        match self.disk.get_or_init(|| Disk::open(&self.state_dir).map_err(|e| format!("{e:#}"))) {
            Ok(disk) => Ok(disk),
            Err(reason) => Err(SubstrateError::Unavailable(format!(
                "sandbox disk quotas are unavailable on this host, so no sandbox can start: {reason}"
            ))
            .into()),
        }
    }

    fn boot_plan(&self, spec: &SandboxSpec, base: &Base, stage: PathBuf, owner: u32) -> BootPlan {
        let dir = self.sandbox_dir(&spec.id);
        let volume = self.volume(&spec.id);
        let mut lowers: Vec<PathBuf> = base.layers.iter().map(|l| self.layers.layer_dir(l)).collect();
        lowers.push(self.templates.rootfs(&base.template));
        BootPlan {
            hostname: spec.id.chars().take(63).collect(),
            lowers,
            upper: volume.join("upper"),
            work: volume.join("work"),
            stage,
            cgroup_procs: self.cgroups.procs_files(&spec.id),
            agent_dir: self.agent_dir.clone(),
            socket_dir: dir.join("run"),
            ids: ids::map(owner),
            volumes: Vec::new(),
        }
    }

    /// Who holds an owner uid claimed for sandbox `id`.
    fn owner_holder(&self, id: &str) -> String {
        format!("{}:{id}", self.state_dir.display())
    }

    /// Claims the owner of sandbox `id`'s user namespace, recorded in its
    /// directory so that [`Self::destroy`] gives it back.
    fn claim_owner(&self, id: &str) -> anyhow::Result<u32> {
        let owner = self.owners.claim(&self.owner_holder(id))?;
        let path = self.sandbox_dir(id).join("owner");
        fs::write(&path, owner.to_string()).with_context(|| format!("writing {}", path.display()))?;
        Ok(owner)
    }

    fn release_owner(&self, id: &str) {
        let recorded = fs::read_to_string(self.sandbox_dir(id).join("owner")).ok();
        if let Some(owner) = recorded.and_then(|s| s.trim().parse().ok()) {
            self.owners.release(owner, &self.owner_holder(id));
        }
    }

    /// What the sandbox stacks on, as recorded at its boot.
    fn base(&self, id: &str) -> anyhow::Result<Base> {
        let path = self.sandbox_dir(id).join("base.json");
        let bytes = fs::read(&path).with_context(|| format!("sandbox {id} has no {}", path.display()))?;
        Ok(serde_json::from_slice(&bytes)?)
    }

    /// Everything a sandbox needs on the host before its processes start:
    /// directories, the pinned layers (of `snapshot`, if any), cgroups and
    /// the gateway's socket link. Returns its boot plan.
    fn prepare(&self, spec: &SandboxSpec, snapshot: Option<&str>, phases: &mut Phases) -> anyhow::Result<BootPlan> {
        let dir = self.sandbox_dir(&spec.id);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let base = phases.time("layers", || self.layers.pin(&dir, snapshot, &spec.template))?;
        if self.templates.get(&base.template).is_none() {
            return Err(SubstrateError::NotFound(format!("template {} is not built", base.template)).into());
        }
        let owner = phases.time("owner", || self.claim_owner(&spec.id))?;
        let mut plan = self.boot_plan(spec, &base, ids::ensure_stage()?, owner);
        plan.volumes = self.volume_binds(spec)?;
        // Before anything is written in it: the limit holds from the first byte.
        phases.time("disk", || self.disk()?.create(&spec.id, spec.limits.disk_mb))?;
        let dirs = std::time::Instant::now();
        for dir in [&plan.upper, &plan.work, &plan.socket_dir] {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            // The sandbox's root writes there (the overlay's root directory
            // is the upper directory's; the agent binds its socket).
            std::os::unix::fs::lchown(dir, Some(ids::BASE), Some(ids::BASE))
                .with_context(|| format!("handing {} to the sandbox's root", dir.display()))?;
        }
        phases.note("dirs", dirs.elapsed());
        phases.time("cgroups", || self.cgroups.create(&spec.id, &spec.limits))?;
        link_socket(&plan.socket_dir, &spec.agent_socket)?;
        Ok(plan)
    }

    /// Where each of the spec's volumes comes from on the host.
    fn volume_binds(&self, spec: &SandboxSpec) -> anyhow::Result<Vec<VolumeBind>> {
        let mut binds = Vec::with_capacity(spec.volumes.len());
        for mount in &spec.volumes {
            copse_substrate::template::validate_name(&mount.volume).map_err(SubstrateError::Invalid)?;
            let source = self.disk()?.persistent(&mount.volume);
            if !source.is_dir() {
                return Err(SubstrateError::NotFound(format!("volume {} not found", mount.volume)).into());
            }
            binds.push(VolumeBind { source, target: mount.path.clone() });
        }
        Ok(binds)
    }

    /// Runs `copse-agent boot` with `launch` on its standard input; returns
    /// what it printed, or its error output.
    fn launch(&self, launch: &Launch) -> anyhow::Result<String> {
        if !self.agent_binary.is_file() {
            bail!("agent binary {} not found (build it with `mise run build`)", self.agent_binary.display());
        }
        let mut child = Command::new(&self.agent_binary)
            .arg("boot")
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting the boot process")?;
        child.stdin.take().expect("piped").write_all(&serde_json::to_vec(launch)?)?;
        let output = child.wait_with_output()?;
        if !output.status.success() {
            bail!("{}: {}", output.status, String::from_utf8_lossy(&output.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    fn boot(&self, spec: &SandboxSpec, phases: &mut Phases) -> anyhow::Result<Placement> {
        let plan = self.prepare(spec, spec.snapshot.as_deref(), phases)?;
        let launched = std::time::Instant::now();
        let printed = self.launch(&Launch::Boot(plan)).context("sandbox boot failed")?;
        let launch = launched.elapsed();
        let report = BootReport::parse(&printed)?;
        // What the boot process's own clock did not see: starting it and
        // handing it the plan.
        let inside: std::time::Duration = report.steps.iter().map(|(_, took)| *took).sum();
        phases.note("jail_spawn", launch.saturating_sub(inside));
        phases.extend_prefixed("jail_", report.steps);
        let pid = report.init_pid;
        let init_start = process_start_time(pid).context("init vanished right after boot")?;
        Ok(Placement { init_pid: pid, init_start })
    }

    fn criu(&self) -> anyhow::Result<&Criu> {
        match self.criu.get_or_init(|| Criu::find().map_err(|e| format!("{e:#}"))) {
            Ok(criu) => Ok(criu),
            Err(reason) => {
                Err(SubstrateError::Unavailable(format!("memory snapshots are unavailable on this host: {reason}"))
                    .into())
            }
        }
    }

    fn checkpoint_dir(&self, snapshot_id: &str) -> PathBuf {
        self.checkpoints.join(snapshot_id)
    }

    /// Where snapshot `snapshot_id`'s checkpoint is, not a link to it (tar
    /// archives a link as a link): its directory, or the memory layer a
    /// lazily fetched one links to; `None` without memory.
    fn checkpoint_source(&self, snapshot_id: &str) -> anyhow::Result<Option<PathBuf>> {
        if !self.checkpoint_dir(snapshot_id).is_dir() {
            return Ok(None);
        }
        Ok(Some(self.layers.memory_layer_dir(snapshot_id)?.unwrap_or_else(|| self.checkpoint_dir(snapshot_id))))
    }

    /// Removes the checkpoints of snapshots that are gone: one a crash cut
    /// short, or one whose lazy layers a restart could not mount again
    /// (`recover_lazy` drops its file, to be fetched again).
    fn remove_stray_checkpoints(&self) -> anyhow::Result<()> {
        for entry in fs::read_dir(&self.checkpoints).into_iter().flatten().filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if copse_substrate::template::validate_name(&name).is_ok() && self.layers.get(&name)?.is_none() {
                tracing::info!(snapshot = %name, "removing the checkpoint of a snapshot that is gone");
                fs::remove_dir_all(entry.path()).with_context(|| format!("removing {}", entry.path().display()))?;
            }
        }
        Ok(())
    }

    /// The sandbox's init: the process of its cgroup that is pid 1 in its
    /// own pid namespace.
    fn init_pid(&self, id: &str) -> anyhow::Result<i32> {
        self.cgroups
            .pids(id)
            .into_iter()
            .find(|pid| {
                fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                    s.lines().any(|l| l.starts_with("NSpid:") && l.split_whitespace().last() == Some("1"))
                })
            })
            .with_context(|| format!("sandbox {id} has no running init"))
    }

    /// Checkpoints a frozen sandbox's processes as `snapshot_id`.
    fn dump(&self, id: &str, snapshot_id: &str) -> anyhow::Result<()> {
        let criu = self.criu()?;
        let init = self.init_pid(id)?;
        // A lazily restored sandbox's pages not copied in yet would be
        // saved as zeros.
        lazy_pages::wait_for_copy(&self.sandbox_dir(id).join(lazy_pages::WORK_DIR), COPY_WAIT)?;
        let images = self.checkpoint_dir(snapshot_id);
        // A snapshot of this id that was fetched lazily is replaced: its
        // checkpoint is a link to a read-only image.
        if images.is_symlink() {
            fs::remove_file(&images).context("removing the replaced checkpoint's link")?;
        }
        let dumped = criu.dump(init, &images, &self.cgroups.freezer_dir(id));
        if dumped.is_err() {
            let _ = fs::remove_dir_all(&images);
        }
        dumped
    }

    /// Like [`Self::boot`], for a sandbox whose snapshot holds memory: its
    /// processes are restored from the checkpoint instead of started.
    fn restore(&self, spec: &SandboxSpec, snapshot_id: &str, phases: &mut Phases) -> anyhow::Result<Placement> {
        let Criu { binary: criu, lazy_pages } = self.criu()?.clone();
        let sandbox = self.prepare(spec, Some(snapshot_id), phases)?;
        let restoring = std::time::Instant::now();
        let work_dir = self.sandbox_dir(&spec.id).join(lazy_pages::WORK_DIR);
        fs::create_dir_all(&work_dir).with_context(|| format!("creating {}", work_dir.display()))?;
        let pidfile = work_dir.join(lazy_pages::RESTORED_PID);
        let images = self.checkpoint_dir(snapshot_id);
        let action_script = self.criu_action_script()?;
        let pager = match lazy_pages && lazy_pages::worth_it(&images) {
            true => lazy_pages::Pager::start(&criu, &images, &work_dir)
                .inspect_err(|e| tracing::warn!(id = %spec.id, "restoring eagerly: {e:#}"))
                .ok(),
            false => None,
        };
        let args = checkpoint::restore_args(
            &RestorePaths {
                images: &images,
                root: &sandbox.stage_root(),
                agent_dir: &sandbox.stage_agent(),
                socket_dir: &sandbox.stage_socket(),
                pidfile: &pidfile,
                action_script: &action_script,
            },
            pager.is_some(),
        );
        let hostname = sandbox.hostname.clone();
        let restored = self.launch(&Launch::Restore(RestorePlan { sandbox, criu, args })).map_err(|e| {
            let log = checkpoint::log_tail(&work_dir.join("restore.log"));
            tracing::error!(id = %spec.id, snapshot = snapshot_id, log = %log, "criu restore failed: {e:#}");
            anyhow::anyhow!(
                "CRIU could not restore sandbox {} from {snapshot_id} (its log is in the gateway's log)",
                spec.id
            )
        });
        let placed = restored.and_then(|_| self.restored_init(&pidfile, &hostname));
        let (pid, init_start) = match placed {
            Ok((pid, init_start)) => {
                if let Some(pager) = pager {
                    pager.watch(pid, init_start);
                }
                (pid, init_start)
            }
            Err(e) => {
                if let Some(pager) = pager {
                    pager.abandon();
                }
                return Err(e);
            }
        };
        phases.note("criu", restoring.elapsed());
        Ok(Placement { init_pid: pid, init_start })
    }

    /// The init CRIU restored (its pid and start time), renamed for its
    /// new sandbox.
    fn restored_init(&self, pidfile: &Path, hostname: &str) -> anyhow::Result<(i32, u64)> {
        let pid: i32 = fs::read_to_string(pidfile)
            .context("CRIU wrote no pid file")?
            .trim()
            .parse()
            .context("CRIU's pid file holds no pid")?;
        // The checkpoint carries the source's host name; this is a new sandbox.
        set_hostname(pid, hostname)?;
        let init_start = process_start_time(pid).context("init vanished right after restore")?;
        Ok((pid, init_start))
    }

    /// CRIU runs its action script by path, without arguments: a script
    /// that runs the installed agent's `criu-action`.
    fn criu_action_script(&self) -> anyhow::Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let agent = self.agent_dir.join(AGENT_NAME);
        let agent =
            agent.to_str().filter(|a| !a.contains('\'')).context("the state directory's path cannot be quoted")?;
        let script = self.state_dir.join("criu-action");
        let text = format!("#!/bin/sh\nexec '{agent}' criu-action\n");
        if fs::read_to_string(&script).ok().as_deref() != Some(text.as_str()) {
            let partial = self.state_dir.join(".criu-action.partial");
            fs::write(&partial, &text).with_context(|| format!("writing {}", partial.display()))?;
            fs::set_permissions(&partial, fs::Permissions::from_mode(0o700))?;
            fs::rename(&partial, &script).with_context(|| format!("installing {}", script.display()))?;
        }
        Ok(script)
    }

    /// Deletes the sandbox's writable layer, and with it its quota.
    fn remove_volume(&self, id: &str) -> anyhow::Result<()> {
        let volume = self.volume(id);
        if !volume.exists() {
            return Ok(());
        }
        match self.disk() {
            Ok(disk) => disk.remove(id),
            // Not on the quota file system (it could not be mounted): a
            // plain directory on the state directory's own.
            Err(_) => fs::remove_dir_all(&volume).with_context(|| format!("removing {}", volume.display())),
        }
    }

    /// Ids of every sandbox that has anything on this host.
    fn resident_ids(&self) -> Vec<String> {
        let mut ids = self.cgroups.existing();
        ids.extend(disk::ids_in(&self.volumes));
        for dir in [&self.sandboxes, &self.run] {
            if let Ok(entries) = fs::read_dir(dir) {
                for entry in entries.filter_map(Result::ok) {
                    if let Some(name) = entry.file_name().to_str() {
                        ids.push(name.trim_end_matches(".sock").to_string());
                    }
                }
            }
        }
        ids.sort();
        ids.dedup();
        ids
    }
}

impl Substrate for LinuxSubstrate {
    fn name(&self) -> &'static str {
        "linux-namespaces"
    }

    fn templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        self.templates.list()
    }

    fn ensure_template(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        copse_substrate::template::check_backend(recipe, &[copse_substrate::template::Backend::Jail])?;
        self.templates.ensure(recipe, progress)
    }

    fn import_template(
        &self,
        name: &str,
        fingerprint: &str,
        fill: &mut dyn FnMut(&std::path::Path) -> anyhow::Result<()>,
        progress: Progress<'_>,
    ) -> anyhow::Result<TemplateInfo> {
        self.templates.import(name, fingerprint, fill, progress)
    }

    fn delete_template(&self, name: &str) -> anyhow::Result<bool> {
        copse_substrate::template::validate_name(name).map_err(SubstrateError::Invalid)?;
        if self.templates.get(name).is_none() {
            return Err(SubstrateError::NotFound(format!("template {name} not found")).into());
        }
        self.layers.unless_stacked_on(name, &self.sandboxes, || self.templates.remove(name))
    }

    fn create(&self, spec: &SandboxSpec) -> anyhow::Result<Placement> {
        self.create_timed(spec, &mut Phases::default())
    }

    fn create_timed(&self, spec: &SandboxSpec, phases: &mut Phases) -> anyhow::Result<Placement> {
        copse_substrate::template::validate_name(&spec.id).map_err(SubstrateError::Invalid)?;
        let memory = spec.snapshot.as_deref().filter(|s| self.checkpoint_dir(s).is_dir());
        let mut boot_and_attach = || {
            let placement = match memory {
                Some(snapshot) => self.restore(spec, snapshot, phases)?,
                None => self.boot(spec, phases)?,
            };
            if let (Some(network), Some(wanted)) = (&self.network, &spec.network) {
                let attached = std::time::Instant::now();
                let steps = network.attach(&spec.id, placement.init_pid, wanted)?;
                phases.note("attach", attached.elapsed());
                phases.extend_prefixed("attach_", steps);
            }
            Ok(placement)
        };
        boot_and_attach().inspect_err(|_| {
            let _ = self.destroy(&spec.id);
        })
    }

    fn destroy(&self, id: &str) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(id).map_err(SubstrateError::Invalid)?;
        if let Some(network) = &self.network {
            network.detach(id)?;
        }
        self.cgroups.destroy(id)?;
        self.remove_volume(id)?;
        self.release_owner(id);
        let dir = self.sandbox_dir(id);
        let stacked = self.base(id).is_ok_and(|b| !b.layers.is_empty());
        match fs::remove_dir_all(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", dir.display()));
            }
            _ => {}
        }
        let _ = fs::remove_file(self.run.join(format!("{id}.sock")));
        if stacked {
            self.layers.collect_garbage(&self.sandboxes)?;
        }
        Ok(())
    }

    fn is_alive(&self, _id: &str, placement: &Placement) -> bool {
        let alive = process_start_time(placement.init_pid) == Some(placement.init_start);
        if !alive && cgroup::parent_of(placement.init_pid) == Some(std::process::id() as i32) {
            // An init that died on its own is our zombie until reaped.
            // SAFETY: non-blocking waitpid on a child of this process.
            unsafe { libc::waitpid(placement.init_pid, std::ptr::null_mut(), libc::WNOHANG) };
        }
        alive
    }

    fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        let mut usage = self.cgroups.usage(id)?;
        usage.disk_bytes = match self.disk() {
            Ok(disk) => disk.used(id)?,
            Err(_) => rootfs::tree_size(&self.volume(id).join("upper")),
        };
        Ok(usage)
    }

    fn capabilities(&self) -> Capabilities {
        let memory_snapshots = match self.criu() {
            Ok(_) => Support::Yes,
            Err(e) => Support::Missing(format!("{e:#}")),
        };
        Capabilities { memory_snapshots }
    }

    fn pause(&self, id: &str) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(id).map_err(SubstrateError::Invalid)?;
        self.cgroups.set_frozen(id, true)
    }

    fn resume(&self, id: &str) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(id).map_err(SubstrateError::Invalid)?;
        self.cgroups.set_frozen(id, false)
    }

    fn snapshot(&self, id: &str, snapshot_id: &str, memory: bool) -> anyhow::Result<SnapshotInfo> {
        for name in [id, snapshot_id] {
            copse_substrate::template::validate_name(name).map_err(SubstrateError::Invalid)?;
        }
        let below = self.base(id)?;
        // Frozen, nothing in the sandbox can write while the upper layer is
        // copied, so the copy is one instant of its files.
        let was_frozen = self.cgroups.is_frozen(id);
        if !was_frozen {
            self.cgroups.set_frozen(id, true)?;
        }
        let mut taken = self.layers.capture(snapshot_id, &self.volume(id).join("upper"), &below);
        if memory && let Ok(info) = &mut taken {
            // Still frozen: memory is of the same instant as the files.
            match self.dump(id, snapshot_id) {
                Ok(()) => info.memory = true,
                Err(e) => {
                    let _ = self.layers.delete(snapshot_id, &self.sandboxes);
                    taken = Err(e);
                }
            }
        }
        // CRIU thaws what it froze; put the freezer back as it was.
        self.cgroups.set_frozen(id, was_frozen)?;
        // Thawed first: the sandbox need not wait for the disk.
        if let Ok(info) = &taken
            && info.memory
        {
            layers::sync_filesystem(&self.checkpoint_dir(snapshot_id))?;
        }
        taken
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotInfo>> {
        let mut all = self.layers.list()?;
        for info in &mut all {
            info.memory = self.checkpoint_dir(&info.id).is_dir();
        }
        Ok(all)
    }

    fn delete_snapshot(&self, snapshot_id: &str) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(snapshot_id).map_err(SubstrateError::Invalid)?;
        match fs::remove_dir_all(self.checkpoint_dir(snapshot_id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e).context("removing the checkpoint"),
            _ => {}
        }
        self.layers.delete(snapshot_id, &self.sandboxes)
    }

    fn rollback(&self, spec: &SandboxSpec, snapshot_id: &str) -> anyhow::Result<Placement> {
        if self.layers.get(snapshot_id)?.is_none() {
            return Err(SubstrateError::NotFound(format!("snapshot {snapshot_id} not found")).into());
        }
        // Files cannot be swapped under a mounted overlay, so the sandbox
        // restarts on the snapshot's layers under its own id.
        self.destroy(&spec.id)?;
        self.create(&SandboxSpec { snapshot: Some(snapshot_id.to_string()), ..spec.clone() })
    }

    fn export_snapshot(&self, snapshot_id: &str, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        let checkpoint = self.checkpoint_source(snapshot_id)?;
        self.layers.export(snapshot_id, checkpoint.as_deref(), ids::BASE, out)
    }

    fn import_snapshot(&self, snapshot_id: &str, input: &mut dyn std::io::Read) -> anyhow::Result<SnapshotInfo> {
        copse_substrate::template::validate_name(snapshot_id).map_err(SubstrateError::Invalid)?;
        self.layers.import(snapshot_id, &self.checkpoint_dir(snapshot_id), ids::BASE, input)
    }

    fn layer_images(&self, snapshot_id: &str, into: &Path) -> anyhow::Result<Option<LayerImages>> {
        let checkpoint = self.checkpoint_source(snapshot_id)?;
        self.layers.images(snapshot_id, checkpoint.as_deref(), into).map(Some)
    }

    fn new_lazy_layer(&self, snapshot_id: &str) -> anyhow::Result<Option<(String, PathBuf)>> {
        copse_substrate::template::validate_name(snapshot_id).map_err(SubstrateError::Invalid)?;
        self.layers.new_lazy_layer(snapshot_id).map(Some)
    }

    fn discard_lazy_layer(&self, layer: &str) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(layer).map_err(SubstrateError::Invalid)?;
        self.layers.discard_lazy(layer)
    }

    fn export_checkpoint(&self, snapshot_id: &str, out: &mut dyn std::io::Write) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(snapshot_id).map_err(SubstrateError::Invalid)?;
        let Some(checkpoint) = self.checkpoint_source(snapshot_id)? else {
            return Err(SubstrateError::NotFound(format!("snapshot {snapshot_id} holds no memory")).into());
        };
        self.layers.export_checkpoint(&checkpoint, out)
    }

    fn import_lazy(
        &self,
        snapshot_id: &str,
        template: &str,
        layers: &[String],
        size_bytes: u64,
        memory: LazyMemory<'_>,
    ) -> anyhow::Result<SnapshotInfo> {
        copse_substrate::template::validate_name(snapshot_id).map_err(SubstrateError::Invalid)?;
        copse_substrate::template::validate_name(template).map_err(SubstrateError::Invalid)?;
        if !self.templates.rootfs(template).is_dir() {
            return Err(SubstrateError::Invalid(format!("template {template} is not on this host")).into());
        }
        // The memory first: the snapshot exists once its file does, and a
        // create that found it without its checkpoint would boot cold.
        let at = self.checkpoint_dir(snapshot_id);
        let imported = match memory {
            LazyMemory::None => return self.layers.import_lazy(snapshot_id, template, layers, None, size_bytes),
            LazyMemory::Whole(input) => self
                .layers
                .import_checkpoint(&at, input)
                .and_then(|()| self.layers.import_lazy(snapshot_id, template, layers, None, size_bytes)),
            LazyMemory::Served(layer) => {
                self.layers.import_lazy(snapshot_id, template, layers, Some((&layer, &at)), size_bytes)
            }
        };
        match imported {
            Ok(info) => Ok(SnapshotInfo { memory: true, ..info }),
            Err(e) => {
                let _ = fs::remove_dir_all(&at);
                Err(e)
            }
        }
    }

    fn recover(&self, known: &[(String, Placement)]) -> anyhow::Result<Recovery> {
        // Mounted first, so the sandboxes' layers are there to be found.
        if let Err(e) = self.disk() {
            tracing::error!("{e:#}");
        }
        self.layers.recover_lazy(&self.sandboxes)?;
        let mut recovery = Recovery::default();
        for (id, placement) in known {
            if self.is_alive(id, placement) {
                recovery.adopted.push(id.clone());
            }
        }
        for id in self.resident_ids() {
            if !recovery.adopted.contains(&id) {
                self.destroy(&id)?;
                recovery.removed.push(id);
            }
        }
        for (id, _) in known {
            if !recovery.adopted.contains(id) && !recovery.removed.contains(id) {
                recovery.removed.push(id.clone());
            }
        }
        self.layers.collect_garbage(&self.sandboxes)?;
        self.remove_stray_checkpoints()?;
        Ok(recovery)
    }

    fn update_network(&self, id: &str, policy: &copse_substrate::Policy) -> anyhow::Result<()> {
        match &self.network {
            Some(network) => network.update(id, policy),
            None => Err(SubstrateError::Unsupported(format!("sandbox {id}: no sandbox network configured")))?,
        }
    }

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

    fn recover_network(&self, known: &[(String, copse_substrate::SandboxNetwork)]) -> anyhow::Result<()> {
        self.network.as_ref().map_or(Ok(()), |network| network.reconcile(known))
    }

    fn host_memory(&self) -> Option<copse_substrate::HostMemory> {
        parse_meminfo(&fs::read_to_string("/proc/meminfo").ok()?)
    }

    fn settle(&self) {
        if let Some(network) = &self.network {
            network.settle();
        }
        if let Err(e) = self.layers.release_lazy(&self.sandboxes) {
            tracing::warn!("unmounting lazily fetched layers: {e:#}");
        }
    }

    fn create_volume(&self, id: &str, limit_bytes: u64) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(id).map_err(SubstrateError::Invalid)?;
        let dir = self.disk()?.create_persistent(id, limit_bytes)?;
        // The template's `user` (uid 1000 inside) owns the volume's root,
        // as it owns its home: what the SDK's commands run as can write.
        let user = ids::BASE + VOLUME_OWNER;
        std::os::unix::fs::lchown(&dir, Some(user), Some(user))
            .with_context(|| format!("handing {} to the sandbox's user", dir.display()))?;
        Ok(())
    }

    fn delete_volume(&self, id: &str) -> anyhow::Result<()> {
        copse_substrate::template::validate_name(id).map_err(SubstrateError::Invalid)?;
        self.disk()?.remove_persistent(id)
    }

    fn volume_location(&self, id: &str) -> anyhow::Result<copse_substrate::VolumeLocation> {
        copse_substrate::template::validate_name(id).map_err(SubstrateError::Invalid)?;
        let root = self.disk()?.persistent(id);
        if !root.is_dir() {
            return Err(SubstrateError::NotFound(format!("volume {id} not found")).into());
        }
        Ok(copse_substrate::VolumeLocation { root, id_base: ids::BASE })
    }

    fn volume_used(&self, id: &str) -> anyhow::Result<u64> {
        copse_substrate::template::validate_name(id).map_err(SubstrateError::Invalid)?;
        self.disk()?.persistent_used(id)
    }
}

/// Uid (and gid) inside a sandbox that owns a new volume's root: the
/// templates' `user`.
const VOLUME_OWNER: u32 = 1000;
/// How long a dump waits for a lazily restored sandbox's memory to be
/// copied in; far more than a copy of the largest memory a template allows
/// takes.
const COPY_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// Copy the agent binary to the directory sandboxes mount, unless the copy
/// there is already the same file. The copy goes through a rename, so
/// sandboxes running from an older copy keep their file.
fn install_agent(binary: &Path, dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let target = dir.join(AGENT_NAME);
    let same_size = fs::metadata(&target).ok().map(|m| m.len())
        == Some(fs::metadata(binary).with_context(|| format!("reading {}", binary.display()))?.len());
    // Contents are compared only when the sizes leave it open.
    if same_size && fs::read(&target).ok() == Some(fs::read(binary)?) {
        return Ok(());
    }
    let partial = dir.join(format!(".{}.partial", AGENT_NAME));
    fs::copy(binary, &partial).with_context(|| format!("copying {} to {}", binary.display(), partial.display()))?;
    fs::rename(&partial, &target).with_context(|| format!("installing {}", target.display()))
}

/// The gateway connects to `link`; the agent binds the socket from inside
/// the sandbox on `socket_dir`.
fn link_socket(socket_dir: &Path, link: &Path) -> anyhow::Result<()> {
    let _ = fs::remove_file(link);
    std::os::unix::fs::symlink(socket_dir.join(SOCKET_NAME), link)
        .with_context(|| format!("linking {}", link.display()))
}

/// Sets the host name in the UTS namespace of `pid`, from a thread of its
/// own: a thread may switch UTS namespaces, and the switch ends with it.
fn set_hostname(pid: i32, name: &str) -> anyhow::Result<()> {
    let uts = fs::File::open(format!("/proc/{pid}/ns/uts")).context("opening the sandbox's UTS namespace")?;
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> anyhow::Result<()> {
                nix::sched::setns(&uts, nix::sched::CloneFlags::CLONE_NEWUTS).context("entering the UTS namespace")?;
                nix::unistd::sethostname(name).context("setting the host name")
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the host name thread panicked"))?
    })
}

/// MemTotal and MemAvailable (the kernel's estimate of what can be
/// allocated without swapping) of `/proc/meminfo`, in MiB.
fn parse_meminfo(meminfo: &str) -> Option<copse_substrate::HostMemory> {
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().strip_suffix(" kB")?.parse::<u64>().ok())
    };
    Some(copse_substrate::HostMemory {
        total_mb: field("MemTotal")? / 1024,
        available_mb: field("MemAvailable")? / 1024,
    })
}

/// Start time (clock ticks since boot) of a live, non-zombie process.
pub fn process_start_time(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

fn parse_start_time(stat: &str) -> Option<u64> {
    // The command name may contain spaces and parentheses; fields resume
    // after the last ')'. State is field 3, start time field 22.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    if fields.first() == Some(&"Z") || fields.first() == Some(&"X") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_survives_odd_command_names_and_skips_zombies() {
        let live = "42 (a) b) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(parse_start_time(live), Some(98765));
        let zombie = "42 (x) Z 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 10";
        assert_eq!(parse_start_time(zombie), None);
    }

    #[test]
    fn meminfo_gives_total_and_available_in_mib() {
        let meminfo = "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   12288000 kB\n";
        let memory = parse_meminfo(meminfo).unwrap();
        assert_eq!((memory.total_mb, memory.available_mb), (24000, 12000));
        assert!(parse_meminfo("MemTotal: 1 kB\n").is_none(), "a kernel without MemAvailable says nothing");
        assert!(parse_meminfo(&std::fs::read_to_string("/proc/meminfo").unwrap()).unwrap().total_mb > 0);
    }

    #[test]
    fn a_checkpoint_outlives_its_snapshot_only_until_the_next_recovery() {
        let dir = tempfile::tempdir().unwrap();
        let substrate = LinuxSubstrate::open(dir.path(), &dir.path().join("no-agent")).unwrap();
        for name in ["kept", "stray"] {
            fs::create_dir_all(substrate.checkpoint_dir(name)).unwrap();
        }
        fs::create_dir_all(dir.path().join("snapshots")).unwrap();
        fs::write(dir.path().join("snapshots/kept.json"), r#"{"template":"base","layers":[],"size_bytes":0}"#).unwrap();
        substrate.remove_stray_checkpoints().unwrap();
        assert!(substrate.checkpoint_dir("kept").is_dir());
        assert!(!substrate.checkpoint_dir("stray").exists());
    }

    /// Refusals that need no root: nothing about them touches the kernel.
    #[test]
    fn unknown_and_malformed_names_are_typed_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let substrate = LinuxSubstrate::open(dir.path(), &dir.path().join("no-agent")).unwrap();
        let spec = SandboxSpec {
            id: "a".into(),
            template: "base".into(),
            limits: copse_substrate::Limits::default(),
            agent_socket: dir.path().join("a.sock"),
            snapshot: None,
            network: None,
            volumes: Vec::new(),
        };
        let kind = |err: anyhow::Error| SubstrateError::find(&err).cloned();
        assert_eq!(
            kind(substrate.rollback(&spec, "nope").unwrap_err()),
            Some(SubstrateError::NotFound("snapshot nope not found".into()))
        );
        assert!(matches!(kind(substrate.delete_snapshot("../x").unwrap_err()), Some(SubstrateError::Invalid(_))));
        let policy = copse_substrate::Policy::open();
        assert!(matches!(
            kind(substrate.update_network("a", &policy).unwrap_err()),
            Some(SubstrateError::Unsupported(_))
        ));
    }

    #[test]
    fn this_process_has_a_start_time() {
        assert!(process_start_time(std::process::id() as i32).is_some());
    }
}
