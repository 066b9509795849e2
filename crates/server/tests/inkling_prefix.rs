//! Prefix reuse on Inkling, whose four short-convolution states per layer are recurrent: the server
//! keeps a checkpoint from just before the assistant's turn opens (`<|message_model|>`), so a
//! follow-up turn reuses the whole conversation up to there and answers exactly as a server that
//! re-runs everything. The model is the golden fixture A with the real tokenizer's vocabulary
//! (`mference_testkit::inkling_text_install`).

mod common;

use common::assert_follow_ups_reuse_the_conversation;
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_testkit::inkling_text_install;

#[test]
fn inkling_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
    let opts = LoadOptions {
        slots: CacheSlots::Fixed(8),
        threads: 1,
        prefill_chunk: 64,
        max_context: 1024,
        ..Default::default()
    };
    // Everything before the previous request's generation prompt `<|message_model|>` is reused.
    assert_follow_ups_reuse_the_conversation(
        inkling_text_install(),
        &opts,
        "inkling-tiny",
        12,
        1e-4,
        "<|message_model|>",
    );
}
