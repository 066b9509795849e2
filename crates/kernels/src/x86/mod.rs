//! x86-64 SIMD kernel tables: AVX2 (+FMA, F16C), AVX-512 (F/BW/VL), and AVX-512 VNNI with int16 activations (`avx512_q16.rs`, and its prompt GEMM on AMX tiles, `amx.rs`) or an int8 prefill GEMM (`avx512_vnni.rs`). Each table is reachable only through
//! [`available`], which checks the CPU features first: that check is what makes the `unsafe` calls from the
//! table's safe wrappers into `#[target_feature]` functions sound.

// Register-tile loops index several arrays (accumulators, loaded vectors, outputs) in lockstep.
#![allow(clippy::needless_range_loop)]

use std::cell::RefCell;

use crate::dispatch::Kernels;

/// Defines the including int16 table's `gemv_tokens::<T>`: rows `[r0, r1)` of `W x` for tokens
/// `t0..t0+T` into `y` (token `t` at `t · ldy`), blocks of 4 rows then single rows over its
/// `rows_dot::<R, T>`, compiled with that file's target features.
macro_rules! define_gemv_tokens {
    ($features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn gemv_tokens<const T: usize>(
            m: &QMatrix,
            p: &PreparedX,
            t0: usize,
            y: &mut [f32],
            ldy: usize,
            r0: usize,
            r1: usize,
        ) {
            let mut r = r0;
            // SAFETY (calls below): r..r+R <= r1 <= rows; y has n · ldy entries.
            while r + 4 <= r1 {
                unsafe { rows_dot::<4, T>(m, p, t0, r, y, ldy, r - r0) };
                r += 4;
            }
            while r < r1 {
                unsafe { rows_dot::<1, T>(m, p, t0, r, y, ldy, r - r0) };
                r += 1;
            }
        }
    };
}

/// Defines the including file's `gemv_impl` (dispatch on the matrix's bits) and `gemv_bits::<BITS>` (blocks
/// of `$rows` rows, then single rows) over its `rows_dot::<R, BITS>`, compiled with that file's target features.
macro_rules! define_gemv {
    ($features:literal, $rows:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn gemv_impl(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
            // SAFETY: the caller's contract, passed on.
            unsafe {
                match m.bits {
                    4 => gemv_bits::<4>(m, p, y, r0, r1),
                    2 => gemv_bits::<2>(m, p, y, r0, r1),
                    _ => gemv_bits::<8>(m, p, y, r0, r1),
                }
            }
        }

        /// Rows `[r0, r1)` of `W x` for `BITS`-bit codes, 4 rows per register block.
        #[target_feature(enable = $features)]
        unsafe fn gemv_bits<const BITS: u32>(
            m: &QMatrix,
            p: &PreparedX,
            y: &mut [f32],
            r0: usize,
            r1: usize,
        ) {
            let (x, sums) = (p.row(0), p.sums_row(0));
            let mut r = r0;
            // SAFETY (calls below): r..r+R <= r1 <= rows; y has r1 - r0 entries.
            while r + $rows <= r1 {
                unsafe { rows_dot::<$rows, BITS>(m, x, sums, r, &mut y[r - r0..]) };
                r += $rows;
            }
            while r < r1 {
                unsafe { rows_dot::<1, BITS>(m, x, sums, r, &mut y[r - r0..]) };
                r += 1;
            }
        }
    };
}

mod amx;
mod avx2;
mod avx2_q16;
mod avx512;
mod avx512_q16;
mod avx512_vec;
mod avx512_vnni;

/// SIMD tables this CPU supports, slowest first.
pub(crate) fn available() -> Vec<&'static Kernels> {
    let mut v = Vec::new();
    if avx2::supported() {
        v.push(&avx2::TABLE);
    }
    if avx2_q16::supported() {
        v.push(&avx2_q16::TABLE);
    }
    if avx512::supported() {
        v.push(&avx512::TABLE);
    }
    if avx512_vnni::supported() {
        v.push(&avx512_vnni::TABLE);
    }
    if avx512_q16::supported() {
        v.push(&avx512_q16::TABLE);
    }
    if amx::supported() {
        v.push(&amx::TABLE);
    }
    v
}

