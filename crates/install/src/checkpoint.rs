//! Reading a source checkpoint's metadata: `config.json`, `model.safetensors.index.json`
//! (checked against a pin), each shard's safetensors header, and the tokenizer sidecars.

use crate::source::{read_error, Source};
use crate::InstallError;
use mference_format::hash::sha256_hex;
use mference_format::safetensors::{header_len, SafetensorsHeader};
use std::io::Read;

/// Files copied into `<install>/tokenizer/` when present, with their size caps (bytes).
/// `config.json` is required; the others are optional.
pub const SIDECARS: &[(&str, u64)] = &[
    ("config.json", 4 << 20),
    ("tokenizer.json", 64 << 20),
    ("tokenizer_config.json", 4 << 20),
    ("special_tokens_map.json", 4 << 20),
    ("chat_template.jinja", 4 << 20),
    ("chat_template.json", 4 << 20),
    ("generation_config.json", 4 << 20),
];

/// The sidecars that turn text into token ids; an install without `tokenizer.json` runs on token
/// ids only (`mference logits`, `mference bench`).
pub const TOKENIZER_FILES: &[&str] = &["tokenizer.json", "tokenizer_config.json"];

/// Expected source identity (a preset).
#[derive(Clone, Debug)]
pub struct Pin {
    /// Lower-case hex SHA-256 of `model.safetensors.index.json`.
    pub index_sha256: String,
}

/// One shard of the checkpoint.
#[derive(Clone, Debug)]
pub struct Shard {
    /// File name inside the checkpoint, e.g. `model-00001-of-00004.safetensors`.
    pub file: String,
    pub header: SafetensorsHeader,
    /// File size, bytes.
    pub size: u64,
}

/// Everything the planner needs from the source, read before any byte is written.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub config: serde_json::Value,
    /// `config.json` as read.
    pub config_bytes: Vec<u8>,
    /// `model.safetensors.index.json` as read, if the checkpoint has one.
    pub index_bytes: Option<Vec<u8>>,
    /// SHA-256 of `model.safetensors.index.json` (or, for a single-file checkpoint with no
    /// index, of `model.safetensors`'s 8-byte length + JSON header).
    pub index_sha256: String,
    pub shards: Vec<Shard>,
    /// Sidecars present in the source: (file name, size in bytes).
    pub sidecars: Vec<(String, u64)>,
}

impl Checkpoint {
    /// The install-time warning for a checkpoint without `tokenizer.json` (the golden fixtures
    /// ship none): it installs, but text commands will refuse it. `None` when the tokenizer is there.
    pub fn tokenizer_warning(&self) -> Option<String> {
        let has = |f: &str| self.sidecars.iter().any(|(n, _)| n == f);
        if has(TOKENIZER_FILES[0]) {
            return None;
        }
        let missing: Vec<&str> = TOKENIZER_FILES
            .iter()
            .copied()
            .filter(|f| !has(f))
            .collect();
        Some(format!(
            "the checkpoint has no tokenizer files ({} missing): the install takes token ids only \
             (`mference logits`, `mference bench`); `run`, `perplexity` and `serve` will refuse it. \
             Add the tokenizer files to the checkpoint and reinstall to use text",
            missing.join(", ")
        ))
    }
}

fn invalid(detail: impl Into<String>) -> InstallError {
    InstallError::SourceInvalid {
        detail: detail.into(),
    }
}

/// The 8-byte length and JSON header of shard `file`, the parsed header and the file size.
fn read_header(
    source: &dyn Source,
    file: &str,
) -> Result<(Vec<u8>, SafetensorsHeader, u64), InstallError> {
    let mut first = [0u8; 8];
    source
        .open_range(file, 0, 8)?
        .read_exact(&mut first)
        .map_err(|e| read_error(file, "cannot read the header length", e))?;
    let n = header_len(&first, file)?;
    let mut json = vec![0u8; n as usize];
    source
        .open_range(file, 8, 8 + n)?
        .read_exact(&mut json)
        .map_err(|e| read_error(file, "cannot read the header", e))?;
    let size = source
        .size_of(file)?
        .ok_or_else(|| invalid(format!("{file} is missing")))?;
    let header = SafetensorsHeader::parse(&json, file, Some(size))?;
    let mut raw = first.to_vec();
    raw.extend_from_slice(&json);
    Ok((raw, header, size))
}

