//! Where the gateway keeps its state and which API keys it accepts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use rand::Rng;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:3000";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/copse";
const KEYS_FILE: &str = "api-keys";

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub agent_binary: PathBuf,
    /// Leave sandboxes running on shutdown, to be re-adopted on restart.
    pub keep_sandboxes: bool,
    /// (template, size): sandboxes kept booted ahead of demand.
    pub pools: Vec<(String, usize)>,
    /// The sandbox network (bridge and subnet); `None`: loopback only.
    pub network: Option<copse_substrate::NetConfig>,
    /// The domain sandbox ports are named under (`{port}-{id}.{domain}`).
    pub domain: Option<String>,
    /// Serve HTTPS with this certificate chain and key (domain mode).
    pub tls: Option<TlsFiles>,
    /// Each sandbox's disk quota, in MiB.
    pub disk_mb: u64,
}

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Config {
    pub fn run_dir(&self) -> PathBuf {
        self.data_dir.join("run")
    }

    pub fn database(&self) -> PathBuf {
        self.data_dir.join("copse.db")
    }
}

/// The API keys the gateway accepts: `COPSE_API_KEY` (comma-separated), else
/// the keys file in the data dir. On loopback a missing file is created with
/// a fresh key; on any other address a key must have been configured.
pub fn api_keys(data_dir: &Path, listen: &SocketAddr) -> anyhow::Result<Vec<String>> {
    if let Ok(env) = std::env::var("COPSE_API_KEY") {
        let keys: Vec<String> = env.split(',').map(str::trim).filter(|k| !k.is_empty()).map(String::from).collect();
        if !keys.is_empty() {
            return Ok(keys);
        }
    }
    let file = data_dir.join(KEYS_FILE);
    if let Ok(text) = std::fs::read_to_string(&file) {
        let keys: Vec<String> =
            text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from).collect();
        if !keys.is_empty() {
            return Ok(keys);
        }
    }
    if !listen.ip().is_loopback() {
        bail!(
            "refusing to listen on {listen} without an API key: set COPSE_API_KEY or write keys (one per line) to {}",
            file.display()
        );
    }
    let key = generate_key();
    std::fs::write(&file, format!("{key}\n")).with_context(|| format!("writing {}", file.display()))?;
    restrict_to_owner(&file)?;
    Ok(vec![key])
}

fn generate_key() -> String {
    let bytes: [u8; 20] = rand::rng().random();
    format!("e2b_{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

fn restrict_to_owner(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).context("restricting the keys file")
}

/// The agent binary: `COPSE_AGENT`, else the static build next to this
/// binary's target dir, else a `copse-agent` beside it.
pub fn find_agent(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(path) = explicit.or_else(|| std::env::var_os("COPSE_AGENT").map(PathBuf::from)) {
        return Ok(path);
    }
    let exe = std::env::current_exe().context("locating the copse binary")?;
    let dir = exe.parent().context("copse binary has no directory")?;
    let profile = dir.file_name().map(|n| n.to_owned()).unwrap_or_default();
    let candidates = [
        dir.join("../x86_64-unknown-linux-musl").join(&profile).join("copse-agent"),
        dir.join("../x86_64-unknown-freebsd").join(&profile).join("copse-agent"),
        dir.join("copse-agent"),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .with_context(|| format!("no copse-agent binary found near {}; set COPSE_AGENT", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_listener_without_a_key_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: tests in this module do not read COPSE_API_KEY concurrently.
        unsafe { std::env::remove_var("COPSE_API_KEY") };
        let err = api_keys(dir.path(), &"0.0.0.0:3000".parse().unwrap()).unwrap_err();
        assert!(err.to_string().contains("refusing to listen"));
        let keys = api_keys(dir.path(), &"127.0.0.1:3000".parse().unwrap()).unwrap();
        assert_eq!(keys.len(), 1);
        // The generated key is now configured, so a public address works.
        assert_eq!(api_keys(dir.path(), &"0.0.0.0:3000".parse().unwrap()).unwrap(), keys);
    }
}
