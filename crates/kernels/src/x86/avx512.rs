//! AVX-512 (F/BW/VL + FMA + F16C) quantized products (the exact table; its f32 / f16 vector kernels are in
//! `avx512_vec.rs`). Pure f32 FMA arithmetic: codes are widened to i32, converted to
//! f32 and multiplied with activations prepared in the kernel's column order (`XLayout::EvenOdd32` for
//! 4-bit, so the low and high nibbles of 16 bytes meet 16 contiguous even and 16 contiguous odd columns;
//! `XLayout::Mod4x32` for 2-bit, so the four 2-bit fields of 8 bytes meet four runs of 8 contiguous columns).
//!
//! Per output row the operation sequence does not depend on which other rows share a register block, so
//! results are bit-identical however rows are split across calls or threads.

use std::arch::x86_64::*;

use super::avx512_vec::{
    axpy, axpy_f16, dot_f16, dot_f32, dots_f16, dots_f16_group, f16_to_f32, f32_to_f16, wsum_f16,
    wsum_f16_group,
};
use super::{read_bf16, with_wtile};
use crate::dispatch::Kernels;
use crate::prepared::{PreparedX, XLayout};
use crate::QMatrix;

pub(super) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The exact AVX-512 table; the VNNI tables start from it.
pub(super) const EXACT: Kernels = Kernels {
    name: "avx512",
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
    wsum_f16: Some(wsum_f16),
    dots_f16: Some(dots_f16),
    dots_f16_group: Some(dots_f16_group),
    wsum_f16_group: Some(wsum_f16_group),
};

pub(super) static TABLE: Kernels = EXACT;
// The safe wrappers below are only reachable through `TABLE`, which `super::available` hands out only after
// `supported()` returned true.

pub(super) fn gemv(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    p.check(m, TABLE.layout_for(m.bits, m.group_size, p.n));
    // SAFETY: AVX-512F/BW/VL, FMA and F16C are present (see above); shapes were checked by the caller.
    unsafe { gemv_impl(m, p, y, r0, r1) }
}

pub(super) fn gemm(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    p.check(m, TABLE.layout_for(m.bits, m.group_size, p.n));
    // SAFETY: as for `gemv`.
    unsafe { gemm_impl(m, p, y, r0, r1) }
}

/// Mask with the low `n` (<= 16) lanes set.
#[inline(always)]
pub(super) fn tail_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// 16 bf16 at `p` widened to f32; lanes outside `mask` are zero and not read.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
pub(super) unsafe fn load_bf16x16(p: *const u8, mask: __mmask16) -> __m512 {
    // SAFETY: the caller guarantees the masked-in lanes are readable; masked-off lanes are not accessed.
    let h = unsafe { _mm256_maskz_loadu_epi16(mask, p as *const i16) };
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// The bf16 at `p` as f32 in every lane: a 16-bit broadcast from memory, then keep the high half of each
/// 32-bit lane (2 uops instead of a scalar load, shift, move and broadcast).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn broadcast_bf16(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 2 readable bytes; the 16-bit load has no alignment requirement.
    let v = _mm512_set1_epi16(unsafe { (p as *const i16).read_unaligned() });
    _mm512_castsi512_ps(_mm512_and_si512(
        v,
        _mm512_set1_epi32(0xffff_0000u32 as i32),
    ))
}

/// How far ahead (in rows) the GEMV prefetches packed weights (software prefetch: the hardware prefetcher
/// stops at 4 KiB pages, and a row block spans several of them; prefetch never faults, so running past the
/// end of the matrix is harmless).
const PF_ROWS: usize = 8;

/// Rows `r..r+R` of `W x` for 8-bit codes (routers), in the GEMM's per-row order (see [`rows_dot`]):
/// each 16 codes widened, converted and dequantized by `fma(q, scale, bias)`, then one FMA with x.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline]
unsafe fn rows_dot_u8<const R: usize>(m: &QMatrix, x: &[f32], r: usize, out: &mut [f32]) {
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
    let mut acc = [_mm512_setzero_ps(); R];
    let mut part = [0.0f32; R];
    let pf = PF_ROWS * rb;
    for g in 0..gpr {
        let mut sb = [(_mm512_setzero_ps(), _mm512_setzero_ps()); R];
        for i in 0..R {
            _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(pf + i * rb + g * gs) as *const i8);
            // SAFETY: group g of row r+i.
            sb[i] = unsafe {
                (
                    broadcast_bf16(sc.add((i * gpr + g) * 2)),
                    broadcast_bf16(bi.add((i * gpr + g) * 2)),
                )
            };
        }
        for c in 0..gs / 16 {
            let col = g * gs + c * 16;
            // SAFETY: col + 16 <= cols.
            let x0 = unsafe { _mm512_loadu_ps(xp.add(col)) };
            for i in 0..R {
                // SAFETY: 16 bytes at byte col of row r+i are inside the row.
                let v = unsafe {
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(i * rb + col) as *const __m128i))
                };
                let wv = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sb[i].0, sb[i].1);
                acc[i] = _mm512_fmadd_ps(wv, x0, acc[i]);
            }
        }
        // At the end of a GEMM column block (every GEMM_KC columns, and the row's end): add each
        // accumulator's sum to the row's total and clear it, as the GEMM's `tile_dots` does.
        if ((g + 1) * gs).is_multiple_of(GEMM_KC) || g + 1 == gpr {
            for i in 0..R {
                part[i] += _mm512_reduce_add_ps(acc[i]);
                acc[i] = _mm512_setzero_ps();
            }
        }
    }
    out[..R].copy_from_slice(&part);
}

