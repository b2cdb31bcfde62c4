//! HTTP/1.1 to a host with `network.rules`, request by request: hyper
//! serves the sandbox's side of the connection (plain on port 80, or inside
//! the TLS [`super::intercept`] terminated), each request is checked to
//! name the host the connection was admitted for ([`rules::addressed`]),
//! gets the rule's headers ([`rules::apply`]) and goes on over one hyper
//! client connection to the upstream the sandbox chose. Bodies stream both
//! ways; nothing is buffered whole. A kept-alive connection so has every
//! request transformed, not only its first.
//!
//! Either side's `Connection: close` is honoured: a client's goes upstream
//! as it is; an upstream that will close after its response (it says so, or
//! speaks HTTP/1.0 without keep-alive) has the response say `Connection:
//! close` to the client, and hyper ends the client's side after it, so the
//! client's next request opens a new connection instead of meeting a closed
//! one. A refused request is answered (400, 421, 501 or 502, with why) and
//! the connection closed; CONNECT and upgrades are refused, not spliced.
//!
//! Inside intercepted TLS the client may have chosen HTTP/2 (ALPN). Its
//! streams are served by hyper's HTTP/2 server and go upstream one at a
//! time as HTTP/1.1 requests, each with a `Host` made from its
//! `:authority`, as an HTTP/2-to-1.1 intermediary does, so the same check
//! and rule apply to every stream. HTTP/2 has no `Connection`: a refused
//! stream is answered alone (the connection's other streams are each
//! checked anyway), and an upstream that closes ends the client's
//! connection gracefully (GOAWAY) once the streams in flight are answered.

use std::convert::Infallible;
use std::net::TcpStream as StdTcpStream;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Request, Response, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::runtime::Runtime;
use tokio::sync::{Mutex, Notify};

use super::intercept::Prefixed;
use super::rules::{self, HostRules, Intercept, Misdirected, SecretResolver};

/// How long a client may take over one request head, idle time on a
/// kept-alive connection included (hyper's timer starts when it waits for
/// a head): an idle connection is closed after it, as servers do, rather
/// than holding one of the sandbox's proxied connections.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

type Body = Either<Incoming, Full<Bytes>>;
type Resolve = dyn Fn(&str, &str) -> Option<String> + Send + Sync;

/// The resolver a request's placeholders are filled by: none yet resolves
/// nothing, so a request whose rule names a secret is refused, never sent
/// without it.
fn resolver(resolve: Option<&SecretResolver>) -> &Resolve {
    fn unresolved(_: &str, _: &str) -> Option<String> {
        None
    }
    match resolve {
        Some(resolve) => resolve.as_ref(),
        None => &unresolved,
    }
}

/// For the blocking proxy (a thread per connection): serves `client`,
/// after replaying what was peeked of it (`target.hello`), on `runtime`,
/// the one `upstream` lives in.
pub fn serve_blocking<U>(
    runtime: &Runtime,
    client: StdTcpStream,
    upstream: U,
    mut target: Intercept<'_>,
    resolve: Option<&SecretResolver>,
) -> anyhow::Result<()>
where
    U: AsyncRead + AsyncWrite + Unpin,
{
    let hello = std::mem::take(&mut target.hello);
    block_on_client(runtime, client, hello, |client| async move {
        serve(client, ClientProtocol::Http1, upstream, &target, resolve).await
    })
}

/// Runs `serve` on `runtime` with the blocking proxy's `client` made async,
/// `hello` (what was peeked of it) read first.
pub(super) fn block_on_client<F, Fut>(
    runtime: &Runtime,
    client: StdTcpStream,
    hello: Vec<u8>,
    serve: F,
) -> anyhow::Result<()>
where
    F: FnOnce(Prefixed) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    runtime.block_on(async {
        client.set_nonblocking(true)?;
        serve(Prefixed::new(hello, TcpStream::from_std(client)?)).await
    })
}

/// The protocol the client speaks to the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientProtocol {
    Http1,
    /// Chosen by ALPN inside intercepted TLS.
    Http2,
}

