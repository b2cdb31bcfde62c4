//! `copse-rig-cluster`: what a node of a shared database costs a create and
//! its first command at concurrency 1. Four ways in, same host, same
//! template: one gateway on its own SQLite (the single-host baseline); node
//! one of three on a throwaway PostgreSQL, called directly; the same node's
//! sandboxes reached through node two's gateway (nodes two and three
//! drained, so every create is placed on node one and every call forwarded, over the
//! cluster's mutual TLS as a cluster between hosts runs); and the same
//! through an API front (`copse up --no-sandboxes`), which runs no
//! sandboxes. All four run at once and take turns, sample by sample.
//!
//! Then a snapshot moving between the nodes through the object store
//! (SeaweedFS on loopback): a sandbox on node one with N MB written, its
//! snapshot (files only), the upload node one makes on its own (the stream,
//! then its layers as images), and a create from it through node two's
//! gateway while node one is drained: node two mounts the layers as they
//! arrive (lazy fetch) and boots, then reads a file and the whole of the N
//! MB, then a second create finds the layers there. The same create
//! through node three (`--no-lazy-fetch`) fetches the whole snapshot
//! before the boot, for comparison.
//!
//! Then a memory snapshot moving between the nodes: a process on node one
//! holding N MiB of random bytes, snapshotted with its memory; node one
//! stores an image of the checkpoint beside the layers'. A create through
//! node two's gateway (node one drained) mounts that image as it arrives
//! and restores lazily, so the sandbox is handed over before its pages
//! are here; the process then hashes every byte it holds. The same through
//! node three (`--no-lazy-fetch`), which fetches the whole snapshot first.
//!
//! Then a paused sandbox moving the same way: paused on its files on node
//! one, uploaded by node one on its own, and resumed (connect) through node
//! two's gateway while node one is drained: the claim, the layers mounted
//! as they arrive, and the boot on node two.
//!
//! Last, creates per second at c=50 with 1, 2 and 3 active nodes (the
//! others drained), all sent through node one's gateway: every sandbox
//! stays until the burst ends, so placement sees them pile up. The three
//! nodes share this host's two cores, so more nodes add no CPU here.
//!
//! Writes one JSON result to `benchmarks/results/` (see
//! `benchmarks/schema.md`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use copse_rigs::api::{Api, filler_seeded, log_text_seeded};
use copse_rigs::exec::first_exec;
use copse_rigs::facts::random_hex;
use copse_rigs::holder;
use copse_rigs::postgres::Postgres;
use copse_rigs::report::{find, p50_difference, print_footer, server_timing};
use copse_rigs::seaweedfs::SeaweedFs;
use copse_rigs::{Binaries, Conn, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, ms};
use hyper::{Method, StatusCode};
use serde_json::json;

const RIG: &str = "cluster";
const CREATE_BODY: &str = r#"{"templateID":"base","metadata":{},"envVars":{}}"#;
/// model/node.rs's heartbeat, and a margin: placement reads heartbeats.
const HEARTBEAT_WAIT: Duration = Duration::from_millis(2_500);
/// service/nodes.rs's node table cache, and a margin: a drain is seen
/// this much later.
const DRAIN_WAIT: Duration = Duration::from_millis(800);
/// A 1 GiB snapshot needs a sandbox disk larger than the default quota.
const DISK_MB: &str = "2048";
const MARKER: &[u8] = b"taken on node one";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Create-to-first-exec through a cluster vs one gateway; snapshots between nodes; creates/s with 1-3 nodes"
)]
struct Args {
    /// Timed samples per scenario. Many: a boot's own spread (p95 about
    /// 1.5x p50 here) would otherwise hide differences of a millisecond.
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Sizes (MB written into the sandbox) of the snapshots moved between nodes.
    #[arg(long, value_delimiter = ',', default_values_t = [0usize, 100, 1024])]
    restore_mb: Vec<usize>,
    /// Snapshots moved per size.
    #[arg(long, default_value_t = 3)]
    restore_samples: usize,
    /// Sizes (MB) of snapshots of log-like text moved between nodes: what
    /// compression of the stored chunks saves.
    #[arg(long, value_delimiter = ',', default_values_t = [100usize])]
    restore_text_mb: Vec<usize>,
    /// MiB of random bytes held in a process's memory, snapshotted with
    /// it and restored on another node (at most 384: the template's
    /// memory limit is 512 MiB).
    #[arg(long, value_delimiter = ',', default_values_t = [160usize, 384])]
    memory_mb: Vec<usize>,
    /// Clients at once in the creates-per-second bursts.
    #[arg(long, default_value_t = 50)]
    burst_concurrency: usize,
    /// Creates per burst (one burst per node count, 1 to 3).
    #[arg(long, default_value_t = 150)]
    burst_creates: usize,
    /// SeaweedFS's `weed`, as scripts/seaweedfs installs it.
    #[arg(long, default_value = "/usr/local/bin/weed")]
    weed: std::path::PathBuf,
    #[command(flatten)]
    common: RigArgs,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = Run::begin(RIG);
    let bins = &args.common.bins;
    bins.check()?;
    bins.build_template(Some("base"))?;
    let key = random_hex(16)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut notes = Vec::new();

