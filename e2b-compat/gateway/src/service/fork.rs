//! Fork and clone: new sandboxes from a snapshot of a running one.
//!
//! What a fork or clone child shares with its source: files (as of the
//! fork), template, metadata and environment variables, and, for a fork
//! with memory (E2B's fork where the substrate can), the memory and running
//! processes. What is new: id, hostname (the id), access token, address,
//! cgroup, and lifetime (the fork request's timeout). See docs/lifecycle.md.

use copse_substrate::Policy;
use futures::future::join_all;

use super::Sandboxes;
use super::create::Network;
use super::quota::Kind;
use crate::fault;
use crate::model::{
    Caller, Change, Result, SandboxError, SandboxRecord, State, new_id, new_token, now_ms, snapshot_key,
    validate_timeout,
};

/// E2B's bounds for one fork request.
pub const MAX_FORKS: u32 = 20;
/// copse's own clone takes more at once (CubeSandbox clones 100 in its
/// report).
pub const MAX_CLONES: u32 = 1000;

impl Sandboxes {
    /// Whether a fork of `id` carries memory. An explicit `requested` the
    /// substrate cannot honour is an error, never a silent downgrade; with
    /// none, `default` applies where the substrate can (a substrate without
    /// memory snapshots forks files only, as docs/lifecycle.md says).
    pub fn fork_memory(&self, caller: &Caller, id: &str, requested: Option<bool>, default: bool) -> Result<bool> {
        let record = self.get(caller, id)?;
        self.memory_for(&record, requested, default, "forks with memory")
    }

    /// `count` new sandboxes with the source's files (and, with `memory`,
    /// its memory and processes) as of now; the source keeps running
    /// untouched (frozen only while the snapshot is taken). One result per
    /// child, in order.
    pub async fn fork(
        &self,
        caller: &Caller,
        id: &str,
        count: u32,
        max: u32,
        timeout_s: i64,
        memory: bool,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        let result = self.fork_now(caller, id, count, max, timeout_s, memory).await;
        self.observe_fork(id, memory, &result);
        result
    }

    async fn fork_now(
        &self,
        caller: &Caller,
        id: &str,
        count: u32,
        max: u32,
        timeout_s: i64,
        memory: bool,
    ) -> Result<Vec<Result<SandboxRecord>>> {
        if !(1..=max).contains(&count) {
            return Err(SandboxError::Invalid(format!("count must be between 1 and {max}, got {count}")));
        }
        let timeout = validate_timeout(timeout_s)?;
        let source = self.get(caller, id)?;
        if source.has_no_processes() {
            return Err(SandboxError::Conflict(format!("sandbox {id} is paused without memory; resume it first")));
        }
        // Every child counts: a fork that does not fit is refused whole,
        // before anything is snapshotted or booted.
        self.quota.check_timeout(caller, &source.team, timeout)?;
        let disk = source.limits.disk_mb << 20;
        let _places = self.quota.reserve_for(caller, &source.team, Kind::Running, count.into(), disk)?;
        let key = snapshot_key();
        let _intent = self.journal(id, Change::Fork { key: key.clone() })?;
        let memory = self.take_snapshot(&source, &key, memory).await?.memory;
        fault::point("fork:after-snapshot");
        let children = join_all((0..count).map(|_| self.child_of(&source, &key, timeout, memory))).await;
        fault::point("fork:after-children");
        // Each child pinned the snapshot's layers at boot; the snapshot
        // itself was only the way to get there.
        self.blocking(move |s| s.delete_snapshot(&key)).await?;
        Ok(children)
    }

    async fn child_of(&self, source: &SandboxRecord, key: &str, timeout_s: i64, memory: bool) -> Result<SandboxRecord> {
        // A child gets its own address, under its source's policy from its
        // first packet.
        let policy = source.network.as_ref().map(|n| n.policy.clone()).unwrap_or_else(Policy::open);
        let booted = self
            .boot_from(
                new_id(),
                &source.template,
                Some(key.to_string()),
                Network::New(policy),
                memory,
                &source.volume_mounts,
            )
            .await?;
        let now = now_ms();
        let record = SandboxRecord {
            id: booted.id,
            access_token: new_token(),
            // A child is as private as its source, under its own token.
            traffic_access_token: source.traffic_access_token.as_ref().map(|_| new_token()),
            started_at_ms: now,
            end_at_ms: now + timeout_s * 1000,
            state: State::Running,
            paused: None,
            placement: booted.placement,
            agent_socket: booted.agent_socket,
            network: booted.network,
            ..source.clone()
        };
        let agent_token = memory.then_some(source.access_token.as_str());
        if let Err(e) = self.hand_over(&record, agent_token).await {
            self.discard(&record.id).await;
            return Err(e.into());
        }
        Ok(record)
    }
}
