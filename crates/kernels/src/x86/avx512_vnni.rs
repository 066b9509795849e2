//! AVX-512 with an int8 (VNNI) GEMM for prefill: the exact AVX-512 table, except that 4-bit products
//! over at least `Q8_MIN_ROWS` tokens quantize the activations to int8 per token and weight group
//! (`d = max|x| / 127`, as ggml's Q8 blocks) and multiply them with the unsigned 4-bit codes by
//! `vpdpbusd`: 64 multiply-adds per instruction against 16 for an f32 FMA.
//!
//! Layout: 16 tokens share a register (one i32 lane each, [`XLayout::Q8Lanes16`]); 4 consecutive codes
//! of one weight row are broadcast to every lane. Per weight group and lane the integer dot product
//! `Σ q·x8` is exact; the group then adds `scale · d · Σ q·x8 + bias · Σ x` in f32, with `Σ x` the exact
//! f32 group sum. The only approximation is the rounding of x to 255 levels of its group's max|x|.
//!
//! Per (row, token) the operation sequence does not depend on the register block, so results are
//! bit-identical however rows are split across calls or threads.
//!
//! 2- and 8-bit matrices never take the int8 path ([`Kernels::layout_for`] gives them no `Q8Lanes16`
//! layout): their GEMV and GEMM are the exact AVX-512 ones.

use std::arch::x86_64::*;

use super::{avx512, read_bf16, with_wtile};
use crate::dispatch::Kernels;
use crate::prepared::{PreparedX, XLayout};
use crate::QMatrix;

pub(super) fn supported() -> bool {
    avx512::supported() && is_x86_feature_detected!("avx512vnni")
}

/// Only reachable after [`supported`] returned true (see `super::available`).
pub(super) static TABLE: Kernels = Kernels {
    name: "avx512vnni",
    q8: true,
    rounding: Some("int8 prefill activations"),
    gemm,
    ..avx512::EXACT
};

fn gemm(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    if TABLE.layout_for(m.bits, m.group_size, p.n) != XLayout::Q8Lanes16 {
        return avx512::gemm(m, p, y, r0, r1);
    }
    p.check(m, XLayout::Q8Lanes16);
    // SAFETY: AVX-512F/BW/VL, VNNI and FMA are present (the table is handed out only after
    // `supported()`); the caller checked r0 <= r1 <= rows and y.len() == n · (r1 - r0).
    unsafe { gemm_q8(m, p, y, r0, r1) }
}

/// Weight rows per register block (each broadcast feeds `TOKEN_BLOCKS` accumulators).
pub(super) const ROWS: usize = 4;
/// 16-token lane groups per register block: ROWS · TOKEN_BLOCKS integer sums plus as many f32
/// accumulators stay in the 32 zmm registers.
pub(super) const TOKEN_BLOCKS: usize = 2;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
unsafe fn gemm_q8(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let tiles: LaneTiles = [
        tile::<ROWS, TOKEN_BLOCKS, 4>,
        tile::<ROWS, 1, 4>,
        tile::<1, TOKEN_BLOCKS, 4>,
        tile::<1, 1, 4>,
    ];
    // SAFETY: the caller's contract; one byte per code.
    unsafe { gemm_lanes(m, p, y, (r0, r1), 1, widen_row::<4>, tiles) }
}

/// A lane tile `(m, p, widened codes, row, first token block, y, r0, r1)`.
pub(super) type LaneTile =
    unsafe fn(&QMatrix, &PreparedX, *const u8, usize, usize, &mut [f32], usize, usize);
/// The tiles of [`ROWS`] × [`TOKEN_BLOCKS`], [`ROWS`] × 1, 1 × [`TOKEN_BLOCKS`] and 1 × 1.
pub(super) type LaneTiles = [LaneTile; 4];

