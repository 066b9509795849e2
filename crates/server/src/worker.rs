//! The generation thread: it owns the one model, takes jobs from a bounded queue one at a time,
//! keeps the single retained conversational KV prefix, and streams events back over a tokio
//! channel (the mistral.rs pattern, `reference/dependencies.md`).

use std::sync::Arc;
use std::time::Instant;

use axum::http::StatusCode;
use serde_json::Value;
use tokio::sync::mpsc;

use mference_models::{Logits, Model, ModelError, PrefixCache, Want};
use mference_runtime::{Sampler, SamplerConfig};
use mference_text::{
    parse_tool_calls_with_tools, stop_token_ids, Family, ReasoningGate, StopStrings,
    StreamingDetokenizer, ToolCall,
};

use crate::api::Sampling;
use crate::error::ApiError;
use crate::stats::Live;
use crate::{PromptCacheMode, TextSide};

/// One queued generation.
pub(crate) struct Job {
    /// The response id (`chatcmpl-…`, `cmpl-…`), also used in the log line.
    pub id: String,
    /// When the request arrived (the log line's duration starts here).
    pub received: Instant,
    /// The whole rendered prompt; the worker reuses whatever prefix its KV cache already holds.
    pub prompt: Vec<u32>,
    pub sampling: Sampling,
    /// `Some(n)`: report each token's log-probability and its `n` most likely alternatives.
    pub logprobs: Option<usize>,
    /// `Some(tools)`: the output is parsed for the family's tool calls (fail closed).
    pub tools: Option<Vec<Value>>,
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
    /// Generation ended normally.
    Done(Done),
    /// Generation failed; nothing more follows.
    Error(ApiError),
}

/// Log-probability of one generated token under the model's distribution (log-softmax of the
/// post-softcap logits, before temperature, top-k/top-p and repetition penalty).
#[derive(Debug, Clone)]
pub(crate) struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The most likely tokens at this step, most likely first.
    pub top: Vec<(String, Vec<u8>, f32)>,
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
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    pub prompt: usize,
    /// Prompt tokens whose KV came from the retained prefix.
    pub cached: usize,
    pub completion: usize,
}

/// The end of a successful generation.
pub(crate) struct Done {
    pub finish: Finish,
    pub usage: Usage,
    /// The visible content (for tool calls: the text outside the call blocks).
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// The model, its retained KV prefix, and the text side.
struct Worker {
    model: Box<dyn Model>,
    text: Arc<TextSide>,
    cache_mode: PromptCacheMode,
    /// The token ids the model's state holds (the retained conversation prefix).
    cache: PrefixCache,
    stop_ids: Vec<u32>,
    /// The family's assistant-turn opener ([`mference_text::Family::turn_open_token`]) as one token id.
    turn_open: Option<u32>,
    /// The family's tool-call marker as one token id: a call opens with this token; the same
    /// characters spelled out by other tokens are prose.
    tool_marker_id: Option<u32>,
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
    let stop_ids = stop_token_ids(text.family, &text.tokenizer);
    let turn_open = match text.tokenizer.encode(text.family.turn_open_token(), false) {
        Ok(ids) if ids.len() == 1 => Some(ids[0]),
        _ => None,
    };
    let tool_marker_id = match text.tokenizer.encode(tool_marker(text.family), false) {
        Ok(ids) if ids.len() == 1 => Some(ids[0]),
        _ => None,
    };
    let mut w = Worker {
        model,
        text,
        cache_mode,
        cache: PrefixCache::new(),
        stop_ids,
        turn_open,
        tool_marker_id,
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

/// The tool-call opening marker of `family`: text from it on is held back while streaming.
fn tool_marker(family: Family) -> &'static str {
    match family {
        Family::Gemma4 => "<|tool_call>",
        Family::Qwen36 | Family::Maple => "<tool_call>",
        Family::DeepSeekV4 => "<｜DSML｜tool_calls>",
        // Inkling's tool-invocation content marker; its text template renders no tools, and the
        // family's parser returns any such text as content.
        Family::Inkling => "<|content_invoke_tool_json|>",
    }
}

/// Streams text until a tool-call marker shows up; from the marker on everything is held for the
/// parser, and a tail that could still become the marker is held until it cannot.
struct ToolGate {
    marker: Option<&'static str>,
    held: String,
    in_call: bool,
}

impl ToolGate {
    fn push(&mut self, s: &str) -> String {
        let Some(marker) = self.marker else {
            return s.to_string();
        };
        self.held.push_str(s);
        if self.in_call {
            return String::new();
        }
        if let Some(i) = self.held.find(marker) {
            let out = self.held[..i].to_string();
            self.in_call = true;
            self.held.drain(..i);
            return out;
        }
        let n = self.held.len();
        let keep = (1..marker.len().min(n + 1))
            .rev()
            .find(|&k| self.held.is_char_boundary(n - k) && marker.starts_with(&self.held[n - k..]))
            .unwrap_or(0);
        self.held.drain(..n - keep).collect()
    }

