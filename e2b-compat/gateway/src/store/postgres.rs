//! The [`Store`] in PostgreSQL (`copse up --database postgres://…`): the
//! same tables as `sqlite.rs`, so gateways and the CLI on other hosts
//! share one state.
//!
//! The traits are synchronous and called from async code. The blocking
//! `postgres` client starts a runtime of its own per call, which panics on
//! a tokio thread, so each store owns one connection on a thread of its
//! own and calls are sent to it. The caller waits on a channel, as it
//! waits on SQLite's lock: no `block_in_place`, which would panic on a
//! current-thread runtime. A lost connection (a restarted server) is made
//! again before the next call; the call in flight fails.

use std::collections::HashMap;
use std::sync::mpsc;

use anyhow::Context;
use postgres::types::ToSql;
use postgres::{Client, NoTls, Row, Statement, Transaction};
use serde::de::DeserializeOwned;

use super::table::{REVOCATION_LIST, Table};
use crate::model::{
    Admit, BuildLayer, Intent, KeyRecord, NodeRecord, NodeStore, PlaceClaim, SandboxRecord, SecretRecord, SecretStore,
    SnapshotRecord, Store, Team, TeamUsage, TemplateLabels, TemplateRecord, VolumeMove, VolumeRecord, VolumeStore,
};

type Job = Box<dyn FnOnce(&mut Conn) + Send>;

/// The store thread's connection. A query sent as text is prepared anew
/// each time, a round trip of its own before the one that runs it; here
/// each text is prepared once per connection and its statement reused.
struct Conn {
    client: Client,
    prepared: HashMap<String, Statement>,
    /// A call failed as the connection does when it is lost. The client
    /// notices the closed socket on its own task, so `is_closed` may not
    /// say so yet when the next call comes.
    lost: bool,
}

type Params<'a> = [&'a (dyn ToSql + Sync)];

impl Conn {
    fn new(client: Client) -> Self {
        Self { client, prepared: HashMap::new(), lost: false }
    }

    /// Runs `sql`'s statement; one that failed is prepared afresh next
    /// time (a migration by a newer gateway may have changed its plan).
    fn with_statement<T>(
        &mut self,
        sql: &str,
        run: impl FnOnce(&mut Client, &Statement) -> Result<T, postgres::Error>,
    ) -> Result<T, postgres::Error> {
        let statement = self.statement(sql)?;
        let result = run(&mut self.client, &statement);
        if let Err(err) = &result {
            self.prepared.remove(sql);
            self.lost |= connection_lost(err);
        }
        result
    }

    /// `sql`'s statement, prepared once per connection.
    fn statement(&mut self, sql: &str) -> Result<Statement, postgres::Error> {
        if let Some(statement) = self.prepared.get(sql) {
            return Ok(statement.clone());
        }
        let statement = self.client.prepare(sql).inspect_err(|err| self.lost |= connection_lost(err))?;
        self.prepared.insert(sql.to_string(), statement.clone());
        Ok(statement)
    }

    fn execute(&mut self, sql: &str, params: &Params) -> Result<u64, postgres::Error> {
        self.with_statement(sql, |c, s| c.execute(s, params))
    }

    fn query(&mut self, sql: &str, params: &Params) -> Result<Vec<Row>, postgres::Error> {
        self.with_statement(sql, |c, s| c.query(s, params))
    }

    fn query_opt(&mut self, sql: &str, params: &Params) -> Result<Option<Row>, postgres::Error> {
        self.with_statement(sql, |c, s| c.query_opt(s, params))
    }

    /// Runs `work` in a transaction and commits it, noting a lost
    /// connection as [`Conn::with_statement`] does (and preparing every
    /// statement afresh after a failure, not knowing which one failed).
    fn in_transaction<T>(&mut self, work: impl FnOnce(&mut Transaction) -> anyhow::Result<T>) -> anyhow::Result<T> {
        let result = self.client.transaction().map_err(anyhow::Error::from).and_then(|mut tx| {
            let value = work(&mut tx)?;
            tx.commit()?;
            Ok(value)
        });
        if let Err(err) = &result {
            self.prepared.clear();
            self.lost |= err.downcast_ref::<postgres::Error>().is_some_and(connection_lost);
        }
        result
    }
}

pub struct PostgresStore {
    jobs: mpsc::Sender<Job>,
}

