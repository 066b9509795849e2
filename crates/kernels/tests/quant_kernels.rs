//! Quantized GEMV/GEMM: the scalar reference against an independent f64 dequantize-then-matmul, and every
//! SIMD table (and the thread pool) against the scalar reference, on random shapes (rows not a multiple of
//! anything, cols a multiple of the group size), bits 2, 4 and 8, groups 32/64/128, negative scales, and
//! tensors that start at odd 2-byte-aligned (and unaligned) byte offsets; and, on every table that claims
//! it, batch invariance: a token's GEMM row is bit-identical to its GEMV and to the GEMM of any other batch. The budgets below hold for every bit
//! width: the measure is relative to the sum of absolute terms, whatever the code range.

mod common;

use common::{max_rel_err, naive_gemm, OwnedQ, Rng};
use mference_kernels::{Kernels, MatJob, PairJob, ThreadPool};
use proptest::prelude::*;

/// Scalar f32 reference vs exact f64: error relative to `Σ (|scale|·q + |bias|)·|x|` (see `naive_gemm`).
/// Observed maxima are ~2.5e-7 (a few f32 ulps of the magnitude); the budget leaves ~15x headroom and is
/// still below the worst-case bound for a 128-term f32 sum (~7.6e-6).
const SCALAR_VS_F64_REL: f64 = 4e-6;
/// Any f32 SIMD table vs the scalar reference, same relative measure (different summation orders only).
const SIMD_VS_SCALAR_REL: f64 = 4e-6;
/// The `avx512vnni` table (int8 activations per group in its 4-bit GEMM) vs the scalar reference, same
/// measure. Rounding x to 127 levels of its group's max|x| moves each term by at most max|x|/254.
const Q8_VS_SCALAR_REL: f64 = 3e-2;

/// The `avx512i16` table (int16 activations per group in its 4-bit products) vs the scalar reference,
/// same measure: x moves by at most max|x| / 65534 of its group, 258x less than with int8.
const Q16_VS_SCALAR_REL: f64 = 2e-4;

fn budget(k: &Kernels) -> f64 {
    match k.name() {
        _ if k.is_exact() => SIMD_VS_SCALAR_REL,
        _ if k.rounding() == Some("int16 activations") => Q16_VS_SCALAR_REL,
        _ => Q8_VS_SCALAR_REL,
    }
}

/// Activations: uniform ±1 with a few ×16 outliers (like real residual streams).
fn activations(rng: &mut Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| {
            let v = rng.sym(1.0);
            if rng.below(64) == 0 {
                v * 16.0
            } else {
                v
            }
        })
        .collect()
}

struct Case {
    seed: u64,
    rows: usize,
    cols: usize,
    bits: u32,
    gs: usize,
    offset: usize,
    n: usize,
}

