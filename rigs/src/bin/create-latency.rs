//! `copse-rig-create`: time from `POST /v2/sandboxes` to the completion of
//! the first command in the new sandbox, through a lean Rust client speaking
//! the E2B wire protocol and through the official Python SDK. Starts its own
//! gateway, writes one JSON result to `benchmarks/results/` (see
//! `benchmarks/schema.md`) and prints a short table.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;

use copse_rigs::anchors;
use copse_rigs::exec::{first_exec, true_command};
use copse_rigs::facts::random_hex;
use copse_rigs::gateway::zombie_notes;
use copse_rigs::report::{
    find, p50_difference, p50_target, pool_miss_counters, print_footer, server_timing, server_timing_series,
};
use copse_rigs::{Conn, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, SdkRun, ms, round3};

use serde_json::{Value, json};

const RIG: &str = "create-latency";
const CREATE_BODY: &str = r#"{"templateID":"base","metadata":{},"envVars":{}}"#;

#[derive(Parser, Debug)]
#[command(version, about = "Create-to-first-exec latency: lean client and official SDK against a fresh gateway")]
struct Args {
    /// Timed samples per scenario (at concurrency > 1, spread over the workers).
    #[arg(long, default_value_t = 100)]
    samples: usize,
    /// Concurrency levels to run; each worker has its own keep-alive connection.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10, 20, 50])]
    concurrency: Vec<usize>,
    /// Untimed samples each worker runs before the timed ones (connection set-up, caches).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Warm pool size for the warm scenarios (should be >= the highest concurrency).
    #[arg(long, default_value_t = 52)]
    warm_pool: usize,
    /// Pause per worker after each warm sample so the pool can refill; default: 2 x concurrency x cold create p50.
    #[arg(long)]
    warm_pace_ms: Option<f64>,
    /// Wait after the warm-up before timing a warm scenario; default: max(2 s, 3 x pool x cold create p50).
    #[arg(long)]
    pool_fill_wait_ms: Option<u64>,
    #[command(flatten)]
    common: RigArgs,
    /// The SDK measurement script.
    #[arg(long, default_value = "rigs/sdk_create_latency.py")]
    sdk_script: PathBuf,
    /// Skip the anchors (fork+exec, unshare, podman) measured beside copse.
    #[arg(long)]
    skip_anchors: bool,
    /// Samples per concurrency tier for the runc and podman anchors (each takes tens to hundreds of ms).
    #[arg(long, default_value_t = 40)]
    container_samples: usize,
}

/// One lean-client sample.
#[derive(Debug, Clone)]
struct Sample {
    total_ms: f64,
    create_ms: f64,
    exec_ms: f64,
    /// Start request sent → `start` event received.
    exec_start_event_ms: f64,
    delete_ms: f64,
    server: Vec<(String, f64)>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = Run::begin(RIG);
    let api_key = random_hex(16)?;
    let mut notes: Vec<String> = Vec::new();
    let bins = &args.common.bins;
    bins.check()?;

    // Templates first (idempotent; the first run on a data dir builds `base` with progress).
    bins.build_template(None)?;
    let pool_supported = bins.pool_supported();

    let mut scenarios: Vec<Scenario> = Vec::new();
    let mut gateway_children = serde_json::Map::new();
    if !args.skip_anchors {
        let rootfs = bins.data_dir.join("templates/base/rootfs");
        let bundle = std::env::temp_dir().join(format!("copse-rig-create-runc-{}", std::process::id()));
        let mut containers = anchors::containers_available(&mut notes);
        if containers && let Err(e) = anchors::runc_bundle(&bundle, &rootfs) {
            notes.push(format!("container anchors skipped: {e:#}"));
            containers = false;
        }
        for &cc in &args.concurrency {
            for anchor in anchors::Anchor::ALL {
                if anchor.is_container() && !containers {
                    continue;
                }
                let n = if anchor.is_container() { args.container_samples } else { args.samples };
                eprintln!("== anchor {} cc{cc}: {n} samples", anchor.metric());
                scenarios.push(anchors::measure(anchor, cc, n, &rootfs, &bundle));
            }
        }
        let _ = std::fs::remove_dir_all(&bundle);
    }

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    // Cold: no pool.
    let mut cold_create_p50 = None;
    {
        let gw = Gateway::start(bins, &api_key, &pool_args(pool_supported.then_some(0)), "copse-rig-create")?;
        eprintln!("== gateway (cold, pool 0) on {} (log {})", gw.addr, gw.log.display());
        for &cc in &args.concurrency {
            let name = format!("lean-cold-cc{cc}");
            eprintln!("-- {name}: {} samples", args.samples);
            let sc = rt.block_on(lean(&name, gw.addr, &api_key, cc, args.samples, args.warmup, None, None))?;
            if cc == 1 {
                cold_create_p50 = sc.p50("create_ms");
            }
            scenarios.push(sc);
        }
        if cold_create_p50.is_none() {
            cold_create_p50 = scenarios.iter().rev().find_map(|s| s.p50("create_ms"));
        }
        if !args.common.skip_sdk {
            eprintln!("-- sdk-cold-cc1: {} samples", args.samples);
            match sdk(&args, gw.addr, &api_key, "sdk-cold-cc1", None, None) {
                Ok(sc) => scenarios.push(sc),
                Err(e) => notes.push(format!("SDK cold measurement failed: {e:#}")),
            }
        }
        let kids = gw.children();
        gateway_children.insert("cold".into(), json!(kids));
        gw.stop(&mut notes);
    }