    let disk = ["--disk-mb".to_string(), DISK_MB.to_string()];
    let single = Gateway::start_with(bins, &key, &["base=0".into()], "copse-rig-cluster", &[], &disk)?;
    // Not in the data dir: it is 0700, closed to the postgres user.
    let pg = Postgres::start(&std::env::temp_dir())?;
    let store = SeaweedFs::start(&args.weed, &bins.data_dir)?;
    // A new CA each run: `cluster-ca` and `node-cert` never overwrite.
    let tls = bins.data_dir.join("cluster-tls");
    if tls.exists() {
        std::fs::remove_dir_all(&tls)?;
    }
    copse(bins, &["tls", "cluster-ca", "--out", &tls.join("ca").to_string_lossy()])?;
    let nodes = (1..=3).map(|n| node(bins, &key, &pg.url, &tls, &store, n)).collect::<anyhow::Result<Vec<_>>>()?;
    let api_front = front(bins, &key, &pg.url, &tls, &store)?;
    let measured = (|| {
        let ids = nodes
            .iter()
            .map(|(_, b, _)| Ok(std::fs::read_to_string(b.data_dir.join("node-id"))?.trim().to_string()))
            .collect::<anyhow::Result<Vec<String>>>()?;
        let drain = |n: usize, on: bool| {
            copse(bins, &["node", if on { "drain" } else { "undrain" }, &ids[n], "--database", &pg.url])
        };
        // Node three takes part in the bursts only.
        drain(1, true)?;
        drain(2, true)?;
        std::thread::sleep(HEARTBEAT_WAIT);
        let ways = [
            ("single-node-c1", single.addr),
            ("cluster-direct-c1", nodes[0].0.addr),
            ("cluster-forwarded-c1", nodes[1].0.addr),
            ("cluster-front-c1", api_front.addr),
        ];
        let mut scenarios = rt.block_on(measure(&ways, &key, args.samples))?;
        let apis = [0, 1, 2].map(|n| Api { addr: nodes[n].0.addr, key: key.clone() });
        let holds = |n: usize, id: &str| nodes[n].1.data_dir.join("sandboxes").join(id).exists();
        let bucket = store.bucket()?;
        let sizes = args.restore_mb.iter().map(|&mb| (mb, Fill::Random));
        for (mb, fill) in sizes.chain(args.restore_text_mb.iter().map(|&mb| (mb, Fill::LogText))) {
            eprintln!("-- cross-node restore of {mb} MB of {}: {} samples", fill.name(), args.restore_samples);
            let (mut rows, mut stored) = (Vec::new(), Vec::new());
            for sample in 0..args.restore_samples {
                let moved = Move { apis: &apis, bucket: &bucket, drain: &drain, holds: &holds };
                let (row, stored_bytes) = rt.block_on(moved.once(mb, sample as u64, fill))?;
                rows.push(row);
                stored.push(stored_bytes);
            }
            let metrics = [
                "snapshot_ms",
                "upload_ms",
                "restore_create_ms",
                "first_read_ms",
                "full_read_ms",
                "cached_create_ms",
                "whole_restore_create_ms",
                "whole_first_read_ms",
                "whole_full_read_ms",
            ];
            let name = format!("cross-node-restore-{mb}mb{}", fill.suffix());
            let mut scenario = Scenario::from_rows(&name, 1, &metrics, &rows);
            scenario.counters.insert("dirty_mb".into(), json!(mb));
            scenario
                .counters
                .insert("stream_mb".into(), json!(stored.iter().map(|s| s.0).sum::<f64>() / rows.len() as f64));
            scenario
                .counters
                .insert("stored_mb".into(), json!(stored.iter().map(|s| s.1).sum::<f64>() / rows.len() as f64));
            scenarios.push(scenario);
        }
        for &mb in &args.memory_mb {
            eprintln!("-- cross-node restore of {mb} MiB held in memory: {} samples", args.restore_samples);
            let mut rows = Vec::new();
            for _ in 0..args.restore_samples {
                let moved = Move { apis: &apis, bucket: &bucket, drain: &drain, holds: &holds };
                rows.push(rt.block_on(moved.memory_once(mb))?);
            }
            let metrics =
                ["snapshot_ms", "upload_ms", "handover_ms", "touch_all_ms", "whole_handover_ms", "whole_touch_all_ms"];
            let mut scenario = Scenario::from_rows(&format!("cross-node-memory-{mb}mb"), 1, &metrics, &rows);
            scenario.counters.insert("anon_mb".into(), json!(mb));
            scenarios.push(scenario);
        }
        for &mb in &args.restore_mb {
            eprintln!("-- paused sandbox moved, {mb} MB: {} samples", args.restore_samples);
            let mut rows = Vec::new();
            for sample in 0..args.restore_samples {
                let moved = Move { apis: &apis, bucket: &bucket, drain: &drain, holds: &holds };
                rows.push(rt.block_on(moved.paused_once(mb, sample as u64))?);
            }
            let metrics = ["pause_ms", "upload_ms", "resume_ms", "first_read_ms"];
            let mut scenario = Scenario::from_rows(&format!("paused-move-{mb}mb"), 1, &metrics, &rows);
            scenario.counters.insert("dirty_mb".into(), json!(mb));
            scenarios.push(scenario);
        }
        let holders: Vec<&Path> = nodes.iter().map(|(_, b, _)| b.data_dir.as_path()).collect();
        for active in 1..=nodes.len() {
            for n in 0..nodes.len() {
                drain(n, n >= active)?;
            }
            std::thread::sleep(HEARTBEAT_WAIT);
            let burst = Burst { addr: nodes[0].0.addr, key: &key, holders: &holders };
            scenarios.push(rt.block_on(burst.run(active, args.burst_concurrency, args.burst_creates))?);
        }
        anyhow::Ok(scenarios)
    })();
    single.stop(&mut notes);
    api_front.stop(&mut notes);
    for (gateway, _, bridge) in nodes {
        gateway.stop(&mut notes);
        drop_network(&bridge);
    }
    let scenarios = measured?;
    let pg_version = pg.version.clone();
    drop(pg);
    drop(store);

