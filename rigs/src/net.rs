//! The net rig (`copse-rig-net`, Linux only; see `bin/net.rs`): the sandbox network's cost. Starts its own gateway (own
//! bridge and subnet) and a peer host in a network namespace it creates, then
//! measures, from inside a sandbox's network namespace (so through its veth,
//! the bridge, the nftables rules and NAT):
//! - TCP request/response RTT to the peer (1 byte each way, one connection),
//!   with an open policy and with a 1000-address allow list;
//! - single-stream TCP throughput to the peer with iperf3;
//! - `PUT /sandboxes/{id}/network` latency for 1000-address allow lists;
//! - the attach/detach cost of one sandbox (cubenet directly, no gateway).
//!
//! Writes one JSON result to `benchmarks/results/` (`benchmarks/schema.md`).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::facts::random_hex;
use crate::report::print_footer;
use crate::{Conn, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, ms};
use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use copse_cubenet::linux::HostNetwork;
use copse_cubenet::{NetConfig, Policy, SandboxNetwork};
use http_body_util::{BodyExt, Full};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

const RIG: &str = "net";
const CREATE_BODY: &str = r#"{"templateID":"base","timeout":600}"#;
const PEER_NS: &str = "cn-bench-peer";
const PEER_VETH: &str = "cnbpeer";
const PEER_HOST: &str = "203.0.113.1";
const PEER: &str = "203.0.113.10";
const RTT_PORT: u16 = 7000;
const IPERF_PORT: u16 = 5201;

#[derive(Parser, Debug)]
#[command(version, about = "Sandbox network RTT, throughput, attach cost and policy update latency")]
struct Args {
    /// Timed request/response round trips per RTT scenario.
    #[arg(long, default_value_t = 5000)]
    rtt_samples: usize,
    /// iperf3 runs (single stream) and the seconds each lasts.
    #[arg(long, default_value_t = 3)]
    iperf_runs: usize,
    #[arg(long, default_value_t = 5)]
    iperf_seconds: u32,
    /// Policy updates timed (each with a different 1000-address allow list).
    #[arg(long, default_value_t = 20)]
    updates: usize,
    /// Direct attach/detach samples.
    #[arg(long, default_value_t = 30)]
    attach_samples: usize,
    /// Bridge and subnet of the rig's gateway (apart from a running one).
    #[arg(long, default_value = "cnbench0")]
    bridge: String,
    #[arg(long, default_value = "10.90.0.0/16")]
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
    let mut notes = vec![
        "RTT and iperf3 clients run on the host inside the sandbox's network namespace (nsenter/setns): the \
         packets take the sandbox's veth, the bridge, the nftables forward rules and NAT, as the sandbox's own \
         would; the sandbox's cgroup limits do not apply to them."
            .to_string(),
        format!("the peer is {PEER} in network namespace {PEER_NS}, routed from the host over a veth"),
    ];
    let peer = Peer::create(PEER_NS, PEER_VETH, PEER_HOST, PEER)?;
    let gateway = Gateway::start(bins, &key, &["base=0".to_string()], "rig-net")?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut conn = rt.block_on(Conn::open(gateway.addr))?;
    let created = rt.block_on(conn.create_sandbox(&key, CREATE_BODY))?;
    let netns = netns_of(&created.id)?;

    let mut scenarios = Vec::new();
    peer.spawn_echo()?;
    let host_rtt = rtt(None, args.rtt_samples)?;
    scenarios.push(series_scenario("rtt-host-peer", "rust std TCP from the host netns", "rtt_ms", host_rtt));
    scenarios.push(series_scenario(
        "rtt-sandbox-peer",
        "rust std TCP from the sandbox netns",
        "rtt_ms",
        rtt(Some(&netns), args.rtt_samples)?,
    ));