/// Serves `client`'s requests to `upstream` until either side closes.
pub async fn serve<C, U>(
    client: C,
    protocol: ClientProtocol,
    upstream: U,
    target: &Intercept<'_>,
    resolve: Option<&SecretResolver>,
) -> anyhow::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let (sender, connection) = hyper::client::conn::http1::handshake::<_, Incoming>(TokioIo::new(upstream)).await?;
    tokio::pin!(connection);
    match protocol {
        ClientProtocol::Http1 => {
            let sender = &Mutex::new(sender);
            let resolve = resolver(resolve);
            let service = hyper::service::service_fn(move |request| async move {
                Ok::<_, Infallible>(exchange(request, protocol, sender, target, resolve).await)
            });
            let server = http1_server()
                // A client that shuts its side after its request still gets
                // the response, as when the connection was spliced.
                .half_close(true)
                .serve_connection(TokioIo::new(client), service);
            tokio::pin!(server);
            tokio::select! {
                served = &mut server => served?,
                // The upstream is gone; the response in flight still reaches
                // the client, which was told to close after it.
                _ = &mut connection => server.await?,
            }
        }
        ClientProtocol::Http2 => {
            // hyper runs each stream as a task of its own: what it needs is
            // owned, not borrowed from this call.
            let shared = Arc::new(Streams {
                sender: Mutex::new(sender),
                name: target.name.clone(),
                owner: target.owner.to_string(),
                rules: target.rules.clone(),
                resolve: resolve.cloned(),
            });
            let service = hyper::service::service_fn(move |request| {
                let shared = shared.clone();
                async move {
                    let target = Intercept {
                        name: shared.name.clone(),
                        owner: &shared.owner,
                        rules: &shared.rules,
                        hello: vec![],
                    };
                    let resolve = resolver(shared.resolve.as_ref());
                    Ok::<_, Infallible>(exchange(request, protocol, &shared.sender, &target, resolve).await)
                }
            });
            let server =
                http2_server().keep_alive_interval(HEAD_TIMEOUT).serve_connection(TokioIo::new(client), service);
            tokio::pin!(server);
            tokio::select! {
                served = &mut server => served?,
                _ = &mut connection => {
                    server.as_mut().graceful_shutdown();
                    server.await?
                }
            }
        }
    }
    Ok(())
}

/// Answers `client`'s request with `status` and `why`, then closes: an
/// intercepted connection whose upstream could not be had. Over HTTP/2,
/// streams already open get the same answer before the GOAWAY.
pub async fn refuse<C>(client: C, protocol: ClientProtocol, status: StatusCode, why: &str) -> anyhow::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let why: Arc<str> = why.into();
    let answered = Arc::new(Notify::new());
    let service = {
        let answered = answered.clone();
        hyper::service::service_fn(move |_: Request<Incoming>| {
            answered.notify_one();
            let response = refusal(status, &why, protocol);
            async move { Ok::<_, Infallible>(response) }
        })
    };
    match protocol {
        // The refusal says `Connection: close`: hyper closes after it.
        ClientProtocol::Http1 => http1_server().serve_connection(TokioIo::new(client), service).await?,
        ClientProtocol::Http2 => {
            let server = http2_server().serve_connection(TokioIo::new(client), service);
            tokio::pin!(server);
            tokio::select! {
                served = &mut server => served?,
                _ = tokio::time::timeout(HEAD_TIMEOUT, answered.notified()) => {
                    server.as_mut().graceful_shutdown();
                    server.await?
                }
            }
        }
    }
    Ok(())
}

/// The sandbox side's HTTP/1.1 server: a head must come within
/// [`HEAD_TIMEOUT`].
fn http1_server() -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(HEAD_TIMEOUT);
    builder
}

/// The sandbox side's HTTP/2 server; hyper runs each stream as a task.
fn http2_server() -> hyper::server::conn::http2::Builder<TokioExecutor> {
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder.timer(TokioTimer::new());
    builder
}

/// A connection's target and upstream, for its HTTP/2 streams.
struct Streams {
    sender: Mutex<SendRequest<Incoming>>,
    name: Option<String>,
    owner: String,
    rules: HostRules,
    resolve: Option<SecretResolver>,
}

