//! The CPU backend's row operations: RMSNorm, GELU-tanh, tanh, softmax, top-k, causal attention
//! over the KV cache, the causal conv and the gated delta rule. The quantized products are in
//! `mference-kernels`.

use std::sync::Mutex;

use mference_kernels::{Kernels, ThreadPool};
use mference_runtime::{KvLayer, KvRow};

use crate::{Act, AttnShape, DeltaShape, LogScaling, Norm};

/// `x ← x · rsqrt(mean(x²) + eps) · s` over each `dim` piece of `x` (mlx `fast.rms_norm`), `s` as
/// [`Norm`] says; weights (`dim` of them) are read from `buf` (the resident bytes). The sum of
/// squares is the kernel table's dot product (SIMD partial sums).
pub fn rms_norm(k: &Kernels, x: &mut [f32], dim: usize, norm: Norm, buf: &[u8], eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let ms = k.dot_f32(row, row) / dim as f32;
        let r = 1.0 / (ms + eps).sqrt();
        match norm {
            Norm::NoScale => row.iter_mut().for_each(|v| *v *= r),
            Norm::Weight(w) => row
                .iter_mut()
                .zip(w.iter(buf).take(dim))
                .for_each(|(v, s)| *v *= r * s),
            Norm::OnePlusWeight(w) => row
                .iter_mut()
                .zip(w.iter(buf).take(dim))
                .for_each(|(v, s)| *v *= r * (1.0 + s)),
            Norm::Scaled(c) => {
                let r = c / (ms + eps).sqrt();
                row.iter_mut().for_each(|v| *v *= r)
            }
        }
    }
}

/// GELU with the tanh approximation (`gelu_pytorch_tanh`, mlx `nn.gelu_approx`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/π)
    0.5 * x * (1.0 + tanh(C * (x + 0.044715 * x * x * x)))
}

/// `g ← act(g) ⊙ u`, the gated activation of a GLU MLP (`g` the gate projection, `u` the up).
pub fn glu(act: Act, g: &mut [f32], u: &[f32]) {
    match act {
        Act::GeluTanh => g
            .iter_mut()
            .zip(u)
            .for_each(|(a, b)| *a = gelu_tanh(*a) * b),
        Act::Silu => g.iter_mut().zip(u).for_each(|(a, b)| *a = silu(*a) * b),
        Act::SiluClamped(l) => g
            .iter_mut()
            .zip(u)
            .for_each(|(a, b)| *a = silu(a.min(l)) * b.clamp(-l, l)),
    }
}

/// `c · tanh(z / c)` on every logit (Gemma's final logit softcap).
pub fn softcap(logits: &mut [f32], c: f32) {
    logits.iter_mut().for_each(|z| *z = c * tanh(*z / c));
}

/// tanh in f32 without a libm call, so loops over slices vectorize: within 2 ulp of the exact
/// value for |x| >= 0.5 and within 1e-7 absolute below (tested against f64 `tanh`). NaN stays NaN.
///
/// |x| < 0.5: the odd Taylor series to x^15 (truncation < 5e-9). Otherwise
/// `1 - 2 / (e^{2|x|} + 1)` with the sign restored, |x| clamped at 10 (where tanh rounds to 1), and
/// `e^y = 2^n · e^r` by Cody-Waite reduction (`r = y - n·ln 2`, |r| <= ln 2 / 2) and a degree-7
/// Taylor polynomial for `e^r` (truncation < 2e-8).
#[inline]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    // Small |x|: Horner in x² over the series coefficients (Bernoulli numbers).
    let z = x * x;
    let p = -0.001_455_834_4_f32; // -929569/638512875
    let p = p * z + 0.003_592_128; // 21844/6081075
    let p = p * z - 0.008_863_235; // -1382/155925
    let p = p * z + 0.021_869_488; // 62/2835
    let p = p * z - 0.053_968_254; // -17/315
    let p = p * z + 0.133_333_33; // 2/15
    let p = p * z - 0.333_333_34; // -1/3
    let small = x + x * z * p;
    // Large |x|.
    let y = 2.0 * a.min(10.0);
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let n = (y * LOG2E + MAGIC) - MAGIC;
    let r = (y - n * LN2_HI) - n * LN2_LO;
    let e = 1.0 / 5040.0;
    let e = e * r + 1.0 / 720.0;
    let e = e * r + 1.0 / 120.0;
    let e = e * r + 1.0 / 24.0;
    let e = e * r + 1.0 / 6.0;
    let e = e * r + 0.5;
    let e = e * r + 1.0;
    let e = e * r + 1.0;
    let exp = e * f32::from_bits(((n as i32 + 127) as u32) << 23);
    let large = (1.0 - 2.0 / (exp + 1.0)).copysign(x);
    if a < 0.5 {
        small
    } else if a.is_nan() {
        x
    } else {
        large
    }
}

