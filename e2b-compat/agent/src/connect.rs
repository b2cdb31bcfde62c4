//! The Connect protocol (connectrpc.com) over HTTP/1.1 with the JSON codec:
//! error codes, the 5-byte envelopes of streaming calls, and the response
//! shapes of unary and streaming RPCs. Nothing here knows about processes or
//! files.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

pub const CONTENT_TYPE_UNARY: &str = "application/json";
pub const CONTENT_TYPE_STREAM: &str = "application/connect+json";

/// Envelope flag of the last frame of a stream (carries `{}` or an error).
pub const FLAG_END_STREAM: u8 = 0x02;
/// Envelope flag of a compressed message; we never negotiate compression.
const FLAG_COMPRESSED: u8 = 0x01;

/// Largest single message we accept; real requests are tiny JSON objects.
const MAX_MESSAGE: usize = 16 << 20;

/// Connect error codes, spelled as on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error response (Connect protocol table).
    pub fn http_status(self) -> StatusCode {
        match self {
            Code::Canceled => StatusCode::from_u16(499).expect("valid status"),
            Code::Unknown | Code::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists => StatusCode::CONFLICT,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }
}

/// An RPC failure as the client will see it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct RpcError {
    pub code: Code,
    pub message: String,
}

impl RpcError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(Code::NotFound, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Code::Internal, message)
    }

    /// Maps an I/O error on `what` to the code envd uses for it.
    pub fn from_io(err: &std::io::Error, what: &str) -> Self {
        use std::io::ErrorKind;
        let code = match err.kind() {
            ErrorKind::NotFound => Code::NotFound,
            ErrorKind::PermissionDenied => Code::PermissionDenied,
            ErrorKind::AlreadyExists => Code::AlreadyExists,
            _ => Code::Internal,
        };
        Self::new(code, format!("{what}: {err}"))
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }
}

impl IntoResponse for RpcError {
    /// The unary error form: HTTP status from the code, JSON body.
    fn into_response(self) -> Response {
        let mut resp = (self.code.http_status(), self.to_json().to_string()).into_response();
        resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE_UNARY));
        resp
    }
}

/// Frames one message: flag byte, big-endian length, payload.
pub fn encode_envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(5 + payload.len());
    buf.put_u8(flags);
    buf.put_u32(payload.len() as u32);
    buf.put_slice(payload);
    buf.freeze()
}

/// The frame that ends every response stream.
pub fn end_stream_frame(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({ "error": e.to_json() }),
    };
    encode_envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// One decoded envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub flags: u8,
    pub payload: Bytes,
}

/// Incremental envelope parser for client streams that arrive in arbitrary
/// chunks.
#[derive(Default)]
pub struct EnvelopeDecoder {
    buf: BytesMut,
}

impl EnvelopeDecoder {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete envelope, if one is buffered.
    pub fn next_envelope(&mut self) -> Result<Option<Envelope>, RpcError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(RpcError::new(Code::ResourceExhausted, "message too large"));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(RpcError::new(Code::Unimplemented, "compressed messages are not supported"));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Envelope { flags, payload }))
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Parses a JSON message, treating an empty body as `{}` like Connect does.
pub fn decode_json<T: DeserializeOwned>(payload: &[u8]) -> Result<T, RpcError> {
    let payload: &[u8] = if payload.iter().all(u8::is_ascii_whitespace) { b"{}" } else { payload };
    serde_json::from_slice(payload).map_err(|e| RpcError::invalid(format!("invalid request message: {e}")))
}

/// Decodes the single request message of a unary or server-streaming call.
pub fn decode_request<T: DeserializeOwned>(streaming: bool, body: &[u8]) -> Result<T, RpcError> {
    if !streaming {
        return decode_json(body);
    }
    let mut decoder = EnvelopeDecoder::default();
    decoder.push(body);
    match decoder.next_envelope()? {
        Some(env) => decode_json(&env.payload),
        None if body.is_empty() => decode_json(b"{}"),
        None => Err(RpcError::invalid("truncated request envelope")),
    }
}

/// A successful unary response.
pub fn unary_ok<T: Serialize>(msg: &T) -> Response {
    match serde_json::to_vec(msg) {
        Ok(body) => ([(header::CONTENT_TYPE, CONTENT_TYPE_UNARY)], body).into_response(),
        Err(e) => RpcError::internal(format!("encoding response: {e}")).into_response(),
    }
}

/// Per-stream knobs taken from the request headers.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// From `Connect-Timeout-Ms`: the stream ends with deadline_exceeded.
    pub deadline: Option<tokio::time::Instant>,
    /// From `Keepalive-Ping-Interval` (seconds), envd's default 90 s.
    pub keepalive: Duration,
}

const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);

impl StreamLimits {
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let number =
            |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
        let deadline = number("connect-timeout-ms")
            .filter(|ms| *ms > 0)
            .map(|ms| tokio::time::Instant::now() + Duration::from_millis(ms));
        let keepalive =
            number("keepalive-ping-interval").filter(|s| *s > 0).map(Duration::from_secs).unwrap_or(DEFAULT_KEEPALIVE);
        Self { deadline, keepalive }
    }
}

/// What a stream producer hands to the response writer.
pub enum StreamItem {
    Message(serde_json::Value),
    /// Ends the stream with this error in the end-of-stream frame.
    Error(RpcError),
}

/// Sender side of a response stream; dropping it ends the stream cleanly.
pub type StreamSender = mpsc::Sender<StreamItem>;