/// One request: checked, transformed, sent, and its response passed back.
async fn exchange(
    request: Request<Incoming>,
    protocol: ClientProtocol,
    sender: &Mutex<SendRequest<Incoming>>,
    target: &Intercept<'_>,
    resolve: &Resolve,
) -> Response<Body> {
    let h2 = protocol == ClientProtocol::Http2;
    let (mut parts, body) = request.into_parts();
    if h2 {
        if let Err(why) = host_from_authority(&parts.uri, &mut parts.headers) {
            return refusal(status(&why), &why.to_string(), protocol);
        }
        parts.version = Version::HTTP_11;
    }
    parts.uri = match rules::addressed(&parts.method, &parts.uri, &parts.headers, target.name.as_deref()) {
        Ok(uri) => uri,
        Err(why) => {
            tracing::info!(name = ?target.name, "egress request refused: {why}");
            return refusal(status(&why), &why.to_string(), protocol);
        }
    };
    let close = closes(parts.version, &parts.headers);
    if let Err(e) = rules::apply(&mut parts.headers, target.rules, target.owner, resolve) {
        tracing::info!(name = ?target.name, "egress request refused: {e}");
        return refusal(StatusCode::BAD_GATEWAY, &e.to_string(), protocol);
    }
    if close {
        parts.headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    let mut sender = sender.lock().await;
    let sent = match sender.ready().await {
        Ok(()) => sender.send_request(Request::from_parts(parts, body)).await,
        Err(e) => Err(e),
    };
    match sent {
        Ok(response) => {
            let (mut parts, body) = response.into_parts();
            let upstream_closes = closes(parts.version, &parts.headers);
            rules::strip_hop_by_hop(&mut parts.headers);
            if (upstream_closes || close) && !h2 {
                parts.headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            parts.version = if h2 { Version::HTTP_2 } else { Version::HTTP_11 };
            Response::from_parts(parts, Either::Left(body))
        }
        Err(e) => {
            tracing::info!(name = ?target.name, "egress request failed upstream: {e}");
            refusal(StatusCode::BAD_GATEWAY, &format!("the upstream: {e}"), protocol)
        }
    }
}

/// An HTTP/2 request's `Host`, as HTTP/1.1 carries it: its `:authority`
/// (RFC 9113 8.3.1). A request that has both keeps its `Host`, which
/// [`rules::addressed`] then checks against the authority too.
fn host_from_authority(uri: &hyper::Uri, headers: &mut HeaderMap) -> Result<(), Misdirected> {
    if headers.contains_key(header::HOST) {
        return Ok(());
    }
    let authority = uri.authority().ok_or(Misdirected::BadHost)?;
    let value = HeaderValue::from_str(authority.as_str()).map_err(|_| Misdirected::BadHost)?;
    headers.insert(header::HOST, value);
    Ok(())
}

fn status(why: &Misdirected) -> StatusCode {
    match why {
        Misdirected::OtherHost => StatusCode::MISDIRECTED_REQUEST,
        Misdirected::Tunnel => StatusCode::NOT_IMPLEMENTED,
        Misdirected::BadHost | Misdirected::OtherTarget => StatusCode::BAD_REQUEST,
    }
}

/// Whether the connection a message came on ends after it.
fn closes(version: Version, headers: &HeaderMap) -> bool {
    let has = |token: &str| {
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    };
    has("close") || (version < Version::HTTP_11 && !has("keep-alive"))
}

/// The proxy's own answer; an HTTP/1.1 connection closes after it.
fn refusal(status: StatusCode, why: &str, protocol: ClientProtocol) -> Response<Body> {
    let body = format!("copse egress proxy: {why}\n");
    let mut response = Response::new(Either::Right(Full::new(Bytes::from(body))));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    if protocol == ClientProtocol::Http1 {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex as StdMutex};

    use http_body_util::BodyExt;

    use super::*;
    use crate::egress::rules::{HeaderRules, Rule};

    #[test]
    fn http_1_0_closes_unless_kept_alive_and_close_always_closes() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONNECTION, HeaderValue::from_str(value).unwrap());
            headers
        };
        assert!(!closes(Version::HTTP_11, &HeaderMap::new()));
        assert!(closes(Version::HTTP_11, &with("Keep-Alive, close")));
        assert!(closes(Version::HTTP_10, &HeaderMap::new()));
        assert!(!closes(Version::HTTP_10, &with("keep-alive")));
    }

    /// What the upstream saw: (target, Authorization) per request.
    type Seen = Arc<StdMutex<Vec<(String, Option<String>)>>>;

    /// An upstream on one in-memory connection that records each request
    /// and answers it with its body, closing after `close_after` requests.
    fn upstream(close_after: usize) -> (tokio::io::DuplexStream, Seen) {
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let seen: Seen = Arc::default();
        let recorded = seen.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                let recorded = recorded.clone();
                async move {
                    let auth = request.headers().get("authorization").map(|v| v.to_str().unwrap().to_string());
                    let count = {
                        let mut seen = recorded.lock().unwrap();
                        seen.push((request.uri().to_string(), auth));
                        seen.len()
                    };
                    let body = request.into_body().collect().await.unwrap().to_bytes();
                    let mut response = Response::new(Full::new(body));
                    if count >= close_after {
                        response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                    }
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(theirs), service).await;
        });
        (ours, seen)
    }

    fn rules() -> HeaderRules {
        let rule = Rule { headers: Some(vec![("Authorization".into(), "Bearer ${e2b.secrets.key}".into())]) };
        HeaderRules::from_e2b("team", vec![("api.test".into(), vec![rule])]).unwrap()
    }

    fn resolve(owner: &str, name: &str) -> Option<String> {
        (owner == "team" && name == "key").then(|| "s3cr3t".to_string())
    }

    /// Sends `requests` (target, Host) on one client connection through the
    /// proxy's [`serve`]; answers (status, Connection, body) until one fails.
    async fn through_proxy(close_after: usize, requests: &[(&str, &str)]) -> (Vec<(u16, String, String)>, Seen) {
        let set = rules();
        let (client, proxy_side) = tokio::io::duplex(64 * 1024);
        let (to_upstream, seen) = upstream(close_after);
        let serving = async {
            let target =
                Intercept { name: Some("api.test".into()), owner: &set.owner, rules: &set.hosts[0], hello: vec![] };
            let resolve: SecretResolver = Arc::new(resolve);
            let _ = serve(proxy_side, ClientProtocol::Http1, to_upstream, &target, Some(&resolve)).await;
        };
        let asking = async {
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(client)).await.unwrap();
            tokio::spawn(async move {
                let _ = connection.await;
            });
            let mut answers = Vec::new();
            for (uri, host) in requests {
                if sender.ready().await.is_err() {
                    break;
                }
                let request = Request::post(*uri)
                    .header(header::HOST, *host)
                    .header("authorization", "forged")
                    .body(Full::new(Bytes::from(format!("body of {uri}"))))
                    .unwrap();
                let Ok(response) = sender.send_request(request).await else { break };
                let status = response.status().as_u16();
                let connection =
                    response.headers().get(header::CONNECTION).map_or("", |v| v.to_str().unwrap()).to_string();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                answers.push((status, connection, String::from_utf8_lossy(&body).into_owned()));
            }
            answers
        };
        let (_, answers) = tokio::join!(serving, asking);
        (answers, seen)
    }

    #[tokio::test]
    async fn every_request_on_a_kept_alive_connection_gets_the_rule() {
        let (answers, seen) =
            through_proxy(usize::MAX, &[("/one", "api.test"), ("http://api.test/two?x=1", "api.test")]).await;
        assert_eq!(
            answers,
            [
                (200, String::new(), "body of /one".into()),
                (200, String::new(), "body of http://api.test/two?x=1".into())
            ]
        );
        let bearer = Some("Bearer s3cr3t".to_string());
        assert_eq!(*seen.lock().unwrap(), [("/one".into(), bearer.clone()), ("/two?x=1".into(), bearer)]);
    }

    #[tokio::test]
    async fn a_request_for_another_host_is_refused_and_the_connection_closed() {
        let requests = [("/one", "api.test"), ("/two", "other.test"), ("/three", "api.test")];
        let (answers, seen) = through_proxy(usize::MAX, &requests).await;
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert_eq!((answers[1].0, answers[1].1.as_str()), (421, "close"));
        let (answers, seen_absolute) = through_proxy(usize::MAX, &[("http://other.test/", "api.test")]).await;
        assert_eq!((answers[0].0, answers[0].1.as_str()), (400, "close"), "{answers:?}");
        assert_eq!(seen.lock().unwrap().len(), 1, "only the first request went upstream");
        assert!(seen_absolute.lock().unwrap().is_empty());
    }

    /// An HTTP/2 client on `io`, its connection driven in the background.
    async fn http2_client(io: tokio::io::DuplexStream) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
        let (sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io)).await.unwrap();
        tokio::spawn(connection);
        sender
    }

    #[tokio::test]
    async fn each_http2_stream_gets_the_rule_and_one_for_another_host_is_refused_alone() {
        let set = rules();
        let (client, proxy_side) = tokio::io::duplex(64 * 1024);
        let (to_upstream, seen) = upstream(usize::MAX);
        let resolve: SecretResolver = Arc::new(resolve);
        let serving = async {
            let target =
                Intercept { name: Some("api.test".into()), owner: &set.owner, rules: &set.hosts[0], hello: vec![] };
            let _ = serve(proxy_side, ClientProtocol::Http2, to_upstream, &target, Some(&resolve)).await;
        };
        let asking = async {
            let mut sender = http2_client(client).await;
            let mut answers = Vec::new();
            for uri in ["https://api.test/one", "https://other.test/two", "https://api.test/three?x=1"] {
                sender.ready().await.unwrap();
                let request = Request::post(uri)
                    .header("authorization", "forged")
                    .body(Full::new(Bytes::from(format!("body of {uri}"))))
                    .unwrap();
                let response = sender.send_request(request).await.unwrap();
                assert_eq!(response.version(), Version::HTTP_2);
                assert!(response.headers().get(header::CONNECTION).is_none());
                let status = response.status().as_u16();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                answers.push((status, String::from_utf8_lossy(&body).into_owned()));
            }
            answers
        };
        let (_, answers) = tokio::join!(serving, asking);
        assert_eq!(answers[0], (200, "body of https://api.test/one".into()));
        assert_eq!(answers[1].0, 421, "{answers:?}");
        assert_eq!(answers[2], (200, "body of https://api.test/three?x=1".into()));
        let bearer = Some("Bearer s3cr3t".to_string());
        assert_eq!(*seen.lock().unwrap(), [("/one".into(), bearer.clone()), ("/three?x=1".into(), bearer)]);
    }

    #[tokio::test]
    async fn a_refused_connection_gets_its_answer_in_the_clients_protocol() {
        let (client, proxy_side) = tokio::io::duplex(64 * 1024);
        let refusing = refuse(proxy_side, ClientProtocol::Http1, StatusCode::BAD_GATEWAY, "no upstream");
        let asking = async {
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake::<_, Full<Bytes>>(TokioIo::new(client)).await.unwrap();
            tokio::spawn(connection);
            let response = sender.send_request(Request::get("/").body(Full::default()).unwrap()).await.unwrap();
            (response.status(), response.headers().get(header::CONNECTION).cloned())
        };
        let (_, (status, connection)) = tokio::join!(refusing, asking);
        assert_eq!((status, connection), (StatusCode::BAD_GATEWAY, Some(HeaderValue::from_static("close"))));

        let (client, proxy_side) = tokio::io::duplex(64 * 1024);
        let refusing = refuse(proxy_side, ClientProtocol::Http2, StatusCode::GATEWAY_TIMEOUT, "no upstream");
        let asking = async {
            let mut sender = http2_client(client).await;
            let request = Request::get("https://api.test/").body(Full::default()).unwrap();
            let response = sender.send_request(request).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            String::from_utf8_lossy(&body).into_owned()
        };
        // The client may be gone before the GOAWAY: how `refuse` ends is
        // not what counts, the answer is.
        let (_, body) = tokio::join!(refusing, asking);
        assert!(body.contains("no upstream"), "{body}");
    }

    #[tokio::test]
    async fn an_upstream_that_closes_has_the_client_told_to_close() {
        let (answers, seen) = through_proxy(1, &[("/one", "api.test"), ("/two", "api.test")]).await;
        assert_eq!(answers, [(200, "close".to_string(), "body of /one".to_string())]);
        assert_eq!(seen.lock().unwrap().len(), 1);
    }
}
