//! Inkling-Small (`inkling_mm_model`, pipenetwork/Inkling-Small-MLX-4bit; text only): sliding and
//! global attention without RoPE but with a learned relative-position bias, four depthwise causal
//! short convolutions per layer (FP32 state), dense SwiGLU first layers, then a sigmoid-routed MoE
//! whose two shared experts act as sinks in the routing softmax; embedding norm, untied head with a
//! muP divisor, logits cut to the unpadded vocabulary.
//!
//! Math: transformers 5.23 `models/inkling/modeling_inkling.py`
//! (`InklingAttention`, `InklingRelativeLogits`, `InklingShortConvolution`, `InklingTopkRouter`,
//! `InklingSharedExperts`, `InklingForCausalLM`); checkpoint names and dtypes:
//! pipenetwork/Inkling-Small-MLX-4bit; the original system's numerics: FP32 residual stream
//! and conv state, FP32 shared-expert outputs, dense `global_scale` BF16 and the router's
//! `global_scale`/`bias` FP32. Every norm is the plain `rms(x)·w` (`InklingRMSNorm`).

mod config;

pub use config::Config;

use mference_backend::Weights::Resident;
use mference_backend::{
    f32_vector, moe, Act, AttnShape, Backend, KvCache, LogScaling, Mlp, Norm, QRef, RelBias,
    RouterSpec, Routes, Scoring, SinkRouter, Tensor, Unary, VRef, WeightError,
};

use crate::{
    check_ids, expert_linear, linear, one, ChunkWant, Engine, FamilyModel, LayerState, LoadOptions,
    Logits, ModelError, Rings, SequenceState, Streamers,
};

/// A short convolution `y + conv(y)` (`InklingShortConvolution`): weight `[C, kernel]` in f32.
struct ShortConv<B: Backend> {
    weight: B::Tensor,
}

/// Attention weights (`attn.*`).
struct Attention<B: Backend> {
    wq_du: QRef,
    wk_dv: QRef,
    wv_dv: QRef,
    /// `r_proj`: `[n_heads · d_rel, hidden]`.
    wr_du: QRef,
    wo_ud: QRef,
    q_norm: VRef,
    k_norm: VRef,
    k_sconv: ShortConv<B>,
    v_sconv: ShortConv<B>,
    /// `rel_logits_proj.proj`: `[d_rel, extent]`.
    rel_logits_proj: B::Tensor,
}

enum Ffn<B: Backend> {
    /// Dense SwiGLU times `mlp.global_scale` (BF16).
    Dense(Box<Mlp>, f32),
    Moe(Box<MoeBlock<B>>),
}

/// `mlp.gate` (router), `mlp.experts` (in the expert blobs) and `mlp.shared_experts` (resident).
struct MoeBlock<B: Backend> {
    /// `[n_routed + n_shared, hidden]` f32 (the BF16 router, unquantized in the checkpoint).
    gate: B::Tensor,
    /// `[1, n_routed]` (`e_score_correction_bias`, FP32).
    bias: B::Tensor,
    /// `route_scale · gate.global_scale` (FP32).
    scale: f32,
    experts: Mlp,
    shared_experts: Vec<Mlp>,
    /// Index among the MoE layers (routing traces).
    moe_index: usize,
}

struct Layer<B: Backend> {
    attn: Attention<B>,
    attn_norm: VRef,
    attn_sconv: ShortConv<B>,
    mlp_norm: VRef,
    mlp: Ffn<B>,
    mlp_sconv: ShortConv<B>,
}

/// A loaded Inkling model with its KV cache, short-conv states and expert streamers (one
/// sequence) on backend `B`.
pub struct Inkling<B: Backend> {
    cfg: Config,
    engine: Engine,
    be: B,
    embed: QRef,
    embed_norm: Option<VRef>,
    norm: VRef,
    /// `unembed` cut to the unpadded vocabulary's rows.
    unembed: QRef,
    layers: Vec<Layer<B>>,
    /// One KV layer per attention layer (sliding layers are rings of [`Inkling::ring_rows`]
    /// rows, which reach a checkpoint up to a chunk plus [`REWIND_REACH`] positions back without
    /// a copy) and per layer its four FP32 short-convolution states `[kernel − 1, C]`: k, v, the
    /// attention output's and the MLP output's.
    state: SequenceState<B>,
    streamers: Streamers,
}

