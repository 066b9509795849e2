//! mference-backend: the op layer every family is written against (`docs/ARCHITECTURE.md`).
//!
//! A family file (`mference-models`) states its math once as calls on a [`Backend`]: quantized
//! matmuls against resident weights or an expert blob, norms, RoPE, attention over a backend-owned
//! KV cache, the recurrent ops of linear attention, elementwise ops, the router and the head. The
//! backend owns every buffer the calls produce ([`Backend::Tensor`], [`Backend::Kv`],
//! [`Backend::State`]); the host sees activations only through the explicit readbacks
//! ([`Backend::route`]'s expert ids and weights, [`Backend::read`], [`Backend::head_argmax`]).
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
pub mod reference;
mod rope;
mod weights;

use std::collections::BTreeMap;

pub use kv::{KvCache, KvState};
pub use mference_runtime::KvDtype;
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
    /// only what [`Backend::held_experts`] or [`Backend::load_expert`] said is held.
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
    /// ([`Backend::routed_experts_held`]); their uses count as hits.
    pub device_routed: u64,
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

/// One pre-norm of a residual ([`Backend::add_rms_norm_pre`]): [`Backend::rms_norm`] by `norm`,
/// then, with `cols = Some((w, c))`, [`Backend::mul_cols`] by `w · c` (a router's input scale).
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
    /// (Maple's clamped SwiGLU, `reference/architectures.md` §6).
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

/// The log position scale of Inkling's global layers (`reference/architectures.md` §5): the
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

/// Inkling's router (`reference/architectures.md` §5, transformers `InklingTopkRouter`): the
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
/// `reference/architectures.md` §4.2): `streams` residual streams of width `dim`.
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

/// The op vocabulary of the five families. Every op has a default body that fails with
/// [`OpError::Missing`], so a backend that lacks an op is reported by the op's name.
///
/// Numerics: each op of the CPU backend computes exactly what its [`reference`] twin computes up
/// to f32 summation order (the kernels' documented budgets); `tests/backend_ops.rs` checks every
/// op of every backend compiled in against it.
#[allow(unused_variables)]
pub trait Backend: Send + Sync + Sized {
    /// Activations `[rows, cols]` f32.
    type Tensor: Tensor;
    /// One attention layer's K and V rows (FP16 or FP32; a sliding ring or linear).
    type Kv: KvState + Send;
    /// A recurrent state vector (f32): a conv tail, a DeltaNet state.
    type State: Clone + Send;

    /// Short description: `cpu avx512 ×2`.
    fn name(&self) -> String;

    #[doc(hidden)]
    fn missing(&self, op: &'static str) -> OpError {
        OpError::Missing {
            backend: self.name(),
            op,
        }
    }

    // ---- the backend's own expert cache (a GPU slot slab; `moe::routed_experts`) -------------

