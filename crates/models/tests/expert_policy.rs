//! The host expert-cache policies (`--expert-cache-policy lfu|lru|pool`) decide only which expert
//! bytes stay cached, never the arithmetic. On the bundled trained tiny models, under budgets
//! small enough to force misses (top-k and 2 x top-k slots per layer, pread and O_DIRECT):
//! greedy 64-token continuations equal mlx-lm's committed ids (`tools/ref/reference-values.json`,
//! produced by tools/ref/compute_reference_values.py) under every policy, and the logits of every
//! position are bit-identical across the policies.

mod common;

use common::*;
use mference_runtime::{CacheSlots, ExpertPolicy};

fn check(model: &str) {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = install(&repo().join("assets/models").join(model), work.path());
    let r = &reference_values()["models"][model];
    let top_k = 4; // both tiny models route to 4 of 16 experts
    for (slots, direct_io) in [
        (CacheSlots::Fixed(top_k), false),
        (CacheSlots::Fixed(2 * top_k), true),
    ] {
        let with = |policy: ExpertPolicy| {
            let mut o = opts(16, 512);
            o.slots = slots;
            o.direct_io = direct_io;
            o.expert_policy = policy;
            o
        };
        for case in ["greedy64_raw_prompt", "greedy64_chat"] {
            let prompt = json_ids(&r[case]["prompt_ids"]);
            let want = json_ids(&r[case]["generated_ids"]);
            let mut logits: Vec<(ExpertPolicy, Vec<f32>)> = Vec::new();
            for policy in ExpertPolicy::ALL {
                let o = with(policy);
                let mut m = mference_models::load(&inst, &o).unwrap();
                let got = greedy(m.as_mut(), &prompt, want.len());
                assert_eq!(
                    got, want,
                    "{model} {case}, {slots:?}, direct_io {direct_io}, policy {}: greedy ids differ \
                     from mlx-lm",
                    policy.name()
                );
                let misses: u64 = m.expert_stats().iter().map(|s| s.misses).sum();
                let hits: u64 = m.expert_stats().iter().map(|s| s.hits).sum();
                assert!(
                    misses > 0 && hits > 0,
                    "{model} policy {}: {hits} hits, {misses} misses; the budget forces both",
                    policy.name()
                );
                // Every position's logits: the prompt and its continuation, prefilled in chunks
                // of 16 (tiles, evictions between chunks) and then decoded one token at a time.
                let mut all = prompt.clone();
                all.extend(&want);
                let mut rows = prefill_all(&inst, &all, &o);
                rows.extend(decode_all(&inst, &all[..24], &o));
                logits.push((policy, rows));
            }
            let (p0, base) = &logits[0];
            for (p, rows) in &logits[1..] {
                assert!(
                    rows == base,
                    "{model} {case}, {slots:?}: logits under policy {} differ from policy {}",
                    p.name(),
                    p0.name()
                );
            }
        }
    }
}

#[test]
fn gemma4_tiny_every_policy_matches_mlx_lm_bit_identically() {
    check("gemma4-tiny");
}

#[test]
fn qwen3_6_tiny_every_policy_matches_mlx_lm_bit_identically() {
    check("qwen3_6-tiny");
}