/// Indices of the `k` largest values (ties to the lower index), largest first.
pub fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// In-place softmax.
pub fn softmax(v: &mut [f32]) {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut z = 0.0;
    for x in v.iter_mut() {
        *x = (*x - m).exp();
        z += *x;
    }
    v.iter_mut().for_each(|x| *x /= z);
}

/// A relative-position bias over host slices ([`crate::RelBias`]): `rel` `[t, n_heads, d_rel]`,
/// `proj` `[d_rel, extent]`.
pub struct RelSlices<'a> {
    pub rel: &'a [f32],
    pub proj: &'a [f32],
    pub d_rel: usize,
    pub extent: usize,
    pub log_scaling: Option<LogScaling>,
}

/// Runs `f(scratch, item, out_item)` for every item of `out` (`item_len` values each) over the
/// worker pool: the items in one contiguous run per worker (at most one item per worker), each
/// worker with its own `scratch` (`S::default()`). The results depend only on `f`, never on the
/// thread count.
pub(crate) fn par_items<S: Default>(
    pool: &ThreadPool,
    out: &mut [f32],
    item_len: usize,
    f: impl Fn(&mut S, usize, &mut [f32]) + Sync,
) {
    let items = out.len() / item_len;
    let threads = pool.threads().min(items).max(1);
    let per = items.div_ceil(threads);
    let pieces: Vec<Mutex<Option<&mut [f32]>>> = out
        .chunks_mut(per * item_len)
        .map(|c| Mutex::new(Some(c)))
        .collect();
    pool.run(|tid, _| {
        let Some(piece) = pieces.get(tid).and_then(|m| m.lock().ok()?.take()) else {
            return;
        };
        let mut scratch = S::default();
        for (j, o) in piece.chunks_exact_mut(item_len).enumerate() {
            f(&mut scratch, tid * per + j, o);
        }
    });
}

/// Rows attended beside the cache (DeepSeek-V4's compressed entries,
/// [`crate::DeepSeekV4Ops::attention_sparse`]): query row `r` also attends rows `visible[r]` of
/// `rows` (`[N, n_kv_heads·head_dim]`, each both key and value), after its cache positions and in
/// the same softmax.
pub struct Entries<'a> {
    pub rows: &'a [f32],
    pub visible: &'a [Vec<usize>],
}

