//! The ops by group, each beside its kernels: inherent methods that `backend.rs` delegates to, and
//! the recurrent group's trait impl.

mod attention;
mod deepseek_v4;
mod elementwise;
mod gemm;
mod inkling;
mod moe;
mod norm;
mod quant;
mod recurrent;
mod router;
