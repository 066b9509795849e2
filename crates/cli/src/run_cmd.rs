//! `run` (raw prompt, messages file, interactive chat) and `perplexity`.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;

use mference_format::VerifyPolicy;
use mference_kernels::Kernels;
use mference_models::{LoadOptions, Logits, Model, Want};
use mference_runtime::{CacheSlots, ExpertPolicy, KvDtype, SamplerConfig};
use mference_session::{
    Finish, GenStats, Request, Session, SessionError, Sink, TextSide, TokenLogprob,
};

/// Options shared by every command that loads a model.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// The installed model directory (`<name>.gturbo`).
    #[arg(long)]
    pub model: PathBuf,
    /// Expert cache slots per layer: 8, 16, 24, 32, 64, 96, 128, resident, or auto (by family and RAM).
    #[arg(long, visible_alias = "slots", default_value = "auto")]
    pub expert_cache_slots: String,
    /// Host expert-cache policy: lfu (per-layer slots, least frequently used leaves), lru
    /// (per-layer, least recently used leaves) or pool (every layer's slots in one LFU pool, so
    /// hot layers hold more). The same total slots and the same outputs under each.
    #[arg(long, default_value = "lfu", value_parser = ["lfu", "lru", "pool"])]
    pub expert_cache_policy: String,
    /// Integrity check at load: full-sha256 or trusted-receipt.
    #[arg(long, default_value = "full-sha256")]
    pub verify: String,
    /// Read experts with O_DIRECT (no second copy in the page cache).
    #[arg(long)]
    pub direct_io: bool,
    /// Kernel worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// KV cache element type: f16 (half the memory) or f32 (K and V kept exactly).
    #[arg(long, default_value = "f16")]
    pub kv_cache: String,
    /// Kernel table: auto (the fastest exact one this CPU has), scalar, avx2, avx512, or
    /// avx512vnni (int8 activations in prefill: 1.5-2.2x the prompt speed on Gemma 26B, perplexity +0.1-0.4% on
    /// the bundled models; decode unchanged).
    #[arg(long, default_value = "auto")]
    pub kernels: String,
    /// Where the ops run: cpu, cuda, cuda:N, or auto (the first CUDA device when a driver and
    /// NVRTC are present, else the CPU). On CUDA, routed experts live in GPU slots
    /// (--gpu-expert-budget) fed from the host tier.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// CUDA: device memory for routed experts, over all layers: auto (what is free after the
    /// weights and KV, less 1 GiB or 5%; at least 3 x top-k slots per layer), resident (every
    /// expert), or bytes (24G, 512M; at least top-k slots per layer).
    #[arg(long, default_value = "auto")]
    pub gpu_expert_budget: String,
    /// The host tier below the GPU slots (page-locked on CUDA), in bytes over all layers (16G,
    /// 512M); instead of --expert-cache-slots.
    #[arg(long)]
    pub host_expert_cache: Option<String>,
    /// CUDA tests: count every expert use as a GPU miss and copy it in again.
    #[arg(long, hide = true)]
    pub gpu_force_miss: bool,
    /// Maple only: FlashHead in single-token decode (score the centroids, exact logits for the
    /// probed clusters and the forced tokens, the rest -inf; approximate). Prefill keeps the exact
    /// head.
    #[arg(long)]
    pub flash_head: bool,
    /// Gemma 4 and Qwen 3.6 decode: layer L+1's router on layer L's post-attention state starts
    /// non-blocking reads of its N heaviest predicted experts not yet cached (0 = off; the output
    /// is the same either way).
    #[arg(long, default_value_t = 0)]
    pub router_lookahead: usize,
}

/// `mference run`.
#[derive(Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Raw completion of this text, no chat framing.
    #[arg(long, group = "mode")]
    pub prompt: Option<String>,
    /// A JSON array of {role, content} rendered through the model's chat template.
    #[arg(long, group = "mode")]
    pub messages_file: Option<PathBuf>,
    /// Interactive chat (/clear, /history, /quit).
    #[arg(long, group = "mode")]
    pub chat: bool,
    /// System message for --chat (repeatable; joined with newlines).
    #[arg(long)]
    pub system: Vec<String>,
    #[arg(long, default_value_t = 1024)]
    pub max_new: usize,
    #[arg(long, default_value_t = 4096)]
    pub max_context: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.2)]
    pub temperature: f32,
    /// 0…256; 0 = off.
    #[arg(long, default_value_t = 64)]
    pub top_k: usize,
    /// (0, 1].
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string (repeatable); it is not printed.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Prefill chunk rows: 32, 64, 128, 256, 512, 1024, 2048, 4096 or auto.
    #[arg(long, default_value = "auto")]
    pub prefill_chunk: String,
    /// Print only the generated text (no footer).
    #[arg(long)]
    pub quiet: bool,
    /// Also print the prompt and generated token ids to stderr as one JSON line.
    #[arg(long)]
    pub show_ids: bool,
}

