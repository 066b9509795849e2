//! AVX2 (+FMA, F16C) kernels: the same algorithm as `avx512.rs` with 8-lane vectors, for CPUs without
//! AVX-512. 4-bit uses `XLayout::EvenOdd32`: of 16 packed bytes, bytes 0..8 give columns (even 0..16 → x[0..8],
//! odd → x[16..24]) and bytes 8..16 give (x[8..16], x[24..32]). 2-bit uses `XLayout::Mod4x32`: 8 packed bytes
//! widened to 8 lanes give, shifted by 0, 2, 4, 6, the columns of x[0..8], x[8..16], x[16..24], x[24..32].

use std::arch::x86_64::*;

use half::f16;

use super::{read_bf16, with_wtile};
use crate::dispatch::Kernels;
use crate::prepared::{PreparedX, XLayout};
use crate::{scalar, QMatrix};

pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

pub(super) static TABLE: Kernels = Kernels {
    name: "avx2",
    layout4: XLayout::EvenOdd32,
    layout2: XLayout::Mod4x32,
    q8: false,
    q16: false,
    q16_lanes: None,
    q16_gemv: XLayout::Q16EvenOdd64,
    amx: false,
    rounding: None,
    gemv,
    gemm,
    dot_f32,
    axpy,
    f32_to_f16,
    f16_to_f32,
    dot_f16,
    axpy_f16,
    wsum_f16: None,
    dots_f16: None,
    dots_f16_group: None,
    wsum_f16_group: None,
};

// The safe wrappers below are only reachable through `TABLE`, which `super::available` hands out only after
// `supported()` returned true.

pub(super) fn gemv(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    p.check(m, TABLE.layout_for(m.bits, m.group_size, p.n));
    // SAFETY: AVX2, FMA and F16C are present (see above); shapes were checked by the caller.
    unsafe { gemv_impl(m, p, y, r0, r1) }
}

pub(super) fn gemm(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    p.check(m, TABLE.layout_for(m.bits, m.group_size, p.n));
    // SAFETY: as for `gemv`.
    unsafe { gemm_impl(m, p, y, r0, r1) }
}

fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: as for `gemv`; lengths are equal (checked by `Kernels::dot_f32`).
    unsafe { dot_f32_impl(a, b) }
}

fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { axpy_impl(a, x, y) }
}

fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { f32_to_f16_impl(src, dst) }
}

fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { f16_to_f32_impl(src, dst) }
}

fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { dot_f16_impl(q, k) }
}

fn axpy_f16(a: f32, v: &[f16], y: &mut [f32]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { axpy_f16_impl(a, v, y) }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// 8 bytes at `p` widened to i32 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load_u8x8(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 8 readable bytes; the load is unaligned.
    _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) })
}

/// The codes of columns `col..col + 32` of the packed row at `w` (4- or 2-bit), widened to i32 lanes in the
/// prepared column order: vector k meets `x[8k..8k + 8]` of the run.
/// - 4-bit (`XLayout::EvenOdd32`): low nibbles of bytes 0..8 and 8..16, then their high nibbles.
/// - 2-bit (`XLayout::Mod4x32`): the 8 bytes shifted by 2k, masked.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn codes32<const BITS: u32>(w: *const u8, col: usize) -> [__m256i; 4] {
    if BITS == 4 {
        let nib = _mm256_set1_epi32(0x0f);
        // SAFETY: the caller guarantees the row holds columns col..col+32 (16 bytes at col/2).
        let (v0, v1) = unsafe { (load_u8x8(w.add(col / 2)), load_u8x8(w.add(col / 2 + 8))) };
        [
            _mm256_and_si256(v0, nib),
            _mm256_and_si256(v1, nib),
            _mm256_srli_epi32::<4>(v0),
            _mm256_srli_epi32::<4>(v1),
        ]
    } else {
        let m = _mm256_set1_epi32(0x03);
        // SAFETY: as above, 8 bytes at col/4.
        let v = unsafe { load_u8x8(w.add(col / 4)) };
        [
            _mm256_and_si256(v, m),
            _mm256_and_si256(_mm256_srli_epi32::<2>(v), m),
            _mm256_and_si256(_mm256_srli_epi32::<4>(v), m),
            _mm256_srli_epi32::<6>(v),
        ]
    }
}

/// `Σ_g bias[g] · sums[g]` over `gpr` groups (`bias` is bf16 at `b`).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn bias_dot(b: *const u8, sums: &[f32], gpr: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut g = 0;
    while g + 8 <= gpr {
        // SAFETY: groups g..g+8 are inside the row's bias slice and `sums` (len gpr).
        unsafe {
            let h = _mm_loadu_si128(b.add(2 * g) as *const __m128i);
            let bv = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
            acc = _mm256_fmadd_ps(bv, _mm256_loadu_ps(sums.as_ptr().add(g)), acc);
        }
        g += 8;
    }
    let mut s = hsum(acc);
    while g < gpr {
        // SAFETY: group g < gpr of the row.
        s += unsafe { read_bf16(b.add(2 * g)) } * sums[g];
        g += 1;
    }
    s
}

