//! Where the records live between requests and across restarts. The
//! service sees only this trait; `store::sqlite` (one host) and
//! `store::postgres` (`--database`) implement it.

use super::build_layer::BuildLayer;
use super::journal::Intent;
use super::key::KeyRecord;
use super::node::{Admit, NodeRecord, PlaceClaim};
use super::sandbox::SandboxRecord;
use super::secret::SecretRecord;
use super::snapshot::SnapshotRecord;
use super::team::{Team, TeamUsage};
use super::template::TemplateRecord;
use super::template_labels::TemplateLabels;
use super::volume::{VolumeMove, VolumeRecord};

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
    /// Writes `record` only while the stored one still names node
    /// `from_node` and the same paused files as `record`; whether it did.
    /// How a node claims a paused sandbox from another, or marks one
    /// stored, when another gateway may be doing the same.
    fn swap_paused(&self, record: &SandboxRecord, from_node: Option<&str>) -> anyhow::Result<bool>;
    /// The sandboxes this gateway indexes as its own (`store::Indexed`),
    /// each with the substrate snapshot it is paused on; none where
    /// nothing is indexed.
    fn indexed(&self) -> Vec<(String, Option<String>)> {
        Vec::new()
    }
    /// Drops sandbox `id` from that index and leaves its record: another
    /// node took it over.
    fn unindex(&self, _id: &str) {}

    /// Inserts or replaces the snapshot's record (its id is unique within
    /// its team).
    fn put_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<()>;
    fn snapshot(&self, team: &str, id: &str) -> anyhow::Result<Option<SnapshotRecord>>;
    /// Every snapshot of every team, ordered by team, then id.
    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotRecord>>;
    fn remove_snapshot(&self, team: &str, id: &str) -> anyhow::Result<bool>;
    /// Replaces the snapshot's record only while the stored one still
    /// names the same files (`key`): a background change to a snapshot
    /// must not bring back one deleted, or undo one replaced, meanwhile.
    /// Whether it was replaced.
    fn update_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<bool>;

    /// Inserts or replaces a built template's record (by id; its name is
    /// unique within its team).
    fn put_template(&self, record: &TemplateRecord) -> anyhow::Result<()>;
    fn template(&self, id: &str) -> anyhow::Result<Option<TemplateRecord>>;
    fn template_named(&self, team: &str, name: &str) -> anyhow::Result<Option<TemplateRecord>>;
    /// Every built template of every team, ordered by id.
    fn built_templates(&self) -> anyhow::Result<Vec<TemplateRecord>>;
    fn remove_template(&self, id: &str) -> anyhow::Result<bool>;
    /// Writes a built template's tags and visibility (by its id) if the
    /// stored row is still at `labels.revision - 1` (a missing row counts
    /// as revision 0); false, writing nothing, when another write came
    /// first.
    fn swap_template_labels(&self, labels: &TemplateLabels) -> anyhow::Result<bool>;
    fn template_labels(&self, id: &str) -> anyhow::Result<Option<TemplateLabels>>;
    fn remove_template_labels(&self, id: &str) -> anyhow::Result<bool>;

    /// Inserts or replaces a build cache entry (by key).
    fn put_build_layer(&self, layer: &BuildLayer) -> anyhow::Result<()>;
    /// The team's entry of `key`; another team's entry is never returned,
    /// whatever its key.
    fn build_layer(&self, team: &str, key: &str) -> anyhow::Result<Option<BuildLayer>>;
    /// Every team's entries, ordered by key.
    fn build_layers(&self) -> anyhow::Result<Vec<BuildLayer>>;
    fn remove_build_layer(&self, key: &str) -> anyhow::Result<bool>;

    /// Inserts or replaces the team's record.
    fn put_team(&self, team: &Team) -> anyhow::Result<()>;
    fn teams(&self) -> anyhow::Result<Vec<Team>>;
    /// Inserts or replaces the key's record (by hash).
    fn put_key(&self, key: &KeyRecord) -> anyhow::Result<()>;
    fn keys(&self) -> anyhow::Result<Vec<KeyRecord>>;
    /// Removes the keys whose prefix starts with `prefix`, if exactly one
    /// does; the removed key, `None` if none did.
    fn revoke_key(&self, prefix: &str) -> anyhow::Result<Option<KeyRecord>>;
    /// Records when each key (by hash) was last used.
    fn keys_used(&self, used: &[(String, i64)]) -> anyhow::Result<()>;
    /// A number that changes whenever a key or team is added, changed or
    /// removed, by this process or another (the CLI, while the gateway
    /// runs); reading it is one small query.
    fn tenancy_generation(&self) -> anyhow::Result<i64>;

    /// Writes an intent before the host is touched; it must outlive a
    /// crash of this process once this returns.
    fn put_intent(&self, intent: &Intent) -> anyhow::Result<()>;
    /// Intents not yet cleared, in no particular order.
    fn intents(&self) -> anyhow::Result<Vec<Intent>>;
    fn remove_intent(&self, id: &str) -> anyhow::Result<()>;
}

