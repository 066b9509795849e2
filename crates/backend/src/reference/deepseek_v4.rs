//! The reference of DeepSeek-V4's ops: RoPE at positions, the grouped product, mHC, window
//! pooling, sparse attention and the indexer's top-k.

use super::*;

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

/// The mHC entry (see `DeepSeekV4Ops::hc_pre`): `(collapsed [T, D], Some((post [T, n], comb [T, n·n])))`.
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

/// Softmax-gated window pooling (see `DeepSeekV4Ops::compress_pool`).
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

/// The indexer's selection (see `DeepSeekV4Ops::index_top_k`), with the scores for tie checks.
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
