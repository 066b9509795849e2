//! Qwen 3.6 (`qwen3_5_moe`) parity with mlx-lm (float32 reference) on tiny random checkpoints built
//! with fresh seeds on every run and installed through the real installer, plus the bundled trained
//! checkpoint `assets/models/qwen3_6-tiny` (issue 7).

mod common;

use common::*;
use mference_models::{load, Logits, Want};

const VOCAB: usize = 4096;
const PROMPT: usize = 320;

struct Shape {
    name: &'static str,
    args: &'static [&'static str],
}

/// Only DeltaNet layers (no attention to mask a state bug): for the chunked-prefill test, which
/// needs no reference.
const DELTANET_ONLY: Shape = Shape {
    name: "deltanet-only",
    args: &[
        "--hidden",
        "64",
        "--layers",
        "3",
        "--layer-types",
        "LLL",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--moe-intermediate",
        "64",
        "--intermediate",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "64",
        "--linear-head-dim",
        "32",
        "--linear-k-heads",
        "2",
        "--linear-v-heads",
        "4",
    ],
};

/// Several shapes: one and two DeltaNet+attention blocks (mlx-lm places full attention at every
/// `full_attention_interval` = 4th layer), GQA 2:1 and 4:1 in the DeltaNet value heads, top-k 2/4/8,
/// a model ending in three DeltaNet layers after its only attention layer with 1:1 DeltaNet heads
/// (mlx-lm cannot run a model without any attention layer), a wider one with 128-dim DeltaNet
/// heads, and one whose attention, DeltaNet and expert shapes are the 35B-A3B's (16/2 × 256
/// attention heads, 16/32 × 128 DeltaNet heads, top-8 of width 512) at hidden 1024.
const SHAPES: [Shape; 5] = [
    Shape {
        name: "lllf-topk2",
        args: &[
            "--hidden",
            "64",
            "--layers",
            "4",
            "--layer-types",
            "LLLF",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--moe-intermediate",
            "64",
            "--intermediate",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "64",
            "--linear-head-dim",
            "32",
            "--linear-k-heads",
            "2",
            "--linear-v-heads",
            "4",
        ],
    },
    Shape {
        name: "two-blocks-topk4",
        args: &[
            "--hidden",
            "128",
            "--layers",
            "8",
            "--layer-types",
            "LLLF",
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
            "64",
            "--linear-head-dim",
            "32",
            "--linear-k-heads",
            "2",
            "--linear-v-heads",
            "8",
        ],
    },
    Shape {
        name: "deltanet-heavy",
        args: &[
            "--hidden",
            "64",
            "--layers",
            "7",
            "--layer-types",
            "LLLFLLL",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--moe-intermediate",
            "64",
            "--intermediate",
            "64",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "64",
            "--linear-head-dim",
            "64",
            "--linear-k-heads",
            "2",
            "--linear-v-heads",
            "2",
        ],
    },
    Shape {
        name: "wide-heads-topk8",
        args: &[
            "--hidden",
            "256",
            "--layers",
            "4",
            "--layer-types",
            "LLLF",
            "--experts",
            "16",
            "--top-k",
            "8",
            "--moe-intermediate",
            "64",
            "--intermediate",
            "128",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "128",
            "--linear-head-dim",
            "128",
            "--linear-k-heads",
            "2",
            "--linear-v-heads",
            "4",
        ],
    },
    Shape {
        name: "35b-layer-dims",
        args: &[
            "--hidden",
            "1024",
            "--layers",
            "4",
            "--layer-types",
            "LLLF",
            "--experts",
            "16",
            "--top-k",
            "8",
            "--moe-intermediate",
            "512",
            "--intermediate",
            "512",
            "--heads",
            "16",
            "--kv-heads",
            "2",
            "--head-dim",
            "256",
            "--linear-head-dim",
            "128",
            "--linear-k-heads",
            "16",
            "--linear-v-heads",
            "32",
        ],
    },
];

/// A fresh random checkpoint of `shape`, installed: (work dir, source dir, install dir, seed).
fn build(
    shape: &Shape,
    seed: u64,
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
    u64,
) {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = work.path().join("src");
    let vocab = VOCAB.to_string();
    let mut args = shape.args.to_vec();
    args.extend_from_slice(&["--vocab-size", &vocab, "--no-tokenizer"]);
    make_tiny("qwen36", seed, &src, &args);
    let inst = install(&src, work.path());
    (work, src, inst, seed)
}

fn run_shape(shape: &Shape, seed: u64) {
    let (work, src, inst, seed) = build(shape, seed);
    check_against_reference(shape.name, &src, &inst, work.path(), seed, PROMPT, VOCAB);
}

#[test]
fn qwen36_one_block_top_k_2() {
    with_near_tie_retry(0, |seed| run_shape(&SHAPES[0], seed));
}

