//! Gemma 4 (`gemma4` / `gemma4_text`, e.g. 26B-A4B): sliding/full attention with per-head q/k norms,
//! a no-scale V norm, K = V on full layers, proportional partial RoPE, a dense shared MLP in parallel
//! with 128 routed GeGLU experts, sandwich norms, a per-layer scalar and a tied, softcapped head.
//!
//! Math: transformers `modeling_gemma4.py`, mlx-lm `gemma4_text.py`; checkpoint names:
//! mlx-community/gemma-4-26b-a4b-it-4bit. Intermediates are named after the reference (`attn_norm`, `router_logits`,
//! `moe_out`) so a layer-by-layer diff stays easy.

use serde::Deserialize;

use mference_backend::Weights::Resident;
use mference_backend::{
    moe, Act, AttnShape, Backend, KvCache, Mlp, Norm, PreNorm, QRef, Rope, RouterSpec, Scoring,
    VRef,
};

use std::time::Instant;

use crate::{
    check_ids, check_sizes, next_pre, one, parse_config, text_config, unsupported, ChunkWant,
    Engine, FamilyModel, LoadOptions, Logits, ModelError, SequenceState, StepTimes, Streamers,
};

/// `text_config` of a Gemma 4 `config.json` (HF keys; defaults as mlx-lm's `ModelArgs`).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub head_dim: usize,
    #[serde(default)]
    pub global_head_dim: Option<usize>,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub num_global_key_value_heads: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub sliding_window: usize,
    pub layer_types: Vec<String>,
    pub rope_parameters: RopeParameters,
    #[serde(default)]
    pub attention_k_eq_v: bool,
    #[serde(default)]
    pub final_logit_softcapping: Option<f32>,
    #[serde(default)]
    pub enable_moe_block: bool,
    #[serde(default)]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub top_k_experts: Option<usize>,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub hidden_size_per_layer_input: usize,
    #[serde(default)]
    pub num_kv_shared_layers: usize,
}

fn default_eps() -> f32 {
    1e-6
}
fn yes() -> bool {
    true
}

/// Per layer kind RoPE settings.
#[derive(Clone, Debug, Deserialize)]
pub struct RopeParameters {
    pub sliding_attention: RopeParams,
    pub full_attention: RopeParams,
}

/// `rope_type` is `default` or `proportional`; both rotate NeoX pairs `(i, i + head_dim/2)`.
#[derive(Clone, Debug, Deserialize)]
pub struct RopeParams {
    #[serde(default)]
    pub rope_type: Option<String>,
    pub rope_theta: f64,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

impl Config {
    /// Reads `text_config` (or the top level) of `config.json` and rejects features this runtime
    /// does not implement (per-layer inputs, KV-shared layers, dense-only layers, untied head).
    pub fn from_config_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let c: Config = parse_config(text_config(v), "gemma4 text_config")?;
        check_sizes(
            "gemma4",
            &[
                ("hidden_size", c.hidden_size),
                ("num_hidden_layers", c.num_hidden_layers),
                ("num_attention_heads", c.num_attention_heads),
                ("num_key_value_heads", c.num_key_value_heads),
                ("head_dim", c.head_dim),
                ("sliding_window", c.sliding_window),
                ("vocab_size", c.vocab_size),
                ("intermediate_size", c.intermediate_size),
                ("num_experts", c.num_experts.unwrap_or(1)),
                ("top_k_experts", c.top_k_experts.unwrap_or(1)),
                (
                    "moe_intermediate_size",
                    c.moe_intermediate_size.unwrap_or(1),
                ),
            ],
            (c.top_k_experts.unwrap_or(0), c.num_experts.unwrap_or(0)),
            c.rms_norm_eps,
        )?;
        let unsupported = |what: &str| unsupported("gemma4", what);
        if c.hidden_size_per_layer_input != 0 {
            return unsupported("per-layer inputs (hidden_size_per_layer_input > 0)");
        }
        if c.num_kv_shared_layers != 0 {
            return unsupported("KV-shared layers");
        }
        if !c.enable_moe_block
            || c.num_experts.is_none()
            || c.top_k_experts.is_none()
            || c.moe_intermediate_size.is_none()
        {
            return unsupported("a model without the MoE block");
        }
        if !c.tie_word_embeddings {
            return unsupported("an untied head");
        }
        if c.layer_types.len() != c.num_hidden_layers {
            return Err(ModelError::Config(format!(
                "layer_types has {} entries for {} layers",
                c.layer_types.len(),
                c.num_hidden_layers
            )));
        }
        Ok(c)
    }

