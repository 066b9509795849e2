//! AVX2 with int16 activations, `--kernels avx2i16`: the `avx512i16` products for CPUs without
//! AVX-512 (AMD Zen 2/3, Intel client cores). Each token's weight group of x is quantized to int16
//! as there (`d = max|x| / 32767`), the 4-bit codes meet it through `vpmaddwd` (16 multiply-adds per
//! instruction into int32 lanes; the exact table converts every code to f32 for an 8-wide FMA),
//! and per (row, token) and group the exact integer sum goes through `avx512i16`'s f32 steps,
//! `acc = fma(Σ q·x16, scale · d, acc)` then `acc = fma(bias, Σ x, acc)`, groups in order (so
//! `avx512i16`'s bits by construction; not yet compared on a CPU that runs both). 2- and 8-bit
//! matrices, and groups of 32, use the exact AVX2 kernels.
//!
//! Fewer than [`LANES_FROM`] tokens ([`XLayout::Q16Nib64`]) go through the GEMV, two tokens
//! per pass over the rows (each row's codes unpacked once for both); more
//! ([`XLayout::Q16Lanes16`]) through a GEMM with 8 tokens per register, each row's codes widened
//! once to int16 pairs and broadcast against every block of 16 tokens (a block of 8 or fewer
//! skips its upper register). Both take the same f32 steps
//! per token, so a token's result does not depend on its batch.

use std::arch::x86_64::*;

use super::avx512_q16::group_step;
use super::{avx2, with_wtile};
use crate::dispatch::Kernels;
use crate::prepared::{PreparedX, XLayout};
use crate::QMatrix;

pub(super) fn supported() -> bool {
    avx2::supported()
}

/// Only reachable after [`supported`] returned true (see `super::available`).
pub(super) static TABLE: Kernels = Kernels {
    name: "avx2i16",
    q16: true,
    q16_lanes: Some(LANES_FROM),
    q16_gemv: XLayout::Q16Nib64,
    rounding: Some("int16 activations"),
    gemv: gemm,
    gemm,
    ..avx2::TABLE
};

/// Fewest tokens for the lane GEMM (fewer take the GEMV, two tokens a pass). One thread of an AMD
/// Zen 3, 704 x 2,816 codes (`bench_kernels only=gemm`), GFLOP/s of the GEMV's two-token passes
/// against the lane GEMM: 5 tokens 53 vs 42, 6 56 vs 50, 7 54 vs 57, 8 55 vs 65.
const LANES_FROM: usize = 7;

/// Tokens per pass of the GEMV over the rows (four rows x two tokens: 8 integer accumulators of
/// the 16 registers).
const TOKENS: usize = 2;

/// How far ahead (in rows) the GEMV prefetches packed weights.
const PF_ROWS: usize = 8;

/// Weight rows per tile of the lane GEMM (4 rows x 2 registers of 8 tokens: 8 accumulators).
const LANE_ROWS: usize = 4;

fn gemm(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let layout = TABLE.layout_for(m.bits, m.group_size, p.n);
    if !matches!(layout, XLayout::Q16Nib64 | XLayout::Q16Lanes16) {
        return if p.n == 1 {
            avx2::gemv(m, p, y, r0, r1)
        } else {
            avx2::gemm(m, p, y, r0, r1)
        };
    }
    p.check(m, layout);
    // SAFETY (calls below): AVX2 and FMA are present (the table is handed out only after
    // `supported()`); the caller checked r0 <= r1 <= rows and y.len() == n · (r1 - r0).
    if layout == XLayout::Q16Lanes16 {
        return unsafe { gemm_lanes(m, p, y, r0, r1) };
    }
    let ldy = r1 - r0;
    let mut t = 0;
    while t < p.n {
        let k = (p.n - t).min(TOKENS);
        unsafe {
            if k == 2 {
                gemv_tokens::<2>(m, p, t, y, ldy, r0, r1)
            } else {
                gemv_tokens::<1>(m, p, t, y, ldy, r0, r1)
            }
        }
        t += k;
    }
}

define_gemv_tokens!("avx2,fma");

