//! Qwen 3.6 (`qwen3_5_moe` / `qwen3_5_moe_text`, e.g. 35B-A3B): a 3:1 hybrid of Gated DeltaNet
//! (linear attention with a recurrent FP32 state) and gated full attention, every layer followed by
//! a softmax-routed MoE (renormalised top-k) plus a sigmoid-gated shared expert; untied head.
//!
//! Math: the installed mlx-lm (`qwen3_5.py` for the decoder and
//! `GatedDeltaNet`, `qwen3_next.py` for attention, MoE block and gated norm, `gated_delta.py` for the
//! recurrence); checkpoint names: mlx-community/Qwen3.6-35B-A3B-4bit. MLX checkpoints store `1 + w` for the zero-centred norms
//! (`input_layernorm`, `post_attention_layernorm`, `norm`, `q_norm`, `k_norm`), so every norm here is
//! the plain `rms(x)·w`; the DeltaNet gated norm is plain in both formats. Intermediates are named
//! after the reference (`attn_norm`, `router_logits`, `moe_out`) for layer-by-layer diffs.

mod config;

pub use config::Config;

use mference_backend::Weights::Resident;
use mference_backend::{
    f32_vector, moe, Act, AttnShape, Backend, DeltaShape, KvCache, Mlp, Norm, PreNorm, QRef, Rope,
    RouterSpec, Scoring, Tensor, VRef, WeightError,
};
use mference_runtime::ExpertStreamer;

use crate::{
    check_ids, expert_linear, into_residual, linear, one, ChunkWant, Engine, FamilyModel,
    LayerState, LoadOptions, Logits, ModelError, SequenceState, Streamers,
};

/// Gated DeltaNet weights (`linear_attn.*`).
struct DeltaNet<B: Backend> {
    in_proj_qkv: QRef,
    in_proj_z: QRef,
    in_proj_b: QRef,
    in_proj_a: QRef,
    out_proj: QRef,
    /// `[conv_dim, kernel]`.
    conv1d: B::Tensor,
    /// `exp(A_log)`, `[1, n_v_heads]`.
    a: B::Tensor,
    dt_bias: B::Tensor,
    norm: VRef,
}

/// Gated full attention weights (`self_attn.*`).
struct Attention {
    q_proj: QRef,
    k_proj: QRef,
    v_proj: QRef,
    o_proj: QRef,
    q_norm: VRef,
    k_norm: VRef,
}

enum Mixer<B: Backend> {
    Linear(Box<DeltaNet<B>>),
    /// With its index into the KV cache's layers.
    Full(Box<Attention>, usize),
}

struct Layer<B: Backend> {
    mixer: Mixer<B>,
    input_layernorm: VRef,
    post_attention_layernorm: VRef,
    /// Router `mlp.gate` `[num_experts, hidden]`.
    gate: QRef,
    shared_expert: Mlp,
    /// `[1, hidden]`.
    shared_expert_gate: QRef,
    /// `mlp.switch_mlp.*` inside an expert blob.
    switch_mlp: Mlp,
}

/// A loaded Qwen 3.6 MoE model with its KV cache, DeltaNet states and expert streamers (one
/// sequence) on backend `B`.
pub struct Qwen35Moe<B: Backend> {
    cfg: Config,
    engine: Engine,
    be: B,
    embed_tokens: QRef,
    norm: VRef,
    lm_head: QRef,
    layers: Vec<Layer<B>>,
    rope: Rope,
    /// The full-attention layers' KV and, per DeltaNet layer, its FP32 conv and recurrent
    /// states (`[kernel − 1, conv_dim]` and `[n_v_heads, head_v_dim, head_k_dim]`: mlx-lm's
    /// `ArraysCache(size=2)`).
    state: SequenceState<B>,
    streamers: Streamers,
}

const P: &str = "language_model.model";

