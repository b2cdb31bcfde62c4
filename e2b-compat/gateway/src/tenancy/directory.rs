//! Keys and teams, in memory. `copse keys create` writes to the database
//! while the gateway runs; the directory notices through the store's
//! tenancy generation (bumped in the transaction of every key or team
//! change): at once when an unknown key is presented, and within
//! [`REFRESH`] for a revoked key or a changed limit. A known key costs one hash and one map lookup.
//! The map is keyed by the key's SHA-256, so a lookup's timing depends on
//! a hash an attacker cannot steer towards a real key.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::keys::{self, ApiKeys};
use crate::model::{Caller, DEFAULT_TEAM, DEFAULTS_ROW, Quotas, Store, now_ms};

/// How often revocations and limit changes made elsewhere are picked up.
pub const REFRESH: Duration = Duration::from_millis(500);

/// Who a key acts for, and the key's own identity for rate limiting.
#[derive(Debug, Clone)]
pub struct Principal {
    pub caller: Caller,
    /// The key's hash line: names the key without being it.
    pub key: Arc<str>,
}

#[derive(Default)]
struct Known {
    keys: HashMap<String, Principal>,
    quotas: HashMap<String, Quotas>,
    defaults: Quotas,
    version: Option<i64>,
}

pub struct Directory {
    store: Box<dyn Store>,
    /// `COPSE_API_KEY` and the keys file: the default team's.
    operator_keys: ApiKeys,
    known: RwLock<Known>,
    /// Keys used since the last flush, by hash: written in batches, never
    /// on the request path.
    used: Mutex<HashMap<Arc<str>, i64>>,
}

impl Directory {
    /// `store`: its own connection to the database, so its reads never wait
    /// on the service's.
    pub fn open(store: Box<dyn Store>, operator_keys: ApiKeys) -> anyhow::Result<Arc<Self>> {
        let directory = Self { store, operator_keys, known: Default::default(), used: Default::default() };
        directory.reload()?;
        Ok(Arc::new(directory))
    }

    /// The principal `presented` belongs to, if any key matches.
    pub fn authenticate(&self, presented: &str) -> Option<Principal> {
        let hash = keys::hash_line(presented);
        if let Some(found) = self.lookup(&hash) {
            return Some(found);
        }
        if self.operator_keys.accepts(presented) {
            return Some(Principal { caller: Caller::team(DEFAULT_TEAM), key: hash.into() });
        }
        // A key made a moment ago by the CLI: look again if keys changed
        // since the last load.
        if let Err(e) = self.refresh() {
            tracing::warn!("reloading API keys: {e:#}");
        }
        self.lookup(&hash)
    }

    fn lookup(&self, hash: &str) -> Option<Principal> {
        let found = read(&self.known).keys.get(hash).cloned()?;
        self.used.lock().unwrap_or_else(|p| p.into_inner()).insert(found.key.clone(), now_ms());
        Some(found)
    }

    /// The limits `team` works under: its own, else the defaults.
    pub fn quotas(&self, team: &str) -> Quotas {
        let known = read(&self.known);
        known.quotas.get(team).copied().unwrap_or_default().or(known.defaults)
    }

    /// Reloads keys and teams if they changed since the last load.
    pub fn refresh(&self) -> anyhow::Result<()> {
        let version = self.store.tenancy_generation()?;
        if read(&self.known).version != Some(version) {
            self.reload()?;
        }
        Ok(())
    }

    fn reload(&self) -> anyhow::Result<()> {
        // Read the version first: a change landing during the reload moves
        // it again, so the next refresh reloads once more.
        let version = self.store.tenancy_generation()?;
        let mut fresh = Known { version: Some(version), ..Default::default() };
        for key in self.store.keys()? {
            let principal = Principal {
                caller: Caller { team: key.team.clone(), admin: key.admin },
                key: key.hash.as_str().into(),
            };
            fresh.keys.insert(key.hash, principal);
        }
        for team in self.store.teams()? {
            if team.name == DEFAULTS_ROW {
                fresh.defaults = team.quotas;
            } else {
                fresh.quotas.insert(team.name, team.quotas);
            }
        }
        *self.known.write().unwrap_or_else(|p| p.into_inner()) = fresh;
        Ok(())
    }

    fn flush_used(&self) -> anyhow::Result<()> {
        let used: Vec<(String, i64)> = std::mem::take(&mut *self.used.lock().unwrap_or_else(|p| p.into_inner()))
            .into_iter()
            .map(|(hash, at)| (hash.to_string(), at))
            .collect();
        if used.is_empty() {
            return Ok(());
        }
        self.store.keys_used(&used)
    }

    /// Refreshes every [`REFRESH`] until the gateway stops.
    pub fn spawn_refresher(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let directory = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REFRESH);
            loop {
                tick.tick().await;
                let directory = directory.clone();
                let done = tokio::task::spawn_blocking(move || {
                    directory.flush_used()?;
                    directory.refresh()
                })
                .await;
                if let Ok(Err(e)) = done {
                    tracing::warn!("refreshing API keys and team limits: {e:#}");
                }
            }
        })
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KeyRecord, Team};
    use crate::store::SqliteStore;

    fn key_record(key: &str, team: &str, admin: bool) -> KeyRecord {
        KeyRecord {
            hash: keys::hash_line(key),
            prefix: key[..12].to_string(),
            team: team.into(),
            label: String::new(),
            admin,
            created_at_ms: 0,
            last_used_ms: None,
        }
    }

    #[test]
    fn keys_added_and_revoked_by_another_connection_are_seen() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("copse.db");
        let operator = "operator-key-0123456789abcdef";
        let directory =
            Directory::open(Box::new(SqliteStore::open(&db).unwrap()), ApiKeys::new([operator]).unwrap()).unwrap();
        assert_eq!(directory.authenticate(operator).unwrap().caller, Caller::team(DEFAULT_TEAM));
        let cli = SqliteStore::open(&db).unwrap();
        let key = keys::generate_key();
        assert!(directory.authenticate(&key).is_none());
        cli.put_key(&key_record(&key, "acme", false)).unwrap();
        // No refresh in between: an unknown key makes the directory look.
        assert_eq!(directory.authenticate(&key).unwrap().caller, Caller::team("acme"));
        let admin = keys::generate_key();
        cli.put_key(&key_record(&admin, "ops", true)).unwrap();
        assert!(directory.authenticate(&admin).unwrap().caller.admin);
        cli.revoke_key(&key[..12]).unwrap();
        directory.refresh().unwrap();
        assert!(directory.authenticate(&key).is_none());
        directory.flush_used().unwrap();
        assert!(cli.keys().unwrap()[0].last_used_ms.is_some(), "last use is recorded");
    }

    #[test]
    fn a_team_without_limits_of_its_own_gets_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("copse.db");
        let store = SqliteStore::open(&db).unwrap();
        let quotas = |n| Quotas { max_sandboxes: Some(n), ..Default::default() };
        store.put_team(&Team { name: DEFAULTS_ROW.into(), quotas: quotas(5), created_at_ms: 0 }).unwrap();
        store.put_team(&Team { name: "acme".into(), quotas: quotas(2), created_at_ms: 0 }).unwrap();
        let directory =
            Directory::open(Box::new(store), ApiKeys::new(["operator-key-0123456789abcdef"]).unwrap()).unwrap();
        assert_eq!(directory.quotas("acme").max_sandboxes, Some(2));
        assert_eq!(directory.quotas("other").max_sandboxes, Some(5));
    }
}
