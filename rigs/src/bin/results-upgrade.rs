//! Upgrades schema-1 result files to schema 2 in place: summaries are
//! recomputed from the unchanged raw samples (adding p99), the clock
//! definitions come from the rig catalogue, the load averages move into the
//! host facts, and what was never recorded (wall time) becomes null.

use anyhow::Context;
use copse_rigs::Summary;
use copse_rigs::catalogue;
use copse_rigs::report::SCHEMA;
use serde_json::{Value, json};

fn main() -> anyhow::Result<()> {
    for path in std::env::args().skip(1) {
        let mut v: Value = serde_json::from_slice(&std::fs::read(&path)?).with_context(|| path.clone())?;
        if v["schema"] != json!(1) {
            println!("{path}: schema {}, left alone", v["schema"]);
            continue;
        }
        upgrade(&mut v)?;
        std::fs::write(&path, serde_json::to_string_pretty(&v)? + "\n")?;
        println!("{path}: upgraded to schema {SCHEMA}");
    }
    Ok(())
}

fn upgrade(v: &mut Value) -> anyhow::Result<()> {
    let rig = catalogue::find(v["rig"].as_str().unwrap_or("")).context("rig not in the catalogue")?;
    let mut metrics = std::collections::BTreeSet::new();
    for sc in v["scenarios"].as_array_mut().context("no scenarios")? {
        let mut summary = serde_json::Map::new();
        for (metric, values) in sc["samples"].as_object().context("no samples")? {
            metrics.insert(metric.clone());
            let xs: Vec<f64> = values.as_array().into_iter().flatten().filter_map(Value::as_f64).collect();
            if let Some(s) = Summary::of(&xs) {
                summary.insert(metric.clone(), s.to_json());
            }
        }
        sc["summary"] = Value::Object(summary);
        sc["wall_ms"] = Value::Null;
        sc["throughput_per_s"] = Value::Null;
        sc["amortized_ms"] = Value::Null;
    }
    v["schema"] = json!(SCHEMA);
    v["rig_version"] = json!(1);
    v["clock"] = catalogue::clock_json(rig, metrics.iter().map(String::as_str));
    v["host"]["loadavg_start"] = v["params"]["loadavg_start"].clone();
    v["host"]["loadavg_end"] = v["params"]["loadavg_end"].clone();
    v["host"]["note"] = Value::Null;
    if let Some(notes) = v["notes"].as_array_mut() {
        notes.push(json!(
            "upgraded from result schema 1: summaries recomputed from the unchanged raw samples by copse-rig-common \
             (adds p99); this rig version did not record wall time, so wall_ms, throughput_per_s and amortized_ms are null"
        ));
    }
    Ok(())
}
