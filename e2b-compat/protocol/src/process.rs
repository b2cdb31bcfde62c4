//! The client side of `process.Process/Start` (envd's
//! `spec/envd/process/process.proto`, JSON codec): the request, the
//! server stream read as typed [`ProcessEvent`]s, and the [`Output`] of a
//! command run to its end.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper::body::Body;
use serde::Serialize;
use serde_json::Value;

use crate::envelope::{EnvelopeDecoder, encode_envelope};
use crate::error::Error;
use crate::headers;

pub const START_PATH: &str = "/process.Process/Start";

/// A command to start. Serialises as a `StartRequest` without stdin.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct StartProcess {
    pub process: ProcessConfig,
    /// Shows up in `commands.list()`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    pub stdin: bool,
    /// Runs as this user (envd takes it from `Authorization: Basic`, not
    /// from the message); the agent's default user when `None`.
    #[serde(skip)]
    pub user: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

impl StartProcess {
    /// `cmd` with `args`, as the default user, in the default directory.
    pub fn new(cmd: impl Into<String>, args: impl IntoIterator<Item = impl Into<String>>) -> Self {
        let process = ProcessConfig { cmd: cmd.into(), args: args.into_iter().map(Into::into).collect(), cwd: None };
        Self { process, tag: None, stdin: false, user: None }
    }

    /// `shell -c script`.
    pub fn shell(shell: &str, script: &str) -> Self {
        Self::new(shell, ["-c", script])
    }

    pub fn cwd(mut self, cwd: impl Into<String>) -> Self {
        self.process.cwd = Some(cwd.into());
        self
    }

    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = Some(tag.into());
        self
    }

    pub fn user(mut self, user: impl Into<String>) -> Self {
        self.user = Some(user.into());
        self
    }

    /// The HTTP request for this call with `Host: host`; callers going
    /// through the gateway add its routing and token headers.
    pub fn request(&self, host: &str) -> Result<Request<Full<Bytes>>, Error> {
        use base64::Engine as _;
        let message = serde_json::to_vec(self)?;
        let mut request = Request::post(START_PATH);
        if let Some(user) = &self.user {
            let credentials = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
            request = request.header(hyper::header::AUTHORIZATION, format!("Basic {credentials}"));
        }
        Ok(request
            .header(hyper::header::HOST, host)
            .header(hyper::header::CONTENT_TYPE, headers::CONTENT_TYPE_STREAM)
            .header(headers::CONNECT_PROTOCOL_VERSION, headers::CONNECT_PROTOCOL_VERSION_1)
            .body(Full::new(encode_envelope(0, &message)))?)
    }
}

/// One message of a `Start` (or `Connect`) server stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessEvent {
    Start {
        pid: Option<u32>,
    },
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Pty(Vec<u8>),
    Keepalive,
    End {
        /// proto3 JSON omits a zero exit code, so an absent one reads as 0.
        exit_code: i64,
        error: Option<String>,
    },
    /// A message this client does not know; skipped.
    Other,
}

impl ProcessEvent {
    /// Reads the JSON message of one (non-final) envelope.
    pub fn decode(payload: &[u8]) -> Result<Self, Error> {
        let message: Value = if payload.iter().all(u8::is_ascii_whitespace) {
            Value::Object(Default::default())
        } else {
            serde_json::from_slice(payload)?
        };
        let Some(event) = message.get("event") else { return Ok(Self::Other) };
        if let Some(start) = event.get("start") {
            let pid = start.get("pid").and_then(as_i64).and_then(|p| u32::try_from(p).ok());
            return Ok(Self::Start { pid });
        }
        if let Some(data) = event.get("data") {
            for (key, wrap) in [("stdout", Self::Stdout as fn(_) -> _), ("stderr", Self::Stderr), ("pty", Self::Pty)] {
                if let Some(text) = data.get(key).and_then(Value::as_str) {
                    return crate::json::decode_base64(text).map(wrap).map_err(Error::Base64);
                }
            }
            return Ok(Self::Other);
        }
        if event.get("keepalive").is_some() {
            return Ok(Self::Keepalive);
        }
        if let Some(end) = event.get("end") {
            let exit_code = end.get("exitCode").or_else(|| end.get("exit_code")).and_then(as_i64).unwrap_or(0);
            let error = end.get("error").and_then(Value::as_str).map(str::to_string);
            return Ok(Self::End { exit_code, error });
        }
        Ok(Self::Other)
    }
}

/// Int64 fields may come as JSON numbers or strings.
fn as_i64(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| v.as_str().and_then(|s| s.parse().ok()))
}

