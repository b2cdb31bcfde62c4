//! `copse-rig-template`: a team's own template, built and used. Times the
//! build of a small template from `base` (cold: nothing cached; cached: the
//! same definition rebuilt) through `copse template build --from-json`, the
//! create → first exec and create → first answer on its port of a template
//! with a start command, restored running from its memory snapshot and
//! booted, started and waited for on a gateway without memory snapshots, and
//! the code interpreter's create → first `run_code` result with no pool.
//! Starts its own gateways, writes one JSON result to `benchmarks/results/`
//! (see `benchmarks/schema.md`) and prints a table.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use copse_rigs::exec::first_exec;
use copse_rigs::facts::random_hex;
use copse_rigs::gateway::zombie_notes;
use copse_rigs::report::{p50_target, print_footer, server_timing_series};
use copse_rigs::run_code::{self, Calls, EXECUTE_BODY};
use copse_rigs::template::{
    CRIU_MISSING, READY_CMD, SERVE_PORT, START_CMD, create_body, definition, sandbox_host, write_context,
    write_definition,
};
use copse_rigs::{Conn, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, ms};
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use serde_json::{Value, json};

const RIG: &str = "template";
const LOG_PREFIX: &str = "copse-rig-template";
/// No pool on either gateway: every create of the code interpreter boots
/// (or restores) one, and no background refill competes with the samples.
const NO_POOL: &str = "code-interpreter-v1=0";

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Template build time (cold, cached), create of a running vs a booted template, code interpreter with no pool"
)]
struct Args {
    /// Timed builds per build scenario (cold, cached).
    #[arg(long, default_value_t = 10)]
    build_samples: usize,
    /// Timed creates per create scenario of the served template.
    #[arg(long, default_value_t = 30)]
    samples: usize,
    /// Timed creates of the code interpreter with no pool.
    #[arg(long, default_value_t = 20)]
    cold_samples: usize,
    /// Untimed samples before the timed ones of each scenario.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    #[command(flatten)]
    common: RigArgs,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = Run::begin(RIG);
    let key = random_hex(16)?;
    let nonce = random_hex(4)?;
    let mut notes: Vec<String> = Vec::new();
    let bins = &args.common.bins;
    bins.check()?;
    for t in ["base", run_code::TEMPLATE] {
        bins.build_template(Some(t))?;
    }
    let ctx = std::env::temp_dir().join(format!("copse-rig-template-{}", std::process::id()));
    write_context(&ctx)?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut scenarios: Vec<Scenario> = Vec::new();
    let mut children = serde_json::Map::new();
    let mut serve_builds = serde_json::Map::new();

    {
        let gw = Gateway::start(bins, &key, &[NO_POOL.into()], LOG_PREFIX)?;
        eprintln!("== gateway (memory snapshots) on {} (log {})", gw.addr, gw.log.display());
        let b = Builder { copse: &bins.copse, addr: gw.addr, key: &key, ctx: &ctx };
        eprintln!("-- build-cold: {} samples", args.build_samples);
        scenarios.push(b.cold(&rt, args.build_samples, args.warmup));
        eprintln!("-- build-cached: {} samples", args.build_samples);
        scenarios.push(b.cached(&rt, &format!("bench-cached-{nonce}"), &nonce, args.build_samples)?);

        let served = format!("bench-serve-{nonce}");
        serve_builds.insert("running".into(), json!(b.build_serving(&served, &nonce)?));
        served_scenarios(&rt, &mut scenarios, "running", gw.addr, &key, &served, &args)?;
        rt.block_on(delete_template(gw.addr, &key, &served))?;

        eprintln!("-- code-interpreter-cold: {} samples", args.cold_samples);
        let calls = Calls { name: "code-interpreter-cold", body: EXECUTE_BODY };
        scenarios.push(rt.block_on(run_code::lean_create(
            calls,
            gw.addr,
            &key,
            0,
            args.cold_samples,
            args.warmup,
            None,
        ))?);
        children.insert("memory".into(), json!(gw.children()));
        gw.stop(&mut notes);
    }
    {
        let env = [("COPSE_CRIU", CRIU_MISSING)];
        let gw = Gateway::start_with_env(bins, &key, &[NO_POOL.into()], LOG_PREFIX, &env)?;
        eprintln!("== gateway (no memory snapshots: COPSE_CRIU={CRIU_MISSING}) on {}", gw.addr);
        let b = Builder { copse: &bins.copse, addr: gw.addr, key: &key, ctx: &ctx };
        let served = format!("bench-boot-{nonce}");
        serve_builds.insert("boot".into(), json!(b.build_serving(&served, &nonce)?));
        served_scenarios(&rt, &mut scenarios, "boot", gw.addr, &key, &served, &args)?;
        rt.block_on(delete_template(gw.addr, &key, &served))?;
        children.insert("no_memory".into(), json!(gw.children()));
        gw.stop(&mut notes);
    }
    let _ = std::fs::remove_dir_all(&ctx);

