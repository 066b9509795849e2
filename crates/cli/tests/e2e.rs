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

/// `mference ARGS` must fail as clap fails on a bad flag, before anything is read: exit status 2
/// (not the 1 of a failed command), with `msg` in its stderr.
fn usage_error(args: &[&str], msg: &str) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(msg), "{args:?}: expected {msg:?} in: {err}");
    err
}

#[test]
fn bad_flags_are_rejected_with_the_allowed_values() {
    // Each flag's own value is clap's to refuse (exit 2); a bad pair of flags is run's (exit 1).
    let cases: [(&[&str], &str); 7] = [
        (
            &["--max-new", "0"],
            "invalid --max-new '0': expected a whole number, at least 1",
        ),
        (
            &["--max-context", "0"],
            "invalid --max-context '0': expected a whole number, at least 1",
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
        usage_error(&args, msg);
    }
    refused(
        &[
            "run",
            "--model",
            "/nonexistent.gturbo",
            "--prompt",
            "x",
            "--temperature",
            "0.5",
            "--top-k",
            "0",
            "--top-p",
            "0.9",
        ],
        "requires --top-k between 1 and 256",
    );
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
        usage_error(
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

/// Numeric flags outside what they take exit 2 with clap's usage error, before anything is read,
/// as a value that is not a number does (`--threads 0` and `--max-new 0` used to exit 1, after
/// the argument parse); a 0 with a documented meaning (`--top-k 0` = off, `--router-lookahead 0`
/// = off, `--warmup 0`) still parses.
#[test]
fn numeric_flags_out_of_range_exit_2_and_documented_zeros_parse() {
    let m = "/nonexistent.gturbo";
    let cases: [(&[&str], &str); 17] = [
        (
            &["run", "--threads", "0"],
            "invalid --threads '0': at least 1 thread is needed",
        ),
        (&["run", "--threads", "1000000"], "more than 4x the"),
        (&["run", "--threads", "x"], "invalid --threads 'x'"),
        (&["run", "--max-new", "0"], "invalid --max-new '0'"),
        (
            &["run", "--top-k", "257"],
            "invalid --top-k '257': expected a whole number, from 0 to 256",
        ),
        (
            &["run", "--temperature", "-1"],
            "--temperature must be >= 0",
        ),
        (
            &["perplexity", "--file", "f", "--ctx", "3"],
            "invalid --ctx '3': expected a whole number, at least 4",
        ),
        (
            &["perplexity", "--file", "f", "--max-tokens", "0"],
            "invalid --max-tokens '0'",
        ),
        (
            &["logits", "--ids", "i", "--out", "o", "--max-context", "0"],
            "invalid --max-context '0'",
        ),
        (&["bench", "--gen", "0"], "invalid --gen '0'"),
        (&["bench", "--repeats", "0"], "invalid --repeats '0'"),
        (
            &["bench", "--max-context", "0"],
            "invalid --max-context '0'",
        ),
        (&["bench", "--threads", "0"], "invalid --threads '0'"),
        (
            &["serve", "--queue-limit", "0"],
            "invalid --queue-limit '0'",
        ),
        (
            &["serve", "--max-context", "5000"],
            "invalid --max-context 5000: allowed values are 4096",
        ),
        (
            &["serve", "--model-id", " "],
            "--model-id must not be empty",
        ),
        (&["serve", "--threads", "0"], "invalid --threads '0'"),
    ];
    for (args, msg) in cases {
        let (cmd, flags) = args.split_first().unwrap();
        let mut all = vec![*cmd, "--model", m];
        if *cmd == "run" {
            all.extend(["--prompt", "x"]);
        }
        all.extend_from_slice(flags);
        usage_error(&all, msg);
    }
    // These get past the parse and fail on the missing install (exit 1).
    for args in [
        &[
            "run", "--model", m, "--prompt", "x", "--top-k", "0", "--top-p", "1",
        ][..],
        &[
            "run",
            "--model",
            m,
            "--prompt",
            "x",
            "--router-lookahead",
            "0",
        ],
        &["run", "--model", m, "--prompt", " "],
        &["bench", "--model", m, "--warmup", "0"],
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(m), "{args:?}: {err}");
    }
}

/// Under an error clap's usage line is the one `--help` prints: it listed the flags given as if
/// they were required (`mference run --model <MODEL> --prompt <PROMPT> --max-new <MAX_NEW>` for a
/// missing --model); `run`'s names the one of --prompt, --messages-file and --chat it needs.
#[test]
fn usage_under_an_error_is_the_help_usage() {
    let cases: [(&str, &[&str]); 6] = [
        ("run", &["--prompt", "x", "--max-new", "3"]),
        ("perplexity", &["--ctx", "8"]),
        ("logits", &["--mode", "decode"]),
        ("serve", &["--port", "1"]),
        ("bench", &["--gen", "2"]),
        ("install", &["--dry-run"]),
    ];
    for (cmd, given) in cases {
        let help = String::from_utf8(run_ok(BIN, &[cmd, "--help"]).stdout).unwrap();
        let usage = help
            .lines()
            .find(|l| l.starts_with("Usage: "))
            .unwrap_or_else(|| panic!("{cmd} --help: {help}"));
        let mut args = vec![cmd];
        args.extend_from_slice(given);
        let err = usage_error(&args, "the following required arguments were not provided");
        assert!(
            err.lines().any(|l| l == usage),
            "{args:?}: {usage:?} not in {err}"
        );
    }
    let help = String::from_utf8(run_ok(BIN, &["run", "--help"]).stdout).unwrap();
    assert!(
        help.lines().any(|l| l
            == "Usage: mference run [OPTIONS] --model <MODEL> \
                <--prompt <PROMPT>|--messages-file <MESSAGES_FILE>|--chat>"),
        "{help}"
    );
    usage_error(
        &["run", "--model", "/nonexistent.gturbo"],
        "<--prompt <PROMPT>|--messages-file <MESSAGES_FILE>|--chat>",
    );
}

/// `--prompt ""` gives the model nothing to continue (Qwen 3.6 got 0 tokens and failed after the
/// load; Gemma 4 continued its BOS alone): clap refuses it, saying so.
#[test]
fn an_empty_prompt_is_refused() {
    usage_error(
        &["run", "--model", "/nonexistent.gturbo", "--prompt", ""],
        "invalid --prompt '': the prompt is empty; give the text to complete",
    );
    // An empty stop string would end every reply at its first token.
    usage_error(
        &[
            "run",
            "--model",
            "/nonexistent.gturbo",
            "--prompt",
            "a",
            "--stop",
            "",
        ],
        "invalid --stop '': a stop string must not be empty",
    );
}

/// `install` of a directory without config.json whose subdirectory has one (a fixture's
/// `A/` for `A/checkpoint/`) names that subdirectory.
#[test]
fn install_of_a_checkpoint_parent_names_the_checkpoint() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let parent = repo().join("assets/fixtures/deepseek_v4/A");
    let out = work.path().join("x.gturbo");
    let err = run_refused(
        BIN,
        &[
            "install",
            parent.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--dry-run",
        ],
        "config.json is missing in ",
    );
    let want = format!("did you mean {}?", parent.join("checkpoint").display());
    assert!(err.contains(&want), "expected {want:?} in: {err}");
    // A directory with no checkpoint below it gets no hint.
    let err = run_refused(
        BIN,
        &[
            "install",
            work.path().to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--dry-run",
        ],
        "config.json is missing",
    );
    assert!(!err.contains("did you mean"), "{err}");
}

/// A checkpoint whose config.json the runtime would refuse at load (here a head_dim of 0) is
/// refused before any weight is copied, naming the key, and nothing is left at --output (it
/// used to copy every byte and fail on its own manifest, with a --resume that could not finish).
#[test]
fn install_refuses_a_config_the_load_would_refuse_before_copying() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let from = repo().join("assets/fixtures/maple/A/checkpoint");
    for e in std::fs::read_dir(&from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    let cfg = src.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg).unwrap()).unwrap();
    v["head_dim"] = 0.into();
    std::fs::write(&cfg, serde_json::to_vec(&v).unwrap()).unwrap();
    let out = work.path().join("x.gturbo");
    let err = run_refused(
        BIN,
        &[
            "install",
            src.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
        ],
        "head_dim is 0",
    );
    assert!(err.contains("nothing was installed"), "{err}");
    let left: Vec<_> = std::fs::read_dir(work.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != "src")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
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
