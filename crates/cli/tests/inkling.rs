//! `run`, `serve` and `bench` on Inkling: the golden fixture A with the real tokenizer's vocabulary
//! (`mference_testkit::inkling_text_install`, random weights, so the text is gibberish) through the
//! `mference` binary. They must run end to end with the Inkling chat format: prompts rendered by
//! the family's template, generation until `--max-new` (the fixture never produces the stop token).

use std::time::Duration;

use mference_testkit::http::post;
use mference_testkit::{inkling_text_install, run_ok, ServeProcess};
use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_mference");

#[test]
fn inkling_run_chat_and_completion() {
    let inst = inkling_text_install().to_str().unwrap();
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let messages = work.path().join("messages.json");
    std::fs::write(
        &messages,
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
            .to_string(),
    )
    .unwrap();
    for args in [
        vec!["--prompt", "It is a truth universally acknowledged, that"],
        vec!["--messages-file", messages.to_str().unwrap()],
    ] {
        let mut all = vec![
            "run",
            "--model",
            inst,
            "--max-new",
            "8",
            "--temperature",
            "0",
            "--threads",
            "1",
            "--slots",
            "8",
        ];
        all.extend(args);
        let out = run_ok(BIN, &all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.stdout.is_empty(), "no text from {all:?}: {err}");
    }
}

#[test]
fn inkling_serve_answers_chat_and_completion_requests() {
    let inst = inkling_text_install().to_str().unwrap();
    let srv = ServeProcess::start(
        BIN,
        &[
            "--model",
            inst,
            "--model-id",
            "inkling",
            "--threads",
            "1",
            "--max-context",
            "4096",
        ],
        Duration::from_secs(120),
    );
    let chat = json!({"model": "inkling", "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 6, "temperature": 0});
    let (s, r) = post(srv.addr(), "/v1/chat/completions", &chat);
    assert_eq!(s, 200, "{r}\n{}", srv.log());
    assert_eq!(r["usage"]["completion_tokens"], 6, "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "length", "{r}");
    // "<|message_system|><|content_text|>Thinking effort level: 0<|end_message|>" (9 tokens),
    // "<|message_user|><|content_text|>Hello<|end_message|>" (4) and "<|message_model|>" (1).
    assert_eq!(r["usage"]["prompt_tokens"], 14, "{r}");
    let done = json!({"model": "inkling", "prompt": "Once upon a time", "max_tokens": 5,
        "temperature": 0});
    let (s, r) = post(srv.addr(), "/v1/completions", &done);
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 5, "{r}");
}

#[test]
fn inkling_bench_reports_json() {
    let inst = inkling_text_install().to_str().unwrap();
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let json_path = work.path().join("bench.json");
    run_ok(
        BIN,
        &[
            "bench",
            "--model",
            inst,
            "--prompts",
            "short,40",
            "--gen",
            "4",
            "--repeats",
            "1",
            "--slots",
            "8",
            "--threads",
            "1",
            "--max-context",
            "256",
            "--json",
            json_path.to_str().unwrap(),
        ],
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{doc}");
    for r in runs {
        assert_eq!(r["gen_tokens"], 4, "{r}");
        let t = r["decode_tok_s"].as_f64().unwrap();
        assert!(t > 0.0 && t.is_finite(), "{r}");
    }
}

/// Inkling's limit is `text_config.model_max_length` (it has no max_position_embeddings): a
/// larger `--max-context` is refused before anything is allocated (it used to allocate 16.8 GB
/// for 3 tokens), and the int8 prefill (`avx512vnni`), unchecked for this family, is refused.
#[test]
fn inkling_refuses_a_context_beyond_its_limit_and_the_int8_prefill() {
    let inst = inkling_text_install().to_str().unwrap();
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let ids = work.path().join("ids.json");
    std::fs::write(&ids, "[1, 2, 3]").unwrap();
    let out = work.path().join("o.npy");
    let base = [
        "logits",
        "--model",
        inst,
        "--ids",
        ids.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    let mut args = base.to_vec();
    args.extend(["--max-context", "16777216"]);
    mference_testkit::run_refused(
        BIN,
        &args,
        "exceeds the model's max_position_embeddings 1048576",
    );
    // Where this CPU has VNNI the family refuses it; elsewhere the table itself is unavailable.
    let mut args = base.to_vec();
    args.extend(["--kernels", "avx512vnni"]);
    let o = std::process::Command::new(BIN)
        .args(&args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("is for Gemma 4 and Qwen 3.6 only") || err.contains("this CPU runs"),
        "{err}"
    );
    // A rounded table from MFERENCE_KERNELS (read by `auto`, every x86-64 CPU with AVX2 runs
    // avx2i16): the advice is an explicit exact table or unsetting the variable, not `auto`.
    let o = std::process::Command::new(BIN)
        .args(base)
        .env("MFERENCE_KERNELS", "avx2i16")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("MFERENCE_KERNELS=avx2i16 (rounded activations)")
            && err.contains("or unset MFERENCE_KERNELS")
            && !err.contains("(or auto)"),
        "{err}"
    );
    assert!(!out.exists());
}
