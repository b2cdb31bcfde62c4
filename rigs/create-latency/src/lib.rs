//! Pure pieces of the create-latency rig: Connect-RPC envelope decoding.
//! Statistics and Server-Timing parsing are shared with the other rigs in
//! `copse-rig-common`; everything that touches the network, processes or the
//! clock lives in `main.rs`.

pub mod anchors;

use anyhow::{Context, bail};
use serde_json::{Value, json};

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
