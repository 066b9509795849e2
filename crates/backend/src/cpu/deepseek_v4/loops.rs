//! CPU bodies of DeepSeek-V4's ops (`DeepSeekV4Ops::{hc_pre, hc_post, compress_pool,
//! index_top_k}`): plain f32 loops over host slices (the indexer's dot products come from the
//! backend's `linear`). `attention_sparse` is the CPU attention with entries
//! (`cpu::ops::attention`).

use crate::cpu::ops::{sigmoid, softmax};
use crate::HcSpec;

/// `pre`, and `(post, comb)` for a site that mixes the streams.
type HcWeights = (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>);

/// The mHC entry of one row: `mixes` (`f · rms(x)`, `rows_f` values) → `pre`, and with
/// `rows_f = (2 + n)·n` also `post` and the Sinkhorn-normalised comb matrix.
pub fn hc_weights(mixes: &[f32], base: &[f32], scale: &[f32], s: &HcSpec) -> HcWeights {
    let n = s.streams;
    let pre: Vec<f32> = (0..n)
        .map(|j| sigmoid(mixes[j] * scale[0] + base[j]) + s.hc_eps)
        .collect();
    if mixes.len() == n {
        return (pre, None);
    }
    let post: Vec<f32> = (0..n)
        .map(|j| 2.0 * sigmoid(mixes[n + j] * scale[1] + base[n + j]))
        .collect();
    let mut c: Vec<f32> = (0..n * n)
        .map(|i| mixes[2 * n + i] * scale[2] + base[2 * n + i])
        .collect();
    for row in c.chunks_exact_mut(n) {
        softmax(row);
        row.iter_mut().for_each(|v| *v += s.hc_eps);
    }
    let cols = |c: &mut [f32]| {
        for k in 0..n {
            let z: f32 = (0..n).map(|j| c[j * n + k]).sum::<f32>() + s.hc_eps;
            (0..n).for_each(|j| c[j * n + k] /= z);
        }
    };
    cols(&mut c);
    for _ in 1..s.sinkhorn_iters {
        for row in c.chunks_exact_mut(n) {
            let z: f32 = row.iter().sum::<f32>() + s.hc_eps;
            row.iter_mut().for_each(|v| *v /= z);
        }
        cols(&mut c);
    }
    (pre, Some((post, c)))
}

/// The weightless RMSNorm of one row (f32, as the reference computes it).
pub fn rms(x: &[f32], eps: f32) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().map(|v| v * r).collect()
}

/// Softmax-gated pooling (see `Backend::compress_pool`); `prior` is `(kv, gate)` `[rate, d]`.
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
    let mut out = vec![0.0f32; n_win * d];
    // Slots of entry w, channel c: (kv, gate with ape) pairs.
    let mut slots: Vec<(f32, f32)> = Vec::with_capacity(2 * rate);
    for w in 0..n_win {
        for c in 0..d {
            slots.clear();
            if overlap {
                for i in 0..rate {
                    if w > 0 {
                        let r = (w - 1) * rate + i;
                        slots.push((kv[r * width + c], gate[r * width + c] + ape[i * width + c]));
                    } else if let Some((pk, pg)) = prior {
                        slots.push((pk[i * d + c], pg[i * d + c]));
                    }
                }
            }
            let off = if overlap { d } else { 0 };
            for i in 0..rate {
                let r = w * rate + i;
                slots.push((
                    kv[r * width + off + c],
                    gate[r * width + off + c] + ape[i * width + off + c],
                ));
            }
            let m = slots.iter().fold(f32::NEG_INFINITY, |m, s| m.max(s.1));
            let z: f32 = slots.iter().map(|s| (s.1 - m).exp()).sum();
            out[w * d + c] = slots.iter().map(|s| s.0 * ((s.1 - m).exp() / z)).sum();
        }
    }
    out
}

/// The indexer's top-k per row (see `Backend::index_top_k`) from `dots` (`[rows · n_heads, n_keys]`:
/// each head's query against every key, the backend's `linear`): a key's score is the sum over
/// heads of `weights · max(dot, 0)`, over the row's visible keys.
pub fn index_top_k(
    dots: &[f32],
    n_keys: usize,
    weights: &[f32],
    n_heads: usize,
    visible: &[usize],
    top_k: usize,
) -> Vec<Vec<usize>> {
    visible
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            let wr = &weights[r * n_heads..(r + 1) * n_heads];
            let scores: Vec<f32> = (0..n)
                .map(|e| {
                    (0..n_heads)
                        .map(|h| wr[h] * dots[(r * n_heads + h) * n_keys + e].max(0.0))
                        .sum()
                })
                .collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            order.truncate(top_k.min(n));
            order.sort_unstable();
            order
        })
        .collect()
}
