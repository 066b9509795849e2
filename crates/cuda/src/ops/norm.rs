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
            blocks(x.len() / dim, 256),
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
        same_shape(op, x, y)?;
        check(op, dim > 0 && x.cols.is_multiple_of(dim), || {
            format!("pieces of {dim} in rows of {}", x.cols)
        })?;
        check(op, pre.len() <= PRE_NORMS, || {
            format!("{} pre-norms, at most {PRE_NORMS} in one launch", pre.len())
        })?;
        // Mode -1: the plain residual add.
        let (mode, w_off, c) = match post {
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
        let (d, cols) = (dim as i32, x.cols as u64);
        launch!(
            self,
            op,
            "rms_norm_add_pre",
            blocks(x.len() / dim, 256),
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
            blocks(x.len() / dim, 256),
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
