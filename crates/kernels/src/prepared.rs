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
    /// Within each run of 32 columns: the 8 columns `≡ 0 (mod 4)`, then those `≡ 1`, `≡ 2` and `≡ 3`. A
    /// 2-bit byte holds columns 4i..4i+3 at bits 0, 2, 4, 6, so SIMD kernels widen 8 packed bytes to lanes,
    /// shift by 2k and meet 8 contiguous x (`k`-th block) without shuffles. 32 divides every group size.
    Mod4x32,
    /// int16 activations for `vpdpwssd`, one token after another (4-bit only, the GEMV's layout):
    /// each token's weight group quantized on its own (`d = max|x| / 32767`, codes `round(x / d)`),
    /// stored `[n, cols]` in `q16` with each run of 64 columns as its 32 even then its 32 odd columns
    /// (a 4-bit byte holds columns 2i, 2i+1: 32 bytes widened to 16-bit lanes meet the even half
    /// with their low nibbles and the odd half with their high nibbles); `qd` and the exact f32
    /// group sums `sums` are `[n, groups]`.
    Q16EvenOdd64,
    /// int16 activations one token after another as [`XLayout::Q16EvenOdd64`] (the same codes,
    /// `qd` and `sums`), each run of 64 columns stored as its 16 columns `≡ 0 (mod 4)`, then those
    /// `≡ 1`, `≡ 2` and `≡ 3`: two packed bytes, read as one 16-bit lane, hold columns 4j..4j+3 at
    /// bits 0, 4, 8, 12, so 32 bytes shifted by 4k and masked meet the k-th run of 16 with no
    /// widening (the `avx2i16` GEMV).
    Q16Nib64,
    /// int16 activations for `vpdpwssd`, 16 tokens per register (4-bit only, the GEMM's layout): per
    /// block of 16 tokens and per 2 columns, 64 bytes `[token][2 columns]` of int16 codes (tokens
    /// past `n` are zero), quantized as [`XLayout::Q16EvenOdd64`]; `qd` and `sums` are
    /// `[block][group][16 tokens]`. Only from the table's `q16_lanes` tokens (`Q16_MIN_ROWS` on
    /// AVX-512).
    Q16Lanes16,
    /// int16 activations for the AMX GEMM (`amx` table, 4-bit only, from `AMX_MIN_ROWS` tokens):
    /// the codes of [`XLayout::Q16EvenOdd64`] split exactly as `c = 256 · hi + lo` (`hi = c >> 8`
    /// signed, `lo = c & 255` unsigned), each half stored as [`XLayout::Q8Lanes16`] stores its int8
    /// codes (per block of 16 tokens and per 4 columns, 64 bytes `[token][4 columns]`, tokens past `n`
    /// zero): `q` holds every block's `hi` half, then every block's `lo` half (as bytes). One
    /// 64-column step of a block is then a 16 x 64-byte AMX tile. `qd` and `sums` as `Q16Lanes16`.
    Q16Amx,
    /// int8 activations for the VNNI GEMM, 16 tokens per 512-bit lane group: per block of 16 tokens
    /// and per 4 columns, 64 bytes `[token][4 columns]` (tokens past `n` are zero), so one
    /// `vpdpbusd` multiplies 4 columns of one weight row (broadcast) with 16 tokens at once. Each
    /// token's weight group is quantized on its own: `d = max|x| / 127`, codes `round(x / d)`; the
    /// scales and the exact f32 group sums are stored `[block][group][16 tokens]` in `qd` / `sums`.
    /// Only for 4-bit matrices with group size 64 or 128 and at least [`Q8_MIN_ROWS`] tokens.
    Q8Lanes16,
}

/// Fewest activation rows for which a table with an int16 GEMM puts 16 tokens in a register
/// ([`XLayout::Q16Lanes16`]); fewer go one token at a time ([`XLayout::Q16EvenOdd64`]), with the
/// same bits.
pub(crate) const Q16_MIN_ROWS: usize = 8;

