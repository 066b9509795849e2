//! Views of resident tensors inside the mapped `model_weights.bin`, and of expert tensors inside
//! a slot of the expert streamer. Nothing here copies model bytes.

use mference_format::{Dtype, ExpertTensor, IndexEntry, ResidentIndex};
use mference_kernels::{bf16_to_f32, QMatrix};

/// A tensor of the install does not fit what the family expects (the install does not match this
/// runtime).
#[derive(Debug, thiserror::Error)]
#[error("tensor {name}: {why}; the install does not match this runtime: reinstall it")]
pub struct WeightError {
    pub name: String,
    pub why: String,
}

/// The three projections of a GLU MLP (a dense MLP, a shared expert, or every routed expert of a
/// layer at the same offsets inside each expert blob).
#[derive(Clone, Copy, Debug)]
pub struct Mlp {
    pub gate_proj: QRef,
    pub up_proj: QRef,
    pub down_proj: QRef,
}

/// A quantized Linear `[rows = out, cols = in]` located by byte ranges in some buffer.
#[derive(Clone, Copy, Debug)]
pub struct QRef {
    w: (usize, usize),
    s: (usize, usize),
    b: (usize, usize),
    pub rows: usize,
    pub cols: usize,
    pub bits: u32,
    pub group_size: usize,
}

impl QRef {
    /// The kernel view over `buf` (the mapped resident file, or an expert blob).
    #[inline]
    pub fn mat<'a>(&self, buf: &'a [u8]) -> QMatrix<'a> {
        QMatrix {
            weight: &buf[self.w.0..self.w.0 + self.w.1],
            scales: &buf[self.s.0..self.s.0 + self.s.1],
            biases: &buf[self.b.0..self.b.0 + self.b.1],
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            group_size: self.group_size,
        }
    }

    /// The byte ranges `(offset, len)` of the packed weights, scales and biases in their buffer
    /// (a device backend reads its copy of that buffer at the same offsets).
    pub fn byte_ranges(&self) -> [(usize, usize); 3] {
        [self.w, self.s, self.b]
    }

    /// A matrix `[rows, cols]` whose packed weights, scales and biases are the byte ranges
    /// `(offset, len)` `w`, `s`, `b` of a buffer of `buf_len` bytes.
    ///
    /// Derives bits and group size from the byte sizes (MLX affine layout, `docs/FORMAT.md`) and
    /// checks them against the kernel's rules, so a malformed install fails at load, not mid-generation.
    pub fn from_parts(
        name: &str,
        rows: usize,
        cols: usize,
        w: (usize, usize),
        s: (usize, usize),
        b: (usize, usize),
        buf_len: usize,
    ) -> Result<Self, WeightError> {
        let bad = |why: String| WeightError {
            name: name.to_string(),
            why,
        };
        if rows == 0 || cols == 0 {
            return Err(bad(format!("empty shape [{rows}, {cols}]")));
        }
        let bits = (w.1 * 8) / (rows * cols);
        let groups = s.1 / 2 / rows;
        if bits * rows * cols != w.1 * 8
            || groups == 0
            || !cols.is_multiple_of(groups)
            || s.1 != b.1
        {
            return Err(bad(format!(
                "sizes (weights {} B, scales {} B) do not fit shape [{rows}, {cols}]",
                w.1, s.1
            )));
        }
        for (o, l) in [w, s, b] {
            if o + l > buf_len {
                return Err(bad("extends past the end of its file".into()));
            }
        }
        let q = Self {
            w,
            s,
            b,
            rows,
            cols,
            bits: bits as u32,
            group_size: cols / groups,
        };
        if !matches!(q.bits, 2 | 4 | 8) || !matches!(q.group_size, 32 | 64 | 128) {
            return Err(bad(format!(
                "{}-bit, group {} is not supported (2/4/8-bit, group 32/64/128)",
                q.bits, q.group_size
            )));
        }
        Ok(q)
    }

    /// Rows `r0..r0 + n` of this matrix (rows are contiguous in the packed weights, scales and
    /// biases alike). Panics when the rows are out of range (a caller's bug).
    pub fn rows_range(&self, r0: usize, n: usize) -> QRef {
        assert!(
            n > 0 && r0 + n <= self.rows,
            "rows {r0}..{} of {}",
            r0 + n,
            self.rows
        );
        let part = |(o, l): (usize, usize)| (o + l / self.rows * r0, l / self.rows * n);
        QRef {
            w: part(self.w),
            s: part(self.s),
            b: part(self.b),
            rows: n,
            ..*self
        }
    }

    /// A resident quantized tensor named `<base>.weight` in the index.
    pub fn resident(
        index: &ResidentIndex,
        file_len: usize,
        base: &str,
    ) -> Result<Self, WeightError> {
        let name = format!("{base}.weight");
        let e = entry(index, &name)?;
        if !e.is_quantized() || e.dtype != Dtype::U32 {
            return Err(WeightError {
                name,
                why: "expected a quantized (U32 + scales/biases) tensor".into(),
            });
        }
        let shape = e.logical_shape();
        if shape.len() != 2 {
            return Err(WeightError {
                name,
                why: format!("expected rank 2, got {shape:?}"),
            });
        }
        Self::from_parts(
            &name,
            shape[0] as usize,
            shape[1] as usize,
            (e.file_offset as usize, e.size_bytes as usize),
            (e.scale_offset as usize, e.scale_size as usize),
            (e.bias_offset as usize, e.bias_size as usize),
            file_len,
        )
    }

    /// An expert tensor inside a blob of `stride` bytes: `[weights, scales, biases]` from layout.json.
    pub fn expert(
        name: &str,
        parts: &[ExpertTensor; 3],
        stride: usize,
    ) -> Result<Self, WeightError> {
        let shape = &parts[0].shape;
        if shape.len() != 2 {
            return Err(WeightError {
                name: name.into(),
                why: format!("expected a per-expert rank-2 shape, got {shape:?}"),
            });
        }
        let r = |t: &ExpertTensor| (t.offset as usize, t.size as usize);
        Self::from_parts(
            name,
            shape[0] as usize,
            shape[1] as usize,
            r(&parts[0]),
            r(&parts[1]),
            r(&parts[2]),
            stride,
        )
    }
}

