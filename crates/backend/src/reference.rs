//! The reference implementation of every op: plain loops in f64 over host slices, written from the
//! op's definition (the docs of [`crate::Backend`]) and not from any backend's code. The op test
//! harness (`tests/backend_ops.rs`) runs each backend's op against its twin here.

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

/// [`attention`] with Inkling's relative-position bias: query row `r` (position `p`), head `h`,
/// key `j` gets `Σ_i rel[r, h, i] · proj[i, p − j]` when `p − j < extent`, and the logits of
/// position `p` are multiplied by `τ_p` on global layers.
#[allow(clippy::too_many_arguments)]
pub fn attention_rel(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    s: &AttnShape,
    rel: &[f32],
    proj: &[f32],
    d_rel: usize,
    log_scaling: Option<LogScaling>,
) -> Vec<f32> {
    let extent = proj.len() / d_rel;
    let nh = s.n_heads;
    let bias = |r: usize, h: usize, dist: usize| -> f64 {
        if dist >= extent {
            return 0.0;
        }
        (0..d_rel)
            .map(|i| rel[(r * nh + h) * d_rel + i] as f64 * proj[i * extent + dist] as f64)
            .sum()
    };
    let tau = |p: usize| -> f64 {
        log_scaling.map_or(1.0, |l| {
            1.0 + l.alpha as f64 * ((p + 1) as f64 / l.n_floor as f64).max(1.0).ln()
        })
    };
    attention_with(q, k, v, pos0, s, &bias, &tau)
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

/// Depthwise causal conv then SiLU; returns the output and the new state.
pub fn conv1d_silu(
    x: &[f32],
    state: &[f32],
    w: &[f32],
    c: usize,
    kernel: usize,
) -> (Vec<f32>, Vec<f32>) {
    conv1d_with(x, state, w, c, kernel, silu)
}

/// Depthwise causal conv alone; returns the output and the new state.
pub fn conv1d(
    x: &[f32],
    state: &[f32],
    w: &[f32],
    c: usize,
    kernel: usize,
) -> (Vec<f32>, Vec<f32>) {
    conv1d_with(x, state, w, c, kernel, |v| v)
}

fn conv1d_with(
    x: &[f32],
    state: &[f32],
    w: &[f32],
    c: usize,
    kernel: usize,
    act: fn(f64) -> f64,
) -> (Vec<f32>, Vec<f32>) {
    let seq: Vec<f32> = state.iter().chain(x).copied().collect();
    let t = x.len() / c;
    let mut out = vec![0.0f32; x.len()];
    for r in 0..t {
        for ch in 0..c {
            let acc: f64 = (0..kernel)
                .map(|j| w[ch * kernel + j] as f64 * seq[(r + j) * c + ch] as f64)
                .sum();
            out[r * c + ch] = act(acc) as f32;
        }
    }
    (out, seq[t * c..].to_vec())
}

/// `(sigmoid(b), exp(−a·softplus(α + dt_bias)))` per `[T, n_v_heads]` element.
pub fn delta_gates(b: &[f32], alpha: &[f32], a: &[f32], dt_bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let nv = a.len();
    let beta = b.iter().map(|&x| sigmoid(x as f64) as f32).collect();
    let decay = alpha
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let z = x as f64 + dt_bias[i % nv] as f64;
            let softplus = z.max(0.0) + (-z.abs()).exp().ln_1p();
            (-(a[i % nv] as f64) * softplus).exp() as f32
        })
        .collect();
    (beta, decay)
}

