//! Reads to its end whatever a handler left of a request body.
//!
//! hyper closes an HTTP/1.1 connection whose request body was not read to
//! its end, and closing a unix socket with unread bytes in it makes the
//! peer's next write fail with EPIPE. The gateway, still forwarding the
//! tail of the body, then loses the response that was already on its way
//! and answers 502. Handlers leave a tail often: multer stops at the closing
//! boundary and never reads the CRLF after it (the JavaScript SDK sends it
//! as a chunk of its own), and a 401 or 400 is answered before any of the
//! body is read. Draining the tail keeps every response deliverable and the
//! connection reusable.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use http_body_util::BodyExt;
use hyper::body::{Body as HttpBody, Frame, SizeHint};

/// A tail longer than this (an upload refused half way, say) is not worth
/// reading: the connection closes, as it would without draining.
const MAX_TAIL: u64 = 16 << 20;
/// A client that stops sending does not hold a task forever.
const MAX_WAIT: Duration = Duration::from_secs(10);

/// Middleware: every request body drains its tail once the handler drops it.
pub async fn request_bodies(request: Request) -> Request {
    request.map(|body| if body.is_end_stream() { body } else { Body::new(DrainOnDrop(Some(body))) })
}

struct DrainOnDrop(Option<Body>);

impl HttpBody for DrainOnDrop {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        match self.0.as_mut() {
            Some(body) => Pin::new(body).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.0.as_ref().map(HttpBody::size_hint).unwrap_or_else(|| SizeHint::with_exact(0))
    }
}

impl Drop for DrainOnDrop {
    fn drop(&mut self) {
        let Some(body) = self.0.take() else { return };
        if body.is_end_stream() || body.size_hint().lower() > MAX_TAIL {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(MAX_WAIT, drain(body)).await;
            });
        }
    }
}

async fn drain(mut body: Body) {
    let mut read = 0u64;
    while let Some(Ok(frame)) = body.frame().await {
        read += frame.data_ref().map_or(0, |d| d.len() as u64);
        if read > MAX_TAIL {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body fed by a channel of capacity one: each send waits until the
    /// previous chunk was read, and fails once nobody reads any more.
    fn fed_body() -> (tokio::sync::mpsc::Sender<Bytes>, Body) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
        let chunks = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|chunk| (Ok::<_, std::io::Error>(chunk), rx))
        });
        (tx, Body::from_stream(chunks))
    }

    #[tokio::test]
    async fn a_tail_left_by_the_handler_is_read_to_its_end() {
        let (tx, body) = fed_body();
        drop(DrainOnDrop(Some(body)));
        for _ in 0..4 {
            tx.send(Bytes::from_static(b"\r\n")).await.expect("the tail is still being read");
        }
    }

    #[tokio::test]
    async fn without_draining_the_sender_sees_the_body_go() {
        let (tx, body) = fed_body();
        drop(body);
        assert!(tx.send(Bytes::from_static(b"\r\n")).await.is_err());
    }

    #[tokio::test]
    async fn a_tail_past_the_bound_is_abandoned() {
        let (tx, body) = fed_body();
        drop(DrainOnDrop(Some(body)));
        let chunk = Bytes::from(vec![0u8; 1 << 20]);
        let mut sent = 0u64;
        while tx.send(chunk.clone()).await.is_ok() {
            sent += chunk.len() as u64;
            assert!(sent <= MAX_TAIL + 2 * chunk.len() as u64, "drained past the bound");
        }
    }
}
