//! Writing `verified-install.json` (`docs/FORMAT.md`): the install's files bound to its manifest
//! and path, and what the source's bytes were checked against.

use crate::journal::write_atomic;
use crate::source::SourceId;
use crate::verify::SourceCheck;
use crate::InstallError;
use mference_format::manifest::{FileEntry, Manifest};
use mference_format::receipt::{utc_timestamp_now, SourceFile};
use mference_format::{Receipt, MANIFEST_FILE, RECEIPT_FILE};
use std::collections::BTreeMap;
use std::path::Path;

/// Tool version written into receipts.
pub const TOOL_VERSION: &str = concat!("mference-install ", env!("CARGO_PKG_VERSION"));

/// Where an install's bytes came from, for its receipt.
#[derive(Clone, Debug, Default)]
pub struct SourceRecord {
    pub repo_id: String,
    pub revision: String,
    /// The receipt's `sourceBytes` sentence.
    pub statement: String,
    /// The receipt's `sourceFiles`.
    pub files: BTreeMap<String, SourceFile>,
}

impl SourceRecord {
    /// The record of an install from `sid` whose source files were checked as `checks` say.
    pub fn new(sid: &SourceId, checks: &[SourceCheck]) -> SourceRecord {
        let unverified: Vec<&str> = checks
            .iter()
            .filter(|c| c.against.is_none())
            .map(|c| c.file.as_str())
            .collect();
        let statement = if unverified.is_empty() {
            format!(
                "verified: every byte of the {} source files was hashed as read and matched the \
                 digest the source publishes for it (sourceFiles)",
                checks.len()
            )
        } else if sid.repo_id.starts_with("local:") && unverified.len() == checks.len() {
            "read from a local directory as they are on disk (it publishes no digests to check \
             against); sourceFiles has the SHA-256 of each file as read"
                .to_string()
        } else {
            format!(
                "{} of {} source files verified against the digest the source publishes; not \
                 verified (no digest published): {}",
                checks.len() - unverified.len(),
                checks.len(),
                unverified.join(", ")
            )
        };
        SourceRecord {
            repo_id: sid.repo_id.clone(),
            revision: sid.revision.clone(),
            statement,
            files: checks
                .iter()
                .map(|c| (c.file.clone(), c.record()))
                .collect(),
        }
    }

    /// The record an existing receipt holds (for `verify`, which rewrites the receipt).
    pub fn from_receipt(r: &Receipt) -> Option<SourceRecord> {
        let repo_id = r.source_repo_id.clone()?;
        Some(SourceRecord {
            statement: r
                .source_bytes
                .clone()
                .unwrap_or_else(|| source_trust(&repo_id).to_string()),
            revision: r.source_revision.clone().unwrap_or_default(),
            files: r.source_files.clone(),
            repo_id,
        })
    }
}

/// Write `verified-install.json` into `dir`, bound to `bound` (the final install path).
pub fn write_receipt(
    dir: &Path,
    bound: &Path,
    manifest: &Manifest,
    manifest_bytes: &[u8],
    source: Option<&SourceRecord>,
) -> Result<Receipt, InstallError> {
    let manifest_sha256 = mference_format::hash::sha256_hex(manifest_bytes);
    let mut files = manifest.files.clone();
    files.insert(
        MANIFEST_FILE.into(),
        FileEntry {
            size: manifest_bytes.len() as u64,
            sha256: manifest_sha256.clone(),
        },
    );
    let receipt = Receipt {
        schema_version: 1,
        manifest_sha256,
        model_directory_path: bound.to_string_lossy().into_owned(),
        source_repo_id: source.map(|s| s.repo_id.clone()),
        source_revision: source.map(|s| s.revision.clone()),
        verification_timestamp: utc_timestamp_now(),
        tool_version: TOOL_VERSION.into(),
        files,
        source_bytes: source.map(|s| s.statement.clone()),
        source_files: source.map(|s| s.files.clone()).unwrap_or_default(),
    };
    write_atomic(&dir.join(RECEIPT_FILE), &receipt.to_bytes())?;
    Ok(receipt)
}

/// What a receipt written before `sourceBytes` existed means for its source: how far installers
/// of that time checked the bytes.
pub fn source_trust(repo_id: &str) -> &'static str {
    if repo_id.starts_with("local:") {
        "read from a local directory as they are on disk"
    } else {
        "trusted as served: HTTP(S) ranges checked against the safetensors headers, the sizes and \
         the index SHA-256 only (installed before source files were checked against published \
         digests)"
    }
}
