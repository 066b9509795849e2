//! Support code shared by the integration tests of `mference-cli` and `mference-server` (a
//! dev-dependency only; never published):
//!
//! - the repository, its reference venv (`.venv`, made by `tools/test.sh`) and the mlx-lm
//!   reference scripts under `tools/ref/`;
//! - the bundled demo model (`assets/models/gemma4-tiny`) installed through the real installer
//!   once per test process ([`demo_install`]);
//! - the `mference` binary as a child process ([`run_ok`], [`ServeProcess`]);
//! - a blocking HTTP client that reads SSE streams ([`http`]).
//!
//! Each test file keeps only its scenarios.

pub mod dsv4;
pub mod http;
mod process;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use serde_json::Value;

pub use process::{output_ok, run_ok, run_ok_with_stdin, run_refused, ServeProcess};

/// Gemma 4's stop tokens (`<eos>`, `<turn|>`, `<|tool_response>`): generation ends before them and
/// our outputs never contain them.
pub const GEMMA_STOP_IDS: [u32; 3] = [1, 106, 50];

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root")
}

/// `<repo>/.venv/bin/python`; a missing venv fails the test with the command that makes it.
pub fn python() -> PathBuf {
    let p = repo().join(".venv/bin/python");
    assert!(
        p.exists(),
        "{} is missing: run `bash tools/ref/setup-venv.sh` (tools/test.sh does)",
        p.display()
    );
    p
}

/// Runs `.venv/bin/python ARGS` in the repository (e.g. `tools/ref/encode.py …`) and parses its
/// stdout as JSON; a failing script fails the test with its stderr.
pub fn py(args: &[&str]) -> Value {
    let out = output_ok(Command::new(python()).args(args).current_dir(repo()));
    serde_json::from_slice(&out.stdout).expect("the script's stdout is JSON")
}

/// The bundled demo checkpoint, `assets/models/gemma4-tiny` (an mlx-community layout).
pub fn demo_source() -> PathBuf {
    repo().join("assets/models/gemma4-tiny")
}

/// The demo checkpoint installed with the real installer (`mference_install::install_local`, what
/// `mference install` runs), made once per test process under `target/testkit/<test binary>/`.
pub fn demo_install() -> &'static Path {
    installed_asset("gemma4-tiny")
}

/// `assets/models/<name>` installed like [`demo_install`], once per test process and model.
pub fn installed_asset(name: &str) -> &'static Path {
    installed_once(name, &|_| repo().join("assets/models").join(name))
}

/// The Inkling golden fixture A (`assets/fixtures/inkling/A/checkpoint`) with its `embed` and
/// `unembed` widened to the real padded vocabulary (201024 rows, 200058 unpadded; the fixture's
/// 1000 rows repeated) and the family's tokenizer (`assets/tokenizers/inkling`), installed like
/// [`demo_install`]: a random tiny model that takes every id the tokenizer makes, for `run`,
/// `serve` and `bench` (its text is gibberish).
pub fn inkling_text_install() -> &'static Path {
    installed_once("inkling-text", &|root: &Path| {
        let src = root.join("src");
        write_inkling_text_checkpoint(&src);
        src
    })
}

/// [`dsv4::write_text_checkpoint`] installed like [`demo_install`].
pub fn dsv4_text_install() -> &'static Path {
    installed_once("deepseek-v4-text", &|root: &Path| {
        let src = root.join("src");
        dsv4::write_text_checkpoint(&src);
        src
    })
}

/// The Maple golden fixture A (`assets/fixtures/maple/A/checkpoint`) with its
/// `model.word_embeddings` and `lm_head` widened to the Qwen3 vocabulary of the Maple tokenizer
/// (151,936 rows; the fixture's 1,024 rows repeated) and that tokenizer and template
/// (`assets/tokenizers/maple`), installed like [`demo_install`]: a random tiny Maple that takes
/// every id the tokenizer makes, for `run --chat` and `serve` (its text is gibberish).
pub fn maple_text_install() -> &'static Path {
    installed_once("maple-text", &|root: &Path| {
        let src = root.join("src");
        write_widened_checkpoint(
            &Widen {
                fixture: "maple/A",
                shard: "model.safetensors",
                tables: &["model.word_embeddings.", "lm_head."],
                fixture_rows: 1024,
                vocab: 151_936,
                tokenizer: "maple",
            },
            &src,
            &|config| {
                config["vocab_size"] = 151_936.into();
                config["eos_token_id"] = 151_645.into();
            },
        );
        src
    })
}

