//! Booting a sandbox: the privileged sequence that turns a plan into a
//! running, isolated init with the agent beside it.
//!
//! The Linux substrate (`copse-namespaces`) computes a [`BootPlan`] and starts `copse-agent boot` with it
//! on standard input. That process (fresh, single-threaded) joins the
//! sandbox's cgroup and, still host root, mounts the overlay root and the
//! agent's and socket's directories on the stage (see [`BootPlan::stage`]) in
//! a private mount namespace of its own. It then creates the sandbox's user
//! namespace with the per-sandbox owner uid as its euid (see [`IdMap`]),
//! has a helper that stayed host root write the id maps, becomes root of
//! that namespace, unshares every other namespace inside it, and forks the
//! sandbox's init. Init makes itself a session leader, builds the root
//! filesystem inside its private mount namespace (so no mount is ever
//! visible on the host, and all of them vanish with the namespace), pivots
//! into it, and re-executes the
//! agent binary from inside the sandbox (`copse-agent boot --init`, see
//! [`run_init`]). That second stage binds the agent's socket on the
//! sandbox's socket directory, forks the agent, and reaps orphans until the
//! agent exits. The boot process reports init's host pid and the time of
//! each step on standard output (see [`super::boot_report`]) and exits.
//!
//! Everything a sandbox's processes hold therefore lives inside the sandbox:
//! their executable, their socket, their session. That is what lets CRIU
//! checkpoint the whole tree (see `copse-namespaces`' `checkpoint`).

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, chdir, fork, pivot_root, sethostname};
use serde::{Deserialize, Serialize};

use super::boot_report::{Laps, parse_steps, render_steps};
use crate::handoff::{AGENT_MOUNT, AGENT_NAME, SOCKET_MOUNT, SOCKET_NAME};

/// The fd on which the second stage of init finds the readiness pipe.
const REPORT_FD: i32 = 3;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootPlan {
    pub hostname: String,
    /// Read-only lower layers, uppermost first: the layers of the snapshot
    /// the sandbox starts from (if any), then the template root.
    pub lowers: Vec<PathBuf>,
    /// The sandbox's private writable layer and overlayfs scratch space.
    pub upper: PathBuf,
    pub work: PathBuf,
    /// Host directory holding the empty mount points [`STAGE_ROOT`],
    /// [`STAGE_AGENT`] and [`STAGE_SOCKET`], each mounted only in a private
    /// mount namespace (so every sandbox shares them). Unlike the state
    /// directory (0700 host root), the sandbox's user namespace can reach
    /// it: whatever it mounts must be found there by path from inside.
    pub stage: PathBuf,
    /// `cgroup.procs` files to join before unsharing.
    pub cgroup_procs: Vec<PathBuf>,
    /// Host directory holding the agent binary, shared by every sandbox.
    pub agent_dir: PathBuf,
    /// Host directory for this sandbox's agent socket.
    pub socket_dir: PathBuf,
    pub ids: IdMap,
    /// Host directories bound read-write into the sandbox, in order.
    #[serde(default)]
    pub volumes: Vec<VolumeBind>,
}

/// A host directory (a persistent volume) and the absolute path it appears
/// at inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeBind {
    pub source: PathBuf,
    pub target: String,
}

/// Names of the mount points under [`BootPlan::stage`].
pub const STAGE_ROOT: &str = "root";
pub const STAGE_AGENT: &str = "bin";
pub const STAGE_SOCKET: &str = "run";
/// Holds one numbered mount point per volume, on a tmpfs of the private
/// mount namespace (volumes vary per sandbox; the stage is shared).
pub const STAGE_VOLUMES: &str = "volumes";

/// How a sandbox's ids map to the host's. Every sandbox maps its ids
/// 0..[`IdMap::RANGE`] to the same host range `base..` (so layers move
/// between sandboxes unchanged), while its user namespace is owned by a
/// host uid of its own, `owner`: the kernel charges per-user counts
/// (inotify instances, user namespaces, ...) of everything inside the
/// namespace to its owner too, so one sandbox cannot use up another's or
/// host root's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdMap {
    pub base: u32,
    pub owner: u32,
}

impl IdMap {
    /// Ids a sandbox has: uid and gid 0..65535, as on a classic system.
    pub const RANGE: u32 = 65536;

    /// The line written to `uid_map` and `gid_map`.
    pub fn map_line(&self) -> String {
        format!("0 {} {}", self.base, Self::RANGE)
    }
}

