//! The DeepSeek-V4 family through the binary on the golden fixture `assets/fixtures/deepseek_v4/A`
//! (a tiny checkpoint in the pinned 2-bit DQ layout, no tokenizer files): `install` of the local
//! directory, `inspect` naming the family, `logits` in decode and chunked modes within the
//! fixture's tolerance of the transformers float32 reference with every argmax equal, and `bench`
//! with an expert cache smaller than the layer.

use std::path::{Path, PathBuf};

use mference_testkit::{read_npy_f32, run_ok};

const BIN: &str = env!("CARGO_BIN_EXE_mference");
/// The case's README: `max |runtime − reference| <= 0.0005` elementwise.
const TOLERANCE: f32 = 5e-4;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/fixtures/deepseek_v4/A")
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
    let src = fixture().join("checkpoint");
    run_ok(
        BIN,
        &[
            "install",
            src.to_str().unwrap(),
            "--output",
            inst.to_str().unwrap(),
        ],
    );
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
            "--ctx",
            "256",
        ],
    );
    let stdout = String::from_utf8(o.stdout).unwrap();
    let doc: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let r = &doc["runs"][0];
    assert_eq!(r["gen_tokens"], 4, "{r}");
    assert_eq!(r["finite"], true, "{r}");
    assert!(r["hit_rate"].as_f64().unwrap() < 1.0, "8 of 16 slots: {r}");
}
