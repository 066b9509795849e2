//! Prefix reuse on DeepSeek-V4, whose sliding K = V rings and compressed-KV windows cannot be cut
//! open: the server keeps a checkpoint from just before the assistant's turn opens
//! (`<｜Assistant｜>`), so a follow-up turn reuses the conversation up to there and answers exactly
//! as a server that re-runs everything. The model is the golden fixture A with the tokenizer's
//! vocabulary (`mference_testkit::dsv4_text_install`); with a prefill chunk of 16 and the fixture's
//! 32-row window the 48-row rings have wrapped by the second turn.

mod common;

use common::assert_follow_ups_reuse_the_conversation;
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_testkit::dsv4_text_install;

#[test]
fn deepseek_v4_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
    let opts = LoadOptions {
        slots: CacheSlots::Fixed(8),
        threads: 1,
        prefill_chunk: 16,
        max_context: 1024,
        ..Default::default()
    };
    // Everything before the previous request's `<｜Assistant｜></think>` is reused.
    assert_follow_ups_reuse_the_conversation(
        dsv4_text_install(),
        &opts,
        "deepseek-v4-tiny",
        12,
        1e-4,
        "<｜Assistant｜></think>",
    );
}
