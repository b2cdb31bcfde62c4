//! Memory snapshots of a whole sandbox with CRIU.
//!
//! A sandbox's process tree (init, the agent, everything users started) is
//! checkpointed into an image directory next to the snapshot's file layers,
//! and restored into a new sandbox (or the same one, for rollback) on those
//! layers. What makes a copse sandbox dumpable is set up at boot (see
//! `copse_jailer::linux::boot`): init leads its own session and every process runs from
//! files inside the sandbox. Three things stay outside the image on purpose:
//! - the agent binary's and socket's directories, declared external mounts
//!   and mapped to the new sandbox's own on restore;
//! - the network namespace's configuration: it belongs to the sandbox's user
//!   namespace like every other (CRIU dumps only such trees, and restoring
//!   established TCP connections needs `CAP_NET_ADMIN` over it), but CRIU
//!   saves and restores none of it (`--empty-ns net`): the restored tree
//!   gets an empty one, which the action script (`copse-agent criu-action`)
//!   prepares and the substrate then plugs into the sandbox network under
//!   the new address;
//! - cgroups: the restored tree inherits the new sandbox's, which the restore
//!   helper joins before starting CRIU.
//!
//! CRIU 4 or later is required; bookworm's 3.17 cannot read this kernel's
//! vDSO. `scripts/criu` builds a suitable one, with libnftables: CRIU locks
//! the sandbox's network while it dumps with an nftables table inside the
//! sandbox's own network namespace (`--network-lock nftables`), never with
//! the host's iptables (docs/lifecycle.md, "Network lock").

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use copse_jailer::handoff::{AGENT_MOUNT, SOCKET_MOUNT};
use copse_jailer::linux::boot::{DEVICES, device_mounts};

/// Keys naming the external mounts in an image.
const AGENT_KEY: &str = "copse-agent";
const SOCKET_KEY: &str = "copse-run";
/// Key naming a host device node's mounts in an image (every mount of one
/// device shares it: see `copse_jailer::linux::boot::device_mounts`).
fn device_key(device: &str) -> String {
    format!("copse-dev-{device}")
}
/// Oldest CRIU major version that works on current kernels.
const MIN_MAJOR: u32 = 4;

/// A CRIU binary that passed `criu check` on this host.
#[derive(Debug, Clone)]
pub struct Criu {
    pub binary: PathBuf,
    /// Whether a large checkpoint may restore lazily (`lazy_pages.rs`):
    /// this CRIU can hand a task in a user namespace its userfaultfd, and
    /// `COPSE_LAZY_PAGES=off` does not say otherwise.
    pub lazy_pages: bool,
}

impl Criu {
    /// The first usable CRIU: `$COPSE_CRIU` alone if it is set, else
    /// `/usr/local/sbin/criu`, `/usr/sbin/criu`, `/sbin/criu`. `Err` says,
    /// in one line, what is missing and how to install it.
    pub fn find() -> anyhow::Result<Self> {
        let candidates: Vec<PathBuf> = match std::env::var_os("COPSE_CRIU") {
            Some(chosen) => vec![PathBuf::from(chosen)],
            None => ["/usr/local/sbin/criu", "/usr/sbin/criu", "/sbin/criu"].map(PathBuf::from).to_vec(),
        };
        let mut reasons = Vec::new();
        for binary in candidates.iter().filter(|b| b.is_file()) {
            // Before the probe's own runs, so none reads a cache an earlier
            // boot left.
            if let Err(e) = crate::criu_cache::ensure(binary) {
                tracing::warn!("CRIU's kernel feature cache: {e:#}; each restore and dump probes the kernel");
            }
            match Self::probe(binary) {
                Ok(()) => return Ok(Self { binary: binary.clone(), lazy_pages: lazy_pages(binary) }),
                Err(e) => reasons.push(format!("{}: {e:#}", binary.display())),
            }
        }
        if reasons.is_empty() {
            let looked = candidates.iter().map(|c| c.display().to_string()).collect::<Vec<_>>().join(", ");
            bail!("no CRIU found (looked for {looked}); {INSTALL_HINT}");
        }
        bail!("no usable CRIU ({}); {INSTALL_HINT}", reasons.join("; "))
    }

