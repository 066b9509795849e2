//! mference-kernels