/// The code values of a 16-entry `vpermps` table (which reads the low 4 bits of each index lane) for `BITS`
/// 4 or 2: `0..16`, or `[0, 1, 2, 3]` four times, so that a 2-bit index only depends on its low 2 bits and
/// the next code's bits above it need no mask.
#[target_feature(enable = "avx512f")]
#[inline]
fn lut_codes<const BITS: u32>() -> __m512 {
    if BITS == 4 {
        _mm512_setr_ps(
            0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
        )
    } else {
        _mm512_setr_ps(
            0., 1., 2., 3., 0., 1., 2., 3., 0., 1., 2., 3., 0., 1., 2., 3.,
        )
    }
}

/// `vpermps` indices (see [`lut_codes`]) of columns `col..col + 32` of the packed row at `w`, in the prepared
/// column order: `(x[0..16], x[16..32])` of the run.
/// - 4-bit (`XLayout::EvenOdd32`): 16 bytes widened to 16 lanes, then shifted by 0 and 4.
/// - 2-bit (`XLayout::Mod4x32`): 8 bytes widened twice to 16 lanes, then shifted by (0, 2) and (4, 6) per
///   half, so lane l < 8 holds column 4l + k of shift 2k.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
unsafe fn lut_indices<const BITS: u32>(w: *const u8, col: usize) -> (__m512i, __m512i) {
    if BITS == 4 {
        // SAFETY: the caller guarantees the row holds columns col..col+32 (16 bytes at col/2).
        let v = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(w.add(col / 2) as *const __m128i) });
        (v, _mm512_srli_epi32::<4>(v))
    } else {
        // SAFETY: as above, 8 bytes at col/4; the load is unaligned.
        let b8 = unsafe { (w.add(col / 4) as *const i64).read_unaligned() };
        let v = _mm512_cvtepu8_epi32(_mm_set1_epi64x(b8));
        let (s01, s23) = (
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2),
            _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6),
        );
        (_mm512_srlv_epi32(v, s01), _mm512_srlv_epi32(v, s23))
    }
}

/// Rows `r..r+R` of `W x` for 4- or 2-bit codes, by table lookup: per (row, group) a 16-entry table
/// `fma(q, scale, bias)` (the GEMM's dequantized value) and `vpermps`, which reads only the low 4 bits of
/// each index lane, turns widened packed bytes into weights directly (no mask, no int→float conversion).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline]
unsafe fn rows_dot_lut<const R: usize, const BITS: u32>(
    m: &QMatrix,
    x: &[f32],
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
    let codes = lut_codes::<BITS>();
    let mut acc = [_mm512_setzero_ps(); R];
    let mut part = [0.0f32; R];
    let pf = PF_ROWS * rb;
    // Scales and biases of 16 groups at a time, widened to f32 on the stack: each group's broadcast is
    // then a plain load (a bf16 broadcast takes a port-5 uop, which the table lookups saturate).
    let (mut sf, mut bf) = ([[0.0f32; 16]; R], [[0.0f32; 16]; R]);
    for g in 0..gpr {
        if g % 16 == 0 {
            let k = tail_mask((gpr - g).min(16));
            for i in 0..R {
                // SAFETY: groups g..min(g+16, gpr) of row r+i; masked-off lanes are not read.
                unsafe {
                    _mm512_storeu_ps(
                        sf[i].as_mut_ptr(),
                        load_bf16x16(sc.add((i * gpr + g) * 2), k),
                    );
                    _mm512_storeu_ps(
                        bf[i].as_mut_ptr(),
                        load_bf16x16(bi.add((i * gpr + g) * 2), k),
                    );
                }
            }
        }
        let mut tbl = [_mm512_setzero_ps(); R];
        for i in 0..R {
            _mm_prefetch::<_MM_HINT_T0>(
                w.wrapping_add(pf + i * rb + g * gs * BITS as usize / 8) as *const i8
            );
            tbl[i] = _mm512_fmadd_ps(
                codes,
                _mm512_set1_ps(sf[i][g % 16]),
                _mm512_set1_ps(bf[i][g % 16]),
            );
        }
        for c in 0..gs / 32 {
            let col = g * gs + c * 32;
            // SAFETY: col + 32 <= cols.
            let (x0, x1) = unsafe {
                (
                    _mm512_loadu_ps(xp.add(col)),
                    _mm512_loadu_ps(xp.add(col + 16)),
                )
            };
            for i in 0..R {
                // SAFETY: columns col..col+32 of row r+i are inside the row.
                let (vl, vh) = unsafe { lut_indices::<BITS>(w.add(i * rb), col) };
                acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(vl, tbl[i]), x0, acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(vh, tbl[i]), x1, acc[i]);
            }
        }
        // At the end of a GEMM column block (every GEMM_KC columns, and the row's end): add each
        // accumulator's sum to the row's total and clear it, as the GEMM's `tile_dots` does.
        if ((g + 1) * gs).is_multiple_of(GEMM_KC) || g + 1 == gpr {
            for i in 0..R {
                part[i] += _mm512_reduce_add_ps(acc[i]);
                acc[i] = _mm512_setzero_ps();
            }
        }
    }
    out[..R].copy_from_slice(&part);
}

