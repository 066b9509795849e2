//! Tool-call parsers. Valid inputs are assistant turns exactly as the chat templates write them
//! (Python Jinja2 renders in `tests/golden/`, upstream renders in `verify/chat_vectors.json`), so
//! parsing must give back the arguments the template was given. Malformed inputs must fail closed.

mod common;

use std::path::PathBuf;

use common::{read_json, tokenizer_dir};
use mference_text::{parse_tool_calls, parse_tool_calls_with_tools, Family, TextError, ToolCall};
use serde_json::{json, Value};

/// The assistant turns of a rendered chat that carry tool calls: the text between the family's
/// assistant header and where the model would stop.
fn assistant_segments(family: Family, rendered: &str) -> Vec<String> {
    let (open, close) = match family {
        Family::Gemma4 => ("<|turn>model\n", "<|tool_response>"),
        Family::Qwen3_5Moe | Family::Maple => ("<|im_start|>assistant\n", "<|im_end|>"),
        Family::DeepseekV4 => ("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
        Family::Inkling => ("<|message_model|>", "<|content_model_end_sampling|>"),
    };
    let marker = match family {
        Family::Gemma4 => "<|tool_call>",
        Family::Qwen3_5Moe | Family::Maple => "<tool_call>",
        Family::DeepseekV4 => "<｜DSML｜tool_calls>",
        Family::Inkling => "<|content_invoke_tool_json|>",
    };
    rendered
        .split(open)
        .skip(1)
        .filter_map(|turn| turn.split(close).next())
        .filter(|seg| seg.contains(marker))
        .map(str::to_string)
        .collect()
}

/// The tool calls of the input messages, in order, as (name, arguments object).
fn input_calls(messages: &[Value]) -> Vec<Vec<ToolCall>> {
    messages
        .iter()
        .filter_map(|m| m["tool_calls"].as_array())
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    let f = &c["function"];
                    let arguments = match &f["arguments"] {
                        Value::String(s) => serde_json::from_str(s).unwrap(),
                        v => v.clone(),
                    };
                    ToolCall {
                        name: f["name"].as_str().unwrap().to_string(),
                        arguments,
                    }
                })
                .collect()
        })
        .collect()
}

