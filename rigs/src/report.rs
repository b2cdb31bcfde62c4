//! Scenarios, targets and the result file (`benchmarks/schema.md`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use serde_json::{Value, json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::catalogue;
use crate::facts::{cores, git_facts, host_facts, load_is_busy, loadavg, other_gateways};
use crate::gateway::Binaries;
use crate::stats::{Summary, round3};

/// Result schema version written by every rig.
pub const SCHEMA: u32 = 2;

/// One scenario's measurements, ready for the result file.
#[derive(Debug, Clone, Default)]
pub struct Scenario {
    pub name: String,
    pub client: String,
    pub concurrency: usize,
    pub pool: Option<usize>,
    pub pace_ms: Option<f64>,
    /// Wall clock of the whole scenario: first sample started → last sample
    /// finished, all workers together; `None` when not measured.
    pub wall_ms: Option<f64>,
    /// Aligned series; `None` where a sample lacks the metric.
    pub series: BTreeMap<String, Vec<Option<f64>>>,
    pub counters: serde_json::Map<String, Value>,
    pub errors: Vec<String>,
}

impl Scenario {
    /// A lean-client scenario from rows of `metrics`, one row per sample,
    /// every sample counted `ok`.
    pub fn from_rows<const N: usize>(name: &str, cc: usize, metrics: &[&str; N], rows: &[[f64; N]]) -> Self {
        let mut series = BTreeMap::new();
        for (i, metric) in metrics.iter().enumerate() {
            series.insert(metric.to_string(), rows.iter().map(|r| Some(r[i])).collect());
        }
        let mut counters = serde_json::Map::new();
        counters.insert("ok".into(), serde_json::json!(rows.len()));
        Self { name: name.into(), client: "lean-rust".into(), concurrency: cc, series, counters, ..Default::default() }
    }

    pub fn summary(&self, metric: &str) -> Option<Summary> {
        let v: Vec<f64> = self.series.get(metric)?.iter().flatten().copied().collect();
        Summary::of(&v)
    }

    pub fn p50(&self, metric: &str) -> Option<f64> {
        self.summary(metric).map(|s| s.p50)
    }

    /// Number of samples that have `metric`.
    pub fn count(&self, metric: &str) -> usize {
        self.series.get(metric).map_or(0, |v| v.iter().flatten().count())
    }

    /// Successful samples (the length of the aligned series).
    pub fn completed(&self) -> usize {
        self.series.values().map(Vec::len).max().unwrap_or(0)
    }

    pub fn to_json(&self) -> Value {
        // The file's series are index-aligned: one sampled fewer times than
        // the longest (a few large GETs beside hundreds of requests) is
        // padded with nulls, which no summary counts.
        let rows = self.completed();
        let samples: serde_json::Map<String, Value> = self
            .series
            .iter()
            .map(|(k, v)| {
                let values = v.iter().map(|x| x.map_or(Value::Null, |x| json!(round3(x))));
                let padding = std::iter::repeat_n(Value::Null, rows - v.len());
                (k.clone(), Value::Array(values.chain(padding).collect()))
            })
            .collect();
        let summary: serde_json::Map<String, Value> =
            self.series.keys().filter_map(|k| Some((k.clone(), self.summary(k)?.to_json()))).collect();
        let mut counters = self.counters.clone();
        counters.insert("errors".into(), json!(self.errors.len()));
        let (throughput, amortized) = rates(self.completed(), self.wall_ms);
        json!({
            "name": self.name,
            "client": self.client,
            "concurrency": self.concurrency,
            "pool": self.pool,
            "pace_ms": self.pace_ms.map(round3),
            "wall_ms": self.wall_ms.map(round3),
            "throughput_per_s": throughput,
            "amortized_ms": amortized,
            "samples": samples,
            "summary": summary,
            "counters": counters,
            "errors": self.errors.iter().take(20).collect::<Vec<_>>(),
        })
    }
}

