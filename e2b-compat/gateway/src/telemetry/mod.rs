//! What the gateway tells its operator: Prometheus metrics (served only on
//! the operator listener, `listener.rs`, never on the public one) and the
//! process's own log format (`logging.rs`).
//!
//! The families live in one process-wide [`Metrics`]: a counter is bumped
//! where the thing happens (the service's `observe.rs`, the data-plane
//! switch), without threading a handle through every verb. Values that are
//! a state rather than an event (sandboxes by state, pool sizes) are read
//! from the service when scraped (`refresh`).
//!
//! Per-team usage: every label set below that describes a sandbox is where
//! a `team` label goes once records carry a team; nothing else changes.

pub mod listener;
pub mod logging;

use std::collections::HashSet;
use std::sync::{LazyLock, Mutex};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Whether an operation did what it was asked.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Error,
}

/// Label values are the variants' names in lower case.
macro_rules! lowercase_label {
    ($($t:ty),*) => {$(
        impl EncodeLabelValue for $t {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                EncodeLabelValue::encode(&format!("{self:?}").to_ascii_lowercase().as_str(), encoder)
            }
        }
    )*};
}

lowercase_label!(Outcome, Source, KillReason, Kind);

impl Outcome {
    pub fn of<T, E>(result: &Result<T, E>) -> Self {
        if result.is_ok() { Outcome::Ok } else { Outcome::Error }
    }
}

/// Where a created sandbox came from.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Source {
    /// Booted for the caller.
    Boot,
    /// Handed over from a warm pool.
    Pool,
    /// Booted (or restored) from a snapshot.
    Snapshot,
}

/// Why a sandbox ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum KillReason {
    /// A caller asked (`DELETE /sandboxes/{id}`, shutdown).
    Request,
    /// Its lifetime ran out.
    Timeout,
    /// Its init died on its own.
    Died,
    /// It stayed paused longer than its team's paused retention.
    Retention,
}

/// Whether a pause, snapshot or fork kept memory.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Kind {
    Memory,
    Files,
}

