//! mference-cuda: the CUDA backend of the op layer (`docs/ARCHITECTURE.md`, issue 11's first
//! slice): the ops of [`mference_backend::Backend`] it has kernels for (the rest it says it lacks
//! through [`CoreOps::supports`]), each a kernel or a composition of kernels, correct first, on
//! one device and one stream.
//!
//! Modules: `device` (probe, context, kernel loading, [`CudaBackend`]) and `compile` (NVRTC and
//! its on-disk cache); `pool` (tensors, KV, state, the activation reuse pool); `launch` (the
//! `launch!` macro: `cuLaunchKernelEx` with programmatic dependent launch on sm_90+, every
//! kernel waiting for its predecessor in `grid_dep_wait`; argument structs, grids); `weights`
//! (where a product's bytes are); `ops/`, one module per op group beside its `.cu` (elementwise,
//! quant, gemm, norm, attention, recurrent, router); `experts` and `device_experts` (the GPU
//! expert cache and its hooks); `backend` (the op-layer traits, delegating to `ops/`).
//!
//! - Kernels: the `.cu` sources of `ops/` (one translation unit), compiled at startup by
//!   NVRTC into a cubin for the device's compute capability and cached on disk (`compile.rs`).
//!   Only the driver (`libcuda`) and NVRTC (`libnvrtc`) are needed at run time, both loaded
//!   dynamically: the crate builds and its tests run on a machine without CUDA.
//! - Buffers: the resident bytes (`model_weights.bin`) are copied to the device once, and
//!   [`QRef`] / [`VRef`] offsets index that copy, so [`Weights::Resident`] reads no host data.
//!   With [`CudaBackend::with_expert_cache`], routed experts live in GPU slots (`experts.rs`:
//!   `--gpu-expert-budget`, LFU as on the CPU, misses copied in from the page-locked host slots
//!   on a copy stream ordered by events); without it, a [`Weights::Blob`] is copied to a device
//!   staging buffer on every call.
//! - Quantized products: `qmv` / `qmatmul` (ops/quant.cu) for decode's one row (2-bit `qmv`
//!   stages x in shared memory, laid out for the lanes' loads), `qgemm_tc`
//!   (ops/gemm.cu, `ops/gemm.rs`: a tensor-core GEMM, `mma.sync` on BF16 codes and a three-term
//!   BF16 x, f32 accumulation; for 4-bit matrices `qgemm_tc4`, the same bits pipelined by
//!   `cp.async` over x split once per product) from 2 rows of x on; the prefill experts a layer's
//!   GPU slots hold run together, up to 256 products a launch ([`CoreOps::glu_mlp_experts`]). Prefill attention is `attention_tiled`
//!   (ops/attention.cu: KV rows shared by the query rows and heads of a KV head's group).
//! - Activations are [`CudaTensor`]s (`CudaSlice<f32>` + shape), the KV cache a [`CudaKv`]
//!   (device K and V, FP16 or FP32, ring or linear, indexed as `mference_runtime::KvLayer`),
//!   recurrent state a [`CudaState`].
//! - Device → host copies happen only in `read`, `all_finite`, `head_argmax` and `route`.

#[macro_use]
mod launch;
mod backend;
mod compile;
mod device;
mod device_experts;
mod experts;
mod host_experts;
mod ops;
mod pool;
mod weights;

pub use compile::default_cache_dir;
pub use device::{CudaBackend, KernelOrigin};
pub use experts::{auto_margin, ExpertCacheOptions, ExpertGeometry, GpuExpertBudget};
pub use host_experts::MissSplit;
pub use pool::{CudaKv, CudaState, CudaTensor};

use launch::*;
use pool::*;

use std::collections::{BTreeMap, HashMap};
use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    DriverError, LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use experts::{CacheError, GpuExperts};
use mference_backend::cpu::ResidentBytes;
use mference_backend::{
    check, check_forced, check_glu_combine, check_glu_rows, check_mlp, deepseek_v4_checks, Act,
    AttnShape, CoreOps, DeepSeekV4Ops, DeltaShape, DeviceExpertOps, DeviceExpertStats, HcSpec,
    InklingOps, KvDtype, KvState, Mlp, Norm, Op, OpError, OpResult, PreNorm, QRef, RecurrentOps,
    RelBias, Rope, RopeStyle, RouterSpec, Routes, Scoring, SinkRouter, Tensor, Unary, VRef,
    Weights,
};

/// Why the CUDA backend could not start. Each names what is missing and what to do.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so` could not be loaded.
    #[error(
        "no CUDA driver: libcuda.so could not be loaded (install the NVIDIA driver, or run on the CPU)"
    )]
    NoDriver,
    /// `libnvrtc.so` could not be loaded.
    #[error(
        "no NVRTC: libnvrtc.so could not be loaded; it ships with the CUDA toolkit (for example in \
         /usr/local/cuda/targets/x86_64-linux/lib or /usr/local/cuda/lib64): add that folder to \
         LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    /// The ordinal names no device.
    #[error("no CUDA device {ordinal}: the driver sees {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    /// A driver call failed.
    #[error("CUDA driver: {what}: {err}")]
    Driver {
        what: &'static str,
        err: DriverError,
    },
    /// NVRTC failed (its log is included).
    #[error("NVRTC could not compile the kernels for {arch}: {log}")]
    Compile { arch: String, log: String },
}

impl CudaError {
    /// Whether CUDA is simply not there (no driver, no NVRTC, no device), as opposed to failing:
    /// `--device auto` then runs on the CPU.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Self::NoDriver | Self::NoNvrtc | Self::NoDevice { count: 0, .. }
        )
    }
}

fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CudaError {
    move |err| CudaError::Driver { what, err }
}
