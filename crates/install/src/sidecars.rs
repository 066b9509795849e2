//! The checkpoint's small files (`config.json`, the index, the tokenizer and template files):
//! read whole into memory with progress, checked against their published digests, and the
//! tokenizer and chat template parsed the way `run` parses them, before anything is written.

use crate::checkpoint::Checkpoint;
use crate::progress::Progress;
use crate::source::{read_error, Source};
use crate::verify::{self, SourceCheck};
use crate::InstallError;
use mference_text::{ChatTemplate, TextError, Tokenizer};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The sidecar files' bytes (in [`Checkpoint::sidecars`] order) and what every small file was
/// checked against (the index included).
pub struct Sidecars {
    pub files: Vec<(String, Vec<u8>)>,
    pub checks: Vec<SourceCheck>,
}

/// Read the sidecars and check every small file against the digest `source` publishes for it
/// (`allow_unverified`: a file without one is accepted on a source that should publish one).
/// Errors: a read failure, a digest mismatch or a missing digest.
pub fn fetch(
    source: &dyn Source,
    ck: &Checkpoint,
    allow_unverified: bool,
    progress: &mut Progress,
) -> Result<Sidecars, InstallError> {
    let expected = |rel: &str| {
        verify::require(
            rel,
            source.published_digest(rel)?,
            source.publishes_digests(),
            allow_unverified,
        )
    };
    let mut checks = Vec::new();
    if let Some(index) = &ck.index_bytes {
        let rel = "model.safetensors.index.json";
        checks.push(verify::check_bytes(rel, index, expected(rel)?)?);
    }
    let total: u64 = ck
        .sidecars
        .iter()
        .filter(|(n, _)| n != "config.json")
        .map(|(_, s)| s)
        .sum();
    let names: Vec<String> = ck
        .sidecars
        .iter()
        .map(|(n, s)| format!("{n} ({s} bytes)"))
        .collect();
    progress.stage(&format!("reading {}", names.join(", ")));
    progress.start_bytes(total, 0);
    let mut files = Vec::with_capacity(ck.sidecars.len());
    for (name, size) in &ck.sidecars {
        let bytes = if name == "config.json" {
            ck.config_bytes.clone()
        } else {
            let mut out = Vec::with_capacity(*size as usize);
            let mut r = source.open_range(name, 0, *size)?;
            let mut tile = vec![0u8; 1 << 20];
            while (out.len() as u64) < *size {
                let n = ((*size - out.len() as u64) as usize).min(tile.len());
                r.read_exact(&mut tile[..n])
                    .map_err(|e| read_error(name, "cannot read", e))?;
                out.extend_from_slice(&tile[..n]);
                progress.inc(n as u64);
            }
            out
        };
        checks.push(verify::check_bytes(name, &bytes, expected(name)?)?);
        files.push((name.clone(), bytes));
    }
    progress.finish();
    Ok(Sidecars { files, checks })
}

/// A directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Parse the tokenizer and chat template as `run` will (`mference-text`) and check that every
/// token id the tokenizer can produce has an embedding row (`vocab_size`, from config.json).
/// Nothing to check without `tokenizer.json`. Errors: [`InstallError::SidecarInvalid`] naming the
/// file and the parse error, [`InstallError::VocabMismatch`] naming both sizes.
pub fn check_text(files: &[(String, Vec<u8>)], vocab_size: u64) -> Result<(), InstallError> {
    if !files.iter().any(|(n, _)| n == "tokenizer.json") {
        return Ok(());
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = TempDir(std::env::temp_dir().join(format!(
        "mference-install-check-{}-{nanos}",
        std::process::id()
    )));
    std::fs::create_dir_all(&dir.0).map_err(|e| InstallError::io("cannot create", &dir.0, e))?;
    for (name, bytes) in files {
        let p = dir.0.join(name);
        std::fs::write(&p, bytes).map_err(|e| InstallError::io("cannot write", &p, e))?;
    }
    let tokenizer = Tokenizer::from_dir(&dir.0).map_err(|e| sidecar_error(&dir.0, e))?;
    match ChatTemplate::from_dir(&dir.0) {
        Ok(_) | Err(TextError::NoChatTemplate(_)) => {}
        Err(e) => return Err(sidecar_error(&dir.0, e)),
    }
    let ids = tokenizer.vocab_size() as u64;
    if ids > vocab_size {
        return Err(InstallError::VocabMismatch {
            tokenizer: ids,
            model: vocab_size,
        });
    }
    Ok(())
}

/// The file a text error is about (its name in the checkpoint) and the error without the
/// temporary directory's path.
fn sidecar_error(dir: &Path, e: TextError) -> InstallError {
    let named = |p: &Path| {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let (file, detail) = match &e {
        TextError::TokenizerLoad { path, message } => (named(path), message.clone()),
        TextError::Json { path, message } => (named(path), message.clone()),
        TextError::Io { path, source } => (named(path), source.to_string()),
        TextError::TemplateSyntax(m) => {
            let file = if dir.join("chat_template.jinja").exists() {
                "chat_template.jinja"
            } else {
                "tokenizer_config.json (its chat_template)"
            };
            (file.to_string(), m.clone())
        }
        other => ("tokenizer.json".to_string(), other.to_string()),
    };
    InstallError::SidecarInvalid { file, detail }
}
