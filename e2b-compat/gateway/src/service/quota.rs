//! Team limits: a verb that would make a team hold more than it may is
//! refused whole with E2B's 429 naming the limit. Counts come from the
//! in-memory [`Usage`] plus what verbs in flight have reserved, so two
//! concurrent creates cannot both take the last place.
//!
//! On a cluster, a verb of a team with a limit also claims its places in
//! the database (`model::PlaceClaim`), under a lock per team, after
//! reading what the team holds on the other nodes: their heartbeats'
//! figures (`NodeRecord::teams`) plus their open claims. A claim stays
//! until this node's heartbeat publishes figures that include what the
//! verb stored, in the same write, so a place is always counted by one or
//! the other and two nodes cannot both give out a team's last one. Teams
//! without limits, and operators, claim nothing: their creates make no
//! extra round trip.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use crate::model::{Caller, NodeStore, PlaceClaim, Quotas, Result, SandboxError, TeamUsage, new_id, now_ms};
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

    /// `places` of this kind with `disk` bytes, as figures.
    fn usage(self, places: u64, disk: u64) -> TeamUsage {
        let mut usage = TeamUsage { disk_bytes: disk, ..Default::default() };
        match self {
            Kind::Running => usage.running = places,
            Kind::Paused => usage.paused = places,
            Kind::Snapshots => usage.snapshots = places,
        }
        usage
    }
}

/// Places a verb in flight holds until its record is stored.
type Pending = HashMap<(String, Kind), (u64, u64)>;

/// Ids of claims whose verbs have ended, oldest first: the next
/// heartbeat removes them as it publishes figures that count their
/// records.
type Settled = Arc<Mutex<Vec<String>>>;

/// This node's seat in a cluster.
struct Shared {
    nodes: Arc<dyn NodeStore>,
    node: String,
    settled: Settled,
}

#[derive(Default)]
pub(super) struct Quota {
    usage: Arc<Usage>,
    directory: Option<Arc<Directory>>,
    /// (team, kind) → (places, disk bytes) reserved.
    pending: Arc<Mutex<Pending>>,
    shared: Option<Shared>,
}

/// Dropping it gives the reserved places back: by then the verb either
/// stored its records (counted in `Usage`) or failed. Its claim, if it
/// made one, is left for the next heartbeat to settle.
pub(super) struct Reservation {
    pending: Arc<Mutex<Pending>>,
    key: (String, Kind),
    places: u64,
    disk: u64,
    claim: Option<(String, Settled)>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some((id, settled)) = self.claim.take() {
            settled.lock().unwrap_or_else(|p| p.into_inner()).push(id);
        }
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

/// What a team holds on this node, with what its verbs in flight here
/// reserved.
#[derive(Clone, Copy)]
struct HeldHere {
    usage: TeamUsage,
    /// Places of the verb's kind in flight.
    places: u64,
    /// Disk in flight, of every kind.
    disk: u64,
}

/// Why `places` more of `kind` with `disk` bytes would pass one of
/// `team`'s limits, given what it holds here and on the other nodes.
fn refusal(
    team: &str,
    (kind, places, disk): (Kind, u64, u64),
    quotas: &Quotas,
    here: HeldHere,
    elsewhere: TeamUsage,
) -> Result<()> {
    let mut usage = here.usage;
    usage += elsewhere;
    if let Some(max) = kind.limit(quotas) {
        let held = kind.held(&usage) + here.places;
        if held + places > max {
            return Err(SandboxError::QuotaExceeded(format!(
                "team {team} has reached its limit of {max} {}: it holds {held}, this request needs {places} more",
                kind.name()
            )));
        }
    }
    if let Some(max_gb) = quotas.max_disk_gb
        && disk > 0
    {
        let held = usage.disk_bytes + here.disk;
        if held + disk > max_gb << 30 {
            return Err(SandboxError::QuotaExceeded(format!(
                "team {team} has reached its disk limit of {max_gb} GiB (max-disk-gb): it holds {} MiB, this request needs {} MiB more",
                held >> 20,
                disk >> 20
            )));
        }
    }
    Ok(())
}

impl Quota {
    pub(super) fn new(usage: Arc<Usage>, directory: Arc<Directory>) -> Self {
        Self { usage, directory: Some(directory), pending: Default::default(), shared: None }
    }

    /// Counts what teams hold on the other nodes of `nodes`' cluster, this
    /// one being `node`.
    pub(super) fn share(&mut self, nodes: Arc<dyn NodeStore>, node: String) {
        self.shared = Some(Shared { nodes, node, settled: Default::default() });
    }

    /// What this node's heartbeat publishes: what each team holds here,
    /// and the claims those figures now include. The claims are listed
    /// first: one settled after that is not in the figures, and waits for
    /// the next heartbeat.
    pub(super) fn for_heartbeat(&self) -> (BTreeMap<String, TeamUsage>, Vec<String>) {
        let settled = match &self.shared {
            Some(shared) => shared.settled.lock().unwrap_or_else(|p| p.into_inner()).clone(),
            None => Vec::new(),
        };
        (self.usage.by_team(), settled)
    }

