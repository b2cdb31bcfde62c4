//! A throwaway PostgreSQL for the cluster rig: Debian's server programs,
//! `initdb` in a scratch directory owned by the `postgres` user, listening
//! only on a unix socket there; stopped (and its files removed) on drop.
//! The same set-up as tests/postgres_server.py, for a rig.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

pub struct Postgres {
    child: Child,
    dir: PathBuf,
    /// What `copse up --database` takes.
    pub url: String,
    pub version: String,
}

/// Debian keeps the server's programs off the PATH, one directory per major
/// version: the newest.
fn program(name: &str) -> anyhow::Result<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .context("no /usr/lib/postgresql: scripts/bootstrap installs postgresql")?
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin").join(name))))
        .filter(|(_, p)| p.exists())
        .collect();
    found.sort();
    found.pop().map(|(_, p)| p).with_context(|| format!("no PostgreSQL {name}"))
}

/// The `postgres` user's uid and gid, from `/etc/passwd`.
fn postgres_user() -> anyhow::Result<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    let fields: Vec<&str> = passwd
        .lines()
        .find(|l| l.starts_with("postgres:"))
        .context("no postgres user: scripts/bootstrap installs postgresql")?
        .split(':')
        .collect();
    Ok((fields.get(2).context("uid")?.parse()?, fields.get(3).context("gid")?.parse()?))
}

impl Postgres {
    /// Starts it under `parent` (which the postgres user must be able to
    /// reach) and waits until it accepts connections.
    pub fn start(parent: &Path) -> anyhow::Result<Self> {
        let (uid, gid) = postgres_user()?;
        let dir = parent.join(format!("postgres-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        let data = dir.join("data");
        let init = Command::new(program("initdb")?)
            .args(["--no-sync", "--auth=trust", "--username=postgres", "-D"])
            .arg(&data)
            .current_dir(&dir)
            .uid(uid)
            .gid(gid)
            .output()?;
        if !init.status.success() {
            bail!("initdb: {}", String::from_utf8_lossy(&init.stderr));
        }
        let log_path = dir.join("server.log");
        let log = std::fs::File::create(&log_path)?;
        std::os::unix::fs::chown(&log_path, Some(uid), Some(gid))?;
        let child = Command::new(program("postgres")?)
            .arg("-D")
            .arg(&data)
            .args(["-c", "listen_addresses=", "-k"])
            .arg(&dir)
            .current_dir(&dir)
            .uid(uid)
            .gid(gid)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting postgres")?;
        let version = std::fs::read_to_string(data.join("PG_VERSION")).unwrap_or_default().trim().to_string();
        let url = format!("postgresql:///postgres?user=postgres&host={}", dir.display());
        let pg = Self { child, dir, url, version };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::fs::read_to_string(&log_path).unwrap_or_default().contains("ready to accept connections") {
            if Instant::now() > deadline {
                bail!("postgres did not start: {}", std::fs::read_to_string(&log_path).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(pg)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // SIGINT: PostgreSQL's fast shutdown.
        // SAFETY: kill with a pid this process spawned.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