/// Writes the checkpoint of [`inkling_text_install`] into `dst`.
fn write_inkling_text_checkpoint(dst: &Path) {
    write_widened_checkpoint(
        &Widen {
            fixture: "inkling/A",
            shard: "model-00001-of-00001.safetensors",
            tables: &["model.llm.embed.", "model.llm.unembed."],
            fixture_rows: 1000,
            vocab: 201_024,
            tokenizer: "inkling",
        },
        dst,
        &|config| {
            config["text_config"]["vocab_size"] = 201_024.into();
            config["text_config"]["unpadded_vocab_size"] = 200_058.into();
        },
    );
}

/// A golden fixture's vocabulary tables widened to a real tokenizer's vocabulary.
struct Widen {
    /// `assets/fixtures/<fixture>/checkpoint`.
    fixture: &'static str,
    /// Its single safetensors file.
    shard: &'static str,
    /// Name prefixes of the tensors with one row per vocabulary id (weight, scales, biases).
    tables: &'static [&'static str],
    /// The fixture's rows that row `r` of a wide table repeats (`r % fixture_rows`).
    fixture_rows: usize,
    /// Rows of a wide table.
    vocab: u64,
    /// `assets/tokenizers/<tokenizer>`: its tokenizer files and chat template are copied.
    tokenizer: &'static str,
}

/// Writes `w`'s widened checkpoint into `dst`, its config edited by `config_edit`.
fn write_widened_checkpoint(w: &Widen, dst: &Path, config_edit: &dyn Fn(&mut Value)) {
    let fixture = repo()
        .join("assets/fixtures")
        .join(w.fixture)
        .join("checkpoint");
    let bytes = std::fs::read(fixture.join(w.shard)).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut tensors: Vec<(String, Value, Vec<u8>)> = Vec::new();
    for (name, t) in &header {
        if name == "__metadata__" {
            continue;
        }
        let [a, b] = [0, 1].map(|i| t["data_offsets"][i].as_u64().unwrap() as usize);
        let mut shape: Vec<u64> = serde_json::from_value(t["shape"].clone()).unwrap();
        let mut raw = data[a..b].to_vec();
        if w.tables.iter().any(|m| name.starts_with(m)) {
            // Row r of the wide table is fixture row r % fixture_rows.
            let (rows, k) = (w.fixture_rows, raw.len() / shape[0] as usize);
            raw = (0..w.vocab as usize)
                .flat_map(|r| raw[(r % rows) * k..(r % rows + 1) * k].to_vec())
                .collect();
            shape[0] = w.vocab;
        }
        tensors.push((
            name.clone(),
            serde_json::json!({"dtype": t["dtype"], "shape": shape}),
            raw,
        ));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut head = serde_json::Map::new();
    head.insert("__metadata__".into(), serde_json::json!({"format": "mlx"}));
    let mut weight_map = serde_json::Map::new();
    let mut off = 0;
    for (name, mut t, raw) in tensors.iter().cloned() {
        t["data_offsets"] = serde_json::json!([off, off + raw.len()]);
        off += raw.len();
        head.insert(name.clone(), t);
        weight_map.insert(name, w.shard.into());
    }
    let mut hb = serde_json::to_vec(&head).unwrap();
    hb.resize(hb.len().div_ceil(8) * 8, b' ');
    std::fs::create_dir_all(dst).unwrap();
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    for (_, _, raw) in &tensors {
        out.extend_from_slice(raw);
    }
    std::fs::write(dst.join(w.shard), out).unwrap();
    let index = serde_json::json!({"metadata": {"total_size": off}, "weight_map": weight_map});
    std::fs::write(dst.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(fixture.join("config.json")).unwrap()).unwrap();
    config_edit(&mut config);
    std::fs::write(dst.join("config.json"), config.to_string()).unwrap();
    let tok = repo().join("assets/tokenizers").join(w.tokenizer);
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(tok.join(f), dst.join(f)).unwrap();
    }
}

