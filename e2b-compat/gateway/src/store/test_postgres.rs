//! A real PostgreSQL server for the store's tests, from Debian's
//! `postgresql` package (scripts/host-programs): a fresh cluster in a
//! temporary directory, listening only on a unix socket there, stopped and
//! removed when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::os::unix::process::CommandExt;

pub struct TestPostgres {
    server: Child,
    dir: tempfile::TempDir,
}

impl TestPostgres {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        // initdb refuses to run as root: as root, the cluster is the
        // `postgres` user's (the package creates it).
        let owner = nix::unistd::geteuid().is_root().then(|| {
            let user = nix::unistd::User::from_name("postgres").unwrap().expect("the postgres user (Debian's package)");
            nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid)).unwrap();
            (user.uid.as_raw(), user.gid.as_raw())
        });
        let data = dir.path().join("data");
        let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
        if let Some((uid, gid)) = owner {
            nix::unistd::chown(&dir.path().join("server.log"), Some(uid.into()), Some(gid.into())).unwrap();
        }
        let run = |bin: PathBuf| {
            let mut command = Command::new(&bin);
            if let Some((uid, gid)) = owner {
                command.uid(uid).gid(gid);
            }
            command.current_dir(dir.path());
            command
        };
        let initdb = run(bin("initdb"))
            .args(["--no-sync", "--auth=trust", "--username=postgres", "--encoding=UTF8", "-D"])
            .arg(&data)
            .stdout(Stdio::null())
            .output()
            .unwrap();
        assert!(initdb.status.success(), "initdb: {}", String::from_utf8_lossy(&initdb.stderr));
        // fsync off: a test cluster outlives no power loss, and the machine
        // is shared.
        let server = run(bin("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-c", "listen_addresses=", "-c", "fsync=off", "-k"])
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let started = Self { server, dir };
        started.wait_until_ready();
        started
    }

    /// A connection string for the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("host={} user=postgres dbname=postgres", self.dir.path().display())
    }

    fn wait_until_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match postgres::Client::connect(&self.url(), postgres::NoTls) {
                Ok(_) => return,
                Err(err) if Instant::now() > deadline => panic!(
                    "postgres did not start: {err}\n{}",
                    std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
                ),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Drop for TestPostgres {
    fn drop(&mut self) {
        // SIGINT: "fast shutdown", which ends the server's children too.
        let pid = nix::unistd::Pid::from_raw(self.server.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let _ = self.server.wait();
    }
}

/// The newest installed version's `program`: Debian keeps the server's
/// programs off the PATH, one directory per major version.
fn bin(program: &str) -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .unwrap_or_else(|e| panic!("{}: {e}; scripts/bootstrap installs postgresql", root.display()))
        .filter_map(|entry| {
            let entry = entry.ok()?;
            Some((entry.file_name().to_str()?.parse().ok()?, entry.path().join("bin").join(program)))
        })
        .filter(|(_, path)| path.exists())
        .collect();
    versions.sort();
    versions.pop().unwrap_or_else(|| panic!("no {program} under {}", root.display())).1
}
