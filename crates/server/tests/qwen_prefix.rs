//! Prefix reuse on a recurrent family: Qwen 3.6's DeltaNet state cannot be cut open, so the server
//! keeps a checkpoint from just before the assistant's turn opens. A follow-up turn then reuses the
//! whole conversation up to there and answers exactly as a server that re-runs everything.

mod common;

use common::{start_install, warm_cold_conversation};
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_testkit::installed_asset;

const MODEL_ID: &str = "qwen-tiny";

#[test]
fn qwen_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
    let dir = installed_asset("qwen3_6-tiny");
    let opts = LoadOptions {
        slots: CacheSlots::Resident,
        threads: 1,
        prefill_chunk: 128,
        max_context: 2048,
        ..Default::default()
    };
    let seen = warm_cold_conversation(
        |cache| start_install(dir, &opts, cache, MODEL_ID),
        MODEL_ID,
        16,
        1e-3,
    );
    // Everything before the previous request's assistant opener is reused: its prompt minus the
    // generation suffix `<|im_start|>assistant\n<think>\n\n</think>\n\n`.
    let tok = mference_text::Tokenizer::from_dir(&dir.join("tokenizer")).unwrap();
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
}
