//! An answer given before its request's body was read (a refusal the
//! gateway makes without reading the upload: a command for a paused
//! sandbox, a bad token) waits for the rest of a small body and reads it.
//! Left unread, hyper closes the HTTP/1.1 connection after the answer,
//! without saying so: a client still writing the body gets a broken pipe
//! instead of the answer, and one that had written it takes the connection
//! back into its pool and sends its next request on it as it closes (seen
//! with the Python SDK: a command refused for a paused sandbox, then
//! `Sandbox.connect`). A body larger than [`DRAIN_LIMIT`], or slower than
//! [`DRAIN_WAIT`], is left: the answer then says `Connection: close`.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, Version, header};
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};

/// What a refused request may still send; E2B's refused calls carry small
/// JSON or one Connect message.
const DRAIN_LIMIT: usize = 1 << 20;
const DRAIN_WAIT: Duration = Duration::from_secs(1);

pub async fn read_before_refusing(request: Request, next: Next) -> Response {
    let http1 = matches!(request.version(), Version::HTTP_10 | Version::HTTP_11);
    if !http1 || hyper::body::Body::is_end_stream(request.body()) {
        return next.run(request).await;
    }
    let left = Arc::new(Mutex::new(None));
    let request = request.map(|inner| Body::new(Tracked { inner, ended: false, left: left.clone() }));
    let mut response = next.run(request).await;
    // Dropped unread by the time the answer is ready: the handler refused
    // it. (A body still being forwarded is not here, and is not touched.)
    let unread = left.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(body) = unread {
        let drained = tokio::time::timeout(DRAIN_WAIT, drain(body)).await.unwrap_or(false);
        if !drained {
            response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
    }
    response
}

/// Reads `body` to its end, unless it holds more than [`DRAIN_LIMIT`].
async fn drain(mut body: Body) -> bool {
    let mut room = DRAIN_LIMIT;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { return false };
        if let Some(data) = frame.data_ref() {
            let Some(less) = room.checked_sub(data.len()) else { return false };
            room = less;
        }
    }
    true
}

/// A request body that, dropped before its end, leaves itself in `left`.
struct Tracked {
    inner: Body,
    ended: bool,
    left: Arc<Mutex<Option<Body>>>,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) || self.inner.is_end_stream() {
            self.ended = true;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if !self.ended {
            let body = std::mem::replace(&mut self.inner, Body::empty());
            *self.left.lock().unwrap_or_else(|e| e.into_inner()) = Some(body);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use axum::Router;
    use axum::routing::post;
    use futures::StreamExt;
    use tower::ServiceExt;

    /// The answer's Connection header and whether the whole body was read,
    /// for `size` bytes sent to a route that refuses without reading.
    async fn refused(size: usize, version: Version) -> (Option<HeaderValue>, bool) {
        let read = Arc::new(AtomicBool::new(false));
        let seen = read.clone();
        let chunks = futures::stream::iter(vec![Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; size]))]).chain(
            futures::stream::poll_fn(move |_| {
                seen.store(true, Ordering::Relaxed);
                Poll::Ready(None)
            }),
        );
        let request =
            Request::builder().method("POST").uri("/").version(version).body(Body::from_stream(chunks)).unwrap();
        let app = Router::new()
            .route("/", post(|| async { "refused unread" }))
            .layer(axum::middleware::from_fn(read_before_refusing));
        let response = app.oneshot(request).await.unwrap();
        (response.headers().get(header::CONNECTION).cloned(), read.load(Ordering::Relaxed))
    }

    #[tokio::test]
    async fn a_small_refused_body_is_read_and_a_large_one_closes_the_connection() {
        assert_eq!(refused(100, Version::HTTP_11).await, (None, true));
        assert_eq!(refused(DRAIN_LIMIT + 1, Version::HTTP_11).await, (Some(HeaderValue::from_static("close")), false));
        // HTTP/2 streams end on their own: nothing to read or say.
        assert_eq!(refused(100, Version::HTTP_2).await, (None, false));
    }

    #[tokio::test]
    async fn a_body_the_handler_reads_is_left_alone() {
        let app = Router::new()
            .route("/", post(|body: String| async move { body }))
            .layer(axum::middleware::from_fn(read_before_refusing));
        let request = Request::builder().method("POST").uri("/").body(Body::from("payload")).unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert!(response.headers().get(header::CONNECTION).is_none());
        assert_eq!(axum::body::to_bytes(response.into_body(), 64).await.unwrap(), "payload");
    }
}
