//! Quantized products: embedding rows, decode mat-vec and short products, the GLU MLP over experts, the head's argmax (kernels: quant.cu, qmv.cu; prefill GEMMs in gemm.rs).

use crate::*;

impl CudaBackend {
    pub(crate) fn embed(
        &self,
        table: &QRef,
        ids: &[u32],
        scale: Option<f32>,
    ) -> OpResult<CudaTensor> {
        let op = "embed";
        check(op, ids.iter().all(|&i| (i as usize) < table.rows), || {
            format!("a token id is outside the table's {} rows", table.rows)
        })?;
        let [wo, so, bo] = qref_offsets(op, table, self.resident.len())?;
        let d_ids = self.to_device(op, ids)?;
        let mut out = self.uninit_tensor(op, ids.len(), table.cols)?;
        let (cols, bits, group) = (
            table.cols as i32,
            table.bits as i32,
            table.group_size as i32,
        );
        let (n, s) = (ids.len() as u64, scale.unwrap_or(1.0));
        launch!(
            self,
            op,
            "qembed",
            elems(out.len()),
            &self.resident,
            &wo,
            &so,
            &bo,
            &cols,
            &bits,
            &group,
            &d_ids,
            &n,
            &s,
            &mut *out.buf
        )?;
        Ok(out)
    }

    pub(crate) fn matmul(
        &self,
        ws: &[&QRef],
        src: Weights,
        x: &CudaTensor,
    ) -> OpResult<Vec<CudaTensor>> {
        let op = "matmul";
        for w in ws {
            check(op, w.cols == x.cols, || {
                format!("a [{}, {}] matrix for rows of {}", w.rows, w.cols, x.cols)
            })?;
        }
        let ys = ws
            .iter()
            .map(|w| self.uninit_tensor(op, x.rows, w.rows))
            .collect::<OpResult<Vec<_>>>()?;
        self.with_weights(op, src, |buf, len| {
            let xa = self.addr(&*x.buf);
            let jobs: Vec<QJob> = ws
                .iter()
                .zip(&ys)
                .map(|(w, y)| QJob {
                    w,
                    buf,
                    len,
                    x: xa,
                    y: self.addr(&*y.buf),
                })
                .collect();
            self.products(op, &jobs, x.rows)
        })?;
        Ok(ys)
    }

    pub(crate) fn glu_mlp(
        &self,
        mlp: &Mlp,
        act: Act,
        src: Weights,
        x: &CudaTensor,
    ) -> OpResult<CudaTensor> {
        let op = "glu_mlp";
        check_mlp(op, mlp, x.cols)?;
        let mut g = self.uninit_tensor(op, x.rows, mlp.gate_proj.rows)?;
        let u = self.uninit_tensor(op, x.rows, mlp.up_proj.rows)?;
        let y = self.uninit_tensor(op, x.rows, mlp.down_proj.rows)?;
        self.with_weights(op, src, |buf, len| {
            let xa = self.addr(&*x.buf);
            let job = |w, x, y| QJob { w, buf, len, x, y };
            let pair = [
                job(&mlp.gate_proj, xa, self.addr(&*g.buf)),
                job(&mlp.up_proj, xa, self.addr(&*u.buf)),
            ];
            self.gated(op, act, &pair, x.rows, &mut g, &u)?;
            self.products(
                op,
                &[job(&mlp.down_proj, self.addr(&*g.buf), self.addr(&*y.buf))],
                x.rows,
            )
        })?;
        Ok(y)
    }

    pub(crate) fn glu_mlp_rows(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        x: &CudaTensor,
        out: &mut CudaTensor,
        rows: &[usize],
    ) -> OpResult<()> {
        let op = "glu_mlp_rows";
        check_glu_rows(op, mlp, srcs.len(), x, out, rows)?;
        let n = srcs.len();
        if n == 0 {
            return Ok(());
        }
        let src = self.sources(op, srcs)?;
        let at = &src.at;
        let (inner, h) = (mlp.gate_proj.rows, mlp.down_proj.rows);
        let mut g = self.uninit_tensor(op, n, inner)?;
        let u = self.uninit_tensor(op, n, inner)?;
        let (xa, ga, ua, oa) = (
            self.addr(&*x.buf),
            self.addr(&*g.buf),
            self.addr(&*u.buf),
            self.addr(&*out.buf),
        );
        let row = |base: u64, r: usize, width: usize| base + (4 * r * width) as u64;
        let job = |w, (buf, len): (u64, usize), x, y| QJob { w, buf, len, x, y };
        let mut gate_up = Vec::with_capacity(2 * n);
        for (j, &a) in at.iter().enumerate() {
            gate_up.push(job(&mlp.gate_proj, a, xa, row(ga, j, inner)));
            gate_up.push(job(&mlp.up_proj, a, xa, row(ua, j, inner)));
        }
        self.gated(op, act, &gate_up, 1, &mut g, &u)?;
        let down: Vec<QJob> = at
            .iter()
            .zip(rows)
            .enumerate()
            .map(|(j, (&a, &r))| job(&mlp.down_proj, a, row(ga, j, inner), row(oa, r, h)))
            .collect();
        self.products(op, &down, 1)?;
        self.after_reads(op, src)
    }

