//! `run --chat` through the binary on the demo install: a follow-up turn reuses the conversation
//! and answers as a cold run, slash commands, fitting the context (oldest turns dropped, a message
//! too long refused with the conversation kept), and invalid UTF-8 and Ctrl-C during a reply.

use std::process::Command;
use std::time::Duration;

use mference_testkit::{demo_install, run_ok, run_ok_with_stdin};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_mference");

/// `run --chat` on the demo install, greedy, with `input` typed in; it must exit 0.
fn chat_session(
    system: &str,
    max_new: usize,
    max_context: usize,
    input: &str,
) -> std::process::Output {
    chat_session_with(system, max_new, max_context, input, &[])
}

fn chat_session_with(
    system: &str,
    max_new: usize,
    max_context: usize,
    input: &str,
    extra: &[&str],
) -> std::process::Output {
    let mut args: Vec<String> = [
        "run",
        "--model",
        demo_install().to_str().unwrap(),
        "--chat",
        "--system",
        system,
        "--temperature",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend([
        "--max-new".into(),
        max_new.to_string(),
        "--max-context".into(),
        max_context.to_string(),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_ok_with_stdin(BIN, &args, input)
}

/// A follow-up turn of `run --chat` prefills only the new messages (the conversation so far is
/// still in the KV cache), and its reply equals a cold `run --messages-file` of the same
/// conversation: the same prompt ids and the same greedy ids.
#[test]
fn chat_reuses_the_conversation_and_answers_as_a_cold_run() {
    // 4 new tokens: one-line replies here, so stdout splits into them.
    let out = chat_session_with(
        "You are terse.",
        4,
        512,
        "Hello there.\nHow are you?\n/quit\n",
        &["--show-ids"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ids: Vec<serde_json::Value> = err
        .lines()
        .filter_map(|l| l.find("{\"prompt\"").map(|at| &l[at..]))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(ids.len(), 2, "{err}");
    let stats: Vec<&str> = err.lines().filter(|l| l.starts_with("[stop=")).collect();
    assert!(!stats[0].contains("cached="), "{err}");
    let cached: usize = stats[1]
        .split(" cached=")
        .nth(1)
        .and_then(|t| t.split("tok").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the second turn reused nothing: {err}"));
    // Everything the model held that the second prompt starts with (the first turn's prompt and
    // reply, up to where the template renders the history differently).
    let held: Vec<&serde_json::Value> = ids[0]["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .chain(ids[0]["generated"].as_array().unwrap())
        .collect();
    let shared = held
        .iter()
        .zip(ids[1]["prompt"].as_array().unwrap())
        .take_while(|(a, b)| **a == *b)
        .count();
    assert!(
        shared > 0 && cached == shared,
        "cached {cached}, shared {shared}: {err}"
    );
    // The cold run: the same conversation in a messages file.
    let replies: Vec<&str> = stdout.lines().collect();
    assert_eq!(replies.len(), 2, "a reply spans lines: {stdout:?}");
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let msgs = work.path().join("chat.json");
    std::fs::write(
        &msgs,
        json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": "How are you?"},
        ])
        .to_string(),
    )
    .unwrap();
    let cold = run_ok(
        BIN,
        &[
            "run",
            "--model",
            demo_install().to_str().unwrap(),
            "--messages-file",
            msgs.to_str().unwrap(),
            "--temperature",
            "0",
            "--max-new",
            "4",
            "--max-context",
            "512",
            "--show-ids",
        ],
    );
    let cold_err = String::from_utf8_lossy(&cold.stderr);
    let cold_ids: serde_json::Value = cold_err
        .lines()
        .find_map(|l| l.find("{\"prompt\"").map(|at| &l[at..]))
        .map(|l| serde_json::from_str(l).unwrap())
        .unwrap();
    assert_eq!(cold_ids, ids[1], "chat turn 2 vs cold run");
}

#[test]
fn interactive_chat_answers_and_handles_slash_commands() {
    let out = chat_session(
        "You are terse.",
        8,
        256,
        "Hello there.\n/history\n/clear\n/history\nHow are you?\n/quit\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.trim().lines().count() >= 1 && !stdout.trim().is_empty(),
        "no reply: {stdout:?}"
    );
    assert!(
        err.contains("system: You are terse.") && err.contains("user: Hello there."),
        "/history: {err}"
    );
    assert!(err.contains("[conversation cleared]"), "{err}");
    assert_eq!(
        err.matches("[stop=").count(),
        2,
        "two replies expected: {err}"
    );
}

#[test]
fn chat_drops_the_oldest_turns_to_fit_but_keeps_system_and_newest_user() {
    let turns = "Tell me about the sea and the ships upon it.\nTell me about the hills and the sheep.\nWhat of the town?\n/history\n/quit\n";
    let out = chat_session("Be brief.", 6, 64, turns);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("[dropped the oldest message"),
        "nothing was dropped: {err}"
    );
    let history = &err[err.rfind("system: Be brief.").expect("system message kept")..];
    assert!(
        history.contains("user: What of the town?"),
        "newest user message lost: {history}"
    );
    assert!(
        !history.contains("the sea and the ships"),
        "oldest turn kept: {history}"
    );
}

/// A chat command with other words after it (`/think maybe`, `/clear now`, `/quit now`) is
/// named as a mistyped command and sent nowhere (it used to go to the model as a message).
#[test]
fn chat_names_a_command_with_extra_words_and_sends_nothing() {
    let out = chat_session(
        "Be brief.",
        4,
        512,
        "/think maybe\n/clear now\n/quit now\n/history\n/quit\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    for cmd in ["/think maybe", "/clear now", "/quit now"] {
        assert!(
            err.contains(&format!("[{cmd} is not a command")),
            "{cmd}: {err}"
        );
    }
    assert!(
        !err.contains("user: "),
        "a command went to the model: {err}"
    );
    assert!(
        out.stdout.is_empty(),
        "a reply was written: {:?}",
        out.stdout
    );
}

/// A message that does not fit `--max-context` even alone is refused and leaves the conversation
/// as it was: the turns dropped while trying to fit it come back.
#[test]
fn chat_keeps_the_conversation_when_a_message_is_refused() {
    let long = "the sea and the ships upon it ".repeat(40);
    let turns = format!("Hello there.\n{long}\n/history\n/quit\n");
    let out = chat_session("Be brief.", 4, 96, &turns);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("even alone"), "not refused: {err}");
    assert!(
        !err.contains("[dropped the oldest message"),
        "a drop was reported for a refused message: {err}"
    );
    let history = &err[err.rfind("system: Be brief.").expect("system message kept")..];
    assert!(
        history.contains("user: Hello there."),
        "the earlier turn was lost: {history}"
    );
    assert!(
        history.contains("assistant: "),
        "the reply was lost: {history}"
    );
}

/// `run --chat` stays up through bad input: a line of invalid UTF-8 is refused and the session
/// goes on; Ctrl-C (SIGINT) during a reply stops that reply and returns to the prompt, where the
/// conversation (with the cut reply) is still there.
#[test]
fn chat_survives_invalid_utf8_and_ctrl_c_during_a_reply() {
    use std::io::{Read, Write};
    use std::process::Stdio;
    use std::sync::{Arc, Mutex};
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--model",
            demo_install().to_str().unwrap(),
            "--chat",
            "--temperature",
            "0",
            "--max-new",
            "3000",
            "--max-context",
            "4096",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // Greedy on this line runs for thousands of tokens without an end of turn.
    stdin
        .write_all(b"\xff\xfe\nIt is a truth universally acknowledged, that\n")
        .unwrap();
    stdin.flush().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut stdout = child.stdout.take().unwrap();
    let sink = Arc::clone(&seen);
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let t0 = std::time::Instant::now();
    while seen.lock().unwrap().len() < 16 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no reply began");
        std::thread::sleep(Duration::from_millis(50));
    }
    let st = Command::new("kill")
        .args(["-s", "INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    stdin.write_all(b"/history\n/quit\n").unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    reader.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(err.contains("not valid UTF-8"), "{err}");
    assert!(err.contains("[stop=interrupted"), "{err}");
    assert!(
        err.contains("user: It is a truth universally acknowledged, that")
            && err.contains("assistant: "),
        "/history after the interrupt: {err}"
    );
}
