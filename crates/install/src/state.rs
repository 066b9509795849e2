//! `verify`, `inspect` and `discard` on an install path.

use crate::journal::{fsync_parent, Journal};
use crate::lock::InstallLock;
use crate::run::{write_receipt, OutPaths};
use crate::InstallError;
use mference_format::hash::{read_capped, sha256_file, sha256_hex};
use mference_format::manifest::MANIFEST_MAX_BYTES;
use mference_format::{
    FormatError, Install, Manifest, Receipt, VerifyPolicy, MANIFEST_FILE, RECEIPT_FILE,
};
use std::path::{Path, PathBuf};

/// Result of [`verify`].
#[derive(Clone, Debug)]
pub struct VerifySummary {
    /// Files the manifest lists, all hashed (the manifest itself is hashed too, not counted).
    pub files: usize,
    /// Their bytes: the install's size, as `inspect` and `install` report it.
    pub bytes: u64,
}

/// Rehash every file listed in the manifest (and the manifest), check the structure
/// ([`Install::open`]), and rewrite `verified-install.json` bound to `dir`. Errors:
/// [`InstallError::PartialInstall`] for `<out>.partial`, or for `<out>` while only a saved
/// partial install (or its journal) is there; [`InstallError::NotAnInstall`] for a directory with
/// no manifest at all.
pub fn verify(dir: &Path) -> Result<VerifySummary, InstallError> {
    let paths = OutPaths::new(&strip_partial(dir))?;
    if (strip_partial(dir) != dir || !paths.out.exists())
        && (paths.partial.exists() || paths.journal.exists())
    {
        return Err(InstallError::PartialInstall {
            path: dir.to_path_buf(),
            hint: resume_hint(&paths),
            out: paths.out,
        });
    }
    // Nothing of an install here (a damaged install with files but no manifest is reported as
    // incomplete below).
    if dir.is_dir()
        && !dir.join(MANIFEST_FILE).exists()
        && !dir.join(mference_format::WEIGHTS_FILE).exists()
    {
        return Err(InstallError::NotAnInstall {
            path: dir.to_path_buf(),
            detail: "no manifest.json, no model_weights.bin, no partial install and no journal"
                .into(),
        });
    }
    let dir = std::fs::canonicalize(dir).map_err(|e| InstallError::io("cannot open", dir, e))?;
    let mbytes = read_capped(&dir.join(MANIFEST_FILE), MANIFEST_FILE, MANIFEST_MAX_BYTES)?;
    let manifest = Manifest::parse(&mbytes)?;
    let mut bytes = 0u64;
    for (rel, want) in &manifest.files {
        let (size, sha) = sha256_file(&dir.join(rel)).map_err(|e| match e {
            FormatError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                FormatError::MissingFile {
                    path: dir.join(rel),
                }
            }
            other => other,
        })?;
        if size != want.size {
            return Err(FormatError::SizeMismatch {
                rel: rel.clone(),
                expected: want.size,
                actual: size,
            }
            .into());
        }
        if !sha.eq_ignore_ascii_case(&want.sha256) {
            return Err(FormatError::ShaMismatch {
                rel: rel.clone(),
                expected: want.sha256.clone(),
                actual: sha,
            }
            .into());
        }
        bytes += size;
    }
    Install::open(&dir, VerifyPolicy::FullSha256)?;
    let old = read_capped(&dir.join(RECEIPT_FILE), RECEIPT_FILE, 4 << 20)
        .ok()
        .and_then(|b| Receipt::parse(&b).ok());
    let source = old
        .as_ref()
        .and_then(crate::receipt::SourceRecord::from_receipt);
    write_receipt(&dir, &dir, &manifest, &mbytes, source.as_ref())?;
    debug_assert_eq!(sha256_hex(&mbytes).len(), 64);
    Ok(VerifySummary {
        files: manifest.files.len(),
        bytes,
    })
}

/// What [`inspect`] found at an output path.
#[derive(Clone, Debug)]
pub struct InspectReport {
    /// Another process holds the install lock: the partial install is being written now, not
    /// interrupted.
    pub running: bool,
    pub out: PathBuf,
    /// The manifest of a complete install, if present and parseable.
    pub manifest: Option<Manifest>,
    /// Total bytes of the files listed in the manifest.
    pub installed_bytes: u64,
    /// Whether `<out>.partial/` exists.
    pub partial: bool,
    /// The journal of a saved partial install.
    pub journal: Option<Journal>,
    /// With a saved partial install: how to continue or remove it ([`resume_hint`]).
    pub partial_hint: Option<String>,
}

