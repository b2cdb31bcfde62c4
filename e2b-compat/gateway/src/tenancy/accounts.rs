//! What `copse keys` and `copse teams` do to the store: they run beside a
//! gateway on the same database, which picks the change up (see
//! `directory.rs`).

use anyhow::{Context, bail};

use crate::keys;
use crate::model::{DEFAULTS_ROW, KeyRecord, Quotas, Store, Team, now_ms, validate_team_name};

/// How many characters of a key `keys list` shows and `keys revoke` takes:
/// `e2b_` and 8 hex digits, 32 bits of the key's 160.
const PREFIX_LEN: usize = 12;

/// A new key for `team` (created if new); the key itself, shown once.
pub fn create_key(store: &dyn Store, team: &str, label: &str, admin: bool) -> anyhow::Result<String> {
    validate_team_name(team)?;
    ensure_team(store, team)?;
    let key = keys::generate_key();
    store.put_key(&KeyRecord {
        hash: keys::hash_line(&key),
        prefix: key[..PREFIX_LEN].to_string(),
        team: team.to_string(),
        label: label.to_string(),
        admin,
        created_at_ms: now_ms(),
        last_used_ms: None,
    })?;
    Ok(key)
}

pub fn revoke_key(store: &dyn Store, prefix: &str) -> anyhow::Result<KeyRecord> {
    if prefix.len() < 6 {
        bail!("give at least 6 characters of the key's prefix (see `copse keys list`)");
    }
    store.revoke_key(prefix)?.with_context(|| format!("no key starts with {prefix:?}"))
}

fn ensure_team(store: &dyn Store, team: &str) -> anyhow::Result<Team> {
    if let Some(found) = store.teams()?.into_iter().find(|t| t.name == team) {
        return Ok(found);
    }
    let created = Team { name: team.to_string(), quotas: Quotas::default(), created_at_ms: now_ms() };
    store.put_team(&created)?;
    Ok(created)
}

/// Sets the limits `change` names for `team` (`None`: the defaults for
/// every team without its own), keeping the others.
pub fn set_limits(store: &dyn Store, team: Option<&str>, change: Quotas) -> anyhow::Result<Team> {
    let name = match team {
        Some(name) => {
            validate_team_name(name)?;
            name
        }
        None => DEFAULTS_ROW,
    };
    let mut team = ensure_team(store, name)?;
    team.quotas = change.or(team.quotas);
    store.put_team(&team)?;
    Ok(team)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

    #[test]
    fn a_key_is_stored_as_its_hash_under_its_team_and_revoked_by_prefix() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        let key = create_key(&store, "acme", "ci", false).unwrap();
        assert!(key.starts_with("e2b_") && key.len() == 44);
        let stored = store.keys().unwrap();
        assert_eq!(stored.len(), 1);
        assert_eq!((stored[0].team.as_str(), stored[0].label.as_str()), ("acme", "ci"));
        assert_eq!(stored[0].hash, keys::hash_line(&key));
        assert!(!serde_json::to_string(&stored).unwrap().contains(&key[PREFIX_LEN..]));
        assert_eq!(store.teams().unwrap()[0].name, "acme");
        assert!(revoke_key(&store, "e2b_").is_err(), "too short to name one key");
        assert_eq!(revoke_key(&store, &key[..PREFIX_LEN]).unwrap().team, "acme");
        assert!(store.keys().unwrap().is_empty());
        assert!(create_key(&store, "bad name", "", false).is_err());
    }

    #[test]
    fn setting_one_limit_keeps_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        set_limits(&store, Some("acme"), Quotas { max_sandboxes: Some(3), ..Default::default() }).unwrap();
        let team = set_limits(&store, Some("acme"), Quotas { max_paused: Some(1), ..Default::default() }).unwrap();
        assert_eq!((team.quotas.max_sandboxes, team.quotas.max_paused), (Some(3), Some(1)));
        let defaults = set_limits(&store, None, Quotas { max_snapshots: Some(4), ..Default::default() }).unwrap();
        assert_eq!(defaults.name, DEFAULTS_ROW);
    }
}
