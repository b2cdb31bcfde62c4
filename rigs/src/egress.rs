//! The egress rig (`copse-rig-egress`, Linux only; see `bin/egress.rs`):
//! what the host's egress proxy and a mounted volume cost a sandbox.
//!
//! Starts its own gateway (own bridge and subnet, the peer's name pinned in
//! its `--egress-hosts-file`) and a peer host in a network namespace it
//! creates, serving HTTP and HTTPS (a certificate from a test CA the rig
//! mints). For each scheme and route (`egress_probe::Route`: the peer's
//! address allowed, its name allowed, its name with a header rule carrying
//! a secret) a fresh sandbox runs one probe program that times every
//! request itself. HTTPS is measured only when a rule's HTTPS request
//! works; otherwise the result says why. Then a volume mounted in a sandbox
//! and the sandbox's own disk are written and read back alike.
//!
//! Writes one JSON result to `benchmarks/results/` (`benchmarks/schema.md`).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use copse_cubenet::NetConfig;
use copse_cubenet::linux::HostNetwork;
use copse_protocol::StartProcess;
use http_body_util::{BodyExt, Full};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::egress_probe::{
    self, DiskRound, PEER_NAME, PEER_SERVER, ProbeOutcome, ProbePlan, Route, SECRET_NAME, Scheme, scenario_name,
};
use crate::facts::{data_dir_fs, random_hex};
use crate::net::Peer;
use crate::report::print_footer;
use crate::{Conn, Gateway, RigArgs, Run, Scenario};

const RIG: &str = "egress";
const PEER_NS: &str = "cn-egress-peer";
const PEER_VETH: &str = "cnepeer";
/// TEST-NET-2, apart from the net rig's and the tests' 203.0.113.0/24.
const PEER_HOST: &str = "198.51.100.1";
const PEER: &str = "198.51.100.10";
const VOLUME_PATH: &str = "/mnt/bench";
const ROOTFS_PATH: &str = "/home/user";
const UPSTREAM_CA_OPTION: &str = "--egress-upstream-ca";

#[derive(Parser, Debug)]
#[command(version, about = "Egress proxy latency and throughput, direct vs proxied; volume vs own-disk I/O")]
struct Args {
    /// Timed requests per scenario, on a new connection each and again on
    /// one keep-alive connection.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Untimed requests first (each on a new connection).
    #[arg(long, default_value_t = 20)]
    warmup: usize,
    /// Large GETs per scenario, and their size.
    #[arg(long, default_value_t = 5)]
    big_runs: usize,
    #[arg(long, default_value_t = 64)]
    big_mib: usize,
    /// Write/read rounds on the volume and on the sandbox's own disk, and
    /// the file size.
    #[arg(long, default_value_t = 9)]
    disk_runs: usize,
    #[arg(long, default_value_t = 256)]
    disk_mib: u64,
    /// Leave the host's page cache alone between write and read (the reads
    /// then measure the cache, not the disks).
    #[arg(long)]
    no_drop_caches: bool,
    /// Bridge and subnet of the rig's gateway (apart from a running one).
    #[arg(long, default_value = "cnbench2")]
    bridge: String,
    #[arg(long, default_value = "10.92.0.0/16")]
    subnet: String,
    #[command(flatten)]
    common: RigArgs,
}

