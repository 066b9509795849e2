//! DeepSeek-V4-Flash (`deepseek_v4`): shared-KV MQA with a low-rank query (one 512-wide K = V
//! head, per-head sinks, interleaved RoPE on the trailing dims and the inverse rotation on the
//! output, a grouped low-rank output projection) over a sliding window, plus long-range compressed
//! KV on most layers (CSA: rate 4 with the Lightning indexer's top-k; HCA: rate 128, dense), four
//! residual streams mixed by manifold-constrained hyper-connections (mHC), hash-routed MoE on the
//! first layers (`tid2eid[token]`) and sqrt-softplus routing with a selection-only correction bias
//! after them, clamped SwiGLU experts plus a shared expert, untied head.
//!
//! Math: transformers 5.23 `modeling_deepseek_v4.py` (the
//! fixtures' reference); checkpoint names: the MLX layout of `mlx-community/DeepSeek-V4-Flash-2bit-DQ`:
//! `attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b,
//! attn_sink}` are HF's `q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks`;
//! `compressor.{wkv, wgate, ape, norm}` are `kv_proj, gate_proj, position_bias, kv_norm`;
//! `attn_norm` / `ffn_norm` are `input_layernorm` / `post_attention_layernorm`. Every norm is the
//! plain `rms(x)·w`. Intermediates are named after the reference.
//!
//! State per sequence, sized once at load: the sliding K = V ring per layer, and per compressed
//! layer the entries `[max_context / rate, head_dim]`, the pending rows of an unfinished window
//! (projected kv and gate), and for CSA the previous window's Ca slice (kv and gate + ape); the
//! indexer keeps the same set at its own width. Indexer ties go to the lower entry.
mod attention;
mod config;
mod moe;

use mference_backend::{f32_vector, Backend, FRef, KvCache, Mlp, Norm, QRef, Rope, VRef, Yarn};

use std::time::Instant;

use crate::{
    check_ids, expert_linear, linear, ChunkWant, CompressedKv, Engine, FamilyModel, LayerState,
    LoadOptions, Logits, ModelError, SequenceState, StepTimes, Streamers,
};
use attention::{attention, tail, Attention, Compressor, Indexer, Ropes};
pub use config::{Config, Kind, RopeScaling};
use moe::{route, sparse_moe, tid2eid, Gate};

/// One mHC site's projection `fn` `[rows, hc_mult·hidden]`, `base` and `scale` (F32).
struct HyperConnection<B: Backend> {
    f: B::Tensor,
    base: Vec<f32>,
    scale: Vec<f32>,
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
    /// The sliding K = V ring of every layer and, per layer, its compressed caches: none
    /// (sliding), the compressor's (HCA), or the compressor's and the indexer's (CSA).
    state: SequenceState<B>,
    streamers: Streamers,
    /// [`LoadOptions::shadow_prefetch`].
    shadow_prefetch: bool,
    /// [`crate::Model::step_times`].
    times: StepTimes,
}

/// Speculative reads started per layer by the shadow prefetch (the original system's sweep of
/// 1/2/3/4/6 peaked at 2).
const SHADOW_BUDGET: usize = 2;

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
        let q = |base: String, rows, cols| linear(idx, map.len(), &base, rows, cols);
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
            let ex = |part: &str, t, rows, cols| {
                expert_linear(&format!("{b}.ffn.switch_mlp.{part}"), t, stride, rows, cols)
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
        let ring = opts.sliding_rows(cfg.sliding_window);
        let kv = (0..cfg.num_hidden_layers)
            .map(|_| be.new_kv(ring, true, 1, hd, opts.kv_dtype))
            .collect::<Result<_, _>>()?;
        let state = |c: &Compressor<B>| -> Result<CompressedKv<B>, ModelError> {
            let width = if c.overlap { 2 * c.dim } else { c.dim };
            Ok(CompressedKv {
                entries: be.zeros(opts.max_context / c.rate + 1, c.dim)?,
                count: 0,
                pending_kv: be.zeros(c.rate, width)?,
                pending_gate: be.zeros(c.rate, width)?,
                pending: 0,
                prior: None,
            })
        };
        // Per layer `[compressor, indexer]` as far as the layer has them (an indexer only
        // beside a compressor).
        let states = layers
            .iter()
            .map(|l| {
                let indexer = l.attn.indexer.as_ref().map(|i| &i.compressor);
                let compressed = l.attn.compressor.iter().chain(indexer).map(state);
                Ok(LayerState::compressed(
                    compressed.collect::<Result<_, _>>()?,
                ))
            })
            .collect::<Result<_, ModelError>>()?;
        Ok(Self {
            embed_tokens: q("model.embed_tokens".into(), cfg.vocab_size, h)?,
            norm: v("model.norm.weight".into(), h)?,
            lm_head: q("lm_head".into(), cfg.vocab_size, h)?,
            hc_head: hyper("model.hc_head".into(), hc)?,
            streamers: Streamers::new(cfg.num_hidden_layers),
            shadow_prefetch: opts.shadow_prefetch,
            times: StepTimes {
                layers: vec![Default::default(); cfg.num_hidden_layers],
                head: Default::default(),
            },
            cfg,
            engine,
            be,
            layers,
            ropes,
            state: SequenceState::new(KvCache::new(kv)).with_layers(states),
        })
    }

    /// The parsed config.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl<B: Backend + 'static> FamilyModel for DeepseekV4<B> {
    type Backend = B;

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`.
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError> {
        let (cfg, be) = (&self.cfg, &self.be);
        let t = tokens.len();
        let (h, n) = (cfg.hidden_size, cfg.hc_mult);
        let pos0 = self.state.kv.len;
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
            let started = Instant::now();
            let hc = &layer.attn_hc;
            let (collapsed, pc) = be.hc_pre(&x, &hc.f, &hc.base, &hc.scale, &spec)?;
            let (post, comb) = pc.expect("an mHC site with post and comb");
            let mut a = collapsed;
            be.rms_norm(&mut a, h, Norm::Weight(&layer.attn_norm), eps)?;
            let mut compressed = self.state.layers[li].compressed.iter_mut();
            let (cs, is) = (compressed.next(), compressed.next());
            let kv = &mut self.state.kv.layers[li];
            let attn_out = attention(cfg, be, layer, &self.ropes, kv, cs, is, &a, pos0)?;
            x = be.hc_post(&x, &attn_out, &post, &comb)?;
            let attended = Instant::now();
            self.times.layers[li][0] += attended - started;

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
            // reads overlap the next layer's attention. Not for a layer the backend holds whole
            // (nothing to read, and the routes would cost a readback).
            let prefetch = self.shadow_prefetch
                && t == 1
                && li + 1 < self.layers.len()
                && !be.routes_on_device(li + 1, cfg.num_experts_per_tok)?;
            if let (true, Some(next)) = (prefetch, self.layers.get(li + 1)) {
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
            self.times.layers[li][1] += attended.elapsed();
        }
        self.state.kv.len = pos0 + t;
        let started = Instant::now();

        let hc = &self.hc_head;
        let (collapsed, _) = be.hc_pre(&x, &hc.f, &hc.base, &hc.scale, &spec)?;
        let head = crate::Head {
            norm: &self.norm,
            eps,
            weight: &self.lm_head,
            softcap: None,
        };
        let logits = crate::head(be, &collapsed, pos0, want, &head);
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
