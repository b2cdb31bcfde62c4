//! The CLI's calls to a running gateway (`copse ls|kill`, the template
//! commands), with the API key the SDK sends, over plain HTTP.

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::Value;

pub struct Api {
    base: String,
    key: String,
    runtime: tokio::runtime::Runtime,
}

/// A name or id as one path segment (names may hold `/`).
pub fn path(segment: &str) -> String {
    url::form_urlencoded::byte_serialize(segment.as_bytes()).collect::<String>().replace('+', "%20")
}

impl Api {
    pub fn new(base: &str, key: &str) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        Ok(Self { base: base.trim_end_matches('/').to_string(), key: key.to_string(), runtime })
    }

    /// A JSON call answered with one of `expected`; else the gateway's
    /// E2B error message.
    pub fn json(&self, method: &str, path: &str, body: Option<&Value>, expected: &[u16]) -> anyhow::Result<Value> {
        let body = body.map(serde_json::to_vec).transpose()?;
        let (status, text) = self.call(method, &format!("{}{path}", self.base), body, true)?;
        if !expected.contains(&status) {
            bail!("{method} {path}: {status}: {}", message(&text));
        }
        if text.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).with_context(|| format!("{method} {path}: the answer is not JSON"))
    }

    /// The upload link's PUT: it carries its own token, not the key.
    pub fn put(&self, url: &str, body: Vec<u8>) -> anyhow::Result<()> {
        let (status, text) = self.call("PUT", url, Some(body), false)?;
        if status != 200 {
            bail!("uploading files: {status}: {}", message(&text));
        }
        Ok(())
    }

    fn call(&self, method: &str, url: &str, body: Option<Vec<u8>>, with_key: bool) -> anyhow::Result<(u16, String)> {
        self.runtime.block_on(async {
            let uri: hyper::Uri = url.parse().with_context(|| format!("bad URL {url}"))?;
            if uri.scheme_str() == Some("https") {
                bail!("the CLI speaks plain HTTP; use the gateway's local address");
            }
            let authority = uri.authority().context("URL has no host")?.clone();
            let stream = tokio::net::TcpStream::connect(authority.as_str())
                .await
                .with_context(|| format!("connecting to {authority}; is `copse up` running?"))?;
            let (mut sender, conn) =
                hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
            tokio::spawn(conn);
            let mut request = hyper::Request::builder()
                .method(method)
                .uri(uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
                .header("host", authority.as_str());
            if with_key {
                request = request.header("x-api-key", &self.key).header("content-type", "application/json");
            }
            let request = request.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let text = response.into_body().collect().await?.to_bytes();
            Ok((status, String::from_utf8_lossy(&text).into_owned()))
        })
    }
}

fn message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(String::from))
        .unwrap_or_else(|| body.to_string())
}
