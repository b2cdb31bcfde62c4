//! A process holding N MiB of random bytes in its own (anonymous) memory:
//! tests/memory_holder.py, shared with the memory tests. Started in a
//! sandbox, then asked for the digest of what it holds, which touches
//! every page of it: how a restored sandbox is checked to hold the bytes
//! its source did, and timed getting all of them back.

use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use copse_protocol::StartProcess;
use hyper::{Method, StatusCode};
use serde_json::json;

use crate::Conn;
use crate::api::{Api, Sandbox};
use crate::{exec, ms};

const SCRIPT: &str = include_str!("../../tests/memory_holder.py");

/// Starts the holder with `mb` MiB in `sbx`; the digest of what it holds.
pub async fn start(api: &Api, sbx: &Sandbox, mb: usize) -> anyhow::Result<String> {
    let mut conn = Conn::open(api.addr).await?;
    api.upload(&mut conn, sbx, "/tmp/memory_holder.py", Bytes::from_static(SCRIPT.as_bytes())).await?;
    let start = format!("nohup python3 /tmp/memory_holder.py {mb} >/dev/null 2>&1 &");
    // A command's stream ends its connection's use: each gets one of its
    // own.
    run_in(&mut Conn::open(api.addr).await?, sbx, &start).await?;
    let wait = "while [ ! -f /tmp/holder.answer ]; do sleep 0.1; done; cat /tmp/holder.answer";
    run_in(&mut Conn::open(api.addr).await?, sbx, wait).await
}

/// Has the holder in `sbx` hash every byte it holds now; its digest.
/// `conn` is a fresh connection, opened before the clock starts.
async fn digest_of(conn: &mut Conn, sbx: &Sandbox) -> anyhow::Result<String> {
    let ask = "rm -f /tmp/holder.answer; touch /tmp/holder.ask; \
               while [ ! -f /tmp/holder.answer ]; do sleep 0.005; done; cat /tmp/holder.answer";
    run_in(conn, sbx, ask).await
}

/// Snapshots sandbox `id` with its memory; the snapshot's id.
pub async fn snapshot_memory(api: &Api, conn: &mut Conn, id: &str) -> anyhow::Result<String> {
    let path = format!("/sandboxes/{id}/snapshots");
    let snap = api.expect(conn, Method::POST, &path, Some(json!({ "memory": true })), StatusCode::CREATED).await?;
    Ok(snap["snapshotID"].as_str().context("no snapshotID")?.to_string())
}

/// A sandbox created from memory snapshot `snap` of a holder whose digest
/// was `digest`, then asked for its digest again, which must match:
/// the sandbox, and [create sent → 201 read, then every byte hashed] in ms.
pub async fn restore_and_touch(
    api: &Api,
    conn: &mut Conn,
    snap: &str,
    digest: &str,
) -> anyhow::Result<(Sandbox, [f64; 2])> {
    let mut asking = Conn::open(api.addr).await?;
    let t0 = Instant::now();
    let child = api.create(conn, snap).await?;
    let handover = ms(t0.elapsed());
    let t1 = Instant::now();
    let answer = digest_of(&mut asking, &child).await?;
    let touched = ms(t1.elapsed());
    if answer.trim() != digest.trim() {
        bail!("sandbox {} restored from {snap} holds other bytes than its source did", child.id);
    }
    Ok((child, [handover, touched]))
}

/// Runs `sh -c line` in `sbx` to its end; what it printed.
pub async fn run_in(conn: &mut Conn, sbx: &Sandbox, line: &str) -> anyhow::Result<String> {
    let command = StartProcess::new("/bin/sh", ["-c", line]);
    let out = exec::output(conn, &sbx.id, &sbx.token, &command).await?;
    if out.exit_code != 0 {
        bail!("`{line}` exited {}: {}", out.exit_code, out.stderr);
    }
    Ok(out.stdout)
}
