//! DeepSeek-V4's ops (kernels: deepseek_v4.cu; sparse attention: attention.cu's split kernel with
//! `SparseArgs`; its sqrt-softplus router is the router kernels' scoring 2, router.rs).

use crate::*;

impl DeepSeekV4Ops for CudaBackend {
    fn rope_at(
        &self,
        x: &mut CudaTensor,
        rope: &Rope,
        head_dim: usize,
        positions: &[usize],
    ) -> OpResult<()> {
        self.rope_rows("rope_at", x, rope, head_dim, 0, Some(positions))
    }

    /// Each group's columns of `x` apart (`split`), the `groups` products in one launch, then
    /// their outputs side by side (written in place for one row).
    fn matmul_grouped(
        &self,
        w: &QRef,
        groups: usize,
        src: Weights,
        x: &CudaTensor,
    ) -> OpResult<CudaTensor> {
        let op = "matmul_grouped";
        deepseek_v4_checks::matmul_grouped(w, groups, x)?;
        let (c, r) = (w.cols, w.rows / groups);
        let xs = self.split(x, x.cols, &vec![c; groups])?;
        let ws: Vec<QRef> = (0..groups).map(|g| w.rows_range(g * r, r)).collect();
        let mut y = self.uninit_tensor(op, x.rows, groups * r)?;
        let one = x.rows == 1;
        let ys = match one {
            true => Vec::new(),
            false => (0..groups)
                .map(|_| self.uninit_tensor(op, x.rows, r))
                .collect::<OpResult<Vec<_>>>()?,
        };
        let ya = self.addr(&*y.buf);
        self.with_weights(op, src, |buf, len| {
            let jobs: Vec<QJob> = (0..groups)
                .map(|g| QJob {
                    w: &ws[g],
                    buf,
                    len,
                    x: self.addr(&*xs[g].buf),
                    y: match one {
                        true => ya + (4 * g * r) as u64,
                        false => self.addr(&*ys[g].buf),
                    },
                })
                .collect();
            self.products(op, &jobs, x.rows)
        })?;
        for (g, yg) in ys.iter().enumerate() {
            let (t, cs, cd, c0) = (x.rows as u64, r as i32, (groups * r) as i32, (g * r) as i32);
            launch!(
                self,
                op,
                "place_cols",
                elems(yg.len()),
                &*yg.buf,
                &t,
                &cs,
                &mut *y.buf,
                &cd,
                &c0
            )?;
        }
        Ok(y)
    }

