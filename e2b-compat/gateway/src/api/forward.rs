//! Calls for a sandbox on another node of a shared database, sent to that
//! node's gateway: the SDK may talk to any gateway, and only the node
//! whose host runs a sandbox can act on it. Creates go to the node that
//! [`Sandboxes::place_create`] picks; on an API front, which runs no
//! sandboxes, template builds and volumes go to a node too.
//!
//! The request is passed on whole (its API key or access token, its body
//! streamed, an upgrade spliced through), so the owner checks the caller as
//! it would a direct call; it is marked with this node's id, and a marked
//! request is never forwarded again. When the cluster has a CA
//! (`tls::cluster`) calls go over mutual TLS to each node's peer listener,
//! and only that listener honours a mark: on the public one any caller
//! could write it. A call for a sandbox on a lost node is a 503 that says
//! so, except describing or killing one paused in the object store, which
//! any gateway does.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio_rustls::rustls::ClientConfig;

use super::error::ApiError;
use super::{template_nodes, volume_nodes};
use crate::model::{NodeRecord, SandboxError};
use crate::service::{Owner, Sandboxes, Volumes};
use crate::tenancy::Principal;

/// Marks a request one gateway passed to another, naming the sender.
pub const FORWARDED_BY: &str = "x-copse-forwarded-by";
/// A create's body is read before it is placed; E2B's are small JSON.
const MAX_CREATE_BODY: usize = 1 << 20;
/// Shorter than the time a node's listener keeps an idle connection (its
/// header timeout), so a pooled connection is not reused as it closes.
const POOL_IDLE: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How this node reaches the others: kept-alive connections, over mutual
/// TLS when the cluster has a CA. A request extension on every route.
#[derive(Clone)]
pub struct Peers {
    client: Arc<RwLock<PeerClient>>,
    tls: Option<Arc<ClientConfig>>,
}

type PeerClient = Client<HttpsConnector<HttpConnector>, Body>;

/// On requests that came in over the peer listener, whose client showed a
/// certificate of the cluster's CA.
#[derive(Clone, Copy, Debug)]
pub struct PeerLink;

impl Peers {
    /// `tls`: the node's client side of the cluster's TLS; `None` for a
    /// cluster on loopback, which speaks plain HTTP.
    pub fn new(tls: Option<Arc<ClientConfig>>) -> Self {
        let client = Arc::new(RwLock::new(connect(tls.as_ref())));
        Self { client, tls }
    }

    /// Drops every kept-alive connection: after a newer revocation list, a
    /// node it names must not keep the connections made before it.
    pub fn renew(&self) {
        *self.client.write().expect("peer client lock") = connect(self.tls.as_ref());
    }

    fn client(&self) -> PeerClient {
        self.client.read().expect("peer client lock").clone()
    }
}

fn connect(tls: Option<&Arc<ClientConfig>>) -> PeerClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(CONNECT_TIMEOUT));
    let connector = match &tls {
        Some(config) => HttpsConnectorBuilder::new().with_tls_config(config.as_ref().clone()).https_only(),
        // No roots: an https:// node address fails rather than going
        // unverified (`cluster::api_url` refuses one anyway).
        None => HttpsConnectorBuilder::new().with_tls_config(no_roots()).https_or_http(),
    }
    .enable_http1()
    .wrap_connector(http);
    Client::builder(TokioExecutor::new()).pool_idle_timeout(POOL_IDLE).pool_timer(TokioTimer::new()).build(connector)
}

fn no_roots() -> ClientConfig {
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(tokio_rustls::rustls::RootCertStore::empty())
        .with_no_client_auth()
}

/// Whether another node forwarded `request`: it carries the mark, and,
/// when the cluster has TLS, came over the peer listener. The mark is
/// removed either way (a forward writes its own).
pub fn take_mark(request: &mut Request) -> bool {
    let marked = request.headers_mut().remove(FORWARDED_BY).is_some();
    let tls = request.extensions().get::<Peers>().is_none_or(|peers| peers.tls.is_some());
    marked && (!tls || request.extensions().get::<PeerLink>().is_some())
}

