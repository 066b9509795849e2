//! The error of loading or running a model.

use mference_backend::{OpError, WeightError};
use mference_runtime::RuntimeError;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Format(#[from] mference_format::FormatError),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error(transparent)]
    Tensor(#[from] WeightError),
    #[error(transparent)]
    Op(#[from] OpError),
    #[error("config: {0}")]
    Config(String),
    #[error("device: {0}")]
    Device(String),
    #[error("input: {0}")]
    Input(String),
    /// NaN or infinity in the residual stream or the logits: never turned into text.
    #[error("non-finite values (NaN or infinity) in the {what} at positions {first}..{end}: the install's weights are probably damaged (run `mference verify` on it; `--verify trusted-receipt` does not rehash the layer files) or the activations overflowed")]
    NonFinite {
        what: &'static str,
        first: usize,
        end: usize,
    },
    #[error("context full: {need} tokens needed, max context is {max} (raise --max-context)")]
    ContextFull { need: usize, max: usize },
    #[error("cannot map {path}: {source}")]
    Map {
        path: String,
        source: std::io::Error,
    },
}
