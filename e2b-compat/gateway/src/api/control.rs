//! Control-plane handlers: extract, call the sandbox service, shape the
//! reply the way the E2B SDK expects.

use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::Admission;
use super::error::ApiError;
use super::host_routing::Exposure;
use super::wire;
use crate::model::{self, SandboxRecord, SnapshotRecord};
use crate::network::{EgressProxyRequest, EgressProxyTlsRequest, NetworkRequest};
use crate::sandbox_log;
use crate::service::{self, Connected, CreateRequest, ListFilter, Sandboxes, Volumes};
use crate::tenancy::Principal;

pub type Service = Arc<Sandboxes>;
pub(super) type ApiResult<T> = Result<T, ApiError>;

/// The template E2B's SDK asks for when the caller names none.
pub(super) const DEFAULT_TEMPLATE: &str = "base";
/// Any stable string: E2B uses it to name the node a sandbox runs on.
const CLIENT_ID: &str = "copse";
const DEFAULT_PAGE: usize = 100;

pub async fn create(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(admission): Extension<Admission>,
    Extension(exposure): Extension<Exposure>,
    Extension(volumes): Extension<Arc<Volumes>>,
    body: Option<Json<wire::NewSandbox>>,
) -> ApiResult<Response> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    refuse_unsupported(body.unsupported())?;
    let asked: Vec<(String, String)> =
        body.volume_mounts.iter().flatten().map(|m| (m.name.clone(), m.path.clone())).collect();
    let volumes = match asked.is_empty() {
        true => Vec::new(),
        false => {
            let caller = who.caller.clone();
            tokio::task::spawn_blocking(move || volumes.resolve(&caller, &asked))
                .await
                .map_err(|e| ApiError::from(model::VolumeError::Internal(e.into())))??
        }
    };
    let private_traffic = body.network.as_ref().and_then(|n| n.allow_public_traffic) == Some(false);
    let mask_request_host = body.network.as_ref().and_then(|n| n.mask_request_host.clone());
    if let Some(mask) = &mask_request_host {
        model::validate_host_mask(mask)?;
    }
    let https_ports = body.network.as_ref().and_then(|n| n.https_ports.as_deref()).unwrap_or_default();
    let https_ports = model::validate_https_ports(https_ports)?;
    let request = CreateRequest {
        template: body.template_id.unwrap_or_else(|| DEFAULT_TEMPLATE.to_string()),
        private_traffic,
        mask_request_host,
        https_ports,
        timeout_s: body.timeout,
        metadata: body.metadata.unwrap_or_default(),
        env_vars: body.env_vars.unwrap_or_default(),
        network: network_request(body.allow_internet_access, body.network),
        auto_pause: body.auto_pause.unwrap_or(false),
        auto_pause_memory: body.auto_pause_memory.unwrap_or(true),
        auto_resume: body.auto_resume.is_some_and(|a| a.enabled),
        volumes,
        for_build: false,
        build_layer: None,
    };
    let started = std::time::Instant::now();
    let (record, timings) = svc.create(&who.caller, request).await?;
    // `tenancy`: what teams cost a create, from the key's lookup to the
    // quota checks (issue 17 bounds it).
    let mut timing = format!(
        "boot;dur={:.3}, handover;dur={:.3}, tenancy;dur={:.3}, total;dur={:.3}",
        timings.boot.as_secs_f64() * 1e3,
        timings.handover.as_secs_f64() * 1e3,
        (admission.0 + timings.quota).as_secs_f64() * 1e3,
        started.elapsed().as_secs_f64() * 1e3
    );
    // The substrate's own steps of `boot`, so a slower create can be taken
    // apart from its responses (bench:create records them per sample).
    for (step, took) in timings.boot_phases.iter() {
        timing.push_str(&format!(", boot_{step};dur={:.3}", took.as_secs_f64() * 1e3));
    }
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
pub(super) fn paginate<'a, T>(
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

pub(super) fn next_token_header(next: Option<String>) -> HeaderMap {
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
        network: network_info(&record),
    }))
}

/// What info says of the sandbox's network: the ingress settings fixed at
/// create, its SOCKS5 upstream, if any, never with the password, and its
/// `dns_servers` unless they are the default.
fn network_info(record: &model::SandboxRecord) -> wire::NetworkInfo {
    let upstream = record.network.as_ref().and_then(|n| n.policy.upstream.as_ref());
    let dns_servers = record
        .network
        .as_ref()
        .map(|n| &n.policy.dns_servers)
        .filter(|servers| **servers != [copse_cubenet::policy::DEFAULT_DNS])
        .map(|servers| servers.iter().map(ToString::to_string).collect());
    wire::NetworkInfo {
        allow_public_traffic: record.traffic_access_token.is_none(),
        mask_request_host: record.mask_request_host.clone(),
        https_ports: record.https_ports.clone(),
        egress_proxy: upstream.map(|upstream| wire::EgressProxyInfo {
            address: upstream.address(),
            username: upstream.username().map(str::to_string),
            tls: upstream
                .tls
                .as_ref()
                .map(|tls| wire::EgressProxyTlsInfo { enabled: true, server_name: tls.server_name.clone() }),
        }),
        dns_servers,
        rules: record.network.as_ref().and_then(|n| n.policy.rules.as_ref()).map(rules_info),
    }
}

