//! The family registry: every fact about a model family that more than one crate needs, in one
//! row per family ([`REGISTRY`]), keyed on [`Family`].
//!
//! A family is named in code after its checkpoints' Hugging Face `config.json` `model_type`
//! (`gemma4`, `qwen3_5_moe`, `deepseek_v4`, `inkling_mm_model`, `maple`): Qwen 3.6 (35B-A3B)
//! reuses the Qwen 3.5 MoE architecture, so its checkpoints say `qwen3_5_moe` and the code says
//! `Qwen3_5Moe` / `qwen3_5_moe`; messages and docs call it by its release name, "Qwen 3.6"
//! ([`FamilySpec::display_name`]). The manifest keeps its own spellings (`qwen36`,
//! `deepseekV4Flash`, `inklingSmall`: [`FamilySpec::manifest_name`]), which installs on disk use.
//!
//! The format crate is the lowest crate every other one depends on (text included), so the
//! registry lives here; install, text and models read it instead of keeping their own lists.

use crate::FormatError;
use serde_json::Value;

/// A model family this runtime installs and runs. The order is [`REGISTRY`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// Gemma 4 (`gemma4`, `gemma4_text`): `<|turn>` chat turns, `<|tool_call>` blocks.
    Gemma4,
    /// Qwen 3.6 (`qwen3_5_moe`, `qwen3_5_moe_text`): ChatML turns, `<tool_call>` blocks.
    Qwen3_5Moe,
    /// DeepSeek-V4-Flash (`deepseek_v4`): `<｜User｜>`/`<｜Assistant｜>` turns, DSML tool calls.
    DeepseekV4,
    /// Inkling-Small (`inkling_mm_model`): TMLv0 `<|message_*|><|content_text|>…<|end_message|>`
    /// turns; the reconstructed template is text only (no tool syntax).
    Inkling,
    /// Maple Preview (`maple`): ChatML turns (Qwen3 vocabulary), the generation prompt leaves a
    /// `<think>` block open, Hermes-style JSON `<tool_call>` blocks.
    Maple,
}

/// How a family writes tool calls in its output (the parsers are in `mference-text`'s
/// `tool_calls` module, one per syntax).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallSyntax {
    /// Gemma 4: `<|tool_call>call:NAME{key:<|"|>str<|"|>,…}<tool_call|>`.
    Gemma4,
    /// `<tool_call>` blocks holding Qwen 3.6's XML form (`<function=NAME><parameter=KEY>…`) or
    /// the Qwen 2.5/3 (Hermes) JSON form `{"name": …, "arguments": {…}}`.
    Qwen3_5Moe,
    /// DeepSeek-V4's DSML: `<｜DSML｜tool_calls>` with `<｜DSML｜invoke name="…">` blocks.
    Dsml,
    /// No call syntax: the template renders no tools and the output is all content.
    None,
}

/// One row of the registry: what a family is called and what it may use.
#[derive(Debug)]
pub struct FamilySpec {
    /// The family this row describes.
    pub family: Family,
    /// Every `config.json` `model_type` that names this family; the first is the canonical one.
    pub model_types: &'static [&'static str],
    /// `manifest.json -> arch.family` (omitted in the manifest for Gemma 4, the first family).
    pub manifest_name: &'static str,
    /// The release name users know, as messages and docs write it ("Qwen 3.6").
    pub display_name: &'static str,
    /// Whether the kernel tables that round activations are allowed (`--kernels avx512vnni`, int8
    /// prefill; `avx512i16`, `amx` and `avx2i16`, int16).
    /// Measured within the bundled models' perplexity bounds on these families (README); on the
    /// golden fixtures of the others even the int16 tables miss the tolerance (Inkling-Small up
    /// to 1.6 of a logit, Maple 3.5e-4 against 1e-4, DeepSeek-V4 4.5e-1: docs/BENCHMARKS.md),
    /// so the loader refuses them there.
    pub int8_prefill: bool,
    /// Whether `--router-lookahead` (prefetch of the next layer's experts from this layer's
    /// router input) applies. DeepSeek-V4 has its own shadow prefetch instead.
    pub router_lookahead: bool,
    /// Whether `--flash-head` (Maple's clustered LM head) applies.
    pub flash_head: bool,
    /// How tool calls are written in the output.
    pub tool_call_syntax: ToolCallSyntax,
    /// The special token that opens the assistant's turn in a rendered chat prompt.
    pub turn_open_token: &'static str,
    /// The markers that open and close a reasoning block in the model's output, if the family
    /// writes one.
    pub reasoning_markers: Option<(&'static str, &'static str)>,
    /// The tokens that end generation, by name (a tokenizer may lack some).
    pub stop_tokens: &'static [&'static str],
}