/// Causal attention for `t` query rows at positions `pos0..pos0+t` against the cache (which already
/// holds those rows): `out[t, n_heads·head_dim] = softmax(q·kᵀ·scale) v`, GQA by `n_heads / n_kv_heads`;
/// with `rel`, the cache positions' logits are `τ_p · (q·kᵀ·scale + bias)`
/// ([`crate::InklingOps::attention_rel`]); with `entries`, each row's entries join the softmax.
///
/// Work items are (row, KV head) pairs, so the query heads that share a KV head read (and convert)
/// its rows once ([`Kernels::dots_f16_group`], [`Kernels::wsum_f16_group`]); per head the result
/// is the one-head computation's, bit for bit. Where those pairs are fewer than the pool's
/// threads (decode: one row, 2 KV heads in Gemma 4's global layers and Qwen 3.6's), each pair's
/// heads are split into equal parts, items of their own: the parts read the KV rows again, and
/// every head's result stays the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    k: &Kernels,
    q: &[f32],
    kv: &KvLayer,
    pos0: usize,
    s: &AttnShape,
    rel: Option<&RelSlices>,
    entries: Option<&Entries>,
    out: &mut [f32],
) {
    let d = s.head_dim;
    let group = s.n_heads / s.n_kv_heads;
    let ew = s.n_kv_heads * d;
    // Items are (row, KV head, part) triples, `parts` parts of `sub` heads per group: the most
    // parts that keep the items within the threads (par_items gives each thread a run of
    // ceil(items / threads) items, so more would only read the KV rows again).
    let pairs = out.len() / (group * d);
    let parts = (1..=group)
        .rev()
        .find(|&p| group.is_multiple_of(p) && pairs * p <= pool.threads())
        .unwrap_or(1);
    let sub = group / parts;
    par_items(pool, out, sub * d, |scores: &mut Vec<f32>, item, o| {
        let (pair, part) = (item / parts, item % parts);
        let (row, kvh) = (pair / s.n_kv_heads, pair % s.n_kv_heads);
        // The part's first (row, head) item; its heads are contiguous in q and out.
        let first = row * s.n_heads + kvh * group + part * sub;
        let p = pos0 + row;
        let lo = s.window.map_or(0, |w| (p + 1).saturating_sub(w));
        let sel: &[usize] = entries.map_or(&[], |e| &e.visible[row]);
        let entry = |e: usize| &entries.expect("selected").rows[e * ew + kvh * d..][..d];
        // Cache positions, then the row's entries: head h's scores at h · n ..
        let (n_kv, n) = (p + 1 - lo, p + 1 - lo + sel.len());
        let qg = &q[first * d..(first + sub) * d];
        // q·K over the positions, run by run: scores[h · n + i] for head h of the group.
        let stride = kv.row_stride();
        scores.clear();
        scores.resize(sub * n, 0.0);
        let mut i0 = 0;
        for (count, run) in kv.k_runs(lo, p, kvh) {
            match run {
                KvRow::F16(r) => k.dots_f16_group(qg, sub, r, stride, count, &mut scores[i0..], n),
                KvRow::F32(r) => {
                    for h in 0..sub {
                        let qh = &qg[h * d..(h + 1) * d];
                        for i in 0..count {
                            let ki = &r[i * stride..i * stride + d];
                            scores[h * n + i0 + i] = k.dot_f32(qh, ki);
                        }
                    }
                }
            }
            i0 += count;
        }
        for h in 0..sub {
            let qh = &qg[h * d..(h + 1) * d];
            for (j, &e) in sel.iter().enumerate() {
                scores[h * n + n_kv + j] = k.dot_f32(qh, entry(e));
            }
        }
        for (h, sc) in scores.chunks_exact_mut(n).enumerate() {
            sc.iter_mut().for_each(|x| *x *= s.scale);
            if let Some(rb) = rel {
                add_rel_bias(&mut sc[..n_kv], rb, first + h, p);
            }
            match &s.sinks {
                None => softmax(sc),
                Some(sinks) => softmax_with_sink(sc, sinks[kvh * group + part * sub + h]),
            }
        }
        o.fill(0.0);
        // Σ w·V over the positions, in order, run by run.
        let mut i0 = 0;
        for (count, run) in kv.v_runs(lo, p, kvh) {
            match run {
                KvRow::F16(r) => k.wsum_f16_group(&scores[i0..], n, count, r, stride, o, sub),
                KvRow::F32(r) => {
                    for (h, oh) in o.chunks_exact_mut(d).enumerate() {
                        for i in 0..count {
                            let wi = scores[h * n + i0 + i];
                            k.axpy(wi, &r[i * stride..i * stride + d], oh);
                        }
                    }
                }
            }
            i0 += count;
        }
        for (h, oh) in o.chunks_exact_mut(d).enumerate() {
            for (j, &e) in sel.iter().enumerate() {
                k.axpy(scores[h * n + n_kv + j], entry(e), oh);
            }
        }
    });
}

/// Adds the relative-position bias of query item `item` (row · n_heads + head) at position `p` to
/// its scores over keys `p + 1 − scores.len() ..= p`, then applies the log position scale.
fn add_rel_bias(scores: &mut [f32], rb: &RelSlices, item: usize, p: usize) {
    let (d_rel, extent) = (rb.d_rel, rb.extent);
    let coef = &rb.rel[item * d_rel..(item + 1) * d_rel];
    let n = scores.len();
    // Distance p − key runs from n − 1 (first score) down to 0 (the query's own key).
    for dist in 0..n.min(extent) {
        let b: f32 = coef
            .iter()
            .enumerate()
            .map(|(j, c)| c * rb.proj[j * extent + dist])
            .sum();
        scores[n - 1 - dist] += b;
    }
    if let Some(ls) = rb.log_scaling {
        let tau = ls.tau(p);
        scores.iter_mut().for_each(|x| *x *= tau);
    }
}

