//! DeepSeek-V4's MoE block: hash routing from `tid2eid`, sqrt-softplus routing with the
//! selection-only correction bias, clamped SwiGLU experts plus the shared expert (transformers
//! `DeepseekV4SparseMoeBlock`, `DeepseekV4HashRouter`, `DeepseekV4TopKRouter`).

use mference_backend::Weights::Resident;
use mference_backend::{moe, Act, Backend, FRef, RouterSpec, Routes, Scoring, Tensor};

use super::{Config, Layer};
use crate::{Engine, ModelError};

/// How a layer picks its experts.
pub(super) enum Gate {
    /// `tid2eid` `[vocab, top_k]`, flattened.
    Hash(Vec<usize>),
    /// `e_score_correction_bias`.
    Learned(FRef),
}

/// `tid2eid` (I64 `[vocab, top_k]`) read to the host, each id checked against the expert count.
pub(super) fn tid2eid(
    engine: &Engine,
    name: &str,
    vocab: usize,
    k: usize,
    n_exp: usize,
) -> Result<Vec<usize>, ModelError> {
    let bad = |why: String| mference_backend::WeightError {
        name: name.into(),
        why,
    };
    let e = engine
        .index
        .get(name)
        .ok_or_else(|| bad("missing from model_weights.bin".into()))?;
    if e.dtype != mference_format::Dtype::I64 || e.size_bytes as usize != vocab * k * 8 {
        return Err(bad(format!(
            "expected I64 [{vocab}, {k}], found {:?} of {} bytes",
            e.dtype, e.size_bytes
        ))
        .into());
    }
    let ids: Vec<i64> = e
        .weight_bytes(&engine.map)
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    if let Some(bad_id) = ids.iter().find(|&&i| i < 0 || i as usize >= n_exp) {
        return Err(bad(format!("expert id {bad_id} outside 0..{n_exp}")).into());
    }
    if ids
        .chunks_exact(k)
        .any(|r| r.iter().enumerate().any(|(i, e)| r[..i].contains(e)))
    {
        return Err(bad("a token routes to the same expert twice".into()).into());
    }
    Ok(ids.into_iter().map(|i| i as usize).collect())
}

/// The MoE block over the rows of `u` (transformers `DeepseekV4SparseMoeBlock`): sqrt-softplus
/// scores of the f32 router; experts from `tid2eid[token]` (hash layers) or the top-k of
/// `score + e_score_correction_bias`; weights renormalised × `routed_scaling_factor`; clamped
/// SwiGLU experts plus the shared expert. Returns `[T, hidden]`.
#[allow(clippy::too_many_arguments)]
pub(super) fn sparse_moe<B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    streamer: &mut mference_runtime::ExpertStreamer,
    u: &B::Tensor,
    tokens: &[u32],
    engine: &Engine,
    (li, pos0): (usize, usize),
) -> Result<B::Tensor, ModelError> {
    let router = Router::new(cfg, be, layer, u, tokens, engine, (li, pos0))?;
    let act = Act::SiluClamped(cfg.swiglu_limit);
    let ((), moe_out, _) = moe::route_and_run(
        be,
        streamer,
        &layer.switch_mlp,
        act,
        u,
        &router.logits,
        &router.spec(cfg),
        None,
        || {
            let shared = be.glu_mlp(&layer.shared_experts, act, Resident, u)?;
            Ok::<_, ModelError>(((), shared))
        },
    )?;
    Ok(moe_out)
}

/// Layer `li`'s router over the rows of `u`: its logits and what picks the experts (the hash
/// layer's `tid2eid` rows, or a replayed trace's, and the correction bias).
struct Router<T> {
    logits: T,
    forced: Option<Vec<usize>>,
    bias: Option<FRef>,
}

impl<T> Router<T> {
    fn new<B: Backend<Tensor = T>>(
        cfg: &Config,
        be: &B,
        layer: &Layer<B>,
        u: &T,
        tokens: &[u32],
        engine: &Engine,
        (li, pos0): (usize, usize),
    ) -> Result<Self, ModelError>
    where
        T: Tensor,
    {
        let k = cfg.num_experts_per_tok;
        let logits = be.linear(u, &layer.gate)?; // [T, num_experts]
        let (bias, hashed) = match &layer.routing {
            Gate::Hash(table) => (
                None,
                Some(
                    tokens
                        .iter()
                        .flat_map(|&id| {
                            table[id as usize * k..(id as usize + 1) * k]
                                .iter()
                                .copied()
                        })
                        .collect::<Vec<_>>(),
                ),
            ),
            Gate::Learned(b) => (Some(*b), None),
        };
        let forced = hashed.or_else(|| engine.forced_routes(li, pos0, u.rows()));
        Ok(Self {
            logits,
            forced,
            bias,
        })
    }

    fn spec(&self, cfg: &Config) -> RouterSpec<'_> {
        RouterSpec {
            scoring: Scoring::SqrtSoftplus {
                routed_scaling_factor: cfg.routed_scaling_factor,
                correction_bias: self.bias,
            },
            top_k: cfg.num_experts_per_tok,
            per_expert_scale: None,
            trace: false,
            forced: self.forced.as_deref(),
        }
    }
}

/// Layer `li`'s router over the rows of `u`: the expert ids and weights.
pub(super) fn route<B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    u: &B::Tensor,
    tokens: &[u32],
    engine: &Engine,
    at: (usize, usize),
) -> Result<Routes, ModelError> {
    let router = Router::new(cfg, be, layer, u, tokens, engine, at)?;
    Ok(be.route(&router.logits, &router.spec(cfg))?)
}