/// The registry, one row per [`Family`], in the enum's order.
pub const REGISTRY: [FamilySpec; 5] = [
    FamilySpec {
        family: Family::Gemma4,
        model_types: &["gemma4", "gemma4_text"],
        manifest_name: "gemma4",
        display_name: "Gemma 4",
        int8_prefill: true,
        router_lookahead: true,
        flash_head: false,
        tool_call_syntax: ToolCallSyntax::Gemma4,
        turn_open_token: "<|turn>",
        // The thought channel: `<|channel>thought\n…<channel|>` (the template's `strip_thinking`).
        reasoning_markers: Some(("<|channel>thought", "<channel|>")),
        stop_tokens: &["<eos>", "<turn|>", "<|tool_response>"],
    },
    FamilySpec {
        family: Family::Qwen3_5Moe,
        model_types: &["qwen3_5_moe", "qwen3_5_moe_text"],
        manifest_name: "qwen36",
        display_name: "Qwen 3.6",
        int8_prefill: true,
        router_lookahead: true,
        flash_head: false,
        tool_call_syntax: ToolCallSyntax::Qwen3_5Moe,
        turn_open_token: "<|im_start|>",
        reasoning_markers: Some(("<think>", "</think>")),
        stop_tokens: &["<|im_end|>", "<|endoftext|>"],
    },
    FamilySpec {
        family: Family::DeepseekV4,
        model_types: &["deepseek_v4"],
        manifest_name: "deepseekV4Flash",
        display_name: "DeepSeek-V4-Flash",
        int8_prefill: false,
        router_lookahead: false,
        flash_head: false,
        tool_call_syntax: ToolCallSyntax::Dsml,
        turn_open_token: "<｜Assistant｜>",
        reasoning_markers: Some(("<think>", "</think>")),
        stop_tokens: &["<｜end▁of▁sentence｜>"],
    },
    FamilySpec {
        family: Family::Inkling,
        // `inkling` is the flat (text-only) spelling; the published checkpoints say
        // `inkling_mm_model` with the language model under `text_config`.
        model_types: &["inkling_mm_model", "inkling"],
        manifest_name: "inklingSmall",
        display_name: "Inkling-Small",
        int8_prefill: false,
        router_lookahead: false,
        flash_head: false,
        tool_call_syntax: ToolCallSyntax::None,
        turn_open_token: "<|message_model|>",
        reasoning_markers: None,
        // tml-renderers v0 `Renderer.stop()`.
        stop_tokens: &["<|content_model_end_sampling|>"],
    },
    FamilySpec {
        family: Family::Maple,
        model_types: &["maple"],
        manifest_name: "maple",
        display_name: "Maple",
        int8_prefill: false,
        router_lookahead: false,
        flash_head: true,
        // Maple writes the Qwen 2.5/3 JSON form, which the Qwen parser reads.
        tool_call_syntax: ToolCallSyntax::Qwen3_5Moe,
        turn_open_token: "<|im_start|>",
        // The template always ends with `<|im_start|>assistant\n<think>\n`.
        reasoning_markers: Some(("<think>", "</think>")),
        stop_tokens: &["<|im_end|>", "<|endoftext|>"],
    },
];

impl Family {
    /// Every family, in [`REGISTRY`] order.
    pub const ALL: [Family; 5] = [
        Family::Gemma4,
        Family::Qwen3_5Moe,
        Family::DeepseekV4,
        Family::Inkling,
        Family::Maple,
    ];

