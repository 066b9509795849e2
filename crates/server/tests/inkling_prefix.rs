//! Prefix reuse on Inkling, whose four short-convolution states per layer are recurrent: the server
//! keeps a checkpoint from just before the assistant's turn opens (`<|message_model|>`), so a
//! follow-up turn reuses the whole conversation up to there and answers exactly as a server that
//! re-runs everything. The model is the golden fixture A with the real tokenizer's vocabulary
//! (`mference_testkit::inkling_text_install`).

mod common;

use common::assert_warm_equals_cold;
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_server::{PromptCacheMode, Server, ServerConfig, TextSide};
use mference_testkit::http::post;
use mference_testkit::inkling_text_install;
use serde_json::json;

const MODEL_ID: &str = "inkling-tiny";

fn start(cache: PromptCacheMode) -> Server {
    let dir = inkling_text_install();
    let text = TextSide::load(dir).unwrap();
    let model = mference_models::load(
        dir,
        &LoadOptions {
            slots: CacheSlots::Fixed(8),
            threads: 1,
            prefill_chunk: 64,
            max_context: 1024,
            ..Default::default()
        },
    )
    .expect("loading the Inkling text install");
    let cfg = ServerConfig {
        prompt_cache: cache,
        ..ServerConfig::new(MODEL_ID)
    };
    mference_server::start(model, text, cfg, "127.0.0.1:0".parse().unwrap()).unwrap()
}

#[test]
fn inkling_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
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
            "max_tokens": 12, "logprobs": true});
        let (s, w) = post(warm.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{w}");
        let (s, c) = post(cold.local_addr(), "/v1/chat/completions", &body);
        assert_eq!(s, 200, "{c}");
        let (prompt, cached) = assert_warm_equals_cold(t, &w, &c, 1e-4);
        seen.push((prompt, cached));
        messages
            .push(json!({"role": "assistant", "content": w["choices"][0]["message"]["content"]}));
    }
    eprintln!("(prompt, cached) per turn: {seen:?}");
    assert_eq!(seen[0].1, 0);
    // Everything before the previous request's generation prompt `<|message_model|>` (one token)
    // is reused.
    for t in 1..seen.len() {
        assert_eq!(
            seen[t].1,
            seen[t - 1].0 - 1,
            "turn {t}: the reused prefix is not the previous conversation: {seen:?}"
        );
    }
    warm.shutdown();
    cold.shutdown();
}