fn check(c: &Case, pools: &[ThreadPool]) {
    let mut rng = Rng::new(c.seed);
    let q = OwnedQ::random(&mut rng, c.rows, c.cols, c.bits, c.gs, c.offset);
    let m = q.view();
    let x = activations(&mut rng, c.n * c.cols);
    let (want, scale) = naive_gemm(&m, &x, c.n);
    let tag = format!(
        "seed {} rows {} cols {} bits {} group {} offset {} n {}",
        c.seed, c.rows, c.cols, c.bits, c.gs, c.offset, c.n
    );

    let sc = Kernels::scalar();
    let mut ys = vec![0.0f32; c.n * c.rows];
    sc.gemm(&m, &x, c.n, &mut ys);
    let e = max_rel_err(&ys, &want, &scale);
    assert!(
        e <= SCALAR_VS_F64_REL,
        "scalar gemm vs f64: rel err {e:e} > budget ({tag})"
    );

    for k in Kernels::available() {
        let name = k.name();
        // gemv, token by token.
        let mut yv = vec![0.0f32; c.n * c.rows];
        for t in 0..c.n {
            k.gemv(
                &m,
                &x[t * c.cols..(t + 1) * c.cols],
                &mut yv[t * c.rows..(t + 1) * c.rows],
            );
        }
        let ysf: Vec<f64> = ys.iter().map(|&v| v as f64).collect();
        let e = max_rel_err(&yv, &ysf, &scale);
        assert!(
            e <= budget(k),
            "{name} gemv vs scalar: rel err {e:e} > budget ({tag})"
        );

        // gemm for the whole batch.
        let mut yg = vec![0.0f32; c.n * c.rows];
        k.gemm(&m, &x, c.n, &mut yg);
        let e = max_rel_err(&yg, &ysf, &scale);
        assert!(
            e <= budget(k),
            "{name} gemm vs scalar: rel err {e:e} > budget ({tag})"
        );

        // Batch invariance: a token's row of the GEMM is bit-identical to its GEMV (a decode step
        // and any prefill chunk give the same bits), and so is the GEMM of any sub-batch of tokens.
        if k.is_batch_invariant() {
            assert!(
                yg == yv,
                "{name} gemm rows differ from token-by-token gemv ({tag})"
            );
            let (t0, t1) = (c.n / 3, c.n);
            let mut ysub = vec![0.0f32; (t1 - t0) * c.rows];
            k.gemm(&m, &x[t0 * c.cols..t1 * c.cols], t1 - t0, &mut ysub);
            assert!(
                ysub == yv[t0 * c.rows..t1 * c.rows],
                "{name} gemm of tokens [{t0},{t1}) differs from the whole batch's ({tag})"
            );
        }

        // A row sub-range gives bit-identical rows (results do not depend on how rows are split).
        let r0 = rng.below(c.rows);
        let r1 = r0 + 1 + rng.below(c.rows - r0);
        let w = r1 - r0;
        let mut yr = vec![0.0f32; w];
        k.gemv_rows(&m, &x[..c.cols], &mut yr, r0, r1);
        assert_eq!(
            yr,
            yv[r0..r1],
            "{name} gemv_rows [{r0},{r1}) differs from gemv ({tag})"
        );
        let mut ygr = vec![0.0f32; c.n * w];
        k.gemm_rows(&m, &x, c.n, &mut ygr, r0, r1);
        for t in 0..c.n {
            assert_eq!(
                ygr[t * w..(t + 1) * w],
                yg[t * c.rows + r0..t * c.rows + r1],
                "{name} gemm_rows [{r0},{r1}) token {t} differs from gemm ({tag})"
            );
        }

        // The pool splits rows across threads; results are bit-identical to the single-thread kernel.
        for pool in pools {
            let mut yp = vec![0.0f32; c.rows];
            pool.gemv(k, &m, &x[..c.cols], &mut yp);
            assert_eq!(
                yp,
                yv[..c.rows],
                "{name} pool({}) gemv differs ({tag})",
                pool.threads()
            );
            let mut ypg = vec![0.0f32; c.n * c.rows];
            pool.gemm(k, &m, &x, c.n, &mut ypg);
            assert_eq!(
                ypg,
                yg,
                "{name} pool({}) gemm differs ({tag})",
                pool.threads()
            );
        }
    }
}

fn pools() -> Vec<ThreadPool> {
    vec![ThreadPool::new(2), ThreadPool::new(3)]
}

