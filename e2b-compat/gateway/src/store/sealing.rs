//! The one credential a sandbox record carries for the host's use, the
//! password of its `egress_proxy` upstream, never lies in the database in
//! the clear: [`Indexed`](super::Indexed) stores the record with the
//! policy's copy blanked and the password sealed beside it by the secrets
//! keyring ([`Vault`]), bound to the sandbox's id, and fills it in again
//! when the record is read. A rotation of the keyring re-seals these too.

use std::borrow::Cow;

use crate::model::SandboxRecord;
use crate::vault::{Held, Keyring, Vault};

/// The associated data binding a sealed password to its sandbox: a value
/// copied onto another record does not open.
pub fn seal_context(sandbox_id: &str) -> String {
    format!("copse-egress-proxy:{sandbox_id}")
}

/// `record` as it is stored. The guard, when there was something to seal,
/// keeps a rotation out until the write is done (see [`Vault::writing`]).
pub(super) fn for_storage<'a>(
    vault: &Vault,
    record: &'a SandboxRecord,
) -> anyhow::Result<(Cow<'a, SandboxRecord>, Option<Held>)> {
    let Some(password) = upstream_password(record).filter(|p| !p.is_empty()) else {
        return Ok((Cow::Borrowed(record), None));
    };
    let held = vault.writing()?;
    let mut stored = record.clone();
    stored.sealed_upstream_password = Some(vault.seal(&seal_context(&record.id), password.as_bytes())?);
    set_upstream_password(&mut stored, String::new());
    Ok((Cow::Owned(stored), Some(held)))
}

/// `record` as read from the store, its password opened. One that does not
/// open (a node whose keyring is not the cluster's) is logged and left
/// blank, its sealed copy kept in the record so that writing the record
/// back keeps it: the record still serves everything but that upstream's
/// login.
pub(super) fn from_storage(vault: &Vault, record: SandboxRecord) -> SandboxRecord {
    all_from_storage(vault, vec![record]).pop().expect("one record in, one out")
}

/// [`from_storage`] of many records, the keyring read once if any needs it.
pub(super) fn all_from_storage(vault: &Vault, records: Vec<SandboxRecord>) -> Vec<SandboxRecord> {
    if records.iter().all(|r| r.sealed_upstream_password.is_none()) {
        return records;
    }
    let keyring = vault.keyring();
    records.into_iter().map(|r| open(&keyring, r)).collect()
}

fn open(keyring: &anyhow::Result<Keyring>, mut record: SandboxRecord) -> SandboxRecord {
    let Some(sealed) = &record.sealed_upstream_password else { return record };
    let opened = match keyring {
        Ok(keyring) => keyring.unseal(&seal_context(&record.id), sealed),
        Err(e) => Err(anyhow::anyhow!("{e:#}")),
    };
    match opened.map(String::from_utf8) {
        Ok(Ok(password)) => {
            set_upstream_password(&mut record, password);
            record.sealed_upstream_password = None;
        }
        Ok(Err(_)) => tracing::error!(sandbox_id = %record.id, "its egress proxy password is not UTF-8"),
        Err(e) => tracing::error!(sandbox_id = %record.id, "opening its egress proxy password: {e:#}"),
    }
    record
}

fn upstream_password(record: &SandboxRecord) -> Option<&String> {
    let upstream = record.network.as_ref()?.policy.upstream.as_ref()?;
    Some(&upstream.credentials.as_ref()?.password)
}

fn set_upstream_password(record: &mut SandboxRecord, password: String) {
    let credentials =
        record.network.as_mut().and_then(|n| n.policy.upstream.as_mut()).and_then(|u| u.credentials.as_mut());
    if let Some(credentials) = credentials {
        credentials.password = password;
    }
}

#[cfg(test)]
mod tests {
    use copse_cubenet::Upstream;
    use copse_substrate::{Policy, SandboxNetwork};

    use super::*;
    use crate::model::Store;
    use crate::store::{Indexed, SqliteStore};

    fn record(id: &str, password: &str) -> SandboxRecord {
        let mut json = serde_json::json!({
            "id": id, "template": "base", "access_token": "t", "metadata": {}, "env_vars": {},
            "started_at_ms": 0, "end_at_ms": 0, "state": "running", "allow_internet_access": true,
            "auto_pause": false, "agent_socket": "/nonexistent",
            "placement": { "init_pid": 0, "init_start": 0 },
        });
        json["limits"] = serde_json::to_value(copse_substrate::Limits::default()).unwrap();
        let mut record: SandboxRecord = serde_json::from_value(json).unwrap();
        let mut policy = Policy::open();
        policy.upstream = Some(Upstream::from_e2b("192.0.2.7:1080", Some("user"), Some(password)).unwrap());
        record.network = Some(SandboxNetwork { address: "10.11.0.2".parse().unwrap(), policy });
        record
    }

    fn password(record: &SandboxRecord) -> &str {
        upstream_password(record).unwrap()
    }

    #[test]
    fn the_database_holds_the_upstream_password_sealed_and_a_read_opens_it() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("copse.db");
        let (store, _) =
            Indexed::new(Box::new(SqliteStore::open(&db).unwrap()), None, Vault::open(dir.path()).unwrap()).unwrap();
        store.put(&record("a", "hunter2-socks")).unwrap();
        store.put(&record("b", "other-socks")).unwrap();
        let raw = SqliteStore::open(&db).unwrap();
        let stored = raw.get("a").unwrap().unwrap();
        assert_eq!(password(&stored), "", "the policy's copy is blank in the database");
        assert!(!serde_json::to_string(&stored).unwrap().contains("hunter2"));
        assert!(!std::fs::read(&db).unwrap().windows(7).any(|w| w == b"hunter2"));
        assert_eq!(password(&store.get("a").unwrap().unwrap()), "hunter2-socks");
        assert!(store.all().unwrap().iter().all(|r| r.sealed_upstream_password.is_none()));

        // Another sandbox's sealed password moved onto this record does not
        // open here: the read goes on without it.
        let mut swapped = stored.clone();
        swapped.sealed_upstream_password = raw.get("b").unwrap().unwrap().sealed_upstream_password;
        raw.put(&swapped).unwrap();
        let unopened = store.get("a").unwrap().unwrap();
        assert_eq!(password(&unopened), "");
        // Written back as read, the sealed copy stays.
        store.put(&unopened).unwrap();
        assert_eq!(raw.get("a").unwrap().unwrap().sealed_upstream_password, swapped.sealed_upstream_password);

        // A rotation re-seals it; a read after it still opens it.
        store.put(&record("a", "hunter2-socks")).unwrap();
        let vault = Vault::open(dir.path()).unwrap();
        let before = raw.get("a").unwrap().unwrap().sealed_upstream_password.unwrap();
        assert_eq!(vault.rotate(&raw, &raw).unwrap(), 2);
        let after = raw.get("a").unwrap().unwrap().sealed_upstream_password.unwrap();
        assert_ne!(before.key_id, after.key_id);
        assert_eq!(password(&store.get("a").unwrap().unwrap()), "hunter2-socks");
        assert_eq!(password(&store.get("b").unwrap().unwrap()), "other-socks");
    }

    #[test]
    fn a_record_without_a_password_is_stored_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let vault = Vault::open(dir.path()).unwrap();
        let mut plain = record("c", "x");
        plain.network = None;
        let (stored, held) = for_storage(&vault, &plain).unwrap();
        assert!(matches!(stored, Cow::Borrowed(_)) && held.is_none());
    }
}
