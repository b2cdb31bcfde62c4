//! `copse-site`: renders the committed benchmark results, the published
//! figures of other projects and the docs into a static site that works
//! from `file://` (no scripts, no requests: charts are inline SVG, styles
//! inline, raw JSON copied beside the pages).

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use copse_rigs::catalogue::RIGS;
use copse_site::charts::{self, Bar};
use copse_site::model::{self, ResultFile, fmt, fmt_value};
use minijinja::{Environment, context};
use serde_json::{Value, json};

#[derive(Parser, Debug)]
#[command(version, about = "Build the static site from benchmarks/results and docs/")]
struct Args {
    #[arg(long, default_value = "benchmarks/results")]
    results: PathBuf,
    #[arg(long, default_value = "benchmarks/published.json")]
    published: PathBuf,
    #[arg(long, default_value = "docs")]
    docs: PathBuf,
    #[arg(long, default_value = "benchmarks/schema.md")]
    schema_doc: PathBuf,
    #[arg(long, default_value = "site/dist")]
    out: PathBuf,
}

/// Home-page figures: label, rig, scenario, metric, stat, unit.
const HEADLINES: &[(&str, &str, &str, &str, &str, &str)] = &[
    ("Create → first command, warm pool, p50", "create-latency", "lean-warm-cc1", "total_ms", "p50", "ms"),
    ("Create → first command, cold, p50", "create-latency", "lean-cold-cc1", "total_ms", "p50", "ms"),
    ("Cold creates per second at concurrency 50", "create-latency", "lean-cold-cc50", "", "throughput_per_s", "/s"),
    ("Create → first run_code result, pooled, p50", "run-code", "lean-pooled", "first_result_ms", "p50", "ms"),
    ("Warm run_code round trip, p50", "run-code", "lean-warm-roundtrip", "roundtrip_ms", "p50", "ms"),
    (
        "Create → first JavaScript runCode result, pooled, p50",
        "run-code",
        "lean-pooled-js",
        "first_result_ms",
        "p50",
        "ms",
    ),
    ("Warm JavaScript runCode round trip, p50", "run-code", "lean-warm-roundtrip-js", "roundtrip_ms", "p50", "ms"),
    ("Idle base sandboxes held", "density", "base-memory", "sandboxes", "last", "sandboxes"),
    ("Host memory per idle base sandbox", "density", "base-memory", "avail_per_sandbox_mib", "last", "MiB"),
    (
        "Host memory per code-interpreter sandbox, kernel running",
        "density",
        "code-interpreter-v1-memory",
        "avail_per_sandbox_mib",
        "last",
        "MiB",
    ),
    ("Snippet requests per second, sandbox reused", "load", "reused", "", "throughput_per_s", "/s"),
    ("Snippet requests per second, fresh sandbox per request", "load", "fresh-pooled", "", "throughput_per_s", "/s"),
    ("Pause, memory kept, p50", "pause-resume", "pause-resume-memory-c1", "pause_ms", "p50", "ms"),
    ("Resume through connect, p50", "pause-resume", "pause-resume-memory-c1", "resume_ms", "p50", "ms"),
    ("Snapshot with 100 MB written, p50", "snapshot-dirty", "dirty-100mb", "snapshot_ms", "p50", "ms"),
    ("Create from a 1 GiB snapshot, p50", "from-snapshot", "from-1024mb", "create_ms", "p50", "ms"),
    ("Clone 100 sandboxes (10 requests), wall, p50", "clone", "clone-100-c10", "wall_ms", "p50", "ms"),
    ("Sandbox → peer TCP round trip, p50", "net", "rtt-sandbox-peer", "rtt_ms", "p50", "ms"),
    (
        "Sandbox → peer HTTP request through the egress proxy with a rule, new connection, p50",
        "egress",
        "http-proxy-rule",
        "new_conn_ms",
        "p50",
        "ms",
    ),
    (
        "Sandbox → peer HTTPS request through the egress proxy with a rule, new connection, p50",
        "egress",
        "https-proxy-rule",
        "new_conn_ms",
        "p50",
        "ms",
    ),
    ("Volume sequential write with fsync, p50", "egress", "volume-io", "write_ms", "p50", "ms"),
    ("Cached rebuild of a small template, p50", "template", "build-cached", "build_ms", "p50", "ms"),
    ("Create → first command, own template restored running, p50", "template", "running-exec", "total_ms", "p50", "ms"),
    (
        "Create → first run_code result, no pool, p50",
        "template",
        "code-interpreter-cold",
        "first_result_ms",
        "p50",
        "ms",
    ),
];