    // Warm: pool sized for the highest concurrency.
    let cold_ref = cold_create_p50.unwrap_or(50.0);
    let fill_wait = Duration::from_millis(
        args.pool_fill_wait_ms.unwrap_or(((3.0 * args.warm_pool as f64 * cold_ref) as u64).max(2000)),
    );
    let mut warm_paces = BTreeMap::new();
    if pool_supported {
        let gw = Gateway::start(bins, &api_key, &pool_args(Some(args.warm_pool)), "copse-rig-create")?;
        eprintln!("== gateway (warm, pool {}) on {} (log {})", args.warm_pool, gw.addr, gw.log.display());
        for &cc in &args.concurrency {
            let pace = args.warm_pace_ms.unwrap_or((2.0 * cc as f64 * cold_ref).max(5.0));
            warm_paces.insert(cc, pace);
            let name = format!("lean-warm-cc{cc}");
            eprintln!("-- {name}: {} samples, pace {pace:.1} ms/worker, fill wait {fill_wait:?}", args.samples);
            let mut sc = rt.block_on(lean(
                &name,
                gw.addr,
                &api_key,
                cc,
                args.samples,
                args.warmup,
                Some(pace),
                Some(fill_wait),
            ))?;
            sc.pool = Some(args.warm_pool);
            scenarios.push(sc);
        }
        if !args.common.skip_sdk {
            let pace = warm_paces.get(&1).copied().unwrap_or((2.0 * cold_ref).max(5.0));
            eprintln!("-- sdk-warm-cc1: {} samples, pace {pace:.1} ms", args.samples);
            std::thread::sleep(fill_wait);
            match sdk(&args, gw.addr, &api_key, "sdk-warm-cc1", Some(args.warm_pool), Some(pace)) {
                Ok(sc) => scenarios.push(sc),
                Err(e) => notes.push(format!("SDK warm measurement failed: {e:#}")),
            }
        }
        let kids = gw.children();
        gateway_children.insert("warm".into(), json!(kids));
        gw.stop(&mut notes);
    } else {
        notes.push(
            "warm scenarios skipped: this gateway's `copse up --help` has no --pool option (warm pool not available)"
                .into(),
        );
    }

    let mut derived = derive(&scenarios, &mut notes);
    notes.extend(zombie_notes(&gateway_children));
    derived["gateway_children_before_stop"] = Value::Object(gateway_children);
    let targets = targets(&scenarios, &mut notes);
    notes.extend(standing_notes(pool_supported));

    let paces: serde_json::Map<String, Value> =
        warm_paces.iter().map(|(cc, p)| (format!("cc{cc}"), json!(round3(*p)))).collect();
    let params = json!({
        "samples": args.samples,
        "concurrency": args.concurrency,
        "warmup_per_worker": args.warmup,
        "template": "base",
        "create_body": serde_json::from_str::<Value>(CREATE_BODY)?,
        "first_exec": serde_json::to_value(true_command())?,
        "warm_pool": pool_supported.then_some(args.warm_pool),
        "warm_pace_ms": paces,
        "pool_fill_wait_ms": fill_wait.as_millis() as u64,
        "pool_option_supported": pool_supported,
        "lean_client": format!("copse-rig-create: {LEAN_CLIENT}"),
        "sdk": args.common.sdk_params(&args.sdk_script),
    });
    let (out, result) = run.write(&args.common.out_dir, params, bins, &scenarios, derived, targets, notes)?;
    print_table(&scenarios);
    print_footer(&result, &out);
    Ok(())
}