/// Softmax of `v` with one extra logit `sink` in the denominator (its probability is dropped).
pub(crate) fn softmax_with_sink(v: &mut [f32], sink: f32) {
    let m = v.iter().copied().fold(sink, f32::max);
    let mut z = (sink - m).exp();
    for x in v.iter_mut() {
        *x = (*x - m).exp();
        z += *x;
    }
    v.iter_mut().for_each(|x| *x /= z);
}

/// SiLU, `x · sigmoid(x)` (mlx `nn.silu`).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(sigmoid(x)) = min(x, 0) − log1p(e^−|x|)` (torch `F.logsigmoid`).
#[inline]
pub fn log_sigmoid(x: f32) -> f32 {
    x.min(0.0) - (-x.abs()).exp().ln_1p()
}

/// `log(1 + e^x)`, computed as mlx's `nn.softplus` (`logaddexp(x, 0)`): `max(x, 0) + log1p(e^-|x|)`.
#[inline]
pub fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Depthwise causal 1-D convolution followed by the activation `act`, continuing from a rolling
/// state: SiLU for Gated DeltaNet's `conv1d` (mlx-lm
/// `qwen3_5.py` `GatedDeltaNet.__call__`), the identity for Inkling's short convolutions
/// (transformers `modeling_inkling.py`).
///
/// - `x`: `[t, channels]` pre-conv rows; `out`: `[t, channels]`.
/// - `w`: `[channels, kernel]` (the MLX `[C, K, 1]` weight); output row `r` of channel `c` is
///   `act(Σ_j w[c, j] · in[r + j])` over the sequence `in = state ++ x` (cross-correlation, no flip).
/// - `state`: `[kernel - 1, channels]`, the last `kernel - 1` pre-conv rows seen (zeros at the start);
///   updated to the last `kernel - 1` rows of `state ++ x`.
pub fn causal_conv1d(
    x: &[f32],
    state: &mut [f32],
    w: &[f32],
    channels: usize,
    kernel: usize,
    out: &mut [f32],
    act: impl Fn(f32) -> f32,
) {
    let keep = kernel - 1;
    let t = x.len() / channels;
    let mut seq = Vec::with_capacity((keep + t) * channels);
    seq.extend_from_slice(state);
    seq.extend_from_slice(x);
    for r in 0..t {
        let o = &mut out[r * channels..(r + 1) * channels];
        for (c, oc) in o.iter_mut().enumerate() {
            let wc = &w[c * kernel..(c + 1) * kernel];
            let mut acc = 0.0f32;
            for (j, wj) in wc.iter().enumerate() {
                acc += wj * seq[(r + j) * channels + c];
            }
            *oc = act(acc);
        }
    }
    state.copy_from_slice(&seq[t * channels..]);
}

