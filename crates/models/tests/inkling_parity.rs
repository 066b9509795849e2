//! Inkling-Small (`inkling_mm_model`) against the golden fixtures `assets/fixtures/inkling/{A,B}`
//! (tiny random checkpoints in the pinned MLX layout, installed through the real installer;
//! float32 logits from transformers' `InklingForCausalLM`, see each case's README): every
//! position of the full-prompt forward, of token-by-token decode and of chunked prefill (chunks 1,
//! 7, 64, 128) within the fixtures' 2e-4, the same argmax everywhere, the reference's 32 greedy
//! ids; outputs bit-identical across expert slot counts; a checkpoint rewinds the short-conv
//! states exactly.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use mference_models::{load, LoadOptions, Logits, Want};

/// The fixtures' recommended tolerance (max |ours − reference| per logit).
const ATOL: f32 = 2e-4;

struct Fixture {
    prompt: Vec<u32>,
    prefill: Vec<f32>,
    decode: Vec<f32>,
    greedy: Vec<u32>,
    vocab: usize,
    _work: tempfile::TempDir,
    install: PathBuf,
}

fn fixture(case: &str) -> Fixture {
    let dir = repo().join("assets/fixtures/inkling").join(case);
    let ids = |f: &str| -> Vec<u32> {
        serde_json::from_slice(&std::fs::read(dir.join(f)).unwrap()).unwrap()
    };
    let ((rows, vocab), prefill) =
        mference_testkit::read_npy_f32(&dir.join("logits_prefill_f32.npy"));
    let (shape, decode) = mference_testkit::read_npy_f32(&dir.join("logits_decode_f32.npy"));
    assert_eq!(shape, (rows, vocab));
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let install = install(&dir.join("checkpoint"), work.path());
    let prompt = ids("prompt_ids.json");
    assert_eq!(prompt.len(), rows);
    Fixture {
        prompt,
        prefill,
        decode,
        greedy: ids("greedy_ids.json"),
        vocab,
        _work: work,
        install,
    }
}

/// Max |Δ| over every logit and the share of rows whose argmax agrees.
fn diff(ours: &[f32], reference: &[f32], vocab: usize) -> (f32, f64) {
    assert_eq!(ours.len(), reference.len(), "logit count");
    let max = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let rows = reference.len() / vocab;
    let agree = (0..rows)
        .filter(|&r| {
            let s = r * vocab..(r + 1) * vocab;
            argmax(&ours[s.clone()]) == argmax(&reference[s])
        })
        .count();
    (max, agree as f64 / rows as f64)
}

fn argmax(v: &[f32]) -> usize {
    mference_testkit::argmax(v)
}

/// Within [`ATOL`] at every logit and the same argmax at every position.
fn check_exact(label: &str, ours: &[f32], reference: &[f32], vocab: usize) {
    let (max, agree) = diff(ours, reference, vocab);
    eprintln!(
        "{label}: max |Δ| {max:.3e}, argmax agreement {:.2}%",
        agree * 100.0
    );
    assert!(
        ours.iter().all(|v| v.is_finite()),
        "{label}: non-finite logits"
    );
    assert!(max <= ATOL, "{label}: max |Δ| {max:.3e} > {ATOL:.0e}");
    assert!(agree == 1.0, "{label}: argmax differs at some position");
}

fn f32_kv(chunk: usize) -> LoadOptions {
    opts32(chunk)
}

fn run_case(case: &str) {
    let f = fixture(case);
    let v = f.vocab;
    let full = prefill_all(&f.install, &f.prompt, &f32_kv(f.prompt.len()));
    check_exact(&format!("{case} full prompt"), &full, &f.prefill, v);
    let dec = decode_all(&f.install, &f.prompt, &f32_kv(128));
    check_exact(&format!("{case} decode"), &dec, &f.decode, v);
    for chunk in [1, 7, 64, 128] {
        let ours = prefill_all(&f.install, &f.prompt, &f32_kv(chunk));
        check_exact(&format!("{case} chunk {chunk}"), &ours, &f.prefill, v);
    }
    let mut m = load(&f.install, &f32_kv(128)).unwrap();
    assert_eq!(m.vocab_size(), v, "logits cover the unpadded vocabulary");
    assert_eq!(
        greedy(m.as_mut(), &f.prompt, f.greedy.len()),
        f.greedy,
        "{case}: greedy ids differ from the reference"
    );

    // The default FP16 KV cache: reported, and held to the argmax >= 99%.
    let ours = prefill_all(&f.install, &f.prompt, &opts(64, 512));
    let (max, agree) = diff(&ours, &f.prefill, v);
    let mut rows: Vec<f32> = (0..f.prompt.len())
        .map(|r| diff(&ours[r * v..(r + 1) * v], &f.prefill[r * v..(r + 1) * v], v).0)
        .collect();
    rows.sort_by(f32::total_cmp);
    eprintln!(
        "{case} FP16 KV, chunk 64: max |Δ| {max:.3e} (median row {:.3e}, p95 row {:.3e}), argmax \
         agreement {:.2}%",
        rows[rows.len() / 2],
        rows[rows.len() * 95 / 100],
        agree * 100.0
    );
    assert!(agree >= 0.99, "{case} FP16 KV: argmax agreement {agree}");
}

#[test]
fn inkling_case_a_matches_the_reference() {
    run_case("A");
}

/// Case B: other dims and heads, one dense layer, the log position scale active from position 64.
#[test]
fn inkling_case_b_matches_the_reference() {
    run_case("B");
}

/// Slot count, resident mode and O_DIRECT change where expert bytes come from, never the math.
#[test]
fn inkling_outputs_identical_across_slots_and_direct_io() {
    for case in ["A", "B"] {
        let f = fixture(case);
        assert_slot_invariance(&f.install, &f.prompt[..200]);
    }
}

