//! Model families over a `.gturbo` install: one file per family (`gemma4.rs`, …), each written once
//! against the op layer (`mference-backend`), sharing the [`Engine`] (install, mapped resident
//! weights, settings) and the per-layer expert streamers.

pub mod deepseek_v4;
pub mod gemma4;
pub mod inkling;
pub mod maple;
pub mod prefix;
pub mod qwen3_5_moe;

use std::path::Path;
use std::sync::Arc;

use mference_backend::cpu::CpuBackend;
use mference_backend::{
    Backend, Norm, OpError, PreNorm, QRef, Tensor, Unary, VRef, WeightError, Weights,
};
use mference_format::{ExpertBlobLayout, Install, ResidentIndex, VerifyPolicy};
use mference_kernels::Kernels;
use mference_runtime::streamer::IoPool;
use mference_runtime::{
    CachePlan, CacheSlots, ExpertPolicy, ExpertStreamer, KvDtype, RoutingTrace, RuntimeError,
    StreamerStats,
};

pub use mference_backend::DeviceExpertStats;
pub use mference_cuda::GpuExpertBudget;
pub use prefix::PrefixCache;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Format(#[from] mference_format::FormatError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Tensor(#[from] WeightError),
    #[error(transparent)]
    Op(#[from] OpError),
    #[error("config: {0}")]
    Config(String),
    #[error("device: {0}")]
    Device(String),
    #[error("unsupported family '{0}' (this build runs: gemma4, qwen3_5_moe, deepseek_v4, maple, inkling_mm_model)")]
    Family(String),
    #[error("input: {0}")]
    Input(String),
    /// NaN or infinity in the residual stream or the logits: never turned into text.
    #[error("non-finite values (NaN or infinity) in the {what} at positions {first}..{end}: the install's weights are probably damaged (run `mference verify` on it; `--verify trusted-receipt` does not rehash the layer files) or the activations overflowed")]
    NonFinite {
        what: &'static str,
        first: usize,
        end: usize,
    },
    #[error("context full: {need} tokens needed, max context is {max} (raise --max-context)")]
    ContextFull { need: usize, max: usize },
    #[error("cannot map {path}: {source}")]
    Map {
        path: String,
        source: std::io::Error,
    },
}

/// Which logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Want {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last row's logits (`[vocab]`, post-softcap).
    Last,
    /// Every row's logits (`[T, vocab]`): parity tests.
    All,
    /// The logits of the last `n` rows (`[n, vocab]`): perplexity scores only the second half.
    Tail(usize),
    /// Only the argmax of the last row (pure greedy; full logits are never materialised).
    Argmax,
}

/// What one prefill chunk must return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkWant {
    None,
    /// Logits of the chunk's rows from this row on.
    From(usize),
    Argmax,
}

/// Splits `tokens` (to be placed after `position` cached positions) into chunks of `chunk` rows and
/// runs `run(chunk_tokens, chunk_want)` on each in order, asking each chunk only for the logits `want`
/// needs; concatenates rows across chunks.
///
/// Errors: no tokens; [`ModelError::ContextFull`] when they would not fit in `max_context`.
pub fn run_chunked(
    tokens: &[u32],
    position: usize,
    chunk: usize,
    max_context: usize,
    want: Want,
    mut run: impl FnMut(&[u32], ChunkWant) -> Result<Logits, ModelError>,
) -> Result<Logits, ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::Input("no tokens to run".into()));
    }
    let need = position + tokens.len();
    if need > max_context {
        return Err(ModelError::ContextFull {
            need,
            max: max_context,
        });
    }
    let total = tokens.len();
    let first = match want {
        Want::None => total,
        Want::All => 0,
        Want::Tail(n) => total - n.min(total),
        Want::Last | Want::Argmax => total - 1,
    };
    let mut rows = Vec::new();
    let mut last = Logits::None;
    for (i, c) in tokens.chunks(chunk).enumerate() {
        let (start, end) = (i * chunk, i * chunk + c.len());
        let w = if want == Want::Argmax && end == total {
            ChunkWant::Argmax
        } else if end > first {
            ChunkWant::From(first.saturating_sub(start))
        } else {
            ChunkWant::None
        };
        match run(c, w)? {
            Logits::Rows(r) => rows.extend(r),
            other => last = other,
        }
    }
    Ok(match want {
        Want::None | Want::Argmax => last,
        _ => Logits::Rows(rows),
    })
}