/// Rows `r..r+R` of `W x` for `BITS`-bit codes, each with the operation sequence the GEMM gives
/// that (row, token): weights dequantized as `fma(q, scale, bias)`, one accumulator per row taking
/// 16 columns per FMA in prepared order, reduced and added to the row's total every `GEMM_KC`
/// columns. So a token's result does not depend on how many tokens share the product (a decode
/// step gives the same bits as any prefill chunk).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline]
unsafe fn rows_dot<const R: usize, const BITS: u32>(
    m: &QMatrix,
    x: &[f32],
    _sums: &[f32], // the bias is folded into the dequantized weights
    r: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        if BITS == 8 {
            rows_dot_u8::<R>(m, x, r, out)
        } else {
            rows_dot_lut::<R, BITS>(m, x, r, out)
        }
    }
}

define_gemv!("avx512f,avx512bw,avx512vl,fma", 4);

/// Dequantizes columns `[c0, c1)` of row `r` of a `BITS`-bit matrix into `out[..c1 - c0]`, in the
/// prepared-activation column order (`c0`, `c1` multiples of the group size).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline]
unsafe fn dequant_cols<const BITS: u32>(
    m: &QMatrix,
    r: usize,
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    let gs = m.group_size;
    let gpr = m.groups_per_row();
    let rb = m.row_bytes();
    debug_assert!(
        m.bits == BITS
            && out.len() >= c1 - c0
            && r < m.rows
            && c0.is_multiple_of(gs)
            && c1.is_multiple_of(gs)
            && c1 <= m.cols
    );
    // SAFETY (pointer arithmetic below): row r exists; columns stay below c1 <= cols, groups below gpr.
    let w = unsafe { m.weight.as_ptr().add(r * rb) };
    let o = out.as_mut_ptr();
    for g in c0 / gs..c1 / gs {
        // SAFETY: group g of row r.
        let (s, b) = unsafe {
            let i = (r * gpr + g) * 2;
            (
                read_bf16(m.scales.as_ptr().add(i)),
                read_bf16(m.biases.as_ptr().add(i)),
            )
        };
        let (s, b) = (_mm512_set1_ps(s), _mm512_set1_ps(b));
        if BITS != 8 {
            // 16-entry table of fma(q, scale, bias) (the same rounding as converting and fusing per element);
            // vpermps reads only the low 4 bits of each index lane.
            let tbl = _mm512_fmadd_ps(lut_codes::<BITS>(), s, b);
            for c in 0..gs / 32 {
                let col = g * gs + c * 32;
                // SAFETY: columns col..col+32 of the row; 32 floats of `out` at col - c0.
                unsafe {
                    let (vl, vh) = lut_indices::<BITS>(w, col);
                    _mm512_storeu_ps(o.add(col - c0), _mm512_permutexvar_ps(vl, tbl));
                    _mm512_storeu_ps(o.add(col - c0 + 16), _mm512_permutexvar_ps(vh, tbl));
                }
            }
        } else {
            for c in 0..gs / 16 {
                let col = g * gs + c * 16;
                // SAFETY: 16 bytes of the row at col; 16 floats of `out` at col - c0.
                unsafe {
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(col) as *const __m128i));
                    _mm512_storeu_ps(
                        o.add(col - c0),
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, b),
                    );
                }
            }
        }
    }
}

