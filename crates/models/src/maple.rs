//! Maple Preview (`maple`, deepgrove/maple-preview-2bit-mlx): ternary weights, 24 layers in blocks
//! of 3 sliding-window layers with partial NeoX RoPE and 1 full-attention layer without positional
//! encoding (NoPE), per-head q/k RMSNorm, and a routed MoE in every layer: an fp32 softmax router
//! over a raw BF16 gate, top-8 renormalised, clamped SwiGLU experts; no shared expert, untied head.
//!
//! Math: deepgrove-ai/mlx-lm-deepgrove eba96c16 `mlx_lm/models/maple.py`; checkpoint layout:
//! deepgrove/maple-preview-2bit-mlx. The ternary
//! projections are installed as MLX 2-bit affine matrices (`row_alpha` → scales `a`, biases `-a`,
//! `docs/FORMAT.md`), so every product here is the ordinary quantized matmul. Activations are f32
//! (the reference's fp32 mode); the original's native-bf16 residual stream is not reproduced.
//! Intermediates are named after `maple.py` (`attn_norm`, `router_logits`, `moe_out`).

use serde::Deserialize;

use mference_backend::Weights::Resident;
use mference_backend::{
    moe, Act, AttnShape, Backend, KvCache, Mlp, Norm, QRef, Rope, RouterSpec, Scoring, Tensor,
    VRef, WeightError,
};

use crate::{
    check_dims, check_ids, check_sizes, expert_linear, linear, one, parse_config, unsupported,
    ChunkWant, Engine, FamilyModel, LoadOptions, Logits, ModelError, SequenceState, Streamers,
};

/// `maple.py`'s `MLP_CLAMP`: the experts' SwiGLU clamps the gate to `≤ 7` and up to `[-7, 7]`.
pub const MLP_CLAMP: f32 = 7.0;

/// A Maple `config.json` (HF keys; defaults as `maple.py`'s `ModelArgs`).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub sliding_window: usize,
    pub layer_types: Vec<String>,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_partial")]
    pub partial_rotary_factor: f64,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub first_k_dense_replace: usize,
    #[serde(default)]
    pub num_shared_experts: usize,
    #[serde(default = "yes")]
    pub use_qk_norm: bool,
    #[serde(default)]
    pub use_bias: bool,
    #[serde(default = "yes")]
    pub nope_on_global_attention: bool,
    /// FlashHead metadata (`mlx_lm.ternary --flash-head`), used only with
    /// [`LoadOptions::flash_head`].
    #[serde(default)]
    pub flash_head: Option<FlashHeadConfig>,
}

/// `config.json -> flash_head` (`maple.py` `FlashHead`; defaults as there).
#[derive(Clone, Debug, Deserialize)]
pub struct FlashHeadConfig {
    pub n_clusters: usize,
    pub cluster_size: usize,
    #[serde(default = "default_probes")]
    pub n_probes: usize,
    #[serde(default)]
    pub force_tokens: Vec<u32>,
    #[serde(default)]
    pub scaled_centroids: bool,
}

