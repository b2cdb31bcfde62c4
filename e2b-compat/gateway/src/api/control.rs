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
use crate::model::{self, SandboxRecord, SnapshotRecord};
use crate::network::NetworkRequest;
use crate::service::{self, Connected, CreateRequest, ListFilter, Sandboxes};
use crate::tenancy::Principal;

pub type Service = Arc<Sandboxes>;
type ApiResult<T> = Result<T, ApiError>;

/// The template E2B's SDK asks for when the caller names none.
const DEFAULT_TEMPLATE: &str = "base";
/// Any stable string: E2B uses it to name the node a sandbox runs on.
const CLIENT_ID: &str = "copse";
const DEFAULT_PAGE: usize = 100;

pub async fn create(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    body: Option<Json<wire::NewSandbox>>,
) -> ApiResult<Response> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    let private_traffic = body.network.as_ref().and_then(|n| n.allow_public_traffic) == Some(false);
    let request = CreateRequest {
        template: body.template_id.unwrap_or_else(|| DEFAULT_TEMPLATE.to_string()),
        private_traffic,
        timeout_s: body.timeout,
        metadata: body.metadata.unwrap_or_default(),
        env_vars: body.env_vars.unwrap_or_default(),
        network: network_request(body.allow_internet_access, body.network),
        auto_pause: body.auto_pause.unwrap_or(false),
        auto_pause_memory: body.auto_pause_memory.unwrap_or(true),
        auto_resume: body.auto_resume.is_some_and(|a| a.enabled),
    };
    let started = std::time::Instant::now();
    let (record, timings) = svc.create(&who.caller, request).await?;
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
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
    body: Option<Json<wire::ConnectBody>>,
) -> ApiResult<Response> {
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let (record, how) = svc.connect(&who.caller, &id, body.timeout, body.memory).await?;
    let status = match how {
        Connected::AlreadyRunning => StatusCode::OK,
        Connected::Resumed => StatusCode::CREATED,
    };
    Ok((status, Json(sandbox(&record, &exposure))).into_response())
}

/// The pre-connect way to resume; E2B still serves it.
pub async fn resume(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
    body: Option<Json<wire::ConnectBody>>,
) -> ApiResult<Response> {
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let record = svc.resume(&who.caller, &id, body.timeout, body.memory).await?;
    Ok((StatusCode::CREATED, Json(sandbox(&record, &exposure))).into_response())
}