/// Installs the checkpoint `source(root)` returns (it may write it under `root`) once per test
/// process as `<root>/model.gturbo`, `root` = `target/testkit/<test binary>/<name>`.
fn installed_once(name: &str, source: &dyn Fn(&Path) -> PathBuf) -> &'static Path {
    static DIRS: OnceLock<Mutex<HashMap<String, &'static Path>>> = OnceLock::new();
    let mut dirs = DIRS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(dir) = dirs.get(name) {
        return dir;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let bin = exe.file_stem().unwrap().to_string_lossy().to_string();
    let root = repo().join("target/testkit").join(bin).join(name);
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let out = root.join("model.gturbo");
    let src = source(&root);
    mference_install::install_local(
        &src,
        &out,
        &mference_install::InstallOptions {
            progress: mference_install::ProgressMode::Quiet,
            disk_reserve_bytes: Some(0),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("installing {}: {e}", src.display()));
    let dir: &'static Path = Box::leak(out.into_boxed_path());
    dirs.insert(name.to_string(), dir);
    dir
}

/// `tools/ref/encode.py --model <demo checkpoint> ARGS`: the reference prompt's token ids.
fn reference_prompt(args: &[&str]) -> Value {
    let src = demo_source();
    let mut all = vec!["tools/ref/encode.py", "--model", src.to_str().unwrap()];
    all.extend_from_slice(args);
    py(&all)["prompt"].clone()
}

/// The reference tokenization (`tools/ref/encode.py`: HF `tokenizers` in the venv) of `text` on
/// the demo checkpoint, with its BOS: a JSON list of token ids.
pub fn reference_text_prompt(text: &str) -> Value {
    reference_prompt(&["--text", text, "--bos"])
}

/// The reference prompt (`tools/ref/encode.py`: the transformers template render, thinking off,
/// then HF `tokenizers`) of one user message on the demo checkpoint: a JSON list of token ids.
pub fn reference_chat_prompt(user: &str) -> Value {
    reference_prompt(&["--chat-user", user, "--thinking", "false"])
}

/// mlx-lm's greedy continuation of `prompt` (a JSON list of token ids) on the demo checkpoint,
/// `n` tokens at most (float32 compute, `tools/ref/ref_logits.py --greedy`), cut at the first
/// Gemma stop token. `work` holds the prompt file.
pub fn mlx_greedy(prompt: &Value, n: usize, work: &Path) -> Vec<u32> {
    let f = work.join("prompt.json");
    std::fs::write(&f, prompt.to_string()).unwrap();
    let g = py(&[
        "tools/ref/ref_logits.py",
        "--model",
        demo_source().to_str().unwrap(),
        "--tokens-file",
        f.to_str().unwrap(),
        "--greedy",
        &n.to_string(),
    ]);
    g["generated"]
        .as_array()
        .expect("`generated` ids")
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .take_while(|id| !GEMMA_STOP_IDS.contains(id))
        .collect()
}

/// mlx-lm's perplexity of `assets/models/<model>` by llama-perplexity's protocol (first 8,192
/// tokens of the Austen text, 512-token chunks), as committed with its command in
/// `tools/ref/reference-values.json`.
pub fn reference_perplexity(model: &str) -> f64 {
    let refs: Value = serde_json::from_slice(
        &std::fs::read(repo().join("tools/ref/reference-values.json")).unwrap(),
    )
    .unwrap();
    refs["models"][model]["perplexity_llama_ctx512_8192"]["perplexity"]
        .as_f64()
        .unwrap_or_else(|| panic!("no reference perplexity for {model}"))
}

/// `bin perplexity` on `install` by the same protocol, plus `extra` flags, which must succeed:
/// the perplexity it prints and its stderr.
pub fn perplexity(bin: &str, install: &Path, extra: &[&str]) -> (f64, String) {
    let text = repo().join("assets/austen_pride_and_prejudice.txt");
    let mut args = vec![
        "perplexity",
        "--model",
        install.to_str().unwrap(),
        "--file",
        text.to_str().unwrap(),
        "--ctx",
        "512",
        "--max-tokens",
        "8192",
    ];
    args.extend_from_slice(extra);
    let out = run_ok(bin, &args);
    let got = String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("perplexity: "))
        .expect("perplexity line")
        .trim()
        .parse()
        .unwrap();
    (got, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Fails unless `got` is within `budget` (relative) of mlx-lm's perplexity for `model`.
pub fn assert_perplexity_near(model: &str, got: f64, budget: f64) {
    let want = reference_perplexity(model);
    let rel = (got - want).abs() / want;
    eprintln!(
        "{model}: perplexity ours {got:.4}, mlx-lm {want:.4}, {:.3}% apart",
        rel * 100.0
    );
    assert!(
        rel <= budget,
        "{model}: perplexity {got} vs mlx-lm {want}: {:.3}% apart (budget {:.2}%)",
        rel * 100.0,
        budget * 100.0
    );
}

/// mlx-lm float32 logits for every position of `tokens` on the checkpoint `model`
/// (`tools/ref/ref_logits.py`): `([T, vocab] row-major, vocab)`. `work` holds the files.
pub fn ref_logits(model: &Path, tokens: &[u32], work: &Path) -> (Vec<f32>, usize) {
    let tf = work.join("tokens.json");
    std::fs::write(&tf, serde_json::to_string(tokens).unwrap()).unwrap();
    let out = work.join("ref_logits.bin");
    output_ok(
        Command::new(python())
            .arg(repo().join("tools/ref/ref_logits.py"))
            .args(["--model", model.to_str().unwrap()])
            .args(["--tokens-file", tf.to_str().unwrap()])
            .args(["--out", out.to_str().unwrap()]),
    );
    let v: Vec<f32> = std::fs::read(&out)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let side: Value =
        serde_json::from_slice(&std::fs::read(out.with_extension("json")).unwrap()).unwrap();
    let vocab = side["vocab"].as_u64().unwrap() as usize;
    assert_eq!(v.len(), tokens.len() * vocab);
    (v, vocab)
}

/// `max|Δlogit| / max|ref logit|` over everything, and the share of rows whose argmax agrees
/// (`[rows, vocab]` row-major both).
pub fn compare(ours: &[f32], reference: &[f32], vocab: usize) -> (f32, f64) {
    assert_eq!(ours.len(), reference.len());
    let max_ref = reference.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_d = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let rows = reference.len() / vocab;
    let agree = (0..rows)
        .filter(|&r| {
            argmax(&ours[r * vocab..(r + 1) * vocab])
                == argmax(&reference[r * vocab..(r + 1) * vocab])
        })
        .count();
    (max_d / max_ref, agree as f64 / rows as f64)
}

/// The index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> usize {
    let mut b = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[b] {
            b = i;
        }
    }
    b
}