    notes.extend(zombie_notes(&children));
    for s in &scenarios {
        if !s.errors.is_empty() {
            notes.push(format!("{}: {} failed samples; first: {}", s.name, s.errors.len(), s.errors[0]));
        }
    }
    notes.extend(standing_notes());
    let derived = json!({
        "serving_template_build_ms": serve_builds,
        "gateway_children_before_stop": children,
    });
    let targets = json!([
        p50_target(&scenarios, "cached rebuild of a small template <= 1 s (p50)", "build-cached", "build_ms", 1000.0),
        p50_target(
            &scenarios,
            "create -> first exec of a running template (restored from memory) p50 <= 150 ms",
            "running-exec",
            "total_ms",
            150.0
        ),
        p50_target(
            &scenarios,
            "code interpreter with no pool: create -> first run_code result p50 <= 250 ms",
            "code-interpreter-cold",
            "first_result_ms",
            250.0
        ),
    ]);
    let params = json!({
        "build_samples": args.build_samples,
        "samples": args.samples,
        "cold_samples": args.cold_samples,
        "warmup": args.warmup,
        "pool_args": [NO_POOL],
        "definition": definition("<nonce>", false),
        "serving": {"start_cmd": START_CMD, "ready_cmd": READY_CMD, "port": SERVE_PORT},
        "no_memory_gateway_env": {"COPSE_CRIU": CRIU_MISSING},
        "build_client": "copse template build --from-json FILE --name NAME --api-url URL --api-key KEY (the gateway's template API, the SDK's routes)",
        "lean_client": format!("copse-rig-template: {LEAN_CLIENT}"),
        "code_interpreter_create_body": serde_json::from_str::<Value>(run_code::CREATE_BODY)?,
        "execute_body": serde_json::from_str::<Value>(EXECUTE_BODY)?,
    });
    let (out, result) = run.write(&args.common.out_dir, params, bins, &scenarios, derived, targets, notes)?;
    print_table(&scenarios);
    print_footer(&result, &out);
    Ok(())
}

// ---------------------------------------------------------------- builds

/// Runs `copse template build --from-json` against one gateway.
struct Builder<'a> {
    copse: &'a Path,
    addr: SocketAddr,
    key: &'a str,
    ctx: &'a Path,
}