/// The result of a forward pass.
#[derive(Debug)]
pub enum Logits {
    None,
    /// Row-major `[rows, vocab]`.
    Rows(Vec<f32>),
    Argmax(u32),
}

/// The final norm and the head of a family.
pub struct Head<'a> {
    pub norm: &'a VRef,
    pub eps: f32,
    pub weight: &'a QRef,
    pub softcap: Option<f32>,
}

/// The final RMSNorm and the head over the rows of `x` (`[T, hidden]`) that `want` asks for:
/// the logits (`[rows, vocab]`, softcapped if the family does) read back to the host, or only the
/// fused greedy argmax of the last row.
///
/// Errors: [`ModelError::NonFinite`] when the residual stream of the chunk at positions `pos0..`
/// or the logits hold a NaN or an infinity.
pub fn head<B: Backend>(
    be: &B,
    x: &B::Tensor,
    pos0: usize,
    want: ChunkWant,
    head: &Head,
) -> Result<Logits, ModelError> {
    let t = x.rows();
    let non_finite = |what| ModelError::NonFinite {
        what,
        first: pos0,
        end: pos0 + t,
    };
    if !be.all_finite(x)? {
        return Err(non_finite("residual stream"));
    }
    let first = match want {
        ChunkWant::None => return Ok(Logits::None),
        ChunkWant::From(r) => r,
        ChunkWant::Argmax => t - 1,
    };
    let mut xf = be.gather_rows(x, &(first..t).collect::<Vec<_>>())?;
    be.rms_norm(&mut xf, x.cols(), Norm::Weight(head.norm), head.eps)?;
    if want == ChunkWant::Argmax {
        let (id, logit) = be.head_argmax(head.weight, &xf)?;
        if !logit.is_finite() {
            return Err(non_finite("logits"));
        }
        return Ok(Logits::Argmax(id));
    }
    let mut logits = one(be.matmul(&[head.weight], Weights::Resident, &xf)?); // [rows, vocab]
    if let Some(c) = head.softcap {
        be.unary(&mut logits, Unary::Softcap(c))?;
    }
    let rows = be.read(&logits)?;
    if rows.iter().any(|v| !v.is_finite()) {
        return Err(non_finite("logits"));
    }
    Ok(Logits::Rows(rows))
}

/// The single result of a one-matrix [`Backend::matmul`].
pub(crate) fn one<T>(mut v: Vec<T>) -> T {
    v.pop().expect("one product")
}

/// A layer's output `y` into the residual `x` (`post` and `s` as in
/// [`Backend::add_rms_norm_pre`]) and, by `next` (`None` after the last layer), the next layer's
/// input norm, in one op.
#[allow(clippy::too_many_arguments)]
pub(crate) fn into_residual<B: Backend>(
    be: &B,
    x: &mut B::Tensor,
    y: &B::Tensor,
    dim: usize,
    post: Option<Norm>,
    eps: f32,
    s: f32,
    next: Option<&VRef>,
) -> Result<Option<B::Tensor>, ModelError> {
    let pre: Vec<PreNorm> = next
        .map(|w| PreNorm {
            norm: Norm::Weight(w),
            cols: None,
        })
        .into_iter()
        .collect();
    Ok(be.add_rms_norm_pre(x, y, dim, post, eps, s, &pre)?.pop())
}

/// A tensor `name` has the dimensions config.json implies.
pub(crate) fn check_dims(
    name: &str,
    got: (usize, usize),
    want: (usize, usize),
) -> Result<(), ModelError> {
    if got == want {
        Ok(())
    } else {
        Err(ModelError::Config(format!(
            "{name} is {got:?}, config.json implies {want:?}"
        )))
    }
}

/// Token ids must index the vocabulary.
pub(crate) fn check_ids(tokens: &[u32], vocab: usize) -> Result<(), ModelError> {
    match tokens.iter().find(|&&id| id as usize >= vocab) {
        Some(id) => Err(ModelError::Input(format!(
            "token id {id} is outside the vocabulary ({vocab})"
        ))),
        None => Ok(()),
    }
}

/// Where the model's ops run (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    /// CUDA device `n` (`cuda` = `cuda:0`).
    Cuda(usize),
    /// The first CUDA device when a driver and NVRTC are present, else the CPU.
    Auto,
}

