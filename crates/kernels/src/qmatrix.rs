//! Zero-copy view of an MLX affine-quantized matrix (mlx's `mx.quantize` affine mode; byte layout in `docs/FORMAT.md`).

use crate::KernelError;

/// Converts one bf16 value (its raw bits) to f32. Exact: bf16 is the top half of an f32.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Reads bf16 number `i` of a little-endian byte slice (any alignment).
#[inline(always)]
pub(crate) fn bf16_at(bytes: &[u8], i: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
}

/// A quantized matrix view over mapped bytes (no copies): an MLX affine-quantized Linear `[out = rows, in = cols]`.
///
/// - `weight`: `rows · cols · bits / 8` bytes; u32 little-endian words, row-major, each row `cols·bits/32` words.
///   Element `j` of a row occupies bits `[j·bits, (j+1)·bits)` of the row's little-endian bitstream (4-bit:
///   word k holds elements 8k..8k+7, first element in the lowest nibble; 2-bit: word k holds elements
///   16k..16k+15, element j at bits `2(j mod 16)`, so byte j/4 holds element j at bits `2(j mod 4)`).
/// - `scales`, `biases`: bf16 (little-endian), `[rows, cols / group_size]`, `2 · rows · cols / group_size` bytes
///   each. Scales may be negative.
/// - Dequantization: `w = scale · q + bias`.
///
/// The slices may be only 2-byte aligned (views into a mapped file); kernels use unaligned loads only.
#[derive(Clone, Copy, Debug)]
pub struct QMatrix<'a> {
    /// Packed codes, `rows · cols · bits / 8` bytes.
    pub weight: &'a [u8],
    /// bf16 scales, `[rows, cols / group_size]`.
    pub scales: &'a [u8],
    /// bf16 biases, `[rows, cols / group_size]`.
    pub biases: &'a [u8],
    /// Output features (`out`).
    pub rows: usize,
    /// Input features (`in`); a multiple of `group_size`.
    pub cols: usize,
    /// Bits per code: 2, 4 or 8.
    pub bits: u32,
    /// Elements per (scale, bias) group along a row: 32, 64 or 128.
    pub group_size: usize,
}

impl<'a> QMatrix<'a> {
    /// Builds a view and validates it.
    ///
    /// Errors: [`KernelError::UnsupportedBits`] (bits not 2/4/8), [`KernelError::UnsupportedGroupSize`]
    /// (not 32/64/128), [`KernelError::ColsNotMultipleOfGroup`], [`KernelError::Empty`], and
    /// [`KernelError::BadLength`] when a slice length differs from the one implied by the shape.
    pub fn new(
        weight: &'a [u8],
        scales: &'a [u8],
        biases: &'a [u8],
        rows: usize,
        cols: usize,
        bits: u32,
        group_size: usize,
    ) -> Result<Self, KernelError> {
        if !matches!(bits, 2 | 4 | 8) {
            return Err(KernelError::UnsupportedBits(bits));
        }
        if !matches!(group_size, 32 | 64 | 128) {
            return Err(KernelError::UnsupportedGroupSize(group_size));
        }
        if rows == 0 || cols == 0 {
            return Err(KernelError::Empty { rows, cols });
        }
        if !cols.is_multiple_of(group_size) {
            return Err(KernelError::ColsNotMultipleOfGroup { cols, group_size });
        }
        let expect_w = rows * cols * bits as usize / 8;
        if weight.len() != expect_w {
            return Err(KernelError::BadLength {
                what: "weight",
                expected: expect_w,
                got: weight.len(),
            });
        }
        let expect_sb = rows * (cols / group_size) * 2;
        if scales.len() != expect_sb {
            return Err(KernelError::BadLength {
                what: "scales",
                expected: expect_sb,
                got: scales.len(),
            });
        }
        if biases.len() != expect_sb {
            return Err(KernelError::BadLength {
                what: "biases",
                expected: expect_sb,
                got: biases.len(),
            });
        }
        Ok(Self {
            weight,
            scales,
            biases,
            rows,
            cols,
            bits,
            group_size,
        })
    }

