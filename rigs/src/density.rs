//! Pure pieces of the density rig: reading memory figures and deciding
//! whether the next batch fits.

use std::path::{Path, PathBuf};

pub const MIB: f64 = 1024.0 * 1024.0;

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:")?.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// The next batch's target: how many sandboxes may be alive after it, given
/// what is alive, the memory available now, the reserve that must stay free
/// and an estimate of the cost of one sandbox (with a 1.5× margin). `None`
/// when not even one more fits.
pub fn next_target(goal: usize, alive: usize, available: u64, reserve: u64, per_sandbox: f64) -> Option<usize> {
    if goal <= alive || available <= reserve {
        return None;
    }
    let fits = ((available - reserve) as f64 / (per_sandbox.max(1.0) * 1.5)).floor() as usize;
    (fits > 0).then(|| goal.min(alive + fits))
}

/// The cgroup directory of a sandbox under the first of `roots` (a
/// controller's root) that has one: `<root>/copse-*/<id>`.
pub fn sandbox_cgroup(roots: &[PathBuf], id: &str) -> Option<PathBuf> {
    for root in roots {
        for e in std::fs::read_dir(root).into_iter().flatten().flatten() {
            let name = e.file_name();
            if name.to_string_lossy().starts_with("copse") && e.path().join(id).is_dir() {
                return Some(e.path().join(id));
            }
        }
    }
    None
}

/// `(usage, rss)` bytes of one memory cgroup, on v1 (`memory.usage_in_bytes`,
/// `rss` of `memory.stat`) or v2 (`memory.current`, `anon`).
pub fn cgroup_memory(dir: &Path) -> Option<(u64, u64)> {
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let usage = read("memory.usage_in_bytes").or_else(|| read("memory.current"))?.trim().parse().ok()?;
    let stat = read("memory.stat").unwrap_or_default();
    let rss = stat_field(&stat, "rss").or_else(|| stat_field(&stat, "anon")).unwrap_or(0);
    Some((usage, rss))
}

pub fn stat_field(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo() {
        let m = "MemTotal:       24684084 kB\nMemFree:        1 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(m), Some(2048 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn batches_stop_before_the_reserve() {
        let gib = 1u64 << 30;
        assert_eq!(next_target(100, 0, 10 * gib, 4 * gib, MIB * 10.0), Some(100));
        // 1 GiB headroom, 100 MiB each with margin 150 MiB -> 6 more.
        assert_eq!(next_target(1000, 300, 5 * gib, 4 * gib, MIB * 100.0), Some(306));
        assert_eq!(next_target(1000, 300, 4 * gib, 4 * gib, MIB), None);
        assert_eq!(next_target(300, 300, 10 * gib, 0, MIB), None);
    }

    #[test]
    fn memory_stat_fields() {
        assert_eq!(stat_field("cache 5\nrss 4096\nrss_huge 0\n", "rss"), Some(4096));
        assert_eq!(stat_field("anon 12\nfile 3\n", "anon"), Some(12));
        assert_eq!(stat_field("rss_huge 1\n", "rss"), None);
    }
}
