//! Where the records live between requests and across restarts. The
//! service sees only this trait; `store::sqlite` is today's implementation,
//! and another (say PostgreSQL) is one more `impl Store`.

use super::sandbox::SandboxRecord;
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
