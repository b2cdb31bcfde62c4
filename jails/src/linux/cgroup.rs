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

use crate::{Limits, Usage};

const ROOT: &str = "/sys/fs/cgroup";
/// Name of copse's subtree in every hierarchy.
const SUBTREE: &str = "copse";
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

    /// Every directory that makes up the sandbox's cgroup.
    pub fn dirs(&self, id: &str) -> Vec<PathBuf> {
        match self {
            Self::V2(root) => vec![root.join(SUBTREE).join(id)],
            Self::V1 => V1_CONTROLLERS.iter().map(|c| Path::new(ROOT).join(c).join(SUBTREE).join(id)).collect(),
        }
    }

    /// Where a process writes its pid to join the sandbox's cgroup.
    pub fn procs_files(&self, id: &str) -> Vec<PathBuf> {
        self.dirs(id).into_iter().map(|d| d.join("cgroup.procs")).collect()
    }

    /// The ids of every sandbox cgroup that exists.
    pub fn existing(&self) -> Vec<String> {
        let parent = match self {
            Self::V2(root) => root.join(SUBTREE),
            Self::V1 => Path::new(ROOT).join("pids").join(SUBTREE),
        };
        list_dirs(&parent)
    }

    /// The knob writes that impose `limits`, as (file, value).
    pub fn limit_writes(&self, id: &str, limits: &Limits) -> Vec<(PathBuf, String)> {
        let memory = (limits.memory_mb * 1024 * 1024).to_string();
        let quota = (u64::from(limits.cpu_count.max(1)) * CPU_PERIOD_US).to_string();
        match self {
            Self::V2(root) => {
                let dir = root.join(SUBTREE).join(id);
                vec![
                    (dir.join("memory.max"), memory),
                    (dir.join("memory.swap.max"), "0".into()),
                    (dir.join("pids.max"), limits.pids.to_string()),
                    (dir.join("cpu.max"), format!("{quota} {CPU_PERIOD_US}")),
                ]
            }
            Self::V1 => {
                let dir = |c: &str| Path::new(ROOT).join(c).join(SUBTREE).join(id);
                vec![
                    (dir("memory").join("memory.limit_in_bytes"), memory),
                    (dir("pids").join("pids.max"), limits.pids.to_string()),
                    (dir("cpu").join("cpu.cfs_period_us"), CPU_PERIOD_US.to_string()),
                    (dir("cpu").join("cpu.cfs_quota_us"), quota),
                ]
            }
        }
    }

    pub fn create(&self, id: &str, limits: &Limits) -> anyhow::Result<()> {
        if let Self::V2(root) = self {
            prepare_v2_subtree(root)?;
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
        let file = match self {
            Self::V2(root) => root.join(SUBTREE).join(id).join("cgroup.procs"),
            Self::V1 => Path::new(ROOT).join("pids").join(SUBTREE).join(id).join("cgroup.procs"),
        };
        fs::read_to_string(file).map(|s| parse_pids(&s)).unwrap_or_default()
    }

    /// Kills every process in the cgroup and removes it. Idempotent.
    pub fn destroy(&self, id: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let pids = self.pids(id);
            if pids.is_empty() {
                break;
            }
            if let Self::V2(root) = self {
                let _ = fs::write(root.join(SUBTREE).join(id).join("cgroup.kill"), "1");
            }
            for pid in &pids {
                // SAFETY: kill and waitpid with plain integers; a pid that is
                // not our child makes waitpid fail harmlessly with ECHILD.
                unsafe {
                    libc::kill(*pid, libc::SIGKILL);
                    libc::waitpid(*pid, std::ptr::null_mut(), libc::WNOHANG);
                }
            }
            if Instant::now() > deadline {
                bail!("processes {pids:?} of sandbox {id} survived SIGKILL for 5 s");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        for dir in self.dirs(id) {
            remove_cgroup_dir(&dir, deadline)?;
        }
        Ok(())
    }

    pub fn usage(&self, id: &str) -> anyhow::Result<Usage> {
        match self {
            Self::V2(root) => {
                let dir = root.join(SUBTREE).join(id);
                let cpu = fs::read_to_string(dir.join("cpu.stat")).context("reading cpu.stat")?;
                let mem = read_u64(&dir.join("memory.current"))?;
                let stat = fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
                Ok(Usage {
                    cpu_ns: stat_field(&cpu, "usage_usec").unwrap_or(0) * 1000,
                    memory_bytes: mem,
                    memory_cache_bytes: stat_field(&stat, "file").unwrap_or(0),
                    disk_bytes: 0,
                })
            }
            Self::V1 => {
                let dir = |c: &str| Path::new(ROOT).join(c).join(SUBTREE).join(id);
                let stat = fs::read_to_string(dir("memory").join("memory.stat")).unwrap_or_default();
                Ok(Usage {
                    cpu_ns: read_u64(&dir("cpuacct").join("cpuacct.usage"))?,
                    memory_bytes: read_u64(&dir("memory").join("memory.usage_in_bytes"))?,
                    memory_cache_bytes: stat_field(&stat, "total_cache")
                        .or_else(|| stat_field(&stat, "cache"))
                        .unwrap_or(0),
                    disk_bytes: 0,
                })
            }
        }
    }
}

fn has_v2_controllers(list: &str) -> bool {
    let names: Vec<&str> = list.split_whitespace().collect();
    ["memory", "pids", "cpu"].iter().all(|c| names.contains(c))
}

/// v2 only delegates controllers to children that the parent enables.
fn prepare_v2_subtree(root: &Path) -> anyhow::Result<()> {
    let subtree = root.join(SUBTREE);
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
        let writes = Hierarchy::V1.limit_writes("sbx", &limits);
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
        let writes = Hierarchy::V2("/cg".into()).limit_writes("a", &limits);
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
    fn v2_needs_memory_pids_and_cpu() {
        assert!(has_v2_controllers("cpuset cpu io memory hugetlb pids rdma"));
        assert!(!has_v2_controllers("hugetlb"));
    }
}
