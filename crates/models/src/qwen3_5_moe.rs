//! Qwen 3.6 (`qwen3_5_moe` / `qwen3_5_moe_text`, e.g. 35B-A3B): a 3:1 hybrid of Gated DeltaNet
//! (linear attention with a recurrent FP32 state) and gated full attention, every layer followed by
//! a softmax-routed MoE (renormalised top-k) plus a sigmoid-gated shared expert; untied head.
//!
//! Math: `reference/architectures.md` §3 and the installed mlx-lm (`qwen3_5.py` for the decoder and
//! `GatedDeltaNet`, `qwen3_next.py` for attention, MoE block and gated norm, `gated_delta.py` for the
//! recurrence); checkpoint names: §3.3. MLX checkpoints store `1 + w` for the zero-centred norms
//! (`input_layernorm`, `post_attention_layernorm`, `norm`, `q_norm`, `k_norm`), so every norm here is
//! the plain `rms(x)·w`; the DeltaNet gated norm is plain in both formats. Intermediates are named
//! after the reference (`attn_norm`, `router_logits`, `moe_out`) for layer-by-layer diffs.

use std::collections::BTreeMap;

use serde::Deserialize;

use mference_format::{Dtype, Install, ResidentIndex};
use mference_kernels::{bf16_to_f32, Kernels, ThreadPool};
use mference_runtime::{KvCache, KvLayer};

use crate::ops::{
    attention, causal_conv1d_silu, gated_delta_rule, rms_norm, rms_norm_into, sigmoid, silu,
    softmax, softplus, top_k, AttnShape, DeltaShape, Rope,
};
use crate::tensors::{QRef, VRef};
use crate::{Engine, LoadOptions, Logits, ModelError, Streamers, Want};

/// `text_config` of a Qwen 3.5/3.6 MoE `config.json` (HF keys; defaults as mlx-lm's
/// `qwen3_5.TextModelArgs`).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Full-attention head size; `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub linear_num_value_heads: usize,
    pub linear_num_key_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    #[serde(default = "default_conv")]
    pub linear_conv_kernel_dim: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    /// Layer `i` is full attention iff `(i + 1) % full_attention_interval == 0` (mlx-lm's rule).
    #[serde(default = "default_interval")]
    pub full_attention_interval: usize,
    /// HF's explicit per-layer list; must agree with `full_attention_interval` when present.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
}

/// `rope_parameters`: only the plain (`default`) RoPE is implemented; for text-only input the
/// interleaved MRoPE sections reduce to it (all three position streams are equal), and mlx-lm
/// ignores `mrope_section` too.
#[derive(Clone, Debug, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub rope_type: Option<String>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_conv() -> usize {
    4
}
fn default_interval() -> usize {
    4
}
fn yes() -> bool {
    true
}

impl Config {
    /// Reads `text_config` (or the top level) of `config.json` and rejects what this runtime does not
    /// implement (dense MLP layers, attention biases, RoPE scaling).
    pub fn from_config_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let text = v.get("text_config").unwrap_or(v);
        let c: Config = serde_json::from_value(text.clone())
            .map_err(|e| ModelError::Config(format!("qwen3_5_moe text_config: {e}")))?;
        let unsupported = |what: &str| {
            Err(ModelError::Config(format!(
                "qwen3_5_moe: {what} is not supported by this runtime"
            )))
        };
        if c.num_experts == 0 || c.num_experts_per_tok == 0 || c.moe_intermediate_size == 0 {
            return unsupported("a model without the MoE block");
        }
        if c.attention_bias {
            return unsupported("attention biases");
        }
        if c.full_attention_interval == 0
            || c.linear_num_key_heads == 0
            || !c
                .linear_num_value_heads
                .is_multiple_of(c.linear_num_key_heads)
            || c.linear_conv_kernel_dim < 2
        {
            return Err(ModelError::Config(
                "qwen3_5_moe: full_attention_interval, linear heads or conv kernel out of range"
                    .into(),
            ));
        }
        if let Some(kind) = c.rope_kind() {
            if kind != "default" {
                return unsupported(&format!("RoPE type '{kind}'"));
            }
        }
        if let Some(lt) = &c.layer_types {
            let ok = lt.len() == c.num_hidden_layers
                && lt.iter().enumerate().all(|(i, t)| {
                    let full = !c.is_linear(i);
                    t == if full {
                        "full_attention"
                    } else {
                        "linear_attention"
                    }
                });
            if !ok {
                return Err(ModelError::Config(format!(
                    "layer_types {lt:?} disagrees with full_attention_interval {}",
                    c.full_attention_interval
                )));
            }
        }
        Ok(c)
    }

    /// Whether layer `i` is a Gated DeltaNet layer.
    pub fn is_linear(&self, i: usize) -> bool {
        !(i + 1).is_multiple_of(self.full_attention_interval)
    }

    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    fn rope_kind(&self) -> Option<&str> {
        let p = self.rope_parameters.as_ref()?;
        p.kind.as_deref().or(p.rope_type.as_deref())
    }

    /// `(theta, partial_rotary_factor)` with mlx-lm's defaults (100000, 0.25).
    fn rope(&self) -> (f64, f64) {
        let p = self.rope_parameters.as_ref();
        (
            p.and_then(|p| p.rope_theta).unwrap_or(100000.0),
            p.and_then(|p| p.partial_rotary_factor).unwrap_or(0.25),
        )
    }
}

