//! `mference bench` on the bundled tiny Gemma 4 (installed with the real installer): every prompt
//! runs in its own process and the JSON has sane values. Timings are not checked (they belong in
//! benchmarks), only that they were measured.

use mference_testkit::{demo_install, run_ok};

fn mference(args: &[&str]) -> std::process::Output {
    run_ok(env!("CARGO_BIN_EXE_mference"), args)
}

#[test]
fn bench_runs_each_prompt_in_a_fresh_process_and_reports_sane_json() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = demo_install();
    let json_path = work.path().join("bench.json");
    // 8 slots of 16 experts with top-4 routing: misses must happen, so bytes are read.
    let out = mference(&[
        "bench",
        "--model",
        inst.to_str().unwrap(),
        "--prompts",
        "short,24",
        "--gen",
        "6",
        "--repeats",
        "2",
        "--slots",
        "8",
        "--threads",
        "1",
        "--max-context",
        "256",
        "--json",
        json_path.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("decode/s"), "no table in:\n{stdout}");
    // The header names the chunk each prompt ran with, not just "auto".
    assert!(
        stdout.contains("prefill-chunk auto (short 64, 24 32)"),
        "no effective prefill chunk in:\n{stdout}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let last_line: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(doc, last_line, "--json file and stdout JSON differ");

    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 4, "2 prompts x 2 repeats");
    let want_tokens = [64, 64, 24, 24];
    let mut pids = std::collections::HashSet::new();
    for (r, want) in runs.iter().zip(want_tokens) {
        assert_eq!(r["prompt_tokens"], want, "{r}");
        assert_eq!(r["gen_tokens"], 6, "{r}");
        assert_eq!(r["generated"].as_array().unwrap().len(), 6, "{r}");
        for k in [
            "prefill_s",
            "prefill_tok_s",
            "ttft_s",
            "decode_s",
            "decode_tok_s",
        ] {
            let v = r[k].as_f64().unwrap();
            assert!(v > 0.0 && v.is_finite(), "{k} = {v} in {r}");
        }
        let rss = r["peak_rss_bytes"].as_u64().unwrap();
        assert!(
            rss > 1 << 20 && rss < 8 << 30,
            "peak RSS {rss} bytes is not plausible"
        );
        let (anon, file) = (
            r["rss_anon_bytes"].as_u64().unwrap(),
            r["rss_file_bytes"].as_u64().unwrap(),
        );
        assert!(
            anon > 0 && file > 0 && anon + file <= rss,
            "resident split anon {anon} + file {file} vs peak {rss}"
        );
        // The sampled peaks of each part: each at most VmHWM, the anonymous one at least the KV
        // cache (allocated at load, anonymous), the file one at least the mapped weights' pages
        // still resident at the end.
        let (peak_anon, peak_file) = (
            r["peak_rss_anon_bytes"].as_u64().unwrap(),
            r["peak_rss_file_bytes"].as_u64().unwrap(),
        );
        assert!(r["rss_samples"].as_u64().unwrap() >= 4, "{r}");
        assert!(
            peak_anon <= rss && peak_file <= rss,
            "peaks anon {peak_anon} file {peak_file} vs VmHWM {rss}"
        );
        assert!(peak_anon >= r["kv_bytes"].as_u64().unwrap(), "{r}");
        assert!(peak_file + (1 << 20) >= file, "{r}");
        let hit = r["hit_rate"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&hit), "hit rate {hit}");
        assert!(
            hit < 1.0,
            "8 slots for 16 experts cannot hit every time: {r}"
        );
        assert!(r["bytes_per_token"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["prefill_bytes_read"].as_u64().unwrap() > 0, "{r}");
        assert!(r["read_wait_per_token_s"].as_f64().unwrap() >= 0.0, "{r}");
        assert_eq!(r["finite"], true, "{r}");
        assert_eq!(r["slots"], 8);
        assert_eq!(r["threads"], 1);
        assert_eq!(r["direct_io"], false);
        assert_eq!(r["ctx"], 256);
        // auto prefill chunk: the prompt length rounded up to an allowed chunk (>= 32)
        assert_eq!(r["prefill_chunk"], if want == 64 { 64 } else { 32 }, "{r}");
        assert!(
            pids.insert(r["pid"].as_u64().unwrap()),
            "two runs shared a process"
        );
    }
    assert!(!pids.contains(&std::process::id().into()));
    // The same prompt is the same ids every run: greedy output repeats exactly.
    assert_eq!(runs[0]["generated"], runs[1]["generated"]);
    assert_eq!(runs[2]["generated"], runs[3]["generated"]);

    let summary = doc["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 2);
    assert_eq!(summary[0]["prompt"], "short");
    assert_eq!(summary[0]["runs"], 2);
    assert_eq!(summary[1]["prompt_tokens"], 24);
    assert!(summary[1]["decode_tok_s"].as_f64().unwrap() > 0.0);
}

/// `--router-lookahead 2` is named in the header and the JSON, reads ahead in decode, and changes
/// no generated id (8 slots: misses are forced).
#[test]
fn bench_router_lookahead_is_reported_and_changes_no_output() {
    let inst = demo_install();
    let run = |n: &str| {
        let out = mference(&[
            "bench",
            "--model",
            inst.to_str().unwrap(),
            "--prompts",
            "24",
            "--gen",
            "12",
            "--slots",
            "8",
            "--threads",
            "1",
            "--max-context",
            "256",
            "--router-lookahead",
            n,
        ]);
        let stdout = String::from_utf8(out.stdout).unwrap();
        assert!(
            stdout.contains(&format!("router-lookahead {n}")),
            "{stdout}"
        );
        let doc: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(
            doc["settings"]["router_lookahead"],
            n.parse::<u64>().unwrap()
        );
        doc["runs"][0].clone()
    };
    let (off, on) = (run("0"), run("2"));
    assert_eq!(off["prefetch_reads_per_token"], 0.0, "{off}");
    assert!(
        on["prefetch_reads_per_token"].as_f64().unwrap() > 0.0,
        "{on}"
    );
    assert_eq!(off["generated"], on["generated"]);
}

#[test]
fn bench_rejects_bad_flags_before_loading() {
    for (args, msg) in [
        (vec!["--decode", "sampled"], "--decode"),
        (vec!["--prompts", "huge"], "--prompts"),
        (
            vec!["--prompts", "short,,long"],
            "an empty entry between commas",
        ),
        (vec!["--prompts", "4000", "--gen", "200"], "does not fit"),
        (vec!["--prefill-chunk", "100"], "--prefill-chunk"),
        (vec!["--repeats", "0"], "--repeats"),
        (vec!["--kernels", "avx9000"], "invalid --kernels"),
        (vec!["--device", "gpu"], "invalid device 'gpu'"),
        (vec!["--gpu-expert-budget", "abc"], "--gpu-expert-budget"),
        // A value that starts with '-' stays the flag's (the child gets `--flag=value` too).
        (vec!["--gpu-expert-budget=-5"], "--gpu-expert-budget"),
        (
            vec!["--host-expert-cache=-5"],
            "invalid --host-expert-cache '-5'",
        ),
        (
            vec!["--device", "cpu", "--gpu-expert-budget", "1G"],
            "--gpu-expert-budget applies only on CUDA",
        ),
        (vec!["--gpu-miss-split", "101"], "--gpu-miss-split"),
        (vec!["--gpu-miss-split", "half"], "expected off, auto"),
        (
            vec!["--device", "cpu", "--gpu-miss-split", "50"],
            "--gpu-miss-split applies only on CUDA",
        ),
        // Given as its default, still refused: nothing a user typed is dropped.
        (
            vec!["--device", "cpu", "--gpu-miss-split", "auto"],
            "--gpu-miss-split applies only on CUDA",
        ),
        (
            vec!["--device", "cpu", "--gpu-expert-budget", "auto"],
            "--gpu-expert-budget applies only on CUDA",
        ),
        // A path that is no install says so (it said "reading .../tokenizer/config.json").
        (
            vec![],
            "/nonexistent.gturbo is not an mference install (no manifest.json)",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mference"))
            .args(["bench", "--model", "/nonexistent.gturbo"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(msg), "{args:?}: {err}");
        assert!(
            !err.contains("[bench]"),
            "{args:?}: a child was started: {err}"
        );
    }
}

/// A bench killed while its child measures takes the child with it (the child would otherwise
/// run on, re-parented, until its prompt and generation finish).
#[test]
fn a_killed_bench_leaves_no_child_running() {
    let inst = demo_install();
    let mut parent = std::process::Command::new(env!("CARGO_BIN_EXE_mference"))
        .args(["bench", "--model", inst.to_str().unwrap(), "--threads", "1"])
        .args([
            "--prompts",
            "1000",
            "--gen",
            "3000",
            "--max-context",
            "4096",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let child_of = |pid: u32| {
        std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // pid (comm) state ppid ...: the fields after the command's closing parenthesis.
            let ppid: u32 = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == pid).then(|| e.file_name().to_str()?.parse::<u32>().ok())?
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let child = loop {
        if let Some(c) = child_of(parent.id()) {
            break c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "bench started no child"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    // SAFETY: a plain signal to a process this test started.
    unsafe { libc::kill(parent.id() as libc::pid_t, libc::SIGKILL) };
    parent.wait().unwrap();
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            !matches!(
                s.rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next()),
                Some("Z")
            )
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while alive(child) {
        assert!(
            std::time::Instant::now() < deadline,
            "the bench child {child} still runs after its parent was killed"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// With `--gen 1` no token is decoded (the first comes from the prompt): the decode rate is
/// null in the JSON and "n/a" in the table, not 0 tok/s.
#[test]
fn one_generated_token_has_no_decode_rate() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let json_path = work.path().join("b.json");
    let out = mference(&[
        "bench",
        "--model",
        demo_install().to_str().unwrap(),
        "--prompts",
        "8",
        "--gen",
        "1",
        "--threads",
        "1",
        "--json",
        json_path.to_str().unwrap(),
    ]);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert!(doc["runs"][0]["decode_tok_s"].is_null(), "{doc}");
    assert!(doc["summary"][0]["decode_tok_s"].is_null(), "{doc}");
    let table = String::from_utf8_lossy(&out.stdout);
    let row = table.lines().find(|l| l.starts_with("8 ")).unwrap_or("");
    assert!(row.contains("n/a"), "{table}");
}