    fn is_sliding(&self, layer: usize) -> bool {
        self.layer_types[layer] == "sliding_attention"
    }
}

struct Layer {
    sliding: bool,
    head_dim: usize,
    n_kv_heads: usize,
    rope: Rope,
    q_proj: QRef,
    k_proj: QRef,
    v_proj: Option<QRef>,
    o_proj: QRef,
    q_norm: VRef,
    k_norm: VRef,
    input_layernorm: VRef,
    post_attention_layernorm: VRef,
    pre_feedforward_layernorm: VRef,
    post_feedforward_layernorm: VRef,
    pre_feedforward_layernorm_2: VRef,
    post_feedforward_layernorm_1: VRef,
    post_feedforward_layernorm_2: VRef,
    mlp: Mlp,
    router_proj: QRef,
    router_scale: VRef,
    per_expert_scale: VRef,
    /// `layer_scalar`, read at load.
    layer_scalar: f32,
    /// `experts.switch_glu.*` inside an expert blob.
    experts: Mlp,
}

/// A loaded Gemma 4 model with its KV cache and expert streamers (one sequence) on backend `B`.
pub struct Gemma4<B: Backend> {
    cfg: Config,
    engine: Engine,
    be: B,
    embed_tokens: QRef,
    norm: VRef,
    layers: Vec<Layer>,
    /// sqrt(hidden_size) rounded to bf16, the weight dtype (HF `Gemma4TextScaledWordEmbedding`).
    embed_scale: f32,
    /// The KV cache (full layers and sliding rings; the rings copied at a checkpoint).
    state: SequenceState<B>,
    streamers: Streamers,
    /// [`crate::Model::step_times`].
    times: StepTimes,
}

const P: &str = "language_model.model";

