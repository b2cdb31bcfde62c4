//! Every sandbox's access token (and, in `usage.rs`, what each team holds)
//! in memory, kept in step with the store it wraps. A signed `/files` link names no sandbox (with `E2B_SANDBOX_URL`
//! the SDK sends it to one URL for all), so its owner is whichever token
//! produced its signature; looking here costs one hash per sandbox and
//! neither reads nor locks the store, so a flood of bogus links does not
//! slow `list` or anything else that needs the store.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use copse_protocol::signature::{self, Signer};

use super::sealing;
use super::usage::Usage;
use crate::model::{KeyRecord, SandboxRecord, SnapshotRecord, Store, Team, TemplateLabels, TemplateRecord};
use crate::vault::Vault;

/// The sandbox id for each access token's owner.
#[derive(Default)]
pub struct AccessTokens {
    by_sandbox: RwLock<HashMap<String, String>>,
}

/// A signed link's claims, as its query gives them.
pub struct SignedLink<'a> {
    pub path: &'a str,
    /// "read" or "write".
    pub operation: &'a str,
    pub username: &'a str,
    pub expiration: Option<u64>,
    pub signature: &'a str,
}

impl AccessTokens {
    /// The sandbox whose token signed `link`, if any. Each candidate is
    /// compared in constant time.
    pub fn signer_of(&self, link: &SignedLink) -> Option<String> {
        if !signature::well_formed(link.signature) {
            return None;
        }
        let signer = Signer::new(link.path, link.operation, link.username);
        let tokens = self.by_sandbox.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        tokens
            .iter()
            .find(|(_, token)| signature::equal(&signer.sign(token, link.expiration), link.signature))
            .map(|(id, _)| id.clone())
    }

    /// The sandbox whose access token `token` is, if any; each compared in
    /// constant time.
    pub fn holder_of(&self, token: &str) -> Option<String> {
        let tokens = self.by_sandbox.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        tokens.iter().find(|(_, t)| signature::equal(t, token)).map(|(id, _)| id.clone())
    }

    /// Holds exactly `tokens` (sandbox id → access token) from now on.
    pub fn replace(&self, tokens: HashMap<String, String>) {
        *self.by_sandbox.write().unwrap_or_else(|poisoned| poisoned.into_inner()) = tokens;
    }

    fn set(&self, id: &str, token: &str) {
        let mut tokens = self.by_sandbox.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if tokens.get(id).is_none_or(|t| t != token) {
            tokens.insert(id.to_string(), token.to_string());
        }
    }

    fn forget(&self, id: &str) {
        self.by_sandbox.write().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(id);
    }
}

/// A [`Store`] that keeps [`AccessTokens`] and [`Usage`] up to date with
/// its records, and seals each record's upstream password on the way in
/// (`sealing.rs`).
pub struct Indexed {
    inner: Box<dyn Store>,
    tokens: Arc<AccessTokens>,
    usage: Arc<Usage>,
    /// Seals the records' upstream passwords (`sealing.rs`).
    vault: Vault,
}

impl Indexed {
    /// Wraps `inner`, indexing the sandboxes it already holds. `node`: on a
    /// shared database, this gateway's node; only its records are indexed,
    /// as only its own writes keep the index in step (another node's
    /// sandbox counted here would never be uncounted).
    pub fn new(inner: Box<dyn Store>, node: Option<&str>, vault: Vault) -> anyhow::Result<(Self, Arc<AccessTokens>)> {
        let tokens = Arc::new(AccessTokens::default());
        let usage = Arc::new(Usage::default());
        let here = |of: Option<&str>| node.is_none() || of.is_none() || of == node;
        for record in inner.all()?.into_iter().filter(|r| here(r.node.as_deref())) {
            tokens.set(&record.id, &record.access_token);
            usage.sandbox(&record);
        }
        for snapshot in inner.snapshots()?.into_iter().filter(|s| here(s.node.as_deref())) {
            usage.snapshot(&snapshot);
        }
        Ok((Self { inner, tokens: tokens.clone(), usage, vault }, tokens))
    }

    /// What each team holds, as this store's records say.
    pub fn usage(&self) -> Arc<Usage> {
        self.usage.clone()
    }
}

impl Store for Indexed {
    fn put(&self, record: &SandboxRecord) -> anyhow::Result<()> {
        let (stored, _held) = sealing::for_storage(&self.vault, record)?;
        self.inner.put(&stored)?;
        self.tokens.set(&record.id, &record.access_token);
        self.usage.sandbox(record);
        Ok(())
    }