    let mut iperf = Scenario {
        name: "throughput-sandbox-peer".into(),
        client: "iperf3 -c (single stream)".into(),
        concurrency: 1,
        ..Default::default()
    };
    match iperf_server() {
        Ok(mut server) => {
            for _ in 0..args.iperf_runs {
                match iperf_once(&netns, args.iperf_seconds) {
                    Ok(gbit) => iperf.series.entry("gbit_per_s".into()).or_default().push(Some(gbit)),
                    Err(e) => iperf.errors.push(format!("{e:#}")),
                }
            }
            let _ = server.kill();
            let _ = server.wait();
        }
        Err(e) => iperf.errors.push(format!("{e:#}")),
    }
    scenarios.push(iperf);

    let mut updates = Scenario {
        name: "policy-update-1000".into(),
        client: LEAN_CLIENT.into(),
        concurrency: 1,
        ..Default::default()
    };
    for i in 0..args.updates {
        let body = allow_list_body(i, false);
        match rt.block_on(put_network(&mut conn, &key, &created.id, body)) {
            Ok(d) => updates.series.entry("update_ms".into()).or_default().push(Some(ms(d))),
            Err(e) => updates.errors.push(format!("{e:#}")),
        }
    }
    scenarios.push(updates);
    rt.block_on(put_network(&mut conn, &key, &created.id, allow_list_body(0, true)))?;
    scenarios.push(series_scenario(
        "rtt-sandbox-peer-allowlist1000",
        "rust std TCP from the sandbox netns, policy: deny 0.0.0.0/0 + 1001 allowed addresses",
        "rtt_ms",
        rtt(Some(&netns), args.rtt_samples)?,
    ));
    rt.block_on(conn.delete_sandbox(&key, &created.id))?;
    gateway.stop(&mut notes);
    // A gateway keeps its bridge and table across restarts; the rig's own
    // network has no further use.
    HostNetwork::open(NetConfig::new(&args.bridge, &args.subnet)?)?.remove()?;

    scenarios.push(attach_scenario(args.attach_samples)?);
    drop(peer);

    let derived = json!({
        "sandbox_path_rtt_overhead_p50_ms": p50_minus(&scenarios, "rtt-sandbox-peer", "rtt-host-peer", "rtt_ms"),
    });
    let params = json!({
        "rtt_samples": args.rtt_samples,
        "iperf_runs": args.iperf_runs,
        "iperf_seconds": args.iperf_seconds,
        "updates": args.updates,
        "attach_samples": args.attach_samples,
        "bridge": args.bridge,
        "subnet": args.subnet,
        "peer": PEER,
        "iperf3_version": crate::facts::command_output(Command::new("iperf3").arg("--version"))
            .and_then(|v| v.lines().next().map(str::to_string)),
        "anchor_published_by_coppice_on_pf": {"rtt_p50_us": 7, "throughput_gbit_s": 14.6, "update_1000_ms": 4},
    });
    notes.push(
        "policy-update-1000: PUT /sandboxes/{id}/network round trip (lean client) with a different 1000-address \
         allowOut each time plus denyOut 0.0.0.0/0; the gateway applies it with one `nft -f` transaction"
            .into(),
    );
    notes.push(
        "attach-direct: cubenet's HostNetwork::attach (veth into a fresh netns, address and route inside, one nft \
         transaction) and detach, on a bridge of its own, without the gateway"
            .into(),
    );
    let (path, result) =
        run.write(&args.common.out_dir, params, bins, &scenarios, derived, Value::Array(vec![]), notes)?;
    for s in &scenarios {
        for metric in s.series.keys() {
            if let Some(sum) = s.summary(metric) {
                println!(
                    "{:<34} {:<14} p50 {:>9.3}  p95 {:>9.3}  max {:>9.3}  (n={})",
                    s.name, metric, sum.p50, sum.p95, sum.max, sum.n
                );
            }
        }
    }
    print_footer(&result, &path);
    Ok(())
}

fn series_scenario(name: &str, client: &str, metric: &str, values: Vec<f64>) -> Scenario {
    let mut s = Scenario { name: name.into(), client: client.into(), concurrency: 1, ..Default::default() };
    let p99 = percentile(&values, 99.0);
    s.series.insert(metric.into(), values.into_iter().map(Some).collect());
    s.counters.insert("p99_us".into(), json!(p99.map(|v| (v * 1000.0).round())));
    s
}