/// The AVX-512 [`QuantizeFn`](crate::prepared::QuantizeFn), when the CPU has AVX-512 F/BW/VL.
pub(crate) fn quantizer() -> Option<crate::prepared::QuantizeFn> {
    avx512::supported().then_some(quantize_avx512 as crate::prepared::QuantizeFn)
}

/// The AVX-512 [`Quantize16Fn`](crate::prepared::Quantize16Fn), when the CPU has AVX-512 F/BW/VL.
pub(crate) fn quantizer16() -> Option<crate::prepared::Quantize16Fn> {
    avx512::supported().then_some(quantize16_avx512 as crate::prepared::Quantize16Fn)
}

/// Only handed out by [`quantizer16`], after the feature check.
fn quantize16_avx512(src: &[f32], inv: f32, codes: &mut [i16]) {
    assert!(src.len().is_multiple_of(16) && codes.len() == src.len());
    // SAFETY: AVX-512 F/BW/VL were detected before this function was handed out; lengths checked.
    unsafe { avx512_vnni::quantize_i16(src, inv, codes) }
}

/// Only handed out by [`quantizer`], after the feature check.
fn quantize_avx512(src: &[f32], inv: f32, words: &mut [u32]) {
    assert!(src.len().is_multiple_of(16) && words.len() * 4 == src.len());
    // SAFETY: AVX-512 F/BW/VL were detected before this function was handed out; lengths checked.
    unsafe { avx512_vnni::quantize_i8(src, inv, words) }
}

thread_local! {
    /// Dequantized f32 weight rows for the GEMM (`[rows per tile, cols]`), reused across calls.
    static WTILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with this thread's dequantized-tile buffer of at least `len` floats.
fn with_wtile<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    WTILE.with(|cell| match cell.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0.0);
            }
            f(&mut v[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// bf16 at `p` (little-endian, any alignment) as f32.
///
/// # Safety
/// `p` must be valid for reading 2 bytes.
#[inline(always)]
unsafe fn read_bf16(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes; read_unaligned has no alignment requirement.
    let v = unsafe { (p as *const u16).read_unaligned() };
    f32::from_bits((u16::from_le(v) as u32) << 16)
}

/// Prefetches into L2 the scales and biases of group `g` onward of rows `r..r + n` (the bytes a
/// 64-byte line holds from there): the int16 GEMVs' second stream beside the codes, asked for as
/// far ahead as the codes (their callers pass `r` = the current row + their `PF_ROWS`). Left to the
/// hardware prefetcher they were demand misses at every row block: the avx512i16 GEMV of Gemma 4's
/// expert matrices, streamed from memory, went from 29-34 to 36-45 GB/s on 2 Zen 5 threads with it
/// (docs/BENCHMARKS.md, "CPU, twenty-eighth session"). A prefetch past the matrix is harmless (the
/// address is never dereferenced).
#[inline(always)]
fn prefetch_scales(m: &crate::QMatrix, r: usize, g: usize, n: usize) {
    let gpr = m.groups_per_row();
    for i in 0..n {
        let at = ((r + i) * gpr + g) * 2;
        for h in [m.scales, m.biases] {
            // SAFETY: a prefetch never faults; wrapping_add computes the address without a claim
            // that it is inside the slice.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    h.as_ptr().wrapping_add(at) as *const i8,
                )
            };
        }
    }
}

/// The int16 GEMVs' results of `T` tokens by `R` rows into `y`: token `k`'s rows at
/// `y[k · ldy + at..]` (`at` counts the first token's offset, `t0 · ldy`, too), from `acc4`
/// when `R == 4`, else from `acc`.
#[inline(always)]
fn store_tokens<const R: usize, const T: usize>(
    acc: &mut [[f32; R]; T],
    acc4: &[std::arch::x86_64::__m128; T],
    y: &mut [f32],
    ldy: usize,
    at: usize,
) {
    for k in 0..T {
        if R == 4 {
            // SAFETY: SSE is part of x86-64; acc[k] holds 4 floats when R == 4.
            unsafe { std::arch::x86_64::_mm_storeu_ps(acc[k].as_mut_ptr(), acc4[k]) };
        }
        let o = k * ldy + at;
        y[o..o + R].copy_from_slice(&acc[k]);
    }
}
