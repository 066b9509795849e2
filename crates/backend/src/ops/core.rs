//! The core ops: what every family's forward is made of (data in and out, quantized and dense
//! products, the GLU MLP, norms and elementwise maps, RoPE and attention over a backend-owned KV
//! cache, the router), and the backend's associated types, name and capability answer.

use super::Op;
use crate::{
    check, check_glu_combine, check_glu_rows, Act, AttnShape, KvDtype, KvState, Mlp, Norm, OpError,
    OpResult, PreNorm, QRef, Rope, RouterSpec, Routes, Tensor, Unary, VRef, Weights,
};

/// The ops every family uses, and what the other groups build on: the backend's buffer types,
/// its name and [`CoreOps::supports`]. Every op that a backend may lack has a default body that
/// fails with [`OpError::Missing`] naming it (the name of its [`Op`]).
///
/// Numerics: each op of the CPU backend computes exactly what its [`crate::reference`] twin
/// computes up to f32 summation order (the kernels' documented budgets); the op harness
/// ([`crate::harness`]) checks every op of every backend compiled in against it.
#[allow(unused_variables)]
pub trait CoreOps: Send + Sync + Sized {
    /// Activations `[rows, cols]` f32.
    type Tensor: Tensor;
    /// One attention layer's K and V rows (FP16 or FP32; a sliding ring or linear).
    type Kv: KvState + Send;
    /// A recurrent state vector (f32): a conv tail, a DeltaNet state.
    type State: Clone + Send;

    /// Short description: `cpu avx512 ×2`.
    fn name(&self) -> String;

    /// What runs this backend's products, for reports: a CPU kernel table's name (`amx`,
    /// `avx512`), or `cuda` for the CUDA backend's own kernels.
    fn kernels(&self) -> &'static str;

    /// Whether this backend implements `op` (ggml's `supports_op`): static per backend type, so a
    /// loader asks before any device context, buffer or weight exists. `false` exactly when the
    /// op fails with [`OpError::Missing`] naming [`Op::name`]; the op harness checks the two agree.
    fn supports(op: Op) -> bool;

    #[doc(hidden)]
    fn missing(&self, op: &'static str) -> OpError {
        OpError::Missing {
            backend: self.name(),
            op,
        }
    }