/// `(throughput_per_s, amortized_ms)` of `n` samples completed in `wall_ms`:
/// n ÷ wall and wall ÷ n (the per-sandbox cost when they ran side by side).
pub fn rates(n: usize, wall_ms: Option<f64>) -> (Value, Value) {
    match wall_ms {
        Some(w) if w > 0.0 && n > 0 => (json!(round3(n as f64 * 1000.0 / w)), json!(round3(w / n as f64))),
        _ => (Value::Null, Value::Null),
    }
}

/// A Server-Timing `boot` above this means the create booted a sandbox
/// itself (a pool miss); a hit reports microseconds.
pub const POOL_MISS_BOOT_MS: f64 = 1.0;

/// `server_<name>_ms` series, index-aligned with `timings` (one parsed
/// Server-Timing header per sample), for every metric name any sample has.
pub fn server_timing_series(timings: &[Vec<(String, f64)>]) -> BTreeMap<String, Vec<Option<f64>>> {
    let mut names: Vec<&str> = Vec::new();
    for (k, _) in timings.iter().flatten() {
        if !names.contains(&k.as_str()) {
            names.push(k);
        }
    }
    names
        .into_iter()
        .map(|name| (format!("server_{name}_ms"), timings.iter().map(|t| server_timing(t, name)).collect()))
        .collect()
}

/// The value of one Server-Timing metric.
pub fn server_timing(timing: &[(String, f64)], name: &str) -> Option<f64> {
    timing.iter().find(|(k, _)| k == name).map(|(_, v)| *v)
}

/// Counters `pool_miss_known` (samples with a boot time), `pool_misses`
/// (boot above `POOL_MISS_BOOT_MS`) and `pool_miss_threshold_ms`.
pub fn pool_miss_counters(boot_ms: &[Option<f64>]) -> serde_json::Map<String, Value> {
    let known: Vec<f64> = boot_ms.iter().flatten().copied().collect();
    let mut c = serde_json::Map::new();
    c.insert("pool_miss_known".into(), json!(known.len()));
    c.insert("pool_misses".into(), json!(known.iter().filter(|b| **b > POOL_MISS_BOOT_MS).count()));
    c.insert("pool_miss_threshold_ms".into(), json!(POOL_MISS_BOOT_MS));
    c
}

pub fn find<'a>(scenarios: &'a [Scenario], name: &str) -> Option<&'a Scenario> {
    scenarios.iter().find(|s| s.name == name)
}

/// One `targets[]` entry checking `p50(scenario.metric) <= limit_ms`; `met`
/// is null when the scenario or metric is missing.
pub fn p50_target(scenarios: &[Scenario], claim: &str, scenario: &str, metric: &str, limit_ms: f64) -> Value {
    let value = find(scenarios, scenario).and_then(|s| s.p50(metric));
    json!({
        "claim": claim,
        "scenario": scenario,
        "metric": metric,
        "stat": "p50",
        "limit_ms": limit_ms,
        "value_ms": value.map(round3),
        "met": value.map(|v| v <= limit_ms),
    })
}

/// `p50(a.metric) - p50(b.metric)`, rounded; null if either is missing.
pub fn p50_difference(a: Option<&Scenario>, b: Option<&Scenario>, metric: &str) -> Value {
    match (a.and_then(|a| a.p50(metric)), b.and_then(|b| b.p50(metric))) {
        (Some(x), Some(y)) => json!(round3(x - y)),
        _ => Value::Null,
    }
}

/// `<rig>-<UTC date>-<short sha>.json` (`nogit` without a commit).
pub fn result_file_name(rig: &str, date: time::Date, commit: Option<&str>) -> String {
    let short: String = commit.map_or("nogit".into(), |c| c.chars().take(7).collect());
    format!("{rig}-{date}-{short}.json")
}

/// What a rig records when it starts: the clock, the checkout, the host and
/// how busy it was.
pub struct Run {
    pub rig: &'static str,
    pub rig_version: u32,
    pub started_at: OffsetDateTime,
    pub git: Value,
    pub host: Value,
    pub load_start: Option<String>,
    pub other_gateways: usize,
}

