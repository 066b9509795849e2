//! The recurrent ops: per-sequence state vectors of linear attention and short convolutions
//! (Qwen 3.6's Gated DeltaNet, Inkling's short convolutions).

use super::CoreOps;
use crate::{DeltaShape, OpResult, VRef};

/// Recurrent state (linear attention, short convolutions): a state vector per layer that each
/// chunk continues ([`CoreOps::State`]), the causal convolutions, Gated DeltaNet's gates and
/// delta rule, and its gated output norm.
#[allow(unused_variables)]
pub trait RecurrentOps: CoreOps {
    /// A zeroed state of `len` floats.
    fn new_state(&self, len: usize) -> OpResult<Self::State> {
        Err(self.missing("new_state"))
    }
    /// Zeroes a state.
    fn zero_state(&self, s: &mut Self::State) -> OpResult<()> {
        Err(self.missing("zero_state"))
    }
    /// Bytes a state holds.
    fn state_bytes(&self, s: &Self::State) -> usize {
        0
    }
    /// Depthwise causal conv over rows of `x` (`[T, C]`) continuing `state` (`[kernel-1, C]`, the
    /// last pre-conv rows), then SiLU; `w` is `[C, kernel]`. Updates `state`.
    fn conv1d_silu(
        &self,
        x: &Self::Tensor,
        state: &mut Self::State,
        w: &Self::Tensor,
        kernel: usize,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("conv1d_silu"))
    }
    /// [`RecurrentOps::conv1d_silu`] without the activation: the depthwise causal conv alone (Inkling's
    /// short convolutions, which add it to their input). Updates `state`.
    fn conv1d(
        &self,
        x: &Self::Tensor,
        state: &mut Self::State,
        w: &Self::Tensor,
        kernel: usize,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("conv1d"))
    }
    /// Gated DeltaNet's per-head gates from `b`, `alpha` (`[T, n_v_heads]`), `a = exp(A_log)` and
    /// `dt_bias` (`[1, n_v_heads]`): `(β = sigmoid(b), decay = exp(−a·softplus(α + dt_bias)))`.
    fn delta_gates(
        &self,
        b: &Self::Tensor,
        alpha: &Self::Tensor,
        a: &Self::Tensor,
        dt_bias: &Self::Tensor,
    ) -> OpResult<(Self::Tensor, Self::Tensor)> {
        Err(self.missing("delta_gates"))
    }
    /// The gated delta rule over the rows (`S ← g·S; u = (v − S·k)·β; S ← S + u ⊗ k; o = S·q`),
    /// `state` `[n_v_heads, head_v_dim, head_k_dim]`. Returns `[T, n_v_heads·head_v_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        decay: &Self::Tensor,
        beta: &Self::Tensor,
        state: &mut Self::State,
        shape: &DeltaShape,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("gated_delta_rule"))
    }
    /// Gated RMSNorm: `rms_norm(x)·w ⊙ silu(z)` per `dim` piece (`Qwen3NextRMSNormGated`).
    fn rms_norm_gated(
        &self,
        x: &mut Self::Tensor,
        dim: usize,
        w: &VRef,
        z: &Self::Tensor,
        eps: f32,
    ) -> OpResult<()> {
        Err(self.missing("rms_norm_gated"))
    }
}