pub fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = Run::begin(RIG);
    let bins = &args.common.bins;
    bins.check()?;
    bins.build_template(Some("base"))?;
    let key = random_hex(16)?;
    crate::gateway::use_network(&args.bridge, &args.subnet);
    let work = WorkDir::create()?;
    let certs = Certs::mint(&work.0)?;
    let hosts = work.0.join("egress-hosts");
    std::fs::write(&hosts, format!("{PEER} {PEER_NAME}\n"))?;
    let secret = random_hex(16)?;

    let mut notes = vec![
        format!(
            "the peer is {PEER} ({PEER_NAME}, pinned in the gateway's --egress-hosts-file) in network namespace \
             {PEER_NS}, routed from the host over a veth; a python3 http.server (HTTP/1.1, threads) answers on 80 \
             and on 443 with a certificate from a CA the rig mints"
        ),
        "routes: direct = the peer's address in allowOut (nftables only); proxy-name = its name in allowOut (the \
         host's egress proxy checks Host/SNI and relays); proxy-rule = the name plus a network.rules header transform \
         whose value is a secret placeholder (the proxy rewrites the request; HTTPS: it terminates TLS with copse's \
         CA, which the sandbox trusts, and re-originates TLS to the peer). denyOut 0.0.0.0/0 in all three."
            .into(),
        "every request timing is taken inside the sandbox by one python3 program per scenario (http.client, \
         TCP_NODELAY), which connects to the peer's address and names the peer in Host/SNI; new_conn_ms includes \
         connect (and TLS handshake), keepalive_ms reuses one connection and reopens it when the other end closes \
         it (counters keepalive_connects, keepalive_retries)"
            .into(),
    ];
    let mut params = json!({
        "requests": args.requests,
        "warmup": args.warmup,
        "big_runs": args.big_runs,
        "big_mib": args.big_mib,
        "disk_runs": args.disk_runs,
        "disk_mib": args.disk_mib,
        "drop_caches": !args.no_drop_caches,
        "bridge": args.bridge,
        "subnet": args.subnet,
        "peer": PEER,
        "peer_name": PEER_NAME,
        "peer_server": "python3 http.server (host python) in the peer's network namespace",
    });

    let peer = Peer::create(PEER_NS, PEER_VETH, PEER_HOST, PEER)?;
    let network = GatewayNetwork(NetConfig::new(&args.bridge, &args.subnet)?);
    let server = PeerServer::start(&peer, &certs, &format!("Bearer {secret}"), args.big_mib << 20)?;
    let upstream_ca = bins.up_has_option(UPSTREAM_CA_OPTION);
    let mut gw_args = Vec::new();
    if upstream_ca {
        gw_args = vec![UPSTREAM_CA_OPTION.to_string(), certs.ca.display().to_string()];
    }
    params["gateway_args"] = json!(gw_args);
    let hosts_env = hosts.display().to_string();
    let gateway = Gateway::start_with(
        bins,
        &key,
        &["base=0".to_string()],
        "rig-egress",
        &[("COPSE_EGRESS_HOSTS_FILE", &hosts_env)],
        &gw_args,
    )?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut api = Api { conn: rt.block_on(Conn::open(gateway.addr))?, addr: gateway.addr, key: key.clone() };

    let measured = rt.block_on(async {
        let secret_id = api.create_secret(SECRET_NAME, &secret).await?;
        let mut scenarios = Vec::new();
        let mut unsupported = BTreeMap::new();
        for scheme in [Scheme::Http, Scheme::Https] {
            // The rule's route first: it decides whether the scheme is measured.
            for route in [Route::Rule, Route::Direct, Route::Name] {
                let plan = ProbePlan {
                    scheme,
                    route,
                    peer_addr: PEER.into(),
                    requests: args.requests,
                    warmup: args.warmup,
                    big_runs: args.big_runs,
                    peer_ca: Some(std::fs::read_to_string(&certs.ca)?),
                };
                let name = scenario_name(scheme, route);
                eprintln!("== {name}");
                match api.probe(&name, &plan).await? {
                    ProbeOutcome::Measured(s) => scenarios.push(s),
                    ProbeOutcome::Failed(why) if scheme == Scheme::Https && route == Route::Rule => {
                        let mut reason =
                            format!("not supported by this gateway: an HTTPS request with a rule failed ({why})");
                        if !upstream_ca {
                            reason.push_str(&format!("; `copse up` has no {UPSTREAM_CA_OPTION} option"));
                        }
                        unsupported.insert(scheme.label(), reason);
                        break;
                    }
                    ProbeOutcome::Failed(why) => {
                        let mut s = Scenario {
                            name,
                            client: egress_probe::PROBE_CLIENT.into(),
                            concurrency: 1,
                            ..Default::default()
                        };
                        s.errors.push(format!("the route failed before the first timed request: {why}"));
                        scenarios.push(s);
                    }
                }
            }
        }
        api.delete(&format!("/secrets/{secret_id}")).await?;
        let disk = api.disk(&args).await?;
        anyhow::Ok((scenarios, unsupported, disk))
    });
    drop(server);
    gateway.stop(&mut notes);
    drop(network);
    drop(peer);
    let (mut scenarios, unsupported, disk) = measured?;
    scenarios.extend(disk.scenarios);
    notes.extend(disk.notes);
    params["filesystems"] = disk.filesystems;

    for (scheme, why) in &unsupported {
        notes.push(format!("{scheme}: {why}; its scenarios were not run"));
    }
    params["schemes"] = json!({
        "http": "measured",
        "https": unsupported.get("https").map_or("measured".to_string(), |w| format!("https: {w}")),
    });
    let p50_diff = |a: &str, b: &str, m: &str| {
        crate::report::p50_difference(crate::report::find(&scenarios, a), crate::report::find(&scenarios, b), m)
    };
    let mut derived = serde_json::Map::new();
    for scheme in [Scheme::Http, Scheme::Https] {
        let direct = scenario_name(scheme, Route::Direct);
        for route in [Route::Name, Route::Rule] {
            let s = scenario_name(scheme, route);
            for m in ["new_conn_ms", "keepalive_ms", "get_ms"] {
                derived.insert(format!("{s}_minus_direct_p50_{m}"), p50_diff(&s, &direct, m));
            }
        }
    }
    derived.insert("volume_minus_rootfs_p50_write_ms".into(), p50_diff("volume-io", "rootfs-io", "write_ms"));
    derived.insert(
        "volume_minus_rootfs_p50_write_synced_ms".into(),
        p50_diff("volume-io", "rootfs-io", "write_synced_ms"),
    );
    derived.insert("volume_minus_rootfs_p50_read_ms".into(), p50_diff("volume-io", "rootfs-io", "read_ms"));
    let targets = egress_probe::targets(&scenarios, &unsupported);
    let (path, result) =
        run.write(&args.common.out_dir, params, bins, &scenarios, Value::Object(derived), targets, notes)?;
    for s in &scenarios {
        for metric in s.series.keys() {
            if let Some(sum) = s.summary(metric) {
                println!(
                    "{:<20} {:<16} p50 {:>10.3}  p95 {:>10.3}  max {:>10.3}  (n={})",
                    s.name, metric, sum.p50, sum.p95, sum.max, sum.n
                );
            }
        }
        for e in s.errors.iter().take(3) {
            println!("{:<20} error: {e}", s.name);
        }
    }
    print_footer(&result, &path);
    Ok(())
}

