//! DeepSeek-V4-Flash (`deepseek_v4`): shared-KV MQA with a low-rank query (one 512-wide K = V
//! head, per-head sinks, interleaved RoPE on the trailing dims and the inverse rotation on the
//! output, a grouped low-rank output projection) over a sliding window, plus long-range compressed
//! KV on most layers (CSA: rate 4 with the Lightning indexer's top-k; HCA: rate 128, dense), four
//! residual streams mixed by manifold-constrained hyper-connections (mHC), hash-routed MoE on the
//! first layers (`tid2eid[token]`) and sqrt-softplus routing with a selection-only correction bias
//! after them, clamped SwiGLU experts plus a shared expert, untied head.
//!
//! Math: `reference/architectures.md` §4 and transformers 5.23 `modeling_deepseek_v4.py` (the
//! fixtures' reference); checkpoint names: the MLX layout of `mlx-community/DeepSeek-V4-Flash-2bit-DQ`
//! (`reference/family-oracles.md` §2.2): `attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b,
//! attn_sink}` are HF's `q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks`;
//! `compressor.{wkv, wgate, ape, norm}` are `kv_proj, gate_proj, position_bias, kv_norm`;
//! `attn_norm` / `ffn_norm` are `input_layernorm` / `post_attention_layernorm`. Every norm is the
//! plain `rms(x)·w`. Intermediates are named after the reference.
//!
//! State per sequence, sized once at load: the sliding K = V ring per layer, and per compressed
//! layer the entries `[max_context / rate, head_dim]`, the pending rows of an unfinished window
//! (projected kv and gate), and for CSA the previous window's Ca slice (kv and gate + ape); the
//! indexer keeps the same set at its own width. Indexer ties go to the lower entry.

use serde::Deserialize;

use mference_backend::Weights::Resident;
use mference_backend::{
    f32_vector, moe, Act, AttnShape, Backend, FRef, HcSpec, KvCache, Mlp, Norm, QRef, Rope,
    RouterSpec, Scoring, Tensor, VRef, Yarn,
};

use crate::{check_ids, one, ChunkWant, Engine, LoadOptions, Logits, ModelError, Streamers, Want};

/// The flat `config.json` of a DeepSeek-V4 checkpoint (HF keys; the published legacy keys
/// `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` as written).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub q_lora_rank: usize,
    pub qk_rope_head_dim: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default = "one_usize")]
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub num_hash_layers: usize,
    /// HF's explicit MLP schedule (`hash_moe` / `moe`); overrides `num_hash_layers`.
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    pub routed_scaling_factor: f32,
    pub swiglu_limit: f32,
    #[serde(default = "sqrtsoftplus")]
    pub scoring_func: String,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub sliding_window: usize,
    /// Per layer 0 (sliding), 4 (CSA) or 128 (HCA); may run past the layers (the MTP entry).
    #[serde(default)]
    pub compress_ratios: Option<Vec<usize>>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "silu")]
    pub hidden_act: String,
}

/// Legacy `rope_scaling` (`{type: yarn, factor, original_max_position_embeddings, beta_fast,
/// beta_slow}`): the compress rope's YaRN (transformers forces its attention factor to 1).
#[derive(Clone, Debug, Deserialize)]
pub struct RopeScaling {
    #[serde(rename = "type", alias = "rope_type")]
    pub kind: String,
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    #[serde(default = "beta_fast")]
    pub beta_fast: f64,
    #[serde(default = "beta_slow")]
    pub beta_slow: f64,
}

fn default_eps() -> f32 {
    1e-6
}
fn one_usize() -> usize {
    1
}
fn yes() -> bool {
    true
}
fn sqrtsoftplus() -> String {
    "sqrtsoftplus".into()
}
fn silu() -> String {
    "silu".into()
}
fn beta_fast() -> f64 {
    32.0
}
fn beta_slow() -> f64 {
    1.0
}

/// A layer's attention kind: the compression rate of its long-range KV (`None`: sliding only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sliding,
    /// Compressed sparse attention (overlapping windows, indexer top-k).
    Csa(usize),
    /// Heavily compressed attention (dense over its entries).
    Hca(usize),
}

