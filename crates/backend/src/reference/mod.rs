//! The reference implementation of every op: plain loops in f64 over host slices, written from the
//! op's definition (the docs of [`crate::Backend`]'s groups) and not from any backend's code. The
//! op test harness ([`crate::harness`]) runs each backend's op against its twin here. The core
//! ops are here; the other groups in `recurrent`, `deepseek_v4` and `inkling`, re-exported.

mod deepseek_v4;
mod inkling;
mod recurrent;

pub use deepseek_v4::{
    attention_sparse, compress_pool, hc_post, hc_pre, index_top_k, matmul_grouped, rope_at,
};
pub use inkling::{attention_rel, route_sinks};
pub use recurrent::{conv1d, conv1d_silu, delta_gates, gated_delta_rule};

use crate::{
    Act, AttnShape, DeltaShape, HcSpec, LogScaling, Norm, QRef, Rope, RopeStyle, RouterSpec,
    Scoring, Unary, VRef,
};

fn bf16(buf: &[u8], off: usize) -> f64 {
    f32::from_bits((u16::from_le_bytes([buf[off], buf[off + 1]]) as u32) << 16) as f64
}

/// The dequantized matrix `[rows, cols]` (MLX affine: little-endian u32 words, `32/bits` codes
/// per word lowest bits first, `w = scale·q + bias` per group of `group_size` columns).
pub fn dequantize(w: &QRef, buf: &[u8]) -> Vec<f64> {
    let m = w.mat(buf);
    let bits = m.bits as usize;
    let per_word = 32 / bits;
    let words_per_row = m.cols / per_word;
    let groups = m.cols / m.group_size;
    let mut out = vec![0.0; m.rows * m.cols];
    for r in 0..m.rows {
        for c in 0..m.cols {
            let wi = r * words_per_row + c / per_word;
            let b = &m.weight[4 * wi..4 * wi + 4];
            let word = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let q = (word >> ((c % per_word) * bits)) & ((1u32 << bits) - 1);
            let g = r * groups + c / m.group_size;
            let scale = bf16(m.scales, 2 * g);
            let bias = bf16(m.biases, 2 * g);
            out[r * m.cols + c] = scale * q as f64 + bias;
        }
    }
    out
}