    fn swap_paused(&self, record: &SandboxRecord, from_node: Option<&str>) -> anyhow::Result<bool> {
        let (stored, _held) = sealing::for_storage(&self.vault, record)?;
        let swapped = self.inner.swap_paused(&stored, from_node)?;
        if swapped {
            self.tokens.set(&record.id, &record.access_token);
            self.usage.sandbox(record);
        }
        Ok(swapped)
    }

    fn indexed(&self) -> Vec<(String, Option<String>)> {
        self.usage.sandboxes()
    }

    fn unindex(&self, id: &str) {
        self.tokens.forget(id);
        self.usage.sandbox_gone(id);
    }

    fn get(&self, id: &str) -> anyhow::Result<Option<SandboxRecord>> {
        Ok(self.inner.get(id)?.map(|r| sealing::from_storage(&self.vault, r)))
    }

    fn all(&self) -> anyhow::Result<Vec<SandboxRecord>> {
        Ok(sealing::all_from_storage(&self.vault, self.inner.all()?))
    }

    fn expired(&self, now_ms: i64) -> anyhow::Result<Vec<String>> {
        self.inner.expired(now_ms)
    }

    fn remove(&self, id: &str) -> anyhow::Result<bool> {
        // A rotation rewrites records it read: none may go meanwhile.
        let _held = self.vault.writing()?;
        let removed = self.inner.remove(id)?;
        self.unindex(id);
        Ok(removed)
    }

    fn put_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<()> {
        self.inner.put_snapshot(record)?;
        self.usage.snapshot(record);
        Ok(())
    }

    fn snapshot(&self, team: &str, id: &str) -> anyhow::Result<Option<SnapshotRecord>> {
        self.inner.snapshot(team, id)
    }

    fn snapshots(&self) -> anyhow::Result<Vec<SnapshotRecord>> {
        self.inner.snapshots()
    }

    fn put_template(&self, record: &TemplateRecord) -> anyhow::Result<()> {
        self.inner.put_template(record)
    }

    fn template(&self, id: &str) -> anyhow::Result<Option<TemplateRecord>> {
        self.inner.template(id)
    }

    fn template_named(&self, team: &str, name: &str) -> anyhow::Result<Option<TemplateRecord>> {
        self.inner.template_named(team, name)
    }

    fn built_templates(&self) -> anyhow::Result<Vec<TemplateRecord>> {
        self.inner.built_templates()
    }

    fn remove_template(&self, id: &str) -> anyhow::Result<bool> {
        self.inner.remove_template(id)
    }

    fn put_build_layer(&self, layer: &crate::model::BuildLayer) -> anyhow::Result<()> {
        self.inner.put_build_layer(layer)
    }

    fn build_layer(&self, team: &str, key: &str) -> anyhow::Result<Option<crate::model::BuildLayer>> {
        self.inner.build_layer(team, key)
    }

    fn build_layers(&self) -> anyhow::Result<Vec<crate::model::BuildLayer>> {
        self.inner.build_layers()
    }

    fn remove_build_layer(&self, key: &str) -> anyhow::Result<bool> {
        self.inner.remove_build_layer(key)
    }

    fn swap_template_labels(&self, labels: &TemplateLabels) -> anyhow::Result<bool> {
        self.inner.swap_template_labels(labels)
    }

    fn template_labels(&self, id: &str) -> anyhow::Result<Option<TemplateLabels>> {
        self.inner.template_labels(id)
    }

    fn remove_template_labels(&self, id: &str) -> anyhow::Result<bool> {
        self.inner.remove_template_labels(id)
    }

    fn update_snapshot(&self, record: &SnapshotRecord) -> anyhow::Result<bool> {
        // The files are the same ones: what the team holds does not change.
        self.inner.update_snapshot(record)
    }

    fn remove_snapshot(&self, team: &str, id: &str) -> anyhow::Result<bool> {
        let removed = self.inner.remove_snapshot(team, id)?;
        self.usage.snapshot_gone(team, id);
        Ok(removed)
    }

    fn put_team(&self, team: &Team) -> anyhow::Result<()> {
        self.inner.put_team(team)
    }

    fn teams(&self) -> anyhow::Result<Vec<Team>> {
        self.inner.teams()
    }

    fn put_key(&self, key: &KeyRecord) -> anyhow::Result<()> {
        self.inner.put_key(key)
    }

    fn keys(&self) -> anyhow::Result<Vec<KeyRecord>> {
        self.inner.keys()
    }

    fn revoke_key(&self, prefix: &str) -> anyhow::Result<Option<KeyRecord>> {
        self.inner.revoke_key(prefix)
    }

    fn keys_used(&self, used: &[(String, i64)]) -> anyhow::Result<()> {
        self.inner.keys_used(used)
    }