/// The control plane's part (inside the API-key check, so a create's team
/// is known): calls naming a sandbox go to its node, creates to the node
/// placement picks, and metrics of many sandboxes to each of their nodes
/// (`fan_out.rs`).
pub async fn control_plane(State(svc): State<Arc<Sandboxes>>, mut request: Request, next: Next) -> Response {
    if svc.node().is_none() {
        return next.run(request).await;
    }
    let forwarded = take_mark(&mut request);
    if let Some(id) = sandbox_in_path(&request) {
        let owner = if is_resume(&request) {
            svc.owner_for_resume(&id, forwarded)
        } else if is_describe_or_kill(&request) {
            svc.owner_for_record_call(&id)
        } else {
            svc.owner_of_sandbox(&id)
        };
        return match owner {
            Ok(Owner::Here) => next.run(request).await,
            Ok(owner) => to_owner(&svc, owner, &format!("sandbox {id}"), forwarded, request).await,
            Err(e) => ApiError::from(SandboxError::from(e)).into_response(),
        };
    }
    if forwarded {
        return next.run(request).await;
    }
    if super::fan_out::is_many_metrics(&request) {
        return super::fan_out::many_metrics(&svc, request, next).await;
    }
    let volumes = request.extensions().get::<Arc<Volumes>>().cloned();
    let caller = request.extensions().get::<Principal>().map(|p| p.caller.clone());
    if let (Some(volumes), Some(caller)) = (&volumes, &caller)
        && let Some((id, node)) = volume_nodes::delete_owner(&request, volumes, caller)
    {
        return where_held(&svc, request, next, &format!("volume {id}"), node.as_deref()).await;
    }
    if let Some(caller) = &caller
        && let Some((id, node)) = template_nodes::build_call_owner(&svc, &request, caller)
    {
        return where_held(&svc, request, next, &format!("template {id}"), node.as_deref()).await;
    }
    if let Some(what) = made_on_a_node(&request) {
        return match svc.place_work(what) {
            Ok(Owner::Here) => next.run(request).await,
            Ok(owner) => to_owner(&svc, owner, what, false, request).await,
            Err(e) => ApiError::from(e).into_response(),
        };
    }
    if !is_create(&request) {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let body = match axum::body::to_bytes(body, MAX_CREATE_BODY).await {
        Ok(body) => body,
        Err(e) => return ApiError::bad_request(format!("reading the request body: {e}")).into_response(),
    };
    // A body that is not the JSON a create takes is the handler's to refuse.
    let Ok(create) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return next.run(Request::from_parts(parts, Body::from(body))).await;
    };
    let request = Request::from_parts(parts, Body::from(body));
    let (Some(volumes), Some(caller)) = (volumes, caller) else {
        return next.run(request).await;
    };
    let template = create.get("templateID").and_then(|t| t.as_str()).unwrap_or(super::control::DEFAULT_TEMPLATE);
    // A sandbox mounting volumes runs where they are.
    match volume_nodes::create_owner(&svc, &volumes, &caller, &create) {
        Ok(None) => {}
        Ok(Some(Owner::Here)) => return next.run(request).await,
        Ok(Some(owner)) => return to_owner(&svc, owner, &format!("template {template}"), false, request).await,
        Err(e) => return e.into_response(),
    }
    match svc.place_create(&caller, template) {
        Ok(Owner::Here) => next.run(request).await,
        Ok(owner) => to_owner(&svc, owner, &format!("template {template}"), false, request).await,
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// Serves `request` here when what it is about (`what`, for errors) is
/// held by `node` and that is this node (or no node: from before nodes),
/// else sends it to `node`.
pub(super) async fn where_held(
    svc: &Sandboxes,
    request: Request,
    next: Next,
    what: &str,
    node: Option<&str>,
) -> Response {
    match svc.owner(node) {
        Ok(Owner::Here) => next.run(request).await,
        Ok(owner) => to_owner(svc, owner, what, false, request).await,
        Err(e) => ApiError::from(SandboxError::from(e)).into_response(),
    }
}

/// For a call that carries its own token (an upload link's, a volume's
/// content token): `locate` checks the token and names the node holding
/// what the call is about (and says what that is, for errors); this node
/// serves it or passes it there. A caller without a good token learns
/// nothing, not even which node that is.
pub(super) async fn where_token_says(
    svc: &Sandboxes,
    mut request: Request,
    next: Next,
    locate: impl FnOnce(&Request) -> Option<(String, Result<Option<String>, ApiError>)>,
) -> Response {
    if svc.node().is_none() || take_mark(&mut request) {
        return next.run(request).await;
    }
    let Some((what, node)) = locate(&request) else {
        return next.run(request).await;
    };
    match node {
        Ok(node) => where_held(svc, request, next, &what, node.as_deref()).await,
        Err(e) => e.into_response(),
    }
}

/// Sends `request` to `owner` (`what` names the thing it is about, for
/// errors); a request already forwarded to this node that finds it here
/// no more is refused rather than sent round again.
pub async fn to_owner(svc: &Sandboxes, owner: Owner, what: &str, forwarded: bool, request: Request) -> Response {
    match owner {
        Owner::Here => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "forwarding to this node").into_response(),
        Owner::Lost { node, last_heard_ms } => {
            ApiError::from(Owner::lost_error(what, &node, last_heard_ms)).into_response()
        }
        Owner::There(node) if forwarded => ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "{what} is on node {}, not on node {} that this call was forwarded to",
                node.id,
                svc.node().unwrap_or("-")
            ),
        )
        .into_response(),
        Owner::There(node) => match request.extensions().get::<Peers>().cloned() {
            Some(peers) => send(&peers, svc.node().unwrap_or_default(), &node, request).await,
            None => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "no way to reach other nodes").into_response(),
        },
    }
}