/// Describe `<out>`: the complete install (family, arch, sizes) and any saved partial
/// install (journaled ranges and bytes). Accepts `<out>` or `<out>.partial`.
pub fn inspect(out: &Path) -> Result<InspectReport, InstallError> {
    let paths = OutPaths::new(&strip_partial(out))?;
    let manifest = read_capped(
        &paths.out.join(MANIFEST_FILE),
        MANIFEST_FILE,
        MANIFEST_MAX_BYTES,
    )
    .ok()
    .map(|b| Manifest::parse(&b))
    .transpose()?;
    let journal = paths
        .journal
        .exists()
        .then(|| Journal::load(&paths.journal))
        .transpose()?;
    let partial = paths.partial.is_dir();
    if manifest.is_none() && journal.is_none() && !partial {
        return Err(InstallError::NotAnInstall {
            path: paths.out,
            detail: "no manifest.json, no partial install and no journal".into(),
        });
    }
    let installed_bytes = manifest
        .as_ref()
        .map(|m| m.files.values().map(|f| f.size).sum())
        .unwrap_or(0);
    let partial_hint = (partial || journal.is_some()).then(|| resume_hint(&paths));
    let running = crate::lock::held_elsewhere(&paths);
    Ok(InspectReport {
        running,
        out: paths.out,
        manifest,
        installed_bytes,
        partial,
        journal,
        partial_hint,
    })
}

/// What to do with the saved partial install of `paths.out`: the `mference install ...
/// --resume` that continues it (its source from the journal when there is one) or the
/// `mference discard` that removes it.
pub fn resume_hint(paths: &OutPaths) -> String {
    let journal = Journal::load(&paths.journal).ok();
    let source = match &journal {
        None => "<SOURCE>".to_string(),
        Some(j) => match j.repo_id.strip_prefix("local:") {
            Some(dir) => dir.to_string(),
            None => match crate::presets::PRESETS
                .iter()
                .find(|p| p.repo == j.repo_id && p.revision == j.requested_revision)
            {
                Some(p) => format!("--model {}", p.name),
                None => format!("--repo {} --revision {}", j.repo_id, j.requested_revision),
            },
        },
    };
    let base = journal
        .as_ref()
        .and_then(|j| j.base_url.as_deref())
        .map(|b| format!(" --base-url {b}"))
        .unwrap_or_default();
    let out = paths.out.display();
    format!("continue it with `mference install {source}{base} --output {out} --resume` or remove it with `mference discard {out}`")
}

/// Remove a saved partial install and its journal, under the install lock, and the lock file
/// itself unless a complete install is there. Returns whether anything was removed. A complete
/// install is never touched; with nothing to discard, nothing is created either.
pub fn discard(out: &Path) -> Result<bool, InstallError> {
    let paths = OutPaths::new(&strip_partial(out))?;
    let leftovers = [
        &paths.partial,
        &paths.journal,
        &journal_tmp(&paths),
        &paths.old(),
    ]
    .iter()
    .any(|p| p.exists());
    // One left by a killed installer: nothing holds it, but it should not outlive the install.
    let stale_lock = paths.lock.exists() && !paths.out.exists();
    if !leftovers && !stale_lock {
        return Ok(false);
    }
    let _lock = InstallLock::acquire(&paths)?;
    let mut removed = stale_lock;
    if paths.partial.exists() {
        std::fs::remove_dir_all(&paths.partial)
            .map_err(|e| InstallError::io("cannot remove", &paths.partial, e))?;
        removed = true;
    }
    for p in [paths.journal.clone(), journal_tmp(&paths)] {
        if p.exists() {
            std::fs::remove_file(&p).map_err(|e| InstallError::io("cannot remove", &p, e))?;
            removed = true;
        }
    }
    // An --overwrite interrupted mid-promotion leaves the previous install at `<out>.old`: restore it
    // when nothing took its place, drop it when the new install is in place.
    let old = paths.old();
    if old.exists() {
        if paths.out.exists() {
            std::fs::remove_dir_all(&old)
                .map_err(|e| InstallError::io("cannot remove", &old, e))?;
        } else {
            std::fs::rename(&old, &paths.out)
                .map_err(|e| InstallError::io("cannot restore", &old, e))?;
        }
        removed = true;
    }
    fsync_parent(&paths.partial)?;
    Ok(removed)
}

fn journal_tmp(paths: &OutPaths) -> PathBuf {
    paths.journal.with_extension("json.tmp")
}

fn strip_partial(p: &Path) -> PathBuf {
    let s = p.to_string_lossy();
    match s.trim_end_matches('/').strip_suffix(".partial") {
        Some(base) => PathBuf::from(base),
        None => p.to_path_buf(),
    }
}
