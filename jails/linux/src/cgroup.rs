//! Per-sandbox cgroups, on either hierarchy the host offers.
//!
//! Hosts differ: a pure cgroup v2 system puts every controller under one
//! tree; a legacy or hybrid one (this workplace's CI among them) mounts each
//! v1 controller separately. Both are handled by naming, per sandbox, the
//! directories that make up its cgroup and the files that carry each knob.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use copse_substrate::{Limits, Usage};

const ROOT: &str = "/sys/fs/cgroup";
/// Start of the name of every copse cgroup subtree.
const PREFIX: &str = "copse";
const V1_CONTROLLERS: &[&str] = &["memory", "pids", "cpu", "cpuacct", "freezer"];
/// CFS period used to turn a CPU count into a quota.
const CPU_PERIOD_US: u64 = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// One unified tree at this mount point, with the controllers we need.
    V2(PathBuf),
    /// One mount per v1 controller.
    V1,
}

impl Hierarchy {
    /// Looks at the host: v2 when the unified tree offers memory, pids and
    /// cpu; otherwise v1, which must then have every controller mounted.
    pub fn detect() -> anyhow::Result<Self> {
        let root = Path::new(ROOT);
        for candidate in [root.to_path_buf(), root.join("unified")] {
            let controllers = fs::read_to_string(candidate.join("cgroup.controllers")).unwrap_or_default();
            if has_v2_controllers(&controllers) {
                return Ok(Self::V2(candidate));
            }
        }
        for controller in V1_CONTROLLERS {
            if !root.join(controller).join("cgroup.procs").exists() {
                bail!(
                    "no usable cgroup hierarchy: v2 lacks memory/pids/cpu and v1 has no {controller} controller at {ROOT}/{controller}"
                );
            }
        }
        Ok(Self::V1)
    }
}

/// The cgroups of one gateway's sandboxes: `<subtree>/<id>` in every
/// hierarchy. Each state directory gets its own subtree, so two gateways
/// on one host (a test run beside a service) never touch each other's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroups {
    pub hierarchy: Hierarchy,
    pub subtree: String,
}

impl Cgroups {
    pub fn new(hierarchy: Hierarchy, state_dir: &Path) -> Self {
        Self { hierarchy, subtree: subtree_name(state_dir) }
    }

    /// The sandbox's directory in one v1 controller's tree (ignored on v2).
    fn dir(&self, controller: &str, id: &str) -> PathBuf {
        self.parent(controller).join(id)
    }

    fn parent(&self, controller: &str) -> PathBuf {
        match &self.hierarchy {
            Hierarchy::V2(root) => root.join(&self.subtree),
            Hierarchy::V1 => Path::new(ROOT).join(controller).join(&self.subtree),
        }
    }

    /// Every directory that makes up the sandbox's cgroup.
    pub fn dirs(&self, id: &str) -> Vec<PathBuf> {
        match &self.hierarchy {
            Hierarchy::V2(_) => vec![self.dir("", id)],
            Hierarchy::V1 => V1_CONTROLLERS.iter().map(|c| self.dir(c, id)).collect(),
        }
    }

    /// Where a process writes its pid to join the sandbox's cgroup.
    pub fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        self.dirs(id).into_iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// The ids of every sandbox cgroup that exists.
    pub fn existing(&self) -> Vec<String> {
        list_dirs(&self.parent("pids"))
    }

    /// The knob writes that impose `limits`, as (file, value).
    pub fn limit_writes(&self, id: &str, limits: &Limits) -> Vec<(PathBuf, String)> {
        let memory = (limits.memory_mb * 1024 * 1024).to_string();
        let quota = (u64::from(limits.cpu_count.max(1)) * CPU_PERIOD_US).to_string();
        match &self.hierarchy {
            Hierarchy::V2(_) => {
                let dir = self.dir("", id);
                vec![
                    (dir.join("memory.max"), memory),
                    (dir.join("memory.swap.max"), "0".into()),
                    (dir.join("pids.max"), limits.pids.to_string()),
                    (dir.join("cpu.max"), format!("{quota} {CPU_PERIOD_US}")),
                ]
            }
            Hierarchy::V1 => vec![
                (self.dir("memory", id).join("memory.limit_in_bytes"), memory),
                (self.dir("pids", id).join("pids.max"), limits.pids.to_string()),
                (self.dir("cpu", id).join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string()),
                (self.dir("cpu", id).join("cpu.cfs_quota_us"), quota),
            ],
        }
    }

