//! A sandbox's resource use now, with its CPU use as a percentage since the
//! last reading (E2B's metrics).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Sandboxes;
use crate::model::{Caller, Result, now_ms};

#[derive(Debug, Clone, Copy)]
pub struct Metric {
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

impl Sandboxes {
    /// Resource use now; `None` for a sandbox paused without memory, which
    /// has nothing running to measure.
    pub async fn metrics(&self, caller: &Caller, id: &str) -> Result<Option<Metric>> {
        let record = self.get(caller, id)?;
        if record.has_no_processes() {
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
        Ok(Some(Metric {
            cpu_count: record.limits.cpu_count,
            cpu_used_pct: (cpu_pct * 100.0).round() / 100.0,
            mem_used: usage.memory_bytes,
            mem_total: record.limits.memory_mb * 1024 * 1024,
            mem_cache: usage.memory_cache_bytes,
            disk_used: usage.disk_bytes,
            disk_total: record.limits.disk_mb * 1024 * 1024,
        }))
    }
}
