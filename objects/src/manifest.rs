//! A stream's manifest: its chunks in order. Read from a bucket another
//! node (or anyone holding the bucket's keys) wrote, so it is checked
//! before anything is fetched on its word.

use anyhow::{bail, ensure};
use serde::{Deserialize, Serialize};

const FORMAT: &str = "copse-chunks 1";
/// No chunk is larger (the chunker's maximum); a manifest saying otherwise
/// would have a reader allocate what it says.
pub const MAX_CHUNK: usize = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Lowercase hex SHA-256 of the chunk: its name in the bucket.
    pub sha256: String,
    pub len: usize,
}

impl ChunkRef {
    pub fn key(&self) -> String {
        format!("chunks/{}", self.sha256)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// The stream's length: the chunks' lengths add up to it.
    pub size: u64,
    pub chunks: Vec<ChunkRef>,
}

impl Manifest {
    pub fn new(chunks: Vec<ChunkRef>) -> Self {
        let size = chunks.iter().map(|c| c.len as u64).sum();
        Self { format: FORMAT.into(), size, chunks }
    }

    pub fn parse(bytes: &[u8]) -> anyhow::Result<Self> {
        let manifest: Self = serde_json::from_slice(bytes).map_err(|e| anyhow::anyhow!("corrupt manifest: {e}"))?;
        ensure!(manifest.format == FORMAT, "manifest format {:?} is not {FORMAT:?}", manifest.format);
        let mut total = 0u64;
        for chunk in &manifest.chunks {
            let hex = chunk.sha256.len() == 64 && chunk.sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
            if !hex {
                bail!("manifest names a chunk {:?} that is not a SHA-256", chunk.sha256);
            }
            ensure!((1..=MAX_CHUNK).contains(&chunk.len), "manifest has a chunk of {} bytes", chunk.len);
            total += chunk.len as u64;
        }
        ensure!(total == manifest.size, "manifest's chunks add up to {total} bytes, not its size {}", manifest.size);
        Ok(manifest)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a manifest always serialises")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(byte: char, len: usize) -> ChunkRef {
        ChunkRef { sha256: byte.to_string().repeat(64), len }
    }

    #[test]
    fn a_manifest_round_trips() {
        let manifest = Manifest::new(vec![chunk('a', 10), chunk('b', 5)]);
        assert_eq!(manifest.size, 15);
        assert_eq!(Manifest::parse(&manifest.to_bytes()).unwrap(), manifest);
        assert_eq!(manifest.chunks[0].key(), format!("chunks/{}", "a".repeat(64)));
    }

    #[test]
    fn names_that_are_paths_sizes_that_lie_and_other_formats_are_refused() {
        let mut bad = Vec::new();
        for name in ["../../etc/passwd", &"A".repeat(64), &"a".repeat(63), &format!("{}/", "a".repeat(63))] {
            bad.push(Manifest::new(vec![ChunkRef { sha256: name.to_string(), len: 1 }]));
        }
        bad.push(Manifest::new(vec![chunk('a', 0)]));
        bad.push(Manifest::new(vec![chunk('a', MAX_CHUNK + 1)]));
        let mut liar = Manifest::new(vec![chunk('a', 3)]);
        liar.size = 4;
        bad.push(liar);
        let mut other = Manifest::new(vec![]);
        other.format = "copse-chunks 2".into();
        bad.push(other);
        for manifest in bad {
            assert!(Manifest::parse(&manifest.to_bytes()).is_err(), "{manifest:?} must be refused");
        }
        assert!(Manifest::parse(b"{not json").is_err());
    }
}