fn percentile(values: &[f64], pct: f64) -> Option<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    (!sorted.is_empty()).then(|| crate::stats::percentile_sorted(&sorted, pct))
}

fn p50_minus(scenarios: &[Scenario], a: &str, b: &str, metric: &str) -> Value {
    let p = |n: &str| scenarios.iter().find(|s| s.name == n).and_then(|s| s.p50(metric));
    match (p(a), p(b)) {
        (Some(x), Some(y)) => json!(crate::round3(x - y)),
        _ => Value::Null,
    }
}

/// 1000 scattered addresses (no two adjacent, so none aggregate), shifted
/// by `round`, and the peer when `with_peer`.
fn allow_list_body(round: usize, with_peer: bool) -> String {
    let mut allow: Vec<String> = (0..1000u32)
        .map(|i| {
            Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 1)) + 2 * i + (round as u32 % 2) * 4096).to_string()
        })
        .collect();
    if with_peer {
        allow.push(PEER.into());
    }
    json!({"allowOut": allow, "denyOut": ["0.0.0.0/0"]}).to_string()
}

async fn put_network(conn: &mut Conn, key: &str, id: &str, body: String) -> anyhow::Result<Duration> {
    let req = conn
        .request(Method::PUT, &format!("/sandboxes/{id}/network"))
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))?;
    let started = Instant::now();
    let resp = conn.send(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    let took = started.elapsed();
    if status != StatusCode::NO_CONTENT {
        bail!("update network: HTTP {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(took)
}

/// `/proc/<pid>/ns/net` of a process of sandbox `id` (found by its cgroup,
/// in whichever hierarchy holds it).
fn netns_of(id: &str) -> anyhow::Result<String> {
    let mut roots = vec![std::path::PathBuf::from("/sys/fs/cgroup")];
    roots.extend(std::fs::read_dir("/sys/fs/cgroup")?.flatten().map(|e| e.path()));
    let procs = crate::density::sandbox_cgroup(&roots, id)
        .and_then(|dir| std::fs::read_to_string(dir.join("cgroup.procs")).ok())
        .unwrap_or_default();
    match procs.split_whitespace().next() {
        Some(pid) => Ok(format!("/proc/{pid}/ns/net")),
        None => bail!("no process of sandbox {id} found in any copse cgroup"),
    }
}

/// Runs `f` on a thread inside the network namespace at `netns` (the
/// sockets it opens stay there).
fn in_netns<T: Send>(netns: Option<&str>, f: impl FnOnce() -> anyhow::Result<T> + Send) -> anyhow::Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(path) = netns {
                let ns = std::fs::File::open(path).with_context(|| format!("opening {path}"))?;
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)?;
            }
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("thread panicked"))?
    })
}

fn rtt(netns: Option<&str>, samples: usize) -> anyhow::Result<Vec<f64>> {
    in_netns(netns, || {
        let addr: SocketAddr = (PEER.parse::<Ipv4Addr>()?, RTT_PORT).into();
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3)).context("connecting to the peer")?;
        stream.set_nodelay(true)?;
        let mut byte = [0u8; 1];
        let mut out = Vec::with_capacity(samples);
        for i in 0..samples + 200 {
            let t = Instant::now();
            stream.write_all(b"x")?;
            stream.read_exact(&mut byte)?;
            if i >= 200 {
                out.push(ms(t.elapsed()));
            }
        }
        Ok(out)
    })
}

