//! The op-layer traits of [`CudaBackend`]: the core group delegates each op to its module under
//! `ops/` (same name); the recurrent ops are in `ops/recurrent.rs`, the expert-cache hooks in
//! `device_experts.rs`, Inkling's and DeepSeek-V4's groups in `ops/inkling.rs` and
//! `ops/deepseek_v4.rs`.

use crate::*;

impl CoreOps for CudaBackend {
    type Tensor = CudaTensor;
    type Kv = CudaKv;
    type State = CudaState;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn kernels(&self) -> &'static str {
        "cuda"
    }

    /// What the kernels of `ops/` cover: every op of every group.
    fn supports(_op: Op) -> bool {
        true
    }

    fn upload(&self, data: &[f32], cols: usize) -> OpResult<CudaTensor> {
        self.upload(data, cols)
    }

    fn zeros(&self, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        self.zeros(rows, cols)
    }

    fn copy(&self, x: &CudaTensor) -> OpResult<CudaTensor> {
        self.copy(x)
    }

    fn read(&self, x: &CudaTensor) -> OpResult<Vec<f32>> {
        self.read(x)
    }

    fn read_many(&self, xs: &[&CudaTensor]) -> OpResult<Vec<Vec<f32>>> {
        self.read_many(xs)
    }

    fn all_finite(&self, x: &CudaTensor) -> OpResult<bool> {
        self.all_finite(x)
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> OpResult<CudaTensor> {
        self.gather_rows(x, rows)
    }

    fn gather_rows_many(&self, x: &CudaTensor, rows: &[&[usize]]) -> OpResult<Vec<CudaTensor>> {
        self.gather_rows_many(x, rows)
    }

    fn split(&self, x: &CudaTensor, group: usize, parts: &[usize]) -> OpResult<Vec<CudaTensor>> {
        self.split(x, group, parts)
    }

    fn embed(&self, table: &QRef, ids: &[u32], scale: Option<f32>) -> OpResult<CudaTensor> {
        self.embed(table, ids, scale)
    }

    fn matmul(&self, ws: &[&QRef], src: Weights, x: &CudaTensor) -> OpResult<Vec<CudaTensor>> {
        self.matmul(ws, src, x)
    }

    fn matmul_bf16(&self, w: &VRef, rows: usize, x: &CudaTensor) -> OpResult<CudaTensor> {
        self.matmul_bf16(w, rows, x)
    }

    fn linear(&self, x: &CudaTensor, w: &CudaTensor) -> OpResult<CudaTensor> {
        self.linear(x, w)
    }

    fn set_rows(&self, dst: &mut CudaTensor, row0: usize, src: &CudaTensor) -> OpResult<()> {
        self.set_rows(dst, row0, src)
    }

    fn glu_mlp(&self, mlp: &Mlp, act: Act, src: Weights, x: &CudaTensor) -> OpResult<CudaTensor> {
        self.glu_mlp(mlp, act, src, x)
    }

    fn glu_mlp_experts(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        xs: &[&CudaTensor],
    ) -> OpResult<Vec<CudaTensor>> {
        self.glu_mlp_experts(mlp, act, srcs, xs)
    }

    fn glu_mlp_rows(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        x: &CudaTensor,
        out: &mut CudaTensor,
        rows: &[usize],
    ) -> OpResult<()> {
        self.glu_mlp_rows(mlp, act, srcs, x, out, rows)
    }

    fn glu_mlp_combine(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        weights: &[f32],
        x: &CudaTensor,
        acc: &mut CudaTensor,
    ) -> OpResult<()> {
        CudaBackend::glu_mlp_combine(self, mlp, act, srcs, weights, x, acc)
    }

    fn head_argmax(&self, w: &QRef, x: &CudaTensor) -> OpResult<(u32, f32)> {
        self.head_argmax(w, x)
    }

    fn rms_norm(&self, x: &mut CudaTensor, dim: usize, norm: Norm, eps: f32) -> OpResult<()> {
        self.rms_norm(x, dim, norm, eps)
    }

    fn rms_norm_to(
        &self,
        x: &CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
    ) -> OpResult<CudaTensor> {
        self.rms_norm_to(x, dim, norm, eps)
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
        s: f32,
    ) -> OpResult<()> {
        self.add_rms_norm(x, y, dim, norm, eps, s)
    }

    fn add_rms_norm_pre(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        dim: usize,
        post: Option<Norm>,
        eps: f32,
        s: f32,
        pre: &[PreNorm],
    ) -> OpResult<Vec<CudaTensor>> {
        self.add_rms_norm_pre(x, y, dim, post, eps, s, pre)
    }

    fn add_rms_norm2_pre(
        &self,
        x: &mut CudaTensor,
        a: &mut CudaTensor,
        a_norm: Norm,
        b: &CudaTensor,
        b_norm: Norm,
        dim: usize,
        post: Option<Norm>,
        eps: f32,
        s: f32,
        pre: &[PreNorm],
    ) -> OpResult<Vec<CudaTensor>> {
        CudaBackend::add_rms_norm2_pre(self, x, a, a_norm, b, b_norm, dim, post, eps, s, pre)
    }

    fn rms_norm_rope(
        &self,
        x: &mut CudaTensor,
        norm: Norm,
        eps: f32,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
    ) -> OpResult<()> {
        self.rms_norm_rope(x, norm, eps, rope, head_dim, pos0)
    }

    fn rms_norm_rope_kv(
        &self,
        q: &mut CudaTensor,
        q_norm: Norm,
        k: &mut CudaTensor,
        k_norm: Norm,
        v: &mut CudaTensor,
        v_norm: Option<Norm>,
        eps: f32,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
        kv: &mut CudaKv,
    ) -> OpResult<()> {
        CudaBackend::rms_norm_rope_kv(
            self, q, q_norm, k, k_norm, v, v_norm, eps, rope, head_dim, pos0, kv,
        )
    }

    fn unary(&self, x: &mut CudaTensor, op: Unary) -> OpResult<()> {
        self.unary(x, op)
    }

    fn mul_cols(&self, x: &mut CudaTensor, w: &VRef, c: f32) -> OpResult<()> {
        self.mul_cols(x, w, c)
    }

    fn mul_sigmoid(&self, x: &mut CudaTensor, g: &CudaTensor) -> OpResult<()> {
        self.mul_sigmoid(x, g)
    }

    fn mul_rows_sigmoid(&self, x: &mut CudaTensor, g: &CudaTensor) -> OpResult<()> {
        self.mul_rows_sigmoid(x, g)
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor, s: f32) -> OpResult<()> {
        self.add(x, y, s)
    }

    fn scatter_add(
        &self,
        acc: &mut CudaTensor,
        y: &CudaTensor,
        rows: &[(usize, f32)],
    ) -> OpResult<()> {
        self.scatter_add(acc, y, rows)
    }

    fn scatter_add_many(
        &self,
        acc: &mut CudaTensor,
        ys: &[&CudaTensor],
        rows: &[&[(usize, f32)]],
    ) -> OpResult<()> {
        self.scatter_add_many(acc, ys, rows)
    }

    fn new_kv(
        &self,
        rows: usize,
        ring: bool,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> OpResult<CudaKv> {
        self.new_kv(rows, ring, n_kv_heads, head_dim, dtype)
    }

    fn rope(&self, x: &mut CudaTensor, rope: &Rope, head_dim: usize, pos0: usize) -> OpResult<()> {
        self.rope(x, rope, head_dim, pos0)
    }

    fn kv_write(
        &self,
        kv: &mut CudaKv,
        pos0: usize,
        k: &CudaTensor,
        v: &CudaTensor,
    ) -> OpResult<()> {
        self.kv_write(kv, pos0, k, v)
    }

    fn kv_clone(&self, kv: &CudaKv) -> OpResult<CudaKv> {
        self.kv_clone(kv)
    }

    fn attention(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        pos0: usize,
        s: &AttnShape,
    ) -> OpResult<CudaTensor> {
        self.attention(q, kv, pos0, s)
    }

    fn route(&self, logits: &CudaTensor, spec: &RouterSpec) -> OpResult<Routes> {
        self.route(logits, spec)
    }
}