/// Serializes the migrations of gateways starting together (any constant
/// the project's other advisory locks do not use).
const MIGRATION_LOCK: i64 = 0x636f_7073_6501;
/// With a hash of the team's name, the two-key advisory lock that
/// serializes a team's place claims (two-key locks never meet one-key
/// ones such as [`MIGRATION_LOCK`]).
const PLACE_CLAIM_LOCK: i32 = 0x636f_7001;

impl PostgresStore {
    /// Connects to `url` (a `postgres://` URL or `key=value` pairs) and
    /// brings its schema up to date.
    pub fn open(url: &str) -> anyhow::Result<Self> {
        let config: postgres::Config = url.parse().context("reading the database URL")?;
        let (jobs, queue) = mpsc::channel::<Job>();
        let (ready, opened) = mpsc::sync_channel(1);
        std::thread::Builder::new().name("copse-postgres".into()).spawn(move || {
            let mut conn = match connect(&config).and_then(|mut client| migrate(&mut client).map(|()| client)) {
                Ok(client) => {
                    let _ = ready.send(Ok(()));
                    Conn::new(client)
                }
                Err(err) => {
                    let _ = ready.send(Err(err));
                    return;
                }
            };
            for job in queue {
                if conn.lost || conn.client.is_closed() {
                    match connect(&config) {
                        Ok(fresh) => conn = Conn::new(fresh),
                        Err(err) => tracing::warn!(error = %err, "reconnecting to the database"),
                    }
                }
                job(&mut conn);
            }
        })?;
        opened.recv().context("the database thread ended while connecting")??;
        Ok(Self { jobs })
    }

    /// Runs `work` on this store's connection and waits for its result.
    fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Conn) -> anyhow::Result<T> + Send + 'static,
    ) -> anyhow::Result<T> {
        let (reply, result) = mpsc::sync_channel(1);
        self.jobs
            .send(Box::new(move |client| {
                let _ = reply.send(work(client));
            }))
            .map_err(|_| anyhow::anyhow!("the database thread has ended"))?;
        result.recv().context("the database thread has ended")?
    }

    fn upsert_by_id<T: serde::Serialize>(&self, table: Table, id: &str, record: &T) -> anyhow::Result<()> {
        let (id, json) = (id.to_owned(), serde_json::to_string(record)?);
        self.run(move |c| {
            let sql = format!(
                "INSERT INTO {} (id, record) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET record = excluded.record",
                table.name()
            );
            c.execute(&sql, &[&id, &json])?;
            Ok(())
        })
    }

    fn delete_by_id(&self, table: Table, id: &str) -> anyhow::Result<bool> {
        let id = id.to_owned();
        self.run(move |c| delete_by_id(c, table, &id))
    }

    fn decode_one<T: DeserializeOwned + Send + 'static>(&self, table: Table, id: &str) -> anyhow::Result<Option<T>> {
        let id = id.to_owned();
        self.run(move |c| decode_one(c, table, &id))
    }

    fn decode_named<T: DeserializeOwned + Send + 'static>(
        &self,
        table: Table,
        team: &str,
        name: &str,
    ) -> anyhow::Result<Option<T>> {
        let (team, name) = (team.to_owned(), name.to_owned());
        self.run(move |c| {
            let sql = format!("SELECT id FROM {} WHERE team = $1 AND name = $2", table.name());
            match c.query_opt(&sql, &[&team, &name])? {
                Some(row) => decode_one(c, table, &row.get::<_, String>(0)),
                None => Ok(None),
            }
        })
    }

    fn decode_all<T: DeserializeOwned + Send + 'static>(&self, table: Table) -> anyhow::Result<Vec<T>> {
        self.run(move |c| {
            let rows = c.query(&format!("SELECT id, record FROM {} ORDER BY id", table.name()), &[])?;
            let mut records = Vec::with_capacity(rows.len());
            for row in rows {
                records.extend(decode_or_quarantine(c, table, &row.get::<_, String>(0), &row.get::<_, String>(1))?);
            }
            Ok(records)
        })
    }

    /// A team's named record, unless the id or the team's name is taken:
    /// the UNIQUE name decides between two creates racing for one name,
    /// whichever gateway they reached.
    fn insert_named<T: serde::Serialize>(
        &self,
        table: Table,
        id: &str,
        team: &str,
        name: &str,
        record: &T,
    ) -> anyhow::Result<bool> {
        let (id, team, name, json) = (id.to_owned(), team.to_owned(), name.to_owned(), serde_json::to_string(record)?);
        self.run(move |c| {
            let sql = format!(
                "INSERT INTO {} (id, team, name, record) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                table.name()
            );
            Ok(c.execute(&sql, &[&id, &team, &name, &json])? > 0)
        })
    }

    /// The records `sql` selects (one column, the JSON), in its order.
    fn records<T: DeserializeOwned + Send + 'static>(&self, sql: &'static str) -> anyhow::Result<Vec<T>> {
        self.run(move |c| c.query(sql, &[])?.iter().map(|row| Ok(serde_json::from_str(row.get(0))?)).collect())
    }

    /// Writes a key or team row and marks tenancy changed, in one
    /// transaction.
    fn tenancy_write(&self, sql: &'static str, params: Vec<String>) -> anyhow::Result<()> {
        self.run(move |c| {
            let params: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p as &(dyn ToSql + Sync)).collect();
            c.in_transaction(|tx| {
                tx.execute(sql, &params)?;
                bump_tenancy(tx)
            })
        })
    }
}

