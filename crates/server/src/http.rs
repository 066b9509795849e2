//! Routes, body checks, and the submission of chat/completion requests to the generation thread
//! (their responses: `respond.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use crate::api::{self, CompletionPrompt};
use crate::error::ApiError;
use crate::respond::{collect_response, stream_response, Kind, Reply};
use crate::worker::{timestamp, Job};
use crate::TextSide;
use mference_runtime::SamplerConfig;
use mference_session::{Reasoning, Request as GenRequest, SessionError};
use mference_text::TextError;

/// Largest accepted request body, bytes (413 above).
pub(crate) const BODY_LIMIT: usize = 1 << 20;

/// Everything a handler needs.
pub(crate) struct AppState {
    pub model_id: String,
    pub max_context: usize,
    pub text: Arc<TextSide>,
    pub jobs: mpsc::Sender<Job>,
    pub heartbeat: Duration,
    /// Unix seconds at startup (`created` of the model object).
    pub started: u64,
    /// Becomes `true` when the server starts shutting down (see [`stopping`]).
    pub stop: watch::Receiver<bool>,
    /// Set by the generation thread when the model can no longer serve (a damaged or
    /// unreadable install file): `/health` reports it.
    pub broken: Arc<std::sync::Mutex<Option<String>>>,
    /// The generation thread's statistics (`/v1/stats`, `/metrics`).
    pub live: Arc<crate::stats::Live>,
}

/// Resolves once the server has begun shutting down, or its [`crate::Server`] is gone.
pub(crate) async fn stopping(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// What a request still open when the server shuts down gets: a 503 before the head, in-band on
/// a stream.
pub(crate) fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the server is shutting down; retry when it is back",
    )
    .with_code("server_shutting_down")
}

pub(crate) type Shared = Arc<AppState>;

pub(crate) fn router(state: Shared) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/stats", get(crate::ui::stats))
        .route("/metrics", get(crate::ui::metrics))
        .merge(crate::ui::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// `{"status": "ok"}`, or 503 `{"status": "error", "error": …}` once a request found that the
/// model cannot serve (a layer file that fails its check, a read error).
async fn health(State(st): State<Shared>) -> (StatusCode, Json<Value>) {
    let broken = st.broken.lock().unwrap_or_else(|e| e.into_inner()).clone();
    match broken {
        None => (StatusCode::OK, Json(json!({"status": "ok"}))),
        Some(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "error", "error": e})),
        ),
    }
}

fn model_object(st: &AppState) -> Value {
    json!({"id": st.model_id, "object": "model", "created": st.started, "owned_by": "mference"})
}

async fn models(State(st): State<Shared>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&st)]}))
}

async fn model(State(st): State<Shared>, Path(id): Path<String>) -> Response {
    if id == st.model_id {
        Json(model_object(&st)).into_response()
    } else {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!("the model `{id}` does not exist"),
        )
        .with_code("model_not_found")
        .into_response()
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "no route {} {} (this server has GET / (the chat page), GET /health, GET /v1/models, GET /v1/stats, GET /metrics, POST /v1/chat/completions, POST /v1/completions)",
            req.method(),
            req.uri().path()
        ),
    )
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// `prefix-<time><counter>`: unique within the process and across restarts.
pub(crate) fn new_id(prefix: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    format!(
        "{prefix}-{t:x}{:04x}",
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    )
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Content type (415), size (413) and JSON (400) checks; nothing has been written yet.
async fn read_json(req: Request) -> Result<Value, ApiError> {
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("application/json") {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!(
                "the content type must be application/json, got {}",
                if ct.is_empty() { "none" } else { ct }
            ),
        ));
    }
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {BODY_LIMIT} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT as u64) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(req.into_body(), BODY_LIMIT)
        .await
        .map_err(|e| {
            if e.to_string().contains("length limit") {
                too_large()
            } else {
                ApiError::invalid(format!("cannot read the request body: {e}"))
            }
        })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("the request body is not valid JSON: {e}")))
}

/// Logs (and counts in the statistics) a request answered with an error before or instead of a
/// generation; a generation's own failure was logged and counted by the generation thread.
fn log_rejected(st: &AppState, id: &str, received: Instant, e: &ApiError) {
    if e.logged {
        return;
    }
    st.live.rejected(e.status.as_u16());
    crate::log_line!(
        "{} request {id} rejected in {:.3}s status={} ({})",
        timestamp(),
        received.elapsed().as_secs_f64(),
        e.status.as_u16(),
        e.message
    );
}

async fn chat(State(st): State<Shared>, req: Request) -> Response {
    let received = Instant::now();
    let id = new_id("chatcmpl");
    match chat_inner(&st, req, &id, received).await {
        Ok(r) => r,
        Err(e) => {
            log_rejected(&st, &id, received, &e);
            e.into_response()
        }
    }
}

