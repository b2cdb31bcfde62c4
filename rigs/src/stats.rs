//! Summary statistics and `Server-Timing` parsing (pure).

use serde_json::{Value, json};

/// Parses a `Server-Timing` header value (`boot;dur=1.2, handover;dur=0.3`)
/// into `(name, milliseconds)` pairs, in order. Metrics without a `dur`
/// parameter or with an unparsable one are skipped; parameter names are
/// case-insensitive and values may be quoted.
pub fn parse_server_timing(header: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for metric in header.split(',') {
        let mut parts = metric.split(';');
        let name = parts.next().unwrap_or("").trim();
        if name.is_empty() {
            continue;
        }
        let dur = parts.filter_map(|p| p.split_once('=')).find_map(|(k, v)| {
            if k.trim().eq_ignore_ascii_case("dur") { v.trim().trim_matches('"').parse::<f64>().ok() } else { None }
        });
        if let Some(ms) = dur.filter(|ms| ms.is_finite()) {
            out.push((name.to_string(), ms));
        }
    }
    out
}

/// p50/p95/p99/min/max/mean over the present values of one sample series.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
}

impl Summary {
    /// `None` when there is no value at all.
    pub fn of(values: &[f64]) -> Option<Self> {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(Self {
            n: v.len(),
            p50: percentile_sorted(&v, 50.0),
            p95: percentile_sorted(&v, 95.0),
            p99: percentile_sorted(&v, 99.0),
            min: v[0],
            max: v[v.len() - 1],
            mean: v.iter().sum::<f64>() / v.len() as f64,
        })
    }

    pub fn to_json(&self) -> Value {
        json!({
            "n": self.n,
            "p50": round3(self.p50),
            "p95": round3(self.p95),
            "p99": round3(self.p99),
            "min": round3(self.min),
            "max": round3(self.max),
            "mean": round3(self.mean),
        })
    }
}

/// Percentile by linear interpolation between closest ranks (the
/// "linear"/type-7 method, numpy's default) over an ascending slice.
pub fn percentile_sorted(sorted: &[f64], pct: f64) -> f64 {
    assert!(!sorted.is_empty(), "percentile of nothing");
    let rank = (pct / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_timing_spec_format() {
        let t = parse_server_timing("boot;dur=12.5, handover;dur=0.3, total;dur=13.1");
        assert_eq!(t, vec![("boot".into(), 12.5), ("handover".into(), 0.3), ("total".into(), 13.1)]);
    }

    #[test]
    fn server_timing_odd_but_legal() {
        let t = parse_server_timing(r#"db;desc="x";DUR="2",cache, miss;dur=abc,  app ; dur = 0 ,"#);
        assert_eq!(t, vec![("db".into(), 2.0), ("app".into(), 0.0)]);
        assert!(parse_server_timing("").is_empty());
    }

    #[test]
    fn percentiles_interpolate() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!(s.n, 100);
        assert!((s.p50 - 50.5).abs() < 1e-9);
        assert!((s.p95 - 95.05).abs() < 1e-9);
        assert!((s.p99 - 99.01).abs() < 1e-9);
        assert_eq!((s.min, s.max), (1.0, 100.0));
        assert!((s.mean - 50.5).abs() < 1e-9);
    }

    #[test]
    fn percentiles_small_and_unsorted() {
        let s = Summary::of(&[5.0, 1.0, f64::NAN, 3.0]).unwrap();
        assert_eq!((s.n, s.p50, s.min, s.max), (3, 3.0, 1.0, 5.0));
        assert!((s.p95 - 4.8).abs() < 1e-9);
        assert_eq!(Summary::of(&[7.0]).unwrap().p95, 7.0);
        assert!(Summary::of(&[]).is_none());
    }
}