impl Config {
    /// Reads `config.json` and rejects what this runtime does not implement.
    pub fn from_config_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let c: Config = serde_json::from_value(v.clone())
            .map_err(|e| ModelError::Config(format!("deepseek_v4 config: {e}")))?;
        let bad = |what: String| Err(ModelError::Config(format!("deepseek_v4: {what}")));
        if c.num_key_value_heads != 1 {
            return bad(format!(
                "num_key_value_heads {} (the shared K = V head must be 1)",
                c.num_key_value_heads
            ));
        }
        if c.scoring_func != "sqrtsoftplus" || !c.norm_topk_prob || c.hidden_act != "silu" {
            return bad(format!(
                "scoring_func {} / norm_topk_prob {} / hidden_act {} is not supported",
                c.scoring_func, c.norm_topk_prob, c.hidden_act
            ));
        }
        if c.tie_word_embeddings || c.n_shared_experts != 1 {
            return bad("tied embeddings or a shared-expert count other than 1".into());
        }
        let rd = c.qk_rope_head_dim;
        if rd == 0
            || !rd.is_multiple_of(2)
            || rd > c.head_dim
            || rd > c.index_head_dim
            || c.o_groups == 0
            || !c.num_attention_heads.is_multiple_of(c.o_groups)
            || c.hc_mult == 0
        {
            return bad("qk_rope_head_dim, o_groups or hc_mult out of range".into());
        }
        if let Some(s) = &c.rope_scaling {
            if s.kind != "yarn" {
                return bad(format!("rope_scaling type {}", s.kind));
            }
        }
        (0..c.num_hidden_layers)
            .map(|l| c.kind(l))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(c)
    }

    /// Layer `l`'s attention kind from `layer_types` or, failing that, `compress_ratios`
    /// (transformers' default schedule is V4-Pro's, so one of them is required).
    pub fn kind(&self, l: usize) -> Result<Kind, ModelError> {
        let bad = |w: String| ModelError::Config(format!("deepseek_v4: {w}"));
        if let Some(t) = &self.layer_types {
            return match t.get(l).map(String::as_str) {
                Some("sliding_attention") => Ok(Kind::Sliding),
                Some("compressed_sparse_attention") => Ok(Kind::Csa(4)),
                Some("heavily_compressed_attention") => Ok(Kind::Hca(128)),
                other => Err(bad(format!("layer_types[{l}] is {other:?}"))),
            };
        }
        let r = self
            .compress_ratios
            .as_ref()
            .ok_or_else(|| bad("needs layer_types or compress_ratios".into()))?;
        match r.get(l) {
            Some(0) => Ok(Kind::Sliding),
            Some(4) => Ok(Kind::Csa(4)),
            Some(&m) if m > 4 => Ok(Kind::Hca(m)),
            other => Err(bad(format!("compress_ratios[{l}] is {other:?}"))),
        }
    }

    /// Whether layer `l`'s router is the hash table `tid2eid`.
    pub fn is_hash(&self, l: usize) -> bool {
        match &self.mlp_layer_types {
            Some(t) => t.get(l).is_some_and(|s| s == "hash_moe"),
            None => l < self.num_hash_layers,
        }
    }

    fn hc(&self) -> HcSpec {
        HcSpec {
            streams: self.hc_mult,
            sinkhorn_iters: self.hc_sinkhorn_iters,
            hc_eps: self.hc_eps,
            norm_eps: self.rms_norm_eps,
        }
    }
}

/// One mHC site's projection `fn` `[rows, hc_mult·hidden]`, `base` and `scale` (F32).
struct HyperConnection<B: Backend> {
    f: B::Tensor,
    base: Vec<f32>,
    scale: Vec<f32>,
}

/// A KV compressor (`attn.compressor.*`, or the indexer's `attn.indexer.compressor.*`).
struct Compressor<B: Backend> {
    wkv: QRef,
    wgate: QRef,
    /// `[rate, c·dim]` (`c = 2` with overlap).
    ape: B::Tensor,
    /// The Ca half of `ape`, `[rate, dim]` (overlap only): added to the saved prior gate rows.
    ape_ca: Option<B::Tensor>,
    norm: VRef,
    rate: usize,
    dim: usize,
    overlap: bool,
}

/// The Lightning indexer of a CSA layer.
struct Indexer<B: Backend> {
    compressor: Compressor<B>,
    wq_b: QRef,
    weights_proj: QRef,
}

struct Attention<B: Backend> {
    wq_a: QRef,
    q_norm: VRef,
    wq_b: QRef,
    wkv: QRef,
    kv_norm: VRef,
    wo_a: QRef,
    wo_b: QRef,
    attn_sink: Vec<f32>,
    compressor: Option<Compressor<B>>,
    indexer: Option<Indexer<B>>,
}

/// How a layer picks its experts.
enum Gate {
    /// `tid2eid` `[vocab, top_k]`, flattened.
    Hash(Vec<usize>),
    /// `e_score_correction_bias`.
    Learned(FRef),
}