/// What `copse-agent boot` is asked to do, read from its standard input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "launch", rename_all = "snake_case")]
pub enum Launch {
    Boot(BootPlan),
    Restore(RestorePlan),
}

/// A sandbox restored from a memory checkpoint: the restore helper joins the
/// sandbox's cgroups, takes a private mount namespace holding the stage (as
/// a boot does), and runs CRIU there, which recreates the user namespace
/// (owned by the plan's owner uid: `CRIU_USERNS_OWNER`, see
/// `patches/criu/userns-owner.patch`) and every namespace inside it. `sandbox` is
/// the plan the sandbox would boot with; its stage, layers, ids and cgroups apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestorePlan {
    pub sandbox: BootPlan,
    pub criu: PathBuf,
    pub args: Vec<String>,
}

impl BootPlan {
    pub fn overlay_options(&self) -> String {
        format!(
            "lowerdir={},upperdir={},workdir={},volatile",
            self.lowers.iter().map(|l| l.display().to_string()).collect::<Vec<_>>().join(":"),
            self.upper.display(),
            self.work.display()
        )
    }

    pub fn stage_root(&self) -> PathBuf {
        self.stage.join(STAGE_ROOT)
    }

    pub fn stage_agent(&self) -> PathBuf {
        self.stage.join(STAGE_AGENT)
    }

    pub fn stage_socket(&self) -> PathBuf {
        self.stage.join(STAGE_SOCKET)
    }

    pub fn stage_volume(&self, index: usize) -> PathBuf {
        self.stage.join(STAGE_VOLUMES).join(index.to_string())
    }
}

/// Character devices a sandbox gets in its private /dev, bound from the host's.
pub const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// /proc files that would let uid 0 in the sandbox reach the host kernel;
/// made read-only (the sandbox has no capability to remount them).
pub const PROC_READ_ONLY: &[&str] = &["sys", "sysrq-trigger", "irq", "bus", "fs"];
/// Files hidden behind /dev/null and directories behind an empty read-only
/// tmpfs, paths from the root: at least runc's default masked paths, since
/// each leaks host kernel state (memory, keys, timers usable for side
/// channels, hardware) or lets root poke at firmware and power limits.
pub const MASKED_FILES: &[&str] = &[
    "proc/interrupts",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/sched_debug",
    "proc/timer_list",
    "proc/timer_stats",
];
pub const MASKED_DIRS: &[&str] =
    &["proc/acpi", "proc/asound", "proc/scsi", "sys/devices/virtual/powercap", "sys/firmware"];

/// Every mount of a host device node a sandbox may have: (its path from the
/// root, the device's name in the host's /dev). CRIU must be told about
/// them (external mounts): their file system's root is not in the sandbox.
pub fn device_mounts() -> impl Iterator<Item = (String, &'static str)> {
    DEVICES.iter().map(|d| (format!("dev/{d}"), *d)).chain(MASKED_FILES.iter().map(|f| (f.to_string(), "null")))
}

/// Entry point of `copse-agent boot`. Never returns: the process exits with
/// 0 once init reported a ready sandbox, 1 otherwise.
pub fn run_from_stdin() -> ! {
    let result = (|| -> anyhow::Result<()> {
        let mut input = String::new();
        std::io::stdin().read_to_string(&mut input).context("reading the boot plan")?;
        match serde_json::from_str(&input).context("parsing the boot plan")? {
            Launch::Boot(plan) => boot(&plan),
            Launch::Restore(plan) => restore(&plan),
        }
    })();
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("copse boot: {e:#}");
            std::process::exit(1)
        }
    }
}

fn join_cgroups(procs_files: &[PathBuf]) -> anyhow::Result<()> {
    let pid = std::process::id().to_string();
    for procs in procs_files {
        fs::write(procs, &pid).with_context(|| format!("joining {}", procs.display()))?;
    }
    Ok(())
}

/// Sets the stage for CRIU and becomes it: see [`RestorePlan`]. Returns
/// only on failure.
fn restore(plan: &RestorePlan) -> anyhow::Result<()> {
    let sandbox = &plan.sandbox;
    join_cgroups(&sandbox.cgroup_procs)?;
    mount_stage(sandbox)?;
    let error = std::process::Command::new(&plan.criu)
        .args(&plan.args)
        .env("CRIU_USERNS_OWNER", sandbox.ids.owner.to_string())
        .exec();
    Err(error).with_context(|| format!("executing {}", plan.criu.display()))
}

