//! Inkling's ops: attention with a learned relative-position bias and the router with shared
//! experts as sinks.

use super::CoreOps;
use crate::{AttnShape, OpResult, RelBias, RouterSpec, Routes, SinkRouter};

/// Inkling-Small's own ops (transformers `InklingRelativeLogits`, `InklingTopkRouter`).
#[allow(unused_variables)]
pub trait InklingOps: CoreOps {
    /// [`CoreOps::attention`] with a relative-position bias added to each logit after the scale,
    /// and on global layers the log position scale of the sum: per head
    /// `softmax(τ_p · (q·kᵀ·scale + bias))`. Operands: `bias.rel` `[T, n_heads · d_rel]`,
    /// `bias.proj` `[d_rel, extent]`. Returns `[T, n_heads·head_dim]`.
    fn attention_rel(
        &self,
        q: &Self::Tensor,
        kv: &Self::Kv,
        pos0: usize,
        shape: &AttnShape,
        bias: &RelBias<Self::Tensor>,
    ) -> OpResult<Self::Tensor> {
        Err(self.missing("attention_rel"))
    }
    /// [`CoreOps::route`] for a [`SinkRouter`]: `spec` gives top-k, trace (the k-th minus the
    /// (k+1)-th selection score) and forced ids (`per_expert_scale` must be `None`). The routes
    /// hold the chosen routed experts and, as ids `n_routed + s`, every row of each shared expert
    /// with its weight.
    fn route_sinks(
        &self,
        logits: &Self::Tensor,
        router: &SinkRouter<Self::Tensor>,
        spec: &RouterSpec,
    ) -> OpResult<Routes> {
        Err(self.missing("route_sinks"))
    }
}