    pub(crate) fn glu_mlp_experts(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        xs: &[&CudaTensor],
    ) -> OpResult<Vec<CudaTensor>> {
        self.gemm_glu_experts(mlp, act, srcs, xs)
    }

    pub(crate) fn head_argmax(&self, w: &QRef, x: &CudaTensor) -> OpResult<(u32, f32)> {
        let op = "head_argmax";
        check(op, x.rows == 1 && x.cols == w.cols, || {
            format!(
                "expected one row of {}, got [{}, {}]",
                w.cols, x.rows, x.cols
            )
        })?;
        let logits = self.qmatmul(op, w, self.addr(&self.resident), self.resident.len(), x)?;
        let nparts = w.rows.div_ceil(ARGMAX_CHUNK).max(1);
        let mut parts = self
            .stream
            .alloc_zeros::<u32>(2 * nparts)
            .map_err(|e| self.dev(op, e))?;
        let mut out = self
            .stream
            .alloc_zeros::<u32>(2)
            .map_err(|e| self.dev(op, e))?;
        let (n, chunk) = (w.rows as i32, ARGMAX_CHUNK as i32);
        launch!(
            self,
            op,
            "argmax_parts",
            blocks(nparts, 1024),
            &*logits.buf,
            &n,
            &chunk,
            &mut parts
        )?;
        let np = nparts as i32;
        launch!(self, op, "argmax", blocks(1, 1024), &parts, &np, &mut out)?;
        let r = self.to_host(op, &out)?;
        Ok(if r[0] == u32::MAX {
            (0, f32::NAN)
        } else {
            (r[0], f32::from_bits(r[1]))
        })
    }

    /// `y[T, w.rows] = x · wᵀ` from the bytes at device address `buf` (`len` of them valid).
    pub(crate) fn qmatmul(
        &self,
        op: &'static str,
        w: &QRef,
        buf: u64,
        len: usize,
        x: &CudaTensor,
    ) -> OpResult<CudaTensor> {
        check(op, w.cols == x.cols, || {
            format!("a [{}, {}] matrix for rows of {}", w.rows, w.cols, x.cols)
        })?;
        // Every element is written by the kernel: no zeroing pass.
        let y = self.uninit_tensor(op, x.rows, w.rows)?;
        let job = QJob {
            w,
            buf,
            len,
            x: self.addr(&*x.buf),
            y: self.addr(&*y.buf),
        };
        self.products(op, &[job], x.rows)?;
        Ok(y)
    }

