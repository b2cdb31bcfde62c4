//! API keys: which keys the gateway accepts, and how a fresh install gets
//! its first one. The gateway keeps only hashes, so neither its memory nor
//! its files give a key away, and a key is shown to nobody but the file the
//! operator reads it from.
//!
//! Sources, the first that yields keys wins:
//! 1. `COPSE_API_KEY`: comma-separated keys (or `sha256:<hex>` hashes);
//! 2. the keys file `DATA_DIR/api-keys`: one `sha256:<hex>` per line, then
//!    optionally a label copse ignores. Plain keys
//!    written by older versions are accepted and converted in place;
//! 3. on loopback only: a fresh key, written once to
//!    `DATA_DIR/generated-api-key` (0600) with its hash in the keys file.
//!
//! These keys are the default team's (see `tenancy/`); keys made with
//! `copse keys create` live in the store, hashed the same way.
//!
//! Keys are SHA-256 hashed without a salt or a slow KDF: generated keys
//! carry 160 random bits and chosen ones need at least [`MIN_KEY_LEN`]
//! characters, so the hash is checked on every request at no cost.

use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use rand::Rng;
use sha2::{Digest, Sha256};

/// Shorter keys are refused at start: a key is the only thing between the
/// network and root in every sandbox.
pub const MIN_KEY_LEN: usize = 20;
pub const KEYS_FILE: &str = "api-keys";
pub const GENERATED_KEY_FILE: &str = "generated-api-key";
const HASH_PREFIX: &str = "sha256:";

/// Where the accepted keys came from: what the startup banner can tell the
/// operator about finding one, without printing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Environment,
    /// The keys file; the generated key's file if copse made one.
    File {
        keys: PathBuf,
        generated: Option<PathBuf>,
    },
}

#[derive(Clone, PartialEq, Eq)]
struct KeyHash([u8; 32]);

impl KeyHash {
    fn of(key: &str) -> Self {
        Self(Sha256::digest(key.as_bytes()).into())
    }

    /// `sha256:<64 lowercase or uppercase hex digits>`.
    fn parse(text: &str) -> Option<Self> {
        let hex = text.strip_prefix(HASH_PREFIX)?;
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut bytes = [0u8; 32];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(bytes))
    }

    fn to_line(&self) -> String {
        format!("{HASH_PREFIX}{}", self.0.iter().map(|b| format!("{b:02x}")).collect::<String>())
    }

    fn equals(&self, other: &Self) -> bool {
        copse_protocol::signature::equal_bytes(&self.0, &other.0)
    }
}

/// The keys the gateway accepts, as hashes.
#[derive(Clone)]
pub struct ApiKeys {
    hashes: Arc<Vec<KeyHash>>,
    origin: Origin,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys").field("count", &self.hashes.len()).field("origin", &self.origin).finish()
    }
}

impl ApiKeys {
    /// The keys for a gateway keeping state in `data_dir` and listening on
    /// `listen` (see the module doc for the order of sources).
    pub fn load(data_dir: &Path, listen: &SocketAddr) -> anyhow::Result<Self> {
        if let Ok(env) = std::env::var("COPSE_API_KEY") {
            let hashes =
                parse_entries(env.split(',').map(str::trim).filter(|k| !k.is_empty()), "COPSE_API_KEY", "entry")?;
            if !hashes.is_empty() {
                return Ok(Self { hashes: Arc::new(hashes), origin: Origin::Environment });
            }
        }
        let keys = data_dir.join(KEYS_FILE);
        let generated = data_dir.join(GENERATED_KEY_FILE);
        let mut hashes = read_keys_file(&keys)?;
        if hashes.is_empty() {
            if !listen.ip().is_loopback() {
                bail!(
                    "refusing to listen on {listen} without an API key: set COPSE_API_KEY or write keys (one per line) to {}",
                    keys.display()
                );
            }
            hashes = vec![first_key(&generated)?];
            write_private(&keys, &format!("{}\n", hashes[0].to_line()))?;
            tracing::info!("generated an API key; it is in {} (readable by its owner only)", generated.display());
        }
        let generated = generated.exists().then_some(generated);
        Ok(Self { hashes: Arc::new(hashes), origin: Origin::File { keys, generated } })
    }

    /// Keys given directly (tests, embedders); each must be long enough.
    pub fn new<'a>(keys: impl IntoIterator<Item = &'a str>) -> anyhow::Result<Self> {
        let hashes = parse_entries(keys, "API key", "key")?;
        anyhow::ensure!(!hashes.is_empty(), "no API key given");
        Ok(Self { hashes: Arc::new(hashes), origin: Origin::Environment })
    }

    pub fn origin(&self) -> &Origin {
        &self.origin
    }

    /// Whether `presented` is one of the keys. Compares hashes, every one of
    /// them, in constant time.
    pub fn accepts(&self, presented: &str) -> bool {
        let presented = KeyHash::of(presented);
        self.hashes.iter().fold(false, |found, hash| found | hash.equals(&presented))
    }
}

