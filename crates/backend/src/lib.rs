//! mference-backend: the op layer every family is written against (`docs/ARCHITECTURE.md`).
//!
//! A family file (`mference-models`) states its math once as calls on a [`Backend`]: quantized
//! matmuls against resident weights or an expert blob, norms, RoPE, attention over a backend-owned
//! KV cache, the recurrent ops of linear attention, elementwise ops, the router and the head. The
//! backend owns every buffer the calls produce ([`CoreOps::Tensor`], [`CoreOps::Kv`],
//! [`CoreOps::State`]); the host sees activations only through the explicit readbacks
//! ([`CoreOps::route`]'s expert ids and weights, [`CoreOps::read`], [`CoreOps::head_argmax`]).
//!
//! The ops come in groups ([`ops`](crate::CoreOps): core, recurrent, DeepSeek-V4, Inkling, the
//! device expert-cache hooks), each a trait; [`Backend`] is all of them. A backend answers
//! [`CoreOps::supports`] per [`Op`] without an instance, and [`missing_ops`] lists what a family
//! needs that a backend type lacks. Every backend (CPU, the f64 reference, the harness, CUDA)
//! follows the same grouping in its modules.
//!
//! - [`cpu::CpuBackend`]: today's kernels (`mference-kernels`) and worker pool.
//! - [`reference`]: a plain scalar implementation of every op, the oracle of the op test harness
//!   (`tests/backend_ops.rs`, in the spirit of llama.cpp's `test-backend-ops`).
//! - [`moe::routed_experts`]: the MoE step (tiles of experts, hits first, the next tile's reads
//!   overlapping this tile's compute), written once for every family and backend.
//!
//! Shapes: activations are row-major `[rows, cols]` f32 (`rows` = tokens of the chunk); a
//! "per-head" op sees each row as `[heads, head_dim]`.

pub mod cpu;
pub mod harness;
mod kv;
pub mod moe;
mod ops;
pub mod reference;
mod rope;
mod weights;

use std::collections::BTreeMap;

pub use kv::{KvCache, KvState};
pub use mference_runtime::KvDtype;
pub use ops::{
    deepseek_v4_checks, missing_ops, Backend, CoreOps, DeepSeekV4Ops, DeviceExpertOps, InklingOps,
    Op, RecurrentOps,
};
pub use rope::{Rope, RopeStyle, Yarn};
pub use weights::{f32_vector, FRef, Mlp, QRef, VRef, WeightError};

/// A backend failed an op: it lacks the op, or the op's operands do not fit together.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OpError {
    /// The backend does not implement `op` (the op harness reports it by name).
    #[error("backend '{backend}' has no op '{op}'")]
    Missing { backend: String, op: &'static str },
    /// Operand shapes disagree (a bug in the caller, reported instead of a wrong result).
    #[error("op '{op}': {why}")]
    Shape { op: &'static str, why: String },
    /// The device failed the op (a GPU backend: out of device memory, a failed launch or copy).
    #[error("backend '{backend}' failed op '{op}': {why}")]
    Device {
        backend: String,
        op: &'static str,
        why: String,
    },
}

/// Result of an op.
pub type OpResult<T> = Result<T, OpError>;

/// A backend-owned activation buffer, row-major `[rows, cols]` f32.
pub trait Tensor: Send {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
}

/// Where the bytes of a quantized matrix live: the resident weights (the mapped
/// `model_weights.bin`, or the backend's copy of it) or one expert blob of the streamer's slots.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    Resident,
    /// An expert blob (`expertStride` bytes); [`QRef`] offsets are inside it.
    Blob(&'a [u8]),
    /// Expert `expert` of MoE layer `layer`, in the backend's own expert cache (a GPU slot):
    /// only what [`DeviceExpertOps::held_experts`] or [`DeviceExpertOps::load_expert`] said is held.
    Held {
        layer: usize,
        expert: usize,
    },
}

/// Counters of a backend's own expert cache (a GPU slot slab) since load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceExpertStats {
    /// Slots per MoE layer, and their bytes over all layers.
    pub slots_per_layer: usize,
    pub slab_bytes: u64,
    /// Uses served from a device slot / copied in from a host slot.
    pub hits: u64,
    pub misses: u64,
    /// Bytes copied host → device for misses.
    pub h2d_bytes: u64,
    /// Time the host thread spent waiting for those copies to leave the host slots.
    pub copy_wait: std::time::Duration,
    /// Decode steps of a layer routed on the device without a readback
    /// ([`DeviceExpertOps::routed_experts_held`]); their uses count as hits.
    pub device_routed: u64,
    /// Kernel launches of the backend since load, every op counted (not only the experts').
    pub launches: u64,
    /// Misses computed on the host CPU instead of copied in
    /// ([`DeviceExpertOps::glu_mlp_combine_split`]), and the host time they took (the read of
    /// the row and the upload of the outputs included).
    pub host_computed: u64,
    pub host_time: std::time::Duration,
    /// The share of each decode row's misses computed on the host, in percent (`None`: no
    /// split), and, when it was calibrated, what one expert cost copied in and on the host.
    pub host_share: Option<u32>,
    pub host_calibration: Option<(std::time::Duration, std::time::Duration)>,
    /// Bytes of the prefill staging area (0: none; prefill copies go into the slots).
    pub staging_bytes: u64,
    /// Router lookahead (`--router-lookahead`): experts copied in ahead of their layer's router
    /// ([`DeviceExpertOps::prefetch_expert`]), and later uses served by such a copy.
    pub prefetched: u64,
    pub prefetch_hits: u64,
}

