//! The gateway under test: `copse template build`, then a private `copse up`
//! on a free loopback port, stopped with SIGTERM.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::facts::{command_output, mtime};

/// The binaries and data directory a rig runs the gateway with.
#[derive(clap::Args, Debug, Clone)]
pub struct Binaries {
    /// Gateway binary.
    #[arg(long, default_value = "target/release/copse")]
    pub copse: PathBuf,
    /// In-sandbox agent binary handed to the gateway.
    #[arg(long, env = "COPSE_AGENT", default_value = "target/x86_64-unknown-linux-musl/release/copse-agent")]
    pub agent: PathBuf,
    /// Gateway data directory (templates are built there on first use).
    #[arg(long, default_value = "/var/lib/copse-bench")]
    pub data_dir: PathBuf,
}

impl Binaries {
    /// Fails unless both binaries exist (the rigs never build them).
    pub fn check(&self) -> anyhow::Result<()> {
        for (what, p) in [("gateway", &self.copse), ("agent", &self.agent)] {
            if !p.is_file() {
                bail!("{what} binary {} is missing: run `mise run build` first", p.display());
            }
        }
        Ok(())
    }

    /// `copse template build [TEMPLATE] --data-dir DIR` (idempotent; a first
    /// build shows its progress on stderr).
    pub fn build_template(&self, template: Option<&str>) -> anyhow::Result<()> {
        eprintln!("== copse template build {} --data-dir {}", template.unwrap_or(""), self.data_dir.display());
        let status = Command::new(&self.copse)
            .args(["template", "build"])
            .args(template)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .env("COPSE_AGENT", &self.agent)
            .status()
            .context("running copse template build")?;
        if !status.success() {
            bail!("copse template build failed: {status}");
        }
        Ok(())
    }

    /// Whether `copse up` has a `--pool` option.
    pub fn pool_supported(&self) -> bool {
        self.up_has_option("--pool")
    }

    /// Whether `copse up --help` lists `option`.
    pub fn up_has_option(&self, option: &str) -> bool {
        command_output(Command::new(&self.copse).args(["up", "--help"])).unwrap_or_default().contains(option)
    }

    /// Result-file `params` describing the binaries.
    pub fn params(&self) -> Value {
        let version = command_output(Command::new(&self.copse).arg("version")).unwrap_or_default();
        json!({
            "gateway": self.copse.display().to_string(),
            "gateway_version": version.trim(),
            "gateway_binary_mtime": mtime(&self.copse),
            "agent": self.agent.display().to_string(),
            "agent_binary_mtime": mtime(&self.agent),
            "data_dir": self.data_dir.display().to_string(),
        })
    }
}

pub struct Gateway {
    child: Option<Child>,
    pub addr: SocketAddr,
    pub log: PathBuf,
}

impl Gateway {
    /// Starts `copse up` with one `--pool SPEC` per entry of `pools` and
    /// waits until it listens. Its output goes to `$TMPDIR/<log_prefix>-<port>.log`.
    pub fn start(bins: &Binaries, key: &str, pools: &[String], log_prefix: &str) -> anyhow::Result<Self> {
        Self::start_with_env(bins, key, pools, log_prefix, &[])
    }

    /// `start`, with `env` added to the gateway's environment (e.g.
    /// `COPSE_CRIU` naming a missing binary: a gateway without memory snapshots).
    pub fn start_with_env(
        bins: &Binaries,
        key: &str,
        pools: &[String],
        log_prefix: &str,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::start_with(bins, key, pools, log_prefix, env, &[])
    }

