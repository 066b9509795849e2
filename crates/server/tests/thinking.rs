//! Thinking switches on Qwen 3.6 (the trained tiny model): `chat_template_kwargs`
//! `{"enable_thinking": …}` changes the prompt exactly as transformers' template render does
//! (`tools/ref/encode.py`), and the reasoning comes back apart, as `reasoning_content`: the
//! reply to a chat equals the raw greedy continuation of the reference prompt
//! (`/v1/completions` on its token ids), split at `</think>`. Variables the template does not
//! read, and a response format inside an open reasoning block, are refused.

mod common;

use std::net::SocketAddr;

use common::{resident_opts, start_install};
use mference_server::PromptCacheMode;
use mference_testkit::http::{post, post_stream};
use mference_testkit::{installed_asset, py, repo};
use serde_json::{json, Value};

const MODEL: &str = "qwen-tiny";
const USER: &str = "Tell me about the king.";
const MAX_TOKENS: usize = 24;

/// The reference prompt ids of [`USER`] with `enable_thinking` = `thinking`.
fn reference_prompt(thinking: bool) -> Value {
    let src = repo().join("assets/models/qwen3_6-tiny");
    py(&[
        "tools/ref/encode.py",
        "--model",
        src.to_str().unwrap(),
        "--chat-user",
        USER,
        "--thinking",
        if thinking { "true" } else { "false" },
    ])["prompt"]
        .clone()
}

fn chat_body(thinking: bool, stream: bool) -> Value {
    json!({
        "model": MODEL, "messages": [{"role": "user", "content": USER}],
        "temperature": 0, "max_tokens": MAX_TOKENS, "stream": stream,
        "chat_template_kwargs": {"enable_thinking": thinking},
    })
}

fn ok(addr: SocketAddr, path: &str, body: &Value) -> Value {
    let (status, v) = post(addr, path, body);
    assert_eq!(status, 200, "{v}");
    v
}

#[test]
fn enable_thinking_changes_the_prompt_and_the_reasoning_comes_back_apart() {
    let dir = installed_asset("qwen3_6-tiny");
    let server = start_install(dir, &resident_opts(1024), PromptCacheMode::Off, MODEL);
    let addr = server.local_addr();
    let mut prompts = Vec::new();
    for thinking in [false, true] {
        let prompt = reference_prompt(thinking);
        let raw = ok(
            addr,
            "/v1/completions",
            &json!({"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS}),
        );
        let raw = raw["choices"][0]["text"].as_str().unwrap().to_string();
        let reply = ok(addr, "/v1/chat/completions", &chat_body(thinking, false));
        assert_eq!(
            reply["usage"]["prompt_tokens"],
            prompt.as_array().unwrap().len(),
            "thinking {thinking}: prompt length vs the reference render"
        );
        let message = &reply["choices"][0]["message"];
        if thinking {
            // The prompt ends inside `<think>\n`: the reply is reasoning up to `</think>`.
            let (reasoning, content) = match raw.split_once("</think>") {
                Some((r, c)) => (r.trim_end_matches('\n'), c.trim_start_matches('\n')),
                None => (raw.trim_end_matches('\n'), ""),
            };
            assert!(!reasoning.is_empty(), "no reasoning in {raw:?}");
            assert_eq!(message["reasoning_content"], reasoning, "{raw:?}");
            assert_eq!(message["content"], content, "{raw:?}");
            // Streamed: the same reasoning, in `delta.reasoning_content` chunks.
            let sse = post_stream(addr, "/v1/chat/completions", &chat_body(true, true));
            let streamed: String = sse
                .chunks()
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
                .collect();
            assert_eq!(streamed, reasoning);
            assert_eq!(sse.text(), content);
        } else {
            assert_eq!(message["content"], raw.as_str());
            assert!(message.get("reasoning_content").is_none(), "{message}");
        }
        prompts.push(prompt);
    }
    assert_ne!(prompts[0], prompts[1], "enable_thinking changed nothing");

    // Refusals, before anything runs.
    let refused = |extra: Value, param: &str, says: &str| {
        let mut body = chat_body(false, false);
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let (status, v) = post(addr, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{extra}: {msg}");
    };
    refused(
        json!({"chat_template_kwargs": {"enable_thinkin": true}}),
        "chat_template_kwargs",
        "does not read `enable_thinkin`",
    );
    // Qwen 3.6's template has no effort levels (DeepSeek-V4's and Inkling's do).
    refused(
        json!({"reasoning_effort": "high"}),
        "reasoning_effort",
        "does not read `reasoning_effort`",
    );
    refused(
        json!({"chat_template_kwargs": {"enable_thinking": true}, "response_format": {"type": "json_object"}}),
        "response_format",
        "reasoning block open",
    );
    server.shutdown();
}
