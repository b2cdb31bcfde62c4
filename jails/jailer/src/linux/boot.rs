//! Booting a sandbox: the privileged sequence that turns a plan into a
//! running, isolated init with the agent beside it.
//!
//! The Linux substrate (`copse-namespaces`) computes a [`BootPlan`] and starts `copse-agent boot` with it
//! on standard input. That process (fresh, single-threaded) joins the
//! sandbox's cgroup, unshares every namespace, and forks the sandbox's init.
//! Init makes itself a session leader, builds the root filesystem inside its
//! private mount namespace (so no mount is ever visible on the host, and all
//! of them vanish with the namespace), pivots into it, and re-executes the
//! agent binary from inside the sandbox (`copse-agent boot --init`, see
//! [`run_init`]). That second stage binds the agent's socket on the
//! sandbox's socket directory, forks the agent, and reaps orphans until the
//! agent exits. The boot process reports init's host pid on standard output
//! and exits.
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

use anyhow::{Context, bail};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::sys::stat::{Mode, SFlag, makedev, mknod};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{ForkResult, Pid, chdir, fork, pivot_root, sethostname};
use serde::{Deserialize, Serialize};

use crate::handoff::{AGENT_MOUNT, AGENT_NAME, NETNS_FD, SOCKET_MOUNT, SOCKET_NAME};

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
    /// Empty directory the merged root is mounted on, inside the namespace.
    pub root: PathBuf,
    /// `cgroup.procs` files to join before unsharing.
    pub cgroup_procs: Vec<PathBuf>,
    /// Host directory holding the agent binary, shared by every sandbox.
    pub agent_dir: PathBuf,
    /// Host directory for this sandbox's agent socket.
    pub socket_dir: PathBuf,
}

/// What `copse-agent boot` is asked to do, read from its standard input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "launch", rename_all = "snake_case")]
pub enum Launch {
    Boot(BootPlan),
    Restore(RestorePlan),
}

/// A sandbox restored from a memory checkpoint: the restore helper joins the
/// sandbox's cgroups, takes a private mount namespace holding the overlay
/// root and a fresh network namespace, and runs CRIU there. `sandbox` is
/// the plan the sandbox would boot with; its root, layers and cgroups apply.
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
}

/// Character devices a sandbox gets in its private /dev: (name, major, minor).
pub const DEVICES: &[(&str, u64, u64)] =
    &[("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)];

/// /proc files that would let uid 0 in the sandbox reach the host kernel;
/// made read-only (the sandbox has no capability to remount them).
pub const PROC_READ_ONLY: &[&str] = &["sys", "sysrq-trigger", "irq", "bus", "fs"];
/// Files hidden behind /dev/null and directories behind an empty read-only
/// tmpfs, paths from the root: at least runc's default masked paths, since
/// each leaks host kernel state (memory, keys, timers usable for side
/// channels, hardware) or lets root poke at firmware and power limits.
pub const MASKED: &[&str] = &[
    "proc/acpi",
    "proc/asound",
    "proc/interrupts",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/sched_debug",
    "proc/scsi",
    "proc/timer_list",
    "proc/timer_stats",
    "sys/devices/virtual/powercap",
    "sys/firmware",
];

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
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWNET).context("unsharing namespaces")?;
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none).context("making / private")?;
    let options = sandbox.overlay_options();
    mount(Some("overlay"), &sandbox.root, Some("overlay"), MsFlags::empty(), Some(options.as_str()))
        .context("mounting the overlay root")?;
    loopback_up().context("bringing up lo")?;
    // Sockets the checkpoint holds may be bound to the source sandbox's
    // address, which this namespace only gets after the restore.
    fs::write("/proc/sys/net/ipv4/ip_nonlocal_bind", "1").context("allowing non-local binds")?;
    let netns = fs::File::open("/proc/self/ns/net").context("opening the new network namespace")?;
    // SAFETY: dup2 onto a descriptor number this process does not use; the
    // copy is not close-on-exec, so CRIU inherits it.
    crate::syscall::check(unsafe { libc::dup2(netns.as_raw_fd(), NETNS_FD) })
        .context("passing on the network namespace")?;
    let error = std::process::Command::new(&plan.criu).args(&plan.args).exec();
    Err(error).with_context(|| format!("executing {}", plan.criu.display()))
}