/// Secrets: a trait of their own, so the sandbox service never sees them
/// and the secrets service sees nothing else.
pub trait SecretStore: Send + Sync {
    /// False, and nothing written, when the name is taken in its team.
    fn insert_secret(&self, record: &SecretRecord) -> anyhow::Result<bool>;
    /// False when there is no record with this id any more.
    fn update_secret(&self, record: &SecretRecord) -> anyhow::Result<bool>;
    fn secret(&self, id: &str) -> anyhow::Result<Option<SecretRecord>>;
    fn secret_named(&self, team: &str, name: &str) -> anyhow::Result<Option<SecretRecord>>;
    /// Every team's secrets, ordered by id.
    fn secrets(&self) -> anyhow::Result<Vec<SecretRecord>>;
    fn remove_secret(&self, id: &str) -> anyhow::Result<bool>;
}

/// Volumes' records (their bytes are the substrate's).
pub trait VolumeStore: Send + Sync {
    /// False, and nothing written, when the name is taken in its team.
    fn insert_volume(&self, record: &VolumeRecord) -> anyhow::Result<bool>;
    fn volume(&self, id: &str) -> anyhow::Result<Option<VolumeRecord>>;
    fn volume_named(&self, team: &str, name: &str) -> anyhow::Result<Option<VolumeRecord>>;
    /// Every team's volumes, ordered by id.
    fn volumes(&self) -> anyhow::Result<Vec<VolumeRecord>>;
    fn remove_volume(&self, id: &str) -> anyhow::Result<bool>;
    /// Replaces volume `record` only while the stored one still names node
    /// `from_node` and is in move state `from` (`VolumeMove::state`), so
    /// two nodes never both take a volume over; whether it did.
    fn swap_volume(
        &self,
        record: &VolumeRecord,
        from_node: Option<&str>,
        from: Option<&VolumeMove>,
    ) -> anyhow::Result<bool>;
}

/// The nodes sharing a database (`model::node`); a single host's SQLite
/// database holds none.
pub trait NodeStore: Send + Sync {
    /// Inserts or replaces the node's record (its heartbeat), keeping the
    /// stored `draining` and `moving_out`: they are the operator's to set,
    /// and a heartbeat must not undo a drain that came after it read the
    /// record.
    ///
    /// In the same write, removes the node's `settled` claims (their
    /// verbs ended before `node.teams` was counted, so the figures hold
    /// what they stored) and those of its earlier runs (made before
    /// `node.started_at_ms`).
    fn beat(&self, node: &NodeRecord, settled: &[String]) -> anyhow::Result<()>;
    /// Sets `draining` and `moving_out`; false when there is no such node.
    fn set_draining(&self, id: &str, draining: bool, moving_out: bool) -> anyhow::Result<bool>;
    fn node(&self, id: &str) -> anyhow::Result<Option<NodeRecord>>;
    /// Every node, ordered by id.
    fn nodes(&self) -> anyhow::Result<Vec<NodeRecord>>;
    /// Removes the node's row and its claims.
    fn remove_node(&self, id: &str) -> anyhow::Result<bool>;
    /// What `team` holds on the nodes other than `node`: their published
    /// figures plus their open claims, read together.
    fn held_elsewhere(&self, node: &str, team: &str) -> anyhow::Result<TeamUsage>;
    /// Stores `claim` if `admit` accepts what its team holds on the other
    /// nodes; one claim per team at a time across the database, so two
    /// nodes cannot both see a last place free.
    fn claim_places(&self, claim: &PlaceClaim, admit: Admit) -> anyhow::Result<super::Result<()>>;
    /// Replaces the cluster CA's revocation list (PEM) that nodes take up
    /// at their heartbeats. The database is only the courier: a node
    /// adopts a list only if the CA signed it and it is newer than its own
    /// (`tls::revocation`).
    fn publish_revocations(&self, pem: &str) -> anyhow::Result<()>;
    fn published_revocations(&self) -> anyhow::Result<Option<String>>;
}
