//! `copse-rig-create`: time from `POST /v2/sandboxes` to the completion of
//! the first command in the new sandbox, through a lean Rust client speaking
//! the E2B wire protocol and through the official Python SDK. Starts its own
//! gateway, writes one JSON result to `benchmarks/results/` (see
//! `benchmarks/schema.md`) and prints a short table.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use copse_rig_create::{EnvelopeDecoder, StreamItem, Summary, classify, encode_envelope, parse_server_timing, round3};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

const SCHEMA: u32 = 1;
const RIG: &str = "create-latency";
const CREATE_BODY: &str = r#"{"templateID":"base","metadata":{},"envVars":{}}"#;
const START_BODY: &str = r#"{"process":{"cmd":"/bin/true","args":[]},"stdin":false}"#;
const ENVD_PORT: &str = "49983";
/// A Server-Timing `boot` above this means the create booted a sandbox
/// itself (a pool miss); a hit reports microseconds.
const POOL_MISS_BOOT_MS: f64 = 1.0;

#[derive(Parser, Debug)]
#[command(version, about = "Create-to-first-exec latency: lean client and official SDK against a fresh gateway")]
struct Args {
    /// Timed samples per scenario (at concurrency > 1, spread over the workers).
    #[arg(long, default_value_t = 100)]
    samples: usize,
    /// Concurrency levels to run; each worker has its own keep-alive connection.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 10])]
    concurrency: Vec<usize>,
    /// Untimed samples each worker runs before the timed ones (connection set-up, caches).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Warm pool size for the warm scenarios (should be >= the highest concurrency).
    #[arg(long, default_value_t = 12)]
    warm_pool: usize,
    /// Pause per worker after each warm sample so the pool can refill; default: 2 x concurrency x cold create p50.
    #[arg(long)]
    warm_pace_ms: Option<f64>,
    /// Wait after the warm-up before timing a warm scenario; default: max(2 s, 3 x pool x cold create p50).
    #[arg(long)]
    pool_fill_wait_ms: Option<u64>,
    /// Gateway binary.
    #[arg(long, default_value = "target/release/copse")]
    copse: PathBuf,
    /// In-sandbox agent binary handed to the gateway.
    #[arg(long, env = "COPSE_AGENT", default_value = "target/x86_64-unknown-linux-musl/release/copse-agent")]
    agent: PathBuf,
    /// Gateway data directory (templates are built there on first use).
    #[arg(long, default_value = "/var/lib/copse-bench")]
    data_dir: PathBuf,
    /// Python with the pinned `e2b` SDK installed.
    #[arg(long, default_value = ".venv/bin/python")]
    python: PathBuf,
    /// The SDK measurement script.
    #[arg(long, default_value = "rigs/sdk_create_latency.py")]
    sdk_script: PathBuf,
    /// Skip the SDK measurement.
    #[arg(long)]
    skip_sdk: bool,
    /// Skip the fork+exec / unshare reference measurement.
    #[arg(long)]
    skip_reference: bool,
    /// Where the JSON result goes.
    #[arg(long, default_value = "benchmarks/results")]
    out_dir: PathBuf,
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

/// One scenario's measurements, ready for the result file.
struct Scenario {
    name: String,
    client: String,
    concurrency: usize,
    pool: Option<usize>,
    pace_ms: Option<f64>,
    /// Aligned series; `None` where a sample lacks the metric.
    series: BTreeMap<String, Vec<Option<f64>>>,
    counters: serde_json::Map<String, Value>,
    errors: Vec<String>,
}

impl Scenario {
    fn summary(&self, metric: &str) -> Option<Summary> {
        let v: Vec<f64> = self.series.get(metric)?.iter().flatten().copied().collect();
        Summary::of(&v)
    }

    fn p50(&self, metric: &str) -> Option<f64> {
        self.summary(metric).map(|s| s.p50)
    }

