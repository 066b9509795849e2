//! End to end through the binary: `mference install` the bundled demo model, then `run --prompt`
//! and `run --messages-file` greedy for 32 tokens must produce exactly mlx-lm's token ids (float32
//! reference) for the same prompt and chat render, and its text. The other scenarios (chat,
//! perplexity, `serve` shutdown) share one demo install made by the same installer
//! (`mference_testkit`).

use std::process::Command;
use std::time::Duration;

use mference_testkit::http::{open_stream, post};
use mference_testkit::{
    assert_perplexity_near, demo_install, demo_source, mlx_greedy, output_ok, perplexity, python,
    reference_chat_prompt, reference_text_prompt, repo, run_ok, run_ok_with_stdin, run_refused,
    ServeProcess,
};
use serde_json::json;

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

/// `mference serve` on the demo model gets SIGTERM (then, in a second run, SIGINT) while a stream
/// is generating and a JSON request waits behind it: the stream ends with the in-band
/// `server_shutting_down` error and `data: [DONE]` (not a cut connection), the JSON request gets a
/// 503 OpenAI error object, and the process exits 0 with its port closed.
#[test]
fn serve_shuts_down_gracefully_on_sigterm_and_sigint() {
    let model = demo_install().to_str().unwrap();
    for signal in ["TERM", "INT"] {
        let mut srv = ServeProcess::start(
            BIN,
            &[
                "--model",
                model,
                "--model-id",
                "demo",
                "--max-context",
                "4096",
                "--prefill-chunk",
                "auto",
            ],
            Duration::from_secs(120),
        );
        let a = srv.addr();
        // Greedy on this prompt runs past 3,000 tokens without a stop token (thousands of tokens
        // after the first chunk, when the signal goes out).
        let long = |stream: bool| json!({"model": "demo", "prompt": "It is a truth universally acknowledged, that", "max_tokens": 4000, "temperature": 0, "stream": stream});
        let mut stream = open_stream(a, "/v1/completions", &long(true));
        assert_eq!(stream.status, 200, "{}", srv.log());
        stream.next_data().expect("a first chunk");
        let waiting = std::thread::spawn(move || post(a, "/v1/completions", &long(false)));
        // The JSON request has no head to wait for; give it time to reach the queue.
        std::thread::sleep(Duration::from_secs(1));

        srv.signal(signal);

        let st = stream.finish();
        let err = st.final_error();
        assert_eq!(
            err["code"], "server_shutting_down",
            "SIG{signal}: {}",
            st.raw
        );
        assert!(
            err["message"]
                .as_str()
                .is_some_and(|m| m.contains("shutting down")),
            "{err}"
        );
        assert_eq!(
            st.finish_reasons(),
            [] as [serde_json::Value; 0],
            "SIG{signal}: the stream finished before the signal: {}",
            st.raw
        );
        let (status, body) = waiting.join().unwrap();
        assert_eq!(status, 503, "SIG{signal}: {body}");
        assert_eq!(body["error"]["code"], "server_shutting_down", "{body}");
        assert_eq!(body["error"]["type"], "server_error", "{body}");

        let exit = srv.wait_exit(Duration::from_secs(60));
        let log = srv.log();
        assert!(
            exit.is_some_and(|e| e.success()),
            "SIG{signal}: exit {exit:?}:\n{log}"
        );
        assert!(
            log.contains(&format!("received SIG{signal}"))
                && log.contains("MferenceServer stopped"),
            "{log}"
        );
        assert!(
            std::net::TcpStream::connect(a).is_err(),
            "SIG{signal}: port still open"
        );
    }
}

/// `serve 2>&1 | head -3`: once nothing reads its stderr, the server still answers generation
/// requests (each logs a line it can no longer write) and still stops on SIGTERM; it used to drop
/// every request's connection (a panic printing the log line) while `/health` said ok, and to
/// ignore the signal. Likewise `run ... | head -c N` ends quietly.
#[test]
fn serve_and_run_survive_a_closed_output_pipe() {
    use std::io::{BufRead, BufReader};
    let model = demo_install().to_str().unwrap();
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--model",
            model,
            "--model-id",
            "demo",
            "--port",
            "0",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr: std::net::SocketAddr = loop {
        let line = lines
            .next()
            .expect("serve ended before its ready line")
            .unwrap();
        if let Some(rest) = line.strip_prefix("MferenceServer ready on http://") {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    drop(lines); // the reader goes away, as `head` does
    let body =
        json!({"model": "demo", "prompt": "It is a truth", "max_tokens": 3, "temperature": 0});
    for _ in 0..2 {
        let (status, v) = post(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        assert!(v["choices"][0]["text"].is_string(), "{v}");
    }
    let (status, _) = post(
        addr,
        "/v1/completions",
        &json!({"model": "nope", "prompt": "x"}),
    );
    assert_eq!(status, 404);
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(e) = child.try_wait().unwrap() {
            break Some(e);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        exit.is_some(),
        "serve ignored SIGTERM once its stderr was closed"
    );

    // `run` whose reader stops after a few bytes: no panic, no exit 101.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{BIN}' run --model '{model}' --prompt 'The king said' --max-new 30 --temperature 0.9 \
             --seed 99 --quiet | head -c 10 >/dev/null"
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
}

/// `serve` checks what a load can check before it says it is ready: a port in use fails before
/// the model loads, and a damaged expert file fails the start (it used to print the ready line,
/// answer `/health` ok and then fail every request).
#[test]
fn serve_refuses_a_busy_port_and_a_damaged_layer_file_before_its_ready_line() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let model = demo_install().to_str().unwrap();
    let t0 = std::time::Instant::now();
    refused(
        &["serve", "--model", model, "--port", &port],
        "cannot listen on",
    );
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "the busy port was found only after {:?}",
        t0.elapsed()
    );
    drop(busy);

    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let copy = work.path().join("damaged.gturbo");
    let ok = Command::new("cp")
        .args(["-r", model, copy.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(ok.success());
    let layer = copy.join("packed_experts/layer_03.bin");
    let mut bytes = std::fs::read(&layer).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(&layer, bytes).unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--model", copy.to_str().unwrap(), "--port", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("ready on"), "{err}");
    assert!(
        err.contains("layer_03.bin") && err.contains("SHA-256"),
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
