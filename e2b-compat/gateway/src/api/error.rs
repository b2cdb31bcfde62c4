//! Every failure the API returns is E2B's JSON `{code, message}`: the SDK
//! parses error bodies and crashes on anything else.

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use copse_substrate::SubstrateError;
use serde_json::json;

use crate::model::{SandboxError, SecretError, VolumeError};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Json(json!({ "code": self.status.as_u16(), "message": self.message }));
        let mut response = (self.status, body).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // The SDK retries 503s unless told otherwise; what this host
            // lacks does not come back between retries.
            response.headers_mut().insert("should-retry", HeaderValue::from_static("false"));
        }
        response
    }
}

impl From<SandboxError> for ApiError {
    fn from(err: SandboxError) -> Self {
        let status = match &err {
            SandboxError::NotFound(_) | SandboxError::SnapshotNotFound(_) | SandboxError::TemplateNotFound(_) => {
                StatusCode::NOT_FOUND
            }
            SandboxError::QuotaExceeded(_) => StatusCode::TOO_MANY_REQUESTS,
            SandboxError::Conflict(_) => StatusCode::CONFLICT,
            SandboxError::UnknownTemplate { .. } | SandboxError::Invalid(_) => StatusCode::BAD_REQUEST,
            SandboxError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            SandboxError::Substrate(refusal) => substrate_status(refusal),
            SandboxError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{err:#}");
        }
        Self::new(status, format!("{err:#}"))
    }
}

impl From<SecretError> for ApiError {
    fn from(err: SecretError) -> Self {
        let status = match &err {
            SecretError::NotFound(_) => StatusCode::NOT_FOUND,
            SecretError::NameTaken(_) => StatusCode::CONFLICT,
            SecretError::Invalid(_) => StatusCode::BAD_REQUEST,
            SecretError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("secrets: {err:#}");
        }
        Self::new(status, format!("{err:#}"))
    }
}

impl From<VolumeError> for ApiError {
    fn from(err: VolumeError) -> Self {
        let status = match &err {
            VolumeError::NotFound(_) => StatusCode::NOT_FOUND,
            VolumeError::NameTaken(_) | VolumeError::InUse(_) => StatusCode::CONFLICT,
            VolumeError::Invalid(_) => StatusCode::BAD_REQUEST,
            VolumeError::Moving(_) => StatusCode::SERVICE_UNAVAILABLE,
            VolumeError::Substrate(refusal) => substrate_status(refusal),
            VolumeError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("volumes: {err:#}");
        }
        Self::new(status, format!("{err:#}"))
    }
}

/// E2B's 429 for a key over its team's request rate; `Retry-After` in
/// whole seconds, rounded up so a client that waits that long gets through.
pub fn rate_limited(per_second: u64, wait: std::time::Duration) -> Response {
    let message = format!("rate limit of {per_second} requests per second per API key exceeded (requests-per-second)");
    let mut response = ApiError::new(StatusCode::TOO_MANY_REQUESTS, message).into_response();
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    response.headers_mut().insert("retry-after", HeaderValue::from(seconds.max(1)));
    response
}

/// E2B's status for a substrate's refusal: E2B answers a feature a sandbox
/// lacks with 400, like bad input; what this host lacks is a 503.
fn substrate_status(refusal: &SubstrateError) -> StatusCode {
    match refusal {
        SubstrateError::NotFound(_) => StatusCode::NOT_FOUND,
        SubstrateError::Unsupported(_) | SubstrateError::Invalid(_) => StatusCode::BAD_REQUEST,
        SubstrateError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
    }
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::*;

    /// What a substrate call that failed with `refusal`, under the context
    /// the gateway adds, becomes on the wire.
    fn answer(refusal: SubstrateError) -> ApiError {
        let err = Err::<(), _>(refusal).context("snapshotting sandbox a").unwrap_err();
        ApiError::from(SandboxError::from(err))
    }

    #[test]
    fn substrate_refusals_get_e2b_statuses() {
        let not_found = answer(SubstrateError::NotFound("snapshot s not found".into()));
        assert_eq!((not_found.status, not_found.message.as_str()), (StatusCode::NOT_FOUND, "snapshot s not found"));
        assert_eq!(answer(SubstrateError::Unsupported("no memory".into())).status, StatusCode::BAD_REQUEST);
        assert_eq!(answer(SubstrateError::Invalid("bad name".into())).status, StatusCode::BAD_REQUEST);
        assert_eq!(answer(SubstrateError::Unavailable("no CRIU".into())).status, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[test]
    fn other_failures_are_internal() {
        let answer = ApiError::from(SandboxError::from(anyhow::anyhow!("disk on fire")));
        assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