/// A BF16 vector (norm weight, scale) located in the mapped resident file.
#[derive(Clone, Copy, Debug)]
pub struct VRef {
    off: usize,
    pub len: usize,
}

impl VRef {
    /// `len` BF16 values at byte offset `off` of the resident buffer.
    pub fn at(off: usize, len: usize) -> Self {
        Self { off, len }
    }

    /// A resident BF16 tensor named `name` with `len` elements.
    pub fn resident(index: &ResidentIndex, name: &str, len: usize) -> Result<Self, WeightError> {
        Ok(Self {
            off: dense_offset(index, name, len, Dtype::BF16)?,
            len,
        })
    }

    /// Byte offset of element 0 in the resident buffer (a device backend reads its copy there).
    pub fn offset(&self) -> usize {
        self.off
    }

    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, buf: &[u8], i: usize) -> f32 {
        let o = self.off + 2 * i;
        bf16_to_f32(u16::from_le_bytes([buf[o], buf[o + 1]]))
    }

    /// The elements as f32, in order (a loop over them vectorizes: one bounds check in all).
    /// Panics if the vector does not lie inside `buf`.
    pub fn iter<'a>(&self, buf: &'a [u8]) -> impl Iterator<Item = f32> + 'a {
        buf[self.off..self.off + 2 * self.len]
            .chunks_exact(2)
            .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
    }

    /// All elements as f32 (for small vectors read once per step).
    pub fn to_vec(&self, buf: &[u8]) -> Vec<f32> {
        (0..self.len).map(|i| self.get(buf, i)).collect()
    }
}

/// An F32 vector located in the mapped resident file (DeepSeek-V4's `e_score_correction_bias`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FRef {
    off: usize,
    pub len: usize,
}

impl FRef {
    /// `len` F32 values at byte offset `off` of the resident buffer.
    pub fn at(off: usize, len: usize) -> Self {
        Self { off, len }
    }

    /// A resident F32 tensor named `name` with `len` elements.
    pub fn resident(index: &ResidentIndex, name: &str, len: usize) -> Result<Self, WeightError> {
        Ok(Self {
            off: dense_offset(index, name, len, Dtype::F32)?,
            len,
        })
    }

    /// Byte offset of element 0 in the resident buffer.
    pub fn offset(&self) -> usize {
        self.off
    }

    /// Element `i`.
    #[inline]
    pub fn get(&self, buf: &[u8], i: usize) -> f32 {
        let o = self.off + 4 * i;
        f32::from_le_bytes([buf[o], buf[o + 1], buf[o + 2], buf[o + 3]])
    }
}

/// A small resident float vector (BF16, F16 or F32) of `len` elements, converted to f32 at load
/// (DeltaNet's `A_log`, `dt_bias`, `conv1d.weight`).
pub fn f32_vector(
    index: &ResidentIndex,
    map: &[u8],
    name: &str,
    len: usize,
) -> Result<Vec<f32>, WeightError> {
    let bad = |why: String| WeightError {
        name: name.into(),
        why,
    };
    let e = entry(index, name)?;
    let width = match e.dtype {
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F32 => 4,
        d => return Err(bad(format!("expected a float vector, found {d:?}"))),
    };
    if e.is_quantized() || e.size_bytes as usize != len * width {
        return Err(bad(format!(
            "expected {len} values, found {} bytes of {:?}",
            e.size_bytes, e.dtype
        )));
    }
    let b = e.weight_bytes(map);
    Ok(match e.dtype {
        Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    })
}

/// Byte offset of the unquantized resident tensor `name`, which must hold `len` values of `dtype`.
fn dense_offset(
    index: &ResidentIndex,
    name: &str,
    len: usize,
    dtype: Dtype,
) -> Result<usize, WeightError> {
    let e = entry(index, name)?;
    if e.dtype != dtype || e.is_quantized() || e.size_bytes != len as u64 * dtype.size_bytes() {
        return Err(WeightError {
            name: name.into(),
            why: format!(
                "expected {len} {dtype} values, found {:?} of {} bytes",
                e.dtype, e.size_bytes
            ),
        });
    }
    Ok(e.file_offset as usize)
}

fn entry<'a>(index: &'a ResidentIndex, name: &str) -> Result<&'a IndexEntry, WeightError> {
    index.get(name).ok_or_else(|| WeightError {
        name: name.into(),
        why: "missing from model_weights.bin".into(),
    })
}