/// `mference perplexity`.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// UTF-8 text file to score.
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per chunk (the first is replaced by BOS; the second half is scored).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score only the first N tokens of the stream (BOS included).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Tokenize without a leading BOS (the stream llama-perplexity sees has one when the
    /// vocabulary adds BOS; chunk-initial BOS is set either way).
    #[arg(long)]
    pub no_stream_bos: bool,
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

fn load_text(dir: &Path) -> Result<TextSide> {
    check_install_dir(dir)?;
    TextSide::load(dir).with_context(|| format!("loading the text side of {}", dir.display()))
}

fn validate_sampling(a: &RunArgs) -> Result<()> {
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", a.top_p);
    }
    if a.top_k > 256 {
        bail!(
            "--top-k must be between 0 and 256 (0 = off), got {}",
            a.top_k
        );
    }
    if a.temperature < 0.0 || !a.temperature.is_finite() {
        bail!(
            "--temperature must be >= 0 (0 = greedy), got {}",
            a.temperature
        );
    }
    if a.temperature > 0.0 && a.top_k == 0 && a.top_p < 1.0 {
        bail!("--top-p {} requires --top-k between 1 and 256; to turn both truncations off pass --top-k 0 --top-p 1", a.top_p);
    }
    if !(a.repetition_penalty > 0.0 && a.repetition_penalty.is_finite()) {
        bail!(
            "--repetition-penalty must be a finite number > 0, got {}",
            a.repetition_penalty
        );
    }
    if !a.system.is_empty() && !a.chat {
        bail!("--system requires --chat (put a system message in --messages-file instead)");
    }
    if a.max_new == 0 || a.max_context == 0 {
        bail!("--max-new and --max-context must be positive");
    }
    if a.prefill_chunk != "auto" {
        parse_prefill_chunk(&a.prefill_chunk, None)?;
    }
    validate_model_args(&a.model)
}

/// Checks the model flags' values before anything is read from disk.
pub(crate) fn validate_model_args(m: &ModelArgs) -> Result<()> {
    slots_flag(&m.expert_cache_slots)?;
    KvDtype::parse(&m.kv_cache).map_err(anyhow::Error::msg)?;
    if !matches!(m.verify.as_str(), "full-sha256" | "trusted-receipt") {
        bail!(
            "invalid --verify '{}': allowed values are full-sha256, trusted-receipt",
            m.verify
        );
    }
    threads_flag(m.threads)?;
    kernels(&m.kernels)?;
    Ok(())
}

/// Checks `--threads`: 1 up to 4x the cores this process may run on (more only adds overhead).
pub(crate) fn threads_flag(t: Option<usize>) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    match t {
        Some(0) => bail!("--threads must be at least 1"),
        Some(n) if n > 4 * cores => {
            bail!(
                "--threads {n} is more than 4x the {cores} cores here; use at most {}",
                4 * cores
            )
        }
        _ => Ok(()),
    }
}

/// Checks an `--expert-cache-slots` / `--slots` value: `auto` or one [`CacheSlots::parse`] takes.
pub(crate) fn slots_flag(s: &str) -> Result<()> {
    if s != "auto" && CacheSlots::parse(s).is_err() {
        bail!("invalid expert cache slots '{s}': allowed values are 8, 16, 24, 32, 64, 96, 128, resident, auto");
    }
    Ok(())
}