    /// Runs `jobs` (each `[t_rows, cols]` rows of x into `[t_rows, rows]` outputs; the caller
    /// gives every job an input and an output of that size), one `qmatmul` launch per shape and
    /// at most `QM_JOBS` jobs (one row of x: one `qmv` launch per columns, bits and group); products
    /// of `gemm::min_rows()` or more rows run on `qgemm_tc`
    /// instead where it takes the shape (`gemm.rs`).
    pub(crate) fn products(&self, op: &'static str, jobs: &[QJob], t_rows: usize) -> OpResult<()> {
        let rest;
        let jobs = if t_rows >= super::gemm::min_rows() {
            rest = self.gemm_products(op, jobs, t_rows)?;
            &rest[..]
        } else {
            jobs
        };
        // One row of x: products of any row counts share a `qmv` launch (rows per job).
        let one = t_rows == 1;
        let shape = |w: &QRef| {
            (
                if one { 0 } else { w.rows },
                w.cols,
                w.bits as usize,
                w.group_size,
            )
        };
        let mut shapes: Vec<(usize, usize, usize, usize)> =
            jobs.iter().map(|j| shape(j.w)).collect();
        shapes.sort_unstable();
        shapes.dedup();
        for sh in shapes {
            let (rows, cols, bits, group) = sh;
            let same: Vec<&QJob> = jobs.iter().filter(|j| shape(j.w) == sh).collect();
            // Rows of x start 16-byte aligned (the kernels read them as float2/float4).
            check_qshape(op, same[0].w)?;
            for chunk in same.chunks(QM_JOBS) {
                let a = qjobs(op, chunk.iter().copied())?;
                let (ri, ci, bi, gi) = (rows as i32, cols as i32, bits as i32, group as i32);
                if one {
                    let lanes = qmv_lanes(cols, bits);
                    let li = lanes as i32;
                    let mut jr = QvRows::default();
                    for (r, j) in jr.rows.iter_mut().zip(chunk) {
                        *r = j.w.rows as i32;
                    }
                    let most = chunk.iter().map(|j| j.w.rows).max().unwrap_or(0);
                    let (cfg, passes) = qmv_grid(most, cols, bits, lanes, chunk.len(), 1);
                    launch!(
                        self,
                        op,
                        qmv_kernel(
                            ["qmv2", "qmv4", "qmv8"],
                            ["qmv2_p", "qmv4_p", "qmv8_p"],
                            bits,
                            passes
                        ),
                        cfg,
                        &a,
                        &jr,
                        &ci,
                        &gi,
                        &li
                    )?;
                    continue;
                }
                let blocks = rows.div_ceil(QM_ROWS);
                let tiles = t_rows.div_ceil(QM_TT).max(1);
                let z = QM_BLOCKS
                    .div_ceil(blocks * chunk.len())
                    .clamp(1, tiles.min(65535));
                let ti = t_rows as i32;
                launch!(
                    self,
                    op,
                    "qmatmul",
                    LaunchConfig {
                        grid_dim: (blocks as u32, chunk.len() as u32, z as u32),
                        block_dim: (32 * QM_ROWS as u32, 1, 1),
                        shared_mem_bytes: 0,
                    },
                    &a,
                    &ri,
                    &ci,
                    &bi,
                    &gi,
                    &ti
                )?;
            }
        }
        Ok(())
    }

    /// `g ← act(g) ⊙ u` over every element.
    /// `g ← act(x·gateᵀ) ⊙ (x·upᵀ)` for `jobs` = gate, up, gate, up, ... (each pair with one x;
    /// the gate job's output rows are in `g`, the up job's in `u`): for one row of x, when every
    /// pair fuses ([`pairs_fuse`]) and the pairs share one shape, one `qmv_glu` launch per 16
    /// pairs (the same sums, `u` unused); else the products, then `glu_act`.
    pub(crate) fn gated(
        &self,
        op: &'static str,
        act: Act,
        jobs: &[QJob],
        t_rows: usize,
        g: &mut CudaTensor,
        u: &CudaTensor,
    ) -> OpResult<()> {
        let shape = |w: &QRef| (w.rows, w.cols, w.bits, w.group_size);
        let mut codes = Vec::with_capacity(jobs.len());
        for j in jobs {
            codes.push(j.buf + qref_offsets(op, j.w, j.len)?[0]);
        }
        // Every gate of one shape, every up of one shape (a launch takes one group size of each).
        let fused = t_rows == 1
            && jobs.len().is_multiple_of(2)
            && jobs
                .chunks(2)
                .all(|p| shape(p[0].w) == shape(jobs[0].w) && shape(p[1].w) == shape(jobs[1].w))
            && jobs
                .chunks(2)
                .zip(codes.chunks(2))
                .all(|(p, c)| pairs_fuse(p[0].w, p[1].w, c[0], c[1]));
        if !fused {
            self.products(op, jobs, t_rows)?;
            return self.glu_act(op, act, g, u);
        }
        let (w, up) = (jobs[0].w, jobs[1].w);
        check_qshape(op, w)?;
        check_qshape(op, up)?;
        let (rows, cols, bits) = (w.rows, w.cols, w.bits as usize);
        let lanes = qmv_lanes(cols, bits);
        let (code, limit) = act_code(act);
        let (ri, ci, gi, ui, li) = (
            rows as i32,
            cols as i32,
            w.group_size as i32,
            up.group_size as i32,
            lanes as i32,
        );
        for chunk in jobs.chunks(QM_JOBS) {
            let a = qjobs(op, chunk.iter())?;
            let (cfg, passes) = qmv_grid(rows, cols, bits, lanes, chunk.len() / 2, 2);
            launch!(
                self,
                op,
                qmv_kernel(
                    ["qmv_glu2", "qmv_glu4", "qmv_glu8"],
                    ["qmv_glu2_p", "qmv_glu4_p", "qmv_glu8_p"],
                    bits,
                    passes
                ),
                cfg,
                &a,
                &ri,
                &ci,
                &gi,
                &ui,
                &li,
                &code,
                &limit
            )?;
        }
        Ok(())
    }

