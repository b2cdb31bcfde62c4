//! What can go wrong talking to an agent: one error type for the event
//! stream (`process`) and the socket client (`client`) alike.

use std::path::PathBuf;

use hyper::StatusCode;

use crate::envelope::EnvelopeError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("connecting {}: {source}", path.display())]
    Connect { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Http(#[from] hyper::Error),
    #[error(transparent)]
    Request(#[from] hyper::http::Error),
    /// The agent answered a status other than success.
    #[error("{what} answered {status}: {body}")]
    Status { what: &'static str, status: StatusCode, body: String },
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("invalid message: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Base64(String),
    /// The end-of-stream frame carried a Connect error.
    #[error("stream failed: {code}: {message}")]
    Rpc { code: String, message: String },
    #[error("reading the response: {0}")]
    Body(Box<dyn std::error::Error + Send + Sync>),
    /// The stream broke a rule of the protocol (ended early, no end event).
    #[error("{0}")]
    Protocol(&'static str),
}