impl Device {
    /// Parses `cpu|cuda|cuda:N|auto`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            "auto" => Ok(Self::Auto),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| {
                    format!("invalid device '{s}': allowed values are cpu, cuda, cuda:N, auto")
                }),
        }
    }
}

/// Settings fixed at load.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub slots: CacheSlots,
    /// Host expert-cache policy (`--expert-cache-policy`): per-layer LFU (default), per-layer LRU,
    /// or one LFU pool over every layer's slots. Outputs are the same under each.
    pub expert_policy: ExpertPolicy,
    pub direct_io: bool,
    /// Worker threads for kernels (the caller counts as one).
    pub threads: usize,
    /// Rows per prefill chunk.
    pub prefill_chunk: usize,
    /// Positions the KV cache can hold.
    pub max_context: usize,
    pub verify: VerifyPolicy,
    /// KV cache element type (FP16 by default).
    pub kv_dtype: KvDtype,
    /// Record each position's smallest router top-k margin (parity tests: a row that disagrees with
    /// the reference must sit on a routing near-tie to be excused).
    pub trace_router: bool,
    /// Replay this recorded routing (`.npy`, uint8 `[tokens, layers, top_k]`) as every router's
    /// choice of experts (benchmarks on synthetic checkpoints, whose random routers pick
    /// near-uniformly); the weights still come from the router's scores of those experts.
    pub routing_trace: Option<std::path::PathBuf>,
    /// Where the ops run.
    pub device: Device,
    /// On CUDA: device memory for routed experts (`--gpu-expert-budget`).
    pub gpu_expert_budget: mference_cuda::GpuExpertBudget,
    /// On CUDA: count every expert use as a miss and copy it in again (tests the copy path).
    pub gpu_force_miss: bool,
    /// DeepSeek-V4's shadow prefetch in decode: layer L+1's router applied to layer L's FFN input
    /// starts reads of its two heaviest predicted experts (hash layers: from the token id) that
    /// layer L+1 joins only if it routes to them. Results are identical either way; other families
    /// ignore it.
    pub shadow_prefetch: bool,
    /// Gemma 4 and Qwen 3.6 router lookahead in decode (`--router-lookahead N`): layer L+1's
    /// router applied to layer L's post-attention state starts non-blocking reads of its N heaviest
    /// predicted experts that are not cached ([`mference_backend::moe::prefetch_predicted`]);
    /// 0 = off. Results are identical either way; other families ignore it.
    pub router_lookahead: usize,
    /// Force a kernel variant by name (`scalar`, `avx2`, `avx512`); `None` = best available.
    pub kernels: Option<String>,
    /// Maple only: FlashHead (approximate head from centroid scoring) for single-token decode
    /// (`--flash-head`); prefill and every other call keep the exact head.
    pub flash_head: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            slots: CacheSlots::Fixed(16),
            expert_policy: ExpertPolicy::Lfu,
            direct_io: false,
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            prefill_chunk: 128,
            max_context: 4096,
            verify: VerifyPolicy::FullSha256,
            kernels: None,
            kv_dtype: KvDtype::F16,
            trace_router: false,
            routing_trace: None,
            device: Device::Cpu,
            gpu_expert_budget: mference_cuda::GpuExpertBudget::Auto,
            gpu_force_miss: false,
            shadow_prefetch: true,
            router_lookahead: 0,
            flash_head: false,
        }
    }
}