    /// This family's row of [`REGISTRY`].
    pub fn spec(self) -> &'static FamilySpec {
        &REGISTRY[self as usize]
    }

    /// The family a `config.json` `model_type` names (any alias in
    /// [`FamilySpec::model_types`]); `None` for a model type this runtime does not run.
    pub fn from_model_type(model_type: &str) -> Option<Family> {
        REGISTRY
            .iter()
            .find(|s| s.model_types.contains(&model_type))
            .map(|s| s.family)
    }

    /// Family of a checkpoint `config.json` by its `model_type` ([`config_model_type`]).
    /// Errors: [`FormatError::UnknownArchitecture`], whose message lists every supported value.
    pub fn from_config(config: &Value) -> Result<Family, FormatError> {
        let mt = config_model_type(config);
        Family::from_model_type(mt).ok_or_else(|| FormatError::UnknownArchitecture {
            model_type: mt.to_string(),
        })
    }

    /// The canonical `model_type` (`gemma4`, `qwen3_5_moe`, `deepseek_v4`, `inkling_mm_model`,
    /// `maple`).
    pub fn model_type(self) -> &'static str {
        self.spec().model_types[0]
    }

    /// The manifest spelling (`gemma4`, `qwen36`, `deepseekV4Flash`, `inklingSmall`, `maple`).
    pub fn manifest_name(self) -> &'static str {
        self.spec().manifest_name
    }

    /// Inverse of [`Family::manifest_name`].
    pub fn from_manifest_name(s: &str) -> Option<Family> {
        REGISTRY
            .iter()
            .find(|r| r.manifest_name == s)
            .map(|r| r.family)
    }

    /// The release name ("Gemma 4", "Qwen 3.6", "DeepSeek-V4-Flash", "Inkling-Small", "Maple").
    pub fn display_name(self) -> &'static str {
        self.spec().display_name
    }

    /// Whether the rounded-activation tables are allowed ([`FamilySpec::int8_prefill`]).
    pub fn int8_prefill(self) -> bool {
        self.spec().int8_prefill
    }

    /// Whether `--router-lookahead` applies ([`FamilySpec::router_lookahead`]).
    pub fn router_lookahead(self) -> bool {
        self.spec().router_lookahead
    }

    /// Whether `--flash-head` applies ([`FamilySpec::flash_head`]).
    pub fn flash_head(self) -> bool {
        self.spec().flash_head
    }

    /// How this family writes tool calls.
    pub fn tool_call_syntax(self) -> ToolCallSyntax {
        self.spec().tool_call_syntax
    }

    /// The special token that opens the assistant's turn in a rendered chat prompt (`<|turn>` of
    /// `<|turn>model`, `<|im_start|>` of `<|im_start|>assistant`, `<｜Assistant｜>`). A conversation
    /// re-rendered with the reply in its history first departs from the generated tokens after
    /// the last one of these, so a server keeps recurrent model state from just before it.
    pub fn turn_open_token(self) -> &'static str {
        self.spec().turn_open_token
    }

    /// The markers (open, close) of a reasoning block in this family's output: `<think>` and
    /// `</think>` (Qwen 3.6, DeepSeek-V4, Maple), Gemma 4's thought channel `<|channel>thought`
    /// and `<channel|>`; `None` for Inkling, whose template renders no thinking. A generation
    /// prompt may leave the block open (Qwen 3.6 and DeepSeek-V4 with thinking on, Maple always):
    /// then the output starts inside it.
    pub fn reasoning_markers(self) -> Option<(&'static str, &'static str)> {
        self.spec().reasoning_markers
    }

    /// The names of the tokens that end generation (Gemma `<eos>`, `<turn|>`,
    /// `<|tool_response>`; ChatML `<|im_end|>`, `<|endoftext|>`; DeepSeek
    /// `<｜end▁of▁sentence｜>`; Inkling `<|content_model_end_sampling|>`).
    pub fn stop_tokens(self) -> &'static [&'static str] {
        self.spec().stop_tokens
    }

    /// The extra template variables mference renders chats with: thinking off. Gemma 4 then ends
    /// the prompt with an empty thought channel, Qwen 3.6 with an empty think block
    /// (`<|im_start|>assistant\n<think>\n\n</think>\n\n`), DeepSeek-V4 with `</think>`.
    pub fn default_template_kwargs(self) -> serde_json::Map<String, Value> {
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), false.into());
        kwargs
    }

    /// The display names of the families where `pred` holds, joined by `sep`
    /// (`"Gemma 4 / Qwen 3.6"`), for messages about options only some families take.
    pub fn display_names_where(pred: impl Fn(Family) -> bool, sep: &str) -> String {
        Family::ALL
            .into_iter()
            .filter(|&f| pred(f))
            .map(Family::display_name)
            .collect::<Vec<_>>()
            .join(sep)
    }
}

