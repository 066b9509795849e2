//! Attention helpers (f32 dot/axpy, f16 KV conversions and products): SIMD tables against the scalar twins.

mod common;

use common::Rng;
use mference_kernels::{f16, Kernels};

/// f32 dot/axpy (and f16-row products) vs the scalar twin: error relative to `Σ |a_i b_i|`.
const DOT_REL: f32 = 1e-5;

fn lengths() -> impl Iterator<Item = usize> {
    [
        0usize, 1, 3, 7, 8, 15, 16, 17, 31, 33, 64, 127, 128, 129, 256, 300, 1000,
    ]
    .into_iter()
}

#[test]
fn dot_and_axpy_match_scalar() {
    let mut rng = Rng::new(3);
    let sc = Kernels::scalar();
    for len in lengths() {
        let a = rng.vec_sym(len, 2.0);
        let b = rng.vec_sym(len, 2.0);
        let mag: f32 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x * y).abs())
            .sum::<f32>()
            .max(1e-30);
        for k in Kernels::available() {
            let d = k.dot_f32(&a, &b);
            let e = (d - sc.dot_f32(&a, &b)).abs() / mag;
            assert!(e <= DOT_REL, "{} dot_f32 len {len}: {e:e}", k.name());
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            k.axpy(0.37, &a, &mut y1);
            sc.axpy(0.37, &a, &mut y2);
            for (u, v) in y1.iter().zip(&y2) {
                // One fused or unfused multiply-add per element: at most one rounding apart.
                assert!(
                    (u - v).abs() <= 1e-6 * (v.abs() + 1.0),
                    "{} axpy len {len}",
                    k.name()
                );
            }
        }
    }
}

#[test]
fn f16_conversions_are_bit_exact() {
    let mut rng = Rng::new(5);
    let mut src: Vec<f32> = (0..1000)
        .map(|_| rng.sym(70000.0) * rng.unit().powi(6))
        .collect();
    src.extend([
        0.0,
        -0.0,
        1e-8,
        -6.0e-5,
        65504.0,
        65520.0,
        1e6,
        f32::INFINITY,
        f32::NEG_INFINITY,
        5.9604645e-8,
    ]);
    for k in Kernels::available() {
        for len in [0, 1, 7, 8, 9, 16, 17, src.len()] {
            let mut h = vec![f16::ZERO; len];
            k.f32_to_f16(&src[..len], &mut h);
            for (i, (&got, &s)) in h.iter().zip(&src[..len]).enumerate() {
                assert_eq!(
                    got.to_bits(),
                    f16::from_f32(s).to_bits(),
                    "{} f32_to_f16 [{i}] = {s}",
                    k.name()
                );
            }
            let mut back = vec![0.0f32; len];
            k.f16_to_f32(&h, &mut back);
            for (&b, &hv) in back.iter().zip(&h) {
                assert_eq!(
                    b.to_bits(),
                    hv.to_f32().to_bits(),
                    "{} f16_to_f32",
                    k.name()
                );
            }
        }
        let mut h = [f16::ZERO; 1];
        k.f32_to_f16(&[f32::NAN], &mut h);
        assert!(h[0].is_nan(), "{} NaN stays NaN", k.name());
    }
}

#[test]
fn f16_dot_and_axpy_match_scalar() {
    let mut rng = Rng::new(9);
    let sc = Kernels::scalar();
    for len in lengths() {
        let q = rng.vec_sym(len, 3.0);
        let kv: Vec<f16> = (0..len).map(|_| f16::from_f32(rng.sym(4.0))).collect();
        let mag: f32 = q
            .iter()
            .zip(&kv)
            .map(|(a, b)| (a * b.to_f32()).abs())
            .sum::<f32>()
            .max(1e-30);
        for k in Kernels::available() {
            let e = (k.dot_f16(&q, &kv) - sc.dot_f16(&q, &kv)).abs() / mag;
            assert!(e <= DOT_REL, "{} dot_f16 len {len}: {e:e}", k.name());
            let mut y1 = q.clone();
            let mut y2 = q.clone();
            k.axpy_f16(-1.25, &kv, &mut y1);
            sc.axpy_f16(-1.25, &kv, &mut y2);
            for (u, v) in y1.iter().zip(&y2) {
                assert!(
                    (u - v).abs() <= 1e-6 * (v.abs() + 1.0),
                    "{} axpy_f16 len {len}",
                    k.name()
                );
            }
        }
    }
}

/// The bit patterns, for exact comparisons that treat -0.0 and NaN payloads as different values.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `n` random f16 rows of width `d`, `stride` (d, d + 16 or d + 32) apart: (stride, storage).
fn strided_rows(rng: &mut Rng, n: usize, d: usize) -> (usize, Vec<f16>) {
    let stride = d + 16 * rng.below(3);
    let rows = rng
        .vec_sym((n.max(1) - 1) * stride + d, 2.0)
        .iter()
        .map(|&v| f16::from_f32(v))
        .collect();
    (stride, rows)
}