/// The metric a scenario's bar shows: the first of these it recorded.
const PRIMARY: &[&str] = &[
    "total_ms",
    "first_http_ms",
    "build_ms",
    "first_result_ms",
    "roundtrip_ms",
    "latency_ms",
    "create_ms",
    "fork_exec_ms",
    "unshare_ms",
    "runc_ms",
    "podman_ms",
    "spawn_true_ms",
    // Lifecycle and network rigs: the operation each scenario times.
    "pause_ms",
    "snapshot_ms",
    "rollback_ms",
    "wall_ms",
    "rtt_ms",
    "update_ms",
    "attach_ms",
    // Egress rig: a request on a new connection; the volume/own-disk write.
    "new_conn_ms",
    "write_ms",
];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let results = model::load(&args.results)?;
    let mut env = Environment::new();
    env.add_template("layout.html", include_str!("../templates/layout.html"))?;
    env.add_template("index.html", include_str!("../templates/index.html"))?;
    env.add_template("rig.html", include_str!("../templates/rig.html"))?;
    env.add_template("compare.html", include_str!("../templates/compare.html"))?;
    env.add_template("prose.html", include_str!("../templates/prose.html"))?;
    std::fs::create_dir_all(args.out.join("results"))?;
    let write = |name: &str, html: String| std::fs::write(args.out.join(name), html);

    // Every catalogued rig, then any rig that only a result file names.
    let mut rigs: Vec<(String, String, String)> =
        RIGS.iter().map(|r| (r.name.to_string(), r.title.to_string(), r.task.to_string())).collect();
    for name in results.keys() {
        if !rigs.iter().any(|r| &r.0 == name) {
            rigs.push((name.clone(), name.clone(), format!("bench:{name}")));
        }
    }
    let mut rig_rows = Vec::new();
    for (name, title, task) in &rigs {
        let files = results.get(name).map(Vec::as_slice).unwrap_or_default();
        for f in files {
            std::fs::copy(args.results.join(&f.file), args.out.join("results").join(&f.file))?;
        }
        let page = format!("rig-{name}.html");
        let ctx = rig_context(name, title, task, files)?;
        write(&page, env.get_template("rig.html")?.render(ctx)?)?;
        rig_rows.push(json!({"title": title, "task": task, "href": page, "file": files.first().map(|f| &f.file)}));
    }

    let headlines = headlines(&results);
    write(
        "index.html",
        env.get_template("index.html")?.render(context! {
            title => "measured numbers", headlines, rigs => rig_rows,
        })?,
    )?;

    let published: Value = serde_json::from_slice(&std::fs::read(&args.published)?).context("published.json")?;
    write("compare.html", env.get_template("compare.html")?.render(compare_context(&published, &results))?)?;

    let prose = |md: &str| {
        let mut html = String::new();
        pulldown_cmark::html::push_html(
            &mut html,
            pulldown_cmark::Parser::new_ext(md, pulldown_cmark::Options::ENABLE_TABLES),
        );
        html
    };
    let read = |p: PathBuf| std::fs::read_to_string(&p).with_context(|| p.display().to_string());
    let methodology = prose(&read(args.schema_doc.clone())?);
    write("methodology.html", env.get_template("prose.html")?.render(context! {
        title => "Methodology",
        lead => "How every number is measured and recorded: the result schema every rig writes (benchmarks/schema.md). Percentiles interpolate linearly between closest ranks; summaries are computed by one library (copse-rigs) from the raw samples stored in each file.",
        html => methodology,
    })?)?;
    write(
        "architecture.html",
        env.get_template("prose.html")?.render(context! {
            title => "Architecture", lead => "", html => prose(&read(args.docs.join("ARCHITECTURE.md"))?),
        })?,
    )?;
    let substrates: std::collections::BTreeSet<String> =
        results.values().flatten().filter_map(|f| f.json["host"]["substrate"].as_str().map(String::from)).collect();
    let lead = format!(
        "What exists for FreeBSD and what has not been run. Substrates with committed results on this site: {}. \
         Nothing on this site was measured on FreeBSD; the FreeBSD code is compiled and linted for \
         x86_64-unknown-freebsd and its pure logic golden-tested on Linux — not run on FreeBSD.",
        substrates.into_iter().collect::<Vec<_>>().join(", ")
    );
    write(
        "freebsd.html",
        env.get_template("prose.html")?.render(context! {
            title => "FreeBSD", lead, html => prose(&read(args.docs.join("freebsd.md"))?),
        })?,
    )?;
    println!("site written to {}", args.out.display());
    Ok(())
}

