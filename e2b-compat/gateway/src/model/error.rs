//! What can go wrong in a service verb, in terms the API maps to E2B's
//! status codes (see `api/error.rs`).

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("sandbox {0} not found")]
    NotFound(String),
    #[error("template '{name}' not found; available templates: {available}")]
    UnknownTemplate { name: String, available: String },
    #[error("{0}")]
    Invalid(String),
    /// The sandbox is not in a state that allows the operation (E2B's 409).
    #[error("{0}")]
    Conflict(String),
    /// A team limit would be passed (E2B's 429); the message names it.
    #[error("{0}")]
    QuotaExceeded(String),
    #[error("snapshot {0} not found")]
    SnapshotNotFound(String),
    /// A built template (or one of its builds) the caller has not.
    #[error("template {0} not found")]
    TemplateNotFound(String),
    /// This host lacks something the operation needs (E2B's 503); the
    /// message says what and how to install it.
    #[error("{0}")]
    Unavailable(String),
    /// The substrate refused, saying why (a missing sandbox, snapshot or
    /// template; an operation this kind of sandbox lacks; bad input);
    /// `api::error` maps its kind to E2B's status.
    #[error(transparent)]
    Substrate(copse_substrate::SubstrateError),
    #[error(transparent)]
    Internal(anyhow::Error),
}

impl From<anyhow::Error> for SandboxError {
    /// A substrate's typed refusal keeps its kind (anywhere in the chain
    /// of causes); anything else is a fault.
    fn from(err: anyhow::Error) -> Self {
        match copse_substrate::SubstrateError::find(&err) {
            Some(refusal) => SandboxError::Substrate(refusal.clone()),
            None => SandboxError::Internal(err),
        }
    }
}

pub type Result<T> = std::result::Result<T, SandboxError>;
