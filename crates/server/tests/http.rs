//! The server over loopback HTTP on the demo model: endpoints, error statuses, streaming, the
//! queue, KV prefix reuse, tool calls, and agreement with mlx-lm (greedy text, logprobs).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use mference_server::PromptCacheMode;
use mference_testkit::http::{get, open_stream, post, post_header, post_stream, raw_request, Sse};
use mference_testkit::{
    demo_install, demo_source, mlx_greedy, ref_logits, reference_chat_prompt, reference_text_prompt,
};
use serde_json::{json, Value};

fn assert_error(status: u16, body: &Value, want: u16, what: &str) {
    assert_eq!(status, want, "{what}: {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{what}: not an OpenAI error object: {body}"
    );
    assert!(body["error"]["type"].is_string(), "{what}: {body}");
}

#[test]
fn endpoints_and_error_statuses() {
    let srv = start(Opts::default());
    let a = srv.local_addr();
    assert_eq!(get(a, "/health"), (200, json!({"status": "ok"})));
    let (s, m) = get(a, "/v1/models");
    assert_eq!(s, 200);
    assert_eq!(m["data"][0]["id"], MODEL_ID);
    let (s, b) = get(a, "/v1/nothing");
    assert_error(s, &b, 404, "unknown route");

    let user = json!([{"role": "user", "content": "Hello"}]);
    // 415: not JSON.
    let (s, text) = raw_request(
        a,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\n",
        b"{}",
    );
    assert_eq!(s, 415, "{text}");
    assert!(text.contains("\"error\""), "{text}");
    // 413: a declared length over 1 MiB is refused before the body is read.
    let (s, text) = raw_request(
        a,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2000000\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
        b"",
    );
    assert_eq!(s, 413, "{text}");
    // 413: a chunked body (no declared length) that grows past 1 MiB.
    let big =
        json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "a ".repeat(600_000)}]})
            .to_string();
    let mut chunked = Vec::new();
    for part in big.as_bytes().chunks(64 * 1024) {
        chunked.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        chunked.extend_from_slice(part);
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    let (s, text) = raw_request(
        a,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        &chunked,
    );
    assert_eq!(s, 413, "{}", &text[..text.len().min(300)]);
    // 400: not JSON.
    let (s, text) = raw_request(
        a,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 5\r\nConnection: close\r\n\r\n",
        b"{nope",
    );
    assert_eq!(s, 400, "{text}");

    let with = |extra: Value| {
        let mut b = chat_body(user.clone());
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (extra, param) in [
        (json!({"n": 2}), "n"),
        (json!({"presence_penalty": 0.5}), "presence_penalty"),
        (json!({"frequency_penalty": -1}), "frequency_penalty"),
        (json!({"top_logprobs": 2}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
            "tool_choice",
        ),
        (json!({"parallel_tool_calls": false}), "parallel_tool_calls"),
        (
            json!({"functions": [{"name": "f", "parameters": {}}]}),
            "functions",
        ),
        (json!({"function_call": "auto"}), "function_call"),
        (json!({"temperature": 3}), "temperature"),
        (json!({"top_k": -1}), "top_k"),
        (json!({"top_k": 257}), "top_k"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format",
        ),
        (json!({"tools": [{"type": "code_interpreter"}]}), "tools[0]"),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]}),
            "messages[1].role",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "call_9", "content": "1"}]}),
            "messages[1].tool_call_id",
        ),
    ] {
        let (s, b) = post(a, "/v1/chat/completions", &with(extra.clone()));
        assert_error(s, &b, 400, &extra.to_string());
        assert_eq!(b["error"]["param"], param, "{extra}: {b}");
    }
    let (s, b) = post(a, "/v1/chat/completions", &with(json!({"model": "gpt-4o"})));
    assert_error(s, &b, 404, "unknown model");
    assert_eq!(b["error"]["code"], "model_not_found");
    // 400: the prompt does not fit the context (4096 here).
    let long = "the quick brown fox jumps over the lazy dog ".repeat(600);
    let (s, b) = post(
        a,
        "/v1/chat/completions",
        &chat_body(json!([{"role": "user", "content": long}])),
    );
    assert_error(s, &b, 400, "prompt longer than the context");
    assert_eq!(b["error"]["code"], "context_length_exceeded");
    // 4096 is also the demo model's own limit: no advice to raise --max-context.
    let msg = b["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("the model's own limit") && !msg.contains("larger --max-context"),
        "{msg}"
    );
    for (extra, param) in [
        (json!({"echo": true}), "echo"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"logprobs": 6}), "logprobs"),
        (json!({"best_of": 2}), "best_of"),
    ] {
        let mut body = json!({"model": MODEL_ID, "prompt": "Once", "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (s, b) = post(a, "/v1/completions", &body);
        assert_error(s, &b, 400, &extra.to_string());
        assert_eq!(b["error"]["param"], param, "{extra}: {b}");
    }
    // The server still answers after all of that.
    let (s, b) = post(a, "/v1/chat/completions", &chat_body(user.clone()));
    assert_eq!(s, 200, "{b}");
    // `top_k: 0` is top-k off (as `mference run --top-k 0`), not an error.
    let (s, b) = post(
        a,
        "/v1/chat/completions",
        &with(json!({"top_k": 0, "top_p": 1, "temperature": 1, "seed": 7})),
    );
    assert_eq!(s, 200, "top_k 0: {b}");
    assert!(b["choices"][0]["message"]["content"].is_string(), "{b}");
    srv.shutdown();
}

#[test]
fn greedy_chat_and_completions_match_mlx_lm() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let srv = start(Opts::default());
    let a = srv.local_addr();
    let src = demo_source();
    let tok = mference_text::Tokenizer::from_dir(&demo_install().join("tokenizer")).unwrap();
    let n = 24;

    // Chat: the reference renders the template in Python (transformers) with thinking off.
    let user = "Tell me about the weather in London.";
    let p = reference_chat_prompt(user);
    let want = tok.decode(&mlx_greedy(&p, n, work.path()), true).unwrap();
    let body = json!({"model": MODEL_ID, "messages": [{"role": "user", "content": user}], "temperature": 0, "max_tokens": n});
    let (s, r) = post(a, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        r["choices"][0]["message"]["content"], want,
        "chat text differs from mlx-lm"
    );
    assert_eq!(r["usage"]["prompt_tokens"], p.as_array().unwrap().len());
    assert_eq!(r["object"], "chat.completion");

    // The same request streamed: same text, role first, usage last, then [DONE].
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let st = post_stream(a, "/v1/chat/completions", &sb);
    assert_eq!(st.status, 200);
    assert!(
        st.content_type.starts_with("text/event-stream"),
        "{}",
        st.content_type
    );
    assert_eq!(st.text(), want, "streamed text differs");
    let chunks = st.chunks();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(
        last["usage"]["completion_tokens"],
        r["usage"]["completion_tokens"]
    );
    assert_eq!(st.data().last().unwrap(), "[DONE]");
    assert_eq!(
        st.finish_reasons(),
        [r["choices"][0]["finish_reason"].clone()]
    );

    // Completions from token ids, with logprobs checked against mlx-lm's last-row log-softmax.
    let text = "It is a truth universally acknowledged, that";
    let p = reference_text_prompt(text);
    let ids = mlx_greedy(&p, n, work.path());
    let body =
        json!({"model": MODEL_ID, "prompt": p, "temperature": 0, "max_tokens": n, "logprobs": 5});
    let (s, r) = post(a, "/v1/completions", &body);
    assert_eq!(s, 200, "{r}");
    assert_eq!(
        r["choices"][0]["text"],
        tok.decode(&ids, true).unwrap(),
        "completion differs from mlx-lm"
    );
    let lp = &r["choices"][0]["logprobs"];
    assert_eq!(
        lp["tokens"].as_array().unwrap().len(),
        r["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    // mlx-lm's logits for the prompt: the last row is the first generated token's distribution.
    let prompt_ids: Vec<u32> = serde_json::from_value(p.clone()).unwrap();
    let (all, vocab) = ref_logits(&src, &prompt_ids, work.path());
    let row = &all[all.len() - vocab..];
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&z| (z as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&x, &y| row[y].total_cmp(&row[x]));
    let ours_top: Vec<f64> = lp["top_logprobs"][0]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(ours_top.len(), 5);
    let mut ours_sorted = ours_top.clone();
    ours_sorted.sort_by(|x, y| y.total_cmp(x));
    for (k, &i) in order.iter().take(5).enumerate() {
        let want = row[i] as f64 - lse;
        assert!(
            (ours_sorted[k] - want).abs() < 0.02,
            "top-{k} logprob {} vs mlx-lm {want}",
            ours_sorted[k]
        );
    }
    let first = lp["token_logprobs"][0].as_f64().unwrap();
    assert!((first - (row[ids[0] as usize] as f64 - lse)).abs() < 0.02);
    assert_eq!(lp["tokens"][0], tok.decode(&ids[..1], false).unwrap());
    srv.shutdown();
}

/// Turn 1, then turn 2 extending it: the warm server reuses the KV prefix and must produce the
/// same tokens (and the same logprobs up to f16 rounding) as a cold server.
#[test]
fn prefix_reuse_matches_a_cold_run() {
    let warm = start(Opts::default());
    let cold = start(Opts {
        cache: PromptCacheMode::Off,
        ..Opts::default()
    });
    let mut messages = vec![
        json!({"role": "system", "content": "You are a storyteller."}),
        json!({"role": "user", "content": "Tell me about the sea."}),
    ];
    // Long user turns push the conversation past the 256-row sliding-window ring, where the
    // prefix can be cut only at the checkpoint taken before the assistant's turn opened.
    let turns = [
        "And then?",
        "What did the captain say?",
        &"Describe the harbour in the morning light, the boats and the gulls. ".repeat(20),
        "And after that?",
    ];
    let mut reused = Vec::new();
    for (t, next_user) in std::iter::once("").chain(turns.iter().copied()).enumerate() {
        if t > 0 {
            messages.push(json!({"role": "user", "content": next_user}));
        }
        let body = json!({"model": MODEL_ID, "messages": messages, "temperature": 0.7, "seed": 1234 + t, "max_tokens": 20, "logprobs": true, "top_logprobs": 3});
        let (s, w) = post(warm.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{w}");
        let (s, c) = post(cold.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{c}");
        let (prompt, cached) = assert_warm_equals_cold(t, &w, &c, 1e-2);
        assert!(cached < prompt);
        reused.push((prompt, cached));
        messages
            .push(json!({"role": "assistant", "content": w["choices"][0]["message"]["content"]}));
    }
    eprintln!("(prompt, cached) per turn: {reused:?}");
    assert_eq!(reused[0].1, 0, "nothing to reuse on the first request");
    // Turns 1 to 3 extend a conversation whose KV still fits the 256-row ring: everything of the
    // previous prompt is reused except its generation-prompt tail (`<|channel>thought\n<channel|>`,
    // which the template drops from the history's assistant turn).
    let tok = mference_text::Tokenizer::from_dir(&demo_install().join("tokenizer")).unwrap();
    let tail = tok
        .encode("<|channel>thought\n<channel|>", false)
        .unwrap()
        .len() as u64;
    for t in 1..4 {
        assert!(
            reused[t].1 >= reused[t - 1].0 - tail,
            "turn {t}: too little reused: {reused:?}"
        );
    }
    // Turn 4 follows a prompt that wrapped the ring: it rewinds to the checkpoint of the rings
    // before turn 3's assistant opener (it used to reuse nothing).
    let opener = tok.encode("<|turn>model\n", false).unwrap().len() as u64;
    assert!(
        reused[3].0 > 256 && reused[4].1 >= reused[3].0 - tail - opener,
        "turn 4: too little reused after the ring wrapped: {reused:?}"
    );
    warm.shutdown();
    cold.shutdown();
}

fn weather_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}])
}

