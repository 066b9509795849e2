//! End to end through the binary: `mference install` the bundled demo model, then `run --prompt`
//! and `run --messages-file` greedy for 32 tokens must produce exactly mlx-lm's token ids (float32
//! reference) for the same prompt and chat render, and its text; bad flags, perplexity against
//! mlx-lm, and install / inspect / verify. `run --chat` is in chat.rs, `serve` in serve.rs; all
//! share one demo install made by the same installer (`mference_testkit`).

use std::process::Command;

use mference_testkit::{
    assert_perplexity_near, demo_install, demo_source, mlx_greedy, output_ok, perplexity, python,
    reference_chat_prompt, reference_text_prompt, repo, run_ok, run_refused,
};

const BIN: &str = env!("CARGO_BIN_EXE_mference");

/// `mference ARGS`, which must succeed.
fn mference(args: &[&str]) -> std::process::Output {
    run_ok(BIN, args)
}

fn ours(out: &std::process::Output) -> (serde_json::Value, Vec<u32>, String) {
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("{\""))
        .expect("--show-ids line");
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let ids = v["generated"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    (
        v["prompt"].clone(),
        ids,
        String::from_utf8(out.stdout.clone()).unwrap(),
    )
}

fn decode(ids: &[u32]) -> String {
    let tok = repo().join("assets/tokenizers/gemma4/tokenizer.json");
    let code = format!("import json,sys; from tokenizers import Tokenizer; t=Tokenizer.from_file({:?}); print(json.dumps(t.decode(json.loads(sys.argv[1]), skip_special_tokens=True)))", tok.to_str().unwrap());
    let out =
        output_ok(Command::new(python()).args(["-c", &code, &serde_json::to_string(ids).unwrap()]));
    serde_json::from_slice::<String>(&out.stdout).unwrap()
}

#[test]
fn demo_prompt_and_messages_match_mlx_lm_token_for_token() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = demo_source();
    let inst = work.path().join("demo.gturbo");
    mference(&[
        "install",
        src.to_str().unwrap(),
        "--output",
        inst.to_str().unwrap(),
        "--quiet",
    ]);
    let m = inst.to_str().unwrap();

    // Raw completion: BOS + text, no chat framing.
    let text = "It is a truth universally acknowledged, that";
    let want_prompt = reference_text_prompt(text);
    let out = mference(&[
        "run",
        "--model",
        m,
        "--prompt",
        text,
        "--temperature",
        "0",
        "--max-new",
        "32",
        "--show-ids",
    ]);
    let (prompt, ids, stdout) = ours(&out);
    assert_eq!(prompt, want_prompt, "raw prompt tokenization differs");
    let want = mlx_greedy(&want_prompt, 32, work.path());
    assert_eq!(ids, want, "raw prompt: greedy ids differ from mlx-lm");
    assert_eq!(
        stdout.trim_end_matches('\n'),
        decode(&want),
        "raw prompt: text differs"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("[stop=maxNew prefill="),
        "footer missing"
    );

    // Chat: one user message through the template (thinking off, as the CLI renders it).
    let user = "Tell me about the weather in London.";
    let want_prompt = reference_chat_prompt(user);
    let mf = work.path().join("messages.json");
    std::fs::write(
        &mf,
        serde_json::json!([{"role": "user", "content": user}]).to_string(),
    )
    .unwrap();
    let out = mference(&[
        "run",
        "--model",
        m,
        "--messages-file",
        mf.to_str().unwrap(),
        "--temperature",
        "0",
        "--max-new",
        "32",
        "--show-ids",
    ]);
    let (prompt, ids, stdout) = ours(&out);
    assert_eq!(
        prompt, want_prompt,
        "chat render/tokenization differs from the transformers template render"
    );
    let want = mlx_greedy(&want_prompt, 32, work.path());
    assert_eq!(ids, want, "messages: greedy ids differ from mlx-lm");
    assert_eq!(
        stdout.trim_end_matches('\n'),
        decode(&want),
        "messages: text differs"
    );
}

/// `mference ARGS` must fail with `msg` in its stderr.
fn refused(args: &[&str], msg: &str) {
    run_refused(BIN, args, msg);
}