fn rules_info(rules: &copse_cubenet::HeaderRules) -> wire::NetworkRules {
    let rule = |rule: &copse_cubenet::Rule| wire::NetworkRule {
        transform: rule.headers.as_ref().map(|h| wire::NetworkTransform { headers: Some(h.iter().cloned().collect()) }),
    };
    rules.hosts.iter().map(|h| (h.host.clone(), h.rules.iter().map(rule).collect())).collect()
}

fn rules_request(rules: wire::NetworkRules) -> Vec<(String, Vec<copse_cubenet::Rule>)> {
    let rule = |rule: wire::NetworkRule| copse_cubenet::Rule {
        headers: rule.transform.map(|t| t.headers.unwrap_or_default().into_iter().collect()),
    };
    rules.into_iter().map(|(host, rules)| (host, rules.into_iter().map(rule).collect())).collect()
}

/// `PUT /sandboxes/{id}/network`: replaces the egress rules as a whole.
pub async fn update_network(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::NetworkConfig>>,
) -> ApiResult<StatusCode> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    if body.mask_request_host.is_some() {
        return Err(ApiError::bad_request("'network.maskRequestHost' is set when a sandbox is created, not updated"));
    }
    if body.https_ports.as_ref().is_some_and(|ports| !ports.is_empty()) {
        return Err(ApiError::bad_request("'network.httpsPorts' is set when a sandbox is created, not updated"));
    }
    svc.update_network(&who.caller, &id, network_request(body.allow_internet_access, Some(body))).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Asked-for features copse lacks are refused by name: a sandbox created
/// without the volume or egress rule its caller asked for fails later and
/// less clearly.
fn refuse_unsupported(field: Option<&str>) -> ApiResult<()> {
    match field {
        Some(field) => Err(ApiError::bad_request(format!("'{field}' is not supported by this copse server"))),
        None => Ok(()),
    }
}

