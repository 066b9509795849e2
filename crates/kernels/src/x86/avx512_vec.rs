//! AVX-512 f32 / f16 vector kernels shared by every AVX-512 table: dots, axpys and the f16
//! conversions, and attention's scores and weighted sums over f16 K/V rows (`dots_f16`,
//! `wsum_f16` and their grouped forms for the query heads of one KV head). The quantized products
//! are in `avx512.rs`.

use std::arch::x86_64::*;

use half::f16;

use super::avx512::tail_mask;

// The safe wrappers below are only reachable through the AVX-512 tables, which `super::available`
// hands out only after `avx512::supported()` returned true.
pub(super) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: as for `gemv`; lengths are equal (checked by `Kernels::dot_f32`).
    unsafe { dot_f32_impl(a, b) }
}

pub(super) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { axpy_impl(a, x, y) }
}

pub(super) fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { f32_to_f16_impl(src, dst) }
}

pub(super) fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { f16_to_f32_impl(src, dst) }
}

pub(super) fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { dot_f16_impl(q, k) }
}

pub(super) fn dots_f16(q: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    // SAFETY: AVX-512F/BW/VL, FMA and F16C are present; the caller checked that every row
    // i·stride .. i·stride + q.len() lies inside `rows`.
    unsafe {
        match q.len() {
            128 => dots_f16_regs::<8>(q, rows, stride, out),
            256 => dots_f16_regs::<16>(q, rows, stride, out),
            d => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = dot_f16_impl(q, &rows[i * stride..i * stride + d]);
                }
            }
        }
    }
}

/// [`dots_f16`] for `q.len() == 16·NQ` (NQ even) with the query held in NQ registers; per row the
/// same two accumulators, multiply-adds and final reduction as `dot_f16_impl`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn dots_f16_regs<const NQ: usize>(q: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    debug_assert!(q.len() == 16 * NQ && NQ.is_multiple_of(2));
    let rp = rows.as_ptr() as *const i16;
    // SAFETY: q has 16·NQ floats; row i's 16·NQ elements lie inside `rows` (caller's check).
    unsafe {
        let qv: [__m512; NQ] = std::array::from_fn(|v| _mm512_loadu_ps(q.as_ptr().add(16 * v)));
        for (i, o) in out.iter_mut().enumerate() {
            let r = rp.add(i * stride);
            let mut acc = [_mm512_setzero_ps(); 2];
            for c in 0..NQ / 2 {
                for (k, acc) in acc.iter_mut().enumerate() {
                    let kf = _mm512_cvtph_ps(_mm256_loadu_si256(
                        r.add(32 * c + 16 * k) as *const __m256i
                    ));
                    *acc = _mm512_fmadd_ps(qv[2 * c + k], kf, *acc);
                }
            }
            *o = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        }
    }
}

pub(super) fn wsum_f16(w: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
    let d = out.len();
    // SAFETY: AVX-512F/BW/VL, FMA and F16C are present; the caller checked that every row
    // i·stride .. i·stride + d lies inside `rows`.
    unsafe {
        let mut c0 = 0;
        while c0 + 256 <= d {
            wsum_f16_block::<16>(w, rows, stride, c0, out);
            c0 += 256;
        }
        while c0 + 128 <= d {
            wsum_f16_block::<8>(w, rows, stride, c0, out);
            c0 += 128;
        }
        while c0 + 16 <= d {
            wsum_f16_block::<1>(w, rows, stride, c0, out);
            c0 += 16;
        }
    }
    // The last d % 16 columns, as axpy_f16 computes them.
    if !d.is_multiple_of(16) {
        let c0 = d - d % 16;
        for (i, &wi) in w.iter().enumerate() {
            axpy_f16(wi, &rows[i * stride + c0..i * stride + d], &mut out[c0..]);
        }
    }
}

