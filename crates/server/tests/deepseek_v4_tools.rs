//! DSML tool calls through the server on a DeepSeek-V4 model: the golden fixture A with the
//! tokenizer's vocabulary (`mference_testkit::dsv4_text_install`) behind [`common::ToolCaller`],
//! which forces the tokens of a DSML block after the DeepSeek chat render of a request with tools
//! (a random tiny model never writes one itself). The forced ids are the DeepSeek tokenizer's
//! encoding of the block; the detokenizer, the DSML parser, the OpenAI shapes and the fail-closed
//! path are the server's real code. A malformed block is an error only when the model wrote the
//! added token `｜DSML｜`; the same characters from other tokens are prose.

mod common;

use std::sync::{Arc, Mutex};

use common::{start_install_wrapped, ToolCaller, DEEPSEEK_V4_TOOLS};
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_server::PromptCacheMode;
use mference_testkit::dsv4_text_install;
use mference_testkit::http::{post, post_stream};
use serde_json::{json, Value};

const MODEL_ID: &str = "deepseek-v4-tiny";

const CALL: &str = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">London</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])
}

#[test]
fn deepseek_v4_dsml_calls_parse_end_to_end_and_fail_closed() {
    let script = Arc::new(Mutex::new(format!("Checking.\n\n{CALL}")));
    let opts = LoadOptions {
        slots: CacheSlots::Fixed(8),
        threads: 1,
        prefill_chunk: 64,
        max_context: 2048,
        ..Default::default()
    };
    let dir = dsv4_text_install();
    let s2 = script.clone();
    let srv = start_install_wrapped(dir, &opts, PromptCacheMode::SinglePrefix, MODEL_ID, |m| {
        Box::new(ToolCaller::new(m, dir, &DEEPSEEK_V4_TOOLS, s2))
    });
    let a = srv.local_addr();
    let messages = vec![json!({"role": "user", "content": "What is the weather in London?"})];
    let body =
        json!({"model": MODEL_ID, "messages": messages, "tools": tools(), "max_tokens": 128});
    let (s, r) = post(a, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{r}");
    let ch = &r["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls", "{r}");
    assert_eq!(ch["message"]["content"], "Checking.", "{r}");
    let call = &ch["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{r}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "London", "days": 3}));

    // Streamed: no DSML reaches the content deltas; one tool_calls delta.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = post_stream(a, "/v1/chat/completions", &sb);
    assert_eq!(st.status, 200);
    assert!(!st.text().contains("DSML"), "{}", st.raw);
    let calls: Vec<Value> = st
        .chunks()
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls").cloned())
        .collect();
    assert_eq!(calls.len(), 1, "{}", st.raw);
    assert_eq!(calls[0][0]["function"]["name"], "get_weather");

    // The call and its result go back through the DeepSeek template (the wrapper then forces the
    // same call again, which parses the same).
    let mut follow = messages.clone();
    follow.push(json!({"role": "assistant", "content": null, "tool_calls": [call.clone()]}));
    follow.push(
        json!({"role": "tool", "tool_call_id": call["id"], "content": "{\"temperature_c\": 14}"}),
    );
    let (s, r2) = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": follow, "tools": tools(), "max_tokens": 128}),
    );
    assert_eq!(s, 200, "{r2}");
    assert!(
        r2["usage"]["prompt_tokens"].as_u64() > r["usage"]["prompt_tokens"].as_u64(),
        "{r2}"
    );
    assert_eq!(r2["choices"][0]["finish_reason"], "tool_calls", "{r2}");

    // A malformed block (a non-JSON value marked string="false") fails closed.
    *script.lock().unwrap() = CALL.replace(">3<", ">{three<");
    let (s, b) = post(a, "/v1/chat/completions", &body);
    assert_eq!(s, 500, "{b}");
    assert_eq!(b["error"]["code"], "malformed_tool_call", "{b}");
    assert!(b.get("choices").is_none(), "{b}");
    // The same characters spelled without the added token `｜DSML｜` are prose, not a call.
    *script.lock().unwrap() = CALL
        .replace(">3<", ">{three<")
        .replace("｜DSML｜", "｜DS\u{1}ML｜");
    let (s, b) = post(a, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["finish_reason"], "stop", "{b}");
    assert!(
        b["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|c| c.contains("｜DSML｜invoke")),
        "{b}"
    );
    srv.shutdown();
}