#[test]
fn template_rendered_calls_parse_back_to_their_arguments() {
    let golden = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut checked = 0;
    for (family, file) in [
        (Family::Gemma4, "gemma4__chat_template.json"),
        (Family::Qwen3_5Moe, "qwen3_6__chat_template.json"),
        (Family::DeepseekV4, "deepseek_v4__chat_template.json"),
    ] {
        let doc = read_json(golden.join(file));
        for case in doc["cases"].as_array().unwrap() {
            let Some(rendered) = case["rendered"].as_str() else {
                continue;
            };
            let messages = case["messages"].as_array().unwrap();
            let tools = case["tools"].as_array().map(Vec::as_slice);
            // Gemma's template writes string arguments verbatim inside its own braces
            // (`call:f{{"a": 1}}`), which is not its call syntax; the server passes objects.
            let string_args = messages.iter().any(|m| {
                m["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["function"]["arguments"].is_string())
            });
            if family == Family::Gemma4 && string_args {
                continue;
            }
            let want = input_calls(messages);
            let segments = assistant_segments(family, rendered);
            if want.is_empty() {
                assert!(segments.is_empty(), "{file}/{}", case["name"]);
                continue;
            }
            // Gemma writes every call of the conversation; each assistant turn parses to its calls.
            assert_eq!(
                segments.len(),
                want.len(),
                "{file}/{}: {segments:?}",
                case["name"]
            );
            for (segment, want) in segments.iter().zip(&want) {
                let parsed = parse_tool_calls_with_tools(family, segment, tools)
                    .unwrap_or_else(|e| panic!("{file}/{}: {e}\n{segment}", case["name"]));
                assert_eq!(&parsed.tool_calls, want, "{file}/{}", case["name"]);
                checked += 1;
            }
        }
    }
    assert!(checked >= 15, "only {checked} tool-call turns checked");
}

#[test]
fn upstream_chat_vector_calls_parse() {
    let want = vec![ToolCall {
        name: "get_weather".into(),
        arguments: json!({"city": "Paris", "unit": "celsius", "days": 2}),
    }];
    for (family, name, chats) in [
        (Family::Gemma4, "gemma4", &["tools", "tools_thinking"][..]),
        (
            Family::Qwen3_5Moe,
            "qwen3_6",
            &["tools", "tools_reasoning"][..],
        ),
        (
            Family::DeepseekV4,
            "deepseek_v4",
            &["tools", "tools_thinking"][..],
        ),
    ] {
        let vectors = read_json(tokenizer_dir(name).join("verify/chat_vectors.json"));
        for chat in chats {
            let text = vectors[*chat]["text"].as_str().unwrap();
            let segments = assistant_segments(family, text);
            assert_eq!(segments.len(), 1, "{name}/{chat}");
            let parsed = parse_tool_calls(family, &segments[0]).unwrap();
            assert_eq!(parsed.tool_calls, want, "{name}/{chat}");
        }
    }
}

#[test]
fn gemma_content_reasoning_and_calls() {
    let out = parse_tool_calls(
        Family::Gemma4,
        "<|channel>thought\nNeed two calls.<channel|>Checking.<|tool_call>call:a{x:<|\"|>1<|\"|>}<tool_call|><|tool_call>call:b{}<tool_call|><|tool_response>",
    )
    .unwrap();
    assert_eq!(out.reasoning.as_deref(), Some("Need two calls."));
    assert_eq!(out.content, "Checking.");
    assert_eq!(out.tool_calls.len(), 2);
    assert_eq!(out.tool_calls[0].arguments, json!({"x": "1"}));
    assert_eq!(
        out.tool_calls[1],
        ToolCall {
            name: "b".into(),
            arguments: json!({})
        }
    );

    let plain = parse_tool_calls(Family::Gemma4, "  Just text, no calls. ").unwrap();
    assert_eq!(plain.content, "  Just text, no calls. ");
    assert!(plain.tool_calls.is_empty() && plain.reasoning.is_none());
}

#[test]
fn qwen_json_form_and_untyped_values() {
    let out = parse_tool_calls(
        Family::Qwen3_5Moe,
        "Thinking done.</think>\n\nSure.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, {\"b\": null}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": \"{\\\"s\\\": \\\"x\\\"}\"}\n</tool_call>",
    )
    .unwrap();
    assert_eq!(out.reasoning.as_deref(), Some("Thinking done."));
    assert_eq!(out.content, "Sure.");
    assert_eq!(out.tool_calls[0].arguments, json!({"a": [1, {"b": null}]}));
    assert_eq!(
        out.tool_calls[1],
        ToolCall {
            name: "g".into(),
            arguments: json!({"s": "x"})
        }
    );

    // Without schemas: JSON literals become JSON, the rest stays text (multi-line kept).
    let xml = "<tool_call>\n<function=h>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\nline 1\nline 2\n</parameter>\n<parameter=o>\n{\"k\": true}\n</parameter>\n<parameter=q>\n\"quoted\"\n</parameter>\n</function>\n</tool_call>";
    let out = parse_tool_calls(Family::Qwen3_5Moe, xml).unwrap();
    assert_eq!(
        out.tool_calls[0].arguments,
        json!({"n": 42, "s": "line 1\nline 2", "o": {"k": true}, "q": "\"quoted\""})
    );

    // With a schema, a string parameter stays a string even when it looks like a number.
    let tools = [
        json!({"type": "function", "function": {"name": "h", "parameters": {"type": "object",
        "properties": {"n": {"type": "string"}, "s": {"type": "string"}, "o": {"type": "object"}, "q": {"type": "string"}}}}}),
    ];
    let out = parse_tool_calls_with_tools(Family::Qwen3_5Moe, xml, Some(&tools)).unwrap();
    assert_eq!(out.tool_calls[0].arguments["n"], json!("42"));
}

#[test]
fn deepseek_calls_and_content() {
    let text = "<think>plan</think>Here.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"s\" string=\"true\">a \"b\" 1</｜DSML｜parameter>\n<｜DSML｜parameter name=\"o\" string=\"false\">{\"k\": [1, 2.5]}</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"g\">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    let out = parse_tool_calls(Family::DeepseekV4, text).unwrap();
    assert_eq!(out.reasoning.as_deref(), Some("plan"));
    assert_eq!(out.content, "Here.");
    assert_eq!(
        out.tool_calls[0],
        ToolCall {
            name: "f".into(),
            arguments: json!({"s": "a \"b\" 1", "o": {"k": [1, 2.5]}})
        }
    );
    assert_eq!(
        out.tool_calls[1],
        ToolCall {
            name: "g".into(),
            arguments: json!({})
        }
    );
}

fn assert_malformed(family: Family, text: &str) {
    match parse_tool_calls(family, text) {
        Err(TextError::MalformedToolCall { family: f, .. }) => assert_eq!(f, family),
        other => panic!("{family:?} accepted {text:?}: {other:?}"),
    }
}

#[test]
fn gemma_malformed_fails_closed() {
    for text in [
        "<|tool_call>call:f{a:1}", // unclosed block (max tokens mid-call)
        "<|tool_call>call:f{a:1<tool_call|>", // unclosed object
        "<|tool_call>f{a:1}<tool_call|>", // no `call:`
        "<|tool_call>call:{a:1}<tool_call|>", // no name
        "<|tool_call>call:my tool{a:1}<tool_call|>", // space in the name
        "<|tool_call>call:f{a:<|\"|>open}<tool_call|>", // unclosed string
        "<|tool_call>call:f{a:bare words}<tool_call|>", // unquoted string
        "<|tool_call>call:f{a:1} trailing<tool_call|>", // text after the arguments
        "<|tool_call>call:f{a:1,}<tool_call|>", // trailing comma
        "<|tool_call>call:f[1]<tool_call|>", // arguments not an object
        "done<tool_call|>",        // stray close
        "<|tool_call>call:f{}<tool_call|>then <tool_call|>",
        "<|channel>thought\nno end", // unclosed reasoning
    ] {
        assert_malformed(Family::Gemma4, text);
    }
}

#[test]
fn qwen_malformed_fails_closed() {
    let tools = [
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"n": {"type": "integer"}, "b": {"type": "boolean"}, "o": {"type": "object"}}}}}),
    ];
    for text in [
        "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</function>\n", // unclosed
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",      // bad JSON
        "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                              // no name
        "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",            // args not object
        "<tool_call>\n{\"name\": \"f\", \"arguments\": \"[1]\"}\n</tool_call>",        // string args not object
        "<tool_call>\n<function=f>\n<parameter=n>\n1\n</function>\n</tool_call>",      // unclosed parameter
        "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</tool_call>",     // no </function>
        "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>",                 // text in function
        "<tool_call>\n<function=>\n</function>\n</tool_call>",                         // empty name
        "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\ncall f\n</tool_call>",                                           // neither form
        "answer</tool_call>",                                                          // stray close
    ] {
        assert_malformed(Family::Qwen3_5Moe, text);
    }
    for text in [
        "<tool_call>\n<function=f>\n<parameter=n>\n1.5\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=b>\nyes\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=o>\n{bad}\n</parameter>\n</function>\n</tool_call>",
    ] {
        assert!(
            matches!(
                parse_tool_calls_with_tools(Family::Qwen3_5Moe, text, Some(&tools)),
                Err(TextError::MalformedToolCall { .. })
            ),
            "accepted {text:?}"
        );
    }
}

#[test]
fn deepseek_malformed_fails_closed() {
    let call = |inner: &str| format!("<｜DSML｜tool_calls>\n{inner}\n</｜DSML｜tool_calls>");
    for text in [
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n".to_string(), // unclosed
        call(""),                                                                          // empty block
        call("<｜DSML｜invoke name=\"f\">\n"),                                               // unclosed invoke
        call("<｜DSML｜invoke name=\"\">\n</｜DSML｜invoke>"),                                 // empty name
        call("stray\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>"),                        // text in block
        call("<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"false\">{bad</｜DSML｜parameter>\n</｜DSML｜invoke>"),
        call("<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"maybe\">x</｜DSML｜parameter>\n</｜DSML｜invoke>"),
        call("<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"a\" string=\"true\">x\n</｜DSML｜invoke>"),
        call("<｜DSML｜invoke name=\"f\">\nloose text\n</｜DSML｜invoke>"),
        "text </｜DSML｜tool_calls>".to_string(),                                            // stray close
        "<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>".to_string(),                          // invoke outside block
    ] {
        assert_malformed(Family::DeepseekV4, &text);
    }
}
