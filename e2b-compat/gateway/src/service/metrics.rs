//! A sandbox's resource use (E2B's metrics): a sample now, with its CPU use
//! as a percentage since the reading before, and a bounded ring of samples
//! per sandbox (taken by the reaper every few seconds and on each read) so
//! `get_metrics(start, end)` returns a series, as on E2B.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{ListFilter, Sandboxes};
use crate::model::{Caller, Result, SandboxError, now_ms};

/// Samples kept per sandbox: an hour at the reaper's pace (one per 5 s).
pub const HISTORY: usize = 720;
/// A read takes a new sample unless the newest is younger than this.
const FRESH: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Metric {
    /// When it was taken, in Unix milliseconds.
    pub at_ms: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// The last (time, CPU ns) reading per sandbox.
#[derive(Default)]
pub(super) struct CpuSamples(Mutex<HashMap<String, (Instant, u64)>>);

impl CpuSamples {
    /// Records a reading; returns the one before it.
    fn record(&self, id: &str, at: Instant, cpu_ns: u64) -> Option<(Instant, u64)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_string(), (at, cpu_ns))
    }

    pub(super) fn forget(&self, id: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }
}

/// The newest [`HISTORY`] samples of each sandbox, oldest first.
#[derive(Default)]
pub(super) struct History(Mutex<HashMap<String, VecDeque<Metric>>>);

impl History {
    fn push(&self, id: &str, metric: Metric) {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let ring = all.entry(id.to_string()).or_default();
        if ring.len() == HISTORY {
            ring.pop_front();
        }
        ring.push_back(metric);
    }

    fn newest(&self, id: &str) -> Option<Metric> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(id).and_then(|r| r.back().copied())
    }

    /// Samples taken from `start_ms` to `end_ms`, both included.
    fn between(&self, id: &str, start_ms: i64, end_ms: i64) -> Vec<Metric> {
        let all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let Some(ring) = all.get(id) else { return Vec::new() };
        ring.iter().filter(|m| (start_ms..=end_ms).contains(&m.at_ms)).copied().collect()
    }

    pub(super) fn forget(&self, id: &str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }
}

impl Sandboxes {
    /// Resource use now (also kept in the sandbox's history); `None` for a
    /// sandbox paused without memory, which has nothing running to measure.
    pub async fn metrics(&self, caller: &Caller, id: &str) -> Result<Option<Metric>> {
        let record = self.get(caller, id)?;
        // Another node's sandbox is sampled on its own host (a list of many
        // is not gathered across nodes: each gateway answers for its own).
        if record.has_no_processes() || !self.holds(record.node.as_deref()) {
            return Ok(None);
        }
        let owned = id.to_string();
        let usage = self.blocking(move |s| s.usage(&owned)).await?;
        let now = Instant::now();
        let previous = self.cpu_samples.record(id, now, usage.cpu_ns);
        let (cpu_before, wall) = match previous {
            Some((at, cpu)) => (cpu, now.duration_since(at)),
            None => (0, Duration::from_millis((now_ms() - record.started_at_ms).max(1) as u64)),
        };
        let cores = f64::from(record.limits.cpu_count.max(1));
        let cpu_pct = (usage.cpu_ns.saturating_sub(cpu_before) as f64 / wall.as_nanos().max(1) as f64) * 100.0 / cores;
        let metric = Metric {
            at_ms: now_ms(),
            cpu_count: record.limits.cpu_count,
            cpu_used_pct: (cpu_pct * 100.0).round() / 100.0,
            mem_used: usage.memory_bytes,
            mem_total: record.limits.memory_mb * 1024 * 1024,
            mem_cache: usage.memory_cache_bytes,
            disk_used: usage.disk_bytes,
            disk_total: record.limits.disk_mb * 1024 * 1024,
        };
        self.metric_history.push(id, metric);
        Ok(Some(metric))
    }

    /// The sandbox's samples from `start_s` (default: its start) to `end_s`
    /// (default: now), Unix seconds, oldest first; the newest is at most
    /// [`FRESH`] old when the range reaches now.
    pub async fn metrics_between(
        &self,
        caller: &Caller,
        id: &str,
        start_s: Option<i64>,
        end_s: Option<i64>,
    ) -> Result<Vec<Metric>> {
        if let (Some(start), Some(end)) = (start_s, end_s)
            && start > end
        {
            return Err(SandboxError::Invalid(format!("start ({start}) is after end ({end})")));
        }
        let record = self.get(caller, id)?;
        let start_ms = start_s.map_or(record.started_at_ms - 1000, |s| s.saturating_mul(1000));
        let end_ms = end_s.map_or(i64::MAX, |s| s.saturating_mul(1000).saturating_add(999));
        if end_ms >= now_ms() - FRESH.as_millis() as i64 && self.stale(id) {
            self.metrics(caller, id).await?;
        }
        Ok(self.metric_history.between(id, start_ms, end_ms))
    }

    /// The newest sample of each of `ids` that exists and runs (taken now if
    /// it has none fresh); others are left out, as E2B does.
    pub async fn latest_metrics(&self, caller: &Caller, ids: &[String]) -> Result<Vec<(String, Metric)>> {
        let mut found = Vec::new();
        for id in ids {
            if self.stale(id) {
                match self.metrics(caller, id).await {
                    Ok(_) | Err(SandboxError::NotFound(_)) => {}
                    Err(e) => tracing::warn!(sandbox_id = %id, "sampling metrics: {e:#}"),
                }
            }
            if self.store.get(id)?.is_some_and(|r| caller.sees(&r.team))
                && let Some(metric) = self.metric_history.newest(id)
            {
                found.push((id.clone(), metric));
            }
        }
        Ok(found)
    }

    /// Samples every sandbox with processes (the reaper's tick).
    pub async fn sample_metrics(&self) -> anyhow::Result<()> {
        let operator = Caller::operator();
        for record in self.list(&operator, &ListFilter::default())? {
            if record.has_no_processes() {
                continue;
            }
            match self.metrics(&operator, &record.id).await {
                Ok(_) | Err(SandboxError::NotFound(_)) => {}
                Err(e) => tracing::debug!(sandbox_id = %record.id, "sampling metrics: {e:#}"),
            }
        }
        Ok(())
    }

    fn stale(&self, id: &str) -> bool {
        self.metric_history.newest(id).is_none_or(|m| now_ms() - m.at_ms >= FRESH.as_millis() as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(at_ms: i64) -> Metric {
        Metric {
            at_ms,
            cpu_count: 1,
            cpu_used_pct: 0.0,
            mem_used: 0,
            mem_total: 0,
            mem_cache: 0,
            disk_used: 0,
            disk_total: 0,
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_samples_and_answers_ranges() {
        let history = History::default();
        for i in 0..(HISTORY as i64 + 10) {
            history.push("a", at(i * 1000));
        }
        let all = history.between("a", 0, i64::MAX);
        assert_eq!(all.len(), HISTORY);
        assert_eq!(all[0].at_ms, 10_000, "the oldest ten were dropped");
        let some: Vec<i64> = history.between("a", 20_000, 22_000).iter().map(|m| m.at_ms).collect();
        assert_eq!(some, [20_000, 21_000, 22_000]);
        assert_eq!(history.newest("a").map(|m| m.at_ms), Some((HISTORY as i64 + 9) * 1000));
        history.forget("a");
        assert!(history.between("a", 0, i64::MAX).is_empty());
    }
}