    let added =
        p50_difference(find(&scenarios, "cluster-forwarded-c1"), find(&scenarios, "single-node-c1"), "total_ms");
    let added_by_front =
        p50_difference(find(&scenarios, "cluster-front-c1"), find(&scenarios, "single-node-c1"), "total_ms");
    let targets = json!([{
        "claim": "the cluster adds <= 3 ms p50 to create -> first exec at c=1 (forwarded through another node's gateway, vs one gateway on SQLite)",
        "scenario": "cluster-forwarded-c1",
        "metric": "total_ms",
        "stat": "p50 difference from single-node-c1",
        "limit_ms": 3.0,
        "value_ms": added,
        "met": added.as_f64().map(|v| v <= 3.0),
    }, {
        "claim": "the cluster adds <= 3 ms p50 to create -> first exec at c=1 (through an API front, copse up --no-sandboxes, vs one gateway on SQLite)",
        "scenario": "cluster-front-c1",
        "metric": "total_ms",
        "stat": "p50 difference from single-node-c1",
        "limit_ms": 3.0,
        "value_ms": added_by_front,
        "met": added_by_front.as_f64().map(|v| v <= 3.0),
    }]);
    let derived = json!({
        "cluster_direct_minus_single_p50_total_ms":
            p50_difference(find(&scenarios, "cluster-direct-c1"), find(&scenarios, "single-node-c1"), "total_ms"),
        "forwarding_p50_total_ms":
            p50_difference(find(&scenarios, "cluster-forwarded-c1"), find(&scenarios, "cluster-direct-c1"), "total_ms"),
        "front_p50_total_ms":
            p50_difference(find(&scenarios, "cluster-front-c1"), find(&scenarios, "cluster-direct-c1"), "total_ms"),
        "forwarded_minus_single_p50_path_ms":
            p50_difference(find(&scenarios, "cluster-forwarded-c1"), find(&scenarios, "single-node-c1"), "path_ms"),
        "front_minus_single_p50_path_ms":
            p50_difference(find(&scenarios, "cluster-front-c1"), find(&scenarios, "single-node-c1"), "path_ms"),
        "direct_minus_single_p50_server_ms":
            p50_difference(find(&scenarios, "cluster-direct-c1"), find(&scenarios, "single-node-c1"), "server_ms"),
    });
    let params = json!({
        "client": LEAN_CLIENT,
        "samples": args.samples,
        "template": "base",
        "create_body": CREATE_BODY,
        "database": format!("PostgreSQL {pg_version} from Debian, on a unix socket on this host"),
        "nodes": "three `copse up --database` on this host, each with its own data dir, bridge and subnet, nodes two and three drained, and an API front (`copse up --no-sandboxes`); the single gateway runs beside them, and the four ways in take turns sample by sample",
        "forwarding": "kept-alive HTTP/1.1 connections over mutual TLS (TLS 1.3, ECDSA P-256 node certificates from `copse tls cluster-ca`/`node-cert`) to the node's peer listener",
        "disk_mb": DISK_MB,
        "bursts": {
            "scenarios": "creates-c{C}-{N}-nodes: N active nodes (the rest drained), C clients at once through node one's gateway, each creating and running its first command (`/bin/true`) until the burst's creates are made",
            "creates": args.burst_creates,
            "concurrency": args.burst_concurrency,
            "kept": "every sandbox stays until the burst ends (then all are deleted, untimed), so each node's count grows during it",
            "counters": "creates_per_s = creates / wall clock of the burst; on_node_K = how many landed on node K",
            "host": "the three nodes share this host's two cores and memory: more nodes add no CPU",
        },
        "cross_node_restore": {
            "object_store": "SeaweedFS `weed server` (master, volume, filer, S3 gateway) on loopback, its files in the rig's data dir (ext4 without a journal)",
            "sizes_mb": args.restore_mb,
            "text_sizes_mb": args.restore_text_mb,
            "samples_per_size": args.restore_samples,
            "snapshot": "files only (`memory: false`), of a sandbox on node one with N MB of incompressible bytes written to /home/user (cross-node-restore-{N}mb), or N MB of log lines (cross-node-restore-{N}mb-text: timestamps, ids and numbers varying, words repeating), each sample's bytes different (nothing deduplicated in the bucket)",
            "counters": "stream_mb = the snapshot stream's length (its manifest's size); stored_mb = its chunks as the bucket holds them (LZ4 where that made a chunk smaller), each a mean over the samples",
            "upload_ms": "from the snapshot call's answer until the manifests of its stream and of its top layer's image are in the bucket (node one uploads both on its own, the image last; polled every 20 ms), plus 100 ms for node one to mark the record, which the rig does not read",
            "restore_create_ms": "create from the snapshot through node two's gateway with nodes one and three drained: placement, then lazy fetch: a `copse lazy-image` server per layer (its image manifest checked against the record's hash), the EROFS mounts and the boot; nothing of the files is fetched before the boot but what the mount and the boot read",
            "first_read_ms": "reading a small file written before the snapshot, from the new sandbox",
            "full_read_ms": "then reading the whole N MB file through the files API: what the reads fetch (chunks checked against their hashes) unless the background fetch got there first",
            "cached_create_ms": "a second create of the same snapshot on node two, which holds the mounted layers",
            "whole_restore_create_ms": "the same create through node three's gateway (`--no-lazy-fetch`) with nodes one and two drained: the fetch of the whole stream from the bucket (chunks checked against their hashes), the import and the boot",
            "whole_first_read_ms": "the small file, from that sandbox",
            "whole_full_read_ms": "the whole N MB file, from that sandbox (local files)",
            "lazy_fetch": "node two: layers mounted as they arrive (EROFS images over FUSE, fetched by range on first read and in the background); node three: the whole snapshot before the boot",
            "published_comparison": "CloudFlare's sandbox backup/restore write-up reports a restore of a squashfs image mounted in 2.2 s, on their hardware and network; not comparable beyond order of magnitude",
        },
        "cross_node_memory": {
            "scenarios": "cross-node-memory-{N}mb: a sandbox on node one runs tests/memory_holder.py holding N MiB of random bytes in its own memory (each sample's different), snapshotted with its memory (POST /sandboxes/{id}/snapshots {\"memory\": true}); samples per size as cross_node_restore",
            "sizes_mib": args.memory_mb,
            "snapshot_ms": "the snapshot call's round trip (the files and the CRIU dump)",
            "upload_ms": "from the snapshot call's answer until the manifest of the checkpoint's image (`…@memimage`, sent after the stream and the layers' images) is in the bucket, polled every 20 ms, plus 100 ms for node one to mark the record",
            "handover_ms": "create from the snapshot through node two's gateway (nodes one and three drained): a `copse lazy-image` server for each layer and for the checkpoint's image, their mounts, and a restore from the mounted checkpoint, lazy from 128 MiB of pages (a `criu lazy-pages` pager copies each page on first touch and the rest in the background), until the 201 is read",
            "touch_all_ms": "then the holder hashes every byte it holds (asked through the agent on a connection opened before the create): whatever pages the pager has not copied yet are fetched from the bucket as they are touched; the digest is checked against the source's",
            "whole_handover_ms": "the same create through node three's gateway (`--no-lazy-fetch`, nodes one and two drained): the whole snapshot stream (files and checkpoint) fetched and imported, then the restore",
            "whole_touch_all_ms": "the holder's hash in that sandbox",
        },
        "paused_move": {
            "scenarios": "paused-move-{N}mb: a sandbox on node one with N MB of incompressible bytes written to /home/user (sizes and samples as cross_node_restore), paused on its files (`memory: false`), resumed through node two's gateway with node one drained",
            "pause_ms": "the pause call's round trip (the files kept, the sandbox destroyed)",
            "upload_ms": "from the pause's answer until the manifests of the paused files' stream and of its layer's image are in the bucket (node one uploads both on its own, the image last; polled every 20 ms), plus 100 ms for node one to mark the record, which the rig does not read",
            "resume_ms": "connect through node two's gateway: placement, the claim of the record, a `copse lazy-image` server per layer and their mounts (as cross_node_restore's node two), and the boot under the sandbox's own id",
            "first_read_ms": "reading a file written before the pause, from the resumed sandbox",
            "lazy_fetch": "node two mounts the paused files' layers as they arrive (EROFS images over FUSE), as for snapshots",
        },
    });
    let (path, result) = run.write(&args.common.out_dir, params, bins, &scenarios, derived, targets, notes)?;
    let metrics = [
        "create_ms",
        "exec_ms",
        "total_ms",
        "server_ms",
        "path_ms",
        "snapshot_ms",
        "upload_ms",
        "restore_create_ms",
        "full_read_ms",
        "whole_restore_create_ms",
        "whole_full_read_ms",
        "cached_create_ms",
        "pause_ms",
        "resume_ms",
        "handover_ms",
        "touch_all_ms",
        "whole_handover_ms",
        "whole_touch_all_ms",
    ];
    for s in &scenarios {
        let line: Vec<String> = metrics
            .iter()
            .filter_map(|k| s.summary(k).map(|v| format!("{k} p50 {:.2} p95 {:.2}", v.p50, v.p95)))
            .collect();
        println!("{:<22} {}", s.name, line.join(" | "));
    }
    print_footer(&result, &path);
    Ok(())
}

