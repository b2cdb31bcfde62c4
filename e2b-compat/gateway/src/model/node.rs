//! A node: one `copse up` on a shared database (`--database postgres://…`),
//! the host whose substrate runs the sandboxes placed on it. Every gateway
//! on a shared database is a node; a gateway on its own SQLite database is
//! none (everything in its database is its own).
//!
//! A node says it is alive by rewriting its record every
//! [`HEARTBEAT_MS`]; one silent for [`LOST_AFTER_MS`] is lost. Its
//! sandboxes are then reported as lost, never re-created elsewhere: their
//! processes and files may still be running on a host that only lost its
//! way to the database.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::team::TeamUsage;

pub const HEARTBEAT_MS: i64 = 2_000;
/// Five missed heartbeats: long enough for a busy host's stall, short
/// enough that a create is not sent to a dead node for long.
pub const LOST_AFTER_MS: i64 = 10_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub id: String,
    /// Where other gateways reach this node's API to forward it the calls
    /// for its sandboxes.
    pub api_url: String,
    /// The substrate's name (`linux-namespaces`, `freebsd-jails`, …).
    pub substrate: String,
    pub capacity: Capacity,
    /// Templates whose files this node holds, so a create of one starts
    /// here without a fetch.
    pub templates: Vec<String>,
    pub started_at_ms: i64,
    pub heartbeat_at_ms: i64,
    /// Set by `copse node drain`: no new sandbox is placed here.
    #[serde(default)]
    pub draining: bool,
    /// Set with `draining` by `copse node drain --move-sandboxes`: the node
    /// also pauses its sandboxes to the object store, where they resume on
    /// whichever node takes them (`service/relocate.rs`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub moving_out: bool,
    /// What each team holds here, as of the heartbeat: the other nodes
    /// add it to their own counts when they check a team's limits.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub teams: BTreeMap<String, TeamUsage>,
}

/// What a node has and what of it is free, as of its last heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub cpus: u32,
    pub memory_mb: u64,
    pub memory_free_mb: u64,
    pub disk_free_mb: u64,
    /// Sandboxes running here (paused ones hold no processes).
    pub running: u32,
}

/// What a verb in flight on one node holds for a team (a create's place
/// and disk, a snapshot's place): it counts against the team's limits on
/// every node from the moment it is admitted until its node's heartbeat
/// publishes figures (`NodeRecord::teams`) that include what it stored.
/// Without it, creates sent to two nodes within a heartbeat could each
/// take the team's last place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceClaim {
    pub id: String,
    pub node: String,
    pub team: String,
    pub usage: TeamUsage,
    pub at_ms: i64,
}

/// Decides a claim from what the team holds on the other nodes (their
/// published figures and their open claims): `Err` refuses it.
pub type Admit = Box<dyn FnOnce(TeamUsage) -> super::Result<()> + Send>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeStatus {
    Active,
    Draining,
    Lost,
}

impl NodeStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeStatus::Active => "active",
            NodeStatus::Draining => "draining",
            NodeStatus::Lost => "lost",
        }
    }
}

impl NodeRecord {
    pub fn status(&self, now_ms: i64) -> NodeStatus {
        if now_ms - self.heartbeat_at_ms > LOST_AFTER_MS {
            NodeStatus::Lost
        } else if self.draining {
            NodeStatus::Draining
        } else {
            NodeStatus::Active
        }
    }

    /// How much new work would like this node: its free memory shared
    /// among the sandboxes it runs, the `pending` ones sent to it since,
    /// and the new one. `None` for a node that is not active, runs no
    /// sandboxes (an API front), or lacks the template's files (they are
    /// not fetched from another node) when the work is a sandbox of one.
    pub fn placement_score(&self, template: Option<&str>, now_ms: i64, pending: u32) -> Option<u64> {
        let has = |template: &str| self.templates.iter().any(|t| t == template);
        if self.status(now_ms) != NodeStatus::Active || !self.runs_sandboxes() || !template.is_none_or(has) {
            return None;
        }
        Some(self.capacity.memory_free_mb / (u64::from(self.capacity.running) + u64::from(pending) + 1))
    }