    /// After a heartbeat stored `count` settled claims' removal.
    pub(super) fn published(&self, count: usize) {
        if let Some(shared) = &self.shared {
            shared.settled.lock().unwrap_or_else(|p| p.into_inner()).drain(..count);
        }
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
        let disk = places * disk_bytes;
        let verb = (kind, places, disk);
        let (mut reservation, here) = {
            let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let in_flight = |k: Kind| pending.get(&(team.to_string(), k)).copied().unwrap_or((0, 0));
            let here = HeldHere {
                usage: self.usage.of(team),
                places: in_flight(kind).0,
                disk: [Kind::Running, Kind::Paused, Kind::Snapshots].into_iter().map(|k| in_flight(k).1).sum(),
            };
            refusal(team, verb, &quotas, here, TeamUsage::default())?;
            let entry = pending.entry((team.to_string(), kind)).or_default();
            entry.0 += places;
            entry.1 += disk;
            let key = (team.to_string(), kind);
            (Reservation { pending: self.pending.clone(), key, places, disk, claim: None }, here)
        };
        let limited = kind.limit(&quotas).is_some() || (quotas.max_disk_gb.is_some() && disk > 0);
        if let Some(shared) = self.shared.as_ref().filter(|_| limited) {
            let claim = PlaceClaim {
                id: new_id(),
                node: shared.node.clone(),
                team: team.to_string(),
                usage: kind.usage(places, disk),
                at_ms: now_ms(),
            };
            let owned_team = team.to_string();
            let admit = Box::new(move |elsewhere| refusal(&owned_team, verb, &quotas, here, elsewhere));
            // Settled when the reservation ends even if the database's
            // answer was lost: the claim may be stored, and removing one
            // that is not costs nothing. A refused claim never is.
            reservation.claim = Some((claim.id.clone(), shared.settled.clone()));
            match shared.nodes.claim_places(&claim, admit) {
                Ok(Ok(())) => {}
                Ok(Err(refused)) => {
                    reservation.claim = None;
                    return Err(refused);
                }
                Err(err) => {
                    return Err(SandboxError::Unavailable(format!(
                        "checking team {team}'s limits across the cluster: {err:#}"
                    )));
                }
            }
        }
        Ok(reservation)
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
        let Some(max_gb) = self.quotas(team).max_disk_gb else { return Ok(()) };
        let mut held = self.usage.of(team);
        if let Some(shared) = &self.shared {
            held += shared.nodes.held_elsewhere(&shared.node, team).map_err(|err| {
                SandboxError::Unavailable(format!("checking team {team}'s disk limit across the cluster: {err:#}"))
            })?;
        }
        if held.disk_bytes >= max_gb << 30 {
            return Err(SandboxError::QuotaExceeded(format!(
                "team {team} has reached its disk limit of {max_gb} GiB (max-disk-gb)"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::ApiKeys;
    use crate::model::{DEFAULTS_ROW, NodeRecord, Store, Team};
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

    /// Two nodes' quotas on one database.
    fn two_nodes_with(quotas: Quotas) -> (Quota, Quota, Arc<dyn NodeStore>, tempfile::TempDir) {
        let (mut a, dir) = quota_with(quotas);
        let store: Arc<dyn NodeStore> = Arc::new(SqliteStore::open(&dir.path().join("copse.db")).unwrap());
        let mut b = Quota::new(Arc::new(Usage::default()), a.directory.clone().unwrap());
        a.share(store.clone(), "a".into());
        b.share(store.clone(), "b".into());
        (a, b, store, dir)
    }

    fn heartbeat(quota: &Quota, nodes: &dyn NodeStore, id: &str) {
        let (teams, settled) = quota.for_heartbeat();
        let record = NodeRecord {
            id: id.into(),
            api_url: String::new(),
            substrate: String::new(),
            capacity: Default::default(),
            templates: vec![],
            started_at_ms: 0,
            heartbeat_at_ms: now_ms(),
            draining: false,
            moving_out: false,
            teams,
        };
        nodes.beat(&record, &settled).unwrap();
        quota.published(settled.len());
    }

    #[test]
    fn what_a_team_holds_on_other_nodes_counts_from_the_moment_it_is_admitted() {
        let (a, b, nodes, _dir) =
            two_nodes_with(Quotas { max_sandboxes: Some(3), max_disk_gb: Some(1), ..Default::default() });
        let two = a.reserve("acme", Kind::Running, 2, 400 << 20).unwrap();
        // No heartbeat yet: node b sees node a's claim.
        let err = b.reserve("acme", Kind::Running, 2, 0).err().unwrap();
        assert!(err.to_string().contains("it holds 2"), "{err}");
        let err = b.reserve("acme", Kind::Running, 1, 300 << 20).err().unwrap();
        assert!(err.to_string().contains("max-disk-gb"), "{err}");
        let one = b.reserve("acme", Kind::Running, 1, 100 << 20).unwrap();
        assert!(a.reserve("acme", Kind::Running, 1, 0).is_err(), "a's own two and b's one");
        drop((two, one));
        // Ended, but counted until each owner's heartbeat replaces its
        // claims with figures (here: nothing stored).
        assert!(b.reserve("acme", Kind::Running, 2, 0).is_err());
        heartbeat(&a, nodes.as_ref(), "a");
        assert!(b.reserve("acme", Kind::Running, 3, 0).is_ok());
        assert!(a.reserve("acme", Kind::Running, 3, 0).is_err(), "b's claims stay until b's heartbeat");
        heartbeat(&b, nodes.as_ref(), "b");
        assert!(a.reserve("acme", Kind::Running, 3, 0).is_ok());
        assert_eq!(a.for_heartbeat().1.len(), 1, "the last reservation's claim waits for the next heartbeat");
    }

    #[test]
    fn a_refused_claim_is_given_back_at_once() {
        let (a, b, _nodes, _dir) = two_nodes_with(Quotas { max_sandboxes: Some(1), ..Default::default() });
        let held = a.reserve("acme", Kind::Running, 1, 0).unwrap();
        assert!(b.reserve("acme", Kind::Running, 1, 0).is_err());
        assert!(b.for_heartbeat().1.is_empty(), "nothing stored, nothing to settle");
        assert!(b.pending.lock().unwrap().is_empty(), "its local reservation is gone too");
        drop(held);
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
