//! The server side of the Connect protocol (connectrpc.com) over HTTP/1.1
//! with the JSON codec: error codes, request decoding, and the response
//! shapes of unary and streaming RPCs. The envelope framing itself is
//! `copse_protocol::envelope`, shared with the agent's clients. Nothing
//! here knows about processes or files.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use copse_protocol::envelope::{EnvelopeDecoder, EnvelopeError, FLAG_END_STREAM, encode_envelope};
use copse_protocol::headers::{CONTENT_TYPE_STREAM, CONTENT_TYPE_UNARY};
use futures::{Stream, StreamExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;

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

/// The frame that ends every response stream.
pub fn end_stream_frame(error: Option<&RpcError>) -> Bytes {
    let body = match error {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({ "error": e.to_json() }),
    };
    encode_envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

impl From<EnvelopeError> for RpcError {
    fn from(err: EnvelopeError) -> Self {
        let code = match err {
            EnvelopeError::TooLarge => Code::ResourceExhausted,
            EnvelopeError::Compressed => Code::Unimplemented,
        };
        Self::new(code, err.to_string())
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
    fn end_stream_error_shape() {
        let f = end_stream_frame(Some(&RpcError::not_found("gone")));
        let v: serde_json::Value = serde_json::from_slice(&f[5..]).unwrap();
        assert_eq!(v, serde_json::json!({"error": {"code": "not_found", "message": "gone"}}));
    }

    #[test]
    fn compressed_envelopes_are_refused_as_unimplemented() {
        let mut dec = EnvelopeDecoder::default();
        dec.push(&encode_envelope(copse_protocol::envelope::FLAG_COMPRESSED, b"{}"));
        assert_eq!(RpcError::from(dec.next_envelope().unwrap_err()).code, Code::Unimplemented);
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