/// In a private mount namespace of this process, as host root: the overlay
/// root and the agent's and socket's directories on the stage. They are
/// mounted here because the sandbox's ids cannot traverse the state
/// directory; the copies the sandbox's mount namespace gets are locked
/// to it (it cannot unmount them to see what they cover, nor make the
/// agent's directory writable).
fn mount_stage(plan: &BootPlan) -> anyhow::Result<()> {
    let none: Option<&str> = None;
    unshare(CloneFlags::CLONE_NEWNS).context("unsharing the mount namespace")?;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none).context("making / private")?;
    mount(
        Some("overlay"),
        &plan.stage_root(),
        Some("overlay"),
        MsFlags::empty(),
        Some(plan.overlay_options().as_str()),
    )
    .context("mounting the overlay root")?;
    let agent = plan.stage_agent();
    mount(Some(&plan.agent_dir), &agent, none, MsFlags::MS_BIND, none).context("mounting the agent directory")?;
    let read_only = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(none, &agent, none, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | read_only, none)
        .context("making the agent directory read-only")?;
    let sockets = plan.stage_socket();
    mount(Some(&plan.socket_dir), &sockets, none, MsFlags::MS_BIND, none).context("mounting the socket directory")?;
    mount(none, &sockets, none, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV, none)
        .context("restricting the socket directory")?;
    if !plan.volumes.is_empty() {
        let volumes = plan.stage.join(STAGE_VOLUMES);
        mount(
            Some("tmpfs"),
            &volumes,
            Some("tmpfs"),
            read_only.difference(MsFlags::MS_RDONLY),
            Some("mode=755,size=64k"),
        )
        .context("mounting the volumes' stage")?;
        for (index, volume) in plan.volumes.iter().enumerate() {
            let point = plan.stage_volume(index);
            fs::create_dir(&point).with_context(|| format!("creating {}", point.display()))?;
            mount(Some(&volume.source), &point, none, MsFlags::MS_BIND, none)
                .with_context(|| format!("mounting volume {}", volume.source.display()))?;
            mount(
                none,
                &point,
                none,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
                none,
            )
            .context("restricting a volume")?;
        }
    }
    Ok(())
}

/// Moves this process into a new user namespace owned by `ids.owner`, with
/// `ids`' maps, as its root. The maps are written by a child that stays
/// host root: the full range can only be mapped by a writer privileged over
/// the parent namespace, and `setgroups` stays `allow`, as CRIU restores it
/// (every group a sandbox process can hold is in the sandbox's range).
fn enter_user_namespace(ids: &IdMap) -> anyhow::Result<()> {
    // Host root's supplementary groups have no name inside.
    nix::unistd::setgroups(&[]).context("dropping supplementary groups")?;
    let (go_rx, go_tx) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("creating a pipe")?;
    let parent = std::process::id();
    // SAFETY: this process is single-threaded (a fresh exec of the agent).
    let writer = match unsafe { fork() }.context("forking the id map writer")? {
        ForkResult::Child => {
            drop(go_tx);
            let mut byte = [0u8; 1];
            let code = match fs::File::from(go_rx).read_exact(&mut byte) {
                Ok(()) => match write_maps(parent, ids) {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("copse boot: {e:#}");
                        1
                    }
                },
                Err(_) => 1,
            };
            // SAFETY: leave without running this process's exit handlers twice.
            unsafe { libc::_exit(code) }
        }
        ForkResult::Parent { child } => child,
    };
    drop(go_rx);
    let owner = nix::unistd::Uid::from_raw(ids.owner);
    let created = nix::unistd::setresuid(owner, owner, owner)
        .context("taking the owner uid")
        .and_then(|()| unshare(CloneFlags::CLONE_NEWUSER).context("creating the user namespace"));
    if created.is_ok() {
        fs::File::from(go_tx).write_all(b"x").context("starting the id map writer")?;
    } else {
        drop(go_tx);
    }
    let written = waitpid(writer, None).context("waiting for the id map writer")?;
    created?;
    if written != WaitStatus::Exited(writer, 0) {
        bail!("writing the id maps failed: {written:?}");
    }
    let root = nix::unistd::Gid::from_raw(0);
    nix::unistd::setresgid(root, root, root).context("becoming group root in the user namespace")?;
    let root = nix::unistd::Uid::from_raw(0);
    nix::unistd::setresuid(root, root, root).context("becoming root in the user namespace")?;
    // The uid changes made this process undumpable: its /proc files (and its
    // children's until they exec) would belong to host root.
    // SAFETY: prctl with integer arguments.
    crate::syscall::check(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1, 0, 0, 0) }).context("PR_SET_DUMPABLE")?;
    Ok(())
}

