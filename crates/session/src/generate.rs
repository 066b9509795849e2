//! The generation loop of `run` and `serve`: prefill the part of the prompt the model does not
//! hold yet, then decode one token at a time through the constraint mask, the sampler, the stop
//! tokens, the detokenizer, the stop strings, the reasoning split and the tool-call gate, until
//! something ends it; then parse tool calls.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mference_models::{Logits, Model, PrefixCache, Want};
use mference_runtime::{Sampler, SamplerConfig};
use mference_text::{
    parse_tool_calls_with_tools, ReasoningParser, ReasoningSplit, StopStrings,
    StreamingDetokenizer, ToolCall,
};
use serde_json::Value;

use crate::logprobs::{logprob, TokenLogprob};
use crate::tool_gate::ToolGate;
use crate::{tool_marker, Constraint, SessionError, TextSide};

/// Why a constraint and a prompt that leaves a reasoning block open do not go together.
const REASONING_OPEN: &str = "the prompt leaves a reasoning block open (thinking on), and a \
    response format would constrain the reasoning too; turn thinking off to use one";

/// One generation.
#[derive(Debug)]
pub struct Request {
    /// The whole rendered prompt (token ids); the session reuses whatever prefix the model holds.
    pub prompt: Vec<u32>,
    /// Temperature, top-k, top-p, repetition penalty, seed.
    pub sampling: SamplerConfig,
    /// Stop strings: generation ends where the first one completes; it is not in the output.
    pub stop: Vec<String>,
    /// New-token budget (stop tokens are not counted).
    pub max_tokens: usize,
    /// `Some(n)`: report each token's log-probability and its `n` most likely alternatives.
    pub logprobs: Option<usize>,
    /// `Some(tools)`: the output is parsed for the family's tool calls (fail closed), and text
    /// from the family's tool-call marker on is held back while streaming.
    pub tools: Option<Vec<Value>>,
    /// Keep the longest prefix the model already holds (and, for a recurrent model, a checkpoint
    /// before the prompt's last assistant-turn opener); `false` prefills from position 0.
    pub reuse_prefix: bool,
    /// Whether the reply's reasoning block is split from its content.
    pub reasoning: Reasoning,
    /// The response format to enforce ([`TextSide::compile`]).
    pub constraint: Option<Constraint>,
}

impl Request {
    /// A request for `prompt` with `sampling` and a budget of `max_tokens` new tokens; no stop
    /// strings, logprobs, tools or constraint, prefix reuse on, no reasoning split.
    pub fn new(prompt: Vec<u32>, sampling: SamplerConfig, max_tokens: usize) -> Self {
        Request {
            prompt,
            sampling,
            stop: Vec::new(),
            max_tokens,
            logprobs: None,
            tools: None,
            reuse_prefix: true,
            reasoning: Reasoning::Raw,
            constraint: None,
        }
    }
}

/// How a generation treats the reasoning block of its reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reasoning {
    /// All text is content (raw completions).
    #[default]
    Raw,
    /// The family's reasoning block ([`ReasoningParser`]) goes to [`Sink::reasoning`] and
    /// [`Outcome::reasoning`], the rest is content. `open`: the prompt ends inside the block
    /// ([`ChatPrompt::reasoning_open`](crate::ChatPrompt::reasoning_open)).
    Split {
        /// The reply starts inside the block.
        open: bool,
    },
}

/// Where the generated text goes while it is generated.
pub trait Sink {
    /// Text that can be shown now (after stop strings, the reasoning split and the tool-call
    /// hold-back), with the log-probabilities of the tokens generated since the previous delta.
    /// Returns `false` to stop generation ([`Finish::Cancelled`]).
    fn delta(&mut self, text: String, logprobs: Vec<TokenLogprob>) -> bool;
    /// Reasoning text that can be shown now ([`Reasoning::Split`]); the log-probabilities of its
    /// tokens go with the next [`delta`](Self::delta). Returns `false` to stop generation.
    /// Default: dropped.
    fn reasoning(&mut self, text: String) -> bool {
        let _ = text;
        true
    }
    /// Checked after every token: `true` stops generation ([`Finish::Cancelled`]).
    fn cancelled(&self) -> bool;
    /// After the prompt's forward pass, `cached` of its tokens reused (live statistics).
    /// Default: nothing.
    fn prefilled(&mut self, cached: usize, model: &dyn Model) {
        let _ = (cached, model);
    }
    /// After each decode step's forward pass (live statistics). Default: nothing.
    fn decoded(&mut self, model: &dyn Model) {
        let _ = model;
    }
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The model sampled this stop token (not part of the output).
    StopToken(u32),
    /// A stop string completed (it is not part of the output).
    StopString,
    /// The response format's grammar is complete: nothing but a stop token could follow.
    Complete,
    /// `max_tokens` new tokens were generated.
    MaxTokens,
    /// The KV cache is full.
    Context,
    /// The output holds tool calls (`Outcome::tool_calls`).
    ToolCalls,
    /// The sink said stop (a client went away, Ctrl-C, a write failed).
    Cancelled,
}

