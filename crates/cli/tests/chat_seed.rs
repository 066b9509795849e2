//! Reproducible sampling in `run --chat`: with a seed and a temperature above zero, the reply to a
//! second turn (its conversation prefix held by the session from the first turn, only the new
//! message prefilled) is the reply a fresh `run --messages-file` of the same conversation samples
//! cold. It holds because a prompt row's logits do not depend on the chunk they were computed in
//! (`crates/kernels`, "batch invariance"; the server's twin is `crates/server/tests/seeded.rs`).

use mference_testkit::{demo_install, run_ok, run_ok_with_stdin};

const BIN: &str = env!("CARGO_BIN_EXE_mference");
const FIRST: &str = "Who lives at Netherfield Park?";
const SECOND: &str = "And what of Mr. Darcy?";

fn stdout(o: std::process::Output) -> String {
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn a_seeded_second_chat_turn_equals_a_cold_run_of_the_conversation() {
    let model = demo_install().to_str().unwrap();
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut seconds = Vec::new();
    for seed in ["5", "6"] {
        let args = [
            "run",
            "--model",
            model,
            "--seed",
            seed,
            "--temperature",
            "1.5",
            "--max-new",
            "24",
        ];
        let chat = |input: &str| {
            stdout(run_ok_with_stdin(
                BIN,
                &[&args[..], &["--chat"]].concat(),
                input,
            ))
        };
        let one = chat(&format!("{FIRST}\n"));
        let two = chat(&format!("{FIRST}\n{SECOND}\n"));
        let first = one.trim_end_matches('\n');
        let second = two
            .strip_prefix(first)
            .unwrap_or_else(|| {
                panic!("seed {seed}: the first reply differs between two chats:\n{one}\n{two}")
            })
            .trim_matches('\n');
        let messages = work.path().join(format!("chat-{seed}.json"));
        let conversation = serde_json::json!([
            {"role": "user", "content": FIRST},
            {"role": "assistant", "content": first},
            {"role": "user", "content": SECOND},
        ]);
        std::fs::write(&messages, conversation.to_string()).unwrap();
        let file = ["--messages-file", messages.to_str().unwrap()];
        let cold = stdout(run_ok(BIN, &[&args[..], &file[..]].concat()));
        assert_eq!(
            cold.trim_matches('\n'),
            second,
            "seed {seed}: the chat's second reply differs from a cold run of the same conversation"
        );
        assert!(!second.is_empty(), "seed {seed}: empty second reply");
        seconds.push(second.to_string());
    }
    assert_ne!(
        seconds[0], seconds[1],
        "the seed does not change the sample"
    );
}
