//! mference-kernels: the CPU speed core.
//!
//! - [`QMatrix`]: a zero-copy view of an MLX affine-quantized Linear (`reference/architectures.md` §7):
//!   packed u32 words (little-endian), bf16 scales and biases, group size 32/64/128, bits 4 or 8.
//!   The byte slices may be only 2-byte aligned (they point into a mapped file); nothing here assumes more.
//! - [`Kernels`]: a table of function pointers (scalar reference, AVX2+FMA, AVX-512) chosen once at startup
//!   with [`Kernels::detect`]. Every SIMD kernel has a scalar twin it is tested against.
//! - [`ThreadPool`]: a persistent worker pool (spin briefly, then park; the caller takes a share) with
//!   row-split GEMV/GEMM and a fused greedy-head argmax.
//!
//! The math of every quantized product is `y_r = Σ_groups ( scale·Σ q_i x_i + bias·Σ x_i )`, accumulated in f32
//! (the factoring used by MLX's own `quantized_matmul`).

mod dispatch;
mod pool;
mod prepared;
mod qmatrix;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use dispatch::Kernels;
pub use half::f16;
pub use pool::{MatJob, ThreadPool};
pub use prepared::PreparedX;
pub use qmatrix::{bf16_to_f32, QMatrix};

/// Errors from validating kernel inputs (shapes and formats of quantized tensors).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// Only 4- and 8-bit MLX affine quantization is implemented.
    #[error("unsupported quantization bits {0} (supported: 4, 8)")]
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