/// Keys or hashes, each named by its position (never by its text) when it
/// is refused.
fn parse_entries<'a>(
    entries: impl IntoIterator<Item = &'a str>,
    source: &str,
    what: &str,
) -> anyhow::Result<Vec<KeyHash>> {
    entries
        .into_iter()
        .enumerate()
        .map(|(i, entry)| {
            if entry.starts_with(HASH_PREFIX) {
                return KeyHash::parse(entry)
                    .with_context(|| format!("{source}: {what} {} is not sha256: and 64 hex digits", i + 1));
            }
            check_length(entry).with_context(|| format!("{source}: {what} {}", i + 1))?;
            Ok(KeyHash::of(entry))
        })
        .collect()
}

fn check_length(key: &str) -> anyhow::Result<()> {
    let len = key.chars().count();
    if len < MIN_KEY_LEN {
        bail!(
            "an API key needs at least {MIN_KEY_LEN} characters, this one has {len} (make one with `openssl rand -hex 20`)"
        );
    }
    Ok(())
}

/// The hashes in the keys file (none if it is missing), converting plain
/// keys left by older versions so no key stays on disk in the clear.
fn read_keys_file(path: &Path) -> anyhow::Result<Vec<KeyHash>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    restrict_to_owner(path)?;
    let mut hashes = Vec::new();
    let mut converted = 0;
    let mut rewritten = String::new();
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        let entry = trimmed.split_whitespace().next().unwrap_or("");
        if entry.is_empty() || entry.starts_with('#') {
            rewritten.push_str(line);
        } else if entry.starts_with(HASH_PREFIX) {
            let hash = KeyHash::parse(entry)
                .with_context(|| format!("{} line {}: not sha256: and 64 hex digits", path.display(), n + 1))?;
            hashes.push(hash);
            rewritten.push_str(line);
        } else {
            check_length(trimmed).with_context(|| format!("{} line {}", path.display(), n + 1))?;
            let hash = KeyHash::of(trimmed);
            rewritten.push_str(&hash.to_line());
            hashes.push(hash);
            converted += 1;
        }
        rewritten.push('\n');
    }
    if converted > 0 {
        write_private(path, &rewritten)?;
        tracing::info!(
            "{}: replaced {converted} plain-text key(s) by their hashes; the keys still work",
            path.display()
        );
    }
    Ok(hashes)
}

/// The generated key's hash: a new key written to `path`, or the one a run
/// that stopped before recording its hash left there.
fn first_key(path: &Path) -> anyhow::Result<KeyHash> {
    let key = match std::fs::read_to_string(path) {
        Ok(text) => text.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = generate_key();
            // Created 0600: there is no moment the key is readable by others.
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("creating {}", path.display()))?;
            file.write_all(format!("{key}\n").as_bytes())?;
            file.sync_all()?;
            key
        }
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    check_length(&key).with_context(|| format!("{}", path.display()))?;
    Ok(KeyHash::of(&key))
}

/// The first key in the generated key's file, for the CLI's own calls.
pub fn generated_key(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join(GENERATED_KEY_FILE);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("no --api-key or E2B_API_KEY given and {} unreadable", path.display()))?;
    text.lines().map(str::trim).find(|l| !l.is_empty()).map(String::from).context("the generated key's file is empty")
}

