//! Pure pieces of the create-latency rig: Server-Timing parsing, summary
//! statistics and Connect-RPC envelope decoding. Everything that touches the
//! network, processes or the clock lives in `main.rs`.

use anyhow::{Context, bail};
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

/// p50/p95/min/max/mean over the present values of one sample series.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub p50: f64,
    pub p95: f64,
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

/// Connect streaming envelope flags.
pub const FLAG_COMPRESSED: u8 = 0x01;
pub const FLAG_END_STREAM: u8 = 0x02;

/// One Connect envelope: flags byte and payload.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub flags: u8,
    pub data: Vec<u8>,
}

/// Wraps one message in a Connect envelope (`flags, u32 BE length, data`).
pub fn encode_envelope(flags: u8, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + data.len());
    out.push(flags);
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Incremental decoder: feed body chunks as they arrive, take whole
/// envelopes out.
#[derive(Debug, Default)]
pub struct EnvelopeDecoder {
    buf: Vec<u8>,
}

impl EnvelopeDecoder {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete envelope, `None` if more bytes are needed.
    pub fn next_envelope(&mut self) -> anyhow::Result<Option<Envelope>> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        if flags & FLAG_COMPRESSED != 0 {
            bail!("compressed envelope (flags {flags:#04x}) although identity was requested");
        }
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        let data = self.buf[5..5 + len].to_vec();
        self.buf.drain(..5 + len);
        Ok(Some(Envelope { flags, data }))
    }

    /// Bytes received but not yet part of a complete envelope.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// What a `process.Process/Start` stream envelope means to the rig.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamItem {
    Start {
        pid: Option<u64>,
    },
    Data,
    Keepalive,
    End {
        exit_code: i64,
        error: Option<String>,
    },
    /// The end-of-stream envelope (flag 0x02); `error` if it carried one.
    EndOfStream {
        error: Option<String>,
    },
    Other,
}

/// Interprets one envelope of a Start/Connect server stream.
pub fn classify(env: &Envelope) -> anyhow::Result<StreamItem> {
    let v: Value = if env.data.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&env.data).context("stream envelope is not JSON")?
    };
    if env.flags & FLAG_END_STREAM != 0 {
        let error = v.get("error").map(|e| {
            let code = e.get("code").and_then(Value::as_str).unwrap_or("unknown");
            let msg = e.get("message").and_then(Value::as_str).unwrap_or("");
            format!("{code}: {msg}")
        });
        return Ok(StreamItem::EndOfStream { error });
    }
    let Some(event) = v.get("event") else { return Ok(StreamItem::Other) };
    if let Some(start) = event.get("start") {
        return Ok(StreamItem::Start { pid: start.get("pid").and_then(as_i64).map(|p| p as u64) });
    }
    if event.get("data").is_some() {
        return Ok(StreamItem::Data);
    }
    if event.get("keepalive").is_some() {
        return Ok(StreamItem::Keepalive);
    }
    if let Some(end) = event.get("end") {
        // proto3 JSON omits a zero exit code; int64-style strings are legal too.
        let exit_code = end.get("exitCode").or_else(|| end.get("exit_code")).and_then(as_i64).unwrap_or(0);
        let error = end.get("error").and_then(Value::as_str).map(str::to_string);
        return Ok(StreamItem::End { exit_code, error });
    }
    Ok(StreamItem::Other)
}

fn as_i64(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_str().and_then(|s| s.parse().ok()))
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

    #[test]
    fn envelopes_split_and_joined() {
        let mut wire = encode_envelope(0, br#"{"event":{"start":{"pid":7}}}"#);
        wire.extend(encode_envelope(0, br#"{"event":{"end":{"exited":true,"status":"exit status 0"}}}"#));
        wire.extend(encode_envelope(FLAG_END_STREAM, b"{}"));
        let mut d = EnvelopeDecoder::default();
        let mut items = Vec::new();
        // Feed in 3-byte chunks so headers and bodies straddle chunk edges.
        for chunk in wire.chunks(3) {
            d.push(chunk);
            while let Some(env) = d.next_envelope().unwrap() {
                items.push(classify(&env).unwrap());
            }
        }
        assert_eq!(d.pending(), 0);
        assert_eq!(
            items,
            vec![
                StreamItem::Start { pid: Some(7) },
                StreamItem::End { exit_code: 0, error: None },
                StreamItem::EndOfStream { error: None },
            ]
        );
    }

    #[test]
    fn envelope_events() {
        let e = |flags, s: &str| classify(&Envelope { flags, data: s.as_bytes().to_vec() }).unwrap();
        assert_eq!(
            e(0, r#"{"event":{"end":{"exitCode":"3","error":"boom"}}}"#),
            StreamItem::End { exit_code: 3, error: Some("boom".into()) }
        );
        assert_eq!(e(0, r#"{"event":{"data":{"stdout":"aGk="}}}"#), StreamItem::Data);
        assert_eq!(e(0, r#"{"event":{"keepalive":{}}}"#), StreamItem::Keepalive);
        assert_eq!(
            e(FLAG_END_STREAM, r#"{"error":{"code":"deadline_exceeded","message":"late"}}"#),
            StreamItem::EndOfStream { error: Some("deadline_exceeded: late".into()) }
        );
        assert_eq!(
            classify(&Envelope { flags: FLAG_END_STREAM, data: vec![] }).unwrap(),
            StreamItem::EndOfStream { error: None }
        );
    }

    #[test]
    fn envelope_rejects_compression_and_waits_for_bytes() {
        let mut d = EnvelopeDecoder::default();
        d.push(&[0, 0, 0, 0, 10, b'{']);
        assert!(d.next_envelope().unwrap().is_none());
        let mut c = EnvelopeDecoder::default();
        c.push(&encode_envelope(FLAG_COMPRESSED, b"x"));
        assert!(c.next_envelope().is_err());
    }
}