const P: &str = "model.llm";

/// Positions past a checkpoint that a rewind to it may cut off (a generated reply and the next
/// turn's opener): the sliding rings keep this many rows beyond the window and a prefill chunk.
pub const REWIND_REACH: usize = 2048;

impl<B: Backend> Inkling<B> {
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
        let kern = cfg.sconv_kernel_size;
        let (n_exp, n_shared) = (cfg.n_routed_experts, cfg.n_shared_experts);
        let mi = cfg.intermediate_size;
        let stride = engine.install.layout.expert_stride as usize;
        let n_moe = cfg.num_hidden_layers - cfg.dense_mlp_idx;
        if n_moe > 0 {
            engine.check_moe(n_moe, n_exp, cfg.num_experts_per_tok)?;
        }
        let q = |base: String, rows, cols| linear(idx, map.len(), &base, rows, cols);
        let v = |name: String, n: usize| VRef::resident(idx, &name, n);
        let vector = |name: String, n: usize| f32_vector(idx, map, &name, n);
        let scalar = |name: String| -> Result<f32, ModelError> { Ok(vector(name, 1)?[0]) };
        // MLX stores the depthwise conv as [C, K, 1]: row-major, it is the [C, K] weight.
        let sconv = |name: String, c: usize| -> Result<ShortConv<B>, ModelError> {
            Ok(ShortConv {
                weight: be.upload(&vector(name, c * kern)?, kern)?,
            })
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let b = format!("{P}.layers.{l}");
            let a = format!("{b}.attn");
            let (nh, nkv, d) = cfg.heads(l);
            let extent = if cfg.is_sliding(l) {
                cfg.sliding_window_size
            } else {
                cfg.rel_extent
            };
            let attn = Attention {
                wq_du: q(format!("{a}.wq_du"), nh * d, h)?,
                wk_dv: q(format!("{a}.wk_dv"), nkv * d, h)?,
                wv_dv: q(format!("{a}.wv_dv"), nkv * d, h)?,
                wr_du: q(format!("{a}.wr_du"), nh * cfg.d_rel, h)?,
                wo_ud: q(format!("{a}.wo_ud"), h, nh * d)?,
                q_norm: v(format!("{a}.q_norm.weight"), d)?,
                k_norm: v(format!("{a}.k_norm.weight"), d)?,
                k_sconv: sconv(format!("{a}.k_sconv.weight"), nkv * d)?,
                v_sconv: sconv(format!("{a}.v_sconv.weight"), nkv * d)?,
                rel_logits_proj: be.upload(
                    &vector(format!("{a}.rel_logits_proj.proj"), cfg.d_rel * extent)?,
                    extent,
                )?,
            };
            let mlp = if l < cfg.dense_mlp_idx {
                let di = cfg.dense_intermediate_size;
                Ffn::Dense(
                    Box::new(Mlp {
                        gate_proj: q(format!("{b}.mlp.gate_proj"), di, h)?,
                        up_proj: q(format!("{b}.mlp.up_proj"), di, h)?,
                        down_proj: q(format!("{b}.mlp.down_proj"), h, di)?,
                    }),
                    scalar(format!("{b}.mlp.global_scale"))?,
                )
            } else {
                let blob = engine.expert_blob(l)?;
                let ex = |part: &str, t, rows, cols| {
                    expert_linear(&format!("{b}.mlp.experts.{part}"), t, stride, rows, cols)
                };
                let shared = |part: &str, rows, cols| {
                    stacked(
                        &engine,
                        &format!("{b}.mlp.shared_experts.{part}"),
                        n_shared,
                        rows,
                        cols,
                    )
                };
                let (sg, su, sd) = (
                    shared("gate_proj", mi, h)?,
                    shared("up_proj", mi, h)?,
                    shared("down_proj", h, mi)?,
                );
                let gate_scale = scalar(format!("{b}.mlp.gate.global_scale"))?;
                Ffn::Moe(Box::new(MoeBlock {
                    gate: be.upload(
                        &vector(format!("{b}.mlp.gate.weight"), (n_exp + n_shared) * h)?,
                        h,
                    )?,
                    bias: be.upload(&vector(format!("{b}.mlp.gate.bias"), n_exp)?, n_exp)?,
                    scale: cfg.route_scale * gate_scale,
                    experts: Mlp {
                        gate_proj: ex("gate_proj", &blob.gate, mi, h)?,
                        up_proj: ex("up_proj", &blob.up, mi, h)?,
                        down_proj: ex("down_proj", &blob.down, h, mi)?,
                    },
                    shared_experts: (0..n_shared)
                        .map(|s| Mlp {
                            gate_proj: sg[s],
                            up_proj: su[s],
                            down_proj: sd[s],
                        })
                        .collect(),
                    moe_index: l - cfg.dense_mlp_idx,
                }))
            };
            layers.push(Layer {
                attn,
                attn_norm: v(format!("{b}.attn_norm.weight"), h)?,
                attn_sconv: sconv(format!("{b}.attn_sconv.weight"), h)?,
                mlp_norm: v(format!("{b}.mlp_norm.weight"), h)?,
                mlp,
                mlp_sconv: sconv(format!("{b}.mlp_sconv.weight"), h)?,
            });
        }
        let embed = q(format!("{P}.embed"), cfg.vocab_size, h)?;
        let embed_norm = match cfg.use_embed_norm {
            true => Some(v(format!("{P}.embed_norm.weight"), h)?),
            false => None,
        };
        let unembed = first_rows(
            &q(format!("{P}.unembed"), cfg.vocab_size, h)?,
            cfg.vocab_size(),
            map.len(),
        )?;
        let ring = Self::ring_rows(&cfg, opts);
        let kv = (0..cfg.num_hidden_layers)
            .map(|l| {
                let (_, nkv, d) = cfg.heads(l);
                match cfg.is_sliding(l) && ring < opts.max_context {
                    true => be.new_kv(ring, true, nkv, d, opts.kv_dtype),
                    false => be.new_kv(opts.max_context, false, nkv, d, opts.kv_dtype),
                }
            })
            .collect::<Result<_, _>>()?;
        let reach = match ring < opts.max_context {
            true => ring - cfg.sliding_window_size,
            false => usize::MAX,
        };
        let mut states = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let (_, nkv, d) = cfg.heads(l);
            let st = |c: usize| be.new_state((kern - 1) * c);
            states.push(LayerState::arrays(vec![
                st(nkv * d)?,
                st(nkv * d)?,
                st(h)?,
                st(h)?,
            ]));
        }
        let norm = v(format!("{P}.norm.weight"), h)?;
        Ok(Self {
            streamers: Streamers::new(cfg.num_hidden_layers),
            cfg,
            engine,
            be,
            embed,
            embed_norm,
            norm,
            unembed,
            layers,
            state: SequenceState::new(KvCache::new(kv))
                .with_layers(states)
                .with_rings(Rings::Reach(reach)),
        })
    }

    /// Rows of a sliding layer's KV ring: the window, a prefill chunk written after it, and
    /// [`REWIND_REACH`] positions a checkpoint may lie behind the end (a server's reply); the whole
    /// context when that is not smaller.
    pub fn ring_rows(cfg: &Config, opts: &LoadOptions) -> usize {
        opts.sliding_rows(cfg.sliding_window_size.saturating_add(REWIND_REACH))
    }

    /// The parsed `text_config`.
    pub fn config(&self) -> &Config {
        &self.cfg
    }
}