    /// Which of the distinct `experts` of MoE layer `layer` the backend holds in its own memory,
    /// each counted as one use. Held experts are computed from [`Weights::Held`] and are not
    /// asked of the host streamer. Default: none (the CPU computes from the host slots).
    fn held_experts(&self, layer: usize, experts: &[usize]) -> OpResult<Vec<bool>> {
        Ok(vec![false; experts.len()])
    }
    /// The weights to compute expert `expert` of `layer` from, given its bytes in a host slot.
    /// A backend with its own cache starts copying `blob` into a slot of it and returns
    /// [`Weights::Held`]; `blob` must then stay unchanged until
    /// [`expert_copies_done`](Backend::expert_copies_done). Default: `blob` itself.
    fn load_expert<'a>(
        &self,
        layer: usize,
        expert: usize,
        blob: &'a [u8],
    ) -> OpResult<Weights<'a>> {
        Ok(Weights::Blob(blob))
    }
    /// Waits until every copy [`load_expert`](Backend::load_expert) started has left its host
    /// slot, so the host streamer may refill it. Default: nothing to wait for.
    fn expert_copies_done(&self) -> OpResult<()> {
        Ok(())
    }
    /// Shows the backend the host slot memory of `layer`'s streamer (called on every MoE step;
    /// a GPU backend page-locks it once, so copies from it run at full bus speed).
    fn attach_host_slots(&self, layer: usize, slots: &[u8]) -> OpResult<()> {
        Ok(())
    }
    /// The counters of the backend's own expert cache, if it has one.
    fn device_expert_stats(&self) -> Option<DeviceExpertStats> {
        None
    }
    /// The experts of MoE layer `layer` the backend's own cache has room to hold for good
    /// (every expert of the layer fits, e.g. `--gpu-expert-budget resident`) but does not hold
    /// yet: the decode step loads them once ([`moe::route_and_run`]), so that
    /// [`routes_on_device`](Backend::routes_on_device) holds from then on. Default: none.
    fn experts_to_complete(&self, layer: usize) -> OpResult<Vec<usize>> {
        Ok(Vec::new())
    }
    /// Whether [`routed_experts_held`](Backend::routed_experts_held) can run a decode step of
    /// MoE layer `layer` with `top_k` experts per token: the backend holds every expert of the
    /// layer for good, so the router's choice needs no readback. Default: no.
    fn routes_on_device(&self, layer: usize, top_k: usize) -> OpResult<bool> {
        Ok(false)
    }
    /// A decode step's routed experts without a readback (only after
    /// [`routes_on_device`](Backend::routes_on_device) said yes): routes the one row of `logits`
    /// (`[1, num_experts]`, as [`Backend::route`]; `spec.trace` must be off), computes the chosen
    /// experts of `layer` from its held copies on the one row `x` (as
    /// [`Backend::glu_mlp_rows`]) and adds each output times its weight to `acc` (`[1, hidden]`)
    /// in ascending expert id, as [`moe::routed_experts`] does after the readback: the same
    /// arithmetic in the same order, so the result is bit-identical to that path's.
    #[allow(clippy::too_many_arguments)]
    fn routed_experts_held(
        &self,
        layer: usize,
        experts: &Mlp,
        act: Act,
        x: &Self::Tensor,
        logits: &Self::Tensor,
        spec: &RouterSpec,
        acc: &mut Self::Tensor,
    ) -> OpResult<()> {
        Err(self.missing("routed_experts_held"))
    }
    /// Allocates the backend's own expert cache from what memory is left (called once the
    /// weights and the KV cache are placed; later calls do nothing). Default: nothing to size.
    fn size_expert_cache(&self) -> OpResult<()> {
        Ok(())
    }

    // ---- data in and out -------------------------------------------------------------------

    /// A tensor `[data.len() / cols, cols]` holding `data` (small constants read at load).
    fn upload(&self, data: &[f32], cols: usize) -> OpResult<Self::Tensor> {
        Err(self.missing("upload"))
    }
    /// Zeros `[rows, cols]`.
    fn zeros(&self, rows: usize, cols: usize) -> OpResult<Self::Tensor> {
        Err(self.missing("zeros"))
    }
    /// A copy of `x`.
    fn copy(&self, x: &Self::Tensor) -> OpResult<Self::Tensor> {
        Err(self.missing("copy"))
    }
    /// The explicit readback: `x` as host floats, row-major.
    fn read(&self, x: &Self::Tensor) -> OpResult<Vec<f32>> {
        Err(self.missing("read"))
    }
    /// Whether every element of `x` is finite (a one-bit readback: the families check the
    /// residual stream once per chunk, so a NaN never turns silently into text).
    fn all_finite(&self, x: &Self::Tensor) -> OpResult<bool> {
        Err(self.missing("all_finite"))
    }
    /// Rows `rows` of `x`, in that order (`[rows.len(), cols]`).
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> OpResult<Self::Tensor> {
        Err(self.missing("gather_rows"))
    }
    /// Splits every row's groups of `group` columns into `parts` (which sum to `group`): part `j`
    /// of the result holds part `j` of every group, so `[T, n·group]` gives `[T, n·parts[j]]`.
    fn split(
        &self,
        x: &Self::Tensor,
        group: usize,
        parts: &[usize],
    ) -> OpResult<Vec<Self::Tensor>> {
        Err(self.missing("split"))
    }

    // ---- embedding and products ------------------------------------------------------------

    /// `[ids.len(), cols]` dequantized rows of the quantized `table`, times `scale` if given.
    fn embed(&self, table: &QRef, ids: &[u32], scale: Option<f32>) -> OpResult<Self::Tensor> {
        Err(self.missing("embed"))
    }
    /// `Y[T, w.rows] = X[T, w.cols] · Wᵀ` for each `w` (MLX affine 2/4/8-bit, group 32/64/128), one
    /// input shared by every product: decode GEMV for one row, prefill GEMM for more.
    fn matmul(&self, ws: &[&QRef], src: Weights, x: &Self::Tensor) -> OpResult<Vec<Self::Tensor>> {
        Err(self.missing("matmul"))
    }
    /// `Y[T, rows] = X[T, w.len / rows] · Wᵀ` for an unquantized resident BF16 matrix `w`
    /// (`[rows, cols]` row-major), accumulated in f32: a router kept in BF16 and scored in fp32
    /// (Maple's `mlp.gate.weight`, `router_dtype: fp32`).
    fn matmul_bf16(&self, w: &VRef, rows: usize, x: &Self::Tensor) -> OpResult<Self::Tensor> {
        Err(self.missing("matmul_bf16"))
    }
    /// `down(act(gate(x)) ⊙ up(x))`, `[T, down.rows]`.
    fn glu_mlp(
        &self,
        mlp: &Mlp,
        act: Act,
        src: Weights,
        x: &Self::Tensor,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("glu_mlp"))
    }
    /// Several experts of prefill rows: `glu_mlp(srcs[j], xs[j])` for each `j` (the rows routed to
    /// each expert, `[T_j, gate.cols]` each), `[T_j, down.rows]` each, bit for bit what
    /// [`Backend::glu_mlp`] gives, in one call so a backend can run them in a few launches
    /// (the routed-experts step passes the experts it holds, then each host tile's hits and
    /// misses). The default runs [`Backend::glu_mlp`] per expert.
    ///
    /// Errors: as [`Backend::glu_mlp`]; `srcs` and `xs` of different lengths.
    fn glu_mlp_experts(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        xs: &[&Self::Tensor],
    ) -> OpResult<Vec<Self::Tensor>> {
        check("glu_mlp_experts", srcs.len() == xs.len(), || {
            format!("{} sources for {} inputs", srcs.len(), xs.len())
        })?;
        srcs.iter()
            .zip(xs)
            .map(|(src, x)| self.glu_mlp(mlp, act, *src, x))
            .collect()
    }
    /// Several experts of one decode row: row `rows[j]` of `out` (`[n, down.rows]`) ←
    /// `glu_mlp(srcs[j], x)` for a one-row `x`; the rows are distinct and every other row of `out`
    /// is left as it was. The routed-experts step stacks a token's experts this way and adds them
    /// in expert order afterwards ([`Backend::scatter_add`]), so a backend can run all of them
    /// in a few launches. The default runs [`Backend::glu_mlp`] and [`Backend::set_rows`] per
    /// expert.
    fn glu_mlp_rows(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        x: &Self::Tensor,
        out: &mut Self::Tensor,
        rows: &[usize],
    ) -> OpResult<()> {
        check_glu_rows("glu_mlp_rows", mlp, srcs.len(), x, out, rows)?;
        for (src, &r) in srcs.iter().zip(rows) {
            let y = self.glu_mlp(mlp, act, *src, x)?;
            self.set_rows(out, r, &y)?;
        }
        Ok(())
    }
    /// The head of one row with a fused greedy argmax: `argmax_r (W x)_r` without materialising
    /// the logits (softcap is monotonic, so it does not change the index). The readback is the id
    /// and its raw logit (NaN when every logit is NaN).
    fn head_argmax(&self, w: &QRef, x: &Self::Tensor) -> OpResult<(u32, f32)> {
        Err(self.missing("head_argmax"))
    }

    // ---- norms and elementwise -------------------------------------------------------------

    /// RMSNorm of every `dim`-wide piece of each row (`dim = cols`: per row; `head_dim`: per head).
    fn rms_norm(&self, x: &mut Self::Tensor, dim: usize, norm: Norm, eps: f32) -> OpResult<()> {
        Err(self.missing("rms_norm"))
    }
    /// [`Backend::rms_norm`] into a new tensor, `x` unchanged (a block's pre-norm of the
    /// residual). The default copies `x` and normalises the copy; a backend may do both in one
    /// pass with the same arithmetic.
    fn rms_norm_to(
        &self,
        x: &Self::Tensor,
        dim: usize,
        norm: Norm,
        eps: f32,
    ) -> OpResult<Self::Tensor> {
        let mut y = self.copy(x)?;
        self.rms_norm(&mut y, dim, norm, eps)?;
        Ok(y)
    }
    /// `x ← (x + rms_norm(y)) · s` with `y` unchanged (a block's output post-norm added to the
    /// residual, scaled as [`Backend::add`]). The default is [`Backend::rms_norm_to`] then
    /// [`Backend::add`]; a backend may do both in one pass with the same arithmetic.
    fn add_rms_norm(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        dim: usize,
        norm: Norm,
        eps: f32,
        s: f32,
    ) -> OpResult<()> {
        let n = self.rms_norm_to(y, dim, norm, eps)?;
        self.add(x, &n, s)
    }
    /// [`Backend::add_rms_norm`] (`x ← (x + rms_norm(y, post)) · s`; `post = None`:
    /// [`Backend::add`], `x ← (x + y) · s`), then each of `pre` of the new `x` into a new tensor
    /// of its shape, all over pieces of `dim` with one `eps`: a block's output into the residual
    /// and the next blocks' input norms (Gemma 4's attention output and its router, shared-MLP
    /// and experts inputs). The default runs the ops one after the other; a backend may do them
    /// in one pass with the same arithmetic.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm_pre(
        &self,
        x: &mut Self::Tensor,
        y: &Self::Tensor,
        dim: usize,
        post: Option<Norm>,
        eps: f32,
        s: f32,
        pre: &[PreNorm],
    ) -> OpResult<Vec<Self::Tensor>> {
        match post {
            Some(post) => self.add_rms_norm(x, y, dim, post, eps, s)?,
            None => self.add(x, y, s)?,
        }
        pre.iter()
            .map(|p| {
                let mut n = self.rms_norm_to(x, dim, p.norm, eps)?;
                if let Some((w, c)) = p.cols {
                    self.mul_cols(&mut n, w, c)?;
                }
                Ok(n)
            })
            .collect()
    }
    /// [`Backend::rms_norm`] of every `head_dim` head, then [`Backend::rope`] from `pos0` (a
    /// per-head q/k norm before the rotation). The default runs the two; a backend may do both in
    /// one pass with the same arithmetic.
    fn rms_norm_rope(
        &self,
        x: &mut Self::Tensor,
        norm: Norm,
        eps: f32,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
    ) -> OpResult<()> {
        self.rms_norm(x, head_dim, norm, eps)?;
        self.rope(x, rope, head_dim, pos0)
    }
    /// Gated RMSNorm: `rms_norm(x)·w ⊙ silu(z)` per `dim` piece (`Qwen3NextRMSNormGated`).
    fn rms_norm_gated(
        &self,
        x: &mut Self::Tensor,
        dim: usize,
        w: &VRef,
        z: &Self::Tensor,
        eps: f32,
    ) -> OpResult<()> {
        Err(self.missing("rms_norm_gated"))
    }
    /// `x ← op(x)` elementwise.
    fn unary(&self, x: &mut Self::Tensor, op: Unary) -> OpResult<()> {
        Err(self.missing("unary"))
    }
    /// `x[r, i] ← x[r, i] · (w[i] · c)` (a per-column weight, e.g. Gemma's `router.scale`).
    fn mul_cols(&self, x: &mut Self::Tensor, w: &VRef, c: f32) -> OpResult<()> {
        Err(self.missing("mul_cols"))
    }
    /// `x ← x ⊙ sigmoid(g)`, same shapes (an output gate).
    fn mul_sigmoid(&self, x: &mut Self::Tensor, g: &Self::Tensor) -> OpResult<()> {
        Err(self.missing("mul_sigmoid"))
    }
    /// `x[r, :] ← x[r, :] · sigmoid(g[r])` for `g` `[rows, 1]` (a per-row gate).
    fn mul_rows_sigmoid(&self, x: &mut Self::Tensor, g: &Self::Tensor) -> OpResult<()> {
        Err(self.missing("mul_rows_sigmoid"))
    }
    /// `x ← (x + y) · s` (`s = 1`: the residual add).
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor, s: f32) -> OpResult<()> {
        Err(self.missing("add"))
    }
    /// `acc[row] += w · y[j]` for the `j`-th `(row, w)` of `rows` (the routed experts' combine).
    fn scatter_add(
        &self,
        acc: &mut Self::Tensor,
        y: &Self::Tensor,
        rows: &[(usize, f32)],
    ) -> OpResult<()> {
        Err(self.missing("scatter_add"))
    }

    // ---- attention -------------------------------------------------------------------------

    /// A KV layer of `rows` positions (`ring`: a sliding ring), rows `[n_kv_heads, head_dim]`.
    fn new_kv(
        &self,
        rows: usize,
        ring: bool,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> OpResult<Self::Kv> {
        Err(self.missing("new_kv"))
    }
    /// Rotates every `head_dim` head of row `r` of `x` by position `pos0 + r`.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
    ) -> OpResult<()> {
        Err(self.missing("rope"))
    }
    /// Stores row `r` of `k` and `v` (`[T, n_kv_heads·head_dim]`) at position `pos0 + r`.
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        pos0: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
    ) -> OpResult<()> {
        Err(self.missing("kv_write"))
    }
    /// An independent copy of `kv` (rows and contents), for a checkpoint of a sliding-window
    /// ring that later writes would overwrite.
    fn kv_clone(&self, kv: &Self::Kv) -> OpResult<Self::Kv> {
        let _ = kv;
        Err(self.missing("kv_clone"))
    }
    /// Causal attention of `q` (`[T, n_heads·head_dim]`, positions `pos0..`) over `kv`, which
    /// already holds those positions: `softmax(q·kᵀ·scale) v` per head, GQA by
    /// `n_heads / n_kv_heads`. Returns `[T, n_heads·head_dim]`.
    fn attention(
        &self,
        q: &Self::Tensor,
        kv: &Self::Kv,
        pos0: usize,
        shape: &AttnShape,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("attention"))
    }

    /// [`Backend::attention`] with a relative-position bias added to each logit after the scale,
    /// and on global layers the log position scale of the sum: per head
    /// `softmax(τ_p · (q·kᵀ·scale + bias))`. Operands: `bias.rel` `[T, n_heads · d_rel]`,
    /// `bias.proj` `[d_rel, extent]`. Returns `[T, n_heads·head_dim]`.
    fn attention_rel(
        &self,
        q: &Self::Tensor,
        kv: &Self::Kv,
        pos0: usize,
        shape: &AttnShape,
        bias: &RelBias<Self::Tensor>,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("attention_rel"))
    }

    // ---- recurrent state (linear attention, short convolutions) ----------------------------

    /// A zeroed state of `len` floats.
    fn new_state(&self, len: usize) -> OpResult<Self::State> {
        Err(self.missing("new_state"))
    }
    /// Zeroes a state.
    fn zero_state(&self, s: &mut Self::State) -> OpResult<()> {
        Err(self.missing("zero_state"))
    }
    /// Bytes a state holds.
    fn state_bytes(&self, s: &Self::State) -> usize {
        0
    }
    /// Depthwise causal conv over rows of `x` (`[T, C]`) continuing `state` (`[kernel-1, C]`, the
    /// last pre-conv rows), then SiLU; `w` is `[C, kernel]`. Updates `state`.
    fn conv1d_silu(
        &self,
        x: &Self::Tensor,
        state: &mut Self::State,
        w: &Self::Tensor,
        kernel: usize,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("conv1d_silu"))
    }
    /// [`Backend::conv1d_silu`] without the activation: the depthwise causal conv alone (Inkling's
    /// short convolutions, which add it to their input). Updates `state`.
    fn conv1d(
        &self,
        x: &Self::Tensor,
        state: &mut Self::State,
        w: &Self::Tensor,
        kernel: usize,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("conv1d"))
    }
    /// Gated DeltaNet's per-head gates from `b`, `alpha` (`[T, n_v_heads]`), `a = exp(A_log)` and
    /// `dt_bias` (`[1, n_v_heads]`): `(β = sigmoid(b), decay = exp(−a·softplus(α + dt_bias)))`.
    fn delta_gates(
        &self,
        b: &Self::Tensor,
        alpha: &Self::Tensor,
        a: &Self::Tensor,
        dt_bias: &Self::Tensor,
    ) -> OpResult<(Self::Tensor, Self::Tensor)> {
        Err(self.missing("delta_gates"))
    }
    /// The gated delta rule over the rows (`S ← g·S; u = (v − S·k)·β; S ← S + u ⊗ k; o = S·q`),
    /// `state` `[n_v_heads, head_v_dim, head_k_dim]`. Returns `[T, n_v_heads·head_v_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        decay: &Self::Tensor,
        beta: &Self::Tensor,
        state: &mut Self::State,
        shape: &DeltaShape,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("gated_delta_rule"))
    }

    // ---- DeepSeek-V4: dense products, row writes, hyper-connections, compressed attention ----

    /// `Y[T, w.rows] = X[T, w.cols] · Wᵀ` with an f32 weight held by the backend (`w` uploaded
    /// once at load: an unquantized router, a hyper-connection projection).
    fn linear(&self, x: &Self::Tensor, w: &Self::Tensor) -> OpResult<Self::Tensor> {
        Err(self.missing("linear"))
    }
    /// `dst[row0 + r] ← src[r]` for every row of `src` (same column count; the rows must fit).
    fn set_rows(&self, dst: &mut Self::Tensor, row0: usize, src: &Self::Tensor) -> OpResult<()> {
        Err(self.missing("set_rows"))
    }
    /// Rotates every `head_dim` head of row `r` of `x` by position `positions[r]` (compressed
    /// entries sit at `rate · w`, not at consecutive positions).
    fn rope_at(
        &self,
        x: &mut Self::Tensor,
        rope: &Rope,
        head_dim: usize,
        positions: &[usize],
    ) -> OpResult<()> {
        Err(self.missing("rope_at"))
    }
    /// `Y[T, G·R] = X[T, G·C] · blockdiag(W_0 … W_{G-1})ᵀ` where `w` is `[G·R, C]` and group `g`
    /// takes rows `g·R..` of `w` and columns `g·C..` of `x` (DeepSeek-V4's grouped `wo_a`).
    fn matmul_grouped(
        &self,
        w: &QRef,
        groups: usize,
        src: Weights,
        x: &Self::Tensor,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("matmul_grouped"))
    }
    /// The entry of an mHC site over `x` (`[T, n·D]`, `n = spec.streams`): `m = f · rms(x)`
    /// (weightless RMSNorm over all `n·D`, `f` `[rows_f, n·D]`), then `pre = σ(m_pre·scale₀ +
    /// base_pre) + hc_eps` and the collapsed block input `Σ_j pre_j x_j` `[T, D]`. With
    /// `rows_f = (2 + n)·n` also `post = 2σ(m_post·scale₁ + base_post)` `[T, n]` and the comb
    /// matrix `[T, n·n]` (row-major `C[j][k]`): `softmax_k(m_comb·scale₂ + base_comb) + hc_eps`,
    /// column-normalised, then `sinkhorn_iters − 1` rounds of row- then column-normalisation, each
    /// denominator `+ hc_eps`. With `rows_f = n` (the final `hc_head`) only the collapse.
    #[allow(clippy::type_complexity)]
    fn hc_pre(
        &self,
        x: &Self::Tensor,
        f: &Self::Tensor,
        base: &[f32],
        scale: &[f32],
        spec: &HcSpec,
    ) -> OpResult<(Self::Tensor, Option<(Self::Tensor, Self::Tensor)>)> {
        Err(self.missing("hc_pre"))
    }
    /// The exit of an mHC site: `x'_k = post_k · out + Σ_j C[j][k] · x_j` for `x` `[T, n·D]`,
    /// `out` `[T, D]`, `post` `[T, n]`, `comb` `[T, n·n]`. Returns `[T, n·D]`.
    fn hc_post(
        &self,
        x: &Self::Tensor,
        out: &Self::Tensor,
        post: &Self::Tensor,
        comb: &Self::Tensor,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("hc_post"))
    }
    /// Softmax-gated pooling of `rate`-row windows (DeepSeek-V4's KV compressor): `kv`, `gate`
    /// `[W·rate, c·D]` (`c = 2` with `overlap`, else 1), `ape` `[rate, c·D]` added to the gate rows
    /// of each window. Without overlap entry `w = Σ_i softmax_i(g_i) ⊙ kv_i` over the window's rows,
    /// per channel. With overlap the `2·rate` slots of entry `w` are the first `D` columns (Ca) of
    /// window `w − 1` and the last `D` (Cb) of window `w`; window 0's Ca slots come from `prior`
    /// (`(kv, gate + ape)` of the previous window's Ca, `[rate, D]` each) or take no weight.
    /// Returns `[W, D]`.
    fn compress_pool(
        &self,
        kv: &Self::Tensor,
        gate: &Self::Tensor,
        ape: &Self::Tensor,
        rate: usize,
        overlap: bool,
        prior: Option<(&Self::Tensor, &Self::Tensor)>,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("compress_pool"))
    }
    /// [`Backend::attention`] over `kv` with more keys: row `r` of `q` also attends to the rows
    /// `visible[r]` of `entries` (`[N, n_kv_heads·head_dim]`, K = V), one softmax over both sets
    /// (and the sink). Returns `[T, n_heads·head_dim]`.
    fn attention_sparse(
        &self,
        q: &Self::Tensor,
        kv: &Self::Kv,
        pos0: usize,
        shape: &AttnShape,
        entries: &Self::Tensor,
        visible: &[Vec<usize>],
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("attention_sparse"))
    }
    /// The Lightning indexer's selection, read back: for row `r` the scores of entries
    /// `0..visible[r]` of `keys` (`[N, head_dim]`) are `Σ_h weights[r, h] · relu(q[r, h] · key)`
    /// (`q` `[T, n_heads·head_dim]`, `weights` `[T, n_heads]`, scaling folded in by the caller); the
    /// `min(top_k, visible[r])` best are kept (ties to the lower entry), returned ascending.
    fn index_top_k(
        &self,
        q: &Self::Tensor,
        keys: &Self::Tensor,
        weights: &Self::Tensor,
        n_heads: usize,
        visible: &[usize],
        top_k: usize,
    ) -> OpResult<Vec<Vec<usize>>> {
        Err(self.missing("index_top_k"))
    }

    // ---- router ----------------------------------------------------------------------------

    /// Scores `logits` (`[T, num_experts]`), picks each row's top-k (ties to the lower id) and
    /// reads back only the chosen ids and weights: the one place per layer where the host sees
    /// data, to plan the expert cache.
    fn route(&self, logits: &Self::Tensor, spec: &RouterSpec) -> OpResult<Routes> {
        Err(self.missing("route"))
    }
    /// [`Backend::route`] for a [`SinkRouter`]: `spec` gives top-k, trace (the k-th minus the
    /// (k+1)-th selection score) and forced ids (`per_expert_scale` must be `None`). The routes
    /// hold the chosen routed experts and, as ids `n_routed + s`, every row of each shared expert
    /// with its weight.
    fn route_sinks(
        &self,
        logits: &Self::Tensor,
        router: &SinkRouter<Self::Tensor>,
        spec: &RouterSpec,
    ) -> OpResult<Routes> {
        Err(self.missing("route_sinks"))
    }
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

/// The operand check of [`Backend::glu_mlp_rows`] shared by the backends: `x` one row of the
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