/// How far ahead (in rows) the GEMV prefetches packed weights.
const PF_ROWS: usize = 8;

/// Rows `r..r+R` of `W x` for 2-, 4- or 8-bit codes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn rows_dot<const R: usize, const BITS: u32>(
    m: &QMatrix,
    x: &[f32],
    sums: &[f32],
    r: usize,
    out: &mut [f32],
) {
    let gs = m.group_size;
    let gpr = m.groups_per_row();
    let rb = m.row_bytes();
    debug_assert!((r + R) * rb <= m.weight.len() && out.len() >= R && x.len() == m.cols);
    // SAFETY (all pointer arithmetic below): rows r..r+R exist (checked by the caller against `m.rows`, whose
    // tensor lengths `QMatrix::new` validated); columns stay below `cols`, groups below `gpr`.
    let w = unsafe { m.weight.as_ptr().add(r * rb) };
    let sc = unsafe { m.scales.as_ptr().add(r * gpr * 2) };
    let bi = unsafe { m.biases.as_ptr().add(r * gpr * 2) };
    let xp = x.as_ptr();
    let mut acc = [_mm256_setzero_ps(); R];
    // Software prefetch of the same bytes PF_ROWS rows ahead (see avx512.rs).
    let pf = PF_ROWS * rb;
    for g in 0..gpr {
        let mut accg = [_mm256_setzero_ps(); R];
        for i in 0..R {
            _mm_prefetch::<_MM_HINT_T0>(
                w.wrapping_add(pf + i * rb + g * gs * BITS as usize / 8) as *const i8
            );
        }
        if BITS != 8 {
            for c in 0..gs / 32 {
                let col = g * gs + c * 32;
                // SAFETY: col + 32 <= cols; columns col..col+32 of each row are inside the row.
                unsafe {
                    let xs: [__m256; 4] =
                        std::array::from_fn(|k| _mm256_loadu_ps(xp.add(col + 8 * k)));
                    for i in 0..R {
                        let q = codes32::<BITS>(w.add(i * rb), col);
                        for k in 0..4 {
                            accg[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[k]), xs[k], accg[i]);
                        }
                    }
                }
            }
        } else {
            for c in 0..gs / 8 {
                let col = g * gs + c * 8;
                // SAFETY: col + 8 <= cols; 8 bytes at byte col of each row are inside the row.
                unsafe {
                    let x0 = _mm256_loadu_ps(xp.add(col));
                    for i in 0..R {
                        let v = load_u8x8(w.add(i * rb + col));
                        accg[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), x0, accg[i]);
                    }
                }
            }
        }
        for i in 0..R {
            // SAFETY: group g of row r+i.
            let s = unsafe { read_bf16(sc.add((i * gpr + g) * 2)) };
            acc[i] = _mm256_fmadd_ps(accg[i], _mm256_set1_ps(s), acc[i]);
        }
    }
    for i in 0..R {
        // SAFETY: the bias row of r+i has gpr entries.
        out[i] = hsum(acc[i]) + unsafe { bias_dot(bi.add(i * gpr * 2), sums, gpr) };
    }
}

define_gemv!("avx2,fma", 4);

/// Row `r` of a `BITS`-bit matrix as unscaled codes in f32 (`cols` floats, prepared-activation column
/// order) into `out`, and its group scales as f32 into `scales` (`groups_per_row` floats).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn codes_row<const BITS: u32>(m: &QMatrix, r: usize, out: &mut [f32], scales: &mut [f32]) {
    let gs = m.group_size;
    let gpr = m.groups_per_row();
    let rb = m.row_bytes();
    debug_assert!(m.bits == BITS && out.len() >= m.cols && scales.len() >= gpr && r < m.rows);
    // SAFETY (pointer arithmetic below): row r exists; columns stay below cols, groups below gpr.
    let w = unsafe { m.weight.as_ptr().add(r * rb) };
    let o = out.as_mut_ptr();
    for g in 0..gpr {
        // SAFETY: group g of row r.
        scales[g] = unsafe { read_bf16(m.scales.as_ptr().add((r * gpr + g) * 2)) };
        if BITS != 8 {
            for c in 0..gs / 32 {
                let col = g * gs + c * 32;
                // SAFETY: columns col..col+32 of the row; 32 floats of `out` at col.
                unsafe {
                    let q = codes32::<BITS>(w, col);
                    for k in 0..4 {
                        _mm256_storeu_ps(o.add(col + 8 * k), _mm256_cvtepi32_ps(q[k]));
                    }
                }
            }
        } else {
            for c in 0..gs / 8 {
                let col = g * gs + c * 8;
                // SAFETY: 8 bytes of the row at col; 8 floats of `out` at col.
                unsafe { _mm256_storeu_ps(o.add(col), _mm256_cvtepi32_ps(load_u8x8(w.add(col)))) };
            }
        }
    }
}