impl std::fmt::Display for Family {
    /// The manifest spelling ([`Family::manifest_name`]).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.manifest_name())
    }
}

/// The `model_type` of a checkpoint `config.json`: the top-level key, else
/// `text_config.model_type`; `""` when neither is a string.
pub fn config_model_type(config: &Value) -> &str {
    config
        .get("model_type")
        .and_then(|m| m.as_str())
        .or_else(|| {
            config
                .pointer("/text_config/model_type")
                .and_then(|m| m.as_str())
        })
        .unwrap_or("")
}

/// Every accepted `model_type`, comma-separated in [`REGISTRY`] order, for error messages.
pub fn supported_model_types() -> String {
    REGISTRY
        .iter()
        .flat_map(|s| s.model_types.iter().copied())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_rows_follow_the_enum() {
        for (i, f) in Family::ALL.into_iter().enumerate() {
            assert_eq!(f as usize, i);
            assert_eq!(REGISTRY[i].family, f);
            assert!(!f.spec().model_types.is_empty(), "{f:?} has no model_type");
        }
    }

    #[test]
    fn every_alias_round_trips() {
        let mut seen = std::collections::BTreeSet::new();
        for f in Family::ALL {
            for &mt in f.spec().model_types {
                assert!(seen.insert(mt), "{mt} names two families");
                assert_eq!(Family::from_model_type(mt), Some(f), "{mt}");
                let top = serde_json::json!({ "model_type": mt });
                assert_eq!(Family::from_config(&top).unwrap(), f, "{mt}");
                let nested = serde_json::json!({ "text_config": { "model_type": mt } });
                assert_eq!(Family::from_config(&nested).unwrap(), f, "{mt}");
            }
            assert_eq!(Family::from_model_type(f.model_type()), Some(f));
            assert_eq!(Family::from_manifest_name(f.manifest_name()), Some(f));
            assert_eq!(f.to_string(), f.manifest_name());
        }
    }

    #[test]
    fn the_published_spellings_are_kept() {
        // The manifest names are on disk in every install; the model types are what the
        // checkpoints on the Hub say.
        let names: Vec<_> = Family::ALL.map(Family::manifest_name).into();
        assert_eq!(
            names,
            [
                "gemma4",
                "qwen36",
                "deepseekV4Flash",
                "inklingSmall",
                "maple"
            ]
        );
        let canonical: Vec<_> = Family::ALL.map(Family::model_type).into();
        assert_eq!(
            canonical,
            [
                "gemma4",
                "qwen3_5_moe",
                "deepseek_v4",
                "inkling_mm_model",
                "maple"
            ]
        );
    }

    #[test]
    fn other_model_types_are_refused_with_the_full_list() {
        // Dense Qwen 3.5 (`qwen3_5`) is another architecture; `qwen3_6*` is no Hub model_type
        // (Qwen 3.6 checkpoints say `qwen3_5_moe`).
        for mt in [
            "llama",
            "",
            "qwen3_5",
            "qwen3_5_text",
            "qwen3_6",
            "qwen3_6_moe",
        ] {
            assert_eq!(Family::from_model_type(mt), None, "{mt}");
        }
        let e = Family::from_config(&serde_json::json!({ "model_type": "llama" })).unwrap_err();
        let msg = e.to_string();
        for f in Family::ALL {
            for mt in f.spec().model_types {
                assert!(msg.contains(mt), "{msg} lacks {mt}");
            }
        }
        assert!(msg.starts_with("unknown architecture \"llama\""), "{msg}");
    }

    #[test]
    fn options_belong_to_their_families() {
        let names = |p: fn(Family) -> bool| Family::display_names_where(p, " / ");
        assert_eq!(names(Family::int8_prefill), "Gemma 4 / Qwen 3.6");
        assert_eq!(names(Family::router_lookahead), "Gemma 4 / Qwen 3.6");
        assert_eq!(names(Family::flash_head), "Maple");
    }
}