/// The home page's figures, each from the newest result that recorded it.
fn headlines(results: &std::collections::BTreeMap<String, Vec<ResultFile>>) -> Vec<Value> {
    HEADLINES
        .iter()
        .map(|(label, rig, sc, metric, stat, unit)| {
            let task = RIGS.iter().find(|r| r.name == *rig).map_or(String::new(), |r| r.task.to_string());
            let newest = model::newest_figure(results.get(*rig), sc, metric, stat);
            let latest = newest.map(|(f, _)| f).or_else(|| results.get(*rig).and_then(|f| f.first()));
            let value = newest.map(|(_, v)| v);
            json!({
                "label": label, "unit": unit, "task": task,
                "value": value.map(fmt),
                "href": format!("rig-{rig}.html#{sc}"),
                "detail": latest.map(|f| format!("{sc} · {} · {}", if metric.is_empty() { stat } else { metric }, f.file)),
            })
        })
        .collect()
}

fn rig_context(name: &str, title: &str, task: &str, files: &[ResultFile]) -> anyhow::Result<minijinja::Value> {
    let rig = json!({"name": name, "title": title, "task": task});
    let Some(latest) = files.first() else {
        return Ok(context! { title, rig });
    };
    let j = &latest.json;
    let scenarios_json = j["scenarios"].as_array().cloned().unwrap_or_default();
    let mut scenarios = Vec::new();
    let mut bars = Vec::new();
    for s in &scenarios_json {
        let metrics: Vec<Value> = s["summary"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(m, st)| {
                let g = |k: &str| fmt_value(&st[k]);
                json!({"metric": m, "n": g("n"), "mean": g("mean"), "min": g("min"), "p50": g("p50"),
                       "p95": g("p95"), "p99": g("p99"), "max": g("max")})
            })
            .collect();
        if let Some(m) = PRIMARY.iter().find(|m| s["summary"][**m].is_object()) {
            let st = &s["summary"][*m];
            if let (Some(p50), Some(p95)) = (st["p50"].as_f64(), st["p95"].as_f64()) {
                bars.push(Bar { label: format!("{} · {m}", s["name"].as_str().unwrap_or("?")), p50, p95 });
            }
        }
        let counters = s["counters"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k} {}", fmt_value(v)))
            .collect::<Vec<_>>()
            .join(", ");
        scenarios.push(json!({
            "name": s["name"], "client": s["client"], "concurrency": s["concurrency"], "pool": fmt_value(&s["pool"]),
            "wall": fmt_value(&s["wall_ms"]), "throughput": fmt_value(&s["throughput_per_s"]),
            "amortized": fmt_value(&s["amortized_ms"]), "counters": counters, "metrics": metrics,
        }));
    }
    let mut chart_svgs = Vec::new();
    if !bars.is_empty() {
        chart_svgs.push(charts::bars(&format!("{title}: p50 (bar) and p95 (line) per scenario"), "ms", &bars)?);
    }
    // One chart per template: their scales differ by two orders of magnitude.
    for sc in scenarios_json.iter().filter(|s| s["samples"]["sandboxes"].is_array()) {
        let name = sc["name"].as_str().unwrap_or("?").trim_end_matches("-memory");
        let x: Vec<Option<f64>> =
            sc["samples"]["sandboxes"].as_array().into_iter().flatten().map(Value::as_f64).collect();
        let series: Vec<(String, Vec<(f64, f64)>)> = ["avail_per_sandbox_mib", "cgroup_per_sandbox_mib"]
            .iter()
            .map(|m| {
                let y = sc["samples"][*m].as_array().cloned().unwrap_or_default();
                let pts = x.iter().zip(y.iter()).filter_map(|(x, y)| Some(((*x)?, y.as_f64()?))).collect();
                (m.to_string(), pts)
            })
            .collect();
        let caption = format!("{name}: host memory per sandbox by sandboxes alive");
        chart_svgs.push(charts::lines(&caption, "sandboxes alive", "MiB per sandbox", &series)?);
    }
    let clock: Vec<Value> = j["clock"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(m, d)| json!({"metric": m, "def": d.as_str().unwrap_or("not defined by this rig version")}))
        .collect();
    let host: Vec<Value> =
        j["host"].as_object().into_iter().flatten().map(|(k, v)| json!({"key": k, "value": fmt_value(v)})).collect();
    let targets: Vec<Value> = j["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            json!({"claim": t["claim"], "value": fmt_value(&t["value_ms"]), "met": fmt_value(&t["met"]),
                   "note": t["note"]})
        })
        .collect();
    // Ratios to the anchors, one row per tier (create-latency's derived.ratio_p50).
    let ratio_rows: Vec<Value> = j["derived"]["ratio_p50"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(tier, r)| {
            let cells: Vec<Value> =
                r.as_object().into_iter().flatten().map(|(k, v)| json!({"key": k, "value": fmt_value(v)})).collect();
            json!({"tier": tier, "cells": cells})
        })
        .collect();
    let others: Vec<Value> =
        files[1..].iter().map(|f| json!({"file": f.file, "started_at": f.json["started_at"]})).collect();
    Ok(context! {
        title, rig,
        file => latest.file,
        started_at => j["started_at"],
        commit => j["git"]["commit"],
        dirty => j["git"]["dirty"],
        charts => chart_svgs,
        scenarios, clock, host, targets, others, ratio_rows,
        notes => j["notes"],
        derived => serde_json::to_string_pretty(&j["derived"])?,
        params => serde_json::to_string_pretty(&j["params"])?,
    })
}