/// The gated delta rule; returns the output and the new state.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    decay: &[f32],
    beta: &[f32],
    state: &[f32],
    s: &DeltaShape,
) -> (Vec<f32>, Vec<f32>) {
    let (nk, nv, dk, dv) = (s.n_k_heads, s.n_v_heads, s.head_k_dim, s.head_v_dim);
    let t = decay.len() / nv;
    let mut st: Vec<f64> = state.iter().map(|&x| x as f64).collect();
    let mut out = vec![0.0f32; t * nv * dv];
    for r in 0..t {
        for h in 0..nv {
            let kh = h / (nv / nk);
            let qr = &q[(r * nk + kh) * dk..(r * nk + kh + 1) * dk];
            let kr = &k[(r * nk + kh) * dk..(r * nk + kh + 1) * dk];
            let (g, b) = (decay[r * nv + h] as f64, beta[r * nv + h] as f64);
            for i in 0..dv {
                let row = &mut st[(h * dv + i) * dk..(h * dv + i + 1) * dk];
                row.iter_mut().for_each(|x| *x *= g);
                let sk: f64 = row.iter().zip(kr).map(|(a, &b)| a * b as f64).sum();
                let u = (v[(r * nv + h) * dv + i] as f64 - sk) * b;
                row.iter_mut()
                    .zip(kr)
                    .for_each(|(x, &kk)| *x += u * kk as f64);
                out[(r * nv + h) * dv + i] =
                    row.iter().zip(qr).map(|(a, &b)| a * b as f64).sum::<f64>() as f32;
            }
        }
    }
    (out, st.into_iter().map(|x| x as f32).collect())
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

/// RoPE of row `r` at position `positions[r]`.
pub fn rope_at(x: &[f32], cols: usize, r: &Rope, head_dim: usize, positions: &[usize]) -> Vec<f32> {
    x.chunks_exact(cols)
        .zip(positions)
        .flat_map(|(row, &p)| rope(row, cols, r, head_dim, p))
        .collect()
}

/// Block-diagonal product: group `g` multiplies columns `g·w.cols..` of `x` by rows
/// `g·(w.rows/groups)..` of `w`.
pub fn matmul_grouped(w: &QRef, groups: usize, buf: &[u8], x: &[f32]) -> Vec<f32> {
    let d = dequantize(w, buf);
    let (c, r) = (w.cols, w.rows / groups);
    x.chunks_exact(groups * c)
        .flat_map(|xr| {
            (0..groups * r)
                .map(|o| {
                    let g = o / r;
                    d[o * c..(o + 1) * c]
                        .iter()
                        .zip(&xr[g * c..(g + 1) * c])
                        .map(|(a, &b)| a * b as f64)
                        .sum::<f64>() as f32
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The mHC entry (see `Backend::hc_pre`): `(collapsed [T, D], Some((post [T, n], comb [T, n·n])))`.
#[allow(clippy::type_complexity)]
pub fn hc_pre(
    x: &[f32],
    cols: usize,
    f: &[f32],
    base: &[f32],
    scale: &[f32],
    s: &HcSpec,
) -> (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>) {
    let n = s.streams;
    let d = cols / n;
    let m = f.len() / cols;
    let eps = s.hc_eps as f64;
    let (mut col, mut post, mut comb) = (Vec::new(), Vec::new(), Vec::new());
    for xr in x.chunks_exact(cols) {
        let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / cols as f64;
        let r = 1.0 / (ms + s.norm_eps as f64).sqrt();
        let mix: Vec<f64> = f
            .chunks_exact(cols)
            .map(|fr| {
                fr.iter()
                    .zip(xr)
                    .map(|(&a, &b)| a as f64 * b as f64 * r)
                    .sum()
            })
            .collect();
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        let pre: Vec<f64> = (0..n)
            .map(|j| sig(mix[j] * scale[0] as f64 + base[j] as f64) + eps)
            .collect();
        for i in 0..d {
            col.push((0..n).map(|j| pre[j] * xr[j * d + i] as f64).sum::<f64>() as f32);
        }
        if m == n {
            continue;
        }
        post.extend(
            (0..n).map(|j| (2.0 * sig(mix[n + j] * scale[1] as f64 + base[n + j] as f64)) as f32),
        );
        let mut c = vec![0.0f64; n * n];
        for j in 0..n {
            let logits: Vec<f64> = (0..n)
                .map(|k| mix[2 * n + j * n + k] * scale[2] as f64 + base[2 * n + j * n + k] as f64)
                .collect();
            let mx = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|v| (v - mx).exp()).sum();
            for k in 0..n {
                c[j * n + k] = (logits[k] - mx).exp() / z + eps;
            }
        }
        let norm_cols = |c: &mut [f64]| {
            for k in 0..n {
                let z: f64 = (0..n).map(|j| c[j * n + k]).sum::<f64>() + eps;
                (0..n).for_each(|j| c[j * n + k] /= z);
            }
        };
        norm_cols(&mut c);
        for _ in 1..s.sinkhorn_iters {
            for j in 0..n {
                let z: f64 = c[j * n..(j + 1) * n].iter().sum::<f64>() + eps;
                c[j * n..(j + 1) * n].iter_mut().for_each(|v| *v /= z);
            }
            norm_cols(&mut c);
        }
        comb.extend(c.iter().map(|&v| v as f32));
    }
    (col, (m != n).then_some((post, comb)))
}

/// The mHC exit: `x'_k = post_k · out + Σ_j C[j][k] · x_j`.
pub fn hc_post(x: &[f32], out: &[f32], post: &[f32], comb: &[f32], n: usize) -> Vec<f32> {
    let d = out.len() / (post.len() / n);
    let mut y = Vec::with_capacity(x.len());
    for (r, xr) in x.chunks_exact(n * d).enumerate() {
        for k in 0..n {
            for i in 0..d {
                let mix: f64 = (0..n)
                    .map(|j| comb[r * n * n + j * n + k] as f64 * xr[j * d + i] as f64)
                    .sum();
                y.push((post[r * n + k] as f64 * out[r * d + i] as f64 + mix) as f32);
            }
        }
    }
    y
}

/// Softmax-gated window pooling (see `Backend::compress_pool`).
#[allow(clippy::too_many_arguments)]
pub fn compress_pool(
    kv: &[f32],
    gate: &[f32],
    ape: &[f32],
    rate: usize,
    width: usize,
    overlap: bool,
    prior: Option<(&[f32], &[f32])>,
) -> Vec<f32> {
    let d = if overlap { width / 2 } else { width };
    let n_win = kv.len() / (rate * width);
    let mut out = Vec::with_capacity(n_win * d);
    for w in 0..n_win {
        for c in 0..d {
            let mut slots: Vec<(f64, f64)> = Vec::new();
            let at = |r: usize, col: usize, i: usize| {
                (
                    kv[r * width + col] as f64,
                    gate[r * width + col] as f64 + ape[i * width + col] as f64,
                )
            };
            if overlap {
                for i in 0..rate {
                    match (w, prior) {
                        (0, Some((pk, pg))) => {
                            slots.push((pk[i * d + c] as f64, pg[i * d + c] as f64))
                        }
                        (0, None) => {}
                        _ => slots.push(at((w - 1) * rate + i, c, i)),
                    }
                }
            }
            let off = if overlap { d } else { 0 };
            for i in 0..rate {
                slots.push(at(w * rate + i, off + c, i));
            }
            let m = slots.iter().fold(f64::NEG_INFINITY, |m, s| m.max(s.1));
            let z: f64 = slots.iter().map(|s| (s.1 - m).exp()).sum();
            out.push(slots.iter().map(|s| s.0 * (s.1 - m).exp() / z).sum::<f64>() as f32);
        }
    }
    out
}

/// [`attention`] over the history `k`, `v` plus, for row `r`, the rows `visible[r]` of `entries`
/// (K = V) in one softmax.
pub fn attention_sparse(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    s: &AttnShape,
    entries: &[f32],
    visible: &[Vec<usize>],
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
            let row = |src: &[f32], j: usize| -> Vec<f64> {
                src[(j * nkv + kvh) * d..(j * nkv + kvh + 1) * d]
                    .iter()
                    .map(|&x| x as f64)
                    .collect()
            };
            let mut keys: Vec<Vec<f64>> = (lo..=p).map(|j| row(k, j)).collect();
            let mut vals: Vec<Vec<f64>> = (lo..=p).map(|j| row(v, j)).collect();
            for &e in &visible[r] {
                keys.push(row(entries, e));
                vals.push(row(entries, e));
            }
            let scores: Vec<f64> = keys
                .iter()
                .map(|kr| {
                    qh.iter().zip(kr).map(|(&a, b)| a as f64 * b).sum::<f64>() * s.scale as f64
                })
                .collect();
            let w = sink_softmax(&scores, s.sinks.as_ref().map(|sv| sv[h] as f64));
            let o = &mut out[(r * nh + h) * d..(r * nh + h + 1) * d];
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = w.iter().zip(&vals).map(|(wj, vr)| wj * vr[i]).sum::<f64>() as f32;
            }
        }
    }
    out
}

/// The indexer's selection (see `Backend::index_top_k`), with the scores for tie checks.
pub fn index_top_k(
    q: &[f32],
    keys: &[f32],
    weights: &[f32],
    n_heads: usize,
    d: usize,
    visible: &[usize],
    top_k: usize,
) -> Vec<(Vec<usize>, Vec<f64>)> {
    visible
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            let scores: Vec<f64> = (0..n)
                .map(|e| {
                    (0..n_heads)
                        .map(|h| {
                            let dot: f64 = (0..d)
                                .map(|i| {
                                    q[(r * n_heads + h) * d + i] as f64 * keys[e * d + i] as f64
                                })
                                .sum();
                            weights[r * n_heads + h] as f64 * dot.max(0.0)
                        })
                        .sum()
                })
                .collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            order.truncate(top_k.min(n));
            order.sort_unstable();
            (order, scores)
        })
        .collect()
}