#[test]
fn tool_calls_round_trip_and_fail_closed() {
    let script = Arc::new(Mutex::new(String::from(
        "<|tool_call>call:get_weather{city:<|\"|>London<|\"|>,days:3}<tool_call|>",
    )));
    let srv = start(Opts {
        tool_script: Some(script.clone()),
        ..Opts::default()
    });
    let a = srv.local_addr();
    let mut messages = vec![json!({"role": "user", "content": "What is the weather in London?"})];
    let body = json!({"model": MODEL_ID, "messages": messages, "tools": weather_tools(), "max_tokens": 64});
    let (s, r) = post(a, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{r}");
    let ch = &r["choices"][0];
    assert_eq!(ch["finish_reason"], "tool_calls", "{r}");
    assert!(ch["message"]["content"].is_null(), "{r}");
    let call = &ch["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "London", "days": 3}));
    let id = call["id"].as_str().unwrap().to_string();

    // Streamed: no markup leaks into content, one tool_calls delta, finish_reason tool_calls.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = post_stream(a, "/v1/chat/completions", &sb);
    assert_eq!(st.status, 200);
    assert!(!st.text().contains("<|tool_call>"), "{}", st.raw);
    let chunks = st.chunks();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1, "{}", st.raw);
    assert_eq!(calls[0][0]["function"]["name"], "get_weather");
    assert_eq!(calls[0][0]["index"], 0);
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "tool_calls"));

    // Round trip: the assistant call and the tool result go back; the model answers in text.
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call.clone()]}));
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": "{\"temperature_c\": 14, \"sky\": \"rain\"}"}));
    let (s, r) = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": messages, "tools": weather_tools(), "max_tokens": 16, "temperature": 0}),
    );
    assert_eq!(s, 200, "{r}");
    assert_ne!(r["choices"][0]["finish_reason"], "tool_calls");
    assert!(r["choices"][0]["message"]["content"].is_string());
    // The tool result reused the KV of the call turn.
    assert!(
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{r}"
    );
    // A tool message answering a call that was never made.
    let mut bad = messages.clone();
    bad[2]["tool_call_id"] = json!("call_other");
    let (s, b) = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": bad, "tools": weather_tools()}),
    );
    assert_error(s, &b, 400, "unmatched tool_call_id");

    // tool_choice none: tools are not offered, the model writes text.
    let (s, r) = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "tools": weather_tools(), "tool_choice": "none", "max_tokens": 8}),
    );
    assert_eq!(s, 200, "{r}");
    assert_ne!(r["choices"][0]["finish_reason"], "tool_calls");

    // Malformed call output fails closed: 500 without a body of half-parsed calls, or in-band.
    *script.lock().unwrap() = "<|tool_call>call:get_weather{city:<|\"|>London}".into();
    let (s, b) = post(a, "/v1/chat/completions", &body);
    assert_error(s, &b, 500, "malformed tool call");
    assert_eq!(b["error"]["code"], "malformed_tool_call");
    let st = post_stream(a, "/v1/chat/completions", &sb);
    assert_eq!(st.status, 200);
    assert_eq!(
        st.final_error()["code"],
        "malformed_tool_call",
        "{}",
        st.raw
    );
    assert!(!st.raw.contains("tool_calls\":[{"), "{}", st.raw);
    // ... with the model's text attached, and a status the official clients do not retry.
    let (s, b, retry) = post_header(a, "/v1/chat/completions", &body, "x-should-retry");
    assert_eq!(s, 500, "{b}");
    assert_eq!(retry.as_deref(), Some("false"), "{b}");
    assert_eq!(
        b["error"]["raw_output"], "<|tool_call>call:get_weather{city:<|\"|>London}",
        "{b}"
    );

    // A call cut by max_tokens or a stop string is not an error: finish_reason length / stop,
    // the text as written.
    *script.lock().unwrap() =
        "<|tool_call>call:get_weather{city:<|\"|>London<|\"|>,days:3}<tool_call|>".into();
    let mut cut = body.clone();
    cut["max_tokens"] = json!(4);
    let (s, r) = post(a, "/v1/chat/completions", &cut);
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
    let content = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.starts_with("<|tool_call>call"), "{r}");
    assert!(
        r["choices"][0]["message"].get("tool_calls").is_none(),
        "{r}"
    );
    cut["stream"] = json!(true);
    let st = post_stream(a, "/v1/chat/completions", &cut);
    assert_eq!(st.status, 200);
    assert_eq!(st.text(), content, "{}", st.raw);
    assert!(st
        .chunks()
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));
    let mut stop = body.clone();
    stop["stop"] = json!(["London"]);
    let (s, r) = post(a, "/v1/chat/completions", &stop);
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    assert_eq!(
        r["choices"][0]["message"]["content"], "<|tool_call>call:get_weather{city:<|\"|>",
        "{r}"
    );

    // The marker's characters spelled by ordinary tokens are prose, not a call.
    *script.lock().unwrap() = "Gemma calls tools with <|tool\u{1}_call> markers.".into();
    let (s, r) = post(a, "/v1/chat/completions", &body);
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
    assert_eq!(
        r["choices"][0]["message"]["content"], "Gemma calls tools with <|tool_call> markers.",
        "{r}"
    );
    srv.shutdown();
}