/// Columns `c0 .. c0 + 16·NB` of [`wsum_f16`], accumulated in NB registers across all rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn wsum_f16_block<const NB: usize>(
    w: &[f32],
    rows: &[f16],
    stride: usize,
    c0: usize,
    out: &mut [f32],
) {
    let (rp, op) = (rows.as_ptr() as *const __m256i, out.as_mut_ptr());
    // SAFETY: c0 + 16·NB <= out.len(); row i's columns c0 .. c0 + 16·NB lie inside `rows`
    // (checked by the caller for the full row width).
    unsafe {
        let mut acc: [__m512; NB] = std::array::from_fn(|v| _mm512_loadu_ps(op.add(c0 + 16 * v)));
        for (i, &wi) in w.iter().enumerate() {
            let a = _mm512_set1_ps(wi);
            let r = (rp as *const i16).add(i * stride + c0);
            for v in 0..NB {
                let vf = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(16 * v) as *const __m256i));
                acc[v] = _mm512_fmadd_ps(a, vf, acc[v]);
            }
        }
        for v in 0..NB {
            _mm512_storeu_ps(op.add(c0 + 16 * v), acc[v]);
        }
    }
}

/// Rows ahead that the grouped attention kernels prefetch.
const KV_PF_ROWS: usize = 8;

/// `Kernels::dots_f16_group` for 2..=8 queries of a width that is a multiple of 32 (false
/// otherwise, and for one query, which `dots_f16` keeps in registers).
pub(super) fn dots_f16_group(
    q: &[f32],
    g: usize,
    rows: &[f16],
    stride: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
) -> bool {
    let d = q.len() / g;
    if !d.is_multiple_of(32) {
        return false;
    }
    // SAFETY: AVX-512F/BW/VL, FMA and F16C are present; `Kernels::dots_f16_group` checked that
    // the n rows of width d and the g outputs of n (ld apart) fit.
    unsafe {
        match g {
            2 => dots_f16_group_impl::<2>(q, d, rows, stride, n, out, ld),
            3 => dots_f16_group_impl::<3>(q, d, rows, stride, n, out, ld),
            4 => dots_f16_group_impl::<4>(q, d, rows, stride, n, out, ld),
            5 => dots_f16_group_impl::<5>(q, d, rows, stride, n, out, ld),
            6 => dots_f16_group_impl::<6>(q, d, rows, stride, n, out, ld),
            7 => dots_f16_group_impl::<7>(q, d, rows, stride, n, out, ld),
            8 => dots_f16_group_impl::<8>(q, d, rows, stride, n, out, ld),
            _ => return false,
        }
    }
    true
}

/// G queries of width d (a multiple of 32) against each row: per (query, row) the same two
/// accumulators, multiply-adds and final reduction as `dot_f16_impl`, the row converted once.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn dots_f16_group_impl<const G: usize>(
    q: &[f32],
    d: usize,
    rows: &[f16],
    stride: usize,
    n: usize,
    out: &mut [f32],
    ld: usize,
) {
    let (rp, qp, op) = (rows.as_ptr() as *const i16, q.as_ptr(), out.as_mut_ptr());
    // SAFETY: q holds G·d floats; row i's d elements lie inside `rows`; (G-1)·ld + n <= out.len()
    // (the caller's checks).
    unsafe {
        for i in 0..n {
            let r = rp.add(i * stride);
            // The rows of one head are a KV row apart (often a page): fetch a few rows ahead.
            let ahead = r.wrapping_add(KV_PF_ROWS * stride);
            for line in (0..d).step_by(32) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
            }
            let mut acc = [[_mm512_setzero_ps(); 2]; G];
            let mut c = 0;
            while c < d {
                for k in 0..2 {
                    let kf =
                        _mm512_cvtph_ps(_mm256_loadu_si256(r.add(c + 16 * k) as *const __m256i));
                    for (h, acc) in acc.iter_mut().enumerate() {
                        let qv = _mm512_loadu_ps(qp.add(h * d + c + 16 * k));
                        acc[k] = _mm512_fmadd_ps(qv, kf, acc[k]);
                    }
                }
                c += 32;
            }
            for (h, acc) in acc.iter().enumerate() {
                *op.add(h * ld + i) = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
            }
        }
    }
}