    /// What is left to show at the end when the held text is a tool call.
    fn finish(&mut self) -> String {
        if self.in_call {
            String::new()
        } else {
            std::mem::take(&mut self.held)
        }
    }

    /// Everything held back, for output whose held text turned out not to be a tool call (cut
    /// by `max_tokens` or a stop string, or a marker written as prose).
    fn release(&mut self) -> String {
        self.in_call = false;
        std::mem::take(&mut self.held)
    }
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

impl Worker {
    fn handle(&mut self, job: Job) {
        if job.events.is_closed() {
            eprintln!(
                "{} request {} cancelled while queued after {:.3}s",
                timestamp(),
                job.id,
                job.received.elapsed().as_secs_f64()
            );
            return;
        }
        let mut usage = Usage {
            prompt: job.prompt.len(),
            ..Default::default()
        };
        self.live
            .begin(&job.id, job.received, job.prompt.len(), self.model.as_ref());
        let result = self.generate(&job, &mut usage);
        let reason = result.as_ref().map_or("error", |d| d.finish.as_str());
        self.live.end(usage.completion, reason, self.model.as_ref());
        let secs = job.received.elapsed().as_secs_f64();
        let finish = match &result {
            Ok(d) => d.finish.as_str().to_string(),
            Err(e) => format!("error status={} ({})", e.status.as_u16(), e.message),
        };
        eprintln!(
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

    /// The outcome of a forward pass as the API sees it; an error after which no request can
    /// succeed also goes to `/health`.
    fn api(&self, r: Result<Logits, ModelError>) -> Result<Logits, ApiError> {
        r.map_err(|e| {
            if cannot_serve(&e) {
                *self.broken.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(format!("the model cannot serve: {e}"));
            }
            model_error(&e)
        })
    }

    /// One decode step: runs `tokens` through the model, recording them in the prefix cache
    /// and in the statistics.
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ApiError> {
        let r = self.cache.forward(self.model.as_mut(), tokens, want);
        let out = self.api(r)?;
        self.live.decoded(self.model.as_ref());
        Ok(out)
    }

    fn generate(&mut self, job: &Job, usage: &mut Usage) -> Result<Done, ApiError> {
        let text = Arc::clone(&self.text);
        let tok = &text.tokenizer;
        let s = &job.sampling;
        let cfg = SamplerConfig {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
            repetition_penalty: s.repetition_penalty,
            seed: s.seed,
        };
        let want = if cfg.is_greedy() && job.logprobs.is_none() {
            Want::Argmax
        } else {
            Want::Last
        };
        let mut sampler = Sampler::new(cfg);
        let max_context = self.model.engine().max_context;
        if job.prompt.is_empty() || job.prompt.len() >= max_context {
            return Err(ApiError::invalid(format!(
                "the prompt is {} tokens; this server's context is {max_context}",
                job.prompt.len()
            ))
            .with_code("context_length_exceeded"));
        }
        usage.cached = match self.cache_mode {
            PromptCacheMode::SinglePrefix => self.cache.reuse(self.model.as_mut(), &job.prompt),
            _ => {
                self.cache.clear(self.model.as_mut());
                0
            }
        };
        // With the prompt cache on, a recurrent model keeps a checkpoint where the next request
        // of this conversation departs.
        let open = (self.cache_mode == PromptCacheMode::SinglePrefix)
            .then_some(self.turn_open)
            .flatten();
        let r = self
            .cache
            .prefill(self.model.as_mut(), &job.prompt, usage.cached, open, want);
        let mut out = self.api(r)?;
        self.live.prefilled(usage.cached, self.model.as_ref());

        let mut history = job.prompt.clone();
        let mut detok = StreamingDetokenizer::new(tok);
        let mut stops = StopStrings::new(s.stop.clone());
        let mut gate = ToolGate {
            marker: job.tools.as_ref().map(|_| tool_marker(text.family)),
            held: String::new(),
            in_call: false,
        };
        // Maple's prompt leaves `<think>` open: its reasoning is neither streamed nor returned.
        let mut think = ReasoningGate::new(text.family);
        let mut raw = String::new();
        let mut pending: Vec<TokenLogprob> = Vec::new();
        let finish;
        loop {
            let pos = self.model.position();
            let next = match out {
                Logits::Argmax(id) => id,
                Logits::Rows(mut row) => {
                    let before = job.logprobs.map(|n| (row.clone(), n));
                    let id = sampler.sample(&mut row, &history, pos);
                    if let Some((orig, n)) = before {
                        pending.push(logprob(&text, &orig, id, n));
                    }
                    id
                }
                Logits::None => {
                    return Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the model returned no logits",
                    ))
                }
            };
            if self.stop_ids.contains(&next) {
                pending.pop();
                finish = Finish::Stop;
                break;
            }
            usage.completion += 1;
            history.push(next);
            let (emit, stopped) = stops.push(&detok.push(next));
            let emit = think.push(&emit);
            raw.push_str(&emit);
            let visible = gate.push(&emit);
            if !visible.is_empty() {
                let lp = std::mem::take(&mut pending);
                if job
                    .events
                    .send(Event::Delta {
                        text: visible,
                        logprobs: lp,
                    })
                    .is_err()
                {
                    finish = Finish::Cancelled;
                    break;
                }
            }
            if job.events.is_closed() {
                finish = Finish::Cancelled;
                break;
            }
            if stopped {
                finish = Finish::Stop;
                break;
            }
            if usage.completion >= s.max_tokens || pos + 1 > max_context {
                finish = Finish::Length;
                break;
            }
            out = self.forward(&[next], want)?;
        }
        if finish == Finish::Cancelled {
            return Ok(Done {
                finish,
                usage: *usage,
                content: String::new(),
                tool_calls: Vec::new(),
            });
        }
        let mut visible = String::new();
        if !stops.stopped() {
            let (tail, _) = stops.push(&detok.finish());
            let tail = think.push(&(tail + &stops.finish()));
            raw.push_str(&tail);
            visible = gate.push(&tail);
        }
        // A stop string or max_tokens cut the output: it ends as `stop` / `length`, whatever it
        // was in the middle of.
        let cut = stops.stopped() || finish == Finish::Length;
        let generated = &history[job.prompt.len()..];
        let marker_token = self.tool_marker_id.is_some_and(|m| generated.contains(&m));
        let parsed = job
            .tools
            .as_ref()
            .map(|tools| parse_tool_calls_with_tools(text.family, &raw, Some(tools)));
        let done = match parsed {
            None => Ok(Done {
                finish,
                usage: *usage,
                content: raw,
                tool_calls: Vec::new(),
            }),
            Some(Ok(parsed)) => {
                visible.push_str(&gate.finish());
                let finish = if parsed.tool_calls.is_empty() {
                    finish
                } else {
                    Finish::ToolCalls
                };
                Ok(Done {
                    finish,
                    usage: *usage,
                    content: parsed.content,
                    tool_calls: parsed.tool_calls,
                })
            }
            // A call cut short, or the marker's characters written as prose (not the marker
            // token): text, not an error.
            Some(Err(_)) if cut || !marker_token => {
                visible.push_str(&gate.release());
                Ok(Done {
                    finish,
                    usage: *usage,
                    content: raw,
                    tool_calls: Vec::new(),
                })
            }
            Some(Err(e)) => Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "the model wrote a tool call that does not parse, so the reply was rejected \
                     (its raw text is in error.raw_output): {e}"
                ),
            )
            .with_code("malformed_tool_call")
            .with_raw_output(raw)),
        };
        if done.is_ok() {
            if job.tools.is_none() {
                visible.push_str(&gate.finish());
            }
            if !visible.is_empty() || !pending.is_empty() {
                let _ = job.events.send(Event::Delta {
                    text: visible,
                    logprobs: std::mem::take(&mut pending),
                });
            }
        }
        done
    }
}

