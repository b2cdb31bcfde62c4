//! The committed results as the site sees them: every file, grouped by rig,
//! newest first, and the figures pages quote from them.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde_json::Value;

pub struct ResultFile {
    pub file: String,
    pub json: Value,
}

impl ResultFile {
    pub fn scenario(&self, name: &str) -> Option<&Value> {
        self.json["scenarios"].as_array()?.iter().find(|s| s["name"] == name)
    }

    /// One figure of a scenario: a summary statistic of a metric
    /// (`p50`, `p95`, …), `last` (the metric's last recorded value) or a
    /// scenario field (`throughput_per_s`, `amortized_ms`, `wall_ms`).
    pub fn figure(&self, scenario: &str, metric: &str, stat: &str) -> Option<f64> {
        let s = self.scenario(scenario)?;
        match stat {
            "last" => s["samples"][metric].as_array()?.iter().rev().find_map(Value::as_f64),
            "throughput_per_s" | "amortized_ms" | "wall_ms" => s[stat].as_f64(),
            _ => s["summary"][metric][stat].as_f64(),
        }
    }
}

/// Every `*.json` in `dir`, grouped by `rig`, newest `started_at` first.
pub fn load(dir: &Path) -> anyhow::Result<BTreeMap<String, Vec<ResultFile>>> {
    let mut by_rig: BTreeMap<String, Vec<ResultFile>> = BTreeMap::new();
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    for p in paths {
        let json: Value = serde_json::from_slice(&std::fs::read(&p)?).with_context(|| p.display().to_string())?;
        let rig = json["rig"].as_str().with_context(|| format!("{}: no rig", p.display()))?.to_string();
        let file = p.file_name().unwrap_or_default().to_string_lossy().into_owned();
        by_rig.entry(rig).or_default().push(ResultFile { file, json });
    }
    for files in by_rig.values_mut() {
        files.sort_by(|a, b| b.json["started_at"].as_str().cmp(&a.json["started_at"].as_str()));
    }
    Ok(by_rig)
}

/// A number as the site prints it: integers whole, otherwise 3 significant
/// decimals at most (the test accepts a printed number when a committed
/// value rounds to it).
pub fn fmt(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// `fmt` of a JSON value; strings and other values as they are, null as "–".
pub fn fmt_value(v: &Value) -> String {
    match v {
        Value::Number(n) => n.as_f64().map_or_else(|| n.to_string(), fmt),
        Value::String(s) => s.clone(),
        Value::Null => "–".into(),
        other => other.to_string(),
    }
}

/// The newest of a rig's results (newest first, as `load` sorts them) that
/// recorded the figure: a run of only some scenarios (a before/after pair
/// at two concurrency levels) leaves the others' figures where they were.
pub fn newest_figure<'a>(
    files: Option<&'a Vec<ResultFile>>,
    scenario: &str,
    metric: &str,
    stat: &str,
) -> Option<(&'a ResultFile, f64)> {
    files?.iter().find_map(|f| f.figure(scenario, metric, stat).map(|v| (f, v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(fmt(1000.0), "1000");
        assert_eq!(fmt(1316.28), "1316.3");
        assert_eq!(fmt(27.126), "27.13");
        assert_eq!(fmt(0.0654), "0.065");
        assert_eq!(fmt_value(&Value::Null), "–");
    }

    #[test]
    fn the_newest_result_with_the_figure_gives_it() {
        let file = |name: &str, scenario: &str| ResultFile {
            file: name.into(),
            json: serde_json::json!({"scenarios": [{"name": scenario, "wall_ms": 1.0}]}),
        };
        let files = vec![file("new.json", "c1"), file("old.json", "c50")];
        assert_eq!(newest_figure(Some(&files), "c1", "", "wall_ms").map(|(f, _)| f.file.as_str()), Some("new.json"));
        assert_eq!(newest_figure(Some(&files), "c50", "", "wall_ms").map(|(f, _)| f.file.as_str()), Some("old.json"));
        assert!(newest_figure(Some(&files), "c10", "", "wall_ms").is_none());
    }

    #[test]
    fn figures() {
        let r = ResultFile {
            file: "x.json".into(),
            json: serde_json::json!({"scenarios": [{"name": "a", "throughput_per_s": 4.5,
                "samples": {"m": [1.0, 2.0, null]}, "summary": {"m": {"p50": 1.5}}}]}),
        };
        assert_eq!(r.figure("a", "m", "p50"), Some(1.5));
        assert_eq!(r.figure("a", "m", "last"), Some(2.0));
        assert_eq!(r.figure("a", "", "throughput_per_s"), Some(4.5));
        assert_eq!(r.figure("b", "m", "p50"), None);
    }
}
