//! Shared harness of the server tests: servers started in-process on loopback port 0 over the demo
//! install (`mference_testkit::demo_install`), and the model wrappers that make the tool-call and
//! queue scenarios possible. The repository, the venv and the HTTP client come from
//! `mference-testkit`.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mference_models::{Engine, LoadOptions, Logits, Model, ModelError, Want};
use mference_runtime::{CacheSlots, StreamerStats};
use mference_server::{PromptCacheMode, Server, ServerConfig, TextSide};
use serde_json::Value;

use mference_testkit::demo_install;
use mference_testkit::http::post;

pub const MODEL_ID: &str = "demo";

pub fn load_model(max_context: usize) -> Box<dyn Model> {
    load_model_from(demo_install(), max_context)
}

/// [`load_model`] from another install directory.
pub fn load_model_from(dir: &std::path::Path, max_context: usize) -> Box<dyn Model> {
    mference_models::load(dir, &resident_opts(max_context)).expect("loading the demo model")
}

/// The test servers' load options: every expert resident, one thread, 128-row prefill chunks.
pub fn resident_opts(max_context: usize) -> LoadOptions {
    LoadOptions {
        slots: CacheSlots::Resident,
        threads: 1,
        prefill_chunk: 128,
        max_context,
        ..Default::default()
    }
}

/// Settings of a test server.
pub struct Opts {
    pub max_context: usize,
    pub queue_limit: usize,
    pub cache: PromptCacheMode,
    pub heartbeat: Duration,
    /// Wrap the model in [`ToolCaller`] with this call text (see there).
    pub tool_script: Option<Arc<Mutex<String>>>,
    /// Sleep this long in every forward pass (queue and heartbeat tests need slow generation).
    pub delay: Duration,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            max_context: 4096,
            queue_limit: 4,
            cache: PromptCacheMode::SinglePrefix,
            heartbeat: Duration::from_secs(5),
            tool_script: None,
            delay: Duration::ZERO,
        }
    }
}

pub fn start(o: Opts) -> Server {
    start_with(o, load_model)
}

/// [`start`] with the model from `load(max_context)`.
pub fn start_with(o: Opts, load: impl FnOnce(usize) -> Box<dyn Model>) -> Server {
    let text = TextSide::load(demo_install()).unwrap();
    let mut model = load(o.max_context);
    if let Some(script) = o.tool_script {
        model = Box::new(ToolCaller::new(model, demo_install(), &GEMMA_TOOLS, script));
    }
    if !o.delay.is_zero() {
        model = Box::new(Slow {
            inner: model,
            delay: o.delay,
        });
    }
    let cfg = ServerConfig {
        model_id: MODEL_ID.into(),
        queue_limit: o.queue_limit,
        prompt_cache: o.cache,
        heartbeat: o.heartbeat,
        stop_on_signals: false,
    };
    mference_server::start(model, text, cfg, "127.0.0.1:0".parse().unwrap()).unwrap()
}

/// What [`ToolCaller`] looks for and writes in one family's chat: a text the rendered prompt holds
/// only when tools are offered, the generation prompt it ends with, and the stop token written
/// after the forced call.
pub struct ToolMarkers {
    pub decl: &'static str,
    pub gen_prompt: &'static str,
    pub stop: &'static str,
}

/// Gemma 4 (the demo model): the `<|tool>` declaration, the thought channel closed, `<|tool_response>`.
pub const GEMMA_TOOLS: ToolMarkers = ToolMarkers {
    decl: "<|tool>",
    gen_prompt: "<|turn>model\n<|channel>thought\n<channel|>",
    stop: "<|tool_response>",
};

/// DeepSeek-V4: the template's tools header, `<｜Assistant｜></think>` (thinking off),
/// `<｜end▁of▁sentence｜>`.
pub const DEEPSEEK_V4_TOOLS: ToolMarkers = ToolMarkers {
    decl: "### Available Tool Schemas",
    gen_prompt: "<｜Assistant｜></think>",
    stop: "<｜end▁of▁sentence｜>",
};

/// The fixture models were never trained to call tools, so the tool-call path is exercised with
/// this wrapper: the real model runs every token (its KV cache, position and truncation are the
/// real ones), but after a prefill whose sequence holds the family's tool declaration
/// ([`ToolMarkers::decl`]'s tokens) and ends with its generation prompt, the next tokens are
/// forced to the tokens of `script` followed by [`ToolMarkers::stop`] (`\u{1}` in the script
/// splits it into separately encoded pieces). Everything after the model — sampling,
/// detokenizing, tool-call parsing, the OpenAI shapes — is the server's real code.
pub struct ToolCaller {
    inner: Box<dyn Model>,
    script: Arc<Mutex<String>>,
    decl: Vec<u32>,
    gen_prompt: Vec<u32>,
    stop: u32,
    seq: Vec<u32>,
    forcing: Option<(Vec<u32>, usize)>,
    /// A second tokenizer (the server owns the first) to encode `script`.
    tok: mference_text::Tokenizer,
}

