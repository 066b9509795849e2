//! Maple parity with the golden fixtures `assets/fixtures/maple/{A,B}` (deepgrove `maple.py` with
//! every float parameter cast to fp32, cross-checked by an independent float64 numpy
//! implementation; see each case's README). The fixture checkpoints go through the real installer.
//!
//! Exact configuration (f32 activations, FP32 KV): full-prompt prefill, token-by-token decode and
//! chunked prefill (1, 7, 64, 128) within the fixture tolerance (|Δ| ≤ 1e-4 elementwise) with the
//! same argmax at every position, and the 32 greedy ids equal the reference's. The default FP16 KV
//! is measured and reported; slot counts never change a bit.

mod common;

use common::*;
use mference_models::{load, LoadOptions};
use mference_runtime::KvDtype;
use mference_testkit::{argmax, read_npy_f32};
use std::path::{Path, PathBuf};

/// The fixtures' recommended elementwise tolerance (README "Recommended tolerance").
const ATOL: f32 = 1e-4;

struct Case {
    _work: tempfile::TempDir,
    inst: PathBuf,
    prompt: Vec<u32>,
    prefill: Vec<f32>,
    decode: Vec<f32>,
    greedy: Vec<u32>,
    vocab: usize,
}

fn fixture(case: &str) -> PathBuf {
    repo().join("assets/fixtures/maple").join(case)
}

fn ids(path: &Path) -> Vec<u32> {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn case(name: &str) -> Case {
    let dir = fixture(name);
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = install(&dir.join("checkpoint"), work.path());
    let prompt = ids(&dir.join("prompt_ids.json"));
    let ((rows, vocab), prefill) = read_npy_f32(&dir.join("logits_prefill_f32.npy"));
    let (shape, decode) = read_npy_f32(&dir.join("logits_decode_f32.npy"));
    assert_eq!((rows, vocab), shape);
    assert_eq!(rows, prompt.len());
    Case {
        _work: work,
        inst,
        prompt,
        prefill,
        decode,
        greedy: ids(&dir.join("greedy_ids.json")),
        vocab,
    }
}

/// f32 activations and FP32 KV, prefill chunks of `chunk` rows.
fn exact(chunk: usize) -> LoadOptions {
    LoadOptions {
        kv_dtype: KvDtype::F32,
        ..opts(chunk, 512)
    }
}

/// Largest |Δ| and the number of positions whose argmax differs.
fn diff(ours: &[f32], reference: &[f32], vocab: usize) -> (f32, usize) {
    assert_eq!(ours.len(), reference.len());
    let max = ours
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let flips = ours
        .chunks_exact(vocab)
        .zip(reference.chunks_exact(vocab))
        .filter(|(o, r)| argmax(o) != argmax(r))
        .count();
    (max, flips)
}

fn check_exact(label: &str, ours: &[f32], reference: &[f32], vocab: usize) {
    let (max, flips) = diff(ours, reference, vocab);
    eprintln!("{label}: max |Δ| {max:.3e}, argmax differs at {flips} positions");
    assert!(
        max <= ATOL && max.is_finite(),
        "{label}: max |Δ| {max} > {ATOL}"
    );
    assert_eq!(flips, 0, "{label}: argmax differs at {flips} positions");
}

fn exact_configuration(name: &str) {
    let c = case(name);
    let n = c.prompt.len();
    let v = c.vocab;
    let full = prefill_all(&c.inst, &c.prompt, &exact(n));
    check_exact(&format!("{name} prefill (one call)"), &full, &c.prefill, v);
    let dec = decode_all(&c.inst, &c.prompt, &exact(128));
    check_exact(&format!("{name} decode"), &dec, &c.decode, v);
    for chunk in [1, 7, 64, 128] {
        let ours = prefill_all(&c.inst, &c.prompt, &exact(chunk));
        check_exact(
            &format!("{name} prefill chunk {chunk}"),
            &ours,
            &c.prefill,
            v,
        );
    }
    let mut m = load(&c.inst, &exact(128)).unwrap();
    let got = greedy(m.as_mut(), &c.prompt, c.greedy.len());
    assert_eq!(
        got, c.greedy,
        "{name}: greedy ids differ from the reference"
    );
}

#[test]
fn maple_a_exact_configuration_matches_the_reference() {
    exact_configuration("A");
}

#[test]
fn maple_b_exact_configuration_matches_the_reference() {
    exact_configuration("B");
}

/// The default FP16 KV cache: measured against the fp32 reference and reported (argmax agreement,
/// worst |Δ|); the greedy ids must still be the reference's.
#[test]
fn maple_default_f16_kv_against_the_reference() {
    for name in ["A", "B"] {
        let c = case(name);
        let o = opts(128, 512);
        assert_eq!(o.kv_dtype, KvDtype::F16);
        let ours = prefill_all(&c.inst, &c.prompt, &o);
        let (max, flips) = diff(&ours, &c.prefill, c.vocab);
        let rows = c.prompt.len();
        let agree = (rows - flips) as f64 / rows as f64;
        eprintln!(
            "{name} f16 KV prefill: max |Δ| {max:.3e}, argmax agreement {:.2}% ({flips} of {rows} differ)",
            agree * 100.0
        );
        assert!(agree >= 0.99, "{name}: f16 KV argmax agreement {agree}");
        let mut m = load(&c.inst, &o).unwrap();
        let got = greedy(m.as_mut(), &c.prompt, c.greedy.len());
        let same = got.iter().zip(&c.greedy).filter(|(a, b)| a == b).count();
        eprintln!("{name} f16 KV greedy: {same}/{} ids equal", c.greedy.len());
    }
}

/// Slot count, resident mode and O_DIRECT change where expert bytes come from, never the math.
#[test]
fn maple_outputs_identical_across_slots_and_direct_io() {
    let c = case("A");
    assert_slot_invariance(&c.inst, &c.prompt[..200]);
}

/// FlashHead (`--flash-head`, opt-in): the first id from the prefill's exact head, then 31
/// single-token FlashHead steps, equal to `maple.py`'s FlashHead ids (which differ from the exact
/// greedy ids on this random model); multi-token calls keep the exact head.
#[test]
fn maple_b_flash_head_greedy_matches_the_reference() {
    let c = case("B");
    let want = ids(&fixture("B").join("greedy_ids_flashhead.json"));
    for kv in [KvDtype::F32, KvDtype::F16] {
        let o = LoadOptions {
            flash_head: true,
            kv_dtype: kv,
            ..opts(128, 512)
        };
        let mut m = load(&c.inst, &o).unwrap();
        let got = greedy(m.as_mut(), &c.prompt, want.len());
        assert_eq!(
            got, want,
            "{kv:?}: FlashHead greedy ids differ from the reference"
        );
        assert_ne!(
            got, c.greedy,
            "the fixture's FlashHead ids differ from exact ones"
        );
    }
    let o = LoadOptions {
        flash_head: true,
        ..exact(128)
    };
    let full = prefill_all(&c.inst, &c.prompt, &o);
    check_exact("B prefill with --flash-head", &full, &c.prefill, c.vocab);
    // A has no FlashHead tensors: refused at load, naming the option.
    let a = case("A");
    let err = load(&a.inst, &o)
        .err()
        .expect("A has no FlashHead")
        .to_string();
    assert!(err.contains("--flash-head"), "{err}");
}