/// Per row, the chosen `(expert, weight)` pairs of Inkling's sink router sorted by id: routed
/// experts by the top-k of `sigmoid(l) + bias` (or `spec.forced`), then every shared expert as id
/// `n_routed + s`; weights `softmax(logsigmoid(l[ids])) · scale`.
pub fn route_sinks(
    logits: &[f32],
    n_all: usize,
    bias: &[f32],
    scale: f32,
    spec: &RouterSpec,
) -> Vec<Vec<(usize, f32)>> {
    let n_routed = bias.len();
    logits
        .chunks_exact(n_all)
        .enumerate()
        .map(|(row, lg)| {
            let choice: Vec<f64> = (0..n_routed)
                .map(|e| sigmoid(lg[e] as f64) + bias[e] as f64)
                .collect();
            let mut order: Vec<usize> = (0..n_routed).collect();
            order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
            order.truncate(spec.top_k);
            if let Some(f) = spec.forced {
                order = f[row * spec.top_k..(row + 1) * spec.top_k].to_vec();
            }
            order.extend(n_routed..n_all);
            let ls: Vec<f64> = order.iter().map(|&e| sigmoid(lg[e] as f64).ln()).collect();
            let m = ls.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = ls.iter().map(|x| (x - m).exp()).sum();
            let mut chosen: Vec<(usize, f32)> = order
                .iter()
                .zip(&ls)
                .map(|(&e, x)| (e, ((x - m).exp() / z * scale as f64) as f32))
                .collect();
            chosen.sort_by_key(|&(e, _)| e);
            chosen
        })
        .collect()
}
