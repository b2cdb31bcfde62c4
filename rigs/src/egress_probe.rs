//! The egress rig's pure pieces (`copse-rig-egress`, see `egress.rs`): the
//! programs it runs inside the sandbox and on the peer, the network policy
//! of each path, and how their output becomes scenarios and targets.
//!
//! Every timing is taken inside the sandbox by one program run per
//! scenario (`PROBE`), so no agent round trip is in any number.

use std::collections::BTreeMap;

use anyhow::Context;
use serde_json::{Value, json};

use crate::Scenario;
use crate::stats::round3;

/// The peer's name, pinned to its address in the gateway's hosts file.
pub const PEER_NAME: &str = "peer.egress.test";
/// The secret a rule's header carries (the peer checks its value).
pub const SECRET_NAME: &str = "bench-egress-key";
/// What a client in the sandbox runs the probes with.
pub const PROBE_CLIENT: &str =
    "python3 http.client in the sandbox (stdlib, TCP_NODELAY), one process per scenario timing all its requests";

/// How a request leaves the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The peer's address in `allowOut`: nftables only, no proxy.
    Direct,
    /// The peer's name in `allowOut`: the proxy checks Host/SNI and relays.
    Name,
    /// The name plus a `network.rules` header transform with a secret:
    /// the proxy rewrites the request (HTTPS: terminates TLS to do so).
    Rule,
}

impl Route {
    pub const ALL: [Route; 3] = [Route::Direct, Route::Name, Route::Rule];

    pub fn label(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::Name => "proxy-name",
            Route::Rule => "proxy-rule",
        }
    }

    /// The create body's `network`: everything else denied, so a request
    /// that does not take this route fails instead of being measured.
    pub fn network(self, peer_addr: &str) -> Value {
        match self {
            Route::Direct => json!({"allowOut": [peer_addr], "denyOut": ["0.0.0.0/0"]}),
            Route::Name => json!({"allowOut": [PEER_NAME], "denyOut": ["0.0.0.0/0"]}),
            Route::Rule => json!({
                "allowOut": [PEER_NAME],
                "denyOut": ["0.0.0.0/0"],
                "rules": {PEER_NAME: [{"transform": {"headers": {
                    "Authorization": format!("Bearer ${{e2b.secrets.{SECRET_NAME}}}")
                }}}]},
            }),
        }
    }
}

/// HTTP or HTTPS: one more scheme of the same scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

impl Scheme {
    pub fn label(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }

    pub fn port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }
}

pub fn scenario_name(scheme: Scheme, route: Route) -> String {
    format!("{}-{}", scheme.label(), route.label())
}

/// What one probe run does.
#[derive(Debug, Clone)]
pub struct ProbePlan {
    pub scheme: Scheme,
    pub route: Route,
    pub peer_addr: String,
    pub requests: usize,
    pub warmup: usize,
    pub big_runs: usize,
    /// The peer's test CA (PEM), trusted by the probe on routes where the
    /// sandbox talks TLS with the peer itself; a rule's route trusts the
    /// sandbox's own store, where copse's CA is.
    pub peer_ca: Option<String>,
}

impl ProbePlan {
    /// `python3 -c PROBE <json>` arguments.
    pub fn argv(&self) -> Vec<String> {
        let cadata = match (self.scheme, self.route) {
            (Scheme::Https, Route::Direct | Route::Name) => self.peer_ca.clone(),
            _ => None,
        };
        let config = json!({
            "addr": self.peer_addr,
            "port": self.scheme.port(),
            "host": PEER_NAME,
            "tls": self.scheme == Scheme::Https,
            "cadata": cadata,
            "requests": self.requests,
            "warmup": self.warmup,
            "big_runs": self.big_runs,
        });
        vec!["-c".into(), PROBE.into(), config.to_string()]
    }
}

