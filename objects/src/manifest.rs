//! A stream's manifest: its chunks in order. Read from a bucket another
//! node (or anyone holding the bucket's keys) wrote, so it is checked
//! before anything is fetched on its word.

use anyhow::{bail, ensure};
use serde::{Deserialize, Serialize};

/// Format 2 added compressed chunks; format 1 manifests (every chunk
/// stored as it is) are still read.
const FORMAT: &str = "copse-chunks 2";
const FORMATS: [&str; 2] = ["copse-chunks 1", FORMAT];
/// No chunk is larger (the chunker's maximum); a manifest saying otherwise
/// would have a reader allocate what it says.
pub const MAX_CHUNK: usize = 4 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// Lowercase hex SHA-256 of the chunk's bytes (uncompressed): its name
    /// in the bucket.
    pub sha256: String,
    /// Its length uncompressed.
    pub len: usize,
    /// How it is stored.
    #[serde(default, skip_serializing_if = "Codec::is_raw")]
    pub codec: Codec,
}

/// How a chunk's bytes are stored. A chunk that does not shrink is stored
/// as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    #[default]
    Raw,
    /// An LZ4 block (no frame: the manifest has the length).
    Lz4,
}

impl Codec {
    fn is_raw(&self) -> bool {
        *self == Codec::Raw
    }
}

impl ChunkRef {
    pub fn key(&self) -> String {
        match self.codec {
            Codec::Raw => format!("chunks/{}", self.sha256),
            Codec::Lz4 => format!("chunks/{}.lz4", self.sha256),
        }
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
        ensure!(FORMATS.contains(&manifest.format.as_str()), "manifest format {:?} is not {FORMAT:?}", manifest.format);
        ensure!(
            manifest.format == FORMAT || manifest.chunks.iter().all(|c| c.codec == Codec::Raw),
            "a {:?} manifest names compressed chunks",
            manifest.format
        );
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
        ChunkRef { sha256: byte.to_string().repeat(64), len, codec: Codec::Raw }
    }

    #[test]
    fn a_manifest_round_trips() {
        let manifest = Manifest::new(vec![chunk('a', 10), chunk('b', 5)]);
        assert_eq!(manifest.size, 15);
        assert_eq!(Manifest::parse(&manifest.to_bytes()).unwrap(), manifest);
        assert_eq!(manifest.chunks[0].key(), format!("chunks/{}", "a".repeat(64)));
        let packed = ChunkRef { codec: Codec::Lz4, ..chunk('c', 3) };
        assert_eq!(packed.key(), format!("chunks/{}.lz4", "c".repeat(64)));
        let manifest = Manifest::new(vec![chunk('a', 10), packed]);
        assert_eq!(Manifest::parse(&manifest.to_bytes()).unwrap(), manifest);
    }

    #[test]
    fn a_manifest_written_before_compression_is_still_read() {
        let old =
            format!(r#"{{"format":"copse-chunks 1","size":7,"chunks":[{{"sha256":"{}","len":7}}]}}"#, "a".repeat(64));
        let manifest = Manifest::parse(old.as_bytes()).unwrap();
        assert_eq!(manifest.chunks, [chunk('a', 7)]);
        // Format 1 had no compressed chunks: one naming them is forged.
        let mut forged = Manifest::new(vec![ChunkRef { codec: Codec::Lz4, ..chunk('a', 7) }]);
        forged.format = "copse-chunks 1".into();
        assert!(Manifest::parse(&forged.to_bytes()).is_err());
    }

    #[test]
    fn names_that_are_paths_sizes_that_lie_and_other_formats_are_refused() {
        let mut bad = Vec::new();
        for name in ["../../etc/passwd", &"A".repeat(64), &"a".repeat(63), &format!("{}/", "a".repeat(63))] {
            bad.push(Manifest::new(vec![ChunkRef { sha256: name.to_string(), len: 1, codec: Codec::Raw }]));
        }
        bad.push(Manifest::new(vec![chunk('a', 0)]));
        bad.push(Manifest::new(vec![chunk('a', MAX_CHUNK + 1)]));
        let mut liar = Manifest::new(vec![chunk('a', 3)]);
        liar.size = 4;
        bad.push(liar);
        let mut other = Manifest::new(vec![]);
        other.format = "copse-chunks 3".into();
        bad.push(other);
        for manifest in bad {
            assert!(Manifest::parse(&manifest.to_bytes()).is_err(), "{manifest:?} must be refused");
        }
        assert!(Manifest::parse(b"{not json").is_err());
    }
}