    pub fn create(&self, id: &str, limits: &Limits) -> anyhow::Result<()> {
        if let Hierarchy::V2(root) = &self.hierarchy {
            prepare_v2_subtree(root, &self.subtree)?;
        }
        for dir in self.dirs(id) {
            fs::create_dir_all(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        }
        for (file, value) in self.limit_writes(id, limits) {
            match fs::write(&file, &value) {
                Ok(()) => {}
                // memory.swap.max is absent on hosts without swap accounting.
                Err(e) if e.kind() == io::ErrorKind::NotFound && file.ends_with("memory.swap.max") => {}
                Err(e) => return Err(e).with_context(|| format!("writing {value} to {}", file.display())),
            }
        }
        Ok(())
    }

    /// Pids of every process in the sandbox's cgroup.
    pub fn pids(&self, id: &str) -> Vec<i32> {
        fs::read_to_string(self.dir("pids", id).join("cgroup.procs")).map(|s| parse_pids(&s)).unwrap_or_default()
    }

    /// The file that freezes the cgroup, and what it reads when frozen and
    /// thawed: v1's freezer controller or v2's `cgroup.freeze`.
    fn freezer(&self, id: &str) -> (PathBuf, &'static str, &'static str) {
        match self.hierarchy {
            Hierarchy::V2(_) => (self.dir("", id).join("cgroup.freeze"), "1", "0"),
            Hierarchy::V1 => (self.dir("freezer", id).join("freezer.state"), "FROZEN", "THAWED"),
        }
    }

    /// The directory CRIU's `--freeze-cgroup` takes.
    pub fn freezer_dir(&self, id: &str) -> PathBuf {
        match self.hierarchy {
            Hierarchy::V2(_) => self.dir("", id),
            Hierarchy::V1 => self.dir("freezer", id),
        }
    }

    pub fn is_frozen(&self, id: &str) -> bool {
        let (file, frozen, _) = self.freezer(id);
        fs::read_to_string(file).is_ok_and(|s| s.trim() == frozen)
    }

    /// Freezes or thaws every process of the sandbox and waits until the
    /// kernel reports it done (a freeze passes through `FREEZING` while
    /// tasks reach a safe point).
    pub fn set_frozen(&self, id: &str, frozen: bool) -> anyhow::Result<()> {
        let (file, on, off) = self.freezer(id);
        let want = if frozen { on } else { off };
        fs::write(&file, want).with_context(|| format!("writing {}", file.display()))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let state = match self.hierarchy {
                Hierarchy::V2(_) => {
                    let events = fs::read_to_string(self.dir("", id).join("cgroup.events")).unwrap_or_default();
                    if stat_field(&events, "frozen") == Some(u64::from(frozen)) { want } else { "" }.to_string()
                }
                Hierarchy::V1 => fs::read_to_string(&file).unwrap_or_default().trim().to_string(),
            };
            if state == want {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("sandbox {id} did not reach {want} within 5 s (at '{state}')");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Kills every process in the cgroup and removes it. Idempotent.
    /// Reaps the sandbox's init if this process is its parent (the
    /// gateway is a child subreaper, so it inherits every init).
    pub fn destroy(&self, id: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut own_children = Vec::new();
        loop {
            let pids = self.pids(id);
            if pids.is_empty() {
                break;
            }
            if let Hierarchy::V2(_) = self.hierarchy {
                let _ = fs::write(self.dir("", id).join("cgroup.kill"), "1");
            }
            for pid in &pids {
                if parent_of(*pid) == Some(std::process::id() as i32) && !own_children.contains(pid) {
                    own_children.push(*pid);
                }
                // SAFETY: kill with plain integers.
                unsafe { libc::kill(*pid, libc::SIGKILL) };
            }
            // A frozen task acts on SIGKILL only once thawed; thawing after
            // the kill lets it die without running another instruction.
            if self.is_frozen(id) {
                let _ = fs::write(self.freezer(id).0, self.freezer(id).2);
            }
            if Instant::now() > deadline {
                bail!("processes {pids:?} of sandbox {id} survived SIGKILL for 5 s");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        for pid in own_children {
            // Killed and out of the cgroup: the wait returns at once.
            // SAFETY: waitpid on a child of this process.
            unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
        }
        for dir in self.dirs(id) {
            remove_cgroup_dir(&dir, deadline)?;
        }
        Ok(())
    }

    pub fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        match &self.hierarchy {
            Hierarchy::V2(_) => {
                let dir = self.dir("", id);
                let cpu = fs::read_to_string(dir.join("cpu.stat")).context("reading cpu.stat")?;
                let stat = fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
                Ok(Usage {
                    cpu_ns: stat_field(&cpu, "usage_usec").unwrap_or(0) * 1000,
                    memory_bytes: read_u64(&dir.join("memory.current"))?,
                    memory_cache_bytes: stat_field(&stat, "file").unwrap_or(0),
                    disk_bytes: 0,
                })
            }
            Hierarchy::V1 => {
                let stat = fs::read_to_string(self.dir("memory", id).join("memory.stat")).unwrap_or_default();
                Ok(Usage {
                    cpu_ns: read_u64(&self.dir("cpuacct", id).join("cpuacct.usage"))?,
                    memory_bytes: read_u64(&self.dir("memory", id).join("memory.usage_in_bytes"))?,
                    memory_cache_bytes: stat_field(&stat, "total_cache")
                        .or_else(|| stat_field(&stat, "cache"))
                        .unwrap_or(0),
                    disk_bytes: 0,
                })
            }
        }
    }
}

/// `copse-<8 hex digits of the state directory's path hash>`.
pub fn subtree_name(state_dir: &Path) -> String {
    use sha2::{Digest, Sha256};
    let path = fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let digest = Sha256::digest(path.as_os_str().as_encoded_bytes());
    format!("{PREFIX}-{:02x}{:02x}{:02x}{:02x}", digest[0], digest[1], digest[2], digest[3])
}

/// The parent pid of a live process, from /proc.
pub fn parent_of(pid: i32) -> Option<i32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix("PPid:")).and_then(|v| v.trim().parse().ok())
}

fn has_v2_controllers(list: &str) -> bool {
    let names: Vec<&str> = list.split_whitespace().collect();
    ["memory", "pids", "cpu"].iter().all(|c| names.contains(c))
}

/// v2 only delegates controllers to children that the parent enables.
fn prepare_v2_subtree(root: &Path, name: &str) -> anyhow::Result<()> {
    let subtree = root.join(name);
    fs::create_dir_all(&subtree).with_context(|| format!("creating {}", subtree.display()))?;
    for dir in [root, subtree.as_path()] {
        let file = dir.join("cgroup.subtree_control");
        let current = fs::read_to_string(&file).unwrap_or_default();
        if !has_v2_controllers(&current) {
            fs::write(&file, "+memory +pids +cpu")
                .with_context(|| format!("enabling controllers in {}", file.display()))?;
        }
    }
    Ok(())
}

fn remove_cgroup_dir(dir: &Path, deadline: Instant) -> anyhow::Result<()> {
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            // The kernel releases a cgroup a moment after its last task exits.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e).with_context(|| format!("removing cgroup {}", dir.display())),
        }
    }
}