#[test]
fn queue_limit_gives_429_and_streams_get_heartbeats() {
    let srv = start(Opts {
        queue_limit: 1,
        delay: Duration::from_millis(40),
        heartbeat: Duration::from_millis(100),
        ..Opts::default()
    });
    let a = srv.local_addr();
    let long = |stream: bool| json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": stream});
    // A: running (its head and first chunk arrive), B: waiting in the one queue slot, C: 429.
    let running = std::thread::spawn(move || post_stream(a, "/v1/completions", &long(true)));
    std::thread::sleep(Duration::from_millis(400));
    let queued = std::thread::spawn(move || post_stream(a, "/v1/completions", &long(true)));
    std::thread::sleep(Duration::from_millis(300));
    let (s, b, retry_after) = post_header(a, "/v1/completions", &long(false), "retry-after");
    assert_error(s, &b, 429, "third request with queue limit 1");
    assert_eq!(b["error"]["type"], "rate_limit_error");
    // When to try again (RFC 9110 `Retry-After`, in seconds), which OpenAI clients obey.
    let retry_after: u32 = retry_after
        .expect("a 429 without Retry-After")
        .parse()
        .expect("Retry-After in whole seconds");
    assert!(retry_after >= 1, "{retry_after}");
    let (ra, rb) = (running.join().unwrap(), queued.join().unwrap());
    assert_eq!((ra.status, rb.status), (200, 200));
    assert_eq!(ra.data().last().unwrap(), "[DONE]");
    // B waited ~1.6 s behind A with its head already sent: the idle stream got `: ping`s.
    assert!(rb.raw.contains(": ping\n\n"), "no heartbeat in {}", rb.raw);
    srv.shutdown();
}

