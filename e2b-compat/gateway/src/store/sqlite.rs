//! The [`Store`] in SQLite (WAL): durable sandbox state, so a restarted
//! gateway knows which sandboxes to re-adopt and which resources to clean.
//!
//! Each sandbox is one row: its id, its expiry (indexed for the reaper) and
//! the whole record as JSON, so new fields need no migration. Snapshots are
//! keyed by team and id (names are per team), teams by name, keys by hash.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior, params};
use serde::de::DeserializeOwned;

use super::table::{REVOCATION_LIST, Table};
use crate::model::{
    Admit, BuildLayer, DEFAULT_TEAM, Intent, KeyRecord, NodeRecord, NodeStore, PlaceClaim, SandboxRecord, SecretRecord,
    SecretStore, SnapshotRecord, Store, Team, TeamUsage, TemplateLabels, TemplateRecord, VolumeMove, VolumeRecord,
    VolumeStore,
};

pub struct SqliteStore {
    conn: Mutex<Connection>,
}

impl SqliteStore {
    /// Opens (creating) the database at `path`, readable by its owner only:
    /// it holds every sandbox's access token and environment.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        private_file(path, true)?;
        let conn = Connection::open(path).with_context(|| format!("opening {}", path.display()))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // SQLite gives new WAL and shared-memory files the database's mode;
        // ones an older version left keep theirs unless fixed here.
        for suffix in ["-wal", "-shm"] {
            private_file(&sidecar(path, suffix), false)?;
        }
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
             );
             CREATE TABLE IF NOT EXISTS quarantine (
                 kind TEXT NOT NULL,
                 id TEXT NOT NULL,
                 record TEXT NOT NULL,
                 reason TEXT NOT NULL,
                 at_ms INTEGER NOT NULL
             );
             CREATE TABLE IF NOT EXISTS team_secrets (
                 id TEXT PRIMARY KEY,
                 team TEXT NOT NULL,
                 name TEXT NOT NULL,
                 record TEXT NOT NULL,
                 UNIQUE (team, name)
             );
             CREATE TABLE IF NOT EXISTS team_volumes (
                 id TEXT PRIMARY KEY,
                 team TEXT NOT NULL,
                 name TEXT NOT NULL,
                 record TEXT NOT NULL,
                 UNIQUE (team, name)
             );
             CREATE TABLE IF NOT EXISTS team_snapshots (
                 team TEXT NOT NULL,
                 id TEXT NOT NULL,
                 record TEXT NOT NULL,
                 PRIMARY KEY (team, id)
             );
             CREATE TABLE IF NOT EXISTS built_templates (
                 id TEXT PRIMARY KEY,
                 team TEXT NOT NULL,
                 name TEXT NOT NULL,
                 record TEXT NOT NULL,
                 UNIQUE (team, name)
             );
             CREATE TABLE IF NOT EXISTS build_layers (
                 id TEXT PRIMARY KEY,
                 team TEXT NOT NULL,
                 record TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS template_labels (
                 id TEXT PRIMARY KEY,
                 record TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS teams (
                 name TEXT PRIMARY KEY,
                 record TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS keys (
                 hash TEXT PRIMARY KEY,
                 prefix TEXT NOT NULL,
                 record TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS journal (
                 id TEXT PRIMARY KEY,
                 record TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS nodes (
                 id TEXT PRIMARY KEY,
                 record TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS place_claims (
                 id TEXT PRIMARY KEY,
                 node TEXT NOT NULL,
                 team TEXT NOT NULL,
                 usage TEXT NOT NULL,
                 at_ms INTEGER NOT NULL
             );
             CREATE TABLE IF NOT EXISTS revocation_lists (
                 id TEXT PRIMARY KEY,
                 pem TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS generations (
                 name TEXT PRIMARY KEY,
                 value INTEGER NOT NULL
             );",
        )?;
        // Snapshots from before teams were the default team's; moved in one
        // transaction, so a crash leaves them in one table or the other.
        conn.execute_batch(&format!(
            "BEGIN IMMEDIATE;
             INSERT OR IGNORE INTO team_snapshots (team, id, record)
                 SELECT '{DEFAULT_TEAM}', id, record FROM snapshots;
             DELETE FROM snapshots;
             COMMIT;"
        ))?;
        // Secrets from before teams were one name space, the default team's.
        let old_secrets: i64 =
            conn.query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'secrets'", [], |r| {
                r.get(0)
            })?;
        if old_secrets > 0 {
            conn.execute_batch(&format!(
                "BEGIN IMMEDIATE;
                 INSERT OR IGNORE INTO team_secrets (id, team, name, record)
                     SELECT id, '{DEFAULT_TEAM}', name, record FROM secrets;
                 DROP TABLE secrets;
                 COMMIT;"
            ))?;
        }
        Ok(Self { conn: Mutex::new(conn) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connection> {
        // A panic while holding the lock leaves SQLite itself consistent.
        self.conn.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Makes `path` readable by its owner only, creating it (already private,
/// so it is never readable by others) if `create` and it is missing.
///
/// An existing database is never opened here: closing any descriptor of a
/// file drops every POSIX lock this process holds on it, so a second
/// connection's open (the gateway keeps two) would strip the first of its
/// locks, and another process (the CLI) could then checkpoint and reset
/// the WAL under it, corrupting the database.
fn private_file(path: &Path, create: bool) -> anyhow::Result<()> {
    if create && std::fs::symlink_metadata(path).is_err() {
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)
            .with_context(|| format!("creating {}", path.display()))?;
    }
    match std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        result => result.with_context(|| format!("making {} private to its owner", path.display())),
    }
}

fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
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

    fn swap_paused(&self, record: &SandboxRecord, from_node: Option<&str>) -> anyhow::Result<bool> {
        let files = record.paused.as_ref().and_then(|p| p.files_only.as_deref());
        let swapped = self.lock().execute(
            "UPDATE sandboxes SET end_at_ms = ?2, record = ?3 WHERE id = ?1
             AND json_extract(record, '$.node') IS ?4 AND json_extract(record, '$.paused.files_only') IS ?5",
            params![record.id, record.end_at_ms, serde_json::to_string(record)?, from_node, files],
        )?;
        Ok(swapped > 0)
    }

    fn get(&self, id: &str) -> anyhow::Result<Option<SandboxRecord>> {
        decode_one(&self.lock(), Table::Sandboxes, "id", id)
    }

    fn all(&self) -> anyhow::Result<Vec<SandboxRecord>> {
        decode_all(&self.lock(), Table::Sandboxes)
    }

    fn expired(&self, now_ms: i64) -> anyhow::Result<Vec<String>> {
        let conn = self.lock();
        let mut stmt = conn.prepare("SELECT id FROM sandboxes WHERE end_at_ms <= ?1")?;
        let rows = stmt.query_map(params![now_ms], |row| row.get::<_, String>(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    fn remove(&self, id: &str) -> anyhow::Result<bool> {
        delete_by_id(&self.lock(), Table::Sandboxes, id)
    }

    fn put_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<()> {
        let json = serde_json::to_string(record)?;
        self.lock().execute(
            "INSERT INTO team_snapshots (team, id, record) VALUES (?1, ?2, ?3)
             ON CONFLICT(team, id) DO UPDATE SET record = excluded.record",
            params![record.team, record.id, json],
        )?;
        Ok(())
    }

    fn snapshot(&self, team: &str, id: &str) -> anyhow::Result<Option<SnapshotRecord>> {
        let json: Option<String> = self
            .lock()
            .query_row("SELECT record FROM team_snapshots WHERE team = ?1 AND id = ?2", params![team, id], |row| {
                row.get(0)
            })
            .optional()?;
        json.map(|j| serde_json::from_str(&j).context("corrupt snapshot record")).transpose()
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotRecord>> {
        self.records("SELECT record FROM team_snapshots ORDER BY team, id")
    }

    fn remove_snapshot(&self, team: &str, id: &str) -> anyhow::Result<bool> {
        Ok(self.lock().execute("DELETE FROM team_snapshots WHERE team = ?1 AND id = ?2", params![team, id])? > 0)
    }

    fn update_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<bool> {
        let json = serde_json::to_string(record)?;
        Ok(self.lock().execute(
            "UPDATE team_snapshots SET record = ?4
             WHERE team = ?1 AND id = ?2 AND json_extract(record, '$.key') = ?3",
            params![record.team, record.id, record.key, json],
        )? > 0)
    }

    fn put_template(&self, record: &TemplateRecord) -> anyhow::Result<()> {
        let json = serde_json::to_string(record)?;
        self.lock().execute(
            "INSERT INTO built_templates (id, team, name, record) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(id) DO UPDATE SET record = excluded.record",
            params![record.id, record.team, record.name, json],
        )?;
        Ok(())
    }

    fn template(&self, id: &str) -> anyhow::Result<Option<TemplateRecord>> {
        decode_one(&self.lock(), Table::Templates, "id", id)
    }

    fn template_named(&self, team: &str, name: &str) -> anyhow::Result<Option<TemplateRecord>> {
        decode_named(&self.lock(), Table::Templates, team, name)
    }

    fn built_templates(&self) -> anyhow::Result<Vec<TemplateRecord>> {
        decode_all(&self.lock(), Table::Templates)
    }

    fn remove_template(&self, id: &str) -> anyhow::Result<bool> {
        delete_by_id(&self.lock(), Table::Templates, id)
    }

    fn put_build_layer(&self, layer: &BuildLayer) -> anyhow::Result<()> {
        let json = serde_json::to_string(layer)?;
        self.lock().execute(
            "INSERT INTO build_layers (id, team, record) VALUES (?1, ?2, ?3)
             ON CONFLICT(id) DO UPDATE SET record = excluded.record",
            params![layer.key, layer.team, json],
        )?;
        Ok(())
    }

    fn build_layer(&self, team: &str, key: &str) -> anyhow::Result<Option<BuildLayer>> {
        let found: Option<BuildLayer> = decode_one(&self.lock(), Table::BuildLayers, "id", key)?;
        Ok(found.filter(|layer| layer.team == team))
    }

    fn build_layers(&self) -> anyhow::Result<Vec<BuildLayer>> {
        decode_all(&self.lock(), Table::BuildLayers)
    }

    fn remove_build_layer(&self, key: &str) -> anyhow::Result<bool> {
        delete_by_id(&self.lock(), Table::BuildLayers, key)
    }

    fn swap_template_labels(&self, labels: &TemplateLabels) -> anyhow::Result<bool> {
        let json = serde_json::to_string(labels)?;
        let read = labels.revision.saturating_sub(1) as i64;
        let written = self.lock().execute(
            "INSERT INTO template_labels (id, record) VALUES (?1, ?2)
             ON CONFLICT(id) DO UPDATE SET record = excluded.record
             WHERE COALESCE(json_extract(template_labels.record, '$.revision'), 0) = ?3",
            params![labels.id, json, read],
        )?;
        Ok(written > 0)
    }

    fn template_labels(&self, id: &str) -> anyhow::Result<Option<TemplateLabels>> {
        decode_one(&self.lock(), Table::TemplateLabels, "id", id)
    }

    fn remove_template_labels(&self, id: &str) -> anyhow::Result<bool> {
        delete_by_id(&self.lock(), Table::TemplateLabels, id)
    }

    fn put_team(&self, team: &Team) -> anyhow::Result<()> {
        let json = serde_json::to_string(team)?;
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        tx.execute(
            "INSERT INTO teams (name, record) VALUES (?1, ?2)
             ON CONFLICT(name) DO UPDATE SET record = excluded.record",
            params![team.name, json],
        )?;
        bump_tenancy(&tx)?;
        tx.commit()?;
        Ok(())
    }

    fn teams(&self) -> anyhow::Result<Vec<Team>> {
        self.records("SELECT record FROM teams ORDER BY name")
    }

    fn put_key(&self, key: &KeyRecord) -> anyhow::Result<()> {
        let json = serde_json::to_string(key)?;
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        tx.execute(
            "INSERT INTO keys (hash, prefix, record) VALUES (?1, ?2, ?3)
             ON CONFLICT(hash) DO UPDATE SET prefix = excluded.prefix, record = excluded.record",
            params![key.hash, key.prefix, json],
        )?;
        bump_tenancy(&tx)?;
        tx.commit()?;
        Ok(())
    }

    fn keys(&self) -> anyhow::Result<Vec<KeyRecord>> {
        self.records("SELECT record FROM keys ORDER BY prefix")
    }

    fn revoke_key(&self, prefix: &str) -> anyhow::Result<Option<KeyRecord>> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let matching: Vec<(String, String)> = {
            let mut stmt = tx.prepare("SELECT hash, record FROM keys WHERE substr(prefix, 1, length(?1)) = ?1")?;
            let rows = stmt.query_map(params![prefix], |row| Ok((row.get(0)?, row.get(1)?)))?;
            rows.collect::<Result<_, _>>()?
        };
        let (hash, json) = match matching.as_slice() {
            [] => return Ok(None),
            [one] => one.clone(),
            many => anyhow::bail!("{} keys start with {prefix:?}; give more of the prefix", many.len()),
        };
        tx.execute("DELETE FROM keys WHERE hash = ?1", params![hash])?;
        bump_tenancy(&tx)?;
        tx.commit()?;
        Ok(Some(serde_json::from_str(&json).context("corrupt key record")?))
    }

    fn keys_used(&self, used: &[(String, i64)]) -> anyhow::Result<()> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        for (hash, at_ms) in used {
            // A key revoked meanwhile stays revoked: only existing rows change.
            tx.execute(
                "UPDATE keys SET record = json_set(record, '$.last_used_ms', ?2) WHERE hash = ?1",
                params![hash, at_ms],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    fn tenancy_generation(&self) -> anyhow::Result<i64> {
        let value = self
            .lock()
            .query_row("SELECT value FROM generations WHERE name = 'tenancy'", [], |row| row.get(0))
            .optional()?;
        Ok(value.unwrap_or(0))
    }

    fn put_intent(&self, intent: &Intent) -> anyhow::Result<()> {
        upsert_by_id(&self.lock(), Table::Journal, &intent.id, intent)
    }

    fn intents(&self) -> anyhow::Result<Vec<Intent>> {
        decode_all(&self.lock(), Table::Journal)
    }

    fn remove_intent(&self, id: &str) -> anyhow::Result<()> {
        delete_by_id(&self.lock(), Table::Journal, id).map(drop)
    }
}

/// Marks keys or teams changed, in the transaction that changes them.
fn bump_tenancy(tx: &rusqlite::Transaction) -> anyhow::Result<()> {
    tx.execute(
        "INSERT INTO generations (name, value) VALUES ('tenancy', 1)
         ON CONFLICT(name) DO UPDATE SET value = value + 1",
        [],
    )?;
    Ok(())
}

impl SqliteStore {
    fn records<T: serde::de::DeserializeOwned>(&self, sql: &str) -> anyhow::Result<Vec<T>> {
        let conn = self.lock();
        let mut stmt = conn.prepare(sql)?;
        let rows = stmt.query_map([], |row| row.get::<_, String>(0))?;
        rows.map(|r| Ok(serde_json::from_str(&r?)?)).collect()
    }
}

impl SecretStore for SqliteStore {
    fn insert_secret(&self, record: &SecretRecord) -> anyhow::Result<bool> {
        insert_named(&self.lock(), Table::Secrets, &record.id, &record.team, &record.name, record)
    }

    fn update_secret(&self, record: &SecretRecord) -> anyhow::Result<bool> {
        let json = serde_json::to_string(record)?;
        let updated =
            self.lock().execute("UPDATE team_secrets SET record = ?2 WHERE id = ?1", params![record.id, json])?;
        Ok(updated > 0)
    }

    fn secret(&self, id: &str) -> anyhow::Result<Option<SecretRecord>> {
        decode_one(&self.lock(), Table::Secrets, "id", id)
    }

    fn secret_named(&self, team: &str, name: &str) -> anyhow::Result<Option<SecretRecord>> {
        decode_named(&self.lock(), Table::Secrets, team, name)
    }

    fn secrets(&self) -> anyhow::Result<Vec<SecretRecord>> {
        decode_all(&self.lock(), Table::Secrets)
    }

    fn remove_secret(&self, id: &str) -> anyhow::Result<bool> {
        delete_by_id(&self.lock(), Table::Secrets, id)
    }
}

impl VolumeStore for SqliteStore {
    fn insert_volume(&self, record: &VolumeRecord) -> anyhow::Result<bool> {
        insert_named(&self.lock(), Table::Volumes, &record.id, &record.team, &record.name, record)
    }

    fn volume(&self, id: &str) -> anyhow::Result<Option<VolumeRecord>> {
        decode_one(&self.lock(), Table::Volumes, "id", id)
    }

    fn volume_named(&self, team: &str, name: &str) -> anyhow::Result<Option<VolumeRecord>> {
        decode_named(&self.lock(), Table::Volumes, team, name)
    }

    fn volumes(&self) -> anyhow::Result<Vec<VolumeRecord>> {
        decode_all(&self.lock(), Table::Volumes)
    }

    fn remove_volume(&self, id: &str) -> anyhow::Result<bool> {
        delete_by_id(&self.lock(), Table::Volumes, id)
    }

    fn swap_volume(
        &self,
        record: &VolumeRecord,
        from_node: Option<&str>,
        from: Option<&VolumeMove>,
    ) -> anyhow::Result<bool> {
        let (state, manifest) = VolumeMove::state(from);
        let swapped = self.lock().execute(
            "UPDATE team_volumes SET record = ?2 WHERE id = ?1 AND json_extract(record, '$.node') IS ?3
             AND json_extract(record, '$.moved_out.state') IS ?4
             AND json_extract(record, '$.moved_out.manifest_sha256') IS ?5",
            params![record.id, serde_json::to_string(record)?, from_node, state, manifest],
        )?;
        Ok(swapped > 0)
    }
}

impl NodeStore for SqliteStore {
    fn beat(&self, node: &NodeRecord, settled: &[String]) -> anyhow::Result<()> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        tx.execute(
            "INSERT INTO nodes (id, record) VALUES (?1, ?2) ON CONFLICT(id) DO UPDATE SET record = json_set(
                 excluded.record,
                 '$.draining', json(CASE WHEN json_extract(nodes.record, '$.draining') THEN 'true' ELSE 'false' END),
                 '$.moving_out', json(CASE WHEN json_extract(nodes.record, '$.moving_out') THEN 'true' ELSE 'false' END))",
            params![node.id, serde_json::to_string(node)?],
        )?;
        tx.execute("DELETE FROM place_claims WHERE node = ?1 AND at_ms < ?2", params![node.id, node.started_at_ms])?;
        for id in settled {
            tx.execute("DELETE FROM place_claims WHERE node = ?1 AND id = ?2", params![node.id, id])?;
        }
        tx.commit()?;
        Ok(())
    }

    fn set_draining(&self, id: &str, draining: bool, moving_out: bool) -> anyhow::Result<bool> {
        let flag = |on: bool| if on { "true" } else { "false" };
        let sql = "UPDATE nodes SET record = json_set(record, '$.draining', json(?2), '$.moving_out', json(?3)) WHERE id = ?1";
        Ok(self.lock().execute(sql, params![id, flag(draining), flag(moving_out)])? > 0)
    }

    fn node(&self, id: &str) -> anyhow::Result<Option<NodeRecord>> {
        decode_one(&self.lock(), Table::Nodes, "id", id)
    }

    fn nodes(&self) -> anyhow::Result<Vec<NodeRecord>> {
        decode_all(&self.lock(), Table::Nodes)
    }

    fn remove_node(&self, id: &str) -> anyhow::Result<bool> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        tx.execute("DELETE FROM place_claims WHERE node = ?1", params![id])?;
        let removed = delete_by_id(&tx, Table::Nodes, id)?;
        tx.commit()?;
        Ok(removed)
    }

    fn held_elsewhere(&self, node: &str, team: &str) -> anyhow::Result<TeamUsage> {
        held_elsewhere(&self.lock(), node, team)
    }

    fn claim_places(&self, claim: &PlaceClaim, admit: Admit) -> anyhow::Result<crate::model::Result<()>> {
        let mut conn = self.lock();
        // Immediate: the write lock is taken before the read, so another
        // process's claim cannot slip in between.
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        if let Err(refused) = admit(held_elsewhere(&tx, &claim.node, &claim.team)?) {
            return Ok(Err(refused));
        }
        tx.execute(
            "INSERT INTO place_claims (id, node, team, usage, at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![claim.id, claim.node, claim.team, serde_json::to_string(&claim.usage)?, claim.at_ms],
        )?;
        tx.commit()?;
        Ok(Ok(()))
    }

    fn publish_revocations(&self, pem: &str) -> anyhow::Result<()> {
        self.lock().execute(
            "INSERT INTO revocation_lists (id, pem) VALUES (?1, ?2) ON CONFLICT(id) DO UPDATE SET pem = excluded.pem",
            params![REVOCATION_LIST, pem],
        )?;
        Ok(())
    }

    fn published_revocations(&self) -> anyhow::Result<Option<String>> {
        let pem = self
            .lock()
            .query_row("SELECT pem FROM revocation_lists WHERE id = ?1", params![REVOCATION_LIST], |r| r.get(0))
            .optional()?;
        Ok(pem)
    }
}

/// The record whose `column` (a literal of this file) equals `value`.
fn decode_one<T: DeserializeOwned>(
    conn: &Connection,
    table: Table,
    column: &'static str,
    value: &str,
) -> anyhow::Result<Option<T>> {
    let sql = format!("SELECT id, record FROM {} WHERE {column} = ?1", table.name());
    let row: Option<(String, String)> =
        conn.query_row(&sql, params![value], |row| Ok((row.get(0)?, row.get(1)?))).optional()?;
    match row {
        Some((id, json)) => decode_or_quarantine(conn, table, &id, &json),
        None => Ok(None),
    }
}

/// A team's record of `table` by its name (the tables with a UNIQUE
/// (team, name)).
fn decode_named<T: DeserializeOwned>(
    conn: &Connection,
    table: Table,
    team: &str,
    name: &str,
) -> anyhow::Result<Option<T>> {
    let sql = format!("SELECT id FROM {} WHERE team = ?1 AND name = ?2", table.name());
    let id: Option<String> = conn.query_row(&sql, params![team, name], |row| row.get(0)).optional()?;
    match id {
        Some(id) => decode_one(conn, table, "id", &id),
        None => Ok(None),
    }
}

/// Adds a team's named record unless the id or the team's name is taken:
/// the UNIQUE name decides between two creates racing for one name.
fn insert_named<T: serde::Serialize>(
    conn: &Connection,
    table: Table,
    id: &str,
    team: &str,
    name: &str,
    record: &T,
) -> anyhow::Result<bool> {
    let sql =
        format!("INSERT INTO {} (id, team, name, record) VALUES (?1, ?2, ?3, ?4) ON CONFLICT DO NOTHING", table.name());
    Ok(conn.execute(&sql, params![id, team, name, serde_json::to_string(record)?])? > 0)
}

/// Writes the record of a table keyed by `id` alone (no other column).
fn upsert_by_id<T: serde::Serialize>(conn: &Connection, table: Table, id: &str, record: &T) -> anyhow::Result<()> {
    let sql = format!(
        "INSERT INTO {} (id, record) VALUES (?1, ?2) ON CONFLICT(id) DO UPDATE SET record = excluded.record",
        table.name()
    );
    conn.execute(&sql, params![id, serde_json::to_string(record)?])?;
    Ok(())
}

fn held_elsewhere(conn: &Connection, node: &str, team: &str) -> anyhow::Result<TeamUsage> {
    let mut read = conn.prepare_cached(
        "SELECT record -> 'teams' -> ?2 FROM nodes WHERE id <> ?1
         UNION ALL SELECT usage FROM place_claims WHERE team = ?2 AND node <> ?1",
    )?;
    let rows = read.query_map(params![node, team], |r| r.get::<_, Option<String>>(0))?;
    super::claims::total(rows.collect::<Result<Vec<_>, _>>()?)
}

/// Deletes `table`'s row `id`; whether there was one.
fn delete_by_id(conn: &Connection, table: Table, id: &str) -> anyhow::Result<bool> {
    Ok(conn.execute(&format!("DELETE FROM {} WHERE id = ?1", table.name()), params![id])? > 0)
}

/// Every record of `table`, ordered by id.
fn decode_all<T: DeserializeOwned>(conn: &Connection, table: Table) -> anyhow::Result<Vec<T>> {
    let rows: Vec<(String, String)> = {
        let mut stmt = conn.prepare(&format!("SELECT id, record FROM {} ORDER BY id", table.name()))?;
        stmt.query_map([], |row| Ok((row.get(0)?, row.get(1)?)))?.collect::<Result<_, _>>()?
    };
    let mut records = Vec::with_capacity(rows.len());
    for (id, json) in rows {
        records.extend(decode_or_quarantine(conn, table, &id, &json)?);
    }
    Ok(records)
}

/// A row that no longer parses (an edited database, a torn write, a
/// downgrade) is moved to `quarantine` with a log line: one bad record
/// must not fail every listing, and with it the gateway's start. The row
/// is kept whole there for the operator.
fn decode_or_quarantine<T: DeserializeOwned>(
    conn: &Connection,
    table: Table,
    id: &str,
    json: &str,
) -> anyhow::Result<Option<T>> {
    let err = match serde_json::from_str(json) {
        Ok(record) => return Ok(Some(record)),
        Err(err) => err,
    };
    tracing::error!(table = table.name(), id, error = %err, "unreadable record moved to the quarantine table");
    conn.execute(
        "INSERT INTO quarantine (kind, id, record, reason, at_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![table.name(), id, json, err.to_string(), crate::model::now_ms()],
    )?;
    delete_by_id(conn, table, id)?;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Database;
    use crate::store::behaviour::{Backend, behaviours};

    struct Sqlite(tempfile::TempDir);

    impl Sqlite {
        fn new() -> Self {
            Self(tempfile::tempdir().unwrap())
        }

        fn path(&self) -> PathBuf {
            self.0.path().join("copse.db")
        }
    }

    impl Backend for Sqlite {
        fn open(&self) -> Box<dyn Database> {
            Box::new(SqliteStore::open(&self.path()).unwrap())
        }

        fn execute(&self, sql: &str) {
            Connection::open(self.path()).unwrap().execute_batch(sql).unwrap();
        }

        fn quarantined(&self) -> Vec<(String, String, String)> {
            let conn = Connection::open(self.path()).unwrap();
            let mut stmt = conn.prepare("SELECT kind, id, record FROM quarantine ORDER BY kind, id").unwrap();
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().collect::<Result<_, _>>().unwrap()
        }
    }

    behaviours!(Sqlite::new());

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_database_and_its_wal_files_are_private_new_or_old() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("copse.db");
        let store = SqliteStore::open(&db).unwrap();
        store.put_snapshot(&serde_json::from_value(snapshot_json()).unwrap()).unwrap();
        for file in [db.clone(), sidecar(&db, "-wal"), sidecar(&db, "-shm")] {
            assert_eq!(mode(&file), 0o600, "{}", file.display());
        }
        drop(store);
        // Left world-readable by an older version: fixed on open.
        std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o644)).unwrap();
        if sidecar(&db, "-wal").exists() {
            std::fs::set_permissions(sidecar(&db, "-wal"), std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        let store = SqliteStore::open(&db).unwrap();
        assert_eq!(store.snapshots().unwrap().len(), 1);
        for file in [db.clone(), sidecar(&db, "-wal"), sidecar(&db, "-shm")] {
            assert_eq!(mode(&file), 0o600, "{}", file.display());
        }
    }

    #[test]
    fn snapshot_names_are_per_team_and_old_rows_become_the_default_teams() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("copse.db");
        {
            // A database from before teams: the old table only.
            let conn = Connection::open(&db).unwrap();
            conn.execute_batch("CREATE TABLE snapshots (id TEXT PRIMARY KEY, record TEXT NOT NULL);").unwrap();
            conn.execute("INSERT INTO snapshots VALUES ('s1', ?1)", params![snapshot_json().to_string()]).unwrap();
        }
        let store = SqliteStore::open(&db).unwrap();
        let old = store.snapshot(DEFAULT_TEAM, "s1").unwrap().expect("migrated");
        assert_eq!(old.team, DEFAULT_TEAM);
        let mut theirs = old.clone();
        theirs.team = "acme".into();
        theirs.key = "other".into();
        store.put_snapshot(&theirs).unwrap();
        assert_eq!(store.snapshot("acme", "s1").unwrap().unwrap().key, "other");
        assert_eq!(store.snapshot(DEFAULT_TEAM, "s1").unwrap().unwrap().key, "k");
        assert!(store.snapshot("nobody", "s1").unwrap().is_none());
        assert_eq!(store.snapshots().unwrap().len(), 2);
        assert!(store.remove_snapshot("acme", "s1").unwrap());
        assert!(store.snapshot(DEFAULT_TEAM, "s1").unwrap().is_some());
        // Opening again migrates nothing twice.
        drop(store);
        assert_eq!(SqliteStore::open(&db).unwrap().snapshots().unwrap().len(), 1);
    }

    fn snapshot_json() -> serde_json::Value {
        serde_json::json!({
            "id": "s1", "names": [], "key": "k", "template": "base",
            "source_sandbox": "x", "created_at_ms": 0, "size_bytes": 0
        })
    }
}