/// A 2-D float32 NumPy file as `mference logits` writes it, read strictly by the format 1.0
/// specification (`numpy/lib/format.py`): magic and version, a `'<f4'` C-order header with a
/// two-entry shape, a header that ends in a newline at a 64-byte boundary, and exactly
/// rows × cols values after it. Returns `((rows, cols), values)`; anything else fails the test.
pub fn read_npy_f32(path: &Path) -> ((usize, usize), Vec<f32>) {
    let b = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert!(b.len() >= 10, "{}: too short for .npy", path.display());
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00", "not a v1.0 .npy");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hlen) % 64, 0, "data not 64-byte aligned");
    let header = std::str::from_utf8(&b[10..10 + hlen]).expect("ASCII header");
    assert!(header.ends_with('\n'), "header does not end in a newline");
    let dict = header.trim_end();
    assert!(dict.contains("'descr': '<f4'"), "dtype: {dict}");
    assert!(dict.contains("'fortran_order': False"), "order: {dict}");
    let shape = dict
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap_or_else(|| panic!("no shape: {dict}"));
    let dims: Vec<usize> = shape
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().expect("integer dimension"))
        .collect();
    assert_eq!(dims.len(), 2, "shape {shape} is not 2-D");
    let data = &b[10 + hlen..];
    assert_eq!(
        data.len(),
        dims[0] * dims[1] * 4,
        "data size vs shape {dims:?}"
    );
    let v = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    ((dims[0], dims[1]), v)
}