/// The other nodes' figures for a team and their claims for it, in one
/// statement (see `claims.rs`).
const HELD_ELSEWHERE: &str = "SELECT (record::jsonb -> 'teams' -> $2)::text FROM nodes WHERE id <> $1
     UNION ALL SELECT usage FROM place_claims WHERE team = $2 AND node <> $1";

fn held_elsewhere(rows: Vec<Row>) -> anyhow::Result<TeamUsage> {
    super::claims::total(rows.iter().map(|r| r.get::<_, Option<String>>(0)))
}

/// An error of the connection rather than of the statement: one the
/// server did not send (the socket, mostly; the rare other client-side
/// error costs one needless reconnect) or a FATAL one, which the server
/// sends before it closes the session (`pg_terminate_backend`, a
/// shutdown).
fn connection_lost(err: &postgres::Error) -> bool {
    err.is_closed()
        || match err.as_db_error() {
            None => true,
            Some(db) => matches!(db.severity(), "FATAL" | "PANIC"),
        }
}

fn connect(config: &postgres::Config) -> anyhow::Result<Client> {
    let mut client = config.connect(NoTls).context("connecting to the database")?;
    // `put_intent` must be durable when it returns, whatever the server's
    // default says.
    client.batch_execute("SET synchronous_commit = on")?;
    Ok(client)
}

fn migrate(client: &mut Client) -> anyhow::Result<()> {
    let migrations = [
        refinery::Migration::unapplied("V1__tables", include_str!("postgres_migrations/V1__tables.sql"))?,
        refinery::Migration::unapplied("V2__nodes", include_str!("postgres_migrations/V2__nodes.sql"))?,
        refinery::Migration::unapplied("V3__revocations", include_str!("postgres_migrations/V3__revocations.sql"))?,
        refinery::Migration::unapplied("V4__place_claims", include_str!("postgres_migrations/V4__place_claims.sql"))?,
    ];
    client.execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])?;
    let migrated = refinery::Runner::new(&migrations).run(client).context("migrating the database");
    client.execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])?;
    migrated.map(drop)
}

/// Marks keys or teams changed, in the transaction that changes them.
fn bump_tenancy(tx: &mut Transaction) -> anyhow::Result<()> {
    tx.execute(
        "INSERT INTO generations (name, value) VALUES ('tenancy', 1)
         ON CONFLICT (name) DO UPDATE SET value = generations.value + 1",
        &[],
    )?;
    Ok(())
}

fn delete_by_id(c: &mut Conn, table: Table, id: &str) -> anyhow::Result<bool> {
    Ok(c.execute(&format!("DELETE FROM {} WHERE id = $1", table.name()), &[&id])? > 0)
}

fn decode_one<T: DeserializeOwned>(c: &mut Conn, table: Table, id: &str) -> anyhow::Result<Option<T>> {
    let row = c.query_opt(&format!("SELECT record FROM {} WHERE id = $1", table.name()), &[&id])?;
    match row {
        Some(row) => decode_or_quarantine(c, table, id, row.get(0)),
        None => Ok(None),
    }
}