/// One sequence of a loaded model: runs tokens through the layers and keeps the KV cache.
pub trait Model: Send {
    /// Runs `tokens` at the next positions (chunked by the prefill chunk), appending to the KV cache.
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError>;
    /// Positions in the KV cache.
    fn position(&self) -> usize;
    /// Keeps the first `n` cached positions; false when the cache cannot be cut there.
    fn truncate(&mut self, n: usize) -> bool;
    /// Saves what a later [`Model::truncate`] to the current position needs (a family with a
    /// recurrent state keeps one snapshot of it, replacing the previous one). A model whose whole
    /// state is its KV cache can be cut anywhere and does nothing.
    fn checkpoint(&mut self) {}
    /// Whether part of the state is recurrent or a sliding-window ring, so the cache can only be
    /// cut at 0, at the end or at a checkpoint once it has moved on (a ring that has wrapped): a
    /// caller that wants to rewind later runs its input in two pieces and calls
    /// [`Model::checkpoint`] between them.
    fn is_recurrent(&self) -> bool {
        false
    }
    /// The largest position `≤ n` that [`Model::truncate`] can cut to right now (0 always works).
    fn rewind_point(&self, n: usize) -> usize {
        n.min(self.position())
    }
    fn vocab_size(&self) -> usize;
    fn engine(&self) -> &Engine;
    /// Expert-cache counters per MoE layer (layers not opened yet report zeros).
    fn expert_stats(&self) -> Vec<StreamerStats>;
    /// The backend's own expert cache (GPU slots) counters, if it has one.
    fn device_expert_stats(&self) -> Option<mference_backend::DeviceExpertStats>;
    /// Where the model runs, for load lines: the backend's name, and on CUDA its expert slots
    /// (`cuda:0 NVIDIA H200 sm_90, GPU experts: 40 slots per layer, 12.03 GiB`).
    fn device(&self) -> String {
        let d = &self.engine().device;
        match self.device_expert_stats() {
            Some(g) => format!(
                "{d}, GPU experts: {} slots per layer, {:.2} GiB",
                g.slots_per_layer,
                g.slab_bytes as f64 / (1u64 << 30) as f64
            ),
            None => match &self.engine().device_fallback {
                Some(why) => format!("{d} (--device auto: {why})"),
                None => d.clone(),
            },
        }
    }
    /// Sizes the backend's own expert cache now that the weights and the KV cache are placed
    /// (the load does this; a no-op without one).
    fn size_device_experts(&self) -> Result<(), ModelError>;
    /// Copies every routed expert into the backend's own cache where it holds all of a layer's
    /// experts (a `resident` GPU budget), as llama.cpp's full offload does at load; a no-op
    /// otherwise (and by default).
    fn preload_device_experts(&mut self) -> Result<(), ModelError> {
        Ok(())
    }
    /// Bytes of KV cache.
    fn kv_bytes(&self) -> usize;
    /// Time spent in each layer and in the head so far ([`StepTimes`]); empty for a family that
    /// does not record it.
    fn step_times(&self) -> StepTimes {
        StepTimes::default()
    }
}

/// Host time spent per layer (`[attention, ffn]`, the FFN's waits on expert reads included) and
/// in the head, summed over every forward pass: the per-layer cost a benchmark reports
/// (DeepSeek-V4 records it). On the CPU backend an op has finished when it returns, so this is
/// the layer's cost; on an asynchronous backend it would be launch time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepTimes {
    pub layers: Vec<[std::time::Duration; 2]>,
    pub head: std::time::Duration,
}

/// What every family shares: the install, the mapped resident file, the settings and the I/O pool.
pub struct Engine {
    pub install: Install,
    pub map: Arc<memmap2::Mmap>,
    pub index: ResidentIndex,
    /// The CPU kernel table the backend runs.
    pub kernels: &'static Kernels,
    /// Worker threads of the backend (the caller included).
    pub threads: usize,
    /// The backend the model runs on, as it names itself (`cpu avx512 x2`, `cuda:0 NVIDIA H200 sm_90`).
    pub device: String,
    /// Why `--device auto` ran on the CPU (what CUDA lacked), if it did.
    pub device_fallback: Option<String>,
    pub io: Arc<IoPool>,
    pub slots: CacheSlots,
    pub expert_policy: ExpertPolicy,
    pub direct_io: bool,
    pub prefill_chunk: usize,
    pub max_context: usize,
    /// [`LoadOptions::router_lookahead`].
    pub router_lookahead: usize,
    /// Per position, the smallest top-k margin seen by any layer's router (traced runs only).
    router_margins: Option<std::sync::Mutex<Vec<f32>>>,
    /// Recorded routing replayed instead of the routers' top-k ([`LoadOptions::routing_trace`]).
    routing: Option<RoutingTrace>,
    routing_path: String,
}

impl Engine {
    /// Whether routers should report their top-k margins ([`Engine::note_router_margins`]).
    pub fn traces_router(&self) -> bool {
        self.router_margins.is_some()
    }

    /// Records one layer's router top-k margins (the k-th largest logit minus the (k+1)-th, in
    /// logit units) of the rows at positions `pos0..`, keeping each position's smallest. A no-op
    /// unless the model was loaded with `trace_router`.
    pub fn note_router_margins(&self, pos0: usize, margins: &[f32]) {
        let Some(m) = &self.router_margins else {
            return;
        };
        let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() < pos0 + margins.len() {
            m.resize(pos0 + margins.len(), f32::INFINITY);
        }
        for (i, &v) in margins.iter().enumerate() {
            m[pos0 + i] = m[pos0 + i].min(v);
        }
    }