/// The scale of an RMSNorm `x · rsqrt(mean(x²) + eps) · s` (mlx `fast.rms_norm`).
#[derive(Clone, Copy)]
pub enum Norm<'a> {
    /// `s = 1` (Gemma 4's V norm, the router's pre-norm).
    NoScale,
    /// `s = w` (the checkpoint stores the final weight; Qwen's MLX `1 + w` norms are stored shifted).
    Weight(&'a VRef),
    /// `s = 1 + w` (zero-centred norms stored unshifted: DeepSeek-V4, Inkling).
    OnePlusWeight(&'a VRef),
    /// `s = c` with the rsqrt and `c` folded first: `x · (c / sqrt(mean(x²) + eps))` (the L2
    /// normalisation of Gated DeltaNet's q and k, `normalize_qk`).
    Scaled(f32),
}

/// One pre-norm of a residual ([`CoreOps::add_rms_norm_pre`]): [`CoreOps::rms_norm`] by `norm`,
/// then, with `cols = Some((w, c))`, [`CoreOps::mul_cols`] by `w · c` (a router's input scale).
#[derive(Clone, Copy)]
pub struct PreNorm<'a> {
    pub norm: Norm<'a>,
    pub cols: Option<(&'a VRef, f32)>,
}

/// An elementwise map.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unary {
    /// `x · c`.
    Scale(f32),
    /// `c · tanh(x / c)` (Gemma's final logit softcap).
    Softcap(f32),
    /// `min(max(x, lo), hi)`.
    Clamp(f32, f32),
    /// `x · sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
}

/// The activation of a GLU MLP: `down(act(gate(x)) ⊙ up(x))`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Act {
    /// GeGLU (Gemma 4).
    GeluTanh,
    /// SwiGLU (Qwen 3.6, DeepSeek-V4, Inkling).
    Silu,
    /// SwiGLU with the gate clamped to `≤ limit` and the up projection to `[-limit, limit]` first
    /// (Maple's clamped SwiGLU, deepgrove-ai/mlx-lm-deepgrove `mlx_lm/models/maple.py`).
    SiluClamped(f32),
}

/// Shape of one attention call.
#[derive(Clone, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// `Some(w)`: a key at position `k` is visible from query position `q` iff `q - w < k <= q`.
    pub window: Option<usize>,
    pub scale: f32,
    /// One learned logit per query head that joins every softmax (attention sinks) and takes
    /// probability mass without contributing a value.
    pub sinks: Option<Vec<f32>>,
}