/// Node `n`: its own data dir beside the rig's (templates hard-linked from
/// it), bridge and subnet, on the shared database and object store, with a
/// certificate of the cluster CA in `tls`.
fn node(
    bins: &Binaries,
    key: &str,
    database: &str,
    tls: &Path,
    store: &SeaweedFs,
    n: u8,
) -> anyhow::Result<(Gateway, Binaries, String)> {
    let node_bins = fresh_data_dir(bins, &format!("cluster-node{n}"))?;
    let status =
        Command::new("cp").arg("-al").arg(bins.data_dir.join("templates")).arg(&node_bins.data_dir).status()?;
    anyhow::ensure!(status.success(), "linking the templates into {}", node_bins.data_dir.display());
    let bridge = format!("copsebc{n}");
    let mut args = member_args(bins, database, tls, &format!("node{n}"))?;
    // Node three fetches snapshots whole: the restore's comparison.
    if n == 3 {
        args.push("--no-lazy-fetch".into());
    }
    args.extend(
        ["--bridge", &bridge, "--subnet", &format!("10.{}.0.0/16", 96 + n), "--disk-mb", DISK_MB].map(String::from),
    );
    let gateway = start_member(&node_bins, key, &["base=0".into()], "copse-rig-cluster", store, &args)?;
    Ok((gateway, node_bins, bridge))
}

