//! The reaper: a background task that ends expired sandboxes every tick,
//! forgets dead ones and deletes those paused past their team's retention
//! every 2 s, samples every sandbox's metrics every 5 s,
//! re-resolves allowed host names every minute, and deletes the logs of
//! sandboxes that ended long ago every hour. The verbs it calls are the service's (`service/expiry.rs`,
//! `service/egress.rs`); this file is only their schedule.

use std::sync::Arc;
use std::time::Duration;

use crate::service::Sandboxes;

const TICK: Duration = Duration::from_millis(100);
/// Dead sandboxes are looked for every 20 ticks.
const DEAD_TICKS: u64 = 20;
/// Allowed host names are re-resolved every minute (600 ticks).
const HOST_REFRESH_TICKS: u64 = 600;
/// Metrics are sampled every 5 s (50 ticks).
const SAMPLE_TICKS: u64 = 50;
/// Old sandbox logs are swept every hour (36 000 ticks), and at start.
const LOG_SWEEP_TICKS: u64 = 36_000;

pub fn spawn(svc: &Arc<Sandboxes>) -> tokio::task::JoinHandle<()> {
    let svc = svc.clone();
    tokio::spawn(async move {
        let mut tick = 0u64;
        loop {
            tokio::time::sleep(TICK).await;
            if let Err(e) = svc.reap().await {
                tracing::error!("reaper: {e:#}");
            }
            tick += 1;
            if tick.is_multiple_of(DEAD_TICKS)
                && let Err(e) = svc.reap_dead().await
            {
                tracing::error!("reaper: {e:#}");
            }
            if tick.is_multiple_of(DEAD_TICKS)
                && let Err(e) = svc.reap_paused().await
            {
                tracing::error!("reaper: {e:#}");
            }
            if tick.is_multiple_of(SAMPLE_TICKS)
                && let Err(e) = svc.sample_metrics().await
            {
                tracing::error!("metrics sampling: {e:#}");
            }
            if tick % LOG_SWEEP_TICKS == 1
                && let Err(e) = svc.sweep_logs().await
            {
                tracing::error!("sweeping sandbox logs: {e:#}");
            }
            if tick.is_multiple_of(HOST_REFRESH_TICKS)
                && let Err(e) = svc.refresh_host_names().await
            {
                tracing::error!("host name refresh: {e:#}");
            }
        }
    })
}