/// Gated DeltaNet weights (`linear_attn.*`).
struct DeltaNet {
    in_proj_qkv: QRef,
    in_proj_z: QRef,
    in_proj_b: QRef,
    in_proj_a: QRef,
    out_proj: QRef,
    /// `[conv_dim, kernel]`.
    conv1d: Vec<f32>,
    /// `exp(A_log)`, `[n_v_heads]`.
    a: Vec<f32>,
    dt_bias: Vec<f32>,
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

enum Mixer {
    Linear(Box<DeltaNet>),
    /// With its index into the KV cache's layers.
    Full(Box<Attention>, usize),
}

struct Mlp {
    gate_proj: QRef,
    up_proj: QRef,
    down_proj: QRef,
}

struct Layer {
    mixer: Mixer,
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

/// The recurrent state of one DeltaNet layer (FP32).
#[derive(Clone)]
struct DeltaState {
    /// `[kernel - 1, conv_dim]` last pre-conv rows.
    conv: Vec<f32>,
    /// `[n_v_heads, head_v_dim, head_k_dim]`.
    ssm: Vec<f32>,
}

/// A loaded Qwen 3.6 MoE model with its KV cache, DeltaNet states and expert streamers (one sequence).
pub struct Qwen35Moe {
    cfg: Config,
    engine: Engine,
    embed_tokens: QRef,
    norm: VRef,
    lm_head: QRef,
    layers: Vec<Layer>,
    rope: Rope,
    rotated: usize,
    kv: KvCache,
    /// One per layer; `None` for full-attention layers.
    states: Vec<Option<DeltaState>>,
    /// The DeltaNet states as they were at one earlier position ([`crate::Model::checkpoint`]).
    snapshot: Option<(usize, Vec<Option<DeltaState>>)>,
    streamers: Streamers,
}

const P: &str = "language_model.model";

/// A small resident float vector (BF16, F16 or F32) of `len` elements, read once at load.
fn small_vec(
    index: &ResidentIndex,
    map: &[u8],
    name: &str,
    len: usize,
) -> Result<Vec<f32>, ModelError> {
    let bad = |why: String| ModelError::Tensor {
        name: name.into(),
        why,
    };
    let e = index
        .get(name)
        .ok_or_else(|| bad("missing from model_weights.bin".into()))?;
    let width = match e.dtype {
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F32 => 4,
        d => return Err(bad(format!("expected a float vector, found {d:?}"))),
    };
    if e.is_quantized() || e.size_bytes as usize != len * width {
        return Err(bad(format!(
            "expected {len} values, found {} bytes of {:?}",
            e.size_bytes, e.dtype
        )));
    }
    let b = e.weight_bytes(map);
    Ok(match e.dtype {
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    })
}

impl Qwen35Moe {
    /// Builds the model over an opened install: every resident tensor is resolved (and its shape
    /// checked against `cfg`) now, so a malformed install fails at load with the tensor's name.
    pub fn load(install: Install, cfg: Config, opts: &LoadOptions) -> Result<Self, ModelError> {
        let engine = Engine::new(install, opts)?;
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
        if engine.install.layout.experts_per_layer != n_exp {
            return Err(ModelError::Config(format!(
                "layout.json has {} experts per layer, config.json {n_exp}",
                engine.install.layout.experts_per_layer
            )));
        }
        // A quantized Linear `base` that must be [rows, cols].
        let q = |base: String, rows: usize, cols: usize| -> Result<QRef, ModelError> {
            let r = QRef::resident(idx, map.len(), &base)?;
            check(&base, (r.rows, r.cols), (rows, cols))?;
            Ok(r)
        };
        let v = |name: String, n: usize| VRef::resident(idx, &name, n);
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
                    return Err(ModelError::Tensor {
                        name: conv_name,
                        why: format!(
                            "expected the MLX layout [{conv_dim}, {kern}, 1], found {shape:?} \
                             (an unconverted HF checkpoint? convert it with mlx-lm)"
                        ),
                    });
                }
                let a_log = small_vec(idx, map, &format!("{a}.A_log"), nv)?;
                Mixer::Linear(Box::new(DeltaNet {
                    in_proj_qkv: q(format!("{a}.in_proj_qkv"), conv_dim, h)?,
                    in_proj_z: q(format!("{a}.in_proj_z"), nv * dv, h)?,
                    in_proj_b: q(format!("{a}.in_proj_b"), nv, h)?,
                    in_proj_a: q(format!("{a}.in_proj_a"), nv, h)?,
                    out_proj: q(format!("{a}.out_proj"), h, nv * dv)?,
                    conv1d: small_vec(idx, map, &conv_name, conv_dim * kern)?,
                    a: a_log.iter().map(|x| x.exp()).collect(),
                    dt_bias: small_vec(idx, map, &format!("{a}.dt_bias"), nv)?,
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
            let blob = engine
                .install
                .layout
                .layer(l)
                .and_then(|ll| ll.blob.as_ref())
                .ok_or_else(|| {
                    ModelError::Config(format!("layout.json has no experts for MoE layer {l}"))
                })?;
            let ex = |part: &str, t, rows, cols| -> Result<QRef, ModelError> {
                let name = format!("{b}.mlp.switch_mlp.{part}");
                let r = QRef::expert(&name, t, stride)?;
                check(&name, (r.rows, r.cols), (rows, cols))?;
                Ok(r)
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
        if opts.slots.count(n_exp) < cfg.num_experts_per_tok {
            return Err(ModelError::Config(format!(
                "{} expert cache slots cannot hold the {} experts one token routes to",
                opts.slots.count(n_exp),
                cfg.num_experts_per_tok
            )));
        }
        let kv = KvCache {
            layers: (0..n_full)
                .map(|_| KvLayer::new(opts.max_context, false, nkv, hd, opts.kv_dtype))
                .collect(),
            len: 0,
        };
        let states = (0..cfg.num_hidden_layers)
            .map(|l| {
                cfg.is_linear(l).then(|| DeltaState {
                    conv: vec![0.0; (kern - 1) * conv_dim],
                    ssm: vec![0.0; nv * dv * dk],
                })
            })
            .collect();
        let streamers = Streamers::new(cfg.num_hidden_layers);
        Ok(Self {
            rope: Rope::new(rotated, rotated, theta),
            rotated,
            cfg,
            engine,
            embed_tokens,
            norm,
            lm_head,
            layers,
            kv,
            states,
            snapshot: None,
            streamers,
        })
    }

    /// The parsed `text_config`.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`; see [`Want`].
    fn forward_chunk(
        &mut self,
        tokens: &[u32],
        want: crate::ChunkWant,
    ) -> Result<Logits, ModelError> {
        let t = tokens.len();
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        let pos0 = self.kv.len;
        let eps = cfg.rms_norm_eps;
        let map = &self.engine.map[..];
        let (k, pool) = (self.engine.kernels, &self.engine.pool);

        let mut x = vec![0.0f32; t * h]; // [T, hidden]
        let emb = self.embed_tokens.mat(map);
        for (row, &id) in x.chunks_exact_mut(h).zip(tokens) {
            if id as usize >= cfg.vocab_size {
                return Err(ModelError::Input(format!(
                    "token id {id} is outside the vocabulary ({})",
                    cfg.vocab_size
                )));
            }
            emb.dequantize_row(id as usize, row);
        }

        let mut attn_norm = vec![0.0f32; t * h];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm_into(
                &x,
                &mut attn_norm,
                h,
                Some((&layer.input_layernorm, map)),
                eps,
            );
            let mixer_out = match &layer.mixer {
                Mixer::Linear(d) => {
                    let st = self.states[li].as_mut().expect("state of a DeltaNet layer");
                    delta_net(cfg, pool, k, map, d, st, &attn_norm, t)
                }
                Mixer::Full(a, kvi) => {
                    let kvl = &mut self.kv.layers[*kvi];
                    let rope = (&self.rope, self.rotated);
                    full_attention(cfg, pool, k, map, a, kvl, rope, &attn_norm, t, pos0)
                }
            };
            x.iter_mut().zip(&mixer_out).for_each(|(a, b)| *a += b);

            let mut u = vec![0.0f32; t * h];
            rms_norm_into(
                &x,
                &mut u,
                h,
                Some((&layer.post_attention_layernorm, map)),
                eps,
            );
            let streamer = self.streamers.get(li, &self.engine)?;
            let moe_out = sparse_moe(
                cfg,
                pool,
                k,
                map,
                layer,
                streamer,
                self.engine.slots,
                &u,
                t,
                &self.engine,
                pos0,
            )?;
            x.iter_mut().zip(&moe_out).for_each(|(a, b)| *a += b);
        }
        self.kv.len = pos0 + t;

        let rows: Vec<usize> = match want {
            crate::ChunkWant::None => return Ok(Logits::None),
            crate::ChunkWant::From(r) => (r..t).collect(),
            crate::ChunkWant::Argmax => vec![t - 1],
        };
        let mut xf = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            xf.extend_from_slice(&x[r * h..(r + 1) * h]);
        }
        rms_norm(&mut xf, h, Some((&self.norm, map)), eps);
        let head = self.lm_head.mat(map);
        if want == crate::ChunkWant::Argmax {
            let (id, _) = pool.gemv_argmax(k, &head, &xf, None);
            return Ok(Logits::Argmax(id as u32));
        }
        let mut logits = vec![0.0f32; rows.len() * cfg.vocab_size];
        pool.gemm(k, &head, &xf, rows.len(), &mut logits);
        Ok(Logits::Rows(logits))
    }
}

/// Gated DeltaNet over `t` rows of `a` (`[T, hidden]`), continuing `st`; returns `[T, hidden]`
/// (mlx-lm `qwen3_5.GatedDeltaNet.__call__`).
#[allow(clippy::too_many_arguments)]
fn delta_net(
    cfg: &Config,
    pool: &ThreadPool,
    k: &Kernels,
    map: &[u8],
    d: &DeltaNet,
    st: &mut DeltaState,
    a: &[f32],
    t: usize,
) -> Vec<f32> {
    let (nk, nv) = (cfg.linear_num_key_heads, cfg.linear_num_value_heads);
    let (dk, dv) = (cfg.linear_key_head_dim, cfg.linear_value_head_dim);
    let key_dim = nk * dk;
    let conv_dim = 2 * key_dim + nv * dv;
    let gemm = |m: &QRef, out_w: usize| {
        let mut y = vec![0.0f32; t * out_w];
        pool.gemm(k, &m.mat(map), a, t, &mut y);
        y
    };
    let mixed_qkv = gemm(&d.in_proj_qkv, conv_dim); // [T, conv_dim] = q | k | v
    let z = gemm(&d.in_proj_z, nv * dv); // [T, n_v_heads, head_v_dim]
    let b = gemm(&d.in_proj_b, nv); // [T, n_v_heads]
    let alpha = gemm(&d.in_proj_a, nv); // [T, n_v_heads]

    let mut conv_out = vec![0.0f32; t * conv_dim];
    causal_conv1d_silu(
        &mixed_qkv,
        &mut st.conv,
        &d.conv1d,
        conv_dim,
        cfg.linear_conv_kernel_dim,
        &mut conv_out,
    );
    // Split, and L2-normalise q and k per head as mlx's `normalize_qk` does: `rms_norm` with the
    // eps scaled by 1/dk, times dk^-1 (q: the readout scale folded in) or dk^-0.5 (k).
    let inv2 = 1.0 / dk as f32;
    let mut q = Vec::with_capacity(t * key_dim); // [T, n_k_heads, head_k_dim]
    let mut kk = Vec::with_capacity(t * key_dim);
    let mut v = Vec::with_capacity(t * nv * dv); // [T, n_v_heads, head_v_dim]
    for row in conv_out.chunks_exact(conv_dim) {
        q.extend_from_slice(&row[..key_dim]);
        kk.extend_from_slice(&row[key_dim..2 * key_dim]);
        v.extend_from_slice(&row[2 * key_dim..]);
    }
    for (buf, scale) in [(&mut q, inv2), (&mut kk, inv2.sqrt())] {
        for head in buf.chunks_exact_mut(dk) {
            let ms = head.iter().map(|x| x * x).sum::<f32>() / dk as f32;
            let r = scale / (ms + 1e-6 * inv2).sqrt();
            head.iter_mut().for_each(|x| *x *= r);
        }
    }
    // β = sigmoid(b); decay = exp(−exp(A_log)·softplus(α + dt_bias)) (`gated_delta.compute_g`).
    let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
    let decay: Vec<f32> = alpha
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let hh = i % nv;
            (-d.a[hh] * softplus(x + d.dt_bias[hh])).exp()
        })
        .collect();
    let mut core = vec![0.0f32; t * nv * dv]; // [T, n_v_heads, head_v_dim]
    let shape = DeltaShape {
        n_k_heads: nk,
        n_v_heads: nv,
        head_k_dim: dk,
        head_v_dim: dv,
    };
    gated_delta_rule(
        pool,
        k,
        &q,
        &kk,
        &v,
        &decay,
        &beta,
        &mut st.ssm,
        &shape,
        &mut core,
    );
    // Gated RMSNorm per value head: rms_norm(o)·w ⊙ silu(z) (`Qwen3NextRMSNormGated`).
    rms_norm(&mut core, dv, Some((&d.norm, map)), cfg.rms_norm_eps);
    core.iter_mut().zip(&z).for_each(|(o, &g)| *o *= silu(g));
    let mut out = vec![0.0f32; t * cfg.hidden_size];
    pool.gemm(k, &d.out_proj.mat(map), &core, t, &mut out);
    out
}

/// Gated full attention over `t` rows of `a` at positions `pos0..` (mlx-lm
/// `qwen3_next.Qwen3NextAttention`): q and an output gate per head from one projection, q/k norms,
/// NeoX RoPE on the first `rotated` dims of each head, scale `head_dim^-0.5`, output ⊙ sigmoid(gate).
#[allow(clippy::too_many_arguments)]
fn full_attention(
    cfg: &Config,
    pool: &ThreadPool,
    k: &Kernels,
    map: &[u8],
    at: &Attention,
    kv: &mut KvLayer,
    (rope, rotated): (&Rope, usize),
    a: &[f32],
    t: usize,
    pos0: usize,
) -> Vec<f32> {
    let d = cfg.head_dim();
    let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let eps = cfg.rms_norm_eps;
    let mut qg = vec![0.0f32; t * nh * 2 * d]; // [T, n_heads, 2·head_dim] = q | gate per head
    pool.gemm(k, &at.q_proj.mat(map), a, t, &mut qg);
    let mut q = Vec::with_capacity(t * nh * d); // [T, n_heads, head_dim]
    let mut gate = Vec::with_capacity(t * nh * d);
    for head in qg.chunks_exact(2 * d) {
        q.extend_from_slice(&head[..d]);
        gate.extend_from_slice(&head[d..]);
    }
    let mut kr = vec![0.0f32; t * nkv * d]; // [T, n_kv_heads, head_dim]
    pool.gemm(k, &at.k_proj.mat(map), a, t, &mut kr);
    let mut v = vec![0.0f32; t * nkv * d];
    pool.gemm(k, &at.v_proj.mat(map), a, t, &mut v);
    rms_norm(&mut q, d, Some((&at.q_norm, map)), eps);
    rms_norm(&mut kr, d, Some((&at.k_norm, map)), eps);
    for r in 0..t {
        let p = pos0 + r;
        for head in q[r * nh * d..(r + 1) * nh * d].chunks_exact_mut(d) {
            rope.apply(&mut head[..rotated], rotated, p);
        }
        for head in kr[r * nkv * d..(r + 1) * nkv * d].chunks_exact_mut(d) {
            rope.apply(&mut head[..rotated], rotated, p);
        }
        kv.write(
            p,
            &kr[r * nkv * d..(r + 1) * nkv * d],
            &v[r * nkv * d..(r + 1) * nkv * d],
        );
    }
    let mut attn = vec![0.0f32; t * nh * d];
    let shape = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: d,
        window: None,
        scale: (d as f32).powf(-0.5),
    };
    attention(pool, k, &q, kv, pos0, &shape, &mut attn);
    attn.iter_mut()
        .zip(&gate)
        .for_each(|(o, &g)| *o *= sigmoid(g));
    let mut out = vec![0.0f32; t * cfg.hidden_size];
    pool.gemm(k, &at.o_proj.mat(map), &attn, t, &mut out);
    out
}

