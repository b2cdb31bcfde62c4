//! Secret values at rest: sealed with AES-256-GCM under a key the operator
//! holds in `DATA_DIR/secrets.keyring` (0600), never in the database, so a
//! copy of `copse.db` (a backup, a support bundle) gives no value away.
//!
//! The keyring is one key per line, `<id> <64 hex digits>`, the first being
//! the one that seals; the others only open values sealed before a rotation.
//! Each sealed value names its key and is bound to its secret and version
//! (the AEAD's associated data), so a value copied onto another record does
//! not open.
//!
//! Rotation (`copse secrets rotate-key`, with the gateway running or not):
//! a new key goes first in the keyring, every kept version is re-sealed
//! under it, then the old keys leave the keyring. A crash in between leaves
//! both keys, and running it again finishes the job. Writers hold
//! `secrets.lock` shared from reading the keyring to storing what they
//! sealed; rotation holds it exclusively, so nothing is sealed under a key
//! it is about to drop.

use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use rand::Rng;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

use crate::model::{SealedValue, SecretRecord, SecretStore, Store, now_ms};

pub const KEYRING_FILE: &str = "secrets.keyring";
const LOCK_FILE: &str = "secrets.lock";
const KEY_LEN: usize = 32;

/// Only paths: every use reads the keyring and takes the lock afresh.
#[derive(Clone)]
pub struct Vault {
    keyring: PathBuf,
    lock: PathBuf,
}

struct Key {
    id: String,
    bytes: [u8; KEY_LEN],
}

/// The keys of the keyring as read once.
pub struct Keyring(Vec<Key>);

impl Keyring {
    pub fn unseal(&self, context: &str, sealed: &SealedValue) -> anyhow::Result<Vec<u8>> {
        let key = self
            .0
            .iter()
            .find(|k| k.id == sealed.key_id)
            .with_context(|| format!("key {} is not in the secrets keyring", sealed.key_id))?;
        unseal_with(key, context, sealed)
    }
}

/// Held while sealing and storing (shared) or rotating (exclusive).
pub struct Held(File);

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

impl Vault {
    /// The vault of `data_dir`, with a keyring made on first use.
    pub fn open(data_dir: &Path) -> anyhow::Result<Self> {
        let vault = Self { keyring: data_dir.join(KEYRING_FILE), lock: data_dir.join(LOCK_FILE) };
        let _held = vault.hold(true)?;
        if !vault.keyring.exists() {
            write_keyring(&vault.keyring, &[Key::fresh()])?;
        }
        vault.keys()?;
        Ok(vault)
    }

    /// Blocks until no rotation runs; keep it across seal and store.
    pub fn writing(&self) -> anyhow::Result<Held> {
        self.hold(false)
    }