/// As in `sqlite.rs`: a row that no longer parses is moved, whole, to
/// `quarantine`, so one bad record does not fail every listing.
fn decode_or_quarantine<T: DeserializeOwned>(
    c: &mut Conn,
    table: Table,
    id: &str,
    json: &str,
) -> anyhow::Result<Option<T>> {
    let err = match serde_json::from_str(json) {
        Ok(record) => return Ok(Some(record)),
        Err(err) => err,
    };
    tracing::error!(table = table.name(), id, error = %err, "unreadable record moved to the quarantine table");
    c.in_transaction(|tx| {
        tx.execute(
            "INSERT INTO quarantine (kind, id, record, reason, at_ms) VALUES ($1, $2, $3, $4, $5)",
            &[&table.name(), &id, &json, &err.to_string(), &crate::model::now_ms()],
        )?;
        tx.execute(&format!("DELETE FROM {} WHERE id = $1", table.name()), &[&id])?;
        Ok(None)
    })
}

impl Store for PostgresStore {
    fn put(&self, record: &SandboxRecord) -> anyhow::Result<()> {
        let (id, end_at_ms, json) = (record.id.clone(), record.end_at_ms, serde_json::to_string(record)?);
        self.run(move |c| {
            c.execute(
                "INSERT INTO sandboxes (id, end_at_ms, record) VALUES ($1, $2, $3)
                 ON CONFLICT (id) DO UPDATE SET end_at_ms = excluded.end_at_ms, record = excluded.record",
                &[&id, &end_at_ms, &json],
            )?;
            Ok(())
        })
    }

    fn swap_paused(&self, record: &SandboxRecord, from_node: Option<&str>) -> anyhow::Result<bool> {
        let (id, end_at_ms, json) = (record.id.clone(), record.end_at_ms, serde_json::to_string(record)?);
        let from_node = from_node.map(str::to_string);
        let files = record.paused.as_ref().and_then(|p| p.files_only.clone());
        self.run(move |c| {
            Ok(c.execute(
                "UPDATE sandboxes SET end_at_ms = $2, record = $3 WHERE id = $1
                 AND (record::jsonb ->> 'node') IS NOT DISTINCT FROM $4
                 AND (record::jsonb -> 'paused' ->> 'files_only') IS NOT DISTINCT FROM $5",
                &[&id, &end_at_ms, &json, &from_node, &files],
            )? > 0)
        })
    }

    fn get(&self, id: &str) -> anyhow::Result<Option<SandboxRecord>> {
        self.decode_one(Table::Sandboxes, id)
    }

    fn all(&self) -> anyhow::Result<Vec<SandboxRecord>> {
        self.decode_all(Table::Sandboxes)
    }

    fn expired(&self, now_ms: i64) -> anyhow::Result<Vec<String>> {
        self.run(move |c| {
            let rows = c.query("SELECT id FROM sandboxes WHERE end_at_ms <= $1 ORDER BY id", &[&now_ms])?;
            Ok(rows.iter().map(|row| row.get(0)).collect())
        })
    }

    fn remove(&self, id: &str) -> anyhow::Result<bool> {
        self.delete_by_id(Table::Sandboxes, id)
    }

    fn put_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<()> {
        let (team, id, json) = (record.team.clone(), record.id.clone(), serde_json::to_string(record)?);
        self.run(move |c| {
            c.execute(
                "INSERT INTO team_snapshots (team, id, record) VALUES ($1, $2, $3)
                 ON CONFLICT (team, id) DO UPDATE SET record = excluded.record",
                &[&team, &id, &json],
            )?;
            Ok(())
        })
    }

