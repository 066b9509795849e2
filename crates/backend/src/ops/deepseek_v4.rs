//! DeepSeek-V4's ops: RoPE at given positions, the grouped output product, the manifold-constrained
//! hyper-connections (mHC), the KV compressor's window pooling, attention over compressed entries
//! and the Lightning indexer's top-k.

use super::CoreOps;
use crate::{check, AttnShape, HcSpec, OpResult, QRef, Rope, Tensor, Weights};

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

/// The operand checks of DeepSeek-V4's ops shared by the backends (each backend may add its own
/// limits).
pub mod checks {
    use super::*;

    /// [`DeepSeekV4Ops::matmul_grouped`]: `groups` blocks of `w` over rows of `groups · w.cols`.
    pub fn matmul_grouped<T: Tensor>(w: &QRef, groups: usize, x: &T) -> OpResult<()> {
        check(
            "matmul_grouped",
            groups > 0 && w.rows.is_multiple_of(groups) && x.cols() == groups * w.cols,
            || {
                format!(
                    "{groups} groups of [{}, {}] over rows of {}",
                    w.rows,
                    w.cols,
                    x.cols()
                )
            },
        )
    }

    /// [`DeepSeekV4Ops::hc_pre`]: `f` `[n or (2 + n)·n, x.cols]`, `base` one per mix, `scale` 1 or
    /// 3 values, at most `max_streams` streams.
    pub fn hc_pre<T: Tensor>(
        x: &T,
        f: &T,
        base: &[f32],
        scale: &[f32],
        spec: &HcSpec,
        max_streams: usize,
    ) -> OpResult<()> {
        let (n, m) = (spec.streams, f.rows());
        check(
            "hc_pre",
            (1..=max_streams).contains(&n)
                && x.cols().is_multiple_of(n)
                && f.cols() == x.cols()
                && (m == n || m == (2 + n) * n)
                && base.len() == m
                && scale.len() == if m == n { 1 } else { 3 },
            || {
                format!(
                    "{n} streams (at most {max_streams}) of rows of {}, projection [{m}, {}]",
                    x.cols(),
                    f.cols()
                )
            },
        )
    }

    /// [`DeepSeekV4Ops::hc_post`]: `x` `[T, n·D]`, `out` `[T, D]`, `post` `[T, n]`, `comb`
    /// `[T, n·n]`.
    pub fn hc_post<T: Tensor>(x: &T, out: &T, post: &T, comb: &T) -> OpResult<()> {
        let (n, t, d) = (post.cols(), out.rows(), out.cols());
        check(
            "hc_post",
            x.cols() == n * d
                && x.rows() == t
                && post.rows() == t
                && comb.cols() == n * n
                && comb.rows() == t,
            || {
                format!(
                    "streams [{t}, {}] for an output [{t}, {d}] and {n} streams",
                    x.cols()
                )
            },
        )
    }

    /// [`DeepSeekV4Ops::compress_pool`]: `kv` and `gate` of one shape, whole windows, `ape`
    /// `[rate, width]`, a prior `[rate, width / 2]` only with overlap.
    pub fn compress_pool<T: Tensor>(
        kv: &T,
        gate: &T,
        ape: &T,
        rate: usize,
        overlap: bool,
        prior: Option<(&T, &T)>,
    ) -> OpResult<()> {
        let w = kv.cols();
        let d = if overlap { w / 2 } else { w };
        check(
            "compress_pool",
            gate.rows() == kv.rows()
                && gate.cols() == w
                && rate > 0
                && kv.rows().is_multiple_of(rate)
                && (!overlap || w.is_multiple_of(2))
                && ape.cols() == w
                && ape.rows() == rate
                && prior.is_none_or(|(k, g)| {
                    overlap
                        && k.cols() == d
                        && g.cols() == d
                        && k.rows() == rate
                        && g.rows() == rate
                }),
            || {
                format!(
                    "windows of {rate} rows of {w} (overlap {overlap}; gate [{}, {}], ape [{}, \
                     {}])",
                    gate.rows(),
                    gate.cols(),
                    ape.rows(),
                    ape.cols()
                )
            },
        )
    }
}
