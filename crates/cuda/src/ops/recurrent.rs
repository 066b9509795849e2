//! The recurrent ops: the causal convs (Gated DeltaNet's, Inkling's), DeltaNet's gates, delta
//! rule and gated norm (kernels: recurrent.cu).

use crate::*;

impl RecurrentOps for CudaBackend {
    fn rms_norm_gated(
        &self,
        x: &mut CudaTensor,
        dim: usize,
        w: &VRef,
        z: &CudaTensor,
        eps: f32,
    ) -> OpResult<()> {
        let op = "rms_norm_gated";
        same_shape(op, x, z)?;
        self.rms_norm_impl(op, None, x, dim, Norm::Weight(w), eps)?;
        let n = x.len() as u64;
        launch!(
            self,
            op,
            "mul_silu",
            elems(x.len()),
            &mut *x.buf,
            &*z.buf,
            &n
        )
    }

    fn new_state(&self, len: usize) -> OpResult<CudaState> {
        Ok(CudaState {
            buf: self.zeros_f32("new_state", len)?,
        })
    }

    fn zero_state(&self, s: &mut CudaState) -> OpResult<()> {
        self.stream
            .memset_zeros(&mut s.buf)
            .map_err(|e| self.dev("zero_state", e))
    }

    fn state_bytes(&self, s: &CudaState) -> usize {
        4 * s.buf.len()
    }

    fn conv1d_silu(
        &self,
        x: &CudaTensor,
        state: &mut CudaState,
        w: &CudaTensor,
        kernel: usize,
    ) -> OpResult<CudaTensor> {
        self.conv1d_causal("conv1d_silu", x, state, w, kernel, true)
    }

    fn conv1d(
        &self,
        x: &CudaTensor,
        state: &mut CudaState,
        w: &CudaTensor,
        kernel: usize,
    ) -> OpResult<CudaTensor> {
        self.conv1d_causal("conv1d", x, state, w, kernel, false)
    }

    fn delta_gates(
        &self,
        b: &CudaTensor,
        alpha: &CudaTensor,
        a: &CudaTensor,
        dt_bias: &CudaTensor,
    ) -> OpResult<(CudaTensor, CudaTensor)> {
        let op = "delta_gates";
        same_shape(op, b, alpha)?;
        let nv = b.cols;
        check(op, a.len() == nv && dt_bias.len() == nv, || {
            format!("a / dt_bias for {nv} heads")
        })?;
        let mut beta = self.tensor(op, b.rows, nv)?;
        let mut decay = self.tensor(op, b.rows, nv)?;
        let (n, nvi) = (b.len() as u64, nv as i32);
        launch!(
            self,
            op,
            "delta_gates",
            elems(b.len()),
            &*b.buf,
            &*alpha.buf,
            &*a.buf,
            &*dt_bias.buf,
            &n,
            &nvi,
            &mut *beta.buf,
            &mut *decay.buf
        )?;
        Ok((beta, decay))
    }

    fn gated_delta_rule(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        decay: &CudaTensor,
        beta: &CudaTensor,
        state: &mut CudaState,
        s: &DeltaShape,
    ) -> OpResult<CudaTensor> {
        let op = "gated_delta_rule";
        let (nk, nv, dk, dv) = (s.n_k_heads, s.n_v_heads, s.head_k_dim, s.head_v_dim);
        same_shape(op, q, k)?;
        same_shape(op, decay, beta)?;
        check(
            op,
            q.cols == nk * dk
                && v.cols == nv * dv
                && decay.cols == nv
                && nk > 0
                && nv.is_multiple_of(nk)
                && state.buf.len() == nv * dv * dk
                && q.rows == v.rows
                && q.rows == decay.rows,
            || format!("operands do not fit {s:?}"),
        )?;
        check(op, dk <= 32 * GDR_COLS, || {
            format!(
                "head_k_dim {dk} (a warp keeps a state row: at most {})",
                32 * GDR_COLS
            )
        })?;
        let mut out = self.tensor(op, q.rows, nv * dv)?;
        let (t, nki, nvi, dki, dvi) = (q.rows as i32, nk as i32, nv as i32, dk as i32, dv as i32);
        launch!(
            self,
            op,
            "gated_delta_rule",
            blocks((nv * dv).div_ceil(GDR_WARPS), 32 * GDR_WARPS as u32),
            &*q.buf,
            &*k.buf,
            &*v.buf,
            &*decay.buf,
            &*beta.buf,
            &mut state.buf,
            &t,
            &nki,
            &nvi,
            &dki,
            &dvi,
            &mut *out.buf
        )?;
        Ok(out)
    }
}

impl CudaBackend {
    /// The depthwise causal conv of `op` over `x`'s rows continuing `state`, SiLU after it with
    /// `silu` (Gated DeltaNet) or not (Inkling's short convolutions).
    fn conv1d_causal(
        &self,
        op: &'static str,
        x: &CudaTensor,
        state: &mut CudaState,
        w: &CudaTensor,
        kernel: usize,
        silu: bool,
    ) -> OpResult<CudaTensor> {
        let c = x.cols;
        check(
            op,
            kernel >= 2 && w.len() == c * kernel && state.buf.len() == (kernel - 1) * c,
            || format!("kernel {kernel} over {c} channels"),
        )?;
        let mut out = self.tensor(op, x.rows, c)?;
        let (t, ci, ki, act) = (x.rows as i32, c as i32, kernel as i32, silu as i32);
        if x.rows > 1 {
            // Every (row, channel) at once, then the state (the same bits as below).
            launch!(
                self,
                op,
                "conv1d_causal_rows",
                elems(out.len()),
                &*x.buf,
                &state.buf,
                &*w.buf,
                &t,
                &ci,
                &ki,
                &act,
                &mut *out.buf
            )?;
            launch!(
                self,
                op,
                "conv1d_keep",
                elems(c),
                &*x.buf,
                &mut state.buf,
                &t,
                &ci,
                &ki
            )?;
            return Ok(out);
        }
        launch!(
            self,
            op,
            "conv1d_causal",
            elems(c),
            &*x.buf,
            &mut state.buf,
            &*w.buf,
            &t,
            &ci,
            &ki,
            &act,
            &mut *out.buf
        )?;
        Ok(out)
    }
}
