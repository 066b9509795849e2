//! The chat and completion responses of a submitted request: one JSON body, or an SSE stream of
//! chunks, shaped from the generation thread's events (logprobs, usage, tool calls).

use std::convert::Infallible;
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::api::Common;
use crate::error::ApiError;
use crate::http::{new_id, shutting_down, stopping};
use crate::worker::{Done, Event, TokenLogprob, Usage};

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

/// Everything needed to shape the response of one request.
pub(crate) struct Reply {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
    pub common: Common,
}

/// The logprobs object of a chat choice or chunk: `{"content": [...]}`.
fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|t| {
            json!({
                "token": t.token,
                "logprob": t.logprob,
                "bytes": t.bytes,
                "top_logprobs": t.top.iter().map(|(tok, b, lp)| json!({"token": tok, "logprob": lp, "bytes": b})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The legacy completions logprobs object; `offset` is the text offset of the first token.
fn completion_logprobs(lps: &[TokenLogprob], offset: &mut usize) -> Value {
    let mut text_offset = Vec::with_capacity(lps.len());
    for t in lps {
        text_offset.push(*offset);
        *offset += t.token.len();
    }
    json!({
        "tokens": lps.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|t| {
            let m: serde_json::Map<String, Value> = t.top.iter().map(|(tok, _, lp)| (tok.clone(), json!(lp))).collect();
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt,
        "completion_tokens": u.completion,
        "total_tokens": u.prompt + u.completion,
        "prompt_tokens_details": {"cached_tokens": u.cached},
    })
}

fn tool_calls_json(d: &Done) -> Vec<Value> {
    d.tool_calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "index": i,
                "id": new_id("call"),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments.to_string()},
            })
        })
        .collect()
}

/// The JSON response once the worker is done; a 503 if the server starts shutting down first
/// (dropping `rx` then tells the worker to stop).
pub(crate) async fn collect_response(
    reply: Reply,
    mut rx: mpsc::UnboundedReceiver<Event>,
    stop: watch::Receiver<bool>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps: Vec<TokenLogprob> = Vec::new();
    let stop = stopping(stop);
    tokio::pin!(stop);
    loop {
        let ev = tokio::select! {
            biased;
            _ = &mut stop => return Err(shutting_down()),
            ev = rx.recv() => ev,
        };
        let Some(ev) = ev else { break };
        match ev {
            Event::Delta { text: t, logprobs } => {
                text.push_str(&t);
                lps.extend(logprobs);
            }
            Event::Reasoning(_) => {} // the whole of it comes with `Done`
            Event::Error(e) => return Err(e),
            Event::Done(d) => {
                let want_lp = reply.common.logprobs.is_some();
                let body = match reply.kind {
                    Kind::Chat => {
                        let mut message =
                            json!({"role": "assistant", "content": d.content, "refusal": null});
                        if !d.reasoning.is_empty() {
                            message["reasoning_content"] = Value::String(d.reasoning.clone());
                        }
                        if !d.tool_calls.is_empty() {
                            let calls: Vec<Value> = tool_calls_json(&d)
                                .into_iter()
                                .map(|mut c| {
                                    c.as_object_mut().map(|o| o.remove("index"));
                                    c
                                })
                                .collect();
                            message["tool_calls"] = Value::Array(calls);
                            if d.content.is_empty() {
                                message["content"] = Value::Null;
                            }
                        }
                        json!({
                            "id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
                            "choices": [{
                                "index": 0, "message": message,
                                "logprobs": if want_lp { chat_logprobs(&lps) } else { Value::Null },
                                "finish_reason": d.finish.as_str(),
                            }],
                            "usage": usage_json(&d.usage),
                        })
                    }
                    Kind::Completion => json!({
                        "id": reply.id, "object": "text_completion", "created": reply.created, "model": reply.model,
                        "choices": [{
                            "index": 0, "text": d.content,
                            "logprobs": if want_lp { completion_logprobs(&lps, &mut 0) } else { Value::Null },
                            "finish_reason": d.finish.as_str(),
                        }],
                        "usage": usage_json(&d.usage),
                    }),
                };
                return Ok(Json(body).into_response());
            }
        }
    }
    Err(ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the generation thread ended without a result",
    ))
}

