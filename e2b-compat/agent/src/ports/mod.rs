//! Traffic for a sandbox port other than the agent's own (49983): the
//! gateway forwards it here, and the agent, which lives in the
//! sandbox's network namespace, relays it to `127.0.0.1:<port>` — the code
//! interpreter on 49999, or any server a user starts. Nothing outside the
//! sandbox can reach its loopback any other way. Responses stream through
//! as they are produced, and WebSocket upgrades are spliced (`copse_protocol::upgrade`).
//!
//! The envd access token and the traffic token are removed here, the one
//! place every request to an in-sandbox port passes: whatever listens on a
//! port may be untrusted code as `user`, and the access token would make it
//! root through this agent. What the listener learns instead is whether the
//! caller presented the token (`x-copse-caller-authenticated`), which is
//! how the code interpreter refuses strangers.
//!
//! A port the sandbox's `network.httpsPorts` lists is reached over TLS
//! (`tls`): the gateway marks such requests with `x-copse-port-tls`, a
//! header it never lets a client set, and which is removed here too.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use copse_protocol::headers::{
    ACCESS_TOKEN, AGENT_PORT, CALLER_AUTHENTICATED, PORT_TLS, SANDBOX_PORT, TRAFFIC_ACCESS_TOKEN,
};
use copse_protocol::upgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::auth::{self, json_error};
use crate::state::SharedState;

mod tls;

pub async fn relay_other_ports(State(state): State<SharedState>, request: Request, next: Next) -> Response {
    let port = request.headers().get(SANDBOX_PORT).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u16>().ok());
    match port {
        Some(port) if port != AGENT_PORT => {
            let authenticated = auth::token_ok(&state, request.headers());
            let over_tls = request.headers().get(PORT_TLS).is_some_and(|v| v.as_bytes() == b"1");
            relay(port, authenticated, over_tls, request).await
        }
        _ => next.run(request).await,
    }
}

/// Headers only the gateway and this agent may read or write.
const PRIVATE_HEADERS: [&str; 4] = [ACCESS_TOKEN, TRAFFIC_ACCESS_TOKEN, CALLER_AUTHENTICATED, PORT_TLS];

/// `authenticated`: the caller presented the access token; the listener
/// learns that much and no more. `over_tls`: the port serves HTTPS.
async fn relay(port: u16, authenticated: bool, over_tls: bool, mut request: Request) -> Response {
    for name in PRIVATE_HEADERS {
        request.headers_mut().remove(name);
    }
    if authenticated {
        request.headers_mut().insert(CALLER_AUTHENTICATED, HeaderValue::from_static("1"));
    }
    let stream = match TcpStream::connect(("127.0.0.1", port)).await {
        Ok(stream) => stream,
        // The SDK reads "port is not open" as SandboxUnreachable.
        Err(e) => return json_error(StatusCode::BAD_GATEWAY, format!("port is not open: {port} ({e})")),
    };
    let _ = stream.set_nodelay(true);
    if !over_tls {
        return exchange(port, stream, request).await;
    }
    match tls::connect(stream).await {
        Ok(stream) => exchange(port, stream, request).await,
        Err(e) => json_error(StatusCode::BAD_GATEWAY, format!("port {port}: TLS handshake failed: {e}")),
    }
}

/// One HTTP/1.1 exchange with the port's server over `io`, plain or TLS.
async fn exchange<T>(port: u16, io: T, mut request: Request) -> Response
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = match hyper::client::conn::http1::handshake(TokioIo::new(io)).await {
        Ok(pair) => pair,
        Err(e) => return json_error(StatusCode::BAD_GATEWAY, format!("port {port}: {e}")),
    };
    tokio::spawn(async move {
        if let Err(e) = connection.with_upgrades().await {
            tracing::debug!("relay to port {port} ended: {e}");
        }
    });
    let client_upgrade = upgrade::take(&mut request);
    match sender.send_request(request).await {
        Ok(mut response) => {
            upgrade::splice(client_upgrade, &mut response);
            response.map(Body::new)
        }
        Err(e) => json_error(StatusCode::BAD_GATEWAY, format!("port {port}: {e}")),
    }
}
