//! `copse-rig-load`: a "run this snippet, return the result" service under
//! sustained load from a real load tool (hey). The rig serves a tiny HTTP
//! front (`POST /run`, body = Python code, response = the result's text)
//! that turns each request into a sandbox run through the E2B API, in one of
//! three modes, and drives it with `hey -z DURATION -c CONCURRENCY`:
//! `reused` (a fixed set of warm sandboxes, one per request at a time),
//! `fresh-pooled` (create → run → delete per request, gateway warm pool on),
//! `fresh-cold` (the same with no pool: every request boots a sandbox and
//! starts a kernel).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use clap::Parser;
use copse_rigs::facts::random_hex;
use copse_rigs::load::{parse_hey_csv, wall_ms};
use copse_rigs::{Conn, Created, Gateway, LEAN_CLIENT, RigArgs, Run, Scenario, round3};
use serde_json::json;
use tokio::sync::{Mutex, Semaphore};

const RIG: &str = "load";
const TEMPLATE: &str = "code-interpreter-v1";
const CREATE_BODY: &str = r#"{"templateID":"code-interpreter-v1","timeout":600,"metadata":{},"envVars":{}}"#;
const SNIPPET: &str = "sum(i * i for i in range(1000))";
const EXPECTED: &str = "332833500";

#[derive(Parser, Debug)]
#[command(version, about = "Snippet requests under sustained load: sandbox reused vs fresh per request")]
struct Args {
    /// hey workers (simultaneous requests); a cold code-interpreter create
    /// keeps about one core busy for a second, so more than a few workers
    /// on a small host only queue.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// How long hey sends requests in each mode, seconds.
    #[arg(long, default_value_t = 30)]
    duration_s: u64,
    /// Modes to run.
    #[arg(long, value_delimiter = ',', default_values_t = ["reused".to_string(), "fresh-pooled".to_string(), "fresh-cold".to_string()])]
    modes: Vec<String>,
    /// The load tool; installed with `go install github.com/rakyll/hey@v0.1.5` when missing.
    #[arg(long, default_value = "hey")]
    hey: PathBuf,
    #[command(flatten)]
    common: RigArgs,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Reused,
    Fresh,
}

struct Front {
    gateway: SocketAddr,
    key: String,
    mode: Mode,
    conns: Mutex<Vec<Conn>>,
    warm: Mutex<Vec<Created>>,
    warm_free: Semaphore,
}

impl Front {
    async fn conn(&self) -> anyhow::Result<Conn> {
        match self.conns.lock().await.pop() {
            Some(c) => Ok(c),
            None => Conn::open(self.gateway).await,
        }
    }

    async fn run(&self, code: &str) -> anyhow::Result<String> {
        let mut conn = self.conn().await?;
        let out = match self.mode {
            Mode::Reused => {
                let _permit = self.warm_free.acquire().await?;
                let sbx = self.warm.lock().await.pop().context("no warm sandbox although a permit was free")?;
                let r = conn.run_code(&sbx.id, &sbx.token, code).await;
                self.warm.lock().await.push(sbx);
                r
            }
            Mode::Fresh => {
                let sbx = conn.create_sandbox(&self.key, CREATE_BODY).await?;
                let r = conn.run_code(&sbx.id, &sbx.token, code).await;
                conn.delete_sandbox(&self.key, &sbx.id).await?;
                r
            }
        };
        self.conns.lock().await.push(conn);
        out
    }
}

async fn run_handler(State(front): State<Arc<Front>>, code: String) -> (StatusCode, String) {
    match front.run(&code).await {
        Ok(text) => (StatusCode::OK, text),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")),
    }
}