#[test]
fn qwen36_two_blocks_top_k_4() {
    with_near_tie_retry(1, |seed| run_shape(&SHAPES[1], seed));
}

#[test]
fn qwen36_deltanet_heavy() {
    with_near_tie_retry(2, |seed| run_shape(&SHAPES[2], seed));
}

#[test]
fn qwen36_wide_heads_top_k_8() {
    with_near_tie_retry(3, |seed| run_shape(&SHAPES[3], seed));
}

#[test]
fn qwen36_35b_layer_dims() {
    with_near_tie_retry(5, |seed| run_shape(&SHAPES[4], seed));
}

/// Chunked prefill carries the DeltaNet conv and recurrent states across chunks exactly as
/// token-by-token decode does: every position's logits agree for chunk sizes 1, 7, 64 and 128.
/// With the scalar kernels (whose GEMM computes every row exactly as GEMV does) they are
/// bit-identical. With the SIMD kernels the batched-vs-single-row rounding of the matrix products
/// can flip a router near-tie, so that comparison uses the parity budget (1e-2 per row, a row over
/// it excused only at a traced near-tie, ≥ 99% top-1).
#[test]
fn qwen36_chunked_prefill_equals_decode() {
    with_near_tie_retry(10, |seed| chunked_equals_decode(&DELTANET_ONLY, seed));
    with_near_tie_retry(11, |seed| chunked_equals_decode(&SHAPES[1], seed));
}

fn chunked_equals_decode(shape: &Shape, seed: u64) {
    let (_work, _src, inst, seed) = build(shape, seed);
    let prompt = random_prompt(seed, 300, VOCAB);
    let scalar = |chunk| {
        let mut o = opts32(chunk);
        o.kernels = Some("scalar".into());
        o
    };
    let decode = decode_all(&inst, &prompt, &scalar(128));
    for chunk in [1, 7, 64, 128] {
        let ours = prefill_all(&inst, &prompt, &scalar(chunk));
        assert!(
            ours == decode,
            "{} chunk {chunk}: scalar-kernel prefill is not bit-identical to decode",
            shape.name
        );
    }
    let (decode, margins) = decode_traced(&inst, &prompt, &opts32(128));
    for chunk in [1, 7, 64, 128] {
        let (ours, chunk_margins) = prefill_traced(&inst, &prompt, &opts32(chunk));
        let margins: Vec<f32> = margins
            .iter()
            .zip(&chunk_margins)
            .map(|(a, b)| a.min(*b))
            .collect();
        let label = format!("{} chunk {chunk} vs decode", shape.name);
        check_strict(&label, &ours, &decode, VOCAB, &margins, 0);
    }
    // Decoding on after a chunked prefill continues the same state.
    let mut m = load(&inst, &opts32(64)).unwrap();
    m.forward(&prompt[..250], Want::None).unwrap();
    let Logits::Rows(tail) = m.forward(&prompt[250..], Want::All).unwrap() else {
        panic!("expected rows")
    };
    let label = format!("{}: prefill then continue", shape.name);
    check_strict(&label, &tail, &decode[250 * VOCAB..], VOCAB, &margins, 250);
    // truncate(0) starts over from empty states.
    assert!(!m.truncate(100), "a DeltaNet state cannot be rewound");
    assert!(m.truncate(0));
    let Logits::Rows(again) = m.forward(&prompt, Want::All).unwrap() else {
        panic!("expected rows")
    };
    let fresh = prefill_all(&inst, &prompt, &opts32(64));
    assert!(again == fresh, "{}: truncate(0) did not reset", shape.name);
}

/// Slot count, resident mode and O_DIRECT change where expert bytes come from, never the math.
#[test]
fn qwen36_outputs_identical_across_slots_and_direct_io() {
    let (_work, _src, inst, seed) = build(&SHAPES[1], fresh_seed(4));
    assert_slot_invariance(&inst, &random_prompt(seed, 200, VOCAB));
}