/// The sandbox id of a control-plane route that names one.
fn sandbox_in_path(request: &Request) -> Option<String> {
    let matched = request.extensions().get::<MatchedPath>()?.as_str();
    let names_sandbox = ["/sandboxes/{id}", "/v2/sandboxes/{id}", "/copse/sandboxes/{id}"]
        .iter()
        .any(|prefix| matched == *prefix || matched.starts_with(&format!("{prefix}/")));
    if !names_sandbox {
        return None;
    }
    let at = matched.split('/').position(|segment| segment == "{id}")?;
    request.uri().path().split('/').nth(at).map(str::to_string)
}

/// A connect or resume: a paused sandbox may move to the node that takes it.
fn is_resume(request: &Request) -> bool {
    let matched = request.extensions().get::<MatchedPath>().map(MatchedPath::as_str).unwrap_or_default();
    request.method() == axum::http::Method::POST && (matched.ends_with("/connect") || matched.ends_with("/resume"))
}

/// A call that reads or removes only the sandbox's record (and a paused
/// sandbox's files in the object store).
fn is_describe_or_kill(request: &Request) -> bool {
    let matched = request.extensions().get::<MatchedPath>().map(MatchedPath::as_str);
    matches!(*request.method(), axum::http::Method::GET | axum::http::Method::DELETE)
        && matched == Some("/sandboxes/{id}")
}

/// What a call makes that stays on the node serving it, other than a
/// sandbox: a template build (its steps run there) or a volume. An API
/// front passes it to a node ([`Sandboxes::place_work`]).
fn made_on_a_node(request: &Request) -> Option<&'static str> {
    let matched = request.extensions().get::<MatchedPath>().map(MatchedPath::as_str);
    match (request.method() == axum::http::Method::POST, matched) {
        (true, Some("/v3/templates")) => Some("a template build"),
        (true, Some("/volumes")) => Some("a volume"),
        _ => None,
    }
}

fn is_create(request: &Request) -> bool {
    let matched = request.extensions().get::<MatchedPath>().map(MatchedPath::as_str);
    request.method() == axum::http::Method::POST && matches!(matched, Some("/sandboxes" | "/v2/sandboxes"))
}

/// Passes `request` to `node`'s gateway.
pub(super) async fn send(peers: &Peers, from: &str, node: &NodeRecord, mut request: Request) -> Response {
    let unreachable = |e: &dyn std::fmt::Display| {
        tracing::warn!(node = %node.id, "forwarding to {}: {e}", node.api_url);
        ApiError::new(StatusCode::BAD_GATEWAY, format!("node {} is not reachable: {e}", node.id)).into_response()
    };
    // HTTP/2 carries the name in the URI, which becomes origin-form below.
    if !request.headers().contains_key(header::HOST)
        && let Some(host) = request.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        request.headers_mut().insert(header::HOST, host);
    }
    if let Ok(from) = HeaderValue::from_str(from) {
        request.headers_mut().insert(FORWARDED_BY, from);
    }
    super::proxy::origin_form(&mut request);
    // The pool picks a connection by the node's scheme and address; the
    // request goes on the wire in origin form, its Host header kept.
    match format!("{}{}", node.api_url, request.uri()).parse::<Uri>() {
        Ok(uri) => *request.uri_mut() = uri,
        Err(_) => return unreachable(&format!("its address {:?} is not a URL", node.api_url)),
    }
    let client_upgrade = copse_protocol::upgrade::take(&mut request);
    match peers.client().request(request).await {
        Ok(mut response) => {
            copse_protocol::upgrade::splice(client_upgrade, &mut response);
            response.map(Body::new)
        }
        // The client's error names only its kind; its sources say why.
        Err(e) => unreachable(&format!("{:#}", anyhow::Error::from(e))),
    }
}