impl<B: Backend + 'static> FamilyModel for Inkling<B> {
    type Backend = B;

    /// Runs `tokens` (one chunk, at most the prefill chunk) at positions `kv.len ..`; see [`crate::Want`].
    fn forward_chunk(&mut self, tokens: &[u32], want: ChunkWant) -> Result<Logits, ModelError> {
        let (cfg, be) = (&self.cfg, &self.be);
        let t = tokens.len();
        let h = cfg.hidden_size;
        let pos0 = self.state.kv.len;
        let eps = cfg.rms_norm_eps;
        check_ids(tokens, cfg.vocab_size)?;

        let mut x = be.embed(&self.embed, tokens, None)?; // [T, hidden]
        if let Some(w) = &self.embed_norm {
            be.rms_norm(&mut x, h, Norm::Weight(w), eps)?;
        }
        for (li, layer) in self.layers.iter().enumerate() {
            let [k_conv, v_conv, attn_conv, mlp_conv] = &mut self.state.layers[li].arrays[..]
            else {
                unreachable!("an Inkling layer has four short-conv states")
            };
            let mut attn_norm = be.copy(&x)?;
            be.rms_norm(&mut attn_norm, h, Norm::Weight(&layer.attn_norm), eps)?;
            let kv = &mut self.state.kv.layers[li];
            let convs = (k_conv, v_conv);
            let attn_out = attention(cfg, be, li, &layer.attn, kv, convs, &attn_norm, pos0)?;
            let attn_out = short_conv(be, &layer.attn_sconv, attn_conv, attn_out, cfg)?;
            be.add(&mut x, &attn_out, 1.0)?;

            let mut mlp_norm = be.copy(&x)?;
            be.rms_norm(&mut mlp_norm, h, Norm::Weight(&layer.mlp_norm), eps)?;
            let mlp_out = match &layer.mlp {
                Ffn::Dense(mlp, global_scale) => {
                    let mut y = be.glu_mlp(mlp, Act::Silu, Resident, &mlp_norm)?;
                    be.unary(&mut y, Unary::Scale(*global_scale))?;
                    y
                }
                Ffn::Moe(m) => {
                    let streamer = self.streamers.get(li, &self.engine)?;
                    sparse_moe(cfg, be, m, streamer, &mlp_norm, &self.engine, pos0)?
                }
            };
            let mlp_out = short_conv(be, &layer.mlp_sconv, mlp_conv, mlp_out, cfg)?;
            be.add(&mut x, &mlp_out, 1.0)?;
        }
        self.state.kv.len = pos0 + t;

        let head = crate::Head {
            norm: &self.norm,
            eps,
            weight: &self.unembed,
            softcap: None,
        };
        // logits = unembed(norm(x) / m): dividing the products by a power of two is the same.
        Ok(match crate::head(be, &x, pos0, want, &head)? {
            Logits::Rows(mut r) => {
                let m = cfg.logits_mup_width_multiplier;
                r.iter_mut().for_each(|z| *z /= m);
                Logits::Rows(r)
            }
            other => other,
        })
    }

    crate::family_parts!();

    fn vocab(&self) -> usize {
        self.cfg.vocab_size()
    }
}

