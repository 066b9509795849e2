//! `run` (raw prompt, messages file, interactive chat), and the install helpers the other
//! commands share.

use crate::notes::say;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args};

use mference_models::Model;
use mference_runtime::SamplerConfig;
use mference_session::{
    ChatPrompt, Finish, GenStats, Reasoning, Request, Session, SessionError, Sink, TextSide,
    TokenLogprob,
};
use mference_text::TokenizerCache;

use crate::flags::{count, seed_flag, typed, ModelArgs, Verify};
use crate::load_options::{load_options_for, open_install};

/// `mference run`: exactly one of --prompt, --messages-file and --chat, which clap enforces (and
/// its usage line shows) like every flag value it can check alone.
#[derive(Args, Debug)]
#[command(
    allow_negative_numbers = true,
    group(ArgGroup::new("mode").required(true).args(["prompt", "messages_file", "chat"])),
)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Raw completion of this text (not empty), no chat framing.
    #[arg(long, value_parser = typed(prompt_text))]
    pub prompt: Option<String>,
    /// A JSON array of chat messages ({role, content}, content a string or a list of text
    /// parts, as `serve` takes them) rendered through the model's chat template.
    #[arg(long)]
    pub messages_file: Option<PathBuf>,
    /// Interactive chat (/clear, /history, /think on|off, /quit). At a terminal: Alt-Enter or a
    /// """ block for several lines, pastes arrive whole, Up/Down recall earlier messages.
    #[arg(long)]
    pub chat: bool,
    /// Thinking for --chat and --messages-file: renders the chat template with
    /// `enable_thinking`; the reasoning is printed to stderr, the answer to stdout.
    #[arg(long, value_enum)]
    pub think: Option<Think>,
    /// System message for --chat (repeatable; joined with newlines).
    #[arg(long)]
    pub system: Vec<String>,
    /// Tokens to generate at most (at least 1).
    #[arg(long, default_value_t = 1024, value_parser = count(1, usize::MAX))]
    pub max_new: usize,
    /// Positions the KV cache holds (at least 1, at most the model's).
    #[arg(long, default_value_t = 4096, value_parser = count(1, usize::MAX))]
    pub max_context: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.2, value_parser = typed(temperature))]
    pub temperature: f32,
    /// 0…256; 0 = off.
    #[arg(long, default_value_t = 64, value_parser = count(0, 256))]
    pub top_k: usize,
    /// (0, 1].
    #[arg(long, default_value_t = 0.95, value_parser = typed(top_p))]
    pub top_p: f32,
    /// A finite number > 0 (1 = off).
    #[arg(long, default_value_t = 1.0, value_parser = typed(repetition_penalty))]
    pub repetition_penalty: f32,
    /// Sampler seed, 0 to 18446744073709551615 (with --temperature above 0): the same seed, prompt
    /// and settings give the same reply, whether or not the prompt was cached (all kernel tables
    /// but avx512vnni). Default: random.
    #[arg(long, value_parser = seed_flag())]
    pub seed: Option<u64>,
    /// Stop string (repeatable); it is not printed.
    #[arg(long, value_parser = typed(stop_text))]
    pub stop: Vec<String>,
    /// Prefill chunk rows: 32, 64, 128, 256, 512, 1024, 2048, 4096 or auto.
    #[arg(long, default_value = "auto", value_parser = prefill_chunk_flag())]
    pub prefill_chunk: String,
    /// Print only the generated text (no footer).
    #[arg(long)]
    pub quiet: bool,
    /// Also print the prompt and generated token ids to stderr as one JSON line.
    #[arg(long)]
    pub show_ids: bool,
}

/// `--think`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Think {
    On,
    Off,
}

impl Think {
    /// The template variables of this setting (`enable_thinking`).
    pub(crate) fn kwargs(self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("enable_thinking".into(), (self == Think::On).into());
        m
    }
}

const CHUNKS: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// Largest prefill chunk `auto` picks.
const AUTO_CHUNK_MAX: usize = 512;

