//! `run --think on|off` on the trained tiny Qwen 3.6: the prompt is transformers' template render
//! with `enable_thinking` true / false (`tools/ref/encode.py`), token for token; with thinking on
//! the reply (inside the open `<think>` block) goes to stderr as reasoning, not to stdout.

use mference_testkit::{installed_asset, py, repo, run_ok, run_refused};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_mference");
const USER: &str = "Tell me about the king.";

#[test]
fn think_on_and_off_render_like_the_reference_and_split_the_reasoning() {
    let model = installed_asset("qwen3_6-tiny");
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let messages = work.path().join("chat.json");
    std::fs::write(
        &messages,
        serde_json::json!([{"role": "user", "content": USER}]).to_string(),
    )
    .unwrap();
    let mut prompts = Vec::new();
    for think in ["on", "off"] {
        let out = run_ok(
            BIN,
            &[
                "run",
                "--model",
                model.to_str().unwrap(),
                "--messages-file",
                messages.to_str().unwrap(),
                "--think",
                think,
                "--temperature",
                "0",
                "--max-new",
                "12",
                "--show-ids",
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        let ids: Value = err
            .lines()
            .find(|l| l.starts_with("{\"prompt\""))
            .and_then(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no ids line: {err}"));
        let reference = py(&[
            "tools/ref/encode.py",
            "--model",
            repo().join("assets/models/qwen3_6-tiny").to_str().unwrap(),
            "--chat-user",
            USER,
            "--thinking",
            if think == "on" { "true" } else { "false" },
        ]);
        assert_eq!(ids["prompt"], reference["prompt"], "--think {think}");
        if think == "on" {
            // Twelve tokens do not close the block: all of them are reasoning, on stderr.
            assert_eq!(ids["generated"].as_array().unwrap().len(), 12, "{err}");
            assert_eq!(stdout.trim(), "", "--think on printed an answer: {err}");
        } else {
            assert!(
                !stdout.trim().is_empty(),
                "--think off printed nothing: {err}"
            );
        }
        prompts.push(ids["prompt"].clone());
    }
    assert_ne!(prompts[0], prompts[1]);
    // A raw prompt has no template to pass the switch to.
    run_refused(
        BIN,
        &[
            "run",
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "hi",
            "--think",
            "on",
        ],
        "--think needs a chat template",
    );
}
