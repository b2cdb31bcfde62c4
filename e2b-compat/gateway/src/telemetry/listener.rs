//! The operator listener (`copse up --metrics-listen ADDR`): `GET /metrics`
//! and nothing else. It is a listener of its own so an operator can bind it
//! where only their scraper reaches; the public listener never serves it.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::{StateLabels, TemplateLabels, metrics};
use crate::api::error::ApiError;
use crate::model::Caller;
use crate::service::{ListFilter, Sandboxes};

/// Binds `addr` and serves `/metrics` until the task is aborted.
pub async fn spawn(addr: SocketAddr, svc: Arc<Sandboxes>) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("metrics listener on {addr}"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(scrape))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "the operator listener serves only /metrics") })
        .with_state(svc);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("metrics listener: {e:#}");
        }
    });
    Ok((bound, task))
}

async fn scrape(State(svc): State<Arc<Sandboxes>>) -> Response {
    if let Err(e) = refresh(&svc) {
        tracing::warn!("reading sandbox states for /metrics: {e:#}");
    }
    ([(header::CONTENT_TYPE, super::CONTENT_TYPE)], metrics().encode()).into_response()
}

/// Sets the gauges that describe a state (sandboxes, pools) from the
/// service, as of this scrape; a template with none left reads 0 until the
/// gateway restarts, never a stale count.
fn refresh(svc: &Sandboxes) -> anyhow::Result<()> {
    let m = metrics();
    for (template, ready, target) in svc.pool_status() {
        let labels = TemplateLabels { template };
        m.pool_ready.get_or_create(&labels).set(ready as i64);
        m.pool_target.get_or_create(&labels).set(target as i64);
    }
    let records = svc.list(&Caller::operator(), &ListFilter::default())?;
    let mut counts = std::collections::HashMap::<StateLabels, i64>::new();
    for record in &records {
        let state = match record.state {
            crate::model::State::Running => "running",
            crate::model::State::Paused => "paused",
        };
        *counts.entry(StateLabels { template: record.template.clone(), state: state.into() }).or_default() += 1;
    }
    // Zero what is gone first: a family cannot be read back to list its
    // label sets, so every known set is kept and overwritten.
    let mut known = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    known.extend(counts.keys().cloned());
    for labels in known.iter() {
        m.sandboxes.get_or_create(labels).set(counts.get(labels).copied().unwrap_or(0));
    }
    Ok(())
}

/// Every (template, state) the gauge has been set for.
static KNOWN: std::sync::LazyLock<std::sync::Mutex<std::collections::HashSet<StateLabels>>> =
    std::sync::LazyLock::new(Default::default);