    /// With a routing trace loaded: the recorded expert ids of `layer` for positions
    /// `pos0..pos0 + t` (`[t, top_k]`, the trace wrapping around at its end).
    pub fn forced_routes(&self, layer: usize, pos0: usize, t: usize) -> Option<Vec<usize>> {
        let tr = self.routing.as_ref()?;
        Some(
            (pos0..pos0 + t)
                .flat_map(|p| tr.ids(p, layer).iter().map(|&e| e as usize))
                .collect(),
        )
    }

    /// The host expert cache as the load line and the bench print it: slots per layer (or
    /// `resident`), the policy and the I/O mode, e.g. `22 slots/layer, policy pool, O_DIRECT`.
    pub fn expert_cache(&self) -> String {
        let slots = match self.slots {
            CacheSlots::Fixed(n) => format!("{n} slots/layer"),
            CacheSlots::Resident => "resident".into(),
        };
        let io = if self.direct_io { "O_DIRECT" } else { "pread" };
        format!("{slots}, policy {}, {io}", self.expert_policy.name())
    }

    /// Which routing runs: `"router"`, or `"trace FILE"`.
    pub fn routing(&self) -> String {
        match &self.routing {
            None => "router".into(),
            Some(_) => format!("trace {}", self.routing_path),
        }
    }

    /// The MoE checks every family makes at load, before anything is allocated: layout.json holds
    /// `experts` experts per layer, the slot cache can hold the `top_k` experts of one token, and a
    /// routing trace (if any) was recorded for `layers` layers, `experts` experts and `top_k`.
    pub fn check_moe(&self, layers: usize, experts: usize, top_k: usize) -> Result<(), ModelError> {
        let per_layer = self.install.layout.experts_per_layer;
        if per_layer != experts {
            return Err(ModelError::Config(format!(
                "layout.json has {per_layer} experts per layer, config.json {experts}"
            )));
        }
        if self.slots.count(experts) < top_k {
            return Err(ModelError::Config(format!(
                "{} expert cache slots cannot hold the {top_k} experts one token routes to",
                self.slots.count(experts)
            )));
        }
        let Some(t) = &self.routing else {
            return Ok(());
        };
        if t.layers != layers || t.top_k != top_k || t.max_id() as usize >= experts {
            return Err(ModelError::Config(format!(
                "routing trace {} is [{} tokens, {} layers, top-{}] with ids up to {}; this model \
                 has {layers} MoE layers, {experts} experts, top-{top_k}",
                self.routing_path,
                t.tokens,
                t.layers,
                t.top_k,
                t.max_id()
            )));
        }
        Ok(())
    }

    /// Where the expert tensors of MoE layer `layer` sit inside each expert blob (layout.json).
    pub fn expert_blob(&self, layer: usize) -> Result<&ExpertBlobLayout, ModelError> {
        self.install
            .layout
            .layer(layer)
            .and_then(|l| l.blob.as_ref())
            .ok_or_else(|| {
                ModelError::Config(format!("layout.json has no experts for MoE layer {layer}"))
            })
    }

    /// The CPU backend over this install's resident bytes.
    pub fn cpu_backend(&self) -> CpuBackend {
        CpuBackend::new(self.kernels, self.threads, self.map.clone())
    }

    /// Per absolute position, the smallest router top-k margin recorded (empty when untraced).
    pub fn router_margins(&self) -> Vec<f32> {
        self.router_margins
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .unwrap_or_default()
    }

