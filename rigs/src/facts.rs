//! Facts about the host, the checkout and the binaries under test, for the
//! result file's `host`, `git` and `params`.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{Value, json};

/// stdout of a successful command, `None` otherwise.
pub fn command_output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `{"commit", "dirty"}` of the current directory's checkout.
pub fn git_facts() -> Value {
    let commit = command_output(Command::new("git").args(["rev-parse", "HEAD"])).map(|s| s.trim().to_string());
    let dirty = command_output(Command::new("git").args(["status", "--porcelain"])).map(|s| !s.trim().is_empty());
    json!({"commit": commit, "dirty": dirty})
}

/// The schema's `host` object.
pub fn host_facts() -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string()));
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string()));
    let mem = read("/proc/meminfo").lines().find_map(|l| {
        l.strip_prefix("MemTotal:").and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    let cgroup = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() { "v2" } else { "v1" };
    let virt = command_output(&mut Command::new("systemd-detect-virt")).map(|s| s.trim().to_string());
    json!({
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "os": os,
        "cpu_model": cpu,
        "cores": cores(),
        "memory_bytes": mem.map(|kb| kb * 1024),
        "cgroup": cgroup,
        "substrate": "linux-namespaces",
        "virtualization": virt,
        // Expedited RCU shortens cgroup v1 migration, a large share of a
        // cold create (see the README's host tuning).
        "rcu_expedited": read("/sys/kernel/rcu_expedited").trim() == "1",
        "load_average": read("/proc/loadavg").split_whitespace().next().unwrap_or("").to_string(),
    })
}

/// CPUs available to this process (0 if unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

/// `copse up` processes already running (another gateway competes for the CPU).
pub fn other_gateways() -> usize {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| is_copse_up(c))
        .count()
}

/// Whether a NUL-separated `/proc/PID/cmdline` is `…copse up …`.
pub fn is_copse_up(cmdline: &[u8]) -> bool {
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    args.len() > 1 && args[0].ends_with(b"copse") && args[1] == b"up"
}

/// `/proc/loadavg`'s 1/5/15-minute figures: other work on the host skews every number here.
pub fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

/// Whether a `loadavg()` string's 1-minute figure says the host was busy (>= 0.5).
pub fn load_is_busy(loadavg: Option<&str>) -> bool {
    loadavg.and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok()).is_some_and(|x| x >= 0.5)
}

/// A file's modification time, RFC 3339.
pub fn mtime(p: &Path) -> Option<String> {
    let t = std::fs::metadata(p).ok()?.modified().ok()?;
    time::OffsetDateTime::from(t).format(&time::format_description::well_known::Rfc3339).ok()
}

/// `n` random bytes as lowercase hex (API keys for the rig's own gateway).
pub fn random_hex(n: usize) -> anyhow::Result<String> {
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The data dir's file system and, for ext4, whether it has a journal (a
/// journalled ext4 has a jbd2 entry in /proc).
pub fn data_dir_fs(dir: &Path) -> Value {
    let found = command_output(Command::new("findmnt").args(["-no", "FSTYPE,SOURCE"]).arg("-T").arg(dir));
    let Some(line) = found else { return json!({"summary": "unknown (findmnt failed)"}) };
    let mut f = line.split_whitespace();
    let (fstype, source) = (f.next().unwrap_or("?").to_string(), f.next().unwrap_or("?").to_string());
    let device = source.rsplit('/').next().unwrap_or("").to_string();
    let journal = (fstype == "ext4").then(|| {
        std::fs::read_dir("/proc/fs/jbd2")
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(&format!("{device}-")))
    });
    let summary = match journal {
        Some(true) => "ext4 with a journal".to_string(),
        Some(false) => "ext4 without a journal".to_string(),
        None => fstype.clone(),
    };
    json!({"fstype": fstype, "source": source, "journal": journal, "summary": summary})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copse_up_cmdlines() {
        assert!(is_copse_up(b"/work/main/target/release/copse\0up\0--listen\0localhost:1\0"));
        assert!(is_copse_up(b"copse\0up"));
        assert!(!is_copse_up(b"copse\0template\0build\0"));
        assert!(!is_copse_up(b"copse-agent\0up\0"));
        assert!(!is_copse_up(b"copse"));
    }

    #[test]
    fn busy_load() {
        assert!(load_is_busy(Some("0.50 0.1 0.0")));
        assert!(!load_is_busy(Some("0.49 3.0 3.0")));
        assert!(!load_is_busy(Some("x")));
        assert!(!load_is_busy(None));
    }
}
