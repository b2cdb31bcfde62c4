//! `copse-rig-run-code`: time from `Sandbox.create()` (template
//! `code-interpreter-v1`) to the first `run_code("1+1")` result, with the
//! warm pool and without it, and the warm `run_code` round-trip, through a
//! lean Rust client and through the official `e2b-code-interpreter` SDK.
//! Starts its own gateways, writes one JSON result to `benchmarks/results/`
//! (see `benchmarks/schema.md`) and prints a table.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::bail;
use clap::Parser;
use copse_rigs::facts::random_hex;
use copse_rigs::gateway::zombie_notes;
use copse_rigs::report::{find, p50_difference, p50_target, pool_miss_counters, print_footer, server_timing};
use copse_rigs::run_code::{
    CREATE_BODY, Calls, EXECUTE_BODY, EXECUTE_BODY_JS, JUPYTER_PORT, TEMPLATE, execute, lean_create,
};
use copse_rigs::{Conn, Created, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, SdkRun, ms, round3};
use serde_json::{Value, json};

const RIG: &str = "run-code";
const LOG_PREFIX: &str = "copse-rig-run-code";

#[derive(Parser, Debug)]
#[command(version, about = "Sandbox.create() to first run_code result, and warm run_code round-trips")]
struct Args {
    /// Timed samples of the pooled create-to-first-result and of the warm round-trip scenarios.
    #[arg(long, default_value_t = 100)]
    samples: usize,
    /// Timed samples of the cold (pool 0) scenario; each boots a sandbox and starts a Python kernel.
    #[arg(long, default_value_t = 20)]
    cold_samples: usize,
    /// Untimed samples before the timed ones (connections, caches, SDK imports).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Untimed run_code calls on the round-trip sandbox before timing (the kernel's first executions).
    #[arg(long, default_value_t = 5)]
    roundtrip_warmup: usize,
    /// Warm pool size of `code-interpreter-v1` for the pooled scenarios.
    #[arg(long, default_value_t = 4)]
    pool: usize,
    /// Pause after each pooled sample so the pool refills; default: max(500, 1.5 x cold first-result p50) ms.
    #[arg(long)]
    pace_ms: Option<f64>,
    /// Wait for the pool to fill before the pooled scenarios; default: max(3 s, pool x 1.5 x cold first-result p50).
    #[arg(long)]
    pool_fill_wait_ms: Option<u64>,
    /// Skip the cold (pool 0) scenario.
    #[arg(long)]
    skip_cold: bool,
    #[command(flatten)]
    common: RigArgs,
    /// The SDK measurement script.
    #[arg(long, default_value = "rigs/sdk_run_code.py")]
    sdk_script: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = Run::begin(RIG);
    let key = random_hex(16)?;
    let mut notes: Vec<String> = Vec::new();
    let bins = &args.common.bins;
    bins.check()?;
    bins.build_template(Some(TEMPLATE))?;
    if !bins.pool_supported() {
        bail!("this gateway's `copse up --help` has no --pool option; the run-code claims are about the warm pool");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut scenarios: Vec<Scenario> = Vec::new();
    let mut children = serde_json::Map::new();

    let mut cold_p50 = None;
    if !args.skip_cold {
        let gw = Gateway::start(bins, &key, &[pool_spec(0)], LOG_PREFIX)?;
        eprintln!("== gateway (cold, pool 0) on {} (log {})", gw.addr, gw.log.display());
        eprintln!("-- lean-cold: {} samples", args.cold_samples);
        let sc = rt.block_on(lean_create(
            Calls { name: "lean-cold", body: EXECUTE_BODY },
            gw.addr,
            &key,
            0,
            args.cold_samples,
            args.warmup,
            None,
        ))?;
        cold_p50 = sc.p50("first_result_ms");
        scenarios.push(sc);
        children.insert("cold".into(), json!(gw.children()));
        gw.stop(&mut notes);
    }

    let cold_ref = cold_p50.unwrap_or(1500.0);
    let pace = args.pace_ms.unwrap_or((1.5 * cold_ref).max(500.0));
    // Round-trip scenarios wait this long after their own create's warm-up (the pool refills meanwhile).
    let settle = Duration::from_secs_f64(pace / 1000.0);
    let fill_wait =
        Duration::from_millis(args.pool_fill_wait_ms.unwrap_or(((args.pool as f64 * 1.5 * cold_ref) as u64).max(3000)));
    {
        let gw = Gateway::start(bins, &key, &[pool_spec(args.pool)], LOG_PREFIX)?;
        eprintln!(
            "== gateway (pool {}) on {} (log {}); pool fill wait {fill_wait:?}",
            args.pool,
            gw.addr,
            gw.log.display()
        );
        std::thread::sleep(fill_wait);
        for (create, roundtrip, body) in [
            ("lean-pooled", "lean-warm-roundtrip", EXECUTE_BODY),
            ("lean-pooled-js", "lean-warm-roundtrip-js", EXECUTE_BODY_JS),
        ] {
            eprintln!("-- {create}: {} samples, pace {pace:.0} ms", args.samples);
            let sc = rt.block_on(lean_create(
                Calls { name: create, body },
                gw.addr,
                &key,
                args.pool,
                args.samples,
                args.warmup,
                Some(pace),
            ))?;
            scenarios.push(sc);
            eprintln!("-- {roundtrip}: {} samples", args.samples);
            let sc = rt.block_on(lean_roundtrip(
                Calls { name: roundtrip, body },
                gw.addr,
                &key,
                args.pool,
                args.samples,
                args.roundtrip_warmup,
                settle,
            ))?;
            scenarios.push(sc);
        }
        if !args.common.skip_sdk {
            for (name, mode, pace_ms) in
                [("sdk-pooled", "create", Some(pace)), ("sdk-warm-roundtrip", "roundtrip", None::<f64>)]
            {
                std::thread::sleep(fill_wait.min(Duration::from_secs_f64(pace / 1000.0 * args.pool as f64)));
                eprintln!("-- {name}: {} samples", args.samples);
                let warmup = if mode == "roundtrip" { args.roundtrip_warmup } else { args.warmup };
                let script_args = [
                    "--mode".to_string(),
                    mode.into(),
                    "--samples".into(),
                    args.samples.to_string(),
                    "--warmup".into(),
                    warmup.to_string(),
                    "--pace-ms".into(),
                    pace_ms.unwrap_or(0.0).to_string(),
                    "--settle-ms".into(),
                    ms(settle).to_string(),
                ];
                let ok_metric = if mode == "roundtrip" { "roundtrip_ms" } else { "first_result_ms" };
                match SdkRun::run(&args.common.python, &args.sdk_script, &script_args, gw.addr, &key) {
                    Ok(r) => scenarios.push(r.into_scenario(name, ok_metric, Some(args.pool), pace_ms)),
                    Err(e) => notes.push(format!("SDK scenario {name} failed: {e:#}")),
                }
            }
        }
        children.insert("pooled".into(), json!(gw.children()));
        gw.stop(&mut notes);
    }

    notes.extend(zombie_notes(&children));
    notes.extend(observations(&scenarios));
    notes.extend(standing_notes());
    let derived = json!({
        "sdk_overhead_ms": sdk_overhead(&scenarios),
        "gateway_children_before_stop": children,
    });
    let python_p50 = |scenario: &str, metric: &str| find(&scenarios, scenario).and_then(|s| s.p50(metric));
    let twice = |scenario: &str, metric: &str| python_p50(scenario, metric).map_or(f64::NAN, |p| 2.0 * p);
    let targets = json!([
        p50_target(
            &scenarios,
            "JavaScript: create -> first result p50 within 2x of Python's (lean client)",
            "lean-pooled-js",
            "first_result_ms",
            twice("lean-pooled", "first_result_ms")
        ),
        p50_target(
            &scenarios,
            "JavaScript: warm round-trip p50 within 2x of Python's (lean client)",
            "lean-warm-roundtrip-js",
            "roundtrip_ms",
            twice("lean-warm-roundtrip", "roundtrip_ms")
        ),
        p50_target(
            &scenarios,
            "create -> first run_code result p50 <= 50 ms with the pool (lean client)",
            "lean-pooled",
            "first_result_ms",
            50.0
        ),
        p50_target(
            &scenarios,
            "create -> first run_code result p50 <= 50 ms with the pool (official SDK)",
            "sdk-pooled",
            "first_result_ms",
            50.0
        ),
        p50_target(
            &scenarios,
            "warm run_code round-trip p50 <= 5 ms (lean client)",
            "lean-warm-roundtrip",
            "roundtrip_ms",
            5.0
        ),
        p50_target(
            &scenarios,
            "warm run_code round-trip p50 <= 5 ms (official SDK)",
            "sdk-warm-roundtrip",
            "roundtrip_ms",
            5.0
        ),
    ]);
    let params = json!({
        "samples": args.samples,
        "cold_samples": if args.skip_cold { Value::Null } else { json!(args.cold_samples) },
        "warmup": args.warmup,
        "roundtrip_warmup": args.roundtrip_warmup,
        "template": TEMPLATE,
        "pool": args.pool,
        "pool_args": {"cold": pool_spec(0), "pooled": pool_spec(args.pool)},
        "pace_ms": round3(pace),
        "pool_fill_wait_ms": fill_wait.as_millis() as u64,
        "roundtrip_settle_ms": round3(ms(settle)),
        "create_body": serde_json::from_str::<Value>(CREATE_BODY)?,
        "execute_body": serde_json::from_str::<Value>(EXECUTE_BODY)?,
        "execute_body_js": serde_json::from_str::<Value>(EXECUTE_BODY_JS)?,
        "execute_headers": ["E2b-Sandbox-Id", format!("E2b-Sandbox-Port: {JUPYTER_PORT}"), "X-Access-Token", "Content-Type: application/json"],
        "lean_client": format!("copse-rig-run-code: {LEAN_CLIENT}"),
        "sdk": args.common.sdk_params(&args.sdk_script),
    });
    let (out, result) = run.write(&args.common.out_dir, params, bins, &scenarios, derived, targets, notes)?;
    print_table(&scenarios);
    print_footer(&result, &out);
    Ok(())
}

fn pool_spec(n: usize) -> String {
    format!("{TEMPLATE}={n}")
}

/// One sandbox, `n` sequential `run_code("1+1")` on one keep-alive connection.
/// `settle` is waited after the warm-up, so the pool's refill for the
/// sandbox this took is not booting while the round-trips are timed.
async fn lean_roundtrip(
    Calls { name, body }: Calls<'_>,
    addr: SocketAddr,
    key: &str,
    pool: usize,
    n: usize,
    warmup: usize,
    settle: Duration,
) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(addr).await?;
    let Created { id, token, server_timing: timing } = conn.create_sandbox(key, CREATE_BODY).await?;
    let (mut roundtrip, mut result, mut end, mut errors) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..warmup + n {
        if i == warmup {
            tokio::time::sleep(settle).await;
        }
        let t0 = Instant::now();
        match execute(&mut conn, &id, &token, body).await {
            Ok(x) if i >= warmup => {
                roundtrip.push(Some(ms(x.body_done_at - t0)));
                result.push(Some(ms(x.result_at - t0)));
                end.push(Some(ms(x.end_at - t0)));
            }
            Ok(_) => {}
            Err(e) => errors.push(format!("call {i} (warm-up: {}): {e:#}", i < warmup)),
        }
    }
    conn.delete_sandbox(key, &id).await?;
    let mut counters = serde_json::Map::new();
    counters.insert("ok".into(), json!(roundtrip.len()));
    counters.extend(pool_miss_counters(&[server_timing(&timing, "boot")]));
    let mut series = BTreeMap::new();
    series.insert("roundtrip_ms".into(), roundtrip);
    series.insert("result_ms".into(), result);
    series.insert("end_of_execution_ms".into(), end);
    Ok(Scenario {
        name: name.into(),
        client: "lean-rust".into(),
        concurrency: 1,
        pool: Some(pool),
        series,
        counters,
        errors,
        ..Scenario::default()
    })
}