/// The text and bytes of one token for logprobs: its decoded text, except that a byte-fallback
/// token (`<0xE2>`) reports its raw byte (its text alone is not valid UTF-8).
fn token_text(text: &TextSide, id: u32) -> (String, Vec<u8>) {
    let s = text.tokenizer.decode(&[id], false).unwrap_or_default();
    if let Some(piece) = text.tokenizer.id_to_token(id) {
        if let Some(hex) = piece.strip_prefix("<0x").and_then(|p| p.strip_suffix('>')) {
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                return (s, vec![b]);
            }
        }
    }
    let bytes = s.as_bytes().to_vec();
    (s, bytes)
}

/// Log-softmax of `row` at `id`, plus the `n` largest entries.
fn logprob(text: &TextSide, row: &[f32], id: u32, n: usize) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&z| (z as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let mut top: Vec<(f32, u32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &z) in row.iter().enumerate() {
            if top.len() < n || z > top[top.len() - 1].0 {
                let at = top.partition_point(|&(v, _)| v >= z);
                top.insert(at, (z, i as u32));
                top.truncate(n);
            }
        }
    }
    let (token, bytes) = token_text(text, id);
    TokenLogprob {
        token,
        bytes,
        logprob: (row[id as usize] as f64 - lse) as f32,
        top: top
            .into_iter()
            .map(|(z, i)| {
                let (t, b) = token_text(text, i);
                (t, b, (z as f64 - lse) as f32)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_holds_back_a_partial_marker_and_everything_after_it() {
        let mut g = ToolGate {
            marker: Some("<|tool_call>"),
            held: String::new(),
            in_call: false,
        };
        assert_eq!(g.push("Hello <|tool"), "Hello ");
        assert_eq!(g.push("_call>call:f{}"), "");
        assert_eq!(g.push(" more"), "");
        assert_eq!(g.finish(), "");
        let mut g = ToolGate {
            marker: Some("<|tool_call>"),
            held: String::new(),
            in_call: false,
        };
        assert_eq!(g.push("a <|to"), "a ");
        assert_eq!(g.push("y"), "<|toy");
        assert_eq!(g.push("<"), "");
        assert_eq!(g.finish(), "<");
        // Not a call after all: everything held from the marker on comes back once.
        let mut g = ToolGate {
            marker: Some("<|tool_call>"),
            held: String::new(),
            in_call: false,
        };
        assert_eq!(g.push("See <|tool_"), "See ");
        assert_eq!(g.push("call>call:f{"), "");
        assert_eq!(g.push("x"), "");
        assert_eq!(g.release(), "<|tool_call>call:f{x");
        assert_eq!(g.release(), "");
    }

    #[test]
    fn timestamp_is_iso_utc() {
        let t = timestamp();
        assert_eq!(t.len(), "[2026-01-02T03:04:05Z]".len());
        assert!(t.starts_with("[20") && t.ends_with("Z]"));
    }
}