#[test]
fn bad_flags_are_rejected_with_the_allowed_values() {
    let cases: [(&[&str], &str); 8] = [
        (&["--max-new", "0"], "--max-new must be positive (got 0)"),
        (
            &["--max-context", "0"],
            "--max-context must be positive (got 0)",
        ),
        (
            &["--temperature", "0.5", "--top-k", "0", "--top-p", "0.9"],
            "requires --top-k between 1 and 256",
        ),
        (
            &["--expert-cache-slots", "7"],
            "allowed values are 8, 16, 24, 32, 64, 96, 128, resident, auto",
        ),
        (
            &["--prefill-chunk", "100"],
            "allowed values are 32, 64, 128",
        ),
        (&["--top-p", "0"], "--top-p must be in (0, 1]"),
        (&["--chat"], "cannot be used with"),
        (
            &["--seed", "-1"],
            "invalid --seed '-1': the seed must be an integer from 0 to 18446744073709551615",
        ),
    ];
    for (flags, msg) in cases {
        let mut args = vec!["run", "--model", "/nonexistent.gturbo", "--prompt", "x"];
        args.extend_from_slice(flags);
        refused(&args, msg);
    }
    // Contexts beyond the model's positions are refused before anything is allocated
    // (perplexity used to size its logits by --ctx: tens of GB); serve's default is clamped.
    let (model, text) = (
        demo_install().to_str().unwrap(),
        repo().join("assets/austen_pride_and_prejudice.txt"),
    );
    let over = "exceeds the model's max_position_embeddings 4096";
    refused(
        &[
            "perplexity",
            "--model",
            model,
            "--file",
            text.to_str().unwrap(),
            "--ctx",
            "100000",
        ],
        over,
    );
    refused(&["serve", "--model", model, "--max-context", "8192"], over);

    // Rough edges a new user hit (issue 16 item 8).
    let file = text.to_str().unwrap();
    for bad in ["nan", "inf"] {
        refused(
            &[
                "run",
                "--model",
                model,
                "--prompt",
                "x",
                "--repetition-penalty",
                bad,
            ],
            "--repetition-penalty must be a finite number > 0",
        );
    }
    let cases: [(&[&str], &str); 6] = [
        (
            &["bench", "--model", model, "--slots", "12"],
            "allowed values are 8, 16, 24, 32, 64, 96, 128, resident, auto",
        ),
        (
            &["serve", "--model", model, "--model-id", ""],
            "--model-id must not be empty",
        ),
        (
            &["serve", "--model", "/nonexistent.gturbo"],
            "is not an mference install",
        ),
        (
            &["serve", "--model", model, "--prefill-chunk", "100"],
            "allowed values are 32, 64, 128, 256, 512, 1024, 2048, 4096, auto",
        ),
        (
            &[
                "perplexity",
                "--model",
                model,
                "--file",
                file,
                "--max-tokens",
                "100",
            ],
            "--max-tokens 100 is less than one --ctx 512 chunk",
        ),
        (
            &["serve", "--model", model, "--expert-cache-slots", "7"],
            "resident, auto",
        ),
    ];
    for (args, msg) in cases {
        refused(args, msg);
    }
}

/// `install --resume` where nothing was saved says so and installs from the start (a mistyped
/// `--output` used to start over without a word).
#[test]
fn install_resume_with_nothing_saved_says_it_starts_anew() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = work.path().join("fresh.gturbo");
    let o = output_ok(
        Command::new(BIN)
            .args(["install", demo_source().to_str().unwrap(), "--output"])
            .arg(&out)
            .arg("--resume"),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--resume: no saved partial install of")
            && err.contains("starting a new install"),
        "{err}"
    );
    assert!(out.join("manifest.json").is_file(), "{err}");
}

/// `mference perplexity` on the demo model: llama-perplexity's protocol on the first 8,192 tokens of
/// the eval text at context 512, within 0.3% of mlx-lm's value (committed with its command in
/// tools/ref/reference-values.json).
#[test]
fn demo_perplexity_is_within_0_3_percent_of_mlx_lm() {
    let (got, err) = perplexity(BIN, demo_install(), &[]);
    assert_perplexity_near("gemma4-tiny", got, 0.003);
    // The load line names the device and its kernel table before the first chunk is scored.
    let load = err.find("[loaded ").expect("no load line");
    let first = err.find("[chunk 1/").expect("no chunk line");
    assert!(load < first, "{err}");
    assert!(
        err[load..].starts_with("[loaded ") && err[load..first].contains("device cpu"),
        "{err}"
    );
}

/// One install has one size: `install`, `inspect` and `verify` report the bytes of the files the
/// manifest lists, and no lock file stays next to the finished install.
#[test]
fn install_inspect_and_verify_report_the_same_size() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = work.path().join("size.gturbo");
    let src = repo().join("assets/models/gemma4-tiny");
    let o = run_ok(
        BIN,
        &[
            "install",
            src.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ],
    );
    let bytes_in = |text: &str, after: &str| -> u64 {
        let at = text
            .find(after)
            .unwrap_or_else(|| panic!("no {after:?} in {text}"))
            + after.len();
        text[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap()
    };
    let installed = bytes_in(&String::from_utf8_lossy(&o.stdout), " (");
    let o = run_ok(BIN, &["inspect", out.to_str().unwrap()]);
    let inspected = bytes_in(&String::from_utf8_lossy(&o.stdout), "sizes:   ");
    let o = run_ok(BIN, &["verify", out.to_str().unwrap()]);
    let verified = bytes_in(&String::from_utf8_lossy(&o.stdout), "files it lists (");
    assert_eq!((installed, inspected), (verified, verified));
    let names: Vec<String> = std::fs::read_dir(work.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["size.gturbo"]);
}
