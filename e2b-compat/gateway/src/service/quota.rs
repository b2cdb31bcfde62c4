//! Team limits: a verb that would make a team hold more than it may is
//! refused whole with E2B's 429 naming the limit. Counts come from the
//! in-memory [`Usage`] plus what verbs in flight have reserved, so two
//! concurrent creates cannot both take the last place.
//!
//! On a cluster, each node's heartbeat publishes what its teams hold there
//! (`NodeRecord::teams`), and every node adds the other nodes' figures to
//! its own ([`Quota::set_elsewhere`], at each of its heartbeats). A limit
//! so holds across the cluster, up to what the other nodes admitted since
//! their figures were read: creates sent to several nodes within a
//! heartbeat or two may pass it by that much. The alternative, a lock in
//! the database around every create, would put a round trip and a
//! cluster-wide queue per team on the create path.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::model::{Caller, Quotas, Result, SandboxError, TeamUsage};
use crate::store::Usage;
use crate::tenancy::Directory;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Kind {
    Running,
    Paused,
    Snapshots,
}

impl Kind {
    fn held(self, usage: &TeamUsage) -> u64 {
        match self {
            Kind::Running => usage.running,
            Kind::Paused => usage.paused,
            Kind::Snapshots => usage.snapshots,
        }
    }

    fn limit(self, quotas: &Quotas) -> Option<u64> {
        match self {
            Kind::Running => quotas.max_sandboxes,
            Kind::Paused => quotas.max_paused,
            Kind::Snapshots => quotas.max_snapshots,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Running => "running sandboxes (max-sandboxes)",
            Kind::Paused => "paused sandboxes (max-paused)",
            Kind::Snapshots => "snapshots (max-snapshots)",
        }
    }
}

/// Places a verb in flight holds until its record is stored.
type Pending = HashMap<(String, Kind), (u64, u64)>;

#[derive(Default)]
pub(super) struct Quota {
    usage: Arc<Usage>,
    directory: Option<Arc<Directory>>,
    /// (team, kind) → (places, disk bytes) reserved.
    pending: Arc<Mutex<Pending>>,
    /// What each team holds on the other nodes of a cluster.
    elsewhere: Mutex<HashMap<String, TeamUsage>>,
}

/// Dropping it gives the reserved places back: by then the verb either
/// stored its records (counted in `Usage`) or failed.
pub(super) struct Reservation {
    pending: Arc<Mutex<Pending>>,
    key: (String, Kind),
    places: u64,
    disk: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = pending.get_mut(&self.key) {
            entry.0 -= self.places;
            entry.1 -= self.disk;
            if entry.0 == 0 {
                pending.remove(&self.key);
            }
        }
    }
}

impl Quota {
    pub(super) fn new(usage: Arc<Usage>, directory: Arc<Directory>) -> Self {
        Self { usage, directory: Some(directory), pending: Default::default(), elsewhere: Default::default() }
    }

    /// What each team holds on this node, for its heartbeat.
    pub(super) fn here_by_team(&self) -> std::collections::BTreeMap<String, TeamUsage> {
        self.usage.by_team()
    }

    /// Replaces what the teams hold on the other nodes.
    pub(super) fn set_elsewhere(&self, teams: HashMap<String, TeamUsage>) {
        *self.elsewhere.lock().unwrap_or_else(|p| p.into_inner()) = teams;
    }

    /// What `team` holds on every node, as far as this one knows.
    fn held(&self, team: &str) -> TeamUsage {
        let mut usage = self.usage.of(team);
        if let Some(other) = self.elsewhere.lock().unwrap_or_else(|p| p.into_inner()).get(team) {
            usage += *other;
        }
        usage
    }

    fn quotas(&self, team: &str) -> Quotas {
        self.directory.as_ref().map(|d| d.quotas(team)).unwrap_or_default()
    }

    /// [`Quota::reserve`] for a verb `caller` asked for on `team`'s behalf.
    /// Operators (admin keys, and the gateway's own expiry: an automatic
    /// pause refused would lose the sandbox's state) are not limited.
    pub(super) fn reserve_for(
        &self,
        caller: &Caller,
        team: &str,
        kind: Kind,
        places: u64,
        disk_bytes: u64,
    ) -> Result<Option<Reservation>> {
        if caller.admin {
            return Ok(None);
        }
        self.reserve(team, kind, places, disk_bytes).map(Some)
    }

    /// Holds `places` more of `kind` for `team`, each with `disk_bytes` of
    /// disk, or refuses them all.
    pub(super) fn reserve(&self, team: &str, kind: Kind, places: u64, disk_bytes: u64) -> Result<Reservation> {
        let quotas = self.quotas(team);
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let usage = self.held(team);
        let in_flight = |k: Kind| pending.get(&(team.to_string(), k)).copied().unwrap_or((0, 0));
        if let Some(max) = kind.limit(&quotas) {
            let held = kind.held(&usage) + in_flight(kind).0;
            if held + places > max {
                return Err(SandboxError::QuotaExceeded(format!(
                    "team {team} has reached its limit of {max} {}: it holds {held}, this request needs {places} more",
                    kind.name()
                )));
            }
        }
        let disk = places * disk_bytes;
        if let Some(max_gb) = quotas.max_disk_gb
            && disk > 0
        {
            let reserved: u64 =
                [Kind::Running, Kind::Paused, Kind::Snapshots].into_iter().map(|k| in_flight(k).1).sum();
            let held = usage.disk_bytes + reserved;
            if held + disk > max_gb << 30 {
                return Err(SandboxError::QuotaExceeded(format!(
                    "team {team} has reached its disk limit of {max_gb} GiB (max-disk-gb): it holds {} MiB, this request needs {} MiB more",
                    held >> 20,
                    disk >> 20
                )));
            }
        }
        let entry = pending.entry((team.to_string(), kind)).or_default();
        entry.0 += places;
        entry.1 += disk;
        Ok(Reservation { pending: self.pending.clone(), key: (team.to_string(), kind), places, disk })
    }