/// The log position scale of Inkling's global layers (transformers `modeling_inkling.py`): the
/// attention logits of the query at position `p` (q·k·scale plus the position bias) are multiplied
/// by `τ_p = 1 + alpha · ln(max((p + 1) / n_floor, 1))`, computed in f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogScaling {
    pub n_floor: f32,
    pub alpha: f32,
}

impl LogScaling {
    /// `τ_p` of the query at position `p`.
    pub fn tau(&self, p: usize) -> f32 {
        1.0 + self.alpha * ((p + 1) as f32 / self.n_floor).max(1.0).ln()
    }
}

/// A learned relative-position bias added to the attention logits (Inkling's `RelativeLogits`,
/// transformers `InklingRelativeLogits`): the bias of query `t` (position `p`), head `h`, over the
/// key at position `s` is `(rel[t, h, :] · proj)[p − s]` for `0 ≤ p − s < extent` and 0 beyond.
pub struct RelBias<'a, T> {
    /// `[T, n_heads · d_rel]`: each query row's mixing coefficients per head.
    pub rel: &'a T,
    /// `[d_rel, extent]`: the bank of bias-vs-distance profiles.
    pub proj: &'a T,
    /// Global layers: the log position scale of the whole logit.
    pub log_scaling: Option<LogScaling>,
}

/// Inkling's router (transformers `InklingTopkRouter`): the
/// logits are `[T, n_routed + n_shared]`; the top-k of `sigmoid(l[..n_routed]) + bias` picks the
/// routed experts, and `softmax(logsigmoid([l[chosen], l[n_routed..]])) · scale` weighs them and
/// the shared experts (sinks) together.
pub struct SinkRouter<'a, T> {
    /// `[1, n_routed]` selection bias (`e_score_correction_bias`), used for the choice only.
    pub bias: &'a T,
    pub n_shared: usize,
    /// `route_scale · global_scale`.
    pub scale: f32,
}

/// Head counts and sizes of one gated delta rule call (Gated DeltaNet).
#[derive(Clone, Debug)]
pub struct DeltaShape {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub head_k_dim: usize,
    pub head_v_dim: usize,
}

/// How a router turns its logits into the top-k experts and their weights.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scoring {
    /// Top-k of the raw logits, then a softmax over the k chosen (Gemma 4).
    SoftmaxOfTopK,
    /// Softmax over every expert, then the top-k, renormalised to sum 1 when `norm_topk_prob`
    /// (Qwen 3.6, Maple).
    TopKOfSoftmax { norm_topk_prob: bool },
    /// DeepSeek-V4 (`noaux_tc`, `scoring_func: sqrtsoftplus`): scores `s = sqrt(softplus(logit))`;
    /// the top-k of `s + correction_bias` (the bias steers selection only, ties to the lower id);
    /// weights `s[i] / (Σ_chosen s + 1e-20) · routed_scaling_factor`. Forced ids (hash layers'
    /// `tid2eid[token]`) take the same weights.
    SqrtSoftplus {
        routed_scaling_factor: f32,
        /// `ffn.gate.e_score_correction_bias` `[num_experts]` (F32, resident).
        correction_bias: Option<FRef>,
    },
}

/// The sizes of one manifold-constrained hyper-connection site (DeepSeek-V4's mHC,
/// transformers `modeling_deepseek_v4.py`): `streams` residual streams of width `dim`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HcSpec {
    pub streams: usize,
    /// Sinkhorn-Knopp iterations of the comb matrix (`hc_sinkhorn_iters`).
    pub sinkhorn_iters: usize,
    /// `hc_eps`: added to `pre` and to the comb matrix and its normalisers.
    pub hc_eps: f32,
    /// The eps of the weightless RMSNorm over the flattened streams (`rms_norm_eps`).
    pub norm_eps: f32,
}

/// A router: scoring rule, experts per token and an optional per-expert weight multiplier.
#[derive(Clone, Copy)]
pub struct RouterSpec<'a> {
    pub scoring: Scoring,
    pub top_k: usize,
    /// Gemma 4's `router.per_expert_scale` (`[num_experts]`), multiplied into each chosen weight.
    pub per_expert_scale: Option<&'a VRef>,
    /// Also return each row's top-k margin (parity tests' router trace).
    pub trace: bool,
    /// `[rows, top_k]` expert ids to take instead of the top-k (a recorded routing trace replayed
    /// in benchmarks); their weights still come from this router's scores of those ids.
    pub forced: Option<&'a [usize]>,
}