impl Builder<'_> {
    /// One build of `definition(nonce, serve)` named `name`: milliseconds
    /// from spawning the CLI to its successful exit.
    fn build(&self, name: &str, nonce: &str, serve: bool) -> anyhow::Result<f64> {
        let file = write_definition(self.ctx, name, nonce, serve)?;
        let t0 = Instant::now();
        let out = Command::new(self.copse)
            .args(["template", "build", "--from-json"])
            .arg(&file)
            .args(["--name", name, "--api-url", &format!("http://{}", self.addr), "--api-key", self.key])
            .stdin(Stdio::null())
            .output()
            .context("running copse template build")?;
        let took = ms(t0.elapsed());
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = err.lines().rev().take(5).collect();
            bail!("build of {name} exited {}: {}", out.status, tail.into_iter().rev().collect::<Vec<_>>().join(" / "));
        }
        Ok(took)
    }

    /// `n` builds (after `warmup` untimed ones), each of a fresh name and
    /// nonce, so no layer is cached; each template is deleted after (untimed).
    fn cold(&self, rt: &tokio::runtime::Runtime, n: usize, warmup: usize) -> Scenario {
        let (mut times, mut errors) = (Vec::new(), Vec::new());
        for i in 0..warmup + n {
            let result = random_hex(6).and_then(|nonce| {
                let name = format!("bench-cold-{nonce}");
                let took = self.build(&name, &nonce, false);
                let deleted = rt.block_on(delete_template(self.addr, self.key, &name));
                let took = took?;
                deleted?;
                Ok(took)
            });
            match result {
                Ok(t) if i >= warmup => times.push(Some(t)),
                Ok(_) => {}
                Err(e) => errors.push(format!("sample {i} (warm-up: {}): {e:#}", i < warmup)),
            }
        }
        build_scenario("build-cold", times, errors)
    }

    /// One untimed build of `name`, then `n` rebuilds of the same definition
    /// under the same name (every layer cached); the template is deleted after.
    fn cached(&self, rt: &tokio::runtime::Runtime, name: &str, nonce: &str, n: usize) -> anyhow::Result<Scenario> {
        let first = self.build(name, nonce, false).context("the first build of the cached scenario")?;
        let (mut times, mut errors) = (Vec::new(), Vec::new());
        for i in 0..n {
            match self.build(name, nonce, false) {
                Ok(t) => times.push(Some(t)),
                Err(e) => errors.push(format!("sample {i}: {e:#}")),
            }
        }
        rt.block_on(delete_template(self.addr, self.key, name))?;
        let mut sc = build_scenario("build-cached", times, errors);
        sc.counters.insert("first_build_ms".into(), json!(copse_rigs::round3(first)));
        Ok(sc)
    }

    /// Builds the served template (untimed for the targets; its time is reported in `derived`).
    fn build_serving(&self, name: &str, nonce: &str) -> anyhow::Result<f64> {
        eprintln!("-- building {name} (start command, ready command)");
        self.build(name, nonce, true).map(copse_rigs::round3)
    }
}

fn build_scenario(name: &str, times: Vec<Option<f64>>, errors: Vec<String>) -> Scenario {
    let mut sc = Scenario {
        name: name.into(),
        client: "copse template build --from-json".into(),
        concurrency: 1,
        errors,
        ..Scenario::default()
    };
    sc.counters.insert("ok".into(), json!(times.len()));
    sc.series.insert("build_ms".into(), times);
    sc
}

