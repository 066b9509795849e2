//! x86-64 SIMD kernel tables (AVX2+FMA+F16C, AVX-512 F/BW/VL).

use crate::dispatch::Kernels;

/// SIMD tables this CPU supports, slowest first.
pub(crate) fn available() -> Vec<&'static Kernels> {
    Vec::new()
}
