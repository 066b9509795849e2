//! A `config.json` whose sizes a forward pass divides or windows by is refused at parse time,
//! naming the key, for every family (it would otherwise install, then panic or compute garbage).

use std::path::Path;

use mference_models::ModelError;

fn config(rel: &str) -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets")
        .join(rel);
    serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
}

/// `v` with `key` (under `text_config` when the file has one) set to `value`.
fn with(mut v: serde_json::Value, key: &str, value: u64) -> serde_json::Value {
    let t = if v.get("text_config").is_some() {
        &mut v["text_config"]
    } else {
        &mut v
    };
    t[key] = value.into();
    v
}

fn refused<T>(r: Result<T, ModelError>, what: &str) {
    match r {
        Err(ModelError::Config(m)) => assert!(m.contains(what), "{m}"),
        Err(e) => panic!("{what}: another error: {e}"),
        Ok(_) => panic!("{what}: accepted"),
    }
}

#[test]
fn zero_sizes_and_a_top_k_past_the_experts_are_refused() {
    use mference_models::{deepseek_v4, gemma4, inkling, maple, qwen3_5_moe};
    let g = config("models/gemma4-tiny/config.json");
    assert!(gemma4::Config::from_config_json(&g).is_ok());
    refused(
        gemma4::Config::from_config_json(&with(g.clone(), "sliding_window", 0)),
        "sliding_window is 0",
    );
    refused(
        gemma4::Config::from_config_json(&with(g.clone(), "top_k_experts", 1000)),
        "routes 1000 experts per token",
    );
    // 1e300 (read as f32: infinity) generated token 0 forever.
    let mut huge = g.clone();
    huge["text_config"]["rms_norm_eps"] = serde_json::json!(1e300);
    refused(gemma4::Config::from_config_json(&huge), "rms_norm_eps inf");
    refused(
        gemma4::Config::from_config_json(&with(g, "rms_norm_eps", 0)),
        "rms_norm_eps 0",
    );
    let q = config("models/qwen3_6-tiny/config.json");
    assert!(qwen3_5_moe::Config::from_config_json(&q).is_ok());
    refused(
        qwen3_5_moe::Config::from_config_json(&with(q, "num_attention_heads", 0)),
        "num_attention_heads is 0",
    );
    let m = config("fixtures/maple/A/checkpoint/config.json");
    assert!(maple::Config::from_config_json(&m).is_ok());
    refused(
        maple::Config::from_config_json(&with(m, "head_dim", 0)),
        "head_dim is 0",
    );
    let d = config("fixtures/deepseek_v4/A/checkpoint/config.json");
    assert!(deepseek_v4::Config::from_config_json(&d).is_ok());
    refused(
        deepseek_v4::Config::from_config_json(&with(d, "sliding_window", 0)),
        "sliding_window is 0",
    );
    let i = config("fixtures/inkling/A/checkpoint/config.json");
    assert!(inkling::Config::from_config_json(&i).is_ok());
    refused(
        inkling::Config::from_config_json(&with(i.clone(), "num_experts_per_tok", 0)),
        "num_experts_per_tok is 0",
    );
    // The logits are divided by it: 0 gave infinite logits with exit 0.
    refused(
        inkling::Config::from_config_json(&with(i, "logits_mup_width_multiplier", 0)),
        "logits_mup_width_multiplier 0",
    );
}