/// The sandbox side: N requests on a new connection each, N on one
/// keep-alive connection (reopened when the other end closes it), and
/// `big_runs` large GETs, every one timed from before connect/send to the
/// last body byte. It connects to the peer's address and names the peer in
/// Host/SNI, as a client given the name would. A failure before the first
/// timed request is `fatal` (the route does not work); later ones are
/// counted per sample.
pub const PROBE: &str = r#"
import http.client, json, socket, ssl, sys, time
cfg = json.loads(sys.argv[1])
ctx = None
if cfg["tls"]:
    ctx = ssl.create_default_context(cadata=cfg["cadata"]) if cfg["cadata"] else ssl.create_default_context()
connects = [0]
class Conn(http.client.HTTPConnection):
    def connect(self):
        connects[0] += 1
        s = socket.create_connection((cfg["addr"], cfg["port"]), timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = ctx.wrap_socket(s, server_hostname=cfg["host"]) if ctx else s
def conn():
    return Conn(cfg["host"], cfg["port"], timeout=10)
out = {"new_conn_ms": [], "keepalive_ms": [], "get_ms": [], "get_mib_per_s": [], "errors": [],
       "auth_ok": 0, "auth_checked": 0, "big_bytes": 0}
def small(c):
    c.request("GET", "/small")
    r = c.getresponse()
    body = r.read()
    if r.status != 200 or body != b"ok":
        raise RuntimeError("HTTP %d %r" % (r.status, body[:80]))
    out["auth_checked"] += 1
    out["auth_ok"] += r.getheader("X-Auth-Seen") == "1"
def once():
    c = conn()
    try:
        small(c)
    finally:
        c.close()
try:
    for _ in range(max(cfg["warmup"], 1)):
        once()
except Exception as e:
    print(json.dumps({"fatal": "%s: %s" % (type(e).__name__, e)}))
    sys.exit(0)
out["auth_ok"] = out["auth_checked"] = 0
for _ in range(cfg["requests"]):
    t = time.perf_counter()
    try:
        once()
        out["new_conn_ms"].append((time.perf_counter() - t) * 1000)
    except Exception as e:
        out["new_conn_ms"].append(None); out["errors"].append("new connection: %s: %s" % (type(e).__name__, e))
c = conn()
small(c)
connects[0] = 0
retries = 0
for _ in range(cfg["requests"]):
    t = time.perf_counter()
    try:
        try:
            small(c)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            retries += 1
            c.close()
            small(c)
        out["keepalive_ms"].append((time.perf_counter() - t) * 1000)
    except Exception as e:
        out["keepalive_ms"].append(None); out["errors"].append("keep-alive: %s: %s" % (type(e).__name__, e))
        c.close()
c.close()
out["keepalive_reconnects"] = connects[0]
out["keepalive_retries"] = retries
for _ in range(cfg["big_runs"]):
    c = conn()
    t = time.perf_counter()
    try:
        c.request("GET", "/big")
        r = c.getresponse()
        n = 0
        while True:
            chunk = r.read(1 << 20)
            if not chunk:
                break
            n += len(chunk)
        took = time.perf_counter() - t
        if r.status != 200 or n == 0:
            raise RuntimeError("HTTP %d, %d bytes" % (r.status, n))
        out["big_bytes"] = n
        out["get_ms"].append(took * 1000)
        out["get_mib_per_s"].append(n / (1 << 20) / took)
    except Exception as e:
        out["get_ms"].append(None); out["get_mib_per_s"].append(None)
        out["errors"].append("large GET: %s: %s" % (type(e).__name__, e))
    finally:
        c.close()
print(json.dumps(out))
"#;

/// The peer: HTTP on 80 and HTTPS (the rig's test certificate) on 443.
/// `/small` answers `ok` with `X-Auth-Seen: 1` when the request carried
/// the rule's header with the secret's value; `/big` sends `big_bytes`.
/// argv: cert, key, expected Authorization, big_bytes.
pub const PEER_SERVER: &str = r#"
import http.server, socketserver, ssl, sys, threading
cert, key, expected, big = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
BIG = bytes(range(256)) * (big // 256)
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):
        super().setup()
        import socket
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    def do_GET(self):
        if self.path == "/big":
            self.send_response(200); self.send_header("Content-Length", str(len(BIG))); self.end_headers()
            view = memoryview(BIG)
            for i in range(0, len(BIG), 1 << 20):
                self.wfile.write(view[i:i + (1 << 20)])
            return
        seen = "1" if self.headers.get("Authorization") == expected else "0"
        self.send_response(200); self.send_header("Content-Length", "2"); self.send_header("X-Auth-Seen", seen)
        self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
plain = S(("0.0.0.0", 80), H)
tls = S(("0.0.0.0", 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(cert, key)
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=plain.serve_forever, daemon=True).start()
tls.serve_forever()
"#;

/// A probe's answer: a scenario, or why the route does not work.
#[derive(Debug, Clone)]
pub enum ProbeOutcome {
    Measured(Scenario),
    Failed(String),
}

/// Reads the probe's JSON line into a scenario (`name`); a `Rule` route
/// whose requests reached the peer without the secret header is an error,
/// not a measurement of the wrong thing.
pub fn parse_probe(name: &str, route: Route, stdout: &str) -> anyhow::Result<ProbeOutcome> {
    let line = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).context("probe printed no JSON")?;
    let v: Value = serde_json::from_str(line).context("probe output is not JSON")?;
    if let Some(fatal) = v["fatal"].as_str() {
        return Ok(ProbeOutcome::Failed(fatal.to_string()));
    }
    let mut s = Scenario { name: name.into(), client: PROBE_CLIENT.into(), concurrency: 1, ..Default::default() };
    for metric in ["new_conn_ms", "keepalive_ms"] {
        s.series.insert(metric.into(), floats(&v[metric]));
    }
    let get = floats(&v["get_ms"]);
    if !get.is_empty() {
        s.series.insert("get_ms".into(), get);
        s.series.insert("get_mib_per_s".into(), floats(&v["get_mib_per_s"]));
    }
    for counter in ["keepalive_reconnects", "keepalive_retries", "big_bytes", "auth_ok", "auth_checked"] {
        s.counters.insert(counter.into(), v[counter].clone());
    }
    s.errors = v["errors"].as_array().into_iter().flatten().filter_map(|e| e.as_str().map(String::from)).collect();
    let (ok, checked) = (v["auth_ok"].as_u64().unwrap_or(0), v["auth_checked"].as_u64().unwrap_or(0));
    match route {
        Route::Rule if ok != checked => {
            s.errors.push(format!("the rule's header reached the peer on {ok} of {checked} requests"))
        }
        Route::Direct | Route::Name if ok != 0 => {
            s.errors.push(format!("{ok} requests reached the peer with the secret header on a route without a rule"))
        }
        _ => {}
    }
    Ok(ProbeOutcome::Measured(s))
}

/// A probe's series; failed samples are null.
fn floats(v: &Value) -> Vec<Option<f64>> {
    v.as_array().into_iter().flatten().map(Value::as_f64).collect()
}

/// The sandbox side of one disk measurement: `write PATH MIB` writes MIB
/// MiB of incompressible data in 1 MiB writes, then fsyncs, then calls
/// sync(2), and prints the milliseconds to the last write, to the end of
/// the fsync and to the end of the sync; `read PATH`
/// reads the file back in 1 MiB reads and prints its milliseconds.
pub const DISK_PROBE: &str = r#"
import os, sys, time
op, path = sys.argv[1], sys.argv[2]
if op == "write":
    chunk = os.urandom(1 << 20)
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for _ in range(int(sys.argv[3])):
        os.write(fd, chunk)
    written = time.perf_counter()
    os.fsync(fd)
    fsynced = time.perf_counter()
    os.sync()
    os.close(fd)
    print((written - t) * 1000, (fsynced - t) * 1000, (time.perf_counter() - t) * 1000)
else:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, 1 << 20):
        pass
    os.close(fd)
    print((time.perf_counter() - t) * 1000)