fn default_probes() -> usize {
    512
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_partial() -> f64 {
    0.5
}
fn yes() -> bool {
    true
}

impl Config {
    /// Reads `config.json` and rejects what this runtime does not implement (dense or shared-expert
    /// layers, biases, RoPE scaling, no q/k norm, RoPE on the full layers, unknown layer types).
    pub fn from_config_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let c: Config = parse_config(v, "maple config.json")?;
        check_sizes(
            "maple",
            &[
                ("hidden_size", c.hidden_size),
                ("num_hidden_layers", c.num_hidden_layers),
                ("num_attention_heads", c.num_attention_heads),
                ("num_key_value_heads", c.num_key_value_heads),
                ("head_dim", c.head_dim),
                ("sliding_window", c.sliding_window),
                ("vocab_size", c.vocab_size),
                ("num_experts", c.num_experts),
                ("num_experts_per_tok", c.num_experts_per_tok),
                ("moe_intermediate_size", c.moe_intermediate_size),
            ],
            (c.num_experts_per_tok, c.num_experts),
            c.rms_norm_eps,
        )?;
        let unsupported = |what: &str| unsupported("maple", what);
        if c.first_k_dense_replace != 0 {
            return unsupported("dense MLP layers (first_k_dense_replace > 0)");
        }
        if c.num_shared_experts != 0 {
            return unsupported("shared experts");
        }
        if !c.use_qk_norm {
            return unsupported("attention without q/k norms");
        }
        if c.use_bias {
            return unsupported("projection biases");
        }
        if c.rope_scaling.as_ref().is_some_and(|r| !r.is_null()) {
            return unsupported("RoPE scaling");
        }
        if !c.nope_on_global_attention {
            return unsupported("RoPE on full-attention layers");
        }
        if c.layer_types.len() != c.num_hidden_layers {
            return Err(ModelError::Config(format!(
                "layer_types has {} entries for {} layers",
                c.layer_types.len(),
                c.num_hidden_layers
            )));
        }
        if let Some(t) = c
            .layer_types
            .iter()
            .find(|t| !matches!(t.as_str(), "sliding_attention" | "full_attention"))
        {
            return Err(ModelError::Config(format!(
                "maple: unknown layer type '{t}'"
            )));
        }
        let rotated = c.rotated_dims();
        if rotated == 0 || !rotated.is_multiple_of(2) || rotated > c.head_dim {
            return Err(ModelError::Config(format!(
                "partial_rotary_factor {} gives {rotated} rotated dims of {}",
                c.partial_rotary_factor, c.head_dim
            )));
        }
        Ok(c)
    }

    /// Whether layer `i` is a sliding-window (RoPE) layer; the others are full NoPE layers.
    pub fn is_sliding(&self, i: usize) -> bool {
        self.layer_types[i] == "sliding_attention"
    }

    /// Dims of each head the sliding layers rotate (`int(head_dim · partial_rotary_factor)`).
    fn rotated_dims(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }
}

/// One decoder layer's weights (`model.layers.L.*`).
struct Layer {
    sliding: bool,
    q_proj: QRef,
    k_proj: QRef,
    v_proj: QRef,
    o_proj: QRef,
    q_norm: VRef,
    k_norm: VRef,
    input_layernorm: VRef,
    post_attention_layernorm: VRef,
    /// The router `mlp.gate.weight`, BF16 `[num_experts, hidden]`, scored in f32.
    gate: VRef,
    /// `mlp.switch_mlp.*` inside an expert blob.
    switch_mlp: Mlp,
}

/// A loaded Maple model with its KV cache and expert streamers (one sequence) on backend `B`.
pub struct Maple<B: Backend> {
    cfg: Config,
    engine: Engine,
    be: B,
    word_embeddings: QRef,
    norm: VRef,
    lm_head: QRef,
    layers: Vec<Layer>,
    rope: Rope,
    /// The KV cache (full layers and sliding rings; the rings copied at a checkpoint, so a
    /// follow-up turn can rewind after they have wrapped: prefix reuse in `serve` and `run --chat`).
    state: SequenceState<B>,
    streamers: Streamers,
    /// The approximate head for single-token decode (`--flash-head`).
    flash: Option<FlashHead>,
    /// Whether the current `forward` call is one token (FlashHead's condition, as `maple.py`'s
    /// `L == 1`).
    single: bool,
}

/// FlashHead (`maple.py` `FlashHead`): score the
/// `n_clusters` centroids (`lm_head_flash.centroids`, scaled by their cluster's largest row norm),
/// take the `n_probes` best clusters, compute exact logits only for their tokens (the
/// cluster-ordered head `lm_head_flash.head`, rows of `lm_head` permuted by `token_map`) and for
/// the forced tokens (rows of `lm_head`); every other logit is −∞.
struct FlashHead {
    centroids: QRef,
    /// `lm_head_flash.head` cluster by cluster, `[cluster_size, hidden]` each.
    clusters: Vec<QRef>,
    /// `token_map[c]`: the token ids of cluster `c`.
    token_map: Vec<Vec<u32>>,
    /// Forced token ids and their `lm_head` rows.
    forced: Vec<(u32, QRef)>,
    n_probes: usize,
}