pub async fn pause(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::PauseBody>>,
) -> ApiResult<StatusCode> {
    let memory = body.and_then(|Json(b)| b.memory).unwrap_or(true);
    svc.pause(&who.caller, &id, memory).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn create_snapshot(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::SnapshotRequest>>,
) -> ApiResult<Response> {
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let snapshot = svc.create_snapshot(&who.caller, &id, body.name, body.memory).await?;
    Ok((StatusCode::CREATED, Json(snapshot_info(&snapshot))).into_response())
}

pub async fn list_snapshots(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Query(query): Query<wire::SnapshotsQuery>,
) -> ApiResult<Response> {
    let all = svc.snapshots(&who.caller, query.sandbox_id.as_deref(), query.name.as_deref())?;
    let (page, next) = paginate(&all, |s| &s.id, query.limit, query.next_token.as_deref());
    let body: Vec<wire::SnapshotInfo> = page.iter().map(snapshot_info).collect();
    Ok((next_token_header(next), Json(body)).into_response())
}

/// `DELETE /templates/{id}`: how the SDK deletes a snapshot. Built
/// templates are not deletable through the API.
pub async fn delete_template(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    svc.delete_snapshot(&who.caller, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn fork(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
    body: Option<Json<wire::ForkRequest>>,
) -> ApiResult<Response> {
    // E2B's API gives forks 15 s unless the request says otherwise.
    children(svc, &who, &exposure, id, body, service::MAX_FORKS, 15, true).await
}

/// copse's clone (CubeSandbox's name for it): a fork with a larger count.
pub async fn clone(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
    body: Option<Json<wire::ForkRequest>>,
) -> ApiResult<Response> {
    children(svc, &who, &exposure, id, body, service::MAX_CLONES, model::DEFAULT_TIMEOUT_S, false).await
}

#[allow(clippy::too_many_arguments)]
async fn children(
    svc: Service,
    who: &Principal,
    exposure: &Exposure,
    id: String,
    body: Option<Json<wire::ForkRequest>>,
    max: u32,
    default_timeout_s: i64,
    memory_by_default: bool,
) -> ApiResult<Response> {
    let body = body.map(|Json(b)| b).unwrap_or_default();
    let timeout = body.timeout.unwrap_or(default_timeout_s);
    let memory = svc.fork_memory(&who.caller, &id, body.memory, memory_by_default)?;
    let results = svc.fork(&who.caller, &id, body.count.unwrap_or(1), max, timeout, memory).await?;
    let body: Vec<wire::ForkResult> = results
        .into_iter()
        .map(|r| match r {
            Ok(record) => wire::ForkResult { sandbox: Some(sandbox(&record, exposure)), error: None },
            Err(e) => {
                let e = ApiError::from(e);
                wire::ForkResult {
                    sandbox: None,
                    error: Some(serde_json::json!({ "code": e.status.as_u16(), "message": e.message })),
                }
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

/// copse's rollback: the sandbox's files go back to one of its snapshots.
pub async fn rollback(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
    body: Option<Json<wire::RollbackRequest>>,
) -> ApiResult<Json<wire::Sandbox>> {
    let snapshot =
        body.and_then(|Json(b)| b.snapshot_id).ok_or_else(|| ApiError::bad_request("missing 'snapshotID'"))?;
    Ok(Json(sandbox(&svc.rollback(&who.caller, &id, &snapshot).await?, &exposure)))
}

pub async fn list(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Query(query): Query<wire::ListQuery>,
) -> ApiResult<Response> {
    let mut filter = ListFilter {
        metadata: query.metadata.as_deref().map(wire::decode_metadata_filter).unwrap_or_default(),
        template: query.template.clone(),
        ..Default::default()
    };
    for state in query.state.as_deref().unwrap_or("").split(',').filter(|s| !s.is_empty()) {
        filter.states.push(match state {
            "running" => model::State::Running,
            "paused" => model::State::Paused,
            other => return Err(ApiError::bad_request(format!("unknown state filter '{other}'"))),
        });
    }
    let all = svc.list(&who.caller, &filter)?;
    let (page, next) = paginate(&all, |r| &r.id, query.limit, query.next_token.as_deref());
    let page: Vec<wire::ListedSandbox> = page.iter().map(listed).collect();
    Ok((next_token_header(next), Json(page)).into_response())
}

/// One page of `all` after the item whose key is `token` (the last one the
/// caller already has), and the token of the next page if there is one.
fn paginate<'a, T>(
    all: &'a [T],
    key: impl Fn(&T) -> &String,
    limit: Option<usize>,
    token: Option<&str>,
) -> (&'a [T], Option<String>) {
    let limit = limit.unwrap_or(DEFAULT_PAGE).clamp(1, 1000);
    let start = match token {
        Some(token) if !token.is_empty() => {
            all.iter().position(|x| key(x) == token).map(|i| i + 1).unwrap_or(all.len())
        }
        _ => 0,
    };
    let end = (start + limit).min(all.len());
    let next = (end < all.len() && end > start).then(|| key(&all[end - 1]).clone());
    (&all[start..end], next)
}

fn next_token_header(next: Option<String>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(token) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        headers.insert("x-next-token", token);
    }
    headers
}

pub async fn detail(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::SandboxDetail>> {
    let record = svc.get(&who.caller, &id)?;
    Ok(Json(wire::SandboxDetail {
        listed: listed(&record),
        envd_access_token: record.access_token.clone(),
        allow_internet_access: record.allow_internet_access,
        domain: exposure.domain.clone(),
        lifecycle: wire::Lifecycle {
            auto_resume: record.auto_resume,
            on_timeout: if record.auto_pause { "pause" } else { "kill" },
        },
    }))
}

/// `PUT /sandboxes/{id}/network`: replaces the egress rules as a whole.
pub async fn update_network(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::NetworkConfig>>,
) -> ApiResult<StatusCode> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    svc.update_network(&who.caller, &id, network_request(body.allow_internet_access, Some(body))).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn network_request(allow_internet_access: Option<bool>, network: Option<wire::NetworkConfig>) -> NetworkRequest {
    let network = network.unwrap_or_default();
    NetworkRequest {
        allow_internet_access: allow_internet_access.or(network.allow_internet_access),
        allow_out: network.allow_out,
        deny_out: network.deny_out,
        dns_servers: network.dns_servers,
    }
}

pub async fn kill(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    svc.kill(&who.caller, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn set_timeout(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::TimeoutBody>>,
) -> ApiResult<StatusCode> {
    let timeout = body.and_then(|Json(b)| b.timeout).ok_or_else(|| ApiError::bad_request("missing 'timeout'"))?;
    svc.set_timeout(&who.caller, &id, timeout)?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn refresh(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::RefreshBody>>,
) -> ApiResult<StatusCode> {
    let duration = body.and_then(|Json(b)| b.duration).unwrap_or(model::DEFAULT_TIMEOUT_S);
    svc.extend(&who.caller, &id, Some(duration))?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn metrics(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<wire::SandboxMetric>>> {
    let Some(metric) = svc.metrics(&who.caller, &id).await? else { return Ok(Json(Vec::new())) };
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
    let templates = svc.templates().await?;
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

pub async fn no_route() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

fn sandbox(record: &SandboxRecord, exposure: &Exposure) -> wire::Sandbox {
    wire::Sandbox {
        template_id: record.template.clone(),
        sandbox_id: record.id.clone(),
        client_id: CLIENT_ID.into(),
        envd_version: model::ENVD_VERSION.into(),
        envd_access_token: record.access_token.clone(),
        traffic_access_token: record.traffic_access_token.clone(),
        domain: exposure.domain.clone(),
        alias: Some(record.template.clone()),
    }
}

fn snapshot_info(snapshot: &SnapshotRecord) -> wire::SnapshotInfo {
    wire::SnapshotInfo { snapshot_id: snapshot.id.clone(), names: snapshot.names.clone() }
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
            model::State::Running => "running",
            model::State::Paused => "paused",
        },
        envd_version: model::ENVD_VERSION.into(),
        metadata: record.metadata.clone(),
    }
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

fn rfc3339_ms(ms: i64) -> String {
    rfc3339(OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap_or(OffsetDateTime::UNIX_EPOCH))
}
