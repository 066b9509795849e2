//! The CPU's DeepSeek-V4 ops; their loops are in [`loops`].

mod loops;

use mference_runtime::KvLayer;

use super::{CpuBackend, CpuTensor};
use crate::deepseek_v4_checks as checks;
use crate::{check, AttnShape, DeepSeekV4Ops, HcSpec, OpResult, QRef, Rope, Tensor, Weights};

impl DeepSeekV4Ops for CpuBackend {
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
        checks::matmul_grouped(w, groups, x)?;
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
        checks::hc_pre(x, f, base, scale, spec, usize::MAX)?;
        let (n, m) = (spec.streams, f.rows());
        let d = x.cols / n;
        let (t, c) = (x.rows(), x.cols);
        let normed: Vec<f32> = x
            .data
            .chunks_exact(c)
            .flat_map(|r| loops::rms(r, spec.norm_eps))
            .collect();
        let mixes = crate::cpu::ops::linear(&self.pool, self.kernels, &normed, &f.data, c);
        let mut collapsed = vec![0.0f32; t * d];
        let (mut post, mut comb) = (Vec::new(), Vec::new());
        for r in 0..t {
            let (pre, pc) = loops::hc_weights(&mixes[r * m..(r + 1) * m], base, scale, spec);
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
        checks::hc_post(x, out, post, comb)?;
        let (n, t, d) = (post.cols, out.rows(), out.cols);
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
        checks::compress_pool(kv, gate, ape, rate, overlap, prior)?;
        let w = kv.cols;
        let d = if overlap { w / 2 } else { w };
        let out = loops::compress_pool(
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
        let entries = Some((entries, visible));
        self.attend("attention_sparse", q, kv, pos0, s, None, entries)
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
        // Every head's query against every key on the pool, one `dot_f32` per pair (`linear`
        // needs a key and a column; with none every dot is 0).
        let dots = if keys.rows() == 0 || d == 0 {
            vec![0.0; q.rows() * n_heads * keys.rows()]
        } else {
            super::ops::linear(&self.pool, self.kernels, &q.data, &keys.data, d)
        };
        Ok(loops::index_top_k(
            &dots,
            keys.rows(),
            &weights.data,
            n_heads,
            visible,
            top_k,
        ))
    }
}