/// Rows per GEMM register tile.
const GEMM_RB: usize = 4;
/// Tokens per GEMM register tile (GEMM_RB · GEMM_TB = 8 group accumulators + 4 weight vectors + 1
/// activation of the 16 ymm registers).
const GEMM_TB: usize = 2;
/// Tokens per GEMM L2 block (a multiple of GEMM_TB).
const GEMM_NB: usize = 48;
/// Columns per GEMM L1 block (a multiple of every group size).
const GEMM_KC: usize = 256;

/// For R rows (codes at `w`, stride `ldw`; scales `s[i · ld_s + g]`) and T tokens (`x`, stride `ldx`),
/// the groups `g0 .. g0 + ng` (group size `gs`, `w` and `x` pointing at group `g0`'s first column):
/// per group one accumulator of `code · x` over its 8-column chunks in order, then
/// `acc[t·GEMM_RB + i] = fma(group sum, scale, acc)`: the GEMV's sequence (`rows_dot`), the same for
/// every R and T.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_groups<const R: usize, const T: usize>(
    w: *const f32,
    ldw: usize,
    x: *const f32,
    ldx: usize,
    (s, ld_s): (&[f32], usize),
    (g0, ng, gs): (usize, usize, usize),
    acc: &mut [__m256],
) {
    debug_assert!(gs.is_multiple_of(8) && acc.len() >= (T - 1) * GEMM_RB + R);
    for gi in 0..ng {
        let mut accg = [[_mm256_setzero_ps(); R]; T];
        let mut c = gi * gs;
        while c < (gi + 1) * gs {
            // SAFETY: column c + 8 <= the block's end for every row of `w` and token of `x` (the
            // caller's contract).
            unsafe {
                let wv: [__m256; R] = std::array::from_fn(|i| _mm256_loadu_ps(w.add(i * ldw + c)));
                for t in 0..T {
                    let xv = _mm256_loadu_ps(x.add(t * ldx + c));
                    for i in 0..R {
                        accg[t][i] = _mm256_fmadd_ps(wv[i], xv, accg[t][i]);
                    }
                }
            }
            c += 8;
        }
        for i in 0..R {
            let sv = _mm256_set1_ps(s[i * ld_s + g0 + gi]);
            for t in 0..T {
                let a = &mut acc[t * GEMM_RB + i];
                *a = _mm256_fmadd_ps(accg[t][i], sv, *a);
            }
        }
    }
}

/// `Y = X · Wᵀ` with, per (row, token), exactly the GEMV's operations (`rows_dot`: unscaled codes
/// times x per group, scaled per group, plus `bias · Σx` at the end), so a token's result does not
/// depend on how many tokens share the product. Each weight row's codes are converted once per call.
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_impl(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let (cols, n, ldy) = (m.cols, p.n, r1 - r0);
    let (gs, gpr) = (m.group_size, m.groups_per_row());
    let mut acc = vec![_mm256_setzero_ps(); GEMM_NB * GEMM_RB];
    with_wtile(GEMM_RB * (cols + gpr), |buf| {
        let (wt, st) = buf.split_at_mut(GEMM_RB * cols);
        let mut r = r0;
        while r < r1 {
            let rb = (r1 - r).min(GEMM_RB);
            for i in 0..rb {
                let (out, sc) = (
                    &mut wt[i * cols..(i + 1) * cols],
                    &mut st[i * gpr..(i + 1) * gpr],
                );
                // SAFETY: row r+i < r1 <= rows; `out` is that row's cols floats of the tile.
                unsafe {
                    match m.bits {
                        4 => codes_row::<4>(m, r + i, out, sc),
                        2 => codes_row::<2>(m, r + i, out, sc),
                        _ => codes_row::<8>(m, r + i, out, sc),
                    }
                }
            }
            let mut n0 = 0;
            while n0 < n {
                let nb = (n - n0).min(GEMM_NB);
                acc.fill(_mm256_setzero_ps());
                let mut c0 = 0;
                while c0 < cols {
                    let kc = (cols - c0).min(GEMM_KC);
                    let groups = (c0 / gs, kc / gs, gs);
                    let mut t = 0;
                    while t < nb {
                        let tb = (nb - t).min(GEMM_TB);
                        let at = &mut acc[t * GEMM_RB..];
                        // SAFETY: tokens n0+t..n0+t+tb exist in p.x ([n, cols]); wt holds rb rows of cols
                        // floats and st their gpr scales; [c0, c0+kc) is whole groups inside both.
                        unsafe {
                            let xt = p.x.as_ptr().add((n0 + t) * cols + c0);
                            let wc = wt.as_ptr().add(c0);
                            if rb == GEMM_RB && tb == GEMM_TB {
                                tile_groups::<GEMM_RB, GEMM_TB>(
                                    wc,
                                    cols,
                                    xt,
                                    cols,
                                    (st, gpr),
                                    groups,
                                    at,
                                );
                            } else {
                                for i in 0..rb {
                                    for k in 0..tb {
                                        tile_groups::<1, 1>(
                                            wc.add(i * cols),
                                            cols,
                                            xt.add(k * cols),
                                            cols,
                                            (&st[i * gpr..], gpr),
                                            groups,
                                            &mut at[k * GEMM_RB + i..],
                                        );
                                    }
                                }
                            }
                        }
                        t += tb;
                    }
                    c0 += kc;
                }
                for t in 0..nb {
                    let sums = p.sums_row(n0 + t);
                    for i in 0..rb {
                        // SAFETY: the bias row of r+i has gpr entries.
                        let b = unsafe { m.biases.as_ptr().add((r + i) * gpr * 2) };
                        y[(n0 + t) * ldy + (r - r0) + i] =
                            hsum(acc[t * GEMM_RB + i]) + unsafe { bias_dot(b, sums, gpr) };
                    }
                }
                n0 += nb;
            }
            r += rb;
        }
    })
}

