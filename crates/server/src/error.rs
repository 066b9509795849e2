//! API errors: an HTTP status plus OpenAI's error object
//! (`{"error": {"message", "type", "param", "code"}}`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error returned to the client. Before the response head is written it becomes a real status
/// code; on a stream that has already started it is sent in-band as `data: {"error": …}`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// The HTTP status (400, 404, 413, 415, 429, 500, …).
    pub status: StatusCode,
    /// What was wrong and, where there is one, what to do.
    pub message: String,
    /// The request field at fault, e.g. `messages[2].tool_call_id`.
    pub param: Option<String>,
    /// A short machine-readable code, e.g. `context_length_exceeded`.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A 400 about one request field.
    pub fn param(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::invalid(message);
        e.param = Some(param.into());
        e
    }

    /// An error with any status.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// Sets the machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// OpenAI's `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The OpenAI error object, `{"error": {...}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
