//! Plans: everything the FreeBSD substrate does to the host, as plain data.
//!
//! Functions here are pure: they take names, limits and what was observed on
//! the host, and return [`Step`]s (command lines, `jail_set(2)` parameters,
//! files to create) or parse the text a FreeBSD tool printed. Nothing here
//! touches the system, so the whole module compiles on every OS and its
//! golden tests run on Linux, where no FreeBSD host is available. The
//! executor in `exec` applies the steps on a real host.
//!
//! This file holds the vocabulary every plan shares: where things live
//! ([`Layout`]), what a step is ([`Step`], [`Cmd`]) and which sandbox ids are
//! acceptable as jail, dataset and rctl names.

use std::fmt;
use std::path::{Path, PathBuf};

pub mod devfs;
pub mod host;
pub mod jail;
pub mod layers;
pub mod lifecycle;
pub mod mounts;
pub mod rctl;
pub mod recover;
pub mod sandbox;
pub mod template;
pub mod volume;
pub mod zfs;

/// Absolute paths of the host tools the plans run, so the gateway's own
/// `PATH` never decides which binary gets root. Locations are those of a
/// FreeBSD base system (hier(7)); not checked on a host from here.
pub mod tool {
    pub const ZFS: &str = "/sbin/zfs";
    pub const CHOWN: &str = "/usr/sbin/chown";
    pub const MOUNT: &str = "/sbin/mount";
    pub const UMOUNT: &str = "/sbin/umount";
    pub const DEVFS: &str = "/sbin/devfs";
    pub const RCTL: &str = "/usr/bin/rctl";
    pub const JEXEC: &str = "/usr/sbin/jexec";
    pub const ENV: &str = "/usr/bin/env";
    pub const PKG: &str = "/usr/sbin/pkg";
    pub const TAR: &str = "/usr/bin/tar";
    pub const PW: &str = "/usr/sbin/pw";
    pub const FETCH: &str = "/usr/bin/fetch";
    pub const SHA256: &str = "/sbin/sha256";
    pub const CHROOT: &str = "/usr/sbin/chroot";
    pub const FREEBSD_VERSION: &str = "/bin/freebsd-version";
    pub const PS: &str = "/bin/ps";
}

/// Where the agent binary appears inside every jail (a read-only nullfs
/// mount of [`Layout::agent_dir`]).
pub const AGENT_DIR_IN_JAIL: &str = "/.copse";
pub const AGENT_IN_JAIL: &str = "/.copse/copse-agent";
pub const AGENT_FILE_NAME: &str = "copse-agent";

/// ZFS user properties copse writes. Every sandbox dataset carries
/// [`PROP_SANDBOX`]; crash reconciliation trusts nothing else to decide that
/// a dataset is copse's to destroy.
pub const PROP_SANDBOX: &str = "copse:sandbox";
pub const PROP_AGENT_SOCKET: &str = "copse:agent_socket";
pub const PROP_TEMPLATE: &str = "copse:template";
pub const PROP_TEMPLATE_GUID: &str = "copse:template_guid";
pub const PROP_BUILT_AT: &str = "copse:built_at";
pub const PROP_RECIPE: &str = "copse:recipe";
/// On a dataset under `<root>/snapshots`: the snapshot id it holds. Like
/// [`PROP_SANDBOX`], the only mark that makes it copse's to list or destroy.
pub const PROP_SNAPSHOT: &str = "copse:snapshot";
/// On a sandbox dataset: the snapshot it was created from, if any.
pub const PROP_FROM_SNAPSHOT: &str = "copse:from_snapshot";
/// On a snapshot dataset that was deleted while sandboxes still were
/// clones of it: destroyed once the last of them is gone.
pub const PROP_DELETED: &str = "copse:deleted";

/// The snapshot every template is cloned from.
pub const TEMPLATE_SNAPSHOT: &str = "base";

/// The ZFS snapshot inside every dataset under `<root>/snapshots`, which
/// sandboxes created from a copse snapshot are cloned from.
pub const SNAPSHOT_SNAPSHOT: &str = "snapshot";

/// The devfs ruleset number copse loads and mounts jails' `/dev` with.
/// Rulesets 1–5 ship in `/etc/defaults/devfs.rules`; this one is copse's.
pub const DEFAULT_DEVFS_RULESET: u16 = 4270;