impl Run {
    pub fn begin(rig: &'static str) -> Self {
        Self {
            rig,
            rig_version: catalogue::find(rig).map_or(1, |r| r.version),
            started_at: OffsetDateTime::now_utc(),
            git: git_facts(),
            host: host_facts(),
            load_start: loadavg(),
            other_gateways: other_gateways(),
        }
    }

    /// Writes the result file into `out_dir` and returns its path and
    /// content. `params` (an object) gains the binaries' facts, the load
    /// averages and the count of other gateways; `notes` gains a line when
    /// either says the host was not quiet.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &self,
        out_dir: &Path,
        mut params: Value,
        bins: &Binaries,
        scenarios: &[Scenario],
        derived: Value,
        targets: Value,
        mut notes: Vec<String>,
    ) -> anyhow::Result<(PathBuf, Value)> {
        let load_end = loadavg();
        if load_is_busy(self.load_start.as_deref()) || load_is_busy(load_end.as_deref()) {
            notes.push(format!(
                "the host was not idle: 1/5/15-min load average {} at start and {} at end on {} cores; other work \
                 competed with the gateway and the client",
                self.load_start.as_deref().unwrap_or("?"),
                load_end.as_deref().unwrap_or("?"),
                cores()
            ));
        }
        if self.other_gateways > 0 {
            notes.push(format!(
                "{} other `copse up` process(es) were running on the host when the rig started",
                self.other_gateways
            ));
        }
        if let Some(p) = params.as_object_mut() {
            p.extend(bins.params().as_object().cloned().unwrap_or_default());
            p.insert("loadavg_start".into(), json!(self.load_start));
            p.insert("loadavg_end".into(), json!(load_end));
            p.insert("other_copse_up_processes_at_start".into(), json!(self.other_gateways));
        }
        let mut host = self.host.clone();
        host["loadavg_start"] = json!(self.load_start);
        host["loadavg_end"] = json!(load_end);
        // The operator's word on what else ran (e.g. "other engineers compiling").
        host["note"] = json!(std::env::var("COPSE_BENCH_HOST_NOTE").ok().filter(|s| !s.is_empty()));
        let metrics: std::collections::BTreeSet<&str> =
            scenarios.iter().flat_map(|s| s.series.keys().map(String::as_str)).collect();
        let clock = catalogue::find(self.rig).map_or(json!({}), |r| catalogue::clock_json(r, metrics));
        let result = json!({
            "rig": self.rig,
            "rig_version": self.rig_version,
            "schema": SCHEMA,
            "started_at": self.started_at.format(&Rfc3339)?,
            "finished_at": OffsetDateTime::now_utc().format(&Rfc3339)?,
            "git": self.git,
            "host": host,
            "clock": clock,
            "params": params,
            "scenarios": scenarios.iter().map(Scenario::to_json).collect::<Vec<_>>(),
            "derived": derived,
            "targets": targets,
            "notes": notes,
        });
        std::fs::create_dir_all(out_dir)?;
        let name = result_file_name(self.rig, self.started_at.date(), self.git["commit"].as_str());
        let out = out_dir.join(name);
        std::fs::write(&out, serde_json::to_string_pretty(&result)? + "\n")?;
        Ok((out, result))
    }
}

/// Prints a written result's targets and SDK overheads, one line each, and where it went.
pub fn print_footer(result: &Value, path: &Path) {
    for t in result["targets"].as_array().into_iter().flatten() {
        println!("target {}: {} (limit {} ms) -> {}", t["claim"], t["value_ms"], t["limit_ms"], t["met"]);
    }
    for (k, v) in result["derived"]["sdk_overhead_ms"].as_object().into_iter().flatten() {
        println!("sdk overhead {k}: {v}");
    }
    println!("wrote {}", path.display());
}

