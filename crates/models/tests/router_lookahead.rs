//! The router lookahead (`--router-lookahead N`, Gemma 4 and Qwen 3.6) on the bundled trained tiny
//! checkpoints (`assets/models/{gemma4-tiny,qwen3_6-tiny}`: 16 experts, top-4), with 8 slots per
//! layer so that misses are forced:
//! - it changes no output: the decode logits are bit-identical with it off and on (pread and
//!   O_DIRECT), and greedy 64 equals mlx-lm's committed ids (`tools/ref/reference-values.json`);
//! - its accuracy where the routing is real: teacher-forced decode over the Austen text
//!   (`assets/austen_pride_and_prejudice.txt`), N = 1, 2, 4, printed as a table (run with
//!   `--nocapture`; docs/BENCHMARKS.md has the numbers).

mod common;

use common::*;
use mference_models::{LoadOptions, Logits, Model, Want};
use mference_runtime::{CacheSlots, StreamerStats};

const MODELS: [&str; 2] = ["gemma4-tiny", "qwen3_6-tiny"];

fn reference(model: &str) -> serde_json::Value {
    let p = repo().join("tools/ref/reference-values.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v["models"][model].clone()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn options(lookahead: usize, direct_io: bool) -> LoadOptions {
    let mut o = opts(128, 2048);
    o.slots = CacheSlots::Fixed(8);
    o.direct_io = direct_io;
    o.router_lookahead = lookahead;
    o
}

/// The counters of every layer after the first (layer 0 has no layer before it to predict from).
fn predicted_layers(m: &dyn Model) -> StreamerStats {
    let mut total = StreamerStats::default();
    for s in m.expert_stats().iter().skip(1) {
        total.add(s);
    }
    total
}

/// Decode logits of every position of `tokens`, one token per step, and the counters.
fn decode(inst: &std::path::Path, tokens: &[u32], o: &LoadOptions) -> (Vec<f32>, StreamerStats) {
    let mut m = mference_models::load(inst, o).expect("load");
    let mut all = Vec::new();
    for &t in tokens {
        match m.forward(&[t], Want::Last).expect("forward") {
            Logits::Rows(r) => all.extend(r),
            other => panic!("unexpected {other:?}"),
        }
    }
    (all, predicted_layers(m.as_ref()))
}

#[test]
fn lookahead_changes_no_output_and_greedy_matches_mlx_lm() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    for model in MODELS {
        let dir = work.path().join(model);
        std::fs::create_dir_all(&dir).unwrap();
        let inst = install(&repo().join("assets/models").join(model), &dir);
        let r = &reference(model)["greedy64_raw_prompt"];
        let (prompt, want) = (ids(&r["prompt_ids"]), ids(&r["generated_ids"]));
        // The prompt and mlx-lm's continuation, decoded one token at a time.
        let tokens: Vec<u32> = prompt.iter().chain(&want).copied().collect();
        for direct_io in [false, true] {
            let (off, st_off) = decode(&inst, &tokens, &options(0, direct_io));
            assert_eq!(
                st_off.prefetch_reads, 0,
                "{model}: lookahead off read ahead"
            );
            assert!(st_off.misses > 0, "{model}: 8 slots forced no miss");
            for n in [1, 2, 4] {
                let (on, st) = decode(&inst, &tokens, &options(n, direct_io));
                eprintln!(
                    "{model} N={n} O_DIRECT {direct_io}: {} reads ahead, {} used; misses {} (off {})",
                    st.prefetch_reads, st.prefetch_used, st.misses, st_off.misses
                );
                assert!(
                    st.prefetch_reads > 0 && st.prefetch_used > 0,
                    "{model} N={n}: the lookahead did nothing: {st:?}"
                );
                let same = off.len() == on.len()
                    && off.iter().zip(&on).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{model} N={n} O_DIRECT {direct_io}: logits changed");
            }
        }
        let mut m = mference_models::load(&inst, &options(2, true)).unwrap();
        let got = greedy(m.as_mut(), &prompt, want.len());
        assert_eq!(
            got, want,
            "{model} lookahead 2: greedy ids differ from mlx-lm"
        );
        assert!(predicted_layers(m.as_ref()).prefetch_used > 0);
    }
}

/// The first `n` tokens of the Austen text by the install's tokenizer (`tokenizer/`).
fn austen(inst: &std::path::Path, n: usize) -> Vec<u32> {
    let text =
        std::fs::read_to_string(repo().join("assets/austen_pride_and_prejudice.txt")).unwrap();
    let passage: String = text.chars().take(8 * n).collect();
    let tok = mference_text::Tokenizer::from_dir(&inst.join("tokenizer")).expect("tokenizer");
    let mut ids = tok.encode(&passage, true).expect("encode");
    ids.truncate(n);
    assert_eq!(ids.len(), n, "the passage gave too few tokens");
    ids
}

/// Accuracy where the routing is real: the share of the reads started ahead that the router then
/// picked (precision), the share of the layers' would-be misses they covered (coverage: used /
/// (used + misses left)), and how many fewer demand misses are left than with the lookahead off
/// (a wrong guess takes a slot, so it can cause a miss later). Counted over layers 1.. of a
/// teacher-forced decode of 1,024 tokens.
#[test]
fn lookahead_accuracy_on_the_trained_tiny_models() {
    const TOKENS: usize = 1024;
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    eprintln!("| model | N | reads ahead / token | used / token | precision | misses / token (off) | coverage | misses cut |");
    eprintln!("|---|---|---|---|---|---|---|---|");
    for model in MODELS {
        let dir = work.path().join(model);
        std::fs::create_dir_all(&dir).unwrap();
        let inst = install(&repo().join("assets/models").join(model), &dir);
        let tokens = austen(&inst, TOKENS);
        let (_, off) = decode(&inst, &tokens, &options(0, false));
        let per = |x: u64| x as f64 / TOKENS as f64;
        for n in [1, 2, 4] {
            let (_, st) = decode(&inst, &tokens, &options(n, false));
            let precision = st.prefetch_used as f64 / st.prefetch_reads.max(1) as f64;
            let coverage = st.prefetch_used as f64 / (st.prefetch_used + st.misses).max(1) as f64;
            eprintln!(
                "| {model} | {n} | {:.2} | {:.2} | {:.1}% | {:.2} ({:.2}) | {:.1}% | {:.1}% |",
                per(st.prefetch_reads),
                per(st.prefetch_used),
                100.0 * precision,
                per(st.misses),
                per(off.misses),
                100.0 * coverage,
                100.0 * (1.0 - st.misses as f64 / off.misses.max(1) as f64)
            );
            // A guess among the uncached experts at random is right about top-k / experts of the
            // time (4 / 16 here): the real router must do better than that.
            assert!(
                precision > 0.25,
                "{model} N={n}: precision {precision} is no better than chance"
            );
        }
    }
}

/// The option belongs to two families: any other install refuses it at load, naming the family.
#[test]
fn lookahead_is_refused_for_other_families() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let src = repo().join("assets/fixtures/deepseek_v4/A/checkpoint");
    let inst = install(&src, work.path());
    let Err(e) = mference_models::load(&inst, &options(2, false)) else {
        panic!("DeepSeek-V4 accepted --router-lookahead");
    };
    let msg = e.to_string();
    assert!(
        msg.contains("--router-lookahead") && msg.contains("deepseek_v4"),
        "{msg}"
    );
    assert!(mference_models::load(&inst, &options(0, false)).is_ok());
}
