//! A small client for one agent's unix socket: run a command, upload and
//! download a file. One connection per request, as the gateway does:
//! connecting a unix socket costs microseconds.

use std::path::{Path, PathBuf};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use crate::error::Error;
use crate::headers;
use crate::process::{Output, ProcessStream, StartProcess};

/// The `Host` the agent is addressed by on its socket (it ignores it).
pub const AGENT_HOST: &str = "agent";

/// Speaks to one agent over its socket.
#[derive(Debug, Clone)]
pub struct AgentClient {
    socket: PathBuf,
}

impl AgentClient {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self { socket: socket.into() }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends one request on a fresh connection.
    pub async fn send(&self, request: Request<Full<Bytes>>) -> Result<Response<Incoming>, Error> {
        let stream = UnixStream::connect(&self.socket)
            .await
            .map_err(|source| Error::Connect { path: self.socket.clone(), source })?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        Ok(sender.send_request(request).await?)
    }

    /// `Process.Start`: the event stream once the agent accepted the call.
    pub async fn process_start(&self, start: &StartProcess) -> Result<ProcessStream<Incoming>, Error> {
        let response = self.send(start.request(AGENT_HOST)?).await?;
        let response = success(response, "Process.Start").await?;
        Ok(ProcessStream::new(response.into_body()))
    }

    /// Runs `start` and waits for its end.
    pub async fn run(&self, start: &StartProcess) -> Result<Output, Error> {
        self.process_start(start).await?.output().await
    }

    /// Writes `content` to `path` as `user` through `POST /files`.
    pub async fn upload(&self, path: &str, user: &str, content: &[u8]) -> Result<(), Error> {
        let request = Request::post(files_uri(path, user))
            .header(hyper::header::HOST, AGENT_HOST)
            .header(hyper::header::CONTENT_TYPE, "application/octet-stream")
            .body(Full::new(Bytes::copy_from_slice(content)))?;
        success(self.send(request).await?, "upload").await?;
        Ok(())
    }

    /// Reads `path` as `user` through `GET /files`.
    pub async fn download(&self, path: &str, user: &str) -> Result<Vec<u8>, Error> {
        let request = Request::get(files_uri(path, user))
            .header(hyper::header::HOST, AGENT_HOST)
            .body(Full::new(Bytes::new()))?;
        let response = success(self.send(request).await?, "download").await?;
        Ok(response.into_body().collect().await?.to_bytes().to_vec())
    }
}

/// A `POST` of a JSON body to `path` (`/init`, say), carrying `token` when
/// the agent demands one.
pub fn json_request(path: &str, body: &serde_json::Value, token: Option<&str>) -> Result<Request<Full<Bytes>>, Error> {
    let mut request = Request::post(path)
        .header(hyper::header::HOST, AGENT_HOST)
        .header(hyper::header::CONTENT_TYPE, headers::CONTENT_TYPE_UNARY);
    if let Some(token) = token {
        request = request.header(headers::ACCESS_TOKEN, token);
    }
    Ok(request.body(Full::new(Bytes::from(serde_json::to_vec(body)?)))?)
}

/// The response if its status is a success, its body in the error if not.
async fn success(response: Response<Incoming>, what: &'static str) -> Result<Response<Incoming>, Error> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let body = response.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    Err(Error::Status { what, status, body: String::from_utf8_lossy(&body).into_owned() })
}

/// `/files?path=…&username=…`, both query values percent-encoded.
fn files_uri(path: &str, user: &str) -> String {
    format!("/files?path={}&username={}", query_value(path), query_value(user))
}

