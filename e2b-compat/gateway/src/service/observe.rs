//! What the service tells about the sandboxes it runs: one line per
//! lifecycle event in the sandbox's own log (`crate::sandbox_log`, read
//! back through E2B's logs routes) and in the gateway's log, and the
//! operator's counters (`crate::telemetry`). The verbs call these in one
//! line each, so what is counted and what is logged cannot drift apart.

use std::time::Duration;

use super::Sandboxes;
use crate::model::{Caller, DEFAULT_TEAM, Result, SandboxError, SandboxRecord, now_ms};
use crate::sandbox_log::{self, Entry, Level};
use crate::telemetry::{self, CreateLabels, KillLabels, KillReason, Kind, KindLabels, Outcome, OutcomeLabels, Source};

impl Sandboxes {
    /// One entry in sandbox `id`'s log, and the same line in the gateway's.
    pub(super) fn note(&self, id: &str, level: Level, message: &str, fields: &[(&str, String)]) {
        self.sandbox_log.append(id, level, message, fields);
        let details = fields.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ");
        match level {
            Level::Error => tracing::error!(sandbox_id = id, details, "{message}"),
            Level::Warn => tracing::warn!(sandbox_id = id, details, "{message}"),
            Level::Info => tracing::info!(sandbox_id = id, details, "{message}"),
            Level::Debug => tracing::debug!(sandbox_id = id, details, "{message}"),
        }
    }

    pub(super) fn observe_create(
        &self,
        origin: &super::create::Origin,
        result: &Result<(SandboxRecord, super::Timings)>,
        took: Duration,
    ) {
        let m = telemetry::metrics();
        let (source, outcome) = (origin.source, Outcome::of(result));
        let template = origin.template.as_deref().unwrap_or("unknown");
        m.creates.get_or_create(&CreateLabels { template: template.to_string(), source, outcome }).inc();
        match result {
            Ok((record, timings)) => {
                m.create_seconds
                    .get_or_create(&telemetry::TemplateLabels { template: record.template.clone() })
                    .observe(took.as_secs_f64());
                let from = match source {
                    Source::Boot => "booted",
                    Source::Pool => "from the warm pool",
                    Source::Snapshot => "from a snapshot",
                };
                self.note(
                    &record.id,
                    Level::Info,
                    &format!("sandbox created ({from})"),
                    &[
                        ("template", template.to_string()),
                        ("boot_ms", timings.boot.as_millis().to_string()),
                        ("total_ms", took.as_millis().to_string()),
                    ],
                );
            }
            Err(e) => tracing::warn!(template, "create failed: {e:#}"),
        }
    }

    /// `team`: the ended sandbox's owner, kept in its log so that only that
    /// team reads the log once the record is gone.
    pub(super) fn observe_kill(&self, id: &str, team: Option<&str>, reason: KillReason, result: &Result<()>) {
        let outcome = Outcome::of(result);
        telemetry::metrics().kills.get_or_create(&KillLabels { reason, outcome }).inc();
        let why = match reason {
            KillReason::Request => "killed",
            KillReason::Timeout => "ended: its timeout passed",
            KillReason::Died => "ended: its init died on its own",
            KillReason::Retention => "deleted: paused longer than its team's paused retention",
        };
        match result {
            Ok(()) => {
                telemetry::metrics().forget(id);
                let fields: Vec<(&str, String)> = team.map(|t| ("team", t.to_string())).into_iter().collect();
                self.note(id, Level::Info, &format!("sandbox {why}"), &fields);
            }
            Err(SandboxError::NotFound(_)) => {}
            Err(e) => self.note(id, Level::Error, "ending the sandbox failed", &[("error", format!("{e:#}"))]),
        }
    }

    pub(super) fn observe_pause(&self, id: &str, memory: bool, result: &Result<()>) {
        let kind = Kind::memory(memory);
        telemetry::metrics().pauses.get_or_create(&KindLabels { kind, outcome: Outcome::of(result) }).inc();
        let how = if memory { "memory kept" } else { "files only" };
        match result {
            Ok(()) => self.note(id, Level::Info, &format!("sandbox paused ({how})"), &[]),
            Err(SandboxError::NotFound(_)) => {}
            Err(e) => self.note(id, Level::Warn, "pause failed", &[("error", format!("{e:#}"))]),
        }
    }

    pub(super) fn observe_resume<T>(&self, id: &str, result: &Result<T>) {
        telemetry::metrics().resumes.get_or_create(&OutcomeLabels { outcome: Outcome::of(result) }).inc();
        match result {
            Ok(_) => self.note(id, Level::Info, "sandbox resumed", &[]),
            Err(e) => self.note(id, Level::Warn, "resume failed", &[("error", format!("{e:#}"))]),
        }
    }