fn write_maps(pid: u32, ids: &IdMap) -> anyhow::Result<()> {
    let line = ids.map_line();
    for file in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{file}");
        fs::write(&path, &line).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}

/// CRIU's action script for a restore into a user namespace (`copse-agent
/// criu-action`, run as host root): the network namespace CRIU creates for
/// the restored tree (`--empty-ns net`) gets `lo` up and non-local binds,
/// before any socket is restored into it (sockets of the checkpoint may be
/// bound to the source sandbox's address, which this namespace only gets
/// after the restore). Other actions need nothing.
pub fn criu_action() -> anyhow::Result<()> {
    if std::env::var("CRTOOLS_SCRIPT_ACTION").as_deref() != Ok("setup-namespaces") {
        return Ok(());
    }
    let pid: u32 = std::env::var("CRTOOLS_INIT_PID")
        .context("CRTOOLS_INIT_PID is not set")?
        .parse()
        .context("CRTOOLS_INIT_PID is not a pid")?;
    let netns = fs::File::open(format!("/proc/{pid}/ns/net")).context("opening the restored network namespace")?;
    nix::sched::setns(&netns, CloneFlags::CLONE_NEWNET).context("entering the restored network namespace")?;
    loopback_up().context("bringing up lo")?;
    // /proc/sys/net shows the namespace of the process that opens it.
    fs::write("/proc/sys/net/ipv4/ip_nonlocal_bind", "1").context("allowing non-local binds")?;
    Ok(())
}

fn boot(plan: &BootPlan) -> anyhow::Result<()> {
    let mut laps = Laps::start();
    join_cgroups(&plan.cgroup_procs)?;
    laps.lap("join");
    mount_stage(plan)?;
    laps.lap("stage");
    enter_user_namespace(&plan.ids)?;
    laps.lap("userns");
    // Inside the user namespace, so that it owns them all: CRIU dumps only
    // trees whose namespaces belong to their user namespace, and restores
    // them so.
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWCGROUP
            | CloneFlags::CLONE_NEWPID,
    )
    .context("unsharing namespaces")?;
    laps.lap("unshare");
    // Close-on-exec: only the copy init places on fd 3 may outlive its exec,
    // or the end-of-file this process waits for would never come.
    let (ready_rx, ready_tx) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("creating the readiness pipe")?;
    // SAFETY: this process is single-threaded (a fresh exec of the agent).
    match unsafe { fork() }.context("forking the sandbox init")? {
        ForkResult::Child => {
            drop(ready_rx);
            let mut report = fs::File::from(ready_tx);
            let e = enter(plan, &report);
            let _ = write!(report, "{e:#}");
            std::process::exit(1)
        }
        ForkResult::Parent { child } => {
            drop(ready_tx);
            let mut message = String::new();
            fs::File::from(ready_rx).read_to_string(&mut message).context("waiting for init")?;
            // Init's own times come first, on a line of their own.
            let (init_steps, message) = match message.strip_prefix(STEPS) {
                Some(rest) => rest.split_once('\n').unwrap_or((rest, "")),
                None => ("", message.as_str()),
            };
            if message != READY {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                let _ = waitpid(child, None);
                bail!("sandbox init failed: {message}");
            }
            let init_steps = parse_steps(init_steps).context("init reported bad step times")?;
            // `agent`: the hostname, loopback, the agent's exec and socket.
            laps.lap_with_parts(init_steps, "agent");
            print!("{}", laps.report(child.as_raw()).render());
            Ok(())
        }
    }
}

/// What init writes to the readiness pipe once the agent runs; anything
/// else is an error message.
const READY: &str = "ready";
/// Starts the line of step times init writes before the second stage's
/// readiness.
const STEPS: &str = "steps ";