fn boot(plan: &BootPlan) -> anyhow::Result<()> {
    join_cgroups(&plan.cgroup_procs)?;
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWCGROUP
            | CloneFlags::CLONE_NEWPID,
    )
    .context("unsharing namespaces")?;
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
            if message != READY {
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                let _ = waitpid(child, None);
                bail!("sandbox init failed: {message}");
            }
            println!("{child}");
            Ok(())
        }
    }
}

/// What init writes to the readiness pipe once the agent runs; anything
/// else is an error message.
const READY: &str = "ready";

/// First stage of init, pid 1 of the new pid namespace: sets the sandbox up
/// and executes the agent binary from inside it, handing over `report` as
/// fd 3. Returns only on failure.
fn enter(plan: &BootPlan, report: &fs::File) -> anyhow::Error {
    let result = (|| -> anyhow::Result<std::convert::Infallible> {
        // A checkpoint of the sandbox must not refer to a session outside it.
        nix::unistd::setsid().context("becoming a session leader")?;
        build_root(plan)?;
        sethostname(&plan.hostname).context("setting the hostname")?;
        loopback_up().context("bringing up lo")?;
        detach_stdio().context("detaching from the boot process's output")?;
        // SAFETY: dup2 onto a descriptor number this process does not use;
        // the copy is not close-on-exec, so it survives into the second stage.
        crate::syscall::check(unsafe { libc::dup2(report.as_raw_fd(), REPORT_FD) })
            .context("passing on the readiness pipe")?;
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

/// Hides each [`MASKED`] path that exists on this kernel.
fn mask(root: &Path, null: &Path) -> anyhow::Result<()> {
    let none: Option<&str> = None;
    for name in MASKED {
        let path = root.join(name);
        let Ok(meta) = fs::symlink_metadata(&path) else { continue };
        if meta.is_dir() {
            let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
            mount(Some("tmpfs"), &path, Some("tmpfs"), flags, Some("mode=555"))
        } else {
            mount(Some(null), &path, none, MsFlags::MS_BIND, none)
        }
        .with_context(|| format!("masking /{name}"))?;
    }
    Ok(())
}

fn build_root(plan: &BootPlan) -> anyhow::Result<()> {
    let none: Option<&str> = None;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_PRIVATE, none).context("making / private")?;
    mount(Some("overlay"), &plan.root, Some("overlay"), MsFlags::empty(), Some(plan.overlay_options().as_str()))
        .context("mounting the overlay root")?;
    let root = plan.root.as_path();
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
    for (name, major, minor) in DEVICES {
        let node = dev.join(name);
        mknod(&node, SFlag::S_IFCHR, Mode::from_bits_truncate(0o666), makedev(*major, *minor))
            .with_context(|| format!("creating /dev/{name}"))?;
        // mknod applies the umask; every user must be able to use these.
        fs::set_permissions(&node, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .with_context(|| format!("opening up /dev/{name}"))?;
    }
    mask(root, &dev.join("null"))?;
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

    let agent = ensure_dir(root, AGENT_MOUNT)?;
    mount(Some(&plan.agent_dir), &agent, none, MsFlags::MS_BIND, none).context("mounting the agent directory")?;
    mount(none, &agent, none, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID, none)
        .context("making the agent directory read-only")?;
    let sockets = ensure_dir(root, SOCKET_MOUNT)?;
    mount(Some(&plan.socket_dir), &sockets, none, MsFlags::MS_BIND, none).context("mounting the socket directory")?;

    // pivot_root(".", ".") stacks the old root under the new one; detaching
    // it leaves the sandbox with no path back to the host's tree.
    chdir(root).context("entering the new root")?;
    pivot_root(".", ".").context("pivot_root")?;
    umount2(".", MntFlags::MNT_DETACH).context("detaching the host root")?;
    chdir("/").context("chdir /")?;
    Ok(())
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
            root: "/s/root".into(),
            cgroup_procs: vec![],
            agent_dir: "/a".into(),
            socket_dir: "/s/run".into(),
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
            root: "/d".into(),
            cgroup_procs: vec!["/sys/fs/cgroup/pids/copse/x/cgroup.procs".into()],
            agent_dir: "/state/agent".into(),
            socket_dir: "/state/sandboxes/x/run".into(),
        };
        let text = serde_json::to_string(&plan).unwrap();
        assert_eq!(serde_json::from_str::<BootPlan>(&text).unwrap(), plan);
    }
}