/// An iperf3 server in the peer's namespace, for all runs (it survives a
/// readiness probe, unlike `iperf3 -s -1`).
fn iperf_server() -> anyhow::Result<Child> {
    let mut server = Command::new("ip")
        .args(["netns", "exec", PEER_NS, "iperf3", "-s", "-p", &IPERF_PORT.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting iperf3 -s (is iperf3 installed?)")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    let addr: SocketAddr = (PEER.parse::<Ipv4Addr>()?, IPERF_PORT).into();
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if Instant::now() > deadline {
            let _ = server.kill();
            let _ = server.wait();
            bail!("iperf3 server did not listen");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(server)
}

fn iperf_once(netns: &str, seconds: u32) -> anyhow::Result<f64> {
    let out = Command::new("nsenter")
        .arg(format!("--net={netns}"))
        .args(["iperf3", "-J", "-c", PEER, "-p", &IPERF_PORT.to_string(), "-t", &seconds.to_string()])
        .output()?;
    let report: Value = serde_json::from_slice(&out.stdout).context("iperf3 -J output")?;
    report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|b| crate::round3(b / 1e9))
        .with_context(|| format!("iperf3 reported no throughput: {}", report["error"]))
}

fn attach_scenario(samples: usize) -> anyhow::Result<Scenario> {
    let cfg = NetConfig::new("cnbench1", "10.91.0.0/24")?;
    let network = HostNetwork::open(cfg.clone())?;
    let mut s = Scenario {
        name: "attach-direct".into(),
        client: "copse_cubenet::linux::HostNetwork".into(),
        concurrency: 1,
        ..Default::default()
    };
    for i in 0..samples {
        let mut holder = Command::new("unshare").args(["-n", "sleep", "60"]).spawn()?;
        // unshare execs sleep once the namespace exists; wait for that.
        let pid = holder.id() as i32;
        let host_ns = std::fs::read_link("/proc/self/ns/net")?;
        while std::fs::read_link(format!("/proc/{pid}/ns/net")).ok().as_ref() == Some(&host_ns) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let id = format!("bench{i}");
        let wanted = SandboxNetwork { address: Ipv4Addr::new(10, 91, 0, 2), policy: Policy::open() };
        let t = Instant::now();
        let attached = network.attach(&id, pid, &wanted);
        let attach = ms(t.elapsed());
        let t = Instant::now();
        network.detach(&id)?;
        let detach = ms(t.elapsed());
        let _ = holder.kill();
        let _ = holder.wait();
        match attached {
            Ok(_) => {
                s.series.entry("attach_ms".into()).or_default().push(Some(attach));
                s.series.entry("detach_ms".into()).or_default().push(Some(detach));
            }
            Err(e) => s.errors.push(format!("{e:#}")),
        }
    }
    network.remove()?;
    Ok(s)
}

/// The peer host: a network namespace routed from the host over a veth
/// (`host` on the host's end, `addr` on the peer's, a /24).
pub(crate) struct Peer {
    pub ns: String,
}

impl Peer {
    pub fn create(ns: &str, veth: &str, host: &str, addr: &str) -> anyhow::Result<Self> {
        let _ = sh(&["ip", "netns", "del", ns]);
        sh(&["ip", "netns", "add", ns])?;
        let peer = Peer { ns: ns.to_string() };
        sh(&["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])?;
        sh(&["ip", "addr", "add", &format!("{host}/24"), "dev", veth])?;
        sh(&["ip", "link", "set", veth, "up"])?;
        sh(&["ip", "-n", ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
        sh(&["ip", "-n", ns, "link", "set", "eth0", "up"])?;
        sh(&["ip", "-n", ns, "link", "set", "lo", "up"])?;
        sh(&["ip", "-n", ns, "route", "add", "default", "via", host])?;
        Ok(peer)
    }

    /// A one-byte echo server in the peer's namespace, for the RTT loops.
    fn spawn_echo(&self) -> anyhow::Result<()> {
        let listener = in_netns(Some(&format!("/var/run/netns/{}", self.ns)), || {
            Ok(TcpListener::bind((PEER.parse::<Ipv4Addr>()?, RTT_PORT))?)
        })?;
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut stream = stream;
                    let _ = stream.set_nodelay(true);
                    let mut byte = [0u8; 1];
                    while stream.read_exact(&mut byte).is_ok() && stream.write_all(&byte).is_ok() {}
                });
            }
        });
        Ok(())
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.ns]);
    }
}

pub(crate) fn sh(argv: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(argv[0]).args(&argv[1..]).output()?;
    if !out.status.success() {
        bail!("{}: {}", argv.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}
