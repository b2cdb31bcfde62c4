//! A process holding N MiB of random bytes in its own (anonymous) memory:
//! tests/memory_holder.py, shared with the memory tests. Started in a
//! sandbox, then asked for the digest of what it holds, which touches
//! every page of it: how a restored sandbox is checked to hold the bytes
//! its source did, and timed getting all of them back.

use anyhow::bail;
use bytes::Bytes;
use copse_protocol::StartProcess;

use crate::Conn;
use crate::api::{Api, Sandbox};
use crate::exec;

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
pub async fn digest(conn: &mut Conn, sbx: &Sandbox) -> anyhow::Result<String> {
    let ask = "rm -f /tmp/holder.answer; touch /tmp/holder.ask; \
               while [ ! -f /tmp/holder.answer ]; do sleep 0.005; done; cat /tmp/holder.answer";
    run_in(conn, sbx, ask).await
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
