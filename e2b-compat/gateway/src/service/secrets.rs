//! The secrets service: create, read, list, new versions, delete. Values
//! go in and are sealed by the vault before they are stored; no verb gives
//! one back. A secret is addressed by its id or its name, as the SDK does,
//! and belongs to the caller's team: other teams are told it does not exist.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::model::{
    Caller, SecretError, SecretRecord, SecretStore, new_id, now_ms, validate_secret_metadata, validate_secret_name,
    validate_secret_value,
};
use crate::vault::{Vault, current_value, seal_context};

type Result<T> = std::result::Result<T, SecretError>;

pub struct Secrets {
    store: Arc<dyn SecretStore>,
    vault: Vault,
}

impl Secrets {
    pub fn new(store: Arc<dyn SecretStore>, vault: Vault) -> Self {
        Self { store, vault }
    }

    pub fn create(
        &self,
        caller: &Caller,
        name: &str,
        value: &str,
        metadata: BTreeMap<String, String>,
    ) -> Result<SecretRecord> {
        validate_secret_name(name)?;
        validate_secret_value(value)?;
        validate_secret_metadata(&metadata)?;
        // A name equal to a secret's id would be unreachable by name.
        if self.store.secret(name)?.is_some() {
            return Err(SecretError::NameTaken(name.to_string()));
        }
        let now = now_ms();
        let mut record = SecretRecord {
            id: new_id(),
            team: caller.team.clone(),
            name: name.to_string(),
            metadata,
            created_at_ms: now,
            updated_at_ms: now,
            versions: Vec::new(),
        };
        let _held = self.vault.writing()?;
        record.push_version(self.vault.seal(&seal_context(&record.id, 1), value.as_bytes())?, now);
        if !self.store.insert_secret(&record)? {
            return Err(SecretError::NameTaken(name.to_string()));
        }
        Ok(record)
    }

    /// A new current version; `metadata`, when given, replaces the old.
    pub fn update(
        &self,
        caller: &Caller,
        id_or_name: &str,
        value: &str,
        metadata: Option<BTreeMap<String, String>>,
    ) -> Result<SecretRecord> {
        validate_secret_value(value)?;
        if let Some(metadata) = &metadata {
            validate_secret_metadata(metadata)?;
        }
        let _held = self.vault.writing()?;
        let mut record = self.get(caller, id_or_name)?;
        let version = record.current_version() + 1;
        let sealed = self.vault.seal(&seal_context(&record.id, version), value.as_bytes())?;
        record.push_version(sealed, now_ms());
        if let Some(metadata) = metadata {
            record.metadata = metadata;
        }
        if !self.store.update_secret(&record)? {
            return Err(SecretError::NotFound(id_or_name.to_string()));
        }
        Ok(record)
    }

    pub fn get(&self, caller: &Caller, id_or_name: &str) -> Result<SecretRecord> {
        let found = match self.store.secret(id_or_name)? {
            Some(record) => Some(record),
            None => self.store.secret_named(&caller.team, id_or_name)?,
        };
        found.filter(|r| caller.sees(&r.team)).ok_or_else(|| SecretError::NotFound(id_or_name.to_string()))
    }

    /// The caller's secrets (every team's for an admin), ordered by id (the
    /// API pages through them).
    pub fn list(&self, caller: &Caller) -> Result<Vec<SecretRecord>> {
        Ok(self.store.secrets()?.into_iter().filter(|r| caller.sees(&r.team)).collect())
    }

    /// Whether `team` has a secret called `name`.
    pub fn exists(&self, team: &str, name: &str) -> anyhow::Result<bool> {
        Ok(self.store.secret_named(team, name)?.is_some())
    }

