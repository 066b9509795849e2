//! Data in and out, and the elementwise maps (kernels: elementwise.cu).

use crate::*;

impl CudaBackend {
    pub(crate) fn upload(&self, data: &[f32], cols: usize) -> OpResult<CudaTensor> {
        check(
            "upload",
            cols > 0 && data.len().is_multiple_of(cols),
            || format!("{} values do not fill rows of {cols}", data.len()),
        )?;
        let buf = self.to_device("upload", data)?;
        Ok(self.wrap(buf, data.len() / cols, cols))
    }

    pub(crate) fn zeros(&self, rows: usize, cols: usize) -> OpResult<CudaTensor> {
        check("zeros", cols > 0, || "zero columns".into())?;
        self.tensor("zeros", rows, cols)
    }

    pub(crate) fn copy(&self, x: &CudaTensor) -> OpResult<CudaTensor> {
        let mut y = self.uninit_tensor("copy", x.rows, x.cols)?;
        self.stream
            .memcpy_dtod(&*x.buf, &mut *y.buf)
            .map_err(|e| self.dev("copy", e))?;
        Ok(y)
    }

    pub(crate) fn read(&self, x: &CudaTensor) -> OpResult<Vec<f32>> {
        self.to_host("read", &*x.buf)
    }

    /// [`CoreOps::read_many`]: the tensors joined on the device by one `join_parts` launch, then
    /// one readback.
    pub(crate) fn read_many(&self, xs: &[&CudaTensor]) -> OpResult<Vec<Vec<f32>>> {
        let op = "read_many";
        if xs.len() < 2 {
            return xs.iter().map(|x| self.read(x)).collect();
        }
        let mut tab: Vec<u64> = xs.iter().map(|x| self.addr(&*x.buf)).collect();
        let mut off = 0u64;
        tab.push(0);
        for x in xs {
            off += x.len() as u64;
            tab.push(off);
        }
        if off == 0 {
            return Ok(vec![Vec::new(); xs.len()]);
        }
        let mut out = self.uninit_tensor(op, 1, off as usize)?;
        let (table, n) = (self.to_device(op, &tab)?, xs.len() as u64);
        launch!(
            self,
            op,
            "join_parts",
            blocks(xs.len().min(1 << 16), 128),
            &table,
            &n,
            &mut *out.buf
        )?;
        let joined = self.read(&out)?;
        Ok(tab[xs.len()..]
            .windows(2)
            .map(|w| joined[w[0] as usize..w[1] as usize].to_vec())
            .collect())
    }

