//! The generation thread: it owns the one model, takes jobs from a bounded queue one at a time,
//! keeps the single retained conversational KV prefix, and streams events back over a tokio
//! channel (the pattern mistral.rs's server uses).

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use tokio::sync::mpsc;

use mference_models::{Model, ModelError};
use mference_session::{GenStats, Request, Session, SessionError, Sink, TextSide};
use mference_text::ToolCall;

pub(crate) use mference_session::TokenLogprob;

use crate::error::ApiError;
use crate::stats::Live;
use crate::PromptCacheMode;

/// One queued generation.
pub(crate) struct Job {
    /// The response id (`chatcmpl-…`, `cmpl-…`), also used in the log line.
    pub id: String,
    /// When the request arrived (the log line's duration starts here).
    pub received: Instant,
    /// The prompt, sampling, stops, logprobs, tools, response format and reasoning split.
    /// Prefix reuse follows the server's `--prompt-cache-mode`.
    pub request: Request,
    pub events: mpsc::UnboundedSender<Event>,
}

/// What the worker sends back for a job.
pub(crate) enum Event {
    /// Text that can be shown now (after stop strings and tool-call hold-back), with the
    /// log-probabilities of the tokens generated since the previous delta.
    Delta {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Reasoning text that can be shown now (`reasoning_content`).
    Reasoning(String),
    /// Generation ended normally.
    Done(Done),
    /// Generation failed; nothing more follows.
    Error(ApiError),
}

/// OpenAI's finish reasons (plus `cancelled` for the log when the client went away).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    Stop,
    Length,
    ToolCalls,
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
            Finish::Cancelled => "cancelled",
        }
    }

    fn of(f: mference_session::Finish) -> Self {
        use mference_session::Finish as F;
        match f {
            F::StopToken(_) | F::StopString | F::Complete => Finish::Stop,
            F::MaxTokens | F::Context => Finish::Length,
            F::ToolCalls => Finish::ToolCalls,
            F::Cancelled => Finish::Cancelled,
        }
    }
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    pub prompt: usize,
    /// Prompt tokens whose KV came from the retained prefix.
    pub cached: usize,
    pub completion: usize,
}

impl Usage {
    fn of(s: &GenStats) -> Self {
        Usage {
            prompt: s.prompt_tokens,
            cached: s.cached_tokens,
            completion: s.new_tokens,
        }
    }
}

