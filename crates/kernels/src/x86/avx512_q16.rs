//! AVX-512 VNNI with int16 activations, `--kernels avx512i16`: the 4-bit products (groups of 64 or
//! 128) quantize each token's weight group of x to int16 (`d = max|x| / 32767`, so x moves by at
//! most `max|x| / 65534`: 258x less than with int8) and multiply them with the 4-bit codes by
//! `vpdpwssd`, 32 multiply-adds per instruction against 16 for an f32 FMA, into exact integer sums.
//! Per (row, token) and group the f32 side is then `acc = fma(Σ q·x16, scale · d, acc)` and
//! `acc = fma(bias, Σ x, acc)`, groups in order, with `Σ x` the exact f32 group sum. 2- and 8-bit
//! matrices (routers) use the exact AVX-512 kernels.
//!
//! Batch invariance: the integer sums are exact whatever the order, and the f32 side is the same
//! sequence in the GEMV (up to four tokens a pass, [`XLayout::Q16EvenOdd64`]) and in the GEMM (16
//! tokens per register, [`XLayout::Q16Lanes16`]), so a token's result does not depend on how many
//! tokens share the product, nor on how rows are split.

use std::arch::x86_64::*;

use super::avx512_vnni::{self, tile, widen_row, LaneTiles, ROWS, TOKEN_BLOCKS};
use super::{avx512, read_bf16};
use crate::dispatch::Kernels;
use crate::prepared::{PreparedX, XLayout};
use crate::QMatrix;

pub(super) fn supported() -> bool {
    avx512::supported() && is_x86_feature_detected!("avx512vnni")
}

/// Only reachable after [`supported`] returned true (see `super::available`).
pub(super) static TABLE: Kernels = Kernels {
    name: "avx512i16",
    q16: true,
    q16_lanes: Some(crate::prepared::Q16_MIN_ROWS),
    rounding: Some("int16 activations"),
    gemv,
    gemm,
    ..avx512::EXACT
};

fn gemv(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    gemm(m, p, y, r0, r1)
}

pub(super) fn gemm(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let layout = TABLE.layout_for(m.bits, m.group_size, p.n);
    if !matches!(layout, XLayout::Q16EvenOdd64 | XLayout::Q16Lanes16) {
        return if p.n == 1 {
            avx512::gemv(m, p, y, r0, r1)
        } else {
            avx512::gemm(m, p, y, r0, r1)
        };
    }
    p.check(m, layout);
    // SAFETY: AVX-512F/BW/VL, VNNI and FMA are present (the table is handed out only after
    // `supported()`); the caller checked r0 <= r1 <= rows and y.len() == n · (r1 - r0).
    unsafe {
        if layout == XLayout::Q16Lanes16 {
            gemm_lanes(m, p, y, r0, r1)
        } else {
            // Up to TOKENS tokens a pass: each row's codes widened once for all of them.
            let ldy = r1 - r0;
            let mut t = 0;
            while t < p.n {
                let k = (p.n - t).min(TOKENS);
                match k {
                    4 => gemv_tokens::<4>(m, p, t, y, ldy, r0, r1),
                    3 => gemv_tokens::<3>(m, p, t, y, ldy, r0, r1),
                    2 => gemv_tokens::<2>(m, p, t, y, ldy, r0, r1),
                    _ => gemv_tokens::<1>(m, p, t, y, ldy, r0, r1),
                }
                t += k;
            }
        }
    }
}

/// How far ahead (in rows) the GEMV prefetches packed weights. The prefetch asks for L2 (`T1`),
/// not L1: on a 2-core AMD EPYC (Zen 4) one thread streamed 11.4 GB/s of codes with `T0` and
/// 13.5-15.0 GB/s with `T1`, and decode of a 6-layer Gemma 4 26B cut went from 26.5-28.1 to
/// 35.0-36.5 tok/s (docs/BENCHMARKS.md, "CPU, twentieth session"); without any prefetch 7.8 GB/s.
const PF_ROWS: usize = 8;

/// Tokens per pass of the GEMV (below the lane GEMM's `Q16_MIN_ROWS`): four rows by four tokens
/// hold 16 integer accumulators of the 32 registers.
const TOKENS: usize = 4;

/// The f32 side of one group for one (row, token): `acc = fma(isum, scale · d, acc)`, then
/// `acc = fma(bias, sum, acc)` (the GEMM's lanes do the same, lane by lane). `avx2i16` takes this
/// step too, so the int16 tables share their f32 numerics.
#[inline(always)]
pub(super) fn group_step(
    acc: f32,
    isum: i32,
    (scale, bias): (f32, f32),
    (d, sum): (f32, f32),
) -> f32 {
    let acc = (isum as f32).mul_add(scale * d, acc);
    bias.mul_add(sum, acc)
}

