#![warn(missing_docs)]
//! mference-session: one loaded model with its text side, and the generation loop that both
//! `mference run` and `mference serve` use, so the CLI and the server cannot drift apart.
//!
//! - [`TextSide`]: tokenizer, chat template, family, position limit, stop ids and markers of an
//!   install ([`TextSide::load`]); [`TextSide::render_chat`] turns messages into prompt ids.
//! - [`Session`]: a model plus the token ids its state holds (one retained conversation prefix);
//!   [`Session::generate`] runs a [`Request`] — prefix reuse, prefill, sampling, stop tokens,
//!   stop strings, the reasoning split, tool-call hold-back, tool-call parsing, logprobs and a
//!   response-format [`Constraint`] — streaming text into a [`Sink`] and counting [`GenStats`].
//! - [`ResponseFormat`] → [`TextSide::compile`] → [`Constraint`]: JSON mode and JSON Schema by
//!   llguidance; the mask is applied before sampling, so a constrained greedy request reads the
//!   full logits row back instead of the fused head argmax.
//! - [`check_install_dir`], [`max_positions`]: what a command checks before loading.
//!
//! Units: token counts are tokens, durations are [`std::time::Duration`]s, logits rows are
//! `[vocab]` f32 (the model's vocabulary, which may be longer than the tokenizer's).

mod constraint;
mod generate;
mod logprobs;
mod text;
mod tool_gate;

pub use constraint::{Constraint, ResponseFormat};
pub use generate::{Finish, GenStats, Outcome, Reasoning, Request, Session, Sink};
pub use logprobs::TokenLogprob;
pub use text::{check_install_dir, max_positions, tool_marker, ChatPrompt, TextSide};

use mference_models::ModelError;
use mference_text::TextError;

/// Errors of loading a text side and of one generation. Each says what was wrong; the CLI turns
/// them into messages, the server into HTTP statuses.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The tokenizer or template could not be loaded, or text did not render or tokenize.
    #[error("{0}")]
    Text(#[from] TextError),
    /// The directory is not a (complete) install, or its `tokenizer/config.json` is unusable.
    #[error("{0}")]
    Install(String),
    /// A chat was asked of an install without a chat template.
    #[error("this install has no chat template")]
    NoTemplate,
    /// The prompt is empty or leaves no room for one generated token.
    #[error("the prompt is {len} tokens; the context is {max_context}")]
    PromptLength {
        /// Prompt tokens.
        len: usize,
        /// The model's KV cache positions.
        max_context: usize,
    },
    /// A forward pass failed (the retained prefix was cleared).
    #[error("generation failed: {0}")]
    Model(#[from] ModelError),
    /// The model returned no logits where it was asked for them.
    #[error("the model returned no logits")]
    NoLogits,
    /// The response format's schema does not compile; the message is llguidance's reason.
    #[error("the schema cannot be used for constrained decoding: {0}")]
    Schema(String),
    /// Constrained decoding failed while generating (or the vocabulary cannot be indexed).
    #[error("constrained decoding failed: {0}")]
    Constraint(String),
    /// With tools declared, the model opened a tool call (the marker token) that does not parse.
    #[error("the model wrote a tool call that does not parse: {message}")]
    MalformedToolCall {
        /// The parser's reason.
        message: String,
        /// The whole generated text.
        raw: String,
    },
}

#[cfg(test)]
mod tests {
    #[test]
    fn shared_types_are_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<crate::TextSide>();
        send::<crate::Session>();
        send::<crate::Request>();
    }
}
