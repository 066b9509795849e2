//! The install plan of the full-size DeepSeek-V4-Flash 2-bit DQ checkpoint, built from headers
//! alone: every tensor of `reference/family-oracles.md` §2.2 (mlx-community/DeepSeek-V4-Flash-2bit-DQ
//! @722bf559: names, dtypes, stored shapes; 43 layers, CSA on even layers 2-42, HCA on odd 3-41,
//! hash routing on 0-2, routed `gate_proj` 2-bit g32 on layers 0-41 and g64 on 42) in one synthetic
//! shard header, no data. The planner must accept it, pad every layer to the one 8 MiB stride of
//! the widest (g32) blob, and produce the installed size the original measured on the real
//! repository (96,689,373,952 bytes, `reference/original-system.md` §4.1) within 1%.

use mference_format::safetensors::{SafetensorsHeader, TensorInfo};
use mference_format::Dtype;
use mference_install::checkpoint::{Checkpoint, Shard};
use serde_json::json;

const LAYERS: usize = 43;
const H: u64 = 4096;
const VOCAB: u64 = 129_280;
const EXPERTS: u64 = 256;
const MOE: u64 = 2048;

struct Tensors {
    list: Vec<TensorInfo>,
    cursor: u64,
}

impl Tensors {
    fn add(&mut self, name: String, dtype: Dtype, shape: &[u64]) {
        let size = shape.iter().product::<u64>() * dtype.size_bytes();
        self.list.push(TensorInfo {
            name,
            dtype,
            shape: shape.to_vec(),
            start: self.cursor,
            size,
        });
        self.cursor += size;
    }

    /// An MLX affine module `<base>.{weight, scales, biases}` of logical `[.., rows, cols]`.
    fn quant(&mut self, base: &str, lead: &[u64], cols: u64, bits: u64, group: u64) {
        let shape = |last: u64| [lead, &[last]].concat();
        self.add(
            format!("{base}.weight"),
            Dtype::U32,
            &shape(cols * bits / 32),
        );
        for part in ["scales", "biases"] {
            self.add(format!("{base}.{part}"), Dtype::BF16, &shape(cols / group));
        }
    }
}

fn config() -> serde_json::Value {
    let mut quant = serde_json::Map::new();
    quant.insert("group_size".into(), json!(64));
    quant.insert("bits".into(), json!(4));
    quant.insert("mode".into(), json!("affine"));
    for l in 0..LAYERS {
        for (p, g) in [
            ("gate_proj", if l < 42 { 32 } else { 64 }),
            ("up_proj", 64),
            ("down_proj", 64),
        ] {
            quant.insert(
                format!("model.layers.{l}.ffn.switch_mlp.{p}"),
                json!({"group_size": g, "bits": 2}),
            );
        }
    }
    let ratios: Vec<u64> = (0..=LAYERS)
        .map(|l| match l {
            0 | 1 => 0,
            l if l == LAYERS => 0,
            l if l % 2 == 0 => 4,
            _ => 128,
        })
        .collect();
    json!({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "compress_ratios": ratios, "compress_rope_theta": 160000.0, "hc_eps": 1e-6, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": H,
        "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
        "moe_intermediate_size": MOE, "n_routed_experts": EXPERTS, "n_shared_experts": 1,
        "norm_topk_prob": true, "num_attention_heads": 64, "num_experts_per_tok": 6,
        "num_hash_layers": 3, "num_hidden_layers": LAYERS, "num_key_value_heads": 1,
        "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
        "quantization": quant,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "rope_theta": 10000.0, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": false,
        "vocab_size": VOCAB
    })
}