/// Command-line options every rig has: the gateway under test, the SDK's
/// interpreter and where the result goes.
#[derive(clap::Args, Debug, Clone)]
pub struct RigArgs {
    #[command(flatten)]
    pub bins: Binaries,
    /// Python with the pinned E2B SDKs installed.
    #[arg(long, default_value = ".venv/bin/python")]
    pub python: PathBuf,
    /// Skip the SDK measurements.
    #[arg(long)]
    pub skip_sdk: bool,
    /// Where the JSON result goes.
    #[arg(long, default_value = "benchmarks/results")]
    pub out_dir: PathBuf,
}

impl RigArgs {
    /// `params.sdk`: the interpreter and `script`, or null when the SDK part is skipped.
    pub fn sdk_params(&self, script: &Path) -> Value {
        if self.skip_sdk {
            return Value::Null;
        }
        json!({"script": script.display().to_string(), "python": self.python.display().to_string()})
    }
}

/// Output of one SDK measurement script run: `{"sdk"?, "sdk_version",
/// "python_version", "samples": {metric: [number|null]}, "errors": [..]}`.
#[derive(Debug, Clone, PartialEq)]
pub struct SdkRun {
    pub client: String,
    pub series: BTreeMap<String, Vec<Option<f64>>>,
    pub errors: Vec<String>,
}

impl SdkRun {
    pub fn parse(v: &Value) -> anyhow::Result<Self> {
        let mut series = BTreeMap::new();
        for (k, arr) in v["samples"].as_object().context("SDK output without samples")? {
            series.insert(k.clone(), arr.as_array().into_iter().flatten().map(Value::as_f64).collect());
        }
        let client = format!(
            "{} {} (python {})",
            v["sdk"].as_str().unwrap_or("e2b-python-sdk"),
            v["sdk_version"].as_str().unwrap_or("?"),
            v["python_version"].as_str().unwrap_or("?")
        );
        let errors =
            v["errors"].as_array().into_iter().flatten().filter_map(|e| e.as_str().map(String::from)).collect();
        Ok(Self { client, series, errors })
    }

    /// Runs `python script ARGS --out FILE` with the SDK pointed at the
    /// gateway on `addr`, and reads FILE.
    pub fn run(python: &Path, script: &Path, args: &[String], addr: SocketAddr, key: &str) -> anyhow::Result<Self> {
        let stem = script.file_stem().and_then(|s| s.to_str()).unwrap_or("sdk");
        let out = std::env::temp_dir().join(format!("copse-rig-{stem}-{}-{}.json", addr.port(), std::process::id()));
        let url = format!("http://{addr}");
        let status = Command::new(python)
            .arg(script)
            .args(args)
            .arg("--out")
            .arg(&out)
            .env("E2B_API_URL", &url)
            .env("E2B_SANDBOX_URL", &url)
            .env("E2B_API_KEY", key)
            .stdin(Stdio::null())
            .status()
            .with_context(|| format!("running {} {}", python.display(), script.display()))?;
        if !status.success() {
            bail!("SDK script exited with {status}");
        }
        let v: Value = serde_json::from_slice(&std::fs::read(&out)?)?;
        let _ = std::fs::remove_file(&out);
        Self::parse(&v)
    }

