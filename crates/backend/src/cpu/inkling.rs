//! The CPU's Inkling ops: relative-position attention and the sink router.

use std::collections::BTreeMap;

use mference_runtime::KvLayer;

use super::{ops, top_k_margin, CpuBackend, CpuTensor};
use crate::{
    check, check_forced, AttnShape, InklingOps, OpResult, RelBias, RouterSpec, Routes, SinkRouter,
};

impl InklingOps for CpuBackend {
    fn attention_rel(
        &self,
        q: &CpuTensor,
        kv: &KvLayer,
        pos0: usize,
        s: &AttnShape,
        bias: &RelBias<CpuTensor>,
    ) -> OpResult<CpuTensor> {
        self.attend("attention_rel", q, kv, pos0, s, Some(bias), None)
    }

    fn route_sinks(
        &self,
        logits: &CpuTensor,
        router: &SinkRouter<CpuTensor>,
        spec: &RouterSpec,
    ) -> OpResult<Routes> {
        sink_routes(
            &logits.data,
            logits.cols,
            &router.bias.data,
            router.n_shared,
            router.scale,
            spec,
        )
    }
}

/// [`InklingOps::route_sinks`] over host slices: `logits` `[T, n_all]` (routed experts, then the
/// `n_shared` shared ones), `bias` `[n_routed]`. The CUDA backend reads its logits back and calls
/// this too, so both give the same routes.
///
/// Errors: `top_k` outside `1..=n_routed`, a bias of another length, a per-expert scale, or
/// forced ids that do not fit.
pub fn sink_routes(
    logits: &[f32],
    n_all: usize,
    bias: &[f32],
    n_shared: usize,
    scale: f32,
    spec: &RouterSpec,
) -> OpResult<Routes> {
    let n_routed = n_all.saturating_sub(n_shared);
    let k = spec.top_k;
    check(
        "route_sinks",
        k > 0 && k <= n_routed && bias.len() == n_routed && spec.per_expert_scale.is_none(),
        || {
            format!(
                "top-{k} of {n_routed} routed experts ({n_shared} shared, bias of {}, no \
                 per-expert scale)",
                bias.len()
            )
        },
    )?;
    check_forced("route_sinks", spec, logits.len() / n_all, n_routed)?;
    let mut experts: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
    let mut margins = Vec::new();
    for (row, lg) in logits.chunks_exact(n_all).enumerate() {
        let choice: Vec<f32> = lg[..n_routed]
            .iter()
            .zip(bias)
            .map(|(&l, &b)| ops::sigmoid(l) + b)
            .collect();
        if spec.trace {
            margins.push(top_k_margin(&choice, k));
        }
        let idx = match spec.forced {
            Some(f) => f[row * k..(row + 1) * k].to_vec(),
            None => ops::top_k(&choice, k),
        };
        let ids: Vec<usize> = idx.into_iter().chain(n_routed..n_all).collect();
        // softmax over log-sigmoids, as transformers computes it: exp(ls − logsumexp(ls)).
        let mut w: Vec<f32> = ids.iter().map(|&e| ops::log_sigmoid(lg[e])).collect();
        ops::softmax(&mut w);
        for (e, w) in ids.into_iter().zip(w) {
            experts.entry(e).or_default().push((row, w * scale));
        }
    }
    Ok(Routes { experts, margins })
}
