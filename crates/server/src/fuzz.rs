//! Entry points for the fuzz targets (`crates/fuzzing`): the request parsers on untrusted bytes,
//! exactly as the HTTP handlers call them. Not an API.

use crate::api;
use mference_text::Family;

const FAMILIES: [Family; 5] = [
    Family::Gemma4,
    Family::Qwen3_5Moe,
    Family::DeepseekV4,
    Family::Maple,
    Family::Inkling,
];

/// A `/v1/chat/completions` body: JSON, then the request checks and message normalisation for
/// every family's template.
pub fn chat_body(bytes: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
        for f in FAMILIES {
            let _ = api::parse_chat(&v, "m", f);
        }
    }
}

/// A `/v1/completions` body.
pub fn completion_body(bytes: &[u8]) {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
        let _ = api::parse_completion(&v, "m");
    }
}
