//! The HTTP listener, plain or TLS: one accept loop for both, bounding what
//! a client can hold: connections per address ([`per_client`]), the time to
//! send a request head and the time a connection may sit with nothing in
//! flight ([`idle`]). A client that opens connections and sends nothing,
//! or half a request, ends up holding nothing.

mod idle;
mod per_client;
mod unread_body;

use std::future::{Future, pending};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::CertificateDer;

use crate::tls::revocation::Revocations;

/// A client that connects and never finishes its TLS handshake must not
/// hold a task for ever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What one client may hold.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From accepting a connection (or finishing its last response) to
    /// having a whole request head. On HTTP/1.1 this is also the keep-alive
    /// idle time: hyper's header timer starts when a connection goes idle.
    pub header_timeout: Duration,
    /// How long a connection that has served a request may sit with no
    /// request in flight (HTTP/2 keeps connections open between requests).
    pub idle_timeout: Duration,
    /// Connections open at once from one address (an IPv6 client's /64).
    pub per_client: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { header_timeout: Duration::from_secs(10), idle_timeout: Duration::from_secs(60), per_client: 256 }
    }
}

/// A listener's TLS.
#[derive(Clone)]
pub struct Tls {
    pub acceptor: TlsAcceptor,
    /// For a listener that requires client certificates: the revocation
    /// list they are checked against again whenever a newer one is
    /// adopted. A connection whose client it now names is closed.
    pub revocations: Option<Arc<Revocations>>,
}

impl From<TlsAcceptor> for Tls {
    fn from(acceptor: TlsAcceptor) -> Self {
        Self { acceptor, revocations: None }
    }
}

/// Serves `app` on `listener` (over TLS with `tls`) until `shutdown`
/// resolves, then waits for open connections to finish (the caller bounds
/// that wait).
pub async fn serve(
    listener: TcpListener,
    tls: Option<Tls>,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    builder.http2().timer(TokioTimer::new());
    let app = app.layer(axum::middleware::from_fn(unread_body::read_before_refusing));
    let clients = per_client::Clients::new(limits.per_client);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                // Running out of descriptors must not end the server.
                Err(e) => {
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Some(slot) = clients.admit(peer.ip()) else {
            tracing::debug!("refusing a connection from {peer}: {} already open", limits.per_client);
            if tls.is_none() {
                // Best effort, never waiting: the socket's buffer is empty.
                let _ = tcp.try_write(TOO_MANY_CONNECTIONS);
            }
            continue;
        };
        // Connect streams write small frames; Nagle would hold each for a
        // delayed ACK (~40 ms on Linux).
        let _ = tcp.set_nodelay(true);
        let (tls, app, builder, watcher) = (tls.clone(), app.clone(), builder.clone(), graceful.watcher());
        tokio::spawn(async move {
            let _slot = slot;
            match tls {
                None => serve_connection(tcp, &builder, app, watcher, limits, pending()).await,
                Some(tls) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let chain = stream.get_ref().1.peer_certificates().unwrap_or_default();
                        let revoked = revoked(chain.iter().map(|c| c.clone().into_owned()).collect(), tls.revocations);
                        serve_connection(stream, &builder, app, watcher, limits, revoked).await
                    }
                    Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                    Err(_) => tracing::debug!("TLS handshake timed out"),
                },
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Resolves when a newer revocation list names the certificate the
/// client showed (never without a list to check, or a certificate).
async fn revoked(chain: Vec<CertificateDer<'static>>, revocations: Option<Arc<Revocations>>) {
    let Some(revocations) = revocations.filter(|_| !chain.is_empty()) else {
        return pending().await;
    };
    let mut changes = revocations.changes();
    while changes.changed().await.is_ok() {
        if !revocations.trusts_peer(&chain) {
            return;
        }
    }
    pending().await
}

async fn serve_connection<I>(
    io: I,
    builder: &auto::Builder<TokioExecutor>,
    app: Router,
    watcher: Watcher,
    limits: Limits,
    revoked: impl Future<Output = ()>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = idle::Activity::new();
    let service = idle::Counted::new(TowerToHyperService::new(app), activity.clone());
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    tokio::select! {
        result = watcher.watch(connection) => if let Err(e) = result {
            tracing::debug!("connection ended: {e}");
        },
        // Dropping the connection closes it; nothing is in flight.
        () = activity.idle_for(limits.header_timeout, limits.idle_timeout) => {
            tracing::debug!("closing a connection with no request in flight");
        }
        () = revoked => tracing::info!("closing a connection whose client certificate was revoked"),
    }
}

/// The answer to a connection over the per-address cap (plain HTTP only:
/// on TLS nothing can be said before a handshake the cap exists to avoid).
const TOO_MANY_CONNECTIONS: &[u8] = b"HTTP/1.1 429 Too Many Requests\r\n\
content-type: application/json\r\n\
content-length: 63\r\n\
connection: close\r\n\
\r\n\
{\"code\":429,\"message\":\"too many connections from this address\"}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_refusal_is_a_well_formed_response_with_an_e2b_error() {
        let text = std::str::from_utf8(TOO_MANY_CONNECTIONS).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let error: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["code"], 429);
    }
}
