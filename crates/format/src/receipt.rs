//! `verified-install.json` (`docs/FORMAT.md`): binds a verification to
//! the manifest hash and the install directory path.

use crate::manifest::FileEntry;
use crate::{FormatError, Manifest};
use std::collections::BTreeMap;
use std::path::Path;

/// Largest receipt accepted, bytes.
pub const RECEIPT_MAX_BYTES: u64 = 4 * 1024 * 1024;

/// The receipt. `files` = the manifest's files plus `manifest.json`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Receipt {
    pub schema_version: u64,
    /// Lower-case hex SHA-256 of `manifest.json`.
    pub manifest_sha256: String,
    /// Absolute path of the install directory the receipt is bound to.
    pub model_directory_path: String,
    #[serde(
        rename = "sourceRepoID",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub source_repo_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub source_revision: Option<String>,
    /// ISO 8601 UTC, e.g. `2026-01-31T12:00:00Z`.
    pub verification_timestamp: String,
    pub tool_version: String,
    pub files: BTreeMap<String, FileEntry>,
    /// How far the source's bytes were checked at install, in one sentence (see `source_files`).
    /// Absent in older receipts.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub source_bytes: Option<String>,
    /// Every source file the install read, by its name in the checkpoint: its size, the SHA-256
    /// of all its bytes as read, and the digest the source published that they matched. Absent
    /// in older receipts.
    #[serde(skip_serializing_if = "BTreeMap::is_empty", default)]
    pub source_files: BTreeMap<String, SourceFile>,
}

/// One source file of an install, as read and checked at install time.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourceFile {
    /// Bytes read (the whole file).
    pub size: u64,
    /// Lower-case hex SHA-256 of the bytes read.
    pub sha256: String,
    /// The published digest the bytes matched, e.g. `sha256:<hex> from X-Linked-Etag` or
    /// `git-blob-sha1:<hex> from ETag`; absent when the source published none (a plain local
    /// directory).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub verified_against: Option<String>,
}

fn rerr(detail: impl Into<String>) -> FormatError {
    FormatError::ReceiptInvalid {
        detail: detail.into(),
    }
}

impl Receipt {
    /// Parse receipt bytes.
    pub fn parse(bytes: &[u8]) -> Result<Receipt, FormatError> {
        serde_json::from_slice(bytes).map_err(|e| rerr(format!("not a receipt: {e}")))
    }

    /// Pretty-printed, sorted-key bytes with a trailing newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        crate::manifest::to_pretty_sorted(&serde_json::to_value(self).expect("serializable"))
    }

    /// Check schema, manifest binding, directory binding (`dir` must equal
    /// `modelDirectoryPath`), and that the file set and every size/SHA equal the manifest's
    /// (plus `manifest.json` itself).
    pub fn validate(
        &self,
        dir: &Path,
        manifest: &Manifest,
        manifest_sha256: &str,
        manifest_size: u64,
    ) -> Result<(), FormatError> {
        if self.schema_version != 1 {
            return Err(rerr(format!(
                "unsupported schemaVersion {}",
                self.schema_version
            )));
        }
        if !self.manifest_sha256.eq_ignore_ascii_case(manifest_sha256) {
            return Err(rerr("it was written for a different manifest.json"));
        }
        if Path::new(&self.model_directory_path) != dir {
            return Err(rerr(format!(
                "it is bound to {}, not {} (the install was moved)",
                self.model_directory_path,
                dir.display()
            )));
        }
        let mut want: BTreeMap<&str, &FileEntry> = manifest
            .files
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .collect();
        let me = FileEntry {
            size: manifest_size,
            sha256: manifest_sha256.to_string(),
        };
        want.insert(crate::MANIFEST_FILE, &me);
        if want.len() != self.files.len() || !want.keys().all(|k| self.files.contains_key(*k)) {
            return Err(rerr("its file set differs from the manifest's"));
        }
        for (k, w) in want {
            let r = &self.files[k];
            if r.size != w.size || !r.sha256.eq_ignore_ascii_case(&w.sha256) {
                return Err(rerr(format!(
                    "size or SHA-256 of {k} differs from the manifest"
                )));
            }
        }
        Ok(())
    }
}

/// Current UTC time as ISO 8601 (`YYYY-MM-DDTHH:MM:SSZ`).
pub fn utc_timestamp_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}
