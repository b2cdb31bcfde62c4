//! Blobs (layers, configs) kept by digest under the data dir, so a second
//! pull of an image, or of another image sharing its layers, downloads
//! nothing it already has.
//!
//! A blob's file appears only after its whole content matched its digest
//! (written aside, checked by the client while streaming, then renamed), so
//! a file under its digest's name is that digest's content.
//!
//! Blobs are only read while an image is pulled and unpacked into a
//! template; after that they save a later pull its download. So the cache
//! keeps what was used lately: each use stamps the blob's mtime, and
//! [`collect`] removes blobs unused for longer than it is told. An open
//! cache holds the cache's lock shared and a collection takes it
//! exclusively, without waiting: a collection never removes a blob a pull
//! has found or is writing, and never holds a pull up.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};

const LOCK_FILE: &str = "lock";

pub struct BlobCache {
    dir: PathBuf,
    /// Shared for as long as the cache is open.
    _lock: File,
}

/// What a collection removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Collected {
    pub blobs: usize,
    pub bytes: u64,
    /// Downloads a crash or a failure left behind.
    pub partials: usize,
}

impl BlobCache {
    /// `dir` is created (0700) if missing.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let blobs = dir.join("sha256");
        std::fs::create_dir_all(&blobs).with_context(|| format!("creating {}", blobs.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        let lock = lock_file(dir)?;
        lock.lock_shared().with_context(|| format!("locking {}", dir.display()))?;
        Ok(Self { dir: dir.to_path_buf(), _lock: lock })
    }

    /// Where the blob of `digest` lives (whether or not it is there yet).
    /// The digest comes from a registry's manifest, so it is checked before
    /// it names a file: `sha256:` and 64 lowercase hex digits, nothing else.
    pub fn path(&self, digest: &str) -> anyhow::Result<PathBuf> {
        let Some(hex) = digest.strip_prefix("sha256:") else {
            bail!("unsupported digest {digest:?}: only sha256 is accepted");
        };
        if !is_hex_digest(hex) {
            bail!("malformed digest {digest:?}");
        }
        Ok(self.dir.join("sha256").join(hex))
    }

    pub fn has(&self, digest: &str) -> anyhow::Result<bool> {
        Ok(self.path(digest)?.is_file())
    }

    /// Marks the blob of `digest` as used now, so a collection keeps it.
    pub fn touch(&self, digest: &str) -> anyhow::Result<()> {
        let path = self.path(digest)?;
        let file = File::options().append(true).open(&path).with_context(|| format!("opening {}", path.display()))?;
        file.set_modified(SystemTime::now()).with_context(|| format!("stamping {}", path.display()))
    }

    /// A scratch name beside the blob's, for a download in progress.
    pub fn partial(&self, digest: &str) -> anyhow::Result<PathBuf> {
        let path = self.path(digest)?;
        Ok(path.with_extension(format!("partial-{}", std::process::id())))
    }

    /// Takes in the blob of `digest` from `source` (read to its end) unless
    /// the cache has it; it appears under its digest only if what was read
    /// hashes to that digest. For blobs that come from somewhere other
    /// than a registry (a cluster's object store), which the OCI client
    /// does not check.
    pub fn insert(&self, digest: &str, source: &mut dyn Read) -> anyhow::Result<PathBuf> {
        use sha2::{Digest, Sha256};
        let path = self.path(digest)?;
        if path.is_file() {
            self.touch(digest)?;
            return Ok(path);
        }
        let partial = self.partial(digest)?;
        let result = (|| {
            let mut file = File::create(&partial).with_context(|| format!("creating {}", partial.display()))?;
            let mut hasher = Sha256::new();
            let mut buffer = vec![0u8; 1 << 16];
            loop {
                let n = source.read(&mut buffer)?;
                if n == 0 {
                    break;
                }
                hasher.update(&buffer[..n]);
                file.write_all(&buffer[..n])?;
            }
            let actual: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
            if Some(actual.as_str()) != digest.strip_prefix("sha256:") {
                bail!("the blob read as {digest} hashes to sha256:{actual}: refused");
            }
            file.sync_all()?;
            std::fs::rename(&partial, &path)?;
            anyhow::Ok(())
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        result.map(|()| path)
    }
}

fn lock_file(dir: &Path) -> anyhow::Result<File> {
    let path = dir.join(LOCK_FILE);
    File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))
}

/// Removes the blobs of the cache in `dir` last used longer than
/// `unused_for` ago, and every unfinished download. `None` when a pull has
/// the cache open (the next collection will see to it).
pub fn collect(dir: &Path, unused_for: Duration) -> anyhow::Result<Option<Collected>> {
    let blobs = dir.join("sha256");
    if !blobs.is_dir() {
        return Ok(Some(Collected::default()));
    }
    let lock = lock_file(dir)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
        Err(std::fs::TryLockError::Error(e)) => return Err(e).with_context(|| format!("locking {}", dir.display())),
    }
    let now = SystemTime::now();
    let mut collected = Collected::default();
    for entry in std::fs::read_dir(&blobs).with_context(|| format!("reading {}", blobs.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        // Only what the cache itself names; never followed if a link.
        let meta = entry.metadata()?;
        if !meta.file_type().is_file() {
            continue;
        }
        let partial = name.len() > 64 && is_hex_digest(&name[..64]) && name[64..].starts_with(".partial-");
        let idle = now.duration_since(meta.modified()?).unwrap_or_default();
        let stale = is_hex_digest(name) && idle > unused_for;
        if !partial && !stale {
            continue;
        }
        match std::fs::remove_file(entry.path()) {
            Ok(()) if partial => collected.partials += 1,
            Ok(()) => {
                collected.blobs += 1;
                collected.bytes += meta.len();
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", entry.path().display())),
        }
    }
    Ok(Some(collected))
}

fn is_hex_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(cache: &BlobCache, c: char, age: Duration) -> (String, PathBuf) {
        let digest = format!("sha256:{}", c.to_string().repeat(64));
        let path = cache.path(&digest).unwrap();
        std::fs::write(&path, b"layer").unwrap();
        File::options().append(true).open(&path).unwrap().set_modified(SystemTime::now() - age).unwrap();
        (digest, path)
    }

    #[test]
    fn an_inserted_blob_appears_under_its_digest_only_if_it_hashes_to_it() {
        use sha2::{Digest, Sha256};
        let dir = tempfile::tempdir().unwrap();
        let cache = BlobCache::open(dir.path()).unwrap();
        let hex: String = Sha256::digest(b"layer bytes").iter().map(|b| format!("{b:02x}")).collect();
        let digest = format!("sha256:{hex}");
        let other = format!("sha256:{}", "f".repeat(64));
        let refused = cache.insert(&other, &mut &b"layer bytes"[..]).unwrap_err();
        assert!(format!("{refused:#}").contains("refused"), "{refused:#}");
        assert!(!cache.has(&other).unwrap());
        let path = cache.insert(&digest, &mut &b"layer bytes"[..]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"layer bytes");
        assert_eq!(std::fs::read_dir(dir.path().join("sha256")).unwrap().count(), 1, "no partial left behind");
        // Already there: the source is not read.
        assert_eq!(cache.insert(&digest, &mut &b"other bytes"[..]).unwrap(), path);
    }

    #[test]
    fn a_collection_removes_blobs_unused_for_long_and_leftover_downloads_only() {
        let dir = tempfile::tempdir().unwrap();
        let day = Duration::from_secs(86_400);
        let (old, used, fresh, partial, other, linked);
        {
            let cache = BlobCache::open(dir.path()).unwrap();
            old = blob(&cache, 'a', 9 * day).1;
            let (digest, path) = blob(&cache, 'b', 9 * day);
            cache.touch(&digest).unwrap();
            used = path;
            fresh = blob(&cache, 'c', day).1;
            partial = cache.partial(&format!("sha256:{}", "d".repeat(64))).unwrap();
            std::fs::write(&partial, b"half").unwrap();
            other = dir.path().join("sha256").join("notes.txt");
            std::fs::write(&other, b"x").unwrap();
            File::options().append(true).open(&other).unwrap().set_modified(SystemTime::now() - 9 * day).unwrap();
            linked = dir.path().join("sha256").join("e".repeat(64));
            std::os::unix::fs::symlink(&other, &linked).unwrap();
            assert_eq!(collect(dir.path(), 7 * day).unwrap(), None, "an open cache is not collected");
        }
        let collected = collect(dir.path(), 7 * day).unwrap().unwrap();
        assert_eq!(collected, Collected { blobs: 1, bytes: 5, partials: 1 });
        assert!(!old.exists() && !partial.exists());
        assert!(used.exists() && fresh.exists() && other.exists(), "used, young and foreign files stay");
        assert!(linked.symlink_metadata().is_ok(), "a link is neither followed nor removed");
        assert_eq!(collect(&dir.path().join("never-made"), day).unwrap(), Some(Collected::default()));
    }

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