    pub(crate) fn glu_act(
        &self,
        op: &'static str,
        act: Act,
        g: &mut CudaTensor,
        u: &CudaTensor,
    ) -> OpResult<()> {
        let (code, limit) = act_code(act);
        let n = g.len() as u64;
        launch!(
            self,
            op,
            "glu_act",
            elems(g.len()),
            &mut *g.buf,
            &*u.buf,
            &n,
            &code,
            &limit
        )
    }

    /// One `qmv_ids` launch: `jobs` (matrix index 0/1 into `mats`, place among the ids at
    /// `ids`, input rows, output rows; one row of x each) over expert blobs of `stride` bytes
    /// whose addresses by expert id are at `slots`. The matrices share one shape. With `glu`, one
    /// `qmv_glu_ids` launch instead: each job's output row is act(gate row) ⊙ (up row) of `mats`
    /// = [gate, up] (which share their alignment modulo 8; the matrix index is unused).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn products_by_id(
        &self,
        op: &'static str,
        mats: &[&QRef],
        jobs: &[(usize, usize, u64, u64)],
        slots: u64,
        ids: u64,
        stride: usize,
        glu: Option<Act>,
    ) -> OpResult<()> {
        let w = mats[0];
        // A gated pair may differ in group size (`up_group`); products by matrix may not.
        let same_group = glu.is_some() || mats.iter().all(|m| m.group_size == w.group_size);
        check(
            op,
            jobs.len() <= QM_JOBS
                && mats.len() <= 2
                && w.cols.is_multiple_of(32)
                && matches!(w.bits, 2 | 4 | 8)
                && mats.iter().all(|m| {
                    (m.rows, m.cols, m.bits) == (w.rows, w.cols, w.bits)
                        && m.group_size.is_power_of_two()
                })
                && same_group,
            || {
                format!(
                    "{} products of {} matrices of one shape",
                    jobs.len(),
                    mats.len()
                )
            },
        )?;
        let mut a = QIdJobs::default();
        for (i, m) in mats.iter().enumerate() {
            [a.w_off[i], a.s_off[i], a.b_off[i]] = qref_offsets(op, m, stride)?;
        }
        for (i, &(mat, pick, x, y)) in jobs.iter().enumerate() {
            a.mat[i] = mat as i32;
            a.pick[i] = pick as i32;
            a.x[i] = x;
            a.y[i] = y;
        }
        let lanes = qmv_lanes(w.cols, w.bits as usize);
        let (ri, ci, gi, li) = (
            w.rows as i32,
            w.cols as i32,
            w.group_size as i32,
            lanes as i32,
        );
        let nm = if glu.is_some() { 2 } else { 1 };
        let (cfg, passes) = qmv_grid(w.rows, w.cols, w.bits as usize, lanes, jobs.len(), nm);
        match glu {
            None => launch!(
                self,
                op,
                qmv_kernel(
                    ["qmv_ids2", "qmv_ids4", "qmv_ids8"],
                    ["qmv_ids2_p", "qmv_ids4_p", "qmv_ids8_p"],
                    w.bits as usize,
                    passes
                ),
                cfg,
                &a,
                &slots,
                &ids,
                &ri,
                &ci,
                &gi,
                &li
            ),
            Some(act) => {
                let (code, limit) = act_code(act);
                let ui = mats[mats.len() - 1].group_size as i32;
                launch!(
                    self,
                    op,
                    qmv_kernel(
                        ["qmv_glu_ids2", "qmv_glu_ids4", "qmv_glu_ids8"],
                        ["qmv_glu_ids2_p", "qmv_glu_ids4_p", "qmv_glu_ids8_p"],
                        w.bits as usize,
                        passes
                    ),
                    cfg,
                    &a,
                    &slots,
                    &ids,
                    &ri,
                    &ci,
                    &gi,
                    &ui,
                    &li,
                    &code,
                    &limit
                )
            }
        }
    }
}