    fn hold(&self, exclusive: bool) -> anyhow::Result<Held> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&self.lock)
            .with_context(|| format!("opening {}", self.lock.display()))?;
        if exclusive { file.lock() } else { file.lock_shared() }
            .with_context(|| format!("locking {}", self.lock.display()))?;
        Ok(Held(file))
    }

    /// Read on every use: a rotation by the CLI takes effect in a running
    /// gateway at once. The file is a few lines; secrets are written rarely.
    fn keys(&self) -> anyhow::Result<Vec<Key>> {
        let text = std::fs::read_to_string(&self.keyring)
            .with_context(|| format!("reading the secrets keyring {}", self.keyring.display()))?;
        let keys = text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(Key::parse)
            .collect::<anyhow::Result<Vec<_>>>()
            .with_context(|| format!("in {}", self.keyring.display()))?;
        if keys.is_empty() {
            bail!("the secrets keyring {} holds no key", self.keyring.display());
        }
        Ok(keys)
    }

    pub fn seal(&self, context: &str, plaintext: &[u8]) -> anyhow::Result<SealedValue> {
        let keys = self.keys()?;
        seal_with(&keys[0], context, plaintext)
    }

    pub fn unseal(&self, context: &str, sealed: &SealedValue) -> anyhow::Result<Vec<u8>> {
        self.keyring()?.unseal(context, sealed)
    }

    /// The keyring as it is now, to open many values with one read.
    pub fn keyring(&self) -> anyhow::Result<Keyring> {
        Ok(Keyring(self.keys()?))
    }

    /// Re-seals every kept version, and every sandbox's upstream password
    /// (`store/sealing.rs`, in `sandboxes` as stored), under a new key and
    /// drops the old keys. Returns how many values were re-sealed.
    pub fn rotate(&self, store: &dyn SecretStore, sandboxes: &dyn Store) -> anyhow::Result<usize> {
        let _held = self.hold(true)?;
        let mut keys = self.keys()?;
        keys.insert(0, Key::fresh());
        write_keyring(&self.keyring, &keys)?;
        let mut resealed = 0;
        for mut record in store.secrets()? {
            for version in &mut record.versions {
                if version.value.key_id == keys[0].id {
                    continue;
                }
                let context = seal_context(&record.id, version.version);
                let key = keys.iter().find(|k| k.id == version.value.key_id).with_context(|| {
                    format!("secret {} version {}: key {} is gone", record.id, version.version, version.value.key_id)
                })?;
                let plaintext = unseal_with(key, &context, &version.value)?;
                version.value = seal_with(&keys[0], &context, &plaintext)?;
                resealed += 1;
            }
            record.updated_at_ms = record.updated_at_ms.max(now_ms());
            store.update_secret(&record)?;
        }
        for mut record in sandboxes.all()? {
            let Some(sealed) = record.sealed_upstream_password.as_ref().filter(|s| s.key_id != keys[0].id) else {
                continue;
            };
            let context = crate::store::sealing::seal_context(&record.id);
            let key = keys.iter().find(|k| k.id == sealed.key_id).with_context(|| {
                format!("sandbox {}'s egress proxy password: key {} is gone", record.id, sealed.key_id)
            })?;
            let plaintext = unseal_with(key, &context, sealed)?;
            record.sealed_upstream_password = Some(seal_with(&keys[0], &context, &plaintext)?);
            sandboxes.put(&record)?;
            resealed += 1;
        }
        keys.truncate(1);
        write_keyring(&self.keyring, &keys)?;
        Ok(resealed)
    }
}

/// The associated data binding a sealed value to its secret and version.
pub fn seal_context(secret_id: &str, version: u32) -> String {
    format!("copse-secret:{secret_id}:{version}")
}

/// The current value of `record`, opened: for the egress proxy that
/// resolves placeholders (see `Secrets::resolver`).
pub fn current_value(vault: &Vault, record: &SecretRecord) -> anyhow::Result<Vec<u8>> {
    let newest = record.versions.first().context("the secret has no value")?;
    vault.unseal(&seal_context(&record.id, newest.version), &newest.value)
}

impl Key {
    fn fresh() -> Self {
        let bytes: [u8; KEY_LEN] = rand::rng().random();
        let id: [u8; 4] = rand::rng().random();
        Self { id: hex(&id), bytes }
    }

    fn parse(line: &str) -> anyhow::Result<Self> {
        let (id, key) = line.split_once(char::is_whitespace).context("a key line is `<id> <64 hex digits>`")?;
        let key = key.trim();
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
            bail!("a key id is letters and digits");
        }
        if key.len() != KEY_LEN * 2 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
            bail!("key {id} is not {} hex digits", KEY_LEN * 2);
        }
        let mut bytes = [0u8; KEY_LEN];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&key[2 * i..2 * i + 2], 16).expect("checked hex");
        }
        Ok(Self { id: id.to_string(), bytes })
    }

    fn aead(&self) -> LessSafeKey {
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &self.bytes).expect("32-byte key"))
    }
}

fn seal_with(key: &Key, context: &str, plaintext: &[u8]) -> anyhow::Result<SealedValue> {
    // Random 96-bit nonces: far below the 2^32 messages per key where
    // their collision starts to matter for GCM.
    let nonce: [u8; NONCE_LEN] = rand::rng().random();
    let mut sealed = plaintext.to_vec();
    key.aead()
        .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::from(context.as_bytes()), &mut sealed)
        .map_err(|_| anyhow::anyhow!("sealing a secret failed"))?;
    Ok(SealedValue { key_id: key.id.clone(), nonce: BASE64.encode(nonce), ciphertext: BASE64.encode(sealed) })
}

fn unseal_with(key: &Key, context: &str, sealed: &SealedValue) -> anyhow::Result<Vec<u8>> {
    let nonce: [u8; NONCE_LEN] = BASE64
        .decode(&sealed.nonce)
        .ok()
        .and_then(|n| n.try_into().ok())
        .context("a sealed secret's nonce is malformed")?;
    let mut buffer = BASE64.decode(&sealed.ciphertext).context("a sealed secret is not base64")?;
    let plaintext = key
        .aead()
        .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(context.as_bytes()), &mut buffer)
        .map_err(|_| anyhow::anyhow!("a sealed secret does not open with key {}: altered or misplaced", key.id))?;
    Ok(plaintext.to_vec())
}