/// `Kernels::wsum_f16_group` for 2..=8 outputs (false otherwise: one output is `wsum_f16`).
pub(super) fn wsum_f16_group(
    w: &[f32],
    ld: usize,
    n: usize,
    rows: &[f16],
    stride: usize,
    out: &mut [f32],
    g: usize,
) -> bool {
    let d = out.len() / g;
    // SAFETY: AVX-512F/BW/VL, FMA and F16C are present; `Kernels::wsum_f16_group` checked that
    // the n rows of width d and the g weight runs of n (ld apart) fit.
    unsafe {
        match g {
            2 => wsum_f16_group_cols::<2, 8>(w, ld, n, rows, stride, out, d),
            3 => wsum_f16_group_cols::<3, 4>(w, ld, n, rows, stride, out, d),
            4 => wsum_f16_group_cols::<4, 4>(w, ld, n, rows, stride, out, d),
            5 => wsum_f16_group_cols::<5, 2>(w, ld, n, rows, stride, out, d),
            6 => wsum_f16_group_cols::<6, 2>(w, ld, n, rows, stride, out, d),
            7 => wsum_f16_group_cols::<7, 2>(w, ld, n, rows, stride, out, d),
            8 => wsum_f16_group_cols::<8, 2>(w, ld, n, rows, stride, out, d),
            _ => return false,
        }
    }
    // The last d % 16 columns of each output, as axpy_f16 computes them (as in `wsum_f16`).
    if !d.is_multiple_of(16) {
        let c0 = d - d % 16;
        for h in 0..g {
            for i in 0..n {
                let o = &mut out[h * d + c0..(h + 1) * d];
                axpy_f16(w[h * ld + i], &rows[i * stride + c0..i * stride + d], o);
            }
        }
    }
    true
}

/// Columns `0 .. d - d % 16` of G outputs, in blocks of 16·NB then 16 columns, each block's G·NB
/// accumulators kept in registers across all rows: per element the same fused multiply-adds, in
/// row order, as `wsum_f16_block` (so as `axpy_f16` row by row).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn wsum_f16_group_cols<const G: usize, const NB: usize>(
    w: &[f32],
    ld: usize,
    n: usize,
    rows: &[f16],
    stride: usize,
    out: &mut [f32],
    d: usize,
) {
    let mut c0 = 0;
    // SAFETY: the caller's contract, passed on; each block stays below d.
    unsafe {
        while c0 + 16 * NB <= d {
            wsum_f16_group_block::<G, NB>(w, ld, n, rows, stride, out, d, c0);
            c0 += 16 * NB;
        }
        while c0 + 16 <= d {
            wsum_f16_group_block::<G, 1>(w, ld, n, rows, stride, out, d, c0);
            c0 += 16;
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn wsum_f16_group_block<const G: usize, const NB: usize>(
    w: &[f32],
    ld: usize,
    n: usize,
    rows: &[f16],
    stride: usize,
    out: &mut [f32],
    d: usize,
    c0: usize,
) {
    let (rp, wp, op) = (rows.as_ptr() as *const i16, w.as_ptr(), out.as_mut_ptr());
    // SAFETY: c0 + 16·NB <= d; output h's block lies at h·d + c0 inside `out` (G·d floats); row
    // i's columns c0 .. c0 + 16·NB lie inside `rows`; weight (h, i) at h·ld + i < w.len().
    unsafe {
        let mut acc: [[__m512; NB]; G] = std::array::from_fn(|h| {
            std::array::from_fn(|v| _mm512_loadu_ps(op.add(h * d + c0 + 16 * v)))
        });
        for i in 0..n {
            let a: [__m512; G] = std::array::from_fn(|h| _mm512_set1_ps(*wp.add(h * ld + i)));
            let r = rp.add(i * stride + c0);
            // As in `dots_f16_group_impl`: this block's columns a few rows ahead.
            let ahead = r.wrapping_add(KV_PF_ROWS * stride);
            for line in (0..16 * NB).step_by(32) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
            }
            for v in 0..NB {
                let vf = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(16 * v) as *const __m256i));
                for h in 0..G {
                    acc[h][v] = _mm512_fmadd_ps(a[h], vf, acc[h][v]);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for (v, acc) in acc.iter().enumerate() {
                _mm512_storeu_ps(op.add(h * d + c0 + 16 * v), *acc);
            }
        }
    }
}

pub(super) fn axpy_f16(a: f32, v: &[f16], y: &mut [f32]) {
    // SAFETY: as for `gemv`; lengths are equal.
    unsafe { axpy_f16_impl(a, v, y) }
}

#[target_feature(enable = "avx512f,fma")]
unsafe fn dot_f32_impl(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (ap, bp) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (loads below): indices stay below n = a.len() = b.len(); the tail is masked.
    while i + 64 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            unsafe {
                *acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(ap.add(i + 16 * k)),
                    _mm512_loadu_ps(bp.add(i + 16 * k)),
                    *acc,
                )
            };
        }
        i += 64;
    }
    while i < n {
        let k = tail_mask((n - i).min(16));
        unsafe {
            acc[0] = _mm512_fmadd_ps(
                _mm512_maskz_loadu_ps(k, ap.add(i)),
                _mm512_maskz_loadu_ps(k, bp.add(i)),
                acc[0],
            )
        };
        i += 16;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(
        _mm512_add_ps(acc[0], acc[1]),
        _mm512_add_ps(acc[2], acc[3]),
    ))
}

