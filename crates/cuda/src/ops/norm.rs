//! RMSNorm and its fused forms (with the residual add, the next pre-norms, RoPE).

use crate::*;

impl CudaBackend {
    pub(crate) fn rms_norm(
        &self,
        x: &mut CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
    ) -> OpResult<()> {
        self.rms_norm_impl("rms_norm", None, x, dim, norm, eps)
    }

    pub(crate) fn rms_norm_to(
        &self,
        x: &CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
    ) -> OpResult<CudaTensor> {
        let mut y = self.uninit_tensor("rms_norm_to", x.rows, x.cols)?;
        self.rms_norm_impl("rms_norm_to", Some(x), &mut y, dim, norm, eps)?;
        Ok(y)
    }

    pub(crate) fn add_rms_norm(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
        s: f32,
    ) -> OpResult<()> {
        let op = "add_rms_norm";
        same_shape(op, x, y)?;
        check(op, dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        let (mode, w_off, c) = self.norm_args(op, norm, dim)?;
        let d = dim as i32;
        launch!(
            self,
            op,
            "rms_norm_add",
            norm_blocks(op, x.len() / dim, dim)?,
            &*y.buf,
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps,
            &s
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_rms_norm_pre(
        &self,
        x: &mut CudaTensor,
        y: &CudaTensor,
        dim: usize,
        post: Option<Norm>,
        eps: f32,
        s: f32,
        pre: &[PreNorm],
    ) -> OpResult<Vec<CudaTensor>> {
        let op = "add_rms_norm_pre";
        let ((mode, w_off, c), args, outs) = self.pre_args(op, x, y, dim, post, pre)?;
        let (d, cols) = (dim as i32, x.cols as u64);
        launch!(
            self,
            op,
            "rms_norm_add_pre",
            norm_blocks(op, x.len() / dim, dim)?,
            &*y.buf,
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps,
            &s,
            &cols,
            &args
        )?;
        Ok(outs)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_rms_norm2_pre(
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
        let op = "add_rms_norm2_pre";
        same_shape(op, a, b)?;
        let ((mode, w_off, c), args, outs) = self.pre_args(op, x, a, dim, post, pre)?;
        let (am, aw, ac) = self.norm_args(op, a_norm, dim)?;
        let (bm, bw, bc) = self.norm_args(op, b_norm, dim)?;
        let (d, cols) = (dim as i32, x.cols as u64);
        launch!(
            self,
            op,
            "rms_norm2_add_pre",
            norm_blocks(op, x.len() / dim, dim)?,
            &mut *a.buf,
            &*b.buf,
            &mut *x.buf,
            &d,
            &am,
            &aw,
            &ac,
            &bm,
            &bw,
            &bc,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps,
            &s,
            &cols,
            &args
        )?;
        Ok(outs)
    }

    /// The shared checks and arguments of the `*_add_pre` kernels: the post-norm's mode, weight
    /// offset and constant (mode -1: none, the plain residual add), the pre-norms and their new
    /// output tensors.
    #[allow(clippy::type_complexity)]
    fn pre_args(
        &self,
        op: &'static str,
        x: &CudaTensor,
        y: &CudaTensor,
        dim: usize,
        post: Option<Norm>,
        pre: &[PreNorm],
    ) -> OpResult<((i32, u64, f32), PreNorms, Vec<CudaTensor>)> {
        same_shape(op, x, y)?;
        check(op, dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        check(op, pre.len() <= PRE_NORMS, || {
            format!("{} pre-norms, at most {PRE_NORMS} in one launch", pre.len())
        })?;
        let post = match post {
            Some(post) => self.norm_args(op, post, dim)?,
            None => (-1, 0, 1.0),
        };
        let mut args = PreNorms {
            n: pre.len() as i32,
            ..Default::default()
        };
        let mut outs = Vec::with_capacity(pre.len());
        for (o, p) in pre.iter().enumerate() {
            let t = self.uninit_tensor(op, x.rows, x.cols)?;
            let (m, w, k) = self.norm_args(op, p.norm, dim)?;
            (args.out[o], args.mode[o], args.w_off[o], args.c[o]) = (self.addr(&*t.buf), m, w, k);
            if let Some((v, k)) = p.cols {
                (args.col_off[o], args.col_c[o], args.has_col[o]) =
                    (self.vref(op, v, x.cols)?, k, 1);
            }
            outs.push(t);
        }
        Ok((post, args, outs))
    }

    pub(crate) fn rms_norm_rope(
        &self,
        x: &mut CudaTensor,
        norm: Norm,
        eps: f32,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
    ) -> OpResult<()> {
        let op = "rms_norm_rope";
        let Some((freq, style)) = self.rope_args(op, x, rope, head_dim)? else {
            return self.rms_norm_impl(op, None, x, head_dim, norm, eps);
        };
        check(op, head_dim <= 512, || {
            format!("heads of {head_dim} (at most 512)")
        })?;
        let (mode, w_off, c) = self.norm_args(op, norm, head_dim)?;
        let heads = x.cols / head_dim;
        let (d, hs, rot, p0) = (
            head_dim as i32,
            heads as i32,
            rope.rotated as i32,
            pos0 as i32,
        );
        launch!(
            self,
            op,
            "rms_norm_rope",
            blocks(x.rows * heads, 128),
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps,
            &hs,
            &rot,
            &style,
            &*freq,
            &p0,
            &rope.mscale
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_rope_kv(
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
        let op = "rms_norm_rope_kv";
        same_shape(op, k, v)?;
        let w = kv.width();
        check(
            op,
            q.rows == k.rows
                && k.cols == w
                && head_dim > 0
                && head_dim <= 512
                && q.cols.is_multiple_of(head_dim)
                && w.is_multiple_of(head_dim),
            || {
                format!(
                    "q [{}, {}], k and v [{}, {}] in heads of {head_dim} (at most 512) into KV \
                     rows of {w}",
                    q.rows, q.cols, k.rows, k.cols
                )
            },
        )?;
        super::attention::check_kv_room(op, kv, pos0, k.rows)?;
        let Some((freq, style)) = self.rope_args(op, q, rope, head_dim)? else {
            // No rotation: the separate ops.
            self.rms_norm_impl(op, None, q, head_dim, q_norm, eps)?;
            self.rms_norm_impl(op, None, k, head_dim, k_norm, eps)?;
            if let Some(n) = v_norm {
                self.rms_norm_impl(op, None, v, head_dim, n, eps)?;
            }
            return self.kv_write(kv, pos0, k, v);
        };
        let mut n = QkvNorms::default();
        for (i, norm) in [Some(q_norm), Some(k_norm), v_norm].into_iter().enumerate() {
            (n.mode[i], n.w_off[i], n.c[i]) = match norm {
                Some(norm) => self.norm_args(op, norm, head_dim)?,
                None => (-1, 0, 1.0),
            };
        }
        let (hq, hk) = (q.cols / head_dim, w / head_dim);
        let ints = [head_dim, hq, hk, rope.rotated, pos0, k.rows, kv.rows].map(|v| v as i32);
        let [d, hqi, hki, rot, p0, t, rows] = ints;
        let ring = kv.ring as i32;
        let (kernel, ks, vs) = self.kv_ptrs(kv, "rms_norm_rope_kv_f16", "rms_norm_rope_kv_f32");
        launch!(
            self,
            op,
            kernel,
            blocks(q.rows * (hq + hk), 128),
            &mut *q.buf,
            &mut *k.buf,
            &mut *v.buf,
            &d,
            &hqi,
            &hki,
            &n,
            &self.resident,
            &eps,
            &rot,
            &style,
            &*freq,
            &p0,
            &rope.mscale,
            &ks,
            &vs,
            &t,
            &rows,
            &ring
        )
    }

    /// The `rms_norm` kernels' mode, weight offset and constant for `norm` over `dim` values.
    pub(crate) fn norm_args(
        &self,
        op: &'static str,
        norm: Norm,
        dim: usize,
    ) -> OpResult<(i32, u64, f32)> {
        Ok(match norm {
            Norm::NoScale => (0, 0, 1.0),
            Norm::Weight(w) => (1, self.vref(op, w, dim)?, 1.0),
            Norm::OnePlusWeight(w) => (2, self.vref(op, w, dim)?, 1.0),
            Norm::Scaled(c) => (3, 0, c),
        })
    }

    /// RMSNorm of `src`'s pieces into `x` (`src = None`: in place); the shapes are equal.
    pub(crate) fn rms_norm_impl(
        &self,
        op: &'static str,
        src: Option<&CudaTensor>,
        x: &mut CudaTensor,
        dim: usize,
        norm: Norm,
        eps: f32,
    ) -> OpResult<()> {
        check(op, dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        let (mode, w_off, c) = self.norm_args(op, norm, dim)?;
        let d = dim as i32;
        let from = self.addr(&*src.unwrap_or(&*x).buf);
        launch!(
            self,
            op,
            "rms_norm",
            norm_blocks(op, x.len() / dim, dim)?,
            &from,
            &mut *x.buf,
            &d,
            &mode,
            &self.resident,
            &w_off,
            &c,
            &eps
        )
    }
}

/// Values a thread of a norm kernel holds in registers (ops/norm.cu `NORM_J`).
const NORM_J: usize = 16;

/// One block per piece of `dim` values for the row norms: 256 threads (pieces up to 4,096
/// values), or 1,024 for longer pieces (up to 16,384; longer ones are refused). The thread count
/// sets the order of the sums, so every row-norm kernel takes it from here: the fused kernels
/// give the separate ones' bits.
fn norm_blocks(op: &'static str, pieces: usize, dim: usize) -> OpResult<LaunchConfig> {
    let threads = if dim <= 256 * NORM_J { 256 } else { 1024 };
    check(op, dim <= threads * NORM_J, || {
        format!("pieces of {dim} values (at most {})", 1024 * NORM_J)
    })?;
    Ok(blocks(pieces, threads as u32))
}