    /// Maps the install's resident weights and checks the settings.
    pub fn new(install: Install, opts: &LoadOptions) -> Result<Self, ModelError> {
        let path = install.weights_path();
        let file = std::fs::File::open(&path).map_err(|source| ModelError::Map {
            path: path.display().to_string(),
            source,
        })?;
        // SAFETY: the install is read-only by contract; nothing in this process writes or truncates
        // model_weights.bin while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| ModelError::Map {
            path: path.display().to_string(),
            source,
        })?;
        let index = ResidentIndex::parse(&map)?;
        let kernels = match &opts.kernels {
            Some(name) => Kernels::by_name(name).ok_or_else(|| {
                ModelError::Config(format!(
                    "kernel variant '{name}' is not available on this CPU"
                ))
            })?,
            None => Kernels::detect(),
        };
        const MAX_CONTEXT: usize = 1 << 24;
        if opts.max_context > MAX_CONTEXT {
            return Err(ModelError::Config(format!(
                "max context {} is beyond the supported {MAX_CONTEXT} positions",
                opts.max_context
            )));
        }
        if opts.expert_policy == ExpertPolicy::Pool && opts.device != Device::Cpu {
            // A GPU backend pins each layer's host slots; a pool's layers share one slab.
            return Err(ModelError::Config(
                "--expert-cache-policy pool runs on the CPU backend only (--device cpu); with a \
                 GPU use lfu or lru"
                    .into(),
            ));
        }
        if opts.prefill_chunk == 0 || opts.max_context == 0 {
            return Err(ModelError::Config(
                "prefill chunk and max context must be positive".into(),
            ));
        }
        Ok(Self {
            install,
            map: Arc::new(map),
            index,
            kernels,
            threads: opts.threads.max(1),
            device: String::new(),
            device_fallback: None,
            io: IoPool::new(4),
            slots: opts.slots,
            expert_policy: opts.expert_policy,
            direct_io: opts.direct_io,
            prefill_chunk: opts.prefill_chunk,
            max_context: opts.max_context,
            router_lookahead: opts.router_lookahead,
            router_margins: opts.trace_router.then(|| std::sync::Mutex::new(Vec::new())),
            routing: opts
                .routing_trace
                .as_deref()
                .map(RoutingTrace::open)
                .transpose()?,
            routing_path: opts
                .routing_trace
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
        })
    }
}

/// One saved copy of a family's recurrent state `S` and the position it describes
/// ([`Model::checkpoint`]): the cut rules of a model whose state cannot be cut open.
pub struct Snapshot<S> {
    saved: Option<(usize, S)>,
}

impl<S: Clone> Snapshot<S> {
    pub fn new() -> Self {
        Self { saved: None }
    }

    /// Keeps a copy of `state` as it is at position `pos` (replacing the previous one in place).
    pub fn save(&mut self, pos: usize, state: &S) {
        match &mut self.saved {
            Some((p, s)) => {
                *p = pos;
                s.clone_from(state);
            }
            None => self.saved = Some((pos, state.clone())),
        }
    }

    /// Forgets the copy (the prefix it described is gone).
    pub fn forget(&mut self) {
        self.saved = None;
    }

    /// Whether the copy describes position `n`.
    pub fn is_at(&self, n: usize) -> bool {
        matches!(self.saved, Some((p, _)) if p == n)
    }

    /// Copies the saved state into `state`, if the copy describes position `n`.
    pub fn restore(&self, n: usize, state: &mut S) -> bool {
        match &self.saved {
            Some((p, s)) if *p == n => {
                state.clone_from(s);
                true
            }
            _ => false,
        }
    }

    /// [`Model::rewind_point`] of a model at position `len`: `len` itself, the checkpoint if it is
    /// at or below `n`, else 0.
    pub fn rewind_point(&self, n: usize, len: usize) -> usize {
        match self.saved {
            _ if n >= len => len,
            Some((p, _)) if p <= n && p <= len => p,
            _ => 0,
        }
    }
}

impl<S: Clone> Default for Snapshot<S> {
    fn default() -> Self {
        Self::new()
    }
}

/// The per-layer expert streamers, opened on a layer's first use (after its file is checked),
/// with their slots as the engine's policy hands them out ([`CachePlan`]).
pub struct Streamers {
    layers: Vec<Option<ExpertStreamer>>,
    plan: Option<CachePlan>,
}

impl Streamers {
    fn new(n: usize) -> Self {
        Self {
            layers: (0..n).map(|_| None).collect(),
            plan: None,
        }
    }

    /// The streamer of `layer`, opening it (and checking its file per the verify policy) on first use.
    pub fn get(
        &mut self,
        layer: usize,
        engine: &Engine,
    ) -> Result<&mut ExpertStreamer, ModelError> {
        if self.layers[layer].is_none() {
            engine.install.check_layer_file(layer)?;
            let l = &engine.install.layout;
            if self.plan.is_none() {
                let moe_layers = l.layers.iter().filter(|x| x.blob.is_some()).count();
                self.plan = Some(CachePlan::new(
                    engine.expert_policy,
                    engine.slots,
                    l.experts_per_layer,
                    l.expert_stride,
                    moe_layers,
                    self.layers.len(),
                )?);
            }
            let plan = self.plan.as_ref().expect("made above");
            let s = plan.open(
                layer,
                &engine.install.layer_path(layer),
                engine.direct_io,
                Arc::clone(&engine.io),
            )?;
            self.layers[layer] = Some(s);
        }
        Ok(self.layers[layer].as_mut().expect("opened above"))
    }