async fn delete_template(addr: SocketAddr, key: &str, name: &str) -> anyhow::Result<()> {
    let mut conn = Conn::open(addr).await?;
    let req =
        conn.request(Method::DELETE, &format!("/templates/{name}")).header("x-api-key", key).body(Full::default())?;
    let resp = conn.send(req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status != StatusCode::NO_CONTENT {
        bail!("delete template {name}: HTTP {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(())
}

// ---------------------------------------------------------------- creates

/// `<kind>-exec` and `<kind>-http` for the served template `template`.
fn served_scenarios(
    rt: &tokio::runtime::Runtime,
    scenarios: &mut Vec<Scenario>,
    kind: &str,
    addr: SocketAddr,
    key: &str,
    template: &str,
    args: &Args,
) -> anyhow::Result<()> {
    for probe in [Probe::Exec, Probe::Http] {
        let name = format!("{kind}-{}", probe.suffix());
        eprintln!("-- {name}: {} samples", args.samples);
        scenarios.push(rt.block_on(creates(&name, probe, addr, key, template, args.samples, args.warmup))?);
    }
    Ok(())
}

#[derive(Clone, Copy)]
enum Probe {
    /// `/bin/true` through the agent's process API.
    Exec,
    /// `GET /` on the start command's port through the gateway's data plane.
    Http,
}

impl Probe {
    fn suffix(self) -> &'static str {
        match self {
            Probe::Exec => "exec",
            Probe::Http => "http",
        }
    }
}

struct CreateSample {
    total_ms: f64,
    create_ms: f64,
    probe_ms: f64,
    /// GETs until the first 200 (1 when the server answered at once).
    attempts: usize,
    delete_ms: f64,
    server: Vec<(String, f64)>,
}

/// create → probe → (untimed) delete.
async fn one_create(conn: &mut Conn, key: &str, template: &str, probe: Probe) -> anyhow::Result<CreateSample> {
    let t0 = Instant::now();
    let created = conn.create_sandbox(key, create_body(template)).await?;
    let t_created = Instant::now();
    let probed = match probe {
        Probe::Exec => first_exec(conn, &created.id, &created.token).await.map(|(_, end)| (end, 1)),
        Probe::Http => first_answer(conn, &created.id).await,
    };
    let t_del = Instant::now();
    let deleted = conn.delete_sandbox(key, &created.id).await;
    let delete_ms = ms(t_del.elapsed());
    let (t_done, attempts) = probed?;
    deleted?;
    Ok(CreateSample {
        total_ms: ms(t_done - t0),
        create_ms: ms(t_created - t0),
        probe_ms: ms(t_done - t_created),
        attempts,
        delete_ms,
        server: created.server_timing,
    })
}

/// GETs `/` on the sandbox's `SERVE_PORT` through the gateway until a 200
/// (a 502 means nothing listens yet); the instant the 200's body was read.
async fn first_answer(conn: &mut Conn, id: &str) -> anyhow::Result<(Instant, usize)> {
    let host = sandbox_host(SERVE_PORT, id, conn_addr(conn)?);
    let deadline = Instant::now() + Duration::from_secs(30);
    for attempt in 1.. {
        let req = Request::builder()
            .method(Method::GET)
            .uri("/")
            .header(hyper::header::HOST, &host)
            .body(Full::<Bytes>::default())?;
        let resp = conn.send(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        match status {
            StatusCode::OK => return Ok((Instant::now(), attempt)),
            StatusCode::BAD_GATEWAY if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(2)).await,
            _ => bail!("GET / on port {SERVE_PORT}: HTTP {status}: {}", String::from_utf8_lossy(&body)),
        }
    }
    unreachable!("the loop returns or fails")
}

fn conn_addr(conn: &Conn) -> anyhow::Result<SocketAddr> {
    conn.host().parse().context("the connection's address")
}

async fn creates(
    name: &str,
    probe: Probe,
    addr: SocketAddr,
    key: &str,
    template: &str,
    n: usize,
    warmup: usize,
) -> anyhow::Result<Scenario> {
    let mut conn = Conn::open(addr).await?;
    let (mut samples, mut errors) = (Vec::new(), Vec::new());
    for i in 0..warmup + n {
        match one_create(&mut conn, key, template, probe).await {
            Ok(s) if i >= warmup => samples.push(s),
            Ok(_) => {}
            Err(e) => errors.push(format!("sample {i} (warm-up: {}): {e:#}", i < warmup)),
        }
    }
    let col = |f: &dyn Fn(&CreateSample) -> f64| samples.iter().map(|s| Some(f(s))).collect::<Vec<_>>();
    let (total, part) = match probe {
        Probe::Exec => ("total_ms", "exec_ms"),
        Probe::Http => ("first_http_ms", "http_ms"),
    };
    let mut series = BTreeMap::new();
    series.insert(total.into(), col(&|s| s.total_ms));
    series.insert("create_ms".into(), col(&|s| s.create_ms));
    series.insert(part.into(), col(&|s| s.probe_ms));
    series.insert("delete_ms".into(), col(&|s| s.delete_ms));
    series.extend(server_timing_series(&samples.iter().map(|s| s.server.clone()).collect::<Vec<_>>()));
    let mut counters = serde_json::Map::new();
    counters.insert("ok".into(), json!(samples.len()));
    if let Probe::Http = probe {
        counters.insert("http_attempts_max".into(), json!(samples.iter().map(|s| s.attempts).max().unwrap_or(0)));
    }
    Ok(Scenario {
        name: name.into(),
        client: "lean-rust".into(),
        concurrency: 1,
        pool: Some(0),
        series,
        counters,
        errors,
        ..Scenario::default()
    })
}

// ---------------------------------------------------------------- results

fn standing_notes() -> Vec<String> {
    vec![
        "build-cold and build-cached: one sample = `copse template build --from-json FILE --name NAME` run against \
         the rig's gateway (the same template API routes the SDK's Template.build uses: POST /v3/templates, the \
         COPY upload link, POST /v2/templates/{id}/builds/{build}, then the status poll), timed from spawning the \
         CLI to its successful exit. The CLI polls the build's status every 200 ms (the SDK's rate), so a build is \
         seen up to 200 ms after it ends: build_ms includes that wait, as a user of the CLI or SDK waits it. \
         The definition (params.definition) is base + RUN writing a file + ENV + COPY of a two-file dir. \
         build-cold uses a fresh template name and a fresh nonce in the RUN step per sample, so no layer is in the \
         build cache; the template is deleted after each sample (untimed). build-cached builds one definition \
         once (counters.first_build_ms), then rebuilds it under the same name `build_samples` times."
            .into(),
        "running-* and boot-*: the same served template (params.serving: a start command serving the copied dir on \
         port 8080, a ready command probing it). running-* is built and created on a gateway with memory \
         snapshots, so each create restores the start command's process running; boot-* is built and created on \
         a gateway whose COPSE_CRIU names a missing binary (params.no_memory_gateway_env), so each create boots \
         the sandbox, runs the start command and waits for the ready command. *-exec: total_ms = create request \
         sent -> `end` event of /bin/true through the agent's process API (as create-latency), exec_ms its part \
         after the create response. *-http: first_http_ms = create request sent -> the first 200 to GET / on \
         8080-<id> through the gateway's host routing (502s, nothing listening yet, are retried every 2 ms; \
         counters.http_attempts_max), http_ms its part after the create response. Delete is untimed."
            .into(),
        "code-interpreter-cold: copse-rig-run-code's lean create scenario (rigs/src/run_code.rs, called, not \
         copied) against the first gateway, which has --pool code-interpreter-v1=0: POST /v2/sandboxes \
         {templateID: code-interpreter-v1} -> first main result of run_code(\"1+1\")."
            .into(),
        "Neither gateway keeps a pool (--pool code-interpreter-v1=0), so no background refill competes with the \
         samples; client, gateway and sandboxes share the host's cores."
            .into(),
    ]
}

fn print_table(scenarios: &[Scenario]) {
    println!(
        "{:<24} {:<16} {:>4} {:>9} {:>9} {:>9} {:>9} {:>5}",
        "scenario", "metric", "n", "p50", "p95", "min", "max", "errs"
    );
    let metrics = ["build_ms", "total_ms", "first_http_ms", "first_result_ms", "create_ms"];
    for s in scenarios {
        for m in metrics {
            let Some(x) = s.summary(m) else { continue };
            println!(
                "{:<24} {:<16} {:>4} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>5}",
                s.name,
                m,
                x.n,
                x.p50,
                x.p95,
                x.min,
                x.max,
                s.errors.len()
            );
        }
    }
}