/// Rows `r..r+R` for tokens `t0..t0+T` of a [`XLayout::Q16Nib64`] activation: per 64 columns
/// and row, 32 packed bytes read as 16-bit lanes (columns 4j..4j+3 of lane j at bits 0, 4, 8, 12),
/// shifted by 4k and masked to the codes of columns `≡ k (mod 4)`, each against the k-th run of 16
/// int16 of x by `vpmaddwd` into the (token, row) integer sum of the group; then [`group_step`].
/// Token `t`'s row `r + i` goes to `y[t · ldy + at + i]`.
#[target_feature(enable = "avx2,fma")]
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
    let qd = &p.qd[t0 * gpr..(t0 + T) * gpr];
    let sums = &p.sums[t0 * gpr..(t0 + T) * gpr];
    let low = _mm256_set1_epi16(0x0f);
    let mut acc = [[0.0f32; R]; T];
    // R == 4: each token's four rows' f32 totals as one 4-lane vector, and the four rows' scales
    // and biases of 8 groups, [group][scale, bias][row].
    let mut acc4 = [_mm_setzero_ps(); T];
    let mut sb4 = [[[0.0f32; 4]; 2]; 8];
    let pf = PF_ROWS * rb;
    for g in 0..gpr {
        let mut isum = [[_mm256_setzero_si256(); R]; T];
        for c in 0..gs / 64 {
            let col = g * gs + c * 64;
            for i in 0..R {
                _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(pf + i * rb + col / 2) as *const i8);
                // SAFETY: col + 64 <= cols: bytes col/2.. + 32 of row r + i; 64 int16 of each x
                // at col.
                unsafe {
                    let v = _mm256_loadu_si256(w.add(i * rb + col / 2) as *const __m256i);
                    let a = [
                        _mm256_and_si256(v, low),
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
                        _mm256_and_si256(_mm256_srli_epi16::<8>(v), low),
                        _mm256_srli_epi16::<12>(v),
                    ];
                    for k in 0..T {
                        let xk =
                            |j: usize| _mm256_loadu_si256(x[k].add(col + 16 * j) as *const __m256i);
                        let s = _mm256_add_epi32(
                            _mm256_add_epi32(
                                _mm256_madd_epi16(a[0], xk(0)),
                                _mm256_madd_epi16(a[1], xk(1)),
                            ),
                            _mm256_add_epi32(
                                _mm256_madd_epi16(a[2], xk(2)),
                                _mm256_madd_epi16(a[3], xk(3)),
                            ),
                        );
                        isum[k][i] = _mm256_add_epi32(isum[k][i], s);
                    }
                }
            }
        }
        if R == 4 {
            if g % 8 == 0 {
                super::prefetch_scales(m, r + PF_ROWS, g, R);
                // SAFETY: groups g..min(g + 8, gpr) of rows r..r+4.
                unsafe { scales_biases4(m, r, g, &mut sb4) };
            }
            let s4 = _mm_loadu_ps(sb4[g % 8][0].as_ptr());
            let b4 = _mm_loadu_ps(sb4[g % 8][1].as_ptr());
            for k in 0..T {
                // `group_step` lane by lane for the four rows.
                let is = sum4(&isum[k]);
                let sd = _mm_mul_ps(s4, _mm_set1_ps(qd[k * gpr + g]));
                acc4[k] = _mm_fmadd_ps(_mm_cvtepi32_ps(is), sd, acc4[k]);
                acc4[k] = _mm_fmadd_ps(b4, _mm_set1_ps(sums[k * gpr + g]), acc4[k]);
            }
            continue;
        }
        for i in 0..R {
            let sb = (m.scale(r + i, g), m.bias(r + i, g));
            for k in 0..T {
                let is = hsum(isum[k][i]);
                acc[k][i] = group_step(acc[k][i], is, sb, (qd[k * gpr + g], sums[k * gpr + g]));
            }
        }
    }
    super::store_tokens(&mut acc, &acc4, y, ldy, t0 * ldy + at);
}

