//! The CPU backend: activations in host `Vec<f32>`, quantized products through the kernel table
//! (`mference-kernels`, picked once at startup) on the persistent worker pool, KV in
//! [`mference_runtime::KvLayer`], recurrent state in `Vec<f32>`. Resident weights are read in place
//! from the mapped `model_weights.bin`; expert weights from the streamer's slot blobs.

mod dsv4;
pub mod ops;

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;

use mference_kernels::{Kernels, MatJob, PairJob, PreparedX, QMatrix, ThreadPool};
use mference_runtime::{KvDtype, KvLayer};

use crate::{
    check, check_forced, check_glu_rows, check_mlp, Act, AttnShape, Backend, DeltaShape, HcSpec,
    Mlp, Norm, OpResult, QRef, RelBias, Rope, RouterSpec, Routes, Scoring, SinkRouter, Tensor,
    Unary, VRef, Weights,
};

/// Resident bytes the backend reads weights from (the mapped `model_weights.bin`, or any buffer
/// in that layout: the op harness uses a `Vec<u8>`).
pub type ResidentBytes = Arc<dyn Deref<Target = [u8]> + Send + Sync>;

/// Activations `[rows, cols]` in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTensor {
    data: Vec<f32>,
    cols: usize,
}

impl CpuTensor {
    fn new(data: Vec<f32>, cols: usize) -> Self {
        debug_assert!(cols > 0 && data.len().is_multiple_of(cols));
        Self { data, cols }
    }
}

impl Tensor for CpuTensor {
    fn rows(&self) -> usize {
        self.data.len() / self.cols
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

/// The CPU backend: a kernel table, a worker pool and the resident bytes.
pub struct CpuBackend {
    kernels: &'static Kernels,
    pool: ThreadPool,
    resident: ResidentBytes,
}

impl CpuBackend {
    /// A backend running `kernels` on `threads` threads (the caller counts as one) over `resident`.
    pub fn new(kernels: &'static Kernels, threads: usize, resident: ResidentBytes) -> Self {
        Self {
            kernels,
            pool: ThreadPool::new(threads.max(1)),
            resident,
        }
    }

    /// The kernel table.
    pub fn kernels(&self) -> &'static Kernels {
        self.kernels
    }

    /// Worker threads, the caller included.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn buf<'a>(&'a self, src: Weights<'a>) -> &'a [u8] {
        match src {
            Weights::Resident => &self.resident,
            Weights::Blob(b) => b,
            // The CPU holds no experts of its own (`held_experts` is the default): nothing
            // lies there, so every matrix range check fails with its shape.
            Weights::Held { .. } => &[],
        }
    }

    /// Several products of the same rows `x` in one parallel region, `x` prepared once per
    /// quantization layout (bit-identical to one product at a time).
    fn products(&self, mats: &[QMatrix], x: &[f32], t: usize) -> Vec<Vec<f32>> {
        self.batched_products(&[(mats, x, t)])
            .pop()
            .expect("one group")
    }

    /// [`CpuBackend::products`] of several inputs in one parallel region: group `i` is
    /// `(matrices, rows x [t, cols], t)` and gets one output per matrix (bit-identical to one
    /// product at a time).
    fn batched_products(&self, groups: &[(&[QMatrix], &[f32], usize)]) -> Vec<Vec<Vec<f32>>> {
        let k = self.kernels;
        let layouts: Vec<Vec<((usize, u32), PreparedX)>> = groups
            .iter()
            .map(|&(mats, x, t)| {
                let mut layouts: Vec<((usize, u32), PreparedX)> = Vec::new();
                for m in mats {
                    let key = (m.group_size, m.bits);
                    if !layouts.iter().any(|(l, _)| *l == key) {
                        layouts.push((key, k.prepare(m, x, t)));
                    }
                }
                layouts
            })
            .collect();
        let mut ys: Vec<Vec<Vec<f32>>> = groups
            .iter()
            .map(|&(mats, _, t)| mats.iter().map(|m| vec![0.0f32; t * m.rows]).collect())
            .collect();
        let mut jobs: Vec<MatJob> = Vec::new();
        for ((&(mats, _, _), ys), layouts) in groups.iter().zip(ys.iter_mut()).zip(&layouts) {
            for (m, y) in mats.iter().zip(ys.iter_mut()) {
                let x = &layouts
                    .iter()
                    .find(|(l, _)| *l == (m.group_size, m.bits))
                    .expect("prepared above")
                    .1;
                jobs.push(MatJob { m: *m, x, y });
            }
        }
        self.pool.gemm_batch(k, &mut jobs);
        ys
    }

