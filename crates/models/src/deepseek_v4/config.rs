//! DeepSeek-V4's `config.json`: HF keys, the published legacy keys, the attention schedule.

use mference_backend::HcSpec;
use serde::Deserialize;

use crate::{check_sizes, parse_config, ModelError};

/// The flat `config.json` of a DeepSeek-V4 checkpoint (HF keys; the published legacy keys
/// `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling` as written).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub q_lora_rank: usize,
    pub qk_rope_head_dim: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    #[serde(default = "one_usize")]
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub num_hash_layers: usize,
    /// HF's explicit MLP schedule (`hash_moe` / `moe`); overrides `num_hash_layers`.
    #[serde(default)]
    pub mlp_layer_types: Option<Vec<String>>,
    pub routed_scaling_factor: f32,
    pub swiglu_limit: f32,
    #[serde(default = "sqrtsoftplus")]
    pub scoring_func: String,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    pub sliding_window: usize,
    /// Per layer 0 (sliding), 4 (CSA) or 128 (HCA); may run past the layers (the MTP entry).
    #[serde(default)]
    pub compress_ratios: Option<Vec<usize>>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "silu")]
    pub hidden_act: String,
}

/// Legacy `rope_scaling` (`{type: yarn, factor, original_max_position_embeddings, beta_fast,
/// beta_slow}`): the compress rope's YaRN (transformers forces its attention factor to 1).
#[derive(Clone, Debug, Deserialize)]
pub struct RopeScaling {
    #[serde(rename = "type", alias = "rope_type")]
    pub kind: String,
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    #[serde(default = "beta_fast")]
    pub beta_fast: f64,
    #[serde(default = "beta_slow")]
    pub beta_slow: f64,
}

fn default_eps() -> f32 {
    1e-6
}
fn one_usize() -> usize {
    1
}
fn yes() -> bool {
    true
}
fn sqrtsoftplus() -> String {
    "sqrtsoftplus".into()
}
fn silu() -> String {
    "silu".into()
}
fn beta_fast() -> f64 {
    32.0
}
fn beta_slow() -> f64 {
    1.0
}

/// A layer's attention kind: the compression rate of its long-range KV (`None`: sliding only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sliding,
    /// Compressed sparse attention (overlapping windows, indexer top-k).
    Csa(usize),
    /// Heavily compressed attention (dense over its entries).
    Hca(usize),
}

impl Config {
    /// Reads `config.json` and rejects what this runtime does not implement.
    pub fn from_config_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let c: Config = parse_config(v, "deepseek_v4 config")?;
        check_sizes(
            "deepseek_v4",
            &[
                ("hidden_size", c.hidden_size),
                ("num_hidden_layers", c.num_hidden_layers),
                ("num_attention_heads", c.num_attention_heads),
                ("head_dim", c.head_dim),
                ("sliding_window", c.sliding_window),
                ("vocab_size", c.vocab_size),
                ("n_routed_experts", c.n_routed_experts),
                ("num_experts_per_tok", c.num_experts_per_tok),
                ("moe_intermediate_size", c.moe_intermediate_size),
                ("q_lora_rank", c.q_lora_rank),
                ("o_lora_rank", c.o_lora_rank),
                ("o_groups", c.o_groups),
                ("hc_mult", c.hc_mult),
                ("index_n_heads", c.index_n_heads),
                ("index_head_dim", c.index_head_dim),
                ("index_topk", c.index_topk),
            ],
            (c.num_experts_per_tok, c.n_routed_experts),
            c.rms_norm_eps,
        )?;
        let bad = |what: String| Err(ModelError::Config(format!("deepseek_v4: {what}")));
        if c.num_key_value_heads != 1 {
            return bad(format!(
                "num_key_value_heads {} (the shared K = V head must be 1)",
                c.num_key_value_heads
            ));
        }
        if c.scoring_func != "sqrtsoftplus" || !c.norm_topk_prob || c.hidden_act != "silu" {
            return bad(format!(
                "scoring_func {} / norm_topk_prob {} / hidden_act {} is not supported",
                c.scoring_func, c.norm_topk_prob, c.hidden_act
            ));
        }
        if c.tie_word_embeddings || c.n_shared_experts != 1 {
            return bad("tied embeddings or a shared-expert count other than 1".into());
        }
        let rd = c.qk_rope_head_dim;
        if rd == 0
            || !rd.is_multiple_of(2)
            || rd > c.head_dim
            || rd > c.index_head_dim
            || c.o_groups == 0
            || !c.num_attention_heads.is_multiple_of(c.o_groups)
            || c.hc_mult == 0
        {
            return bad("qk_rope_head_dim, o_groups or hc_mult out of range".into());
        }
        if let Some(s) = &c.rope_scaling {
            if s.kind != "yarn" {
                return bad(format!("rope_scaling type {}", s.kind));
            }
        }
        (0..c.num_hidden_layers)
            .map(|l| c.kind(l))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(c)
    }

    /// Layer `l`'s attention kind from `layer_types` or, failing that, `compress_ratios`
    /// (transformers' default schedule is V4-Pro's, so one of them is required).
    pub fn kind(&self, l: usize) -> Result<Kind, ModelError> {
        let bad = |w: String| ModelError::Config(format!("deepseek_v4: {w}"));
        if let Some(t) = &self.layer_types {
            return match t.get(l).map(String::as_str) {
                Some("sliding_attention") => Ok(Kind::Sliding),
                Some("compressed_sparse_attention") => Ok(Kind::Csa(4)),
                Some("heavily_compressed_attention") => Ok(Kind::Hca(128)),
                other => Err(bad(format!("layer_types[{l}] is {other:?}"))),
            };
        }
        let r = self
            .compress_ratios
            .as_ref()
            .ok_or_else(|| bad("needs layer_types or compress_ratios".into()))?;
        match r.get(l) {
            Some(0) => Ok(Kind::Sliding),
            Some(4) => Ok(Kind::Csa(4)),
            Some(&m) if m > 4 => Ok(Kind::Hca(m)),
            other => Err(bad(format!("compress_ratios[{l}] is {other:?}"))),
        }
    }

    /// Whether layer `l`'s router is the hash table `tid2eid`.
    pub fn is_hash(&self, l: usize) -> bool {
        match &self.mlp_layer_types {
            Some(t) => t.get(l).is_some_and(|s| s == "hash_moe"),
            None => l < self.num_hash_layers,
        }
    }

    pub(super) fn hc(&self) -> HcSpec {
        HcSpec {
            streams: self.hc_mult,
            sinkhorn_iters: self.hc_sinkhorn_iters,
            hc_eps: self.hc_eps,
            norm_eps: self.rms_norm_eps,
        }
    }
}
