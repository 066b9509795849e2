//! The reference of Inkling's ops: relative-position attention and the sink router.

use super::*;

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
