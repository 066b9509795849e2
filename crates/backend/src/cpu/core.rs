//! The CPU's core ops: host `Vec<f32>` activations, quantized products through the kernel table
//! on the worker pool, KV in [`KvLayer`], the router's readback.

use std::collections::BTreeMap;

use mference_kernels::QMatrix;
use mference_runtime::{KvDtype, KvLayer};

use super::{ops, same_shape, top_k_margin, CpuBackend, CpuTensor};
use crate::{
    check, check_forced, check_glu_rows, check_mlp, Act, AttnShape, CoreOps, Mlp, Norm, Op,
    OpResult, QRef, Rope, RouterSpec, Routes, Scoring, Tensor, Unary, VRef, Weights,
};

impl CoreOps for CpuBackend {
    type Tensor = CpuTensor;

    type Kv = KvLayer;

    type State = Vec<f32>;

    fn name(&self) -> String {
        let rounding = self.kernels.rounding().map(|r| format!(" ({r})"));
        let (name, threads) = (self.kernels.name(), self.pool.threads());
        format!("cpu {name}{} x{threads}", rounding.unwrap_or_default())
    }

    fn kernels(&self) -> &'static str {
        self.kernels.name()
    }

    fn supports(_op: Op) -> bool {
        true
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

    fn glu_mlp_experts(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        xs: &[&CpuTensor],
    ) -> OpResult<Vec<CpuTensor>> {
        check("glu_mlp_experts", srcs.len() == xs.len(), || {
            format!("{} sources for {} inputs", srcs.len(), xs.len())
        })?;
        for x in xs {
            check_mlp("glu_mlp_experts", mlp, x.cols)?;
        }
        let ins: Vec<(&[f32], usize)> = xs.iter().map(|x| (&x.data[..], x.rows())).collect();
        match self.glu_mlp_batch(mlp, act, srcs, &ins) {
            Some(ys) => Ok(ys
                .into_iter()
                .map(|y| CpuTensor::new(y, mlp.down_proj.rows))
                .collect()),
            None => srcs
                .iter()
                .zip(xs)
                .map(|(src, x)| self.glu_mlp(mlp, act, *src, x))
                .collect(),
        }
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
        let (k, buf) = (self.kernels, &**self.resident);
        self.rows_in_parallel(&mut x.data, dim, |_, piece| {
            ops::rms_norm(k, piece, dim, norm, buf, eps)
        });
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
        let (c, y) = (x.cols, &y.data);
        self.rows_in_parallel(&mut x.data, c, |r, row| {
            let y = &y[r * c..(r + 1) * c];
            if s == 1.0 {
                row.iter_mut().zip(y).for_each(|(a, b)| *a += b);
            } else {
                row.iter_mut().zip(y).for_each(|(a, b)| *a = (*a + b) * s);
            }
        });
        Ok(())
    }

    fn scatter_add(
        &self,
        acc: &mut CpuTensor,
        y: &CpuTensor,
        rows: &[(usize, f32)],
    ) -> OpResult<()> {
        check_scatter(acc, y, rows)?;
        let h = acc.cols;
        for (j, &(row, w)) in rows.iter().enumerate() {
            self.kernels.axpy(
                w,
                &y.data[j * h..(j + 1) * h],
                &mut acc.data[row * h..(row + 1) * h],
            );
        }
        Ok(())
    }

    /// Each row of `acc` takes its terms in the default's order (expert after expert), a row's
    /// terms all on one thread: the default's bits.
    fn scatter_add_many(
        &self,
        acc: &mut CpuTensor,
        ys: &[&CpuTensor],
        rows: &[&[(usize, f32)]],
    ) -> OpResult<()> {
        let (h, n) = (acc.cols, acc.rows());
        check("scatter_add_many", ys.len() == rows.len(), || {
            format!("{} outputs for {} row lists", ys.len(), rows.len())
        })?;
        for (y, r) in ys.iter().zip(rows) {
            check_scatter(acc, y, r)?;
        }
        // Per row of acc: (output, its row, weight), outputs in order.
        let mut terms: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); n];
        for (j, r) in rows.iter().enumerate() {
            for (i, &(row, w)) in r.iter().enumerate() {
                terms[row].push((j, i, w));
            }
        }
        let k = self.kernels;
        self.rows_in_parallel(&mut acc.data, h, |row, a| {
            for &(j, i, w) in &terms[row] {
                k.axpy(w, &ys[j].data[i * h..(i + 1) * h], a);
            }
        });
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
        self.attend("attention", q, kv, pos0, s, None, None)
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
        let y = ops::linear(&self.pool, self.kernels, &x.data, &w.data, x.cols);
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
                } => sqrt_softplus_row(
                    lg,
                    k,
                    spec.forced.map(|f| &f[row * k..(row + 1) * k]),
                    correction_bias.map(|b| move |e| b.get(&self.resident, e)),
                    routed_scaling_factor,
                    &mut p,
                ),
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
}

/// One row of DeepSeek-V4's sqrt-softplus routing ([`Scoring::SqrtSoftplus`]): `p` gets the
/// scores `sqrt(softplus(lg))`; the experts are `forced` or the top-k of `p + bias(e)` (of `p`
/// without a bias); each weighs `p[e] / (Σ_chosen p + 1e-20) · routed_scaling_factor` (the CUDA
/// router kernels' scoring 2 is the same rule).
pub(crate) fn sqrt_softplus_row(
    lg: &[f32],
    k: usize,
    forced: Option<&[usize]>,
    bias: Option<impl Fn(usize) -> f32>,
    routed_scaling_factor: f32,
    p: &mut Vec<f32>,
) -> Vec<(usize, f32)> {
    p.clear();
    p.extend(lg.iter().map(|&x| ops::softplus(x).sqrt()));
    let idx = match (forced, bias) {
        (Some(f), _) => f.to_vec(),
        (None, Some(b)) => {
            let biased: Vec<f32> = (0..lg.len()).map(|e| p[e] + b(e)).collect();
            ops::top_k(&biased, k)
        }
        (None, None) => ops::top_k(p, k),
    };
    let z: f32 = idx.iter().map(|&e| p[e]).sum::<f32>() + 1e-20;
    idx.into_iter()
        .map(|e| (e, p[e] / z * routed_scaling_factor))
        .collect()
}

/// The operands of [`CoreOps::scatter_add`]: `y` is `[rows.len(), acc.cols]` and every row index
/// is inside `acc`.
fn check_scatter(acc: &CpuTensor, y: &CpuTensor, rows: &[(usize, f32)]) -> OpResult<()> {
    let (h, n) = (acc.cols, acc.rows());
    check(
        "scatter_add",
        y.cols == h && y.rows() == rows.len() && rows.iter().all(|&(r, _)| r < n),
        || format!("[{}, {}] rows into [{n}, {h}]", y.rows(), y.cols),
    )
}