    /// How long `team`'s sandboxes may stay paused, in ms; `None`: for
    /// ever.
    pub(super) fn paused_retention_ms(&self, team: &str) -> Option<i64> {
        self.quotas(team).paused_retention_s.map(|s| i64::try_from(s.saturating_mul(1000)).unwrap_or(i64::MAX))
    }

    /// Refuses a lifetime longer than the team may ask for (operators may).
    pub(super) fn check_timeout(&self, caller: &Caller, team: &str, timeout_s: i64) -> Result<()> {
        if caller.admin {
            return Ok(());
        }
        match self.quotas(team).max_sandbox_timeout_s {
            Some(max) if timeout_s > max as i64 => Err(SandboxError::QuotaExceeded(format!(
                "team {team} may ask for at most {max} s of sandbox lifetime (max-sandbox-timeout), not {timeout_s} s"
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses a snapshot while the team is already at or over its disk
    /// limit (a snapshot's size is known only once taken).
    pub(super) fn check_disk(&self, caller: &Caller, team: &str) -> Result<()> {
        if caller.admin {
            return Ok(());
        }
        match self.quotas(team).max_disk_gb {
            Some(max_gb) if self.held(team).disk_bytes >= max_gb << 30 => Err(SandboxError::QuotaExceeded(format!(
                "team {team} has reached its disk limit of {max_gb} GiB (max-disk-gb)"
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::ApiKeys;
    use crate::model::{DEFAULTS_ROW, Store, Team};
    use crate::store::SqliteStore;

    fn quota_with(quotas: Quotas) -> (Quota, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("copse.db")).unwrap();
        store.put_team(&Team { name: DEFAULTS_ROW.into(), quotas, created_at_ms: 0 }).unwrap();
        let directory = Directory::open(Box::new(store), ApiKeys::new(["operator-key-0123456789abcdef"]).unwrap());
        (Quota::new(Arc::new(Usage::default()), directory.unwrap()), dir)
    }

    #[test]
    fn a_request_for_several_places_is_refused_whole_and_in_flight_ones_count() {
        let (quota, _dir) = quota_with(Quotas { max_sandboxes: Some(3), ..Default::default() });
        let err = quota.reserve("acme", Kind::Running, 4, 0).err().unwrap();
        assert!(err.to_string().contains("limit of 3 running sandboxes"), "{err}");
        let two = quota.reserve("acme", Kind::Running, 2, 0).unwrap();
        assert!(quota.reserve("acme", Kind::Running, 2, 0).is_err(), "two are in flight");
        assert!(quota.reserve("other", Kind::Running, 3, 0).is_ok(), "teams count apart");
        drop(two);
        assert!(quota.reserve("acme", Kind::Running, 3, 0).is_ok());
    }

    #[test]
    fn what_a_team_holds_on_other_nodes_counts_against_its_limits() {
        let (quota, _dir) = quota_with(Quotas { max_sandboxes: Some(3), max_disk_gb: Some(1), ..Default::default() });
        let elsewhere = TeamUsage { running: 2, disk_bytes: 900 << 20, ..Default::default() };
        quota.set_elsewhere([("acme".to_string(), elsewhere)].into());
        let err = quota.reserve("acme", Kind::Running, 2, 0).err().unwrap();
        assert!(err.to_string().contains("it holds 2"), "{err}");
        let err = quota.reserve("acme", Kind::Running, 1, 200 << 20).err().unwrap();
        assert!(err.to_string().contains("max-disk-gb"), "{err}");
        assert!(quota.reserve("acme", Kind::Running, 1, 100 << 20).is_ok());
        assert!(quota.reserve("other", Kind::Running, 3, 0).is_ok(), "another team's figures are its own");
        quota.set_elsewhere(HashMap::new());
        assert!(quota.reserve("acme", Kind::Running, 2, 0).is_ok(), "the next heartbeat's figures replace them");
    }

    #[test]
    fn disk_and_lifetime_limits_name_themselves() {
        let (quota, _dir) =
            quota_with(Quotas { max_disk_gb: Some(1), max_sandbox_timeout_s: Some(60), ..Default::default() });
        let _held = quota.reserve("acme", Kind::Running, 1, 600 << 20).unwrap();
        let err = quota.reserve("acme", Kind::Running, 1, 600 << 20).err().unwrap();
        assert!(err.to_string().contains("max-disk-gb"), "{err}");
        let acme = Caller::team("acme");
        assert!(quota.check_timeout(&acme, "acme", 60).is_ok());
        assert!(quota.check_timeout(&Caller { admin: true, ..acme.clone() }, "acme", 61).is_ok());
        let err = quota.check_timeout(&acme, "acme", 61).unwrap_err();
        assert!(matches!(err, SandboxError::QuotaExceeded(_)) && err.to_string().contains("max-sandbox-timeout"));
    }
}