fn list_dirs(parent: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(parent) else { return Vec::new() };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
        .filter_map(|e| e.file_name().into_string().ok())
        .collect()
}

fn read_u64(path: &Path) -> anyhow::Result<u64> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.trim().parse().with_context(|| format!("parsing {}", path.display()))
}

pub(crate) fn parse_pids(text: &str) -> Vec<i32> {
    text.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// The value of `key` in a flat-keyed cgroup stat file.
pub(crate) fn stat_field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_limits_land_in_each_controllers_files() {
        let limits = Limits { cpu_count: 2, memory_mb: 256, disk_mb: 1, pids: 64 };
        let cgroups = Cgroups { hierarchy: Hierarchy::V1, subtree: "copse".into() };
        let writes = cgroups.limit_writes("sbx", &limits);
        assert!(
            writes.contains(&(
                PathBuf::from("/sys/fs/cgroup/memory/copse/sbx/memory.limit_in_bytes"),
                "268435456".into()
            ))
        );
        assert!(writes.contains(&(PathBuf::from("/sys/fs/cgroup/pids/copse/sbx/pids.max"), "64".into())));
        assert!(writes.contains(&(PathBuf::from("/sys/fs/cgroup/cpu/copse/sbx/cpu.cfs_quota_us"), "200000".into())));
    }

    #[test]
    fn v2_limits_use_the_unified_names() {
        let limits = Limits { cpu_count: 1, memory_mb: 1, disk_mb: 1, pids: 10 };
        let cgroups = Cgroups { hierarchy: Hierarchy::V2("/cg".into()), subtree: "copse".into() };
        let writes = cgroups.limit_writes("a", &limits);
        assert_eq!(writes[0], (PathBuf::from("/cg/copse/a/memory.max"), "1048576".into()));
        assert!(writes.contains(&(PathBuf::from("/cg/copse/a/cpu.max"), "100000 100000".into())));
    }

    #[test]
    fn stat_files_and_pid_lists_parse() {
        let stat = "cache 4096\nrss 100\ntotal_cache 8192\n";
        assert_eq!(stat_field(stat, "total_cache"), Some(8192));
        assert_eq!(stat_field(stat, "cache"), Some(4096));
        assert_eq!(stat_field(stat, "missing"), None);
        assert_eq!(parse_pids("12\n 34\n\n"), vec![12, 34]);
    }

    #[test]
    fn each_state_directory_gets_its_own_subtree() {
        let a = subtree_name(Path::new("/var/lib/copse"));
        assert!(a.starts_with("copse-") && a.len() == "copse-".len() + 8);
        assert_eq!(a, subtree_name(Path::new("/var/lib/copse")));
        assert_ne!(a, subtree_name(Path::new("/var/lib/copse-test")));
    }

    #[test]
    fn v2_needs_memory_pids_and_cpu() {
        assert!(has_v2_controllers("cpuset cpu io memory hugetlb pids rdma"));
        assert!(!has_v2_controllers("hugetlb"));
    }
}