    /// The egress proxy's view: a secret's current value by team and name.
    /// Values are opened per request, so a new version or a delete takes
    /// effect on the next one.
    pub fn resolver(self: &Arc<Self>) -> copse_substrate::SecretResolver {
        let secrets = self.clone();
        Arc::new(move |team, name| {
            let record = secrets.store.secret_named(team, name).ok()??;
            match current_value(&secrets.vault, &record).map(String::from_utf8) {
                Ok(Ok(value)) => Some(value),
                Ok(Err(_)) => None,
                Err(e) => {
                    tracing::warn!(secret = %record.id, "opening a secret for the egress proxy: {e:#}");
                    None
                }
            }
        })
    }

    pub fn delete(&self, caller: &Caller, id_or_name: &str) -> Result<()> {
        let record = self.get(caller, id_or_name)?;
        if self.store.remove_secret(&record.id)? { Ok(()) } else { Err(SecretError::NotFound(id_or_name.to_string())) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DEFAULT_TEAM;
    use crate::store::SqliteStore;

    fn team() -> Caller {
        Caller::team(DEFAULT_TEAM)
    }

    fn secrets(dir: &std::path::Path) -> Secrets {
        let store = Arc::new(SqliteStore::open(&dir.join("copse.db")).unwrap());
        Secrets::new(store, Vault::open(dir).unwrap())
    }

    #[test]
    fn versions_are_addressed_by_id_or_name_and_values_stay_sealed() {
        let dir = tempfile::tempdir().unwrap();
        let secrets = secrets(dir.path());
        let created =
            secrets.create(&team(), "api-key", "first", BTreeMap::from([("env".into(), "prod".into())])).unwrap();
        assert_eq!(created.current_version(), 1);
        let updated = secrets.update(&team(), "api-key", "second", None).unwrap();
        assert_eq!(updated.current_version(), 2);
        assert_eq!(updated.metadata["env"], "prod");
        let by_id = secrets.get(&team(), &created.id).unwrap();
        assert_eq!(current_value(&secrets.vault, &by_id).unwrap(), b"second");
        let database = std::fs::read(dir.path().join("copse.db")).unwrap();
        assert!(!database.windows(6).any(|w| w == b"second"));
        secrets.delete(&team(), &created.id).unwrap();
        assert!(matches!(secrets.get(&team(), "api-key"), Err(SecretError::NotFound(_))));
    }

    #[test]
    fn names_are_unique_and_never_shadow_an_id() {
        let dir = tempfile::tempdir().unwrap();
        let secrets = secrets(dir.path());
        let first = secrets.create(&team(), "a", "v", BTreeMap::new()).unwrap();
        assert!(matches!(secrets.create(&team(), "a", "v", BTreeMap::new()), Err(SecretError::NameTaken(_))));
        assert!(matches!(secrets.create(&team(), &first.id, "v", BTreeMap::new()), Err(SecretError::NameTaken(_))));
        assert!(matches!(secrets.update(&team(), "nope", "v", None), Err(SecretError::NotFound(_))));
        assert!(matches!(secrets.create(&team(), "a{b}", "v", BTreeMap::new()), Err(SecretError::Invalid(_))));
    }

    #[test]
    fn another_team_neither_sees_nor_touches_a_secret_and_may_reuse_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let secrets = secrets(dir.path());
        let ours = secrets.create(&team(), "db-password", "v", BTreeMap::new()).unwrap();
        let acme = Caller::team("acme");
        for id in [ours.id.as_str(), "db-password"] {
            assert!(matches!(secrets.get(&acme, id), Err(SecretError::NotFound(_))));
            assert!(matches!(secrets.update(&acme, id, "w", None), Err(SecretError::NotFound(_))));
            assert!(matches!(secrets.delete(&acme, id), Err(SecretError::NotFound(_))));
        }
        assert!(secrets.list(&acme).unwrap().is_empty());
        let theirs = secrets.create(&acme, "db-password", "x", BTreeMap::new()).unwrap();
        assert_eq!(secrets.get(&acme, "db-password").unwrap().id, theirs.id);
        assert_eq!(secrets.get(&team(), "db-password").unwrap().current_version(), 1);
        assert_eq!(secrets.list(&Caller::operator()).unwrap().len(), 2);
    }
}