#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32_impl(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (loads below): indices stay below n = a.len() = b.len().
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            unsafe {
                *acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(ap.add(i + 8 * k)),
                    _mm256_loadu_ps(bp.add(i + 8 * k)),
                    *acc,
                )
            };
        }
        i += 32;
    }
    while i + 8 <= n {
        unsafe {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(ap.add(i)),
                _mm256_loadu_ps(bp.add(i)),
                acc[0],
            )
        };
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    s += scalar::dot_f32(&a[i..], &b[i..]);
    s
}

#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_impl(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let av = _mm256_set1_ps(a);
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = x.len() = y.len().
        unsafe {
            _mm256_storeu_ps(
                yp.add(i),
                _mm256_fmadd_ps(av, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(yp.add(i))),
            )
        };
        i += 8;
    }
    for j in i..n {
        y[j] = a.mul_add(x[j], y[j]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_to_f16_impl(src: &[f32], dst: &mut [f16]) {
    let n = src.len();
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = src.len() = dst.len(); f16 is a transparent u16.
        unsafe {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(sp.add(i)));
            _mm_storeu_si128(dp.add(i) as *mut __m128i, h);
        }
        i += 8;
    }
    scalar::f32_to_f16(&src[i..], &mut dst[i..]);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_to_f32_impl(src: &[f16], dst: &mut [f32]) {
    let n = src.len();
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = src.len() = dst.len().
        unsafe {
            _mm256_storeu_ps(
                dp.add(i),
                _mm256_cvtph_ps(_mm_loadu_si128(sp.add(i) as *const __m128i)),
            )
        };
        i += 8;
    }
    scalar::f16_to_f32(&src[i..], &mut dst[i..]);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_impl(q: &[f32], kv: &[f16]) -> f32 {
    let n = q.len();
    let (qp, kp) = (q.as_ptr(), kv.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY (loads below): indices stay below n = q.len() = kv.len().
    while i + 16 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            unsafe {
                let kf = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i + 8 * k) as *const __m128i));
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i + 8 * k)), kf, *acc);
            }
        }
        i += 16;
    }
    while i + 8 <= n {
        unsafe {
            let kf = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i) as *const __m128i));
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i)), kf, acc[0]);
        }
        i += 8;
    }
    hsum(_mm256_add_ps(acc[0], acc[1])) + scalar::dot_f16(&q[i..], &kv[i..])
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_f16_impl(a: f32, v: &[f16], y: &mut [f32]) {
    let n = v.len();
    let av = _mm256_set1_ps(a);
    let (vp, yp) = (v.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: i + 8 <= n = v.len() = y.len().
        unsafe {
            let vf = _mm256_cvtph_ps(_mm_loadu_si128(vp.add(i) as *const __m128i));
            _mm256_storeu_ps(
                yp.add(i),
                _mm256_fmadd_ps(av, vf, _mm256_loadu_ps(yp.add(i))),
            );
        }
        i += 8;
    }
    for j in i..n {
        y[j] = a.mul_add(v[j].to_f32(), y[j]);
    }
}
