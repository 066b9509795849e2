//! x86-64 SIMD kernel tables: AVX2 (+FMA, F16C), AVX-512 (F/BW/VL) and AVX-512 with a VNNI int8 GEMM for prefill. Each table is reachable only through
//! [`available`], which checks the CPU features first: that check is what makes the `unsafe` calls from the
//! table's safe wrappers into `#[target_feature]` functions sound.

// Register-tile loops index several arrays (accumulators, loaded vectors, outputs) in lockstep.
#![allow(clippy::needless_range_loop)]

use std::cell::RefCell;

use crate::dispatch::Kernels;

mod avx2;
mod avx512;
mod avx512_vnni;

/// SIMD tables this CPU supports, slowest first.
pub(crate) fn available() -> Vec<&'static Kernels> {
    let mut v = Vec::new();
    if avx2::supported() {
        v.push(&avx2::TABLE);
    }
    if avx512::supported() {
        v.push(&avx512::TABLE);
    }
    if avx512_vnni::supported() {
        v.push(&avx512_vnni::TABLE);
    }
    v
}

/// The AVX-512 [`QuantizeFn`](crate::prepared::QuantizeFn), when the CPU has AVX-512 F/BW/VL.
pub(crate) fn quantizer() -> Option<crate::prepared::QuantizeFn> {
    avx512::supported().then_some(quantize_avx512 as crate::prepared::QuantizeFn)
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