/// The gated delta rule recurrence over `t` rows (mlx-lm `gated_delta.py::_gated_delta_step_ops`),
/// one value head per work item, in FP32:
///
/// ```text
/// S ← g·S;  u = (v − S·k)·β;  S ← S + u ⊗ k;  o = S·q
/// ```
///
/// - `q`, `k`: `[t, n_k_heads, head_k_dim]` (already L2-normalised; q carries the `head_k_dim^-0.5`);
///   value head `h` reads key head `h / (n_v_heads / n_k_heads)`.
/// - `v`: `[t, n_v_heads, head_v_dim]`; `g` (the decay `exp(log-decay)`), `beta`: `[t, n_v_heads]`.
/// - `state`: `[n_v_heads, head_v_dim, head_k_dim]` (mlx's `[B, Hv, Dv, Dk]` layout), carried across calls.
/// - `out`: `[t, n_v_heads, head_v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_rule(
    pool: &ThreadPool,
    kern: &Kernels,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    s: &DeltaShape,
    out: &mut [f32],
) {
    let (nk, nv, dk, dv) = (s.n_k_heads, s.n_v_heads, s.head_k_dim, s.head_v_dim);
    let t = g.len() / nv;
    let rep = nv / nk;
    let threads = pool.threads().min(nv).max(1);
    let per = nv.div_ceil(threads);
    // Each work piece owns a run of value heads: their states and a head-major output.
    let mut head_out = vec![0.0f32; nv * t * dv];
    type Piece<'a> = Mutex<Option<(&'a mut [f32], &'a mut [f32])>>;
    let pieces: Vec<Piece> = state
        .chunks_mut(per * dv * dk)
        .zip(head_out.chunks_mut(per * t * dv))
        .map(|p| Mutex::new(Some(p)))
        .collect();
    pool.run(|tid, _n| {
        let Some((st, ho)) = pieces.get(tid).and_then(|m| m.lock().ok()?.take()) else {
            return;
        };
        for (j, (sh, oh)) in st
            .chunks_exact_mut(dv * dk)
            .zip(ho.chunks_exact_mut(t * dv))
            .enumerate()
        {
            let h = tid * per + j;
            let kh = h / rep;
            for r in 0..t {
                let qr = &q[(r * nk + kh) * dk..(r * nk + kh + 1) * dk];
                let kr = &k[(r * nk + kh) * dk..(r * nk + kh + 1) * dk];
                let vr = &v[(r * nv + h) * dv..(r * nv + h + 1) * dv];
                let (gr, br) = (g[r * nv + h], beta[r * nv + h]);
                let o = &mut oh[r * dv..(r + 1) * dv];
                for (i, row) in sh.chunks_exact_mut(dk).enumerate() {
                    row.iter_mut().for_each(|x| *x *= gr);
                    let delta = (vr[i] - kern.dot_f32(row, kr)) * br;
                    kern.axpy(delta, kr, row);
                    o[i] = kern.dot_f32(row, qr);
                }
            }
        }
    });
    for h in 0..nv {
        for r in 0..t {
            out[(r * nv + h) * dv..(r * nv + h + 1) * dv]
                .copy_from_slice(&head_out[(h * t + r) * dv..(h * t + r + 1) * dv]);
        }
    }
}

/// `y[T, n] = x[T, c] · wᵀ` for `w` `[n, c]`.
pub fn linear(pool: &ThreadPool, k: &Kernels, x: &[f32], w: &[f32], c: usize) -> Vec<f32> {
    let (t, n) = (x.len() / c, w.len() / c);
    let mut y = vec![0.0f32; t * n];
    par_items(pool, &mut y, n, |_: &mut (), r, yr| {
        let xr = &x[r * c..(r + 1) * c];
        for (o, wr) in yr.iter_mut().zip(w.chunks_exact(c)) {
            *o = k.dot_f32(xr, wr);
        }
    });
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64 `tanh` (libm): every f32 on a dense grid over [-12, 12] plus the edges.
    #[test]
    fn tanh_matches_f64_tanh() {
        let mut worst = (0.0f64, 0.0f32);
        let grid = (-120_000..=120_000).map(|i| i as f32 * 1e-4);
        let edges = [
            0.0f32, -0.0, 1e-30, -1e-7, 0.4999999, 0.5, 0.5000001, 8.99, 9.0, 30.0, -1e4,
        ];
        for x in grid.chain(edges) {
            let want = (x as f64).tanh();
            let got = tanh(x) as f64;
            let err = (got - want).abs();
            let budget = if x.abs() < 0.5 {
                1e-7
            } else {
                2.0 * f32::EPSILON as f64 * want.abs()
            };
            assert!(err <= budget, "tanh({x}) = {got}, f64 says {want}");
            if err > worst.0 {
                worst = (err, x);
            }
        }
        assert!(tanh(f32::NAN).is_nan());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        eprintln!("worst |error| {:.2e} at {}", worst.0, worst.1);
    }

    #[test]
    fn gelu_and_softcap_follow_their_definitions() {
        for i in -2000..=2000 {
            let x = i as f32 * 5e-3;
            let xd = x as f64;
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let want = 0.5 * xd * (1.0 + (c * (xd + 0.044715 * xd * xd * xd)).tanh());
            assert!(
                (gelu_tanh(x) as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "gelu({x})"
            );
        }
        let mut z: Vec<f32> = (-100..=100).map(|i| i as f32 * 0.7).collect();
        let want: Vec<f64> = z.iter().map(|&v| 30.0 * (v as f64 / 30.0).tanh()).collect();
        softcap(&mut z, 30.0);
        for (g, w) in z.iter().zip(&want) {
            assert!((*g as f64 - w).abs() <= 4e-6, "softcap {g} vs {w}");
        }
    }
}