/// Rows per GEMM register tile.
const GEMM_RB: usize = 8;
/// Tokens per GEMM register tile (GEMM_RB · GEMM_TB = 24 accumulators of the 32 zmm registers).
const GEMM_TB: usize = 3;
/// Tokens per GEMM L2 block (a multiple of GEMM_TB): the block's activations stay in L2 while every row
/// block of the call passes over them.
const GEMM_NB: usize = 48;
/// Columns per GEMM L1 block: a row block's slice (GEMM_RB · GEMM_KC floats = 16 KiB) stays in L1 while the
/// tokens of the block stream past it. A multiple of every group size.
const GEMM_KC: usize = 512;

/// Adds `Σ_{c < kc} w[i][c] · x[t][c]` to `part[t·GEMM_RB + i]` for R rows (stride `ldw`) and T tokens (stride
/// `ldx`). The per-(row, token) operation sequence is the same for every R and T.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline]
unsafe fn tile_dots<const R: usize, const T: usize>(
    w: *const f32,
    ldw: usize,
    x: *const f32,
    ldx: usize,
    kc: usize,
    part: &mut [f32],
) {
    debug_assert!(kc.is_multiple_of(16) && part.len() >= (T - 1) * GEMM_RB + R);
    let mut acc = [[_mm512_setzero_ps(); R]; T];
    let mut c = 0;
    while c < kc {
        // SAFETY: c + 16 <= kc for every row of `w` and every token row of `x` (the caller's contract).
        unsafe {
            let wv: [__m512; R] = std::array::from_fn(|i| _mm512_loadu_ps(w.add(i * ldw + c)));
            for t in 0..T {
                let xv = _mm512_loadu_ps(x.add(t * ldx + c));
                for i in 0..R {
                    acc[t][i] = _mm512_fmadd_ps(wv[i], xv, acc[t][i]);
                }
            }
        }
        c += 16;
    }
    for t in 0..T {
        for i in 0..R {
            part[t * GEMM_RB + i] += _mm512_reduce_add_ps(acc[t][i]);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn gemm_impl(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let (cols, n, ldy) = (m.cols, p.n, r1 - r0);
    with_wtile(GEMM_RB * cols + GEMM_NB * GEMM_RB, |buf| {
        let (wt, part) = buf.split_at_mut(GEMM_RB * cols);
        let mut r = r0;
        while r < r1 {
            let rb = (r1 - r).min(GEMM_RB);
            // Each weight row is dequantized once per call (rb · cols floats, in L2).
            for i in 0..rb {
                let out = &mut wt[i * cols..(i + 1) * cols];
                // SAFETY: row r+i < r1 <= rows; `out` is that row's cols floats of the tile.
                unsafe {
                    match m.bits {
                        4 => dequant_cols::<4>(m, r + i, 0, cols, out),
                        2 => dequant_cols::<2>(m, r + i, 0, cols, out),
                        _ => dequant_cols::<8>(m, r + i, 0, cols, out),
                    }
                }
            }
            let mut n0 = 0;
            while n0 < n {
                let nb = (n - n0).min(GEMM_NB);
                part.fill(0.0);
                let mut c0 = 0;
                while c0 < cols {
                    let kc = (cols - c0).min(GEMM_KC);
                    let mut t = 0;
                    while t < nb {
                        let tb = (nb - t).min(GEMM_TB);
                        let pt = &mut part[t * GEMM_RB..];
                        // SAFETY: tokens n0+t..n0+t+tb exist in p.x ([n, cols]); wt holds rb rows of cols
                        // floats; [c0, c0+kc) is inside both and kc is a multiple of 16.
                        unsafe {
                            let xt = p.x.as_ptr().add((n0 + t) * cols + c0);
                            let wc = wt.as_ptr().add(c0);
                            if rb == GEMM_RB && tb == GEMM_TB {
                                tile_dots::<GEMM_RB, GEMM_TB>(wc, cols, xt, cols, kc, pt);
                            } else if rb == GEMM_RB && tb == 2 {
                                tile_dots::<GEMM_RB, 2>(wc, cols, xt, cols, kc, pt);
                            } else if rb == GEMM_RB {
                                tile_dots::<GEMM_RB, 1>(wc, cols, xt, cols, kc, pt);
                            } else {
                                for i in 0..rb {
                                    for k in 0..tb {
                                        let pk = &mut pt[k * GEMM_RB + i..];
                                        tile_dots::<1, 1>(
                                            wc.add(i * cols),
                                            cols,
                                            xt.add(k * cols),
                                            cols,
                                            kc,
                                            pk,
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
                    let dst = (n0 + t) * ldy + (r - r0);
                    y[dst..dst + rb].copy_from_slice(&part[t * GEMM_RB..t * GEMM_RB + rb]);
                }
                n0 += nb;
            }
            r += rb;
        }
    })
}
