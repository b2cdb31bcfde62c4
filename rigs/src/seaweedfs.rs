//! A SeaweedFS object store on loopback for the object-store rig: `weed
//! server` (master, volume, filer, S3 gateway) in a scratch directory, one
//! bucket, one signing identity; stopped (and its files removed) on drop.
//! The same set-up as tests/object_store.py, for a rig.

use std::io::Write;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use copse_objects::{Bucket, BucketConfig};

const BUCKET: &str = "copse-bench";
const KEY_ID: &str = "copse-bench-key";
const SECRET: &str = "copse-bench-secret-0123456789";

pub struct SeaweedFs {
    child: Child,
    dir: PathBuf,
    pub url: String,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl SeaweedFs {
    /// Starts it under `parent` (on the file system being measured) and
    /// waits until a write to the bucket succeeds.
    pub fn start(weed: &Path, parent: &Path) -> anyhow::Result<Self> {
        let dir = parent.join(format!("seaweedfs-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("data"))?;
        let config = dir.join("s3.json");
        let identity = serde_json::json!({"identities": [{"name": "copse",
            "credentials": [{"accessKey": KEY_ID, "secretKey": SECRET}],
            "actions": ["Admin", "Read", "Write", "List"]}]});
        std::fs::write(&config, identity.to_string())?;
        let mut cmd = Command::new(weed);
        cmd.arg("server")
            .arg(format!("-dir={}", dir.join("data").display()))
            .args(["-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-volume.max=64", "-master.volumeSizeLimitMB=256"])
            .args(["-filer", "-s3", "-s3.port.iceberg=0", "-s3.port.lance=0"])
            .arg(format!("-s3.config={}", config.display()));
        let mut ports = std::collections::BTreeMap::new();
        for name in ["master", "volume", "filer", "s3"] {
            let (http, grpc) = (free_port()?, free_port()?);
            cmd.arg(format!("-{name}.port={http}")).arg(format!("-{name}.port.grpc={grpc}"));
            ports.insert(name, (http, grpc));
        }
        // SeaweedFS's address form for a gRPC port that is not HTTP's + 10000.
        let master = format!("127.0.0.1:{}.{}", ports["master"].0, ports["master"].1);
        let url = format!("http://127.0.0.1:{}/{BUCKET}", ports["s3"].0);
        let log = std::fs::File::create(dir.join("weed.log"))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", weed.display()))?;
        let store = Self { child, dir, url };
        store.create_bucket(weed, &master)?;
        Ok(store)
    }

    /// What a `copse snapshot push|pull` needs in its environment.
    pub fn env(&self) -> [(&'static str, String); 3] {
        [
            ("COPSE_OBJECT_STORE", self.url.clone()),
            ("AWS_ACCESS_KEY_ID", KEY_ID.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET.into()),
        ]
    }

    /// The bucket, as a copse host opens it.
    pub fn bucket(&self) -> anyhow::Result<Bucket> {
        let config =
            BucketConfig::parse(&self.url, |name| self.env().into_iter().find(|(k, _)| *k == name).map(|(_, v)| v))?;
        Bucket::open(&config)
    }

    fn create_bucket(&self, weed: &Path, master: &str) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(90);
        let bucket = self.bucket()?;
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (mut created, mut last) = (false, String::new());
        while Instant::now() < deadline {
            // Once made, the bucket stays; only the write is retried.
            if !created {
                let mut shell = Command::new(weed)
                    .arg("shell")
                    .arg(format!("-master={master}"))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()?;
                let command = format!("s3.bucket.create -name {BUCKET}\n");
                shell.stdin.take().expect("piped").write_all(command.as_bytes())?;
                let out = shell.wait_with_output()?;
                last = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
                created = last.contains("created bucket");
            }
            // A write proves the master has a leader and a volume server.
            if created {
                match runtime.block_on(bucket.put("ready-probe", bytes::Bytes::from_static(b"ready"))) {
                    Ok(()) => return Ok(()),
                    Err(e) => last = format!("{e:#}"),
                }
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        bail!("SeaweedFS did not take a write within 90 s: {last}")
    }
}

impl Drop for SeaweedFs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