/// `Y[T, rows] = X[T, cols] · Wᵀ`.
pub fn matmul(w: &QRef, buf: &[u8], x: &[f32]) -> Vec<f32> {
    let d = dequantize(w, buf);
    x.chunks_exact(w.cols)
        .flat_map(|xr| {
            d.chunks_exact(w.cols)
                .map(|wr| wr.iter().zip(xr).map(|(a, &b)| a * b as f64).sum::<f64>() as f32)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `Y[T, rows] = X[T, cols] · Wᵀ` for the BF16 matrix `w` (`[rows, cols]` row-major).
pub fn matmul_bf16(w: &VRef, buf: &[u8], rows: usize, x: &[f32]) -> Vec<f32> {
    let cols = w.len / rows;
    x.chunks_exact(cols)
        .flat_map(|xr| {
            (0..rows)
                .map(|r| {
                    (0..cols)
                        .map(|c| vget(w, buf, r * cols + c) * xr[c] as f64)
                        .sum::<f64>() as f32
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `down(act(gate(x)) ⊙ up(x))`.
pub fn glu_mlp(gate: &QRef, up: &QRef, down: &QRef, act: Act, buf: &[u8], x: &[f32]) -> Vec<f32> {
    let g = matmul(gate, buf, x);
    let u = matmul(up, buf, x);
    let h: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&a, &b)| {
            let (a, b) = (a as f64, b as f64);
            (match act {
                Act::GeluTanh => gelu_tanh(a) * b,
                Act::Silu => silu(a) * b,
                Act::SiluClamped(l) => silu(a.min(l as f64)) * b.clamp(-l as f64, l as f64),
            }) as f32
        })
        .collect();
    matmul(down, buf, &h)
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// One elementwise map.
pub fn unary(x: f32, op: Unary) -> f32 {
    let v = x as f64;
    (match op {
        Unary::Scale(c) => v * c as f64,
        Unary::Softcap(c) => c as f64 * (v / c as f64).tanh(),
        Unary::Clamp(lo, hi) => v.clamp(lo as f64, hi as f64),
        Unary::Silu => silu(v),
        Unary::GeluTanh => gelu_tanh(v),
        Unary::Sigmoid => sigmoid(v),
    }) as f32
}

/// RMSNorm of each `dim` piece.
pub fn rms_norm(x: &[f32], dim: usize, norm: Norm, buf: &[u8], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for piece in x.chunks_exact(dim) {
        let ms = piece.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for (i, &v) in piece.iter().enumerate() {
            let s = match norm {
                Norm::NoScale => 1.0,
                Norm::Weight(w) => vget(w, buf, i),
                Norm::OnePlusWeight(w) => 1.0 + vget(w, buf, i),
                Norm::Scaled(c) => c as f64,
            };
            out.push((v as f64 * r * s) as f32);
        }
    }
    out
}

fn vget(w: &VRef, buf: &[u8], i: usize) -> f64 {
    w.get(buf, i) as f64
}

/// RoPE of row `r` at position `pos0 + r`, each `head_dim` head.
pub fn rope(x: &[f32], cols: usize, rope: &Rope, head_dim: usize, pos0: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    let half = rope.rotated / 2;
    for (r, row) in out.chunks_exact_mut(cols).enumerate() {
        for head in row.chunks_exact_mut(head_dim) {
            for (i, &f) in rope.inv_freq.iter().enumerate() {
                let (ia, ib) = match rope.style {
                    RopeStyle::NeoX => (i, i + half),
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                };
                // The angle is formed in f32 (position × frequency), as every implementation does.
                let ang = ((pos0 + r) as f32 * f) as f64;
                let (s, c) = ang.sin_cos();
                let m = rope.mscale as f64;
                let (a, b) = (head[ia] as f64, head[ib] as f64);
                head[ia] = ((a * c - b * s) * m) as f32;
                head[ib] = ((a * s + b * c) * m) as f32;
            }
        }
    }
    out
}

/// Causal attention of `q` (`[T, n_heads·head_dim]`, positions `pos0..`) over the full history
/// `k`, `v` (`[pos0 + T, n_kv_heads·head_dim]`, position order).
pub fn attention(q: &[f32], k: &[f32], v: &[f32], pos0: usize, s: &AttnShape) -> Vec<f32> {
    attention_with(q, k, v, pos0, s, &|_, _, _| 0.0, &|_| 1.0)
}

/// Softmax weights of `scores`, with an optional sink logit in the denominator only (a sink
/// takes probability mass but contributes no value).
fn sink_softmax(scores: &[f64], sink: Option<f64>) -> Vec<f64> {
    let m = scores
        .iter()
        .copied()
        .chain(sink)
        .fold(f64::NEG_INFINITY, f64::max);
    let z: f64 =
        scores.iter().map(|x| (x - m).exp()).sum::<f64>() + sink.map_or(0.0, |sv| (sv - m).exp());
    scores.iter().map(|x| (x - m).exp() / z).collect()
}

/// Attention whose logit of (row `r`, head `h`, key at distance `dist`) is
/// `tau(p) · (q·k·scale + bias(r, h, dist))`.
fn attention_with(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    s: &AttnShape,
    bias: &dyn Fn(usize, usize, usize) -> f64,
    tau: &dyn Fn(usize) -> f64,
) -> Vec<f32> {
    let (nh, nkv, d) = (s.n_heads, s.n_kv_heads, s.head_dim);
    let t = q.len() / (nh * d);
    let mut out = vec![0.0f32; q.len()];
    for r in 0..t {
        let p = pos0 + r;
        let lo = s.window.map_or(0, |w| (p + 1).saturating_sub(w));
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let qh = &q[(r * nh + h) * d..(r * nh + h + 1) * d];
            let scores: Vec<f64> = (lo..=p)
                .map(|j| {
                    let kr = &k[(j * nkv + kvh) * d..(j * nkv + kvh + 1) * d];
                    let dot = qh
                        .iter()
                        .zip(kr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>();
                    tau(p) * (dot * s.scale as f64 + bias(r, h, p - j))
                })
                .collect();
            let w = sink_softmax(&scores, s.sinks.as_ref().map(|v| v[h] as f64));
            let o = &mut out[(r * nh + h) * d..(r * nh + h + 1) * d];
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = w
                    .iter()
                    .zip(lo..=p)
                    .map(|(wj, j)| wj * v[(j * nkv + kvh) * d + i] as f64)
                    .sum::<f64>() as f32;
            }
        }
    }
    out
}

/// Per row, the chosen `(expert, weight)` pairs sorted by expert id.
pub fn route(
    logits: &[f32],
    n_exp: usize,
    spec: &RouterSpec,
    buf: &[u8],
) -> Vec<Vec<(usize, f32)>> {
    logits
        .chunks_exact(n_exp)
        .enumerate()
        .map(|(row, lg)| {
            let mut order: Vec<usize> = (0..n_exp).collect();
            let probs: Vec<f64> = match spec.scoring {
                Scoring::SoftmaxOfTopK => lg.iter().map(|&x| x as f64).collect(),
                Scoring::TopKOfSoftmax { .. } => softmax(lg),
                Scoring::SqrtSoftplus { .. } => lg
                    .iter()
                    .map(|&x| {
                        let x = x as f64;
                        (x.max(0.0) + (-x.abs()).exp().ln_1p()).sqrt()
                    })
                    .collect(),
            };
            let select: Vec<f64> = match spec.scoring {
                Scoring::SqrtSoftplus {
                    correction_bias: Some(b),
                    ..
                } => (0..n_exp)
                    .map(|e| probs[e] + b.get(buf, e) as f64)
                    .collect(),
                _ => probs.clone(),
            };
            order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
            order.truncate(spec.top_k);
            if let Some(f) = spec.forced {
                order = f[row * spec.top_k..(row + 1) * spec.top_k].to_vec();
            }
            let w: Vec<f64> = match spec.scoring {
                Scoring::SoftmaxOfTopK => {
                    softmax(&order.iter().map(|&e| lg[e]).collect::<Vec<_>>())
                }
                Scoring::TopKOfSoftmax { norm_topk_prob } => {
                    let z: f64 = if norm_topk_prob {
                        order.iter().map(|&e| probs[e]).sum()
                    } else {
                        1.0
                    };
                    order.iter().map(|&e| probs[e] / z).collect()
                }
                Scoring::SqrtSoftplus {
                    routed_scaling_factor,
                    ..
                } => {
                    let z: f64 = order.iter().map(|&e| probs[e]).sum::<f64>() + 1e-20;
                    order
                        .iter()
                        .map(|&e| probs[e] / z * routed_scaling_factor as f64)
                        .collect()
                }
            };
            let mut chosen: Vec<(usize, f32)> = order
                .iter()
                .zip(w)
                .map(|(&e, w)| {
                    let s = spec.per_expert_scale.map_or(1.0, |p| vget(p, buf, e));
                    (e, (w * s) as f32)
                })
                .collect();
            chosen.sort_by_key(|&(e, _)| e);
            chosen
        })
        .collect()
}

fn softmax(v: &[f32]) -> Vec<f64> {
    let m = v
        .iter()
        .map(|&x| x as f64)
        .fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = v.iter().map(|&x| (x as f64 - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// `Y[T, n] = X[T, c] · Wᵀ` for an f32 `w` `[n, c]`.
pub fn linear(x: &[f32], w: &[f32], c: usize) -> Vec<f32> {
    x.chunks_exact(c)
        .flat_map(|xr| {
            w.chunks_exact(c)
                .map(|wr| {
                    wr.iter()
                        .zip(xr)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>() as f32
                })
                .collect::<Vec<_>>()
        })
        .collect()
}