/// The GEMM over 16-token lanes shared by the int8 and int16 tables: per block of [`ROWS`] weight
/// rows, their codes widened by `widen` (`code_bytes` bytes per column) into a tile buffer, then
/// every token block through `tiles`.
pub(super) unsafe fn gemm_lanes(
    m: &QMatrix,
    p: &PreparedX,
    y: &mut [f32],
    (r0, r1): (usize, usize),
    code_bytes: usize,
    widen: unsafe fn(&QMatrix, usize, *mut u8),
    tiles: LaneTiles,
) {
    let (cols, blocks) = (m.cols, p.n.div_ceil(16));
    let stride = cols * code_bytes;
    with_wtile(ROWS * stride / 4, |buf| {
        let codes = buf.as_mut_ptr() as *mut u8;
        let mut r = r0;
        while r < r1 {
            let rb = (r1 - r).min(ROWS);
            for i in 0..rb {
                // SAFETY: row r + i < rows; the buffer holds ROWS · stride bytes.
                unsafe { widen(m, r + i, codes.add(i * stride)) };
            }
            let mut b = 0;
            while b < blocks {
                let bb = (blocks - b).min(TOKEN_BLOCKS);
                // SAFETY: rows r..r+rb are widened; token blocks b..b+bb exist in `p`.
                unsafe {
                    match (rb, bb) {
                        (ROWS, TOKEN_BLOCKS) => tiles[0](m, p, codes, r, b, y, r0, r1),
                        (ROWS, _) => tiles[1](m, p, codes, r, b, y, r0, r1),
                        (_, TOKEN_BLOCKS) => {
                            for i in 0..rb {
                                let c = codes.add(i * stride);
                                tiles[2](m, p, c, r + i, b, y, r0, r1);
                            }
                        }
                        _ => {
                            for i in 0..rb {
                                tiles[3](m, p, codes.add(i * stride), r + i, b, y, r0, r1);
                            }
                        }
                    }
                }
                b += bb;
            }
            r += rb;
        }
    })
}

/// Row `r`'s 4-bit codes widened in column order (a packed byte holds columns 2j, 2j+1 in its
/// low, high nibble) to one byte each (`K = 4`, the int8 tile's) or one int16 each (`K = 2`).
/// `cols` is a multiple of 64 (the group size).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn widen_row<const K: usize>(m: &QMatrix, r: usize, dst: *mut u8) {
    let rb = m.row_bytes();
    for j in (0..rb).step_by(8 * K) {
        // SAFETY: 8 · K bytes of row r at j (rb is a multiple of 32); 64 bytes of `dst` at
        // 2j · (4 / K) (a packed byte's 2 codes, 8 / K bytes).
        unsafe {
            let w = if K == 4 {
                let v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                    m.weight.as_ptr().add(r * rb + j) as *const __m256i
                ));
                _mm512_or_si512(
                    _mm512_and_si512(v, _mm512_set1_epi16(0x000f)),
                    _mm512_and_si512(_mm512_slli_epi16::<4>(v), _mm512_set1_epi16(0x0f00)),
                )
            } else {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                    m.weight.as_ptr().add(r * rb + j) as *const __m128i
                ));
                _mm512_or_si512(
                    _mm512_and_si512(v, _mm512_set1_epi32(0x0000_000f)),
                    _mm512_and_si512(_mm512_slli_epi32::<12>(v), _mm512_set1_epi32(0x000f_0000)),
                )
            };
            _mm512_storeu_si512(dst.add(j * 8 / K) as *mut __m512i, w);
        }
    }
}

/// Outputs of rows `r..r+R` (widened codes at `codes`: 4 bytes per `K` columns, so `4 · cols / K`
/// bytes per row) for the 16-token blocks `b..b+T`, written to `y[t, row - r0]` for tokens `t < n`.
/// Per `K` columns, one 4-byte broadcast of a row's codes meets 64 bytes of activations per block
/// (16 tokens × `K` codes): `K = 4` is int8 (`vpdpbusd`, `p.q`), `K = 2` int16 (`vpdpwssd`,
/// `p.q16`), each into exact integer sums per (row, token, group).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile<const R: usize, const T: usize, const K: usize>(
    m: &QMatrix,
    p: &PreparedX,
    codes: *const u8,
    r: usize,
    b: usize,
    y: &mut [f32],
    r0: usize,
    r1: usize,
) {
    let (cols, gs) = (m.cols, m.group_size);
    let steps = cols / K;
    let q = if K == 4 {
        p.q.as_ptr() as *const u8
    } else {
        p.q16.as_ptr() as *const u8
    };
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for g in 0..m.groups_per_row() {
        let mut isum = [[_mm512_setzero_si512(); T]; R];
        for c in g * gs / K..(g + 1) * gs / K {
            // SAFETY: blocks b..b+T hold steps · 64 bytes each; columns K·c..K·c+K < cols.
            let xv: [__m512i; T] = std::array::from_fn(|j| unsafe {
                _mm512_loadu_si512(q.add(((b + j) * steps + c) * 64) as *const __m512i)
            });
            for i in 0..R {
                // SAFETY: row i of the widened codes has 4 · steps bytes.
                let w = unsafe { (codes.add((i * steps + c) * 4) as *const i32).read_unaligned() };
                let wb = _mm512_set1_epi32(w);
                for j in 0..T {
                    isum[i][j] = if K == 4 {
                        _mm512_dpbusd_epi32(isum[i][j], wb, xv[j])
                    } else {
                        _mm512_dpwssd_epi32(isum[i][j], wb, xv[j])
                    };
                }
            }
        }
        // SAFETY: rows r..r+R and blocks b..b+T exist (the caller's contract).
        unsafe { add_groups_lanes(m, p, r, b, g, &isum, &mut acc) };
    }
    store_lanes(p, &acc, r, b, y, r0, r1);
}

