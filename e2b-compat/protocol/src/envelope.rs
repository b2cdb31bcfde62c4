//! The envelopes of Connect streaming calls (connectrpc.com): a flag byte,
//! a big-endian `u32` length, then the message. Both directions of a
//! stream use them; the last frame of a response carries
//! [`FLAG_END_STREAM`] and `{}` or an error.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Envelope flag of a compressed message; nobody here negotiates compression.
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag of the last frame of a stream (carries `{}` or an error).
pub const FLAG_END_STREAM: u8 = 0x02;

/// Largest single message accepted; real messages are small JSON objects.
const MAX_MESSAGE: usize = 16 << 20;

/// Frames one message: flag byte, big-endian length, payload.
pub fn encode_envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(5 + payload.len());
    buf.put_u8(flags);
    buf.put_u32(payload.len() as u32);
    buf.put_slice(payload);
    buf.freeze()
}

/// One decoded envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

impl Envelope {
    pub fn is_end_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }
}

/// Why a byte stream is not a sequence of envelopes we accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EnvelopeError {
    #[error("message too large")]
    TooLarge,
    #[error("compressed messages are not supported")]
    Compressed,
}

/// Incremental envelope parser for streams that arrive in arbitrary chunks.
#[derive(Debug, Default)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
}

impl EnvelopeDecoder {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete envelope, if one is buffered.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, EnvelopeError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(EnvelopeError::TooLarge);
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(EnvelopeError::Compressed);
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    /// Whether every byte pushed so far was part of a complete envelope.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_roundtrip_across_chunk_boundaries() {
        let mut all = encode_envelope(0, br#"{"a":1}"#).to_vec();
        all.extend_from_slice(&encode_envelope(FLAG_END_STREAM, b"{}"));
        let mut dec = EnvelopeDecoder::default();
        let mut got = Vec::new();
        for byte in all {
            dec.push(&[byte]);
            while let Some(env) = dec.next_envelope().unwrap() {
                got.push(env);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], Envelope { flags: 0, payload: Bytes::from_static(br#"{"a":1}"#) });
        assert!(!got[0].is_end_stream());
        assert!(got[1].is_end_stream());
        assert_eq!(&got[1].payload[..], b"{}");
        assert!(dec.is_empty());
    }

    #[test]
    fn envelope_header_is_flag_then_big_endian_length() {
        let f = encode_envelope(2, &[b'x'; 300]);
        assert_eq!(&f[..5], &[2, 0, 0, 1, 44]);
    }

    #[test]
    fn compressed_envelopes_are_refused() {
        let mut dec = EnvelopeDecoder::default();
        dec.push(&encode_envelope(FLAG_COMPRESSED, b"{}"));
        assert_eq!(dec.next_envelope().unwrap_err(), EnvelopeError::Compressed);
    }

    #[test]
    fn oversized_envelopes_are_refused_before_their_body_arrives() {
        let mut dec = EnvelopeDecoder::default();
        dec.push(&[0, 0x7f, 0, 0, 0]);
        assert_eq!(dec.next_envelope().unwrap_err(), EnvelopeError::TooLarge);
    }

    #[test]
    fn a_partial_envelope_waits_for_more_bytes() {
        let mut dec = EnvelopeDecoder::default();
        dec.push(&[0, 0, 0, 0, 10, b'{']);
        assert!(dec.next_envelope().unwrap().is_none());
        assert!(!dec.is_empty());
    }
}
