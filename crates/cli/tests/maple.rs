//! Maple through the binary: `mference install` of a fixture checkpoint
//! (`assets/fixtures/maple/{A,B}`) combined with the Maple tokenizer and template
//! (`assets/tokenizers/maple`), then `run`, `bench` and `serve` on it, with and without
//! `--flash-head`. The fixtures' vocabulary is 1,024 ids: with the full tokenizer (151,669 ids) the
//! install is refused naming both sizes; with the tokenizer cut to the fixture's 1,024 ids (no
//! added tokens, the merges among those ids) it installs, and its text is gibberish.

use std::path::Path;
use std::time::Duration;

use mference_testkit::http::post;
use mference_testkit::{repo, run_ok, run_refused, ServeProcess};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_mference");

/// Fixture `case`'s checkpoint plus the tokenizer files, installed at `<work>/maple.gturbo`.
fn install(work: &Path, case: &str) -> String {
    let src = work.join("src");
    std::fs::create_dir(&src).unwrap();
    let ck = repo()
        .join("assets/fixtures/maple")
        .join(case)
        .join("checkpoint");
    for f in std::fs::read_dir(&ck).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, src.join(f.file_name().unwrap())).unwrap();
    }
    let tok = repo().join("assets/tokenizers/maple");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(tok.join(f), src.join(f)).unwrap();
    }
    let out = work.join("maple.gturbo");
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    run_refused(
        BIN,
        &["install", s, "--output", o, "--quiet"],
        "tokenizer.json has 151669 token ids but the model's vocabulary (config.json vocab_size, \
         the embedding rows) is 1024",
    );
    std::fs::write(
        src.join("tokenizer.json"),
        cut_tokenizer(&tok.join("tokenizer.json"), 1024),
    )
    .unwrap();
    run_ok(BIN, &["install", s, "--output", o, "--quiet"]);
    o.to_string()
}

/// The BPE `tokenizer.json` at `path` cut to its first `ids` ids: the vocabulary entries below
/// `ids`, the merges whose two pieces and result are among them, no added tokens.
fn cut_tokenizer(path: &Path, ids: u64) -> Vec<u8> {
    let mut t: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> = t["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, id)| id.as_u64().unwrap() < ids)
        .map(|(k, id)| (k.clone(), id.clone()))
        .collect();
    let merges: Vec<serde_json::Value> = t["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| {
            let (a, b) = (m[0].as_str().unwrap(), m[1].as_str().unwrap());
            [a.to_string(), b.to_string(), format!("{a}{b}")]
                .iter()
                .all(|p| vocab.contains_key(p))
        })
        .cloned()
        .collect();
    t["model"]["vocab"] = vocab.into();
    t["model"]["merges"] = merges.into();
    t["added_tokens"] = json!([]);
    serde_json::to_vec(&t).unwrap()
}

/// `args` then `extra`, as a `run_ok` argument list.
fn with<'a>(args: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    args.iter().chain(extra).copied().collect()
}

fn check_case(case: &str, extra: &[&str]) {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = install(work.path(), case);
    let m = model.as_str();

    // run: a raw prompt generates; so does a chat (its ChatML markers are plain text here).
    let run = ["run", "--model", m, "--prompt", "a b c d", "--max-new", "8"];
    let out = run_ok(BIN, &with(&run, extra));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("new=8tok"), "{err}");
    let msgs = work.path().join("msgs.json");
    std::fs::write(&msgs, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    let chat = [
        "run",
        "--model",
        m,
        "--messages-file",
        msgs.to_str().unwrap(),
        "--max-new",
        "4",
    ];
    run_ok(BIN, &with(&chat, extra));

    // bench: finite results for two prompt lengths.
    let json_out = work.path().join("bench.json");
    let bench = [
        "bench",
        "--model",
        m,
        "--prompts",
        "64,200",
        "--gen",
        "8",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--max-context",
        "512",
        "--json",
        json_out.to_str().unwrap(),
    ];
    run_ok(BIN, &with(&bench, extra));
    let b: serde_json::Value = serde_json::from_slice(&std::fs::read(&json_out).unwrap()).unwrap();
    let summary = b["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 2);
    assert!(summary.iter().all(|s| s["finite"] == true), "{b}");
    assert_eq!(b["settings"]["flash_head"], !extra.is_empty(), "{b}");

    // serve: completions and chats generate.
    let serve = ["--model", m, "--model-id", "maple", "--max-context", "4096"];
    let srv = ServeProcess::start(BIN, &with(&serve, extra), Duration::from_secs(60));
    let (status, body) = post(
        srv.addr(),
        "/v1/completions",
        &json!({"model": "maple", "prompt": "a b c d", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}\n{}", srv.log());
    assert_eq!(body["usage"]["completion_tokens"], 8, "{body}");
    let (status, body) = post(
        srv.addr(),
        "/v1/chat/completions",
        &json!({"model": "maple", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{body}\n{}", srv.log());
}

#[test]
fn maple_fixture_with_its_tokenizer_runs_benches_and_serves() {
    check_case("A", &[]);
}

/// The same with `--flash-head` on every command (fixture B carries the FlashHead tensors).
#[test]
fn maple_flash_head_runs_benches_and_serves() {
    check_case("B", &["--flash-head"]);
}

/// A flag Maple does not take is refused before a bench starts a run, naming the families that
/// take it (and nothing of DeepSeek-V4's own prefetch).
#[test]
fn maple_bench_refuses_the_router_lookahead_up_front() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = install(work.path(), "A");
    let out = std::process::Command::new(BIN)
        .args([
            "bench",
            "--model",
            &model,
            "--prompts",
            "16",
            "--router-lookahead",
            "2",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "accepted:\n{err}");
    assert!(
        err.contains("--router-lookahead is a Gemma 4 / Qwen 3.6 option; this install is maple")
            && !err.contains("DeepSeek-V4")
            && !err.contains("[bench]"),
        "{err}"
    );
}
