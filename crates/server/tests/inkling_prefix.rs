//! Prefix reuse on Inkling, whose four short-convolution states per layer are recurrent: the server
//! keeps a checkpoint from just before the assistant's turn opens (`<|message_model|>`), so a
//! follow-up turn reuses the whole conversation up to there and answers exactly as a server that
//! re-runs everything. The model is the golden fixture A with the real tokenizer's vocabulary
//! (`mference_testkit::inkling_text_install`).

mod common;

use common::{start_install, warm_cold_conversation};
use mference_models::LoadOptions;
use mference_runtime::CacheSlots;
use mference_testkit::inkling_text_install;

const MODEL_ID: &str = "inkling-tiny";

#[test]
fn inkling_follow_up_turns_reuse_the_conversation_and_match_a_cold_run() {
    let opts = LoadOptions {
        slots: CacheSlots::Fixed(8),
        threads: 1,
        prefill_chunk: 64,
        max_context: 1024,
        ..Default::default()
    };
    let seen = warm_cold_conversation(
        |cache| start_install(inkling_text_install(), &opts, cache, MODEL_ID),
        MODEL_ID,
        12,
        1e-4,
    );
    // Everything before the previous request's generation prompt `<|message_model|>` (one token)
    // is reused.
    for t in 1..seen.len() {
        assert_eq!(
            seen[t].1,
            seen[t - 1].0 - 1,
            "turn {t}: the reused prefix is not the previous conversation: {seen:?}"
        );
    }
}