/// Reads the end-of-stream frame: `Ok` for `{}`, the error it carries
/// otherwise.
pub fn end_of_stream(payload: &[u8]) -> Result<(), Error> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    let message: Value = serde_json::from_slice(payload)?;
    match message.get("error") {
        None | Some(Value::Null) => Ok(()),
        Some(error) => Err(Error::Rpc {
            code: error.get("code").and_then(Value::as_str).unwrap_or("unknown").to_string(),
            message: error.get("message").and_then(Value::as_str).unwrap_or("").to_string(),
        }),
    }
}

/// A `Start` response body read event by event, as its frames arrive.
pub struct ProcessStream<B> {
    body: B,
    decoder: EnvelopeDecoder,
    finished: bool,
}

impl<B> ProcessStream<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    pub fn new(body: B) -> Self {
        Self { body, decoder: EnvelopeDecoder::default(), finished: false }
    }

    /// The next event; `None` after a clean end-of-stream frame, the
    /// stream's error if that frame carried one.
    pub async fn next(&mut self) -> Result<Option<ProcessEvent>, Error> {
        loop {
            if self.finished {
                return Ok(None);
            }
            if let Some(envelope) = self.decoder.next_envelope()? {
                if envelope.is_end_stream() {
                    self.finished = true;
                    end_of_stream(&envelope.payload)?;
                    return Ok(None);
                }
                return ProcessEvent::decode(&envelope.payload).map(Some);
            }
            match self.body.frame().await {
                None => return Err(Error::Protocol("the stream ended without its end-of-stream frame")),
                Some(frame) => {
                    if let Ok(data) = frame.map_err(|e| Error::Body(e.into()))?.into_data() {
                        self.decoder.push(&data);
                    }
                }
            }
        }
    }

    /// Reads the rest of the body without looking at it, so the connection
    /// can carry the next request.
    pub async fn drain(mut self) -> Result<(), Error> {
        while let Some(frame) = self.body.frame().await {
            frame.map_err(|e| Error::Body(e.into()))?;
        }
        Ok(())
    }

    /// Reads the stream to its end: what the command printed and its exit
    /// code.
    pub async fn output(mut self) -> Result<Output, Error> {
        let (mut stdout, mut stderr, mut exit_code) = (Vec::new(), Vec::new(), None);
        while let Some(event) = self.next().await? {
            match event {
                ProcessEvent::Stdout(data) | ProcessEvent::Pty(data) => stdout.extend(data),
                ProcessEvent::Stderr(data) => stderr.extend(data),
                ProcessEvent::End { exit_code: code, .. } => exit_code = Some(code),
                ProcessEvent::Start { .. } | ProcessEvent::Keepalive | ProcessEvent::Other => {}
            }
        }
        let exit_code = exit_code.ok_or(Error::Protocol("the process stream ended without an end event"))?;
        Ok(Output {
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
            exit_code,
        })
    }
}