/// Where everything of copse's lives on one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The gateway's state directory; mountpoints live below it.
    pub state_dir: PathBuf,
    /// Parent dataset of everything copse creates, e.g. `zroot/copse`.
    pub dataset_root: String,
    pub devfs_ruleset: u16,
}

/// Environment variables an operator sets to fit copse to the host.
pub const ENV_DATASET: &str = "COPSE_ZFS_DATASET";
pub const ENV_DEVFS_RULESET: &str = "COPSE_DEVFS_RULESET";
pub const DEFAULT_DATASET: &str = "zroot/copse";

impl Layout {
    /// Reads the operator's choices through `var` (the process environment
    /// in production, a map in tests).
    pub fn from_env(state_dir: &Path, var: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let dataset_root = var(ENV_DATASET).unwrap_or_else(|| DEFAULT_DATASET.to_string());
        validate_dataset(&dataset_root)?;
        let devfs_ruleset = match var(ENV_DEVFS_RULESET) {
            None => DEFAULT_DEVFS_RULESET,
            Some(v) => match v.parse::<u16>() {
                // 0 means "no ruleset" to devfs; 1-5 are the system's own.
                Ok(n) if n > 5 => n,
                _ => return Err(format!("{ENV_DEVFS_RULESET}={v:?}: want a number from 6 to 65535")),
            },
        };
        if !state_dir.is_absolute() {
            return Err(format!("state directory {} must be absolute", state_dir.display()));
        }
        Ok(Self { state_dir: state_dir.to_path_buf(), dataset_root, devfs_ruleset })
    }

    pub fn sandboxes_dataset(&self) -> String {
        format!("{}/sandboxes", self.dataset_root)
    }

    pub fn templates_dataset(&self) -> String {
        format!("{}/templates", self.dataset_root)
    }

    pub fn sandbox_dataset(&self, id: &str) -> String {
        format!("{}/{id}", self.sandboxes_dataset())
    }

    pub fn template_dataset(&self, name: &str) -> String {
        format!("{}/{name}", self.templates_dataset())
    }

    pub fn template_snapshot(&self, name: &str) -> String {
        format!("{}@{TEMPLATE_SNAPSHOT}", self.template_dataset(name))
    }

    /// Parent of the datasets that hold copse snapshots; they outlive the
    /// sandbox they were taken from, so they cannot live below it.
    pub fn snapshots_dataset(&self) -> String {
        format!("{}/snapshots", self.dataset_root)
    }

    pub fn snapshot_dataset(&self, snapshot_id: &str) -> String {
        format!("{}/{snapshot_id}", self.snapshots_dataset())
    }

    /// The ZFS snapshot sandboxes created from `snapshot_id` are cloned from.
    pub fn snapshot_origin(&self, snapshot_id: &str) -> String {
        format!("{}@{SNAPSHOT_SNAPSHOT}", self.snapshot_dataset(snapshot_id))
    }

    /// Mountpoint of a sandbox's clone, which is also its jail's `path`.
    pub fn sandbox_root(&self, id: &str) -> PathBuf {
        self.state_dir.join("sandboxes").join(id)
    }

    pub fn template_root(&self, name: &str) -> PathBuf {
        self.state_dir.join("templates").join(name)
    }

    /// Host directory holding the only file jails see of the host: the
    /// agent binary, copied here so the operator's build output is never
    /// exposed (or locked) by a mount.
    pub fn agent_dir(&self) -> PathBuf {
        self.state_dir.join("agent")
    }

    pub fn agent_binary(&self) -> PathBuf {
        self.agent_dir().join(AGENT_FILE_NAME)
    }

    /// Cache of downloaded release sets (`base.txz`, `MANIFEST`).
    pub fn dist_dir(&self, release: &str) -> PathBuf {
        self.state_dir.join("dist").join(release)
    }
}

/// Jail names double as rctl subjects (`jail:<name>:…`), so they must not
/// contain `:`; `.` would make them hierarchical jail names.
pub fn jail_name(id: &str) -> String {
    format!("copse-{id}")
}

/// The sandbox id behind a jail name of ours, if it is one.
pub fn sandbox_of_jail(name: &str) -> Option<&str> {
    name.strip_prefix("copse-").filter(|id| validate_id(id).is_ok())
}

/// Sandbox ids become jail names, dataset names, rctl subjects and path
/// components: allow only what is safe in all four.
pub fn validate_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && !id.starts_with('-');
    if ok { Ok(()) } else { Err(format!("invalid sandbox id {id:?}: use letters, digits, '-' or '_'")) }
}

