//! `copse-rig-lifecycle OP`: lifecycle operations timed through the API a
//! user calls (E2B's pause/connect/snapshots/fork, copse's clone and
//! rollback), shaped like CubeSandbox's report §4.1–4.6 so the numbers line
//! up point by point. Starts its own gateway, writes one JSON result per
//! operation to `benchmarks/results/` (see `benchmarks/schema.md`).
//!
//! Every clock is client-side, from sending the request to having read the
//! whole response, on one keep-alive connection per worker.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::{Parser, ValueEnum};
use copse_rigs::api::{Api, filler, filler_seeded};
use copse_rigs::facts::random_hex;
use copse_rigs::holder;
use copse_rigs::report::{p50_target, print_footer};
use copse_rigs::seaweedfs::SeaweedFs;
use copse_rigs::{Binaries, Conn, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, ms};
use futures::future::join_all;
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Op {
    /// §4.1: pause, then resume through connect (memory kept; and files only).
    PauseResume,
    /// §4.2: filesystem snapshot of a sandbox with nothing written.
    Snapshot,
    /// §4.3: filesystem snapshot with N MB written since boot.
    SnapshotDirty,
    /// §4.4: create a sandbox from snapshots of several sizes, then read a file.
    FromSnapshot,
    /// §4.5: roll a sandbox back to its snapshot in place.
    Rollback,
    /// §4.6: clone N sandboxes from a running one.
    Clone,
    /// Memory ("full") snapshot of a running sandbox, and a new sandbox
    /// restored from it, with N MB held in the sandbox's memory (tmpfs).
    MemorySnapshot,
    /// A snapshot of N MB through an S3 object store (SeaweedFS on
    /// loopback): pushed cold and again unchanged, deleted here, pulled
    /// back, and a sandbox created from it.
    ObjectStore,
}