/// The gateway's API as the rig calls it, on one connection.
struct Api {
    conn: Conn,
    addr: SocketAddr,
    key: String,
}

struct Disk {
    scenarios: Vec<Scenario>,
    notes: Vec<String>,
    filesystems: Value,
}

impl Api {
    async fn call(&mut self, method: Method, path: &str, body: Option<Value>) -> anyhow::Result<(StatusCode, Value)> {
        let mut req = self.conn.request(method.clone(), path).header("x-api-key", &self.key);
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let bytes = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
        let resp = self.conn.send(req.body(Full::new(bytes))?).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("{method} {path}: HTTP {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
    }

    async fn delete(&mut self, path: &str) -> anyhow::Result<()> {
        self.call(Method::DELETE, path, None).await.map(drop)
    }

    /// Creates the secret the rule names; one a failed earlier run left in
    /// the rig's data dir is replaced.
    async fn create_secret(&mut self, name: &str, value: &str) -> anyhow::Result<String> {
        let body = json!({"name": name, "value": value});
        let created = match self.call(Method::POST, "/secrets", Some(body.clone())).await {
            Ok((_, v)) => v,
            Err(first) => {
                let (_, list) = self.call(Method::GET, "/secrets", None).await?;
                let stale = list.as_array().into_iter().flatten().find(|s| s["name"] == name).ok_or(first)?;
                let id = stale["secretID"].as_str().context("secret without secretID")?.to_string();
                self.delete(&format!("/secrets/{id}")).await?;
                self.call(Method::POST, "/secrets", Some(body)).await?.1
            }
        };
        Ok(created["secretID"].as_str().context("secret create without secretID")?.to_string())
    }

    async fn create(&mut self, body: Value) -> anyhow::Result<crate::Created> {
        self.conn.create_sandbox(&self.key, body.to_string()).await
    }

    /// Runs `python3 ARGV` in the sandbox on a connection of its own: a
    /// probe can outlast the gateway's idle timeout on the shared one.
    async fn run(&mut self, sbx: &crate::Created, argv: Vec<String>) -> anyhow::Result<copse_protocol::Output> {
        let mut conn = Conn::open(self.addr).await?;
        let out = crate::exec::output(&mut conn, &sbx.id, &sbx.token, &StartProcess::new("python3", argv)).await?;
        if out.exit_code != 0 {
            bail!("python3 exited {}: {}", out.exit_code, out.stderr.trim());
        }
        Ok(out)
    }

    /// One scenario: a fresh sandbox with the route's policy runs the probe.
    async fn probe(&mut self, name: &str, plan: &ProbePlan) -> anyhow::Result<ProbeOutcome> {
        let sbx =
            self.create(json!({"templateID": "base", "timeout": 600, "network": plan.route.network(PEER)})).await?;
        let out = self.run(&sbx, plan.argv()).await;
        self.conn.delete_sandbox(&self.key, &sbx.id).await?;
        egress_probe::parse_probe(name, plan.route, &out?.stdout)
    }

    /// Volume vs the sandbox's own disk: one sandbox with the volume
    /// mounted writes and reads a file on each in turn.
    async fn disk(&mut self, args: &Args) -> anyhow::Result<Disk> {
        let name = format!("bench-egress-{}", random_hex(4)?);
        let (_, vol) = self.call(Method::POST, "/volumes", Some(json!({"name": name}))).await?;
        let vol_id = vol["volumeID"].as_str().context("volume create without volumeID")?.to_string();
        let created = self
            .create(
                json!({"templateID": "base", "timeout": 600, "volumeMounts": [{"name": name, "path": VOLUME_PATH}]}),
            )
            .await;
        let result = match created {
            Ok(sbx) => {
                let r = self.disk_rounds(&sbx, args).await;
                self.conn.delete_sandbox(&self.key, &sbx.id).await?;
                r
            }
            Err(e) => Err(e),
        };
        self.delete(&format!("/volumes/{vol_id}")).await?;
        result
    }

    async fn disk_rounds(&mut self, sbx: &crate::Created, args: &Args) -> anyhow::Result<Disk> {
        let fs =
            self.run(sbx, vec!["-c".into(), FS_TYPES.into(), VOLUME_PATH.into(), ROOTFS_PATH.into()]).await?.stdout;
        let inside: Value = serde_json::from_str(fs.trim()).unwrap_or(Value::Null);
        let data_dir = data_dir_fs(&args.common.bins.data_dir);
        let mut notes = vec![
            format!(
                "volume-io writes and reads {VOLUME_PATH}/bench.bin, on a volume (a btrfs subvolume with its own \
                 qgroup under the data dir's btrfs, bind-mounted into the sandbox); rootfs-io {ROOTFS_PATH}/bench.bin \
                 on the sandbox's own disk (an overlay whose writable layer is a btrfs subvolume of the same file \
                 system); rounds alternate between the two, python3 in the sandbox, {} MiB of incompressible data \
                 in 1 MiB writes",
                args.disk_mib
            ),
            "write_buffered_ms stops at the last write (page cache), write_ms after fsync, write_synced_ms after \
             sync(2) as well (every file system flushed: the bytes are on the btrfs backing store whatever the \
             overlay does with fsync); read_ms reads the file \
             back after the host's page cache was dropped (sync; echo 3 > /proc/sys/vm/drop_caches), so it comes \
             from the btrfs file system's backing store"
                .into(),
            format!(
                "filesystems: the data dir is {} here (the reference host's data dir is ext4 without a journal, and \
                 sandbox disks and volumes live on a btrfs file system in a loop file there, DATA_DIR/disk.img); the \
                 sandbox sees {VOLUME_PATH} as {} and {ROOTFS_PATH} as {}",
                data_dir["summary"].as_str().unwrap_or("?"),
                inside[VOLUME_PATH]["fstype"].as_str().unwrap_or("?"),
                inside[ROOTFS_PATH]["fstype"].as_str().unwrap_or("?")
            ),
        ];
        // The boot plan mounts it so (jails/jailer's `overlay_options`); the
        // sandbox's mount table may not show the option.
        notes.push(format!(
            "the sandbox's root overlay is mounted `volatile`: fsync there returns without flushing (a sandbox's \
             disk is not meant to outlive a host crash), so rootfs-io write_ms is close to write_buffered_ms, while \
             a volume (persistent) flushes; write_ms is what an fsyncing program in {ROOTFS_PATH} vs {VOLUME_PATH} \
             waits for, write_synced_ms the cost of the two paths carrying the same bytes to the same backing store \
             (the write target's metric)"
        ));
        if args.no_drop_caches {
            notes.push("page cache not dropped between write and read: read_ms measures the cache".into());
        }
        let mut dropped_all = true;
        let mut rounds: BTreeMap<&str, Vec<DiskRound>> = BTreeMap::new();
        let mut errors: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        for _ in 0..args.disk_runs {
            for (scenario, dir) in [("volume-io", VOLUME_PATH), ("rootfs-io", ROOTFS_PATH)] {
                let file = format!("{dir}/bench.bin");
                let mut failed = |e: anyhow::Error| {
                    errors.entry(scenario).or_default().push(format!("{e:#}"));
                };
                let write = self.run(sbx, egress_probe::disk_argv("write", &file, Some(args.disk_mib))).await;
                let mut round = DiskRound::default();
                match write.and_then(|o| egress_probe::parse_ms(&o.stdout)) {
                    Ok(v) => {
                        (round.buffered, round.fsynced, round.synced) =
                            (v.first().copied(), v.get(1).copied(), v.get(2).copied())
                    }
                    Err(e) => failed(e),
                }
                if !args.no_drop_caches {
                    dropped_all &= drop_caches();
                }
                let read = self.run(sbx, egress_probe::disk_argv("read", &file, None)).await;
                match read.and_then(|o| egress_probe::parse_ms(&o.stdout)) {
                    Ok(v) => round.read = v.first().copied(),
                    Err(e) => failed(e),
                }
                let _ = self.run(sbx, vec!["-c".into(), "import os,sys; os.remove(sys.argv[1])".into(), file]).await;
                rounds.entry(scenario).or_default().push(round);
            }
        }
        if !args.no_drop_caches && !dropped_all {
            notes.push(
                "writing /proc/sys/vm/drop_caches failed at least once: some reads may have come from the page cache"
                    .into(),
            );
        }
        let client = "python3 os.write/os.fsync/os.sync/os.read in the sandbox";
        let scenarios = rounds
            .into_iter()
            .map(|(name, r)| {
                let mut s = egress_probe::disk_scenario(name, client, args.disk_mib, &r);
                s.errors = errors.remove(name).unwrap_or_default();
                s
            })
            .collect();
        Ok(Disk { scenarios, notes, filesystems: json!({"data_dir": data_dir, "in_sandbox": inside}) })
    }
}

/// `{path: {"fstype", "volatile"}}` for each argument, from inside the
/// sandbox (the mount holding the path; `volatile`: the option is in its
/// mount table entry).
const FS_TYPES: &str = r#"
import json, sys
mounts = [l.split() for l in open("/proc/self/mounts")]
def fs(p):
    m = max((m for m in mounts if p == m[1] or p.startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]))
    return {"fstype": m[2], "volatile": "volatile" in m[3].split(",")}
