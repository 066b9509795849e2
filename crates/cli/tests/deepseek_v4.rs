//! The DeepSeek-V4 family through the binary on the golden fixture `assets/fixtures/deepseek_v4/A`
//! (a tiny checkpoint in the pinned 2-bit DQ layout, no tokenizer files): `install` of the local
//! directory, `inspect` naming the family, `logits` in decode and chunked modes within the
//! fixture's tolerance of the transformers float32 reference with every argmax equal, and `bench`
//! with an expert cache smaller than the layer (and its per-layer decode costs). Then the text
//! commands: the fixture with its vocabulary widened to the DeepSeek-V4 tokenizer's 129,280 ids
//! (rows cycled, so the model still reads `id mod 1024`) and the bundled tokenizer and chat
//! template runs `run --prompt`, `run --messages-file` (the DeepSeek chat render), `run --chat` (a
//! follow-up turn reuses the conversation through the model's checkpoint) and `serve`
//! (`/v1/chat/completions`).

use std::path::{Path, PathBuf};

use mference_testkit::http::post;
use mference_testkit::{read_npy_f32, run_ok, run_ok_with_stdin, ServeProcess};
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_mference");
/// The case's README: `max |runtime − reference| <= 0.0005` elementwise.
const TOLERANCE: f32 = 5e-4;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/fixtures/deepseek_v4/A")
}

/// `mference install SRC --output OUT --quiet`, which must succeed.
fn install(src: &Path, out: &Path) {
    let (s, o) = (src.to_str().unwrap(), out.to_str().unwrap());
    run_ok(BIN, &["install", s, "--output", o, "--quiet"]);
}

fn argmax(r: &[f32]) -> usize {
    (0..r.len())
        .max_by(|&a, &b| r[a].total_cmp(&r[b]).then(b.cmp(&a)))
        .unwrap()
}

fn check(label: &str, ours: &[f32], reference: &[f32], v: usize) {
    assert_eq!(ours.len(), reference.len(), "{label}: row counts differ");
    let worst = ours
        .iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(
            0.0f32,
            |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
        );
    let agree = ours
        .chunks_exact(v)
        .zip(reference.chunks_exact(v))
        .all(|(a, b)| argmax(a) == argmax(b));
    eprintln!("{label}: max |Δ| {worst:.3e}, argmax equal everywhere: {agree}");
    assert!(
        worst <= TOLERANCE && agree,
        "{label}: max |Δ| {worst}, argmax equal {agree}"
    );
}