/// The MoE block over `t` rows of `u` (mlx-lm `Qwen3NextSparseMoeBlock`): softmax router, top-k
/// (renormalised when `norm_topk_prob`), SwiGLU experts streamed tile by tile, plus the shared
/// expert scaled by `sigmoid(shared_expert_gate(u))`. Returns `[T, hidden]`.
#[allow(clippy::too_many_arguments)]
fn sparse_moe(
    cfg: &Config,
    pool: &ThreadPool,
    k: &Kernels,
    map: &[u8],
    layer: &Layer,
    streamer: &mut mference_runtime::ExpertStreamer,
    slots: mference_runtime::CacheSlots,
    u: &[f32],
    t: usize,
    engine: &crate::Engine,
    pos0: usize,
) -> Result<Vec<f32>, ModelError> {
    let h = cfg.hidden_size;
    let n_exp = cfg.num_experts;
    let mut router_logits = vec![0.0f32; t * n_exp]; // [T, num_experts]
    pool.gemm(k, &layer.gate.mat(map), u, t, &mut router_logits);
    let mut routes: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
    for (row, p) in router_logits.chunks_exact_mut(n_exp).enumerate() {
        engine.note_router_margin(pos0 + row, p, cfg.num_experts_per_tok);
        softmax(p);
        let idx = top_k(p, cfg.num_experts_per_tok);
        let z: f32 = if cfg.norm_topk_prob {
            idx.iter().map(|&e| p[e]).sum()
        } else {
            1.0
        };
        for &e in &idx {
            routes.entry(e).or_default().push((row, p[e] / z));
        }
    }
    let needed: Vec<usize> = routes.keys().copied().collect();
    let tile = if t == 1 {
        needed.len().max(1)
    } else {
        (slots.count(n_exp) / 2).clamp(1, 8)
    };
    let tiles: Vec<&[usize]> = needed.chunks(tile).collect();
    let mut next_slots = match tiles.first() {
        Some(first) => Some(streamer.acquire(first)?),
        None => None,
    };

    // Shared expert while the first tile's reads are in flight.
    let se = &layer.shared_expert;
    let mut moe_out = swiglu_mlp(pool, k, map, se, u, t);
    let mut shared_gate = vec![0.0f32; t];
    pool.gemm(
        k,
        &layer.shared_expert_gate.mat(map),
        u,
        t,
        &mut shared_gate,
    );
    for (row, &g) in moe_out.chunks_exact_mut(h).zip(&shared_gate) {
        let s = sigmoid(g);
        row.iter_mut().for_each(|v| *v *= s);
    }

    for (ti, tl) in tiles.iter().enumerate() {
        streamer.wait()?;
        let got = next_slots.take().expect("tile acquired one step ahead");
        if let Some(next) = tiles.get(ti + 1) {
            next_slots = Some(streamer.acquire(next)?);
        }
        for (&e, &(slot, _hit)) in tl.iter().zip(&got) {
            let rows = &routes[&e];
            let blob = streamer.blob(slot);
            let mut xe = Vec::with_capacity(rows.len() * h);
            for &(row, _) in rows {
                xe.extend_from_slice(&u[row * h..(row + 1) * h]);
            }
            let ye = swiglu_mlp(pool, k, blob, &layer.switch_mlp, &xe, rows.len());
            for (j, &(row, w)) in rows.iter().enumerate() {
                k.axpy(
                    w,
                    &ye[j * h..(j + 1) * h],
                    &mut moe_out[row * h..(row + 1) * h],
                );
            }
        }
        streamer.release(tl);
    }
    Ok(moe_out)
}