    /// Checks that `binary` is recent enough, that `criu check` passes on
    /// this kernel, and that it can lock a network with nftables, the one
    /// option copse needs beyond the basics.
    fn probe(binary: &Path) -> anyhow::Result<()> {
        let version = Command::new(binary).arg("--version").output().context("running --version")?;
        let text = String::from_utf8_lossy(&version.stdout);
        let major = parse_major(&text).with_context(|| format!("unexpected --version output {text:?}"))?;
        if major < MIN_MAJOR {
            bail!("version {major}.x is too old (need {MIN_MAJOR} or later)");
        }
        for check in [&["check"][..], &["check", "--feature", "network_lock_nftables"]] {
            let output = Command::new(binary).args(check).output().with_context(|| format!("running {check:?}"))?;
            if !output.status.success() {
                bail!("`criu {}` failed: {}", check.join(" "), first_line(&output));
            }
        }
        Ok(())
    }

    /// Checkpoints the tree under `init` into `images`, leaving it running
    /// (or frozen, if its cgroup was frozen). `freezer` is the sandbox's
    /// freezer cgroup directory.
    /// CRIU's own log goes to the gateway's log, not into the error.
    pub fn dump(&self, init: i32, images: &Path, freezer: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(images).with_context(|| format!("creating {}", images.display()))?;
        let output =
            Command::new(&self.binary).args(dump_args(init, images, freezer)).output().context("running criu dump")?;
        if !output.status.success() {
            tracing::error!(log = %log_tail(&images.join("dump.log")), "criu dump failed");
            bail!("CRIU could not checkpoint the sandbox's processes (its log is in the gateway's log)");
        }
        Ok(())
    }
}

/// Whether `binary` has copse's patch for lazy restores into a user
/// namespace and the host lets it work, unless the operator turned lazy
/// restores off.
fn lazy_pages(binary: &Path) -> bool {
    if std::env::var("COPSE_LAZY_PAGES").is_ok_and(|v| v == "off") {
        return false;
    }
    let checked = Command::new(binary).args(["check", "--feature", "uffd-dev"]).output();
    let ok = checked.as_ref().is_ok_and(|o| o.status.success());
    if !ok {
        tracing::info!(
            "large memories restore eagerly: this CRIU or kernel has no /dev/userfaultfd for restored tasks"
        );
    }
    ok
}

/// How to get a CRIU copse can use, for messages to the operator.
pub const INSTALL_HINT: &str = "install it with scripts/criu (./dev up runs it)";

/// The first line a failed command printed, for a one-line reason.
fn first_line(output: &std::process::Output) -> String {
    let text = String::from_utf8_lossy(if output.stderr.is_empty() { &output.stdout } else { &output.stderr });
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("no output").to_string()
}

/// `criu dump` arguments. `--leave-running` keeps the source going;
/// `--freeze-cgroup` lets CRIU stop a tree the freezer may already hold
/// (ptrace alone would wait forever on frozen tasks); established TCP
/// connections (a code interpreter's kernel talks to its broker over
/// loopback) are kept with the kernel's repair mode.
pub fn dump_args(init: i32, images: &Path, freezer: &Path) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "dump".into(),
        "--tree".into(),
        init.to_string(),
        "--images-dir".into(),
        images.display().to_string(),
        "--log-file".into(),
        "dump.log".into(),
        "--leave-running".into(),
        "--freeze-cgroup".into(),
        freezer.display().to_string(),
        "--manage-cgroups=ignore".into(),
        "--tcp-established".into(),
        "--file-locks".into(),
        "--link-remap".into(),
        "--skip-in-flight".into(),
        // The lock is a table in the sandbox's own network namespace, made
        // through libnftables: no iptables on the host, no host rule touched.
        "--network-lock".into(),
        "nftables".into(),
        "--empty-ns".into(),
        "net".into(),
    ];
    let devices = device_mounts().map(|(path, device)| format!("mnt[/{path}]:{}", device_key(device)));
    for external in [format!("mnt[/{AGENT_MOUNT}]:{AGENT_KEY}"), format!("mnt[/{SOCKET_MOUNT}]:{SOCKET_KEY}")]
        .into_iter()
        .chain(devices)
    {
        args.push("--external".into());
        args.push(external);
    }
    args
}

/// Where a restore finds things on the host: see [`restore_args`].
pub struct RestorePaths<'a> {
    pub images: &'a Path,
    /// The new sandbox's merged overlay, mounted by the restore helper.
    pub root: &'a Path,
    pub agent_dir: &'a Path,
    pub socket_dir: &'a Path,
    /// Where CRIU writes the restored init's host pid; its directory is
    /// CRIU's work directory.
    pub pidfile: &'a Path,
    /// An executable running `copse-agent criu-action`.
    pub action_script: &'a Path,
}

