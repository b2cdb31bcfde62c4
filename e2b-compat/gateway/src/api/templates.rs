//! The SDK's template build routes (`Template.build`): request a build,
//! the upload link and the upload of a copy step's files, start the build,
//! poll its status and log; find, list, publish and delete built
//! templates; their tags; the templates copse ships.

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::routing::{get, patch, post, put};
use axum::{Extension, Router};

use super::control::{ApiResult, Service, rfc3339_ms};
use super::error::ApiError;
use super::host_routing::Exposure;
use super::wire;
use crate::model::{ENVD_VERSION, Tag, TemplateLabels, TemplateRecord};
use crate::service::{BuildSpec, LogWindow, RawStep};
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
        .route("/templates/{id}/builds/{build_id}/logs", get(build_logs))
        .route("/templates/aliases/{alias}", get(alias))
        .route("/templates/{id}", get(detail).delete(delete).patch(update))
        .route("/v2/templates/{id}", patch(update_v2))
        .route("/v2/templates", get(list))
        .route("/default-templates", get(defaults))
        .route("/templates/tags", post(assign_tags).delete(remove_tags))
        .route("/templates/{id}/tags", get(tags))
        .route("/templates/{id}/tags/count", get(tag_count))
        .route("/templates/{id}/tags/exists", get(tag_exists))
        .route("/templates/{id}/tags/groups", get(tag_groups))
        .route("/templates/{id}/tags/{tag}/assignments", get(tag_assignments))
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
    let extra = body.tags.unwrap_or_default();
    let (record, labels, tags) = svc.request_build(&who.caller, &name, &extra, body.cpu_count, body.memory_mb).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(wire::TemplateRequested {
            template_id: record.id,
            build_id: record.build.id,
            public: labels.public,
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
        .into_iter()
        .map(|s| RawStep { kind: s.kind, args: s.args, files_hash: s.files_hash, force: s.force })
        .collect();
    let spec = BuildSpec {
        from_template: body.from_template,
        from_image: body.from_image,
        steps,
        force: body.force,
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
    let (record, labels) = svc.tagged_template(&who.caller, &alias)?;
    Ok(Json(wire::TemplateAlias { template_id: record.id, public: labels.public }))
}

async fn detail(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::BuiltTemplate>> {
    let (record, labels) = svc.tagged_template(&who.caller, &id)?;
    Ok(Json(built(&record, &labels, true)))
}

async fn list(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
) -> ApiResult<Json<Vec<wire::BuiltTemplate>>> {
    let mut out = Vec::new();
    for record in svc.built_templates(&who.caller)? {
        let labels = svc.template_labels(&record)?;
        out.push(built(&record, &labels, false));
    }
    Ok(Json(out))
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

fn built(record: &TemplateRecord, labels: &TemplateLabels, with_builds: bool) -> wire::BuiltTemplate {
    let build = &record.build;
    wire::BuiltTemplate {
        template_id: record.id.clone(),
        build_id: build.id.clone(),
        cpu_count: build.cpu_count,
        memory_mb: build.memory_mb,
        disk_size_mb: 0,
        public: labels.public,
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
        is_default: None,
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

async fn build_logs(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path((id, build_id)): Path<(String, String)>,
    Query(query): Query<wire::BuildLogsQuery>,
) -> ApiResult<Json<wire::BuildLogs>> {
    let record = svc.build_status(&who.caller, &id, &build_id)?;
    let window = LogWindow {
        cursor: query.cursor,
        limit: query.limit,
        direction: query.direction.as_deref(),
        level: query.level.as_deref(),
    };
    let lines = crate::service::log_window(&record.build.log, &window)?;
    Ok(Json(wire::BuildLogs { logs: lines.into_iter().map(log_entry).collect() }))
}

/// `PATCH /templates/{id}`: E2B answers with no body.
async fn update(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::TemplateUpdate>>,
) -> ApiResult<StatusCode> {
    patch_template(&svc, &who, &id, body)?;
    Ok(StatusCode::OK)
}

/// `PATCH /v2/templates/{id}`: the same, answering with the names.
async fn update_v2(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    body: Option<Json<wire::TemplateUpdate>>,
) -> ApiResult<Json<wire::TemplateUpdated>> {
    let record = patch_template(&svc, &who, &id, body)?;
    Ok(Json(wire::TemplateUpdated { names: vec![record.name] }))
}

fn patch_template(
    svc: &Service,
    who: &Principal,
    id: &str,
    body: Option<Json<wire::TemplateUpdate>>,
) -> ApiResult<TemplateRecord> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    match body.public {
        Some(public) => Ok(svc.set_public(&who.caller, id, public)?),
        None => Ok(svc.built_template(&who.caller, id)?),
    }
}

/// `GET /default-templates`: the templates copse ships (and any the
/// operator built with `copse template build`), usable by every team.
async fn defaults(State(svc): State<Service>) -> ApiResult<Json<Vec<wire::BuiltTemplate>>> {
    let templates = svc.templates().await?;
    Ok(Json(
        templates
            .into_iter()
            .map(|t| {
                let at = rfc3339_ms(i64::try_from(t.built_at).unwrap_or(0).saturating_mul(1000));
                wire::BuiltTemplate {
                    template_id: t.name.clone(),
                    build_id: format!("{}-{}", t.name, t.built_at),
                    cpu_count: 0,
                    memory_mb: 0,
                    disk_size_mb: t.size_bytes >> 20,
                    public: true,
                    aliases: vec![t.name.clone()],
                    names: vec![t.name],
                    created_at: at.clone(),
                    updated_at: at,
                    created_by: None,
                    last_spawned_at: None,
                    spawn_count: 0,
                    build_count: 1,
                    envd_version: ENVD_VERSION.into(),
                    build_status: "ready".into(),
                    is_default: Some(true),
                    builds: None,
                }
            })
            .collect(),
    ))
}

async fn assign_tags(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    body: Option<Json<wire::AssignTags>>,
) -> ApiResult<(StatusCode, Json<wire::AssignedTags>)> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    let (build_id, tags) = svc.assign_tags(&who.caller, &body.target, &body.tags).await?;
    Ok((StatusCode::CREATED, Json(wire::AssignedTags { tags, build_id })))
}

async fn remove_tags(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    body: Option<Json<wire::RemoveTags>>,
) -> ApiResult<StatusCode> {
    let Json(body) = body.ok_or_else(|| ApiError::bad_request("request body must be a JSON object"))?;
    svc.remove_tags(&who.caller, &body.name, &body.tags).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn tags(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<Vec<wire::TemplateTag>>> {
    let (_, labels) = svc.tagged_template(&who.caller, &id)?;
    Ok(Json(
        labels
            .tags
            .iter()
            .map(|t| wire::TemplateTag {
                tag: t.name.clone(),
                build_id: t.build_id().to_string(),
                created_at: rfc3339_ms(t.assigned_at_ms()),
            })
            .collect(),
    ))
}

async fn tag_count(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
) -> ApiResult<Json<wire::TagCount>> {
    let (_, labels) = svc.tagged_template(&who.caller, &id)?;
    Ok(Json(wire::TagCount { total: labels.tags.len() }))
}

async fn tag_exists(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    Query(query): Query<wire::TagExistsQuery>,
) -> ApiResult<Json<wire::TagExists>> {
    let (_, labels) = svc.tagged_template(&who.caller, &id)?;
    let tag = crate::model::normalize_tag(&query.tag)?;
    Ok(Json(wire::TagExists { exists: labels.tag(&tag).is_some(), normalized_tag: tag }))
}

/// At most this many tags, and assignments per tag, per page.
const MAX_TAG_PAGE: usize = 100;

async fn tag_groups(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path(id): Path<String>,
    Query(query): Query<wire::TagGroupsQuery>,
) -> ApiResult<Json<wire::TagGroups>> {
    let (record, labels) = svc.tagged_template(&who.caller, &id)?;
    let search = query.search.as_deref().map(str::to_ascii_lowercase).unwrap_or_default();
    let mut found: Vec<Tag> = labels.tags.into_iter().filter(|t| t.name.contains(&search)).collect();
    crate::service::sort_tags(&mut found, query.sort.as_deref())?;
    let limit = query.tags_limit.unwrap_or(25).min(MAX_TAG_PAGE);
    let (found, next_cursor) = crate::service::page(found, query.tags_cursor.as_deref(), limit)?;
    let per_tag = query.assignment_limit.unwrap_or(6).min(MAX_TAG_PAGE);
    let tags = found
        .iter()
        .map(|t| wire::TagGroup {
            tag: t.name.clone(),
            assignments: t.assignments.iter().take(per_tag).map(|a| assignment(&record, a)).collect(),
            has_more: t.assignments.len() > per_tag,
        })
        .collect();
    Ok(Json(wire::TagGroups { tags, next_cursor }))
}

async fn tag_assignments(
    State(svc): State<Service>,
    Extension(who): Extension<Principal>,
    Path((id, tag)): Path<(String, String)>,
    Query(query): Query<wire::TagAssignmentsQuery>,
) -> ApiResult<Json<wire::TagAssignments>> {
    let (record, labels) = svc.tagged_template(&who.caller, &id)?;
    let tag = crate::model::normalize_tag(&tag)?;
    let found = labels.tag(&tag).ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no tag {tag:?}")))?;
    let limit = query.limit.unwrap_or(50).min(MAX_TAG_PAGE);
    let (page, next_cursor) = crate::service::page(found.assignments.clone(), query.cursor.as_deref(), limit)?;
    Ok(Json(wire::TagAssignments { data: page.iter().map(|a| assignment(&record, a)).collect(), next_cursor }))
}

/// What copse knows of an assignment's build: the times of the latest
/// build; of an earlier one, only when the tag was pointed at it.
fn assignment(record: &TemplateRecord, a: &crate::model::TagAssignment) -> wire::TagAssignment {
    let latest = (a.build_id == record.build.id).then_some(&record.build);
    let finished =
        latest.filter(|b| matches!(b.status, crate::model::BuildStatus::Ready | crate::model::BuildStatus::Error));
    wire::TagAssignment {
        assignment_id: a.id.clone(),
        build_id: a.build_id.clone(),
        assigned_at: rfc3339_ms(a.assigned_at_ms),
        build_created_at: rfc3339_ms(latest.map_or(a.assigned_at_ms, |b| b.created_at_ms)),
        build_finished_at: finished.map(|b| rfc3339_ms(b.updated_at_ms)),
    }
}