/// A checkpoint lets a server reuse a conversation prefix: cutting back to it restores the four
/// short-conv states per layer and the KV, and what runs next is bit-identical to a model that only
/// ever saw the prefix; other cuts are refused without changing anything.
#[test]
fn inkling_checkpoint_rewinds_exactly() {
    let f = fixture("B");
    check_rewind(&f.install, &f.prompt);
}

fn check_rewind(inst: &Path, prompt: &[u32]) {
    let other: Vec<u32> = prompt[..60].iter().map(|&t| (t * 7 + 3) % 1000).collect();
    let o = opts32(64);
    let rows = |m: &mut Box<dyn mference_models::Model>, t: &[u32]| match m.forward(t, Want::All) {
        Ok(Logits::Rows(r)) => r,
        _ => panic!("expected rows"),
    };
    let mut fresh = load(inst, &o).unwrap();
    fresh.forward(&prompt[..180], Want::None).unwrap();
    let want = rows(&mut fresh, &other);

    let mut m = load(inst, &o).unwrap();
    m.forward(&prompt[..180], Want::None).unwrap();
    m.checkpoint();
    let past = rows(&mut m, &prompt[180..]);
    assert_eq!(m.rewind_point(250), 180);
    assert_eq!(m.rewind_point(179), 0);
    assert!(!m.truncate(250), "a cut past the checkpoint was accepted");
    assert_eq!(m.position(), 300, "a refused cut changed the position");
    assert!(m.truncate(180));
    assert!(
        rows(&mut m, &other) == want,
        "logits after the rewind differ from a fresh run"
    );
    assert!(m.truncate(180));
    assert!(
        rows(&mut m, &prompt[180..]) == past,
        "replay after a second rewind differs"
    );
    assert!(m.truncate(0));
    m.forward(&prompt[..200], Want::None).unwrap();
    assert_eq!(m.rewind_point(190), 0);
    assert!(!m.truncate(180), "a restart kept the old checkpoint");
}

/// Sliding layers keep a ring of `window + prefill chunk + REWIND_REACH` rows once the context is
/// longer than that: past the point where the rings wrap, logits equal those of a model whose
/// sliding layers keep every position (within the fixtures' tolerance: the two runs use other
/// chunk sizes), a checkpoint 100 positions back still rewinds exactly, and one further back than
/// the rings' rows beyond the window is refused.
#[test]
fn inkling_sliding_rings_wrap_and_rewind() {
    use mference_models::inkling::REWIND_REACH;
    let f = fixture("B");
    let n = 48 + 64 + REWIND_REACH + 60; // past the wrap of 64-row-chunk rings
    let seq: Vec<u32> = (0..n)
        .map(|i| f.prompt[i % 300] ^ (i / 300) as u32)
        .collect();
    let tail = |chunk: usize, ctx: usize| {
        let o = LoadOptions {
            max_context: ctx,
            ..opts32(chunk)
        };
        let mut m = load(&f.install, &o).unwrap();
        let Logits::Rows(r) = m.forward(&seq, Want::Tail(100)).unwrap() else {
            panic!("expected rows")
        };
        r
    };
    let ring = tail(64, 4096);
    // Chunks of 128 make the rings 48 + 128 + REWIND_REACH rows, which covers the whole context.
    let linear = tail(128, 48 + 128 + REWIND_REACH);
    check_exact(
        "B ring vs linear sliding KV, last 100 rows",
        &ring,
        &linear,
        f.vocab,
    );

    let o = LoadOptions {
        max_context: 4096,
        ..opts32(64)
    };
    let rows = |m: &mut Box<dyn mference_models::Model>, t: &[u32]| match m.forward(t, Want::All) {
        Ok(Logits::Rows(r)) => r,
        _ => panic!("expected rows"),
    };
    let c = n - 100;
    let mut fresh = load(&f.install, &o).unwrap();
    fresh.forward(&seq[..c], Want::None).unwrap();
    let want = rows(&mut fresh, &seq[..40]);
    let mut m = load(&f.install, &o).unwrap();
    m.forward(&seq[..c], Want::None).unwrap();
    m.checkpoint();
    m.forward(&seq[c..], Want::None).unwrap();
    assert_eq!(m.rewind_point(n - 1), c);
    assert!(
        m.truncate(c),
        "a rewind of 100 positions over wrapped rings was refused"
    );
    assert!(
        rows(&mut m, &seq[..40]) == want,
        "logits after the rewind differ"
    );
    // A checkpoint further back than the rings' rows beyond the window (a chunk + REWIND_REACH).
    let mut m = load(&f.install, &o).unwrap();
    m.forward(&seq[..50], Want::None).unwrap();
    m.checkpoint();
    m.forward(&seq[50..50 + 64 + REWIND_REACH + 10], Want::None)
        .unwrap();
    assert_eq!(m.rewind_point(60), 0);
    assert!(
        !m.truncate(50),
        "a rewind past the rings' reach was accepted"
    );
}

/// The flat `inkling` model_type, which the installer has always accepted, also loads (the
/// loader used to refuse it after the install succeeded) and gives fixture A's logits.
#[test]
fn inkling_flat_model_type_loads() {
    let dir = repo().join("assets/fixtures/inkling/A");
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("checkpoint");
    std::fs::create_dir(&src).unwrap();
    for e in std::fs::read_dir(dir.join("checkpoint")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    let cfg_path = src.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = "inkling".into();
    std::fs::write(&cfg_path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
    let install = install(&src, work.path());
    let f = fixture("A");
    let ours = prefill_all(&install, &f.prompt, &f32_kv(f.prompt.len()));
    check_exact("A as `inkling`", &ours, &f.prefill, f.vocab);
}
