//! The E2B API calls the lifecycle and cluster rigs make, on the lean
//! client: create, snapshot, delete, and files through the agent.

use std::net::SocketAddr;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use copse_protocol::headers;
use http_body_util::{BodyExt, Full};
use hyper::{Method, StatusCode};
use serde_json::{Value, json};

use crate::{Conn, ms};

/// `mb` megabytes that no file system can deduplicate or compress away.
pub fn filler(mb: usize) -> Bytes {
    filler_seeded(mb, 0)
}

/// As [`filler`], other bytes for each `seed`.
pub fn filler_seeded(mb: usize, seed: u64) -> Bytes {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15 ^ seed.wrapping_mul(0xA24B_AED4_963E_E407);
    let mut data = Vec::with_capacity(mb << 20);
    while data.len() < mb << 20 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        data.extend_from_slice(&state.to_le_bytes());
    }
    Bytes::from(data)
}

/// `mb` MB of log lines (compressible as real logs are: timestamps, ids
/// and numbers varying, words repeating), different for each `seed`.
pub fn log_text_seeded(mb: usize, seed: u64) -> Bytes {
    let mut state: u64 = 0x2545_F491_4F6C_DD1D ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut data = Vec::with_capacity((mb << 20) + 200);
    let mut line = 0u64;
    while data.len() < mb << 20 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        line += 1;
        let status = [200, 200, 200, 201, 204, 404, 500][(state % 7) as usize];
        data.extend_from_slice(
            format!(
                "2026-11-29T{:02}:{:02}:{:02}.{:06}Z INFO request id={:016x} method=GET path=/sandboxes/{:08x}/files status={status} took_ms={}\n",
                (line / 3_600_000) % 24,
                (line / 60_000) % 60,
                (line / 1000) % 60,
                line % 1_000_000,
                state,
                state >> 32,
                state % 97
            )
            .as_bytes(),
        );
    }
    data.truncate(mb << 20);
    Bytes::from(data)
}

pub struct Sandbox {
    pub id: String,
    pub token: String,
}

pub struct Api {
    pub addr: SocketAddr,
    pub key: String,
}

impl Api {
    pub async fn expect(
        &self,
        conn: &mut Conn,
        method: Method,
        path: &str,
        body: Option<Value>,
        want: StatusCode,
    ) -> anyhow::Result<Value> {
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let req = conn
            .request(method.clone(), path)
            .header("x-api-key", &self.key)
            .header("content-type", "application/json")
            .body(Full::new(body))?;
        let resp = conn.send(req).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        if status != want {
            bail!("{method} {path}: HTTP {status} (wanted {want}): {}", String::from_utf8_lossy(&bytes));
        }
        Ok(if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes)? })
    }

    pub async fn create(&self, conn: &mut Conn, template: &str) -> anyhow::Result<Sandbox> {
        let body = json!({ "templateID": template, "timeout": 900 });
        let created = self.expect(conn, Method::POST, "/v2/sandboxes", Some(body), StatusCode::CREATED).await?;
        Ok(Sandbox {
            id: created["sandboxID"].as_str().context("no sandboxID")?.to_string(),
            token: created["envdAccessToken"].as_str().unwrap_or("").to_string(),
        })
    }

    /// `POST /sandboxes/{id}/snapshots` of the files only (E2B's default
    /// is memory too); returns the snapshot's id.
    pub async fn snapshot(&self, conn: &mut Conn, id: &str) -> anyhow::Result<String> {
        let path = format!("/sandboxes/{id}/snapshots");
        let body = json!({ "memory": false });
        let snap = self.expect(conn, Method::POST, &path, Some(body), StatusCode::CREATED).await?;
        Ok(snap["snapshotID"].as_str().context("no snapshotID")?.to_string())
    }

    /// A sandbox from snapshot `snap`, then its `/home/user/marker` read
    /// and checked: (sandbox, create ms, read ms).
    pub async fn create_and_read_marker(
        &self,
        conn: &mut Conn,
        snap: &str,
        expected: &[u8],
    ) -> anyhow::Result<(Sandbox, f64, f64)> {
        let t0 = Instant::now();
        let child = self.create(conn, snap).await?;
        let create = ms(t0.elapsed());
        let t1 = Instant::now();
        let body = self.read(conn, &child, "/home/user/marker").await?;
        let read = ms(t1.elapsed());
        if body.as_ref() != expected {
            bail!("sandbox from snapshot {snap} read {:?} from its marker", String::from_utf8_lossy(&body));
        }
        Ok((child, create, read))
    }

    /// `POST /sandboxes/{id}/pause` keeping its files only (no memory).
    pub async fn pause_files(&self, conn: &mut Conn, id: &str) -> anyhow::Result<()> {
        let path = format!("/sandboxes/{id}/pause");
        let body = json!({ "memory": false });
        self.expect(conn, Method::POST, &path, Some(body), StatusCode::NO_CONTENT).await.map(drop)
    }

    /// `POST /sandboxes/{id}/connect` of a paused sandbox, which resumes
    /// it: the sandbox with the token its agent now takes.
    pub async fn resume(&self, conn: &mut Conn, sbx: &Sandbox) -> anyhow::Result<Sandbox> {
        let path = format!("/sandboxes/{}/connect", sbx.id);
        let resumed =
            self.expect(conn, Method::POST, &path, Some(json!({ "timeout": 900 })), StatusCode::CREATED).await?;
        let token = resumed["envdAccessToken"].as_str().unwrap_or(&sbx.token).to_string();
        Ok(Sandbox { id: sbx.id.clone(), token })
    }

    pub async fn delete(&self, conn: &mut Conn, id: &str) -> anyhow::Result<()> {
        self.expect(conn, Method::DELETE, &format!("/sandboxes/{id}"), None, StatusCode::NO_CONTENT).await.map(drop)
    }

    fn data_plane(&self, conn: &Conn, sbx: &Sandbox, method: Method, path: &str) -> hyper::http::request::Builder {
        conn.request(method, path)
            .header(headers::SANDBOX_ID, &sbx.id)
            .header(headers::SANDBOX_PORT, headers::AGENT_PORT.to_string())
            .header(headers::ACCESS_TOKEN, &sbx.token)
    }

    pub async fn health(&self, conn: &mut Conn, sbx: &Sandbox) -> anyhow::Result<()> {
        let req = self.data_plane(conn, sbx, Method::GET, "/health").body(Full::default())?;
        let resp = conn.send(req).await?;
        let status = resp.status();
        resp.into_body().collect().await?;
        if !status.is_success() {
            bail!("envd /health after resume: HTTP {status}");
        }
        Ok(())
    }

    pub async fn upload(&self, conn: &mut Conn, sbx: &Sandbox, path: &str, data: Bytes) -> anyhow::Result<()> {
        let req = self
            .data_plane(conn, sbx, Method::POST, &format!("/files?path={path}&username=user"))
            .header("content-type", "application/octet-stream")
            .body(Full::new(data))?;
        let resp = conn.send(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("upload {path}: HTTP {status}: {}", String::from_utf8_lossy(&body));
        }
        Ok(())
    }

    pub async fn read(&self, conn: &mut Conn, sbx: &Sandbox, path: &str) -> anyhow::Result<Bytes> {
        let req = self
            .data_plane(conn, sbx, Method::GET, &format!("/files?path={path}&username=user"))
            .body(Full::default())?;
        let resp = conn.send(req).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!("read {path}: HTTP {status}");
        }
        Ok(body)
    }
}