impl ToolCaller {
    /// Over the tokenizer of the install at `dir`.
    pub fn new(
        inner: Box<dyn Model>,
        dir: &std::path::Path,
        markers: &ToolMarkers,
        script: Arc<Mutex<String>>,
    ) -> Self {
        let tok = mference_text::Tokenizer::from_dir(&dir.join("tokenizer")).unwrap();
        let stop = tok.encode(markers.stop, false).unwrap();
        assert_eq!(stop.len(), 1, "{} is not one token", markers.stop);
        ToolCaller {
            inner,
            script,
            decl: tok.encode(markers.decl, false).unwrap(),
            gen_prompt: tok.encode(markers.gen_prompt, false).unwrap(),
            stop: stop[0],
            seq: Vec::new(),
            forcing: None,
            tok,
        }
    }

    fn forced(&self, id: u32, want: Want) -> Logits {
        match want {
            Want::Argmax => Logits::Argmax(id),
            _ => {
                let mut row = vec![-30.0f32; self.inner.vocab_size()];
                row[id as usize] = 30.0;
                Logits::Rows(row)
            }
        }
    }
}

impl Model for ToolCaller {
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError> {
        let real = self.inner.forward(tokens, want)?;
        self.seq.extend_from_slice(tokens);
        if self.forcing.is_none() || tokens.len() > 1 {
            self.forcing = None;
            let declared = self.seq.windows(self.decl.len()).any(|w| w == self.decl);
            if declared && self.seq.ends_with(&self.gen_prompt) {
                // `\u{1}` splits the script into pieces encoded separately (to spell a
                // marker with ordinary tokens instead of the marker token).
                let mut ids: Vec<u32> = Vec::new();
                for piece in self.script.lock().unwrap().split('\u{1}') {
                    ids.extend(self.tok.encode(piece, false).unwrap());
                }
                ids.push(self.stop);
                self.forcing = Some((ids, 0));
            }
        }
        if let Some((ids, at)) = &mut self.forcing {
            let id = ids[*at];
            *at += 1;
            if *at == ids.len() {
                self.forcing = None;
            }
            return Ok(self.forced(id, want));
        }
        Ok(real)
    }
    fn position(&self) -> usize {
        self.inner.position()
    }
    fn truncate(&mut self, n: usize) -> bool {
        let ok = self.inner.truncate(n);
        if ok {
            self.seq.truncate(n);
            // A rewound sequence starts its forced reply again (a cut reply left it midway).
            self.forcing = None;
        }
        ok
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn engine(&self) -> &Engine {
        self.inner.engine()
    }
    fn expert_stats(&self) -> Vec<StreamerStats> {
        self.inner.expert_stats()
    }
    fn device_expert_stats(&self) -> Option<mference_models::DeviceExpertStats> {
        self.inner.device_expert_stats()
    }
    fn size_device_experts(&self) -> Result<(), ModelError> {
        self.inner.size_device_experts()
    }
    fn kv_bytes(&self) -> usize {
        self.inner.kv_bytes()
    }
}

/// The real model, slowed down by `delay` per forward pass.
pub struct Slow {
    inner: Box<dyn Model>,
    delay: Duration,
}

impl Model for Slow {
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError> {
        std::thread::sleep(self.delay);
        self.inner.forward(tokens, want)
    }
    fn position(&self) -> usize {
        self.inner.position()
    }
    fn truncate(&mut self, n: usize) -> bool {
        self.inner.truncate(n)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn engine(&self) -> &Engine {
        self.inner.engine()
    }
    fn expert_stats(&self) -> Vec<StreamerStats> {
        self.inner.expert_stats()
    }
    fn device_expert_stats(&self) -> Option<mference_models::DeviceExpertStats> {
        self.inner.device_expert_stats()
    }
    fn size_device_experts(&self) -> Result<(), ModelError> {
        self.inner.size_device_experts()
    }
    fn kv_bytes(&self) -> usize {
        self.inner.kv_bytes()
    }
}

/// A chat request body for the demo model.
pub fn chat_body(messages: Value) -> Value {
    serde_json::json!({"model": MODEL_ID, "messages": messages, "temperature": 0, "max_tokens": 24})
}

/// Resident set size of this process, bytes (`VmRSS`), and its peak (`VmHWM`).
pub fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// One turn of a warm-vs-cold comparison: the warm (prefix-reusing) and cold servers' answers to
/// the same request must have the same tokens and text and logprobs within `tol`; the cold one
/// reuses nothing. Returns the warm answer's (prompt tokens, cached tokens).
pub fn assert_warm_equals_cold(turn: usize, w: &Value, c: &Value, tol: f64) -> (u64, u64) {
    let content = |r: &Value| {
        r["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .clone()
    };
    let (wl, cl) = (content(w), content(c));
    let tokens = |l: &[Value]| l.iter().map(|x| x["token"].clone()).collect::<Vec<_>>();
    assert_eq!(
        tokens(&wl),
        tokens(&cl),
        "turn {turn}: warm and cold tokens differ"
    );
    assert_eq!(
        w["choices"][0]["message"]["content"],
        c["choices"][0]["message"]["content"]
    );
    let mut worst = 0.0f64;
    for (x, y) in wl.iter().zip(&cl) {
        let (x, y) = (
            x["logprob"].as_f64().unwrap(),
            y["logprob"].as_f64().unwrap(),
        );
        assert!((x - y).abs() < tol, "turn {turn}: logprob {x} vs {y}");
        worst = worst.max((x - y).abs());
    }
    eprintln!("turn {turn}: max |warm - cold| logprob {worst:.2e} (budget {tol:.0e})");
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (w["usage"]["prompt_tokens"].as_u64().unwrap(), cached)
}

/// A server on `dir` loaded with `opts`, with the prompt cache `cache`.
pub fn start_install(
    dir: &std::path::Path,
    opts: &LoadOptions,
    cache: PromptCacheMode,
    model_id: &str,
) -> Server {
    start_install_wrapped(dir, opts, cache, model_id, |m| m)
}

/// [`start_install`] with the model wrapped by `wrap` (a [`ToolCaller`]).
pub fn start_install_wrapped(
    dir: &std::path::Path,
    opts: &LoadOptions,
    cache: PromptCacheMode,
    model_id: &str,
    wrap: impl FnOnce(Box<dyn Model>) -> Box<dyn Model>,
) -> Server {
    let text = TextSide::load(dir).unwrap();
    let model = wrap(
        mference_models::load(dir, opts)
            .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display())),
    );
    let cfg = ServerConfig {
        prompt_cache: cache,
        ..ServerConfig::new(model_id)
    };
    mference_server::start(model, text, cfg, "127.0.0.1:0".parse().unwrap()).unwrap()
}

/// The same greedy conversation (a novel-reader system prompt, a question and two follow-ups)
/// sent to a warm server (single-prefix cache) and a cold one (cache off): every turn's reply must
/// be the same ([`assert_warm_equals_cold`] with logprobs within `tol`). Returns each turn's
/// `(prompt tokens, cached tokens)` on the warm server; the first turn reused nothing.
pub fn warm_cold_conversation(
    start: impl Fn(PromptCacheMode) -> Server,
    model_id: &str,
    max_tokens: u32,
    tol: f64,
) -> Vec<(u64, u64)> {
    let warm = start(PromptCacheMode::SinglePrefix);
    let cold = start(PromptCacheMode::Off);
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a careful reader of old novels."}),
        serde_json::json!({"role": "user", "content": "Who lives at Netherfield Park?"}),
    ];
    let follow_ups = ["And what of Mr. Darcy?", "Tell me about Longbourn."];
    let mut seen = Vec::new();
    for t in 0..=follow_ups.len() {
        if t > 0 {
            messages.push(serde_json::json!({"role": "user", "content": follow_ups[t - 1]}));
        }
        let body = serde_json::json!({"model": model_id, "messages": messages, "temperature": 0,
            "max_tokens": max_tokens, "logprobs": true});
        let (s, w) = post(warm.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{w}");
        let (s, c) = post(cold.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{c}");
        seen.push(assert_warm_equals_cold(t, &w, &c, tol));
        messages.push(
            serde_json::json!({"role": "assistant", "content": w["choices"][0]["message"]["content"]}),
        );
    }
    eprintln!("(prompt, cached) per turn: {seen:?}");
    assert_eq!(seen[0].1, 0, "nothing to reuse on the first request");
    warm.shutdown();
    cold.shutdown();
    seen
}

/// [`warm_cold_conversation`] on the install `dir` loaded with `opts`, where every follow-up
/// turn must reuse the previous turn's whole prompt but its generation suffix `gen_prompt` (from
/// the assistant opener on: where a recurrent model keeps its checkpoint).
pub fn assert_follow_ups_reuse_the_conversation(
    dir: &std::path::Path,
    opts: &LoadOptions,
    model_id: &str,
    max_tokens: u32,
    tol: f64,
    gen_prompt: &str,
) {
    let seen = warm_cold_conversation(
        |cache| start_install(dir, opts, cache, model_id),
        model_id,
        max_tokens,
        tol,
    );
    let tok = mference_text::Tokenizer::from_dir(&dir.join("tokenizer")).unwrap();
    let suffix = tok.encode(gen_prompt, false).unwrap().len() as u64;
    for t in 1..seen.len() {
        assert_eq!(
            seen[t].1,
            seen[t - 1].0 - suffix,
            "turn {t}: the reused prefix is not the previous conversation less {gen_prompt:?}: {seen:?}"
        );
    }
}