/// `--kernels`: `auto` → `None` (detection, or `MFERENCE_KERNELS`); a named table must be one
/// this CPU runs.
pub(crate) fn kernels(name: &str) -> Result<Option<String>> {
    if name == "auto" {
        return Ok(None);
    }
    let here: Vec<&str> = Kernels::available().iter().map(|k| k.name()).collect();
    if !here.contains(&name) {
        bail!(
            "invalid --kernels '{name}': this CPU runs auto, {}",
            here.join(", ")
        );
    }
    Ok(Some(name.to_string()))
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

/// `--device`, `--gpu-expert-budget` and `--gpu-force-miss` checked together (run, perplexity,
/// logits, serve, bench): the GPU-only flags are refused on the CPU, not ignored, and a CUDA
/// device that cannot start is named before anything is read.
pub fn device_flags(
    device: &str,
    gpu_expert_budget: &str,
    gpu_force_miss: bool,
) -> Result<(mference_models::Device, mference_models::GpuExpertBudget)> {
    let d = mference_models::Device::parse(device).map_err(anyhow::Error::msg)?;
    let budget = mference_models::GpuExpertBudget::parse(gpu_expert_budget)
        .map_err(|e| anyhow::anyhow!("--gpu-expert-budget: {e}"))?;
    if d == mference_models::Device::Cpu && (gpu_expert_budget != "auto" || gpu_force_miss) {
        bail!("--gpu-expert-budget and --gpu-force-miss apply on CUDA: add --device cuda");
    }
    // `--device cuda` without CUDA fails here, before the model is sized or read.
    mference_models::probe_device(d)?;
    Ok((d, budget))
}

/// `--host-expert-cache BYTES`, parsed.
pub fn host_expert_cache_flag(v: Option<&str>) -> Result<Option<u64>> {
    match v {
        Some(v) => match mference_runtime::parse_bytes(v) {
            Some(b) => Ok(Some(b)),
            None => bail!("invalid --host-expert-cache '{v}': expected bytes such as 16G or 512M"),
        },
        None => Ok(None),
    }
}

/// `--expert-cache-slots` and the I/O mode: an explicit value wins; `auto` sizes the slot cache
/// to the memory this process may use ([`mference_runtime::sizing::auto_slots`]: resident
/// weights, KV at `max_context` and scratch counted) and reads with O_DIRECT when the slots are
/// smaller than the expert files, and says on stderr what it chose and from which limit.
fn resolve_slots(
    m: &ModelArgs,
    prefill_chunk: usize,
    max_context: usize,
) -> Result<(CacheSlots, bool)> {
    if m.expert_cache_slots != "auto" {
        if m.host_expert_cache.is_some() {
            bail!("give one of --expert-cache-slots and --host-expert-cache, not both");
        }
        let s = CacheSlots::parse(&m.expert_cache_slots).map_err(anyhow::Error::msg)?;
        return Ok((s, m.direct_io));
    }
    let host_bytes = host_expert_cache_flag(m.host_expert_cache.as_deref())?;
    let dir = &m.model;
    let Ok(bytes) = std::fs::read(dir.join("manifest.json")) else {
        // Not an install: the load reports it.
        return Ok((CacheSlots::Resident, m.direct_io));
    };
    let man = mference_format::Manifest::parse(&bytes)?;
    if let Some(b) = host_bytes {
        return Ok((host_tier_slots(&man, b)?, m.direct_io));
    }
    let size = |prefix: &str| -> u64 {
        man.files
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, f)| f.size)
            .sum()
    };
    let a = &man.arch;
    let kv_bytes: u64 = if m.kv_cache == "f32" { 4 } else { 2 };
    let kv: u64 = a
        .full_attention_layer_mask
        .iter()
        .map(|&t| {
            let (rows, width) = match t {
                0 => (
                    a.sliding_window + prefill_chunk as u64,
                    a.num_kv_heads * a.head_dim,
                ),
                1 => (max_context as u64, a.num_full_kv_heads * a.full_head_dim),
                // Compressed KV (DeepSeek-V4 CSA / HCA): a window plus 1/4 or 1/128 of the context.
                3 => (a.sliding_window + max_context as u64 / 4, a.head_dim),
                4 => (a.sliding_window + max_context as u64 / 128, a.head_dim),
                // Gated DeltaNet: a fixed recurrent state.
                _ => (
                    a.linear_key_head_dim * a.linear_num_v_heads,
                    a.linear_value_head_dim,
                ),
            };
            2 * rows * width * kv_bytes
        })
        .sum();
    let (limit, from) = usable_memory();
    let input = mference_runtime::sizing::SizingInput {
        limit,
        resident_weights: size(mference_format::WEIGHTS_FILE),
        kv,
        // 256 MiB, plus ~400 KB per prefill row (measured on Gemma 26B: a 4,000-token prompt in
        // one 4,096-row chunk peaked 1.6 GB above chunk 256; at chunk 64 / 512 everything besides
        // the slots, KV and mapped weights was 70 / 150 MB), i.e. 36 f32 rows of the hidden size,
        // plus one head row: prefill computes the logits of the rows wanted, the last one here.
        scratch: (256 << 20) + prefill_chunk as u64 * a.hidden_size * 4 * 36 + a.vocab_size * 4,
        expert_files: size("packed_experts/layer_"),
        moe_layers: man.expert_layer_files() as u64,
        stride: man.expert_stride,
        experts_per_layer: man.experts_per_layer,
        top_k: a.top_k_experts as usize,
    };
    let s = mference_runtime::sizing::auto_slots(&input);
    let gb = |b: u64| b as f64 / 1e9;
    let slots = match s.slots {
        CacheSlots::Resident => "resident (layer files mapped)".to_string(),
        CacheSlots::Fixed(n) => format!("{n} slots per layer"),
    };
    eprintln!(
        "[expert cache auto: {slots}{}; from {:.2} GB ({from}) - weights {:.2} GB - KV {:.2} GB - scratch {:.2} GB = {:.2} GB for {:.2} GB of expert files]",
        if s.direct_io || m.direct_io { ", O_DIRECT" } else { "" },
        gb(limit),
        gb(input.resident_weights),
        gb(input.kv),
        gb(input.scratch),
        gb(s.budget),
        gb(input.expert_files),
    );
    Ok((s.slots, s.direct_io || m.direct_io))
}