/// An API front (`copse up --no-sandboxes`): no templates, bridge or pool.
fn front(bins: &Binaries, key: &str, database: &str, tls: &Path, store: &SeaweedFs) -> anyhow::Result<Gateway> {
    let front_bins = fresh_data_dir(bins, "cluster-front")?;
    let mut args = member_args(bins, database, tls, "front")?;
    args.push("--no-sandboxes".into());
    start_member(&front_bins, key, &[], "copse-rig-cluster-front", store, &args)
}

/// `copse up` of a cluster member, the object store's keys in its
/// environment.
fn start_member(
    bins: &Binaries,
    key: &str,
    pools: &[String],
    log_prefix: &str,
    store: &SeaweedFs,
    args: &[String],
) -> anyhow::Result<Gateway> {
    let env = store.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Gateway::start_with(bins, key, pools, log_prefix, &env, args)
}

/// `bins` with the data dir `name` beside its own, emptied of an earlier
/// run's files but the sandboxes' disk (it stays mounted between runs; the
/// gateway clears it at start).
fn fresh_data_dir(bins: &Binaries, name: &str) -> anyhow::Result<Binaries> {
    let data_dir = bins.data_dir.join(name);
    std::fs::create_dir_all(&data_dir)?;
    for entry in std::fs::read_dir(&data_dir)?.flatten() {
        if !matches!(entry.file_name().to_str(), Some("disk" | "disk.img")) {
            let path = entry.path();
            if path.is_dir() { std::fs::remove_dir_all(&path)? } else { std::fs::remove_file(&path)? }
        }
    }
    Ok(Binaries { data_dir, ..bins.clone() })
}

/// The `copse up` arguments of a cluster member called `name`: the shared
/// database, and a node certificate and peer listener of its own.
fn member_args(bins: &Binaries, database: &str, tls: &Path, name: &str) -> anyhow::Result<Vec<String>> {
    let certs = tls.join(name).to_string_lossy().into_owned();
    let ca = tls.join("ca").to_string_lossy().into_owned();
    copse(bins, &["tls", "node-cert", "--ca", &ca, "--host", "127.0.0.1", "--out", &certs])?;
    // A port free now; the member binds it moments later.
    let peer_port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    Ok(["--database", database, "--cluster-tls", &certs, "--cluster-listen", &format!("127.0.0.1:{peer_port}")]
        .map(String::from)
        .to_vec())
}

fn drop_network(bridge: &str) {
    let _ = Command::new("nft").args(["delete", "table", "inet", &format!("copse_{bridge}")]).output();
    let _ = Command::new("ip").args(["link", "del", bridge]).output();
}

