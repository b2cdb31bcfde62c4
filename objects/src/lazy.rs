//! A pushed stream read in place: any range of it is fetched on its first
//! read, chunk by chunk, into a local file of the stream's size, so a
//! filesystem image in the bucket can be mounted before all of it has
//! arrived. Each chunk is checked against its name before a byte of it is
//! written locally, so the local file only ever holds what the manifest
//! says; a read of a chunk that does not arrive whole is an error, never
//! other bytes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, bail};
use futures::StreamExt;
use sha2::{Digest, Sha256};

use crate::bucket::Bucket;
use crate::chunks::{hex, unpack};
use crate::manifest::{ChunkRef, Manifest};

/// Chunks fetched at once by [`LazyFile::fetch_all`].
const PARALLEL: usize = 4;

pub struct LazyFile {
    bucket: Bucket,
    chunks: Vec<ChunkRef>,
    /// Where each chunk starts in the stream.
    starts: Vec<u64>,
    size: u64,
    local: File,
    /// Per chunk: whether the local file holds it. The lock makes two
    /// readers of one missing chunk fetch it once.
    held: Vec<tokio::sync::Mutex<bool>>,
    held_count: AtomicUsize,
    /// The local file was there before (a restart): a chunk's local bytes
    /// are checked before it is fetched again.
    reopened: bool,
}

impl LazyFile {
    /// The stream `manifest` lists, held in `local` (created at its size,
    /// sparse, when missing).
    pub fn open(bucket: Bucket, manifest: Manifest, local: &Path) -> anyhow::Result<Self> {
        let reopened = local.exists();
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(local)
            .with_context(|| format!("opening {}", local.display()))?;
        if file.metadata()?.len() != manifest.size {
            file.set_len(manifest.size)?;
        }
        let mut starts = Vec::with_capacity(manifest.chunks.len());
        let mut at = 0;
        for chunk in &manifest.chunks {
            starts.push(at);
            at += chunk.len as u64;
        }
        Ok(Self {
            bucket,
            held: manifest.chunks.iter().map(|_| tokio::sync::Mutex::new(false)).collect(),
            chunks: manifest.chunks,
            starts,
            size: manifest.size,
            local: file,
            held_count: AtomicUsize::new(0),
            reopened,
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether every chunk is local.
    pub fn complete(&self) -> bool {
        self.held_count.load(Ordering::Relaxed) == self.chunks.len()
    }

    /// Up to `len` bytes at `offset` (fewer only past the end).
    pub async fn read_at(&self, offset: u64, len: usize) -> anyhow::Result<Vec<u8>> {
        if offset >= self.size {
            return Ok(Vec::new());
        }
        let end = (offset + len as u64).min(self.size);
        let first = self.starts.partition_point(|&start| start <= offset) - 1;
        let mut index = first;
        while index < self.chunks.len() && self.starts[index] < end {
            self.hold(index).await?;
            index += 1;
        }
        let mut out = vec![0; (end - offset) as usize];
        self.local.read_exact_at(&mut out, offset).context("reading the local copy")?;
        Ok(out)
    }

    /// Fetches every chunk not local yet, a few at a time.
    pub async fn fetch_all(&self) -> anyhow::Result<()> {
        let mut fetches = futures::stream::iter(0..self.chunks.len()).map(|i| self.hold(i)).buffer_unordered(PARALLEL);
        while let Some(fetched) = fetches.next().await {
            fetched?;
        }
        Ok(())
    }

    /// Makes chunk `index` local.
    async fn hold(&self, index: usize) -> anyhow::Result<()> {
        let mut held = self.held[index].lock().await;
        if *held {
            return Ok(());
        }
        let chunk = &self.chunks[index];
        let start = self.starts[index];
        if self.reopened {
            let mut local = vec![0; chunk.len];
            if self.local.read_exact_at(&mut local, start).is_ok() && hex(&Sha256::digest(&local)) == chunk.sha256 {
                self.mark(&mut held);
                return Ok(());
            }
        }
        let stored =
            self.bucket.get(&chunk.key()).await?.with_context(|| format!("chunk {} is missing", chunk.sha256))?;
        let data = unpack(chunk, stored)?;
        let actual = hex(&Sha256::digest(&data));
        if data.len() != chunk.len || actual != chunk.sha256 {
            bail!("chunk {} does not match its name (got {} bytes hashing to {actual})", chunk.sha256, data.len());
        }
        self.local.write_all_at(&data, start).context("writing the local copy")?;
        self.mark(&mut held);
        Ok(())
    }

    fn mark(&self, held: &mut bool) {
        *held = true;
        self.held_count.fetch_add(1, Ordering::Relaxed);
    }
}