/// Turns a channel of messages into a Connect streaming response. Every
/// message becomes its own body chunk so hyper flushes it at once (the SDK
/// blocks on the first event). While the producer is silent, `keepalive`
/// messages are interleaved; at the deadline the stream ends with
/// deadline_exceeded. The producer notices a closed client when its sends
/// fail.
pub fn stream_response(rx: mpsc::Receiver<StreamItem>, limits: StreamLimits, keepalive: serde_json::Value) -> Response {
    let frames = frame_stream(rx, limits, keepalive);
    let mut resp = Response::new(Body::from_stream(frames.map(Ok::<_, std::convert::Infallible>)));
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE_STREAM));
    resp
}

/// A stream that failed before its first message.
pub fn stream_error(err: RpcError) -> Response {
    let frames = futures::stream::once(async move { Ok::<_, std::convert::Infallible>(end_stream_frame(Some(&err))) });
    let mut resp = Response::new(Body::from_stream(frames));
    resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE_STREAM));
    resp
}

fn frame_stream(
    rx: mpsc::Receiver<StreamItem>,
    limits: StreamLimits,
    keepalive: serde_json::Value,
) -> impl Stream<Item = Bytes> + Send {
    struct St {
        rx: mpsc::Receiver<StreamItem>,
        limits: StreamLimits,
        keepalive: Bytes,
        done: bool,
    }
    let st = St { rx, limits, keepalive: encode_envelope(0, keepalive.to_string().as_bytes()), done: false };
    futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        let deadline = async {
            match st.limits.deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            item = st.rx.recv() => match item {
                Some(StreamItem::Message(msg)) => {
                    let frame = encode_envelope(0, msg.to_string().as_bytes());
                    Some((frame, st))
                }
                Some(StreamItem::Error(err)) => {
                    st.done = true;
                    Some((end_stream_frame(Some(&err)), st))
                }
                None => {
                    st.done = true;
                    Some((end_stream_frame(None), st))
                }
            },
            _ = deadline => {
                st.done = true;
                let err = RpcError::new(Code::DeadlineExceeded, "deadline exceeded");
                Some((end_stream_frame(Some(&err)), st))
            }
            _ = tokio::time::sleep(st.limits.keepalive) => {
                let frame = st.keepalive.clone();
                Some((frame, st))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_roundtrip_across_chunk_boundaries() {
        let a = encode_envelope(0, br#"{"a":1}"#);
        let b = end_stream_frame(None);
        let mut all = a.to_vec();
        all.extend_from_slice(&b);
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
        assert_eq!(got[1].flags, FLAG_END_STREAM);
        assert_eq!(&got[1].payload[..], b"{}");
        assert!(dec.is_empty());
    }

    #[test]
    fn envelope_header_is_flag_then_big_endian_length() {
        let f = encode_envelope(2, &[b'x'; 300]);
        assert_eq!(&f[..5], &[2, 0, 0, 1, 44]);
    }

    #[test]
    fn end_stream_error_shape() {
        let f = end_stream_frame(Some(&RpcError::not_found("gone")));
        let v: serde_json::Value = serde_json::from_slice(&f[5..]).unwrap();
        assert_eq!(v, serde_json::json!({"error": {"code": "not_found", "message": "gone"}}));
    }

    #[test]
    fn compressed_envelopes_are_refused() {
        let mut dec = EnvelopeDecoder::default();
        dec.push(&encode_envelope(1, b"{}"));
        assert_eq!(dec.next_envelope().unwrap_err().code, Code::Unimplemented);
    }

    #[test]
    fn empty_bodies_decode_as_empty_messages() {
        let v: serde_json::Value = decode_request(false, b"").unwrap();
        assert_eq!(v, serde_json::json!({}));
        let v: serde_json::Value = decode_request(true, b"").unwrap();
        assert_eq!(v, serde_json::json!({}));
    }

    #[test]
    fn http_statuses_follow_the_connect_table() {
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::AlreadyExists.http_status(), 409);
        assert_eq!(Code::Unauthenticated.http_status(), 401);
        assert_eq!(Code::DeadlineExceeded.http_status(), 504);
        assert_eq!(Code::Canceled.http_status(), 499);
    }

    #[tokio::test]
    async fn stream_ends_with_deadline_exceeded() {
        let (tx, rx) = mpsc::channel(4);
        let limits = StreamLimits {
            deadline: Some(tokio::time::Instant::now() + Duration::from_millis(50)),
            keepalive: Duration::from_secs(60),
        };
        tx.send(StreamItem::Message(serde_json::json!({"n": 1}))).await.unwrap();
        let frames: Vec<Bytes> = frame_stream(rx, limits, serde_json::json!({})).collect().await;
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[1][0], FLAG_END_STREAM);
        assert!(String::from_utf8_lossy(&frames[1][5..]).contains("deadline_exceeded"));
        drop(tx);
    }

    #[tokio::test]
    async fn stream_sends_keepalives_while_idle() {
        let (tx, rx) = mpsc::channel(4);
        let limits = StreamLimits { deadline: None, keepalive: Duration::from_millis(20) };
        let mut frames = Box::pin(frame_stream(rx, limits, serde_json::json!({"keepalive": {}})));
        let first = frames.next().await.unwrap();
        assert_eq!(&first[5..], br#"{"keepalive":{}}"#);
        drop(tx);
        let last = frames.next().await.unwrap();
        assert_eq!(last[0], FLAG_END_STREAM);
        assert!(frames.next().await.is_none());
    }
}