"#;

pub fn disk_argv(op: &str, path: &str, mib: Option<u64>) -> Vec<String> {
    let mut v = vec!["-c".to_string(), DISK_PROBE.to_string(), op.to_string(), path.to_string()];
    v.extend(mib.map(|m| m.to_string()));
    v
}

/// The numbers a disk probe printed (milliseconds), at least one.
pub fn parse_ms(stdout: &str) -> anyhow::Result<Vec<f64>> {
    let v: Vec<f64> = stdout
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("expected milliseconds, got {stdout:?}"))?;
    if v.is_empty() {
        anyhow::bail!("the disk probe printed nothing");
    }
    Ok(v)
}

/// One disk round's samples.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiskRound {
    /// To the last write (page cache).
    pub buffered: Option<f64>,
    /// To the end of the fsync.
    pub fsynced: Option<f64>,
    /// To the end of sync(2): the bytes are on the backing store.
    pub synced: Option<f64>,
    pub read: Option<f64>,
}

/// One disk's rounds, as a scenario with throughput beside each time.
pub fn disk_scenario(name: &str, client: &str, mib: u64, rounds: &[DiskRound]) -> Scenario {
    let rate = |ms: Option<f64>| ms.filter(|m| *m > 0.0).map(|m| mib as f64 * 1000.0 / m);
    let mut s = Scenario { name: name.into(), client: client.into(), concurrency: 1, ..Default::default() };
    let columns = [
        ("write_buffered_ms", rounds.iter().map(|r| r.buffered).collect::<Vec<_>>()),
        ("write_ms", rounds.iter().map(|r| r.fsynced).collect()),
        ("write_synced_ms", rounds.iter().map(|r| r.synced).collect()),
        ("read_ms", rounds.iter().map(|r| r.read).collect()),
    ];
    for (metric, times) in columns {
        let rates = times.iter().map(|t| rate(*t)).collect();
        s.series.insert(metric.into(), times);
        s.series.insert(metric.replace("_ms", "_mib_per_s"), rates);
    }
    s.counters.insert("file_mib".into(), json!(mib));
    s
}