/// Counts and timings of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose state came from the retained prefix (not prefilled again).
    pub cached_tokens: usize,
    /// Generated tokens, stop tokens excluded.
    pub new_tokens: usize,
    /// Prefix reuse and prefill, up to the first logits.
    pub prefill: Duration,
    /// The decode steps after the first logits, to the end.
    pub decode: Duration,
    /// Compiling the response format (0 without one; the one-time vocabulary index excluded).
    pub constraint_compile: Duration,
    /// Computing and applying the masks of the response format, all steps together.
    pub constraint_masks: Duration,
}

/// The end of a generation.
#[derive(Debug)]
pub struct Outcome {
    /// Why it ended.
    pub finish: Finish,
    /// The visible content (for tool calls: the text outside the call blocks).
    pub content: String,
    /// The reasoning block's text ([`Reasoning::Split`]; empty otherwise).
    pub reasoning: String,
    /// Parsed tool calls (only with `Request::tools`).
    pub tool_calls: Vec<ToolCall>,
    /// The generated token ids (stop tokens excluded).
    pub tokens: Vec<u32>,
}

/// A loaded model, its text side, and which token ids its state holds: one conversation at a
/// time, as `run --chat` and `serve`'s single-prefix prompt cache keep it.
pub struct Session {
    model: Box<dyn Model>,
    text: Arc<TextSide>,
    cache: PrefixCache,
}

impl Session {
    /// A session over `model` with `text`, holding nothing yet.
    pub fn new(model: Box<dyn Model>, text: Arc<TextSide>) -> Self {
        Session {
            model,
            text,
            cache: PrefixCache::new(),
        }
    }

    /// The model (engine, expert-cache counters, KV bytes).
    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    /// The text side.
    pub fn text(&self) -> &Arc<TextSide> {
        &self.text
    }

    /// Forgets the held conversation (the next request prefills from position 0).
    pub fn clear(&mut self) {
        self.cache.clear(self.model.as_mut());
    }