/// `Server::shutdown` while a stream is generating, a stream is queued and a JSON request is
/// queued: both streams end in-band (`server_shutting_down`, then `[DONE]`) instead of being cut,
/// the JSON request gets a 503 OpenAI error object, and the port is closed afterwards.
#[test]
fn shutdown_ends_open_streams_in_band_and_answers_waiting_requests_503() {
    let srv = start(Opts {
        delay: Duration::from_millis(20),
        ..Opts::default()
    });
    let a = srv.local_addr();
    let long = |stream: bool| json!({"model": MODEL_ID, "prompt": "It is a truth universally acknowledged, that", "max_tokens": 3000, "temperature": 0, "stream": stream});
    let mut running = open_stream(a, "/v1/completions", &long(true));
    assert_eq!(running.status, 200);
    let first = running.next_data().expect("a first chunk");
    assert!(first.contains("\"text\""), "{first}");
    let waiting_json = std::thread::spawn(move || post(a, "/v1/completions", &long(false)));
    // The JSON request has no head to wait for; give it time to reach the queue.
    std::thread::sleep(Duration::from_secs(1));
    // A stream's head is sent once its job is queued, so this one is waiting when this returns.
    let waiting_stream = open_stream(a, "/v1/completions", &long(true));
    assert_eq!(waiting_stream.status, 200);

    srv.shutdown();

    let shut_down_in_band = |st: &Sse, what: &str| {
        let err = st.final_error();
        assert_eq!(err["code"], "server_shutting_down", "{what}: {}", st.raw);
        assert_eq!(err["type"], "server_error", "{what}: {}", st.raw);
        assert_eq!(
            st.finish_reasons(),
            [] as [Value; 0],
            "{what}: the stream finished instead of being ended by the shutdown: {}",
            st.raw
        );
    };
    let running = running.finish();
    assert!(!running.text().is_empty());
    shut_down_in_band(&running, "running stream");
    let waiting_stream = waiting_stream.finish();
    assert_eq!(waiting_stream.text(), "", "{}", waiting_stream.raw);
    shut_down_in_band(&waiting_stream, "queued stream");
    let (s, b) = waiting_json.join().unwrap();
    assert_error(s, &b, 503, "queued JSON request at shutdown");
    assert_eq!(b["error"]["code"], "server_shutting_down");
    assert!(
        std::net::TcpStream::connect(a).is_err(),
        "the port still accepts connections after the shutdown"
    );
}