    // ---- data in and out ----------------------------------------------------------------

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
    /// [`CoreOps::read`] of each of `xs`, in one call so a backend can read them back with one
    /// device synchronisation (Maple's FlashHead reads its 512 probed clusters' logits this way).
    /// The default reads them one by one.
    fn read_many(&self, xs: &[&Self::Tensor]) -> OpResult<Vec<Vec<f32>>> {
        xs.iter().map(|x| self.read(x)).collect()
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
    /// [`CoreOps::gather_rows`] for each list of `rows` (the rows routed to each expert of a
    /// prefill chunk), in one call so a backend can gather them in one launch. The default
    /// gathers list by list.
    fn gather_rows_many(&self, x: &Self::Tensor, rows: &[&[usize]]) -> OpResult<Vec<Self::Tensor>> {
        rows.iter().map(|r| self.gather_rows(x, r)).collect()
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
    /// `dst[row0 + r] ← src[r]` for every row of `src` (same column count; the rows must fit).
    fn set_rows(&self, dst: &mut Self::Tensor, row0: usize, src: &Self::Tensor) -> OpResult<()> {
        Err(self.missing("set_rows"))
    }

    // ---- embedding and products ---------------------------------------------------------

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
    /// `Y[T, w.rows] = X[T, w.cols] · Wᵀ` with an f32 weight held by the backend (`w` uploaded
    /// once at load: an unquantized router, a hyper-connection projection).
    fn linear(&self, x: &Self::Tensor, w: &Self::Tensor) -> OpResult<Self::Tensor> {
        Err(self.missing("linear"))
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
    /// [`CoreOps::glu_mlp`] gives, in one call so a backend can run them in a few launches
    /// (the routed-experts step passes the experts it holds, then each host tile's hits and
    /// misses). The default runs [`CoreOps::glu_mlp`] per expert.
    ///
    /// Errors: as [`CoreOps::glu_mlp`]; `srcs` and `xs` of different lengths.
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
    /// in expert order afterwards ([`CoreOps::scatter_add`]), so a backend can run all of them
    /// in a few launches. The default runs [`CoreOps::glu_mlp`] and [`CoreOps::set_rows`] per
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
    /// One decode row's routed experts, combined: `acc ← acc + Σ_j weights[j] · glu_mlp(srcs[j],
    /// x)` for a one-row `x` and `acc` (`[1, down.rows]`), the terms added one after the other in
    /// `j` order (the routed-experts step passes the experts in ascending id). Bit for bit
    /// [`CoreOps::glu_mlp_rows`] into a stack then [`CoreOps::scatter_add`], which the default
    /// runs; a backend with its own expert cache does it in two launches (gate and up with the
    /// GLU, then down with the weighted sum), so the decode step calls it once, after every
    /// expert's bytes are placed.
    ///
    /// Errors: as [`CoreOps::glu_mlp_rows`]; `srcs` and `weights` of different lengths, `acc` not
    /// `[1, down.rows]`.
    fn glu_mlp_combine(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        weights: &[f32],
        x: &Self::Tensor,
        acc: &mut Self::Tensor,
    ) -> OpResult<()> {
        check_glu_combine("glu_mlp_combine", mlp, srcs.len(), weights.len(), x, acc)?;
        if srcs.is_empty() {
            return Ok(());
        }
        let mut stack = self.zeros(srcs.len(), acc.cols())?;
        let rows: Vec<usize> = (0..srcs.len()).collect();
        self.glu_mlp_rows(mlp, act, srcs, x, &mut stack, &rows)?;
        let pairs: Vec<(usize, f32)> = weights.iter().map(|&w| (0, w)).collect();
        self.scatter_add(acc, &stack, &pairs)
    }
    /// The head of one row with a fused greedy argmax: `argmax_r (W x)_r` without materialising
    /// the logits (softcap is monotonic, so it does not change the index). The readback is the id
    /// and its raw logit (NaN when every logit is NaN).
    fn head_argmax(&self, w: &QRef, x: &Self::Tensor) -> OpResult<(u32, f32)> {
        Err(self.missing("head_argmax"))
    }

    // ---- norms and elementwise ----------------------------------------------------------

    /// RMSNorm of every `dim`-wide piece of each row (`dim = cols`: per row; `head_dim`: per head).
    fn rms_norm(&self, x: &mut Self::Tensor, dim: usize, norm: Norm, eps: f32) -> OpResult<()> {
        Err(self.missing("rms_norm"))
    }
    /// [`CoreOps::rms_norm`] into a new tensor, `x` unchanged (a block's pre-norm of the
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
    /// residual, scaled as [`CoreOps::add`]). The default is [`CoreOps::rms_norm_to`] then
    /// [`CoreOps::add`]; a backend may do both in one pass with the same arithmetic.
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
    /// [`CoreOps::add_rms_norm`] (`x ← (x + rms_norm(y, post)) · s`; `post = None`:
    /// [`CoreOps::add`], `x ← (x + y) · s`), then each of `pre` of the new `x` into a new tensor
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
    /// Two block outputs normed, summed and added into the residual: `a ← rms_norm(a, a_norm) +
    /// rms_norm(b, b_norm)` (Gemma 4's shared MLP and routed experts, each with its own
    /// post-norm), then [`CoreOps::add_rms_norm_pre`] of `x` by the new `a` (the MLP block's
    /// post-norm, the layer scalar, the next layer's input norm), all over pieces of `dim` with
    /// one `eps`. The default runs [`CoreOps::rms_norm`], [`CoreOps::add_rms_norm`] (scale 1)
    /// and [`CoreOps::add_rms_norm_pre`]; a backend may do them in one pass with the same
    /// arithmetic.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm2_pre(
        &self,
        x: &mut Self::Tensor,
        a: &mut Self::Tensor,
        a_norm: Norm,
        b: &Self::Tensor,
        b_norm: Norm,
        dim: usize,
        post: Option<Norm>,
        eps: f32,
        s: f32,
        pre: &[PreNorm],
    ) -> OpResult<Vec<Self::Tensor>> {
        self.rms_norm(a, dim, a_norm, eps)?;
        self.add_rms_norm(a, b, dim, b_norm, eps, 1.0)?;
        self.add_rms_norm_pre(x, a, dim, post, eps, s, pre)
    }
    /// [`CoreOps::rms_norm`] of every `head_dim` head, then [`CoreOps::rope`] from `pos0` (a
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
    /// A layer's attention inputs into its KV cache: [`CoreOps::rms_norm_rope`] of `q` and of
    /// `k` (per `head_dim` head, each by its own norm, the same `rope` from `pos0`), `v ←
    /// rms_norm(v)` per head by `v_norm` (`None`: `v` as it is), then [`CoreOps::kv_write`] of
    /// `k` and `v` at `pos0`. The default runs those ops; a backend may do them in one launch
    /// (the same values up to the norms' summation order).
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_rope_kv(
        &self,
        q: &mut Self::Tensor,
        q_norm: Norm,
        k: &mut Self::Tensor,
        k_norm: Norm,
        v: &mut Self::Tensor,
        v_norm: Option<Norm>,
        eps: f32,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
        kv: &mut Self::Kv,
    ) -> OpResult<()> {
        self.rms_norm_rope(q, q_norm, eps, rope, head_dim, pos0)?;
        self.rms_norm_rope(k, k_norm, eps, rope, head_dim, pos0)?;
        if let Some(n) = v_norm {
            self.rms_norm(v, head_dim, n, eps)?;
        }
        self.kv_write(kv, pos0, k, v)
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

    /// [`CoreOps::scatter_add`] of `ys[j]` by `rows[j]` for each `j` in order (the routed
    /// experts' combine, in expert order), in one call so a backend can add every expert's rows in
    /// one launch. A backend's result is bit for bit its `scatter_add`s in that order: each
    /// element of `acc` gets its terms added one by one in the order of `j`. The default calls
    /// `scatter_add` per `j`.
    ///
    /// Errors: as [`CoreOps::scatter_add`]; `ys` and `rows` of different lengths.
    fn scatter_add_many(
        &self,
        acc: &mut Self::Tensor,
        ys: &[&Self::Tensor],
        rows: &[&[(usize, f32)]],
    ) -> OpResult<()> {
        check("scatter_add_many", ys.len() == rows.len(), || {
            format!("{} outputs for {} row lists", ys.len(), rows.len())
        })?;
        for (y, r) in ys.iter().zip(rows) {
            self.scatter_add(acc, y, r)?;
        }
        Ok(())
    }

    // ---- attention ----------------------------------------------------------------------

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

    // ---- router -------------------------------------------------------------------------

    /// Scores `logits` (`[T, num_experts]`), picks each row's top-k (ties to the lower id) and
    /// reads back only the chosen ids and weights: the one place per layer where the host sees
    /// data, to plan the expert cache.
    fn route(&self, logits: &Self::Tensor, spec: &RouterSpec) -> OpResult<Routes> {
        Err(self.missing("route"))
    }
}