    /// Runs `req`, streaming into `sink`; `stats` is filled as it goes (also when an error ends
    /// it). Greedy sampling without logprobs or a constraint takes the model's fused argmax head.
    ///
    /// Errors: [`SessionError::PromptLength`] for an empty prompt or one that leaves no room in
    /// the context (checked before anything runs); [`SessionError::Model`] from a forward pass
    /// (the held prefix is then cleared); [`SessionError::NoLogits`];
    /// [`SessionError::Constraint`] (also for a constraint on a prompt that leaves a reasoning
    /// block open: the grammar would bind inside it); [`SessionError::MalformedToolCall`] when `tools` were given
    /// and the model wrote a call block, opened by the marker token, that does not parse.
    pub fn generate(
        &mut self,
        mut req: Request,
        sink: &mut dyn Sink,
        stats: &mut GenStats,
    ) -> Result<Outcome, SessionError> {
        let text = Arc::clone(&self.text);
        let tok = &text.tokenizer;
        let max_context = self.model.engine().max_context;
        stats.prompt_tokens = req.prompt.len();
        if req.prompt.is_empty() || req.prompt.len() >= max_context {
            return Err(SessionError::PromptLength {
                len: req.prompt.len(),
                max_context,
            });
        }
        let mut constraint = req.constraint.take();
        if constraint.is_some() && req.reasoning == (Reasoning::Split { open: true }) {
            return Err(SessionError::Constraint(REASONING_OPEN.into()));
        }
        if let Some(c) = &constraint {
            stats.constraint_compile = c.compile;
        }
        let want = if req.sampling.is_greedy() && req.logprobs.is_none() && constraint.is_none() {
            Want::Argmax
        } else {
            Want::Last
        };
        let mut sampler = Sampler::new(req.sampling.clone());
        let t0 = Instant::now();
        stats.cached_tokens = if req.reuse_prefix {
            self.cache.reuse(self.model.as_mut(), &req.prompt)
        } else {
            self.cache.clear(self.model.as_mut());
            0
        };
        // A recurrent model keeps a checkpoint where the conversation's next prompt departs.
        let open = req.reuse_prefix.then_some(text.turn_open).flatten();
        let mut out = self.cache.prefill(
            self.model.as_mut(),
            &req.prompt,
            stats.cached_tokens,
            open,
            want,
        )?;
        stats.prefill = t0.elapsed();
        sink.prefilled(stats.cached_tokens, self.model.as_ref());
        let t1 = Instant::now();

        let mut history = req.prompt.clone();
        let mut detok = StreamingDetokenizer::new(tok);
        let mut stops = StopStrings::new(std::mem::take(&mut req.stop));
        let mut gate = ToolGate::new(req.tools.as_ref().map(|_| tool_marker(text.family)));
        let mut think = match req.reasoning {
            Reasoning::Split { open } => Some(ReasoningParser::new(text.family, open)),
            Reasoning::Raw => None,
        };
        let mut reasoning = String::new();
        let mut raw = String::new();
        let mut pending: Vec<TokenLogprob> = Vec::new();
        let finish;
        loop {
            let pos = self.model.position();
            let next = match out {
                Logits::Argmax(id) => id,
                Logits::Rows(mut row) => {
                    let before = req.logprobs.map(|n| (row.clone(), n));
                    if let Some(c) = &mut constraint {
                        c.mask(&mut row)?;
                    }
                    let id = sampler.sample(&mut row, &history, pos);
                    if let Some((orig, n)) = before {
                        pending.push(logprob(&text, &orig, id, n));
                    }
                    id
                }
                Logits::None => return Err(SessionError::NoLogits),
            };
            if text.stop_ids.contains(&next) {
                pending.pop();
                finish = Finish::StopToken(next);
                break;
            }
            if let Some(c) = &mut constraint {
                c.advance(next)?;
            }
            stats.new_tokens += 1;
            history.push(next);
            let (emit, stopped) = stops.push(&detok.push(next));
            let emit = match &mut think {
                Some(t) => {
                    let ReasoningSplit {
                        reasoning: r,
                        content,
                    } = t.push(&emit);
                    reasoning.push_str(&r);
                    if !r.is_empty() && !sink.reasoning(r) {
                        finish = Finish::Cancelled;
                        break;
                    }
                    content
                }
                None => emit,
            };
            raw.push_str(&emit);
            let visible = gate.push(&emit);
            if !visible.is_empty() && !sink.delta(visible, std::mem::take(&mut pending)) {
                finish = Finish::Cancelled;
                break;
            }
            if sink.cancelled() {
                finish = Finish::Cancelled;
                break;
            }
            if stopped {
                finish = Finish::StopString;
                break;
            }
            if constraint.as_ref().is_some_and(Constraint::is_done) {
                finish = Finish::Complete;
                break;
            }
            if stats.new_tokens >= req.max_tokens {
                finish = Finish::MaxTokens;
                break;
            }
            if pos + 1 > max_context {
                finish = Finish::Context;
                break;
            }
            out = match self.cache.forward(self.model.as_mut(), &[next], want) {
                Ok(o) => {
                    sink.decoded(self.model.as_ref());
                    o
                }
                Err(e) => {
                    stats.decode = t1.elapsed();
                    return Err(e.into());
                }
            };
        }
        if let Some(c) = &constraint {
            stats.constraint_masks = c.mask_time;
        }
        let tail = if stops.stopped() {
            String::new()
        } else {
            let (tail, _) = stops.push(&detok.finish());
            tail + &stops.finish()
        };
        let tail = match &mut think {
            Some(t) => {
                let mut s = t.push(&tail);
                let end = t.finish();
                s.reasoning += &end.reasoning;
                s.content += &end.content;
                reasoning.push_str(&s.reasoning);
                if !s.reasoning.is_empty() {
                    sink.reasoning(s.reasoning);
                }
                s.content
            }
            None => tail,
        };
        raw.push_str(&tail);
        let mut visible = gate.push(&tail);
        stats.decode = t1.elapsed();
        if finish == Finish::Cancelled {
            // Whatever was generated stays (a Ctrl-C'd reply is part of the conversation).
            visible.push_str(&gate.release());
            sink.delta(visible, Vec::new());
            return Ok(Outcome {
                finish,
                content: raw,
                reasoning,
                tool_calls: Vec::new(),
                tokens: history.split_off(req.prompt.len()),
            });
        }
        // A stop string or the budget cut the output: it ends as it is, whatever it was in
        // the middle of.
        let cut = stops.stopped() || matches!(finish, Finish::MaxTokens | Finish::Context);
        let generated = history.split_off(req.prompt.len());
        let marker_token = text.tool_marker_id.is_some_and(|m| generated.contains(&m));
        let parsed = req
            .tools
            .as_ref()
            .map(|tools| parse_tool_calls_with_tools(text.family, &raw, Some(tools)));
        let outcome = match parsed {
            None => {
                visible.push_str(&gate.finish());
                Outcome {
                    finish,
                    content: raw,
                    reasoning: std::mem::take(&mut reasoning),
                    tool_calls: Vec::new(),
                    tokens: generated,
                }
            }
            Some(Ok(parsed)) => {
                visible.push_str(&gate.finish());
                Outcome {
                    finish: if parsed.tool_calls.is_empty() {
                        finish
                    } else {
                        Finish::ToolCalls
                    },
                    content: parsed.content,
                    reasoning: std::mem::take(&mut reasoning),
                    tool_calls: parsed.tool_calls,
                    tokens: generated,
                }
            }
            // A call cut short, or the marker's characters written as prose (not the marker
            // token): text, not an error.
            Some(Err(_)) if cut || !marker_token => {
                visible.push_str(&gate.release());
                Outcome {
                    finish,
                    content: raw,
                    reasoning: std::mem::take(&mut reasoning),
                    tool_calls: Vec::new(),
                    tokens: generated,
                }
            }
            Some(Err(e)) => {
                return Err(SessionError::MalformedToolCall {
                    message: e.to_string(),
                    raw,
                })
            }
        };
        if !visible.is_empty() || !pending.is_empty() {
            sink.delta(visible, std::mem::take(&mut pending));
        }
        Ok(outcome)
    }
}