    /// `down(act(gate(x)) ⊙ up(x))` of the same rows `x` (`[t, cols]`) for every weight source
    /// in `srcs` (the experts of one decode token): every gate and up projection in one parallel
    /// region, every down projection in a second (bit-identical to one MLP at a time).
    fn glu_mlps(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        x: &[f32],
        t: usize,
    ) -> Vec<Vec<f32>> {
        let bufs: Vec<&[u8]> = srcs.iter().map(|w| self.buf(*w)).collect();
        let gate_up: Vec<[QMatrix; 2]> = bufs
            .iter()
            .map(|b| [mlp.gate_proj.mat(b), mlp.up_proj.mat(b)])
            .collect();
        let (g, u) = (&mlp.gate_proj, &mlp.up_proj);
        if t != 1 || (g.bits, g.group_size) != (u.bits, u.group_size) {
            // Prefill: one MLP at a time (its rows are the batch); the row preparations reuse
            // the thread's scratch.
            return gate_up
                .iter()
                .zip(&bufs)
                .map(|([g, u], buf)| {
                    let mut gu = self.products(&[*g, *u], x, t);
                    let u = gu.pop().expect("two products");
                    let mut g = gu.pop().expect("two products");
                    ops::glu(act, &mut g, &u);
                    let mut y = vec![0.0f32; t * mlp.down_proj.rows];
                    let down = mlp.down_proj.mat(buf);
                    self.pool.gemm(self.kernels, &down, &g, t, &mut y);
                    y
                })
                .collect();
        }
        // Decode: one preparation of the row for every expert, the activation applied to each
        // chunk of rows by the thread that computed it, then every down projection.
        let (k, rows) = (self.kernels, mlp.gate_proj.rows);
        let mut hidden = vec![vec![0.0f32; rows]; srcs.len()];
        let Some([g0, _]) = gate_up.first() else {
            return Vec::new();
        };
        let p = k.prepare(g0, x, 1);
        let mut jobs: Vec<PairJob> = gate_up
            .iter()
            .zip(hidden.iter_mut())
            .map(|([a, b], y)| PairJob {
                a: *a,
                b: *b,
                x: &p,
                y,
            })
            .collect();
        self.pool
            .gemv_pairs(k, &mut jobs, |g, u| ops::glu(act, g, u));
        let downs: Vec<[QMatrix; 1]> = bufs.iter().map(|b| [mlp.down_proj.mat(b)]).collect();
        let groups: Vec<(&[QMatrix], &[f32], usize)> = downs
            .iter()
            .zip(&hidden)
            .map(|(m, g)| (&m[..], &g[..], 1))
            .collect();
        self.batched_products(&groups)
            .into_iter()
            .map(|mut y| y.pop().expect("one product"))
            .collect()
    }
}