/// The f32 side of group `g` for rows `r..r+R` and the 16-token blocks `b..b+T` (lanes): per lane
/// `acc = fma(isum, scale · d, acc)`, then `acc = fma(bias, Σ x, acc)`, with `d` and `Σ x` from
/// `p.qd` / `p.sums` (`[block][group][16]`). Shared by the int8 and the int16 GEMM.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
#[inline]
unsafe fn add_groups_lanes<const R: usize, const T: usize>(
    m: &QMatrix,
    p: &PreparedX,
    r: usize,
    b: usize,
    g: usize,
    isum: &[[__m512i; T]; R],
    acc: &mut [[__m512; T]; R],
) {
    let gpr = m.groups_per_row();
    for i in 0..R {
        // SAFETY: group g of row r + i.
        let (s, bias) = unsafe {
            let at = ((r + i) * gpr + g) * 2;
            (
                read_bf16(m.scales.as_ptr().add(at)),
                read_bf16(m.biases.as_ptr().add(at)),
            )
        };
        for j in 0..T {
            let at = ((b + j) * gpr + g) * 16;
            // SAFETY: qd and sums hold [blocks, gpr, 16] floats.
            let (d, sum) = unsafe {
                (
                    _mm512_loadu_ps(p.qd.as_ptr().add(at)),
                    _mm512_loadu_ps(p.sums.as_ptr().add(at)),
                )
            };
            let sd = _mm512_mul_ps(_mm512_set1_ps(s), d);
            acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][j]), sd, acc[i][j]);
            acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(bias), sum, acc[i][j]);
        }
    }
}

/// Writes the lanes `acc[i][j]` (row r + i, tokens of block b + j) to `y[t, row - r0]` for tokens
/// `t < n`.
#[target_feature(enable = "avx512f")]
#[inline]
fn store_lanes<const R: usize, const T: usize>(
    p: &PreparedX,
    acc: &[[__m512; T]; R],
    r: usize,
    b: usize,
    y: &mut [f32],
    r0: usize,
    r1: usize,
) {
    let ldy = r1 - r0;
    for j in 0..T {
        let t0 = (b + j) * 16;
        let lanes = (p.n - t0).min(16);
        for i in 0..R {
            let mut out = [0.0f32; 16];
            // SAFETY: 16 floats of `out`.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), acc[i][j]) };
            for (l, &v) in out[..lanes].iter().enumerate() {
                y[(t0 + l) * ldy + r + i - r0] = v;
            }
        }
    }
}

/// `words[i]` = the 4 int8 codes `round(src[4i..4i+4] · inv)` (|src · inv| <= 127; round to
/// nearest, ties to even, as the MXCSR default the conversion uses). `src.len()` is a multiple of
/// 16 and `words.len() · 4 == src.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_i8(src: &[f32], inv: f32, words: &mut [u32]) {
    let s = _mm512_set1_ps(inv);
    for (i, c) in src.chunks_exact(16).enumerate() {
        // SAFETY: 16 floats of `c`; 16 bytes = words 4i..4i+4, inside `words` (checked lengths).
        unsafe {
            let v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), s));
            _mm_storeu_si128(
                words.as_mut_ptr().add(4 * i) as *mut __m128i,
                _mm512_cvtsepi32_epi8(v),
            );
        }
    }
}

/// `codes[i] = round(src[i] · inv)` as int16 (|src · inv| <= 32767; round to nearest, ties to even,
/// as the MXCSR default the conversion uses). `src.len()` is a multiple of 16 and equals `codes.len()`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_i16(src: &[f32], inv: f32, codes: &mut [i16]) {
    let s = _mm512_set1_ps(inv);
    for (i, c) in src.chunks_exact(16).enumerate() {
        // SAFETY: 16 floats of `c`; 16 int16 of `codes` at 16i (checked lengths).
        unsafe {
            let v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), s));
            _mm256_storeu_si256(
                codes.as_mut_ptr().add(16 * i) as *mut __m256i,
                _mm512_cvtsepi32_epi16(v),
            );
        }
    }
}