/// Slots per layer for `--host-expert-cache BYTES`: the bytes over every expert layer, at least
/// top-k per layer (one token's experts), at most every expert.
fn host_tier_slots(man: &mference_format::Manifest, bytes: u64) -> Result<CacheSlots> {
    let layers = man.expert_layer_files() as u64;
    let per_slot = man.expert_stride * layers.max(1);
    let n = (bytes / per_slot) as usize;
    let top_k = man.arch.top_k_experts as usize;
    if n < top_k {
        bail!(
            "--host-expert-cache {bytes} bytes holds {n} experts per layer over {layers} layers, \
             fewer than top-k = {top_k}: give at least {} bytes",
            top_k as u64 * per_slot
        );
    }
    let n = n.min(man.experts_per_layer);
    eprintln!(
        "[host expert cache: {n} slots per layer ({:.2} GB over {layers} layers)]",
        (n as u64 * per_slot) as f64 / 1e9
    );
    Ok(CacheSlots::Fixed(n))
}

/// Bytes this process can use and where that number comes from: MemAvailable, lowered to the
/// memory cgroup's limit minus its usage when one is set (cgroup v1 `memory.limit_in_bytes` or v2
/// `memory.max`), the page cache charged to the cgroup not counted as used
/// ([`mference_runtime::sizing::cgroup_headroom`]).
fn usable_memory() -> (u64, &'static str) {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail = meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024);
    let read = |p: String| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut limit = u64::MAX;
    let mut from = "MemAvailable";
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (
            parts.next(),
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
        );
        if controllers.split(',').any(|c| c == "memory") {
            let base = format!("/sys/fs/cgroup/memory{path}");
            if let (Some(l), Some(u)) = (
                read(format!("{base}/memory.limit_in_bytes")),
                read(format!("{base}/memory.usage_in_bytes")),
            ) {
                let stat =
                    std::fs::read_to_string(format!("{base}/memory.stat")).unwrap_or_default();
                let room = mference_runtime::sizing::cgroup_headroom(l, u, &stat);
                if room < limit {
                    limit = room;
                    from = "cgroup v1 memory.limit_in_bytes";
                }
            }
        } else if controllers.is_empty() {
            let base = format!("/sys/fs/cgroup{path}");
            if let (Some(l), Some(u)) = (
                read(format!("{base}/memory.max")),
                read(format!("{base}/memory.current")),
            ) {
                let stat =
                    std::fs::read_to_string(format!("{base}/memory.stat")).unwrap_or_default();
                let room = mference_runtime::sizing::cgroup_headroom(l, u, &stat);
                if room < limit {
                    limit = room;
                    from = "cgroup v2 memory.max";
                }
            }
        }
    }
    if avail <= limit {
        (avail, "MemAvailable")
    } else {
        (limit, from)
    }
}

