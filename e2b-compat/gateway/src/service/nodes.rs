//! The service as one node of a shared database (`model::node`): which
//! records are this host's to act on, where a new sandbox should run, and
//! the heartbeat that tells the other gateways what this host holds.
//!
//! A gateway acts on the host only for its own node's records: recovery,
//! the reaper, the journal and shutdown never touch another node's. Calls
//! for another node's sandbox are forwarded to it by `api::forward`.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use copse_substrate::TemplateInfo;

use super::Sandboxes;
use crate::model::{
    Caller, NodeRecord, NodeStatus, NodeStore, RecentPlacements, Result, SandboxError, SandboxRecord, now_ms, place,
};

/// Files a create starts from (a snapshot's, a built template's image):
/// the node holding them, whether it has stored them in the object store,
/// and the template they sit on, and whether that template is stored
/// with them (an OCI image's, `service/image_objects.rs`), so any node
/// can start them.
struct Held<'a> {
    node: Option<&'a str>,
    stored: bool,
    base: &'a str,
    base_stored: bool,
}

/// How long one read of the node table serves placement and forwarding. A
/// node's row moves only at its heartbeat, every two seconds; a drain is
/// seen this much later at most.
const NODE_TABLE_TTL: Duration = Duration::from_millis(500);

/// This gateway's seat in a shared database.
#[derive(Clone)]
pub struct Membership {
    pub id: String,
    /// Where other gateways reach this one.
    pub api_url: String,
    pub nodes: Arc<dyn NodeStore>,
    pub started_at_ms: i64,
    /// The last read of every node's row: forwarding needs the owner's
    /// address on every call, and a database round trip for it would be a
    /// fixed cost on each.
    table: Arc<Mutex<Option<TableRead>>>,
    /// Creates this gateway placed that the nodes' heartbeats may not
    /// count yet.
    recent: Arc<Mutex<RecentPlacements>>,
    /// The cluster's object store, through which a snapshot moves to the
    /// node that starts it (`objects.rs`).
    pub objects: Option<Arc<copse_objects::Bucket>>,
    /// Rung when this node takes a snapshot, so its upload starts at once
    /// rather than at the next round.
    pub snapshot_taken: Arc<tokio::sync::Notify>,
    /// Snapshots with their layers stored as images start on those,
    /// mounted as they arrive (`lazy_layers.rs`).
    pub lazy_fetch: bool,
    /// The other nodes' sandboxes' tokens, for signed links
    /// (`other_links.rs`).
    pub(super) other_tokens: Arc<super::other_links::OtherTokens>,
}

/// When the node table was read, and what it held.
type TableRead = (Instant, Arc<Vec<NodeRecord>>);

impl Membership {
    pub fn new(id: String, api_url: String, nodes: Arc<dyn NodeStore>) -> Self {
        Self {
            id,
            api_url,
            nodes,
            started_at_ms: now_ms(),
            table: Arc::default(),
            recent: Arc::default(),
            objects: None,
            snapshot_taken: Arc::default(),
            lazy_fetch: true,
            other_tokens: Arc::default(),
        }
    }

    pub fn with_objects(mut self, bucket: Option<copse_objects::Bucket>, lazy_fetch: bool) -> Self {
        self.objects = bucket.map(Arc::new);
        self.lazy_fetch = lazy_fetch;
        self
    }

    /// Every node's row, read at most [`NODE_TABLE_TTL`] ago.
    fn node_table(&self) -> anyhow::Result<Arc<Vec<NodeRecord>>> {
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((read_at, rows)) = table.as_ref()
            && read_at.elapsed() < NODE_TABLE_TTL
        {
            return Ok(rows.clone());
        }
        let rows = Arc::new(self.nodes.nodes()?);
        *table = Some((Instant::now(), rows.clone()));
        Ok(rows)
    }

    /// `id`'s row; a node missing from the last read is looked up (it
    /// may have registered since).
    pub(super) fn node_record(&self, id: &str) -> anyhow::Result<Option<NodeRecord>> {
        match self.node_table()?.iter().find(|n| n.id == id) {
            Some(record) => Ok(Some(record.clone())),
            None => self.nodes.node(id),
        }
    }
}

