//! Where checkpoint bytes come from: a local directory or an HTTP(S) mirror in Hugging
//! Face's `resolve/{revision}/{file}` layout. Both are read with byte ranges only.

pub mod http;
pub mod local;

use crate::verify::Published;
use crate::InstallError;
use std::io::Read;

/// Identity of a source, recorded in the journal and receipt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceId {
    /// `owner/name` for Hugging Face, `local:<absolute dir>` for a directory.
    pub repo_id: String,
    /// Requested revision (`local` for a directory).
    pub revision: String,
    /// Resolved commit (40 hex) when known, else the revision.
    pub resolved_commit: String,
    /// The HTTP base URL when it is not `https://huggingface.co` (a mirror, `--base-url`), so a
    /// resume hint can name it; `None` for the hub and for a directory.
    pub base_url: Option<String>,
}

/// A checkpoint source. `rel` is a file path inside the checkpoint (e.g. `config.json`).
pub trait Source: Send + Sync {
    /// Identity for the journal and the receipt.
    fn id(&self) -> SourceId;

    /// Read a whole small file (config, index, tokenizer sidecars), refusing more than
    /// `cap` bytes. `Ok(None)` if the file does not exist.
    fn read_small(&self, rel: &str, cap: u64) -> Result<Option<Vec<u8>>, InstallError>;

    /// Size in bytes of `rel`, `Ok(None)` if it does not exist.
    fn size_of(&self, rel: &str) -> Result<Option<u64>, InstallError>;

    /// Stream bytes `start..end` of `rel`. The reader yields exactly `end - start` bytes or
    /// fails; transient failures are retried inside (HTTP).
    fn open_range(
        &self,
        rel: &str,
        start: u64,
        end: u64,
    ) -> Result<Box<dyn Read + Send + '_>, InstallError>;

    /// Requests made so far for data ranges (for reports and tests).
    fn range_requests(&self) -> u64 {
        0
    }

    /// The digest the source publishes for `rel` ([`crate::verify`]), `Ok(None)` if none.
    fn published_digest(&self, _rel: &str) -> Result<Option<Published>, InstallError> {
        Ok(None)
    }

    /// Whether every file of this source should have a published digest (an HTTP source in
    /// Hugging Face's layout); a file without one is then refused unless unverified installs are
    /// allowed.
    fn publishes_digests(&self) -> bool {
        false
    }
}

/// The install error for a failed read of `rel` (`what`: what was being read): an HTTP failure
/// as [`InstallError::SourceUnreachable`] or [`InstallError::Http`], a short local file or other
/// read failure as [`InstallError::SourceInvalid`].
pub fn read_error(rel: &str, what: &str, e: std::io::Error) -> InstallError {
    if let Some(h) = e
        .get_ref()
        .and_then(|r| r.downcast_ref::<http::HttpReadError>())
    {
        return h.to_install_error();
    }
    InstallError::SourceInvalid {
        detail: format!("{rel}: {what}: {e}"),
    }
}
