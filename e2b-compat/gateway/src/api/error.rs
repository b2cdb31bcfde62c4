//! Every failure the API returns is E2B's JSON `{code, message}`: the SDK
//! parses error bodies and crashes on anything else.

use axum::Json;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::model::SandboxError;

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
            SandboxError::NotFound(_) | SandboxError::SnapshotNotFound(_) => StatusCode::NOT_FOUND,
            SandboxError::Conflict(_) => StatusCode::CONFLICT,
            SandboxError::UnknownTemplate { .. } | SandboxError::Invalid(_) => StatusCode::BAD_REQUEST,
            SandboxError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            SandboxError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{err:#}");
        }
        Self::new(status, format!("{err:#}"))
    }
}
