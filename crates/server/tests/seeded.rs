//! Reproducible sampling: a seeded request at a temperature above zero gives the same tokens, text
//! and logprobs whether its prompt was computed cold, came partly from the prompt cache (the rest
//! prefilled as a shorter chunk), came wholly from it, or was streamed. It holds because a prompt
//! row's logits do not depend on the chunk they were computed in: on the CPU every exact kernel
//! table gives a token's row of a batched product the bits of its one-token product
//! (`crates/kernels`, "Batch invariance"); llama.cpp #4902 and ollama #5760 report the opposite.

mod common;

use common::start_install;
use mference_models::LoadOptions;
use mference_server::PromptCacheMode;
use mference_testkit::http::{post, post_stream};
use mference_testkit::installed_asset;
use serde_json::{json, Value};

/// `(seed, temperature, top_k)`: a mild and a wild temperature, with and without a top-k cut.
const SAMPLING: [(u64, f64, u64); 3] = [(1, 0.8, 40), (7, 2.0, 0), (1234, 1.3, 0)];

fn body(model: &str, messages: &[Value], (seed, temperature, top_k): (u64, f64, u64)) -> Value {
    json!({"model": model, "messages": messages, "seed": seed, "temperature": temperature,
        "top_k": top_k, "top_p": 1, "max_tokens": 40, "logprobs": true, "top_logprobs": 2})
}

fn ok(addr: std::net::SocketAddr, body: &Value) -> Value {
    let (status, v) = post(addr, "/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    v
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

fn same_seed_same_tokens(name: &str, model: &str, kernels: Option<&str>) {
    let dir = installed_asset(name);
    // Two threads and 16-row chunks: the cold prompt spans several chunks, split unlike the warm.
    let opts = LoadOptions {
        threads: 2,
        prefill_chunk: 16,
        kernels: kernels.map(str::to_string),
        ..common::resident_opts(2048)
    };
    let cold = start_install(dir, &opts, PromptCacheMode::Off, model);
    let warm = start_install(dir, &opts, PromptCacheMode::SinglePrefix, model);
    let first = [
        json!({"role": "system", "content": "You are a careful reader of old novels, and you answer at length."}),
        json!({"role": "user", "content": "Who lives at Netherfield Park, and why does it matter to the Bennets?"}),
    ];
    let mut full = first.to_vec();
    full.push(
        json!({"role": "assistant", "content": "Mr. Bingley, a rich young man, has taken it."}),
    );
    full.push(json!({"role": "user", "content": "And what of his friend Mr. Darcy?"}));
    let mut answers = Vec::new();
    for s in SAMPLING {
        let c = ok(cold.local_addr(), &body(model, &full, s));
        assert_eq!(cached(&c), 0);
        // The first turn alone, then the whole conversation: its prefix comes from the cache and
        // the rest is prefilled as a chunk that starts elsewhere than in the cold run.
        ok(warm.local_addr(), &body(model, &first, s));
        let w1 = ok(warm.local_addr(), &body(model, &full, s));
        // The same request again: all but the prompt's last token from the cache.
        let w2 = ok(warm.local_addr(), &body(model, &full, s));
        assert!(
            0 < cached(&w1) && cached(&w1) < cached(&w2),
            "{name} {s:?}: the warm requests did not reuse a prefix and then the whole prompt: {} then {}",
            cached(&w1),
            cached(&w2)
        );
        let mut st = body(model, &full, s);
        st["stream"] = json!(true);
        let streamed = post_stream(cold.local_addr(), "/v1/chat/completions", &st);
        assert_eq!(streamed.status, 200, "{}", streamed.raw);

        let text = |v: &Value| v["choices"][0]["message"]["content"].clone();
        let logprobs = |v: &Value| v["choices"][0]["logprobs"]["content"].clone();
        for (label, w) in [("prefix cached", &w1), ("prompt cached", &w2)] {
            let (got, want) = (logprobs(w), logprobs(&c));
            let (got, want) = (got.as_array().unwrap(), want.as_array().unwrap());
            if let Some(i) = (0..got.len().max(want.len())).find(|&i| got.get(i) != want.get(i)) {
                panic!(
                    "{name} {s:?}: {label}: token {i} (token and logprobs) differs from the cold run:\n {}\n {}",
                    got.get(i).unwrap_or(&Value::Null),
                    want.get(i).unwrap_or(&Value::Null)
                );
            }
            assert_eq!(text(w), text(&c), "{name} {s:?}: {label} text differs");
        }
        assert_eq!(
            json!(streamed.text()),
            text(&c),
            "{name} {s:?}: the streamed text differs from the cold run's"
        );
        eprintln!(
            "{name} {s:?}: cached {} / {} tokens, {:?}",
            cached(&w1),
            cached(&w2),
            text(&c)
        );
        answers.push(text(&c));
    }
    // The seeds and temperatures really sample: not every setting gives the same text.
    assert!(
        answers.iter().any(|a| a != &answers[0]),
        "{name}: every seed and temperature gave {:?}",
        answers[0]
    );
    cold.shutdown();
    warm.shutdown();
}

#[test]
fn gemma_same_seed_same_tokens_cold_warm_and_streamed() {
    same_seed_same_tokens("gemma4-tiny", "gemma-tiny", None);
}

#[test]
fn qwen_same_seed_same_tokens_cold_warm_and_streamed() {
    same_seed_same_tokens("qwen3_6-tiny", "qwen-tiny", None);
}

/// Both bundled models with `--kernels table`, or a skip message naming what this CPU lacks.
fn table_same_seed_same_tokens(table: &str, lacking: &str) {
    if mference_kernels::Kernels::by_name(table).is_none() {
        eprintln!("skipped: this CPU has no {lacking}");
        return;
    }
    same_seed_same_tokens("gemma4-tiny", "gemma-tiny", Some(table));
    same_seed_same_tokens("qwen3_6-tiny", "qwen-tiny", Some(table));
}

/// The int16-activation table (`--kernels avx512i16`) is batch-invariant too: its GEMV and its
/// 16-tokens-per-register GEMM add the same exact integer sums in the same f32 order.
#[test]
fn int16_kernels_same_seed_same_tokens() {
    table_same_seed_same_tokens("avx512i16", "AVX-512 VNNI");
}

/// `--kernels avx2i16` (int16 activations on AVX2, `auto`'s table for these families on CPUs
/// without AVX-512 VNNI): its GEMV and its 8-tokens-per-register GEMM take the same f32 steps per
/// token.
#[test]
fn avx2_int16_kernels_same_seed_same_tokens() {
    table_same_seed_same_tokens("avx2i16", "AVX2");
}

/// `--kernels amx` (the int16 table with its prompt GEMM on AMX tiles) gives the same integer sums
/// in the same f32 order as its GEMV, so it is batch-invariant too.
#[test]
fn amx_kernels_same_seed_same_tokens() {
    table_same_seed_same_tokens("amx", "AMX-INT8 (or its OS does not grant it)");
}