/// Fewest activation rows for which the `amx` table runs its GEMM on tiles ([`XLayout::Q16Amx`]);
/// fewer go one token at a time on the int16 GEMV, with the same bits. 704x2816, one thread, the
/// tiles against the GEMV (prepare included): n = 5 326 vs 345 us, 6 343 vs 412, 7 337 vs 476.
pub(crate) const AMX_MIN_ROWS: usize = 6;

/// Fewest activation rows for which a table with an int8 GEMM quantizes them ([`XLayout::Q8Lanes16`]);
/// below this, mostly empty 16-token lanes cost as much as the f32 kernel (704x2816, one thread:
/// n = 2 63 vs 61 GFLOP/s, n = 4 120 vs 98, n = 8 219 vs 128).
pub(crate) const Q8_MIN_ROWS: usize = 4;

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
    /// `XLayout::Q8Lanes16`: int8 codes `[n.div_ceil(16), cols / 4, 16, 4]` and per-token group
    /// scales `[n.div_ceil(16), cols / group_size, 16]` (`sums` then has the same shape);
    /// `XLayout::Q16Amx`: two such code arrays (the int16 codes' high then low bytes).
    pub(crate) q: Vec<i8>,
    pub(crate) qd: Vec<f32>,
    /// `XLayout::Q16EvenOdd64` / `XLayout::Q16Lanes16` only: int16 codes (see there).
    pub(crate) q16: Vec<i16>,
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

/// Adding and subtracting 1.5 · 2^23 rounds an f32 of magnitude below 2^22 to the nearest integer.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// `round(v · inv)` as int8 (|v · inv| <= 127), four per little-endian word, `words.len() · 4 ==
/// src.len()` (a multiple of 16); round to nearest, ties to even, on every implementation.
pub(crate) type QuantizeFn = fn(&[f32], f32, &mut [u32]);

/// The fastest [`QuantizeFn`] this CPU runs, picked once per call site rather than per group.
fn quantizer() -> QuantizeFn {
    #[cfg(target_arch = "x86_64")]
    if let Some(f) = crate::x86::quantizer() {
        return f;
    }
    quantize_scalar
}

/// `round(v · inv)` as int16 (|v · inv| <= 32767), `codes.len() == src.len()` (a multiple of 16);
/// round to nearest, ties to even, on every implementation.
pub(crate) type Quantize16Fn = fn(&[f32], f32, &mut [i16]);

/// The fastest [`Quantize16Fn`] this CPU runs.
fn quantizer16() -> Quantize16Fn {
    #[cfg(target_arch = "x86_64")]
    if let Some(f) = crate::x86::quantizer16() {
        return f;
    }
    quantize16_scalar
}

fn quantize16_scalar(src: &[f32], inv: f32, codes: &mut [i16]) {
    for (c, &v) in codes.iter_mut().zip(src) {
        // The 1.5 · 2^23 trick rounds to the nearest integer, ties to even.
        *c = ((v * inv + ROUND_MAGIC) - ROUND_MAGIC) as i32 as i16;
    }
}

fn quantize_scalar(src: &[f32], inv: f32, words: &mut [u32]) {
    for (w, quad) in words.iter_mut().zip(src.chunks_exact(4)) {
        // The 1.5 · 2^23 trick rounds to the nearest integer, ties to even.
        let q = |v: f32| ((v * inv + ROUND_MAGIC) - ROUND_MAGIC) as i32 as u8 as u32;
        *w = q(quad[0]) | q(quad[1]) << 8 | q(quad[2]) << 16 | q(quad[3]) << 24;
    }
}

/// max |v| with 8 independent maxima (so it vectorizes); NaN-free input assumed.
fn abs_max(v: &[f32]) -> f32 {
    let mut m = [0.0f32; 8];
    for c in v.chunks_exact(8) {
        for i in 0..8 {
            let a = c[i].abs();
            m[i] = if a > m[i] { a } else { m[i] };
        }
    }
    m.iter().fold(0.0f32, |a, &b| if b > a { b } else { a })
}