/// First stage of init, pid 1 of the new pid namespace: sets the sandbox up
/// and executes the agent binary from inside it, handing over `report` as
/// fd 3. Returns only on failure.
fn enter(plan: &BootPlan, report: &fs::File) -> anyhow::Error {
    let result = (|| -> anyhow::Result<std::convert::Infallible> {
        // A checkpoint of the sandbox must not refer to a session outside it.
        nix::unistd::setsid().context("becoming a session leader")?;
        let started = Instant::now();
        let masking = build_root(plan)?;
        let steps = [("root".to_string(), started.elapsed().saturating_sub(masking)), ("mask".to_string(), masking)];
        sethostname(&plan.hostname).context("setting the hostname")?;
        loopback_up().context("bringing up lo")?;
        detach_stdio().context("detaching from the boot process's output")?;
        // SAFETY: dup2 onto a descriptor number this process does not use;
        // the copy is not close-on-exec, so it survives into the second stage.
        crate::syscall::check(unsafe { libc::dup2(report.as_raw_fd(), REPORT_FD) })
            .context("passing on the readiness pipe")?;
        (&*report)
            .write_all(format!("{STEPS}{}\n", render_steps(&steps)).as_bytes())
            .context("reporting step times")?;
        // Whatever else the gateway's own parent left open (not
        // close-on-exec) would end up in the sandbox: close it.
        // SAFETY: closes descriptors above the readiness pipe; nothing in
        // this process uses them any more.
        // (musl's libc has no close_range wrapper.)
        if unsafe { libc::syscall(libc::SYS_close_range, REPORT_FD + 1, u32::MAX, 0) } != 0 {
            return Err(std::io::Error::last_os_error()).context("closing inherited descriptors");
        }
        let agent = format!("/{AGENT_MOUNT}/{AGENT_NAME}");
        let args = [c"copse-agent", c"boot", c"--init"];
        let path = std::ffi::CString::new(agent.clone())?;
        nix::unistd::execve(&path, &args, &[] as &[&std::ffi::CStr]).with_context(|| format!("executing {agent}"))
    })();
    match result {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

/// Entry point of `copse-agent boot --init`: the second stage of init,
/// running from the sandbox's own agent binary. Binds the agent's socket,
/// forks the agent, reports readiness on fd 3 and reaps until the agent
/// exits. Never returns.
pub fn run_init(serve: impl FnOnce(UnixListener) -> anyhow::Result<()>) -> ! {
    // SAFETY: fd 3 was placed by the first stage and nothing else owns it.
    let mut report = fs::File::from(unsafe { OwnedFd::from_raw_fd(REPORT_FD) });
    // No process the agent starts may hold the readiness pipe.
    // SAFETY: fcntl on an fd this process owns.
    let _ = unsafe { libc::fcntl(REPORT_FD, libc::F_SETFD, libc::FD_CLOEXEC) };
    if let Err(e) = crate::linux::confine::keep_agent_capabilities() {
        let _ = write!(report, "limiting the agent's capabilities: {e}");
        std::process::exit(1)
    }
    let socket = Path::new("/").join(SOCKET_MOUNT).join(SOCKET_NAME);
    let _ = fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(listener) => listener,
        Err(e) => {
            let _ = write!(report, "binding {}: {e}", socket.display());
            std::process::exit(1)
        }
    };
    // SAFETY: single-threaded: nothing else ran since exec.
    let code = match unsafe { fork() } {
        Err(e) => {
            let _ = write!(report, "forking the agent: {e}");
            1
        }
        Ok(ForkResult::Child) => {
            drop(report);
            match serve(listener) {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("copse agent: {e:#}");
                    1
                }
            }
        }
        Ok(ForkResult::Parent { child }) => {
            drop(listener);
            let _ = report.write_all(READY.as_bytes());
            drop(report);
            reap_until(child)
        }
    };
    std::process::exit(code)
}

/// Init's job once the agent runs: collect every orphan, and end the
/// sandbox when the agent ends (the kernel then kills the rest).
fn reap_until(agent: Pid) -> i32 {
    loop {
        match waitpid(None, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == agent => return code,
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == agent => return 128 + signal as i32,
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return 1,
        }
    }
}