fn validate_dataset(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && !name.starts_with('/')
        && !name.ends_with('/')
        && !name.contains("//")
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/' | ':'));
    if ok { Ok(()) } else { Err(format!("invalid ZFS dataset {name:?}")) }
}

/// One host program invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cmd {
    /// Absolute path; see [`tool`].
    pub program: String,
    pub args: Vec<String>,
    /// Added to an otherwise empty environment.
    pub env: Vec<(String, String)>,
    /// Forward each output line as progress (long template steps).
    pub stream: bool,
    /// A failure is logged, not fatal (best-effort cleanup only).
    pub may_fail: bool,
}

impl Cmd {
    pub fn new<I, S>(program: &str, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            program: program.to_string(),
            args: args.into_iter().map(Into::into).collect(),
            env: Vec::new(),
            stream: false,
            may_fail: false,
        }
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    pub fn streamed(mut self) -> Self {
        self.stream = true;
        self
    }

    pub fn may_fail(mut self) -> Self {
        self.may_fail = true;
        self
    }
}

impl fmt::Display for Cmd {
    /// A copy-pasteable shell line: what an operator reruns by hand.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (k, v) in &self.env {
            write!(f, "{k}={} ", shell_quote(v))?;
        }
        write!(f, "{}", shell_quote(&self.program))?;
        for a in &self.args {
            write!(f, " {}", shell_quote(a))?;
        }
        Ok(())
    }
}

pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | ':' | '=' | ',' | '@' | '%' | '+')
        });
    if plain { s.to_string() } else { format!("'{}'", s.replace('\'', r"'\''")) }
}

/// One privileged action. Each variant is something the executor can do and
/// log as a single line; the `Display` form is what golden tests compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Tell the operator what is happening (template builds).
    Progress(String),
    Run(Cmd),
    /// Create `path` (mode `mode`) if missing and refuse if any component
    /// at or below `below` is a symlink: the host mounts onto these paths,
    /// and a symlink planted in a sandbox's filesystem would redirect the
    /// mount onto the host's own tree (the check jail(8) also makes).
    RealDir {
        path: PathBuf,
        below: PathBuf,
        mode: u32,
    },
    /// Copy a host file (agent binary, resolv.conf) to `to` via a temporary
    /// name and a rename, so a running reader never sees half a file.
    CopyFile {
        from: PathBuf,
        to: PathBuf,
        mode: u32,
    },
    RemoveFile {
        path: PathBuf,
    },
    /// Check a downloaded file against the release's MANIFEST.
    VerifySha256 {
        file: PathBuf,
        manifest: PathBuf,
        entry: String,
    },
    /// `jail_set(2)` with `JAIL_CREATE`; yields the jid later steps use.
    CreateJail(jail::JailParams),
    /// `jail_remove(2)` of `jid` if the jail named `name` still has that
    /// jid; the kernel SIGKILLs every process in it first.
    RemoveJail {
        name: String,
        jid: i32,
    },
    /// Bind and listen on a unix socket at a host path outside every jail.
    BindAgentSocket {
        path: PathBuf,
    },
    /// fork, `jail_attach(2)`, exec the agent with the socket as fd 3.
    StartAgent(jail::AgentLaunch),
    /// fork, `jail_attach(2)` to `jid` (if the jail named `name` still has
    /// it), then `kill(-1, signal)`: the kernel signals every process of
    /// the jail but the sender in one pass, so nothing forked meanwhile
    /// escapes, and no binary of the sandbox's is trusted to do it.
    SignalJail {
        name: String,
        jid: i32,
        signal: lifecycle::JailSignal,
    },
    /// `from | to`, failing if either fails (`zfs send | zfs recv`).
    Pipe {
        from: Cmd,
        to: Cmd,
    },
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::Progress(line) => write!(f, "progress {line}"),
            Step::Run(cmd) => write!(f, "run {cmd}"),
            Step::RealDir { path, below, mode } => {
                write!(f, "realdir {} mode={mode:o} nosymlinks-below={}", path.display(), below.display())
            }
            Step::CopyFile { from, to, mode } => write!(f, "copy {} {} mode={mode:o}", from.display(), to.display()),
            Step::RemoveFile { path } => write!(f, "remove {}", path.display()),
            Step::VerifySha256 { file, manifest, entry } => {
                write!(f, "verify-sha256 {} against {} entry {entry}", file.display(), manifest.display())
            }
            Step::CreateJail(params) => write!(f, "jail_set create {params}"),
            Step::RemoveJail { name, jid } => write!(f, "jail_remove {jid} ({name})"),
            Step::BindAgentSocket { path } => write!(f, "listen {}", path.display()),
            Step::StartAgent(launch) => write!(f, "start {launch}"),
            Step::SignalJail { name, jid, signal } => write!(f, "signal {signal} every process in jail {jid} ({name})"),
            Step::Pipe { from, to } => write!(f, "run {from} | {to}"),
        }
    }
}