fn compare_context(
    published: &Value,
    results: &std::collections::BTreeMap<String, Vec<ResultFile>>,
) -> minijinja::Value {
    let figures: Vec<Value> = published["figures"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| {
            let c = &f["compare_to"];
            let rig = c["rig"].as_str().unwrap_or("");
            let latest = results.get(rig).and_then(|v| v.first());
            let (sc, metric, stat) = (
                c["scenario"].as_str().unwrap_or(""),
                c["metric"].as_str().unwrap_or(""),
                c["stat"].as_str().unwrap_or(""),
            );
            let value = model::newest_figure(results.get(rig), sc, metric, stat).map(|(_, v)| v);
            let missing = if latest.is_none() {
                format!("not yet measured ({rig})")
            } else {
                format!("no like-for-like figure in the {rig} result yet")
            };
            json!({
                "project": f["project"], "what": f["what"], "value": fmt_value(&f["value"]), "unit": f["unit"],
                "source": f["source"], "url": f["url"],
                "copse": value.map(fmt),
                "copse_href": format!("rig-{rig}.html#{sc}"),
                "copse_label": format!("{} {stat} of {sc}", metric),
                "copse_missing": missing,
            })
        })
        .collect();
    context! { title => "Comparison", about => published["about"], figures }
}

#[cfg(test)]
mod tests {
    use super::*;
    use copse_rigs::Scenario;

    fn scenario(name: &str, metric: &str, values: &[f64]) -> Value {
        let mut s = Scenario { name: name.into(), client: "lean-rust".into(), concurrency: 1, ..Scenario::default() };
        s.series.insert(metric.into(), values.iter().map(|v| Some(*v)).collect());
        s.to_json()
    }

    /// A result as `copse-rig-template` writes it (the scenarios and targets it records).
    fn template_result() -> ResultFile {
        let json = json!({
            "rig": "template", "started_at": "2026-11-27T03:00:00Z",
            "git": {"commit": "abc1234", "dirty": false},
            "host": {"cores": 2},
            "clock": {"build_ms": "copse template build spawned → exited 0"},
            "params": {}, "derived": {}, "notes": ["a note"],
            "scenarios": [
                scenario("build-cold", "build_ms", &[2200.0, 2400.0]),
                scenario("build-cached", "build_ms", &[610.0, 630.0]),
                scenario("running-exec", "total_ms", &[120.0, 140.0]),
                scenario("running-http", "first_http_ms", &[125.0, 145.0]),
                scenario("boot-http", "first_http_ms", &[900.0, 950.0]),
                scenario("code-interpreter-cold", "first_result_ms", &[230.0, 250.0]),
            ],
            "targets": [{"claim": "cached rebuild of a small template <= 1 s (p50)", "value_ms": 620.0, "met": true}],
        });
        ResultFile { file: "template-2026-11-27-abc1234.json".into(), json }
    }

    #[test]
    fn a_template_result_renders_its_page() {
        let mut env = Environment::new();
        env.add_template("layout.html", include_str!("../templates/layout.html")).unwrap();
        env.add_template("rig.html", include_str!("../templates/rig.html")).unwrap();
        let rig = copse_rigs::catalogue::find("template").unwrap();
        let ctx = rig_context(rig.name, rig.title, rig.task, &[template_result()]).unwrap();
        let html = env.get_template("rig.html").unwrap().render(ctx).unwrap();
        for needle in [
            "template-2026-11-27-abc1234.json",
            "bench:template",
            "code-interpreter-cold",
            "cached rebuild of a small template",
            "<svg",
            // Each scenario's bar shows the metric it times.
            "build-cached · build_ms",
            "running-http · first_http_ms",
            "running-exec · total_ms",
        ] {
            assert!(html.contains(needle), "{needle} missing from the page");
        }
    }