fn copse(bins: &Binaries, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(&bins.copse).args(args).output()?;
    if !out.status.success() {
        bail!("copse {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// `n` creates through each way in, each followed by its first command
/// (`/bin/true`) and a delete, one after another on one connection per
/// way. The ways take turns sample by sample, so a slow spell of this
/// shared host falls on all of them alike.
async fn measure(ways: &[(&str, SocketAddr)], key: &str, n: usize) -> anyhow::Result<Vec<Scenario>> {
    let mut conns = Vec::new();
    for (name, addr) in ways {
        eprintln!("-- {name}: {n} samples through {addr}");
        conns.push(Conn::open(*addr).await?);
    }
    let mut rows = vec![Vec::new(); ways.len()];
    for sample in 0..n + 2 {
        for ((conn, rows), (name, _)) in conns.iter_mut().zip(&mut rows).zip(ways) {
            let t0 = Instant::now();
            let created = conn.create_sandbox(key, CREATE_BODY).await.with_context(|| format!("{name}: create"))?;
            let t_created = Instant::now();
            let (_, t_done) =
                first_exec(conn, &created.id, &created.token).await.with_context(|| format!("{name}: first exec"))?;
            conn.delete_sandbox(key, &created.id).await.with_context(|| format!("{name}: delete"))?;
            // Two untimed: the connection's and the node's first.
            if sample >= 2 {
                // The node's own time for it, passed back unchanged by a forwarding gateway.
                let server = server_timing(&created.server_timing, "total")
                    .with_context(|| format!("{name}: create without a Server-Timing total"))?;
                let total = ms(t_done - t0);
                rows.push([ms(t_created - t0), ms(t_done - t_created), total, server, total - server]);
            }
        }
    }
    Ok(ways
        .iter()
        .zip(rows)
        .map(|((name, _), rows)| {
            Scenario::from_rows(name, 1, &["create_ms", "exec_ms", "total_ms", "server_ms", "path_ms"], &rows)
        })
        .collect())
}

/// A burst of creates through one gateway, with the node data dirs to tell
/// where each sandbox landed.
struct Burst<'a> {
    addr: SocketAddr,
    key: &'a str,
    holders: &'a [&'a Path],
}

impl Burst<'_> {
    /// `creates` creates from `clients` connections at once, each followed
    /// by its first command; then every sandbox is deleted (untimed).
    async fn run(&self, active: usize, clients: usize, creates: usize) -> anyhow::Result<Scenario> {
        let name = format!("creates-c{clients}-{active}-nodes");
        eprintln!("-- {name}: {creates} creates");
        let tickets = std::sync::atomic::AtomicUsize::new(creates);
        let take = || tickets.fetch_update(Relaxed, Relaxed, |left| left.checked_sub(1)).is_ok();
        let mut conns = Vec::new();
        for _ in 0..clients {
            conns.push(Conn::open(self.addr).await?);
        }
        let t0 = Instant::now();
        let workers = conns.iter_mut().map(|conn| async {
            let mut made = Vec::new();
            while take() {
                let started = Instant::now();
                let created = conn.create_sandbox(self.key, CREATE_BODY).await.context("create")?;
                let t_created = Instant::now();
                let (_, t_done) = first_exec(conn, &created.id, &created.token).await.context("first exec")?;
                made.push((created.id, [ms(t_created - started), ms(t_done - started)]));
            }
            anyhow::Ok(made)
        });
        let made: Vec<_> = futures::future::try_join_all(workers).await?.into_iter().flatten().collect();
        let wall = t0.elapsed();
        let mut landed = vec![0usize; self.holders.len()];
        for (id, _) in &made {
            if let Some(k) = self.holders.iter().position(|dir| dir.join("sandboxes").join(id).exists()) {
                landed[k] += 1;
            }
        }
        let mut cleanup = Conn::open(self.addr).await?;
        for (id, _) in &made {
            cleanup.delete_sandbox(self.key, id).await?;
        }
        let rows: Vec<[f64; 2]> = made.iter().map(|(_, row)| *row).collect();
        let mut scenario = Scenario::from_rows(&name, clients, &["create_ms", "total_ms"], &rows);
        scenario.wall_ms = Some(ms(wall));
        scenario.counters.insert("active_nodes".into(), json!(active));
        scenario.counters.insert("creates_per_s".into(), json!(made.len() as f64 / wall.as_secs_f64()));
        for (k, count) in landed.iter().enumerate() {
            scenario.counters.insert(format!("on_node_{}", k + 1), json!(count));
        }
        Ok(scenario)
    }
}

/// What a moved snapshot's sandbox is filled with.
#[derive(Clone, Copy)]
enum Fill {
    Random,
    LogText,
}

impl Fill {
    fn name(self) -> &'static str {
        match self {
            Fill::Random => "incompressible bytes",
            Fill::LogText => "log lines",
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Fill::Random => "",
            Fill::LogText => "-text",
        }
    }

    fn bytes(self, mb: usize, seed: u64) -> Bytes {
        match self {
            Fill::Random => filler_seeded(mb, seed),
            Fill::LogText => log_text_seeded(mb, seed),
        }
    }
}