    fn tenancy_generation(&self) -> anyhow::Result<i64> {
        self.inner.tenancy_generation()
    }

    fn put_intent(&self, intent: &crate::model::Intent) -> anyhow::Result<()> {
        self.inner.put_intent(intent)
    }

    fn intents(&self) -> anyhow::Result<Vec<crate::model::Intent>> {
        self.inner.intents()
    }

    fn remove_intent(&self, id: &str) -> anyhow::Result<()> {
        self.inner.remove_intent(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

    fn record(id: &str, token: &str) -> SandboxRecord {
        let mut json = serde_json::json!({
            "id": id, "template": "base", "access_token": token, "metadata": {}, "env_vars": {},
            "started_at_ms": 0, "end_at_ms": 0, "state": "running", "allow_internet_access": true,
            "auto_pause": false, "agent_socket": "/nonexistent",
            "placement": { "init_pid": 0, "init_start": 0 },
        });
        json["limits"] = serde_json::to_value(copse_substrate::Limits::default()).unwrap();
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn each_teams_holdings_follow_its_records() {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        sqlite.put(&record("old", "t")).unwrap();
        let (store, _) = Indexed::new(Box::new(sqlite), None, Vault::open(dir.path()).unwrap()).unwrap();
        let usage = store.usage();
        let disk = copse_substrate::Limits::default().disk_mb << 20;
        assert_eq!(usage.of("default").running, 1, "records already stored are counted");
        let mut theirs = record("a1", "t");
        theirs.team = "acme".into();
        store.put(&theirs).unwrap();
        theirs.state = crate::model::State::Paused;
        store.put(&theirs).unwrap();
        let snapshot: SnapshotRecord = serde_json::from_value(serde_json::json!({
            "id": "s", "team": "acme", "names": [], "key": "k", "template": "base",
            "source_sandbox": "a1", "created_at_ms": 0, "size_bytes": 10
        }))
        .unwrap();
        store.put_snapshot(&snapshot).unwrap();
        let acme = usage.of("acme");
        assert_eq!((acme.running, acme.paused, acme.snapshots, acme.disk_bytes), (0, 1, 1, disk + 10));
        store.remove("a1").unwrap();
        store.remove_snapshot("acme", "s").unwrap();
        assert_eq!(usage.of("acme"), Default::default());
        assert_eq!(usage.of("default").running, 1);
    }

    #[test]
    fn on_a_shared_database_only_this_nodes_records_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        for (id, node) in [("mine", Some("n1")), ("theirs", Some("n2")), ("older", None)] {
            sqlite.put(&SandboxRecord { node: node.map(String::from), ..record(id, id) }).unwrap();
        }
        let (store, tokens) = Indexed::new(Box::new(sqlite), Some("n1"), Vault::open(dir.path()).unwrap()).unwrap();
        assert_eq!(store.usage().of("default").running, 2, "its own and the record from before nodes");
        assert_eq!(tokens.holder_of("theirs"), None);
        assert_eq!(tokens.holder_of("mine").as_deref(), Some("mine"));
    }

    fn link<'a>(signature: &'a str, expiration: Option<u64>) -> SignedLink<'a> {
        SignedLink { path: "/home/user/a.txt", operation: "read", username: "user", expiration, signature }
    }

    #[test]
    fn a_link_is_owned_by_the_sandbox_whose_token_signed_it_while_it_lives() {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        sqlite.put(&record("old", "token-old")).unwrap();
        let (store, tokens) = Indexed::new(Box::new(sqlite), None, Vault::open(dir.path()).unwrap()).unwrap();
        store.put(&record("new", "token-new")).unwrap();
        for (id, token) in [("old", "token-old"), ("new", "token-new")] {
            let signature = signature::sign("/home/user/a.txt", "read", "user", token, Some(9));
            assert_eq!(tokens.signer_of(&link(&signature, Some(9))).as_deref(), Some(id));
            // Any claim changed, and the signature is no one's.
            assert_eq!(tokens.signer_of(&link(&signature, Some(10))), None);
            assert_eq!(tokens.signer_of(&SignedLink { operation: "write", ..link(&signature, Some(9)) }), None);
        }
        assert_eq!(tokens.holder_of("token-new").as_deref(), Some("new"));
        assert_eq!(tokens.holder_of("token-none"), None);
        store.remove("old").unwrap();
        assert_eq!(tokens.holder_of("token-old"), None);
        let signature = signature::sign("/home/user/a.txt", "read", "user", "token-old", None);
        assert_eq!(tokens.signer_of(&link(&signature, None)), None);
        assert_eq!(tokens.signer_of(&link("v1_garbage", None)), None);
    }
}