/// The install's `max_position_embeddings`, when its config states one.
pub(crate) fn max_positions(dir: &Path) -> Result<Option<usize>> {
    Ok(mference_session::max_positions(dir)?)
}

/// Refuses a directory that is not a complete install, with what to run instead.
pub(crate) fn check_install_dir(dir: &Path) -> Result<()> {
    Ok(mference_session::check_install_dir(dir)?)
}

pub(crate) fn load_text(dir: &Path) -> Result<TextSide> {
    check_install_dir(dir)?;
    TextSide::load(dir).with_context(|| format!("loading the text side of {}", dir.display()))
}

/// [`load_text`] for a caller that opens the install with [`open_install`] beside it and stops
/// if that fails: under `--verify full-sha256` that check holds `tokenizer.json` to the
/// manifest's digest, so the tokenizer cache is bound to that digest instead of hashing the file
/// a second time ([`TextSide::load_beside_check`]).
pub(crate) fn load_text_beside_check(m: &ModelArgs) -> Result<TextSide> {
    let dir = &m.model;
    check_install_dir(dir)?;
    match m.verify {
        Verify::FullSha256 => TextSide::load_beside_check(dir),
        Verify::TrustedReceipt => TextSide::load(dir),
    }
    .with_context(|| format!("loading the text side of {}", dir.display()))
}

/// A line on stderr when the install's tokenizer cache could not be used as it should: a stale
/// one was replaced, or none could be written (each start then parses `tokenizer.json`).
pub(crate) fn cache_note(text: &TextSide) {
    match &text.tokenizer_cache {
        Some(TokenizerCache::Written {
            replaced: Some(why),
        }) => say!("[tokenizer cache {why}: rebuilt from tokenizer.json]"),
        Some(TokenizerCache::NotWritten(why)) => {
            say!("[tokenizer cache not written ({why}): every start parses tokenizer.json]")
        }
        _ => {}
    }
}

/// `--prompt`: any text but none; an empty prompt gives the model no tokens to continue (or,
/// where the tokenizer adds BOS, only BOS).
fn prompt_text(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("invalid --prompt '': the prompt is empty; give the text to complete".into());
    }
    Ok(s.to_string())
}

/// `--stop`: any text but none (an empty stop string would end every reply at once).
fn stop_text(s: &str) -> Result<String, String> {
    if s.is_empty() {
        return Err("invalid --stop '': a stop string must not be empty".into());
    }
    Ok(s.to_string())
}

/// `--temperature`: a finite number >= 0.
fn temperature(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(t) if t >= 0.0 && t.is_finite() => Ok(t),
        _ => Err(format!("--temperature must be >= 0 (0 = greedy), got {s}")),
    }
}

/// `--top-p`: in (0, 1].
fn top_p(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("--top-p must be in (0, 1], got {s}")),
    }
}

/// `--repetition-penalty`: a finite number > 0.
fn repetition_penalty(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
        _ => Err(format!(
            "--repetition-penalty must be a finite number > 0, got {s}"
        )),
    }
}

/// `--prefill-chunk` (run, serve, bench): `auto` or an allowed chunk, checked by clap; the text
/// is kept, since `auto` is resolved against the prompt ([`parse_prefill_chunk`]).
pub(crate) fn prefill_chunk_flag() -> crate::flags::Typed<String> {
    typed(|s| {
        parse_prefill_chunk(s, None)
            .map(|_| s.to_string())
            .map_err(|e| e.to_string())
    })
}

/// The checks between flags (each flag's own value is checked by clap).
fn validate_sampling(a: &RunArgs) -> Result<()> {
    if a.temperature > 0.0 && a.top_k == 0 && a.top_p < 1.0 {
        bail!("--top-p {} requires --top-k between 1 and 256; to turn both truncations off pass --top-k 0 --top-p 1", a.top_p);
    }
    if !a.system.is_empty() && !a.chat {
        bail!("--system requires --chat (put a system message in --messages-file instead)");
    }
    if a.think.is_some() && a.prompt.is_some() {
        bail!("--think needs a chat template: use it with --chat or --messages-file, not --prompt");
    }
    Ok(())
}

