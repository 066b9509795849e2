//! The text side agrees with the family registry (`mference_format::family`): each family's
//! markers are single special tokens of its tokenizer, and its tool syntax parses its own calls.

use crate::{parse_tool_calls, stop_token_ids, Family, TextError, Tokenizer, ToolCallSyntax};

/// The bundled tokenizer folder (`assets/tokenizers/<name>`) of each family.
pub(crate) fn tokenizer_dir(family: Family) -> std::path::PathBuf {
    let name = match family {
        Family::Gemma4 => "gemma4",
        Family::Qwen3_5Moe => "qwen3_6",
        Family::DeepseekV4 => "deepseek_v4",
        Family::Inkling => "inkling",
        Family::Maple => "maple",
    };
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/tokenizers")
        .join(name)
}

#[test]
fn turn_open_tokens_are_single_special_tokens() {
    for family in Family::ALL {
        let tok = Tokenizer::from_dir(&tokenizer_dir(family)).expect("tokenizer");
        let t = family.turn_open_token();
        let ids = tok.encode(t, false).expect("encode");
        assert_eq!(ids.len(), 1, "{family:?}: {t} encodes to {ids:?}");
    }
}

#[test]
fn every_stop_token_is_in_its_tokenizer() {
    for family in Family::ALL {
        let tok = Tokenizer::from_dir(&tokenizer_dir(family)).expect("tokenizer");
        let ids = stop_token_ids(family, &tok);
        assert_eq!(ids.len(), family.stop_tokens().len(), "{family:?}: {ids:?}");
    }
}

#[test]
fn each_family_parses_its_own_call_syntax() {
    for family in Family::ALL {
        let call = match family.tool_call_syntax() {
            ToolCallSyntax::Gemma4 => "<|tool_call>call:f{n:3}<tool_call|>",
            ToolCallSyntax::Qwen3_5Moe => "<tool_call>{\"name\": \"f\", \"arguments\": {\"n\": 3}}</tool_call>",
            ToolCallSyntax::Dsml => {
                "<｜DSML｜tool_calls><｜DSML｜invoke name=\"f\"><｜DSML｜parameter name=\"n\" string=\"false\">3</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>"
            }
            ToolCallSyntax::None => {
                let out = parse_tool_calls(family, "<tool_call>{}</tool_call>").unwrap();
                assert!(out.tool_calls.is_empty(), "{family:?}");
                continue;
            }
        };
        let out = parse_tool_calls(family, call).unwrap_or_else(|e| panic!("{family:?}: {e}"));
        assert_eq!(out.tool_calls.len(), 1, "{family:?}: {out:?}");
        assert_eq!(out.tool_calls[0].name, "f");
        assert_eq!(out.tool_calls[0].arguments, serde_json::json!({"n": 3}));
    }
}

#[test]
fn malformed_call_messages_keep_their_names() {
    let cases = [
        (
            Family::Gemma4,
            "<|tool_call>",
            "malformed Gemma4 tool call: ",
        ),
        (
            Family::Qwen3_5Moe,
            "<tool_call>",
            "malformed Qwen36 tool call: ",
        ),
        (Family::Maple, "<tool_call>", "malformed Qwen36 tool call: "),
        (
            Family::DeepseekV4,
            "<｜DSML｜tool_calls>",
            "malformed DeepSeekV4 tool call: ",
        ),
    ];
    for (family, open, want) in cases {
        let e = parse_tool_calls(family, open).unwrap_err();
        assert!(matches!(e, TextError::MalformedToolCall { .. }), "{e:?}");
        assert!(e.to_string().starts_with(want), "{family:?}: {e}");
    }
}
