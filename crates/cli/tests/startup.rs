//! What `run` and `serve` do before the first token (issue 32): the tokenizer cache inside the
//! install, the port checked before anything is read, the expert-cache slots clamped to the
//! model's experts, `--quiet` silencing every note, and `--messages-file` taking the messages
//! `serve` takes.

use std::path::Path;
use std::process::Output;

use mference_testkit::{copy_install, demo_install, run_ok, run_refused};

const BIN: &str = env!("CARGO_BIN_EXE_mference");

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The prompt and generated ids of a greedy `run` (its `--show-ids` line).
fn ids(out: &Output) -> serde_json::Value {
    let err = stderr(out);
    let line = err
        .lines()
        .find(|l| l.starts_with("{\""))
        .unwrap_or_else(|| panic!("no --show-ids line in {err}"));
    serde_json::from_str(line).unwrap()
}

/// `mference run --model <the demo install>` with `args` after them.
fn run_demo(args: &[&str]) -> Output {
    let model = demo_install().to_str().unwrap();
    let mut all = vec!["run", "--model", model];
    all.extend_from_slice(args);
    run_ok(BIN, &all)
}

/// A copy of the demo install under `work` (so its cache starts absent).
fn copy_demo(work: &Path) -> String {
    let copy = copy_install(demo_install(), work, "demo.gturbo");
    let _ = std::fs::remove_dir_all(copy.join("cache"));
    copy.to_str().unwrap().to_string()
}

/// The first `run` parses tokenizer.json and writes `cache/tokenizer.bin`; later runs use it and
/// give the same ids; a damaged cache is named, rebuilt and not used.
#[test]
fn run_writes_the_tokenizer_cache_and_rebuilds_a_damaged_one() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = copy_demo(work.path());
    let cache = Path::new(&model).join("cache/tokenizer.bin");
    let args = [
        "run",
        "--model",
        &model,
        "--prompt",
        "It is a truth universally acknowledged, that",
        "--max-new",
        "8",
        "--temperature",
        "0",
        "--show-ids",
    ];
    let first = run_ok(BIN, &args);
    assert!(cache.is_file(), "no cache after the first run");
    let second = run_ok(BIN, &args);
    assert!(
        !stderr(&second).contains("tokenizer cache"),
        "{}",
        stderr(&second)
    );
    assert_eq!(ids(&first), ids(&second));
    assert_eq!(first.stdout, second.stdout);

    let mut bytes = std::fs::read(&cache).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&cache, &bytes).unwrap();
    let third = run_ok(BIN, &args);
    let err = stderr(&third);
    assert!(
        err.contains("tokenizer cache damaged") && err.contains("rebuilt"),
        "{err}"
    );
    assert_eq!(ids(&first), ids(&third));
    assert_ne!(
        std::fs::read(&cache).unwrap(),
        bytes,
        "the damaged cache stayed"
    );
}

/// `run` binds the tokenizer cache to the manifest's digest of tokenizer.json instead of hashing
/// the file again, because the install's own check (beside the load) holds the file to that
/// digest: a same-size edit of tokenizer.json after the cache was made still stops `run`, naming
/// the file, before any text; `--verify trusted-receipt` (no hash of it) hashes it for the cache
/// and rebuilds the cache from the edited file.
#[test]
fn an_edited_tokenizer_json_is_refused_though_its_cache_is_bound_to_the_manifest() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = copy_demo(work.path());
    let args = [
        "run",
        "--model",
        &model,
        "--prompt",
        "It is a truth",
        "--max-new",
        "2",
        "--temperature",
        "0",
    ];
    run_ok(BIN, &args);
    let json = Path::new(&model).join("tokenizer/tokenizer.json");
    let text = std::fs::read_to_string(&json).unwrap();
    // A same-size edit that changes the bytes, not the tokenizer: a newline between two
    // entries becomes a space.
    let edited = text.replacen('\n', " ", 1);
    assert_ne!(edited, text, "no newline to edit");
    std::fs::write(&json, &edited).unwrap();
    let out = std::process::Command::new(BIN).args(args).output().unwrap();
    let err = stderr(&out);
    assert!(
        !out.status.success(),
        "the edited tokenizer.json was accepted: {err}"
    );
    assert!(
        err.contains("SHA-256 of tokenizer/tokenizer.json") && err.contains("the manifest says"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "text was written: {:?}", out.stdout);
    let mut trusted = args.to_vec();
    trusted.extend(["--verify", "trusted-receipt"]);
    // (This copy's receipt names the original's folder, so the trusted-receipt open then
    // refuses it; the text side, loaded beside that, has already hashed the file.)
    let out = std::process::Command::new(BIN)
        .args(&trusted)
        .output()
        .unwrap();
    assert!(
        stderr(&out).contains("tokenizer cache made from another tokenizer.json"),
        "{}",
        stderr(&out)
    );
}