/// Which node a record's host is, as seen from this gateway.
#[derive(Debug)]
pub enum Owner {
    Here,
    /// Another node, heard from lately.
    There(NodeRecord),
    /// Another node that has stopped heartbeating (or was never
    /// registered): its sandboxes are reported lost, not re-created.
    Lost {
        node: String,
        last_heard_ms: Option<i64>,
    },
}

impl Sandboxes {
    /// Makes this gateway a node of a shared database.
    pub fn with_membership(mut self, membership: Option<Membership>) -> Self {
        if let Some(membership) = &membership {
            self.quota.share(membership.nodes.clone(), membership.id.clone());
        }
        self.node = membership;
        self
    }

    /// This gateway's node id, if it shares its database.
    pub fn node(&self) -> Option<&str> {
        self.node.as_ref().map(|m| m.id.as_str())
    }

    /// Whether a record naming `node` is held by this gateway's host:
    /// always on a single host; on a shared database, only this node's
    /// (and records from before nodes, which any node may adopt).
    pub fn holds(&self, node: Option<&str>) -> bool {
        match (self.node(), node) {
            (Some(own), Some(node)) => own == node,
            _ => true,
        }
    }

    /// The records of the sandboxes this gateway's host holds: what
    /// recovery, the reaper and shutdown act on.
    pub(super) fn own_records(&self) -> anyhow::Result<Vec<SandboxRecord>> {
        Ok(self.store.all()?.into_iter().filter(|r| self.holds(r.node.as_deref())).collect())
    }

    /// The node whose host holds what a record naming `node` describes.
    pub fn owner(&self, node: Option<&str>) -> anyhow::Result<Owner> {
        let (Some(membership), Some(node)) = (&self.node, node) else { return Ok(Owner::Here) };
        if node == membership.id {
            return Ok(Owner::Here);
        }
        Ok(match membership.node_record(node)? {
            Some(record) if record.status(now_ms()) != NodeStatus::Lost => Owner::There(record),
            record => Owner::Lost { node: node.to_string(), last_heard_ms: record.map(|r| r.heartbeat_at_ms) },
        })
    }

    /// The sandbox `id`'s node, whoever asks (the node it is forwarded to
    /// checks the caller); `Here` for an id no record has, which this
    /// gateway then answers as missing.
    pub fn owner_of_sandbox(&self, id: &str) -> anyhow::Result<Owner> {
        match self.store.get(id)? {
            Some(record) => self.owner(record.node.as_deref()),
            None => Ok(Owner::Here),
        }
    }

    /// Where a create of `template` by `caller` runs: the node holding the
    /// snapshot or built template it names (their files are there), else
    /// the node with the most room that has the template. With an object
    /// store, a snapshot or built template whose node takes no new
    /// sandboxes (draining, lost) is placed as its base template would be,
    /// and fetched there once its node has stored it. `Here` on a single
    /// host.
    pub fn place_create(&self, caller: &Caller, template: &str) -> Result<Owner> {
        let Some(membership) = &self.node else { return Ok(Owner::Here) };
        // No snapshot or build takes a shipped template's name: no lookup.
        let own_files = !crate::templates::is_shipped(template);
        if own_files && let Some(snapshot) = self.store.snapshot(&caller.team, template)? {
            let (node, stored) = (snapshot.node.as_deref(), snapshot.in_object_store);
            let files = Held { node, stored, base: &snapshot.template, base_stored: stored && snapshot.oci.is_some() };
            return self.place_held(membership, files, &format!("snapshot {template}"));
        }
        if own_files
            && let Some(built) = self.ready_template(&caller.team, template)?
            && let Some(image) = &built.image
        {
            let stored = self.template_labels(&built)?.stored_images.contains(&image.snapshot_key);
            let base_stored = stored && image.oci.is_some() && super::is_image_template(&image.substrate_template);
            let files = Held { node: built.node.as_deref(), stored, base: &image.substrate_template, base_stored };
            return self.place_held(membership, files, &format!("template {template}"));
        }
        match self.place_by_room(membership, Some(template))? {
            Some(owner) => Ok(owner),
            None if membership.node_table()?.iter().any(|n| n.id == membership.id && n.draining) => {
                Err(SandboxError::Unavailable(format!(
                    "no node can take a sandbox of {template}: this one is draining and no other active one has it"
                )))
            }
            None if !self.substrate.runs_sandboxes() => Err(self.nowhere_to_run(template)?),
            // This node answers: a template no node has is its error to give.
            None => Ok(Owner::Here),
        }
    }

