//! Pushing a stream into a bucket as chunks, and pulling it back.

use std::io::Read;

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use sha2::{Digest, Sha256};

use crate::bucket::Bucket;
use crate::manifest::{ChunkRef, Codec, MAX_CHUNK, Manifest};
use crate::stream::StreamSender;

/// Content-defined cut points: chunks of 256 KiB to 4 MiB, 1 MiB on
/// average, so a change costs about a megabyte of upload and a chunk is
/// worth a request.
const MIN_CHUNK: usize = 256 << 10;
const AVG_CHUNK: usize = 1 << 20;
/// Requests in flight each way.
const PARALLEL: usize = 4;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushReport {
    pub chunks: usize,
    /// The stream's length.
    pub bytes: u64,
    /// Its chunks as stored (compressed where that made them smaller).
    pub stored_bytes: u64,
    /// What the bucket did not hold yet, so was sent: uncompressed, and
    /// as it went over the wire.
    pub new_chunks: usize,
    pub new_bytes: u64,
    pub new_stored_bytes: u64,
    /// The SHA-256 of the manifest written: a record elsewhere that keeps
    /// it vouches for the whole stream ([`verified_manifest`]).
    pub manifest_sha256: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullReport {
    pub chunks: usize,
    pub bytes: u64,
}

/// Reads `source` to its end and stores it in `bucket` as chunks, sending
/// only those the bucket lacks, then writes the manifest under `key` —
/// unless `source_ok`, asked once the source has ended, says the stream
/// it read was not whole (a producer that failed part-way closes its end
/// like one that finished). Nothing names the chunks until the manifest
/// exists, so a push cut short leaves no manifest and the old one, if
/// any, stands.
pub async fn push(
    bucket: &Bucket,
    key: &str,
    source: impl Read + Send + 'static,
    source_ok: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<PushReport> {
    let (tx, rx) = tokio::sync::mpsc::channel::<anyhow::Result<(ChunkRef, Bytes)>>(PARALLEL);
    // Reading, cutting and hashing are blocking work, off the runtime.
    let chunker = tokio::task::spawn_blocking(move || {
        for chunk in fastcdc::v2020::StreamCDC::new(source, MIN_CHUNK, AVG_CHUNK, MAX_CHUNK) {
            let item = chunk.map_err(|e| anyhow::anyhow!("reading the stream: {e}")).map(|chunk| {
                let sha256 = hex(&Sha256::digest(&chunk.data));
                let (codec, stored) = pack(chunk.data);
                (ChunkRef { sha256, len: chunk.length, codec }, stored)
            });
            let failed = item.is_err();
            if tx.blocking_send(item).is_err() || failed {
                return;
            }
        }
    });
    let uploads = futures::stream::unfold(rx, |mut rx| async { rx.recv().await.map(|item| (item, rx)) })
        .map(|item| async move {
            let (chunk, data) = item?;
            // A chunk stored long ago is written again: that is what keeps
            // garbage collection from removing it under this push (`gc.rs`).
            let new = !bucket.has_recent(&chunk.key(), crate::gc::REWRITE_AFTER).await?;
            let stored = data.len() as u64;
            if new {
                bucket.put(&chunk.key(), data).await?;
            }
            anyhow::Ok((chunk, new, stored))
        })
        .buffered(PARALLEL);
    let sent: Vec<(ChunkRef, bool, u64)> = uploads.try_collect().await?;
    chunker.await.context("the chunker stopped")?;
    source_ok()?;
    let mut report = PushReport::default();
    for (chunk, new, stored) in &sent {
        report.chunks += 1;
        report.bytes += chunk.len as u64;
        report.stored_bytes += stored;
        if *new {
            report.new_chunks += 1;
            report.new_bytes += chunk.len as u64;
            report.new_stored_bytes += stored;
        }
    }
    let manifest = Manifest::new(sent.into_iter().map(|(chunk, _, _)| chunk).collect()).to_bytes();
    report.manifest_sha256 = hex(&Sha256::digest(&manifest));
    bucket.put(key, Bytes::from(manifest)).await?;
    Ok(report)
}

/// The manifest under `key`, checked; `None` when there is none.
pub async fn manifest(bucket: &Bucket, key: &str) -> anyhow::Result<Option<Manifest>> {
    match bucket.get(key).await? {
        Some(bytes) => Ok(Some(Manifest::parse(&bytes).with_context(|| key.to_string())?)),
        None => Ok(None),
    }
}

/// The manifest under `key`, only if it is the one whose SHA-256 a
/// trusted record kept ([`PushReport::manifest_sha256`]).
pub async fn verified_manifest(bucket: &Bucket, key: &str, sha256: &str) -> anyhow::Result<Manifest> {
    let bytes = bucket.get(key).await?.with_context(|| format!("{key} is not in the object store"))?;
    let actual = hex(&Sha256::digest(&bytes));
    if actual != sha256 {
        bail!("{key} is not the manifest its record names (it hashes to {actual}, not {sha256})");
    }
    Manifest::parse(&bytes).with_context(|| key.to_string())
}

/// Sends the stream `manifest` lists into `sink`, fetching ahead and
/// checking each chunk's hash and length before a byte of it is sent;
/// the stream is finished only when every chunk arrived whole, so a reader
/// of a pull that failed gets an error, not a shorter stream.
pub async fn pull(bucket: &Bucket, manifest: &Manifest, sink: StreamSender) -> anyhow::Result<PullReport> {
    let mut fetched = futures::stream::iter(&manifest.chunks)
        .map(|chunk| async move {
            let stored =
                bucket.get(&chunk.key()).await?.with_context(|| format!("chunk {} is missing", chunk.sha256))?;
            let data = unpack(chunk, stored)?;
            let actual = hex(&Sha256::digest(&data));
            if data.len() != chunk.len || actual != chunk.sha256 {
                bail!("chunk {} does not match its name (got {} bytes hashing to {actual})", chunk.sha256, data.len());
            }
            anyhow::Ok(data)
        })
        .buffered(PARALLEL);
    let mut report = PullReport::default();
    while let Some(data) = fetched.next().await {
        let data = data?;
        report.chunks += 1;
        report.bytes += data.len() as u64;
        sink.send(data).await.map_err(|_| ReaderStopped)?;
    }
    sink.finish().await;
    Ok(report)
}

/// The pull's reader stopped reading (it failed or refused the stream):
/// its own error says why.
#[derive(Debug, thiserror::Error)]
#[error("the reader of the stream stopped")]
pub struct ReaderStopped;

/// A chunk as it is stored: LZ4 where that makes it smaller, else as it is
/// (already compressed data, random bytes).
fn pack(data: Vec<u8>) -> (Codec, Bytes) {
    let packed = lz4_flex::block::compress(&data);
    match packed.len() < data.len() {
        true => (Codec::Lz4, Bytes::from(packed)),
        false => (Codec::Raw, Bytes::from(data)),
    }
}

/// A stored chunk's bytes. Decompression stops at the length the manifest
/// gives (at most [`MAX_CHUNK`]), so a small object cannot make a node
/// allocate more than that.
pub(crate) fn unpack(chunk: &ChunkRef, stored: Bytes) -> anyhow::Result<Bytes> {
    match chunk.codec {
        Codec::Raw => Ok(stored),
        Codec::Lz4 => {
            let data = lz4_flex::block::decompress(&stored, chunk.len)
                .map_err(|e| anyhow::anyhow!("chunk {} does not decompress: {e}", chunk.sha256))?;
            Ok(Bytes::from(data))
        }
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(data: &[u8]) -> (ChunkRef, Bytes) {
        let sha256 = hex(&Sha256::digest(data));
        let (codec, bytes) = pack(data.to_vec());
        (ChunkRef { sha256, len: data.len(), codec }, bytes)
    }

    #[test]
    fn a_chunk_is_compressed_only_when_that_makes_it_smaller() {
        let text: Vec<u8> = b"the same line again and again\n".repeat(20_000);
        let (chunk, bytes) = stored(&text);
        assert_eq!(chunk.codec, Codec::Lz4);
        assert!(bytes.len() * 10 < text.len(), "{} of {}", bytes.len(), text.len());
        assert_eq!(unpack(&chunk, bytes).unwrap(), text);
        // Bytes that do not shrink (a hash chain stands in for random data).
        let noise: Vec<u8> = (0..4096u32).flat_map(|i| Sha256::digest(i.to_le_bytes())).collect();
        let (chunk, bytes) = stored(&noise);
        assert_eq!(chunk.codec, Codec::Raw);
        assert_eq!(bytes, noise);
    }

    #[test]
    fn a_stored_chunk_never_unpacks_past_its_listed_length() {
        let zeros = vec![0u8; MAX_CHUNK];
        let (chunk, bomb) = stored(&zeros);
        assert!(bomb.len() < 64 << 10);
        // The manifest claims less than the object expands to.
        let short = ChunkRef { len: 1024, ..chunk.clone() };
        assert!(unpack(&short, bomb.clone()).is_err());
        assert!(unpack(&chunk, Bytes::from_static(b"not lz4 at all")).is_err());
        assert_eq!(unpack(&chunk, bomb).unwrap().len(), MAX_CHUNK);
    }
}
