//! The one way the service calls the substrate: its calls block (they run
//! commands, wait on the kernel), so each runs on tokio's blocking pool, and
//! its error becomes the service's error in one place.

use copse_substrate::Substrate;

use super::Sandboxes;
use crate::model::Result;

impl Sandboxes {
    /// Runs `call` on a blocking thread. A substrate's typed refusal keeps
    /// its kind (`SandboxError::Substrate`); a panic or any other failure is
    /// internal.
    pub(super) async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&dyn Substrate) -> anyhow::Result<T> + Send + 'static,
    ) -> Result<T> {
        let substrate = self.substrate.clone();
        // The substrate's own log lines keep the request's (or sandbox's) span.
        let span = tracing::Span::current();
        Ok(tokio::task::spawn_blocking(move || span.in_scope(|| call(substrate.as_ref())))
            .await
            .map_err(anyhow::Error::from)??)
    }
}
