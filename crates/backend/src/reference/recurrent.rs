//! The reference of the recurrent ops: the causal convolutions, DeltaNet's gates and delta rule.

use super::*;

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