struct Layer<B: Backend> {
    kind: Kind,
    attn: Attention<B>,
    attn_norm: VRef,
    ffn_norm: VRef,
    attn_hc: HyperConnection<B>,
    ffn_hc: HyperConnection<B>,
    /// Router `ffn.gate.weight` `[num_experts, hidden]` (BF16 in the checkpoint, f32 here).
    gate: B::Tensor,
    routing: Gate,
    shared_experts: Mlp,
    /// `ffn.switch_mlp.*` inside an expert blob.
    switch_mlp: Mlp,
}

/// A compressor's per-sequence state.
struct CompressorState<B: Backend> {
    /// `[max_context / rate, dim]`; the first `count` rows are valid.
    entries: B::Tensor,
    count: usize,
    /// Projected kv and gate rows of the unfinished window, `[rate, c·dim]`; `pending` are valid.
    pending_kv: B::Tensor,
    pending_gate: B::Tensor,
    pending: usize,
    /// The previous window's Ca slice: kv and gate + ape, `[rate, dim]` (CSA).
    prior: Option<(B::Tensor, B::Tensor)>,
}

/// The RoPE tables: main (sliding layers) and compress (CSA/HCA layers and the indexer), each as
/// a forward and an inverse rotation of the trailing `qk_rope_head_dim` dims of a head.
struct Ropes {
    main: (Rope, Rope),
    compress: (Rope, Rope),
    /// The compress rope over an indexer head.
    index: Rope,
}

/// A loaded DeepSeek-V4 model with its sliding rings, compressed caches and expert streamers (one
/// sequence) on backend `B`.
pub struct DeepseekV4<B: Backend> {
    cfg: Config,
    engine: Engine,
    be: B,
    embed_tokens: QRef,
    norm: VRef,
    lm_head: QRef,
    hc_head: HyperConnection<B>,
    layers: Vec<Layer<B>>,
    ropes: Ropes,
    /// The sliding K = V ring of every layer.
    kv: KvCache<B::Kv>,
    /// Per layer: the compressor's and the indexer's state.
    states: Vec<(Option<CompressorState<B>>, Option<CompressorState<B>>)>,
    streamers: Streamers,
    max_context: usize,
    /// [`LoadOptions::shadow_prefetch`].
    shadow_prefetch: bool,
}

/// Speculative reads started per layer by the shadow prefetch (the original system's sweep of
/// 1/2/3/4/6 peaked at 2, `reference/family-oracles.md` §5.1).
const SHADOW_BUDGET: usize = 2;

/// Interleaved RoPE on the trailing `rope.rotated` dims of a `head_dim` head: the leading pairs
/// get frequency 0 (cos 1, sin 0: unchanged); `inverse` rotates by `−pos` (HF's `(cos, −sin)`).
fn tail(rope: &Rope, head_dim: usize, inverse: bool) -> Rope {
    let lead = (head_dim - rope.rotated) / 2;
    let sign = if inverse { -1.0 } else { 1.0 };
    Rope {
        inv_freq: std::iter::repeat_n(0.0, lead)
            .chain(rope.inv_freq.iter().map(|f| sign * f))
            .collect(),
        rotated: head_dim,
        ..rope.clone()
    }
}

