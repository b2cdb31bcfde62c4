//! Pure pieces of the load rig: reading hey's per-request CSV.

use anyhow::Context;

/// What hey recorded about one request.
#[derive(Debug, Clone, PartialEq)]
pub struct HeyRequest {
    /// Request start → response read, ms.
    pub latency_ms: f64,
    pub status: u16,
    /// Start of the request since hey started, ms.
    pub offset_ms: f64,
}

/// Parses `hey -o csv` output: a header, then
/// `response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset`
/// with times in seconds.
pub fn parse_hey_csv(csv: &str) -> anyhow::Result<Vec<HeyRequest>> {
    let mut lines = csv.lines().filter(|l| !l.trim().is_empty());
    let header = lines.next().context("hey wrote nothing")?;
    let cols: Vec<&str> = header.split(',').collect();
    let idx = |name: &str| cols.iter().position(|c| *c == name).with_context(|| format!("hey CSV without {name}"));
    let (rt, st, off) = (idx("response-time")?, idx("status-code")?, idx("offset")?);
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let num = |i: usize| {
                f.get(i).and_then(|v| v.trim().parse::<f64>().ok()).with_context(|| format!("bad line {l:?}"))
            };
            Ok(HeyRequest { latency_ms: num(rt)? * 1000.0, status: num(st)? as u16, offset_ms: num(off)? * 1000.0 })
        })
        .collect()
}

/// First request sent → last response read, ms.
pub fn wall_ms(reqs: &[HeyRequest]) -> Option<f64> {
    let start = reqs.iter().map(|r| r.offset_ms).fold(f64::INFINITY, f64::min);
    let end = reqs.iter().map(|r| r.offset_ms + r.latency_ms).fold(f64::NEG_INFINITY, f64::max);
    (start.is_finite() && end > start).then_some(end - start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hey_csv() {
        let csv = "response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset\n\
                   0.0120,0.0001,0.0000,0.0000,0.0118,0.0001,200,0.0010\n\
                   0.0300,0.0000,0.0000,0.0000,0.0290,0.0001,500,0.0050\n";
        let r = parse_hey_csv(csv).unwrap();
        assert_eq!(r.len(), 2);
        assert!((r[0].latency_ms - 12.0).abs() < 1e-9);
        assert_eq!(r[1].status, 500);
        assert!((wall_ms(&r).unwrap() - 34.0).abs() < 1e-9);
        assert!(parse_hey_csv("").is_err());
        assert!(parse_hey_csv("a,b\n1,2\n").is_err());
    }
}
