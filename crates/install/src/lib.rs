//! mference-install: builds `.gturbo` installs (`docs/FORMAT.md`).
//!
//! Sequence: take `<out>.install.lock`; read `config.json`, the index (checked against a
//! pin) and each shard's safetensors header with byte ranges; plan every tensor piece as a
//! range copy (destinations never overlap; ranges coalesced to ≤ 64 MiB); check free disk;
//! read the small files (tokenizer, template) and check them against the digests the source
//! publishes and parse them; journal `<out>.resume.json` then stage `<out>.partial/`; read each
//! shard front to back through a hasher, copying each range through ≤ 512 KiB tiles (fsync,
//! then journal it with its destination digest) and checking the shard's published digest;
//! hash every output file, write the manifest and receipt (which says what each source file was
//! checked against), verify them, rename into place and fsync the parent.
//! Quantized bytes are copied unchanged.

pub mod checkpoint;
pub mod copy;
pub mod disk;
mod error;
pub mod journal;
pub mod lock;
pub mod maple;
pub mod plan;
pub mod presets;
pub mod progress;
pub mod receipt;
pub mod run;
pub mod sidecars;
pub mod source;
pub mod state;
pub mod stream;
pub mod verify;

pub use error::InstallError;
pub use progress::ProgressMode;
pub use run::{install, InstallOptions, InstallReport, OutPaths};
pub use source::{http::HttpSource, local::LocalSource, Source, SourceId};

use std::path::Path;

/// Install a local mlx-community-style checkpoint directory into `output`
/// (`<name>.gturbo`). Errors: see [`InstallError`]; nothing is written before the plan
/// and the free-disk check pass.
pub fn install_local(
    source_dir: &Path,
    output: &Path,
    opts: &InstallOptions,
) -> Result<InstallReport, InstallError> {
    let src = LocalSource::new(source_dir)?;
    install(&src, output, opts)
}
