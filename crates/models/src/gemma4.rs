//! Gemma 4 (`gemma4` / `gemma4_text`, e.g. 26B-A4B): sliding/full attention with per-head q/k norms,
//! a no-scale V norm, K = V on full layers, proportional partial RoPE, a dense shared MLP in parallel
//! with 128 routed GeGLU experts, sandwich norms, a per-layer scalar and a tied, softcapped head.
//!
//! Math: `reference/architectures.md` §2 (transformers `modeling_gemma4.py`, mlx-lm `gemma4_text.py`);
//! checkpoint names: §2.4. Intermediates are named after the reference (`attn_norm`, `router_logits`,
//! `moe_out`) so a layer-by-layer diff stays easy.

use std::collections::BTreeMap;

use serde::Deserialize;

use mference_format::Install;
use mference_kernels::{Kernels, MatJob, QMatrix, ThreadPool};
use mference_runtime::{KvCache, KvLayer};

use crate::ops::{
    attention, gelu_tanh, rms_norm, rms_norm_into, softcap, softmax, top_k, AttnShape, Rope,
};
use crate::tensors::{QRef, VRef};
use crate::{ChunkWant, Engine, LoadOptions, Logits, ModelError, Streamers, Want};

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
        let text = v.get("text_config").unwrap_or(v);
        let c: Config = serde_json::from_value(text.clone())
            .map_err(|e| ModelError::Config(format!("gemma4 text_config: {e}")))?;
        let unsupported = |what: &str| {
            Err(ModelError::Config(format!(
                "gemma4: {what} is not supported by this runtime"
            )))
        };
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

struct Mlp {
    gate_proj: QRef,
    up_proj: QRef,
    down_proj: QRef,
}

struct Experts {
    gate_proj: QRef,
    up_proj: QRef,
    down_proj: QRef,
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
    layer_scalar: VRef,
    experts: Experts,
}

/// A loaded Gemma 4 model with its KV cache and expert streamers (one sequence).
pub struct Gemma4 {
    cfg: Config,
    engine: Engine,
    embed_tokens: QRef,
    norm: VRef,
    layers: Vec<Layer>,
    /// sqrt(hidden_size) rounded to bf16, the weight dtype (HF `Gemma4TextScaledWordEmbedding`).
    embed_scale: f32,
    kv: KvCache,
    streamers: Streamers,
}

const P: &str = "language_model.model";