impl Reply {
    /// One streamed chunk with a single choice.
    fn chunk(&self, choice: Value) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut c = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        if self.common.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn delta_chunk(&self, text: &str, lps: &[TokenLogprob], offset: &mut usize) -> Value {
        let want_lp = self.common.logprobs.is_some();
        match self.kind {
            Kind::Chat => self.chunk(json!({
                "index": 0, "delta": {"content": text},
                "logprobs": if want_lp { chat_logprobs(lps) } else { Value::Null },
                "finish_reason": null,
            })),
            Kind::Completion => self.chunk(json!({
                "index": 0, "text": text,
                "logprobs": if want_lp { completion_logprobs(lps, offset) } else { Value::Null },
                "finish_reason": null,
            })),
        }
    }

    fn finish_chunks(&self, d: &Done) -> Vec<Value> {
        let mut out = Vec::new();
        match self.kind {
            Kind::Chat => {
                if !d.tool_calls.is_empty() {
                    out.push(self.chunk(json!({
                        "index": 0, "delta": {"tool_calls": tool_calls_json(d)},
                        "logprobs": null, "finish_reason": null,
                    })));
                }
                out.push(self.chunk(json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": d.finish.as_str()})));
            }
            Kind::Completion => out.push(self.chunk(json!({
                "index": 0, "text": "", "logprobs": null, "finish_reason": d.finish.as_str(),
            }))),
        }
        if self.common.include_usage {
            let object = match self.kind {
                Kind::Chat => "chat.completion.chunk",
                Kind::Completion => "text_completion",
            };
            out.push(json!({
                "id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_json(&d.usage),
            }));
        }
        out
    }
}

/// SSE: the 200 head goes out now; the worker's events become chunks; `: ping` while idle; a
/// failure, or the server shutting down, goes in-band as `data: {"error": …}`; always ends with
/// `data: [DONE]`.
pub(crate) fn stream_response(
    reply: Reply,
    mut rx: mpsc::UnboundedReceiver<Event>,
    heartbeat: Duration,
    stop: watch::Receiver<bool>,
) -> Response {
    let (tx, out) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move {
                tx.send(Ok(SseEvent::default().data(v.to_string())))
                    .await
                    .is_ok()
            }
        };
        if reply.kind == Kind::Chat {
            let first = reply.chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}));
            if !send(first).await {
                return;
            }
        }
        let mut offset = 0usize;
        let stop = stopping(stop);
        tokio::pin!(stop);
        loop {
            // Shutdown first: a fast generation always has an event ready.
            let ev = tokio::select! {
                biased;
                _ = &mut stop => {
                    // Dropping `rx` (on return) tells the worker to stop.
                    if !send(shutting_down().body()).await {
                        return;
                    }
                    break;
                }
                ev = rx.recv() => ev,
            };
            match ev {
                Some(Event::Delta { text, logprobs }) => {
                    if !send(reply.delta_chunk(&text, &logprobs, &mut offset)).await {
                        return; // the client went away; dropping `rx` stops the worker
                    }
                }
                Some(Event::Reasoning(text)) => {
                    let chunk = reply.chunk(json!({
                        "index": 0, "delta": {"reasoning_content": text},
                        "logprobs": null, "finish_reason": null,
                    }));
                    if !send(chunk).await {
                        return;
                    }
                }
                Some(Event::Done(d)) => {
                    for c in reply.finish_chunks(&d) {
                        if !send(c).await {
                            return;
                        }
                    }
                    break;
                }
                Some(Event::Error(e)) => {
                    if !send(e.body()).await {
                        return;
                    }
                    break;
                }
                None => {
                    let e = ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "the generation thread ended without a result",
                    );
                    if !send(e.body()).await {
                        return;
                    }
                    break;
                }
            }
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    let mut resp = Sse::new(ReceiverStream::new(out))
        .keep_alive(KeepAlive::new().interval(heartbeat).text("ping"))
        .into_response();
    resp.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("keep-alive"),
    );
    resp
}