/// `--pool` values for a pool of `n` `base` sandboxes (none: the gateway's default).
fn pool_args(n: Option<usize>) -> Vec<String> {
    n.map(|n| n.to_string()).into_iter().collect()
}

// ---------------------------------------------------------------- lean client

/// create → first exec → delete; only the first two are timed.
async fn one_sample(conn: &mut Conn, key: &str) -> anyhow::Result<Sample> {
    let t0 = Instant::now();
    let created = conn.create_sandbox(key, CREATE_BODY).await?;
    let t_created = Instant::now();
    let exec = first_exec(conn, &created.id, &created.token).await;
    let t_del = Instant::now();
    let deleted = conn.delete_sandbox(key, &created.id).await;
    let delete_ms = ms(t_del.elapsed());
    let (t_start_event, t_done) = exec?;
    deleted?;
    Ok(Sample {
        total_ms: ms(t_done - t0),
        create_ms: ms(t_created - t0),
        exec_ms: ms(t_done - t_created),
        exec_start_event_ms: ms(t_start_event - t_created),
        delete_ms,
        server: created.server_timing,
    })
}

#[allow(clippy::too_many_arguments)]
async fn lean(
    name: &str,
    addr: SocketAddr,
    key: &str,
    cc: usize,
    n: usize,
    warmup: usize,
    pace_ms: Option<f64>,
    fill_wait: Option<Duration>,
) -> anyhow::Result<Scenario> {
    let next = Arc::new(AtomicUsize::new(0));
    let warmed = Arc::new(tokio::sync::Barrier::new(cc + 1));
    let go = Arc::new(tokio::sync::Barrier::new(cc + 1));
    let mut tasks = Vec::new();
    for _ in 0..cc {
        let (next, warmed, go, key) = (next.clone(), warmed.clone(), go.clone(), key.to_string());
        tasks.push(tokio::spawn(async move {
            let mut out: Vec<Result<Sample, String>> = Vec::new();
            let mut conn = match Conn::open(addr).await {
                Ok(c) => Some(c),
                Err(e) => {
                    out.push(Err(format!("connect: {e:#}")));
                    None
                }
            };
            for _ in 0..warmup {
                if let Some(c) = conn.as_mut() {
                    let _ = one_sample(c, &key).await;
                }
            }
            warmed.wait().await;
            go.wait().await;
            let Some(mut conn) = conn else { return out };
            while next.fetch_add(1, Ordering::SeqCst) < n {
                out.push(one_sample(&mut conn, &key).await.map_err(|e| format!("{e:#}")));
                if let Some(p) = pace_ms {
                    tokio::time::sleep(Duration::from_secs_f64(p / 1000.0)).await;
                }
            }
            out
        }));
    }
    warmed.wait().await;
    if let Some(w) = fill_wait {
        tokio::time::sleep(w).await;
    }
    go.wait().await;
    let t0 = Instant::now();
    let mut samples = Vec::new();
    let mut errors = Vec::new();
    for t in tasks {
        for r in t.await? {
            match r {
                Ok(s) => samples.push(s),
                Err(e) => errors.push(e),
            }
        }
    }
    // Includes the pace sleeps of pooled scenarios: their throughput is the
    // paced rate, not the gateway's ceiling.
    let wall_ms = ms(t0.elapsed());
    let mut series: BTreeMap<String, Vec<Option<f64>>> = BTreeMap::new();
    let col = |f: &dyn Fn(&Sample) -> Option<f64>| samples.iter().map(f).collect::<Vec<_>>();
    series.insert("total_ms".into(), col(&|s| Some(s.total_ms)));
    series.insert("create_ms".into(), col(&|s| Some(s.create_ms)));
    series.insert("exec_ms".into(), col(&|s| Some(s.exec_ms)));
    series.insert("exec_start_event_ms".into(), col(&|s| Some(s.exec_start_event_ms)));
    series.insert("delete_ms".into(), col(&|s| Some(s.delete_ms)));
    series.extend(server_timing_series(&samples.iter().map(|s| s.server.clone()).collect::<Vec<_>>()));
    series.insert("api_overhead_ms".into(), col(&|s| server_timing(&s.server, "total").map(|t| s.create_ms - t)));
    let mut counters = serde_json::Map::new();
    counters.insert("ok".into(), json!(samples.len()));
    counters.insert("with_server_timing".into(), json!(samples.iter().filter(|s| !s.server.is_empty()).count()));
    if pace_ms.is_some() {
        counters.extend(pool_miss_counters(series.get("server_boot_ms").map_or(&[][..], Vec::as_slice)));
    }
    Ok(Scenario {
        name: name.into(),
        client: "lean-rust".into(),
        concurrency: cc,
        pool: Some(0),
        pace_ms,
        wall_ms: Some(wall_ms),
        series,
        counters,
        errors,
    })
}