/// A new random key, `e2b_` and 40 hex digits (160 bits).
pub fn generate_key() -> String {
    let bytes: [u8; 20] = rand::rng().random();
    format!("e2b_{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// How the store and the keys file keep `key`: `sha256:<hex>`.
pub fn hash_line(key: &str) -> String {
    KeyHash::of(key).to_line()
}

/// Replaces `path` with `text`, readable by its owner only (also while
/// being written); a crash leaves the old file or the new one.
pub(crate) fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn restrict_to_owner(path: &Path) -> anyhow::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {} to its owner", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Tests that read or change COPSE_API_KEY take turns.
    static ENV: Mutex<()> = Mutex::new(());

    fn without_env_key<T>(f: impl FnOnce() -> T) -> T {
        let _guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: every test touching COPSE_API_KEY holds ENV.
        unsafe { std::env::remove_var("COPSE_API_KEY") };
        f()
    }

    fn loopback() -> SocketAddr {
        "127.0.0.1:3000".parse().unwrap()
    }

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn public_listener_without_a_key_is_refused() {
        without_env_key(|| {
            let dir = tempfile::tempdir().unwrap();
            let err = ApiKeys::load(dir.path(), &"0.0.0.0:3000".parse().unwrap()).unwrap_err();
            assert!(err.to_string().contains("refusing to listen"));
            ApiKeys::load(dir.path(), &loopback()).unwrap();
            // The generated key is now configured, so a public address works.
            ApiKeys::load(dir.path(), &"0.0.0.0:3000".parse().unwrap()).unwrap();
        })
    }

    #[test]
    fn a_generated_key_is_accepted_and_kept_on_disk_only_as_a_hash_and_in_its_private_file() {
        without_env_key(|| {
            let dir = tempfile::tempdir().unwrap();
            let keys = ApiKeys::load(dir.path(), &loopback()).unwrap();
            let key = generated_key(dir.path()).unwrap();
            assert!(key.len() >= MIN_KEY_LEN);
            assert!(keys.accepts(&key));
            assert!(!keys.accepts(&format!("{key}x")));
            let generated = dir.path().join(GENERATED_KEY_FILE);
            let file = dir.path().join(KEYS_FILE);
            assert_eq!(mode(&generated), 0o600);
            assert_eq!(mode(&file), 0o600);
            let stored = std::fs::read_to_string(&file).unwrap();
            assert!(!stored.contains(&key), "the keys file holds the key itself");
            assert_eq!(keys.origin(), &Origin::File { keys: file.clone(), generated: Some(generated.clone()) });
            // A restart keeps the same key and generates no other.
            let again = ApiKeys::load(dir.path(), &loopback()).unwrap();
            assert!(again.accepts(&key));
            assert_eq!(generated_key(dir.path()).unwrap(), key);
        })
    }

    #[test]
    fn a_run_that_stopped_before_recording_the_hash_keeps_its_generated_key() {
        without_env_key(|| {
            let dir = tempfile::tempdir().unwrap();
            let key = "e2b_0123456789abcdef0123456789abcdef01234567";
            std::fs::write(dir.path().join(GENERATED_KEY_FILE), format!("{key}\n")).unwrap();
            let keys = ApiKeys::load(dir.path(), &loopback()).unwrap();
            assert!(keys.accepts(key));
        })
    }

    #[test]
    fn plain_keys_left_by_older_versions_are_converted_to_hashes() {
        without_env_key(|| {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join(KEYS_FILE);
            let key = "an-old-plain-text-key-of-some-length";
            std::fs::write(&file, format!("# comment\n{key}\n")).unwrap();
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
            let keys = ApiKeys::load(dir.path(), &"0.0.0.0:3000".parse().unwrap()).unwrap();
            assert!(keys.accepts(key));
            let stored = std::fs::read_to_string(&file).unwrap();
            assert!(!stored.contains(key));
            assert!(stored.starts_with("# comment\nsha256:"));
            assert_eq!(mode(&file), 0o600);
            assert!(!dir.path().join(GENERATED_KEY_FILE).exists());
            assert!(ApiKeys::load(dir.path(), &loopback()).unwrap().accepts(key));
        })
    }

    #[test]
    fn short_keys_are_refused_without_being_repeated() {
        let _guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        // SAFETY: every test touching COPSE_API_KEY holds ENV.
        unsafe { std::env::set_var("COPSE_API_KEY", "a-long-enough-key-0123456789,shortkey") };
        let err = format!("{:#}", ApiKeys::load(dir.path(), &loopback()).unwrap_err());
        unsafe { std::env::remove_var("COPSE_API_KEY") };
        assert!(err.contains("COPSE_API_KEY: entry 2"), "{err}");
        assert!(err.contains("at least 20"), "{err}");
        assert!(!err.contains("shortkey"), "{err}");
        assert!(ApiKeys::new(["x"]).is_err());
    }

    #[test]
    fn environment_keys_may_be_hashes() {
        let _guard = ENV.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let key = "a-key-known-only-by-its-hash-000";
        let line = KeyHash::of(key).to_line();
        // SAFETY: every test touching COPSE_API_KEY holds ENV.
        unsafe { std::env::set_var("COPSE_API_KEY", &line) };
        let keys = ApiKeys::load(dir.path(), &"0.0.0.0:3000".parse().unwrap());
        unsafe { std::env::remove_var("COPSE_API_KEY") };
        let keys = keys.unwrap();
        assert!(keys.accepts(key));
        assert!(!keys.accepts(&line));
        assert_eq!(keys.origin(), &Origin::Environment);
        assert!(!dir.path().join(KEYS_FILE).exists());
    }

    #[test]
    fn hashes_parse_only_in_full() {
        let line = KeyHash::of("k").to_line();
        assert!(KeyHash::parse(&line).is_some_and(|h| h == KeyHash::of("k")));
        assert!(KeyHash::parse(&line[..line.len() - 1]).is_none());
        assert!(KeyHash::parse(&format!("{line}0")).is_none());
        assert!(KeyHash::parse(&line.replace("sha256:", "sha1:")).is_none());
    }
}
