//! The settings fixed at load: [`LoadOptions`] and the [`Device`] the ops run on.

use mference_format::VerifyPolicy;
use mference_runtime::{CacheSlots, ExpertPolicy, KvDtype};

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
    /// On CUDA: device memory for routed experts (`--gpu-expert-budget`; `None`: not given, auto
    /// on CUDA; given, even as auto, it is refused where `--device auto` falls back to the CPU).
    pub gpu_expert_budget: Option<mference_cuda::GpuExpertBudget>,
    /// On CUDA: count every expert use as a miss and copy it in again (tests the copy path).
    pub gpu_force_miss: bool,
    /// On CUDA under a budget: the share of each decode row's GPU misses computed on the host
    /// CPU instead of copied in (`--gpu-miss-split`; `None`: not given, `auto` on CUDA, nothing to
    /// refuse on the CPU; `mference_cuda::MissSplit`).
    pub gpu_miss_split: Option<mference_cuda::MissSplit>,
    /// DeepSeek-V4's shadow prefetch in decode: layer L+1's router applied to layer L's FFN input
    /// starts reads of its two heaviest predicted experts (hash layers: from the token id) that
    /// layer L+1 joins only if it routes to them. Results are identical either way; other families
    /// ignore it.
    pub shadow_prefetch: bool,
    /// Gemma 4 and Qwen 3.6 router lookahead in decode (`--router-lookahead N`): layer L+1's
    /// router applied to layer L's post-attention state starts non-blocking reads of its N heaviest
    /// predicted experts that are not cached, or, on a GPU under an expert budget, copies of those
    /// in the host tier into GPU slots ([`mference_backend::moe::Lookahead`]); 0 = off. Results
    /// are identical either way (on CUDA with `--gpu-miss-split off`: a split may compute other
    /// misses on the CPU, within tolerance); other families ignore it.
    pub router_lookahead: usize,
    /// Force a kernel table by name (`scalar`, `avx2`, `avx2i16`, `avx512`, `avx512i16`, `amx`, `avx512vnni`); `None` =
    /// auto: `Kernels::detect_int16` for the families checked with int16 activations (Gemma 4,
    /// Qwen 3.6), else the fastest exact table.
    pub kernels: Option<String>,
    /// Maple only: FlashHead (approximate head from centroid scoring) for single-token decode
    /// (`--flash-head`); prefill and every other call keep the exact head.
    pub flash_head: bool,
}

impl LoadOptions {
    /// Rows of a sliding-window layer's KV ring for a window of `window` positions: the window
    /// and one prefill chunk written after it, or the whole context when that is not smaller
    /// (saturating: a chunk past the context is the whole prompt, never a wrapped-around ring).
    pub fn sliding_rows(&self, window: usize) -> usize {
        window
            .saturating_add(self.prefill_chunk)
            .min(self.max_context)
    }
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
            gpu_expert_budget: None,
            gpu_force_miss: false,
            gpu_miss_split: None,
            shadow_prefetch: true,
            router_lookahead: 0,
            flash_head: false,
        }
    }
}