/// Replaced whole (`keys::write_private`), so a crash leaves the old
/// keyring or the new one.
fn write_keyring(path: &Path, keys: &[Key]) -> anyhow::Result<()> {
    let mut text = String::from("# copse secrets keyring: the first key seals, the others open older values.\n");
    for key in keys {
        writeln!(text, "{} {}", key.id, hex(&key.bytes)).expect("writing to a String");
    }
    crate::keys::write_private(path, &text)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::store::SqliteStore;

    fn record(vault: &Vault, id: &str, values: &[&str]) -> SecretRecord {
        let mut record = SecretRecord {
            id: id.into(),
            team: crate::model::DEFAULT_TEAM.into(),
            name: format!("name-{id}"),
            metadata: Default::default(),
            created_at_ms: 0,
            updated_at_ms: 0,
            versions: Vec::new(),
        };
        for value in values {
            let sealed = vault.seal(&seal_context(id, record.current_version() + 1), value.as_bytes()).unwrap();
            record.push_version(sealed, 0);
        }
        record
    }

    #[test]
    fn a_value_opens_only_for_its_own_secret_and_version() {
        let dir = tempfile::tempdir().unwrap();
        let vault = Vault::open(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join(KEYRING_FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let sealed = vault.seal(&seal_context("a", 1), b"hunter2").unwrap();
        assert!(!sealed.ciphertext.contains("hunter2"));
        assert_eq!(vault.unseal(&seal_context("a", 1), &sealed).unwrap(), b"hunter2");
        assert!(vault.unseal(&seal_context("b", 1), &sealed).is_err());
        assert!(vault.unseal(&seal_context("a", 2), &sealed).is_err());
        let mut altered = sealed.clone();
        altered.ciphertext = BASE64.encode(b"not what was sealed at all");
        assert!(vault.unseal(&seal_context("a", 1), &altered).is_err());
    }

    #[test]
    fn rotation_reseals_every_kept_version_and_drops_the_old_key() {
        let dir = tempfile::tempdir().unwrap();
        let vault = Vault::open(dir.path()).unwrap();
        let store = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        store.insert_secret(&record(&vault, "a", &["one", "two"])).unwrap();
        store.insert_secret(&record(&vault, "b", &["three"])).unwrap();
        let old_keyring = std::fs::read_to_string(dir.path().join(KEYRING_FILE)).unwrap();

        assert_eq!(vault.rotate(&store, &store).unwrap(), 3);
        let keys = vault.keys().unwrap();
        assert_eq!(keys.len(), 1);
        assert!(!old_keyring.contains(&hex(&keys[0].bytes)));
        let a = store.secret("a").unwrap().unwrap();
        assert!(a.versions.iter().all(|v| v.value.key_id == keys[0].id));
        assert_eq!(current_value(&vault, &a).unwrap(), b"two");
        assert_eq!(vault.unseal(&seal_context("a", 1), &a.versions[1].value).unwrap(), b"one");
        assert_eq!(current_value(&vault, &store.secret("b").unwrap().unwrap()).unwrap(), b"three");
    }

    #[test]
    fn a_rotation_cut_short_is_finished_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let vault = Vault::open(dir.path()).unwrap();
        let store = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        store.insert_secret(&record(&vault, "a", &["v"])).unwrap();
        // As a crash after the new key was written leaves it.
        let mut keys = vault.keys().unwrap();
        keys.insert(0, Key::fresh());
        write_keyring(&vault.keyring, &keys).unwrap();
        assert_eq!(current_value(&vault, &store.secret("a").unwrap().unwrap()).unwrap(), b"v");

        vault.rotate(&store, &store).unwrap();
        assert_eq!(vault.keys().unwrap().len(), 1);
        assert_eq!(current_value(&vault, &store.secret("a").unwrap().unwrap()).unwrap(), b"v");
    }

    #[test]
    fn a_damaged_keyring_is_an_error_that_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(KEYRING_FILE), "k1 abc\n").unwrap();
        let err = format!("{:#}", Vault::open(dir.path()).err().unwrap());
        assert!(err.contains(KEYRING_FILE), "{err}");
    }
}