    fn to_json(&self) -> Value {
        let samples: serde_json::Map<String, Value> = self
            .series
            .iter()
            .map(|(k, v)| {
                (k.clone(), Value::Array(v.iter().map(|x| x.map_or(Value::Null, |x| json!(round3(x)))).collect()))
            })
            .collect();
        let summary: serde_json::Map<String, Value> =
            self.series.keys().filter_map(|k| Some((k.clone(), self.summary(k)?.to_json()))).collect();
        let mut counters = self.counters.clone();
        counters.insert("errors".into(), json!(self.errors.len()));
        json!({
            "name": self.name,
            "client": self.client,
            "concurrency": self.concurrency,
            "pool": self.pool,
            "pace_ms": self.pace_ms.map(round3),
            "samples": samples,
            "summary": summary,
            "counters": counters,
            "errors": self.errors.iter().take(20).collect::<Vec<_>>(),
        })
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let started_at = time::OffsetDateTime::now_utc();
    let git = git_facts();
    let host = host_facts();
    let api_key = random_hex(16)?;
    let load_start = loadavg();
    let others = other_gateways();
    let mut notes: Vec<String> = Vec::new();
    for (what, p) in [("gateway", &args.copse), ("agent", &args.agent)] {
        if !p.is_file() {
            bail!("{what} binary {} is missing: run `mise run build` first", p.display());
        }
    }

    // Templates first (idempotent; the first run on a data dir builds `base` with progress).
    eprintln!("== copse template build --data-dir {}", args.data_dir.display());
    let status = Command::new(&args.copse)
        .args(["template", "build", "--data-dir"])
        .arg(&args.data_dir)
        .env("COPSE_AGENT", &args.agent)
        .status()
        .context("running copse template build")?;
    if !status.success() {
        bail!("copse template build failed: {status}");
    }
    let up_help = command_output(Command::new(&args.copse).args(["up", "--help"])).unwrap_or_default();
    let pool_supported = up_help.contains("--pool");
    let gateway_version = command_output(Command::new(&args.copse).arg("version")).unwrap_or_default();

    let mut scenarios: Vec<Scenario> = Vec::new();
    let mut gateway_children = serde_json::Map::new();
    if !args.skip_reference {
        eprintln!("== reference: spawn /bin/true, unshare -mnpiu --fork /bin/true");
        scenarios.push(reference(args.samples)?);
    }

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    // Cold: no pool.
    let mut cold_create_p50 = None;
    {
        let gw = Gateway::start(&args, &api_key, pool_supported.then_some(0))?;
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
        if !args.skip_sdk {
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
        let gw = Gateway::start(&args, &api_key, Some(args.warm_pool))?;
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
        if !args.skip_sdk {
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
    for (phase, kids) in &gateway_children {
        if let Some(z) = kids.get("Z").and_then(Value::as_u64).filter(|z| *z > 0) {
            notes.push(format!(
                "{phase} gateway: {z} zombie (unreaped) child processes at the end of its scenarios, just before SIGTERM"
            ));
        }
    }
    derived["gateway_children_before_stop"] = Value::Object(gateway_children);
    let targets = targets(&scenarios, &mut notes);
    notes.extend(standing_notes(pool_supported));
    let busy = |l: &Option<String>| {
        l.as_deref().and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok()).is_some_and(|x| x >= 0.5)
    };
    let load_end = loadavg();
    if busy(&load_start) || busy(&load_end) {
        notes.push(format!(
            "the host was not idle: 1/5/15-min load average {} at start and {} at end on {} cores; other work \
             competed with the gateway, the client and the reference measurement",
            load_start.as_deref().unwrap_or("?"),
            load_end.as_deref().unwrap_or("?"),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        ));
    }
    if others > 0 {
        notes.push(format!("{others} other `copse up` process(es) were running on the host when the rig started"));
    }

    let short: String =
        git.get("commit").and_then(Value::as_str).map(|c| c.chars().take(7).collect()).unwrap_or("nogit".into());
    let date = started_at.date();
    std::fs::create_dir_all(&args.out_dir)?;
    let out = args.out_dir.join(format!("{RIG}-{date}-{short}.json"));
    let paces: serde_json::Map<String, Value> =
        warm_paces.iter().map(|(cc, p)| (format!("cc{cc}"), json!(round3(*p)))).collect();
    let result = json!({
        "rig": RIG,
        "schema": SCHEMA,
        "started_at": started_at.format(&time::format_description::well_known::Rfc3339)?,
        "finished_at": time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339)?,
        "git": git,
        "host": host,
        "params": {
            "samples": args.samples,
            "concurrency": args.concurrency,
            "warmup_per_worker": args.warmup,
            "template": "base",
            "create_body": serde_json::from_str::<Value>(CREATE_BODY)?,
            "first_exec": serde_json::from_str::<Value>(START_BODY)?,
            "warm_pool": pool_supported.then_some(args.warm_pool),
            "warm_pace_ms": paces,
            "pool_fill_wait_ms": fill_wait.as_millis() as u64,
            "pool_option_supported": pool_supported,
            "gateway": args.copse.display().to_string(),
            "gateway_version": gateway_version.trim(),
            "gateway_binary_mtime": mtime(&args.copse),
            "agent": args.agent.display().to_string(),
            "agent_binary_mtime": mtime(&args.agent),
            "data_dir": args.data_dir.display().to_string(),
            "loadavg_start": load_start,
            "loadavg_end": load_end,
            "other_copse_up_processes_at_start": others,
            "lean_client": "copse-rig-create: Rust, hyper 1 HTTP/1.1 keep-alive over TCP (TCP_NODELAY), one connection per worker, tokio current-thread runtime",
            "sdk": if args.skip_sdk { Value::Null } else { json!({"script": args.sdk_script.display().to_string(), "python": args.python.display().to_string()}) },
        },
        "scenarios": scenarios.iter().map(Scenario::to_json).collect::<Vec<_>>(),
        "derived": derived,
        "targets": targets,
        "notes": notes,
    });
    std::fs::write(&out, serde_json::to_string_pretty(&result)? + "\n")?;
    print_table(&scenarios);
    for t in result["targets"].as_array().into_iter().flatten() {
        println!("target {}: {} (limit {} ms) -> {}", t["claim"], t["value_ms"], t["limit_ms"], t["met"]);
    }
    if let Some(o) = result["derived"]["sdk_overhead_ms"].as_object() {
        for (k, v) in o {
            println!("sdk overhead {k}: {v}");
        }
    }
    println!("wrote {}", out.display());
    Ok(())
}

// ---------------------------------------------------------------- gateway

struct Gateway {
    child: Option<Child>,
    addr: SocketAddr,
    log: PathBuf,
}

impl Gateway {
    fn start(args: &Args, key: &str, pool: Option<usize>) -> anyhow::Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let log = std::env::temp_dir().join(format!("copse-rig-create-{port}.log"));
        let logf = std::fs::File::create(&log)?;
        let mut cmd = Command::new(&args.copse);
        cmd.args(["up", "--listen", &addr.to_string(), "--data-dir"]).arg(&args.data_dir);
        if let Some(n) = pool {
            cmd.args(["--pool", &n.to_string()]);
        }
        let child = cmd
            .env("COPSE_API_KEY", key)
            .env("COPSE_AGENT", &args.agent)
            .stdin(Stdio::null())
            .stdout(logf.try_clone()?)
            .stderr(logf)
            .spawn()
            .context("starting copse up")?;
        let mut gw = Self { child: Some(child), addr, log };
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(gw);
            }
            if let Some(status) = gw.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                gw.child = None;
                bail!("copse up exited with {status} before listening; log {}:\n{}", gw.log.display(), tail(&gw.log));
            }
            if Instant::now() > deadline {
                bail!("copse up did not listen on {addr} within 300 s; log {}", gw.log.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Direct children of the gateway by state letter, e.g. {"S": 12, "Z": 3}.
    fn children(&self) -> BTreeMap<String, usize> {
        let Some(pid) = self.child.as_ref().map(Child::id) else { return BTreeMap::new() };
        let mut out = BTreeMap::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            // "pid (comm) S ppid ..."; comm may contain spaces and parentheses.
            let Some((_, rest)) = stat.rsplit_once(')') else { continue };
            let mut f = rest.split_whitespace();
            let (Some(state), Some(ppid)) = (f.next(), f.next()) else { continue };
            if ppid.parse::<u32>() == Ok(pid) {
                *out.entry(state.to_string()).or_insert(0) += 1;
            }
        }
        out
    }

    /// SIGTERM, then wait up to 30 s (SIGKILL after that).
    fn stop(mut self, notes: &mut Vec<String>) {
        if let Some(msg) = self.terminate() {
            notes.push(msg);
        }
    }

    fn terminate(&mut self) -> Option<String> {
        let mut child = self.child.take()?;
        let t0 = Instant::now();
        // SAFETY: plain kill(2) on the pid of a child we spawned and have not reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        while t0.elapsed() < Duration::from_secs(30) {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => return None,
                Ok(Some(status)) => {
                    return Some(format!("gateway on {} exited with {status} after SIGTERM", self.addr));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Some(format!("waiting for gateway: {e}")),
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        Some(format!("gateway on {} ignored SIGTERM for 30 s and was SIGKILLed", self.addr))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(msg) = self.terminate() {
            eprintln!("{msg}");
        }
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

// ---------------------------------------------------------------- lean client

struct Conn {
    addr: SocketAddr,
    tx: http1::SendRequest<Full<Bytes>>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (tx, conn) = http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self { addr, tx })
    }

    async fn send(&mut self, req: Request<Full<Bytes>>) -> anyhow::Result<Response<Incoming>> {
        if self.tx.is_closed() {
            *self = Self::open(self.addr).await?;
        }
        self.tx.ready().await?;
        Ok(self.tx.send_request(req).await?)
    }

    fn request(&self, method: Method, path: &str) -> hyper::http::request::Builder {
        Request::builder().method(method).uri(path).header(hyper::header::HOST, self.addr.to_string())
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// create → first exec → delete; only the first two are timed.
async fn one_sample(conn: &mut Conn, key: &str) -> anyhow::Result<Sample> {
    let t0 = Instant::now();
    let req = conn
        .request(Method::POST, "/v2/sandboxes")
        .header("x-api-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(CREATE_BODY.as_bytes())))?;
    let resp = conn.send(req).await?;
    let status = resp.status();
    let server =
        resp.headers().get("server-timing").and_then(|v| v.to_str().ok()).map(parse_server_timing).unwrap_or_default();
    let body = resp.into_body().collect().await?.to_bytes();
    let t_created = Instant::now();
    if status != StatusCode::CREATED {
        bail!("create: HTTP {status}: {}", String::from_utf8_lossy(&body));
    }
    let created: Value = serde_json::from_slice(&body).context("create response is not JSON")?;
    let id = created["sandboxID"].as_str().context("create response without sandboxID")?.to_string();
    let token = created["envdAccessToken"].as_str().unwrap_or("").to_string();

    let exec = first_exec(conn, &id, &token).await;

    let t_del = Instant::now();
    let del =
        conn.request(Method::DELETE, &format!("/sandboxes/{id}")).header("x-api-key", key).body(Full::default())?;
    let del_resp = conn.send(del).await?;
    let del_status = del_resp.status();
    let del_body = del_resp.into_body().collect().await?.to_bytes();
    let delete_ms = ms(t_del.elapsed());
    let (t_start_event, t_done) = exec?;
    if del_status != StatusCode::NO_CONTENT {
        bail!("delete {id}: HTTP {del_status}: {}", String::from_utf8_lossy(&del_body));
    }
    Ok(Sample {
        total_ms: ms(t_done - t0),
        create_ms: ms(t_created - t0),
        exec_ms: ms(t_done - t_created),
        exec_start_event_ms: ms(t_start_event - t_created),
        delete_ms,
        server,
    })
}

/// `process.Process/Start` of `/bin/true`. Returns the instant its `end`
/// event arrived; the rest of the stream (the end-of-stream envelope) is read
/// after that instant so the connection stays reusable.
async fn first_exec(conn: &mut Conn, id: &str, token: &str) -> anyhow::Result<(Instant, Instant)> {
    let req = conn
        .request(Method::POST, "/process.Process/Start")
        .header("e2b-sandbox-id", id)
        .header("e2b-sandbox-port", ENVD_PORT)
        .header("x-access-token", token)
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .header("connect-content-encoding", "identity")
        .header("connect-accept-encoding", "identity")
        .body(Full::new(Bytes::from(encode_envelope(0, START_BODY.as_bytes()))))?;
    let resp = conn.send(req).await?;
    if resp.status() != StatusCode::OK {
        let st = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        bail!("Process/Start: HTTP {st}: {}", String::from_utf8_lossy(&body));
    }
    let mut body = resp.into_body();
    let mut dec = EnvelopeDecoder::default();
    let mut started: Option<Instant> = None;
    let mut ended: Option<(i64, Option<String>)> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame?;
        let Some(data) = frame.data_ref() else { continue };
        dec.push(data);
        while let Some(env) = dec.next_envelope()? {
            match classify(&env)? {
                StreamItem::Start { .. } => started = started.or(Some(Instant::now())),
                StreamItem::End { exit_code, error } => ended = Some((exit_code, error)),
                StreamItem::EndOfStream { error: Some(e) } => bail!("Process/Start stream error: {e}"),
                StreamItem::EndOfStream { error: None } => {}
                StreamItem::Data | StreamItem::Keepalive | StreamItem::Other => {}
            }
        }
        if ended.is_some() {
            break;
        }
    }
    let t_end = Instant::now();
    let Some((code, error)) = ended else { bail!("Process/Start stream ended without an end event") };
    let Some(t_start) = started else { bail!("Process/Start: end event without a start event") };
    if code != 0 || error.is_some() {
        bail!("/bin/true exited {code} (error {error:?})");
    }
    while let Some(frame) = body.frame().await {
        frame?;
    }
    Ok((t_start, t_end))
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
    let mut names: Vec<String> = Vec::new();
    for s in &samples {
        for (k, _) in &s.server {
            if !names.contains(k) {
                names.push(k.clone());
            }
        }
    }
    let mut series: BTreeMap<String, Vec<Option<f64>>> = BTreeMap::new();
    let col = |f: &dyn Fn(&Sample) -> Option<f64>| samples.iter().map(f).collect::<Vec<_>>();
    series.insert("total_ms".into(), col(&|s| Some(s.total_ms)));
    series.insert("create_ms".into(), col(&|s| Some(s.create_ms)));
    series.insert("exec_ms".into(), col(&|s| Some(s.exec_ms)));
    series.insert("exec_start_event_ms".into(), col(&|s| Some(s.exec_start_event_ms)));
    series.insert("delete_ms".into(), col(&|s| Some(s.delete_ms)));
    for name in &names {
        series.insert(format!("server_{name}_ms"), col(&|s| server_metric(s, name)));
    }
    series.insert("api_overhead_ms".into(), col(&|s| server_metric(s, "total").map(|t| s.create_ms - t)));
    let mut counters = serde_json::Map::new();
    counters.insert("ok".into(), json!(samples.len()));
    counters.insert("with_server_timing".into(), json!(samples.iter().filter(|s| !s.server.is_empty()).count()));
    if pace_ms.is_some() {
        let known: Vec<f64> = samples.iter().filter_map(|s| server_metric(s, "boot")).collect();
        counters.insert("pool_miss_known".into(), json!(known.len()));
        counters.insert("pool_misses".into(), json!(known.iter().filter(|b| **b > POOL_MISS_BOOT_MS).count()));
        counters.insert("pool_miss_threshold_ms".into(), json!(POOL_MISS_BOOT_MS));
    }
    Ok(Scenario {
        name: name.into(),
        client: "lean-rust".into(),
        concurrency: cc,
        pool: Some(0),
        pace_ms,
        series,
        counters,
        errors,
    })
}

fn server_metric(s: &Sample, name: &str) -> Option<f64> {
    s.server.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
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
    let out = std::env::temp_dir().join(format!("copse-rig-create-{name}-{}.json", std::process::id()));
    let url = format!("http://{addr}");
    let status = Command::new(&args.python)
        .arg(&args.sdk_script)
        .args(["--samples", &args.samples.to_string(), "--warmup", &args.warmup.to_string()])
        .args(["--pace-ms", &pace_ms.unwrap_or(0.0).to_string(), "--out"])
        .arg(&out)
        .env("E2B_API_URL", &url)
        .env("E2B_SANDBOX_URL", &url)
        .env("E2B_API_KEY", key)
        .stdin(Stdio::null())
        .status()
        .with_context(|| format!("running {} {}", args.python.display(), args.sdk_script.display()))?;
    if !status.success() {
        bail!("SDK script exited with {status}");
    }
    let v: Value = serde_json::from_slice(&std::fs::read(&out)?)?;
    let _ = std::fs::remove_file(&out);
    let mut series = BTreeMap::new();
    for (k, arr) in v["samples"].as_object().context("SDK output without samples")? {
        series.insert(k.clone(), arr.as_array().into_iter().flatten().map(Value::as_f64).collect());
    }
    let mut counters = serde_json::Map::new();
    counters.insert("ok".into(), json!(series.get("total_ms").map_or(0, Vec::len)));
    let sdk_version = v["sdk_version"].as_str().unwrap_or("?");
    Ok(Scenario {
        name: name.into(),
        client: format!("e2b-python-sdk {sdk_version} (python {})", v["python_version"].as_str().unwrap_or("?")),
        concurrency: 1,
        pool: Some(pool.unwrap_or(0)),
        pace_ms,
        series,
        counters,
        errors: v["errors"].as_array().into_iter().flatten().filter_map(|e| e.as_str().map(String::from)).collect(),
    })
}

// ---------------------------------------------------------------- reference

fn reference(n: usize) -> anyhow::Result<Scenario> {
    let mut spawn = Vec::with_capacity(n);
    let mut unshare = Vec::with_capacity(n);
    let mut errors = Vec::new();
    let run = |cmd: &mut Command| -> anyhow::Result<f64> {
        let t = Instant::now();
        let st = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status()?;
        let d = ms(t.elapsed());
        if !st.success() {
            bail!("{cmd:?}: {st}");
        }
        Ok(d)
    };
    for i in 0..n + 1 {
        let a = run(&mut Command::new("/bin/true"));
        let b = run(Command::new("unshare").args(["-m", "-n", "-p", "-i", "-u", "--fork", "/bin/true"]));
        if i == 0 {
            continue; // page cache / first-exec warm-up
        }
        for (r, v) in [(a, &mut spawn), (b, &mut unshare)] {
            match r {
                Ok(d) => v.push(Some(d)),
                Err(e) => errors.push(format!("{e:#}")),
            }
        }
    }
    let mut series = BTreeMap::new();
    series.insert("spawn_true_ms".into(), spawn);
    series.insert("unshare_mnpiu_fork_true_ms".into(), unshare);
    Ok(Scenario {
        name: "reference".into(),
        client: "std::process::Command, sequential, wall clock spawn..wait".into(),
        concurrency: 1,
        pool: None,
        pace_ms: None,
        series,
        counters: serde_json::Map::new(),
        errors,
    })
}

// ---------------------------------------------------------------- results

fn find<'a>(scenarios: &'a [Scenario], name: &str) -> Option<&'a Scenario> {
    scenarios.iter().find(|s| s.name == name)
}

fn derive(scenarios: &[Scenario], notes: &mut Vec<String>) -> Value {
    let mut overhead = serde_json::Map::new();
    for kind in ["cold", "warm"] {
        let (Some(sdk), Some(lean)) =
            (find(scenarios, &format!("sdk-{kind}-cc1")), find(scenarios, &format!("lean-{kind}-cc1")))
        else {
            continue;
        };
        let d = |m: &str| match (sdk.p50(m), lean.p50(m)) {
            (Some(a), Some(b)) => json!(round3(a - b)),
            _ => Value::Null,
        };
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
    json!({ "sdk_overhead_ms": overhead })
}

fn targets(scenarios: &[Scenario], notes: &mut Vec<String>) -> Value {
    let mut out = Vec::new();
    let mut push = |claim: &str, scenario: &str, metric: &str, limit: f64| {
        let value = find(scenarios, scenario).and_then(|s| s.p50(metric));
        out.push(json!({
            "claim": claim,
            "scenario": scenario,
            "metric": metric,
            "stat": "p50",
            "limit_ms": limit,
            "value_ms": value.map(round3),
            "met": value.map(|v| v <= limit),
        }));
        value.is_none()
    };
    if push("cold substrate part (server boot) p50 <= 15 ms", "lean-cold-cc1", "server_boot_ms", 15.0) {
        notes.push(
            "cold substrate target not evaluated: the gateway sent no Server-Timing `boot` metric, so the \
             substrate share of create_ms is unknown"
                .into(),
        );
    }
    push("warm create+first-exec p50 <= 3 ms", "lean-warm-cc1", "total_ms", 3.0);
    Value::Array(out)
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
        "reference.spawn_true_ms is std::process::Command spawn+wait of /bin/true; \
         reference.unshare_mnpiu_fork_true_ms runs util-linux `unshare -m -n -p -i -u --fork /bin/true`, i.e. \
         two execs and two forks plus five namespaces (an upper bound of the namespace cost, not a pure unshare(2))."
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
        if s.name == "reference" {
            for m in ["spawn_true_ms", "unshare_mnpiu_fork_true_ms"] {
                if let Some(x) = s.summary(m) {
                    println!("reference {m}: p50 {:.3} ms, p95 {:.3} ms (n {})", x.p50, x.p95, x.n);
                }
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

// ---------------------------------------------------------------- facts

fn command_output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn git_facts() -> Value {
    let commit = command_output(Command::new("git").args(["rev-parse", "HEAD"])).map(|s| s.trim().to_string());
    let dirty = command_output(Command::new("git").args(["status", "--porcelain"])).map(|s| !s.trim().is_empty());
    json!({"commit": commit, "dirty": dirty})
}

fn host_facts() -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME=").map(|v| v.trim_matches('"').to_string()));
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string()));
    let mem = read("/proc/meminfo").lines().find_map(|l| {
        l.strip_prefix("MemTotal:").and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    let cgroup = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() { "v2" } else { "v1" };
    let virt = command_output(&mut Command::new("systemd-detect-virt")).map(|s| s.trim().to_string());
    json!({
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "os": os,
        "cpu_model": cpu,
        "cores": std::thread::available_parallelism().map(|n| n.get()).ok(),
        "memory_bytes": mem.map(|kb| kb * 1024),
        "cgroup": cgroup,
        "substrate": "linux-namespaces",
        "virtualization": virt,
    })
}

/// `copse up` processes already running (another gateway competes for the CPU).
fn other_gateways() -> usize {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|c| {
            let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
            args.len() > 1 && args[0].ends_with(b"copse") && args[1] == b"up"
        })
        .count()
}

/// `/proc/loadavg`'s 1/5/15-minute figures: other work on the host skews every number here.
fn loadavg() -> Option<String> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn mtime(p: &Path) -> Option<String> {
    let t = std::fs::metadata(p).ok()?.modified().ok()?;
    time::OffsetDateTime::from(t).format(&time::format_description::well_known::Rfc3339).ok()
}

fn random_hex(n: usize) -> anyhow::Result<String> {
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}