/// The step `d = max|v| / levels` of a symmetric integer quantization of `v`, and `1 / d` (0 for
/// an all-zero `v`).
fn quant_step(v: &[f32], levels: f32) -> (f32, f32) {
    let d = abs_max(v) / levels;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
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
            q16: Vec::new(),
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
        self.fill_each(layout, m, x, n, |blocks, work| (0..blocks).for_each(work));
    }

    /// [`PreparedX::fill`], the int16 layouts' blocks of 16 tokens handed to `each` (see
    /// `fill_q16`), which may run them at once: the same bytes whatever it does.
    pub(crate) fn fill_each(
        &mut self,
        layout: XLayout,
        m: &QMatrix,
        x: &[f32],
        n: usize,
        each: impl FnOnce(usize, &(dyn Fn(usize) + Sync)),
    ) {
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
        self.q.clear();
        self.qd.clear();
        self.x.clear();
        self.sums.clear();
        if layout == XLayout::Q8Lanes16 {
            self.fill_q8_lanes(x);
            return;
        }
        if matches!(
            layout,
            XLayout::Q16EvenOdd64 | XLayout::Q16Nib64 | XLayout::Q16Lanes16 | XLayout::Q16Amx
        ) {
            self.fill_q16(x, layout, each);
            return;
        }
        self.x.resize(n * cols, 0.0);
        self.sums.resize(n * gpr, 0.0);
        for t in 0..n {
            let src = &x[t * cols..(t + 1) * cols];
            let dst = &mut self.x[t * cols..(t + 1) * cols];
            match layout {
                XLayout::Natural => dst.copy_from_slice(src),
                XLayout::Q8Lanes16
                | XLayout::Q16EvenOdd64
                | XLayout::Q16Nib64
                | XLayout::Q16Lanes16
                | XLayout::Q16Amx => {
                    unreachable!("filled above")
                }
                XLayout::Mod4x32 => {
                    for (d, s) in dst.chunks_exact_mut(32).zip(src.chunks_exact(32)) {
                        let d: &mut [f32; 32] = d.try_into().expect("chunk of 32");
                        let s: &[f32; 32] = s.try_into().expect("chunk of 32");
                        for k in 0..4 {
                            for i in 0..8 {
                                d[8 * k + i] = s[4 * i + k];
                            }
                        }
                    }
                }
                XLayout::EvenOdd32 => {
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
    }

    /// [`XLayout::Q16EvenOdd64`], [`XLayout::Q16Nib64`], [`XLayout::Q16Lanes16`] or
    /// [`XLayout::Q16Amx`]: quantizes every
    /// token's weight groups to int16 (the same codes for all three) and places them (see there).
    /// Blocks of 16 tokens own disjoint ranges of every buffer, so `each` may run them in any
    /// order or at once: `each(blocks, work)` must call `work(b)` once for every `b < blocks`.
    fn fill_q16(
        &mut self,
        x: &[f32],
        layout: XLayout,
        each: impl FnOnce(usize, &(dyn Fn(usize) + Sync)),
    ) {
        let (n, cols, gs) = (self.n, self.cols, self.group_size);
        assert!(
            gs.is_multiple_of(64),
            "int16 activations need groups of 64 or 128, got {gs}"
        );
        let gpr = cols / gs;
        let lanes = !matches!(layout, XLayout::Q16EvenOdd64 | XLayout::Q16Nib64);
        let rows = if lanes { n.div_ceil(16) * 16 } else { n };
        self.q16.clear();
        if layout == XLayout::Q16Amx {
            self.q.resize(2 * rows * cols, 0);
        } else {
            self.q16.resize(rows * cols, 0);
        }
        self.qd.resize(rows * gpr, 0.0);
        self.sums.resize(rows * gpr, 0.0);
        // Block b's share of each buffer: tokens 16b .. 16b + 16 (fewer in the last block of a
        // layout without lanes), the same span in every layout (`Q16Amx`: in each half of `q`).
        let (hi, lo) = self.q.split_at_mut(if layout == XLayout::Q16Amx {
            rows * cols
        } else {
            0
        });
        type Block<'a> = (
            &'a mut [i16],
            &'a mut [i8],
            &'a mut [i8],
            &'a mut [f32],
            &'a mut [f32],
        );
        let blocks: Vec<std::sync::Mutex<Block>> = {
            let mut q16 = self.q16.chunks_mut(16 * cols);
            let mut hi = hi.chunks_mut(16 * cols);
            let mut lo = lo.chunks_mut(16 * cols);
            self.qd
                .chunks_mut(16 * gpr)
                .zip(self.sums.chunks_mut(16 * gpr))
                .map(|(qd, sums)| {
                    let (q16, hi, lo) = (
                        q16.next().unwrap_or_default(),
                        hi.next().unwrap_or_default(),
                        lo.next().unwrap_or_default(),
                    );
                    std::sync::Mutex::new((q16, hi, lo, qd, sums))
                })
                .collect()
        };
        let quantize = quantizer16();
        let work = |b: usize| {
            let mut guard = blocks[b].lock().unwrap_or_else(|e| e.into_inner());
            let (q16, q_hi, q_lo, qd, sums) = &mut *guard;
            let (mut hi, mut lo) = (vec![0i8; gs], vec![0i8; gs]);
            let mut codes = vec![0i16; gs];
            for t in 16 * b..(16 * b + 16).min(n) {
                let l = t % 16;
                for g in 0..gpr {
                    let src = &x[t * cols + g * gs..t * cols + (g + 1) * gs];
                    let (d, inv) = quant_step(src, 32767.0);
                    quantize(src, inv, &mut codes);
                    let at = if lanes { g * 16 + l } else { l * gpr + g };
                    qd[at] = d;
                    sums[at] = group_sum(src);
                    match layout {
                        XLayout::Q16Amx => {
                            // The halves of this group's codes, then 4 columns (one dword) at a
                            // time to their places 64 bytes apart.
                            for (k, &c) in codes.iter().enumerate() {
                                hi[k] = (c >> 8) as i8;
                                lo[k] = c as u8 as i8;
                            }
                            let base = (g * gs / 4) * 64 + l * 4;
                            for (j, (h, w)) in
                                hi.chunks_exact(4).zip(lo.chunks_exact(4)).enumerate()
                            {
                                let at = base + j * 64;
                                q_hi[at..at + 4].copy_from_slice(h);
                                q_lo[at..at + 4].copy_from_slice(w);
                            }
                        }
                        XLayout::Q16Lanes16 => {
                            for k in 0..gs / 2 {
                                let at = (g * gs / 2 + k) * 32 + l * 2;
                                q16[at] = codes[2 * k];
                                q16[at + 1] = codes[2 * k + 1];
                            }
                        }
                        XLayout::Q16Nib64 => {
                            let row = &mut q16[l * cols + g * gs..l * cols + (g + 1) * gs];
                            for (d, s) in row.chunks_exact_mut(64).zip(codes.chunks_exact(64)) {
                                for j in 0..16 {
                                    for k in 0..4 {
                                        d[16 * k + j] = s[4 * j + k];
                                    }
                                }
                            }
                        }
                        _ => {
                            let row = &mut q16[l * cols + g * gs..l * cols + (g + 1) * gs];
                            for (d, s) in row.chunks_exact_mut(64).zip(codes.chunks_exact(64)) {
                                for j in 0..32 {
                                    d[j] = s[2 * j];
                                    d[32 + j] = s[2 * j + 1];
                                }
                            }
                        }
                    }
                }
            }
        };
        each(blocks.len(), &work);
    }

    /// [`XLayout::Q8Lanes16`]: quantizes each token's weight groups to int8 and interleaves 16
    /// tokens per 4 columns (see there).
    fn fill_q8_lanes(&mut self, x: &[f32]) {
        let (n, cols, gs) = (self.n, self.cols, self.group_size);
        let (gpr, blocks, quads) = (cols / gs, n.div_ceil(16), cols / 4);
        self.q.resize(blocks * quads * 64, 0);
        self.qd.resize(blocks * gpr * 16, 0.0);
        self.sums.resize(blocks * gpr * 16, 0.0);
        // Per 16-token block: quantize each token's row into `codes` ([16][cols] bytes as 4-byte
        // words), then transpose the words into the lane layout.
        let quantize = quantizer();
        let mut codes = vec![0u32; 16 * quads];
        for b in 0..blocks {
            let lanes = (n - b * 16).min(16);
            codes.fill(0);
            for lane in 0..lanes {
                let t = b * 16 + lane;
                let row = &mut codes[lane * quads..(lane + 1) * quads];
                for g in 0..gpr {
                    let src = &x[t * cols + g * gs..t * cols + (g + 1) * gs];
                    let (d, inv) = quant_step(src, 127.0);
                    self.qd[(b * gpr + g) * 16 + lane] = d;
                    self.sums[(b * gpr + g) * 16 + lane] = group_sum(src);
                    quantize(src, inv, &mut row[g * gs / 4..(g + 1) * gs / 4]);
                }
            }
            let dst = &mut self.q[b * quads * 64..(b + 1) * quads * 64];
            for (c4, out) in dst.chunks_exact_mut(64).enumerate() {
                for (lane, o) in out.chunks_exact_mut(4).enumerate() {
                    o.copy_from_slice(&codes[lane * quads + c4].to_le_bytes().map(|v| v as i8));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD quantizers (when this CPU has them; int8 and int16) give the scalar ones' codes bit for bit,
    /// including exact halves (ties to even) and the ±127 ends.
    #[test]
    fn simd_quantize_equals_scalar() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        for case in 0..200 {
            let len = 64 * (1 + case % 4);
            let mut src: Vec<f32> = (0..len).map(|_| next() * 3.0).collect();
            for (i, v) in src.iter_mut().enumerate().take(16) {
                *v = (i as f32 - 8.0) + 0.5; // exact halves after scaling by 1
            }
            let inv = if case % 2 == 0 {
                1.0
            } else {
                127.0 / abs_max(&src)
            };
            let (mut a, mut b) = (vec![0u32; len / 4], vec![0u32; len / 4]);
            quantizer()(&src, inv, &mut a);
            quantize_scalar(&src, inv, &mut b);
            assert_eq!(a, b, "case {case}");
            let inv16 = inv * 32767.0 / 127.0;
            let (mut a, mut b) = (vec![0i16; len], vec![0i16; len]);
            quantizer16()(&src, inv16, &mut a);
            quantize16_scalar(&src, inv16, &mut b);
            assert_eq!(a, b, "int16, case {case}");
        }
    }

    /// The int16 layouts filled block by block in any order, or over a pool's threads, give the
    /// serial fill's bytes (every buffer), for token counts around the 16-token blocks.
    #[test]
    fn int16_blocks_in_any_order_give_the_serial_bytes() {
        let (cols, gs) = (256, 64);
        let (w, sb) = (vec![0u8; cols / 2], vec![0u8; 2 * cols / gs]);
        let m = QMatrix::new(&w, &sb, &sb, 1, cols, 4, gs).unwrap();
        let pool = crate::ThreadPool::new(3);
        let fields = |p: &PreparedX| (p.q16.clone(), p.q.clone(), p.qd.clone(), p.sums.clone());
        for layout in [
            XLayout::Q16EvenOdd64,
            XLayout::Q16Nib64,
            XLayout::Q16Lanes16,
            XLayout::Q16Amx,
        ] {
            for n in [1, 7, 15, 16, 17, 40, 64] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 2_654_435_761usize) % 1_000_003) as f32 / 1_000_003.0 - 0.5)
                    .collect();
                let mut serial = PreparedX::new();
                serial.fill(layout, &m, &x, n);
                let mut reversed = PreparedX::new();
                reversed.fill_each(layout, &m, &x, n, |blocks, work| {
                    assert_eq!(blocks, n.div_ceil(16));
                    (0..blocks).rev().for_each(work)
                });
                let mut pooled = PreparedX::new();
                pooled.fill_each(layout, &m, &x, n, |blocks, work| {
                    pool.for_chunks(blocks, 1, |a, b| (a..b).for_each(work))
                });
                assert!(
                    serial.qd.iter().any(|&d| d > 0.0),
                    "{layout:?} n {n}: nothing quantized"
                );
                assert_eq!(
                    fields(&reversed),
                    fields(&serial),
                    "{layout:?} n {n}, blocks reversed"
                );
                assert_eq!(
                    fields(&pooled),
                    fields(&serial),
                    "{layout:?} n {n}, over 3 threads"
                );
            }
        }
    }
}
