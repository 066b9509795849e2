//! The trained tiny Gemma 4 (`assets/models/gemma4-tiny`) against mlx-lm (float32 reference) with
//! the shipped defaults (FP16 KV cache): greedy 64-token continuations identical to the committed
//! reference ids (`tools/ref/reference-values.json`, produced by tools/ref/compute_reference_values.py),
//! and every position of a 320-token real-text prompt within budget of a live mlx-lm run.
//! Perplexity is checked end to end through the CLI (`crates/cli/tests/e2e.rs`).

mod common;

use common::*;
use mference_runtime::{CacheSlots, KvDtype};

#[test]
fn gemma4_tiny_greedy_64_matches_mlx_lm() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = install(&repo().join("assets/models/gemma4-tiny"), work.path());
    let r = &reference_values()["models"]["gemma4-tiny"];
    for case in ["greedy64_raw_prompt", "greedy64_chat"] {
        let prompt = json_ids(&r[case]["prompt_ids"]);
        let want = json_ids(&r[case]["generated_ids"]);
        for slots in [
            CacheSlots::Fixed(8),
            CacheSlots::Fixed(16),
            CacheSlots::Resident,
        ] {
            let mut o = opts(128, 512);
            o.slots = slots;
            let mut m = mference_models::load(&inst, &o).unwrap();
            let got = greedy(m.as_mut(), &prompt, want.len());
            assert_eq!(
                got, want,
                "{case} with {slots:?}: greedy ids differ from mlx-lm"
            );
        }
    }
}

#[test]
fn gemma4_tiny_logits_match_mlx_lm_at_every_position() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = repo().join("assets/models/gemma4-tiny");
    let inst = install(&src, work.path());
    // 320 tokens of the eval text (a passage past the first chunk), BOS first.
    let text =
        std::fs::read_to_string(repo().join("assets/austen_pride_and_prejudice.txt")).unwrap();
    let passage: String = text.chars().skip(5000).take(4000).collect();
    let tf = work.path().join("passage.txt");
    std::fs::write(&tf, &passage).unwrap();
    let out = std::process::Command::new(python())
        .args([
            repo().join("tools/ref/encode.py").to_str().unwrap(),
            "--model",
            src.to_str().unwrap(),
            "--text",
            &passage,
            "--bos",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut prompt = json_ids(&v["prompt"]);
    assert!(prompt.len() >= 320, "passage too short: {}", prompt.len());
    prompt.truncate(320);
    let (reference, vocab) = ref_logits(&src, &prompt, work.path());

    for chunk in [7, 64, 128] {
        let ours = prefill_all(&inst, &prompt, &opts(chunk, 512));
        check_f16(
            &format!("gemma4-tiny prefill chunk {chunk}"),
            &ours,
            &reference,
            vocab,
        );
        let mut o = opts(chunk, 512);
        o.kv_dtype = KvDtype::F32;
        let ours = prefill_all(&inst, &prompt, &o);
        let (rel, agree) = compare(&ours, &reference, vocab);
        eprintln!(
            "gemma4-tiny prefill chunk {chunk} (f32 KV): max {rel:.2e}, top-1 {:.2}%",
            agree * 100.0
        );
        assert!(
            rel <= 1e-2 && agree >= 0.99,
            "f32 KV: rel {rel}, agreement {agree}"
        );
    }
    let ours = decode_all(&inst, &prompt, &opts(128, 512));
    check_f16("gemma4-tiny decode", &ours, &reference, vocab);
}