#[test]
fn scalar_and_simd_match_f64_reference_on_fixed_shapes() {
    let pools = pools();
    let mut seed = 1;
    for &(rows, cols, bits, gs) in &[
        (1, 32, 4, 32),
        (7, 64, 4, 64),
        (33, 128, 4, 128),
        (61, 384, 8, 32),
        (45, 640, 8, 64),
        (19, 256, 8, 128),
        (97, 2816, 4, 64), // Gemma-26B gate/up input width
        (37, 704, 4, 64),  // Gemma-26B down input width
        (13, 2816, 8, 64), // 8-bit router
        (3, 32, 2, 32),
        (9, 192, 2, 64),
        (35, 384, 2, 128),
        (19, 4096, 2, 32),  // DeepSeek-V4-Flash routed gate_proj (g32) input width
        (11, 2048, 2, 64),  // DeepSeek-V4-Flash routed down_proj input width
        (29, 2048, 2, 128), // Maple ternary projections
    ] {
        for &offset in &[0usize, 2, 6, 1] {
            for &n in &[1usize, 3, 6, 8] {
                check(
                    &Case {
                        seed,
                        rows,
                        cols,
                        bits,
                        gs,
                        offset,
                        n,
                    },
                    &pools,
                );
                seed += 1;
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn simd_and_pool_match_scalar_on_random_shapes(
        seed in any::<u64>(),
        rows in 1usize..90,
        groups in 1usize..9,
        bits in prop_oneof![Just(2u32), Just(4u32), Just(8u32)],
        gs in prop_oneof![Just(32usize), Just(64usize), Just(128usize)],
        offset in prop_oneof![Just(0usize), Just(2usize), Just(6usize), Just(10usize), Just(1usize)],
        n in 1usize..12,
    ) {
        let pools = vec![ThreadPool::new(2)];
        check(&Case { seed, rows, cols: groups * gs, bits, gs, offset, n }, &pools);
    }
}

#[test]
fn gemm_of_a_long_batch_matches_scalar() {
    // Prefill-sized batch (more tokens than one L2 token block, ragged register tiles) on a real row width.
    check(
        &Case {
            seed: 99,
            rows: 21,
            cols: 2816,
            bits: 4,
            gs: 64,
            offset: 2,
            n: 101,
        },
        &pools(),
    );
    check(
        &Case {
            seed: 100,
            rows: 13,
            cols: 4096,
            bits: 2,
            gs: 32,
            offset: 6,
            n: 101,
        },
        &pools(),
    );
    // DeepSeek-V4-Flash's routed down_proj rows: 2-bit, group 64, input 2048.
    check(
        &Case {
            seed: 101,
            rows: 17,
            cols: 2048,
            bits: 2,
            gs: 64,
            offset: 2,
            n: 37,
        },
        &pools(),
    );
}

#[test]
fn argmax_matches_full_logits_with_and_without_softcap() {
    for (seed, bits, gs) in [(7, 4, 64), (8, 2, 128), (9, 2, 32)] {
        argmax_matches_full_logits(seed, bits, gs);
    }
}

fn argmax_matches_full_logits(seed: u64, bits: u32, gs: usize) {
    let mut rng = Rng::new(seed);
    let q = OwnedQ::random(&mut rng, 1000, 256, bits, gs, 2);
    let m = q.view();
    let x = activations(&mut rng, 256);
    for k in Kernels::available() {
        let mut y = vec![0.0f32; m.rows];
        k.gemv(&m, &x, &mut y);
        let (want_i, want_v) =
            y.iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            );
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            assert_eq!(
                pool.gemv_argmax(k, &m, &x, None),
                (want_i, want_v),
                "{} threads {threads} bits {bits}",
                k.name()
            );
            let (i, v) = pool.gemv_argmax(k, &m, &x, Some(30.0));
            assert_eq!(i, want_i);
            assert!((v - 30.0 * (want_v / 30.0).tanh()).abs() <= 1e-6 * want_v.abs().max(1.0));
        }
    }
}

#[test]
fn argmax_ties_go_to_the_lowest_index() {
    // Two identical rows: both logits are equal bit for bit; the first must win.
    let mut rng = Rng::new(11);
    let q = OwnedQ::random(&mut rng, 300, 128, 8, 32, 0);
    let m0 = q.view();
    let mut y = vec![0.0f32; m0.rows];
    let x = activations(&mut rng, 128);
    Kernels::scalar().gemv(&m0, &x, &mut y);
    let best = y
        .iter()
        .enumerate()
        .fold(0, |b, (i, &v)| if v > y[b] { i } else { b });
    // Copy the best row (codes, scales, biases) over row 299 so two rows tie.
    let rb = m0.row_bytes();
    let gpr = m0.groups_per_row();
    let mut w = m0.weight.to_vec();
    let mut s = m0.scales.to_vec();
    let mut b = m0.biases.to_vec();
    w.copy_within(best * rb..(best + 1) * rb, 299 * rb);
    s.copy_within(best * 2 * gpr..(best + 1) * 2 * gpr, 299 * 2 * gpr);
    b.copy_within(best * 2 * gpr..(best + 1) * 2 * gpr, 299 * 2 * gpr);
    let m = mference_kernels::QMatrix::new(&w, &s, &b, 300, 128, 8, 32).unwrap();
    for k in Kernels::available() {
        let pool = ThreadPool::new(2);
        assert_eq!(
            pool.gemv_argmax(k, &m, &x, None).0,
            best.min(299),
            "{}",
            k.name()
        );
    }
}

#[test]
fn gemm_batch_equals_one_by_one() {
    let mut rng = Rng::new(21);
    let mats = [
        OwnedQ::random(&mut rng, 70, 256, 4, 64, 2),
        OwnedQ::random(&mut rng, 70, 256, 4, 64, 2),
        OwnedQ::random(&mut rng, 33, 128, 8, 32, 6),
        OwnedQ::random(&mut rng, 257, 64, 4, 32, 0),
        OwnedQ::random(&mut rng, 45, 256, 2, 32, 2),
        OwnedQ::random(&mut rng, 45, 256, 2, 128, 6),
    ];
    let ns = [1usize, 1, 5, 3, 1, 4];
    for k in Kernels::available() {
        let preps: Vec<_> = mats
            .iter()
            .zip(ns)
            .map(|(q, n)| {
                let x = activations(&mut rng, n * q.cols);
                k.prepare(&q.view(), &x, n)
            })
            .collect();
        let want: Vec<Vec<f32>> = mats
            .iter()
            .zip(&preps)
            .map(|(q, p)| {
                let mut y = vec![0.0f32; p.n() * q.rows];
                k.gemm_prepared(&q.view(), p, &mut y, 0, q.rows);
                y
            })
            .collect();
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads);
            let mut outs: Vec<Vec<f32>> = want.iter().map(|w| vec![f32::NAN; w.len()]).collect();
            let mut jobs: Vec<MatJob> = mats
                .iter()
                .zip(&preps)
                .zip(outs.iter_mut())
                .map(|((q, x), y)| MatJob { m: q.view(), x, y })
                .collect();
            pool.gemm_batch(k, &mut jobs);
            assert_eq!(outs, want, "{} threads {threads}", k.name());
        }
    }
}

