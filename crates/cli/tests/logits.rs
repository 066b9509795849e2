//! `mference logits` through the binary on the bundled demo model (issue 10, item 7): the `.npy`
//! it writes parses (by the format specification and by numpy) as float32 [T, vocab]; the rows of
//! prefill, decode and chunk:3 each agree with mlx-lm's float32 logits (`tools/ref/ref_logits.py`)
//! and with each other within the f32-KV parity budget of `crates/models/tests/gemma4_tiny.rs`. A
//! copy of the demo checkpoint without its tokenizer files installs with a warning, gives logits
//! within the same budget, and the text commands refuse it naming the missing files.

use std::path::Path;

use mference_testkit::{
    compare, demo_install, demo_source, py, read_npy_f32, ref_logits, reference_text_prompt, repo,
    run_ok, run_refused,
};

const BIN: &str = env!("CARGO_BIN_EXE_mference");

/// max|Δlogit| / max|ref logit| over all rows, and top-1 agreement, as the models' f32-KV checks.
const BUDGET: f32 = 1e-2;
const AGREE: f64 = 0.99;

/// A short real-text prompt, tokenized by the reference (HF `tokenizers`), BOS first.
fn prompt() -> Vec<u32> {
    let v = reference_text_prompt(
        "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    );
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn write_ids(dir: &Path, ids: &[u32]) -> std::path::PathBuf {
    let f = dir.join("ids.json");
    std::fs::write(&f, serde_json::to_string(ids).unwrap()).unwrap();
    f
}

/// `mference logits` in `mode` with an f32 KV cache; the parsed `.npy`.
fn logits(install: &Path, ids: &Path, out: &Path, mode: &str) -> ((usize, usize), Vec<f32>) {
    let o = run_ok(
        BIN,
        &[
            "logits",
            "--model",
            install.to_str().unwrap(),
            "--ids",
            ids.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--mode",
            mode,
            "--kv-cache",
            "f32",
        ],
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("float32 logits"),
        "no summary line"
    );
    read_npy_f32(out)
}

fn within_budget(label: &str, ours: &[f32], reference: &[f32], vocab: usize) {
    let (rel, agree) = compare(ours, reference, vocab);
    eprintln!(
        "{label}: max|Δ|/max|ref| {rel:.2e}, top-1 {:.1}%",
        agree * 100.0
    );
    assert!(
        rel <= BUDGET && agree >= AGREE,
        "{label}: rel {rel} (budget {BUDGET}), top-1 agreement {agree}"
    );
}

#[test]
fn logits_in_every_mode_match_mlx_lm_and_each_other() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let ids = prompt();
    assert!(ids.len() >= 8, "prompt too short: {ids:?}");
    let ids_file = write_ids(work.path(), &ids);
    let (reference, vocab) = ref_logits(&demo_source(), &ids, work.path());

    let mut by_mode = Vec::new();
    // A chunk past the context (here u64::MAX rows) is the whole prompt: the sliding layers'
    // window plus the chunk must not wrap around into a small ring.
    for mode in ["prefill", "decode", "chunk:3", "chunk:18446744073709551615"] {
        let out = work.path().join(format!("{}.npy", mode.replace(':', "")));
        let (shape, rows) = logits(demo_install(), &ids_file, &out, mode);
        assert_eq!(shape, (ids.len(), vocab), "{mode}: shape");
        within_budget(&format!("{mode} vs mlx-lm"), &rows, &reference, vocab);
        by_mode.push((mode, rows));
    }
    let prefill = &by_mode[0].1;
    for (mode, rows) in &by_mode[1..] {
        within_budget(&format!("{mode} vs prefill"), rows, prefill, vocab);
    }

    // numpy reads the file as written: float32, C order, [T, vocab].
    let code = "import json, sys, numpy as np; a = np.load(sys.argv[1]); print(json.dumps({'shape': list(a.shape), 'dtype': str(a.dtype), 'c': bool(a.flags['C_CONTIGUOUS']), 'sum': float(a.astype(np.float64).sum())}))";
    let npy = work.path().join("prefill.npy");
    let v = py(&["-c", code, npy.to_str().unwrap()]);
    assert_eq!(v["shape"], serde_json::json!([ids.len(), vocab]), "{v}");
    assert_eq!(v["dtype"], "float32", "{v}");
    assert_eq!(v["c"], true, "{v}");
    let ours: f64 = prefill.iter().map(|&x| x as f64).sum();
    assert!(
        (v["sum"].as_f64().unwrap() - ours).abs() <= 1e-6 * ours.abs().max(1.0),
        "numpy reads other values: {v} vs {ours}"
    );
    // Written through a temporary file and a rename: nothing else is left next to the outputs.
    let mut left: Vec<String> = std::fs::read_dir(work.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    left.sort();
    assert!(left.is_empty(), "temporary files left: {left:?}");
}

#[test]
fn an_install_without_tokenizer_files_gives_logits_and_refuses_text() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("no-tokenizer");
    std::fs::create_dir(&src).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
    ] {
        std::fs::copy(demo_source().join(f), src.join(f)).unwrap();
    }
    let inst = work.path().join("m.gturbo");
    let out = run_ok(
        BIN,
        &[
            "install",
            src.to_str().unwrap(),
            "--output",
            inst.to_str().unwrap(),
            "--quiet",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning:") && err.contains("tokenizer.json"),
        "no tokenizer warning: {err}"
    );
    assert!(inst.join("manifest.json").is_file(), "not installed");

    let ids = prompt();
    let ids_file = write_ids(work.path(), &ids);
    let (reference, vocab) = ref_logits(&demo_source(), &ids, work.path());
    let (shape, rows) = logits(&inst, &ids_file, &work.path().join("l.npy"), "prefill");
    assert_eq!(shape, (ids.len(), vocab));
    within_budget("no-tokenizer install vs mlx-lm", &rows, &reference, vocab);

    let m = inst.to_str().unwrap();
    let text = repo().join("assets/austen_pride_and_prejudice.txt");
    for args in [
        vec!["run", "--model", m, "--prompt", "Hello", "--max-new", "4"],
        vec!["perplexity", "--model", m, "--file", text.to_str().unwrap()],
        vec!["serve", "--model", m, "--port", "0"],
    ] {
        let err = run_refused(BIN, &args, "tokenizer.json");
        assert!(
            err.contains("mference logits") && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
    // bench feeds token ids and needs no tokenizer.
    run_ok(
        BIN,
        &["bench", "--model", m, "--prompts", "8", "--gen", "2"],
    );
}

#[test]
fn bad_ids_modes_and_outputs_are_refused_and_nothing_is_written() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let m = demo_install().to_str().unwrap();
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(demo_source().join("config.json")).unwrap()).unwrap();
    let vocab = cfg["text_config"]["vocab_size"].as_u64().unwrap();
    let out = work.path().join("out.npy");
    let o = out.to_str().unwrap();
    let ids = work.path().join("ids.json");
    let i = ids.to_str().unwrap();
    let too_big = format!("[2, {vocab}]");
    let cases: [(&str, &[&str], &str); 10] = [
        ("[]", &[], "the id array is empty"),
        ("[2, -1]", &[], "entry 1 is -1, not a token id"),
        ("[2, 1.5]", &[], "entry 1 is 1.5, not a token id"),
        ("[2, \"651\"]", &[], "not a token id"),
        ("{\"ids\": [2]}", &[], "must hold a JSON array of token ids"),
        ("2, 651", &[], "is not valid JSON"),
        (&too_big, &[], "outside the vocabulary"),
        (
            "[2, 3, 4, 5, 6]",
            &["--max-context", "4"],
            "more than --max-context 4",
        ),
        (
            "[2, 3]",
            &["--mode", "chunk:0"],
            "allowed values are prefill, decode, chunk:N",
        ),
        (
            "[2, 3]",
            &["--mode", "fast"],
            "allowed values are prefill, decode, chunk:N",
        ),
    ];
    for (content, flags, msg) in cases {
        std::fs::write(&ids, content).unwrap();
        let mut args = vec!["logits", "--model", m, "--ids", i, "--out", o];
        args.extend_from_slice(flags);
        run_refused(BIN, &args, msg);
        assert!(!out.exists(), "{content} {flags:?}: an output was written");
    }
    std::fs::write(&ids, "[2, 3]").unwrap();
    let missing = work.path().join("no/such/dir/out.npy");
    run_refused(
        BIN,
        &[
            "logits",
            "--model",
            m,
            "--ids",
            i,
            "--out",
            missing.to_str().unwrap(),
        ],
        "is not a directory",
    );
    run_refused(
        BIN,
        &[
            "logits",
            "--model",
            demo_source().to_str().unwrap(),
            "--ids",
            i,
            "--out",
            o,
        ],
        "is a checkpoint, not an install",
    );
    // Never a file of the install being read (it used to replace model_weights.bin).
    let weights = demo_install().join("model_weights.bin");
    let before = std::fs::metadata(&weights).unwrap().len();
    run_refused(
        BIN,
        &[
            "logits",
            "--model",
            m,
            "--ids",
            i,
            "--out",
            weights.to_str().unwrap(),
        ],
        "is inside the install",
    );
    assert_eq!(std::fs::metadata(&weights).unwrap().len(), before);
    // An existing directory, device or symlink at --out is refused and left as it was; a
    // successful write leaves no temporary file and a readable .npy.
    let adir = work.path().join("adir");
    std::fs::create_dir(&adir).unwrap();
    let link = work.path().join("link.npy");
    std::os::unix::fs::symlink(work.path().join("target.npy"), &link).unwrap();
    for target in [adir.as_path(), link.as_path(), Path::new("/dev/null")] {
        let t = target.to_str().unwrap();
        run_refused(
            BIN,
            &["logits", "--model", m, "--ids", i, "--out", t],
            "is not a regular file",
        );
    }
    assert!(
        adir.is_dir()
            && std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
    );
    run_ok(BIN, &["logits", "--model", m, "--ids", i, "--out", o]);
    let left: Vec<_> = std::fs::read_dir(work.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
        0o644
    );
}

/// `--device`: a bad value is refused; `auto` always runs and names its backend (on the CPU with
/// what CUDA lacked); `cuda` either runs on a GPU and says so, or fails naming what is missing (CI
/// has no GPU) — never a silent CPU; GPU-only flags are refused when `auto` takes the CPU.
#[test]
fn the_device_flag_names_its_backend_and_never_falls_back_silently() {
    let work = tempfile::tempdir().unwrap();
    let ids = write_ids(work.path(), &[2, 651, 1178, 563]);
    let out = work.path().join("l.npy");
    let args = |device: &'static str| -> Vec<String> {
        [
            "logits",
            "--model",
            demo_install().to_str().unwrap(),
            "--ids",
            ids.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--device",
            device,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    fn refs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }
    let argv = |d| args(d);
    run_refused(
        BIN,
        &refs(&argv("gpu")),
        "allowed values are cpu, cuda, cuda:N, auto",
    );
    let auto = run_ok(BIN, &refs(&argv("auto")));
    let said = String::from_utf8_lossy(&auto.stderr).into_owned();
    assert!(
        said.contains("device cpu ") || said.contains("device cuda:0 "),
        "{said}"
    );
    let cuda = std::process::Command::new(BIN)
        .args(refs(&argv("cuda")))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&cuda.stderr).into_owned();
    if cuda.status.success() {
        assert!(err.contains("device cuda:0"), "{err}");
    } else {
        assert!(
            err.contains("no CUDA driver")
                || err.contains("no NVRTC")
                || err.contains("no CUDA device"),
            "{err}"
        );
        assert!(
            said.contains("device cpu "),
            "auto without CUDA runs on the CPU: {said}"
        );
        // ... and says what CUDA lacked, the reason `--device cuda` gave.
        let why = err.trim().rsplit("cuda:0: ").next().unwrap();
        assert!(
            said.contains(&format!("(--device auto: {why})")),
            "auto names why it took the CPU ({why}): {said}"
        );
        // A GPU-only flag is refused rather than dropped when auto takes the CPU, even typed as
        // its default.
        for value in ["1G", "auto"] {
            let mut budget = argv("auto");
            budget.extend(["--gpu-expert-budget".to_string(), value.to_string()]);
            run_refused(BIN, &refs(&budget), "--device auto found no usable CUDA");
        }
    }
}

/// A `logits` run killed while it computes leaves nothing in the output's folder (its temporary
/// file used to be made before the compute and stayed behind).
#[test]
fn a_killed_logits_run_leaves_nothing_behind() {
    use std::io::BufRead;
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out_dir = work.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let ids: Vec<u32> = (100..1100).collect();
    let ids_file = write_ids(work.path(), &ids);
    let mut child = std::process::Command::new(BIN)
        .args([
            "logits",
            "--model",
            demo_install().to_str().unwrap(),
            "--ids",
        ])
        .arg(&ids_file)
        .arg("--out")
        .arg(out_dir.join("x.npy"))
        .args(["--mode", "decode", "--max-context", "2048"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The load line comes before the compute; the temporary file used to exist by then.
    let mut err = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while err.read_line(&mut line).unwrap() > 0 && !line.contains("expert cache") {
        line.clear();
    }
    // SAFETY: a plain signal to a process this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let left: Vec<_> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "{status}: left behind: {left:?}");
}