    /// Why an API front has nowhere to send a create of `template`: no
    /// node that takes sandboxes has it, or none at all does.
    fn nowhere_to_run(&self, template: &str) -> anyhow::Result<SandboxError> {
        let known = self.cluster_templates()?;
        Ok(match known.iter().any(|t| t.name == template) {
            true => SandboxError::Unavailable(format!(
                "no node can take a sandbox of {template}: every node that has it is draining or lost"
            )),
            false => SandboxError::UnknownTemplate {
                name: template.to_string(),
                available: known.into_iter().map(|t| t.name).collect::<Vec<_>>().join(", "),
            },
        })
    }

    /// An API front's templates: those the nodes that are not lost hold
    /// (by name; their files and build times are the nodes').
    pub(super) fn cluster_templates(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        let Some(membership) = &self.node else { return Ok(Vec::new()) };
        let now = now_ms();
        let table = membership.node_table()?;
        let names: BTreeSet<&str> = table
            .iter()
            .filter(|n| n.status(now) != NodeStatus::Lost)
            .flat_map(|n| n.templates.iter().map(String::as_str))
            .collect();
        Ok(names
            .into_iter()
            .map(|name| TemplateInfo {
                name: name.to_string(),
                built_at: 0,
                size_bytes: 0,
                backend: Default::default(),
                recipe: String::new(),
            })
            .collect())
    }

    /// Refuses to make `what` on an API front: only a call its peer
    /// listener believed already forwarded gets that far.
    pub(super) fn refuse_on_a_front(&self, what: &str) -> Result<()> {
        match self.substrate.runs_sandboxes() {
            true => Ok(()),
            false => Err(SandboxError::Unavailable(copse_substrate::none::refusal(what))),
        }
    }

    /// Where an API front sends what it cannot hold (a template build, a
    /// volume): the active node with the most room, `what` naming it in
    /// the error. `Here` on a gateway that runs sandboxes itself.
    pub fn place_work(&self, what: &str) -> Result<Owner> {
        let Some(membership) = self.node.as_ref().filter(|_| !self.substrate.runs_sandboxes()) else {
            return Ok(Owner::Here);
        };
        self.place_by_room(membership, None)?
            .ok_or_else(|| SandboxError::Unavailable(format!("no active node can take {what}")))
    }

    /// Where files one node holds start: on that node while it takes
    /// sandboxes (or while there is no object store to move them through),
    /// else, once stored, on the node with the most room that has their
    /// base; `what` names them in the error.
    fn place_held(&self, membership: &Membership, files: Held<'_>, what: &str) -> Result<Owner> {
        let holder = self.owner(files.node)?;
        if membership.objects.is_none() || self.takes_sandboxes(&holder)? {
            return Ok(holder);
        }
        if !files.stored {
            return Err(SandboxError::Unavailable(format!(
                "{what} is on node {}, which takes no new sandboxes, and is not in the object store yet; try again shortly",
                files.node.unwrap_or("-")
            )));
        }
        let placed = match self.place_by_room(membership, Some(files.base))? {
            None if files.base_stored => self.place_by_room(membership, None)?,
            placed => placed,
        };
        Ok(placed.unwrap_or(holder))
    }