pub(crate) fn load_options(
    m: &ModelArgs,
    prefill_chunk: usize,
    max_context: usize,
) -> Result<LoadOptions> {
    let verify = match m.verify.as_str() {
        "full-sha256" => VerifyPolicy::FullSha256,
        "trusted-receipt" => VerifyPolicy::TrustedReceipt,
        other => {
            bail!("invalid --verify '{other}': allowed values are full-sha256, trusted-receipt")
        }
    };
    // Every flag is checked before the expert-cache sizing prints its line.
    let (device, gpu_expert_budget) =
        device_flags(&m.device, &m.gpu_expert_budget, m.gpu_force_miss)?;
    let kernels = kernels(&m.kernels)?;
    let kv_dtype = KvDtype::parse(&m.kv_cache).map_err(anyhow::Error::msg)?;
    let expert_policy = ExpertPolicy::parse(&m.expert_cache_policy).map_err(anyhow::Error::msg)?;
    let (slots, direct_io) = resolve_slots(m, prefill_chunk, max_context)?;
    let mut o = LoadOptions {
        slots,
        expert_policy,
        direct_io,
        prefill_chunk,
        max_context,
        verify,
        kernels,
        kv_dtype,
        device,
        gpu_expert_budget,
        gpu_force_miss: m.gpu_force_miss,
        flash_head: m.flash_head,
        router_lookahead: m.router_lookahead,
        ..Default::default()
    };
    if let Some(t) = m.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        o.threads = t;
    }
    Ok(o)
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

fn read_messages(path: &Path) -> Result<Vec<serde_json::Value>> {
    let arr = read_json_array(path, "{role, content} objects", "messages")?;
    for (i, m) in arr.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(|r| r.as_str())
            .with_context(|| format!("message {i}: missing string \"role\""))?;
        if m.get("content").and_then(|c| c.as_str()).is_none() {
            bail!("message {i}: missing string \"content\"");
        }
        match role {
            "system" if i == 0 => {}
            "system" => bail!("message {i}: a system message is only allowed first"),
            "user" | "assistant" => {}
            other => {
                bail!("message {i}: unknown role '{other}' (allowed: system, user, assistant)")
            }
        }
    }
    Ok(arr)
}

fn render(text: &TextSide, messages: &[serde_json::Value]) -> Result<Vec<u32>> {
    match text.render_chat(messages, None) {
        Err(SessionError::NoTemplate) => bail!("this install has no chat template; use --prompt"),
        r => Ok(r?),
    }
}

/// Writes the reply to stdout as it is generated; stops on Ctrl-C or a failed write.
struct Terminal<'a, W: Write> {
    out: &'a mut W,
    cancel: &'a AtomicBool,
    io_err: Option<std::io::Error>,
}