/// `auto` is the smallest allowed chunk covering a one-shot prompt (the original's rule), capped at
/// [`AUTO_CHUNK_MAX`]: on Gemma 26B a 4,000-token prompt prefilled at 10.3 tok/s with one 4096-row
/// chunk and 17.3 tok/s with 256-row chunks, at 4.8 vs 3.2 GiB peak RSS (docs/BENCHMARKS.md).
pub(crate) fn parse_prefill_chunk(s: &str, prompt_len: Option<usize>) -> Result<usize> {
    if s == "auto" {
        let n = prompt_len.unwrap_or(128);
        return Ok(CHUNKS
            .iter()
            .copied()
            .find(|&c| c >= n)
            .unwrap_or(4096)
            .clamp(32, AUTO_CHUNK_MAX));
    }
    match s.parse::<usize>() {
        Ok(n) if CHUNKS.contains(&n) => Ok(n),
        _ => bail!("invalid --prefill-chunk '{s}': allowed values are 32, 64, 128, 256, 512, 1024, 2048, 4096, auto"),
    }
}

/// The non-empty JSON array in `path` (`--messages-file`, `--ids`). Errors name the file and say
/// what it must hold (`holds`, e.g. "{role, content} objects") or that the `name` array is empty.
pub(crate) fn read_json_array(
    path: &Path,
    holds: &str,
    name: &str,
) -> Result<Vec<serde_json::Value>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not valid JSON", path.display()))?;
    let serde_json::Value::Array(arr) = v else {
        bail!("{} must hold a JSON array of {holds}", path.display());
    };
    if arr.is_empty() {
        bail!("{}: the {name} array is empty", path.display());
    }
    Ok(arr)
}

/// The messages of `--messages-file`, checked by the parser `serve` uses for `messages`
/// (string content or a list of text parts, system / developer / user / assistant / tool roles,
/// tool calls); an error names the file and the field.
fn read_messages(path: &Path, family: mference_text::Family) -> Result<Vec<serde_json::Value>> {
    let arr = read_json_array(path, "{role, content} objects", "messages")?;
    mference_session::normalize_messages(&arr, family).with_context(|| {
        format!(
            "{} is not a message list this model can take",
            path.display()
        )
    })
}

/// The chat prompt of `messages`, thinking as `think` says (the family's default when `None`).
pub(crate) fn render(
    text: &TextSide,
    messages: &[serde_json::Value],
    think: Option<Think>,
) -> Result<ChatPrompt> {
    let kwargs = think.map(Think::kwargs).unwrap_or_default();
    match text.render_chat(messages, None, &kwargs) {
        Err(SessionError::NoTemplate) => bail!("this install has no chat template; use --prompt"),
        Err(SessionError::Text(e @ mference_text::TextError::TemplateVariable { .. })) => {
            bail!("--think: {e}")
        }
        r => Ok(r?),
    }
}

/// Writes the reply to stdout as it is generated, and its reasoning to stderr (dimmed at a
/// terminal); stops on Ctrl-C or a failed write.
struct Terminal<'a, W: Write> {
    out: &'a mut W,
    cancel: &'a AtomicBool,
    io_err: Option<std::io::Error>,
    /// Reasoning was printed and the line it is on not ended yet.
    in_reasoning: bool,
}

impl<W: Write> Terminal<'_, W> {
    fn end_reasoning(&mut self) {
        if std::mem::take(&mut self.in_reasoning) {
            let reset = if std::io::stderr().is_terminal() {
                "\x1b[0m"
            } else {
                ""
            };
            say!("{reset}");
        }
    }
}

