//! Control-plane handlers: extract, call the sandbox service, shape the
//! reply the way the E2B SDK expects.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::error::ApiError;
use super::host_routing::Exposure;
use super::wire;
use crate::sandboxes::{self, CreateRequest, ListFilter, SandboxRecord, Sandboxes};

pub type Service = Arc<Sandboxes>;
type ApiResult<T> = Result<T, ApiError>;

/// The template E2B's SDK asks for when the caller names none.
const DEFAULT_TEMPLATE: &str = "base";
/// Any stable string: E2B uses it to name the node a sandbox runs on.
const CLIENT_ID: &str = "copse";
const DEFAULT_PAGE: usize = 100;

pub async fn create(
    State(svc): State<Service>,
    Extension(exposure): Extension<Exposure>,
    body: Option<Json<wire::NewSandbox>>,
) -> ApiResult<Response> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    let request = CreateRequest {
        template: body.template_id.unwrap_or_else(|| DEFAULT_TEMPLATE.to_string()),
        timeout_s: body.timeout,
        metadata: body.metadata.unwrap_or_default(),
        env_vars: body.env_vars.unwrap_or_default(),
        allow_internet_access: body.allow_internet_access.unwrap_or(true),
        auto_pause: body.auto_pause.unwrap_or(false),
    };
    let started = std::time::Instant::now();
    let (record, timings) = svc.create(request).await?;
    let timing = format!(
        "boot;dur={:.3}, handover;dur={:.3}, total;dur={:.3}",
        timings.boot.as_secs_f64() * 1e3,
        timings.handover.as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64() * 1e3
    );
    let header = [("server-timing", HeaderValue::from_str(&timing).expect("ascii"))];
    Ok((StatusCode::CREATED, header, Json(sandbox(&record, &exposure))).into_response())
}

pub async fn connect(
    State(svc): State<Service>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
    body: Option<Json<wire::TimeoutBody>>,
) -> ApiResult<Json<wire::Sandbox>> {
    let timeout = body.and_then(|Json(b)| b.timeout);
    Ok(Json(sandbox(&svc.connect(&id, timeout)?, &exposure)))
}

pub async fn list(State(svc): State<Service>, Query(query): Query<wire::ListQuery>) -> ApiResult<Response> {
    let mut filter = ListFilter {
        metadata: query.metadata.as_deref().map(wire::decode_metadata_filter).unwrap_or_default(),
        template: query.template.clone(),
        ..Default::default()
    };
    for state in query.state.as_deref().unwrap_or("").split(',').filter(|s| !s.is_empty()) {
        filter.states.push(match state {
            "running" => sandboxes::State::Running,
            "paused" => sandboxes::State::Paused,
            other => return Err(ApiError::bad_request(format!("unknown state filter '{other}'"))),
        });
    }
    let all = svc.list(&filter)?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE).clamp(1, 1000);
    // The page token is the id of the last sandbox already returned.
    let start = match &query.next_token {
        Some(token) if !token.is_empty() => all.iter().position(|r| &r.id == token).map(|i| i + 1).unwrap_or(all.len()),
        _ => 0,
    };
    let page: Vec<wire::ListedSandbox> = all.iter().skip(start).take(limit).map(listed).collect();
    let mut headers = HeaderMap::new();
    if start + page.len() < all.len()
        && let Some(last) = all.get(start + page.len() - 1)
    {
        headers.insert("x-next-token", HeaderValue::from_str(&last.id).expect("ids are ascii"));
    }
    Ok((headers, Json(page)).into_response())
}