// ---------------------------------------------------------------- SDK

fn sdk(
    args: &Args,
    addr: SocketAddr,
    key: &str,
    name: &str,
    pool: Option<usize>,
    pace_ms: Option<f64>,
) -> anyhow::Result<Scenario> {
    let script_args = [
        "--samples".to_string(),
        args.samples.to_string(),
        "--warmup".into(),
        args.warmup.to_string(),
        "--pace-ms".into(),
        pace_ms.unwrap_or(0.0).to_string(),
    ];
    let run = SdkRun::run(&args.common.python, &args.sdk_script, &script_args, addr, key)?;
    Ok(run.into_scenario(name, "total_ms", Some(pool.unwrap_or(0)), pace_ms))
}

// ---------------------------------------------------------------- results

fn derive(scenarios: &[Scenario], notes: &mut Vec<String>) -> Value {
    let mut overhead = serde_json::Map::new();
    for kind in ["cold", "warm"] {
        let (Some(sdk), Some(lean)) =
            (find(scenarios, &format!("sdk-{kind}-cc1")), find(scenarios, &format!("lean-{kind}-cc1")))
        else {
            continue;
        };
        let d = |m: &str| p50_difference(Some(sdk), Some(lean), m);
        overhead.insert(
            kind.into(),
            json!({"total_p50": d("total_ms"), "create_p50": d("create_ms"), "exec_p50": d("exec_ms")}),
        );
    }
    if !overhead.is_empty() {
        notes.push(
            "sdk_overhead_ms = SDK scenario p50 - lean scenario p50 (cc=1, same gateway run). The SDK's \
             commands.run(\"true\") starts `/bin/bash -l -c true` where the lean client starts /bin/true, so \
             exec_p50 overhead includes a login bash; create_p50 compares identical requests."
                .into(),
        );
    }
    json!({ "sdk_overhead_ms": overhead, "ratio_p50": ratios(scenarios) })
}

/// copse total_ms p50 ÷ anchor p50 at each tier: `ratio_p50.cc10.cold_vs_podman`.
fn ratios(scenarios: &[Scenario]) -> Value {
    let mut out = serde_json::Map::new();
    for s in scenarios.iter().filter(|s| s.name.starts_with("lean-")) {
        let Some((kind, cc)) = s.name.strip_prefix("lean-").and_then(|r| r.split_once("-cc")) else { continue };
        let Some(copse) = s.p50("total_ms") else { continue };
        for anchor in anchors::Anchor::ALL {
            let Some(a) =
                find(scenarios, &anchor.scenario_name(cc.parse().unwrap_or(0))).and_then(|a| a.p50(anchor.metric()))
            else {
                continue;
            };
            let key = format!("{kind}_vs_{}", anchor.metric().trim_end_matches("_ms"));
            let tier = out.entry(format!("cc{cc}")).or_insert_with(|| json!({}));
            tier[key] = json!(round3(copse / a));
        }
    }
    Value::Object(out)
}

fn targets(scenarios: &[Scenario], notes: &mut Vec<String>) -> Value {
    let cold = p50_target(
        scenarios,
        "cold substrate part (server boot) p50 <= 15 ms",
        "lean-cold-cc1",
        "server_boot_ms",
        15.0,
    );
    if cold["value_ms"].is_null() {
        notes.push(
            "cold substrate target not evaluated: the gateway sent no Server-Timing `boot` metric, so the \
             substrate share of create_ms is unknown"
                .into(),
        );
    }
    let warm = p50_target(scenarios, "warm create+first-exec p50 <= 3 ms", "lean-warm-cc1", "total_ms", 3.0);
    // The gateway's own measure of its team lookup, rate and quota checks.
    let tenancy = p50_target(
        scenarios,
        "tenancy checks (key -> team, rate, quotas) p50 <= 0.2 ms per create",
        "lean-warm-cc1",
        "server_tenancy_ms",
        0.2,
    );
    json!([cold, warm, tenancy])
}

