//! The SDK's template build routes (`Template.build`): request a build,
//! the upload link and the upload of a copy step's files, start the build,
//! poll its status and log; find, list and delete built templates.

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::routing::{get, post, put};
use axum::{Extension, Router};

use super::control::{ApiResult, Service, rfc3339_ms};
use super::error::ApiError;
use super::host_routing::Exposure;
use super::wire;
use crate::model::{ENVD_VERSION, TemplateRecord};
use crate::service::{BuildSpec, RawStep};
use crate::tenancy::Principal;

/// The status route returns at most this many log lines per call (the SDK
/// keeps polling until a call returns none).
const MAX_LOG_PAGE: usize = 100;
/// The upload route, outside the API key's gate: the SDK sends the upload
/// without its key, so the link's token stands for it.
pub const UPLOAD_PATH: &str = "/copse/template-files";

/// Routes that need the API key.
pub fn routes() -> Router<Service> {
    Router::new()
        .route("/v3/templates", post(request_build))
        .route("/templates/{id}/files/{hash}", get(upload_link))
        .route("/v2/templates/{id}/builds/{build_id}", post(start_build))
        .route("/templates/{id}/builds/{build_id}/status", get(build_status))
        .route("/templates/aliases/{alias}", get(alias))
        .route("/templates/{id}", get(detail).delete(delete))
        .route("/v2/templates", get(list))
}

/// The upload link's route, which carries its own token.
pub fn upload_routes() -> Router<Service> {
    Router::new().route(&format!("{UPLOAD_PATH}/{{id}}/{{hash}}"), put(upload))
}

async fn request_build(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    body: Option<Json<wire::TemplateBuildRequest>>,
) -> ApiResult<(StatusCode, Json<wire::TemplateRequested>)> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    let name = body.name.or(body.alias).ok_or_else(|| ApiError::bad_request("the template needs a name"))?;
    let record = svc.request_build(&who.caller, &name, body.cpu_count, body.memory_mb).await?;
    let mut tags = body.tags.unwrap_or_default();
    if let Some((_, tag)) = name.rsplit_once(':') {
        tags.insert(0, tag.to_string());
    }
    if tags.is_empty() {
        tags.push("default".into());
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(wire::TemplateRequested {
            template_id: record.id,
            build_id: record.build.id,
            public: false,
            names: vec![record.name.clone()],
            tags,
            aliases: vec![record.name],
        }),
    ))
}

async fn upload_link(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Extension(exposure): Extension<Exposure>,
    Path((id, hash)): Path<(String, String)>,
    request: Request,
) -> ApiResult<(StatusCode, Json<wire::TemplateFileUpload>)> {
    let (present, record) = svc.upload_link(&who.caller, &id, &hash)?;
    // The link names this gateway as the caller reached it.
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.to_string()))
        .ok_or_else(|| ApiError::bad_request("the request names no host"))?;
    let scheme = if exposure.domain.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{host}{UPLOAD_PATH}/{}/{hash}?token={}", record.id, record.upload_token);
    Ok((StatusCode::CREATED, Json(wire::TemplateFileUpload { present, url: Some(url) })))
}

#[derive(serde::Deserialize)]
struct UploadQuery {
    token: String,
}

async fn upload(
    State(svc): State<Service>,
    Path((id, hash)): Path<(String, String)>,
    Query(query): Query<UploadQuery>,
    body: Body,
) -> ApiResult<StatusCode> {
    svc.accept_upload(&id, &hash, &query.token, body.into_data_stream()).await?;
    Ok(StatusCode::OK)
}

async fn start_build(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path((id, build_id)): Path<(String, String)>,
    body: Option<Json<wire::TemplateBuildStart>>,
) -> ApiResult<StatusCode> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    let registry_login = registry_login(body.from_image_registry.as_ref())?;
    let steps = body
        .steps
        .unwrap_or_default()
        .into_iter()
        .map(|s| RawStep {
            kind: s.kind,
            args: s.args.unwrap_or_default(),
            files_hash: s.files_hash,
            force: s.force.unwrap_or(false),
        })
        .collect();
    let spec = BuildSpec {
        from_template: body.from_template,
        from_image: body.from_image,
        steps,
        force: body.force.unwrap_or(false),
        start_cmd: body.start_cmd,
        ready_cmd: body.ready_cmd,
        registry_login,
    };
    svc.start_build(&who.caller, &id, &build_id, spec).await?;
    Ok(StatusCode::ACCEPTED)
}