#[target_feature(enable = "avx512f,fma")]
unsafe fn axpy_impl(a: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let av = _mm512_set1_ps(a);
    let (xp, yp) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i < n {
        let k = tail_mask((n - i).min(16));
        // SAFETY: masked lanes stay below n = x.len() = y.len().
        unsafe {
            let v = _mm512_fmadd_ps(
                av,
                _mm512_maskz_loadu_ps(k, xp.add(i)),
                _mm512_maskz_loadu_ps(k, yp.add(i)),
            );
            _mm512_mask_storeu_ps(yp.add(i), k, v);
        }
        i += 16;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn f32_to_f16_impl(src: &[f32], dst: &mut [f16]) {
    let n = src.len();
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr() as *mut i16);
    let mut i = 0;
    while i < n {
        let k = tail_mask((n - i).min(16));
        // SAFETY: masked lanes stay below n = src.len() = dst.len(); f16 is a transparent u16.
        unsafe {
            let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_maskz_loadu_ps(k, sp.add(i)),
            );
            _mm256_mask_storeu_epi16(dp.add(i), k, h);
        }
        i += 16;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn f16_to_f32_impl(src: &[f16], dst: &mut [f32]) {
    let n = src.len();
    let (sp, dp) = (src.as_ptr() as *const i16, dst.as_mut_ptr());
    let mut i = 0;
    while i < n {
        let k = tail_mask((n - i).min(16));
        // SAFETY: masked lanes stay below n = src.len() = dst.len().
        unsafe {
            _mm512_mask_storeu_ps(
                dp.add(i),
                k,
                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, sp.add(i))),
            )
        };
        i += 16;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn dot_f16_impl(q: &[f32], kv: &[f16]) -> f32 {
    let n = q.len();
    let (qp, kp) = (q.as_ptr(), kv.as_ptr() as *const i16);
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut i = 0;
    // SAFETY (loads below): indices stay below n = q.len() = kv.len(); the tail is masked.
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            unsafe {
                let kf = _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(i + 16 * k) as *const __m256i));
                *acc = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(i + 16 * k)), kf, *acc);
            }
        }
        i += 32;
    }
    while i < n {
        let k = tail_mask((n - i).min(16));
        unsafe {
            let kf = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, kp.add(i)));
            acc[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, qp.add(i)), kf, acc[0]);
        }
        i += 16;
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
unsafe fn axpy_f16_impl(a: f32, v: &[f16], y: &mut [f32]) {
    let n = v.len();
    let av = _mm512_set1_ps(a);
    let (vp, yp) = (v.as_ptr() as *const i16, y.as_mut_ptr());
    let mut i = 0;
    while i < n {
        let k = tail_mask((n - i).min(16));
        // SAFETY: masked lanes stay below n = v.len() = y.len().
        unsafe {
            let vf = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, vp.add(i)));
            _mm512_mask_storeu_ps(
                yp.add(i),
                k,
                _mm512_fmadd_ps(av, vf, _mm512_maskz_loadu_ps(k, yp.add(i))),
            );
        }
        i += 16;
    }
}