    /// Whether the node runs sandboxes: every node but an API front
    /// (`copse up --no-sandboxes`).
    pub fn runs_sandboxes(&self) -> bool {
        self.substrate != copse_substrate::none::NAME
    }
}

/// The node that should take a new sandbox of `template` (or, with none,
/// a build or a volume): the best score, ties to the lowest id so every
/// gateway picks the same one.
pub fn place<'a>(
    nodes: &'a [NodeRecord],
    template: Option<&str>,
    now_ms: i64,
    recent: &RecentPlacements,
) -> Option<&'a NodeRecord> {
    nodes
        .iter()
        .filter_map(|n| Some((n.placement_score(template, now_ms, recent.pending(n))?, n)))
        .max_by(|(a, na), (b, nb)| a.cmp(b).then_with(|| nb.id.cmp(&na.id)))
        .map(|(_, n)| n)
}

/// The creates one gateway placed on each node lately. A node's count of
/// running sandboxes moves only at its heartbeat, so without these a burst
/// of creates between two heartbeats would all go where the last one
/// showed the most room. Only this gateway's own creates are known here:
/// a burst split over several gateways still lands unevenly.
#[derive(Debug, Default)]
pub struct RecentPlacements {
    at_ms: HashMap<String, Vec<i64>>,
}

impl RecentPlacements {
    /// A create counts until a heartbeat of its node a whole interval
    /// later: by then the node has its record (or the create has failed),
    /// so the count it reports includes it.
    pub fn pending(&self, node: &NodeRecord) -> u32 {
        let unseen = |at: &&i64| **at + HEARTBEAT_MS > node.heartbeat_at_ms;
        self.at_ms.get(&node.id).map_or(0, |times| times.iter().filter(unseen).count() as u32)
    }

    /// Notes a create placed on `node`, and forgets the ones every node's
    /// heartbeat now counts.
    pub fn record(&mut self, node: &str, now_ms: i64, nodes: &[NodeRecord]) {
        for n in nodes {
            if let Some(times) = self.at_ms.get_mut(&n.id) {
                times.retain(|at| at + HEARTBEAT_MS > n.heartbeat_at_ms);
            }
        }
        self.at_ms.retain(|id, times| !times.is_empty() && nodes.iter().any(|n| &n.id == id));
        self.at_ms.entry(node.to_string()).or_default().push(now_ms);
    }
}

