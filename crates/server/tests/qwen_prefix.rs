//! Prefix reuse on a recurrent family: Qwen 3.6's DeltaNet state cannot be cut open, so the server
//! keeps a checkpoint from just before the assistant's turn opens. A follow-up turn then reuses the
//! whole conversation up to there and answers exactly as a server that re-runs everything.

mod common;

use common::assert_follow_ups_reuse_the_conversation;
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_testkit::installed_asset;

#[test]
fn qwen_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
    let opts = LoadOptions {
        slots: CacheSlots::Resident,
        threads: 1,
        prefill_chunk: 128,
        max_context: 2048,
        ..Default::default()
    };
    assert_follow_ups_reuse_the_conversation(
        installed_asset("qwen3_6-tiny"),
        &opts,
        "qwen-tiny",
        16,
        1e-3,
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    );
}
