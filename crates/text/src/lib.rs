#![warn(missing_docs)]
//! mference-text: everything between token ids and text for the supported families.
//!
//! - [`Tokenizer`]: the HF `tokenizer.json` of an install, behind our own type.
//! - [`ChatTemplate`]: the install's Jinja chat template rendered with minijinja configured like
//!   transformers' `apply_chat_template` (transformers
//!   `utils/chat_template_utils.py`).
//! - [`StreamingDetokenizer`]: incremental decode that never splits a multi-byte UTF-8 character.
//! - [`stop_token_ids`] and [`StopStrings`]: per-family stop tokens and user stop strings
//!   (the original system's, github.com/NeelM0906/Mference).
//! - [`parse_tool_calls`]: per-family tool-call parsers that fail closed on malformed output
//!   (as in the original system, github.com/NeelM0906/Mference).
//! - [`ReasoningParser`]: a reply split into its reasoning block and its content.
//! - [`Tokenizer::token_bytes`]: the bytes each id writes, for constrained decoding.

mod detokenizer;
#[cfg(test)]
mod family_tests;
mod pyjson;
mod reasoning;
mod stops;
mod template;
mod tokenizer;
mod tokenizer_cache;
#[cfg(test)]
mod tokenizer_cache_tests;
mod tool_calls;
mod vocab;

pub use detokenizer::StreamingDetokenizer;
pub use mference_format::{Family, ToolCallSyntax};
pub use reasoning::{ReasoningParser, Split as ReasoningSplit};
pub use stops::{stop_token_ids, StopStrings};
pub use template::ChatTemplate;
pub use tokenizer::{Tokenizer, TokenizerCache};
pub use tool_calls::{parse_tool_calls, parse_tool_calls_with_tools, ParsedOutput, ToolCall};
pub use vocab::TokenBytes;

use std::path::PathBuf;

/// Errors of the text crate. Each message says what was wrong and, where there is one, what to do.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file of the tokenizer folder could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// `tokenizer.json` is gone from an install whose manifest lists it: the install is damaged.
    #[error("{path} is missing, but the install's manifest lists it: the install is incomplete or damaged (`mference verify` names what else is wrong); install it again")]
    TokenizerMissing {
        /// The missing file.
        path: PathBuf,
    },
    /// The folder has no `tokenizer.json`: the install was made from a checkpoint without tokenizer
    /// files, so it runs on token ids only.
    #[error("no tokenizer files in {dir} ({missing} missing): the install was made from a checkpoint without them, so it cannot turn text into tokens. `mference logits` and `mference bench` take token ids and work without a tokenizer; for text, add tokenizer.json and tokenizer_config.json to the checkpoint and reinstall")]
    NoTokenizer {
        /// The install's tokenizer folder.
        dir: PathBuf,
        /// The tokenizer files that are absent, comma-separated.
        missing: String,
    },
    /// `tokenizer.json` exists but the `tokenizers` crate rejected it.
    #[error("cannot load tokenizer {path}: {message} (is it an HF tokenizer.json?)")]
    TokenizerLoad {
        /// The `tokenizer.json` path.
        path: PathBuf,
        /// The error reported by `tokenizers`.
        message: String,
    },
    /// Encoding or decoding failed inside the `tokenizers` crate.
    #[error("tokenizer error: {0}")]
    Tokenize(String),
    /// A JSON file of the tokenizer folder is not valid JSON or has a field of the wrong type.
    #[error("invalid JSON in {path}: {message}")]
    Json {
        /// The file that failed.
        path: PathBuf,
        /// What was wrong.
        message: String,
    },
    /// Neither `chat_template.jinja` nor a `chat_template` string in `tokenizer_config.json` was found.
    #[error("no chat template in {0}: expected chat_template.jinja or tokenizer_config.json's chat_template")]
    NoChatTemplate(PathBuf),
    /// A template variable was given (`chat_template_kwargs`, `reasoning_effort`, `--think`)
    /// that the install's chat template never reads: it would change nothing.
    #[error("the chat template does not read `{name}`, so it would change nothing (the template reads: {known})")]
    TemplateVariable {
        /// The variable given.
        name: String,
        /// The variables the template reads, comma-separated.
        known: String,
    },
    /// The chat template does not compile.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// Rendering failed, including a `raise_exception(...)` from the template itself
    /// (for example "System message must be at the beginning.").
    #[error("chat template rejected the conversation: {0}")]
    TemplateRender(String),
    /// The model's output contains a tool-call block that does not parse; the whole output is rejected.
    #[error("malformed {} tool call: {message}", message_name(*family))]
    MalformedToolCall {
        /// The family whose syntax was expected.
        family: Family,
        /// What was wrong, with the offending part.
        message: String,
    },
}

/// The family's name in [`TextError::MalformedToolCall`]'s message: the spelling the message has
/// always had (it printed the family with `{:?}` before the family registry moved to
/// `mference-format` and renamed the variants), so the API's error text stays the same.
fn message_name(family: Family) -> &'static str {
    match family {
        Family::Gemma4 => "Gemma4",
        Family::Qwen3_5Moe => "Qwen36",
        Family::DeepseekV4 => "DeepSeekV4",
        Family::Inkling => "Inkling",
        Family::Maple => "Maple",
    }
}

#[cfg(test)]
mod tests {
    /// The server shares one tokenizer and template across threads.
    #[test]
    fn shared_types_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<crate::Tokenizer>();
        check::<crate::ChatTemplate>();
        check::<crate::StopStrings>();
        check::<crate::ParsedOutput>();
    }
}
