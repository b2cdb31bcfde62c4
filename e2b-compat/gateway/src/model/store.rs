//! Where the records live between requests and across restarts. The
//! service sees only this trait; `store::sqlite` is today's implementation,
//! and another (say PostgreSQL) is one more `impl Store`.

use super::sandbox::SandboxRecord;
use super::secret::SecretRecord;
use super::snapshot::SnapshotRecord;

pub trait Store: Send + Sync {
    /// Inserts or replaces the sandbox's record.
    fn put(&self, record: &SandboxRecord) -> anyhow::Result<()>;
    fn get(&self, id: &str) -> anyhow::Result<Option<SandboxRecord>>;
    /// Every sandbox, ordered by id.
    fn all(&self) -> anyhow::Result<Vec<SandboxRecord>>;
    /// Ids whose expiry is at or before `now_ms`.
    fn expired(&self, now_ms: i64) -> anyhow::Result<Vec<String>>;
    /// Whether there was a record to remove.
    fn remove(&self, id: &str) -> anyhow::Result<bool>;

    /// Inserts or replaces the snapshot's record.
    fn put_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<()>;
    fn snapshot(&self, id: &str) -> anyhow::Result<Option<SnapshotRecord>>;
    /// Every snapshot, ordered by id.
    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotRecord>>;
    fn remove_snapshot(&self, id: &str) -> anyhow::Result<bool>;
}

/// Secrets: a trait of their own, so the sandbox service never sees them
/// and the secrets service sees nothing else.
pub trait SecretStore: Send + Sync {
    /// False, and nothing written, when the name is taken.
    fn insert_secret(&self, record: &SecretRecord) -> anyhow::Result<bool>;
    /// False when there is no record with this id any more.
    fn update_secret(&self, record: &SecretRecord) -> anyhow::Result<bool>;
    fn secret(&self, id: &str) -> anyhow::Result<Option<SecretRecord>>;
    fn secret_named(&self, name: &str) -> anyhow::Result<Option<SecretRecord>>;
    /// Every secret, ordered by id.
    fn secrets(&self) -> anyhow::Result<Vec<SecretRecord>>;
    fn remove_secret(&self, id: &str) -> anyhow::Result<bool>;
}
