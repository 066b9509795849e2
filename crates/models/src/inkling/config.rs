//! The `text_config` of an Inkling `config.json` and what this runtime accepts of it.

use serde::Deserialize;

use crate::{check_sizes, parse_config, text_config, unsupported, ModelError};

/// `text_config` of an Inkling `config.json` as the checkpoint stores it (transformers
/// `InklingTextConfig` keys before its `__post_init__`): `intermediate_size` is the expert width,
/// `dense_intermediate_size` the dense layers'.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// Rows of `embed` / `unembed` (padded).
    pub vocab_size: usize,
    /// Logits beyond this id are padding and dropped.
    pub unpadded_vocab_size: Option<usize>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// Sliding layers' head counts and size; the global ones when absent.
    pub swa_num_attention_heads: Option<usize>,
    pub swa_num_key_value_heads: Option<usize>,
    pub swa_head_dim: Option<usize>,
    pub sliding_window_size: usize,
    /// Layers with sliding-window attention (relative-position extent = the window); the rest are
    /// global (extent `rel_extent`, log position scale).
    pub local_layer_ids: Vec<usize>,
    pub d_rel: usize,
    pub rel_extent: usize,
    /// `None` (JSON null) turns the log position scale off.
    pub log_scaling_n_floor: Option<f64>,
    #[serde(default = "default_alpha")]
    pub log_scaling_alpha: f64,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "yes")]
    pub use_embed_norm: bool,
    #[serde(default = "yes")]
    pub use_sconv: bool,
    #[serde(default = "default_kernel")]
    pub sconv_kernel_size: usize,
    /// Layers `0..dense_mlp_idx` have a dense SwiGLU MLP.
    pub dense_mlp_idx: usize,
    pub dense_intermediate_size: usize,
    pub intermediate_size: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    #[serde(default = "yes")]
    pub shared_expert_sink: bool,
    pub route_scale: f32,
    pub logits_mup_width_multiplier: f32,
    #[serde(default = "silu")]
    pub hidden_act: String,
}

fn default_alpha() -> f64 {
    0.1
}
fn default_eps() -> f32 {
    1e-6
}
fn default_kernel() -> usize {
    4
}
fn yes() -> bool {
    true
}
fn silu() -> String {
    "silu".into()
}

impl Config {
    /// Reads `text_config` of `config.json` and rejects what this runtime does not implement.
    pub fn from_config_json(v: &serde_json::Value) -> Result<Self, ModelError> {
        let c: Config = parse_config(text_config(v), "inkling text_config")?;
        check_sizes(
            "inkling",
            &[
                ("hidden_size", c.hidden_size),
                ("num_hidden_layers", c.num_hidden_layers),
                ("num_attention_heads", c.num_attention_heads),
                ("num_key_value_heads", c.num_key_value_heads),
                ("head_dim", c.head_dim),
                ("sliding_window_size", c.sliding_window_size),
                ("vocab_size", c.vocab_size),
                ("n_routed_experts", c.n_routed_experts),
                ("num_experts_per_tok", c.num_experts_per_tok),
                ("intermediate_size", c.intermediate_size),
                ("dense_intermediate_size", c.dense_intermediate_size),
                ("sconv_kernel_size", c.sconv_kernel_size),
            ],
            (c.num_experts_per_tok, c.n_routed_experts),
            c.rms_norm_eps,
        )?;
        let unsupported = |what: &str| unsupported("inkling", what);
        if !c.use_sconv || !c.shared_expert_sink || c.hidden_act != "silu" {
            return unsupported("a model without short convolutions, sink shared experts or SiLU");
        }
        // (A top-k of 0 or past the routed experts is refused by `check_sizes` above.)
        if c.dense_mlp_idx > c.num_hidden_layers
            || c.n_shared_experts == 0
            || c.sconv_kernel_size < 2
            || c.local_layer_ids.iter().any(|&l| l >= c.num_hidden_layers)
            || c.vocab_size() > c.vocab_size
        {
            return Err(ModelError::Config(
                "inkling: dense_mlp_idx, shared experts, sconv kernel, local_layer_ids or \
                 unpadded_vocab_size out of range"
                    .into(),
            ));
        }
        let m = c.logits_mup_width_multiplier;
        if !(m.is_normal() && m > 0.0) {
            return Err(ModelError::Config(format!(
                "inkling: logits_mup_width_multiplier {m} (the logits are divided by it: it must \
                 be a positive normal number)"
            )));
        }
        Ok(c)
    }

    /// Whether layer `i` attends within the sliding window.
    pub fn is_sliding(&self, i: usize) -> bool {
        self.local_layer_ids.contains(&i)
    }

    /// `(n_heads, n_kv_heads, head_dim)` of layer `i`.
    pub(super) fn heads(&self, i: usize) -> (usize, usize, usize) {
        if self.is_sliding(i) {
            (
                self.swa_num_attention_heads
                    .unwrap_or(self.num_attention_heads),
                self.swa_num_key_value_heads
                    .unwrap_or(self.num_key_value_heads),
                self.swa_head_dim.unwrap_or(self.head_dim),
            )
        } else {
            (
                self.num_attention_heads,
                self.num_key_value_heads,
                self.head_dim,
            )
        }
    }

    /// The vocabulary the logits cover (`unpadded_vocab_size`).
    pub fn vocab_size(&self) -> usize {
        self.unpadded_vocab_size.unwrap_or(self.vocab_size)
    }
}