/// Scales and biases of groups `g..g+8` of rows `r..r+4` as `[group][scale, bias][row]` (groups
/// past the row's end left as they were).
///
/// # Safety
/// Rows `r..r+4` and group `g` exist.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn scales_biases4(m: &QMatrix, r: usize, g: usize, out: &mut [[[f32; 4]; 2]; 8]) {
    let gpr = m.groups_per_row();
    if g + 8 > gpr {
        for (j, o) in out.iter_mut().enumerate().take(gpr - g) {
            for i in 0..4 {
                o[0][i] = m.scale(r + i, g + j);
                o[1][i] = m.bias(r + i, g + j);
            }
        }
        return;
    }
    for (h, src) in [m.scales, m.biases].iter().enumerate() {
        // Four rows of 8 bf16 widened to f32, then transposed: each 128-bit half of `t[j]` is one
        // group's four rows (group j in the low half, j + 4 in the high one).
        let v: [__m256; 4] = std::array::from_fn(|i| {
            // SAFETY: groups g..g+8 <= gpr of row r + i: 16 bytes.
            let b = unsafe {
                _mm_loadu_si128(src.as_ptr().add(((r + i) * gpr + g) * 2) as *const __m128i)
            };
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(b)))
        });
        let ab_lo = _mm256_unpacklo_ps(v[0], v[1]);
        let ab_hi = _mm256_unpackhi_ps(v[0], v[1]);
        let cd_lo = _mm256_unpacklo_ps(v[2], v[3]);
        let cd_hi = _mm256_unpackhi_ps(v[2], v[3]);
        let t = [
            _mm256_shuffle_ps::<0x44>(ab_lo, cd_lo),
            _mm256_shuffle_ps::<0xee>(ab_lo, cd_lo),
            _mm256_shuffle_ps::<0x44>(ab_hi, cd_hi),
            _mm256_shuffle_ps::<0xee>(ab_hi, cd_hi),
        ];
        for (j, tj) in t.iter().enumerate() {
            _mm_storeu_ps(out[j][h].as_mut_ptr(), _mm256_castps256_ps128(*tj));
            _mm_storeu_ps(out[j + 4][h].as_mut_ptr(), _mm256_extractf128_ps::<1>(*tj));
        }
    }
}

/// The sum of the 8 lanes of `v` (integer adds: exact in any order).
#[target_feature(enable = "avx2")]
#[inline]
fn hsum(v: __m256i) -> i32 {
    let h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32::<0b01>(h)))
}

/// The sums of the 8 lanes of each of four vectors, as the four lanes of one.
#[target_feature(enable = "avx2")]
#[inline]
fn sum4(v: &[__m256i]) -> __m128i {
    let ab = _mm256_add_epi32(
        _mm256_unpacklo_epi32(v[0], v[1]),
        _mm256_unpackhi_epi32(v[0], v[1]),
    );
    let cd = _mm256_add_epi32(
        _mm256_unpacklo_epi32(v[2], v[3]),
        _mm256_unpackhi_epi32(v[2], v[3]),
    );
    // Per 128-bit half: [a, b, c, d] partial sums.
    let abcd = _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd));
    _mm_add_epi32(
        _mm256_castsi256_si128(abcd),
        _mm256_extracti128_si256::<1>(abcd),
    )
}

/// The GEMM over [`XLayout::Q16Lanes16`] activations: per tile of [`LANE_ROWS`] weight rows, their
/// codes widened to int32 words of two int16 codes (columns 2k, 2k+1) in a thread-local buffer,
/// then every block of 16 tokens through [`lane_tile`].
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_lanes(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    let pairs = m.cols / 2;
    let blocks = p.n.div_ceil(16);
    with_wtile(LANE_ROWS * pairs, |buf| {
        // The f32 buffer holds the int32 words (same size and alignment).
        let words = buf.as_mut_ptr() as *mut i32;
        let mut r = r0;
        while r < r1 {
            let rn = (r1 - r).min(LANE_ROWS);
            for i in 0..rn {
                // SAFETY: row r + i < rows; the buffer holds LANE_ROWS · pairs words.
                unsafe { widen_pairs(m, r + i, words.add(i * pairs)) };
            }
            for b in 0..blocks {
                // A block of at most 8 tokens (the last) skips its empty upper register.
                let full = p.n - b * 16 > 8;
                // SAFETY: rows r..r+rn are widened; token block b exists in `p`.
                unsafe {
                    match (rn == LANE_ROWS, full) {
                        (true, true) => lane_tile::<LANE_ROWS, 2>(m, p, words, r, b, y, r0, r1),
                        (true, false) => lane_tile::<LANE_ROWS, 1>(m, p, words, r, b, y, r0, r1),
                        (false, _) => {
                            for i in 0..rn {
                                let w = words.add(i * pairs);
                                if full {
                                    lane_tile::<1, 2>(m, p, w, r + i, b, y, r0, r1);
                                } else {
                                    lane_tile::<1, 1>(m, p, w, r + i, b, y, r0, r1);
                                }
                            }
                        }
                    }
                }
            }
            r += rn;
        }
    })
}

