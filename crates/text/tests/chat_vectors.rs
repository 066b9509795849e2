//! The single-turn chats of `verify/chat_vectors.json` (rendered upstream with the same templates).
//! The multi-turn ones are covered with their inputs by `golden_templates.rs`.

mod common;

use common::{read_json, tokenizer_dir};
use mference_text::ChatTemplate;
use serde_json::json;

fn render(name: &str, extra: serde_json::Value) -> String {
    let t = ChatTemplate::from_dir(&tokenizer_dir(name)).unwrap();
    let messages = [json!({"role": "user", "content": "Hi there"})];
    t.render(&messages, None, true, extra.as_object().unwrap())
        .unwrap()
}

fn vector(name: &str, chat: &str) -> String {
    read_json(tokenizer_dir(name).join("verify/chat_vectors.json"))[chat]["text"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn plain_chats_render_like_the_vectors() {
    assert_eq!(render("gemma4", json!({})), vector("gemma4", "plain"));
    assert_eq!(
        render("qwen3_6", json!({"enable_thinking": false})),
        vector("qwen3_6", "no_thinking")
    );
    assert_eq!(
        render("deepseek_v4", json!({})),
        vector("deepseek_v4", "plain")
    );
}

/// With the default kwargs, generation prompts end as in the original system
/// (github.com/NeelM0906/Mference) and the checkpoints' chat templates.
#[test]
fn default_kwargs_give_the_original_generation_suffixes() {
    use mference_text::Family;
    for (family, name, suffix) in [
        (
            Family::Gemma4,
            "gemma4",
            "<|turn>model\n<|channel>thought\n<channel|>",
        ),
        (
            Family::Qwen3_5Moe,
            "qwen3_6",
            "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        ),
        (Family::DeepseekV4, "deepseek_v4", "<｜Assistant｜></think>"),
    ] {
        let t = ChatTemplate::from_dir(&tokenizer_dir(name)).unwrap();
        let messages = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "Hi"}),
        ];
        let out = t
            .render(&messages, None, true, &family.default_template_kwargs())
            .unwrap();
        assert!(out.ends_with(suffix), "{name}: {out:?}");
    }
}

/// The thinking variables each bundled template reads (what `chat_template_kwargs` and
/// `reasoning_effort` can change; anything else is refused), and what they change.
#[test]
fn each_template_reads_its_own_thinking_variables() {
    let reads = |name: &str, var: &str| {
        let t = ChatTemplate::from_dir(&tokenizer_dir(name)).unwrap();
        let kw = json!({ var: "max" });
        t.check_extra(kw.as_object().unwrap()).is_ok()
    };
    for (name, enable_thinking, reasoning_effort) in [
        ("gemma4", true, false),
        ("qwen3_6", true, false),
        ("deepseek_v4", true, true),
        ("inkling", false, true),
        ("maple", false, false),
    ] {
        assert_eq!(reads(name, "enable_thinking"), enable_thinking, "{name}");
        assert_eq!(reads(name, "reasoning_effort"), reasoning_effort, "{name}");
        assert!(!reads(name, "enable_thinkin"), "{name}");
    }
    // DeepSeek-V4 with thinking on and the top effort: the template's preamble, then `<think>`.
    let max = render(
        "deepseek_v4",
        json!({"enable_thinking": true, "reasoning_effort": "max"}),
    );
    assert!(
        max.contains("Reasoning Effort: Absolute maximum")
            && max.ends_with("<｜Assistant｜><think>"),
        "{max}"
    );
    assert!(!render("deepseek_v4", json!({"enable_thinking": true})).contains("Reasoning Effort"));
    // Gemma 4 with thinking on: `<|think|>` in the system turn, no empty thought channel.
    let on = render("gemma4", json!({"enable_thinking": true}));
    assert!(
        on.contains("<|think|>") && on.ends_with("<|turn>model\n"),
        "{on}"
    );
}