/// Rows `r..r+R` for tokens `t0..t0+T` of a [`XLayout::Q16EvenOdd64`] activation: per 64
/// columns, 32 packed bytes widened to 16-bit lanes once, their low nibbles against the even half
/// of each token's x and their high nibbles against the odd half, two `vpdpwssd` per token into
/// its (row, group) integer sum. Token `t0 + k`'s row `r + i` goes to `y[(t0 + k) · ldy + at + i]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_dot<const R: usize, const T: usize>(
    m: &QMatrix,
    p: &PreparedX,
    t0: usize,
    r: usize,
    y: &mut [f32],
    ldy: usize,
    at: usize,
) {
    let (cols, gs) = (m.cols, m.group_size);
    let gpr = m.groups_per_row();
    let rb = m.row_bytes();
    debug_assert!((r + R) * rb <= m.weight.len() && t0 + T <= p.n);
    debug_assert!((t0 + T - 1) * ldy + at + R <= y.len());
    // SAFETY (pointer arithmetic below): rows r..r+R exist; columns stay below cols, groups below
    // gpr; token t's codes are cols int16 at t · cols.
    let w = unsafe { m.weight.as_ptr().add(r * rb) };
    let x: [*const i16; T] =
        std::array::from_fn(|k| unsafe { p.q16.as_ptr().add((t0 + k) * cols) });
    let (qd, sums) = (
        &p.qd[t0 * gpr..(t0 + T) * gpr],
        &p.sums[t0 * gpr..(t0 + T) * gpr],
    );
    let low = _mm512_set1_epi16(0x0f);
    let mut acc = [[0.0f32; R]; T];
    // R == 4: each token's four rows' f32 totals, and 16 groups' scales and biases,
    // [group][scale, bias][row].
    let mut acc4 = [_mm_setzero_ps(); T];
    let mut sb4 = [[[0.0f32; 4]; 2]; 16];
    let pf = PF_ROWS * rb;
    for g in 0..gpr {
        let mut isum = [[_mm512_setzero_si512(); R]; T];
        for c in 0..gs / 64 {
            let col = g * gs + c * 64;
            // SAFETY: col + 64 <= cols: 64 int16 of each x at col; 32 bytes of each row at col / 2.
            unsafe {
                let xe: [__m512i; T] =
                    std::array::from_fn(|k| _mm512_loadu_si512(x[k].add(col) as *const __m512i));
                let xo: [__m512i; T] = std::array::from_fn(|k| {
                    _mm512_loadu_si512(x[k].add(col + 32) as *const __m512i)
                });
                for i in 0..R {
                    _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(pf + i * rb + col / 2) as *const i8);
                    let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        w.add(i * rb + col / 2) as *const __m256i
                    ));
                    let e = _mm512_and_si512(v, low);
                    let o = _mm512_srli_epi16::<4>(v);
                    for k in 0..T {
                        isum[k][i] = _mm512_dpwssd_epi32(isum[k][i], e, xe[k]);
                        isum[k][i] = _mm512_dpwssd_epi32(isum[k][i], o, xo[k]);
                    }
                }
            }
        }
        if R == 4 {
            // Four rows at once: their integer sums added across lanes together, then the f32
            // side of the four as one 4-lane vector (lane by lane, `group_step`).
            if g % 16 == 0 {
                let k = avx512::tail_mask((gpr - g).min(16));
                super::prefetch_scales(m, r + PF_ROWS, g, R);
                let mut rows = [[[0.0f32; 16]; 2]; 4];
                for (i, row) in rows.iter_mut().enumerate() {
                    let at = ((r + i) * gpr + g) * 2;
                    // SAFETY: groups g..min(g+16, gpr) of row r + i; masked-off lanes unread.
                    unsafe {
                        let (s16, b16) = (
                            avx512::load_bf16x16(m.scales.as_ptr().add(at), k),
                            avx512::load_bf16x16(m.biases.as_ptr().add(at), k),
                        );
                        _mm512_storeu_ps(row[0].as_mut_ptr(), s16);
                        _mm512_storeu_ps(row[1].as_mut_ptr(), b16);
                    }
                }
                for j in 0..16 {
                    for (i, row) in rows.iter().enumerate() {
                        sb4[j][0][i] = row[0][j];
                        sb4[j][1][i] = row[1][j];
                    }
                }
            }
            let [s4, b4] = sb4[g % 16].map(|v| _mm_loadu_ps(v.as_ptr()));
            for k in 0..T {
                let is = sum4(&isum[k]);
                let sd = _mm_mul_ps(s4, _mm_set1_ps(qd[k * gpr + g]));
                acc4[k] = _mm_fmadd_ps(_mm_cvtepi32_ps(is), sd, acc4[k]);
                acc4[k] = _mm_fmadd_ps(b4, _mm_set1_ps(sums[k * gpr + g]), acc4[k]);
            }
            continue;
        }
        for i in 0..R {
            // SAFETY: group g of row r + i.
            let sb = unsafe {
                let at = ((r + i) * gpr + g) * 2;
                (
                    read_bf16(m.scales.as_ptr().add(at)),
                    read_bf16(m.biases.as_ptr().add(at)),
                )
            };
            for k in 0..T {
                let is = _mm512_reduce_add_epi32(isum[k][i]);
                acc[k][i] = group_step(acc[k][i], is, sb, (qd[k * gpr + g], sums[k * gpr + g]));
            }
        }
    }
    super::store_tokens(&mut acc, &acc4, y, ldy, t0 * ldy + at);
}

/// The sums of the 16 lanes of each of four vectors, as the four lanes of one (integer adds: exact
/// in any order).
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
#[inline]
fn sum4(v: &[__m512i]) -> __m128i {
    let ab = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let cd = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    // Per 128-bit lane: [a, b, c, d] partial sums.
    let abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    let h = _mm256_add_epi32(
        _mm512_castsi512_si256(abcd),
        _mm512_extracti64x4_epi64::<1>(abcd),
    );
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

define_gemv_tokens!("avx512f,avx512bw,avx512vl,avx512vnni,fma");

/// The GEMM over 16-token lanes (the int8 table's driver, with two bytes per code).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn gemm_lanes(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let tiles: LaneTiles = [
        tile::<ROWS, TOKEN_BLOCKS, 2>,
        tile::<ROWS, 1, 2>,
        tile::<1, TOKEN_BLOCKS, 2>,
        tile::<1, 1, 2>,
    ];
    // SAFETY: the caller's contract; two bytes per code.
    unsafe { avx512_vnni::gemm_lanes(m, p, y, (r0, r1), 2, widen_row::<2>, tiles) }
}