/// Hides each [`MASKED_FILES`] and [`MASKED_DIRS`] path that exists on this kernel.
fn mask(root: &Path, null: &Path) -> anyhow::Result<()> {
    let none: Option<&str> = None;
    for name in MASKED_DIRS {
        if root.join(name).is_dir() {
            let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
            mount(Some("tmpfs"), &root.join(name), Some("tmpfs"), flags, Some("mode=555"))
                .with_context(|| format!("masking /{name}"))?;
        }
    }
    for name in MASKED_FILES {
        if fs::symlink_metadata(root.join(name)).is_ok_and(|m| m.is_file()) {
            mount(Some(null), &root.join(name), none, MsFlags::MS_BIND, none)
                .with_context(|| format!("masking /{name}"))?;
        }
    }
    Ok(())
}

/// Returns how long masking took (runc's masked paths, most of init's
/// mounts), so a boot's report can show it apart.
fn build_root(plan: &BootPlan) -> anyhow::Result<Duration> {
    let none: Option<&str> = None;
    // The overlay came from the host's mount namespace, so it is locked here
    // and pivot_root refuses it; a bind of it onto itself is this
    // namespace's own mount. Everything below is relative to it.
    let stage_root = plan.stage_root();
    mount(Some(&stage_root), &stage_root, none, MsFlags::MS_BIND | MsFlags::MS_REC, none)
        .context("binding the root onto itself")?;
    chdir(&stage_root).context("entering the new root")?;
    let root = Path::new(".");
    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;

    let proc_dir = ensure_dir(root, "proc")?;
    mount(Some("proc"), &proc_dir, Some("proc"), nosuid_nodev_noexec, none).context("mounting /proc")?;
    for name in PROC_READ_ONLY {
        let path = proc_dir.join(name);
        if path.exists() {
            bind_read_only(&path)?;
        }
    }

    let sys_dir = ensure_dir(root, "sys")?;
    mount(Some("sysfs"), &sys_dir, Some("sysfs"), nosuid_nodev_noexec | MsFlags::MS_RDONLY, none)
        .context("mounting /sys")?;

    let dev = ensure_dir(root, "dev")?;
    mount(Some("tmpfs"), &dev, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC, Some("mode=755,size=1m"))
        .context("mounting /dev")?;
    // No device node can be made in a user namespace: the host's own are
    // bound in (a device's permissions are its driver's, not the node's).
    for name in DEVICES {
        let node = dev.join(name);
        // (Also declared to CRIU: see `device_mounts`.)
        fs::File::create(&node).with_context(|| format!("creating /dev/{name}"))?;
        let host = Path::new("/dev").join(name);
        mount(Some(&host), &node, none, MsFlags::MS_BIND, none).with_context(|| format!("binding /dev/{name}"))?;
    }
    let masking = Instant::now();
    mask(root, &dev.join("null"))?;
    let masking = masking.elapsed();
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(link)).with_context(|| format!("linking /dev/{link}"))?;
    }
    let pts = ensure_dir(&dev, "pts")?;
    mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )
    .context("mounting /dev/pts")?;
    let shm = ensure_dir(&dev, "shm")?;
    mount(Some("shm"), &shm, Some("tmpfs"), nosuid_nodev_noexec, Some("mode=1777,size=64m"))
        .context("mounting /dev/shm")?;

    // Read-only, nosuid and nodev since the host mounted them (locked).
    let agent = ensure_dir(root, AGENT_MOUNT)?;
    mount(Some(&plan.stage_agent()), &agent, none, MsFlags::MS_BIND, none).context("mounting the agent directory")?;
    let sockets = ensure_dir(root, SOCKET_MOUNT)?;
    mount(Some(&plan.stage_socket()), &sockets, none, MsFlags::MS_BIND, none)
        .context("mounting the socket directory")?;
    for (index, volume) in plan.volumes.iter().enumerate() {
        let point = mount_point(&volume.target).with_context(|| format!("volume mount point {}", volume.target))?;
        let at = format!("/proc/self/fd/{}", point.as_raw_fd());
        mount(Some(&plan.stage_volume(index)), at.as_str(), none, MsFlags::MS_BIND, none)
            .with_context(|| format!("mounting a volume at {}", volume.target))?;
    }

    // pivot_root(".", ".") stacks the old root under the new one; detaching
    // it leaves the sandbox with no path back to the host's tree.
    pivot_root(".", ".").context("pivot_root")?;
    umount2(".", MntFlags::MNT_DETACH).context("detaching the host root")?;
    chdir("/").context("chdir /")?;
    Ok(masking)
}