/// Read the checkpoint metadata. Errors: missing `config.json` or shards, index/header
/// disagreement, pin mismatch ([`InstallError::PinMismatch`]).
pub fn load(source: &dyn Source, pin: Option<&Pin>) -> Result<Checkpoint, InstallError> {
    let config_bytes = source
        .read_small("config.json", 4 << 20)?
        .ok_or_else(|| invalid("config.json is missing"))?;
    let config: serde_json::Value = serde_json::from_slice(&config_bytes)
        .map_err(|e| invalid(format!("config.json is not JSON: {e}")))?;
    let index = source.read_small("model.safetensors.index.json", 64 << 20)?;
    let (index_sha256, shard_files, weight_map) = match &index {
        Some(bytes) => {
            let sha = sha256_hex(bytes);
            let v: serde_json::Value = serde_json::from_slice(bytes)
                .map_err(|e| invalid(format!("model.safetensors.index.json is not JSON: {e}")))?;
            let wm = v
                .get("weight_map")
                .and_then(|w| w.as_object())
                .ok_or_else(|| invalid("model.safetensors.index.json has no weight_map"))?;
            let mut map = std::collections::BTreeMap::new();
            for (k, f) in wm {
                let f = f
                    .as_str()
                    .ok_or_else(|| invalid(format!("weight_map[{k}] is not a string")))?;
                if f.contains('/') || f.contains("..") {
                    return Err(invalid(format!(
                        "weight_map names a file outside the checkpoint: {f}"
                    )));
                }
                map.insert(k.clone(), f.to_string());
            }
            let mut files: Vec<String> = map.values().cloned().collect();
            files.sort();
            files.dedup();
            (sha, files, Some(map))
        }
        None => (String::new(), vec!["model.safetensors".to_string()], None),
    };
    if let Some(p) = pin {
        if index.is_none() {
            return Err(InstallError::PinMismatch {
                detail: "model.safetensors.index.json is missing".into(),
            });
        }
        if !p.index_sha256.eq_ignore_ascii_case(&index_sha256) {
            return Err(InstallError::PinMismatch {
                detail: format!(
                    "index SHA-256 is {index_sha256}, the preset pins {}",
                    p.index_sha256
                ),
            });
        }
    }
    let mut shards = Vec::with_capacity(shard_files.len());
    let mut single_header_sha = None;
    for file in &shard_files {
        let (raw, header, size) = read_header(source, file)?;
        if index.is_none() {
            single_header_sha = Some(sha256_hex(&raw));
        }
        shards.push(Shard {
            file: file.clone(),
            header,
            size,
        });
    }
    if let Some(wm) = &weight_map {
        let mut seen = 0usize;
        for s in &shards {
            for t in &s.header.tensors {
                match wm.get(&t.name) {
                    Some(f) if f == &s.file => seen += 1,
                    _ => {
                        return Err(invalid(format!(
                            "{} in {} is not mapped to that shard by the index",
                            t.name, s.file
                        )))
                    }
                }
            }
        }
        if seen != wm.len() {
            return Err(invalid(format!(
                "the index maps {} tensors but the shard headers hold {seen}",
                wm.len()
            )));
        }
    }
    let mut sidecars = Vec::new();
    for (name, cap) in SIDECARS {
        if let Some(size) = source.size_of(name)? {
            if size > *cap {
                return Err(invalid(format!(
                    "{name} is {size} bytes, above the {cap}-byte cap"
                )));
            }
            sidecars.push((name.to_string(), size));
        }
    }
    Ok(Checkpoint {
        config,
        config_bytes,
        index_bytes: index,
        index_sha256: single_header_sha.unwrap_or(index_sha256),
        shards,
        sidecars,
    })
}