/// The weighted sum of f16 rows equals, bit for bit, one `axpy_f16` per row in order on the same
/// table (register blocking must not change any element's sequence of fused multiply-adds), for
/// head widths with and without a 16-column tail, strides wider than the row, and 0..40 rows.
#[test]
fn wsum_f16_equals_axpy_f16_row_by_row() {
    let mut rng = Rng::new(11);
    for k in Kernels::available() {
        for d in [16usize, 100, 128, 256, 384, 512, 520] {
            for n in [0usize, 1, 2, 7, 40] {
                let (stride, rows) = strided_rows(&mut rng, n, d);
                let w = rng.vec_sym(n, 1.0);
                let start = rng.vec_sym(d, 1.0);
                let mut want = start.clone();
                for (i, &wi) in w.iter().enumerate() {
                    k.axpy_f16(wi, &rows[i * stride..i * stride + d], &mut want);
                }
                let mut got = start.clone();
                k.wsum_f16(&w, &rows, stride, &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{} d {d} n {n} stride {stride}: wsum differs from axpy row by row",
                    k.name()
                );
            }
        }
    }
}

/// Scores against strided f16 rows equal one `dot_f16` per row on the same table, bit for bit.
#[test]
fn dots_f16_equal_dot_f16_row_by_row() {
    let mut rng = Rng::new(12);
    for k in Kernels::available() {
        for d in [16usize, 100, 128, 256, 512] {
            for n in [0usize, 1, 3, 40] {
                let (stride, rows) = strided_rows(&mut rng, n, d);
                let q = rng.vec_sym(d, 1.0);
                let want: Vec<f32> = (0..n)
                    .map(|i| k.dot_f16(&q, &rows[i * stride..i * stride + d]))
                    .collect();
                let mut got = vec![f32::NAN; n];
                k.dots_f16(&q, &rows, stride, &mut got);
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{} d {d} n {n} stride {stride}: dots differ from dot_f16 row by row",
                    k.name()
                );
            }
        }
    }
}

/// Scores of g queries at once equal one `dots_f16` per query on the same table, bit for bit,
/// and the f64 dot products within `DOT_REL` of `Σ |q_i k_i|`.
#[test]
fn dots_f16_group_equals_dots_f16_per_query() {
    let mut rng = Rng::new(13);
    for k in Kernels::available() {
        for d in [16usize, 64, 100, 256, 512] {
            for g in [1usize, 2, 3, 8, 9] {
                for n in [0usize, 1, 5, 40] {
                    let (stride, rows) = strided_rows(&mut rng, n, d);
                    let q = rng.vec_sym(g * d, 1.0);
                    let ld = n + rng.below(3);
                    let mut want = vec![f32::NAN; g * ld];
                    for h in 0..g {
                        let o = &mut want[h * ld..h * ld + n];
                        k.dots_f16(&q[h * d..(h + 1) * d], &rows, stride, o);
                    }
                    let mut got = vec![f32::NAN; g * ld];
                    k.dots_f16_group(&q, g, &rows, stride, n, &mut got, ld);
                    let what = format!("{} d {d} g {g} n {n} stride {stride} ld {ld}", k.name());
                    assert_eq!(bits(&got), bits(&want), "{what}: differs from dots_f16");
                    for h in 0..g {
                        for i in 0..n {
                            let (qh, r) = (&q[h * d..(h + 1) * d], &rows[i * stride..][..d]);
                            let exact: f64 =
                                qh.iter().zip(r).map(|(a, b)| *a as f64 * b.to_f64()).sum();
                            let mag: f64 = qh
                                .iter()
                                .zip(r)
                                .map(|(a, b)| (*a as f64 * b.to_f64()).abs())
                                .sum();
                            let e = (got[h * ld + i] as f64 - exact).abs() / mag.max(1e-30);
                            assert!(e <= DOT_REL as f64, "{what}: {e:e} from f64");
                        }
                    }
                }
            }
        }
    }
}

/// Weighted sums into g outputs at once equal one `wsum_f16` per output on the same table, bit
/// for bit, and the f64 sums within `DOT_REL` of `|start| + Σ |w_i v_i|`.
#[test]
fn wsum_f16_group_equals_wsum_f16_per_output() {
    let mut rng = Rng::new(14);
    for k in Kernels::available() {
        for d in [16usize, 100, 128, 256, 512, 520] {
            for g in [1usize, 2, 3, 5, 8, 9] {
                for n in [0usize, 1, 7, 40] {
                    let (stride, rows) = strided_rows(&mut rng, n, d);
                    let ld = n + rng.below(3);
                    let w = rng.vec_sym(g * ld.max(1), 1.0);
                    let start = rng.vec_sym(g * d, 1.0);
                    let mut want = start.clone();
                    for h in 0..g {
                        let o = &mut want[h * d..(h + 1) * d];
                        k.wsum_f16(&w[h * ld..h * ld + n], &rows, stride, o);
                    }
                    let mut got = start.clone();
                    k.wsum_f16_group(&w, ld, n, &rows, stride, &mut got, g);
                    let what = format!("{} d {d} g {g} n {n} stride {stride} ld {ld}", k.name());
                    assert_eq!(bits(&got), bits(&want), "{what}: differs from wsum_f16");
                    for h in 0..g {
                        for c in 0..d {
                            let s0 = start[h * d + c] as f64;
                            let terms = (0..n)
                                .map(|i| w[h * ld + i] as f64 * rows[i * stride + c].to_f64());
                            let (exact, mag) =
                                terms.fold((s0, s0.abs()), |(e, m), t| (e + t, m + t.abs()));
                            let e = (got[h * d + c] as f64 - exact).abs() / mag.max(1e-30);
                            assert!(e <= DOT_REL as f64, "{what}: {e:e} from f64");
                        }
                    }
                }
            }
        }
    }
}