/// What a finished command printed and how it ended.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EnvelopeDecoder, FLAG_END_STREAM};

    /// A `Start` response as the agent sends it for `echo hi; exit 3`.
    fn recorded_response() -> Vec<u8> {
        let mut wire = Vec::new();
        for (flags, message) in [
            (0, r#"{"event":{"start":{"pid":7}}}"#),
            (0, r#"{"event":{"data":{"stdout":"aGkK"}}}"#),
            (0, r#"{"event":{"keepalive":{}}}"#),
            (0, r#"{"event":{"data":{"stderr":"b29wcw=="}}}"#),
            (0, r#"{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}"#),
            (FLAG_END_STREAM, "{}"),
        ] {
            wire.extend_from_slice(&encode_envelope(flags, message.as_bytes()));
        }
        wire
    }

    /// A body that hands out its bytes in small chunks, so envelopes
    /// straddle frame edges.
    struct Chunked(std::collections::VecDeque<Bytes>);

    impl Chunked {
        fn new(bytes: &[u8], size: usize) -> Self {
            Self(bytes.chunks(size).map(Bytes::copy_from_slice).collect())
        }
    }

    impl Body for Chunked {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
            std::task::Poll::Ready(self.0.pop_front().map(|b| Ok(hyper::body::Frame::data(b))))
        }
    }

    #[tokio::test]
    async fn a_stream_reads_as_events_across_frame_edges() {
        let mut stream = ProcessStream::new(Chunked::new(&recorded_response(), 3));
        let mut events = Vec::new();
        while let Some(event) = stream.next().await.unwrap() {
            events.push(event);
        }
        assert_eq!(
            events,
            vec![
                ProcessEvent::Start { pid: Some(7) },
                ProcessEvent::Stdout(b"hi\n".to_vec()),
                ProcessEvent::Keepalive,
                ProcessEvent::Stderr(b"oops".to_vec()),
                ProcessEvent::End { exit_code: 3, error: None },
            ]
        );
        assert!(stream.next().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn output_collects_a_whole_stream() {
        let output = ProcessStream::new(Chunked::new(&recorded_response(), 64)).output().await.unwrap();
        assert_eq!(output, Output { stdout: "hi\n".into(), stderr: "oops".into(), exit_code: 3 });
    }

    #[tokio::test]
    async fn a_stream_cut_short_is_an_error() {
        let wire = recorded_response();
        let cut = &wire[..wire.len() - 7];
        assert!(matches!(ProcessStream::new(Chunked::new(cut, 64)).output().await, Err(Error::Protocol(_))));
        let mut failed = encode_envelope(0, br#"{"event":{"start":{"pid":1}}}"#).to_vec();
        failed.extend_from_slice(&encode_envelope(FLAG_END_STREAM, br#"{"error":{"code":"internal","message":"x"}}"#));
        assert!(matches!(ProcessStream::new(Chunked::new(&failed, 64)).output().await, Err(Error::Rpc { .. })));
    }

    #[test]
    fn a_named_user_travels_as_basic_credentials() {
        let request = StartProcess::new("true", [""; 0]).user("copse-interp").request("agent").unwrap();
        // base64("copse-interp:")
        assert_eq!(request.headers()["authorization"], "Basic Y29wc2UtaW50ZXJwOg==");
    }

    #[tokio::test]
    async fn the_request_is_one_envelope_with_the_start_message() {
        let start = StartProcess::shell("/bin/bash", "sleep 1").cwd("/home/user").tag("svc");
        let request = start.request("agent").unwrap();
        assert_eq!(request.uri(), START_PATH);
        assert_eq!(request.method(), hyper::Method::POST);
        assert_eq!(request.headers()["host"], "agent");
        assert_eq!(request.headers()["content-type"], "application/connect+json");
        assert_eq!(request.headers()["connect-protocol-version"], "1");
        assert!(request.headers().get("authorization").is_none());
        let body = request.into_body().collect().await.unwrap().to_bytes();
        let mut decoder = EnvelopeDecoder::default();
        decoder.push(&body);
        let envelope = decoder.next_envelope().unwrap().unwrap();
        assert_eq!(envelope.flags, 0);
        let message: Value = serde_json::from_slice(&envelope.payload).unwrap();
        assert_eq!(
            message,
            serde_json::json!({
                "process": {"cmd": "/bin/bash", "args": ["-c", "sleep 1"], "cwd": "/home/user"},
                "tag": "svc",
                "stdin": false,
            })
        );
        assert!(decoder.is_empty());
    }

    #[test]
    fn unset_fields_stay_off_the_wire() {
        let json = serde_json::to_string(&StartProcess::new("/bin/true", Vec::<String>::new())).unwrap();
        assert_eq!(json, r#"{"process":{"cmd":"/bin/true","args":[]},"stdin":false}"#);
    }

    #[test]
    fn events_decode_from_their_json() {
        let e = |s: &str| ProcessEvent::decode(s.as_bytes()).unwrap();
        assert_eq!(e(r#"{"event":{"start":{"pid":"7"}}}"#), ProcessEvent::Start { pid: Some(7) });
        assert_eq!(e(r#"{"event":{"data":{"stdout":"aGk="}}}"#), ProcessEvent::Stdout(b"hi".to_vec()));
        assert_eq!(e(r#"{"event":{"data":{"pty":"aGk"}}}"#), ProcessEvent::Pty(b"hi".to_vec()));
        assert_eq!(
            e(r#"{"event":{"end":{"exitCode":"3","error":"boom"}}}"#),
            ProcessEvent::End { exit_code: 3, error: Some("boom".into()) }
        );
        assert_eq!(e(r#"{"event":{"end":{"exited":true}}}"#), ProcessEvent::End { exit_code: 0, error: None });
        assert_eq!(e(r#"{"event":{"keepalive":{}}}"#), ProcessEvent::Keepalive);
        assert_eq!(e(""), ProcessEvent::Other);
    }

    #[test]
    fn the_end_of_stream_frame_carries_the_stream_error() {
        assert!(end_of_stream(b"{}").is_ok());
        assert!(end_of_stream(b"").is_ok());
        match end_of_stream(br#"{"error":{"code":"deadline_exceeded","message":"late"}}"#) {
            Err(Error::Rpc { code, message }) => {
                assert_eq!((code.as_str(), message.as_str()), ("deadline_exceeded", "late"))
            }
            other => panic!("{other:?}"),
        }
    }
}