    fn snapshot(&self, team: &str, id: &str) -> anyhow::Result<Option<SnapshotRecord>> {
        let (team, id) = (team.to_owned(), id.to_owned());
        self.run(move |c| {
            let row = c.query_opt("SELECT record FROM team_snapshots WHERE team = $1 AND id = $2", &[&team, &id])?;
            row.map(|row| serde_json::from_str(row.get(0)).context("corrupt snapshot record")).transpose()
        })
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotRecord>> {
        self.records("SELECT record FROM team_snapshots ORDER BY team, id")
    }

    fn remove_snapshot(&self, team: &str, id: &str) -> anyhow::Result<bool> {
        let (team, id) = (team.to_owned(), id.to_owned());
        self.run(move |c| Ok(c.execute("DELETE FROM team_snapshots WHERE team = $1 AND id = $2", &[&team, &id])? > 0))
    }

    fn update_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<bool> {
        let (team, id, key) = (record.team.clone(), record.id.clone(), record.key.clone());
        let json = serde_json::to_string(record)?;
        self.run(move |c| {
            Ok(c.execute(
                "UPDATE team_snapshots SET record = $4
                 WHERE team = $1 AND id = $2 AND (record::jsonb ->> 'key') = $3",
                &[&team, &id, &key, &json],
            )? > 0)
        })
    }

    fn put_template(&self, record: &TemplateRecord) -> anyhow::Result<()> {
        let (id, team, name) = (record.id.clone(), record.team.clone(), record.name.clone());
        let json = serde_json::to_string(record)?;
        self.run(move |c| {
            c.execute(
                "INSERT INTO built_templates (id, team, name, record) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (id) DO UPDATE SET record = excluded.record",
                &[&id, &team, &name, &json],
            )?;
            Ok(())
        })
    }

    fn template(&self, id: &str) -> anyhow::Result<Option<TemplateRecord>> {
        self.decode_one(Table::Templates, id)
    }

    fn template_named(&self, team: &str, name: &str) -> anyhow::Result<Option<TemplateRecord>> {
        self.decode_named(Table::Templates, team, name)
    }

    fn built_templates(&self) -> anyhow::Result<Vec<TemplateRecord>> {
        self.decode_all(Table::Templates)
    }

    fn remove_template(&self, id: &str) -> anyhow::Result<bool> {
        self.delete_by_id(Table::Templates, id)
    }

    fn swap_template_labels(&self, labels: &TemplateLabels) -> anyhow::Result<bool> {
        let (id, json) = (labels.id.clone(), serde_json::to_string(labels)?);
        let read = labels.revision.saturating_sub(1) as i64;
        self.run(move |c| {
            let written = c.execute(
                "INSERT INTO template_labels (id, record) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE SET record = excluded.record
                 WHERE COALESCE((template_labels.record::jsonb ->> 'revision')::bigint, 0) = $3",
                &[&id, &json, &read],
            )?;
            Ok(written > 0)
        })
    }

    fn template_labels(&self, id: &str) -> anyhow::Result<Option<TemplateLabels>> {
        self.decode_one(Table::TemplateLabels, id)
    }

    fn remove_template_labels(&self, id: &str) -> anyhow::Result<bool> {
        self.delete_by_id(Table::TemplateLabels, id)
    }

    fn put_build_layer(&self, layer: &BuildLayer) -> anyhow::Result<()> {
        let (key, team, json) = (layer.key.clone(), layer.team.clone(), serde_json::to_string(layer)?);
        self.run(move |c| {
            c.execute(
                "INSERT INTO build_layers (id, team, record) VALUES ($1, $2, $3)
                 ON CONFLICT (id) DO UPDATE SET record = excluded.record",
                &[&key, &team, &json],
            )?;
            Ok(())
        })
    }

    fn build_layer(&self, team: &str, key: &str) -> anyhow::Result<Option<BuildLayer>> {
        let found: Option<BuildLayer> = self.decode_one(Table::BuildLayers, key)?;
        Ok(found.filter(|layer| layer.team == team))
    }

    fn build_layers(&self) -> anyhow::Result<Vec<BuildLayer>> {
        self.decode_all(Table::BuildLayers)
    }

    fn remove_build_layer(&self, key: &str) -> anyhow::Result<bool> {
        self.delete_by_id(Table::BuildLayers, key)
    }

    fn put_team(&self, team: &Team) -> anyhow::Result<()> {
        self.tenancy_write(
            "INSERT INTO teams (name, record) VALUES ($1, $2)
             ON CONFLICT (name) DO UPDATE SET record = excluded.record",
            vec![team.name.clone(), serde_json::to_string(team)?],
        )
    }

    fn teams(&self) -> anyhow::Result<Vec<Team>> {
        self.records("SELECT record FROM teams ORDER BY name")
    }

    fn put_key(&self, key: &KeyRecord) -> anyhow::Result<()> {
        self.tenancy_write(
            "INSERT INTO keys (hash, prefix, record) VALUES ($1, $2, $3)
             ON CONFLICT (hash) DO UPDATE SET prefix = excluded.prefix, record = excluded.record",
            vec![key.hash.clone(), key.prefix.clone(), serde_json::to_string(key)?],
        )
    }

    fn keys(&self) -> anyhow::Result<Vec<KeyRecord>> {
        self.records("SELECT record FROM keys ORDER BY prefix")
    }

    fn revoke_key(&self, prefix: &str) -> anyhow::Result<Option<KeyRecord>> {
        let prefix = prefix.to_owned();
        self.run(move |c| {
            let json = c.in_transaction(|tx| {
                let matching = tx.query(
                    "SELECT hash, record FROM keys WHERE left(prefix, length($1)) = $1 FOR UPDATE",
                    &[&prefix],
                )?;
                let (hash, json): (String, String) = match matching.as_slice() {
                    [] => return Ok(None),
                    [one] => (one.get(0), one.get(1)),
                    many => anyhow::bail!("{} keys start with {prefix:?}; give more of the prefix", many.len()),
                };
                tx.execute("DELETE FROM keys WHERE hash = $1", &[&hash])?;
                bump_tenancy(tx)?;
                Ok(Some(json))
            })?;
            json.map(|json| serde_json::from_str(&json).context("corrupt key record")).transpose()
        })
    }

    fn keys_used(&self, used: &[(String, i64)]) -> anyhow::Result<()> {
        let used = used.to_vec();
        self.run(move |c| {
            c.in_transaction(|tx| {
                for (hash, at_ms) in &used {
                    // A key revoked meanwhile stays revoked: only existing rows change.
                    tx.execute(
                    "UPDATE keys SET record = jsonb_set(record::jsonb, '{last_used_ms}', to_jsonb($2::bigint))::text
                     WHERE hash = $1",
                    &[hash, at_ms],
                )?;
                }
                Ok(())
            })
        })
    }

    fn tenancy_generation(&self) -> anyhow::Result<i64> {
        self.run(|c| {
            let row = c.query_opt("SELECT value FROM generations WHERE name = 'tenancy'", &[])?;
            Ok(row.map(|row| row.get(0)).unwrap_or(0))
        })
    }

    fn put_intent(&self, intent: &Intent) -> anyhow::Result<()> {
        // Durable on return: the connection commits with synchronous_commit on.
        self.upsert_by_id(Table::Journal, &intent.id, intent)
    }

    fn intents(&self) -> anyhow::Result<Vec<Intent>> {
        self.decode_all(Table::Journal)
    }

    fn remove_intent(&self, id: &str) -> anyhow::Result<()> {
        self.delete_by_id(Table::Journal, id).map(drop)
    }
}

impl SecretStore for PostgresStore {
    fn insert_secret(&self, record: &SecretRecord) -> anyhow::Result<bool> {
        self.insert_named(Table::Secrets, &record.id, &record.team, &record.name, record)
    }

