//! Gemma 4 parity with mlx-lm (float32 reference) on tiny random checkpoints built with fresh
//! seeds on every run, installed through the real installer (issue: "Gemma 4 on CPU", item 8).

mod common;

use common::*;

const VOCAB: usize = 4096;
const PROMPT: usize = 320;

struct Shape {
    name: &'static str,
    args: &'static [&'static str],
}

/// Several shapes: a sliding window shorter than the prompt (the ring wraps), one and two
/// full-attention layers, top-k 2 and 4, K = V and separate V on full layers.
const SHAPES: [Shape; 3] = [
    Shape {
        name: "one-full-topk2",
        args: &[
            "--hidden",
            "64",
            "--layers",
            "4",
            "--layer-types",
            "SSSF",
            "--sliding-window",
            "16",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--moe-intermediate",
            "64",
            "--intermediate",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--global-head-dim",
            "64",
            "--global-kv-heads",
            "1",
        ],
    },
    Shape {
        name: "two-full-topk4",
        args: &[
            "--hidden",
            "64",
            "--layers",
            "5",
            "--layer-types",
            "SSFSF",
            "--sliding-window",
            "24",
            "--experts",
            "16",
            "--top-k",
            "4",
            "--moe-intermediate",
            "64",
            "--intermediate",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--global-head-dim",
            "64",
            "--global-kv-heads",
            "2",
        ],
    },
    Shape {
        name: "wide-no-k-eq-v",
        args: &[
            "--hidden",
            "256",
            "--layers",
            "3",
            "--layer-types",
            "SFS",
            "--sliding-window",
            "32",
            "--experts",
            "8",
            "--top-k",
            "4",
            "--moe-intermediate",
            "128",
            "--intermediate",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "1",
            "--head-dim",
            "64",
            "--global-head-dim",
            "128",
            "--global-kv-heads",
            "1",
            "--no-k-eq-v",
        ],
    },
];

fn opts32(chunk: usize) -> mference_models::LoadOptions {
    let mut o = opts(chunk, 512);
    o.kv_dtype = mference_runtime::KvDtype::F32;
    o
}

fn run_shape(shape: &Shape, seed: u64) {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("src");
    let vocab = VOCAB.to_string();
    let mut args = shape.args.to_vec();
    args.extend_from_slice(&["--vocab-size", &vocab, "--no-tokenizer"]);
    make_tiny("gemma4", seed, &src, &args);
    let inst = install(&src, work.path());
    let prompt = random_prompt(seed, PROMPT, VOCAB);
    let (reference, v) = ref_logits(&src, &prompt, work.path());
    assert_eq!(v, VOCAB);

    for chunk in [7, 64, 128] {
        let (ours, margins) = prefill_traced(&inst, &prompt, &opts32(chunk));
        check_strict(
            &format!("{} prefill chunk {chunk}", shape.name),
            &ours,
            &reference,
            v,
            &margins,
            0,
        );
    }
    let (ours, margins) = decode_traced(&inst, &prompt, &opts32(128));
    check_strict(
        &format!("{} decode", shape.name),
        &ours,
        &reference,
        v,
        &margins,
        0,
    );

    let want = ref_greedy(&src, &prompt[..PROMPT / 4], 64, work.path());
    check_greedy(shape.name, &inst, &opts32(64), &prompt[..PROMPT / 4], &want);
}

#[test]
fn gemma4_one_full_layer_top_k_2() {
    with_near_tie_retry(0, |seed| run_shape(&SHAPES[0], seed));
}

#[test]
fn gemma4_two_full_layers_top_k_4() {
    with_near_tie_retry(1, |seed| run_shape(&SHAPES[1], seed));
}

#[test]
fn gemma4_separate_v_projection() {
    with_near_tie_retry(2, |seed| run_shape(&SHAPES[2], seed));
}

/// Slot count, resident mode and O_DIRECT change where expert bytes come from, never the math.
#[test]
fn gemma4_outputs_identical_across_slots_and_direct_io() {
    let seed = fresh_seed(3);
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("src");
    let vocab = VOCAB.to_string();
    let mut args = SHAPES[1].args.to_vec();
    args.extend_from_slice(&["--vocab-size", &vocab, "--no-tokenizer"]);
    make_tiny("gemma4", seed, &src, &args);
    let inst = install(&src, work.path());
    assert_slot_invariance(&inst, &random_prompt(seed, 200, VOCAB));
}