/// One snapshot moved from node one to node two. Node two is drained
/// before and after.
struct Move<'a> {
    apis: &'a [Api; 3],
    bucket: &'a copse_objects::Bucket,
    drain: &'a dyn Fn(usize, bool) -> anyhow::Result<()>,
    /// Whether node `n` (0 to 2) holds sandbox `id`.
    holds: &'a dyn Fn(usize, &str) -> bool,
}

impl Move<'_> {
    /// A sandbox on node one with `mb` MB of bytes no other sample wrote
    /// (`salt`), and the marker file.
    async fn filled_source(
        &self,
        c1: &mut Conn,
        mb: usize,
        salt: u64,
        fill: Fill,
    ) -> anyhow::Result<copse_rigs::api::Sandbox> {
        let one = &self.apis[0];
        let source = one.create(c1, "base").await?;
        if mb > 0 {
            one.upload(c1, &source, "/home/user/dirty.bin", fill.bytes(mb, ((mb as u64) << 8) + salt)).await?;
        }
        one.upload(c1, &source, "/home/user/marker", Bytes::from_static(MARKER)).await?;
        Ok(source)
    }

    /// Polls until `key` is in the bucket (`what` names it for the error).
    async fn wait_in_bucket(&self, key: &str, what: &str) -> anyhow::Result<()> {
        let start = Instant::now();
        while !self.bucket.has(key).await? {
            if start.elapsed() > Duration::from_secs(600) {
                bail!("{what} was not in the bucket after 10 minutes");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Makes node `n` (0 to 2) the one that takes sandboxes, the others
    /// drained, and waits until gateways see it.
    async fn place_on(&self, n: usize) -> anyhow::Result<()> {
        for other in 0..self.apis.len() {
            (self.drain)(other, other != n)?;
        }
        tokio::time::sleep(DRAIN_WAIT).await;
        Ok(())
    }

    /// A create from `snap` on node `n` (placed there), a read of the
    /// marker, and of the whole dirty file if any: [create, first read,
    /// full read] in ms.
    async fn restore_on(&self, n: usize, conn: &mut Conn, snap: &str, mb: usize) -> anyhow::Result<[f64; 3]> {
        let api = &self.apis[n];
        let (moved, create, read) = api.create_and_read_marker(conn, snap, MARKER).await?;
        if !(self.holds)(n, &moved.id) {
            bail!("sandbox {} from snapshot {snap} is not on node {}", moved.id, n + 1);
        }
        let t0 = Instant::now();
        if mb > 0 {
            let body = api.read(conn, &moved, "/home/user/dirty.bin").await?;
            anyhow::ensure!(body.len() == mb << 20, "read {} bytes of the {mb} MB file", body.len());
        }
        let full = ms(t0.elapsed());
        api.delete(conn, &moved.id).await?;
        Ok([create, read, full])
    }

    /// [snapshot, upload, lazy create, first read, full read, cached
    /// create, whole create, first read, full read] in ms, and the
    /// stream's MB and its chunks' MB as stored.
    async fn once(&self, mb: usize, seed: u64, fill: Fill) -> anyhow::Result<([f64; 9], (f64, f64))> {
        let [one, two, three] = &self.apis;
        let (mut c1, mut c2, mut c3) =
            (Conn::open(one.addr).await?, Conn::open(two.addr).await?, Conn::open(three.addr).await?);
        let source = self.filled_source(&mut c1, mb, seed + 1, fill).await?;
        let t0 = Instant::now();
        let snap = one.snapshot(&mut c1, &source.id).await?;
        let snapshot = ms(t0.elapsed());
        let t1 = Instant::now();
        self.wait_in_bucket(&format!("snapshots/default/{snap}"), &format!("snapshot {snap}")).await?;
        self.wait_in_bucket(&format!("snapshots/default/{snap}@layer0"), &format!("snapshot {snap}'s image")).await?;
        // The record is marked stored right after the upload.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let upload = ms(t1.elapsed());
        let stored = self.stored_mb(&format!("snapshots/default/{snap}")).await?;
        one.delete(&mut c1, &source.id).await?;
        let restored = async {
            self.place_on(1).await?;
            let [create, read, full] = self.restore_on(1, &mut c2, &snap, mb).await?;
            let (again, cached, _) = two.create_and_read_marker(&mut c2, &snap, MARKER).await?;
            two.delete(&mut c2, &again.id).await?;
            self.place_on(2).await?;
            let [whole, whole_read, whole_full] = self.restore_on(2, &mut c3, &snap, mb).await?;
            anyhow::Ok([create, read, full, cached, whole, whole_read, whole_full])
        }
        .await;
        self.place_on(0).await?;
        let [create, read, full, cached, whole, whole_read, whole_full] = restored?;
        one.expect(&mut c1, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
        Ok(([snapshot, upload, create, read, full, cached, whole, whole_read, whole_full], stored))
    }

    /// The stream under `key` in MB, and its chunks in MB as the bucket
    /// holds them.
    async fn stored_mb(&self, key: &str) -> anyhow::Result<(f64, f64)> {
        let manifest = copse_objects::manifest(self.bucket, key).await?.with_context(|| format!("{key} is gone"))?;
        let sizes: std::collections::HashMap<String, u64> =
            self.bucket.list().await?.into_iter().map(|o| (o.key, o.size)).collect();
        let stored: u64 = manifest.chunks.iter().filter_map(|c| sizes.get(&c.key())).sum();
        Ok((manifest.size as f64 / 1048576.0, stored as f64 / 1048576.0))
    }

    /// [snapshot, upload, lazy handover, its touch-all, whole handover,
    /// its touch-all] in ms, for a memory snapshot of a process holding
    /// `mb` MiB on node one, restored on node two, then node three.
    async fn memory_once(&self, mb: usize) -> anyhow::Result<[f64; 6]> {
        let one = &self.apis[0];
        let mut c1 = Conn::open(one.addr).await?;
        let source = one.create(&mut c1, "base").await?;
        let digest = holder::start(one, &source, mb).await?;
        let t0 = Instant::now();
        let snap = holder::snapshot_memory(one, &mut c1, &source.id).await?;
        let snapshot = ms(t0.elapsed());
        let t1 = Instant::now();
        let image = format!("snapshots/default/{snap}@memimage");
        self.wait_in_bucket(&image, &format!("snapshot {snap}'s checkpoint image")).await?;
        // The record is marked stored right after the upload.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let upload = ms(t1.elapsed());
        one.delete(&mut c1, &source.id).await?;
        let restored = async {
            self.place_on(1).await?;
            let lazy = self.held_on(1, &snap, &digest).await?;
            self.place_on(2).await?;
            let whole = self.held_on(2, &snap, &digest).await?;
            anyhow::Ok([lazy, whole])
        }
        .await;
        self.place_on(0).await?;
        let [[handover, touched], [whole, whole_touched]] = restored?;
        one.expect(&mut c1, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
        Ok([snapshot, upload, handover, touched, whole, whole_touched])
    }

    /// A create from memory snapshot `snap` on node `n` (placed there),
    /// then the holder's digest, checked: [handover, touch-all] in ms.
    async fn held_on(&self, n: usize, snap: &str, digest: &str) -> anyhow::Result<[f64; 2]> {
        let api = &self.apis[n];
        let mut conn = Conn::open(api.addr).await?;
        let (child, row) = holder::restore_and_touch(api, &mut conn, snap, digest).await?;
        if !(self.holds)(n, &child.id) {
            bail!("sandbox {} from snapshot {snap} is not on node {}", child.id, n + 1);
        }
        api.delete(&mut conn, &child.id).await?;
        Ok(row)
    }

    /// [pause, upload, resume, first read] in ms, for a paused sandbox
    /// moved from node one to node two.
    async fn paused_once(&self, mb: usize, seed: u64) -> anyhow::Result<[f64; 4]> {
        let [one, two, _] = &self.apis;
        let (mut c1, mut c2) = (Conn::open(one.addr).await?, Conn::open(two.addr).await?);
        let source = self.filled_source(&mut c1, mb, seed + 7, Fill::Random).await?;
        let t0 = Instant::now();
        one.pause_files(&mut c1, &source.id).await?;
        let pause = ms(t0.elapsed());
        let t1 = Instant::now();
        let manifest = format!("paused/default/{}", source.id);
        self.wait_in_bucket(&manifest, &format!("paused sandbox {}", source.id)).await?;
        // Its layer's image goes up after the stream, before the mark.
        self.wait_in_bucket(&format!("{manifest}@layer0"), &format!("paused sandbox {}'s image", source.id)).await?;
        // The record is marked stored right after the upload.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let upload = ms(t1.elapsed());
        self.place_on(1).await?;
        let moved = async {
            let t2 = Instant::now();
            let resumed = two.resume(&mut c2, &source).await?;
            let resume = ms(t2.elapsed());
            if !(self.holds)(1, &resumed.id) {
                bail!("paused sandbox {} did not resume on node two", resumed.id);
            }
            let t3 = Instant::now();
            let body = two.read(&mut c2, &resumed, "/home/user/marker").await?;
            let read = ms(t3.elapsed());
            if body.as_ref() != MARKER {
                bail!(
                    "sandbox {} read {:?} from its marker after the move",
                    resumed.id,
                    String::from_utf8_lossy(&body)
                );
            }
            two.delete(&mut c2, &resumed.id).await?;
            anyhow::Ok([resume, read])
        }
        .await;
        self.place_on(0).await?;
        let [resume, read] = moved?;
        Ok([pause, upload, resume, read])
    }
}