    /// `start_with_env`, with `args` added to `copse up`'s command line.
    pub fn start_with(
        bins: &Binaries,
        key: &str,
        pools: &[String],
        log_prefix: &str,
        env: &[(&str, &str)],
        args: &[String],
    ) -> anyhow::Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let log = std::env::temp_dir().join(format!("{log_prefix}-{port}.log"));
        let logf = std::fs::File::create(&log)?;
        let mut cmd = Command::new(&bins.copse);
        cmd.args(["up", "--listen", &addr.to_string(), "--data-dir"]).arg(&bins.data_dir);
        for p in pools {
            cmd.args(["--pool", p]);
        }
        cmd.args(args);
        cmd.envs(env.iter().copied());
        let child = cmd
            .env("COPSE_API_KEY", key)
            .env("COPSE_AGENT", &bins.agent)
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("starting copse up")?;
        let mut gw = Self { child: Some(child), addr, log };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(gw);
            }
            if let Some(status) = gw.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                gw.child = None;
                bail!("copse up exited with {status} before listening; log {}:\n{}", gw.log.display(), tail(&gw.log));
            }
            if Instant::now() > deadline {
                bail!("copse up did not listen on {addr} within 300 s; log {}", gw.log.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Direct children of the gateway by state letter, e.g. {"S": 12, "Z": 3}.
    pub fn children(&self) -> BTreeMap<String, usize> {
        let Some(pid) = self.child.as_ref().map(Child::id) else { return BTreeMap::new() };
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            if let Some((state, _)) = state_and_ppid(&stat).filter(|(_, ppid)| *ppid == pid) {
                *out.entry(state.to_string()).or_insert(0) += 1;
            }
        }
        out
    }

    /// SIGTERM, then wait up to 30 s (SIGKILL after that).
    pub fn stop(mut self, notes: &mut Vec<String>) {
        if let Some(msg) = self.terminate() {
            notes.push(msg);
        }
    }

    fn terminate(&mut self) -> Option<String> {
        let mut child = self.child.take()?;
        let t0 = Instant::now();
        // SAFETY: plain kill(2) on the pid of a child we spawned and have not reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        while t0.elapsed() < Duration::from_secs(30) {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return None,
                Ok(Some(status)) => {
                    return Some(format!("gateway on {} exited with {status} after SIGTERM", self.addr));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Some(format!("waiting for gateway: {e}")),
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        Some(format!("gateway on {} ignored SIGTERM for 30 s and was SIGKILLed", self.addr))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(msg) = self.terminate() {
            eprintln!("{msg}");
        }
    }
}

/// State letter and parent pid from a `/proc/PID/stat` line
/// (`pid (comm) S ppid …`; comm may contain spaces and parentheses).
/// Gives the rig's gateways a bridge and subnet of their own, apart from
/// a gateway already running here. Call it before any thread starts: the
/// gateway inherits them through the environment.
pub fn use_network(bridge: &str, subnet: &str) {
    // SAFETY: the caller starts no thread before this.
    unsafe {
        std::env::set_var("COPSE_BRIDGE", bridge);
        std::env::set_var("COPSE_SUBNET", subnet);
    }
}

pub fn state_and_ppid(stat: &str) -> Option<(&str, u32)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut f = rest.split_whitespace();
    let state = f.next()?;
    Some((state, f.next()?.parse().ok()?))
}

/// Notes about zombie children seen just before a gateway was stopped;
/// `children` maps a phase name to a `Gateway::children` result.
pub fn zombie_notes(children: &serde_json::Map<String, Value>) -> Vec<String> {
    children
        .iter()
        .filter_map(|(phase, kids)| {
            let z = kids.get("Z").and_then(Value::as_u64).filter(|z| *z > 0)?;
            Some(format!(
                "{phase} gateway: {z} zombie (unreaped) child processes at the end of its scenarios, just before SIGTERM"
            ))
        })
        .collect()
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_fields() {
        assert_eq!(state_and_ppid("42 (copse) S 7 42 42 0 -1"), Some(("S", 7)));
        assert_eq!(state_and_ppid("43 (a (b) c) Z 9 1"), Some(("Z", 9)));
        assert_eq!(state_and_ppid("44 (x) R"), None);
        assert_eq!(state_and_ppid("garbage"), None);
    }

    #[test]
    fn zombies_are_noted_per_phase() {
        let kids = json!({"cold": {"S": 3}, "warm": {"S": 1, "Z": 2}});
        let notes = zombie_notes(kids.as_object().unwrap());
        assert_eq!(notes.len(), 1);
        assert!(notes[0].starts_with("warm gateway: 2 zombie"));
    }
}