fn tensors() -> Vec<TensorInfo> {
    let mut t = Tensors {
        list: Vec::new(),
        cursor: 8 + 4096,
    };
    t.quant("model.embed_tokens", &[VOCAB], H, 4, 64);
    t.quant("lm_head", &[VOCAB], H, 4, 64);
    t.add("model.norm.weight".into(), Dtype::BF16, &[H]);
    t.add("model.hc_head.fn".into(), Dtype::F32, &[4, 4 * H]);
    t.add("model.hc_head.base".into(), Dtype::F32, &[4]);
    t.add("model.hc_head.scale".into(), Dtype::F32, &[1]);
    for l in 0..LAYERS {
        let b = format!("model.layers.{l}");
        let a = format!("{b}.attn");
        t.quant(&format!("{a}.wq_a"), &[1024], H, 4, 64);
        t.add(format!("{a}.q_norm.weight"), Dtype::BF16, &[1024]);
        t.quant(&format!("{a}.wq_b"), &[32768], 1024, 4, 64);
        t.quant(&format!("{a}.wkv"), &[512], H, 4, 64);
        t.add(format!("{a}.kv_norm.weight"), Dtype::BF16, &[512]);
        t.add(format!("{a}.attn_sink"), Dtype::F32, &[64]);
        t.quant(&format!("{a}.wo_a"), &[8192], H, 4, 64);
        t.quant(&format!("{a}.wo_b"), &[H], 8192, 4, 64);
        match l {
            0 | 1 => {}
            l if l % 2 == 0 => {
                let c = format!("{a}.compressor");
                t.quant(&format!("{c}.wkv"), &[1024], H, 4, 64);
                t.quant(&format!("{c}.wgate"), &[1024], H, 4, 64);
                t.add(format!("{c}.norm.weight"), Dtype::BF16, &[512]);
                t.add(format!("{c}.ape"), Dtype::BF16, &[4, 1024]);
                let i = format!("{a}.indexer");
                t.quant(&format!("{i}.compressor.wkv"), &[256], H, 4, 64);
                t.quant(&format!("{i}.compressor.wgate"), &[256], H, 4, 64);
                t.add(format!("{i}.compressor.norm.weight"), Dtype::BF16, &[128]);
                t.add(format!("{i}.compressor.ape"), Dtype::BF16, &[4, 256]);
                t.quant(&format!("{i}.wq_b"), &[8192], 1024, 4, 64);
                t.quant(&format!("{i}.weights_proj"), &[64], H, 4, 64);
            }
            _ => {
                let c = format!("{a}.compressor");
                t.quant(&format!("{c}.wkv"), &[512], H, 4, 64);
                t.quant(&format!("{c}.wgate"), &[512], H, 4, 64);
                t.add(format!("{c}.norm.weight"), Dtype::BF16, &[512]);
                t.add(format!("{c}.ape"), Dtype::BF16, &[128, 512]);
            }
        }
        t.add(format!("{b}.attn_norm.weight"), Dtype::BF16, &[H]);
        t.add(format!("{b}.ffn_norm.weight"), Dtype::BF16, &[H]);
        for site in ["attn_hc", "ffn_hc"] {
            t.add(format!("{b}.{site}.fn"), Dtype::F32, &[24, 4 * H]);
            t.add(format!("{b}.{site}.base"), Dtype::F32, &[24]);
            t.add(format!("{b}.{site}.scale"), Dtype::F32, &[3]);
        }
        t.add(format!("{b}.ffn.gate.weight"), Dtype::BF16, &[EXPERTS, H]);
        if l < 3 {
            t.add(format!("{b}.ffn.gate.tid2eid"), Dtype::I64, &[VOCAB, 6]);
        } else {
            t.add(
                format!("{b}.ffn.gate.e_score_correction_bias"),
                Dtype::F32,
                &[EXPERTS],
            );
        }
        let s = format!("{b}.ffn.shared_experts");
        t.quant(&format!("{s}.gate_proj"), &[MOE], H, 4, 64);
        t.quant(&format!("{s}.up_proj"), &[MOE], H, 4, 64);
        t.quant(&format!("{s}.down_proj"), &[H], MOE, 4, 64);
        let r = format!("{b}.ffn.switch_mlp");
        t.quant(
            &format!("{r}.gate_proj"),
            &[EXPERTS, MOE],
            H,
            2,
            if l < 42 { 32 } else { 64 },
        );
        t.quant(&format!("{r}.up_proj"), &[EXPERTS, MOE], H, 2, 64);
        t.quant(&format!("{r}.down_proj"), &[EXPERTS, H], MOE, 2, 64);
    }
    t.list
}

#[test]
fn full_size_plan_matches_the_measured_install() {
    let ck = Checkpoint {
        config: config(),
        index_sha256: "0".repeat(64),
        shards: vec![Shard {
            file: "model.safetensors".into(),
            header: SafetensorsHeader {
                header_len: 4096,
                data_start: 8 + 4096,
                tensors: tensors(),
                metadata: None,
            },
        }],
        sidecars: vec![("config.json".into(), 10_000)],
    };
    let plan = mference_install::plan::build(&ck, mference_install::plan::MAX_RANGE_BYTES).unwrap();
    assert_eq!(plan.expert_layers(), LAYERS);
    // 8 MiB: the g32-gate blob exactly; layer 42's g64 blob (7.5 MiB) is laid out at that stride.
    assert_eq!(plan.layout.expert_stride, 8 << 20);
    let l42 = plan.layout.layers[42].blob.as_ref().unwrap().used_bytes();
    assert_eq!(l42, (15 << 20) / 2);
    let out = plan.output_bytes();
    let measured = 96_689_373_952u64;
    let rel = (out as f64 - measured as f64).abs() / measured as f64;
    eprintln!(
        "plan: {out} output bytes ({:.3} GB; measured install {measured}: {:+.3}%), source {} bytes, {} ranges",
        out as f64 / 1e9,
        (out as f64 / measured as f64 - 1.0) * 100.0,
        plan.source_bytes(),
        plan.ranges.len()
    );
    assert!(
        rel < 0.01,
        "plan output {out} is {rel:.4} away from {measured}"
    );
}
