//! The `.gturbo` install format (`docs/FORMAT.md`).
//!
//! An install is a directory:
//! ```text
//! manifest.json  verified-install.json  model_weights.bin
//! tokenizer/{config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, ...}
//! packed_experts/{layout.json, layer_00.bin ... layer_NN.bin}
//! ```
//! This crate owns the encodings (resident index, manifest, layout, receipt), the
//! MLX checkpoint metadata the installer reads (safetensors headers, the `config.json`
//! quantization block, architecture facts), and the loader-side checks ([`Install::open`]).
//! It has no HTTP and no install policy.

pub mod arch;
pub mod dtype;
mod error;
pub mod family;
pub mod hash;
pub mod install;
pub mod layout;
pub mod manifest;
pub mod quant;
pub mod receipt;
pub mod resident;
pub mod safetensors;

pub use arch::ArchInfo;
pub use dtype::Dtype;
pub use error::FormatError;
pub use family::{Family, FamilySpec, ToolCallSyntax, REGISTRY};
pub use install::{Install, OpenOptions, VerifyPolicy};
pub use layout::{ExpertBlobLayout, ExpertTensor, LayerLayout, Layout};
pub use manifest::{FileEntry, Flags, Manifest, QuantSlot, QuantSlots};
pub use quant::{QuantConfig, QuantSpec};
pub use receipt::Receipt;
pub use resident::{IndexEntry, ResidentIndex};
pub use safetensors::{SafetensorsHeader, TensorInfo};

/// The fixed "format page" of `.gturbo` files, in bytes: the resident index is padded
/// to it and the expert stride is a multiple of it, independent of the host page size.
pub const FORMAT_PAGE_BYTES: u64 = 16_384;

/// Relative path of the manifest inside an install.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Relative path of the verification receipt inside an install.
pub const RECEIPT_FILE: &str = "verified-install.json";
/// Relative path of the resident weights file inside an install.
pub const WEIGHTS_FILE: &str = "model_weights.bin";
/// Relative path of the expert layout inside an install.
pub const LAYOUT_FILE: &str = "packed_experts/layout.json";
/// Directory (relative) holding the per-layer expert files.
pub const EXPERTS_DIR: &str = "packed_experts";
/// Directory (relative) holding the tokenizer sidecars and the checkpoint's `config.json`.
pub const TOKENIZER_DIR: &str = "tokenizer";
/// The compact form of `tokenizer/tokenizer.json` that `run` and `serve` build on their first
/// start and use afterwards, bound to that file's SHA-256 (ours; not in the manifest or the
/// receipt: it is derived, checked on every load, and may be deleted).
pub const TOKENIZER_CACHE_FILE: &str = "cache/tokenizer.bin";

/// Relative path of the expert file of `layer` (`packed_experts/layer_NN.bin`).
pub fn layer_file_name(layer: usize) -> String {
    format!("{EXPERTS_DIR}/layer_{layer:02}.bin")
}

/// Round `v` up to a multiple of [`FORMAT_PAGE_BYTES`].
pub fn round_up_to_page(v: u64) -> u64 {
    v.div_ceil(FORMAT_PAGE_BYTES) * FORMAT_PAGE_BYTES
}
