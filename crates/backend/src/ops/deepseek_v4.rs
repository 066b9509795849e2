//! DeepSeek-V4's ops: RoPE at given positions, the grouped output product, the manifold-constrained
//! hyper-connections (mHC), the KV compressor's window pooling, attention over compressed entries
//! and the Lightning indexer's top-k.

use super::CoreOps;
use crate::{AttnShape, HcSpec, OpResult, QRef, Rope, Weights};

/// DeepSeek-V4-Flash's own ops (`reference` twins in [`crate::reference`]): its router's
/// sqrt-softplus scoring is a mode of [`CoreOps::route`] ([`super::Op::RouteSqrtSoftplus`]).
#[allow(unused_variables)]
pub trait DeepSeekV4Ops: CoreOps {
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
    /// [`CoreOps::attention`] over `kv` with more keys: row `r` of `q` also attends to the rows
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
}
