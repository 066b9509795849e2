//! Scalar f32 reference kernels: the twins every SIMD kernel is tested against.

use crate::prepared::{PreparedX, XLayout};
use crate::qmatrix::bf16_at;
use crate::QMatrix;
use half::f16;

/// `Σ_groups ( scale·Σ q_i x_i + bias·Σ x_i )` for one row; `x` in natural order, `sums` per group.
#[inline]
pub(crate) fn row_dot(m: &QMatrix, r: usize, x: &[f32], sums: &[f32]) -> f32 {
    let gs = m.group_size;
    let gpr = m.groups_per_row();
    let w = m.row_weight(r);
    let mut acc = 0.0f32;
    for g in 0..gpr {
        let s = bf16_at(m.scales, r * gpr + g);
        let b = bf16_at(m.biases, r * gpr + g);
        let xg = &x[g * gs..(g + 1) * gs];
        let mut qx = 0.0f32;
        match m.bits {
            2 => {
                for (i, &byte) in w[g * gs / 4..(g + 1) * gs / 4].iter().enumerate() {
                    let q = |k: u32| ((byte >> (2 * k)) & 0x03) as f32;
                    qx += q(0) * xg[4 * i]
                        + q(1) * xg[4 * i + 1]
                        + q(2) * xg[4 * i + 2]
                        + q(3) * xg[4 * i + 3];
                }
            }
            4 => {
                for (i, &byte) in w[g * gs / 2..(g + 1) * gs / 2].iter().enumerate() {
                    qx += (byte & 0x0f) as f32 * xg[2 * i] + (byte >> 4) as f32 * xg[2 * i + 1];
                }
            }
            _ => {
                for (&q, &xi) in w[g * gs..(g + 1) * gs].iter().zip(xg) {
                    qx += q as f32 * xi;
                }
            }
        }
        acc += s * qx + b * sums[g];
    }
    acc
}

pub(crate) fn gemv(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    p.check(m, XLayout::Natural);
    let (x, sums) = (p.row(0), p.sums_row(0));
    for (yi, r) in y.iter_mut().zip(r0..r1) {
        *yi = row_dot(m, r, x, sums);
    }
}

pub(crate) fn gemm(m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
    p.check(m, XLayout::Natural);
    let w = r1 - r0;
    for t in 0..p.n {
        let (x, sums) = (p.row(t), p.sums_row(t));
        for (yi, r) in y[t * w..(t + 1) * w].iter_mut().zip(r0..r1) {
            *yi = row_dot(m, r, x, sums);
        }
    }
}

pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

pub(crate) fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(*s);
    }
}

pub(crate) fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

pub(crate) fn dot_f16(q: &[f32], k: &[f16]) -> f32 {
    q.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum()
}

pub(crate) fn axpy_f16(a: f32, v: &[f16], y: &mut [f32]) {
    for (yi, vi) in y.iter_mut().zip(v) {
        *yi += a * vi.to_f32();
    }
}