/// Node ids are what `new_id` makes: 20 lowercase letters and digits. A
/// `node-id` file edited by hand is checked before it names records.
pub fn validate_node_id(id: &str) -> Result<(), String> {
    if id.len() == 20 && id.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) {
        Ok(())
    } else {
        Err(format!("node id {id:?} is not 20 lowercase letters and digits"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, free: u64, running: u32, heartbeat: i64) -> NodeRecord {
        NodeRecord {
            id: id.into(),
            api_url: format!("http://{id}"),
            substrate: "linux-namespaces".into(),
            capacity: Capacity { cpus: 2, memory_mb: 8192, memory_free_mb: free, disk_free_mb: 1000, running },
            templates: vec!["base".into()],
            started_at_ms: 0,
            heartbeat_at_ms: heartbeat,
            draining: false,
            moving_out: false,
            teams: Default::default(),
        }
    }

    #[test]
    fn a_silent_node_is_lost_and_a_draining_one_takes_nothing() {
        let mut n = node("a", 4096, 0, 1_000);
        assert_eq!(n.status(1_000 + LOST_AFTER_MS), NodeStatus::Active);
        assert_eq!(n.status(1_001 + LOST_AFTER_MS), NodeStatus::Lost);
        n.draining = true;
        assert_eq!(n.status(2_000), NodeStatus::Draining);
        assert_eq!(n.placement_score(Some("base"), 2_000, 0), None);
    }

    #[test]
    fn placement_shares_free_memory_among_sandboxes_and_needs_the_template() {
        let now = 5_000;
        let place = |nodes, template, now| place(nodes, template, now, &RecentPlacements::default());
        let nodes = vec![node("a", 2048, 0, now), node("b", 6144, 0, now), node("c", 6144, 4, now)];
        assert_eq!(place(&nodes, Some("base"), now).map(|n| n.id.as_str()), Some("b"));
        // One host seen by two nodes: the one running fewer wins.
        let same = vec![node("x", 4096, 1, now), node("y", 4100, 0, now)];
        assert_eq!(place(&same, Some("base"), now).map(|n| n.id.as_str()), Some("y"));
        // Equal: the lowest id, whichever gateway asks.
        let equal = vec![node("y", 4096, 1, now), node("x", 4096, 1, now)];
        assert_eq!(place(&equal, Some("base"), now).map(|n| n.id.as_str()), Some("x"));
        // A node without the template's files takes none of it.
        assert!(place(&nodes, Some("custom"), now).is_none());
        // Nobody alive: nowhere.
        assert!(place(&nodes, Some("base"), now + LOST_AFTER_MS + 1).is_none());
    }

    #[test]
    fn an_api_front_takes_no_work_and_a_build_goes_where_there_is_room() {
        let now = 5_000;
        let mut front = node("a", 16384, 0, now);
        front.substrate = copse_substrate::none::NAME.into();
        front.templates.clear();
        let nodes = vec![front, node("b", 2048, 0, now), node("c", 4096, 0, now)];
        let recent = RecentPlacements::default();
        assert_eq!(place(&nodes, None, now, &recent).map(|n| n.id.as_str()), Some("c"));
        assert!(place(&nodes[..1], None, now, &recent).is_none());
        assert_eq!(place(&nodes, Some("base"), now, &recent).map(|n| n.id.as_str()), Some("c"));
    }

    #[test]
    fn a_burst_between_heartbeats_spreads_over_the_nodes() {
        let now = 10_000;
        let mut nodes = vec![node("a", 4096, 0, now), node("b", 4096, 0, now), node("c", 2048, 0, now)];
        let mut recent = RecentPlacements::default();
        let mut placed = Vec::new();
        for i in 0..10 {
            let chosen = place(&nodes, Some("base"), now + i, &recent).unwrap().id.clone();
            recent.record(&chosen, now + i, &nodes);
            placed.push(chosen);
        }
        // By room: c has half of a's and b's, so it takes half as many.
        assert_eq!(placed.iter().filter(|id| *id == "a").count(), 4, "{placed:?}");
        assert_eq!(placed.iter().filter(|id| *id == "b").count(), 4, "{placed:?}");
        assert_eq!(placed.iter().filter(|id| *id == "c").count(), 2, "{placed:?}");
        // A heartbeat taken right after still may not count them all; one
        // a whole interval later does, and then they no longer add up.
        nodes[0].heartbeat_at_ms = now + 100;
        assert_eq!(recent.pending(&nodes[0]), 4);
        nodes[0].heartbeat_at_ms = now + 10 + HEARTBEAT_MS;
        nodes[0].capacity.running = 4;
        assert_eq!(recent.pending(&nodes[0]), 0);
        recent.record("b", now + 20 + HEARTBEAT_MS, &nodes);
        assert!(!recent.at_ms.contains_key("a"), "settled placements are forgotten");
    }

    #[test]
    fn node_ids_are_checked_before_they_name_records() {
        assert!(validate_node_id("abcdefghij0123456789").is_ok());
        assert!(validate_node_id("../../etc/passwd").is_err());
        assert!(validate_node_id("ABCDEFGHIJ0123456789").is_err());
        assert!(validate_node_id("").is_err());
    }
}
