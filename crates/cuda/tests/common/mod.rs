//! Helpers shared by the CUDA backend's test binaries: starting a backend on device 0 (or
//! skipping without a driver), error measures, and model-sized quantized matrices.
#![allow(dead_code)]

use std::sync::Arc;

use mference_backend::cpu::ResidentBytes;
use mference_backend::harness::Rng;
use mference_backend::{Op, QRef};
use mference_cuda::{CudaBackend, CudaError};

/// Bits the kernels implement.
pub const BITS: [usize; 3] = [2, 4, 8];

/// A backend on device 0 over `bytes`, or `None` (after saying so) when no driver is installed
/// or the driver sees no GPU.
pub fn start(bytes: &Arc<Vec<u8>>) -> Option<CudaBackend> {
    let resident: ResidentBytes = bytes.clone();
    match CudaBackend::new(0, resident) {
        Ok(be) => Some(be),
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice { count: 0, .. })) => {
            eprintln!("skipped the CUDA backend: {e}");
            None
        }
        Err(e) => panic!("the CUDA driver is present but the backend did not start: {e}"),
    }
}

/// Ops the CUDA backend says it lacks (none since issue 30; the harness checks `supports`
/// against what ran).
pub fn not_yet() -> Vec<&'static str> {
    mference_backend::missing_ops::<CudaBackend>(Op::ALL)
        .into_iter()
        .map(Op::name)
        .collect()
}

/// Records a failure when `got` is further than `budget` from `want`.
pub fn expect(fails: &mut Vec<String>, name: String, got: &[f32], want: &[f32], budget: f64) {
    let e = rel(got, want);
    if e > budget {
        fails.push(format!("{name}: relative error {e:.3e} > {budget:.1e}"));
    }
}

/// `max |got − want| / max(max |want|, 1e-3)`, infinite on a non-finite value.
pub fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let m = want.iter().fold(1e-3f64, |m, &v| m.max(v.abs() as f64));
    let d = got
        .iter()
        .zip(want)
        .fold(0.0f64, |d, (&a, &b)| d.max((a as f64 - b as f64).abs()));
    d / m
}

/// Whether two results differ in any bit.
pub fn bits_differ(a: &[f32], b: &[f32]) -> bool {
    a.iter()
        .map(|v| v.to_bits())
        .ne(b.iter().map(|v| v.to_bits()))
}

/// `n` values uniform in `[-a, a]` (the harness's Rng stream; its helpers are private).
pub fn vals(rng: &mut Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n)
        .map(|_| ((next(rng) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a)
        .collect()
}

/// splitmix64, as the harness's Rng.
pub fn next(r: &mut Rng) -> u64 {
    r.0 = r.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = r.0;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub fn bf16(v: f32) -> [u8; 2] {
    ((v.to_bits() >> 16) as u16).to_le_bytes()
}

/// A model-sized quantized matrix at a 2-byte-aligned (not 4-byte) offset of `buf`.
pub fn qmatrix(
    buf: &mut Vec<u8>,
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    bits: usize,
    gs: usize,
) -> QRef {
    let pad = |b: &mut Vec<u8>| {
        while b.len() % 4 != 2 {
            b.push(0)
        }
    };
    pad(buf);
    let w0 = buf.len();
    let wlen = rows * cols * bits / 8;
    buf.extend((0..wlen).map(|_| next(rng) as u8));
    let groups = rows * cols / gs;
    pad(buf);
    let s0 = buf.len();
    for s in vals(rng, groups, 0.05) {
        buf.extend(bf16(s));
    }
    pad(buf);
    let b0 = buf.len();
    for b in vals(rng, groups, 0.2) {
        buf.extend(bf16(b));
    }
    QRef::from_parts(
        "big",
        rows,
        cols,
        (w0, wlen),
        (s0, 2 * groups),
        (b0, 2 * groups),
        buf.len(),
    )
    .expect("a well-formed matrix")
}