/// Row `r`'s 4-bit codes as `cols / 2` int32 words `code(2k) | code(2k + 1) << 16` at `dst` (a
/// packed byte k holds columns 2k, 2k + 1 in its low, high nibble).
///
/// # Safety
/// Row `r` exists; `dst` has room for `cols / 2` words.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn widen_pairs(m: &QMatrix, r: usize, dst: *mut i32) {
    let rb = m.row_bytes();
    let low = _mm256_set1_epi32(0x0f);
    for k in (0..rb).step_by(8) {
        // SAFETY: 8 bytes of row r at k (rb is a multiple of 32); 8 words of dst at k.
        unsafe {
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                m.weight.as_ptr().add(r * rb + k) as *const __m128i
            ));
            let w = _mm256_or_si256(
                _mm256_and_si256(v, low),
                _mm256_slli_epi32::<16>(_mm256_srli_epi32::<4>(v)),
            );
            _mm256_storeu_si256(dst.add(k) as *mut __m256i, w);
        }
    }
}

/// Rows `r..r+R` (widened words at `words`, `cols / 2` a row) against the first `8 · H` tokens of
/// block `b`: per column pair one broadcast word, `vpmaddwd` against the tokens' int16 pairs (`H`
/// registers of 8), the group's exact integer sums per token lane, then [`group_step`] lane by
/// lane.
#[target_feature(enable = "avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn lane_tile<const R: usize, const H: usize>(
    m: &QMatrix,
    p: &PreparedX,
    words: *const i32,
    r: usize,
    b: usize,
    y: &mut [f32],
    r0: usize,
    r1: usize,
) {
    let (cols, gs) = (m.cols, m.group_size);
    let gpr = m.groups_per_row();
    let pairs = cols / 2;
    let ldy = r1 - r0;
    // SAFETY (pointer arithmetic below): block b's codes are 16 · cols int16, pair k at 32k; its
    // qd and sums 16 per group; the widened rows hold `pairs` words each.
    let x = unsafe { p.q16.as_ptr().add(b * 16 * cols) };
    let (qd, sums) = (
        &p.qd[b * gpr * 16..(b + 1) * gpr * 16],
        &p.sums[b * gpr * 16..(b + 1) * gpr * 16],
    );
    let mut acc = [[_mm256_setzero_ps(); H]; R];
    for g in 0..gpr {
        let mut isum = [[_mm256_setzero_si256(); H]; R];
        for k in g * gs / 2..(g + 1) * gs / 2 {
            // SAFETY: pair k < pairs of the block and of each widened row.
            unsafe {
                let xs: [__m256i; H] = std::array::from_fn(|h| {
                    _mm256_loadu_si256(x.add(32 * k + 16 * h) as *const __m256i)
                });
                for i in 0..R {
                    let w = _mm256_set1_epi32(*words.add(i * pairs + k));
                    for h in 0..H {
                        isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_madd_epi16(w, xs[h]));
                    }
                }
            }
        }
        // SAFETY: 16 lanes of group g.
        let (d, s): ([__m256; H], [__m256; H]) = unsafe {
            (
                std::array::from_fn(|h| _mm256_loadu_ps(qd.as_ptr().add(g * 16 + 8 * h))),
                std::array::from_fn(|h| _mm256_loadu_ps(sums.as_ptr().add(g * 16 + 8 * h))),
            )
        };
        for i in 0..R {
            let (scale, bias) = (m.scale(r + i, g), m.bias(r + i, g));
            for h in 0..H {
                // `group_step` lane by lane: scale · d, then the two FMAs.
                let sd = _mm256_mul_ps(_mm256_set1_ps(scale), d[h]);
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), sd, acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(_mm256_set1_ps(bias), s[h], acc[i][h]);
            }
        }
    }
    let tokens = (p.n - b * 16).min(16);
    for (i, a) in acc.iter().enumerate() {
        let mut lanes = [0.0f32; 16];
        for (h, v) in a.iter().enumerate() {
            _mm256_storeu_ps(lanes.as_mut_ptr().wrapping_add(8 * h), *v);
        }
        for (t, v) in lanes.iter().enumerate().take(tokens) {
            y[(b * 16 + t) * ldy + r + i - r0] = *v;
        }
    }
}