impl<B: Backend> DeepseekV4<B> {
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
        let (nh, hd) = (cfg.num_attention_heads, cfg.head_dim);
        let (ni, id) = (cfg.index_n_heads, cfg.index_head_dim);
        let (g, r) = (cfg.o_groups, cfg.o_lora_rank);
        let n_exp = cfg.n_routed_experts;
        let mi = cfg.moe_intermediate_size;
        let hc = cfg.hc_mult;
        let stride = engine.install.layout.expert_stride as usize;
        engine.check_moe(cfg.num_hidden_layers, n_exp, cfg.num_experts_per_tok)?;
        let q = |base: String, rows: usize, cols: usize| -> Result<QRef, ModelError> {
            let w = QRef::resident(idx, map.len(), &base)?;
            check(&base, (w.rows, w.cols), (rows, cols))?;
            Ok(w)
        };
        let v = |name: String, n: usize| VRef::resident(idx, &name, n);
        let vector = |name: String, n: usize| f32_vector(idx, map, &name, n);
        let hyper = |p: String, rows: usize| -> Result<HyperConnection<B>, ModelError> {
            Ok(HyperConnection {
                f: be.upload(&vector(format!("{p}.fn"), rows * hc * h)?, hc * h)?,
                base: vector(format!("{p}.base"), rows)?,
                scale: vector(format!("{p}.scale"), if rows == hc { 1 } else { 3 })?,
            })
        };
        let compressor = |p: String, rate: usize, dim: usize, overlap: bool| {
            let c = if overlap { 2 } else { 1 };
            let ape = vector(format!("{p}.ape"), rate * c * dim)?;
            let ape_ca: Option<Vec<f32>> = overlap.then(|| {
                ape.chunks_exact(c * dim)
                    .flat_map(|row| row[..dim].iter().copied())
                    .collect()
            });
            Ok::<_, ModelError>(Compressor {
                wkv: q(format!("{p}.wkv"), c * dim, h)?,
                wgate: q(format!("{p}.wgate"), c * dim, h)?,
                ape: be.upload(&ape, c * dim)?,
                ape_ca: ape_ca.map(|a| be.upload(&a, dim)).transpose()?,
                norm: v(format!("{p}.norm.weight"), dim)?,
                rate,
                dim,
                overlap,
            })
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let b = format!("model.layers.{l}");
            let kind = cfg.kind(l)?;
            let a = format!("{b}.attn");
            let (comp, indexer) = match kind {
                Kind::Sliding => (None, None),
                Kind::Hca(m) => (
                    Some(compressor(format!("{a}.compressor"), m, hd, false)?),
                    None,
                ),
                Kind::Csa(m) => (
                    Some(compressor(format!("{a}.compressor"), m, hd, true)?),
                    Some(Indexer {
                        compressor: compressor(format!("{a}.indexer.compressor"), m, id, true)?,
                        wq_b: q(format!("{a}.indexer.wq_b"), ni * id, cfg.q_lora_rank)?,
                        weights_proj: q(format!("{a}.indexer.weights_proj"), ni, h)?,
                    }),
                ),
            };
            let attn = Attention {
                wq_a: q(format!("{a}.wq_a"), cfg.q_lora_rank, h)?,
                q_norm: v(format!("{a}.q_norm.weight"), cfg.q_lora_rank)?,
                wq_b: q(format!("{a}.wq_b"), nh * hd, cfg.q_lora_rank)?,
                wkv: q(format!("{a}.wkv"), hd, h)?,
                kv_norm: v(format!("{a}.kv_norm.weight"), hd)?,
                wo_a: q(format!("{a}.wo_a"), g * r, nh * hd / g)?,
                wo_b: q(format!("{a}.wo_b"), h, g * r)?,
                attn_sink: vector(format!("{a}.attn_sink"), nh)?,
                compressor: comp,
                indexer,
            };
            let routing = if cfg.is_hash(l) {
                Gate::Hash(tid2eid(
                    &engine,
                    &format!("{b}.ffn.gate.tid2eid"),
                    cfg.vocab_size,
                    cfg.num_experts_per_tok,
                    n_exp,
                )?)
            } else {
                Gate::Learned(FRef::resident(
                    idx,
                    &format!("{b}.ffn.gate.e_score_correction_bias"),
                    n_exp,
                )?)
            };
            let blob = engine.expert_blob(l)?;
            let ex = |part: &str, t, rows, cols| -> Result<QRef, ModelError> {
                let name = format!("{b}.ffn.switch_mlp.{part}");
                let w = QRef::expert(&name, t, stride)?;
                check(&name, (w.rows, w.cols), (rows, cols))?;
                Ok(w)
            };
            layers.push(Layer {
                kind,
                attn,
                attn_norm: v(format!("{b}.attn_norm.weight"), h)?,
                ffn_norm: v(format!("{b}.ffn_norm.weight"), h)?,
                attn_hc: hyper(format!("{b}.attn_hc"), (2 + hc) * hc)?,
                ffn_hc: hyper(format!("{b}.ffn_hc"), (2 + hc) * hc)?,
                gate: be.upload(&vector(format!("{b}.ffn.gate.weight"), n_exp * h)?, h)?,
                routing,
                shared_experts: Mlp {
                    gate_proj: q(format!("{b}.ffn.shared_experts.gate_proj"), mi, h)?,
                    up_proj: q(format!("{b}.ffn.shared_experts.up_proj"), mi, h)?,
                    down_proj: q(format!("{b}.ffn.shared_experts.down_proj"), h, mi)?,
                },
                switch_mlp: Mlp {
                    gate_proj: ex("gate_proj", &blob.gate, mi, h)?,
                    up_proj: ex("up_proj", &blob.up, mi, h)?,
                    down_proj: ex("down_proj", &blob.down, h, mi)?,
                },
            });
        }
        let rd = cfg.qk_rope_head_dim;
        let main = Rope::interleaved(rd, cfg.rope_theta);
        let mut compress = Rope::interleaved(rd, cfg.compress_rope_theta);
        if let Some(s) = &cfg.rope_scaling {
            let y = Yarn {
                factor: s.factor,
                original_max_position_embeddings: s.original_max_position_embeddings,
                beta_fast: s.beta_fast,
                beta_slow: s.beta_slow,
                attention_factor: Some(1.0),
            };
            compress = compress.yarn(&y, cfg.compress_rope_theta);
        }
        let ropes = Ropes {
            main: (tail(&main, hd, false), tail(&main, hd, true)),
            compress: (tail(&compress, hd, false), tail(&compress, hd, true)),
            index: tail(&compress, id, false),
        };
        let ring = (cfg.sliding_window + opts.prefill_chunk).min(opts.max_context);
        let kv = (0..cfg.num_hidden_layers)
            .map(|_| be.new_kv(ring, true, 1, hd, opts.kv_dtype))
            .collect::<Result<_, _>>()?;
        let state = |c: &Compressor<B>| -> Result<CompressorState<B>, ModelError> {
            let width = if c.overlap { 2 * c.dim } else { c.dim };
            Ok(CompressorState {
                entries: be.zeros(opts.max_context / c.rate + 1, c.dim)?,
                count: 0,
                pending_kv: be.zeros(c.rate, width)?,
                pending_gate: be.zeros(c.rate, width)?,
                pending: 0,
                prior: None,
            })
        };
        let states = layers
            .iter()
            .map(|l| {
                Ok((
                    l.attn.compressor.as_ref().map(state).transpose()?,
                    l.attn
                        .indexer
                        .as_ref()
                        .map(|i| state(&i.compressor))
                        .transpose()?,
                ))
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(Self {
            embed_tokens: q("model.embed_tokens".into(), cfg.vocab_size, h)?,
            norm: v("model.norm.weight".into(), h)?,
            lm_head: q("lm_head".into(), cfg.vocab_size, h)?,
            hc_head: hyper("model.hc_head".into(), hc)?,
            streamers: Streamers::new(cfg.num_hidden_layers),
            max_context: opts.max_context,
            shadow_prefetch: opts.shadow_prefetch,
            cfg,
            engine,
            be,
            layers,
            ropes,
            kv: KvCache::new(kv),
            states,
        })
    }

    /// The parsed config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`.
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError> {
        let (cfg, be) = (&self.cfg, &self.be);
        let t = tokens.len();
        let (h, n) = (cfg.hidden_size, cfg.hc_mult);
        let pos0 = self.kv.len;
        let eps = cfg.rms_norm_eps;
        let spec = cfg.hc();
        check_ids(tokens, cfg.vocab_size)?;

        // The embedding in every stream: x_k = 1·embed + Σ_j 0·x_j.
        let embed = be.embed(&self.embed_tokens, tokens, None)?; // [T, hidden]
        let mut x = be.hc_post(
            &be.zeros(t, n * h)?,
            &embed,
            &be.upload(&vec![1.0; t * n], n)?,
            &be.zeros(t, n * n)?,
        )?; // [T, hc_mult·hidden]
        for (li, layer) in self.layers.iter().enumerate() {
            let hc = &layer.attn_hc;
            let (collapsed, pc) = be.hc_pre(&x, &hc.f, &hc.base, &hc.scale, &spec)?;
            let (post, comb) = pc.expect("an mHC site with post and comb");
            let mut a = collapsed;
            be.rms_norm(&mut a, h, Norm::Weight(&layer.attn_norm), eps)?;
            let (cs, is) = &mut self.states[li];
            let kv = &mut self.kv.layers[li];
            let attn_out = attention(cfg, be, layer, &self.ropes, kv, cs, is, &a, pos0)?;
            x = be.hc_post(&x, &attn_out, &post, &comb)?;

            let hc = &layer.ffn_hc;
            let (collapsed, pc) = be.hc_pre(&x, &hc.f, &hc.base, &hc.scale, &spec)?;
            let (post, comb) = pc.expect("an mHC site with post and comb");
            let mut u = collapsed;
            be.rms_norm(&mut u, h, Norm::Weight(&layer.ffn_norm), eps)?;
            let streamer = self.streamers.get(li, &self.engine)?;
            let moe_out = sparse_moe(
                cfg,
                be,
                layer,
                streamer,
                &u,
                tokens,
                &self.engine,
                (li, pos0),
            )?;
            x = be.hc_post(&x, &moe_out, &post, &comb)?;
            // Shadow prefetch (decode): the next layer's router on this layer's FFN input; its
            // reads overlap the next layer's attention.
            if let (true, 1, Some(next)) = (self.shadow_prefetch, t, self.layers.get(li + 1)) {
                let routes = route(cfg, be, next, &u, tokens, &self.engine, (li + 1, pos0))?;
                let mut guess: Vec<(usize, f32)> = routes
                    .experts
                    .iter()
                    .map(|(&e, rows)| (e, rows[0].1))
                    .collect();
                guess.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let ids: Vec<usize> = guess.iter().take(SHADOW_BUDGET).map(|g| g.0).collect();
                self.streamers.get(li + 1, &self.engine)?.prefetch(&ids);
            }
        }
        self.kv.len = pos0 + t;

        let hc = &self.hc_head;
        let (collapsed, _) = be.hc_pre(&x, &hc.f, &hc.base, &hc.scale, &spec)?;
        let head = crate::Head {
            norm: &self.norm,
            eps,
            weight: &self.lm_head,
            softcap: None,
        };
        crate::head(be, &collapsed, pos0, want, &head)
    }
}

/// `tid2eid` (I64 `[vocab, top_k]`) read to the host, each id checked against the expert count.
fn tid2eid(
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

/// The attention block over the rows of `a` (`[T, hidden]`, the normed collapsed streams) at
/// positions `pos0..` (transformers `DeepseekV4Attention.forward`). Returns `[T, hidden]`.
#[allow(clippy::too_many_arguments)]
fn attention<B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    ropes: &Ropes,
    kv: &mut B::Kv,
    cs: &mut Option<CompressorState<B>>,
    is: &mut Option<CompressorState<B>>,
    a: &B::Tensor,
    pos0: usize,
) -> Result<B::Tensor, ModelError> {
    let at = &layer.attn;
    let (nh, hd) = (cfg.num_attention_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let t = a.rows();
    let (rope, rope_inv) = match layer.kind {
        Kind::Sliding => &ropes.main,
        _ => &ropes.compress,
    };
    let mut p = be.matmul(&[&at.wq_a, &at.wkv], Resident, a)?;
    let mut kv_rows = p.pop().expect("wkv"); // [T, head_dim]
    let mut q_residual = p.pop().expect("wq_a"); // [T, q_lora_rank]
    be.rms_norm(
        &mut q_residual,
        cfg.q_lora_rank,
        Norm::Weight(&at.q_norm),
        eps,
    )?;
    let mut q = one(be.matmul(&[&at.wq_b], Resident, &q_residual)?); // [T, heads·head_dim]
    be.rms_norm(&mut q, hd, Norm::NoScale, eps)?;
    be.rope(&mut q, rope, hd, pos0)?;
    be.rms_norm(&mut kv_rows, hd, Norm::Weight(&at.kv_norm), eps)?;
    be.rope(&mut kv_rows, rope, hd, pos0)?;
    be.kv_write(kv, pos0, &kv_rows, &kv_rows)?;

    let shape = AttnShape {
        n_heads: nh,
        n_kv_heads: 1,
        head_dim: hd,
        window: Some(cfg.sliding_window),
        scale: (hd as f32).powf(-0.5),
        sinks: Some(at.attn_sink.clone()),
    };
    let mut o = match (&at.compressor, cs.as_mut()) {
        (Some(c), Some(st)) => {
            compress(cfg, be, c, st, &ropes.compress.0, hd, a)?;
            // Entry w covers positions rate·w .. rate·w + rate − 1: visible from position p iff
            // w < (p + 1) / rate.
            let n_vis: Vec<usize> = (0..t).map(|r| (pos0 + r + 1) / c.rate).collect();
            let visible: Vec<Vec<usize>> = match (&at.indexer, is.as_mut()) {
                (Some(ix), Some(ist)) => {
                    compress(
                        cfg,
                        be,
                        &ix.compressor,
                        ist,
                        &ropes.index,
                        cfg.index_head_dim,
                        a,
                    )?;
                    let (ni, id) = (cfg.index_n_heads, cfg.index_head_dim);
                    let mut iq = one(be.matmul(&[&ix.wq_b], Resident, &q_residual)?); // [T, ni·id]
                    be.rope(&mut iq, &ropes.index, id, pos0)?;
                    let mut w = one(be.matmul(&[&ix.weights_proj], Resident, a)?); // [T, ni]
                    let scale = (ni as f32).powf(-0.5) * (id as f32).powf(-0.5);
                    be.unary(&mut w, mference_backend::Unary::Scale(scale))?;
                    be.index_top_k(&iq, &ist.entries, &w, ni, &n_vis, cfg.index_topk)?
                }
                _ => n_vis.iter().map(|&n| (0..n).collect()).collect(),
            };
            be.attention_sparse(&q, kv, pos0, &shape, &st.entries, &visible)?
        }
        _ => be.attention(&q, kv, pos0, &shape)?,
    };
    // K = V carried the rotation into the output: rotate it back by −pos.
    be.rope(&mut o, rope_inv, hd, pos0)?;
    let grouped = be.matmul_grouped(&at.wo_a, cfg.o_groups, Resident, &o)?; // [T, groups·o_lora]
    Ok(one(be.matmul(&[&at.wo_b], Resident, &grouped)?))
}

/// Runs a compressor over the rows of `a`: projects kv and gate, closes every window the pending
/// rows plus these complete, and appends the pooled, normed, rotated entries to `st` (transformers
/// `DeepseekV4{CSA,HCA}Compressor` with its cache: `store_compression_weights`,
/// `update_overlap_state`, `update_compressor_states`).
fn compress<B: Backend>(
    cfg: &Config,
    be: &B,
    c: &Compressor<B>,
    st: &mut CompressorState<B>,
    rope: &Rope,
    head_dim: usize,
    a: &B::Tensor,
) -> Result<(), ModelError> {
    let t = a.rows();
    let m = c.rate;
    let mut p = be.matmul(&[&c.wkv, &c.wgate], Resident, a)?;
    let gate = p.pop().expect("wgate"); // [T, c·dim]
    let kv = p.pop().expect("wkv");
    let total = st.pending + t;
    let n_win = total / m;
    if n_win == 0 {
        be.set_rows(&mut st.pending_kv, st.pending, &kv)?;
        be.set_rows(&mut st.pending_gate, st.pending, &gate)?;
        st.pending += t;
        return Ok(());
    }
    let usable = n_win * m;
    let from_chunk = usable - st.pending; // rows of this chunk inside closed windows
    let width = kv.cols();
    let windows = |pending: &B::Tensor, new: &B::Tensor| -> Result<B::Tensor, ModelError> {
        let mut w = be.zeros(usable, width)?;
        if st.pending > 0 {
            be.set_rows(
                &mut w,
                0,
                &be.gather_rows(pending, &(0..st.pending).collect::<Vec<_>>())?,
            )?;
        }
        be.set_rows(
            &mut w,
            st.pending,
            &be.gather_rows(new, &(0..from_chunk).collect::<Vec<_>>())?,
        )?;
        Ok(w)
    };
    let kv_w = windows(&st.pending_kv, &kv)?; // [usable, c·dim]
    let gate_w = windows(&st.pending_gate, &gate)?;
    let prior = st.prior.as_ref().map(|(k, g)| (k, g));
    let mut pooled = be.compress_pool(&kv_w, &gate_w, &c.ape, m, c.overlap, prior)?; // [W, dim]
    be.rms_norm(&mut pooled, c.dim, Norm::Weight(&c.norm), cfg.rms_norm_eps)?;
    let positions: Vec<usize> = (st.count..st.count + n_win).map(|w| w * m).collect();
    be.rope_at(&mut pooled, rope, head_dim, &positions)?;
    if st.count + n_win > st.entries.rows() {
        return Err(ModelError::ContextFull {
            need: (st.count + n_win) * m,
            max: st.entries.rows() * m,
        });
    }
    be.set_rows(&mut st.entries, st.count, &pooled)?;
    st.count += n_win;
    if let Some(ape_ca) = &c.ape_ca {
        // The last closed window's Ca slice (kv, and gate with its position bias) for entry
        // `count`'s overlap.
        let last: Vec<usize> = (usable - m..usable).collect();
        let ca = |x: &B::Tensor| -> Result<B::Tensor, ModelError> {
            let rows = be.gather_rows(x, &last)?;
            Ok(be.split(&rows, width, &[c.dim, c.dim])?.swap_remove(0))
        };
        let prior_kv = ca(&kv_w)?;
        let mut prior_gate = ca(&gate_w)?;
        be.add(&mut prior_gate, ape_ca, 1.0)?;
        st.prior = Some((prior_kv, prior_gate));
    }
    let rest: Vec<usize> = (from_chunk..t).collect();
    if !rest.is_empty() {
        be.set_rows(&mut st.pending_kv, 0, &be.gather_rows(&kv, &rest)?)?;
        be.set_rows(&mut st.pending_gate, 0, &be.gather_rows(&gate, &rest)?)?;
    }
    st.pending = rest.len();
    Ok(())
}

/// The MoE block over the rows of `u` (transformers `DeepseekV4SparseMoeBlock`): sqrt-softplus
/// scores of the f32 router; experts from `tid2eid[token]` (hash layers) or the top-k of
/// `score + e_score_correction_bias`; weights renormalised × `routed_scaling_factor`; clamped
/// SwiGLU experts plus the shared expert. Returns `[T, hidden]`.
#[allow(clippy::too_many_arguments)]
fn sparse_moe<B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    streamer: &mut mference_runtime::ExpertStreamer,
    u: &B::Tensor,
    tokens: &[u32],
    engine: &Engine,
    (li, pos0): (usize, usize),
) -> Result<B::Tensor, ModelError> {
    let routes = route(cfg, be, layer, u, tokens, engine, (li, pos0))?;
    let act = Act::SiluClamped(cfg.swiglu_limit);
    let ((), moe_out) =
        moe::routed_experts(be, streamer, &layer.switch_mlp, act, u, &routes, || {
            let shared = be.glu_mlp(&layer.shared_experts, act, Resident, u)?;
            Ok::<_, ModelError>(((), shared))
        })?;
    Ok(moe_out)
}

/// Layer `li`'s router over the rows of `u`: the expert ids and weights.
fn route<B: Backend>(
    cfg: &Config,
    be: &B,
    layer: &Layer<B>,
    u: &B::Tensor,
    tokens: &[u32],
    engine: &Engine,
    (li, pos0): (usize, usize),
) -> Result<mference_backend::Routes, ModelError> {
    let k = cfg.num_experts_per_tok;
    let router_logits = be.linear(u, &layer.gate)?; // [T, num_experts]
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
    let routes = be.route(
        &router_logits,
        &RouterSpec {
            scoring: Scoring::SqrtSoftplus {
                routed_scaling_factor: cfg.routed_scaling_factor,
                correction_bias: bias,
            },
            top_k: k,
            per_expert_scale: None,
            trace: false,
            forced: forced.as_deref(),
        },
    )?;
    Ok(routes)
}

fn check(name: &str, got: (usize, usize), want: (usize, usize)) -> Result<(), ModelError> {
    if got == want {
        Ok(())
    } else {
        Err(ModelError::Config(format!(
            "{name} is {got:?}, config.json implies {want:?}"
        )))
    }
}

impl<B: Backend + 'static> crate::Model for DeepseekV4<B> {
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError> {
        let (chunk, max) = (self.engine.prefill_chunk, self.max_context);
        crate::run_chunked(tokens, self.kv.len, chunk, max, want, |c, w| {
            self.forward_chunk(c, w)
        })
    }