    pub(crate) fn all_finite(&self, x: &CudaTensor) -> OpResult<bool> {
        let op = "all_finite";
        let mut flag = self
            .stream
            .alloc_zeros::<i32>(1)
            .map_err(|e| self.dev(op, e))?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "all_finite",
            elems(x.len()),
            &*x.buf,
            &n,
            &mut flag
        )?;
        Ok(self.to_host(op, &flag)?[0] == 0)
    }

    pub(crate) fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> OpResult<CudaTensor> {
        let op = "gather_rows";
        check(op, rows.iter().all(|&r| r < x.rows), || {
            format!("a row index is outside {} rows", x.rows)
        })?;
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.to_device(op, &idx)?;
        let mut out = self.uninit_tensor(op, rows.len(), x.cols)?;
        let (cols, n) = (x.cols as u64, rows.len() as u64);
        launch!(
            self,
            op,
            "gather_rows",
            elems(out.len()),
            &*x.buf,
            &cols,
            &idx,
            &n,
            &mut *out.buf
        )?;
        Ok(out)
    }

    /// [`CoreOps::gather_rows_many`]: every list's rows in one `gather_rows_many` launch.
    pub(crate) fn gather_rows_many(
        &self,
        x: &CudaTensor,
        rows: &[&[usize]],
    ) -> OpResult<Vec<CudaTensor>> {
        let op = "gather_rows_many";
        check(
            op,
            rows.iter().flat_map(|r| r.iter()).all(|&r| r < x.rows),
            || format!("a row index is outside {} rows", x.rows),
        )?;
        let outs = rows
            .iter()
            .map(|r| self.uninit_tensor(op, r.len(), x.cols))
            .collect::<OpResult<Vec<_>>>()?;
        let n: usize = rows.iter().map(|r| r.len()).sum();
        if n == 0 {
            return Ok(outs);
        }
        // Destination row addresses, then source rows.
        let mut tab = Vec::with_capacity(2 * n);
        for (r, o) in rows.iter().zip(&outs) {
            let base = self.addr(&*o.buf);
            tab.extend((0..r.len()).map(|j| base + (4 * j * x.cols) as u64));
        }
        tab.extend(rows.iter().flat_map(|r| r.iter()).map(|&r| r as u64));
        let tab = self.to_device(op, &tab)?;
        let (cols, nr) = (x.cols as u64, n as u64);
        launch!(
            self,
            op,
            "gather_rows_many",
            elems(n * x.cols),
            &*x.buf,
            &cols,
            &tab,
            &nr
        )?;
        Ok(outs)
    }

    pub(crate) fn split(
        &self,
        x: &CudaTensor,
        group: usize,
        parts: &[usize],
    ) -> OpResult<Vec<CudaTensor>> {
        let op = "split";
        check(
            op,
            group > 0 && parts.iter().sum::<usize>() == group && x.cols.is_multiple_of(group),
            || format!("parts {parts:?} of groups of {group} in rows of {}", x.cols),
        )?;
        let n_groups = (x.len() / group) as u64;
        let per_row = x.cols / group;
        let mut out = Vec::with_capacity(parts.len());
        // One `split_parts` launch per SPLIT_PARTS parts (one launch for the families' splits).
        let mut off = 0usize;
        for chunk in parts.chunks(SPLIT_PARTS) {
            let mut sp = SplitParts::default();
            for (i, &p) in chunk.iter().enumerate() {
                let t = self.uninit_tensor(op, x.rows, per_row * p)?;
                sp.out[i] = self.addr(&*t.buf);
                sp.off[i] = off as i32;
                sp.len[i] = p as i32;
                off += p;
                out.push(t);
            }
            sp.n = chunk.len() as i32;
            let g = group as i32;
            launch!(
                self,
                op,
                "split_parts",
                elems(x.len()),
                &*x.buf,
                &n_groups,
                &g,
                &sp
            )?;
        }
        Ok(out)
    }

    pub(crate) fn unary(&self, x: &mut CudaTensor, op: Unary) -> OpResult<()> {
        let (code, a, b) = match op {
            Unary::Scale(c) => (0i32, c, 0.0f32),
            Unary::Softcap(c) => (1, c, 0.0),
            Unary::Clamp(lo, hi) => (2, lo, hi),
            Unary::Silu => (3, 0.0, 0.0),
            Unary::GeluTanh => (4, 0.0, 0.0),
            Unary::Sigmoid => (5, 0.0, 0.0),
        };
        let n = x.len() as u64;
        launch!(
            self,
            "unary",
            "unary",
            elems(x.len()),
            &mut *x.buf,
            &n,
            &code,
            &a,
            &b
        )
    }

    pub(crate) fn matmul_bf16(
        &self,
        w: &VRef,
        rows: usize,
        x: &CudaTensor,
    ) -> OpResult<CudaTensor> {
        let op = "matmul_bf16";
        let off = self.vref(op, w, rows * x.cols)?;
        let mut out = self.tensor(op, x.rows(), rows)?;
        let (t, r, c) = (x.rows() as u64, rows as u64, x.cols as u64);
        launch!(
            self,
            op,
            "matmul_bf16",
            dot_blocks(out.len()),
            &*x.buf,
            &t,
            &r,
            &c,
            &self.resident,
            &off,
            &mut *out.buf
        )?;
        Ok(out)
    }

    pub(crate) fn linear(&self, x: &CudaTensor, w: &CudaTensor) -> OpResult<CudaTensor> {
        let op = "linear";
        check(op, x.cols == w.cols, || {
            format!(
                "rows of {} against a weight [{}, {}]",
                x.cols, w.rows, w.cols
            )
        })?;
        let mut out = self.tensor(op, x.rows, w.rows)?;
        let (t, r, c) = (x.rows as u64, w.rows as u64, x.cols as u64);
        launch!(
            self,
            op,
            "linear",
            dot_blocks(out.len()),
            &*x.buf,
            &*w.buf,
            &t,
            &r,
            &c,
            &mut *out.buf
        )?;
        Ok(out)
    }

    pub(crate) fn set_rows(
        &self,
        dst: &mut CudaTensor,
        row0: usize,
        src: &CudaTensor,
    ) -> OpResult<()> {
        let op = "set_rows";
        check(
            op,
            dst.cols == src.cols && row0 + src.rows <= dst.rows,
            || {
                format!(
                    "[{}, {}] at row {row0} of [{}, {}]",
                    src.rows, src.cols, dst.rows, dst.cols
                )
            },
        )?;
        let at = row0 * dst.cols;
        let mut view = dst.buf.slice_mut(at..at + src.len());
        self.stream
            .memcpy_dtod(&*src.buf, &mut view)
            .map_err(|e| self.dev(op, e))
    }

    pub(crate) fn mul_cols(&self, x: &mut CudaTensor, w: &VRef, c: f32) -> OpResult<()> {
        let op = "mul_cols";
        let off = self.vref(op, w, x.cols)?;
        let (n, cols) = (x.len() as u64, x.cols as u64);
        launch!(
            self,
            op,
            "mul_cols",
            elems(x.len()),
            &mut *x.buf,
            &n,
            &cols,
            &self.resident,
            &off,
            &c
        )
    }

    pub(crate) fn mul_sigmoid(&self, x: &mut CudaTensor, g: &CudaTensor) -> OpResult<()> {
        let op = "mul_sigmoid";
        same_shape(op, x, g)?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "mul_sigmoid",
            elems(x.len()),
            &mut *x.buf,
            &*g.buf,
            &n
        )
    }

    pub(crate) fn mul_rows_sigmoid(&self, x: &mut CudaTensor, g: &CudaTensor) -> OpResult<()> {
        let op = "mul_rows_sigmoid";
        check(op, g.cols == 1 && g.rows == x.rows, || {
            format!("gate [{}, {}] for {} rows", g.rows, g.cols, x.rows)
        })?;
        let (n, cols) = (x.len() as u64, x.cols as u64);
        launch!(
            self,
            op,
            "mul_rows_sigmoid",
            elems(x.len()),
            &mut *x.buf,
            &*g.buf,
            &n,
            &cols
        )
    }

    pub(crate) fn add(&self, x: &mut CudaTensor, y: &CudaTensor, s: f32) -> OpResult<()> {
        let op = "add";
        same_shape(op, x, y)?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "add_scaled",
            elems(x.len()),
            &mut *x.buf,
            &*y.buf,
            &n,
            &s
        )
    }

    pub(crate) fn scatter_add(
        &self,
        acc: &mut CudaTensor,
        y: &CudaTensor,
        rows: &[(usize, f32)],
    ) -> OpResult<()> {
        let op = "scatter_add";
        let (h, n) = (acc.cols, acc.rows);
        check(
            op,
            y.cols == h && y.rows == rows.len() && rows.iter().all(|&(r, _)| r < n),
            || format!("[{}, {}] rows into [{n}, {h}]", y.rows, y.cols),
        )?;
        if rows.is_empty() {
            return Ok(());
        }
        let cols = h as u64;
        let ya = self.addr(&*y.buf);
        for (ci, chunk) in rows.chunks(SCATTER_PAIRS).enumerate() {
            let mut p = Pairs {
                rows: [0; SCATTER_PAIRS],
                w: [0.0; SCATTER_PAIRS],
            };
            for (i, &(r, w)) in chunk.iter().enumerate() {
                p.rows[i] = r as u32;
                p.w[i] = w;
            }
            let (np, yc) = (chunk.len() as i32, ya + (4 * ci * SCATTER_PAIRS * h) as u64);
            launch!(
                self,
                op,
                "scatter_add",
                elems(h),
                &mut *acc.buf,
                &yc,
                &p,
                &np,
                &cols
            )?;
        }
        Ok(())
    }

    /// [`CoreOps::scatter_add_many`]: every output's rows in one `scatter_add_many` launch, each
    /// row of `acc` taking its terms in the order of `ys` (a row appears at most once per list).
    pub(crate) fn scatter_add_many(
        &self,
        acc: &mut CudaTensor,
        ys: &[&CudaTensor],
        rows: &[&[(usize, f32)]],
    ) -> OpResult<()> {
        let op = "scatter_add_many";
        let (h, n) = (acc.cols, acc.rows);
        check(op, ys.len() == rows.len(), || {
            format!("{} outputs for {} row lists", ys.len(), rows.len())
        })?;
        let mut per_row: Vec<Vec<(u64, f32)>> = vec![Vec::new(); n];
        for (y, r) in ys.iter().zip(rows) {
            check(
                op,
                y.cols == h && y.rows == r.len() && r.iter().all(|&(t, _)| t < n),
                || format!("[{}, {}] rows into [{n}, {h}]", y.rows, y.cols),
            )?;
            let base = self.addr(&*y.buf);
            for (j, &(t, w)) in r.iter().enumerate() {
                per_row[t].push((base + (4 * j * h) as u64, w));
            }
        }
        let terms: usize = per_row.iter().map(Vec::len).sum();
        if terms == 0 {
            return Ok(());
        }
        // Row offsets (n + 1), then each term's row address, then its weight's bits.
        let mut tab = Vec::with_capacity(n + 1 + 2 * terms);
        let mut at = 0u64;
        tab.push(0);
        for r in &per_row {
            at += r.len() as u64;
            tab.push(at);
        }
        tab.extend(per_row.iter().flatten().map(|&(a, _)| a));
        tab.extend(per_row.iter().flatten().map(|&(_, w)| w.to_bits() as u64));
        let tab = self.to_device(op, &tab)?;
        let (nn, cols, nt) = (n as u64, h as u64, terms as u64);
        launch!(
            self,
            op,
            "scatter_add_many",
            elems(n * h),
            &mut *acc.buf,
            &nn,
            &cols,
            &tab,
            &nt
        )
    }
}
