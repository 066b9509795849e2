//! The checkpoint journal `<out>.resume.json` (schema 1), always replaced atomically
//! (write temp, fsync, rename, fsync the directory).

use crate::InstallError;
use mference_format::receipt::SourceFile;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// Largest journal accepted, bytes.
pub const JOURNAL_MAX_BYTES: u64 = 8 << 20;

/// One durable range: its destination bytes were fsynced before it was recorded.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CompletedRange {
    pub id: String,
    /// SHA-256 (hex) of the range's destination bytes in copy order.
    pub destination_digest: String,
    pub source_bytes: u64,
    pub destination_bytes: u64,
}

/// The journal document.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Journal {
    pub schema: u32,
    #[serde(rename = "repoID")]
    pub repo_id: String,
    pub requested_revision: String,
    pub resolved_commit: String,
    #[serde(rename = "sourceIndexSHA256")]
    pub source_index_sha256: String,
    pub plan_fingerprint: String,
    pub total_source_bytes: u64,
    pub completed_ranges: Vec<CompletedRange>,
    /// The source's base URL when it is not the hub (`--base-url`), for the resume hint; absent
    /// in journals that predate it and for the hub.
    #[serde(rename = "baseURL", default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Source shards read whole and matched against their published digest, by file name; a
    /// resume reads again every shard not listed here (absent in older journals: none).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub verified_source_files: BTreeMap<String, SourceFile>,
}

impl Journal {
    /// Read a journal. Errors: unreadable, too large, not a schema-1 journal.
    pub fn load(path: &Path) -> Result<Journal, InstallError> {
        let bytes = mference_format::hash::read_capped(path, "resume journal", JOURNAL_MAX_BYTES)?;
        Self::parse(&bytes, path)
    }

    /// [`Journal::load`] of bytes already read from `path` (named in errors).
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Journal, InstallError> {
        let j: Journal = serde_json::from_slice(bytes).map_err(|e| InstallError::StateCorrupt {
            out: path.to_path_buf(),
            detail: format!("the journal is not valid: {e}"),
        })?;
        if j.schema != 1 {
            return Err(InstallError::StateCorrupt {
                out: path.to_path_buf(),
                detail: format!("journal schema {} is not supported", j.schema),
            });
        }
        Ok(j)
    }

    /// Atomically replace the journal at `path`.
    pub fn store(&self, path: &Path) -> Result<(), InstallError> {
        write_atomic(
            path,
            &serde_json::to_vec_pretty(self).expect("serializable"),
        )
    }
}

/// Write `bytes` to `path` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), InstallError> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    let mut f =
        std::fs::File::create(&tmp).map_err(|e| InstallError::io("cannot create", &tmp, e))?;
    f.write_all(bytes)
        .map_err(|e| InstallError::io("cannot write", &tmp, e))?;
    f.sync_all()
        .map_err(|e| InstallError::io("cannot fsync", &tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| InstallError::io("cannot rename", &tmp, e))?;
    fsync_parent(path)
}

/// fsync the directory containing `path`.
pub fn fsync_parent(path: &Path) -> Result<(), InstallError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fsync_dir(parent)
}

/// fsync a directory.
pub fn fsync_dir(dir: &Path) -> Result<(), InstallError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| InstallError::io("cannot fsync directory", dir, e))
}
