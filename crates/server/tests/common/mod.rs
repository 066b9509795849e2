//! Shared test harness: install the bundled demo model with the real installer (once per test
//! binary), start servers in-process on loopback port 0, and a small HTTP client.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use mference_models::{Engine, LoadOptions, Logits, Model, ModelError, Want};
use mference_runtime::{CacheSlots, StreamerStats};
use mference_server::{PromptCacheMode, Server, ServerConfig, TextSide};
use serde_json::Value;

pub const MODEL_ID: &str = "demo";

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// `<repo>/.venv/bin/python`; a missing venv fails the test with the command that makes it.
pub fn python() -> PathBuf {
    let p = repo().join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run `bash tools/ref/setup-venv.sh` (tools/test.sh does)",
        p.display()
    );
    p
}

/// The demo install (`assets/models/gemma4-tiny` through the real installer), made once per test
/// process under `target/`.
pub fn install() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let name = exe.file_stem().unwrap().to_string_lossy().to_string();
        let root = repo().join("target/server-tests").join(name);
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let out = root.join("demo.gturbo");
        mference_install::install_local(
            &repo().join("assets/models/gemma4-tiny"),
            &out,
            &mference_install::InstallOptions {
                progress: mference_install::ProgressMode::Quiet,
                disk_reserve_bytes: 0,
                ..Default::default()
            },
        )
        .expect("installing the demo model");
        out
    })
}

pub fn load_model(max_context: usize) -> Box<dyn Model> {
    mference_models::load(
        install(),
        &LoadOptions {
            slots: CacheSlots::Resident,
            threads: 1,
            prefill_chunk: 128,
            max_context,
            ..Default::default()
        },
    )
    .expect("loading the demo model")
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
    let text = TextSide::load(install()).unwrap();
    let mut model = load_model(o.max_context);
    if let Some(script) = o.tool_script {
        model = Box::new(ToolCaller::new(model, &text, script));
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
    };
    mference_server::start(model, text, cfg, "127.0.0.1:0".parse().unwrap()).unwrap()
}

/// The demo model was trained on plain English and never writes tool calls, so the tool-call
/// path is exercised with this wrapper: the real model runs every token (its KV cache, position
/// and truncation are the real ones), but after a prefill whose sequence declares a tool
/// (`<|tool>`) and ends with the generation prompt (`<|turn>model\n<|channel>thought\n<channel|>`),
/// the next tokens are forced to the tokens of `script` followed by `<|tool_response>` (the stop
/// token Gemma writes after its calls). Everything after the model — sampling, detokenizing,
/// tool-call parsing, the OpenAI shapes — is the server's real code.
pub struct ToolCaller {
    inner: Box<dyn Model>,
    script: Arc<Mutex<String>>,
    tool_decl: u32,
    gen_prompt: Vec<u32>,
    stop: u32,
    seq: Vec<u32>,
    forcing: Option<(Vec<u32>, usize)>,
    /// A second tokenizer (the server owns the first) to encode `script`.
    tok: mference_text::Tokenizer,
}

impl ToolCaller {
    pub fn new(inner: Box<dyn Model>, text: &TextSide, script: Arc<Mutex<String>>) -> Self {
        let tok = &text.tokenizer;
        let tool_decl = tok.token_id("<|tool>").expect("<|tool> token");
        let gen_prompt = tok
            .encode("<|turn>model\n<|channel>thought\n<channel|>", false)
            .unwrap();
        let stop = tok
            .token_id("<|tool_response>")
            .expect("<|tool_response> token");
        ToolCaller {
            inner,
            script,
            tool_decl,
            gen_prompt,
            stop,
            seq: Vec::new(),
            forcing: None,
            tok: mference_text::Tokenizer::from_dir(&install().join("tokenizer")).unwrap(),
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
            if self.seq.contains(&self.tool_decl) && self.seq.ends_with(&self.gen_prompt) {
                let mut ids = self
                    .tok
                    .encode(&self.script.lock().unwrap(), false)
                    .unwrap();
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
    fn kv_bytes(&self) -> usize {
        self.inner.kv_bytes()
    }
}

/// A blocking HTTP client that reports every status (no error on 4xx/5xx).
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into()
}

/// POSTs JSON; returns the status and the body as JSON (or a JSON string when it is not JSON).
pub fn post(addr: SocketAddr, path: &str, body: &Value) -> (u16, Value) {
    let mut r = agent()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn get(addr: SocketAddr, path: &str) -> (u16, Value) {
    let mut r = agent().get(format!("http://{addr}{path}")).call().unwrap();
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// A streamed response: status, content type, and the raw SSE text.
pub struct Sse {
    pub status: u16,
    pub content_type: String,
    pub raw: String,
}

impl Sse {
    /// The `data:` payloads in order (`[DONE]` included as a string).
    pub fn data(&self) -> Vec<String> {
        self.raw
            .split("\n\n")
            .filter_map(|ev| ev.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// The JSON chunks (every `data:` but `[DONE]`).
    pub fn chunks(&self) -> Vec<Value> {
        self.data()
            .iter()
            .filter(|d| d.as_str() != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    /// The concatenated `delta.content` (chat) or `text` (completions).
    pub fn text(&self) -> String {
        self.chunks()
            .iter()
            .filter_map(|c| {
                let ch = c["choices"].get(0)?;
                ch["delta"]["content"]
                    .as_str()
                    .or(ch["text"].as_str())
                    .map(str::to_string)
            })
            .collect()
    }
}

pub fn post_stream(addr: SocketAddr, path: &str, body: &Value) -> Sse {
    let r = agent()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    let status = r.status().as_u16();
    let content_type = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut raw = String::new();
    r.into_body()
        .into_reader()
        .read_to_string(&mut raw)
        .unwrap();
    Sse {
        status,
        content_type,
        raw,
    }
}

/// Sends raw bytes and returns the status line's code and the rest of the response (the
/// connection is closed by the request's `Connection: close`).
pub fn raw_request(addr: SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, text)
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
