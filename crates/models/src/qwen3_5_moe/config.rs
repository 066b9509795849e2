//! The `text_config` of a Qwen 3.5/3.6 MoE `config.json` and what this runtime accepts of it.

use serde::Deserialize;

use crate::{check_sizes, parse_config, text_config, unsupported, ModelError};

/// `text_config` of a Qwen 3.5/3.6 MoE `config.json` (HF keys; defaults as mlx-lm's
/// `qwen3_5.TextModelArgs`).
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Full-attention head size; `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub linear_num_value_heads: usize,
    pub linear_num_key_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    #[serde(default = "default_conv")]
    pub linear_conv_kernel_dim: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub attention_bias: bool,
    /// Layer `i` is full attention iff `(i + 1) % full_attention_interval == 0` (mlx-lm's rule).
    #[serde(default = "default_interval")]
    pub full_attention_interval: usize,
    /// HF's explicit per-layer list; must agree with `full_attention_interval` when present.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
}

/// `rope_parameters`: only the plain (`default`) RoPE is implemented; for text-only input the
/// interleaved MRoPE sections reduce to it (all three position streams are equal), and mlx-lm
/// ignores `mrope_section` too.
#[derive(Clone, Debug, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub rope_type: Option<String>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_conv() -> usize {
    4
}
fn default_interval() -> usize {
    4
}
fn yes() -> bool {
    true
}

impl Config {
    /// Reads `text_config` (or the top level) of `config.json` and rejects what this runtime does not
    /// implement (dense MLP layers, attention biases, RoPE scaling).
    pub fn from_config_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let c: Config = parse_config(text_config(v), "qwen3_5_moe text_config")?;
        check_sizes(
            "qwen3_5_moe",
            &[
                ("hidden_size", c.hidden_size),
                ("num_hidden_layers", c.num_hidden_layers),
                ("num_attention_heads", c.num_attention_heads),
                ("num_key_value_heads", c.num_key_value_heads),
                ("head_dim", c.head_dim.unwrap_or(1)),
                ("vocab_size", c.vocab_size),
                ("linear_key_head_dim", c.linear_key_head_dim),
                ("linear_value_head_dim", c.linear_value_head_dim),
                ("linear_num_value_heads", c.linear_num_value_heads),
            ],
            (c.num_experts_per_tok, c.num_experts),
            c.rms_norm_eps,
        )?;
        let unsupported = |what: &str| unsupported("qwen3_5_moe", what);
        if c.num_experts == 0 || c.num_experts_per_tok == 0 || c.moe_intermediate_size == 0 {
            return unsupported("a model without the MoE block");
        }
        if c.attention_bias {
            return unsupported("attention biases");
        }
        if c.full_attention_interval == 0
            || c.linear_num_key_heads == 0
            || !c
                .linear_num_value_heads
                .is_multiple_of(c.linear_num_key_heads)
            || c.linear_conv_kernel_dim < 2
        {
            return Err(ModelError::Config(
                "qwen3_5_moe: full_attention_interval, linear heads or conv kernel out of range"
                    .into(),
            ));
        }
        if let Some(kind) = c.rope_kind() {
            if kind != "default" {
                return unsupported(&format!("RoPE type '{kind}'"));
            }
        }
        if let Some(lt) = &c.layer_types {
            let ok = lt.len() == c.num_hidden_layers
                && lt.iter().enumerate().all(|(i, t)| {
                    let full = !c.is_linear(i);
                    t == if full {
                        "full_attention"
                    } else {
                        "linear_attention"
                    }
                });
            if !ok {
                return Err(ModelError::Config(format!(
                    "layer_types {lt:?} disagrees with full_attention_interval {}",
                    c.full_attention_interval
                )));
            }
        }
        Ok(c)
    }

    /// Whether layer `i` is a Gated DeltaNet layer.
    pub fn is_linear(&self, i: usize) -> bool {
        !(i + 1).is_multiple_of(self.full_attention_interval)
    }

    pub(super) fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub(super) fn rope_kind(&self) -> Option<&str> {
        let p = self.rope_parameters.as_ref()?;
        p.kind.as_deref().or(p.rope_type.as_deref())
    }

    /// `(theta, partial_rotary_factor)` with mlx-lm's defaults (100000, 0.25).
    pub(super) fn rope(&self) -> (f64, f64) {
        let p = self.rope_parameters.as_ref();
        (
            p.and_then(|p| p.rope_theta).unwrap_or(100000.0),
            p.and_then(|p| p.partial_rotary_factor).unwrap_or(0.25),
        )
    }
}