/// A layer file damaged under a running server: the request fails (logged once) and `/health`
/// stops saying ok.
#[test]
fn health_reports_a_model_that_cannot_serve() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let copy = mference_testkit::copy_install(demo_install(), work.path(), "copy.gturbo");
    let srv = start_with(Opts::default(), |ctx| {
        let m = load_model_from(&copy, ctx);
        // After the load, before the first request (`serve` checks the files before its ready
        // line; this is a file damaged later).
        let layer = copy.join("packed_experts/layer_01.bin");
        let mut bytes = std::fs::read(&layer).unwrap();
        bytes[100] ^= 1;
        std::fs::write(&layer, bytes).unwrap();
        m
    });
    let a = srv.local_addr();
    assert_eq!(get(a, "/health"), (200, json!({"status": "ok"})));
    let (s, b) = post(
        a,
        "/v1/completions",
        &json!({"model": MODEL_ID, "prompt": "Hello", "max_tokens": 4}),
    );
    assert_error(s, &b, 500, "damaged layer file");
    let (s, h) = get(a, "/health");
    assert_eq!(s, 503, "{h}");
    assert_eq!(h["status"], "error", "{h}");
    assert!(h["error"].as_str().unwrap().contains("layer_01.bin"), "{h}");
    srv.shutdown();
}