impl Gemma4 {
    /// Builds the model over an opened install: every resident tensor is resolved (and checked) now,
    /// so a malformed install fails at load with the tensor's name.
    pub fn load(install: Install, cfg: Config, opts: &LoadOptions) -> Result<Self, ModelError> {
        let engine = Engine::new(install, opts)?;
        let (idx, len) = (&engine.index, engine.map.len());
        let q = |base: String| QRef::resident(idx, len, &base);
        let h = cfg.hidden_size;
        let v = |name: String, n: usize| VRef::resident(idx, &name, n);
        let n_exp = cfg.num_experts.unwrap_or(0);
        let stride = engine.install.layout.expert_stride as usize;
        if engine.install.layout.experts_per_layer != n_exp {
            return Err(ModelError::Config(format!(
                "layout.json has {} experts per layer, config.json {n_exp}",
                engine.install.layout.experts_per_layer
            )));
        }
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
            let blob = engine
                .install
                .layout
                .layer(l)
                .and_then(|ll| ll.blob.as_ref())
                .ok_or_else(|| {
                    ModelError::Config(format!("layout.json has no experts for MoE layer {l}"))
                })?;
            let layer = Layer {
                sliding,
                head_dim,
                n_kv_heads,
                rope: Rope::new(head_dim, rotated, rp.rope_theta),
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
                layer_scalar: v(format!("{b}.layer_scalar"), 1)?,
                experts: Experts {
                    gate_proj: QRef::expert(
                        &format!("{b}.experts.switch_glu.gate_proj"),
                        &blob.gate,
                        stride,
                    )?,
                    up_proj: QRef::expert(
                        &format!("{b}.experts.switch_glu.up_proj"),
                        &blob.up,
                        stride,
                    )?,
                    down_proj: QRef::expert(
                        &format!("{b}.experts.switch_glu.down_proj"),
                        &blob.down,
                        stride,
                    )?,
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
        let ring = cfg.sliding_window + opts.prefill_chunk;
        let kv = KvCache {
            layers: layers
                .iter()
                .map(|l| {
                    if l.sliding {
                        KvLayer::new(
                            ring.min(opts.max_context),
                            true,
                            l.n_kv_heads,
                            l.head_dim,
                            opts.kv_dtype,
                        )
                    } else {
                        KvLayer::new(
                            opts.max_context,
                            false,
                            l.n_kv_heads,
                            l.head_dim,
                            opts.kv_dtype,
                        )
                    }
                })
                .collect(),
            len: 0,
        };
        if opts.slots.count(n_exp) < cfg.top_k_experts.unwrap_or(0) {
            return Err(ModelError::Config(format!(
                "{} expert cache slots cannot hold the {} experts one token routes to",
                opts.slots.count(n_exp),
                cfg.top_k_experts.unwrap_or(0)
            )));
        }
        let streamers = Streamers::new(cfg.num_hidden_layers);
        Ok(Self {
            cfg,
            engine,
            embed_tokens,
            norm,
            layers,
            embed_scale,
            kv,
            streamers,
        })
    }

    /// The `text_config` this model was built from.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`.
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError> {
        let t = tokens.len();
        let h = self.cfg.hidden_size;
        let pos0 = self.kv.len;
        let eps = self.cfg.rms_norm_eps;
        let map = &self.engine.map[..];
        let (k, pool) = (self.engine.kernels, &self.engine.pool);

        // Embedding rows, scaled.
        let mut x = vec![0.0f32; t * h];
        let emb = self.embed_tokens.mat(map);
        for (row, &id) in x.chunks_exact_mut(h).zip(tokens) {
            if id as usize >= self.cfg.vocab_size {
                return Err(ModelError::Input(format!(
                    "token id {id} is outside the vocabulary ({})",
                    self.cfg.vocab_size
                )));
            }
            emb.dequantize_row(id as usize, row);
            row.iter_mut().for_each(|v| *v *= self.embed_scale);
        }

        let mut attn_norm = vec![0.0f32; t * h];
        for (li, layer) in self.layers.iter().enumerate() {
            let d = layer.head_dim;
            let nh = self.cfg.num_attention_heads;
            let nkv = layer.n_kv_heads;
            // Attention block.
            rms_norm_into(
                &x,
                &mut attn_norm,
                h,
                Some((&layer.input_layernorm, map)),
                eps,
            );
            let mut q = vec![0.0f32; t * nh * d];
            let mut kraw = vec![0.0f32; t * nkv * d];
            let mut vraw = vec![
                0.0f32;
                if layer.v_proj.is_some() {
                    t * nkv * d
                } else {
                    0
                }
            ];
            projections(
                pool,
                k,
                &attn_norm,
                t,
                &mut [
                    (layer.q_proj.mat(map), &mut q[..]),
                    (layer.k_proj.mat(map), &mut kraw[..]),
                ],
                layer.v_proj.as_ref().map(|vp| (vp.mat(map), &mut vraw[..])),
            );
            // attention_k_eq_v: V is the raw K projection (before k_norm and RoPE).
            let mut v = if layer.v_proj.is_some() {
                vraw
            } else {
                kraw.clone()
            };
            rms_norm(&mut q, d, Some((&layer.q_norm, map)), eps);
            rms_norm(&mut kraw, d, Some((&layer.k_norm, map)), eps);
            rms_norm(&mut v, d, None, eps);
            for r in 0..t {
                layer
                    .rope
                    .apply(&mut q[r * nh * d..(r + 1) * nh * d], d, pos0 + r);
                layer
                    .rope
                    .apply(&mut kraw[r * nkv * d..(r + 1) * nkv * d], d, pos0 + r);
                self.kv.layers[li].write(
                    pos0 + r,
                    &kraw[r * nkv * d..(r + 1) * nkv * d],
                    &v[r * nkv * d..(r + 1) * nkv * d],
                );
            }
            let mut attn = vec![0.0f32; t * nh * d];
            let shape = AttnShape {
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: d,
                window: layer.sliding.then_some(self.cfg.sliding_window),
                scale: 1.0,
            };
            attention(pool, k, &q, &self.kv.layers[li], pos0, &shape, &mut attn);
            let mut o = vec![0.0f32; t * h];
            pool.gemm(k, &layer.o_proj.mat(map), &attn, t, &mut o);
            rms_norm(&mut o, h, Some((&layer.post_attention_layernorm, map)), eps);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            // Router on the raw post-attention residual: no-scale norm × scale × hidden^-0.5.
            let n_exp = layer.per_expert_scale.len;
            let top = self.cfg.top_k_experts.unwrap_or(0);
            let mut r = vec![0.0f32; t * h];
            rms_norm_into(&x, &mut r, h, None, eps);
            let root = (h as f32).powf(-0.5);
            for row in r.chunks_exact_mut(h) {
                row.iter_mut()
                    .enumerate()
                    .for_each(|(i, v)| *v *= layer.router_scale.get(map, i) * root);
            }
            let mut router_logits = vec![0.0f32; t * n_exp];
            pool.gemm(k, &layer.router_proj.mat(map), &r, t, &mut router_logits);
            let mut routes: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
            for (row, lg) in router_logits.chunks_exact(n_exp).enumerate() {
                self.engine.note_router_margin(pos0 + row, lg, top);
                let idx = top_k(lg, top);
                let mut w: Vec<f32> = idx.iter().map(|&e| lg[e]).collect();
                softmax(&mut w);
                for (&e, w) in idx.iter().zip(w) {
                    routes
                        .entry(e)
                        .or_default()
                        .push((row, w * layer.per_expert_scale.get(map, e)));
                }
            }
            let needed: Vec<usize> = routes.keys().copied().collect();
            let tile = if t == 1 {
                needed.len().max(1)
            } else {
                (self.engine.slots.count(n_exp) / 2).clamp(1, 8)
            };
            let streamer = self.streamers.get(li, &self.engine)?;
            let tiles: Vec<&[usize]> = needed.chunks(tile).collect();
            let mut next_slots = match tiles.first() {
                Some(first) => Some(streamer.acquire(first)?),
                None => None,
            };

            // Shared (dense) MLP while the first tile's reads are in flight.
            let mut u = vec![0.0f32; t * h];
            rms_norm_into(
                &x,
                &mut u,
                h,
                Some((&layer.pre_feedforward_layernorm, map)),
                eps,
            );
            let mut shared = mlp(
                pool,
                k,
                map,
                &layer.mlp.gate_proj,
                &layer.mlp.up_proj,
                &layer.mlp.down_proj,
                &u,
                t,
            );
            rms_norm(
                &mut shared,
                h,
                Some((&layer.post_feedforward_layernorm_1, map)),
                eps,
            );

            // Routed experts, tile by tile; the next tile's reads overlap this tile's compute.
            rms_norm_into(
                &x,
                &mut u,
                h,
                Some((&layer.pre_feedforward_layernorm_2, map)),
                eps,
            );
            let mut moe_out = vec![0.0f32; t * h];
            // Each expert's rows land in `expert_out` and are summed in expert order afterwards, so the
            // result never depends on which experts happened to be cached.
            let mut expert_out: Vec<Option<Vec<f32>>> = vec![None; n_exp];
            let run_expert = |e: usize, blob: &[u8]| {
                let rows = &routes[&e];
                let mut xe = Vec::with_capacity(rows.len() * h);
                for &(row, _) in rows {
                    xe.extend_from_slice(&u[row * h..(row + 1) * h]);
                }
                let ex = &layer.experts;
                mlp(
                    pool,
                    k,
                    blob,
                    &ex.gate_proj,
                    &ex.up_proj,
                    &ex.down_proj,
                    &xe,
                    rows.len(),
                )
            };
            for (ti, tl) in tiles.iter().enumerate() {
                let slots = next_slots.take().expect("tile acquired one step ahead");
                // Hits are in memory already: compute them while this tile's misses are read.
                for (&e, &(slot, hit)) in tl.iter().zip(&slots) {
                    if hit {
                        expert_out[e] = Some(run_expert(e, streamer.blob(slot)));
                    }
                }
                streamer.wait()?;
                if let Some(next) = tiles.get(ti + 1) {
                    next_slots = Some(streamer.acquire(next)?);
                }
                for (&e, &(slot, hit)) in tl.iter().zip(&slots) {
                    if !hit {
                        expert_out[e] = Some(run_expert(e, streamer.blob(slot)));
                    }
                }
                streamer.release(tl);
            }
            for (e, rows) in &routes {
                let ye = expert_out[*e].as_ref().expect("every routed expert ran");
                for (j, &(row, w)) in rows.iter().enumerate() {
                    k.axpy(
                        w,
                        &ye[j * h..(j + 1) * h],
                        &mut moe_out[row * h..(row + 1) * h],
                    );
                }
            }
            rms_norm(
                &mut moe_out,
                h,
                Some((&layer.post_feedforward_layernorm_2, map)),
                eps,
            );
            shared.iter_mut().zip(&moe_out).for_each(|(a, b)| *a += b);
            rms_norm(
                &mut shared,
                h,
                Some((&layer.post_feedforward_layernorm, map)),
                eps,
            );
            let scalar = layer.layer_scalar.get(map, 0);
            x.iter_mut()
                .zip(&shared)
                .for_each(|(a, b)| *a = (*a + b) * scalar);
        }
        self.kv.len = pos0 + t;

        // Final norm and the tied head, only for the rows asked for.
        let first = match want {
            ChunkWant::None => return Ok(Logits::None),
            ChunkWant::From(r) => r,
            ChunkWant::Argmax => t - 1,
        };
        let rows = t - first;
        let mut xf = x[first * h..].to_vec();
        rms_norm(&mut xf, h, Some((&self.norm, map)), eps);
        let head = self.embed_tokens.mat(map);
        let cap = self.cfg.final_logit_softcapping;
        if want == ChunkWant::Argmax {
            let (id, _) = pool.gemv_argmax(k, &head, &xf, cap);
            return Ok(Logits::Argmax(id as u32));
        }
        let mut logits = vec![0.0f32; rows * self.cfg.vocab_size];
        pool.gemm(k, &head, &xf, rows, &mut logits);
        if let Some(c) = cap {
            softcap(&mut logits, c);
        }
        Ok(Logits::Rows(logits))
    }
}

/// Several projections of the same `t` rows of `x` in one parallel region (x prepared once per
/// quantization layout).
fn projections<'a>(
    pool: &ThreadPool,
    k: &Kernels,
    x: &[f32],
    t: usize,
    mats: &mut [(QMatrix<'a>, &mut [f32]); 2],
    extra: Option<(QMatrix<'a>, &mut [f32])>,
) {
    let [(m0, y0), (m1, y1)] = mats;
    let p0 = k.prepare(m0, x, t);
    let same = |m: &QMatrix| m.group_size == m0.group_size && m.bits == m0.bits;
    let p1 = (!same(m1)).then(|| k.prepare(m1, x, t));
    let mut jobs = vec![
        MatJob {
            m: *m0,
            x: &p0,
            y: y0,
        },
        MatJob {
            m: *m1,
            x: p1.as_ref().unwrap_or(&p0),
            y: y1,
        },
    ];
    let p2 = extra
        .as_ref()
        .filter(|(m, _)| !same(m))
        .map(|(m, _)| k.prepare(m, x, t));
    if let Some((m2, y2)) = extra {
        jobs.push(MatJob {
            m: m2,
            x: p2.as_ref().unwrap_or(&p0),
            y: y2,
        });
    }
    pool.gemm_batch(k, &mut jobs);
}

/// `down(gelu_tanh(gate(x)) * up(x))` for `t` rows of `x` (GeGLU, `gelu_pytorch_tanh`).
#[allow(clippy::too_many_arguments)]
fn mlp(
    pool: &ThreadPool,
    k: &Kernels,
    buf: &[u8],
    gate: &QRef,
    up: &QRef,
    down: &QRef,
    x: &[f32],
    t: usize,
) -> Vec<f32> {
    let i = gate.rows;
    let mut g = vec![0.0f32; t * i];
    let mut u = vec![0.0f32; t * i];
    let (gm, um) = (gate.mat(buf), up.mat(buf));
    if gm.group_size == um.group_size && gm.bits == um.bits {
        // One preparation of x and one parallel region for both projections.
        let px = k.prepare(&gm, x, t);
        pool.gemm_batch(
            k,
            &mut [
                MatJob {
                    m: gm,
                    x: &px,
                    y: &mut g,
                },
                MatJob {
                    m: um,
                    x: &px,
                    y: &mut u,
                },
            ],
        );
    } else {
        pool.gemm(k, &gm, x, t, &mut g);
        pool.gemm(k, &um, x, t, &mut u);
    }
    g.iter_mut()
        .zip(&u)
        .for_each(|(a, b)| *a = gelu_tanh(*a) * b);
    let mut y = vec![0.0f32; t * down.rows];
    pool.gemm(k, &down.mat(buf), &g, t, &mut y);
    y
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

impl crate::Model for Gemma4 {
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError> {
        let (chunk, max) = (self.engine.prefill_chunk, self.engine.max_context);
        crate::run_chunked(tokens, self.kv.len, chunk, max, want, |c, w| {
            self.forward_chunk(c, w)
        })
    }

    fn position(&self) -> usize {
        self.kv.len
    }

    fn truncate(&mut self, n: usize) -> bool {
        self.kv.truncate(n)
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

    fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }
}
