//! What each team holds, in memory, kept in step with the store by
//! [`super::Indexed`]: quota checks on the create path count here, never by
//! reading the store.

use std::collections::{BTreeMap, HashMap};
use std::sync::RwLock;

use crate::model::{SandboxRecord, SnapshotRecord, State, TeamUsage};

struct Held {
    team: String,
    state: State,
    disk_bytes: u64,
    /// The substrate snapshot it is paused on, if any: this host's files
    /// of it, which a node lets go of once another takes it over.
    files: Option<String>,
}

#[derive(Default)]
pub struct Usage {
    sandboxes: RwLock<HashMap<String, Held>>,
    /// (team, id) → size.
    snapshots: RwLock<HashMap<(String, String), u64>>,
}

impl Usage {
    pub fn of(&self, team: &str) -> TeamUsage {
        self.tally(|t| t == team).remove(team).unwrap_or_default()
    }

    /// Every team's holdings, for the teams that hold anything.
    pub fn by_team(&self) -> BTreeMap<String, TeamUsage> {
        self.tally(|_| true)
    }

    /// The holdings of the teams `counted` picks.
    fn tally(&self, counted: impl Fn(&str) -> bool) -> BTreeMap<String, TeamUsage> {
        let mut teams: BTreeMap<String, TeamUsage> = BTreeMap::new();
        for held in read(&self.sandboxes).values().filter(|h| counted(&h.team)) {
            let usage = teams.entry(held.team.clone()).or_default();
            match held.state {
                State::Running => usage.running += 1,
                State::Paused => usage.paused += 1,
            }
            usage.disk_bytes += held.disk_bytes;
        }
        for ((team, _), size) in read(&self.snapshots).iter().filter(|((t, _), _)| counted(t)) {
            let usage = teams.entry(team.clone()).or_default();
            usage.snapshots += 1;
            usage.disk_bytes += size;
        }
        teams
    }

    pub(super) fn sandbox(&self, record: &SandboxRecord) {
        let held = Held {
            team: record.team.clone(),
            state: record.state,
            disk_bytes: record.limits.disk_mb << 20,
            files: record.paused.as_ref().and_then(|p| p.files_only.clone()),
        };
        write(&self.sandboxes).insert(record.id.clone(), held);
    }

    /// Every sandbox counted, with the files it is paused on.
    pub(super) fn sandboxes(&self) -> Vec<(String, Option<String>)> {
        read(&self.sandboxes).iter().map(|(id, held)| (id.clone(), held.files.clone())).collect()
    }

    pub(super) fn sandbox_gone(&self, id: &str) {
        write(&self.sandboxes).remove(id);
    }

    pub(super) fn snapshot(&self, record: &SnapshotRecord) {
        write(&self.snapshots).insert((record.team.clone(), record.id.clone()), record.size_bytes);
    }

    pub(super) fn snapshot_gone(&self, team: &str, id: &str) {
        write(&self.snapshots).remove(&(team.to_string(), id.to_string()));
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}