print(json.dumps({p: fs(p) for p in sys.argv[1:]}))
"#;

/// `sync`, then drop the host's clean page cache so the reads that follow
/// come from the disks.
fn drop_caches() -> bool {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// The rig gateway's bridge and nftables table, removed on drop (also when
/// the rig fails): a gateway keeps them across restarts, the rig's own
/// network has no further use.
struct GatewayNetwork(NetConfig);

impl Drop for GatewayNetwork {
    fn drop(&mut self) {
        if let Err(e) = HostNetwork::open(self.0.clone()).and_then(|n| n.remove()) {
            eprintln!("removing the rig's bridge {}: {e:#}", self.0.bridge);
        }
    }
}

/// A private temporary directory for the hosts file and the certificates.
struct WorkDir(PathBuf);

impl WorkDir {
    fn create() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("copse-rig-egress-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Self(dir))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The peer's test CA and its certificate for the peer's name and address.
struct Certs {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl Certs {
    fn mint(dir: &Path) -> anyhow::Result<Self> {
        let p = |n: &str| dir.join(n).display().to_string();
        let (ca_key, ca, key, csr, cert, ext) =
            (p("ca.key"), p("ca.pem"), p("peer.key"), p("peer.csr"), p("peer.pem"), p("peer.ext"));
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
        openssl(
            &[
                &["req", "-x509"][..],
                &ec,
                &["-subj", "/CN=copse egress rig test CA", "-days", "2"],
                &["-keyout", &ca_key, "-out", &ca],
            ]
            .concat(),
        )?;
        openssl(&[&["req"][..], &ec, &["-subj", &format!("/CN={PEER_NAME}"), "-keyout", &key, "-out", &csr]].concat())?;
        std::fs::write(&ext, format!("subjectAltName=DNS:{PEER_NAME},IP:{PEER}\nextendedKeyUsage=serverAuth\n"))?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &cert,
        ])?;
        Ok(Self { ca: ca.into(), cert: cert.into(), key: key.into() })
    }
}

fn openssl(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("openssl").args(args).output().context("running openssl")?;
    if !out.status.success() {
        bail!("openssl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// The peer's HTTP and HTTPS server (`PEER_SERVER`), stopped on drop.
struct PeerServer(Child);

impl PeerServer {
    fn start(peer: &Peer, certs: &Certs, expected_auth: &str, big_bytes: usize) -> anyhow::Result<Self> {
        let child = Command::new("ip")
            .args(["netns", "exec", &peer.ns, "python3", "-c", PEER_SERVER])
            .arg(&certs.cert)
            .arg(&certs.key)
            .arg(expected_auth)
            .arg(big_bytes.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .context("starting the peer's python3 server")?;
        let mut server = Self(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        for port in [80, 443] {
            let addr: SocketAddr = (PEER.parse::<Ipv4Addr>()?, port).into();
            while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
                if let Ok(Some(status)) = server.0.try_wait() {
                    bail!("the peer's server exited with {status}");
                }
                if Instant::now() > deadline {
                    bail!("the peer's server did not listen on {addr}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(server)
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