// ---------------------------------------------------------------- results

fn sdk_overhead(scenarios: &[Scenario]) -> Value {
    let mut o = serde_json::Map::new();
    for (kind, sdk, lean, metrics) in [
        ("pooled", "sdk-pooled", "lean-pooled", &["first_result_ms", "create_ms"][..]),
        ("warm_roundtrip", "sdk-warm-roundtrip", "lean-warm-roundtrip", &["roundtrip_ms", "result_ms"][..]),
    ] {
        let (sdk, lean) = (find(scenarios, sdk), find(scenarios, lean));
        if sdk.is_none() || lean.is_none() {
            continue;
        }
        let m: serde_json::Map<String, Value> = metrics
            .iter()
            .map(|m| (format!("{}_p50", m.trim_end_matches("_ms")), p50_difference(sdk, lean, m)))
            .collect();
        o.insert(kind.into(), Value::Object(m));
    }
    Value::Object(o)
}

/// Facts of this run worth a sentence: pool misses, errors, slow outliers.
fn observations(scenarios: &[Scenario]) -> Vec<String> {
    let mut v = Vec::new();
    for s in scenarios {
        let misses = s.counters.get("pool_misses").and_then(Value::as_u64).unwrap_or(0);
        if s.pool.is_some_and(|p| p > 0) && misses > 0 {
            let known = s.counters.get("pool_miss_known").and_then(Value::as_u64).unwrap_or(0);
            v.push(format!("{}: {misses} of {known} creates missed the pool (Server-Timing boot > 1 ms)", s.name));
        }
        if !s.errors.is_empty() {
            v.push(format!("{}: {} failed samples; first: {}", s.name, s.errors.len(), s.errors[0]));
        }
    }
    v
}

