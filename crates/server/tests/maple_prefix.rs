//! Prefix reuse on Maple, whose sliding-window layers keep ring KV caches (with a checkpoint of
//! the rings before the assistant's turn opens, for once they wrap): a follow-up turn reuses the
//! whole conversation up to where it differs from the previous prompt and answers exactly as a
//! server that re-runs everything.
//! The model is the golden fixture A with the Maple tokenizer's vocabulary
//! (`mference_testkit::maple_text_install`).

mod common;

use common::assert_follow_ups_reuse_the_conversation;
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_testkit::maple_text_install;

#[test]
fn maple_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
    let opts = LoadOptions {
        slots: CacheSlots::Fixed(8),
        threads: 1,
        prefill_chunk: 64,
        max_context: 1024,
        ..Default::default()
    };
    // Everything of the previous request but the `<think>\n` its generation prompt leaves open
    // (the history renders the assistant turn without it) is reused.
    assert_follow_ups_reuse_the_conversation(
        maple_text_install(),
        &opts,
        "maple-tiny",
        12,
        1e-4,
        "<think>\n",
    );
}