    /// Fills the backend's own expert cache at load where it holds every expert of a layer
    /// ([`Model::preload_device_experts`]); only such a layer opens its file (and checks it) now,
    /// the others on first use as before.
    pub fn preload<B: Backend>(&mut self, be: &B, engine: &Engine) -> Result<(), ModelError> {
        for layer in 0..self.layers.len() {
            if engine.install.layout.layers[layer].blob.is_none() {
                continue;
            }
            let missing = be.experts_to_complete(layer)?;
            if !missing.is_empty() {
                mference_backend::moe::complete::<B, ModelError>(
                    be,
                    self.get(layer, engine)?,
                    &missing,
                )?;
            }
        }
        Ok(())
    }

    /// The streamer of `layer` and, when `next` and a layer follows, the one of `layer + 1` (both
    /// opened as by [`Streamers::get`]): the router lookahead prefetches into the second while the
    /// first serves the current layer.
    pub fn with_next(
        &mut self,
        layer: usize,
        next: bool,
        engine: &Engine,
    ) -> Result<(&mut ExpertStreamer, Option<&mut ExpertStreamer>), ModelError> {
        let next = next && layer + 1 < self.layers.len();
        if next {
            self.get(layer + 1, engine)?;
        }
        self.get(layer, engine)?;
        let (this, rest) = self.layers.split_at_mut(layer + 1);
        let this = this[layer].as_mut().expect("opened above");
        Ok((
            this,
            rest.first_mut().filter(|_| next).and_then(Option::as_mut),
        ))
    }

    /// Counters per layer.
    pub fn stats(&self) -> Vec<StreamerStats> {
        self.layers
            .iter()
            .map(|s| s.as_ref().map(|s| s.stats()).unwrap_or_default())
            .collect()
    }
}

/// Opens the install at `dir` and loads its family.
///
/// Errors: any install check (`mference_format`), an unknown family, or a tensor that does not match
/// the config.
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn Model>, ModelError> {
    let install = Install::open(dir, opts.verify)?;
    let model_type = install
        .config_json
        .get("model_type")
        .and_then(|v| v.as_str())
        .unwrap_or("")
        .to_string();
    if !matches!(
        model_type.as_str(),
        "gemma4"
            | "gemma4_text"
            | "qwen3_5_moe"
            | "qwen3_5_moe_text"
            | "deepseek_v4"
            | "maple"
            | "inkling_mm_model"
    ) {
        return Err(ModelError::Family(model_type));
    }
    if opts.flash_head && model_type != "maple" {
        return Err(ModelError::Config(format!(
            "--flash-head is a Maple option; this install is {model_type}"
        )));
    }
    let lookahead_families = ["gemma4", "gemma4_text", "qwen3_5_moe", "qwen3_5_moe_text"];
    if opts.router_lookahead > 0 && !lookahead_families.contains(&model_type.as_str()) {
        return Err(ModelError::Config(format!(
            "--router-lookahead is a Gemma 4 / Qwen 3.6 option; this install is {model_type} \
             (DeepSeek-V4 has its own shadow prefetch)"
        )));
    }
    // What CUDA lacks is named before the weights are read; `auto` decides here.
    let auto_cpu = probe_device(opts.device)?;
    let gpu_only = opts.gpu_expert_budget != GpuExpertBudget::Auto || opts.gpu_force_miss;
    if let Some(why) = auto_cpu.as_ref().filter(|_| gpu_only) {
        // The GPU-only settings would be dropped without a word: refuse them instead.
        return Err(ModelError::Device(format!(
            "--device auto found no usable CUDA ({why}), and --gpu-expert-budget / \
             --gpu-force-miss apply only on CUDA: drop them, or fix CUDA and use --device cuda"
        )));
    }
    let mut engine = Engine::new(install, opts)?;
    // The int8 prefill (VNNI) rounds activations to int8; its cost is measured only on these two
    // families (README). Elsewhere it was found far off the reference: refuse rather than mislead.
    if !engine.kernels.is_exact()
        && !matches!(
            model_type.as_str(),
            "gemma4" | "gemma4_text" | "qwen3_5_moe" | "qwen3_5_moe_text"
        )
    {
        return Err(ModelError::Config(format!(
            "--kernels {} (int8 prefill) is checked only for Gemma 4 and Qwen 3.6; on {model_type} \
             it is far from the reference: use --kernels avx512 (or auto)",
            engine.kernels.name()
        )));
    }
    let cuda = |n: usize, engine: &Engine| {
        mference_cuda::CudaBackend::new(n, engine.map.clone())
            .and_then(|be| be.with_expert_cache(gpu_expert_cache(engine, opts)))
            .map_err(|e| ModelError::Device(format!("cuda:{n}: {e}")))
    };
    match opts.device {
        Device::Cpu => {
            let be = engine.cpu_backend();
            load_family(&model_type, engine, be, opts)
        }
        Device::Cuda(n) => {
            let be = cuda(n, &engine)?;
            load_family(&model_type, engine, be, opts)
        }
        Device::Auto => match auto_cpu {
            Some(why) => {
                engine.device_fallback = Some(why);
                let be = engine.cpu_backend();
                load_family(&model_type, engine, be, opts)
            }
            None => {
                let be = cuda(0, &engine)?;
                load_family(&model_type, engine, be, opts)
            }
        },
    }
}