impl<W: Write> Sink for Terminal<'_, W> {
    fn reasoning(&mut self, text: String) -> bool {
        let mut err = std::io::stderr().lock();
        let dim = if !self.in_reasoning && err.is_terminal() {
            "\x1b[2m"
        } else {
            ""
        };
        self.in_reasoning = true;
        let _ = write!(err, "{dim}{text}").and_then(|_| err.flush());
        true
    }
    fn delta(&mut self, text: String, _: Vec<TokenLogprob>) -> bool {
        self.end_reasoning();
        if self.io_err.is_none() {
            if let Err(e) = self
                .out
                .write_all(text.as_bytes())
                .and_then(|_| self.out.flush())
            {
                self.io_err = Some(e);
            }
        }
        self.io_err.is_none()
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// Generates and streams one reply; returns the reply text (without its reasoning).
pub(crate) fn reply(
    session: &mut Session,
    prompt: &[u32],
    reasoning: Reasoning,
    a: &RunArgs,
    out: &mut impl Write,
    cancel: &AtomicBool,
) -> Result<String> {
    let mut req = Request::new(
        prompt.to_vec(),
        SamplerConfig {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            repetition_penalty: a.repetition_penalty,
            seed: a.seed,
        },
        a.max_new,
    );
    req.stop = a.stop.clone();
    req.reasoning = reasoning;
    let mut sink = Terminal {
        out,
        cancel,
        io_err: None,
        in_reasoning: false,
    };
    let mut stats = GenStats::default();
    let outcome = session.generate(req, &mut sink, &mut stats);
    sink.end_reasoning();
    let outcome = outcome?;
    if let Some(e) = sink.io_err {
        return Err(e.into());
    }
    out.flush()?;
    if a.show_ids {
        say!(
            "{}",
            serde_json::json!({"prompt": prompt, "generated": outcome.tokens})
        );
    }
    let stop = match outcome.finish {
        Finish::StopToken(id) if Some(id) == session.text().tokenizer.eos_id() => "eos",
        Finish::StopToken(_) => "endOfTurn",
        Finish::Cancelled if cancel.load(Ordering::Relaxed) => "interrupted",
        Finish::Cancelled => "cancelled",
        Finish::StopString => "stopString",
        Finish::Complete => "complete",
        Finish::MaxTokens => "maxNew",
        Finish::Context => "context",
        Finish::ToolCalls => "toolCalls",
    };
    if !a.quiet {
        // The first new token comes from the prompt's logits: the decode time covers the
        // forward passes of the others (as llama.cpp's eval time), so the rate is theirs.
        let dec = stats.decode.as_secs_f64();
        let steps = stats.new_tokens.saturating_sub(1);
        let tps = if dec > 0.0 && steps > 0 {
            format!("{:.3}", steps as f64 / dec)
        } else {
            "n/a".to_string()
        };
        let cached = if stats.cached_tokens > 0 {
            format!(" cached={}tok", stats.cached_tokens)
        } else {
            String::new()
        };
        say!(
            "\n[stop={stop} prefill={}tok/{:.2}s{cached} new={}tok decode={:.2}s tok/s={}]",
            stats.prompt_tokens - stats.cached_tokens,
            stats.prefill.as_secs_f64(),
            stats.new_tokens,
            dec,
            tps
        );
        if std::env::var_os("MFERENCE_PHASES").is_some_and(|v| v == "1") {
            print_expert_stats(session.model());
        }
    }
    Ok(outcome.content)
}

/// The load line's note of `--router-lookahead N` (empty when off).
pub(crate) fn lookahead_note(n: usize) -> String {
    match n {
        0 => String::new(),
        n => format!(", router lookahead {n}"),
    }
}

/// Expert-cache counters per MoE layer and in total (`MFERENCE_PHASES=1`).
fn print_expert_stats(model: &dyn Model) {
    let per_layer = model.expert_stats();
    let mut total = mference_runtime::StreamerStats::default();
    for (l, s) in per_layer.iter().enumerate() {
        total.add(s);
        let n = s.hits + s.misses;
        if n > 0 {
            say!(
                "[experts layer {l:02}: hits={} misses={} hit-rate={:.1}% read={:.1}MiB wait={:.3}s]",
                s.hits,
                s.misses,
                100.0 * s.hits as f64 / n as f64,
                s.bytes_read as f64 / (1 << 20) as f64,
                s.read_wait.as_secs_f64()
            );
        }
    }
    let n = (total.hits + total.misses).max(1);
    say!(
        "[experts total: hits={} misses={} hit-rate={:.1}% read={:.1}MiB wait={:.3}s kv={:.1}MiB]",
        total.hits,
        total.misses,
        100.0 * total.hits as f64 / n as f64,
        total.bytes_read as f64 / (1 << 20) as f64,
        total.read_wait.as_secs_f64(),
        model.kv_bytes() as f64 / (1 << 20) as f64
    );
}

/// `mference run`.
pub fn run(a: RunArgs) -> Result<()> {
    let t0 = Instant::now();
    crate::notes::set_quiet(a.quiet);
    validate_sampling(&a)?;
    check_install_dir(&a.model.model)?;
    // The text side (most of it the tokenizer) is built while the install's files are checked;
    // errors keep their order: the text side's, the prompt's, then the device's and install's.
    let (text, install) = std::thread::scope(|s| {
        let text = s.spawn(|| load_text_beside_check(&a.model));
        let install = open_install(&a.model);
        (
            text.join().expect("loading the text side panicked"),
            install,
        )
    });
    let text = text?;
    if !a.quiet {
        cache_note(&text);
    }
    let prompt: Option<(Vec<u32>, Reasoning)> = if let Some(p) = &a.prompt {
        Some((text.tokenizer.encode(p, true)?, Reasoning::Raw))
    } else if let Some(f) = &a.messages_file {
        let p = render(&text, &read_messages(f, text.family)?, a.think)?;
        let open = p.reasoning_open;
        Some((p.ids, Reasoning::Split { open }))
    } else if a.chat {
        if let Some(think) = a.think {
            crate::chat::check_think(&text, think)?;
        }
        None
    } else {
        unreachable!("clap requires one of --prompt, --messages-file and --chat")
    };
    if let Some((p, _)) = &prompt {
        if p.len() >= a.max_context {
            bail!(
                "the prompt is {} tokens, which does not fit --max-context {}",
                p.len(),
                a.max_context
            );
        }
    }
    if let Some(m) = text.max_positions {
        if a.max_context > m {
            bail!(
                "--max-context {} exceeds the model's max_position_embeddings {m}",
                a.max_context
            );
        }
    }
    let chunk = parse_prefill_chunk(
        &a.prefill_chunk,
        if a.chat {
            None
        } else {
            prompt.as_ref().map(|(p, _)| p.len())
        },
    )?;
    let install = install?;
    let opts = load_options_for(&a.model, &install, chunk, a.max_context)?;
    let model = mference_models::load_install(install, &opts)?;
    if !a.quiet {
        say!(
            "[loaded {} (tokenizer, checks, weights) in {:.2}s, device {}, expert cache {}{}]",
            a.model.model.display(),
            t0.elapsed().as_secs_f64(),
            model.device(),
            model.engine().expert_cache(),
            lookahead_note(a.model.router_lookahead),
        );
    }
    let mut session = Session::new(model, Arc::new(text));
    let stdout = std::io::stdout();
    match prompt {
        Some((p, reasoning)) => {
            let never = AtomicBool::new(false);
            reply(&mut session, &p, reasoning, &a, &mut stdout.lock(), &never)?;
            // A reader that has gone (`| head -c N`) is not an error here, as in the reply.
            let _ = writeln!(stdout.lock());
        }
        None => crate::chat::chat(&mut session, &a)?,
    }
    // The process ends here: freeing the tokenizer's ~1.5 million allocations one by one took
    // ~0.1 s on the demo model, for memory the exit returns anyway.
    std::mem::forget(session);
    Ok(())
}