    /// Groups per row (`cols / group_size`).
    #[inline(always)]
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group_size
    }

    /// Packed bytes per row (`cols · bits / 8`).
    #[inline(always)]
    pub fn row_bytes(&self) -> usize {
        self.cols * self.bits as usize / 8
    }

    /// Total bytes the kernels stream for one full product (weights + scales + biases).
    pub fn total_bytes(&self) -> usize {
        self.weight.len() + self.scales.len() + self.biases.len()
    }

    /// The packed bytes of one row.
    #[inline(always)]
    pub(crate) fn row_weight(&self, row: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.weight[row * rb..(row + 1) * rb]
    }

    /// Scale of group `g` in `row`, as f32.
    #[inline(always)]
    pub fn scale(&self, row: usize, g: usize) -> f32 {
        bf16_at(self.scales, row * self.groups_per_row() + g)
    }

    /// Bias of group `g` in `row`, as f32.
    #[inline(always)]
    pub fn bias(&self, row: usize, g: usize) -> f32 {
        bf16_at(self.biases, row * self.groups_per_row() + g)
    }

    /// Code (unsigned integer in `0..2^bits`) of element `col` in `row`.
    #[inline(always)]
    pub fn code(&self, row: usize, col: usize) -> u32 {
        let w = self.row_weight(row);
        match self.bits {
            2 => (w[col / 4] >> (2 * (col % 4))) as u32 & 0x03,
            4 => {
                let b = w[col / 2];
                if col.is_multiple_of(2) {
                    (b & 0x0f) as u32
                } else {
                    (b >> 4) as u32
                }
            }
            _ => w[col] as u32,
        }
    }

    /// Dequantizes one row into `out` (`out.len() == cols`), natural column order, `w = scale·q + bias` in f32.
    ///
    /// Panics if `row >= rows` or `out.len() != cols`. Cold path (embedding lookup, debugging).
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(
            row < self.rows,
            "row {row} out of range (rows {})",
            self.rows
        );
        assert_eq!(
            out.len(),
            self.cols,
            "dequantize_row: out must have cols elements"
        );
        let gs = self.group_size;
        for g in 0..self.groups_per_row() {
            let s = self.scale(row, g);
            let b = self.bias(row, g);
            for (j, o) in out[g * gs..(g + 1) * gs].iter_mut().enumerate() {
                *o = s * self.code(row, g * gs + j) as f32 + b;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_order_matches_the_mlx_examples() {
        // MLX affine packing, low bits first: 4-bit codes 15,14,…,8 pack to the word 0x89abcdef; 8-bit codes 255,238,221,204
        // pack to 0xccddeeff.
        let w4 = 0x89abcdefu32.to_le_bytes();
        let one = 0x3f80u16.to_le_bytes(); // bf16 1.0
        let zero = [0u8; 2];
        let m = QMatrix::new(&w4, &one, &zero, 1, 8, 4, 32);
        assert!(m.is_err(), "8 columns cannot form a group of 32");
        let mut w = [0u8; 16];
        w[..4].copy_from_slice(&w4);
        let m = QMatrix::new(&w, &one, &zero, 1, 32, 4, 32).unwrap();
        let codes: Vec<u32> = (0..8).map(|c| m.code(0, c)).collect();
        assert_eq!(codes, [15, 14, 13, 12, 11, 10, 9, 8]);
        let mut w8 = [0u8; 32];
        w8[..4].copy_from_slice(&0xccddeeffu32.to_le_bytes());
        let m = QMatrix::new(&w8, &one, &zero, 1, 32, 8, 32).unwrap();
        let codes: Vec<u32> = (0..4).map(|c| m.code(0, c)).collect();
        assert_eq!(codes, [255, 238, 221, 204]);
        let mut row = vec![0.0; 32];
        m.dequantize_row(0, &mut row);
        assert_eq!(&row[..4], &[255.0, 238.0, 221.0, 204.0]);
    }

    #[test]
    fn two_bit_order_matches_mlx_quantize() {
        // mlx 0.32.4 `mx.quantize(w, group_size=32, bits=2)` of the row
        // [3,2,1,0, 0,1,2,3, 1,1,1,1, 2,2,2,2, 0 ×15, 3] gives the words 0x55aa1be4, 0x3fffffff with
        // scale -1 and bias 3 (codes 3 - w), and `mx.dequantize` returns the row exactly.
        let mut w = [0u8; 8];
        w[..4].copy_from_slice(&0x55aa1be4u32.to_le_bytes());
        w[4..].copy_from_slice(&0x3fffffffu32.to_le_bytes());
        let s = 0xbf80u16.to_le_bytes(); // bf16 -1.0
        let b = 0x4040u16.to_le_bytes(); // bf16 3.0
        let m = QMatrix::new(&w, &s, &b, 1, 32, 2, 32).unwrap();
        let codes: Vec<u32> = (0..8).map(|c| m.code(0, c)).collect();
        assert_eq!(codes, [0, 1, 2, 3, 3, 2, 1, 0]);
        let mut row = vec![0.0; 32];
        m.dequantize_row(0, &mut row);
        let mut want = vec![
            3., 2., 1., 0., 0., 1., 2., 3., 1., 1., 1., 1., 2., 2., 2., 2.,
        ];
        want.extend([0.0; 15]);
        want.push(3.0);
        assert_eq!(row, want);
    }

    #[test]
    fn dequantize_row_applies_negative_scale_and_bias() {
        let w = [0x21u8; 16]; // codes 1, 2, 1, 2, …
        let s = (((-0.5f32).to_bits() >> 16) as u16).to_le_bytes(); // bf16 -0.5
        let b = ((3.0f32.to_bits() >> 16) as u16).to_le_bytes(); // bf16 3.0
        let m = QMatrix::new(&w, &s, &b, 1, 32, 4, 32).unwrap();
        let mut row = vec![0.0; 32];
        m.dequantize_row(0, &mut row);
        assert_eq!(&row[..4], &[2.5, 2.0, 2.5, 2.0]);
    }

    #[test]
    fn new_rejects_bad_shapes_with_specific_errors() {
        let w = vec![0u8; 64];
        let sb = vec![0u8; 4];
        for bits in [1, 3, 5, 6, 16] {
            assert_eq!(
                QMatrix::new(&w, &sb, &sb, 2, 64, bits, 64).unwrap_err(),
                KernelError::UnsupportedBits(bits)
            );
        }
        // 2-bit: a quarter of the 8-bit bytes.
        let two_bit = QMatrix::new(&w, &sb, &sb, 2, 64, 2, 64).unwrap_err();
        assert!(matches!(
            two_bit,
            KernelError::BadLength { expected: 32, .. }
        ));
        assert!(QMatrix::new(&w[..32], &sb, &sb, 2, 64, 2, 64).is_ok());
        assert_eq!(
            QMatrix::new(&w, &sb, &sb, 2, 64, 4, 16).unwrap_err(),
            KernelError::UnsupportedGroupSize(16)
        );
        assert_eq!(
            QMatrix::new(&w, &sb, &sb, 2, 96, 4, 64).unwrap_err(),
            KernelError::ColsNotMultipleOfGroup {
                cols: 96,
                group_size: 64
            }
        );
        assert_eq!(
            QMatrix::new(&w[..63], &sb, &sb, 2, 64, 4, 64).unwrap_err(),
            KernelError::BadLength {
                what: "weight",
                expected: 64,
                got: 63
            }
        );
        assert_eq!(
            QMatrix::new(&w, &sb[..2], &sb, 2, 64, 4, 64).unwrap_err(),
            KernelError::BadLength {
                what: "scales",
                expected: 4,
                got: 2
            }
        );
        assert_eq!(
            QMatrix::new(&w, &sb, &sb[..3], 2, 64, 4, 64).unwrap_err(),
            KernelError::BadLength {
                what: "biases",
                expected: 4,
                got: 3
            }
        );
        assert_eq!(
            QMatrix::new(&[], &[], &[], 0, 64, 4, 64).unwrap_err(),
            KernelError::Empty { rows: 0, cols: 64 }
        );
        assert!(QMatrix::new(&w, &sb, &sb, 2, 64, 4, 64).is_ok());
    }
}
