//! Whether a connection has a request in flight, and for how long it has
//! had none: a connection that sends no request, or stops sending them, is
//! closed; one streaming a response (a command's output, a WebSocket) for
//! an hour is busy all along, however quiet.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::HttpBody;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::{Request, Response};
use tokio::sync::Notify;
use tokio::time::Instant;

pub struct Activity {
    state: Mutex<State>,
    /// Woken when the last request in flight ends.
    finished: Notify,
}

struct State {
    in_flight: usize,
    /// When the connection was accepted or its last request ended.
    idle_since: Instant,
    served: bool,
}

impl Activity {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State { in_flight: 0, idle_since: Instant::now(), served: false }),
            finished: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn begin(self: &Arc<Self>) -> Busy {
        let mut state = self.lock();
        state.in_flight += 1;
        state.served = true;
        Busy(self.clone())
    }

    /// Resolves once nothing has been in flight for `first` since the
    /// connection was accepted (before its first request) or for `between`
    /// since its last request ended.
    pub async fn idle_for(&self, first: Duration, between: Duration) {
        loop {
            let deadline = {
                let state = self.lock();
                (state.in_flight == 0).then(|| state.idle_since + if state.served { between } else { first })
            };
            match deadline {
                // A permit stored by an end in between wakes this at once.
                None => self.finished.notified().await,
                Some(deadline) if Instant::now() >= deadline => return,
                // Requests may come and go meanwhile: look again at the deadline.
                Some(deadline) => tokio::time::sleep_until(deadline).await,
            }
        }
    }
}

/// A request in flight, until its response body is done or dropped.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.in_flight -= 1;
        if state.in_flight == 0 {
            state.idle_since = Instant::now();
            drop(state);
            self.0.finished.notify_one();
        }
    }
}

/// A hyper service counted in its connection's [`Activity`].
#[derive(Clone)]
pub struct Counted<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S> Counted<S> {
    pub fn new(inner: S, activity: Arc<Activity>) -> Self {
        Self { inner, activity }
    }
}

impl<S, B> hyper::service::Service<Request<Incoming>> for Counted<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
    S::Future: Send + 'static,
{
    type Response = Response<Tracked<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let busy = self.activity.begin();
        let response = self.inner.call(request);
        Box::pin(async move { Ok(response.await?.map(|body| Tracked { body, _busy: busy })) })
    }
}

/// A response body that keeps its request in flight while it is sent.
pub struct Tracked<B> {
    body: B,
    _busy: Busy,
}

impl<B: HttpBody + Unpin> HttpBody for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real time, short: long enough apart that a loaded machine still
    // tells them apart.
    const FIRST: Duration = Duration::from_millis(200);
    const BETWEEN: Duration = Duration::from_millis(600);

    #[tokio::test]
    async fn a_connection_that_never_sends_a_request_is_idle_after_the_first_limit() {
        let activity = Activity::new();
        let start = Instant::now();
        activity.idle_for(FIRST, BETWEEN).await;
        assert!(start.elapsed() >= FIRST);
        assert!(start.elapsed() < BETWEEN);
    }

    #[tokio::test]
    async fn a_request_in_flight_keeps_the_connection_until_it_ends_then_the_longer_limit_runs() {
        let activity = Activity::new();
        let busy = activity.begin();
        let watch = {
            let activity = activity.clone();
            tokio::spawn(async move { activity.idle_for(FIRST, BETWEEN).await })
        };
        tokio::time::sleep(BETWEEN * 2).await;
        assert!(!watch.is_finished(), "closed with a request in flight");
        drop(busy);
        let ended = Instant::now();
        watch.await.unwrap();
        assert!(ended.elapsed() >= BETWEEN);
    }
}