/// A port in use fails `serve` before the install is read: here the install's tokenizer.json is
/// broken, and the error is still the port's, naming the address.
#[test]
fn serve_finds_a_busy_port_before_reading_the_install() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = copy_demo(work.path());
    std::fs::write(Path::new(&model).join("tokenizer/tokenizer.json"), "{").unwrap();
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port().to_string();
    let err = run_refused(
        BIN,
        &["serve", "--model", &model, "--port", &port],
        &format!("cannot listen on 127.0.0.1:{port}"),
    );
    assert!(!err.contains("tokenizer"), "{err}");
}

/// `--expert-cache-slots 32` on the demo model (16 experts per layer) says so and uses 16.
#[test]
fn expert_cache_slots_above_the_experts_are_clamped_with_a_note() {
    let out = run_demo(&[
        "--prompt",
        "Once",
        "--max-new",
        "1",
        "--expert-cache-slots",
        "32",
    ]);
    let err = stderr(&out);
    assert!(
        err.contains("--expert-cache-slots 32 is more than this model's 16 experts per layer"),
        "{err}"
    );
    assert!(err.contains("expert cache 16 slots/layer"), "{err}");
    assert!(!err.contains("32 slots/layer"), "{err}");
}

/// `run --quiet` prints only the generated text: nothing on stderr, not even the expert-cache
/// sizing note of the default `--expert-cache-slots auto` (printed by the flag code all commands
/// share).
#[test]
fn run_quiet_prints_nothing_on_stderr() {
    let out = run_demo(&[
        "--prompt",
        "Once upon a time",
        "--max-new",
        "4",
        "--temperature",
        "0",
        "--quiet",
    ]);
    assert_eq!(stderr(&out), "", "run --quiet wrote to stderr");
}

/// `--messages-file` takes content as a list of text parts, as `serve` does (the parts joined with
/// newlines), and refuses other parts naming the field.
#[test]
fn messages_file_takes_content_parts_as_serve_does() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let model = demo_install().to_str().unwrap();
    let write = |name: &str, v: serde_json::Value| {
        let p = work.path().join(name);
        std::fs::write(&p, v.to_string()).unwrap();
        p.to_str().unwrap().to_string()
    };
    let parts = write(
        "parts.json",
        serde_json::json!([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                           {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                        {"type": "text", "text": "there"}]}]),
    );
    let plain = write(
        "plain.json",
        serde_json::json!([{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hello\nthere"}]),
    );
    let run = |file: &str| {
        run_ok(
            BIN,
            &[
                "run",
                "--model",
                model,
                "--messages-file",
                file,
                "--max-new",
                "4",
                "--temperature",
                "0",
                "--show-ids",
            ],
        )
    };
    let (a, b) = (run(&parts), run(&plain));
    assert_eq!(ids(&a), ids(&b));
    let image = write(
        "image.json",
        serde_json::json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    );
    run_refused(
        BIN,
        &["run", "--model", model, "--messages-file", &image],
        "messages[0].content[0]: content part type image_url is not supported",
    );
}