/// `y + conv(y)` with the depthwise causal conv continuing `state` (`InklingShortConvolution`).
fn short_conv<B: Backend>(
    be: &B,
    c: &ShortConv<B>,
    state: &mut B::State,
    mut y: B::Tensor,
    cfg: &Config,
) -> Result<B::Tensor, ModelError> {
    let conv = be.conv1d(&y, state, &c.weight, cfg.sconv_kernel_size)?;
    be.add(&mut y, &conv, 1.0)?;
    Ok(y)
}

/// Attention of layer `li` over the rows of `a` at positions `pos0..` (`InklingAttention`): q, k,
/// v and the relative-position coefficients from one input; k and v through their short
/// convolutions; per-head q/k RMSNorm; no RoPE; scale `1/head_dim`; the relative-position bias
/// within the layer's extent; on global layers the log position scale.
#[allow(clippy::too_many_arguments)]
fn attention<B: Backend>(
    cfg: &Config,
    be: &B,
    li: usize,
    at: &Attention<B>,
    kv: &mut B::Kv,
    (k_conv, v_conv): (&mut B::State, &mut B::State),
    a: &B::Tensor,
    pos0: usize,
) -> Result<B::Tensor, ModelError> {
    let (nh, nkv, d) = cfg.heads(li);
    let sliding = cfg.is_sliding(li);
    let eps = cfg.rms_norm_eps;
    let mut p = be.matmul(&[&at.wq_du, &at.wk_dv, &at.wv_dv, &at.wr_du], Resident, a)?;
    let rel = p.pop().expect("wr_du"); // [T, n_heads · d_rel]
    let v = p.pop().expect("wv_dv"); // [T, n_kv_heads · head_dim]
    let k = p.pop().expect("wk_dv");
    let mut q = p.pop().expect("wq_du"); // [T, n_heads · head_dim]
    let mut k = short_conv(be, &at.k_sconv, k_conv, k, cfg)?;
    let v = short_conv(be, &at.v_sconv, v_conv, v, cfg)?;
    be.rms_norm(&mut q, d, Norm::Weight(&at.q_norm), eps)?;
    be.rms_norm(&mut k, d, Norm::Weight(&at.k_norm), eps)?;
    be.kv_write(kv, pos0, &k, &v)?;
    let shape = AttnShape {
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: d,
        window: sliding.then_some(cfg.sliding_window_size),
        scale: 1.0 / d as f32,
        sinks: None,
    };
    let log_scaling = match cfg.log_scaling_n_floor {
        Some(n_floor) if !sliding => Some(LogScaling {
            n_floor: n_floor as f32,
            alpha: cfg.log_scaling_alpha as f32,
        }),
        _ => None,
    };
    let bias = RelBias {
        rel: &rel,
        proj: &at.rel_logits_proj,
        log_scaling,
    };
    let out = be.attention_rel(&q, kv, pos0, &shape, &bias)?;
    Ok(one(be.matmul(&[&at.wo_ud], Resident, &out)?))
}