fn network_request(allow_internet_access: Option<bool>, network: Option<wire::NetworkConfig>) -> NetworkRequest {
    let network = network.unwrap_or_default();
    NetworkRequest {
        allow_internet_access: allow_internet_access.or(network.allow_internet_access),
        allow_out: network.allow_out,
        deny_out: network.deny_out,
        dns_servers: network.dns_servers,
        egress_proxy: network.egress_proxy.map(|p| EgressProxyRequest {
            address: p.address,
            username: p.username,
            password: p.password,
            tls: p.tls.map(|t| EgressProxyTlsRequest {
                enabled: t.enabled,
                server_name: t.server_name,
                ca_cert: t.ca_cert,
            }),
        }),
        rules: network.rules.map(rules_request),
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

/// `GET /sandboxes/{id}/metrics`: the samples between `start` and `end`
/// (Unix seconds; default the sandbox's start and now).
pub async fn metrics(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<wire::MetricsQuery>, QueryRejection>,
) -> ApiResult<Json<Vec<wire::SandboxMetric>>> {
    let Query(query) = query.map_err(bad_query)?;
    let series = svc.metrics_between(&who.caller, &id, query.start, query.end).await?;
    Ok(Json(series.iter().map(sandbox_metric).collect()))
}

/// E2B caps one bulk metrics request at 100 sandboxes.
pub const MAX_METRICS_IDS: usize = 100;

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the newest sample of each
/// (sandboxes that do not exist or do not run are left out).
pub async fn many_metrics(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    query: Result<Query<wire::ManyMetricsQuery>, QueryRejection>,
) -> ApiResult<Json<wire::SandboxesWithMetrics>> {
    let Query(query) = query.map_err(bad_query)?;
    let ids = query.ids();
    if ids.is_empty() {
        return Err(ApiError::bad_request("sandbox_ids must name at least one sandbox"));
    }
    if ids.len() > MAX_METRICS_IDS {
        return Err(ApiError::bad_request(format!(
            "sandbox_ids names {} sandboxes; at most {MAX_METRICS_IDS}",
            ids.len()
        )));
    }
    let latest = svc.latest_metrics(&who.caller, &ids).await?;
    Ok(Json(wire::SandboxesWithMetrics {
        sandboxes: latest.into_iter().map(|(id, m)| (id, sandbox_metric(&m))).collect(),
    }))
}

fn sandbox_metric(m: &service::Metric) -> wire::SandboxMetric {
    wire::SandboxMetric {
        timestamp: rfc3339_ms(m.at_ms),
        timestamp_unix: m.at_ms.div_euclid(1000),
        cpu_count: m.cpu_count,
        cpu_used_pct: m.cpu_used_pct,
        mem_used: m.mem_used,
        mem_total: m.mem_total,
        mem_cache: m.mem_cache,
        disk_used: m.disk_used,
        disk_total: m.disk_total,
    }
}

/// E2B's ceiling for one page of logs.
const MAX_LOG_PAGE: usize = 1000;
const MAX_LOG_SEARCH: usize = 256;

/// `GET /sandboxes/{id}/logs` (deprecated by E2B, still in the SDK):
/// forward from `start` (Unix ms), as lines and as structured entries.
pub async fn logs(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<wire::LogsQuery>, QueryRejection>,
) -> ApiResult<Json<wire::SandboxLogs>> {
    let Query(query) = query.map_err(bad_query)?;
    let query = sandbox_log::Query { cursor_ms: query.start, limit: page_limit(query.limit)?, ..Default::default() };
    let entries = svc.sandbox_logs(&who.caller, &id, &query)?;
    Ok(Json(wire::SandboxLogs {
        logs: entries.iter().map(|e| wire::SandboxLog { timestamp: rfc3339_ms(e.at_ms), line: log_line(e) }).collect(),
        log_entries: entries.iter().map(log_entry).collect(),
    }))
}

/// `GET /v2/sandboxes/{id}/logs`: a page from `cursor` (Unix ms) forward,
/// or backward (newest first), at `level` or above, matching `search`.
pub async fn logs_v2(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    query: Result<Query<wire::LogsV2Query>, QueryRejection>,
) -> ApiResult<Json<wire::SandboxLogsV2>> {
    let Query(query) = query.map_err(bad_query)?;
    let backward = match query.direction.as_deref() {
        None | Some("forward") => false,
        Some("backward") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!("direction must be forward or backward, not {other:?}")));
        }
    };
    let min_level = match query.level.as_deref() {
        None => None,
        Some("debug") => Some(sandbox_log::Level::Debug),
        Some("info") => Some(sandbox_log::Level::Info),
        Some("warn") => Some(sandbox_log::Level::Warn),
        Some("error") => Some(sandbox_log::Level::Error),
        Some(other) => {
            return Err(ApiError::bad_request(format!("level must be debug, info, warn or error, not {other:?}")));
        }
    };
    if query.search.as_ref().is_some_and(|s| s.len() > MAX_LOG_SEARCH) {
        return Err(ApiError::bad_request(format!("search is longer than {MAX_LOG_SEARCH} bytes")));
    }
    let query = sandbox_log::Query {
        cursor_ms: query.cursor,
        limit: page_limit(query.limit)?,
        backward,
        min_level,
        search: query.search,
    };
    let entries = svc.sandbox_logs(&who.caller, &id, &query)?;
    Ok(Json(wire::SandboxLogsV2 { logs: entries.iter().map(log_entry).collect() }))
}

fn page_limit(limit: Option<usize>) -> ApiResult<usize> {
    match limit {
        None => Ok(MAX_LOG_PAGE),
        Some(n) if n <= MAX_LOG_PAGE => Ok(n),
        Some(n) => Err(ApiError::bad_request(format!("limit must be at most {MAX_LOG_PAGE}, got {n}"))),
    }
}

fn log_entry(e: &sandbox_log::Entry) -> wire::SandboxLogEntry {
    let level = match e.level {
        sandbox_log::Level::Debug => "debug",
        sandbox_log::Level::Info => "info",
        sandbox_log::Level::Warn => "warn",
        sandbox_log::Level::Error => "error",
    };
    wire::SandboxLogEntry {
        timestamp: rfc3339_ms(e.at_ms),
        message: e.message.clone(),
        level,
        fields: e.fields.clone(),
    }
}

/// The one-line form of an entry: its message, then its fields.
fn log_line(e: &sandbox_log::Entry) -> String {
    std::iter::once(e.message.clone())
        .chain(e.fields.iter().map(|(k, v)| format!("{k}={v}")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A query string the handler's type does not accept, as E2B's JSON error.
fn bad_query(rejection: QueryRejection) -> ApiError {
    ApiError::bad_request(rejection.body_text())
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
        volume_mounts: record
            .volume_mounts
            .iter()
            .map(|m| wire::VolumeMount { name: m.name.clone(), path: m.path.clone() })
            .collect(),
    }
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

pub(super) fn rfc3339_ms(ms: i64) -> String {
    rfc3339(OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).unwrap_or(OffsetDateTime::UNIX_EPOCH))
}
