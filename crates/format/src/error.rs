use std::path::PathBuf;

/// Every way reading or validating an install (or a source checkpoint's metadata) can fail.
/// Each message says what was wrong and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is missing: the install is incomplete; reinstall it (mference install ... --overwrite)")]
    MissingFile { path: PathBuf },
    #[error("{rel} is {actual} bytes but the manifest says {expected}: the file was truncated or replaced; reinstall the model")]
    SizeMismatch {
        rel: String,
        expected: u64,
        actual: u64,
    },
    #[error("SHA-256 of {rel} is {actual}, the manifest says {expected}: the file is corrupt; reinstall the model")]
    ShaMismatch {
        rel: String,
        expected: String,
        actual: String,
    },
    #[error("{rel} is {size} bytes, above the {cap}-byte cap for this file: not a valid install")]
    TooLarge { rel: String, size: u64, cap: u64 },
    #[error(
        "manifest.json is invalid: {detail}; reinstall the model with this version of mference"
    )]
    ManifestInvalid { detail: String },
    #[error("manifest.json has unknown flag \"{flag}\": it was written by a newer or different tool; reinstall with this version of mference")]
    UnknownFlag { flag: String },
    #[error(
        "manifest.json enables {feature}, which this runtime does not support; reinstall the model"
    )]
    UnsupportedFeature { feature: String },
    #[error("architecture mismatch in {field}: manifest has {manifest}, {against} has {other}; the install does not match its config.json or the requested model; reinstall it")]
    ArchMismatch {
        field: String,
        manifest: String,
        against: String,
        other: String,
    },
    #[error("expert stride {stride} is not a multiple of the page size {page}: this install cannot be mapped here; reinstall it")]
    StrideNotPageAligned { stride: u64, page: u64 },
    #[error("model_weights.bin index is invalid: {detail}; reinstall the model")]
    ResidentIndexInvalid { detail: String },
    #[error("packed_experts/layout.json is invalid: {detail}; reinstall the model")]
    LayoutInvalid { detail: String },
    #[error("verified-install.json is invalid: {detail}; run `mference verify <install>` to rehash and rewrite it")]
    ReceiptInvalid { detail: String },
    #[error("config.json is invalid: {detail}")]
    ConfigInvalid { detail: String },
    #[error(
        "unknown architecture \"{model_type}\": supported model_type values are {}",
        crate::family::supported_model_types()
    )]
    UnknownArchitecture { model_type: String },
    #[error("quantization metadata is missing or incompatible: {detail}; install an MLX affine-quantized checkpoint (config.json with a \"quantization\" block)")]
    QuantInvalid { detail: String },
    #[error("tensor {name}: {detail}; the checkpoint does not match its config.json")]
    ShapeMismatch { name: String, detail: String },
    #[error("safetensors header of {file} is invalid: {detail}")]
    SafetensorsInvalid { file: String, detail: String },
    #[error("layer {layer} has no expert file in this install")]
    NoSuchLayer { layer: usize },
}

impl FormatError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }
}