fn same_shape(op: &'static str, a: &CpuTensor, b: &CpuTensor) -> OpResult<()> {
    check(op, a.data.len() == b.data.len() && a.cols == b.cols, || {
        format!("[{}, {}] vs [{}, {}]", a.rows(), a.cols, b.rows(), b.cols)
    })
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Kv = KvLayer;
    type State = Vec<f32>;

    fn name(&self) -> String {
        format!("cpu {} x{}", self.kernels.name(), self.pool.threads())
    }

    fn upload(&self, data: &[f32], cols: usize) -> OpResult<CpuTensor> {
        check(
            "upload",
            cols > 0 && data.len().is_multiple_of(cols),
            || format!("{} values do not fill rows of {cols}", data.len()),
        )?;
        Ok(CpuTensor::new(data.to_vec(), cols))
    }

    fn zeros(&self, rows: usize, cols: usize) -> OpResult<CpuTensor> {
        Ok(CpuTensor::new(vec![0.0; rows * cols], cols))
    }

    fn copy(&self, x: &CpuTensor) -> OpResult<CpuTensor> {
        Ok(x.clone())
    }

    fn read(&self, x: &CpuTensor) -> OpResult<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn all_finite(&self, x: &CpuTensor) -> OpResult<bool> {
        Ok(x.data.iter().all(|v| v.is_finite()))
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> OpResult<CpuTensor> {
        let c = x.cols;
        let n = x.rows();
        check("gather_rows", rows.iter().all(|&r| r < n), || {
            format!("a row index is outside {n} rows")
        })?;
        let mut out = Vec::with_capacity(rows.len() * c);
        for &r in rows {
            out.extend_from_slice(&x.data[r * c..(r + 1) * c]);
        }
        Ok(CpuTensor::new(out, c))
    }

    fn split(&self, x: &CpuTensor, group: usize, parts: &[usize]) -> OpResult<Vec<CpuTensor>> {
        check(
            "split",
            parts.iter().sum::<usize>() == group && x.cols.is_multiple_of(group),
            || format!("parts {parts:?} of groups of {group} in rows of {}", x.cols),
        )?;
        let groups = x.data.len() / group;
        let mut out: Vec<Vec<f32>> = parts
            .iter()
            .map(|p| Vec::with_capacity(groups * p))
            .collect();
        for g in x.data.chunks_exact(group) {
            let mut o = 0;
            for (dst, &p) in out.iter_mut().zip(parts) {
                dst.extend_from_slice(&g[o..o + p]);
                o += p;
            }
        }
        let per_row = x.cols / group;
        Ok(out
            .into_iter()
            .zip(parts)
            .map(|(d, &p)| CpuTensor::new(d, per_row * p))
            .collect())
    }

    fn embed(&self, table: &QRef, ids: &[u32], scale: Option<f32>) -> OpResult<CpuTensor> {
        let h = table.cols;
        check(
            "embed",
            ids.iter().all(|&i| (i as usize) < table.rows),
            || format!("a token id is outside the table's {} rows", table.rows),
        )?;
        let emb = table.mat(&self.resident);
        let mut x = vec![0.0f32; ids.len() * h];
        for (row, &id) in x.chunks_exact_mut(h).zip(ids) {
            emb.dequantize_row(id as usize, row);
            if let Some(s) = scale {
                row.iter_mut().for_each(|v| *v *= s);
            }
        }
        Ok(CpuTensor::new(x, h))
    }

    fn matmul(&self, ws: &[&QRef], src: Weights, x: &CpuTensor) -> OpResult<Vec<CpuTensor>> {
        check("matmul", ws.iter().all(|w| w.cols == x.cols), || {
            format!("a matrix's columns differ from the input's {}", x.cols)
        })?;
        let buf = self.buf(src);
        let mats: Vec<QMatrix> = ws.iter().map(|w| w.mat(buf)).collect();
        let ys = self.products(&mats, &x.data, x.rows());
        Ok(ys
            .into_iter()
            .zip(ws)
            .map(|(y, w)| CpuTensor::new(y, w.rows))
            .collect())
    }

    fn matmul_bf16(&self, w: &VRef, rows: usize, x: &CpuTensor) -> OpResult<CpuTensor> {
        let cols = x.cols;
        check("matmul_bf16", w.len == rows * cols, || {
            format!("{} values are not [{rows}, {cols}]", w.len)
        })?;
        let t = x.rows();
        let y = std::sync::Mutex::new(vec![0.0f32; t * rows]);
        // Each work item converts its weight rows to f32 once and dots them with every input row.
        self.pool.for_chunks(rows, 16, |r0, r1| {
            let mut wr = vec![0.0f32; cols];
            let mut part = vec![0.0f32; t * (r1 - r0)];
            for r in r0..r1 {
                wr.iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v = w.get(&self.resident, r * cols + i));
                for (i, xr) in x.data.chunks_exact(cols).enumerate() {
                    part[i * (r1 - r0) + r - r0] = self.kernels.dot_f32(&wr, xr);
                }
            }
            let mut y = y.lock().unwrap_or_else(|e| e.into_inner());
            for (i, p) in part.chunks_exact(r1 - r0).enumerate() {
                y[i * rows + r0..i * rows + r1].copy_from_slice(p);
            }
        });
        Ok(CpuTensor::new(
            y.into_inner().unwrap_or_else(|e| e.into_inner()),
            rows,
        ))
    }

    fn glu_mlp(&self, mlp: &Mlp, act: Act, src: Weights, x: &CpuTensor) -> OpResult<CpuTensor> {
        check_mlp("glu_mlp", mlp, x.cols)?;
        let y = self.glu_mlps(mlp, act, &[src], &x.data, x.rows()).pop();
        Ok(CpuTensor::new(y.expect("one MLP"), mlp.down_proj.rows))
    }

    fn glu_mlp_rows(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        x: &CpuTensor,
        out: &mut CpuTensor,
        rows: &[usize],
    ) -> OpResult<()> {
        check_glu_rows("glu_mlp_rows", mlp, srcs.len(), x, out, rows)?;
        let c = out.cols;
        for (y, &r) in self.glu_mlps(mlp, act, srcs, &x.data, 1).iter().zip(rows) {
            out.data[r * c..(r + 1) * c].copy_from_slice(y);
        }
        Ok(())
    }

    fn head_argmax(&self, w: &QRef, x: &CpuTensor) -> OpResult<(u32, f32)> {
        check("head_argmax", x.rows() == 1 && x.cols == w.cols, || {
            format!(
                "expected one row of {}, got [{}, {}]",
                w.cols,
                x.rows(),
                x.cols
            )
        })?;
        let (id, logit) =
            self.pool
                .gemv_argmax(self.kernels, &w.mat(&self.resident), &x.data, None);
        Ok((id as u32, logit))
    }

    fn rms_norm(&self, x: &mut CpuTensor, dim: usize, norm: Norm, eps: f32) -> OpResult<()> {
        check("rms_norm", dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        ops::rms_norm(self.kernels, &mut x.data, dim, norm, &self.resident, eps);
        Ok(())
    }

    fn rms_norm_gated(
        &self,
        x: &mut CpuTensor,
        dim: usize,
        w: &VRef,
        z: &CpuTensor,
        eps: f32,
    ) -> OpResult<()> {
        same_shape("rms_norm_gated", x, z)?;
        ops::rms_norm(
            self.kernels,
            &mut x.data,
            dim,
            Norm::Weight(w),
            &self.resident,
            eps,
        );
        x.data
            .iter_mut()
            .zip(&z.data)
            .for_each(|(o, &g)| *o *= ops::silu(g));
        Ok(())
    }

    fn unary(&self, x: &mut CpuTensor, op: Unary) -> OpResult<()> {
        let d = &mut x.data;
        match op {
            Unary::Scale(c) => d.iter_mut().for_each(|v| *v *= c),
            Unary::Softcap(c) => ops::softcap(d, c),
            Unary::Clamp(lo, hi) => d.iter_mut().for_each(|v| *v = v.clamp(lo, hi)),
            Unary::Silu => d.iter_mut().for_each(|v| *v = ops::silu(*v)),
            Unary::GeluTanh => d.iter_mut().for_each(|v| *v = ops::gelu_tanh(*v)),
            Unary::Sigmoid => d.iter_mut().for_each(|v| *v = ops::sigmoid(*v)),
        }
        Ok(())
    }

    fn mul_cols(&self, x: &mut CpuTensor, w: &VRef, c: f32) -> OpResult<()> {
        check("mul_cols", w.len == x.cols, || {
            format!("{} weights for rows of {}", w.len, x.cols)
        })?;
        for row in x.data.chunks_exact_mut(x.cols) {
            row.iter_mut()
                .zip(w.iter(&self.resident))
                .for_each(|(v, s)| *v *= s * c);
        }
        Ok(())
    }

    fn mul_sigmoid(&self, x: &mut CpuTensor, g: &CpuTensor) -> OpResult<()> {
        same_shape("mul_sigmoid", x, g)?;
        x.data
            .iter_mut()
            .zip(&g.data)
            .for_each(|(o, &g)| *o *= ops::sigmoid(g));
        Ok(())
    }

    fn mul_rows_sigmoid(&self, x: &mut CpuTensor, g: &CpuTensor) -> OpResult<()> {
        check(
            "mul_rows_sigmoid",
            g.cols == 1 && g.rows() == x.rows(),
            || format!("gate [{}, {}] for {} rows", g.rows(), g.cols, x.rows()),
        )?;
        for (row, &g) in x.data.chunks_exact_mut(x.cols).zip(&g.data) {
            let s = ops::sigmoid(g);
            row.iter_mut().for_each(|v| *v *= s);
        }
        Ok(())
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor, s: f32) -> OpResult<()> {
        same_shape("add", x, y)?;
        if s == 1.0 {
            x.data.iter_mut().zip(&y.data).for_each(|(a, b)| *a += b);
        } else {
            x.data
                .iter_mut()
                .zip(&y.data)
                .for_each(|(a, b)| *a = (*a + b) * s);
        }
        Ok(())
    }

    fn scatter_add(
        &self,
        acc: &mut CpuTensor,
        y: &CpuTensor,
        rows: &[(usize, f32)],
    ) -> OpResult<()> {
        let (h, n) = (acc.cols, acc.rows());
        check(
            "scatter_add",
            y.cols == h && y.rows() == rows.len() && rows.iter().all(|&(r, _)| r < n),
            || format!("[{}, {}] rows into [{n}, {h}]", y.rows(), y.cols),
        )?;
        for (j, &(row, w)) in rows.iter().enumerate() {
            self.kernels.axpy(
                w,
                &y.data[j * h..(j + 1) * h],
                &mut acc.data[row * h..(row + 1) * h],
            );
        }
        Ok(())
    }

    fn new_kv(
        &self,
        rows: usize,
        ring: bool,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> OpResult<KvLayer> {
        Ok(KvLayer::new(rows, ring, n_kv_heads, head_dim, dtype))
    }

    fn rope(&self, x: &mut CpuTensor, rope: &Rope, head_dim: usize, pos0: usize) -> OpResult<()> {
        check(
            "rope",
            x.cols.is_multiple_of(head_dim) && rope.rotated <= head_dim,
            || {
                format!(
                    "heads of {head_dim} (rotating {}) in rows of {}",
                    rope.rotated, x.cols
                )
            },
        )?;
        let c = x.cols;
        for (r, row) in x.data.chunks_exact_mut(c).enumerate() {
            rope.apply(row, head_dim, pos0 + r);
        }
        Ok(())
    }

    fn kv_clone(&self, kv: &KvLayer) -> OpResult<KvLayer> {
        Ok(kv.clone())
    }

    fn kv_write(
        &self,
        kv: &mut KvLayer,
        pos0: usize,
        k: &CpuTensor,
        v: &CpuTensor,
    ) -> OpResult<()> {
        same_shape("kv_write", k, v)?;
        let w = kv.row_stride();
        check("kv_write", k.cols == w, || {
            format!("rows of {} into a KV row of {w}", k.cols)
        })?;
        for r in 0..k.rows() {
            kv.write(
                pos0 + r,
                &k.data[r * w..(r + 1) * w],
                &v.data[r * w..(r + 1) * w],
            );
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuTensor,
        kv: &KvLayer,
        pos0: usize,
        s: &AttnShape,
    ) -> OpResult<CpuTensor> {
        self.attend("attention", q, kv, pos0, s, None)
    }

    fn attention_rel(
        &self,
        q: &CpuTensor,
        kv: &KvLayer,
        pos0: usize,
        s: &AttnShape,
        bias: &RelBias<CpuTensor>,
    ) -> OpResult<CpuTensor> {
        self.attend("attention_rel", q, kv, pos0, s, Some(bias))
    }

    fn new_state(&self, len: usize) -> OpResult<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn zero_state(&self, s: &mut Vec<f32>) -> OpResult<()> {
        s.fill(0.0);
        Ok(())
    }

    fn state_bytes(&self, s: &Vec<f32>) -> usize {
        4 * s.len()
    }

    fn conv1d_silu(
        &self,
        x: &CpuTensor,
        state: &mut Vec<f32>,
        w: &CpuTensor,
        kernel: usize,
    ) -> OpResult<CpuTensor> {
        conv("conv1d_silu", x, state, w, kernel, ops::silu)
    }

    fn conv1d(
        &self,
        x: &CpuTensor,
        state: &mut Vec<f32>,
        w: &CpuTensor,
        kernel: usize,
    ) -> OpResult<CpuTensor> {
        conv("conv1d", x, state, w, kernel, |v| v)
    }

    fn delta_gates(
        &self,
        b: &CpuTensor,
        alpha: &CpuTensor,
        a: &CpuTensor,
        dt_bias: &CpuTensor,
    ) -> OpResult<(CpuTensor, CpuTensor)> {
        same_shape("delta_gates", b, alpha)?;
        let nv = b.cols;
        check(
            "delta_gates",
            a.data.len() == nv && dt_bias.data.len() == nv,
            || format!("a / dt_bias for {nv} heads"),
        )?;
        let beta: Vec<f32> = b.data.iter().map(|&x| ops::sigmoid(x)).collect();
        let decay: Vec<f32> = alpha
            .data
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let h = i % nv;
                (-a.data[h] * ops::softplus(x + dt_bias.data[h])).exp()
            })
            .collect();
        Ok((CpuTensor::new(beta, nv), CpuTensor::new(decay, nv)))
    }

    fn gated_delta_rule(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        decay: &CpuTensor,
        beta: &CpuTensor,
        state: &mut Vec<f32>,
        s: &DeltaShape,
    ) -> OpResult<CpuTensor> {
        let (nk, nv, dk, dv) = (s.n_k_heads, s.n_v_heads, s.head_k_dim, s.head_v_dim);
        same_shape("gated_delta_rule", q, k)?;
        same_shape("gated_delta_rule", decay, beta)?;
        check(
            "gated_delta_rule",
            q.cols == nk * dk
                && v.cols == nv * dv
                && decay.cols == nv
                && nk > 0
                && nv.is_multiple_of(nk)
                && state.len() == nv * dv * dk
                && q.rows() == v.rows()
                && q.rows() == decay.rows(),
            || format!("operands do not fit {s:?}"),
        )?;
        let mut out = vec![0.0f32; v.data.len()];
        ops::gated_delta_rule(
            &self.pool,
            self.kernels,
            &q.data,
            &k.data,
            &v.data,
            &decay.data,
            &beta.data,
            state,
            s,
            &mut out,
        );
        Ok(CpuTensor::new(out, nv * dv))
    }

    fn linear(&self, x: &CpuTensor, w: &CpuTensor) -> OpResult<CpuTensor> {
        check("linear", x.cols == w.cols, || {
            format!(
                "rows of {} against a weight [{}, {}]",
                x.cols,
                w.rows(),
                w.cols
            )
        })?;
        let y = dsv4::linear(&self.pool, self.kernels, &x.data, &w.data, x.cols);
        Ok(CpuTensor::new(y, w.rows()))
    }

    fn set_rows(&self, dst: &mut CpuTensor, row0: usize, src: &CpuTensor) -> OpResult<()> {
        check(
            "set_rows",
            dst.cols == src.cols && row0 + src.rows() <= dst.rows(),
            || {
                format!(
                    "[{}, {}] at row {row0} of [{}, {}]",
                    src.rows(),
                    src.cols,
                    dst.rows(),
                    dst.cols
                )
            },
        )?;
        let c = dst.cols;
        dst.data[row0 * c..row0 * c + src.data.len()].copy_from_slice(&src.data);
        Ok(())
    }

    fn rope_at(
        &self,
        x: &mut CpuTensor,
        rope: &Rope,
        head_dim: usize,
        positions: &[usize],
    ) -> OpResult<()> {
        check(
            "rope_at",
            x.cols.is_multiple_of(head_dim)
                && rope.rotated <= head_dim
                && positions.len() == x.rows(),
            || {
                format!(
                    "{} positions for {} rows of {}",
                    positions.len(),
                    x.rows(),
                    x.cols
                )
            },
        )?;
        let c = x.cols;
        for (row, &p) in x.data.chunks_exact_mut(c).zip(positions) {
            rope.apply(row, head_dim, p);
        }
        Ok(())
    }

    fn matmul_grouped(
        &self,
        w: &QRef,
        groups: usize,
        src: Weights,
        x: &CpuTensor,
    ) -> OpResult<CpuTensor> {
        check(
            "matmul_grouped",
            groups > 0 && w.rows.is_multiple_of(groups) && x.cols == groups * w.cols,
            || {
                format!(
                    "{groups} groups of [{}, {}] over rows of {}",
                    w.rows, w.cols, x.cols
                )
            },
        )?;
        let (t, c, r) = (x.rows(), w.cols, w.rows / groups);
        let buf = self.buf(src);
        let mut y = vec![0.0f32; t * groups * r];
        for g in 0..groups {
            let xg: Vec<f32> = x
                .data
                .chunks_exact(x.cols)
                .flat_map(|row| row[g * c..(g + 1) * c].iter().copied())
                .collect();
            let m = w.rows_range(g * r, r).mat(buf);
            let yg = self.products(&[m], &xg, t).pop().expect("one product");
            for (row, yr) in yg.chunks_exact(r).enumerate() {
                let at = row * groups * r + g * r;
                y[at..at + r].copy_from_slice(yr);
            }
        }
        Ok(CpuTensor::new(y, groups * r))
    }

    fn hc_pre(
        &self,
        x: &CpuTensor,
        f: &CpuTensor,
        base: &[f32],
        scale: &[f32],
        spec: &HcSpec,
    ) -> OpResult<(CpuTensor, Option<(CpuTensor, CpuTensor)>)> {
        let n = spec.streams;
        let m = f.rows();
        check(
            "hc_pre",
            n > 0
                && x.cols.is_multiple_of(n)
                && f.cols == x.cols
                && (m == n || m == (2 + n) * n)
                && base.len() == m
                && scale.len() == if m == n { 1 } else { 3 },
            || {
                format!(
                    "{n} streams of rows of {}, projection [{m}, {}]",
                    x.cols, f.cols
                )
            },
        )?;
        let d = x.cols / n;
        let (t, c) = (x.rows(), x.cols);
        let normed: Vec<f32> = x
            .data
            .chunks_exact(c)
            .flat_map(|r| dsv4::rms(r, spec.norm_eps))
            .collect();
        let mixes = dsv4::linear(&self.pool, self.kernels, &normed, &f.data, c);
        let mut collapsed = vec![0.0f32; t * d];
        let (mut post, mut comb) = (Vec::new(), Vec::new());
        for r in 0..t {
            let (pre, pc) = dsv4::hc_weights(&mixes[r * m..(r + 1) * m], base, scale, spec);
            let o = &mut collapsed[r * d..(r + 1) * d];
            for (j, &pj) in pre.iter().enumerate() {
                let xj = &x.data[r * c + j * d..r * c + (j + 1) * d];
                o.iter_mut().zip(xj).for_each(|(a, &b)| *a += pj * b);
            }
            if let Some((p, cm)) = pc {
                post.extend(p);
                comb.extend(cm);
            }
        }
        let rest = (m != n).then(|| (CpuTensor::new(post, n), CpuTensor::new(comb, n * n)));
        Ok((CpuTensor::new(collapsed, d), rest))
    }

    fn hc_post(
        &self,
        x: &CpuTensor,
        out: &CpuTensor,
        post: &CpuTensor,
        comb: &CpuTensor,
    ) -> OpResult<CpuTensor> {
        let n = post.cols;
        let (t, d) = (out.rows(), out.cols);
        check(
            "hc_post",
            x.cols == n * d
                && x.rows() == t
                && post.rows() == t
                && comb.cols == n * n
                && comb.rows() == t,
            || {
                format!(
                    "streams [{t}, {}] for an output [{t}, {d}] and {n} streams",
                    x.cols
                )
            },
        )?;
        let mut y = vec![0.0f32; t * n * d];
        for r in 0..t {
            let xr = &x.data[r * n * d..(r + 1) * n * d];
            let (pr, cr) = (
                &post.data[r * n..(r + 1) * n],
                &comb.data[r * n * n..(r + 1) * n * n],
            );
            let orow = &out.data[r * d..(r + 1) * d];
            for kk in 0..n {
                let yk = &mut y[(r * n + kk) * d..(r * n + kk + 1) * d];
                for (i, v) in yk.iter_mut().enumerate() {
                    let mix: f32 = (0..n).map(|j| cr[j * n + kk] * xr[j * d + i]).sum();
                    *v = pr[kk] * orow[i] + mix;
                }
            }
        }
        Ok(CpuTensor::new(y, n * d))
    }

    fn compress_pool(
        &self,
        kv: &CpuTensor,
        gate: &CpuTensor,
        ape: &CpuTensor,
        rate: usize,
        overlap: bool,
        prior: Option<(&CpuTensor, &CpuTensor)>,
    ) -> OpResult<CpuTensor> {
        same_shape("compress_pool", kv, gate)?;
        let w = kv.cols;
        let d = if overlap { w / 2 } else { w };
        check(
            "compress_pool",
            rate > 0
                && kv.rows().is_multiple_of(rate)
                && (!overlap || w.is_multiple_of(2))
                && ape.cols == w
                && ape.rows() == rate
                && prior.is_none_or(|(k, g)| {
                    overlap && k.cols == d && g.cols == d && k.rows() == rate && g.rows() == rate
                }),
            || format!("windows of {rate} rows of {w} (overlap {overlap})"),
        )?;
        let out = dsv4::compress_pool(
            &kv.data,
            &gate.data,
            &ape.data,
            rate,
            w,
            overlap,
            prior.map(|(k, g)| (&k.data[..], &g.data[..])),
        );
        Ok(CpuTensor::new(out, d))
    }

    fn attention_sparse(
        &self,
        q: &CpuTensor,
        kv: &KvLayer,
        pos0: usize,
        s: &AttnShape,
        entries: &CpuTensor,
        visible: &[Vec<usize>],
    ) -> OpResult<CpuTensor> {
        check(
            "attention_sparse",
            q.cols == s.n_heads * s.head_dim
                && s.n_kv_heads > 0
                && s.n_heads.is_multiple_of(s.n_kv_heads)
                && kv.row_stride() == s.n_kv_heads * s.head_dim
                && entries.cols == kv.row_stride()
                && visible.len() == q.rows()
                && visible.iter().flatten().all(|&e| e < entries.rows())
                && s.sinks.as_ref().is_none_or(|v| v.len() == s.n_heads),
            || {
                format!(
                    "q rows of {} for {} heads of {}, {} entries of {}",
                    q.cols,
                    s.n_heads,
                    s.head_dim,
                    entries.rows(),
                    entries.cols
                )
            },
        )?;
        let mut out = vec![0.0f32; q.data.len()];
        dsv4::attention_sparse(
            &self.pool,
            self.kernels,
            &q.data,
            kv,
            pos0,
            s,
            &entries.data,
            visible,
            &mut out,
        );
        Ok(CpuTensor::new(out, q.cols))
    }

    fn index_top_k(
        &self,
        q: &CpuTensor,
        keys: &CpuTensor,
        weights: &CpuTensor,
        n_heads: usize,
        visible: &[usize],
        top_k: usize,
    ) -> OpResult<Vec<Vec<usize>>> {
        let d = keys.cols;
        check(
            "index_top_k",
            q.cols == n_heads * d
                && weights.cols == n_heads
                && weights.rows() == q.rows()
                && visible.len() == q.rows()
                && visible.iter().all(|&n| n <= keys.rows()),
            || format!("{n_heads} heads of {d} over {} keys", keys.rows()),
        )?;
        Ok(dsv4::index_top_k(
            self.kernels,
            &q.data,
            &keys.data,
            &weights.data,
            n_heads,
            d,
            visible,
            top_k,
        ))
    }

    fn route(&self, logits: &CpuTensor, spec: &RouterSpec) -> OpResult<Routes> {
        let n_exp = logits.cols;
        let k = spec.top_k;
        check("route", k > 0 && k <= n_exp, || {
            format!("top-{k} of {n_exp} experts")
        })?;
        check(
            "route",
            spec.per_expert_scale.is_none_or(|s| s.len == n_exp),
            || format!("per_expert_scale length for {n_exp} experts"),
        )?;
        check_forced("route", spec, logits.rows(), n_exp)?;
        if let Scoring::SqrtSoftplus {
            correction_bias: Some(b),
            ..
        } = spec.scoring
        {
            check("route", b.len == n_exp, || {
                format!("correction bias length {} for {n_exp} experts", b.len)
            })?;
        }
        let pick = |row: usize, scores: &[f32]| match spec.forced {
            Some(f) => f[row * k..(row + 1) * k].to_vec(),
            None => ops::top_k(scores, k),
        };
        let mut experts: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        let mut margins = Vec::new();
        let mut p = Vec::with_capacity(n_exp);
        for (row, lg) in logits.data.chunks_exact(n_exp).enumerate() {
            if spec.trace {
                margins.push(top_k_margin(lg, k));
            }
            let chosen: Vec<(usize, f32)> = match spec.scoring {
                Scoring::SoftmaxOfTopK => {
                    let idx = pick(row, lg);
                    let mut w: Vec<f32> = idx.iter().map(|&e| lg[e]).collect();
                    ops::softmax(&mut w);
                    idx.into_iter().zip(w).collect()
                }
                Scoring::TopKOfSoftmax { norm_topk_prob } => {
                    p.clear();
                    p.extend_from_slice(lg);
                    ops::softmax(&mut p);
                    let idx = pick(row, &p);
                    let z: f32 = if norm_topk_prob {
                        idx.iter().map(|&e| p[e]).sum()
                    } else {
                        1.0
                    };
                    idx.into_iter().map(|e| (e, p[e] / z)).collect()
                }
                Scoring::SqrtSoftplus {
                    routed_scaling_factor,
                    correction_bias,
                } => {
                    p.clear();
                    p.extend(lg.iter().map(|&x| ops::softplus(x).sqrt()));
                    let idx = match (spec.forced, correction_bias) {
                        (None, Some(b)) => {
                            let biased: Vec<f32> = (0..n_exp)
                                .map(|e| p[e] + b.get(&self.resident, e))
                                .collect();
                            ops::top_k(&biased, k)
                        }
                        _ => pick(row, &p),
                    };
                    let z: f32 = idx.iter().map(|&e| p[e]).sum::<f32>() + 1e-20;
                    idx.into_iter()
                        .map(|e| (e, p[e] / z * routed_scaling_factor))
                        .collect()
                }
            };
            for (e, w) in chosen {
                let w = match spec.per_expert_scale {
                    Some(s) => w * s.get(&self.resident, e),
                    None => w,
                };
                experts.entry(e).or_default().push((row, w));
            }
        }
        Ok(Routes { experts, margins })
    }

    fn route_sinks(
        &self,
        logits: &CpuTensor,
        router: &SinkRouter<CpuTensor>,
        spec: &RouterSpec,
    ) -> OpResult<Routes> {
        let (n_all, n_shared) = (logits.cols, router.n_shared);
        let n_routed = n_all.saturating_sub(n_shared);
        let k = spec.top_k;
        check(
            "route_sinks",
            k > 0
                && k <= n_routed
                && router.bias.data.len() == n_routed
                && spec.per_expert_scale.is_none(),
            || {
                format!(
                    "top-{k} of {n_routed} routed experts ({n_shared} shared, bias of {}, no \
                     per-expert scale)",
                    router.bias.data.len()
                )
            },
        )?;
        check_forced("route_sinks", spec, logits.rows(), n_routed)?;
        let mut experts: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        let mut margins = Vec::new();
        for (row, lg) in logits.data.chunks_exact(n_all).enumerate() {
            let choice: Vec<f32> = lg[..n_routed]
                .iter()
                .zip(&router.bias.data)
                .map(|(&l, &b)| ops::sigmoid(l) + b)
                .collect();
            if spec.trace {
                margins.push(top_k_margin(&choice, k));
            }
            let idx = match spec.forced {
                Some(f) => f[row * k..(row + 1) * k].to_vec(),
                None => ops::top_k(&choice, k),
            };
            let ids: Vec<usize> = idx.into_iter().chain(n_routed..n_all).collect();
            // softmax over log-sigmoids, as transformers computes it: exp(ls − logsumexp(ls)).
            let mut w: Vec<f32> = ids.iter().map(|&e| ops::log_sigmoid(lg[e])).collect();
            ops::softmax(&mut w);
            for (e, w) in ids.into_iter().zip(w) {
                experts.entry(e).or_default().push((row, w * router.scale));
            }
        }
        Ok(Routes { experts, margins })
    }
}

impl CpuBackend {
    /// [`Backend::attention`], with `bias` [`Backend::attention_rel`].
    fn attend(
        &self,
        op: &'static str,
        q: &CpuTensor,
        kv: &KvLayer,
        pos0: usize,
        s: &AttnShape,
        bias: Option<&RelBias<CpuTensor>>,
    ) -> OpResult<CpuTensor> {
        let d_rel = bias.map_or(0, |b| b.proj.rows());
        check(
            op,
            q.cols == s.n_heads * s.head_dim
                && s.n_kv_heads > 0
                && s.n_heads.is_multiple_of(s.n_kv_heads)
                && kv.row_stride() == s.n_kv_heads * s.head_dim
                && s.sinks.as_ref().is_none_or(|v| v.len() == s.n_heads)
                && bias.is_none_or(|b| b.rel.rows() == q.rows() && b.rel.cols == s.n_heads * d_rel),
            || {
                format!(
                    "q rows of {} for {} heads of {} (rel rows of {:?}, d_rel {d_rel})",
                    q.cols,
                    s.n_heads,
                    s.head_dim,
                    bias.map(|b| b.rel.cols)
                )
            },
        )?;
        let slices = bias.map(|b| ops::RelSlices {
            rel: &b.rel.data,
            proj: &b.proj.data,
            d_rel,
            extent: b.proj.cols,
            log_scaling: b.log_scaling,
        });
        let mut out = vec![0.0f32; q.data.len()];
        ops::attention(
            &self.pool,
            self.kernels,
            &q.data,
            kv,
            pos0,
            s,
            slices.as_ref(),
            &mut out,
        );
        Ok(CpuTensor::new(out, q.cols))
    }
}

/// The depthwise causal conv of `op` (`conv1d_silu`, `conv1d`) with activation `act`.
fn conv(
    op: &'static str,
    x: &CpuTensor,
    state: &mut [f32],
    w: &CpuTensor,
    kernel: usize,
    act: impl Fn(f32) -> f32,
) -> OpResult<CpuTensor> {
    let c = x.cols;
    check(
        op,
        kernel >= 2 && w.data.len() == c * kernel && state.len() == (kernel - 1) * c,
        || format!("kernel {kernel} over {c} channels"),
    )?;
    let mut out = vec![0.0f32; x.data.len()];
    ops::causal_conv1d(&x.data, state, &w.data, c, kernel, &mut out, act);
    Ok(CpuTensor::new(out, c))
}

/// The k-th largest logit minus the (k+1)-th (`+∞` when there is no (k+1)-th).
pub fn top_k_margin(logits: &[f32], k: usize) -> f32 {
    if k == 0 || k >= logits.len() {
        return f32::INFINITY;
    }
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[k - 1] - v[k]
}
