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
    /// The model's raw output, for an error about what the model wrote (`malformed_tool_call`),
    /// returned as `error.raw_output` so the caller can see it.
    pub raw_output: Option<String>,
    /// `false`: sending the same request again cannot help (the header `x-should-retry: false`,
    /// which the official OpenAI clients obey, goes with the status).
    pub retryable: bool,
    /// Seconds after which the same request may succeed (a full queue), sent as the standard
    /// `Retry-After` header (RFC 9110 section 10.2.3), which the official OpenAI clients obey.
    pub retry_after: Option<u32>,
    /// Already written to the server log (by the generation thread's completion line).
    pub(crate) logged: bool,
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
            raw_output: None,
            retryable: true,
            retry_after: None,
            logged: false,
        }
    }

    /// Sets the machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// Says when to try again ([`ApiError::retry_after`]).
    pub fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// Attaches the model's raw output and marks the error as not worth retrying: the same
    /// request would make the model write the same thing.
    pub fn with_raw_output(mut self, raw: impl Into<String>) -> Self {
        self.raw_output = Some(raw.into());
        self.retryable = false;
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
        let mut e = serde_json::json!({
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code,
        });
        if let Some(raw) = &self.raw_output {
            e["raw_output"] = raw.as_str().into();
        }
        serde_json::json!({ "error": e })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if !self.retryable {
            r.headers_mut().insert(
                "x-should-retry",
                axum::http::HeaderValue::from_static("false"),
            );
        }
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}