/// Opens (making what is missing, as the sandbox's root) the directory at
/// absolute `target` under the current directory, the new root, one
/// component at a time and never through a link: the tree is the
/// sandbox's, and a link it planted (`/mnt -> /etc`) must not carry the
/// mount, nor a directory made for it, outside.
fn mount_point(target: &str) -> anyhow::Result<OwnedFd> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::{Mode, mkdirat};
    let flags = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mut dir = nix::fcntl::open(".", flags, Mode::empty()).context("opening the new root")?;
    for name in target.split('/').filter(|c| !c.is_empty()) {
        if name == "." || name == ".." {
            bail!("{target} is not a normal absolute path");
        }
        let next = match openat(&dir, name, flags, Mode::empty()) {
            Err(nix::errno::Errno::ENOENT) => {
                mkdirat(&dir, name, Mode::from_bits_truncate(0o755)).with_context(|| format!("creating {name}"))?;
                openat(&dir, name, flags, Mode::empty())
            }
            other => other,
        };
        dir = next.with_context(|| format!("{name} is not a directory (links are not followed)"))?;
    }
    Ok(dir)
}

fn ensure_dir(parent: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let path = parent.join(name);
    if !path.is_dir() {
        fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
    }
    Ok(path)
}

fn bind_read_only(path: &Path) -> anyhow::Result<()> {
    let none: Option<&str> = None;
    mount(Some(path), path, none, MsFlags::MS_BIND | MsFlags::MS_REC, none)
        .with_context(|| format!("binding {}", path.display()))?;
    mount(none, path, none, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY, none)
        .with_context(|| format!("making {} read-only", path.display()))
}

/// The boot process's caller waits for end-of-file on its output; init and
/// the agent must not hold those pipes open.
fn detach_stdio() -> anyhow::Result<()> {
    let null = fs::OpenOptions::new().read(true).write(true).open("/dev/null")?;
    for fd in 0..=2 {
        // SAFETY: dup2 onto the standard descriptors of this process.
        crate::syscall::check(unsafe { libc::dup2(null.as_raw_fd(), fd) })?;
    }
    Ok(())
}

/// A fresh network namespace has `lo` down.
fn loopback_up() -> anyhow::Result<()> {
    // SAFETY: a plain socket used only for the two ioctls below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("socket");
    }
    // SAFETY: fd is a socket we own.
    let _guard = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write an ifreq we own.
    unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS as _, &mut req) < 0 {
            return Err(std::io::Error::last_os_error()).context("SIOCGIFFLAGS");
        }
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        if libc::ioctl(fd, libc::SIOCSIFFLAGS as _, &req) < 0 {
            return Err(std::io::Error::last_os_error()).context("SIOCSIFFLAGS");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_options_name_every_layer() {
        let plan = BootPlan {
            hostname: "h".into(),
            lowers: vec!["/l/snap1".into(), "/t/rootfs".into()],
            upper: "/s/upper".into(),
            work: "/s/work".into(),
            stage: "/run/copse-stage".into(),
            cgroup_procs: vec![],
            agent_dir: "/a".into(),
            socket_dir: "/s/run".into(),
            ids: IdMap { base: 1 << 31, owner: 2_000_000 },
            volumes: vec![],
        };
        assert_eq!(plan.overlay_options(), "lowerdir=/l/snap1:/t/rootfs,upperdir=/s/upper,workdir=/s/work,volatile");
    }

    #[test]
    fn plan_round_trips_through_json() {
        let plan = BootPlan {
            hostname: "sbx".into(),
            lowers: vec!["/a".into()],
            upper: "/b".into(),
            work: "/c".into(),
            stage: "/run/copse-stage".into(),
            cgroup_procs: vec!["/sys/fs/cgroup/pids/copse/x/cgroup.procs".into()],
            agent_dir: "/state/agent".into(),
            socket_dir: "/state/sandboxes/x/run".into(),
            ids: IdMap { base: 1 << 31, owner: 2_000_000 },
            volumes: vec![VolumeBind { source: "/state/disk/.volumes/v".into(), target: "/mnt/data".into() }],
        };
        assert_eq!(plan.ids.map_line(), "0 2147483648 65536");
        assert_eq!(plan.stage_root(), Path::new("/run/copse-stage/root"));
        assert_eq!(plan.stage_volume(0), Path::new("/run/copse-stage/volumes/0"));
        let text = serde_json::to_string(&plan).unwrap();
        assert_eq!(serde_json::from_str::<BootPlan>(&text).unwrap(), plan);
    }
}