impl Kind {
    pub fn memory(memory: bool) -> Self {
        if memory { Kind::Memory } else { Kind::Files }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CreateLabels {
    pub template: String,
    pub source: Source,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KillLabels {
    pub reason: KillReason,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: Kind,
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TemplateLabels {
    pub template: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub template: String,
    pub state: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn histograms<L: Clone + std::hash::Hash + Eq>() -> Histograms<L> {
    Histograms::new_with_constructor(latency_buckets as fn() -> Histogram)
}

/// Boots take from a few milliseconds (pool) to tens of seconds (a CRIU
/// restore of a large sandbox).
fn latency_buckets() -> Histogram {
    Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0])
}

pub struct Metrics {
    pub creates: Family<CreateLabels, Counter>,
    pub kills: Family<KillLabels, Counter>,
    pub pauses: Family<KindLabels, Counter>,
    pub resumes: Family<OutcomeLabels, Counter>,
    pub snapshots: Family<KindLabels, Counter>,
    pub forks: Family<KindLabels, Counter>,
    pub create_seconds: Histograms<TemplateLabels>,
    pub first_exec_seconds: Histograms<TemplateLabels>,
    pub pool_hits: Family<TemplateLabels, Counter>,
    pub pool_misses: Family<TemplateLabels, Counter>,
    pub pool_ready: Family<TemplateLabels, Gauge>,
    pub pool_target: Family<TemplateLabels, Gauge>,
    pub sandboxes: Family<StateLabels, Gauge>,
    pub network_attaches: Family<OutcomeLabels, Counter>,
    pub network_detaches: Family<OutcomeLabels, Counter>,
    pub checkpoint_dump_seconds: Histograms<OutcomeLabels>,
    pub checkpoint_restore_seconds: Histograms<OutcomeLabels>,
    pub reaper_queue: Gauge,
    /// Sandboxes that have run their first command (first-exec latency is
    /// observed once per sandbox).
    executed: Mutex<HashSet<String>>,
    registry: Registry,
}

impl Metrics {
    fn new() -> Self {
        let mut metrics = Self {
            creates: Default::default(),
            kills: Default::default(),
            pauses: Default::default(),
            resumes: Default::default(),
            snapshots: Default::default(),
            forks: Default::default(),
            create_seconds: histograms(),
            first_exec_seconds: histograms(),
            pool_hits: Default::default(),
            pool_misses: Default::default(),
            pool_ready: Default::default(),
            pool_target: Default::default(),
            sandboxes: Default::default(),
            network_attaches: Default::default(),
            network_detaches: Default::default(),
            checkpoint_dump_seconds: histograms(),
            checkpoint_restore_seconds: histograms(),
            reaper_queue: Default::default(),
            executed: Default::default(),
            registry: Registry::with_prefix("copse"),
        };
        let r = &mut metrics.registry;
        r.register("sandbox_creates", "Sandbox creates by template, source and outcome", metrics.creates.clone());
        r.register("sandbox_kills", "Sandboxes ended, by reason and outcome", metrics.kills.clone());
        r.register("sandbox_pauses", "Pauses by kind (memory or files) and outcome", metrics.pauses.clone());
        r.register("sandbox_resumes", "Resumes of paused sandboxes by outcome", metrics.resumes.clone());
        r.register("snapshots", "Snapshots taken by kind and outcome", metrics.snapshots.clone());
        r.register("sandbox_forks", "Fork and clone requests by kind and outcome", metrics.forks.clone());
        r.register(
            "sandbox_create_seconds",
            "Time to create a sandbox, request to hand-over",
            metrics.create_seconds.clone(),
        );
        r.register(
            "sandbox_first_exec_seconds",
            "Time from a sandbox's creation to its first command starting",
            metrics.first_exec_seconds.clone(),
        );
        r.register("pool_hits", "Creates served from a warm pool", metrics.pool_hits.clone());
        r.register("pool_misses", "Creates of a pooled template that had to boot", metrics.pool_misses.clone());
        r.register("pool_ready", "Booted sandboxes waiting in each warm pool", metrics.pool_ready.clone());
        r.register("pool_target", "The size each warm pool is kept at", metrics.pool_target.clone());
        r.register("sandboxes", "Sandboxes by template and state", metrics.sandboxes.clone());
        r.register("network_attaches", "Sandbox network attaches by outcome", metrics.network_attaches.clone());
        r.register("network_detaches", "Sandbox network detaches by outcome", metrics.network_detaches.clone());
        r.register(
            "checkpoint_dump_seconds",
            "Memory checkpoints (CRIU dump) of a sandbox",
            metrics.checkpoint_dump_seconds.clone(),
        );
        r.register(
            "checkpoint_restore_seconds",
            "Sandboxes restored from a memory checkpoint (CRIU restore)",
            metrics.checkpoint_restore_seconds.clone(),
        );
        r.register("reaper_queue", "Expired sandboxes the reaper found still to end", metrics.reaper_queue.clone());
        metrics
    }

    /// Observes the first command of sandbox `id`; later ones are ignored.
    pub fn first_exec(&self, id: &str, template: &str, since_create: Duration) {
        if self.executed.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_string()) {
            self.first_exec_seconds
                .get_or_create(&TemplateLabels { template: template.to_string() })
                .observe(since_create.as_secs_f64());
        }
    }

    /// Forgets an ended sandbox.
    pub fn forget(&self, id: &str) {
        self.executed.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }

    /// The OpenMetrics text of every family.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// The gateway's metrics.
pub fn metrics() -> &'static Metrics {
    &METRICS
}

/// The content type of [`Metrics::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_encode_with_the_copse_prefix_and_their_labels() {
        let m = Metrics::new();
        let labels = CreateLabels { template: "base".into(), source: Source::Pool, outcome: Outcome::Ok };
        m.creates.get_or_create(&labels).inc();
        m.create_seconds.get_or_create(&TemplateLabels { template: "base".into() }).observe(0.02);
        let text = m.encode();
        assert!(
            text.contains(r#"copse_sandbox_creates_total{template="base",source="pool",outcome="ok"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"copse_sandbox_create_seconds_bucket{le="0.025",template="base"} 1"#), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn first_exec_is_observed_once_per_sandbox() {
        let m = Metrics::new();
        let count = |m: &Metrics| {
            let text = m.encode();
            let line = text.lines().find(|l| l.starts_with("copse_sandbox_first_exec_seconds_count")).unwrap_or("");
            line.rsplit(' ').next().unwrap_or("").to_string()
        };
        m.first_exec("a", "base", Duration::from_millis(30));
        m.first_exec("a", "base", Duration::from_millis(90));
        assert_eq!(count(&m), "1");
        m.forget("a");
        m.first_exec("a", "base", Duration::from_millis(30));
        assert_eq!(count(&m), "2");
    }
}
