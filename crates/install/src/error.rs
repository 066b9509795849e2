use mference_format::FormatError;
use std::path::PathBuf;

/// `errno` for "no space left on device".
pub(crate) const ENOSPC: i32 = 28;

/// Every way an install, verify, inspect or discard can fail. Messages say what to do.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "install busy: another installer holds {lock}; wait for it to finish (nothing was changed)"
    )]
    Busy { lock: PathBuf },
    #[error("a saved partial install exists at {partial} (resume or discard it): pass --resume, or run `mference discard {out}`")]
    PartialExists { partial: PathBuf, out: PathBuf },
    #[error("the install state next to {out} is inconsistent ({detail}); run `mference discard {out}` and install again")]
    StateCorrupt { out: PathBuf, detail: String },
    #[error("{path} is not a complete install: the install into {out} was interrupted and saved as a partial install; {hint}")]
    PartialInstall {
        path: PathBuf,
        out: PathBuf,
        /// What to run: [`crate::state::resume_hint`].
        hint: String,
    },
    #[error("{out} already exists; pass --overwrite to replace it")]
    OutputExists { out: PathBuf },
    #[error("{out} exists and is not an mference install (no GTURBO manifest.json), so --overwrite will not delete it; remove it yourself or choose another --output")]
    OverwriteRefused { out: PathBuf },
    #[error("the saved partial install does not match this source or plan ({detail}); run `mference discard {out}` to start over")]
    ResumeMismatch { out: PathBuf, detail: String },
    #[error("not enough free disk at {dir}: need {need} bytes ({remaining} bytes of output still to write + a reserve of {reserve} bytes, {reserve_rule}), {free} free; free some space or choose another --output")]
    DiskFull {
        dir: PathBuf,
        need: u64,
        remaining: u64,
        reserve: u64,
        /// How the reserve was chosen, e.g. "1/16 of the output, at least 16 MiB".
        reserve_rule: String,
        free: u64,
    },
    #[error("the disk filled up writing {path}: free some space, then run the same `mference install` with --resume (the ranges written so far are kept)")]
    DiskFilled { path: PathBuf },
    #[error("the copy plan is invalid: {detail}")]
    PlanInvalid { detail: String },
    #[error("source checkpoint is invalid: {detail}")]
    SourceInvalid { detail: String },
    #[error(
        "source pin check failed: {detail}; the remote repository changed or the mirror is wrong"
    )]
    PinMismatch { detail: String },
    #[error("HTTP error for {url}: {detail}")]
    Http { url: String, detail: String },
    #[error("cannot reach the source at {url}: {detail}; check the network and the address (--base-url, $HF_ENDPOINT), then run the same command again (with --resume if a partial install was saved)")]
    SourceUnreachable { url: String, detail: String },
    #[error("{file} does not match the digest the source publishes for it: expected {expected}, the bytes read hash to {actual}; the file changed after it was published (a mirror, a damaged cache blob) or on the way. Nothing from {file} is kept as verified; once the source serves the published bytes, run the same command again (with --resume if a partial install was saved)")]
    SourceDigestMismatch {
        file: String,
        /// The published digest, as [`crate::verify::Published::describe`] writes it.
        expected: String,
        /// The digest of the bytes served, same kind, hex.
        actual: String,
    },
    #[error("the source published no digest for {file} (no SHA-256 in X-Linked-Etag, no git blob id in ETag), so its bytes cannot be checked; use a server that passes Hugging Face's headers through, or pass --allow-unverified to install it unchecked (the receipt will say so)")]
    SourceDigestMissing { file: String },
    #[error("{file} in the checkpoint does not parse: {detail}; `run`, `serve` and `perplexity` would fail on it. Fix or replace the file in the checkpoint and install again")]
    SidecarInvalid { file: String, detail: String },
    #[error("tokenizer.json has {tokenizer} token ids but the model's vocabulary (config.json vocab_size, the embedding rows) is {model}: ids from {model} up would index past the embedding. Use the tokenizer that belongs to this checkpoint")]
    VocabMismatch { tokenizer: u64, model: u64 },
    #[error("{path} is not an install or partial install: {detail}")]
    NotAnInstall { path: PathBuf, detail: String },
    #[error("invalid option: {detail}")]
    BadOption { detail: String },
}

impl InstallError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        if source.raw_os_error() == Some(ENOSPC) {
            return InstallError::DiskFilled { path: path.into() };
        }
        InstallError::Io {
            what,
            path: path.into(),
            source,
        }
    }
}