fn query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~/".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use hyper::service::service_fn;

    use super::*;
    use crate::envelope::{EnvelopeDecoder, FLAG_END_STREAM, encode_envelope};

    /// Serves `answer` on a unix socket in a tempdir, handing each request
    /// (head and body) to the test through the returned channel.
    async fn agent<F>(
        answer: F,
    ) -> (tempfile::TempDir, AgentClient, tokio::sync::mpsc::UnboundedReceiver<(hyper::http::request::Parts, Bytes)>)
    where
        F: Fn(&hyper::http::request::Parts) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
    {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let (tx, answer) = (tx.clone(), answer.clone());
                let service = service_fn(move |request: Request<Incoming>| {
                    let (tx, answer) = (tx.clone(), answer.clone());
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body.collect().await.unwrap().to_bytes();
                        let response = answer(&parts);
                        tx.send((parts, body)).unwrap();
                        Ok::<_, Infallible>(response)
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        (dir, AgentClient::new(socket), rx)
    }

    #[tokio::test]
    async fn run_sends_one_start_envelope_and_collects_the_stream() {
        let (_dir, client, mut requests) = agent(|_| {
            let mut body = encode_envelope(0, br#"{"event":{"start":{"pid":9}}}"#).to_vec();
            body.extend_from_slice(&encode_envelope(0, br#"{"event":{"data":{"stdout":"b2s="}}}"#));
            body.extend_from_slice(&encode_envelope(0, br#"{"event":{"end":{"exitCode":0,"exited":true}}}"#));
            body.extend_from_slice(&encode_envelope(FLAG_END_STREAM, b"{}"));
            Response::new(Full::new(Bytes::from(body)))
        })
        .await;
        let output = client.run(&StartProcess::shell("/bin/sh", "echo ok")).await.unwrap();
        assert_eq!(output, Output { stdout: "ok".into(), stderr: String::new(), exit_code: 0 });
        let (parts, body) = requests.recv().await.unwrap();
        assert_eq!(parts.uri, "/process.Process/Start");
        assert_eq!(parts.headers["content-type"], "application/connect+json");
        let mut decoder = EnvelopeDecoder::default();
        decoder.push(&body);
        let start: serde_json::Value =
            serde_json::from_slice(&decoder.next_envelope().unwrap().unwrap().payload).unwrap();
        assert_eq!(start["process"]["args"], serde_json::json!(["-c", "echo ok"]));
    }

    #[tokio::test]
    async fn file_transfer_names_path_and_user_in_the_query() {
        let (_dir, client, mut requests) = agent(|parts| match parts.method {
            hyper::Method::GET => Response::new(Full::new(Bytes::from_static(b"content"))),
            _ => Response::new(Full::new(Bytes::new())),
        })
        .await;
        client.upload("/tmp/a b.txt", "user", b"content").await.unwrap();
        let (parts, body) = requests.recv().await.unwrap();
        assert_eq!(parts.uri, "/files?path=/tmp/a%20b.txt&username=user");
        assert_eq!(&body[..], b"content");
        assert_eq!(client.download("/tmp/a b.txt", "user").await.unwrap(), b"content");
    }

    #[test]
    fn json_requests_carry_the_token_only_when_given() {
        let body = serde_json::json!({"accessToken": "t"});
        let with = json_request("/init", &body, Some("old")).unwrap();
        assert_eq!(with.uri().path(), "/init");
        assert_eq!(with.headers()["x-access-token"], "old");
        assert_eq!(with.headers()["content-type"], "application/json");
        assert!(!json_request("/init", &body, None).unwrap().headers().contains_key("x-access-token"));
    }

    #[tokio::test]
    async fn a_refused_call_reports_status_and_body() {
        let (_dir, client, _requests) = agent(|_| {
            let mut response = Response::new(Full::new(Bytes::from_static(b"no such user")));
            *response.status_mut() = hyper::StatusCode::UNAUTHORIZED;
            response
        })
        .await;
        match client.download("/x", "nobody").await {
            Err(Error::Status { status, body, .. }) => {
                assert_eq!((status.as_u16(), body.as_str()), (401, "no such user"))
            }
            other => panic!("{other:?}"),
        }
    }
}