impl Op {
    fn rig(self) -> &'static str {
        match self {
            Op::PauseResume => "pause-resume",
            Op::Snapshot => "snapshot",
            Op::SnapshotDirty => "snapshot-dirty",
            Op::FromSnapshot => "from-snapshot",
            Op::Rollback => "rollback",
            Op::Clone => "clone",
            Op::MemorySnapshot => "memory-snapshot",
            Op::ObjectStore => "object-store",
        }
    }

    fn clock(self) -> &'static str {
        match self {
            Op::PauseResume => {
                "pause_ms: POST /sandboxes/{id}/pause sent -> 204 read; resume_ms: POST /v2/sandboxes/{id}/connect sent -> 201 read; resume_to_health_ms: resume request sent -> the sandbox's envd GET /health answered through the gateway"
            }
            Op::Snapshot | Op::SnapshotDirty => {
                "snapshot_ms: POST /sandboxes/{id}/snapshots sent -> 201 read (the sandbox's files are copied, its processes frozen meanwhile); delete_ms: DELETE /templates/{snapshot} sent -> 204 read"
            }
            Op::FromSnapshot => {
                "create_ms: POST /v2/sandboxes with the snapshot as templateID sent -> 201 read; first_read_ms: then GET /files of a file from the snapshot sent -> its bytes read; total_ms: both"
            }
            Op::Rollback => {
                "rollback_ms: POST /copse/sandboxes/{id}/rollback sent -> 200 read (processes restarted on the snapshot's files)"
            }
            Op::Clone => {
                "wall_ms: first POST /copse/sandboxes/{id}/clone sent -> last response read, for all clones of one round; per_sandbox_ms: wall_ms / clones"
            }
            Op::ObjectStore => {
                "push_ms: `copse snapshot push` started -> exited (export stream, content-defined chunks hashed, a HEAD per chunk and a PUT per chunk the bucket lacks, the manifest); repush_ms: the same snapshot pushed again (every chunk there: HEADs only); pull_ms: once the snapshot was deleted on this host, `copse snapshot pull` started -> exited (manifest, every chunk fetched and checked against its hash, import); create_ms: POST /v2/sandboxes from the pulled snapshot sent -> 201 read; first_read_ms: then GET /files of a file from it -> bytes read"
            }
            Op::MemorySnapshot => {
                "snapshot_ms: POST /sandboxes/{id}/snapshots {memory: true} sent -> 201 read (sandbox frozen, files copied, processes checkpointed); restore_ms: POST /v2/sandboxes with the snapshot as templateID sent -> 201 read (processes restored into a new sandbox); first_read_ms: then GET /files of a file from the snapshot -> bytes read"
            }
        }
    }
}

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Lifecycle operations (pause/resume, snapshots, from-snapshot, rollback, clone, memory snapshots) against a fresh gateway"
)]
struct Args {
    #[arg(value_enum)]
    op: Op,
    /// Timed samples per scenario.
    #[arg(long, default_value_t = 50)]
    samples: usize,
    /// Concurrency levels (pause-resume, snapshot, from-snapshot).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10])]
    concurrency: Vec<usize>,
    /// Megabytes written before a snapshot (snapshot-dirty, from-snapshot).
    #[arg(long, value_delimiter = ',', default_values_t = [0usize, 16, 100, 256, 1024])]
    dirty_mb: Vec<usize>,
    /// Megabytes of random bytes a process holds in its own (anonymous)
    /// memory (memory-snapshot): restored lazily, then again by a gateway
    /// told to restore eagerly.
    #[arg(long, value_delimiter = ',', default_values_t = [160usize, 384])]
    anon_mb: Vec<usize>,
    /// Clones per round (clone).
    #[arg(long, default_value_t = 100)]
    clones: u32,
    /// Parallel clone requests the clones are spread over (clone).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10, 20, 50])]
    clone_concurrency: Vec<usize>,
    /// SeaweedFS's `weed` (object-store), as scripts/seaweedfs installs it.
    #[arg(long, default_value = "/usr/local/bin/weed")]
    weed: PathBuf,
    #[command(flatten)]
    common: RigArgs,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = Run::begin(args.op.rig());
    args.common.bins.check()?;
    args.common.bins.build_template(Some("base"))?;
    let key = random_hex(16)?;
    // A 1 GiB snapshot needs a sandbox disk larger than the default quota.
    let gateway_args: Vec<String> = match args.op {
        Op::ObjectStore => vec!["--disk-mb".into(), "2048".into()],
        _ => Vec::new(),
    };
    let pools = ["base=0".to_string()];
    let gateway = Gateway::start_with(&args.common.bins, &key, &pools, "copse-rig-lifecycle", &[], &gateway_args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let api = Api { addr: gateway.addr, key };
    // Beside the gateway's data (the file system a node would use).
    let store = match args.op {
        Op::ObjectStore => Some(SeaweedFs::start(&args.weed, &args.common.bins.data_dir)?),
        _ => None,
    };
    let measured = runtime.block_on(measure(&args, &api, store.as_ref()));
    drop(store);
    let mut notes = Vec::new();
    gateway.stop(&mut notes);
    let mut scenarios = measured?;
    if args.op == Op::MemorySnapshot && !args.anon_mb.is_empty() {
        // The same holders once more, on a gateway whose restores are all
        // eager: the lazy restore's comparison on this host.
        let eager = [("COPSE_LAZY_PAGES", "off")];
        let gateway =
            Gateway::start_with(&args.common.bins, &api.key, &pools, "copse-rig-lifecycle", &eager, &gateway_args)?;
        let api = Api { addr: gateway.addr, key: api.key.clone() };
        let measured = runtime.block_on(held_memories(&args, &api, "eager"));
        gateway.stop(&mut notes);
        scenarios.extend(measured?);
    }
    let targets = targets(args.op, &scenarios);
    let params = json!({
        "op": args.op.rig(),
        "clock": args.op.clock(),
        "client": LEAN_CLIENT,
        "samples": args.samples,
        "concurrency": args.concurrency,
        "dirty_mb": args.dirty_mb,
        "anon_mb": (args.op == Op::MemorySnapshot).then_some(&args.anon_mb),
        "clones": args.clones,
        "clone_concurrency": args.clone_concurrency,
        "template": "base",
        "gateway_args": gateway_args,
        "object_store": (args.op == Op::ObjectStore).then(|| json!({
            "server": "SeaweedFS `weed server` (master, volume, filer, S3 gateway) on loopback, its files in the gateway's data dir",
            "data_dir_fs": copse_rigs::facts::data_dir_fs(&args.common.bins.data_dir),
            "weed": args.weed.display().to_string(),
            "weed_version": copse_rigs::facts::command_output(std::process::Command::new(&args.weed).arg("version")).map(|v| v.lines().next().unwrap_or("").to_string()),
        })),
    });
    let (path, result) =
        run.write(&args.common.out_dir, params, &args.common.bins, &scenarios, json!({}), targets, notes)?;
    for s in &scenarios {
        let line: Vec<String> = s
            .series
            .keys()
            .filter_map(|k| s.summary(k).map(|v| format!("{k} p50 {:.2} p95 {:.2}", v.p50, v.p95)))
            .collect();
        println!("{:<28} {}", s.name, line.join(" | "));
    }
    print_footer(&result, &path);
    Ok(())
}

/// The targets issue 5 sets for this 2-core machine.
fn targets(op: Op, scenarios: &[Scenario]) -> Value {
    let list: Vec<Value> = match op {
        Op::PauseResume => vec![
            p50_target(scenarios, "pause <= 5 ms p50", "pause-resume-memory-c1", "pause_ms", 5.0),
            p50_target(scenarios, "resume <= 5 ms p50", "pause-resume-memory-c1", "resume_ms", 5.0),
        ],
        Op::SnapshotDirty => {
            vec![p50_target(scenarios, "snapshot with 100 MB dirty <= 100 ms p50", "dirty-100mb", "snapshot_ms", 100.0)]
        }
        Op::FromSnapshot => scenarios
            .iter()
            .map(|s| p50_target(scenarios, "create from snapshot <= 20 ms p50, any size", &s.name, "create_ms", 20.0))
            .collect(),
        Op::Clone => scenarios
            .iter()
            .filter(|s| s.concurrency == 10)
            .map(|s| p50_target(scenarios, "clone of 100 <= 500 ms wall", &s.name, "wall_ms", 500.0))
            .collect(),
        Op::Snapshot | Op::Rollback | Op::MemorySnapshot | Op::ObjectStore => Vec::new(),
    };
    Value::Array(list)
}

async fn measure(args: &Args, api: &Api, store: Option<&SeaweedFs>) -> anyhow::Result<Vec<Scenario>> {
    let mut out = Vec::new();
    match args.op {
        Op::PauseResume => {
            for &cc in &args.concurrency {
                out.push(pause_resume(api, cc, args.samples, true).await?);
            }
            out.push(pause_resume(api, 1, args.samples.min(20), false).await?);
        }
        Op::Snapshot => {
            for &cc in &args.concurrency {
                out.push(snapshots(api, &format!("clean-c{cc}"), cc, args.samples, 0).await?);
            }
        }
        Op::SnapshotDirty => {
            for &mb in &args.dirty_mb {
                let n = if mb >= 256 { args.samples.min(5) } else { args.samples.min(20) };
                out.push(snapshots(api, &format!("dirty-{mb}mb"), 1, n, mb).await?);
            }
        }
        Op::FromSnapshot => {
            for &mb in &args.dirty_mb {
                for &cc in &args.concurrency {
                    out.push(from_snapshot(api, mb, cc, args.samples.min(30).max(cc)).await?);
                }
            }
        }
        Op::Rollback => out.push(rollback(api, args.samples.min(30)).await?),
        Op::Clone => {
            for &cc in &args.clone_concurrency {
                out.push(clone(api, args.clones, cc, 3).await?);
            }
        }
        Op::MemorySnapshot => {
            for &mb in &args.dirty_mb {
                out.push(memory_snapshot(api, mb, args.samples.min(20)).await?);
            }
            out.extend(held_memories(args, api, "lazy").await?);
        }
        Op::ObjectStore => {
            let store = store.context("the object store was not started")?;
            for &mb in &args.dirty_mb {
                let n = if mb >= 1024 { args.samples.min(3) } else { args.samples.min(10) };
                out.push(object_store(api, &args.common.bins, store, mb, n).await?);
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------- scenarios

async fn pause_resume(api: &Api, cc: usize, n: usize, memory: bool) -> anyhow::Result<Scenario> {
    let per_worker = n.div_ceil(cc);
    let workers = (0..cc).map(|_| async move {
        let mut conn = Conn::open(api.addr).await?;
        let sbx = api.create(&mut conn, "base").await?;
        let mut rows = Vec::new();
        for _ in 0..per_worker {
            let t0 = Instant::now();
            api.expect(
                &mut conn,
                Method::POST,
                &format!("/sandboxes/{}/pause", sbx.id),
                Some(json!({ "memory": memory })),
                StatusCode::NO_CONTENT,
            )
            .await?;
            let pause = ms(t0.elapsed());
            let t1 = Instant::now();
            api.expect(
                &mut conn,
                Method::POST,
                &format!("/v2/sandboxes/{}/connect", sbx.id),
                Some(json!({ "timeout": 600 })),
                StatusCode::CREATED,
            )
            .await?;
            let resume = ms(t1.elapsed());
            api.health(&mut conn, &sbx).await?;
            rows.push([pause, resume, ms(t1.elapsed())]);
        }
        api.delete(&mut conn, &sbx.id).await?;
        anyhow::Ok(rows)
    });
    let rows = collect(join_all(workers).await)?;
    let mode = if memory { "memory" } else { "filesystem" };
    Ok(Scenario::from_rows(
        &format!("pause-resume-{mode}-c{cc}"),
        cc,
        &["pause_ms", "resume_ms", "resume_to_health_ms"],
        &rows,
    ))
}

/// Snapshots of sandboxes with `mb` megabytes written since boot; each
/// snapshot is deleted again (timed separately) so disk use stays flat.
async fn snapshots(api: &Api, name: &str, cc: usize, n: usize, mb: usize) -> anyhow::Result<Scenario> {
    let per_worker = n.div_ceil(cc);
    let workers = (0..cc).map(|_| async move {
        let mut conn = Conn::open(api.addr).await?;
        let sbx = api.create(&mut conn, "base").await?;
        if mb > 0 {
            api.upload(&mut conn, &sbx, "/home/user/dirty.bin", filler(mb)).await?;
        }
        let mut rows = Vec::new();
        for _ in 0..per_worker {
            let t0 = Instant::now();
            let id = api.snapshot(&mut conn, &sbx.id).await?;
            let snapshot = ms(t0.elapsed());
            let t1 = Instant::now();
            api.expect(&mut conn, Method::DELETE, &format!("/templates/{id}"), None, StatusCode::NO_CONTENT).await?;
            rows.push([snapshot, ms(t1.elapsed())]);
        }
        api.delete(&mut conn, &sbx.id).await?;
        anyhow::Ok(rows)
    });
    let rows = collect(join_all(workers).await)?;
    let mut s = Scenario::from_rows(name, cc, &["snapshot_ms", "delete_ms"], &rows);
    s.counters.insert("dirty_mb".into(), json!(mb));
    Ok(s)
}

/// Sandboxes created from a snapshot with `mb` MB written before it was
/// taken, `cc` at a time (each worker on its own connection), each read
/// from once and killed.
async fn from_snapshot(api: &Api, mb: usize, cc: usize, n: usize) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(api.addr).await?;
    let source = api.create(&mut conn, "base").await?;
    if mb > 0 {
        api.upload(&mut conn, &source, "/home/user/dirty.bin", filler(mb)).await?;
    }
    api.upload(&mut conn, &source, "/home/user/marker", Bytes::from_static(b"from the snapshot")).await?;
    let snap = api.snapshot(&mut conn, &source.id).await?;
    api.delete(&mut conn, &source.id).await?;
    let per_worker = n.div_ceil(cc);
    let snap_ref = &snap;
    let workers = (0..cc).map(|_| async move {
        let mut conn = Conn::open(api.addr).await?;
        let mut rows = Vec::new();
        for _ in 0..per_worker {
            let (child, create, read) = api.create_and_read_marker(&mut conn, snap_ref, b"from the snapshot").await?;
            rows.push([create, read, create + read]);
            api.delete(&mut conn, &child.id).await?;
        }
        anyhow::Ok(rows)
    });
    let rows = collect(join_all(workers).await)?;
    api.expect(&mut conn, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
    // At concurrency 1 the name earlier results (and the site) use.
    let name = if cc == 1 { format!("from-{mb}mb") } else { format!("from-{mb}mb-c{cc}") };
    let mut s = Scenario::from_rows(&name, cc, &["create_ms", "first_read_ms", "total_ms"], &rows);
    s.counters.insert("snapshot_dirty_mb".into(), json!(mb));
    Ok(s)
}

/// `n` snapshots of `mb` MB (each of other bytes, so each push is cold)
/// through the object store and back; sandboxes and snapshots deleted.
async fn object_store(api: &Api, bins: &Binaries, store: &SeaweedFs, mb: usize, n: usize) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(api.addr).await?;
    let (mut rows, mut chunks, mut sent_chunks) = (Vec::new(), Vec::new(), Vec::new());
    for sample in 0..n {
        let source = api.create(&mut conn, "base").await?;
        if mb > 0 {
            let seed = ((mb as u64) << 32) | (sample as u64 + 1);
            api.upload(&mut conn, &source, "/home/user/dirty.bin", filler_seeded(mb, seed)).await?;
        }
        api.upload(&mut conn, &source, "/home/user/marker", Bytes::from_static(b"through the store")).await?;
        let snap = api.snapshot(&mut conn, &source.id).await?;
        api.delete(&mut conn, &source.id).await?;
        let (push, pushed) = snapshot_cli(bins, store, "push", &snap).await?;
        let (repush, repushed) = snapshot_cli(bins, store, "push", &snap).await?;
        if !repushed.contains("sent 0 new chunks") {
            bail!("an unchanged snapshot sent chunks again: {repushed}");
        }
        let counts = pushed_counts(&pushed).with_context(|| format!("unexpected push output: {pushed}"))?;
        chunks.push(counts.0);
        sent_chunks.push(counts.1);
        api.expect(&mut conn, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
        let (pull, _) = snapshot_cli(bins, store, "pull", &snap).await?;
        let (child, create, read) = api.create_and_read_marker(&mut conn, &snap, b"through the store").await?;
        rows.push([push, repush, pull, create, read]);
        api.delete(&mut conn, &child.id).await?;
        api.expect(&mut conn, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
    }
    let mut s = Scenario::from_rows(
        &format!("object-store-{mb}mb"),
        1,
        &["push_ms", "repush_ms", "pull_ms", "create_ms", "first_read_ms"],
        &rows,
    );
    s.counters.insert("snapshot_dirty_mb".into(), json!(mb));
    s.counters.insert("chunks".into(), json!(chunks));
    s.counters.insert("chunks_sent_by_first_push".into(), json!(sent_chunks));
    Ok(s)
}

/// `copse snapshot OP SNAP` beside the rig's gateway: (wall ms, stdout).
async fn snapshot_cli(bins: &Binaries, store: &SeaweedFs, op: &str, snap: &str) -> anyhow::Result<(f64, String)> {
    let t0 = Instant::now();
    let out = tokio::process::Command::new(&bins.copse)
        .args(["snapshot", op, snap, "--data-dir"])
        .arg(&bins.data_dir)
        .envs(store.env())
        .output()
        .await?;
    let took = ms(t0.elapsed());
    if !out.status.success() {
        bail!("copse snapshot {op} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((took, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// (chunks, new chunks) from `copse snapshot push`'s report line.
fn pushed_counts(out: &str) -> Option<(u64, u64)> {
    let line = out.lines().find(|l| l.starts_with("pushed snapshot"))?;
    let (_, rest) = line.split_once(": ")?;
    let chunks = rest.split_whitespace().next()?.parse().ok()?;
    let (_, sent) = rest.split_once("sent ")?;
    Some((chunks, sent.split_whitespace().next()?.parse().ok()?))
}

/// Memory snapshots of a sandbox holding `mb` MB in its `/dev/shm` (tmpfs:
/// memory the checkpoint must carry), each restored into a new sandbox
/// that then serves a file; snapshot and child are deleted (untimed).
async fn memory_snapshot(api: &Api, mb: usize, n: usize) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(api.addr).await?;
    let source = api.create(&mut conn, "base").await?;
    if mb > 0 {
        api.upload(&mut conn, &source, "/dev/shm/held.bin", filler(mb)).await?;
    }
    api.upload(&mut conn, &source, "/home/user/marker", Bytes::from_static(b"from the snapshot")).await?;
    let path = format!("/sandboxes/{}/snapshots", source.id);
    let mut rows = Vec::new();
    for _ in 0..n {
        let t0 = Instant::now();
        let snap =
            api.expect(&mut conn, Method::POST, &path, Some(json!({ "memory": true })), StatusCode::CREATED).await?;
        let snapshot = ms(t0.elapsed());
        let snap = snap["snapshotID"].as_str().context("no snapshotID")?.to_string();
        let (child, restore, read) = api.create_and_read_marker(&mut conn, &snap, b"from the snapshot").await?;
        rows.push([snapshot, restore, read]);
        api.delete(&mut conn, &child.id).await?;
        api.expect(&mut conn, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
    }
    api.delete(&mut conn, &source.id).await?;
    let mut s =
        Scenario::from_rows(&format!("memory-{mb}mb"), 1, &["snapshot_ms", "restore_ms", "first_read_ms"], &rows);
    s.counters.insert("shm_mb".into(), json!(mb));
    Ok(s)
}

/// [`held_memory`] for each of `--anon-mb`, named `how` the gateway
/// restores.
async fn held_memories(args: &Args, api: &Api, how: &str) -> anyhow::Result<Vec<Scenario>> {
    let mut out = Vec::new();
    for &mb in &args.anon_mb {
        out.push(held_memory(api, mb, args.samples.min(20), how).await?);
    }
    Ok(out)
}

/// A memory snapshot of a process holding `mb` MB of random bytes in its
/// own memory, restored `n` times: how soon each new sandbox is handed
/// over, and how long the process then takes to hash every byte it holds
/// (checked against the digest it had).
async fn held_memory(api: &Api, mb: usize, n: usize, how: &str) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(api.addr).await?;
    let source = api.create(&mut conn, "base").await?;
    let digest = holder::start(api, &source, mb).await?;
    let snap = holder::snapshot_memory(api, &mut conn, &source.id).await?;
    api.delete(&mut conn, &source.id).await?;
    let mut rows = Vec::new();
    for _ in 0..n {
        let (child, row) = holder::restore_and_touch(api, &mut conn, &snap, &digest).await?;
        rows.push(row);
        api.delete(&mut conn, &child.id).await?;
    }
    api.expect(&mut conn, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
    let mut s = Scenario::from_rows(&format!("held-{mb}mb-{how}"), 1, &["handover_ms", "touch_all_ms"], &rows);
    s.counters.insert("anon_mb".into(), json!(mb));
    s.counters.insert("restore".into(), json!(how));
    Ok(s)
}

async fn rollback(api: &Api, n: usize) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(api.addr).await?;
    let sbx = api.create(&mut conn, "base").await?;
    api.upload(&mut conn, &sbx, "/home/user/dirty.bin", filler(16)).await?;
    let snap = api.snapshot(&mut conn, &sbx.id).await?;
    let mut rows = Vec::new();
    for _ in 0..n {
        api.upload(&mut conn, &sbx, "/home/user/after", Bytes::from_static(b"written after the snapshot")).await?;
        let t0 = Instant::now();
        api.expect(
            &mut conn,
            Method::POST,
            &format!("/copse/sandboxes/{}/rollback", sbx.id),
            Some(json!({ "snapshotID": snap })),
            StatusCode::OK,
        )
        .await?;
        let rollback = ms(t0.elapsed());
        if api.read(&mut conn, &sbx, "/home/user/after").await.is_ok() {
            bail!("a file written after the snapshot survived the rollback");
        }
        rows.push([rollback]);
    }
    api.delete(&mut conn, &sbx.id).await?;
    api.expect(&mut conn, Method::DELETE, &format!("/templates/{snap}"), None, StatusCode::NO_CONTENT).await?;
    let mut s = Scenario::from_rows("rollback-16mb", 1, &["rollback_ms"], &rows);
    s.counters.insert("snapshot_dirty_mb".into(), json!(16));
    Ok(s)
}

/// `rounds` rounds of `total` clones spread over `cc` parallel requests;
/// the clones of a round are deleted (untimed) before the next.
async fn clone(api: &Api, total: u32, cc: usize, rounds: usize) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(api.addr).await?;
    let source = api.create(&mut conn, "base").await?;
    api.upload(&mut conn, &source, "/home/user/state", Bytes::from_static(b"cloned")).await?;
    let counts: Vec<u32> = (0..cc as u32).map(|i| total / cc as u32 + u32::from(i < total % cc as u32)).collect();
    let mut rows = Vec::new();
    let mut failures = 0;
    let mut errors = Vec::new();
    for _ in 0..rounds {
        let t0 = Instant::now();
        let path = format!("/copse/sandboxes/{}/clone", source.id);
        let path = path.as_str();
        let requests = counts.iter().filter(|c| **c > 0).map(|&count| async move {
            let mut conn = Conn::open(api.addr).await?;
            api.expect(
                &mut conn,
                Method::POST,
                path,
                Some(json!({ "count": count, "timeout": 600 })),
                StatusCode::CREATED,
            )
            .await
        });
        let answers = join_all(requests).await;
        let wall = ms(t0.elapsed());
        let mut ids = Vec::new();
        for answer in answers {
            match answer {
                Ok(children) => {
                    for child in children.as_array().cloned().unwrap_or_default() {
                        match child["sandbox"]["sandboxID"].as_str() {
                            Some(id) => ids.push(id.to_string()),
                            None => errors.push(format!("clone failed: {}", child["error"])),
                        }
                    }
                }
                Err(e) => errors.push(format!("clone request failed: {e:#}")),
            }
        }
        failures += total as usize - ids.len();
        rows.push([wall, wall / f64::from(total)]);
        for id in ids {
            api.delete(&mut conn, &id).await?;
        }
    }
    api.delete(&mut conn, &source.id).await?;
    let mut s = Scenario::from_rows(&format!("clone-{total}-c{cc}"), cc, &["wall_ms", "per_sandbox_ms"], &rows);
    s.counters.insert("clones_per_round".into(), json!(total));
    s.counters.insert("failed_clones".into(), json!(failures));
    // A round with failed clones still counts: its wall clock covers every
    // clone asked for, answered or not.
    s.errors = errors;
    Ok(s)
}

// ---------------------------------------------------------------- helpers

fn collect<T>(results: Vec<anyhow::Result<Vec<T>>>) -> anyhow::Result<Vec<T>> {
    let mut out = Vec::new();
    for r in results {
        out.extend(r?);
    }
    Ok(out)
}
