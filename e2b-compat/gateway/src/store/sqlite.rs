//! The [`Store`] in SQLite (WAL): durable sandbox state, so a restarted
//! gateway knows which sandboxes to re-adopt and which resources to clean.
//!
//! Each sandbox is one row: its id, its expiry (indexed for the reaper) and
//! the whole record as JSON, so new fields need no migration.

use std::path::Path;
use std::sync::Mutex;

use anyhow::Context;
use rusqlite::{Connection, OptionalExtension, params};

use crate::model::{SandboxRecord, SnapshotRecord, Store};

pub struct SqliteStore {
    conn: Mutex<Connection>,
}

impl SqliteStore {
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let conn = Connection::open(path).with_context(|| format!("opening {}", path.display()))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // Losing the last transaction on power loss is acceptable: recovery
        // destroys resources no row mentions.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS sandboxes (
                 id TEXT PRIMARY KEY,
                 end_at_ms INTEGER NOT NULL,
                 record TEXT NOT NULL
             );
             CREATE INDEX IF NOT EXISTS sandboxes_end_at ON sandboxes(end_at_ms);
             CREATE TABLE IF NOT EXISTS snapshots (
                 id TEXT PRIMARY KEY,
                 record TEXT NOT NULL
             );",
        )?;
        Ok(Self { conn: Mutex::new(conn) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves SQLite itself consistent.
        self.conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Store for SqliteStore {
    fn put(&self, record: &SandboxRecord) -> anyhow::Result<()> {
        let json = serde_json::to_string(record)?;
        self.lock().execute(
            "INSERT INTO sandboxes (id, end_at_ms, record) VALUES (?1, ?2, ?3)
             ON CONFLICT(id) DO UPDATE SET end_at_ms = excluded.end_at_ms, record = excluded.record",
            params![record.id, record.end_at_ms, json],
        )?;
        Ok(())
    }

    fn get(&self, id: &str) -> anyhow::Result<Option<SandboxRecord>> {
        let json: Option<String> = self
            .lock()
            .query_row("SELECT record FROM sandboxes WHERE id = ?1", params![id], |row| row.get(0))
            .optional()?;
        json.map(|j| serde_json::from_str(&j).context("corrupt sandbox record")).transpose()
    }

    fn all(&self) -> anyhow::Result<Vec<SandboxRecord>> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT record FROM sandboxes ORDER BY id")?;
        let rows = stmt.query_map([], |row| row.get::<_, String>(0))?;
        rows.map(|r| Ok(serde_json::from_str(&r?)?)).collect()
    }

    fn expired(&self, now_ms: i64) -> anyhow::Result<Vec<String>> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT id FROM sandboxes WHERE end_at_ms <= ?1")?;
        let rows = stmt.query_map(params![now_ms], |row| row.get::<_, String>(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn remove(&self, id: &str) -> anyhow::Result<bool> {
        Ok(self.lock().execute("DELETE FROM sandboxes WHERE id = ?1", params![id])? > 0)
    }

    fn put_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<()> {
        let json = serde_json::to_string(record)?;
        self.lock().execute(
            "INSERT INTO snapshots (id, record) VALUES (?1, ?2)
             ON CONFLICT(id) DO UPDATE SET record = excluded.record",
            params![record.id, json],
        )?;
        Ok(())
    }

    fn snapshot(&self, id: &str) -> anyhow::Result<Option<SnapshotRecord>> {
        let json: Option<String> = self
            .lock()
            .query_row("SELECT record FROM snapshots WHERE id = ?1", params![id], |row| row.get(0))
            .optional()?;
        json.map(|j| serde_json::from_str(&j).context("corrupt snapshot record")).transpose()
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotRecord>> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT record FROM snapshots ORDER BY id")?;
        let rows = stmt.query_map([], |row| row.get::<_, String>(0))?;
        rows.map(|r| Ok(serde_json::from_str(&r?)?)).collect()
    }

    fn remove_snapshot(&self, id: &str) -> anyhow::Result<bool> {
        Ok(self.lock().execute("DELETE FROM snapshots WHERE id = ?1", params![id])? > 0)
    }
}