async fn chat_inner(
    st: &Shared,
    req: Request,
    id: &str,
    received: Instant,
) -> Result<Response, ApiError> {
    let body = read_json(req).await?;
    let r = api::parse_chat(&body, &st.model_id, st.text.family)?;
    let prompt = st
        .text
        .render_chat(&r.messages, r.tools.as_deref(), &r.template_kwargs)
        .map_err(|e| match e {
            SessionError::NoTemplate => {
                ApiError::invalid("this install has no chat template; use POST /v1/completions")
            }
            SessionError::Text(TextError::Tokenize(_)) => {
                ApiError::invalid(format!("cannot tokenize the prompt: {e}"))
            }
            SessionError::Text(TextError::TemplateVariable { ref name, .. }) => ApiError::param(
                if name == "reasoning_effort" {
                    "reasoning_effort"
                } else {
                    "chat_template_kwargs"
                },
                e.to_string(),
            ),
            e => ApiError::param("messages", e.to_string()),
        })?;
    if prompt.reasoning_open && r.common.response_format.is_some() {
        return Err(ApiError::param(
            "response_format",
            "this prompt leaves the model's reasoning block open (thinking on), and `response_format` would constrain the reasoning too; turn thinking off (`chat_template_kwargs: {\"enable_thinking\": false}`) to use it",
        ));
    }
    let reply = Reply {
        kind: Kind::Chat,
        id: id.to_string(),
        created: unix_now(),
        model: st.model_id.clone(),
        common: r.common,
    };
    let reasoning = Reasoning::Split {
        open: prompt.reasoning_open,
    };
    submit(st, reply, prompt.ids, r.tools, reasoning, received).await
}

async fn completions(State(st): State<Shared>, req: Request) -> Response {
    let received = Instant::now();
    let id = new_id("cmpl");
    let res = async {
        let body = read_json(req).await?;
        let r = api::parse_completion(&body, &st.model_id)?;
        let prompt = match r.prompt {
            CompletionPrompt::Text(s) => st
                .text
                .tokenizer
                .encode(&s, true)
                .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}")))?,
            CompletionPrompt::Tokens(ids) => {
                let vocab = st.text.tokenizer.vocab_size() as u32;
                if let Some(bad) = ids.iter().find(|&&t| t >= vocab) {
                    return Err(ApiError::param(
                        "prompt",
                        format!("token id {bad} is outside the vocabulary (size {vocab})"),
                    ));
                }
                ids
            }
        };
        let reply = Reply {
            kind: Kind::Completion,
            id: id.clone(),
            created: unix_now(),
            model: st.model_id.clone(),
            common: r.common,
        };
        submit(&st, reply, prompt, None, Reasoning::Raw, received).await
    }
    .await;
    match res {
        Ok(r) => r,
        Err(e) => {
            log_rejected(&st, &id, received, &e);
            e.into_response()
        }
    }
}

/// The `Retry-After` of a 429 (queue full), in seconds: a place in the queue opens whenever a
/// generation ends, which the server cannot foresee; one second lets a client poll without
/// flooding the server.
const QUEUE_FULL_RETRY_AFTER_S: u32 = 1;

/// Context check, queue admission (429 when full), then the JSON or SSE response.
async fn submit(
    st: &Shared,
    reply: Reply,
    prompt: Vec<u32>,
    tools: Option<Vec<Value>>,
    reasoning: Reasoning,
    received: Instant,
) -> Result<Response, ApiError> {
    if prompt.len() >= st.max_context {
        // A larger --max-context helps only below the model's own limit.
        let remedy = match st.text.max_positions {
            Some(m) if st.max_context >= m => {
                format!("shorten it ({m} tokens is the model's own limit)")
            }
            _ => "shorten it or restart with a larger --max-context".to_string(),
        };
        return Err(ApiError::param(
            if reply.kind == Kind::Chat { "messages" } else { "prompt" },
            format!(
                "the prompt is {} tokens, which does not fit this server's context of {} tokens (at least one token must be generated); {remedy}",
                prompt.len(),
                st.max_context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    if *st.stop.borrow() {
        return Err(shutting_down());
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let s = &reply.common.sampling;
    let mut request = GenRequest::new(
        prompt,
        SamplerConfig {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
        },
        s.max_tokens,
    );
    request.stop = s.stop.clone();
    request.logprobs = reply.common.logprobs;
    request.tools = tools;
    request.reasoning = reasoning;
    if let Some(format) = reply.common.response_format.clone() {
        // Compiling indexes the vocabulary on first use and can take a while on a large schema:
        // off the HTTP threads.
        let text = Arc::clone(&st.text);
        let compiled = tokio::task::spawn_blocking(move || text.compile(&format))
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("compiling the response format failed: {e}"),
                )
            })?;
        request.constraint =
            Some(compiled.map_err(|e| ApiError::param("response_format", e.to_string()))?);
    }
    let job = Job {
        id: reply.id.clone(),
        received,
        request,
        events: tx,
    };
    st.jobs.try_send(job).map_err(|e| match e {
        mpsc::error::TrySendError::Full(_) => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "the generation queue is full; retry later",
        )
        .with_code("queue_full")
        .with_retry_after(QUEUE_FULL_RETRY_AFTER_S),
        mpsc::error::TrySendError::Closed(_) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the generation thread has stopped",
        ),
    })?;
    if reply.common.stream {
        Ok(stream_response(reply, rx, st.heartbeat, st.stop.clone()))
    } else {
        collect_response(reply, rx, st.stop.clone()).await
    }
}