/// `down(silu(gate(x)) * up(x))` for `t` rows of `x` (SwiGLU).
fn swiglu_mlp(
    pool: &ThreadPool,
    k: &Kernels,
    buf: &[u8],
    m: &Mlp,
    x: &[f32],
    t: usize,
) -> Vec<f32> {
    let i = m.gate_proj.rows;
    let mut g = vec![0.0f32; t * i];
    let mut u = vec![0.0f32; t * i];
    pool.gemm(k, &m.gate_proj.mat(buf), x, t, &mut g);
    pool.gemm(k, &m.up_proj.mat(buf), x, t, &mut u);
    g.iter_mut().zip(&u).for_each(|(a, b)| *a = silu(*a) * b);
    let mut y = vec![0.0f32; t * m.down_proj.rows];
    pool.gemm(k, &m.down_proj.mat(buf), &g, t, &mut y);
    y
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

impl crate::Model for Qwen35Moe {
    fn forward(&mut self, tokens: &[u32], want: Want) -> Result<Logits, ModelError> {
        let (chunk, max) = (self.engine.prefill_chunk, self.engine.max_context);
        crate::run_chunked(tokens, self.kv.len, chunk, max, want, |c, w| {
            self.forward_chunk(c, w)
        })
    }

    fn position(&self) -> usize {
        self.kv.len
    }

    /// The DeltaNet state summarises the whole prefix and cannot be cut open: `n == 0` (start
    /// over), `n == position()` (keep everything) and `n` at the checkpoint (restore its states and
    /// cut the attention KV there) succeed; anything else is refused and changes nothing.
    fn truncate(&mut self, n: usize) -> bool {
        if n == self.kv.len {
            return true;
        }
        if n == 0 {
            // The snapshot described a prefix that is now gone.
            self.snapshot = None;
            self.kv.clear();
            for s in self.states.iter_mut().flatten() {
                s.conv.fill(0.0);
                s.ssm.fill(0.0);
            }
            return true;
        }
        match &self.snapshot {
            Some((pos, states)) if *pos == n && n <= self.kv.len && self.kv.truncate(n) => {
                self.states.clone_from(states);
                true
            }
            _ => false,
        }
    }

    /// Copies the FP32 DeltaNet states (conv and recurrent; ~60 MiB on the 35B-A3B).
    fn checkpoint(&mut self) {
        let pos = self.kv.len;
        match &mut self.snapshot {
            Some((p, states)) => {
                *p = pos;
                states.clone_from(&self.states);
            }
            None => self.snapshot = Some((pos, self.states.clone())),
        }
    }

    fn is_recurrent(&self) -> bool {
        true
    }

    fn rewind_point(&self, n: usize) -> usize {
        match self.snapshot {
            _ if n >= self.kv.len => self.kv.len,
            Some((pos, _)) if pos <= n && pos <= self.kv.len => pos,
            _ => 0,
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

    /// KV cache of the full-attention layers plus the FP32 DeltaNet states (conv and recurrent).
    fn kv_bytes(&self) -> usize {
        let states: usize = self
            .states
            .iter()
            .flatten()
            .map(|s| 4 * (s.conv.len() + s.ssm.len()))
            .sum();
        self.kv.bytes() + states
    }
}