    fn update_secret(&self, record: &SecretRecord) -> anyhow::Result<bool> {
        let (id, json) = (record.id.clone(), serde_json::to_string(record)?);
        self.run(move |c| Ok(c.execute("UPDATE team_secrets SET record = $2 WHERE id = $1", &[&id, &json])? > 0))
    }

    fn secret(&self, id: &str) -> anyhow::Result<Option<SecretRecord>> {
        self.decode_one(Table::Secrets, id)
    }

    fn secret_named(&self, team: &str, name: &str) -> anyhow::Result<Option<SecretRecord>> {
        self.decode_named(Table::Secrets, team, name)
    }

    fn secrets(&self) -> anyhow::Result<Vec<SecretRecord>> {
        self.decode_all(Table::Secrets)
    }

    fn remove_secret(&self, id: &str) -> anyhow::Result<bool> {
        self.delete_by_id(Table::Secrets, id)
    }
}

impl VolumeStore for PostgresStore {
    fn insert_volume(&self, record: &VolumeRecord) -> anyhow::Result<bool> {
        self.insert_named(Table::Volumes, &record.id, &record.team, &record.name, record)
    }

    fn volume(&self, id: &str) -> anyhow::Result<Option<VolumeRecord>> {
        self.decode_one(Table::Volumes, id)
    }

    fn volume_named(&self, team: &str, name: &str) -> anyhow::Result<Option<VolumeRecord>> {
        self.decode_named(Table::Volumes, team, name)
    }

    fn volumes(&self) -> anyhow::Result<Vec<VolumeRecord>> {
        self.decode_all(Table::Volumes)
    }

    fn remove_volume(&self, id: &str) -> anyhow::Result<bool> {
        self.delete_by_id(Table::Volumes, id)
    }

