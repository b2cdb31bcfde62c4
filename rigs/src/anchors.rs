//! The anchors measured beside copse in the same run: what starting a
//! process costs with nothing around it (fork+exec), with the namespaces a
//! copse sandbox gets (`unshare`), and with the container tools a user
//! would otherwise pick: the OCI runtime alone (`runc run` of a bundle) and
//! podman on top of it (Debian's packages). Debian's crun refuses hosts with
//! a hybrid cgroup layout (this one), so podman runs with runc.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::{Scenario, ms};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Anchor {
    ForkExec,
    Unshare,
    Runc,
    Podman,
}

impl Anchor {
    pub const ALL: [Anchor; 4] = [Anchor::ForkExec, Anchor::Unshare, Anchor::Runc, Anchor::Podman];

    /// The metric (and, without `_ms`, the scenario-name stem) it records.
    pub fn metric(self) -> &'static str {
        match self {
            Anchor::ForkExec => "fork_exec_ms",
            Anchor::Unshare => "unshare_ms",
            Anchor::Runc => "runc_ms",
            Anchor::Podman => "podman_ms",
        }
    }

    pub fn scenario_name(self, cc: usize) -> String {
        format!("anchor-{}-cc{cc}", self.metric().trim_end_matches("_ms").replace('_', "-"))
    }

    /// Whether it needs the container tools (and gets fewer samples).
    pub fn is_container(self) -> bool {
        matches!(self, Anchor::Runc | Anchor::Podman)
    }

    /// The command line sample `i` runs; `bundle` is the runc bundle.
    pub fn argv(self, rootfs: &Path, bundle: &Path, i: usize) -> Vec<String> {
        let v: Vec<&str> = match self {
            Anchor::ForkExec => vec!["/bin/true"],
            // The namespaces copse's Linux substrate unshares for a sandbox.
            Anchor::Unshare => {
                vec!["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--cgroup", "--fork", "/bin/true"]
            }
            Anchor::Runc => {
                let b = bundle.display().to_string();
                let name = format!("copse-anchor-{}-{i}", std::process::id());
                return ["runc", "run", "--bundle", &b, &name].map(String::from).to_vec();
            }
            // `:O` mounts an overlay over the rootfs so the template stays
            // untouched; explicit ulimits because podman's defaults exceed
            // this container host's hard limits.
            Anchor::Podman => {
                let r = format!("{}:O", rootfs.display());
                return [
                    "podman",
                    "run",
                    "--rm",
                    "--network",
                    "none",
                    "--runtime",
                    "runc",
                    "--ulimit",
                    "nofile=1024:1024",
                    "--ulimit",
                    "nproc=4096:4096",
                    "--rootfs",
                    &r,
                    "/bin/true",
                ]
                .map(String::from)
                .to_vec();
            }
        };
        v.into_iter().map(String::from).collect()
    }
}

/// Whether podman and runc can run; installs them from Debian if missing
/// (the rig's own dependency, kept out of the project's bootstrap).
pub fn containers_available(notes: &mut Vec<String>) -> bool {
    let ok = || {
        ["podman", "runc"]
            .iter()
            .all(|b| Command::new(b).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok())
    };
    if ok() {
        return true;
    }
    eprintln!("== installing podman and runc from Debian for the container anchors");
    let _ = Command::new("apt-get")
        .args(["install", "-y", "-qq", "podman", "runc"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null())
        .status();
    let available = ok();
    if !available {
        notes.push("container anchors skipped: podman/runc missing and `apt-get install podman runc` failed".into());
    }
    available
}

/// `n` samples of one anchor spread over `cc` threads (like the copse
/// scenarios' workers); one untimed run per thread first.
pub fn measure(anchor: Anchor, cc: usize, n: usize, rootfs: &Path, bundle: &Path) -> Scenario {
    let next = Arc::new(AtomicUsize::new(0));
    let barrier = Arc::new(std::sync::Barrier::new(cc + 1));
    let workers: Vec<_> = (0..cc)
        .map(|w| {
            let (next, barrier) = (next.clone(), barrier.clone());
            let (rootfs, bundle) = (rootfs.to_path_buf(), bundle.to_path_buf());
            std::thread::spawn(move || {
                let _ = run_once(&anchor.argv(&rootfs, &bundle, usize::MAX - w));
                barrier.wait();
                let mut out = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= n {
                        break;
                    }
                    out.push(run_once(&anchor.argv(&rootfs, &bundle, i)));
                }
                out
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    let mut values = Vec::new();
    let mut errors = Vec::new();
    for w in workers {
        for r in w.join().unwrap_or_else(|_| vec![Err("anchor worker panicked".into())]) {
            match r {
                Ok(d) => values.push(Some(d)),
                Err(e) => errors.push(e),
            }
        }
    }
    let mut sc = Scenario {
        name: anchor.scenario_name(cc),
        client: format!(
            "std::process::Command spawn..wait of `{}`, {cc} threads",
            anchor.argv(rootfs, bundle, 0).join(" ")
        ),
        concurrency: cc,
        wall_ms: Some(ms(t0.elapsed())),
        errors,
        ..Scenario::default()
    };
    sc.counters.insert("ok".into(), values.len().into());
    sc.series.insert(anchor.metric().into(), values);
    sc
}

/// A runc bundle in `dir`: `runc spec`'s defaults with the template's
/// rootfs read-only, `/bin/true` as the process and copse's six namespaces.
pub fn runc_bundle(dir: &Path, rootfs: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let _ = std::fs::remove_file(dir.join("config.json"));
    let st = Command::new("runc").args(["spec", "--bundle"]).arg(dir).status()?;
    anyhow::ensure!(st.success(), "runc spec: {st}");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    c["root"] = serde_json::json!({"path": rootfs, "readonly": true});
    c["process"]["args"] = serde_json::json!(["/bin/true"]);
    c["process"]["terminal"] = false.into();
    if let Some(ns) = c["linux"]["namespaces"].as_array_mut() {
        if !ns.iter().any(|n| n["type"] == "cgroup") {
            ns.push(serde_json::json!({"type": "cgroup"}));
        }
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&c)?)?;
    Ok(())
}

fn run_once(argv: &[String]) -> Result<f64, String> {
    let t = Instant::now();
    let out = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("{}: {e}", argv[0]))?;
    let d = ms(t.elapsed());
    if !out.status.success() {
        return Err(format!("{}: {}: {}", argv.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(Anchor::ForkExec.scenario_name(10), "anchor-fork-exec-cc10");
        assert_eq!(Anchor::Podman.scenario_name(1), "anchor-podman-cc1");
        assert!(Anchor::Podman.argv(Path::new("/r"), Path::new("/b"), 0).contains(&"/r:O".to_string()));
        assert_ne!(
            Anchor::Runc.argv(Path::new("/r"), Path::new("/b"), 1),
            Anchor::Runc.argv(Path::new("/r"), Path::new("/b"), 2)
        );
    }

    #[test]
    fn fork_exec_runs_for_real() {
        let sc = measure(Anchor::ForkExec, 2, 4, Path::new("/"), Path::new("/"));
        assert_eq!(sc.count("fork_exec_ms"), 4);
        assert!(sc.wall_ms.unwrap() > 0.0);
    }
}