impl<W: Write> Sink for Terminal<'_, W> {
    fn delta(&mut self, text: String, _: Vec<TokenLogprob>) -> bool {
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

/// Generates and streams one reply; returns the reply text.
fn reply(
    session: &mut Session,
    prompt: &[u32],
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
    let mut sink = Terminal {
        out,
        cancel,
        io_err: None,
    };
    let mut stats = GenStats::default();
    let outcome = session.generate(req, &mut sink, &mut stats)?;
    if let Some(e) = sink.io_err {
        return Err(e.into());
    }
    out.flush()?;
    if a.show_ids {
        eprintln!(
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
        let dec = stats.decode.as_secs_f64();
        let tps = if dec > 0.0 {
            stats.new_tokens as f64 / dec
        } else {
            0.0
        };
        let cached = if stats.cached_tokens > 0 {
            format!(" cached={}tok", stats.cached_tokens)
        } else {
            String::new()
        };
        eprintln!(
            "\n[stop={stop} prefill={}tok/{:.2}s{cached} new={}tok decode={:.2}s tok/s={:.3}]",
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
            eprintln!(
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
    eprintln!(
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
    validate_sampling(&a)?;
    let text = load_text(&a.model.model)?;
    let prompt: Option<Vec<u32>> = if let Some(p) = &a.prompt {
        Some(text.tokenizer.encode(p, true)?)
    } else if let Some(f) = &a.messages_file {
        Some(render(&text, &read_messages(f)?)?)
    } else if a.chat {
        None
    } else {
        bail!("give exactly one of --prompt, --messages-file or --chat");
    };
    if let Some(p) = &prompt {
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
            prompt.as_ref().map(Vec::len)
        },
    )?;
    let model = mference_models::load(
        &a.model.model,
        &load_options(&a.model, chunk, a.max_context)?,
    )?;
    if !a.quiet {
        eprintln!(
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
        Some(p) => {
            let never = AtomicBool::new(false);
            reply(&mut session, &p, &a, &mut stdout.lock(), &never)?;
            println!();
        }
        None => chat(&mut session, &a)?,
    }
    Ok(())
}

/// Interactive chat: the whole conversation is re-rendered each turn, and only what the model
/// does not hold yet (the new messages) is prefilled, as `serve` does.
fn chat(session: &mut Session, a: &RunArgs) -> Result<()> {
    let text = Arc::clone(session.text());
    let interrupt = Interrupt::install()?;
    let system = (!a.system.is_empty())
        .then(|| serde_json::json!({"role": "system", "content": a.system.join("\n")}));
    let mut turns: Vec<serde_json::Value> = Vec::new();
    let stdin = std::io::stdin();
    let mut bytes = Vec::new();
    loop {
        eprint!("> ");
        bytes.clear();
        if stdin.lock().read_until(b'\n', &mut bytes)? == 0 {
            eprintln!(); // end of input: leave the terminal on a fresh line
            return Ok(());
        }
        let Ok(line) = std::str::from_utf8(&bytes) else {
            eprintln!("[that line is not valid UTF-8 text; nothing was sent, type it again]");
            continue;
        };
        let input = line.trim_end_matches(['\n', '\r']);
        match input.trim() {
            "" => continue,
            "/quit" | "/exit" => return Ok(()),
            "/clear" => {
                turns.clear();
                session.clear();
                eprintln!("[conversation cleared]");
                continue;
            }
            cmd if cmd.starts_with('/') && !cmd.contains(' ') && !matches!(cmd, "/history") => {
                eprintln!("[unknown command {cmd}: use /clear, /history or /quit]");
                continue;
            }
            "/history" => {
                for m in system.iter().chain(&turns) {
                    eprintln!(
                        "{}: {}",
                        m["role"].as_str().unwrap_or(""),
                        m["content"].as_str().unwrap_or("")
                    );
                }
                continue;
            }
            _ => {}
        }
        turns.push(serde_json::json!({"role": "user", "content": input}));
        // Drop the oldest turns until the prompt fits, never the system message or the newest user turn.
        let prompt = loop {
            let msgs: Vec<_> = system
                .iter()
                .cloned()
                .chain(turns.iter().cloned())
                .collect();
            let p = render(&text, &msgs)?;
            if p.len() + 1 < a.max_context || turns.len() <= 1 {
                break p;
            }
            turns.remove(0);
            eprintln!(
                "[dropped the oldest message to fit --max-context {}]",
                a.max_context
            );
        };
        if prompt.len() + 1 >= a.max_context {
            eprintln!(
                "[the message does not fit --max-context {} even alone; try a shorter one]",
                a.max_context
            );
            turns.pop();
            continue;
        }
        // The conversation so far is still in the model: only the new part is prefilled.
        interrupt.hit.store(false, Ordering::Relaxed);
        interrupt.generating.store(true, Ordering::Relaxed);
        let out = reply(
            session,
            &prompt,
            a,
            &mut std::io::stdout().lock(),
            &interrupt.hit,
        );
        interrupt.generating.store(false, Ordering::Relaxed);
        let out = out?;
        println!();
        turns.push(serde_json::json!({"role": "assistant", "content": out}));
    }
}

/// Ctrl-C in `run --chat`: during a reply it stops the reply (the text so far stays in the
/// conversation) and the session goes on; at the prompt it ends the session (exit 130).
struct Interrupt {
    generating: Arc<AtomicBool>,
    hit: Arc<AtomicBool>,
}

impl Interrupt {
    fn install() -> Result<Interrupt> {
        let generating = Arc::new(AtomicBool::new(false));
        let hit = Arc::new(AtomicBool::new(false));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let mut sigint = {
            let _guard = rt.enter();
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?
        };
        let (g, h) = (Arc::clone(&generating), Arc::clone(&hit));
        std::thread::Builder::new()
            .name("mference-sigint".into())
            .spawn(move || {
                rt.block_on(async move {
                    while sigint.recv().await.is_some() {
                        if g.load(Ordering::Relaxed) {
                            h.store(true, Ordering::Relaxed);
                        } else {
                            eprintln!();
                            std::process::exit(130);
                        }
                    }
                })
            })?;
        Ok(Interrupt { generating, hit })
    }
}

/// Scored positions per forward call in `perplexity` (256 × a 262k vocabulary = 256 MiB of logits).
const SCORED_ROWS: usize = 256;

/// `mference perplexity`: llama-perplexity's protocol — chunks of `ctx` tokens, the first token of
/// each chunk replaced by BOS, the second half of each chunk scored.
pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    validate_model_args(&a.model)?;
    let text = load_text(&a.model.model)?;
    if a.ctx < 4 {
        bail!("--ctx must be at least 4");
    }
    if let Some(m) = text.max_positions {
        if a.ctx > m {
            bail!(
                "--ctx {} exceeds the model's max_position_embeddings {m}",
                a.ctx
            );
        }
    }
    let body = std::fs::read_to_string(&a.file)
        .with_context(|| format!("reading {}", a.file.display()))?;
    if let Some(m) = a.max_tokens {
        if m < a.ctx {
            bail!(
                "--max-tokens {m} is less than one --ctx {} chunk: raise --max-tokens or lower --ctx",
                a.ctx
            );
        }
    }
    // llama-perplexity's stream: `common_tokenize(text, add_special = true)`, so BOS first when
    // the vocabulary adds one; then every chunk's first token becomes BOS.
    let bos = text.tokenizer.bos_id();
    let mut ids: Vec<u32> = bos.filter(|_| !a.no_stream_bos).into_iter().collect();
    ids.extend(text.tokenizer.encode(&body, false)?);
    if let Some(m) = a.max_tokens {
        ids.truncate(m);
    }
    let chunks = ids.len() / a.ctx;
    if chunks == 0 {
        bail!(
            "{} has {} tokens, fewer than one --ctx {} chunk",
            a.file.display(),
            ids.len(),
            a.ctx
        );
    }
    let mut model = mference_models::load(
        &a.model.model,
        &load_options(&a.model, a.ctx.clamp(32, 512).next_power_of_two(), a.ctx)?,
    )?;
    let vocab = model.vocab_size();
    let first = a.ctx / 2;
    let (mut nll, mut count) = (0.0f64, 0usize);
    let t0 = Instant::now();
    for c in 0..chunks {
        let mut chunk = ids[c * a.ctx..(c + 1) * a.ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        model.truncate(0);
        model.forward(&chunk[..first], Want::None)?;
        // The scored half in pieces of at most SCORED_ROWS positions, so the logits held at once
        // stay bounded (rows · vocab floats) whatever --ctx is.
        for j0 in (first..a.ctx).step_by(SCORED_ROWS) {
            let j1 = (j0 + SCORED_ROWS).min(a.ctx);
            let Logits::Rows(logits) = model.forward(&chunk[j0..j1], Want::All)? else {
                bail!("model returned no logits")
            };
            for j in j0..j1.min(a.ctx - 1) {
                let row = &logits[(j - j0) * vocab..(j - j0 + 1) * vocab];
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = m + row.iter().map(|&z| (z as f64 - m).exp()).sum::<f64>().ln();
                nll += lse - row[chunk[j + 1] as usize] as f64;
                count += 1;
            }
        }
        eprintln!(
            "[chunk {}/{chunks}: running perplexity {:.4}]",
            c + 1,
            (nll / count as f64).exp()
        );
    }
    println!("perplexity: {:.4}", (nll / count as f64).exp());
    eprintln!(
        "[{} chunks of {}, {} scored tokens, mean NLL {:.6}, {:.1}s, device {}, expert cache {}, kernels {}{}]",
        chunks,
        a.ctx,
        count,
        nll / count as f64,
        t0.elapsed().as_secs_f64(),
        model.device(),
        model.engine().expert_cache(),
        model.engine().kernels.name(),
        lookahead_note(a.model.router_lookahead)
    );
    Ok(())
}
