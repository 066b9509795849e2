//! Runtime building blocks shared by every family: the expert streamer (per-layer slot cache over
//! the packed expert files), the FP16 KV cache, and the sampler.
//!
//! The design is in `docs/ARCHITECTURE.md`; the model math lives in `mference-models`.

mod io;
pub mod kv;
mod layer_file;
pub mod pool;
pub mod sampler;
pub mod sizing;
pub mod slab;
pub mod slots;
pub mod streamer;
pub mod trace;
pub mod units;

pub use kv::{KvDtype, KvLayer, KvRow};
pub use pool::{CachePlan, ExpertPolicy, SlotPool};
pub use sampler::{Sampler, SamplerConfig};
pub use slots::{CacheSlots, Eviction, SlotTable};
pub use streamer::{ExpertStreamer, StreamerStats};
pub use trace::RoutingTrace;
pub use units::parse_bytes;

/// Errors raised by the runtime building blocks.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("routing trace {path}: {why}")]
    Trace { path: String, why: String },
    #[error("cannot open expert file {path}: {source}")]
    OpenLayer {
        path: String,
        source: std::io::Error,
    },
    #[error("expert file {path} is {actual} bytes, expected {expected} ({experts} experts × {stride}-byte stride); the install is damaged: run `mference verify` or reinstall")]
    LayerSize {
        path: String,
        actual: u64,
        expected: u64,
        experts: usize,
        stride: u64,
    },
    #[error("reading expert {expert} from {path}: {source}")]
    Read {
        path: String,
        expert: usize,
        source: std::io::Error,
    },
    #[error("cannot allocate the {bytes}-byte expert slab: {source}")]
    Slab {
        bytes: usize,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}