fn hey_binary(args: &Args, notes: &mut Vec<String>) -> anyhow::Result<PathBuf> {
    let works = |p: &PathBuf| Command::new(p).arg("-h").output().is_ok();
    if works(&args.hey) {
        return Ok(args.hey.clone());
    }
    let gopath = PathBuf::from(std::env::var("HOME").unwrap_or_default()).join("go/bin/hey");
    if !works(&gopath) {
        eprintln!("== installing hey: go install github.com/rakyll/hey@v0.1.5");
        let st = Command::new("go").args(["install", "github.com/rakyll/hey@v0.1.5"]).status();
        if !st.is_ok_and(|s| s.success()) || !works(&gopath) {
            bail!("hey is missing and `go install github.com/rakyll/hey@v0.1.5` failed");
        }
        notes.push("hey installed by the rig with go install github.com/rakyll/hey@v0.1.5".into());
    }
    Ok(gopath)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = Run::begin(RIG);
    let bins = &args.common.bins;
    bins.check()?;
    bins.build_template(Some(TEMPLATE))?;
    let mut notes = Vec::new();
    let hey = hey_binary(&args, &mut notes)?;
    let key = random_hex(16)?;
    let rt = tokio::runtime::Runtime::new()?;
    let cc = args.concurrency;
    let mut scenarios = Vec::new();
    for mode_name in &args.modes {
        let (mode, pool) = match mode_name.as_str() {
            "reused" => (Mode::Reused, 0),
            "fresh-pooled" => (Mode::Fresh, cc + 2),
            "fresh-cold" => (Mode::Fresh, 0),
            other => bail!("unknown mode {other}"),
        };
        let pools = vec![format!("{TEMPLATE}={pool}"), "base=0".into()];
        let gw = Gateway::start(bins, &key, &pools, "copse-rig-load")?;
        eprintln!("== {mode_name}: gateway (pool {pool}) on {}", gw.addr);
        let result = rt.block_on(drive(&args, &hey, gw.addr, &key, mode, pool, mode_name));
        gw.stop(&mut notes);
        match result {
            Ok(sc) => scenarios.push(sc),
            Err(e) => notes.push(format!("{mode_name}: {e:#}")),
        }
    }
    let ratio = |a: &str, b: &str| {
        let t = |n: &str| scenarios.iter().find(|s| s.name == n).and_then(|s| s.counters.get("req_per_s")?.as_f64());
        t(a).zip(t(b)).filter(|(_, y)| *y > 0.0).map(|(x, y)| round3(x / y))
    };
    let derived = json!({
        "throughput_ratio": {
            "reused_vs_fresh_pooled": ratio("reused", "fresh-pooled"),
            "reused_vs_fresh_cold": ratio("reused", "fresh-cold"),
            "fresh_pooled_vs_fresh_cold": ratio("fresh-pooled", "fresh-cold"),
        }
    });
    notes.extend(standing_notes());
    let params = json!({
        "concurrency": cc,
        "duration_s": args.duration_s,
        "modes": args.modes,
        "template": TEMPLATE,
        "snippet": SNIPPET,
        "expected_result": EXPECTED,
        "load_tool": format!("hey v0.1.5 ({}): hey -z {}s -c {cc} -m POST -d <snippet> -o csv", hey.display(), args.duration_s),
        "front": "the rig's own axum server on loopback: POST /run → lean client → gateway",
        "lean_client": format!("copse-rig-load: {LEAN_CLIENT}"),
    });
    let (out, _) = run.write(&args.common.out_dir, params, bins, &scenarios, derived, json!([]), notes)?;
    for s in &scenarios {
        let sum = s.summary("latency_ms");
        println!(
            "{:<14} {:>8} req/s  p50 {:>8.2} ms  p99 {:>8.2} ms  errors {}",
            s.name,
            s.counters.get("req_per_s").map_or("-".into(), |v| v.to_string()),
            sum.as_ref().map_or(f64::NAN, |x| x.p50),
            sum.as_ref().map_or(f64::NAN, |x| x.p99),
            s.errors.len()
        );
    }
    println!("wrote {}", out.display());
    Ok(())
}

