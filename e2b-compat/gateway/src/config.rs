//! Where the gateway keeps its state, and how it serves. The API keys it
//! accepts are `keys`'s.

use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:3000";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/copse";

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// The state database: a PostgreSQL URL, or `None` for SQLite in the
    /// data dir.
    pub database_url: Option<String>,
    /// Where other gateways on a shared database reach this one (`None`:
    /// the listen address).
    pub advertise: Option<String>,
    /// Mutual TLS between the nodes of a shared database.
    pub cluster_tls: Option<ClusterTls>,
    /// Whether the E2B API is served on `listen`; a worker node of a
    /// cluster (`--no-api`) serves other nodes only.
    pub api: bool,
    /// Whether sandboxes run on this host; an API front of a cluster
    /// (`--no-sandboxes`) runs none and opens no substrate.
    pub sandboxes: bool,
    /// The object store the nodes of a shared database move snapshots
    /// through.
    pub object_store: Option<copse_objects::BucketConfig>,
    /// Whether a snapshot from the object store starts on layers mounted as
    /// they arrive (`lazy_layers.rs`) rather than once fetched whole.
    pub lazy_fetch: bool,
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
    /// Timeouts and the per-address cap on connections.
    pub limits: crate::serve::Limits,
    /// The operator listener serving `/metrics`; `None`: no metrics served.
    pub metrics_listen: Option<SocketAddr>,
    /// Registry mirrors and credentials for templates from images.
    pub registries: copse_images::Registries,
    /// Extra CA certificates (PEM) the egress proxy trusts for the servers
    /// it re-originates intercepted HTTPS to, besides the host's store.
    pub egress_upstream_ca: Option<PathBuf>,
}

/// The node's cluster TLS files (`copse tls node-cert`) and the peer
/// listener other nodes forward calls to.
#[derive(Debug, Clone)]
pub struct ClusterTls {
    pub dir: PathBuf,
    pub listen: SocketAddr,
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

    /// The SQLite database, when no `database_url` is given.
    pub fn database(&self) -> PathBuf {
        self.data_dir.join("copse.db")
    }

    /// Each sandbox's own log (`crate::sandbox_log`).
    pub fn sandbox_logs(&self) -> PathBuf {
        self.data_dir.join("logs")
    }

    /// The copse egress CA (`ca.pem`, `ca-key.pem`).
    pub fn egress_ca_dir(&self) -> PathBuf {
        egress_ca_dir(&self.data_dir)
    }
}

/// The copse egress CA's directory under `data_dir`.
pub fn egress_ca_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("egress-ca")
}

/// Creates the data dir if it is missing and makes it, new or old, private
/// to its owner: its database holds every sandbox's access token and
/// environment, its keys file the API keys' hashes.
pub fn private_data_dir(path: &Path) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .with_context(|| format!("creating {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("making {} private to its owner", path.display()))
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
    fn the_data_dir_is_made_private_whether_new_or_old() {
        let parent = tempfile::tempdir().unwrap();
        let fresh = parent.path().join("a/b");
        private_data_dir(&fresh).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&fresh), 0o700);
        let old = parent.path().join("old");
        std::fs::create_dir(&old).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_data_dir(&old).unwrap();
        assert_eq!(mode(&old), 0o700);
    }
}
