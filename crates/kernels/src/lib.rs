//! mference-kernels: the CPU speed core (`docs/ARCHITECTURE.md`).
//!
//! - [`QMatrix`]: a zero-copy view of an MLX affine-quantized Linear (mlx's `mx.quantize` affine mode; `docs/FORMAT.md`):
//!   packed u32 words (little-endian), bf16 scales and biases, group size 32/64/128, bits 2, 4 or 8.
//!   The byte slices may be only 2-byte aligned (they point into a mapped file); nothing here assumes more.
//! - [`Kernels`]: a table of function pointers (scalar reference, AVX2+FMA, AVX-512, and opt-in
//!   AVX-512 VNNI variants: int16 activations in every 4-bit product (`avx512i16`, and `amx`, the
//!   same bits with its prompt GEMM on AMX tiles), int8 in the prefill GEMM; and `avx2i16`, int16
//!   activations on AVX2)
//!   chosen once at startup with [`Kernels::detect`]. Every SIMD kernel has a scalar
//!   twin it is tested against (`tests/quant_kernels.rs`, `tests/f32_f16_kernels.rs`).
//! - [`PreparedX`]: activations reordered once per product for the chosen table (plus per-group sums for the
//!   bias term); share one across matrices that read the same input (an expert's gate and up).
//! - [`ThreadPool`]: a persistent worker pool (spin briefly, then park; the caller takes a share) with
//!   row-split GEMV/GEMM, [`ThreadPool::gemm_batch`] (many products in one parallel region) and a fused
//!   greedy-head argmax ([`ThreadPool::gemv_argmax`]).
//!
//! The math of every quantized product is `y_r = Σ_groups ( scale·Σ q_i x_i + bias·Σ x_i )`, accumulated in f32
//! (the factoring used by MLX's own `quantized_matmul`).
//!
//! Numerics. The exact tables (`scalar`, `avx2`, `avx512`) differ only in f32 summation order: measured against
//! an f64 dequantize-then-matmul, errors stay below 4e-6 of `Σ (|scale|·q + |bias|)·|x|` (observed ≈ 2.5e-7).
//! Within one table, a row's result does not depend on how rows are split (bit-identical across `gemv_rows`
//! ranges and thread counts), and on the exact tables a token's result does not depend on how many tokens
//! share the product: its GEMM row is bit-identical to its GEMV (batch invariance; each table's GEMV and
//! GEMM share one per-(row, token) operation sequence, see `x86/avx512.rs` and `x86/avx2.rs`). `avx512vnni` rounds the prefill (GEMM) activations of 4-bit matrices to int8 per
//! group (its 2- and 8-bit products are the exact AVX-512 ones); with outlier-heavy activations its error
//! reaches ~1.5e-2 of the same magnitude, so [`Kernels::detect`] never picks it.
//!
//! Typical decode use:
//! ```
//! use mference_kernels::{Kernels, MatJob, QMatrix, ThreadPool};
//! # let (rows, cols) = (8, 64);
//! # let w = vec![0x21u8; rows * cols / 2];
//! # let sb = vec![0x80u8, 0x3f].repeat(rows * cols / 64); // bf16 1.0
//! let k = Kernels::detect();
//! let pool = ThreadPool::new(2);
//! let m = QMatrix::new(&w, &sb, &sb, rows, cols, 4, 64)?; // views into the mapped install
//! let x = vec![0.5f32; cols];
//! let mut y = vec![0.0f32; rows];
//! pool.gemv(k, &m, &x, &mut y); // y = W x
//! assert_eq!(y[0], 0.5 * (32.0 * 1.0 + 32.0 * 2.0) + 0.5 * 64.0); // Σ (1·q + 1)·0.5
//! // Several matrices sharing one input: prepare once, one parallel region.
//! let p = k.prepare(&m, &x, 1);
//! let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
//! pool.gemm_batch(k, &mut [MatJob { m, x: &p, y: &mut a }, MatJob { m, x: &p, y: &mut b }]);
//! assert_eq!(a, y);
//! # Ok::<(), mference_kernels::KernelError>(())
//! ```

mod dispatch;
mod pool;
mod prepared;
mod qmatrix;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use dispatch::Kernels;
pub use half::f16;
pub use pool::{MatJob, PairJob, ThreadPool, DEFAULT_SPIN};
pub use prepared::PreparedX;
pub use qmatrix::{bf16_to_f32, QMatrix};

/// Errors from validating kernel inputs (shapes and formats of quantized tensors).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// Only 2-, 4- and 8-bit MLX affine quantization is implemented (not 3, 5 or 6).
    #[error("unsupported quantization bits {0} (supported: 2, 4, 8)")]
    UnsupportedBits(u32),
    /// Only group sizes 32, 64 and 128 are implemented (MLX's set).
    #[error("unsupported group size {0} (supported: 32, 64, 128)")]
    UnsupportedGroupSize(usize),
    /// `cols` must be a multiple of the group size (MLX leaves such Linears unquantized).
    #[error("cols {cols} is not a multiple of group size {group_size}")]
    ColsNotMultipleOfGroup { cols: usize, group_size: usize },
    /// A byte slice does not have the length implied by `rows`, `cols`, `bits` and `group_size`.
    #[error("{what}: expected {expected} bytes for the declared shape, got {got}")]
    BadLength {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// `rows` or `cols` is zero.
    #[error("empty matrix: rows {rows}, cols {cols}")]
    Empty { rows: usize, cols: usize },
}