/// Renders a plan one step per line, for logs and golden tests.
pub fn render(steps: &[Step]) -> String {
    steps.iter().map(|s| format!("{s}\n")).collect()
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub fn layout() -> Layout {
        Layout {
            state_dir: PathBuf::from("/var/db/copse"),
            dataset_root: "zroot/copse".into(),
            devfs_ruleset: DEFAULT_DEVFS_RULESET,
        }
    }

    /// Compares line by line so a failing golden test names the first
    /// differing line instead of dumping two walls of text.
    pub fn assert_golden(actual: &str, expected: &str) {
        let expected = expected.trim_start_matches('\n');
        for (i, (a, e)) in actual.lines().zip(expected.lines()).enumerate() {
            assert_eq!(a, e, "line {} differs\n--- actual ---\n{actual}", i + 1);
        }
        assert_eq!(actual.lines().count(), expected.lines().count(), "line count differs\n--- actual ---\n{actual}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn layout_defaults_and_overrides() {
        let none = Layout::from_env(Path::new("/var/db/copse"), |_| None).unwrap();
        assert_eq!(none.dataset_root, "zroot/copse");
        assert_eq!(none.devfs_ruleset, 4270);
        assert_eq!(none.sandbox_dataset("abc"), "zroot/copse/sandboxes/abc");
        assert_eq!(none.template_snapshot("base"), "zroot/copse/templates/base@base");
        assert_eq!(none.snapshot_origin("s1"), "zroot/copse/snapshots/s1@snapshot");
        assert_eq!(none.sandbox_root("abc"), Path::new("/var/db/copse/sandboxes/abc"));
        assert_eq!(none.agent_binary(), Path::new("/var/db/copse/agent/copse-agent"));

        let env: HashMap<&str, &str> = [(ENV_DATASET, "tank/svc/copse"), (ENV_DEVFS_RULESET, "300")].into();
        let custom = Layout::from_env(Path::new("/srv/copse"), |k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(custom.templates_dataset(), "tank/svc/copse/templates");
        assert_eq!(custom.devfs_ruleset, 300);
    }

    #[test]
    fn layout_refuses_system_rulesets_and_odd_datasets() {
        assert!(Layout::from_env(Path::new("/x"), |k| (k == ENV_DEVFS_RULESET).then(|| "4".into())).is_err());
        assert!(Layout::from_env(Path::new("/x"), |k| (k == ENV_DATASET).then(|| "/zroot".into())).is_err());
        assert!(Layout::from_env(Path::new("/x"), |k| (k == ENV_DATASET).then(|| "zroot/a b".into())).is_err());
        assert!(Layout::from_env(Path::new("relative"), |_| None).is_err());
    }

    #[test]
    fn ids_that_would_break_jail_or_rctl_names_are_refused() {
        assert!(validate_id("i3k2m9x").is_ok());
        assert!(validate_id("sb_1-a").is_ok());
        for bad in ["", "a.b", "a:b", "a/b", "../x", "-x", "a b", &"x".repeat(65)] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        assert_eq!(jail_name("abc"), "copse-abc");
        assert_eq!(sandbox_of_jail("copse-abc"), Some("abc"));
        assert_eq!(sandbox_of_jail("other"), None);
        assert_eq!(sandbox_of_jail("copse-a.b"), None);
    }

    #[test]
    fn commands_render_as_shell_lines() {
        let cmd = Cmd::new("/usr/sbin/chroot", ["/x", "/bin/sh", "-c", "echo 'hi' there"]).env("A", "b c");
        assert_eq!(cmd.to_string(), r"A='b c' /usr/sbin/chroot /x /bin/sh -c 'echo '\''hi'\'' there'");
    }
}