    /// A concurrency-1 scenario with `counters.ok` = samples with `ok_metric`.
    pub fn into_scenario(self, name: &str, ok_metric: &str, pool: Option<usize>, pace_ms: Option<f64>) -> Scenario {
        let mut sc = Scenario {
            name: name.into(),
            client: self.client,
            concurrency: 1,
            pool,
            pace_ms,
            series: self.series,
            errors: self.errors,
            ..Scenario::default()
        };
        sc.counters.insert("ok".into(), json!(sc.series.get(ok_metric).map_or(0, Vec::len)));
        sc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(name: &str, values: &[Option<f64>]) -> Scenario {
        let mut s = Scenario { name: name.into(), client: "t".into(), concurrency: 1, ..Scenario::default() };
        s.series.insert("x_ms".into(), values.to_vec());
        s
    }

    #[test]
    fn scenario_json_keeps_alignment_and_counts_errors() {
        let mut s = scenario("a", &[Some(1.23456), None, Some(3.0)]);
        s.errors = (0..25).map(|i| format!("e{i}")).collect();
        let v = s.to_json();
        assert_eq!(v["samples"]["x_ms"], json!([1.235, null, 3.0]));
        assert_eq!(v["summary"]["x_ms"]["n"], 2);
        assert_eq!(v["counters"]["errors"], 25);
        assert_eq!(v["errors"].as_array().unwrap().len(), 20);
        assert_eq!(v["pool"], Value::Null);
        assert_eq!(s.count("x_ms"), 2);

        // A metric sampled less often is padded to the longest series.
        s.series.insert("big_ms".into(), vec![Some(9.0)]);
        let v = s.to_json();
        assert_eq!(v["samples"]["big_ms"], json!([9.0, null, null]));
        assert_eq!(v["summary"]["big_ms"]["n"], 1);
    }

    #[test]
    fn targets_and_differences() {
        let all = [scenario("a", &[Some(4.0), Some(6.0)]), scenario("b", &[Some(1.0)])];
        let t = p50_target(&all, "a fast", "a", "x_ms", 5.0);
        assert_eq!((t["value_ms"].clone(), t["met"].clone()), (json!(5.0), json!(true)));
        let missing = p50_target(&all, "c fast", "c", "x_ms", 5.0);
        assert_eq!((missing["value_ms"].clone(), missing["met"].clone()), (Value::Null, Value::Null));
        assert_eq!(p50_difference(find(&all, "a"), find(&all, "b"), "x_ms"), json!(4.0));
        assert_eq!(p50_difference(find(&all, "a"), None, "x_ms"), Value::Null);
    }

    #[test]
    fn server_timing_columns_and_pool_misses() {
        let t = |v: &[(&str, f64)]| v.iter().map(|(k, x)| (k.to_string(), *x)).collect::<Vec<_>>();
        let timings = vec![t(&[("boot", 0.002), ("total", 2.0)]), vec![], t(&[("boot", 900.0), ("handover", 1.0)])];
        let s = server_timing_series(&timings);
        assert_eq!(s.keys().collect::<Vec<_>>(), ["server_boot_ms", "server_handover_ms", "server_total_ms"]);
        assert_eq!(s["server_boot_ms"], vec![Some(0.002), None, Some(900.0)]);
        assert_eq!(s["server_handover_ms"], vec![None, None, Some(1.0)]);
        let c = pool_miss_counters(&s["server_boot_ms"]);
        assert_eq!((c["pool_miss_known"].clone(), c["pool_misses"].clone()), (json!(2), json!(1)));
    }

    #[test]
    fn file_names() {
        let d = time::macros::date!(2026 - 11 - 22);
        assert_eq!(result_file_name("run-code", d, Some("ceddc5cabcdef")), "run-code-2026-11-22-ceddc5c.json");
        assert_eq!(result_file_name("x", d, None), "x-2026-11-22-nogit.json");
    }

    #[test]
    fn sdk_output() {
        let v = json!({"sdk": "e2b-code-interpreter", "sdk_version": "2.11.5", "python_version": "3.11.2",
                       "samples": {"a_ms": [1.5, null]}, "errors": ["boom"]});
        let r = SdkRun::parse(&v).unwrap();
        assert_eq!(r.client, "e2b-code-interpreter 2.11.5 (python 3.11.2)");
        assert_eq!(r.series["a_ms"], vec![Some(1.5), None]);
        let sc = r.into_scenario("sdk", "a_ms", Some(4), None);
        assert_eq!((sc.counters["ok"].clone(), sc.errors.len(), sc.pool), (json!(2), 1, Some(4)));
        let old = SdkRun::parse(&json!({"sdk_version": "2.63.0", "samples": {}})).unwrap();
        assert_eq!(old.client, "e2b-python-sdk 2.63.0 (python ?)");
        assert!(SdkRun::parse(&json!({})).is_err());
    }
}
