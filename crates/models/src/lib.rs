//! Model families over a `.gturbo` install: one file per family (`gemma4.rs`, …), each written once
//! against the op layer (`mference-backend`), sharing the [`Engine`] (install, mapped resident
//! weights, settings) and the per-layer expert streamers.

pub mod deepseek_v4;
pub mod gemma4;
pub mod inkling;
pub mod maple;
pub mod prefix;
pub mod qwen3_5_moe;

mod engine;
mod error;
mod family;
mod forward;
mod loading;
mod model;
mod options;
mod registry;
mod state;
mod streamers;

pub use engine::Engine;
pub use error::ModelError;
pub use family::{FamilyModel, Parts, PartsMut};
pub(crate) use forward::{check_ids, into_residual, next_pre, one};
pub use forward::{head, run_chunked, ChunkWant, Head, Logits, Want};
pub(crate) use loading::{
    check_dims, check_sizes, expert_linear, linear, parse_config, text_config, unsupported,
};
pub use mference_backend::DeviceExpertStats;
pub use mference_cuda::{GpuExpertBudget, MissSplit};
pub use model::{Model, StepTimes};
pub use options::{Device, LoadOptions};
pub use prefix::PrefixCache;
pub use registry::{
    check_config, check_device, check_flags, check_kernels, load, load_install, probe_device,
    required_ops,
};
pub use state::{CompressedKv, LayerState, Rings, SequenceState};
pub use streamers::Streamers;
