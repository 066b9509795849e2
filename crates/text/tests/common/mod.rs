//! Shared helpers for the integration tests: the bundled tokenizer folders.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use mference_text::{Family, Tokenizer};

pub const FAMILIES: [(Family, &str); 3] = [
    (Family::Gemma4, "gemma4"),
    (Family::Qwen3_5Moe, "qwen3_6"),
    (Family::DeepseekV4, "deepseek_v4"),
];

/// `assets/tokenizers/<name>` of the repository.
pub fn tokenizer_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/tokenizers")
        .join(name)
}

/// Loading a 33 MB tokenizer.json takes a while; load each once per test binary.
pub fn tokenizer(name: &str) -> &'static Tokenizer {
    static TOKS: OnceLock<Vec<(String, Tokenizer)>> = OnceLock::new();
    let toks = TOKS.get_or_init(|| {
        std::thread::scope(|s| {
            let handles: Vec<_> = FAMILIES
                .iter()
                .map(|(_, n)| {
                    s.spawn(move || {
                        (
                            n.to_string(),
                            Tokenizer::from_dir(&tokenizer_dir(n)).unwrap(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    });
    &toks
        .iter()
        .find(|(n, _)| n == name)
        .expect("known family")
        .1
}

pub fn read_json(path: PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}
