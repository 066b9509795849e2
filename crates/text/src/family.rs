/// The model families whose text conventions this crate knows (`reference/architectures.md` §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// Gemma 4 (`gemma4`, `gemma4_text`): `<|turn>` chat turns, `<|tool_call>` blocks.
    Gemma4,
    /// Qwen 3.5 / 3.6 (`qwen3_5_moe`, ...): ChatML turns, `<tool_call>` blocks.
    Qwen36,
    /// DeepSeek-V4 (`deepseek_v4`): `<｜User｜>`/`<｜Assistant｜>` turns, DSML tool calls.
    DeepSeekV4,
    /// Maple Preview (`maple`): ChatML turns (Qwen3 vocabulary), the generation prompt leaves a
    /// `<think>` block open, Hermes-style JSON `<tool_call>` blocks.
    Maple,
    /// Inkling-Small (`inkling_mm_model`): TMLv0 `<|message_*|><|content_text|>…<|end_message|>`
    /// turns; the reconstructed template is text only (no tool syntax).
    Inkling,
}

impl Family {
    /// Maps a `config.json` `model_type` to its family; `None` for a model type we do not run.
    pub fn from_model_type(model_type: &str) -> Option<Family> {
        match model_type {
            "gemma4" | "gemma4_text" => Some(Family::Gemma4),
            "qwen3_5" | "qwen3_5_text" | "qwen3_5_moe" | "qwen3_5_moe_text" | "qwen3_6"
            | "qwen3_6_moe" => Some(Family::Qwen36),
            "deepseek_v4" => Some(Family::DeepSeekV4),
            "maple" => Some(Family::Maple),
            "inkling_mm_model" | "inkling" => Some(Family::Inkling),
            _ => None,
        }
    }
}

impl Family {
    /// The special token that opens the assistant's turn in a rendered chat prompt (`<|turn>` of
    /// `<|turn>model`, `<|im_start|>` of `<|im_start|>assistant`, `<｜Assistant｜>`). A conversation
    /// re-rendered with the reply in its history first departs from the generated tokens after
    /// the last one of these, so a server keeps recurrent model state from just before it.
    pub fn turn_open_token(self) -> &'static str {
        match self {
            Family::Gemma4 => "<|turn>",
            Family::Qwen36 | Family::Maple => "<|im_start|>",
            Family::DeepSeekV4 => "<｜Assistant｜>",
            Family::Inkling => "<|message_model|>",
        }
    }

    /// The marker that closes a reasoning block the generation prompt leaves open, if this family's
    /// template does that: Maple's ends with `<|im_start|>assistant\n<think>\n`, so everything the
    /// model writes before `</think>` is reasoning ([`crate::ReasoningGate`]).
    pub fn open_reasoning_close(self) -> Option<&'static str> {
        match self {
            Family::Maple => Some("</think>"),
            _ => None,
        }
    }
}

impl Family {
    /// The extra template variables mference renders chats with, as the original does
    /// (`reference/original-system.md` §2.6): thinking off. Gemma 4 then ends the prompt with an
    /// empty thought channel, Qwen 3.6 with an empty think block
    /// (`<|im_start|>assistant\n<think>\n\n</think>\n\n`), DeepSeek-V4 with `</think>`.
    pub fn default_template_kwargs(self) -> serde_json::Map<String, serde_json::Value> {
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), false.into());
        kwargs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_types_map_to_families() {
        assert_eq!(Family::from_model_type("gemma4_text"), Some(Family::Gemma4));
        assert_eq!(Family::from_model_type("qwen3_5_moe"), Some(Family::Qwen36));
        assert_eq!(
            Family::from_model_type("deepseek_v4"),
            Some(Family::DeepSeekV4)
        );
        assert_eq!(Family::from_model_type("llama"), None);
    }

    #[test]
    fn turn_open_tokens_are_single_special_tokens() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets/tokenizers");
        for (family, name) in [
            (Family::Gemma4, "gemma4"),
            (Family::Qwen36, "qwen3_6"),
            (Family::DeepSeekV4, "deepseek_v4"),
            (Family::Maple, "maple"),
            (Family::Inkling, "inkling"),
        ] {
            let tok = crate::Tokenizer::from_dir(&dir.join(name)).expect("tokenizer");
            let t = family.turn_open_token();
            let ids = tok.encode(t, false).expect("encode");
            assert_eq!(ids.len(), 1, "{family:?}: {t} encodes to {ids:?}");
        }
    }
}
