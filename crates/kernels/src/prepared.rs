//! Activations prepared once per product and shared by every row (and every thread, and every matrix that
//! reads the same input, e.g. an expert's gate and up projections).

use crate::QMatrix;

/// Column order of the prepared activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum XLayout {
    /// `x` as given.
    Natural,
    /// Within each run of 32 columns: the 16 even columns, then the 16 odd columns. A 4-bit byte holds
    /// columns (2i, 2i+1) in its (low, high) nibble, so SIMD kernels can mask/shift nibbles and multiply by
    /// contiguous x without shuffles.
    EvenOdd32,
    /// `EvenOdd32` f32 activations (for the GEMM and fallbacks) plus, for one activation row, an int8 copy:
    /// per group a scale `d = max|x| / 127` and codes `round(x / d)`, ordered per 64 columns as the 32 even
    /// columns then the 32 odd ones (the order of 32 packed bytes' low then high nibbles). Only for 4-bit
    /// matrices with group size 64 or 128 (the VNNI GEMV).
    Q8EvenOdd64,
}

/// Activations `x[n, cols]` prepared for one kernel table and one (bits, group size): reordered as the
/// kernels want them, with per-group sums `Σ x_i` (for the bias term) precomputed.
///
/// Build with [`crate::Kernels::prepare`]; use with [`crate::Kernels::gemv_prepared`] /
/// [`crate::Kernels::gemm_prepared`] or the pool's `*_prepared` methods. Reusing one `PreparedX` across calls
/// avoids reallocation.
#[derive(Clone, Debug)]
pub struct PreparedX {
    pub(crate) n: usize,
    pub(crate) cols: usize,
    pub(crate) bits: u32,
    pub(crate) group_size: usize,
    pub(crate) layout: XLayout,
    /// `[n, cols]` in `layout` order.
    pub(crate) x: Vec<f32>,
    /// `[n, cols / group_size]`: Σ x over each group.
    pub(crate) sums: Vec<f32>,
    /// `XLayout::Q8EvenOdd64` with `n == 1` only: int8 codes `[cols]` and per-group scales `[cols / group_size]`.
    pub(crate) q: Vec<i8>,
    pub(crate) qd: Vec<f32>,
}

/// Sum of one group (a multiple of 8 elements) with 8 independent partial sums, so it vectorizes instead of
/// waiting on one add chain; the order is fixed, so every kernel table sees the same sums.
fn group_sum(v: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for c in v.chunks_exact(8) {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

impl Default for PreparedX {
    fn default() -> Self {
        Self::new()
    }
}

impl PreparedX {
    /// An empty buffer, to be filled by [`crate::Kernels::prepare_into`].
    pub fn new() -> Self {
        Self {
            n: 0,
            cols: 0,
            bits: 0,
            group_size: 0,
            layout: XLayout::Natural,
            x: Vec::new(),
            sums: Vec::new(),
            q: Vec::new(),
            qd: Vec::new(),
        }
    }

    /// Number of activation rows (tokens).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Columns per activation row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    pub(crate) fn fill(&mut self, layout: XLayout, m: &QMatrix, x: &[f32], n: usize) {
        let cols = m.cols;
        assert_eq!(
            x.len(),
            n * cols,
            "prepare: x must be [n, cols] = [{n}, {cols}]"
        );
        let gs = m.group_size;
        let gpr = cols / gs;
        self.n = n;
        self.cols = cols;
        self.bits = m.bits;
        self.group_size = gs;
        self.layout = layout;
        self.x.clear();
        self.x.resize(n * cols, 0.0);
        self.sums.clear();
        self.sums.resize(n * gpr, 0.0);
        for t in 0..n {
            let src = &x[t * cols..(t + 1) * cols];
            let dst = &mut self.x[t * cols..(t + 1) * cols];
            match layout {
                XLayout::Natural => dst.copy_from_slice(src),
                XLayout::EvenOdd32 | XLayout::Q8EvenOdd64 => {
                    for (d, s) in dst.chunks_exact_mut(32).zip(src.chunks_exact(32)) {
                        let d: &mut [f32; 32] = d.try_into().expect("chunk of 32");
                        let s: &[f32; 32] = s.try_into().expect("chunk of 32");
                        for i in 0..16 {
                            d[i] = s[2 * i];
                            d[16 + i] = s[2 * i + 1];
                        }
                    }
                }
            }
            for (g, sum) in self.sums[t * gpr..(t + 1) * gpr].iter_mut().enumerate() {
                *sum = group_sum(&src[g * gs..(g + 1) * gs]);
            }
        }
        self.q.clear();
        self.qd.clear();
        if layout == XLayout::Q8EvenOdd64 && n == 1 {
            debug_assert!(gs.is_multiple_of(64));
            self.q.resize(cols, 0);
            self.qd.resize(gpr, 0.0);
            for g in 0..gpr {
                let src = &x[g * gs..(g + 1) * gs];
                let amax = src.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                self.qd[g] = d;
                let dst = &mut self.q[g * gs..(g + 1) * gs];
                for (d64, s64) in dst.chunks_exact_mut(64).zip(src.chunks_exact(64)) {
                    for i in 0..32 {
                        d64[i] = (s64[2 * i] * inv).round() as i8;
                        d64[32 + i] = (s64[2 * i + 1] * inv).round() as i8;
                    }
                }
            }
        }
    }

    /// Panics unless this buffer was prepared for `m`'s shape/format and the expected layout.
    pub(crate) fn check(&self, m: &QMatrix, layout: XLayout) {
        assert!(
            self.cols == m.cols && self.bits == m.bits && self.group_size == m.group_size && self.layout == layout,
            "PreparedX (cols {}, bits {}, group {}, {:?}) does not match the matrix (cols {}, bits {}, group {}) \
             or kernel table ({:?}); prepare it with the same Kernels",
            self.cols,
            self.bits,
            self.group_size,
            self.layout,
            m.cols,
            m.bits,
            m.group_size,
            layout
        );
    }

    #[inline(always)]
    pub(crate) fn row(&self, t: usize) -> &[f32] {
        &self.x[t * self.cols..(t + 1) * self.cols]
    }

    #[inline(always)]
    pub(crate) fn sums_row(&self, t: usize) -> &[f32] {
        let gpr = self.cols / self.group_size;
        &self.sums[t * gpr..(t + 1) * gpr]
    }
}