/// `fromImageRegistry`: the SDK's `from_image(image, username=,
/// password=)` is a basic login; the cloud ones need their vendors' token
/// exchanges, which copse does not do.
fn registry_login(config: Option<&serde_json::Value>) -> ApiResult<Option<copse_images::Credential>> {
    let Some(config) = config.filter(|c| !c.is_null()) else { return Ok(None) };
    let field = |name: &str| config.get(name).and_then(|v| v.as_str()).filter(|v| !v.is_empty());
    match config.get("type").and_then(|t| t.as_str()) {
        Some("registry") => match (field("username"), field("password")) {
            (Some(username), Some(password)) => {
                Ok(Some(copse_images::Credential { username: username.into(), password: password.into() }))
            }
            _ => Err(ApiError::bad_request("fromImageRegistry of type registry needs a username and a password")),
        },
        Some(kind @ ("aws" | "gcp")) => Err(ApiError::bad_request(format!(
            "fromImageRegistry of type {kind} is not supported: copse pulls with a registry username and password \
             (from_image(image, username=..., password=...)), or through the operator's --registry-auth-file"
        ))),
        other => Err(ApiError::bad_request(format!("fromImageRegistry of type {other:?} is not supported"))),
    }
}

async fn build_status(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path((id, build_id)): Path<(String, String)>,
    Query(query): Query<wire::BuildStatusQuery>,
) -> ApiResult<Json<wire::TemplateBuildInfo>> {
    let record = svc.build_status(&who.caller, &id, &build_id)?;
    let build = &record.build;
    let offset = query.logs_offset.unwrap_or(0).min(build.log.len());
    let limit = query.limit.unwrap_or(MAX_LOG_PAGE).min(MAX_LOG_PAGE);
    let page: Vec<wire::BuildLogEntry> = build.log[offset..].iter().take(limit).map(log_entry).collect();
    let reason = build.failure.as_ref().map(|f| wire::BuildStatusReason {
        message: f.message.clone(),
        step: f.step.clone(),
        log_entries: build.log.iter().rev().take(MAX_LOG_PAGE).rev().map(log_entry).collect(),
    });
    Ok(Json(wire::TemplateBuildInfo {
        logs: page.iter().map(|e| format!("{} {}", e.timestamp, e.message)).collect(),
        log_entries: page,
        template_id: record.id.clone(),
        build_id: build.id.clone(),
        status: build.status.as_str().into(),
        reason,
    }))
}

fn log_entry(line: &crate::model::BuildLine) -> wire::BuildLogEntry {
    wire::BuildLogEntry {
        timestamp: rfc3339_ms(line.at_ms),
        message: line.message.clone(),
        level: line.level.clone(),
        step: line.step.clone(),
    }
}

async fn alias(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(alias): Path<String>,
) -> ApiResult<Json<wire::TemplateAlias>> {
    let record = svc.built_template(&who.caller, &alias)?;
    Ok(Json(wire::TemplateAlias { template_id: record.id, public: false }))
}

async fn detail(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::BuiltTemplate>> {
    let record = svc.built_template(&who.caller, &id)?;
    Ok(Json(built(&record, true)))
}

async fn list(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
) -> ApiResult<Json<Vec<wire::BuiltTemplate>>> {
    Ok(Json(svc.built_templates(&who.caller)?.iter().map(|r| built(r, false)).collect()))
}

/// `DELETE /templates/{id}`: a built template, else (as before) a
/// snapshot, which the SDK deletes through the same route.
async fn delete(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    if !svc.delete_built(&who.caller, &id).await? {
        svc.delete_snapshot(&who.caller, &id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

fn built(record: &TemplateRecord, with_builds: bool) -> wire::BuiltTemplate {
    let build = &record.build;
    wire::BuiltTemplate {
        template_id: record.id.clone(),
        build_id: build.id.clone(),
        cpu_count: build.cpu_count,
        memory_mb: build.memory_mb,
        disk_size_mb: 0,
        public: false,
        aliases: vec![record.name.clone()],
        names: vec![record.name.clone()],
        created_at: rfc3339_ms(record.created_at_ms),
        updated_at: rfc3339_ms(build.updated_at_ms),
        created_by: None,
        last_spawned_at: None,
        spawn_count: 0,
        build_count: record.build_count,
        envd_version: ENVD_VERSION.into(),
        build_status: build.status.as_str().into(),
        builds: with_builds.then(|| {
            vec![wire::TemplateBuildSummary {
                build_id: build.id.clone(),
                status: build.status.as_str().into(),
                created_at: rfc3339_ms(build.created_at_ms),
                updated_at: rfc3339_ms(build.updated_at_ms),
                cpu_count: build.cpu_count,
                memory_mb: build.memory_mb,
            }]
        }),
    }
}