/// The targets: what the proxy adds to an HTTPS request with a rule (p50
/// of a new-connection request, rule route minus direct: ≤ 1 ms), the same
/// for HTTP (information), and the volume's write and read within 10% of
/// the sandbox's own disk (volume p50 ≤ 1.1 × root disk p50). The write
/// compared is the one that ends on the backing store (sync(2)): an fsync
/// on the own disk returns without flushing (its overlay is `volatile`),
/// one on a volume flushes, so fsync times compare durability, not the two
/// paths; they are reported beside (`write_ms`) and in the notes. `unsupported`
/// names why a scheme was not measured; its targets stay unmet-unknown.
pub fn targets(scenarios: &[Scenario], unsupported: &BTreeMap<&str, String>) -> Value {
    let p50 = |name: &str, metric: &str| scenarios.iter().find(|s| s.name == name).and_then(|s| s.p50(metric));
    let mut out = Vec::new();
    for (scheme, limit) in [(Scheme::Https, 1.0), (Scheme::Http, 1.0)] {
        let rule = scenario_name(scheme, Route::Rule);
        let direct = scenario_name(scheme, Route::Direct);
        let added = match (p50(&rule, "new_conn_ms"), p50(&direct, "new_conn_ms")) {
            (Some(r), Some(d)) => Some(round3(r - d)),
            _ => None,
        };
        let mut t = json!({
            "claim": format!("the egress proxy adds <= {limit} ms p50 to a new-connection {} request with a rule", scheme.label().to_uppercase()),
            "scenario": rule,
            "metric": "new_conn_ms",
            "stat": format!("p50 minus p50 of {direct}"),
            "limit_ms": limit,
            "value_ms": added,
            "met": added.map(|a| a <= limit),
        });
        if let Some(why) = unsupported.get(scheme.label()) {
            t["note"] = json!(format!("{}: {why}", scheme.label()));
        }
        out.push(t);
    }
    for (metric, what) in [("write_synced_ms", "write, flushed to the backing store by sync(2),"), ("read_ms", "read")]
    {
        let own = p50("rootfs-io", metric);
        let limit = own.map(|o| round3(o * 1.1));
        let value = p50("volume-io", metric);
        out.push(json!({
            "claim": format!("volume sequential {what} within 10% of the sandbox's own disk (p50 <= 1.1 x rootfs-io p50)"),
            "scenario": "volume-io",
            "metric": metric,
            "stat": "p50",
            // The limit is derived from the same run's own disk; 0 when it
            // was not measured (met is then null).
            "limit_ms": limit.unwrap_or(0.0),
            "value_ms": value.map(round3),
            "met": match (value, limit) { (Some(v), Some(l)) => Some(v <= l), _ => None },
        }));
    }
    Value::Array(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_route_has_its_policy() {
        let d = Route::Direct.network("198.51.100.10");
        assert_eq!(d["allowOut"], json!(["198.51.100.10"]));
        assert!(d.get("rules").is_none());
        let n = Route::Name.network("x");
        assert_eq!(n["allowOut"], json!([PEER_NAME]));
        assert!(n.get("rules").is_none());
        let r = Route::Rule.network("x");
        assert_eq!(
            r["rules"][PEER_NAME][0]["transform"]["headers"]["Authorization"],
            json!("Bearer ${e2b.secrets.bench-egress-key}")
        );
        for net in [d, n, r] {
            assert_eq!(net["denyOut"], json!(["0.0.0.0/0"]));
        }
    }

    #[test]
    fn only_tls_to_the_peer_itself_trusts_the_test_ca() {
        let plan = |scheme, route| ProbePlan {
            scheme,
            route,
            peer_addr: "198.51.100.10".into(),
            requests: 3,
            warmup: 1,
            big_runs: 1,
            peer_ca: Some("PEM".into()),
        };
        let config = |p: ProbePlan| serde_json::from_str::<Value>(&p.argv()[2]).unwrap();
        assert_eq!(config(plan(Scheme::Https, Route::Direct))["cadata"], json!("PEM"));
        assert_eq!(config(plan(Scheme::Https, Route::Name))["cadata"], json!("PEM"));
        assert_eq!(config(plan(Scheme::Https, Route::Rule))["cadata"], Value::Null);
        let http = config(plan(Scheme::Http, Route::Direct));
        assert_eq!(
            (http["port"].clone(), http["tls"].clone(), http["cadata"].clone()),
            (json!(80), json!(false), Value::Null)
        );
        assert_eq!(scenario_name(Scheme::Https, Route::Rule), "https-proxy-rule");
    }

    const OUTPUT: &str = r#"{"new_conn_ms": [1.5, null, 2.5], "keepalive_ms": [0.5, 0.7, 0.6], "get_ms": [100.0],
        "get_mib_per_s": [640.0], "errors": ["new connection: timeout: x"], "auth_ok": 6, "auth_checked": 6,
        "big_bytes": 67108864, "keepalive_reconnects": 3, "keepalive_retries": 0}"#;

    #[test]
    fn probe_output_becomes_a_scenario() {
        let noise = format!("some warning\n{}", OUTPUT.replace('\n', ""));
        let ProbeOutcome::Measured(s) = parse_probe("http-proxy-rule", Route::Rule, &noise).unwrap() else {
            panic!("measured")
        };
        assert_eq!(s.series["new_conn_ms"], vec![Some(1.5), None, Some(2.5)]);
        assert_eq!(s.p50("keepalive_ms"), Some(0.6));
        assert_eq!(s.series["get_mib_per_s"], vec![Some(640.0)]);
        assert_eq!(s.counters["keepalive_reconnects"], json!(3));
        assert_eq!(s.errors.len(), 1);
    }

    #[test]
    fn a_rule_that_did_not_reach_the_peer_is_an_error() {
        let partial = OUTPUT.replace('\n', "").replace(r#""auth_ok": 6"#, r#""auth_ok": 4"#);
        let ProbeOutcome::Measured(s) = parse_probe("x", Route::Rule, &partial).unwrap() else { panic!() };
        assert!(s.errors.iter().any(|e| e.contains("4 of 6")), "{:?}", s.errors);
        let ProbeOutcome::Measured(s) = parse_probe("x", Route::Direct, &partial).unwrap() else { panic!() };
        assert!(s.errors.iter().any(|e| e.contains("without a rule")), "{:?}", s.errors);
        let none = partial.replace(r#""auth_ok": 4"#, r#""auth_ok": 0"#);
        let ProbeOutcome::Measured(s) = parse_probe("x", Route::Name, &none).unwrap() else { panic!() };
        assert_eq!(s.errors.len(), 1);
    }

    #[test]
    fn a_route_that_fails_at_once_is_reported_not_measured() {
        let out = r#"{"fatal": "SSLCertVerificationError: certificate verify failed"}"#;
        let ProbeOutcome::Failed(why) = parse_probe("x", Route::Rule, out).unwrap() else { panic!() };
        assert!(why.contains("verify failed"));
        assert!(parse_probe("x", Route::Rule, "Traceback ...").is_err());
    }

    #[test]
    fn disk_samples_carry_their_throughput() {
        let rounds = [round(Some(256.0), Some(512.0), Some(1024.0), Some(256.0)), round(None, None, None, Some(128.0))];
        let s = disk_scenario("volume-io", "c", 256, &rounds);
        assert_eq!(s.series["write_mib_per_s"], vec![Some(500.0), None]);
        assert_eq!(s.series["write_synced_mib_per_s"], vec![Some(250.0), None]);
        assert_eq!(s.series["write_buffered_mib_per_s"], vec![Some(1000.0), None]);
        assert_eq!(s.series["read_mib_per_s"], vec![Some(1000.0), Some(2000.0)]);
        assert_eq!(parse_ms(" 12.5 20 30\n").unwrap(), [12.5, 20.0, 30.0]);
        assert!(parse_ms("oops").is_err());
        assert!(parse_ms("").is_err());
        assert_eq!(disk_argv("write", "/f", Some(4))[2..], ["write", "/f", "4"]);
    }

    #[test]
    fn targets_compare_like_with_like_and_say_what_was_not_measured() {
        let mut all = Vec::new();
        for (name, v) in [("http-direct", 1.0), ("http-proxy-rule", 1.8)] {
            let mut s = Scenario { name: name.into(), ..Default::default() };
            s.series.insert("new_conn_ms".into(), vec![Some(v)]);
            all.push(s);
        }
        // The own disk's fsync is nearly free, the volume's is not: the
        // write target compares the synced time, not the fsync'd one.
        all.push(disk_scenario("rootfs-io", "c", 1, &[round(Some(90.0), Some(91.0), Some(100.0), Some(50.0))]));
        all.push(disk_scenario("volume-io", "c", 1, &[round(Some(95.0), Some(300.0), Some(105.0), Some(60.0))]));
        let unsupported = BTreeMap::from([("https", "not supported by this gateway".to_string())]);
        let t = targets(&all, &unsupported);
        let by = |i: usize, k: &str| t[i][k].clone();
        assert_eq!((by(0, "value_ms"), by(0, "met")), (Value::Null, Value::Null));
        assert_eq!(by(0, "note"), json!("https: not supported by this gateway"));
        assert_eq!((by(1, "value_ms"), by(1, "met")), (json!(0.8), json!(true)));
        assert_eq!((by(2, "limit_ms"), by(2, "met")), (json!(110.0), json!(true)));
        assert_eq!(by(2, "metric"), json!("write_synced_ms"));
        assert_eq!((by(3, "limit_ms"), by(3, "met")), (json!(55.0), json!(false)));
    }

    fn round(buffered: Option<f64>, fsynced: Option<f64>, synced: Option<f64>, read: Option<f64>) -> DiskRound {
        DiskRound { buffered, fsynced, synced, read }
    }
}
