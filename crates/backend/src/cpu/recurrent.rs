//! The CPU's recurrent ops: conv tails and DeltaNet states as host `Vec<f32>`.

use super::{conv, ops, same_shape, CpuBackend, CpuTensor};
use crate::{check, DeltaShape, Norm, OpResult, RecurrentOps, Tensor, VRef};

impl RecurrentOps for CpuBackend {
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
}