fn standing_notes(pool_supported: bool) -> Vec<String> {
    let mut v = vec![
        "total_ms = client clock from sending POST /v2/sandboxes to receiving the `end` event of Process/Start \
         for /bin/true; create_ms and exec_ms are its two parts. DELETE is untimed (delete_ms recorded for \
         information); the end-of-stream envelope after `end` is not waited for."
            .into(),
        "server_*_ms come from the create response's Server-Timing header (parsed generically); api_overhead_ms = \
         create_ms - server_total_ms (HTTP, JSON, routing and client time outside the server's own total)."
            .into(),
        "Client and gateway share the same cores; at cc=10 on a 2-core host the samples queue on the CPU, so \
         cc=10 latency measures throughput pressure, not per-request cost."
            .into(),
        "anchors run on the same host in the same run, before the gateways start, at the same concurrency \
         tiers: anchor-fork-exec (spawn+wait of /bin/true), anchor-unshare (util-linux unshare with copse's six \
         namespaces and --fork: two forks, two execs; an upper bound of the namespace cost), anchor-runc (`runc run` \
         of a bundle over the base template's rootfs, read-only, copse's six namespaces: create+exec+delete by \
         the OCI runtime alone), anchor-podman (podman run --rm on runc over the same rootfs as an overlay, no \
         network). Debian's crun refuses this host's hybrid cgroup layout, hence runc. \
         derived.ratio_p50 = copse lean total_ms p50 ÷ anchor p50 at the same tier."
            .into(),
        "wall_ms: the scenario's first timed sample started → its last finished, all workers together; \
         throughput_per_s = samples ÷ wall, amortized_ms = wall ÷ samples (the CubeSandbox report's per-sandbox \
         figure). Warm scenarios' wall includes the workers' pace sleeps, so their throughput is the paced rate."
            .into(),
    ];
    if pool_supported {
        v.push(
            "warm scenarios: each worker sleeps pace_ms after each sample's DELETE so the pool can refill; \
             counters.pool_misses counts samples whose Server-Timing boot exceeded pool_miss_threshold_ms (a pool \
             hit reports boot of a few microseconds, a real boot several milliseconds), out of \
             counters.pool_miss_known samples that carried a boot metric."
                .into(),
        );
    }
    v
}

fn print_table(scenarios: &[Scenario]) {
    let f = |s: &Scenario, m: &str, p95: bool| {
        s.summary(m).map_or("-".to_string(), |x| format!("{:.2}", if p95 { x.p95 } else { x.p50 }))
    };
    println!(
        "{:<16} {:>4} {:>4} {:>9} {:>9} {:>10} {:>9} {:>9} {:>10} {:>6} {:>5}",
        "scenario",
        "cc",
        "n",
        "total p50",
        "total p95",
        "create p50",
        "exec p50",
        "boot p50",
        "api_ovh50",
        "misses",
        "errs"
    );
    for s in scenarios {
        if s.name.starts_with("anchor-") {
            if let Some((m, x)) = s.series.keys().next().and_then(|m| Some((m, s.summary(m)?))) {
                println!("{} {m}: p50 {:.3} ms, p95 {:.3} ms (n {})", s.name, x.p50, x.p95, x.n);
            }
            continue;
        }
        let n = s.series.get("total_ms").map_or(0, |v| v.iter().flatten().count());
        let misses = s
            .counters
            .get("pool_misses")
            .map(|m| format!("{}/{}", m, s.counters.get("pool_miss_known").unwrap_or(&json!(0))))
            .unwrap_or("-".into());
        println!(
            "{:<16} {:>4} {:>4} {:>9} {:>9} {:>10} {:>9} {:>9} {:>10} {:>6} {:>5}",
            s.name,
            s.concurrency,
            n,
            f(s, "total_ms", false),
            f(s, "total_ms", true),
            f(s, "create_ms", false),
            f(s, "exec_ms", false),
            f(s, "server_boot_ms", false),
            f(s, "api_overhead_ms", false),
            misses,
            s.errors.len()
        );
    }
}