async fn drive(
    args: &Args,
    hey: &PathBuf,
    gateway: SocketAddr,
    key: &str,
    mode: Mode,
    pool: usize,
    name: &str,
) -> anyhow::Result<Scenario> {
    let cc = args.concurrency;
    let front = Arc::new(Front {
        gateway,
        key: key.into(),
        mode,
        conns: Mutex::new(Vec::new()),
        warm: Mutex::new(Vec::new()),
        warm_free: Semaphore::new(0),
    });
    if mode == Mode::Reused {
        let mut conn = Conn::open(gateway).await?;
        for _ in 0..cc {
            let sbx = conn.create_sandbox(key, CREATE_BODY).await?;
            conn.run_code(&sbx.id, &sbx.token, "1+1").await?;
            front.warm.lock().await.push(sbx);
        }
        front.warm_free.add_permits(cc);
    }
    if pool > 0 {
        // Let the warm pool fill (each sandbox starts a kernel: about a second).
        tokio::time::sleep(Duration::from_secs(pool as u64 * 2)).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let app = axum::Router::new().route("/run", post(run_handler)).with_state(front.clone());
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    // One request by hand: the front works and returns the right answer.
    let check = front.run(SNIPPET).await?;
    anyhow::ensure!(check == EXPECTED, "snippet returned {check:?}, expected {EXPECTED}");
    eprintln!("-- {name}: hey -z {}s -c {cc} against {addr}", args.duration_s);
    let out = tokio::process::Command::new(hey)
        .args(["-z", &format!("{}s", args.duration_s), "-c", &cc.to_string(), "-m", "POST", "-T", "text/plain"])
        .args(["-d", SNIPPET, "-o", "csv", &format!("http://{addr}/run")])
        .output()
        .await?;
    server.abort();
    if !out.status.success() {
        bail!("hey: {}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    let reqs = parse_hey_csv(&String::from_utf8_lossy(&out.stdout))?;
    for sbx in front.warm.lock().await.drain(..) {
        let mut conn = Conn::open(gateway).await?;
        let _ = conn.delete_sandbox(key, &sbx.id).await;
    }
    let ok: Vec<_> = reqs.iter().filter(|r| r.status == 200).collect();
    let wall = wall_ms(&reqs);
    let mut sc = Scenario {
        name: name.into(),
        client: "hey v0.1.5 → rig front (axum) → lean-rust → gateway".into(),
        concurrency: cc,
        pool: Some(pool),
        wall_ms: wall,
        errors: reqs.iter().filter(|r| r.status != 200).map(|r| format!("HTTP {}", r.status)).collect(),
        ..Scenario::default()
    };
    sc.series.insert("latency_ms".into(), ok.iter().map(|r| Some(r.latency_ms)).collect());
    sc.counters.insert("ok".into(), json!(ok.len()));
    sc.counters.insert("requests".into(), json!(reqs.len()));
    let rps = wall.map(|w| round3(ok.len() as f64 * 1000.0 / w));
    sc.counters.insert("req_per_s".into(), json!(rps));
    Ok(sc)
}

fn standing_notes() -> Vec<String> {
    vec![
        format!(
            "Each request runs `{SNIPPET}` (expected {EXPECTED}); the front checks nothing per request beyond the \
             E2B stream (an error line or a missing result is HTTP 500, counted in errors). One request per mode is \
             checked for the exact answer before hey starts."
        ),
        "reused: the front holds `concurrency` sandboxes created and warmed (1+1) before the run, one request per \
         sandbox at a time. fresh-pooled: create → run → delete per request, gateway pool concurrency+2. \
         fresh-cold: the same with pool 0 (every request boots a sandbox and starts its kernel)."
            .into(),
        "latency_ms is hey's response-time; req_per_s (counters) = successful requests ÷ wall, wall = first \
         request sent → last response read (from hey's offsets), equal to throughput_per_s. hey, the front, the \
         gateway and the sandboxes share the host's cores."
            .into(),
    ]
}