impl<B: Backend> Qwen35Moe<B> {
    /// Builds the model over an opened install: every resident tensor is resolved (and its shape
    /// checked against `cfg`) now, so a malformed install fails at load with the tensor's name.
    pub fn load(
        engine: Engine,
        be: B,
        cfg: Config,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let (idx, map) = (&engine.index, &engine.map[..]);
        let h = cfg.hidden_size;
        let hd = cfg.head_dim();
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
        let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
        let conv_dim = 2 * nk * dk + nv * dv;
        let kern = cfg.linear_conv_kernel_dim;
        let n_exp = cfg.num_experts;
        let (mi, si) = (
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
        );
        let stride = engine.install.layout.expert_stride as usize;
        engine.check_moe(cfg.num_hidden_layers, n_exp, cfg.num_experts_per_tok)?;
        // A quantized Linear `base` that must be [rows, cols].
        let q = |base: String, rows, cols| linear(idx, map.len(), &base, rows, cols);
        let v = |name: String, n: usize| VRef::resident(idx, &name, n);
        let vector = |name: String, n: usize| f32_vector(idx, map, &name, n);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut n_full = 0;
        for l in 0..cfg.num_hidden_layers {
            let b = format!("{P}.layers.{l}");
            let mixer = if cfg.is_linear(l) {
                let a = format!("{b}.linear_attn");
                let conv_name = format!("{a}.conv1d.weight");
                let shape = idx
                    .get(&conv_name)
                    .map(|e| e.logical_shape())
                    .unwrap_or_default();
                if shape != [conv_dim as u64, kern as u64, 1] {
                    return Err(WeightError {
                        name: conv_name,
                        why: format!(
                            "expected the MLX layout [{conv_dim}, {kern}, 1], found {shape:?} \
                             (an unconverted HF checkpoint? convert it with mlx-lm)"
                        ),
                    }
                    .into());
                }
                let a_exp: Vec<f32> = vector(format!("{a}.A_log"), nv)?
                    .iter()
                    .map(|x| x.exp())
                    .collect();
                Mixer::Linear(Box::new(DeltaNet {
                    in_proj_qkv: q(format!("{a}.in_proj_qkv"), conv_dim, h)?,
                    in_proj_z: q(format!("{a}.in_proj_z"), nv * dv, h)?,
                    in_proj_b: q(format!("{a}.in_proj_b"), nv, h)?,
                    in_proj_a: q(format!("{a}.in_proj_a"), nv, h)?,
                    out_proj: q(format!("{a}.out_proj"), h, nv * dv)?,
                    conv1d: be.upload(&vector(conv_name, conv_dim * kern)?, kern)?,
                    a: be.upload(&a_exp, nv)?,
                    dt_bias: be.upload(&vector(format!("{a}.dt_bias"), nv)?, nv)?,
                    norm: v(format!("{a}.norm.weight"), dv)?,
                }))
            } else {
                let a = format!("{b}.self_attn");
                n_full += 1;
                Mixer::Full(
                    Box::new(Attention {
                        q_proj: q(format!("{a}.q_proj"), 2 * nh * hd, h)?,
                        k_proj: q(format!("{a}.k_proj"), nkv * hd, h)?,
                        v_proj: q(format!("{a}.v_proj"), nkv * hd, h)?,
                        o_proj: q(format!("{a}.o_proj"), h, nh * hd)?,
                        q_norm: v(format!("{a}.q_norm.weight"), hd)?,
                        k_norm: v(format!("{a}.k_norm.weight"), hd)?,
                    }),
                    n_full - 1,
                )
            };
            let blob = engine.expert_blob(l)?;
            let ex = |part: &str, t, rows, cols| {
                expert_linear(&format!("{b}.mlp.switch_mlp.{part}"), t, stride, rows, cols)
            };
            layers.push(Layer {
                mixer,
                input_layernorm: v(format!("{b}.input_layernorm.weight"), h)?,
                post_attention_layernorm: v(format!("{b}.post_attention_layernorm.weight"), h)?,
                gate: q(format!("{b}.mlp.gate"), n_exp, h)?,
                shared_expert: Mlp {
                    gate_proj: q(format!("{b}.mlp.shared_expert.gate_proj"), si, h)?,
                    up_proj: q(format!("{b}.mlp.shared_expert.up_proj"), si, h)?,
                    down_proj: q(format!("{b}.mlp.shared_expert.down_proj"), h, si)?,
                },
                shared_expert_gate: q(format!("{b}.mlp.shared_expert_gate"), 1, h)?,
                switch_mlp: Mlp {
                    gate_proj: ex("gate_proj", &blob.gate, mi, h)?,
                    up_proj: ex("up_proj", &blob.up, mi, h)?,
                    down_proj: ex("down_proj", &blob.down, h, mi)?,
                },
            });
        }
        let embed_tokens = q(format!("{P}.embed_tokens"), cfg.vocab_size, h)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens
        } else {
            q("language_model.lm_head".into(), cfg.vocab_size, h)?
        };
        let norm = v(format!("{P}.norm.weight"), h)?;
        let (theta, factor) = cfg.rope();
        let rotated = (hd as f64 * factor) as usize;
        if rotated == 0 || !rotated.is_multiple_of(2) || rotated > hd {
            return Err(ModelError::Config(format!(
                "partial_rotary_factor {factor} gives {rotated} rotated dims of {hd}"
            )));
        }
        let kv = (0..n_full)
            .map(|_| be.new_kv(opts.max_context, false, nkv, hd, opts.kv_dtype))
            .collect::<Result<_, _>>()?;
        let mut states = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            states.push(LayerState::arrays(match cfg.is_linear(l) {
                true => vec![
                    be.new_state((kern - 1) * conv_dim)?,
                    be.new_state(nv * dv * dk)?,
                ],
                false => Vec::new(),
            }));
        }
        let streamers = Streamers::new(cfg.num_hidden_layers);
        Ok(Self {
            rope: Rope::neox(rotated, theta),
            cfg,
            engine,
            be,
            embed_tokens,
            norm,
            lm_head,
            layers,
            state: SequenceState::new(KvCache::new(kv)).with_layers(states),
            streamers,
        })
    }

    /// The parsed `text_config`.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl<B: Backend + 'static> FamilyModel for Qwen35Moe<B> {
    type Backend = B;

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`; see [`crate::Want`].
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError> {
        let (cfg, be) = (&self.cfg, &self.be);
        let t = tokens.len();
        let h = cfg.hidden_size;
        let pos0 = self.state.kv.len;
        let eps = cfg.rms_norm_eps;
        check_ids(tokens, cfg.vocab_size)?;

        let mut x = be.embed(&self.embed_tokens, tokens, None)?; // [T, hidden]

        // Each layer's mixer input: the previous layer computes it with its residual add.
        let first = Norm::Weight(&self.layers[0].input_layernorm);
        let mut attn_norm = be.rms_norm_to(&x, h, first, eps)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let mixer_out = match &layer.mixer {
                Mixer::Linear(d) => {
                    let [conv, ssm] = &mut self.state.layers[li].arrays[..] else {
                        unreachable!("a DeltaNet layer has its conv and recurrent states")
                    };
                    delta_net(cfg, be, d, conv, ssm, &attn_norm)?
                }
                Mixer::Full(a, kvi) => {
                    let kv = &mut self.state.kv.layers[*kvi];
                    full_attention(cfg, be, a, kv, &self.rope, &attn_norm, pos0)?
                }
            };
            // The mixer's output into the residual and the MoE block's input norm; with router
            // lookahead (decode) also layer L+1's, for its router on this post-attention state.
            let eng = &self.engine;
            let ahead = eng.router_lookahead;
            let next = self.layers.get(li + 1).filter(|_| ahead > 0 && t == 1);
            let pre: Vec<PreNorm> = std::iter::once(layer)
                .chain(next)
                .map(|l| PreNorm {
                    norm: Norm::Weight(&l.post_attention_layernorm),
                    cols: None,
                })
                .collect();
            let mut inputs = be
                .add_rms_norm_pre(&mut x, &mixer_out, h, None, eps, 1.0, &pre)?
                .into_iter();
            let u = inputs.next().expect("the MoE block's input");
            let guess = match (next, inputs.next()) {
                (Some(next), Some(u1)) => {
                    let (logits, spec) = router(cfg, be, next, &u1, false, None)?;
                    Some(be.route(&logits, &spec)?)
                }
                _ => None,
            };
            let (streamer, next) = self.streamers.with_next(li, guess.is_some(), eng)?;
            let ahead = moe::Lookahead::of(next, guess.as_ref(), ahead);
            let moe_out = sparse_moe(cfg, be, layer, streamer, &u, eng, (li, pos0), ahead)?;
            // The MoE output into the residual, and the next layer's input norm.
            let next = self.layers.get(li + 1).map(|n| &n.input_layernorm);
            if let Some(n) = into_residual(be, &mut x, &moe_out, h, None, eps, 1.0, next)? {
                attn_norm = n;
            }
        }
        self.state.kv.len = pos0 + t;

        let head = crate::Head {
            norm: &self.norm,
            eps,
            weight: &self.lm_head,
            softcap: None,
        };
        crate::head(be, &x, pos0, want, &head)
    }

    crate::family_parts!();

    fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }
}

/// Gated DeltaNet over the rows of `a` (`[T, hidden]`), continuing the `conv` and recurrent
/// `ssm` states; returns `[T, hidden]`
/// (mlx-lm `qwen3_5.GatedDeltaNet.__call__`).
fn delta_net<B: Backend>(
    cfg: &Config,
    be: &B,
    d: &DeltaNet<B>,
    conv: &mut B::State,
    ssm: &mut B::State,
    a: &B::Tensor,
) -> Result<B::Tensor, ModelError> {
    let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
    let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    let key_dim = nk * dk;
    // The four input projections of `a` in one call (one launch where the backend groups them).
    let mut p = be.matmul(
        &[&d.in_proj_qkv, &d.in_proj_z, &d.in_proj_b, &d.in_proj_a],
        Resident,
        a,
    )?;
    let alpha = p.pop().expect("in_proj_a"); // [T, n_v_heads]
    let b = p.pop().expect("in_proj_b"); // [T, n_v_heads]
    let z = p.pop().expect("in_proj_z"); // [T, n_v_heads · head_v_dim]
    let mixed_qkv = p.pop().expect("in_proj_qkv"); // [T, conv_dim] = q | k | v

    let conv_out = be.conv1d_silu(&mixed_qkv, conv, &d.conv1d, cfg.linear_conv_kernel_dim)?;
    let conv_dim = 2 * key_dim + nv * dv;
    let mut qkv = be.split(&conv_out, conv_dim, &[key_dim, key_dim, nv * dv])?;
    let v = qkv.pop().expect("v"); // [T, n_v_heads · head_v_dim]
    let mut k = qkv.pop().expect("k"); // [T, n_k_heads · head_k_dim]
    let mut q = qkv.pop().expect("q");
    // L2-normalise q and k per head as mlx's `normalize_qk` does: `rms_norm` with the eps scaled
    // by 1/dk, times dk^-1 (q: the readout scale folded in) or dk^-0.5 (k).
    let inv2 = 1.0 / dk as f32;
    be.rms_norm(&mut q, dk, Norm::Scaled(inv2), 1e-6 * inv2)?;
    be.rms_norm(&mut k, dk, Norm::Scaled(inv2.sqrt()), 1e-6 * inv2)?;
    // β = sigmoid(b); decay = exp(−exp(A_log)·softplus(α + dt_bias)) (`gated_delta.compute_g`).
    let (beta, decay) = be.delta_gates(&b, &alpha, &d.a, &d.dt_bias)?;
    let shape = DeltaShape {
        n_k_heads: nk,
        n_v_heads: nv,
        head_k_dim: dk,
        head_v_dim: dv,
    };
    let mut core = be.gated_delta_rule(&q, &k, &v, &decay, &beta, ssm, &shape)?;
    // Gated RMSNorm per value head: rms_norm(o)·w ⊙ silu(z) (`Qwen3NextRMSNormGated`).
    be.rms_norm_gated(&mut core, dv, &d.norm, &z, cfg.rms_norm_eps)?;
    Ok(one(be.matmul(&[&d.out_proj], Resident, &core)?))
}

/// Gated full attention over the rows of `a` at positions `pos0..` (mlx-lm
/// `qwen3_next.Qwen3NextAttention`): q and an output gate per head from one projection, q/k norms,
/// NeoX RoPE on the first `rotated` dims of each head, scale `head_dim^-0.5`, output ⊙ sigmoid(gate).
fn full_attention<B: Backend>(
    cfg: &Config,
    be: &B,
    at: &Attention,
    kv: &mut B::Kv,
    rope: &Rope,
    a: &B::Tensor,
    pos0: usize,
) -> Result<B::Tensor, ModelError> {
    let d = cfg.head_dim();
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let eps = cfg.rms_norm_eps;
    let mut p = be.matmul(&[&at.q_proj, &at.k_proj, &at.v_proj], Resident, a)?;
    let mut v = p.pop().expect("v_proj"); // [T, n_kv_heads · head_dim]
    let mut k = p.pop().expect("k_proj");
    let qg = p.pop().expect("q_proj"); // [T, n_heads · 2·head_dim] = q | gate per head
    let mut qg = be.split(&qg, 2 * d, &[d, d])?;
    let gate = qg.pop().expect("gate"); // [T, n_heads · head_dim]
    let mut q = qg.pop().expect("q");
    // q and k per-head norms and RoPE, K and V into the cache: one op.
    let (qn, kn) = (Norm::Weight(&at.q_norm), Norm::Weight(&at.k_norm));
    be.rms_norm_rope_kv(&mut q, qn, &mut k, kn, &mut v, None, eps, rope, d, pos0, kv)?;
    let shape = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: d,
        window: None,
        scale: (d as f32).powf(-0.5),
        sinks: None,
    };
    let mut attn = be.attention(&q, kv, pos0, &shape)?;
    be.mul_sigmoid(&mut attn, &gate)?;
    Ok(one(be.matmul(&[&at.o_proj], Resident, &attn)?))
}

/// The MoE block over the rows of `u` (mlx-lm `Qwen3NextSparseMoeBlock`): softmax router, top-k
/// (renormalised when `norm_topk_prob`), SwiGLU experts, plus the shared expert scaled by
/// `sigmoid(shared_expert_gate(u))`. Returns `[T, hidden]`.
///
/// `ahead`: the router lookahead of this decode step ([`moe::Lookahead`]).
#[allow(clippy::too_many_arguments)]
fn sparse_moe<B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    streamer: &mut ExpertStreamer,
    u: &B::Tensor,
    engine: &Engine,
    (li, pos0): (usize, usize),
    ahead: Option<moe::Lookahead>,
) -> Result<B::Tensor, ModelError> {
    let forced = engine.forced_routes(li, pos0, u.rows());
    // The router and the shared expert's gate in one call (one launch where the backend groups
    // products of one shape: both are 8-bit in the pinned checkpoints).
    let mut p = be.matmul(&[&layer.gate, &layer.shared_expert_gate], Resident, u)?;
    let shared_gate = p.pop().expect("shared_expert_gate"); // [T, 1]
    let router_logits = p.pop().expect("gate"); // [T, num_experts]
    let spec = router_spec(cfg, engine.traces_router(), forced.as_deref());
    let ((), moe_out, margins) = moe::route_and_run(
        be,
        streamer,
        &layer.switch_mlp,
        Act::Silu,
        u,
        &router_logits,
        &spec,
        ahead,
        || {
            let mut shared = be.glu_mlp(&layer.shared_expert, Act::Silu, Resident, u)?;
            be.mul_rows_sigmoid(&mut shared, &shared_gate)?;
            Ok::<_, ModelError>(((), shared))
        },
    )?;
    engine.note_router_margins(pos0, &margins);
    Ok(moe_out)
}

/// `layer`'s router on `u` (`[T, hidden]`, after the post-attention norm): the logits
/// (`[T, num_experts]`) and the scoring, softmax then top-k, renormalised when `norm_topk_prob`
/// (mlx-lm `Qwen3NextSparseMoeBlock`). `forced` replays recorded ids ([`Engine::forced_routes`]).
fn router<'a, B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    u: &B::Tensor,
    trace: bool,
    forced: Option<&'a [usize]>,
) -> Result<(B::Tensor, RouterSpec<'a>), ModelError> {
    let logits = one(be.matmul(&[&layer.gate], Resident, u)?);
    Ok((logits, router_spec(cfg, trace, forced)))
}

/// The router's scoring: softmax then top-k, renormalised when `norm_topk_prob`.
fn router_spec<'a>(cfg: &Config, trace: bool, forced: Option<&'a [usize]>) -> RouterSpec<'a> {
    RouterSpec {
        scoring: Scoring::TopKOfSoftmax {
            norm_topk_prob: cfg.norm_topk_prob,
        },
        top_k: cfg.num_experts_per_tok,
        per_expert_scale: None,
        trace,
        forced,
    }
}