/// Checks `device` before anything is read: `cuda:N` must have its driver, device and NVRTC
/// (else the error names what is missing). For `auto`, `Some(what CUDA lacks)` when it takes the
/// CPU; `None` when it takes `cuda:0` (or for `cpu`).
pub fn probe_device(device: Device) -> Result<Option<String>, ModelError> {
    match device {
        Device::Cpu => Ok(None),
        Device::Cuda(n) => mference_cuda::CudaBackend::probe(n)
            .map(|()| None)
            .map_err(|e| ModelError::Device(format!("cuda:{n}: {e}"))),
        Device::Auto => match mference_cuda::CudaBackend::probe(0) {
            Ok(()) => Ok(None),
            Err(e) if e.is_unavailable() => Ok(Some(e.to_string())),
            Err(e) => Err(ModelError::Device(format!("cuda:0: {e}"))),
        },
    }
}

/// The GPU expert cache's settings for this install: its expert layers, blob stride and top-k.
fn gpu_expert_cache(engine: &Engine, opts: &LoadOptions) -> mference_cuda::ExpertCacheOptions {
    let l = &engine.install.layout;
    mference_cuda::ExpertCacheOptions {
        geometry: mference_cuda::ExpertGeometry {
            layers: l
                .layers
                .iter()
                .filter(|x| x.blob.is_some())
                .map(|x| x.layer)
                .collect(),
            experts: l.experts_per_layer,
            stride: l.expert_stride as usize,
            top_k: engine.install.manifest.arch.top_k_experts as usize,
        },
        budget: opts.gpu_expert_budget,
        force_miss: opts.gpu_force_miss,
    }
}

/// The family registry: `model_type` → the family's loader, on backend `be`.
fn load_family<B: Backend + 'static>(
    model_type: &str,
    mut engine: Engine,
    be: B,
    opts: &LoadOptions,
) -> Result<Box<dyn Model>, ModelError> {
    engine.device = be.name();
    let config = &engine.install.config_json;
    let mut model: Box<dyn Model> = match model_type {
        "gemma4" | "gemma4_text" => {
            let cfg = gemma4::Config::from_config_json(config)?;
            Box::new(gemma4::Gemma4::load(engine, be, cfg, opts)?)
        }
        "qwen3_5_moe" | "qwen3_5_moe_text" => {
            let cfg = qwen3_5_moe::Config::from_config_json(config)?;
            Box::new(qwen3_5_moe::Qwen35Moe::load(engine, be, cfg, opts)?)
        }
        "deepseek_v4" => {
            let cfg = deepseek_v4::Config::from_config_json(config)?;
            Box::new(deepseek_v4::DeepseekV4::load(engine, be, cfg, opts)?)
        }
        "maple" => {
            let cfg = maple::Config::from_config_json(config)?;
            Box::new(maple::Maple::load(engine, be, cfg, opts)?)
        }
        "inkling_mm_model" => {
            let cfg = inkling::Config::from_config_json(config)?;
            Box::new(inkling::Inkling::load(engine, be, cfg, opts)?)
        }
        other => return Err(ModelError::Family(other.to_string())),
    };
    model.size_device_experts()?;
    model.preload_device_experts()?;
    Ok(model)
}