/// `criu restore` arguments for a tree restored under `paths.root`, with the
/// external mounts mapped to the agent's and socket's directories and an
/// empty network namespace prepared by the action script. CRIU detaches
/// once the tree runs; `lazy`: its anonymous memory is left to a pager
/// (`lazy_pages.rs`).
pub fn restore_args(paths: &RestorePaths<'_>, lazy: bool) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "restore".into(),
        "--images-dir".into(),
        paths.images.display().to_string(),
        "--work-dir".into(),
        paths.pidfile.parent().unwrap_or(Path::new("/")).display().to_string(),
        "--log-file".into(),
        "restore.log".into(),
        "--root".into(),
        paths.root.display().to_string(),
        "--restore-detached".into(),
        "--pidfile".into(),
        paths.pidfile.display().to_string(),
        "--manage-cgroups=ignore".into(),
        "--tcp-established".into(),
        "--file-locks".into(),
        "--link-remap".into(),
        "--empty-ns".into(),
        "net".into(),
        "--action-script".into(),
        paths.action_script.display().to_string(),
    ];
    let devices = DEVICES.iter().map(|device| format!("mnt[{}]:/dev/{device}", device_key(device)));
    for external in [
        format!("mnt[{AGENT_KEY}]:{}", paths.agent_dir.display()),
        format!("mnt[{SOCKET_KEY}]:{}", paths.socket_dir.display()),
    ]
    .into_iter()
    .chain(devices)
    {
        args.push("--external".into());
        args.push(external);
    }
    if lazy {
        args.push("--lazy-pages".into());
    }
    args
}

/// The last lines of a CRIU log, for an error message.
pub fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("Error") || l.contains("rror (")).collect();
    let lines = if errors.is_empty() { text.lines().rev().take(5).collect::<Vec<_>>() } else { errors };
    let joined = lines.iter().rev().take(6).rev().copied().collect::<Vec<_>>().join(" | ");
    if joined.is_empty() { format!("no log at {}", log.display()) } else { joined }
}

fn parse_major(version_output: &str) -> Option<u32> {
    let line = version_output.lines().find_map(|l| l.trim().strip_prefix("Version:"))?;
    line.trim().split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_major_version_comes_from_the_version_line() {
        assert_eq!(parse_major("Version: 4.1.1\n"), Some(4));
        assert_eq!(parse_major("Version: 3.17.1\nGitID: v3.17\n"), Some(3));
        assert_eq!(parse_major("criu"), None);
    }

    #[test]
    fn dump_keeps_the_source_running_and_names_every_external() {
        let args = dump_args(42, Path::new("/s/ckpt/x"), Path::new("/sys/fs/cgroup/freezer/copse-1/a"));
        let text = args.join(" ");
        assert!(text.starts_with("dump --tree 42 --images-dir /s/ckpt/x "), "{text}");
        for part in [
            "--leave-running",
            "--freeze-cgroup /sys/fs/cgroup/freezer/copse-1/a",
            "--tcp-established",
            "--network-lock nftables",
            "--external mnt[/.copse/bin]:copse-agent",
            "--external mnt[/.copse/run]:copse-run",
            "--empty-ns net",
            "--external mnt[/dev/null]:copse-dev-null",
            "--external mnt[/proc/kcore]:copse-dev-null",
            "--external mnt[/dev/urandom]:copse-dev-urandom",
        ] {
            assert!(text.contains(part), "{part} missing from {text}");
        }
        assert!(!text.contains("net["), "the network namespace is the sandbox's own, not external: {text}");
    }

    #[test]
    fn restore_maps_every_external_to_the_new_sandbox() {
        let paths = RestorePaths {
            images: Path::new("/s/ckpt/x"),
            root: Path::new("/run/copse-stage/root"),
            agent_dir: Path::new("/run/copse-stage/bin"),
            socket_dir: Path::new("/run/copse-stage/run"),
            pidfile: Path::new("/s/sandboxes/b/restore/init.pid"),
            action_script: Path::new("/s/criu-action"),
        };
        let text = restore_args(&paths, false).join(" ");
        assert!(!text.contains("--lazy-pages"), "{text}");
        assert!(restore_args(&paths, true).join(" ").ends_with(" --lazy-pages"));
        for part in [
            "--root /run/copse-stage/root",
            "--restore-detached",
            "--pidfile /s/sandboxes/b/restore/init.pid",
            "--work-dir /s/sandboxes/b/restore",
            "--empty-ns net",
            "--action-script /s/criu-action",
            "--external mnt[copse-agent]:/run/copse-stage/bin",
            "--external mnt[copse-run]:/run/copse-stage/run",
            "--external mnt[copse-dev-null]:/dev/null",
            "--external mnt[copse-dev-tty]:/dev/tty",
        ] {
            assert!(text.contains(part), "{part} missing from {text}");
        }
    }
}
