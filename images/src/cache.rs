//! Blobs (layers, configs) kept by digest under the data dir, so a second
//! pull of an image, or of another image sharing its layers, downloads
//! nothing it already has.
//!
//! A blob's file appears only after its whole content matched its digest
//! (written aside, checked by the client while streaming, then renamed), so
//! a file under its digest's name is that digest's content.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

pub struct BlobCache {
    dir: PathBuf,
}

impl BlobCache {
    /// `dir` is created (0700) if missing.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let blobs = dir.join("sha256");
        std::fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        Ok(Self { dir: dir.to_path_buf() })
    }

    /// Where the blob of `digest` lives (whether or not it is there yet).
    /// The digest comes from a registry's manifest, so it is checked before
    /// it names a file: `sha256:` and 64 lowercase hex digits, nothing else.
    pub fn path(&self, digest: &str) -> anyhow::Result<PathBuf> {
        let Some(hex) = digest.strip_prefix("sha256:") else {
            bail!("unsupported digest {digest:?}: only sha256 is accepted");
        };
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            bail!("malformed digest {digest:?}");
        }
        Ok(self.dir.join("sha256").join(hex))
    }

    pub fn has(&self, digest: &str) -> anyhow::Result<bool> {
        Ok(self.path(digest)?.is_file())
    }

    /// A scratch name beside the blob's, for a download in progress.
    pub fn partial(&self, digest: &str) -> anyhow::Result<PathBuf> {
        let path = self.path(digest)?;
        Ok(path.with_extension(format!("partial-{}", std::process::id())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_well_formed_sha256_digests_name_files() {
        let dir = tempfile::tempdir().unwrap();
        let cache = BlobCache::open(dir.path()).unwrap();
        let good = format!("sha256:{}", "a".repeat(64));
        assert_eq!(cache.path(&good).unwrap(), dir.path().join("sha256").join("a".repeat(64)));
        for bad in [
            "sha512:00".to_string(),
            format!("sha256:{}", "A".repeat(64)),
            format!("sha256:../../{}", "a".repeat(58)),
            "sha256:".to_string(),
            format!("sha256:{}/x", "a".repeat(62)),
        ] {
            assert!(cache.path(&bad).is_err(), "{bad}");
        }
    }
}