    fn swap_volume(
        &self,
        record: &VolumeRecord,
        from_node: Option<&str>,
        from: Option<&VolumeMove>,
    ) -> anyhow::Result<bool> {
        let (id, json) = (record.id.clone(), serde_json::to_string(record)?);
        let from_node = from_node.map(str::to_string);
        let (state, manifest) = VolumeMove::state(from);
        let (state, manifest) = (state.map(str::to_string), manifest.map(str::to_string));
        self.run(move |c| {
            Ok(c.execute(
                "UPDATE team_volumes SET record = $2 WHERE id = $1
                 AND (record::jsonb ->> 'node') IS NOT DISTINCT FROM $3
                 AND (record::jsonb -> 'moved_out' ->> 'state') IS NOT DISTINCT FROM $4
                 AND (record::jsonb -> 'moved_out' ->> 'manifest_sha256') IS NOT DISTINCT FROM $5",
                &[&id, &json, &from_node, &state, &manifest],
            )? > 0)
        })
    }
}

impl NodeStore for PostgresStore {
    fn beat(&self, node: &NodeRecord, settled: &[String]) -> anyhow::Result<()> {
        let (id, json, started_at_ms) = (node.id.clone(), serde_json::to_string(node)?, node.started_at_ms);
        let settled = settled.to_vec();
        self.run(move |c| {
            c.in_transaction(|tx| {
                tx.execute(
                "INSERT INTO nodes (id, record) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET record = jsonb_set(
                     jsonb_set(excluded.record::jsonb, '{draining}', COALESCE(nodes.record::jsonb -> 'draining', 'false')),
                     '{moving_out}', COALESCE(nodes.record::jsonb -> 'moving_out', 'false'))::text",
                    &[&id, &json],
                )?;
                tx.execute(
                    "DELETE FROM place_claims WHERE node = $1 AND (at_ms < $2 OR id = ANY($3))",
                    &[&id, &started_at_ms, &settled],
                )?;
                Ok(())
            })
        })
    }