/// The end of a successful generation.
pub(crate) struct Done {
    pub finish: Finish,
    pub usage: Usage,
    /// The visible content (for tool calls: the text outside the call blocks).
    pub content: String,
    /// The reasoning block's text (`reasoning_content`), empty when there was none.
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

/// The model with its retained KV prefix, and the text side.
struct Worker {
    session: Session,
    cache_mode: PromptCacheMode,
    /// Shared with `/health`: why the model cannot serve, once a request has found out.
    broken: Arc<std::sync::Mutex<Option<String>>>,
    /// Shared with `/v1/stats` and `/metrics`.
    live: Arc<Live>,
}

/// Starts the generation thread. The queue holds up to `queue_limit` waiting jobs besides the
/// running one; the caller `try_send`s and answers 429 when it is full.
pub(crate) fn spawn(
    model: Box<dyn Model>,
    text: Arc<TextSide>,
    cache_mode: PromptCacheMode,
    queue_limit: usize,
    broken: Arc<std::sync::Mutex<Option<String>>>,
    live: Arc<Live>,
) -> std::io::Result<(mpsc::Sender<Job>, std::thread::JoinHandle<()>)> {
    let (tx, mut rx) = mpsc::channel::<Job>(queue_limit.max(1));
    let mut w = Worker {
        session: Session::new(model, text),
        cache_mode,
        broken,
        live,
    };
    let handle = std::thread::Builder::new()
        .name("mference-generate".into())
        .spawn(move || {
            while let Some(job) = rx.blocking_recv() {
                w.handle(job);
            }
        })?;
    Ok((tx, handle))
}

/// `[2026-01-02T03:04:05Z]`, from the system clock (UTC).
pub(crate) fn timestamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "[{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z]",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn model_error(e: &ModelError) -> ApiError {
    let status = match e {
        ModelError::ContextFull { .. } | ModelError::Input(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::new(status, format!("generation failed: {e}"))
}

/// Errors after which no request can succeed: the install failed a check or cannot be read.
fn cannot_serve(e: &ModelError) -> bool {
    matches!(
        e,
        ModelError::Format(_) | ModelError::Runtime(_) | ModelError::Map { .. }
    )
}

/// Events of one job: a delta is sent while the client listens; prefill and decode steps are
/// counted in the live statistics.
struct Events<'a>(&'a mpsc::UnboundedSender<Event>, &'a Live);

impl Sink for Events<'_> {
    fn delta(&mut self, text: String, logprobs: Vec<TokenLogprob>) -> bool {
        self.0.send(Event::Delta { text, logprobs }).is_ok()
    }
    fn reasoning(&mut self, text: String) -> bool {
        self.0.send(Event::Reasoning(text)).is_ok()
    }
    fn cancelled(&self) -> bool {
        self.0.is_closed()
    }
    fn prefilled(&mut self, cached: usize, model: &dyn Model) {
        self.1.prefilled(cached, model);
    }
    fn decoded(&mut self, model: &dyn Model) {
        self.1.decoded(model);
    }
}

impl Worker {
    fn handle(&mut self, job: Job) {
        if job.events.is_closed() {
            crate::log_line!(
                "{} request {} cancelled while queued after {:.3}s",
                timestamp(),
                job.id,
                job.received.elapsed().as_secs_f64()
            );
            return;
        }
        let mut stats = GenStats::default();
        let mut request = job.request;
        request.reuse_prefix = self.cache_mode == PromptCacheMode::SinglePrefix;
        let prompt_len = request.prompt.len();
        self.live
            .begin(&job.id, job.received, prompt_len, self.session.model());
        let live = Arc::clone(&self.live);
        let result = self
            .session
            .generate(request, &mut Events(&job.events, &live), &mut stats)
            .map(|o| Done {
                finish: Finish::of(o.finish),
                usage: Usage::of(&stats),
                content: o.content,
                reasoning: o.reasoning,
                tool_calls: o.tool_calls,
            })
            .map_err(|e| self.api_error(e));
        let usage = Usage::of(&stats);
        let reason = result.as_ref().map_or("error", |d| d.finish.as_str());
        self.live
            .end(usage.completion, reason, self.session.model());
        let secs = job.received.elapsed().as_secs_f64();
        let finish = match &result {
            Ok(d) => d.finish.as_str().to_string(),
            Err(e) => format!("error status={} ({})", e.status.as_u16(), e.message),
        };
        crate::log_line!(
            "{} request {} completed in {secs:.3}s prompt={} cached={} completion={} finish={finish}",
            timestamp(),
            job.id,
            usage.prompt,
            usage.cached,
            usage.completion,
        );
        let _ = job.events.send(match result {
            Ok(d) => Event::Done(d),
            Err(mut e) => {
                e.logged = true;
                Event::Error(e)
            }
        });
    }

    /// The API's view of a failed generation; an error after which no request can succeed also
    /// goes to `/health`.
    fn api_error(&self, e: SessionError) -> ApiError {
        match e {
            SessionError::Model(e) => {
                if cannot_serve(&e) {
                    *self.broken.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(format!("the model cannot serve: {e}"));
                }
                model_error(&e)
            }
            SessionError::PromptLength { len, max_context } => ApiError::invalid(format!(
                "the prompt is {len} tokens; this server's context is {max_context}"
            ))
            .with_code("context_length_exceeded"),
            SessionError::MalformedToolCall { message, raw } => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "the model wrote a tool call that does not parse, so the reply was rejected \
                     (its raw text is in error.raw_output): {message}"
                ),
            )
            .with_code("malformed_tool_call")
            .with_raw_output(raw),
            e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamp_is_iso_utc() {
        let t = timestamp();
        assert_eq!(t.len(), "[2026-01-02T03:04:05Z]".len());
        assert!(t.starts_with("[20") && t.ends_with("Z]"));
    }
}