    /// A result as `copse-rig-egress` writes it when the gateway does not
    /// intercept HTTPS: the HTTP scenarios, the disks, and the HTTPS target
    /// with no value and the reason.
    fn egress_result() -> ResultFile {
        let mut scenarios = Vec::new();
        for (name, v) in [("http-direct", 1.2), ("http-proxy-name", 1.9), ("http-proxy-rule", 2.1)] {
            let mut s = Scenario { name: name.into(), client: "python3".into(), concurrency: 1, ..Scenario::default() };
            s.series.insert("new_conn_ms".into(), vec![Some(v), Some(v + 0.2)]);
            s.series.insert("keepalive_ms".into(), vec![Some(v / 2.0), Some(v / 2.0)]);
            scenarios.push(s);
        }
        let disk = |name: &str, w: f64| {
            copse_rigs::egress_probe::disk_scenario(
                name,
                "python3",
                256,
                &[copse_rigs::egress_probe::DiskRound {
                    buffered: Some(w / 2.0),
                    fsynced: Some(w),
                    synced: Some(w * 1.5),
                    read: Some(w / 3.0),
                }],
            )
        };
        scenarios.push(disk("rootfs-io", 400.0));
        scenarios.push(disk("volume-io", 420.0));
        let unsupported = std::collections::BTreeMap::from([("https", "not supported by this gateway".to_string())]);
        let targets = copse_rigs::egress_probe::targets(&scenarios, &unsupported);
        let json = json!({
            "rig": "egress", "started_at": "2026-11-27T10:00:00Z",
            "git": {"commit": "def5678", "dirty": false},
            "host": {"cores": 2},
            "clock": {"new_conn_ms": "before connect → last byte"},
            "params": {"schemes": {"http": "measured", "https": "https: not supported by this gateway"}},
            "derived": {}, "notes": ["https: not supported by this gateway; its scenarios were not run"],
            "scenarios": scenarios.iter().map(Scenario::to_json).collect::<Vec<_>>(),
            "targets": targets,
        });
        ResultFile { file: "egress-2026-11-27-def5678.json".into(), json }
    }

    #[test]
    fn an_egress_result_renders_its_page_and_headlines() {
        let mut env = Environment::new();
        env.add_template("layout.html", include_str!("../templates/layout.html")).unwrap();
        env.add_template("rig.html", include_str!("../templates/rig.html")).unwrap();
        let rig = copse_rigs::catalogue::find("egress").unwrap();
        let ctx = rig_context(rig.name, rig.title, rig.task, &[egress_result()]).unwrap();
        let html = env.get_template("rig.html").unwrap().render(ctx).unwrap();
        for needle in [
            "egress-2026-11-27-def5678.json",
            "bench:egress",
            "http-proxy-rule · new_conn_ms",
            "volume-io · write_ms",
            "write_mib_per_s",
            "adds &lt;= 1 ms p50 to a new-connection HTTPS request",
            "https: not supported by this gateway",
            "<svg",
        ] {
            assert!(html.contains(needle), "{needle} missing from the page");
        }
        let results = std::collections::BTreeMap::from([("egress".to_string(), vec![egress_result()])]);
        let h = headlines(&results);
        let value = |label: &str| h.iter().find(|x| x["label"] == label).map(|x| x["value"].clone());
        assert_eq!(
            value("Sandbox → peer HTTP request through the egress proxy with a rule, new connection, p50"),
            Some(json!("2.20"))
        );
        assert_eq!(
            value("Sandbox → peer HTTPS request through the egress proxy with a rule, new connection, p50"),
            Some(Value::Null)
        );
        assert_eq!(value("Volume sequential write with fsync, p50"), Some(json!("420")));
    }

    #[test]
    fn template_headlines_quote_the_newest_result() {
        let results = std::collections::BTreeMap::from([("template".to_string(), vec![template_result()])]);
        let h = headlines(&results);
        let value = |label: &str| h.iter().find(|x| x["label"] == label).map(|x| x["value"].clone());
        assert_eq!(value("Cached rebuild of a small template, p50"), Some(json!("620")));
        assert_eq!(value("Create → first command, own template restored running, p50"), Some(json!("130")));
        assert_eq!(value("Create → first run_code result, no pool, p50"), Some(json!("240")));
        assert_eq!(value("Create → first command, cold, p50"), Some(Value::Null));
    }
}