    fn set_draining(&self, id: &str, draining: bool, moving_out: bool) -> anyhow::Result<bool> {
        let id = id.to_owned();
        self.run(move |c| {
            let sql = "UPDATE nodes SET record = jsonb_set(jsonb_set(record::jsonb, '{draining}', to_jsonb($2::bool)),
                       '{moving_out}', to_jsonb($3::bool))::text WHERE id = $1";
            Ok(c.execute(sql, &[&id, &draining, &moving_out])? > 0)
        })
    }

    fn node(&self, id: &str) -> anyhow::Result<Option<NodeRecord>> {
        self.decode_one(Table::Nodes, id)
    }

    fn nodes(&self) -> anyhow::Result<Vec<NodeRecord>> {
        self.decode_all(Table::Nodes)
    }

    fn remove_node(&self, id: &str) -> anyhow::Result<bool> {
        let id = id.to_owned();
        self.run(move |c| {
            c.in_transaction(|tx| {
                tx.execute("DELETE FROM place_claims WHERE node = $1", &[&id])?;
                Ok(tx.execute("DELETE FROM nodes WHERE id = $1", &[&id])? > 0)
            })
        })
    }

    fn held_elsewhere(&self, node: &str, team: &str) -> anyhow::Result<TeamUsage> {
        let (node, team) = (node.to_owned(), team.to_owned());
        self.run(move |c| held_elsewhere(c.query(HELD_ELSEWHERE, &[&node, &team])?))
    }

    fn claim_places(&self, claim: &PlaceClaim, admit: Admit) -> anyhow::Result<crate::model::Result<()>> {
        let claim = claim.clone();
        let usage = serde_json::to_string(&claim.usage)?;
        self.run(move |c| {
            // Prepared ahead: on the create path of a limited team, each
            // round trip counts.
            let lock = c.statement("SELECT pg_advisory_xact_lock($1, hashtext($2))")?;
            let read = c.statement(HELD_ELSEWHERE)?;
            let insert =
                c.statement("INSERT INTO place_claims (id, node, team, usage, at_ms) VALUES ($1, $2, $3, $4, $5)")?;
            c.in_transaction(|tx| {
                // Held until the transaction ends: the next claim for the
                // team reads after this one is stored (each statement of
                // a READ COMMITTED transaction sees what committed before
                // it began).
                tx.execute(&lock, &[&PLACE_CLAIM_LOCK, &claim.team])?;
                if let Err(refused) = admit(held_elsewhere(tx.query(&read, &[&claim.node, &claim.team])?)?) {
                    return Ok(Err(refused));
                }
                tx.execute(&insert, &[&claim.id, &claim.node, &claim.team, &usage, &claim.at_ms])?;
                Ok(Ok(()))
            })
        })
    }

    fn publish_revocations(&self, pem: &str) -> anyhow::Result<()> {
        let pem = pem.to_owned();
        self.run(move |c| {
            c.execute(
                "INSERT INTO revocation_lists (id, pem) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET pem = excluded.pem",
                &[&REVOCATION_LIST, &pem],
            )?;
            Ok(())
        })
    }

    fn published_revocations(&self) -> anyhow::Result<Option<String>> {
        self.run(|c| {
            let row = c.query_opt("SELECT pem FROM revocation_lists WHERE id = $1", &[&REVOCATION_LIST])?;
            Ok(row.map(|r| r.get(0)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Database;
    use crate::store::behaviour::{Backend, behaviours};
    use crate::store::test_postgres::TestPostgres;

    impl Backend for TestPostgres {
        fn open(&self) -> Box<dyn Database> {
            Box::new(PostgresStore::open(&self.url()).unwrap())
        }

        fn execute(&self, sql: &str) {
            Client::connect(&self.url(), NoTls).unwrap().batch_execute(sql).unwrap();
        }

        fn quarantined(&self) -> Vec<(String, String, String)> {
            let mut client = Client::connect(&self.url(), NoTls).unwrap();
            let rows = client.query("SELECT kind, id, record FROM quarantine ORDER BY kind, id", &[]).unwrap();
            rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
        }
    }

    behaviours!(TestPostgres::start());

    /// The gateway calls the store from its tokio workers, where the
    /// blocking client alone panics ("Cannot start a runtime from within
    /// a runtime"); a current-thread runtime rules out `block_in_place`.
    #[test]
    fn the_store_is_usable_from_async_code() {
        let server = TestPostgres::start();
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let store = PostgresStore::open(&server.url()).unwrap();
            store.put_snapshot(&crate::store::behaviour::snapshot("acme", "s1", "k")).unwrap();
            assert_eq!(store.snapshots().unwrap().len(), 1);
        });
    }

    #[test]
    fn a_second_gateway_finds_the_schema_migrated_once() {
        let server = TestPostgres::start();
        let url = server.url();
        let stores: Vec<PostgresStore> = std::thread::scope(|s| {
            let opening: Vec<_> = (0..3).map(|_| s.spawn(|| PostgresStore::open(&url))).collect();
            opening.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        stores[0]
            .put_intent(&Intent {
                id: "i".into(),
                sandbox: "s".into(),
                change: crate::model::Change::Resume { files: None },
                started_at_ms: 0,
                node: None,
            })
            .unwrap();
        assert_eq!(stores[2].intents().unwrap().len(), 1);
        let mut client = Client::connect(&server.url(), NoTls).unwrap();
        let applied: i64 = client.query_one("SELECT count(*) FROM refinery_schema_history", &[]).unwrap().get(0);
        assert_eq!(applied, 4, "V1__tables, V2__nodes, V3__revocations and V4__place_claims, each once");
    }

    /// Statements are kept per connection: after the server drops the
    /// connection (a restart, an administrator), the call in flight fails
    /// and the next ones prepare theirs on the new connection.
    #[test]
    fn a_dropped_connection_is_made_again_with_its_statements() {
        let server = TestPostgres::start();
        let store = PostgresStore::open(&server.url()).unwrap();
        let snapshot = crate::store::behaviour::snapshot("acme", "s1", "k");
        store.put_snapshot(&snapshot).unwrap();
        assert!(store.snapshot("acme", "s1").unwrap().is_some());
        let mut admin = Client::connect(&server.url(), NoTls).unwrap();
        // With a timeout, the server waits for each backend to exit: a
        // call made before that would still be answered, and the one after
        // it would meet the dead socket instead of the first one below.
        admin
            .execute(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity
                 WHERE pid <> pg_backend_pid() AND datname = current_database()",
                &[],
            )
            .unwrap();
        // The first call may find the old connection not yet seen closed.
        let _ = store.snapshot("acme", "s1");
        assert_eq!(store.snapshot("acme", "s1").unwrap().map(|s| s.id), Some("s1".to_string()));
        // A table changed under a kept statement: that statement fails
        // once, then is prepared again.
        admin.batch_execute("ALTER TABLE team_snapshots ALTER COLUMN record TYPE varchar").unwrap();
        let _ = store.snapshot("acme", "s1");
        assert!(store.snapshot("acme", "s1").unwrap().is_some());
    }

    #[test]
    fn a_bad_url_is_an_error_not_a_hang() {
        assert!(PostgresStore::open("postgres://nobody@127.0.0.1:1/none?connect_timeout=2").is_err());
        assert!(PostgresStore::open("not a url at all ===").is_err());
    }
}