    fn hc_pre(
        &self,
        x: &CudaTensor,
        f: &CudaTensor,
        base: &[f32],
        scale: &[f32],
        spec: &HcSpec,
    ) -> OpResult<(CudaTensor, Option<(CudaTensor, CudaTensor)>)> {
        let op = "hc_pre";
        // hc_pre_row keeps the (2 + n)·n mixes in shared memory: at most 6 streams.
        deepseek_v4_checks::hc_pre(x, f, base, scale, spec, 6)?;
        let (n, m) = (spec.streams, f.rows);
        let d = x.cols / n;
        let full = m != n;
        let mut col = self.uninit_tensor(op, x.rows, d)?;
        let mut post = self.uninit_tensor(op, x.rows, if full { n } else { 1 })?;
        let mut comb = self.uninit_tensor(op, x.rows, if full { n * n } else { 1 })?;
        let (base, scale) = (self.constant(op, base)?, self.constant(op, scale)?);
        // The products split over the columns (a block per HC_SPLIT of them and row), then the
        // rest, a block per HC_COLS columns of col and row.
        let splits = x.cols.div_ceil(HC_SPLIT);
        let parts = self.uninit_tensor(op, x.rows * splits, m + 1)?;
        let (ci, ni, mi, si, iters) = (
            x.cols as i32,
            n as i32,
            m as i32,
            splits as i32,
            spec.sinkhorn_iters as i32,
        );
        launch!(
            self,
            op,
            "hc_mix_parts",
            LaunchConfig {
                grid_dim: (splits as u32, x.rows as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
            &*x.buf,
            &ci,
            &*f.buf,
            &mi,
            &*parts.buf
        )?;
        launch!(
            self,
            op,
            "hc_pre_row",
            LaunchConfig {
                grid_dim: (x.rows as u32, d.div_ceil(HC_COLS) as u32, 1),
                block_dim: (HC_COLS as u32, 1, 1),
                shared_mem_bytes: 0,
            },
            &*x.buf,
            &ci,
            &ni,
            &*parts.buf,
            &si,
            &mi,
            &*base,
            &*scale,
            &spec.hc_eps,
            &spec.norm_eps,
            &iters,
            &mut *col.buf,
            &mut *post.buf,
            &mut *comb.buf
        )?;
        Ok((col, full.then_some((post, comb))))
    }

    fn hc_post(
        &self,
        x: &CudaTensor,
        out: &CudaTensor,
        post: &CudaTensor,
        comb: &CudaTensor,
    ) -> OpResult<CudaTensor> {
        let op = "hc_post";
        deepseek_v4_checks::hc_post(x, out, post, comb)?;
        let (n, t, d) = (post.cols, out.rows, out.cols);
        let mut y = self.uninit_tensor(op, t, n * d)?;
        let (tu, ni, di) = (t as u64, n as i32, d as i32);
        launch!(
            self,
            op,
            "hc_post",
            elems(y.len()),
            &*x.buf,
            &*out.buf,
            &*post.buf,
            &*comb.buf,
            &tu,
            &ni,
            &di,
            &mut *y.buf
        )?;
        Ok(y)
    }

    fn compress_pool(
        &self,
        kv: &CudaTensor,
        gate: &CudaTensor,
        ape: &CudaTensor,
        rate: usize,
        overlap: bool,
        prior: Option<(&CudaTensor, &CudaTensor)>,
    ) -> OpResult<CudaTensor> {
        let op = "compress_pool";
        deepseek_v4_checks::compress_pool(kv, gate, ape, rate, overlap, prior)?;
        let w = kv.cols;
        let d = if overlap { w / 2 } else { w };
        let n_win = kv.rows / rate;
        let mut out = self.uninit_tensor(op, n_win, d)?;
        let (pk, pg) = prior.map_or((0, 0), |(k, g)| (self.addr(&*k.buf), self.addr(&*g.buf)));
        let (ri, wi, oi, nw) = (rate as i32, w as i32, overlap as i32, n_win as u64);
        launch!(
            self,
            op,
            "compress_pool",
            elems(out.len()),
            &*kv.buf,
            &*gate.buf,
            &*ape.buf,
            &ri,
            &wi,
            &oi,
            &pk,
            &pg,
            &nw,
            &mut *out.buf
        )?;
        Ok(out)
    }

    fn attention_sparse(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        pos0: usize,
        shape: &AttnShape,
        entries: &CudaTensor,
        visible: &[Vec<usize>],
    ) -> OpResult<CudaTensor> {
        let sparse = Some((entries, visible));
        self.attention_with("attention_sparse", q, kv, pos0, shape, None, sparse)
    }

    /// The scores on the device (`index_scores`, a warp per (row, entry)), read back; the top-k
    /// per row on the host (ties to the lower entry), as the reference.
    fn index_top_k(
        &self,
        q: &CudaTensor,
        keys: &CudaTensor,
        weights: &CudaTensor,
        n_heads: usize,
        visible: &[usize],
        top_k: usize,
    ) -> OpResult<Vec<Vec<usize>>> {
        let op = "index_top_k";
        let d = keys.cols;
        check(
            op,
            n_heads > 0
                && q.cols == n_heads * d
                && weights.cols == n_heads
                && weights.rows == q.rows
                && visible.len() == q.rows
                && visible.iter().all(|&v| v <= keys.rows),
            || {
                format!(
                    "q rows of {} for {n_heads} heads of {d}, weights [{}, {}], {} visible \
                     counts for {} rows over {} keys",
                    q.cols,
                    weights.rows,
                    weights.cols,
                    visible.len(),
                    q.rows,
                    keys.rows
                )
            },
        )?;
        let n_keys = keys.rows;
        if n_keys == 0 || q.rows == 0 {
            return Ok(vec![Vec::new(); q.rows]);
        }
        let vis: Vec<i32> = visible.iter().map(|&v| v as i32).collect();
        let vis = self.to_device(op, &vis)?;
        let scores = self.uninit_tensor(op, q.rows, n_keys)?;
        let (ti, hi, di, ki) = (q.rows as i32, n_heads as i32, d as i32, n_keys as i32);
        launch!(
            self,
            op,
            "index_scores",
            warps(scores.len()),
            &*q.buf,
            &*keys.buf,
            &*weights.buf,
            &ti,
            &hi,
            &di,
            &ki,
            &vis,
            &*scores.buf
        )?;
        let all = self.read(&scores)?;
        Ok(all
            .chunks_exact(n_keys)
            .zip(visible)
            .map(|(s, &n)| {
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
                order.truncate(top_k.min(n));
                order.sort_unstable();
                order
            })
            .collect())
    }
}
