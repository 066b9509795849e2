//! The parsers that read untrusted bytes, one entry point per fuzz target: what comes from a
//! checkpoint source (safetensors headers, the index, `config.json`), what an install directory
//! holds (manifest, layout, receipt, resident index, resume journal), what a client sends
//! (request bodies with their messages) and what a model writes (tool-call text).
//!
//! `fuzz/` (cargo-fuzz, nightly) runs each target under libFuzzer; the smoke test here runs the
//! same entry points on mutated seeds on the stable toolchain, in CI. A target fails by
//! panicking, hanging or allocating what a length field asks for; every error must come back as
//! a value.

use std::io::Read;
use std::path::Path;

use mference_install::{InstallError, Source, SourceId};

/// A target's entry point: any bytes in, nothing out (it must not panic).
pub type Target = fn(&[u8]);

/// Every target: its name (the `fuzz/fuzz_targets/<name>.rs` file) and its entry point.
pub const TARGETS: &[(&str, Target)] = &[
    ("safetensors_header", safetensors_header),
    ("checkpoint", checkpoint),
    ("config_json", config_json),
    ("manifest", manifest),
    ("layout", layout),
    ("receipt", receipt),
    ("resident_index", resident_index),
    ("journal", journal),
    ("chat_request", mference_server::fuzz::chat_body),
    ("completion_request", mference_server::fuzz::completion_body),
    ("tool_calls", tool_calls),
];

/// A shard's first 8 bytes (the header length) and the JSON header after them, bounded by the
/// input's length as the file size.
pub fn safetensors_header(data: &[u8]) {
    let Some(first) = data.get(..8) else { return };
    let first: [u8; 8] = first.try_into().expect("8 bytes");
    if let Ok(n) = mference_format::safetensors::header_len(&first, "f") {
        if let Some(json) = data.get(8..8 + n as usize) {
            let _ = mference_format::safetensors::SafetensorsHeader::parse(
                json,
                "f",
                Some(data.len() as u64),
            );
        }
    }
}

/// The files of an in-memory checkpoint: `config.json`, `model.safetensors.index.json` (absent
/// when empty) and `model.safetensors`, split from the input at [`SPLIT`].
pub const SPLIT: &[u8] = b"\n--8<--\n";

struct MemSource {
    files: Vec<(&'static str, Vec<u8>)>,
}

impl MemSource {
    fn file(&self, rel: &str) -> Option<&[u8]> {
        self.files
            .iter()
            .find(|(n, _)| *n == rel)
            .map(|(_, b)| b.as_slice())
    }
}

impl Source for MemSource {
    fn id(&self) -> SourceId {
        SourceId {
            repo_id: "fuzz/checkpoint".into(),
            revision: "main".into(),
            resolved_commit: "main".into(),
            base_url: None,
        }
    }
    fn read_small(&self, rel: &str, cap: u64) -> Result<Option<Vec<u8>>, InstallError> {
        match self.file(rel) {
            Some(b) if b.len() as u64 > cap => Err(InstallError::SourceInvalid {
                detail: format!("{rel} above the cap"),
            }),
            other => Ok(other.map(<[u8]>::to_vec)),
        }
    }
    fn size_of(&self, rel: &str) -> Result<Option<u64>, InstallError> {
        Ok(self.file(rel).map(|b| b.len() as u64))
    }
    fn open_range(
        &self,
        rel: &str,
        start: u64,
        end: u64,
    ) -> Result<Box<dyn Read + Send + '_>, InstallError> {
        let b = self.file(rel).ok_or_else(|| InstallError::SourceInvalid {
            detail: format!("{rel} is missing"),
        })?;
        let range = usize::try_from(start)
            .ok()
            .zip(usize::try_from(end).ok())
            .and_then(|(s, e)| b.get(s..e))
            .ok_or_else(|| InstallError::SourceInvalid {
                detail: format!("{rel}: range {start}..{end} is beyond the file"),
            })?;
        Ok(Box::new(range))
    }
}

fn split<'a>(data: &'a [u8], at: &[u8]) -> Vec<&'a [u8]> {
    let mut parts = Vec::new();
    let mut rest = data;
    while let Some(i) = rest.windows(at.len()).position(|w| w == at) {
        parts.push(&rest[..i]);
        rest = &rest[i + at.len()..];
    }
    parts.push(rest);
    parts
}

/// A whole checkpoint as the installer reads it: metadata ([`mference_install::checkpoint::load`])
/// and the install plan ([`mference_install::plan::build`]).
pub fn checkpoint(data: &[u8]) {
    let parts = split(data, SPLIT);
    let names = [
        "config.json",
        "model.safetensors.index.json",
        "model.safetensors",
    ];
    let files = names
        .iter()
        .zip(parts)
        .filter(|(n, b)| !(b.is_empty() && **n == "model.safetensors.index.json"))
        .map(|(n, b)| (*n, b.to_vec()))
        .collect();
    let src = MemSource { files };
    if let Ok(ck) = mference_install::checkpoint::load(&src, None) {
        let _ = mference_install::plan::build(&ck, 64 << 20);
    }
}

/// A checkpoint `config.json`: family, arch block and quantization block.
pub fn config_json(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = mference_format::ArchInfo::from_config(&v);
        let _ = mference_format::QuantConfig::from_config(&v);
    }
}

pub fn manifest(data: &[u8]) {
    let _ = mference_format::Manifest::parse(data);
}

pub fn layout(data: &[u8]) {
    let _ = mference_format::Layout::parse(data);
}

pub fn receipt(data: &[u8]) {
    let _ = mference_format::Receipt::parse(data);
}

/// The resident index at the head of `model_weights.bin`: the header alone, then the whole index.
pub fn resident_index(data: &[u8]) {
    let _ = mference_format::ResidentIndex::parse_header(data);
    let _ = mference_format::ResidentIndex::parse_prefix(data);
    let _ = mference_format::ResidentIndex::parse(data);
}

pub fn journal(data: &[u8]) {
    let _ = mference_install::journal::Journal::parse(data, Path::new("fuzz.resume.json"));
}

/// Model output parsed for tool calls, for every family.
pub fn tool_calls(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    for f in [
        mference_text::Family::Gemma4,
        mference_text::Family::Qwen3_5Moe,
        mference_text::Family::DeepseekV4,
        mference_text::Family::Maple,
        mference_text::Family::Inkling,
    ] {
        let _ = mference_text::parse_tool_calls(f, &text);
    }
}

/// Runs the target `name` on `data` (the libFuzzer binaries' one line). Panics on an unknown name.
pub fn run(name: &str, data: &[u8]) {
    let (_, target) = TARGETS
        .iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no fuzz target {name}"));
    target(data)
}