pub async fn detail(
    State(svc): State<Service>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::SandboxDetail>> {
    let record = svc.get(&id)?;
    Ok(Json(wire::SandboxDetail {
        listed: listed(&record),
        envd_access_token: record.access_token.clone(),
        allow_internet_access: record.allow_internet_access,
        domain: exposure.domain.clone(),
        lifecycle: wire::Lifecycle { auto_resume: false, on_timeout: if record.auto_pause { "pause" } else { "kill" } },
    }))
}

pub async fn kill(State(svc): State<Service>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    svc.kill(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn set_timeout(
    State(svc): State<Service>,
    Path(id): Path<String>,
    body: Option<Json<wire::TimeoutBody>>,
) -> ApiResult<StatusCode> {
    let timeout = body.and_then(|Json(b)| b.timeout).ok_or_else(|| ApiError::bad_request("missing 'timeout'"))?;
    svc.set_timeout(&id, timeout)?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn refresh(
    State(svc): State<Service>,
    Path(id): Path<String>,
    body: Option<Json<wire::RefreshBody>>,
) -> ApiResult<StatusCode> {
    let duration = body.and_then(|Json(b)| b.duration).unwrap_or(sandboxes::DEFAULT_TIMEOUT_S);
    svc.connect(&id, Some(duration))?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn metrics(State(svc): State<Service>, Path(id): Path<String>) -> ApiResult<Json<Vec<wire::SandboxMetric>>> {
    let metric = svc.metrics(&id).await?;
    let now = OffsetDateTime::now_utc();
    Ok(Json(vec![wire::SandboxMetric {
        timestamp: rfc3339(now),
        timestamp_unix: now.unix_timestamp(),
        cpu_count: metric.cpu_count,
        cpu_used_pct: metric.cpu_used_pct,
        mem_used: metric.mem_used,
        mem_total: metric.mem_total,
        mem_cache: metric.mem_cache,
        disk_used: metric.disk_used,
        disk_total: metric.disk_total,
    }]))
}

pub async fn templates(State(svc): State<Service>) -> ApiResult<Json<Vec<wire::Template>>> {
    let substrate = svc.substrate().clone();
    let templates = tokio::task::spawn_blocking(move || substrate.templates())
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")))?;
    Ok(Json(
        templates
            .into_iter()
            .map(|t| wire::Template {
                build_id: format!("{}-{}", t.name, t.built_at),
                aliases: vec![t.name.clone()],
                template_id: t.name,
                public: true,
                created_at: rfc3339(
                    OffsetDateTime::from_unix_timestamp(t.built_at as i64).unwrap_or(OffsetDateTime::UNIX_EPOCH),
                ),
                size_bytes: t.size_bytes,
            })
            .collect(),
    ))
}

/// copse's own addition: how full each warm pool is.
pub async fn pools(State(svc): State<Service>) -> Json<serde_json::Value> {
    let pools: Vec<_> = svc
        .pool_status()
        .into_iter()
        .map(|(template, ready, target)| serde_json::json!({ "template": template, "ready": ready, "target": target }))
        .collect();
    Json(serde_json::Value::Array(pools))
}

pub async fn not_implemented() -> ApiError {
    ApiError::new(StatusCode::NOT_IMPLEMENTED, "this operation is not supported by copse yet")
}

pub async fn no_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

fn sandbox(record: &SandboxRecord, exposure: &Exposure) -> wire::Sandbox {
    wire::Sandbox {
        template_id: record.template.clone(),
        sandbox_id: record.id.clone(),
        client_id: CLIENT_ID.into(),
        envd_version: sandboxes::ENVD_VERSION.into(),
        envd_access_token: record.access_token.clone(),
        traffic_access_token: None,
        domain: exposure.domain.clone(),
        alias: Some(record.template.clone()),
    }
}

fn listed(record: &SandboxRecord) -> wire::ListedSandbox {
    wire::ListedSandbox {
        template_id: record.template.clone(),
        sandbox_id: record.id.clone(),
        client_id: CLIENT_ID.into(),
        alias: Some(record.template.clone()),
        started_at: rfc3339_ms(record.started_at_ms),
        end_at: rfc3339_ms(record.end_at_ms),
        cpu_count: record.limits.cpu_count,
        memory_mb: record.limits.memory_mb,
        disk_size_mb: record.limits.disk_mb,
        state: match record.state {
            sandboxes::State::Running => "running",
            sandboxes::State::Paused => "paused",
        },
        envd_version: sandboxes::ENVD_VERSION.into(),
        metadata: record.metadata.clone(),
    }
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

fn rfc3339_ms(ms: i64) -> String {
    rfc3339(OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap_or(OffsetDateTime::UNIX_EPOCH))
}
