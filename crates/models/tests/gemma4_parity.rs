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

/// A fresh random checkpoint of `shape` built with mlx-lm and installed: (work dir, source, install).
fn build(shape: &Shape, seed: u64) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("src");
    let vocab = VOCAB.to_string();
    let mut args = shape.args.to_vec();
    args.extend_from_slice(&["--vocab-size", &vocab, "--no-tokenizer"]);
    make_tiny("gemma4", seed, &src, &args);
    let inst = install(&src, work.path());
    (work, src, inst)
}

fn run_shape(shape: &Shape, seed: u64) {
    let (work, src, inst) = build(shape, seed);
    check_against_reference(shape.name, &src, &inst, work.path(), seed, PROMPT, VOCAB);
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
    let (_work, _src, inst) = build(&SHAPES[1], seed);
    assert_slot_invariance(&inst, &random_prompt(seed, 200, VOCAB));
}