    fn position(&self) -> usize {
        self.kv.len
    }

    /// The compressed caches summarise whole windows and the sliding ring keeps only the last
    /// positions: only `n == 0` (start over) and `n == position()` succeed.
    fn truncate(&mut self, n: usize) -> bool {
        if n == self.kv.len {
            return true;
        }
        if n != 0 {
            return false;
        }
        self.kv.clear();
        for st in self.states.iter_mut().flat_map(|(a, b)| [a, b]).flatten() {
            st.count = 0;
            st.pending = 0;
            st.prior = None;
        }
        true
    }

    fn is_recurrent(&self) -> bool {
        true
    }

    fn rewind_point(&self, n: usize) -> usize {
        if n >= self.kv.len {
            self.kv.len
        } else {
            0
        }
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn engine(&self) -> &Engine {
        &self.engine
    }

    fn expert_stats(&self) -> Vec<mference_runtime::StreamerStats> {
        self.streamers.stats()
    }

    /// The sliding rings plus the compressed caches and their pending and prior rows (f32).
    fn kv_bytes(&self) -> usize {
        let floats: usize = self
            .states
            .iter()
            .flat_map(|(a, b)| [a, b])
            .flatten()
            .map(|s| {
                let t = |x: &B::Tensor| x.rows() * x.cols();
                t(&s.entries)
                    + t(&s.pending_kv)
                    + t(&s.pending_gate)
                    + s.prior.as_ref().map_or(0, |(k, g)| t(k) + t(g))
            })
            .sum();
        self.kv.bytes() + 4 * floats
    }
}