/// `gemv_pairs` with a combine `f(a, b) = a - 2b`: against the f64 products (combined in f64),
/// and bit for bit against the two one-row products and `f` over the whole vectors.
#[test]
fn gemv_pairs_equal_two_products_and_the_combine() {
    let mut rng = Rng::new(23);
    // (rows, cols, bits, group, offset): several row chunks (700 rows), a short one, 8-bit.
    let shapes = [
        (700usize, 256usize, 4u32, 64usize, 2usize),
        (45, 256, 4, 32, 0),
        (33, 128, 8, 32, 6),
        (70, 256, 2, 64, 2),
    ];
    let f = |a: &mut [f32], b: &[f32]| a.iter_mut().zip(b).for_each(|(a, b)| *a -= 2.0 * b);
    for k in Kernels::available() {
        let pairs: Vec<(OwnedQ, OwnedQ, Vec<f32>)> = shapes
            .iter()
            .map(|&(r, c, bits, gs, off)| {
                let a = OwnedQ::random(&mut rng, r, c, bits, gs, off);
                let b = OwnedQ::random(&mut rng, r, c, bits, gs, off);
                (a, b, activations(&mut rng, c))
            })
            .collect();
        let preps: Vec<_> = pairs
            .iter()
            .map(|(a, _, x)| k.prepare(&a.view(), x, 1))
            .collect();
        let mut want = Vec::new();
        for ((a, b, x), p) in pairs.iter().zip(&preps) {
            let (mut ya, mut yb) = (vec![0.0f32; a.rows], vec![0.0f32; a.rows]);
            k.gemv_prepared(&a.view(), p, &mut ya, 0, a.rows);
            k.gemv_prepared(&b.view(), p, &mut yb, 0, a.rows);
            f(&mut ya, &yb);
            // The f64 reference: A x − 2 B x, error measured against both products' magnitudes.
            let ((ra, ma), (rb, mb)) = (naive_gemm(&a.view(), x, 1), naive_gemm(&b.view(), x, 1));
            let r: Vec<f64> = ra.iter().zip(&rb).map(|(a, b)| a - 2.0 * b).collect();
            let m: Vec<f64> = ma.iter().zip(&mb).map(|(a, b)| a + 2.0 * b).collect();
            let err = max_rel_err(&ya, &r, &m);
            assert!(err <= budget(k), "{}: {err:.2e} vs f64", k.name());
            want.push(ya);
        }
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            let mut outs: Vec<Vec<f32>> = want.iter().map(|w| vec![f32::NAN; w.len()]).collect();
            let mut jobs: Vec<PairJob> = pairs
                .iter()
                .zip(&preps)
                .zip(outs.iter_mut())
                .map(|(((a, b, _), x), y)| PairJob {
                    a: a.view(),
                    b: b.view(),
                    x,
                    y,
                })
                .collect();
            pool.gemv_pairs(k, &mut jobs, f);
            assert_eq!(outs, want, "{} threads {threads}", k.name());
        }
    }
}

#[test]
fn dequantize_row_matches_the_u32_bitstream_definition() {
    let mut rng = Rng::new(31);
    for &(bits, gs, offset) in &[
        (4u32, 32usize, 2usize),
        (4, 64, 0),
        (4, 128, 6),
        (8, 32, 1),
        (8, 64, 2),
        (8, 128, 0),
        (2, 32, 2),
        (2, 64, 6),
        (2, 128, 1),
    ] {
        let q = OwnedQ::random(&mut rng, 9, 384, bits, gs, offset);
        let m = q.view();
        let mut row = vec![0.0f32; m.cols];
        for r in 0..m.rows {
            m.dequantize_row(r, &mut row);
            for (c, &v) in row.iter().enumerate() {
                let (s, code, b) = common::naive_parts(&m, r, c);
                let want = s * code + b;
                // One f32 multiply and one add: at most ~2 ulps of the larger term.
                let tol = 2.5e-7 * (s.abs() * code + b.abs());
                assert!(
                    (v as f64 - want).abs() <= tol,
                    "bits {bits} group {gs} ({r},{c}): {v} vs {want}"
                );
            }
        }
    }
}