fn logits(inst: &Path, out: &Path, mode: &str) -> Vec<f32> {
    let ids = fixture().join("prompt_ids.json");
    run_ok(
        BIN,
        &[
            "logits",
            "--model",
            inst.to_str().unwrap(),
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
    let ((rows, cols), data) = read_npy_f32(out);
    assert_eq!((rows, cols), (300, 1024));
    data
}

#[test]
fn install_inspect_logits_and_bench_on_the_fixture() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = work.path().join("dsv4.gturbo");
    install(&fixture().join("checkpoint"), &inst);
    let o = run_ok(BIN, &["inspect", inst.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
    assert!(
        text.contains("deepseekV4Flash"),
        "inspect does not name the family:\n{text}"
    );

    let (dec_ref, v) = {
        let ((_, c), d) = read_npy_f32(&fixture().join("logits_decode_f32.npy"));
        (d, c)
    };
    let ((_, _), pre_ref) = read_npy_f32(&fixture().join("logits_prefill_f32.npy"));
    let ours = logits(&inst, &work.path().join("decode.npy"), "decode");
    check("logits --mode decode", &ours, &dec_ref, v);
    let ours = logits(&inst, &work.path().join("chunk.npy"), "chunk:37");
    check("logits --mode chunk:37", &ours, &pre_ref, v);

    let o = run_ok(
        BIN,
        &[
            "bench",
            "--model",
            inst.to_str().unwrap(),
            "--prompts",
            "40",
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
        ],
    );
    let stdout = String::from_utf8(o.stdout).unwrap();
    let doc: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let r = &doc["runs"][0];
    assert_eq!(r["gen_tokens"], 4, "{r}");
    assert_eq!(r["finite"], true, "{r}");
    assert!(r["hit_rate"].as_f64().unwrap() < 1.0, "8 of 16 slots: {r}");
    // Per-layer decode costs: one row per layer, each with time in attention and the FFN.
    let layers = r["layers"]["per_token"].as_array().expect("per-layer rows");
    assert_eq!(layers.len(), 7, "{r}");
    for l in layers {
        let (a, f) = (l["attention_ms"].as_f64(), l["ffn_ms"].as_f64());
        assert!(a > Some(0.0) && f > Some(0.0), "{l}");
    }
    assert!(r["layers"]["head_ms"].as_f64() > Some(0.0), "{r}");
}

/// The `--show-ids` line: (prompt ids, generated ids).
fn shown_ids(out: &std::process::Output) -> (Vec<u64>, Vec<u64>) {
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("{\""))
        .expect("--show-ids line");
    let v: Value = serde_json::from_str(line).unwrap();
    let ids = |k: &str| {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    (ids("prompt"), ids("generated"))
}

#[test]
fn run_and_serve_with_the_deepseek_tokenizer_and_chat_template() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("wide");
    mference_testkit::dsv4::write_text_checkpoint(&src);
    let inst = work.path().join("wide.gturbo");
    install(&src, &inst);
    let m = inst.to_str().unwrap();
    let base = [
        "run",
        "--model",
        m,
        "--temperature",
        "0",
        "--max-new",
        "12",
        "--show-ids",
    ];

    let out = run_ok(
        BIN,
        &[&base[..], &["--prompt", "The weather in London is"]].concat(),
    );
    let (prompt, generated) = shown_ids(&out);
    // The tokenizer adds no BOS (`add_bos_token: false`; the chat template writes it).
    assert!(
        !prompt.is_empty() && prompt.iter().all(|&i| i < 128_000),
        "a raw prompt is plain BPE ids: {prompt:?}"
    );
    assert!(
        !generated.is_empty() && generated.len() <= 12,
        "{generated:?}"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[stop="), "footer missing:\n{err}");

    let mf = work.path().join("messages.json");
    std::fs::write(
        &mf,
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]).to_string(),
    )
    .unwrap();
    let out = run_ok(
        BIN,
        &[&base[..], &["--messages-file", mf.to_str().unwrap()]].concat(),
    );
    let (chat, _) = shown_ids(&out);
    // <｜User｜> 128803, <｜Assistant｜> 128804, </think> 128822 (tokenizer.json added tokens).
    assert_eq!(chat[0], 0, "{chat:?}");
    assert!(
        chat.contains(&128803) && chat.contains(&128804),
        "no DeepSeek turns: {chat:?}"
    );
    assert_eq!(
        chat.last(),
        Some(&128822),
        "thinking off ends the prompt with </think>: {chat:?}"
    );

    // `run --chat`: the second turn reuses the first turn's prompt up to its
    // `<｜Assistant｜></think>` (the checkpoint the sliding rings and compressors rewind to).
    let out = run_ok_with_stdin(
        BIN,
        &[&base[..], &["--chat", "--max-context", "1024"]].concat(),
        "Hello there.\nHow are you?\n/quit\n",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let prompts: Vec<usize> = err
        .lines()
        .filter_map(|l| l.find("{\"prompt\"").map(|at| &l[at..]))
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["prompt"]
                .as_array()
                .unwrap()
                .len()
        })
        .collect();
    let stats: Vec<&str> = err.lines().filter(|l| l.contains("[stop=")).collect();
    assert_eq!((prompts.len(), stats.len()), (2, 2), "{err}");
    assert!(!stats[0].contains("cached="), "{err}");
    assert!(
        stats[1].contains(&format!(" cached={}tok", prompts[0] - 2)),
        "the second turn did not reuse the first prompt less <｜Assistant｜></think>: {err}"
    );

    let srv = ServeProcess::start(
        BIN,
        &["--model", m, "--model-id", "dsv4", "--max-context", "4096"],
        std::time::Duration::from_secs(120),
    );
    let (status, body) = post(
        srv.addr(),
        "/v1/chat/completions",
        &json!({"model": "dsv4", "messages": [{"role": "user", "content": "Hi there"}],
                "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{body}\n{}", srv.log());
    let choice = &body["choices"][0];
    assert!(
        choice["message"]["content"].is_string() || choice["message"]["tool_calls"].is_array(),
        "{body}"
    );
    assert!(
        body["usage"]["prompt_tokens"].as_u64().unwrap() > 3,
        "{body}"
    );
}
