//! Shared test fixtures: a deterministic RNG, random MLX-affine matrices at chosen byte offsets, and an
//! independent f64 reference (dequantize every element from the u32 words, then a plain matmul).

#![allow(dead_code)]

use mference_kernels::QMatrix;

/// Deterministic splitmix64 generator (no dependency, reproducible across versions).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Uniform in [-a, a).
    pub fn sym(&mut self, a: f32) -> f32 {
        (self.unit() * 2.0 - 1.0) * a
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn vec_sym(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
}

/// bf16 bits of `v` (round to nearest even), as a checkpoint writer would store them.
pub fn to_bf16_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let round = 0x7fff + ((b >> 16) & 1);
    ((b + round) >> 16) as u16
}

/// An owned random quantized matrix whose three tensors start `offset` bytes into their buffers (to test
/// 2-byte-aligned and unaligned views).
pub struct OwnedQ {
    w: Vec<u8>,
    s: Vec<u8>,
    b: Vec<u8>,
    offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub gs: usize,
}

impl OwnedQ {
    /// Random codes; scales uniform in ±[0.002, 0.05] with random sign (MLX scales may be negative);
    /// biases uniform in ±0.4.
    pub fn random(
        rng: &mut Rng,
        rows: usize,
        cols: usize,
        bits: u32,
        gs: usize,
        offset: usize,
    ) -> Self {
        let wlen = rows * cols * bits as usize / 8;
        let glen = rows * cols / gs;
        let mut w = vec![0u8; offset + wlen];
        for v in &mut w[offset..] {
            *v = rng.next_u64() as u8;
        }
        let mut s = vec![0u8; offset + 2 * glen];
        let mut b = vec![0u8; offset + 2 * glen];
        for i in 0..glen {
            let mag = 0.002 + rng.unit() * 0.048;
            let sc = if rng.next_u64() & 1 == 0 { mag } else { -mag };
            s[offset + 2 * i..offset + 2 * i + 2].copy_from_slice(&to_bf16_bits(sc).to_le_bytes());
            let bi = rng.sym(0.4);
            b[offset + 2 * i..offset + 2 * i + 2].copy_from_slice(&to_bf16_bits(bi).to_le_bytes());
        }
        Self {
            w,
            s,
            b,
            offset,
            rows,
            cols,
            bits,
            gs,
        }
    }

    pub fn view(&self) -> QMatrix<'_> {
        let o = self.offset;
        QMatrix::new(
            &self.w[o..],
            &self.s[o..],
            &self.b[o..],
            self.rows,
            self.cols,
            self.bits,
            self.gs,
        )
        .expect("valid random matrix")
    }
}

fn bf16_f64(bytes: &[u8], i: usize) -> f64 {
    f32::from_bits((u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]) as u32) << 16) as f64
}

/// Element (row, col) dequantized in f64 from the packed u32 little-endian words (bitstream definition,
/// independent of the kernels' byte/nibble handling).
pub fn naive_weight(m: &QMatrix, r: usize, c: usize) -> f64 {
    let (s, q, b) = naive_parts(m, r, c);
    s * q + b
}

/// (scale, code, bias) of element (row, col), read from the u32 words and bf16 tensors.
pub fn naive_parts(m: &QMatrix, r: usize, c: usize) -> (f64, f64, f64) {
    let b = m.bits as usize;
    let words_per_row = m.cols * b / 32;
    let bit = c * b;
    let k = r * words_per_row + bit / 32;
    let word = u32::from_le_bytes(m.weight[4 * k..4 * k + 4].try_into().unwrap());
    let q = (word >> (bit % 32)) & ((1u32 << b) - 1);
    let g = r * (m.cols / m.group_size) + c / m.group_size;
    (bf16_f64(m.scales, g), q as f64, bf16_f64(m.biases, g))
}

/// Naive dequantize-then-matmul in f64: `(y[n, rows], scale[n, rows])` where
/// `scale = Σ_c (|scale_g|·q_c + |bias_g|)·|x_c|`, the magnitude the relative error budgets are measured
/// against: floating-point dot-product error bounds scale with the sum of absolute terms of the computation
/// (here MLX's factoring `scale·Σqx + bias·Σx`); a plain `|y|` would blow up under cancellation.
pub fn naive_gemm(m: &QMatrix, x: &[f32], n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0f64; n * m.rows];
    let mut mag = vec![0.0f64; n * m.rows];
    let mut wrow = vec![0.0f64; m.cols];
    let mut arow = vec![0.0f64; m.cols];
    for r in 0..m.rows {
        for c in 0..m.cols {
            let (s, q, b) = naive_parts(m, r, c);
            wrow[c] = s * q + b;
            arow[c] = s.abs() * q + b.abs();
        }
        for t in 0..n {
            let xt = &x[t * m.cols..(t + 1) * m.cols];
            let (mut acc, mut a) = (0.0f64, 0.0f64);
            for ((w, aw), &xv) in wrow.iter().zip(&arow).zip(xt) {
                acc += w * xv as f64;
                a += aw * (xv as f64).abs();
            }
            y[t * m.rows + r] = acc;
            mag[t * m.rows + r] = a;
        }
    }
    (y, mag)
}

/// Largest `|got - want| / scale` over all entries (scale floored at 1e-30).
pub fn max_rel_err(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .zip(scale)
        .map(|((&g, &w), &s)| (g as f64 - w).abs() / s.max(1e-30))
        .fold(0.0, f64::max)
}