    /// The active node with the most room that has `template` (any that
    /// runs sandboxes, with none), if there is one, counting the creates
    /// this gateway sent since each node's heartbeat.
    pub(super) fn place_by_room(
        &self,
        membership: &Membership,
        template: Option<&str>,
    ) -> anyhow::Result<Option<Owner>> {
        let nodes = membership.node_table()?;
        let now = now_ms();
        let mut recent = membership.recent.lock().unwrap_or_else(|e| e.into_inner());
        let Some(chosen) = place(&nodes, template, now, &recent) else { return Ok(None) };
        recent.record(&chosen.id, now, &nodes);
        Ok(Some(match chosen.id == membership.id {
            true => Owner::Here,
            false => Owner::There(chosen.clone()),
        }))
    }

    /// Whether `owner` takes new sandboxes: heard from, not draining.
    pub fn takes_sandboxes(&self, owner: &Owner) -> anyhow::Result<bool> {
        let draining = |id: &str| -> anyhow::Result<bool> {
            let Some(membership) = &self.node else { return Ok(false) };
            Ok(membership.node_record(id)?.is_some_and(|n| n.draining))
        };
        Ok(match owner {
            Owner::Here => !draining(self.node().unwrap_or_default())?,
            Owner::There(node) => !node.draining,
            Owner::Lost { .. } => false,
        })
    }

    /// Writes this node's record as of now: what it has free and holds.
    /// At an API front's shutdown: removes its node row, since it holds
    /// nothing a restart would need to find (a node keeps its row, which
    /// names its sandboxes' home, until `copse node rm`).
    pub async fn leave_if_front(&self) {
        let Some(membership) = self.node.as_ref().filter(|_| !self.substrate.runs_sandboxes()) else { return };
        let (nodes, id) = (membership.nodes.clone(), membership.id.clone());
        match tokio::task::spawn_blocking(move || nodes.remove_node(&id)).await {
            Ok(Ok(_)) => tracing::info!(node = %membership.id, "left the cluster: this API front's row is removed"),
            Ok(Err(e)) => tracing::warn!("removing this API front's node row: {e:#}"),
            Err(e) => tracing::warn!("removing this API front's node row: {e}"),
        }
    }

    pub async fn heartbeat(&self) -> anyhow::Result<()> {
        let Some(membership) = &self.node else { return Ok(()) };
        let templates: Vec<String> =
            self.substrate_templates().await?.into_iter().filter(super::nameable).map(|t| t.name).collect();
        let running = self.own_records()?.iter().filter(|r| r.paused.is_none()).count();
        let memory = self.substrate.host_memory();
        let (teams, settled) = self.quota.for_heartbeat();
        let disk_free_mb = nix::sys::statvfs::statvfs(&self.run_dir)
            .map(|s| s.blocks_available().saturating_mul(s.fragment_size()) >> 20)
            .unwrap_or(0);
        let record = NodeRecord {
            id: membership.id.clone(),
            api_url: membership.api_url.clone(),
            substrate: self.substrate.name().to_string(),
            capacity: crate::model::Capacity {
                cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
                memory_mb: memory.map_or(0, |m| m.total_mb),
                memory_free_mb: memory.map_or(0, |m| m.available_mb),
                disk_free_mb,
                running: running as u32,
            },
            templates,
            started_at_ms: membership.started_at_ms,
            heartbeat_at_ms: now_ms(),
            // The stored flag is kept: a drain outlives restarts, and only
            // `copse node undrain` ends it.
            draining: false,
            moving_out: false,
            teams,
        };
        membership.nodes.beat(&record, &settled)?;
        self.quota.published(settled.len());
        Ok(())
    }
}

impl Owner {
    /// The error for a call about `what` that must run on a lost node.
    pub fn lost_error(what: &str, node: &str, last_heard_ms: Option<i64>) -> SandboxError {
        let heard = match last_heard_ms {
            Some(at) => format!("not heard from for {} s", (now_ms() - at) / 1000),
            None => "not registered".to_string(),
        };
        SandboxError::Unavailable(format!(
            "{what} is on node {node}, which is lost ({heard}); it is not re-created elsewhere"
        ))
    }
}