/// The router's decision for a chunk, read back to the host to plan the expert cache.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routes {
    /// Expert → the rows routed to it with their combine weights; experts ascending, rows ascending.
    pub experts: BTreeMap<usize, Vec<(usize, f32)>>,
    /// Per row, the k-th largest raw logit minus the (k+1)-th (only when traced).
    pub margins: Vec<f32>,
}

/// An operand check shared by the backends: `Err(OpError::Shape)` unless `ok`.
pub fn check(op: &'static str, ok: bool, why: impl FnOnce() -> String) -> OpResult<()> {
    if ok {
        Ok(())
    } else {
        Err(OpError::Shape { op, why: why() })
    }
}

/// Checks `mlp`'s projections chain from rows of `cols` inputs (gate and up of one shape).
pub fn check_mlp(op: &'static str, mlp: &Mlp, cols: usize) -> OpResult<()> {
    check(
        op,
        mlp.gate_proj.cols == cols
            && mlp.up_proj.cols == cols
            && mlp.up_proj.rows == mlp.gate_proj.rows
            && mlp.down_proj.cols == mlp.gate_proj.rows,
        || format!("projections do not chain from {cols} columns"),
    )
}

/// The operand check of [`CoreOps::glu_mlp_rows`] shared by the backends: `x` one row of the
/// MLP's input width, one distinct row of `out` (`[_, down.rows]`) per source.
pub fn check_glu_rows<T: Tensor>(
    op: &'static str,
    mlp: &Mlp,
    n_srcs: usize,
    x: &T,
    out: &T,
    rows: &[usize],
) -> OpResult<()> {
    check_mlp(op, mlp, x.cols())?;
    check(
        op,
        x.rows() == 1
            && out.cols() == mlp.down_proj.rows
            && rows.len() == n_srcs
            && rows.iter().all(|&r| r < out.rows())
            && rows.iter().enumerate().all(|(i, r)| !rows[..i].contains(r)),
        || {
            format!(
                "{n_srcs} experts of a [{}, {}] input into rows {rows:?} of [{}, {}]",
                x.rows(),
                x.cols(),
                out.rows(),
                out.cols()
            )
        },
    )
}

/// The operand check of [`CoreOps::glu_mlp_combine`] shared by the backends: one row of
/// `gate.cols` in, an accumulator `[1, down.rows]`, one weight per source.
pub fn check_glu_combine<T: Tensor>(
    op: &'static str,
    mlp: &Mlp,
    n_srcs: usize,
    n_weights: usize,
    x: &T,
    acc: &T,
) -> OpResult<()> {
    check_mlp(op, mlp, x.cols())?;
    check(
        op,
        x.rows() == 1 && acc.rows() == 1 && acc.cols() == mlp.down_proj.rows && n_srcs == n_weights,
        || {
            format!(
                "{n_srcs} experts and {n_weights} weights of a [{}, {}] input into a [{}, {}] \
                 accumulator (one row, {} wide)",
                x.rows(),
                x.cols(),
                acc.rows(),
                acc.cols(),
                mlp.down_proj.rows
            )
        },
    )
}

/// The operand check of [`RouterSpec::forced`] shared by the backends: `[rows, top_k]` ids, each
/// below `n_exp`, distinct within a row.
pub fn check_forced(
    op: &'static str,
    spec: &RouterSpec,
    rows: usize,
    n_exp: usize,
) -> OpResult<()> {
    let Some(f) = spec.forced else {
        return Ok(());
    };
    let k = spec.top_k;
    check(
        op,
        f.len() == rows * k
            && f.iter().all(|&e| e < n_exp)
            && f.chunks_exact(k)
                .all(|r| r.iter().enumerate().all(|(i, e)| !r[..i].contains(e))),
        || format!("forced ids must be [{rows}, {k}] distinct ids < {n_exp}"),
    )
}