/// The MoE block over the rows of `u` (`InklingMoE`): the sink router, the routed SwiGLU experts
/// from the streamer, and the shared experts weighted by their share of the routing softmax.
/// Returns `[T, hidden]`.
fn sparse_moe<B: Backend>(
    cfg: &Config,
    be: &B,
    m: &MoeBlock<B>,
    streamer: &mut mference_runtime::ExpertStreamer,
    u: &B::Tensor,
    engine: &Engine,
    pos0: usize,
) -> Result<B::Tensor, ModelError> {
    let router_logits = be.linear(u, &m.gate)?; // [T, n_routed + n_shared]
    let forced = engine.forced_routes(m.moe_index, pos0, u.rows());
    let mut routes = be.route_sinks(
        &router_logits,
        &SinkRouter {
            bias: &m.bias,
            n_shared: cfg.n_shared_experts,
            scale: m.scale,
        },
        &RouterSpec {
            scoring: Scoring::SoftmaxOfTopK,
            top_k: cfg.num_experts_per_tok,
            per_expert_scale: None,
            trace: engine.traces_router(),
            forced: forced.as_deref(),
        },
    )?;
    engine.note_router_margins(pos0, &routes.margins);
    // The shared experts' weights per row (ids n_routed..) are not streamed.
    let shared = routes.experts.split_off(&cfg.n_routed_experts);
    let routed = Routes {
        experts: routes.experts,
        margins: Vec::new(),
    };
    let ((), moe_out) =
        moe::routed_experts(be, streamer, &m.experts, Act::Silu, u, &routed, || {
            let mut acc = be.zeros(u.rows(), cfg.hidden_size)?;
            for (mlp, rows) in m.shared_experts.iter().zip(shared.values()) {
                let y = be.glu_mlp(mlp, Act::Silu, Resident, u)?;
                be.scatter_add(&mut acc, &y, rows)?;
            }
            Ok::<_, ModelError>(((), acc))
        })?;
    Ok(moe_out)
}

/// The `n` matrices `[rows, cols]` of the stacked resident tensor `<base>.weight` (`[n, rows,
/// cols]`: the shared experts).
fn stacked(
    engine: &Engine,
    base: &str,
    n: usize,
    rows: usize,
    cols: usize,
) -> Result<Vec<QRef>, ModelError> {
    let name = format!("{base}.weight");
    let e = engine.index.get(&name).ok_or_else(|| WeightError {
        name: name.clone(),
        why: "missing from model_weights.bin".into(),
    })?;
    let shape = e.logical_shape();
    if !e.is_quantized() || shape != [n as u64, rows as u64, cols as u64] {
        return Err(WeightError {
            name,
            why: format!("expected quantized [{n}, {rows}, {cols}], found {shape:?}"),
        }
        .into());
    }
    let part = |off: u64, size: u64, s: usize| {
        let per = size as usize / n;
        (off as usize + s * per, per)
    };
    (0..n)
        .map(|s| {
            QRef::from_parts(
                &name,
                rows,
                cols,
                part(e.file_offset, e.size_bytes, s),
                part(e.scale_offset, e.scale_size, s),
                part(e.bias_offset, e.bias_size, s),
                engine.map.len(),
            )
            .map_err(ModelError::from)
        })
        .collect()
}

/// The first `n` rows of `w` (rows are contiguous in the packed weights, scales and biases).
fn first_rows(w: &QRef, n: usize, buf_len: usize) -> Result<QRef, ModelError> {
    let [wb, sb, bb] = w.byte_ranges();
    let cut = |(off, len): (usize, usize)| (off, len / w.rows * n);
    Ok(QRef::from_parts(
        "model.llm.unembed.weight",
        n,
        w.cols,
        cut(wb),
        cut(sb),
        cut(bb),
        buf_len,
    )?)
}
