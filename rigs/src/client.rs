//! The lean HTTP/1.1 client the rigs time the gateway with: one keep-alive
//! connection (TCP_NODELAY) per worker, reopened if the gateway closed it.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use copse_protocol::headers;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::stats::parse_server_timing;

/// Describes this client in result files' `params`.
pub const LEAN_CLIENT: &str =
    "Rust, hyper 1 HTTP/1.1 keep-alive over TCP (TCP_NODELAY), one connection per worker, tokio current-thread runtime";

pub struct Conn {
    addr: SocketAddr,
    tx: http1::SendRequest<Full<Bytes>>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (tx, conn) = http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Self { addr, tx })
    }

    pub async fn send(&mut self, req: Request<Full<Bytes>>) -> anyhow::Result<Response<Incoming>> {
        if self.tx.is_closed() {
            *self = Self::open(self.addr).await?;
        }
        self.tx.ready().await?;
        Ok(self.tx.send_request(req).await?)
    }

    /// The `Host` requests on this connection carry.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// A request builder with the method, path and `Host` filled in.
    pub fn request(&self, method: Method, path: &str) -> hyper::http::request::Builder {
        Request::builder().method(method).uri(path).header(hyper::header::HOST, self.host())
    }

    /// `POST /v2/sandboxes` with `body`, response read; expects 201.
    pub async fn create_sandbox(&mut self, key: &str, body: impl Into<Bytes>) -> anyhow::Result<Created> {
        let req = self
            .request(Method::POST, "/v2/sandboxes")
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(Full::new(body.into()))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let server_timing = resp
            .headers()
            .get("server-timing")
            .and_then(|v| v.to_str().ok())
            .map(parse_server_timing)
            .unwrap_or_default();
        let body = resp.into_body().collect().await?.to_bytes();
        if status != StatusCode::CREATED {
            bail!("create: HTTP {status}: {}", String::from_utf8_lossy(&body));
        }
        let created: Value = serde_json::from_slice(&body).context("create response is not JSON")?;
        Ok(Created {
            id: created["sandboxID"].as_str().context("create response without sandboxID")?.to_string(),
            token: created["envdAccessToken"].as_str().unwrap_or("").to_string(),
            server_timing,
        })
    }

    /// `DELETE /sandboxes/{id}`, response read; expects 204.
    pub async fn delete_sandbox(&mut self, key: &str, id: &str) -> anyhow::Result<()> {
        let del =
            self.request(Method::DELETE, &format!("/sandboxes/{id}")).header("x-api-key", key).body(Full::default())?;
        let resp = self.send(del).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if status != StatusCode::NO_CONTENT {
            bail!("delete {id}: HTTP {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(())
    }
}

impl Conn {
    /// Runs `code` in a code-interpreter sandbox (`POST /execute` on its
    /// Jupyter port through the gateway) and returns the main result's
    /// text; an `error` line or a missing result is an error.
    pub async fn run_code(&mut self, id: &str, token: &str, code: &str) -> anyhow::Result<String> {
        let body = serde_json::json!({"code": code, "context_id": null, "language": null, "env_vars": null});
        let req = self
            .request(Method::POST, "/execute")
            .header(headers::SANDBOX_ID, id)
            .header(headers::SANDBOX_PORT, "49999")
            .header(headers::ACCESS_TOKEN, token)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))?;
        let resp = self.send(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if status != StatusCode::OK {
            bail!("execute: HTTP {status}: {}", String::from_utf8_lossy(&body));
        }
        main_result(&body)
    }
}

/// The main result text of an `/execute` NDJSON body.
pub fn main_result(ndjson: &[u8]) -> anyhow::Result<String> {
    let mut result = None;
    for line in ndjson.split(|b| *b == b'\n').filter(|l| !l.iter().all(u8::is_ascii_whitespace)) {
        let v: Value = serde_json::from_slice(line).context("execute: a line is not JSON")?;
        match v["type"].as_str() {
            Some("error") => {
                bail!("execute: {}: {}", v["name"].as_str().unwrap_or("?"), v["value"].as_str().unwrap_or(""))
            }
            Some("result") if v["is_main_result"] == true => result = v["text"].as_str().map(String::from),
            _ => {}
        }
    }
    result.context("execute: no main result")
}

/// What a create response told the client.
#[derive(Debug, Clone)]
pub struct Created {
    pub id: String,
    /// `envdAccessToken` (empty if absent).
    pub token: String,
    /// The parsed `Server-Timing` header.
    pub server_timing: Vec<(String, f64)>,
}

/// A duration in (fractional) milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn main_result_of_an_execute_stream() {
        let ok = b"{\"type\":\"stdout\",\"text\":\"x\"}\n{\"type\":\"result\",\"text\":\"2\",\"is_main_result\":true}\n{\"type\":\"end_of_execution\"}\n";
        assert_eq!(main_result(ok).unwrap(), "2");
        assert!(main_result(b"{\"type\":\"error\",\"name\":\"NameError\",\"value\":\"x\"}\n").is_err());
        assert!(main_result(b"{\"type\":\"end_of_execution\"}\n").is_err());
    }
}
