//! Prefix reuse on a recurrent family: Qwen 3.6's DeltaNet state cannot be cut open, so the server
//! keeps a checkpoint from just before the assistant's turn opens. A follow-up turn then reuses the
//! whole conversation up to there and answers exactly as a server that re-runs everything.

mod common;

use common::assert_warm_equals_cold;
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_server::{PromptCacheMode, Server, ServerConfig, TextSide};
use mference_testkit::http::post;
use mference_testkit::installed_asset;
use serde_json::json;

const MODEL_ID: &str = "qwen-tiny";

fn start(cache: PromptCacheMode) -> Server {
    let dir = installed_asset("qwen3_6-tiny");
    let text = TextSide::load(dir).unwrap();
    let model = mference_models::load(
        dir,
        &LoadOptions {
            slots: CacheSlots::Resident,
            threads: 1,
            prefill_chunk: 128,
            max_context: 2048,
            ..Default::default()
        },
    )
    .expect("loading qwen3_6-tiny");
    let cfg = ServerConfig {
        prompt_cache: cache,
        ..ServerConfig::new(MODEL_ID)
    };
    mference_server::start(model, text, cfg, "127.0.0.1:0".parse().unwrap()).unwrap()
}

#[test]
fn qwen_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
    let warm = start(PromptCacheMode::SinglePrefix);
    let cold = start(PromptCacheMode::Off);
    let mut messages = vec![
        json!({"role": "system", "content": "You are a careful reader of old novels."}),
        json!({"role": "user", "content": "Who lives at Netherfield Park?"}),
    ];
    let follow_ups = ["And what of Mr. Darcy?", "Tell me about Longbourn."];
    let mut seen = Vec::new();
    for t in 0..=follow_ups.len() {
        if t > 0 {
            messages.push(json!({"role": "user", "content": follow_ups[t - 1]}));
        }
        let body = json!({"model": MODEL_ID, "messages": messages, "temperature": 0,
            "max_tokens": 16, "logprobs": true});
        let (s, w) = post(warm.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{w}");
        let (s, c) = post(cold.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{c}");
        let (prompt, cached) = assert_warm_equals_cold(t, &w, &c, 1e-3);
        seen.push((prompt, cached));
        messages
            .push(json!({"role": "assistant", "content": w["choices"][0]["message"]["content"]}));
    }
    eprintln!("(prompt, cached) per turn: {seen:?}");
    assert_eq!(seen[0].1, 0);
    // Everything before the previous request's assistant opener is reused: its prompt minus the
    // generation suffix `<|im_start|>assistant\n<think>\n\n</think>\n\n`.
    let tok =
        mference_text::Tokenizer::from_dir(&installed_asset("qwen3_6-tiny").join("tokenizer"))
            .unwrap();
    let suffix = tok
        .encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", false)
        .unwrap()
        .len() as u64;
    for t in 1..seen.len() {
        assert_eq!(
            seen[t].1,
            seen[t - 1].0 - suffix,
            "turn {t}: the reused prefix is not the previous conversation: {seen:?}"
        );
    }
    warm.shutdown();
    cold.shutdown();
}
