//! Connection upgrades (WebSocket, or any `Upgrade:` protocol) across one
//! proxy hop. A hop forwards the upgrade request like any other; when the
//! upstream answers 101, both sides hand over their raw connections and the
//! hop copies bytes each way until either end closes. The gateway and the
//! agent's port relay both use this, so an upgrade crosses both hops.

use hyper::upgrade::OnUpgrade;
use hyper::{Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;

/// Takes the client side of a pending upgrade out of the request; call it
/// before the request is moved into the upstream client.
pub fn take<B>(request: &mut Request<B>) -> Option<OnUpgrade> {
    request.headers().contains_key(header::UPGRADE).then(|| hyper::upgrade::on(request))
}

/// Joins the client's connection to the upstream's once the upstream agreed
/// to switch protocols. The response still goes back to the client as is:
/// sending it is what completes the client's side of the upgrade.
pub fn splice<B>(client: Option<OnUpgrade>, response: &mut Response<B>) {
    let Some(client) = client else { return };
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return;
    }
    let upstream = hyper::upgrade::on(response);
    tokio::spawn(async move {
        match tokio::try_join!(client, upstream) {
            Ok((client, upstream)) => {
                let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
                if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
                    tracing::debug!("upgraded connection ended: {e}");
                }
            }
            Err(e) => tracing::debug!("upgrade did not complete: {e}"),
        }
    });
}
