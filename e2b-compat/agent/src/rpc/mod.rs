//! The Connect services the agent serves (`process.Process`,
//! `filesystem.Filesystem`): request shapes, handlers and their streams,
//! over the process supervisor and the filesystem operations, which know
//! nothing of the wire or of the agent's state.

pub mod filesystem;
pub mod process;

use axum::body::Body;

use crate::connect::RpcError;

/// A unary request's body, bounded: no Connect request the SDK sends is
/// near 16 MiB, and an unbounded read would let a caller exhaust memory.
pub async fn read_body(body: Body) -> Result<bytes::Bytes, RpcError> {
    axum::body::to_bytes(body, 16 << 20).await.map_err(|e| RpcError::invalid(format!("reading request: {e}")))
}