/// The bundled trained checkpoint (`assets/models/qwen3_6-tiny`, vocab 248320) with the default
/// FP16 KV cache: perplexity within 0.3% of mlx-lm's (llama-perplexity protocol, first 8192 tokens
/// of Pride and Prejudice, ctx 512, same token ids), logits of a 256-token window per the FP16
/// criterion, and mlx-lm's greedy 64-token continuation of the README prompt.
///
/// Our NLL is summed in f64. perplexity.py takes `mx.logsumexp` in f32 over the 248320 logits,
/// which on the CPU comes out ~0.9e-3 nat/token low (measured on chunk 1 against an f64
/// log-sum-exp of the same mlx logits), so the two perplexities differ by ~0.09% even though the
/// logits agree to ~1e-6 (FP32 KV).
#[test]
fn qwen36_trained_tiny_checkpoint() {
    let src = repo().join("assets/models/qwen3_6-tiny");
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = install(&src, work.path());
    let text = repo().join("assets/austen_pride_and_prejudice.txt");

    // Token ids exactly as tools/ref/perplexity.py makes them (HF tokenizers, no special tokens).
    let ids_file = work.path().join("ids.json");
    let out = std::process::Command::new(python())
        .args([
            "-c",
            "import json, sys\nfrom tokenizers import Tokenizer\n\
             t = Tokenizer.from_file(sys.argv[1])\n\
             ids = t.encode(open(sys.argv[2], encoding='utf-8').read(), add_special_tokens=False).ids\n\
             json.dump(ids[:8192], open(sys.argv[3], 'w'))",
        ])
        .arg(repo().join("assets/tokenizers/qwen3_6/tokenizer.json"))
        .arg(&text)
        .arg(&ids_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ids: Vec<u32> = serde_json::from_slice(&std::fs::read(&ids_file).unwrap()).unwrap();
    assert_eq!(ids.len(), 8192);

    let mut m = load(&inst, &opts(128, 512)).unwrap();
    let vocab = m.vocab_size();
    let (ctx, first) = (512, 256);
    let (mut nll, mut count) = (0.0f64, 0usize);
    for chunk in ids.chunks_exact(ctx) {
        assert!(m.truncate(0));
        let Logits::Rows(logits) = m.forward(chunk, Want::All).unwrap() else {
            panic!("expected rows")
        };
        for j in first..ctx - 1 {
            let row = &logits[j * vocab..(j + 1) * vocab];
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = mx + row.iter().map(|&z| (z as f64 - mx).exp()).sum::<f64>().ln();
            nll += lse - row[chunk[j + 1] as usize] as f64;
            count += 1;
        }
    }
    // mlx-lm's value (tools/ref/reference-values.json, with the command that made it).
    mference_testkit::assert_perplexity_near("qwen3_6-tiny", (nll / count as f64).exp(), 3e-3);

    // All-position logits of one window.
    let window = &ids[..256];
    let (reference, v) = ref_logits(&src, window, work.path());
    assert_eq!(v, vocab);
    let ours = prefill_all(&inst, window, &opts(64, 512));
    check_f16("qwen3_6-tiny window", &ours, &reference, v);
    drop((reference, ours));

    // README prompt "It is a truth universally acknowledged, that" (no BOS).
    let prompt = [2064, 369, 264, 7793, 58391, 24687, 11, 421];
    let want = ref_greedy(&src, &prompt, 64, work.path());
    let mut m = load(&inst, &opts(128, 512)).unwrap();
    assert_eq!(
        greedy(m.as_mut(), &prompt, 64),
        want,
        "greedy 64 differs from mlx-lm"
    );
}

/// A checkpoint lets a server reuse a conversation prefix on a DeltaNet model: cutting back to it
/// restores the recurrent states and the attention KV, and what runs next is bit-identical to a
/// model that only ever saw the prefix. Cuts anywhere else are refused without changing anything,
/// and a restart forgets the checkpoint.
#[test]
fn qwen36_checkpoint_rewinds_exactly() {
    let (_work, _src, inst, seed) = build(&SHAPES[1], fresh_seed(12));
    let prompt = random_prompt(seed, 300, VOCAB);
    let other = random_prompt(seed ^ 0x5555, 60, VOCAB);
    let o = opts32(64);
    let rows = |m: &mut Box<dyn mference_models::Model>, t: &[u32]| match m.forward(t, Want::All) {
        Ok(Logits::Rows(r)) => r,
        _ => panic!("expected rows"),
    };
    let mut fresh = load(&inst, &o).unwrap();
    fresh.forward(&prompt[..180], Want::None).unwrap();
    let want = rows(&mut fresh, &other);

    let mut m = load(&inst, &o).unwrap();
    m.forward(&prompt[..180], Want::None).unwrap();
    m.checkpoint();
    let past = rows(&mut m, &prompt[180..]);
    assert_eq!(m.rewind_point(250), 180);
    assert_eq!(m.rewind_point(179), 0);
    assert_eq!(m.rewind_point(400), 300);
    assert!(
        !m.truncate(250),
        "a cut between the checkpoint and the end was accepted"
    );
    assert_eq!(m.position(), 300, "a refused cut changed the position");
    assert!(m.truncate(180));
    assert!(
        rows(&mut m, &other) == want,
        "logits after the rewind differ from a fresh run"
    );
    // Rewinding to the same checkpoint again, then replaying the original continuation.
    assert!(m.truncate(180));
    assert!(
        rows(&mut m, &prompt[180..]) == past,
        "replay after a second rewind differs"
    );
    // A restart forgets the checkpoint: its states described a prefix that is gone.
    assert!(m.truncate(0));
    m.forward(&prompt[..200], Want::None).unwrap();
    assert_eq!(m.rewind_point(190), 0);
    assert!(!m.truncate(180));
}