impl<B: Backend> Gemma4<B> {
    /// Builds the model over an opened install: every resident tensor is resolved (and checked) now,
    /// so a malformed install fails at load with the tensor's name.
    pub fn load(
        engine: Engine,
        be: B,
        cfg: Config,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let (idx, len) = (&engine.index, engine.map.len());
        let q = |base: String| QRef::resident(idx, len, &base);
        let h = cfg.hidden_size;
        let v = |name: String, n: usize| VRef::resident(idx, &name, n);
        let n_exp = cfg.num_experts.unwrap_or(0);
        let stride = engine.install.layout.expert_stride as usize;
        engine.check_moe(cfg.num_hidden_layers, n_exp, cfg.top_k_experts.unwrap_or(0))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let sliding = cfg.is_sliding(l);
            let head_dim = if sliding {
                cfg.head_dim
            } else {
                cfg.global_head_dim.unwrap_or(cfg.head_dim)
            };
            let k_eq_v = cfg.attention_k_eq_v && !sliding;
            let n_kv_heads = if k_eq_v {
                cfg.num_global_key_value_heads
                    .unwrap_or(cfg.num_key_value_heads)
            } else {
                cfg.num_key_value_heads
            };
            let rp = if sliding {
                &cfg.rope_parameters.sliding_attention
            } else {
                &cfg.rope_parameters.full_attention
            };
            let rotated = (head_dim as f64 * rp.partial_rotary_factor.unwrap_or(1.0)) as usize;
            let b = format!("{P}.layers.{l}");
            let blob = engine.expert_blob(l)?;
            let ex =
                |part: &str, t| QRef::expert(&format!("{b}.experts.switch_glu.{part}"), t, stride);
            let layer = Layer {
                sliding,
                head_dim,
                n_kv_heads,
                rope: Rope::proportional(head_dim, rotated, rp.rope_theta),
                q_proj: q(format!("{b}.self_attn.q_proj"))?,
                k_proj: q(format!("{b}.self_attn.k_proj"))?,
                v_proj: if k_eq_v {
                    None
                } else {
                    Some(q(format!("{b}.self_attn.v_proj"))?)
                },
                o_proj: q(format!("{b}.self_attn.o_proj"))?,
                q_norm: v(format!("{b}.self_attn.q_norm.weight"), head_dim)?,
                k_norm: v(format!("{b}.self_attn.k_norm.weight"), head_dim)?,
                input_layernorm: v(format!("{b}.input_layernorm.weight"), h)?,
                post_attention_layernorm: v(format!("{b}.post_attention_layernorm.weight"), h)?,
                pre_feedforward_layernorm: v(format!("{b}.pre_feedforward_layernorm.weight"), h)?,
                post_feedforward_layernorm: v(format!("{b}.post_feedforward_layernorm.weight"), h)?,
                pre_feedforward_layernorm_2: v(
                    format!("{b}.pre_feedforward_layernorm_2.weight"),
                    h,
                )?,
                post_feedforward_layernorm_1: v(
                    format!("{b}.post_feedforward_layernorm_1.weight"),
                    h,
                )?,
                post_feedforward_layernorm_2: v(
                    format!("{b}.post_feedforward_layernorm_2.weight"),
                    h,
                )?,
                mlp: Mlp {
                    gate_proj: q(format!("{b}.mlp.gate_proj"))?,
                    up_proj: q(format!("{b}.mlp.up_proj"))?,
                    down_proj: q(format!("{b}.mlp.down_proj"))?,
                },
                router_proj: q(format!("{b}.router.proj"))?,
                router_scale: v(format!("{b}.router.scale"), h)?,
                per_expert_scale: v(format!("{b}.router.per_expert_scale"), n_exp)?,
                layer_scalar: v(format!("{b}.layer_scalar"), 1)?.get(&engine.map, 0),
                experts: Mlp {
                    gate_proj: ex("gate_proj", &blob.gate)?,
                    up_proj: ex("up_proj", &blob.up)?,
                    down_proj: ex("down_proj", &blob.down)?,
                },
            };
            check_shapes(&cfg, &layer, l)?;
            layers.push(layer);
        }
        let embed_tokens = q(format!("{P}.embed_tokens"))?;
        if embed_tokens.rows != cfg.vocab_size || embed_tokens.cols != h {
            return Err(ModelError::Config(format!(
                "embed_tokens is [{}, {}], config says [{}, {h}]",
                embed_tokens.rows, embed_tokens.cols, cfg.vocab_size
            )));
        }
        let norm = v(format!("{P}.norm.weight"), h)?;
        let embed_scale = half::bf16::from_f32((h as f32).sqrt()).to_f32();
        let ring = opts.sliding_rows(cfg.sliding_window);
        let kv = layers
            .iter()
            .map(|l| {
                let rows = if l.sliding { ring } else { opts.max_context };
                be.new_kv(rows, l.sliding, l.n_kv_heads, l.head_dim, opts.kv_dtype)
            })
            .collect::<Result<_, _>>()?;
        let n_layers = cfg.num_hidden_layers;
        let streamers = Streamers::new(n_layers);
        Ok(Self {
            cfg,
            engine,
            be,
            embed_tokens,
            norm,
            layers,
            embed_scale,
            state: SequenceState::new(KvCache::new(kv)),
            streamers,
            times: StepTimes {
                layers: vec![Default::default(); n_layers],
                head: Default::default(),
            },
        })
    }

    /// The `text_config` this model was built from.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl<B: Backend + 'static> FamilyModel for Gemma4<B> {
    type Backend = B;

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`.
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError> {
        let (cfg, be) = (&self.cfg, &self.be);
        let t = tokens.len();
        let h = cfg.hidden_size;
        let nh = cfg.num_attention_heads;
        let pos0 = self.state.kv.len;
        let eps = cfg.rms_norm_eps;
        check_ids(tokens, cfg.vocab_size)?;
        // The same norm into a new tensor (a block's input from the residual).
        let normed = |x: &B::Tensor, w: &VRef| be.rms_norm_to(x, h, Norm::Weight(w), eps);

        let mut x = be.embed(&self.embed_tokens, tokens, Some(self.embed_scale))?; // [T, hidden]

        // Each layer's attention input: the previous layer computes it with its residual add.
        let mut attn_norm = normed(&x, &self.layers[0].input_layernorm)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let started = Instant::now();
            let d = layer.head_dim;
            // Attention block.
            let mut projs = match &layer.v_proj {
                Some(v_proj) => be.matmul(
                    &[&layer.q_proj, &layer.k_proj, v_proj],
                    Resident,
                    &attn_norm,
                )?,
                None => be.matmul(&[&layer.q_proj, &layer.k_proj], Resident, &attn_norm)?,
            };
            // V: its projection, normed without a scale with q and k below, or with
            // attention_k_eq_v the raw K projection (before k_norm and RoPE), normed here.
            let (mut v, v_norm) = match layer.v_proj {
                Some(_) => (projs.pop().expect("three projections"), Some(Norm::NoScale)),
                None => (be.rms_norm_to(&projs[1], d, Norm::NoScale, eps)?, None),
            }; // [T, n_kv_heads · head_dim]
            let mut k = projs.pop().expect("k_proj");
            let mut q = projs.pop().expect("q_proj"); // [T, n_heads · head_dim]
                                                      // q and k per-head norms and RoPE, the V norm, K and V into the cache: one op.
            let kv = &mut self.state.kv.layers[li];
            be.rms_norm_rope_kv(
                &mut q,
                Norm::Weight(&layer.q_norm),
                &mut k,
                Norm::Weight(&layer.k_norm),
                &mut v,
                v_norm,
                eps,
                &layer.rope,
                d,
                pos0,
                kv,
            )?;
            let shape = AttnShape {
                n_heads: nh,
                n_kv_heads: layer.n_kv_heads,
                head_dim: d,
                window: layer.sliding.then_some(cfg.sliding_window),
                scale: 1.0,
                sinks: None,
            };
            let attn = be.attention(&q, kv, pos0, &shape)?;
            let o = one(be.matmul(&[&layer.o_proj], Resident, &attn)?);
            // The attention output into the residual, and the MLP block's three input norms
            // (router, routed experts, shared MLP), with router lookahead (decode) layer L+1's
            // router input from this post-attention state too.
            let ahead = self.engine.router_lookahead;
            let next = self.layers.get(li + 1).filter(|_| ahead > 0 && t == 1);
            let mut pre = vec![
                router_input(cfg, layer),
                PreNorm {
                    norm: Norm::Weight(&layer.pre_feedforward_layernorm_2),
                    cols: None,
                },
                PreNorm {
                    norm: Norm::Weight(&layer.pre_feedforward_layernorm),
                    cols: None,
                },
            ];
            pre.extend(next.map(|next| router_input(cfg, next)));
            let mut inputs = be
                .add_rms_norm_pre(
                    &mut x,
                    &o,
                    h,
                    Some(Norm::Weight(&layer.post_attention_layernorm)),
                    eps,
                    1.0,
                    &pre,
                )?
                .into_iter();
            let mut input = || inputs.next().expect("one tensor per pre-norm");
            let (r, u2, u) = (input(), input(), input());
            let attended = Instant::now();
            self.times.layers[li][0] += attended - started;

            let forced = self.engine.forced_routes(li, pos0, t);
            let trace = self.engine.traces_router();
            let (router_logits, spec) = router(cfg, be, layer, &r, trace, forced.as_deref())?;
            let guess = match next {
                Some(next) => {
                    let (logits, spec) = router(cfg, be, next, &input(), false, None)?;
                    Some(be.route(&logits, &spec)?)
                }
                None => None,
            };

            // Dense shared MLP ‖ routed experts, each with its own pre- and post-norm.
            let (streamer, next) = self
                .streamers
                .with_next(li, guess.is_some(), &self.engine)?;
            let ahead = moe::Lookahead::of(next, guess.as_ref(), ahead);
            let (mut shared, moe_out, margins) = moe::route_and_run(
                be,
                streamer,
                &layer.experts,
                Act::GeluTanh,
                &u2,
                &router_logits,
                &spec,
                ahead,
                || {
                    let shared = be.glu_mlp(&layer.mlp, Act::GeluTanh, Resident, &u)?;
                    Ok::<_, ModelError>((shared, be.zeros(t, h)?))
                },
            )?;
            self.engine.note_router_margins(pos0, &margins);
            // Each MLP's post-norm, their sum, the block's post-norm into the residual, scaled,
            // and the next layer's input norm, in one op.
            let next = self.layers.get(li + 1).map(|n| &n.input_layernorm);
            let outs = be.add_rms_norm2_pre(
                &mut x,
                &mut shared,
                Norm::Weight(&layer.post_feedforward_layernorm_1),
                &moe_out,
                Norm::Weight(&layer.post_feedforward_layernorm_2),
                h,
                Some(Norm::Weight(&layer.post_feedforward_layernorm)),
                eps,
                layer.layer_scalar,
                &next_pre(next),
            )?;
            if let Some(n) = outs.into_iter().next() {
                attn_norm = n;
            }
            self.times.layers[li][1] += attended.elapsed();
        }
        self.state.kv.len = pos0 + t;
        let started = Instant::now();

        // Final norm and the tied head, only for the rows asked for.
        let head = crate::Head {
            norm: &self.norm,
            eps,
            weight: &self.embed_tokens,
            softcap: cfg.final_logit_softcapping,
        };
        let logits = crate::head(be, &x, pos0, want, &head);
        self.times.head += started.elapsed();
        logits
    }

    crate::family_parts!();

    fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }

    fn times(&self) -> Option<&StepTimes> {
        Some(&self.times)
    }
}

/// `layer`'s router input from the post-attention residual: a no-scale norm times the router
/// scale times hidden^-0.5 (HF `Gemma4TextRouter`).
fn router_input<'a>(cfg: &Config, layer: &'a Layer) -> PreNorm<'a> {
    PreNorm {
        norm: Norm::NoScale,
        cols: Some((&layer.router_scale, (cfg.hidden_size as f32).powf(-0.5))),
    }
}

/// `layer`'s router on its input `r` ([`router_input`], `[T, hidden]`): the logits (the
/// projection, `[T, num_experts]`) and the scoring, softmax over the top-k times the per-expert
/// scale (HF `Gemma4TextRouter`). `forced` replays recorded ids ([`Engine::forced_routes`]).
fn router<'a, B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &'a Layer,
    r: &B::Tensor,
    trace: bool,
    forced: Option<&'a [usize]>,
) -> Result<(B::Tensor, RouterSpec<'a>), ModelError> {
    let logits = one(be.matmul(&[&layer.router_proj], Resident, r)?);
    let spec = RouterSpec {
        scoring: Scoring::SoftmaxOfTopK,
        top_k: cfg.top_k_experts.unwrap_or(0),
        per_expert_scale: Some(&layer.per_expert_scale),
        trace,
        forced,
    };
    Ok((logits, spec))
}

/// Shapes that must agree with config.json: a mismatch means the install and config disagree.
fn check_shapes(c: &Config, l: &Layer, li: usize) -> Result<(), ModelError> {
    let h = c.hidden_size;
    let nh = c.num_attention_heads;
    let e = c.moe_intermediate_size.unwrap_or(0);
    let checks = [
        ("q_proj", l.q_proj.rows, l.q_proj.cols, nh * l.head_dim, h),
        (
            "k_proj",
            l.k_proj.rows,
            l.k_proj.cols,
            l.n_kv_heads * l.head_dim,
            h,
        ),
        ("o_proj", l.o_proj.rows, l.o_proj.cols, h, nh * l.head_dim),
        (
            "mlp.gate_proj",
            l.mlp.gate_proj.rows,
            l.mlp.gate_proj.cols,
            c.intermediate_size,
            h,
        ),
        (
            "mlp.down_proj",
            l.mlp.down_proj.rows,
            l.mlp.down_proj.cols,
            h,
            c.intermediate_size,
        ),
        (
            "router.proj",
            l.router_proj.rows,
            l.router_proj.cols,
            c.num_experts.unwrap_or(0),
            h,
        ),
        (
            "experts.gate_proj",
            l.experts.gate_proj.rows,
            l.experts.gate_proj.cols,
            e,
            h,
        ),
        (
            "experts.up_proj",
            l.experts.up_proj.rows,
            l.experts.up_proj.cols,
            e,
            h,
        ),
        (
            "experts.down_proj",
            l.experts.down_proj.rows,
            l.experts.down_proj.cols,
            h,
            e,
        ),
    ];
    for (name, r, cc, er, ec) in checks {
        if (r, cc) != (er, ec) {
            return Err(ModelError::Config(format!(
                "layer {li} {name} is [{r}, {cc}], config.json implies [{er}, {ec}]"
            )));
        }
    }
    Ok(())
}