fn standing_notes() -> Vec<String> {
    vec![
        "lean create scenarios: one sample = POST /v2/sandboxes {templateID: code-interpreter-v1} -> 201, then \
         POST /execute through the gateway (E2b-Sandbox-Id, E2b-Sandbox-Port 49999, X-Access-Token) with the SDK's \
         body for run_code(\"1+1\"). first_result_ms = client clock from sending the create request to receiving \
         the NDJSON line {type: result, is_main_result: true, text: \"2\"}; create_ms and execute_ms are its two \
         parts; execute_end_ms runs to the end_of_execution line. The stream is read to its end and the result \
         checked (text \"2\", no error line) before DELETE, which is untimed (delete_ms for information)."
            .into(),
        "lean-pooled: pace_ms pause after every sample (after DELETE) so the pool refills; counters.pool_misses \
         counts creates whose Server-Timing boot exceeded pool_miss_threshold_ms (a hit reports microseconds). \
         lean-cold runs against a gateway with --pool code-interpreter-v1=0, so every create boots a sandbox and \
         its first run_code waits for the Python kernel; it has fewer samples (cold_samples) because each takes \
         about a second or more."
            .into(),
        "lean-warm-roundtrip: one sandbox from the pool, roundtrip_warmup untimed run_code calls, then a pause of \
         params.roundtrip_settle_ms (so the pool's refill for this sandbox is not booting a kernel meanwhile), then \
         `samples` sequential POST /execute on the same keep-alive connection. roundtrip_ms = request sent -> response body \
         complete (what the SDK waits for); result_ms = request sent -> main result line; end_of_execution_ms = \
         request sent -> end_of_execution line."
            .into(),
        "sdk-pooled (rigs/sdk_run_code.py --mode create): Sandbox.create() then sbx.run_code(\"1+1\"); \
         first_result_ms = create call -> the SDK's on_result callback for the main result; total_ms = until \
         run_code returned; create_ms, run_code_ms its parts; kill_ms (untimed sbx.kill()). Pool misses are not \
         observable through the SDK (no access to Server-Timing); the same pace as lean-pooled is used. \
         sdk-warm-roundtrip (--mode roundtrip): one sandbox, the same warm-up and settle pause as \
         lean-warm-roundtrip, roundtrip_ms = run_code(\"1+1\") call -> return, \
         result_ms = call -> on_result callback. The SDK builds a new httpx.Client for every run_code call (HTTP/1.1 \
         transport from e2b's get_transport), so connection reuse across calls depends on that transport."
            .into(),
        "lean-pooled-js and lean-warm-roundtrip-js: the same two measurements with the body of \
         runCode(\"1+1\", {language: \"js\"}) (params.execute_body_js): the first JavaScript call of a sandbox \
         starts its Node.js kernel, so lean-pooled-js's first result includes that start; the targets compare \
         each with twice the Python p50 of the same run."
            .into(),
        "sdk_overhead_ms = SDK p50 - lean p50 of the same metric in the same gateway run (pooled: first_result and \
         create; warm_roundtrip: roundtrip and result)."
            .into(),
        "Client, gateway, the sandboxes' Python kernels and the pool's background refills share the host's cores."
            .into(),
    ]
}

fn print_table(scenarios: &[Scenario]) {
    println!(
        "{:<20} {:<20} {:>4} {:>9} {:>9} {:>9} {:>9} {:>7} {:>5}",
        "scenario", "metric", "n", "p50", "p95", "min", "max", "misses", "errs"
    );
    let metrics = [
        "first_result_ms",
        "create_ms",
        "execute_ms",
        "execute_end_ms",
        "run_code_ms",
        "server_boot_ms",
        "roundtrip_ms",
        "result_ms",
        "end_of_execution_ms",
    ];
    for s in scenarios {
        let misses = s
            .counters
            .get("pool_misses")
            .map(|m| format!("{}/{}", m, s.counters.get("pool_miss_known").unwrap_or(&json!(0))))
            .unwrap_or("-".into());
        for m in metrics {
            let Some(x) = s.summary(m) else { continue };
            println!(
                "{:<20} {:<20} {:>4} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>7} {:>5}",
                s.name,
                m,
                x.n,
                x.p50,
                x.p95,
                x.min,
                x.max,
                misses,
                s.errors.len()
            );
        }
    }
}