impl FlashHead {
    fn load(engine: &Engine, cfg: &Config, lm_head: &QRef) -> Result<Self, ModelError> {
        let f = cfg.flash_head.as_ref().ok_or_else(|| {
            ModelError::Config(
                "--flash-head: this checkpoint has no FlashHead (config.json flash_head)".into(),
            )
        })?;
        if !f.scaled_centroids {
            return Err(ModelError::Config(
                "--flash-head: the FlashHead metadata predates scaled centroids".into(),
            ));
        }
        let (idx, map) = (&engine.index, &engine.map[..]);
        let (nc, cs, h) = (f.n_clusters, f.cluster_size, cfg.hidden_size);
        let centroids = QRef::resident(idx, map.len(), "lm_head_flash.centroids")?;
        check_dims(
            "lm_head_flash.centroids",
            (centroids.rows, centroids.cols),
            (nc, h),
        )?;
        let name = "lm_head_flash.head.weight";
        let e = idx.get(name).ok_or_else(|| WeightError {
            name: name.into(),
            why: "missing: --flash-head needs the cluster-ordered head copy".into(),
        })?;
        if e.logical_shape() != [nc as u64, cs as u64, h as u64] || !e.is_quantized() {
            return Err(WeightError {
                name: name.into(),
                why: format!(
                    "expected quantized [{nc}, {cs}, {h}], got {:?}",
                    e.logical_shape()
                ),
            }
            .into());
        }
        let part = |off: u64, size: u64, c: usize| {
            let per = size as usize / nc;
            (off as usize + c * per, per)
        };
        let clusters = (0..nc)
            .map(|c| {
                QRef::from_parts(
                    name,
                    cs,
                    h,
                    part(e.file_offset, e.size_bytes, c),
                    part(e.scale_offset, e.scale_size, c),
                    part(e.bias_offset, e.bias_size, c),
                    map.len(),
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tm = idx
            .get("lm_head_flash.token_map")
            .ok_or_else(|| WeightError {
                name: "lm_head_flash.token_map".into(),
                why: "missing from model_weights.bin".into(),
            })?;
        let ids: Vec<u32> = tm
            .weight_bytes(map)
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
            .collect();
        if tm.dtype != mference_format::Dtype::I32
            || ids.len() != nc * cs
            || ids.iter().any(|&i| i as usize >= cfg.vocab_size)
        {
            return Err(WeightError {
                name: "lm_head_flash.token_map".into(),
                why: format!(
                    "expected I32 [{nc}, {cs}] token ids below {}",
                    cfg.vocab_size
                ),
            }
            .into());
        }
        // One row of lm_head: its share of the head's weights, scales and biases.
        let [w, sc, bi] = lm_head.byte_ranges();
        let row = |id: u32| {
            let at = |(off, len): (usize, usize)| {
                let per = len / cfg.vocab_size;
                (off + id as usize * per, per)
            };
            QRef::from_parts("lm_head", 1, h, at(w), at(sc), at(bi), map.len())
        };
        let forced = f
            .force_tokens
            .iter()
            .filter(|&&id| (id as usize) < cfg.vocab_size)
            .map(|&id| Ok((id, row(id)?)))
            .collect::<Result<Vec<_>, WeightError>>()?;
        Ok(Self {
            centroids,
            clusters,
            token_map: ids.chunks(cs).map(<[u32]>::to_vec).collect(),
            forced,
            n_probes: f.n_probes.min(nc),
        })
    }

    /// Logits of the one row `xf` (already normed): exact for the probed clusters' tokens and the
    /// forced tokens, −∞ elsewhere (`[vocab]`).
    fn logits<B: Backend>(
        &self,
        be: &B,
        xf: &B::Tensor,
        vocab: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let scores = be.read(&one(be.matmul(&[&self.centroids], Resident, xf)?))?;
        let mut order: Vec<usize> = (0..scores.len()).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let probed = &order[..self.n_probes];
        let mut mats: Vec<&QRef> = probed.iter().map(|&c| &self.clusters[c]).collect();
        mats.extend(self.forced.iter().map(|(_, q)| q));
        let ys = be.matmul(&mats, Resident, xf)?;
        let mut full = vec![f32::NEG_INFINITY; vocab];
        for (i, vals) in be
            .read_many(&ys.iter().collect::<Vec<_>>())?
            .into_iter()
            .enumerate()
        {
            let ids: &[u32] = match probed.get(i) {
                Some(&c) => &self.token_map[c],
                None => std::slice::from_ref(&self.forced[i - probed.len()].0),
            };
            for (&id, &v) in ids.iter().zip(&vals) {
                full[id as usize] = v;
            }
        }
        Ok(full)
    }
}

impl<B: Backend> Maple<B> {
    /// Builds the model over an opened install: every resident tensor is resolved (and its shape
    /// checked against `cfg`) now, so a malformed install fails at load with the tensor's name.
    pub fn load(
        engine: Engine,
        be: B,
        cfg: Config,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let (idx, len) = (&engine.index, engine.map.len());
        let h = cfg.hidden_size;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (n_exp, mi) = (cfg.num_experts, cfg.moe_intermediate_size);
        let stride = engine.install.layout.expert_stride as usize;
        engine.check_moe(cfg.num_hidden_layers, n_exp, cfg.num_experts_per_tok)?;
        // A quantized Linear `base` that must be [rows, cols].
        let q = |base: String, rows, cols| linear(idx, len, &base, rows, cols);
        let v = |name: String, n: usize| VRef::resident(idx, &name, n);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let b = format!("model.layers.{l}");
            let a = format!("{b}.self_attn");
            let blob = engine.expert_blob(l)?;
            let ex = |part: &str, t, rows, cols| {
                expert_linear(&format!("{b}.mlp.switch_mlp.{part}"), t, stride, rows, cols)
            };
            layers.push(Layer {
                sliding: cfg.is_sliding(l),
                q_proj: q(format!("{a}.q_proj"), nh * hd, h)?,
                k_proj: q(format!("{a}.k_proj"), nkv * hd, h)?,
                v_proj: q(format!("{a}.v_proj"), nkv * hd, h)?,
                o_proj: q(format!("{a}.o_proj"), h, nh * hd)?,
                q_norm: v(format!("{a}.q_norm.weight"), hd)?,
                k_norm: v(format!("{a}.k_norm.weight"), hd)?,
                input_layernorm: v(format!("{b}.input_layernorm.weight"), h)?,
                post_attention_layernorm: v(format!("{b}.post_attention_layernorm.weight"), h)?,
                gate: v(format!("{b}.mlp.gate.weight"), n_exp * h)?,
                switch_mlp: Mlp {
                    gate_proj: ex("gate_proj", &blob.gate, mi, h)?,
                    up_proj: ex("up_proj", &blob.up, mi, h)?,
                    down_proj: ex("down_proj", &blob.down, h, mi)?,
                },
            });
        }
        let table = if idx.get("model.word_embeddings.weight").is_some() {
            "model.word_embeddings"
        } else {
            "model.embed_tokens"
        };
        let word_embeddings = q(table.into(), cfg.vocab_size, h)?;
        let lm_head = if cfg.tie_word_embeddings {
            word_embeddings
        } else {
            q("lm_head".into(), cfg.vocab_size, h)?
        };
        let norm = v("model.norm.weight".into(), h)?;
        // Sliding layers keep a ring of the window plus one prefill chunk; full layers everything.
        let ring = opts.sliding_rows(cfg.sliding_window);
        let kv = layers
            .iter()
            .map(|l| {
                let rows = if l.sliding { ring } else { opts.max_context };
                be.new_kv(rows, l.sliding, nkv, hd, opts.kv_dtype)
            })
            .collect::<Result<_, _>>()?;
        let flash = match opts.flash_head {
            true => Some(FlashHead::load(&engine, &cfg, &lm_head)?),
            false => None,
        };
        Ok(Self {
            flash,
            single: false,
            rope: Rope::neox(cfg.rotated_dims(), cfg.rope_theta),
            streamers: Streamers::new(cfg.num_hidden_layers),
            cfg,
            engine,
            be,
            word_embeddings,
            norm,
            lm_head,
            layers,
            state: SequenceState::new(KvCache::new(kv)),
        })
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl<B: Backend + 'static> FamilyModel for Maple<B> {
    type Backend = B;

    fn begin_forward(&mut self, tokens: &[u32]) {
        self.single = tokens.len() == 1;
    }

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`; see [`crate::Want`].
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError> {
        let (cfg, be) = (&self.cfg, &self.be);
        let t = tokens.len();
        let h = cfg.hidden_size;
        let d = cfg.head_dim;
        let pos0 = self.state.kv.len;
        let eps = cfg.rms_norm_eps;
        check_ids(tokens, cfg.vocab_size)?;

        let mut x = be.embed(&self.word_embeddings, tokens, None)?; // [T, hidden]
        for (li, layer) in self.layers.iter().enumerate() {
            // Attention: q/k/v, per-head q/k norms, RoPE on sliding layers only (NoPE on full).
            let mut attn_norm = be.copy(&x)?;
            be.rms_norm(&mut attn_norm, h, Norm::Weight(&layer.input_layernorm), eps)?;
            let mut qkv = be.matmul(
                &[&layer.q_proj, &layer.k_proj, &layer.v_proj],
                Resident,
                &attn_norm,
            )?;
            let v = qkv.pop().expect("v_proj"); // [T, n_kv_heads · head_dim]
            let mut k = qkv.pop().expect("k_proj");
            let mut q = qkv.pop().expect("q_proj"); // [T, n_heads · head_dim]
            be.rms_norm(&mut q, d, Norm::Weight(&layer.q_norm), eps)?;
            be.rms_norm(&mut k, d, Norm::Weight(&layer.k_norm), eps)?;
            if layer.sliding {
                be.rope(&mut q, &self.rope, d, pos0)?;
                be.rope(&mut k, &self.rope, d, pos0)?;
            }
            let kv = &mut self.state.kv.layers[li];
            be.kv_write(kv, pos0, &k, &v)?;
            let shape = AttnShape {
                n_heads: cfg.num_attention_heads,
                n_kv_heads: cfg.num_key_value_heads,
                head_dim: d,
                window: layer.sliding.then_some(cfg.sliding_window),
                scale: (d as f32).powf(-0.5),
                sinks: None,
            };
            let attn = be.attention(&q, kv, pos0, &shape)?;
            let o = one(be.matmul(&[&layer.o_proj], Resident, &attn)?);
            be.add(&mut x, &o, 1.0)?;

            // MoE: fp32 softmax over every expert, top-k renormalised, clamped SwiGLU experts.
            let mut u = be.copy(&x)?;
            be.rms_norm(
                &mut u,
                h,
                Norm::Weight(&layer.post_attention_layernorm),
                eps,
            )?;
            let router_logits = be.matmul_bf16(&layer.gate, cfg.num_experts, &u)?; // [T, num_experts]
            let routes = be.route(
                &router_logits,
                &RouterSpec {
                    scoring: Scoring::TopKOfSoftmax {
                        norm_topk_prob: cfg.norm_topk_prob,
                    },
                    top_k: cfg.num_experts_per_tok,
                    per_expert_scale: None,
                    trace: self.engine.traces_router(),
                    forced: self.engine.forced_routes(li, pos0, t).as_deref(),
                },
            )?;
            self.engine.note_router_margins(pos0, &routes.margins);
            let streamer = self.streamers.get(li, &self.engine)?;
            let ((), moe_out) = moe::routed_experts(
                be,
                streamer,
                &layer.switch_mlp,
                Act::SiluClamped(MLP_CLAMP),
                &u,
                &routes,
                || Ok::<_, ModelError>(((), be.zeros(t, h)?)),
            )?;
            be.add(&mut x, &moe_out, 1.0)?;
        }
        self.state.kv.len = pos0 + t;

        let head = crate::Head {
            norm: &self.norm,
            eps,
            weight: &self.lm_head,
            softcap: None,
        };
        match &self.flash {
            Some(f) if self.single && t == 1 && want != ChunkWant::None => {
                flash_head(be, &x, pos0, want, &head, f, cfg.vocab_size)
            }
            _ => crate::head(be, &x, pos0, want, &head),
        }
    }

    crate::family_parts!();

    fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }
}

/// [`crate::head`] through FlashHead for one row: the final norm, then [`FlashHead::logits`];
/// the greedy id is the first largest logit (ids outside the probed clusters are never chosen).
///
/// Errors: [`ModelError::NonFinite`] when the residual stream or a computed logit is NaN or ±∞.
fn flash_head<B: Backend>(
    be: &B,
    x: &B::Tensor,
    pos0: usize,
    want: ChunkWant,
    head: &crate::Head,
    flash: &FlashHead,
    vocab: usize,
) -> Result<Logits, ModelError> {
    let non_finite = |what| ModelError::NonFinite {
        what,
        first: pos0,
        end: pos0 + 1,
    };
    if !be.all_finite(x)? {
        return Err(non_finite("residual stream"));
    }
    let mut xf = be.copy(x)?;
    be.rms_norm(&mut xf, x.cols(), Norm::Weight(head.norm), head.eps)?;
    let logits = flash.logits(be, &xf, vocab)?;
    if logits.iter().any(|v| v.is_nan() || *v == f32::INFINITY) {
        return Err(non_finite("logits"));
    }
    Ok(match want {
        ChunkWant::Argmax => Logits::Argmax(first_argmax(&logits) as u32),
        _ => Logits::Rows(logits),
    })
}

/// The index of the first largest value (mlx's `argmax`; −∞ entries never win over a finite one).
fn first_argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}