    pub(super) fn observe_snapshot(&self, id: &str, memory: bool, result: &Result<crate::model::SnapshotRecord>) {
        let kind = Kind::memory(result.as_ref().map_or(memory, |s| s.memory));
        telemetry::metrics().snapshots.get_or_create(&KindLabels { kind, outcome: Outcome::of(result) }).inc();
        match result {
            Ok(s) => self.note(id, Level::Info, "snapshot taken", &[("snapshot", s.id.clone())]),
            Err(SandboxError::NotFound(_)) => {}
            Err(e) => self.note(id, Level::Warn, "snapshot failed", &[("error", format!("{e:#}"))]),
        }
    }

    pub(super) fn observe_fork(&self, id: &str, memory: bool, result: &Result<Vec<Result<SandboxRecord>>>) {
        let kind = Kind::memory(memory);
        telemetry::metrics().forks.get_or_create(&KindLabels { kind, outcome: Outcome::of(result) }).inc();
        if let Ok(children) = result {
            let ids: Vec<&str> = children.iter().flatten().map(|c| c.id.as_str()).collect();
            self.note(id, Level::Info, "sandbox forked", &[("children", ids.join(","))]);
            for child in children.iter().flatten() {
                self.note(&child.id, Level::Info, "sandbox created (forked)", &[("source", id.to_string())]);
            }
        }
    }

    /// A memory checkpoint (CRIU dump) or restore, and how long it took.
    pub(super) fn observe_checkpoint(&self, restore: bool, ok: bool, took: Duration) {
        let m = telemetry::metrics();
        let family = if restore { &m.checkpoint_restore_seconds } else { &m.checkpoint_dump_seconds };
        let outcome = if ok { Outcome::Ok } else { Outcome::Error };
        family.get_or_create(&OutcomeLabels { outcome }).observe(took.as_secs_f64());
    }

    pub(super) fn observe_network(&self, attach: bool, ok: bool) {
        let m = telemetry::metrics();
        let family = if attach { &m.network_attaches } else { &m.network_detaches };
        family.get_or_create(&OutcomeLabels { outcome: if ok { Outcome::Ok } else { Outcome::Error } }).inc();
    }

    /// A call the data plane forwarded to the sandbox's agent, as its log
    /// shows it; the first command started also gives first-exec latency.
    pub fn note_traffic(&self, record: &SandboxRecord, what: &str, fields: &[(&str, String)], status: u16) {
        if what == "process started" && status < 300 {
            let since = Duration::from_millis((now_ms() - record.started_at_ms).max(0) as u64);
            telemetry::metrics().first_exec(&record.id, &record.template, since);
        }
        let level = if status < 400 { Level::Info } else { Level::Warn };
        let mut fields = fields.to_vec();
        fields.push(("status", status.to_string()));
        self.sandbox_log.append(&record.id, level, what, &fields);
    }

    /// A page of sandbox `id`'s log; a sandbox that ended keeps its log for
    /// a while (`sandbox_log::RETENTION`). Not found if it has neither a
    /// record nor a log.
    /// Only `caller`'s team reads it: while the sandbox lives its record
    /// says whose it is, after that the team its end was logged with.
    pub fn sandbox_logs(&self, caller: &Caller, id: &str, query: &sandbox_log::Query) -> Result<Vec<Entry>> {
        let live = self.store.get(id)?;
        if live.as_ref().is_some_and(|r| !caller.sees(&r.team)) {
            return Err(SandboxError::NotFound(id.to_string()));
        }
        match self.sandbox_log.read(id)? {
            Some(entries) => {
                let ended_team = entries.iter().rev().find_map(|e| e.fields.get("team")).map(String::as_str);
                if live.is_none() && !caller.sees(ended_team.unwrap_or(DEFAULT_TEAM)) {
                    return Err(SandboxError::NotFound(id.to_string()));
                }
                Ok(sandbox_log::page(entries, query))
            }
            None if live.is_some() => Ok(Vec::new()),
            None => Err(SandboxError::NotFound(id.to_string())),
        }
    }

    /// Deletes the logs of sandboxes that ended long enough ago.
    pub async fn sweep_logs(&self) -> anyhow::Result<()> {
        let live: std::collections::HashSet<String> = self.store.all()?.into_iter().map(|r| r.id).collect();
        self.sandbox_log.sweep(&|id| live.contains(id), sandbox_log::RETENTION);
        Ok(())
    }
}
