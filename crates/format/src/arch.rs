//! Architecture facts recorded in `manifest.json -> arch` and derived from the checkpoint's
//! `config.json` (`docs/FORMAT.md`, `manifest.json`; HF config keys as
//! each family's transformers configuration names them).

use crate::{Family, FormatError};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// `manifest.json -> arch`. Sizes are element counts; `full_attention_layer_mask` has one
/// entry per layer: 0 = sliding window, 1 = full, 2 = gated DeltaNet, 3 = CSA, 4 = HCA.
/// The family-extension fields default to the Gemma values when absent from the JSON.
#[derive(Clone, Debug, PartialEq)]
pub struct ArchInfo {
    pub hidden_size: u64,
    /// Dense/shared-expert FFN width (`ffnIntermediate`).
    pub ffn_intermediate: u64,
    pub moe_intermediate_size: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub num_full_kv_heads: u64,
    pub head_dim: u64,
    pub full_head_dim: u64,
    pub vocab_size: u64,
    pub sliding_window: u64,
    pub final_logit_softcap: f64,
    pub rope_theta: f64,
    pub full_rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub num_layers: u64,
    pub num_experts: u64,
    pub top_k_experts: u64,
    pub tie_word_embeddings: bool,
    pub attention_k_eq_v: bool,
    pub hidden_activation: String,
    pub full_attention_layer_mask: Vec<u8>,
    pub family: Family,
    pub attn_output_gate: bool,
    pub attention_scale: f64,
    pub embedding_scaled_by_sqrt_hidden: bool,
    pub router_scaled: bool,
    pub ffn_sandwich_norms: bool,
    pub shared_expert_gated: bool,
    pub rope_neox_subdim: bool,
    pub linear_num_k_heads: u64,
    pub linear_num_v_heads: u64,
    pub linear_key_head_dim: u64,
    pub linear_value_head_dim: u64,
    pub linear_conv_kernel_size: u64,
    /// Other family-specific keys (DeepSeek-V4, Inkling, Maple), kept as written.
    pub extra: BTreeMap<String, Value>,
}

fn cfg_err(detail: impl Into<String>) -> FormatError {
    FormatError::ConfigInvalid {
        detail: detail.into(),
    }
}

struct Cfg<'a>(&'a Map<String, Value>);
impl Cfg<'_> {
    fn u(&self, k: &str) -> Result<u64, FormatError> {
        self.0
            .get(k)
            .and_then(|v| v.as_u64())
            .ok_or_else(|| cfg_err(format!("missing integer \"{k}\"")))
    }
    fn f(&self, k: &str) -> Result<f64, FormatError> {
        self.0
            .get(k)
            .and_then(|v| v.as_f64())
            .ok_or_else(|| cfg_err(format!("missing number \"{k}\"")))
    }
    fn b(&self, k: &str, default: bool) -> bool {
        self.0.get(k).and_then(|v| v.as_bool()).unwrap_or(default)
    }
    fn s(&self, k: &str, default: &str) -> String {
        self.0
            .get(k)
            .and_then(|v| v.as_str())
            .unwrap_or(default)
            .to_string()
    }
    fn layer_types(&self) -> Result<Vec<String>, FormatError> {
        self.0
            .get("layer_types")
            .and_then(|v| v.as_array())
            .ok_or_else(|| cfg_err("missing \"layer_types\""))?
            .iter()
            .map(|t| {
                t.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| cfg_err("non-string layer_types entry"))
            })
            .collect()
    }
}

/// The language-model part of a config: `text_config` when present, else the root.
pub fn text_config(config: &Value) -> Result<&Map<String, Value>, FormatError> {
    config
        .get("text_config")
        .unwrap_or(config)
        .as_object()
        .ok_or_else(|| cfg_err("config.json is not a JSON object"))
}

impl ArchInfo {
    /// Derive the arch block from a checkpoint `config.json`. Errors: unknown
    /// `model_type`, missing or inconsistent keys.
    pub fn from_config(config: &Value) -> Result<ArchInfo, FormatError> {
        let family = Family::from_config(config)?;
        let c = Cfg(text_config(config)?);
        match family {
            Family::Gemma4 => Self::gemma4(&c),
            Family::Qwen3_5Moe => Self::qwen3_5_moe(&c),
            Family::DeepseekV4 => Self::deepseek_v4(&c),
            Family::Maple => Self::maple(&c),
            Family::Inkling => Self::inkling(&c),
        }
    }

    fn base(c: &Cfg, family: Family) -> Result<ArchInfo, FormatError> {
        Self::base_with(c, family, "moe_intermediate_size", "num_experts")
    }

    /// The common keys, with the family's names for the expert width and the expert count.
    fn base_with(
        c: &Cfg,
        family: Family,
        expert_width: &str,
        experts: &str,
    ) -> Result<ArchInfo, FormatError> {
        Ok(ArchInfo {
            hidden_size: c.u("hidden_size")?,
            ffn_intermediate: 0,
            moe_intermediate_size: c.u(expert_width)?,
            num_heads: c.u("num_attention_heads")?,
            num_kv_heads: c.u("num_key_value_heads")?,
            num_full_kv_heads: 0,
            head_dim: c.u("head_dim")?,
            full_head_dim: 0,
            vocab_size: c.u("vocab_size")?,
            sliding_window: 0,
            final_logit_softcap: 0.0,
            rope_theta: 0.0,
            full_rope_theta: 0.0,
            partial_rotary_factor: 0.0,
            num_layers: c.u("num_hidden_layers")?,
            num_experts: c.u(experts)?,
            top_k_experts: 0,
            tie_word_embeddings: c.b("tie_word_embeddings", false),
            attention_k_eq_v: false,
            hidden_activation: String::new(),
            full_attention_layer_mask: Vec::new(),
            family,
            attn_output_gate: false,
            attention_scale: 1.0,
            embedding_scaled_by_sqrt_hidden: true,
            router_scaled: true,
            ffn_sandwich_norms: true,
            shared_expert_gated: false,
            rope_neox_subdim: false,
            linear_num_k_heads: 0,
            linear_num_v_heads: 0,
            linear_key_head_dim: 0,
            linear_value_head_dim: 0,
            linear_conv_kernel_size: 0,
            extra: BTreeMap::new(),
        })
    }

    fn gemma4(c: &Cfg) -> Result<ArchInfo, FormatError> {
        let mut a = Self::base(c, Family::Gemma4)?;
        let types = c.layer_types()?;
        a.full_attention_layer_mask = types
            .iter()
            .map(|t| u8::from(t == "full_attention"))
            .collect();
        let rope = c.0.get("rope_parameters");
        let num = |p: &str, d: f64| {
            rope.and_then(|r| r.pointer(p))
                .and_then(|v| v.as_f64())
                .unwrap_or(d)
        };
        a.ffn_intermediate = c.u("intermediate_size")?;
        a.num_full_kv_heads = c.u("num_global_key_value_heads")?;
        a.full_head_dim = c.u("global_head_dim")?;
        a.sliding_window = c.u("sliding_window")?;
        a.final_logit_softcap = c.f("final_logit_softcapping")?;
        a.rope_theta = num("/sliding_attention/rope_theta", 10_000.0);
        a.full_rope_theta = num("/full_attention/rope_theta", 1_000_000.0);
        a.partial_rotary_factor = num("/full_attention/partial_rotary_factor", 0.25);
        a.top_k_experts = c.u("top_k_experts")?;
        a.attention_k_eq_v = c.b("attention_k_eq_v", false);
        a.hidden_activation = c.s("hidden_activation", "gelu_pytorch_tanh");
        a.check_layers()?;
        Ok(a)
    }

    fn qwen3_5_moe(c: &Cfg) -> Result<ArchInfo, FormatError> {
        let mut a = Self::base(c, Family::Qwen3_5Moe)?;
        a.full_attention_layer_mask = c
            .layer_types()?
            .iter()
            .map(|t| match t.as_str() {
                "linear_attention" => Ok(2),
                "full_attention" => Ok(1),
                other => Err(cfg_err(format!("unknown layer_types entry \"{other}\""))),
            })
            .collect::<Result<_, _>>()?;
        let rope = c.0.get("rope_parameters");
        let theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| c.0.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .ok_or_else(|| cfg_err("missing rope_parameters.rope_theta"))?;
        let prf = rope
            .and_then(|r| r.get("partial_rotary_factor"))
            .or_else(|| c.0.get("partial_rotary_factor"))
            .and_then(|v| v.as_f64())
            .ok_or_else(|| cfg_err("missing rope_parameters.partial_rotary_factor"))?;
        a.ffn_intermediate = c.u("shared_expert_intermediate_size")?;
        a.num_full_kv_heads = a.num_kv_heads;
        a.full_head_dim = a.head_dim;
        a.rope_theta = theta;
        a.full_rope_theta = theta;
        a.partial_rotary_factor = prf;
        a.top_k_experts = c.u("num_experts_per_tok")?;
        a.hidden_activation = c.s("hidden_act", "silu");
        // HF Qwen3.5-MoE defaults attn_output_gate to true; q_proj is [q | gate] per head.
        a.attn_output_gate = c.b("attn_output_gate", true);
        a.attention_scale = 1.0 / (a.head_dim as f64).sqrt();
        a.embedding_scaled_by_sqrt_hidden = false;
        a.router_scaled = false;
        a.ffn_sandwich_norms = false;
        a.shared_expert_gated = true;
        a.rope_neox_subdim = true;
        a.linear_num_k_heads = c.u("linear_num_key_heads")?;
        a.linear_num_v_heads = c.u("linear_num_value_heads")?;
        a.linear_key_head_dim = c.u("linear_key_head_dim")?;
        a.linear_value_head_dim = c.u("linear_value_head_dim")?;
        a.linear_conv_kernel_size = c.u("linear_conv_kernel_dim")?;
        a.check_layers()?;
        Ok(a)
    }

    /// DeepSeek-V4 (transformers `models/deepseek_v4`): a flat config;
    /// the attention schedule comes from `layer_types` or the legacy `compress_ratios` (0 sliding,
    /// 4 CSA, 128 HCA; truncated to `num_hidden_layers`, so the published list with its trailing
    /// MTP entry works). Neither present is refused: transformers' default is the V4-Pro schedule,
    /// not Flash's. The DeepSeek-specific keys are kept in `extra` as written.
    fn deepseek_v4(c: &Cfg) -> Result<ArchInfo, FormatError> {
        let layers = c.u("num_hidden_layers")?;
        let mask: Vec<u8> = if c.0.contains_key("layer_types") {
            c.layer_types()?
                .iter()
                .map(|t| match t.as_str() {
                    "sliding_attention" => Ok(0),
                    "compressed_sparse_attention" => Ok(3),
                    "heavily_compressed_attention" => Ok(4),
                    other => Err(cfg_err(format!("unknown layer_types entry \"{other}\""))),
                })
                .collect::<Result<_, _>>()?
        } else {
            let ratios =
                c.0.get("compress_ratios")
                    .and_then(|v| v.as_array())
                    .ok_or_else(|| {
                        cfg_err("deepseek_v4 needs \"layer_types\" or \"compress_ratios\"")
                    })?;
            if (ratios.len() as u64) < layers {
                return Err(cfg_err(format!(
                    "compress_ratios has {} entries, num_hidden_layers is {layers}",
                    ratios.len()
                )));
            }
            ratios[..layers as usize]
                .iter()
                .map(|r| match r.as_u64() {
                    Some(0) => Ok(0),
                    Some(4) => Ok(3),
                    Some(128) => Ok(4),
                    _ => Err(cfg_err(format!(
                        "compress_ratios entry {r} is not 0, 4 or 128"
                    ))),
                })
                .collect::<Result<_, _>>()?
        };
        let head_dim = c.u("head_dim")?;
        let rope_dims = c.u("qk_rope_head_dim")?;
        let moe = c.u("moe_intermediate_size")?;
        let mut extra = BTreeMap::new();
        for k in [
            "q_lora_rank",
            "qk_rope_head_dim",
            "o_groups",
            "o_lora_rank",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "hc_mult",
            "hc_sinkhorn_iters",
            "hc_eps",
            "num_hash_layers",
            "n_shared_experts",
            "routed_scaling_factor",
            "swiglu_limit",
            "scoring_func",
            "compress_rope_theta",
            "rope_scaling",
        ] {
            if let Some(v) = c.0.get(k) {
                extra.insert(k.to_string(), v.clone());
            }
        }
        let a = ArchInfo {
            hidden_size: c.u("hidden_size")?,
            ffn_intermediate: moe
                * c.0
                    .get("n_shared_experts")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(1),
            moe_intermediate_size: moe,
            num_heads: c.u("num_attention_heads")?,
            num_kv_heads: c.u("num_key_value_heads")?,
            num_full_kv_heads: c.u("num_key_value_heads")?,
            head_dim,
            full_head_dim: head_dim,
            vocab_size: c.u("vocab_size")?,
            sliding_window: c.u("sliding_window")?,
            final_logit_softcap: 0.0,
            rope_theta: c.f("rope_theta")?,
            full_rope_theta: c.f("compress_rope_theta")?,
            partial_rotary_factor: rope_dims as f64 / head_dim as f64,
            num_layers: layers,
            num_experts: c.u("n_routed_experts")?,
            top_k_experts: c.u("num_experts_per_tok")?,
            tie_word_embeddings: c.b("tie_word_embeddings", false),
            attention_k_eq_v: true,
            hidden_activation: c.s("hidden_act", "silu"),
            full_attention_layer_mask: mask,
            family: Family::DeepseekV4,
            attn_output_gate: false,
            attention_scale: 1.0 / (head_dim as f64).sqrt(),
            embedding_scaled_by_sqrt_hidden: false,
            router_scaled: false,
            ffn_sandwich_norms: false,
            shared_expert_gated: false,
            rope_neox_subdim: false,
            linear_num_k_heads: 0,
            linear_num_v_heads: 0,
            linear_key_head_dim: 0,
            linear_value_head_dim: 0,
            linear_conv_kernel_size: 0,
            extra,
        };
        a.check_layers()?;
        Ok(a)
    }

    /// Maple Preview (deepgrove-ai/mlx-lm-deepgrove `mlx_lm/models/maple.py`): 3 sliding layers
    /// with partial NeoX RoPE,
    /// then 1 full layer without positional encoding; every layer routed (no dense or shared
    /// expert). `fullRopeTheta` is 0: the full layers rotate nothing.
    fn maple(c: &Cfg) -> Result<ArchInfo, FormatError> {
        let mut a = Self::base(c, Family::Maple)?;
        a.full_attention_layer_mask = c
            .layer_types()?
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(0),
                "full_attention" => Ok(1),
                other => Err(cfg_err(format!("unknown layer_types entry \"{other}\""))),
            })
            .collect::<Result<_, _>>()?;
        if !c.b("nope_on_global_attention", true) {
            return Err(cfg_err(
                "maple: nope_on_global_attention false (RoPE on full layers) is not supported",
            ));
        }
        a.ffn_intermediate = c.u("intermediate_size")?;
        a.num_full_kv_heads = a.num_kv_heads;
        a.full_head_dim = a.head_dim;
        a.sliding_window = c.u("sliding_window")?;
        a.rope_theta = c.f("rope_theta")?;
        a.partial_rotary_factor = c.f("partial_rotary_factor")?;
        a.top_k_experts = c.u("num_experts_per_tok")?;
        a.hidden_activation = c.s("hidden_act", "silu");
        a.attention_scale = 1.0 / (a.head_dim as f64).sqrt();
        a.embedding_scaled_by_sqrt_hidden = false;
        a.router_scaled = false;
        a.ffn_sandwich_norms = false;
        a.rope_neox_subdim = true;
        a.check_layers()?;
        Ok(a)
    }

    /// Inkling-Small (`inkling_mm_model`, transformers `models/inkling`). The checkpoint's
    /// `intermediate_size` is the expert width and `dense_intermediate_size` the dense layers'
    /// (transformers swaps them in `__post_init__`). `numHeads`/`numKVHeads`/`headDim` describe the
    /// sliding layers (`swa_*`, falling back to the global counts when absent), `numFullKVHeads`/
    /// `fullHeadDim` the global ones; the rest of the family's keys go to `extra`.
    fn inkling(c: &Cfg) -> Result<ArchInfo, FormatError> {
        let mut a = Self::base_with(c, Family::Inkling, "intermediate_size", "n_routed_experts")?;
        let or = |k: &str, d: u64| c.0.get(k).and_then(|v| v.as_u64()).unwrap_or(d);
        a.num_full_kv_heads = a.num_kv_heads;
        a.full_head_dim = a.head_dim;
        let swa_heads = or("swa_num_attention_heads", a.num_heads);
        a.num_kv_heads = or("swa_num_key_value_heads", a.num_kv_heads);
        a.head_dim = or("swa_head_dim", a.head_dim);
        a.ffn_intermediate = c.u("dense_intermediate_size")?;
        a.sliding_window = c.u("sliding_window_size")?;
        a.top_k_experts = c.u("num_experts_per_tok")?;
        a.hidden_activation = c.s("hidden_act", "silu");
        a.attention_scale = 1.0 / a.full_head_dim as f64;
        a.embedding_scaled_by_sqrt_hidden = false;
        a.router_scaled = false;
        a.ffn_sandwich_norms = false;
        a.linear_conv_kernel_size = c.u("sconv_kernel_size")?;
        let local: Vec<u64> =
            c.0.get("local_layer_ids")
                .and_then(|v| v.as_array())
                .ok_or_else(|| cfg_err("missing \"local_layer_ids\""))?
                .iter()
                .map(|v| {
                    v.as_u64()
                        .ok_or_else(|| cfg_err("non-integer local_layer_ids entry"))
                })
                .collect::<Result<_, _>>()?;
        if let Some(l) = local.iter().find(|&&l| l >= a.num_layers) {
            return Err(cfg_err(format!(
                "local_layer_ids has layer {l}, num_hidden_layers is {}",
                a.num_layers
            )));
        }
        a.full_attention_layer_mask = (0..a.num_layers)
            .map(|i| u8::from(!local.contains(&i)))
            .collect();
        a.extra
            .insert("swaNumAttentionHeads".into(), json!(swa_heads));
        for (key, manifest) in [
            ("unpadded_vocab_size", "unpaddedVocabSize"),
            ("n_shared_experts", "numSharedExperts"),
            ("dense_mlp_idx", "denseMlpIdx"),
            ("d_rel", "dRel"),
            ("rel_extent", "relExtent"),
        ] {
            a.extra.insert(manifest.into(), json!(c.u(key)?));
        }
        for (key, manifest) in [
            ("route_scale", "routeScale"),
            ("logits_mup_width_multiplier", "logitsMupWidthMultiplier"),
            ("log_scaling_alpha", "logScalingAlpha"),
        ] {
            a.extra.insert(manifest.into(), json!(c.f(key)?));
        }
        // `null` turns the log position scale off (transformers' `log_scaling_n_floor: None`).
        let n_floor =
            c.0.get("log_scaling_n_floor")
                .cloned()
                .unwrap_or(Value::Null);
        a.extra.insert("logScalingNFloor".into(), n_floor);
        a.check_layers()?;
        Ok(a)
    }

    fn check_layers(&self) -> Result<(), FormatError> {
        if self.full_attention_layer_mask.len() as u64 != self.num_layers {
            return Err(cfg_err(format!(
                "layer_types has {} entries, num_hidden_layers is {}",
                self.full_attention_layer_mask.len(),
                self.num_layers
            )));
        }
        Ok(())
    }

    /// The manifest JSON object. Gemma omits the family-extension keys.
    pub fn to_json(&self) -> Value {
        let mut m = json!({
            "hiddenSize": self.hidden_size,
            "ffnIntermediate": self.ffn_intermediate,
            "moeIntermediateSize": self.moe_intermediate_size,
            "numHeads": self.num_heads,
            "numKVHeads": self.num_kv_heads,
            "numFullKVHeads": self.num_full_kv_heads,
            "headDim": self.head_dim,
            "fullHeadDim": self.full_head_dim,
            "vocabSize": self.vocab_size,
            "slidingWindow": self.sliding_window,
            "finalLogitSoftcap": self.final_logit_softcap,
            "ropeTheta": self.rope_theta,
            "fullRopeTheta": self.full_rope_theta,
            "partialRotaryFactor": self.partial_rotary_factor,
            "numLayers": self.num_layers,
            "numExperts": self.num_experts,
            "topKExperts": self.top_k_experts,
            "tieWordEmbeddings": self.tie_word_embeddings,
            "attentionKEqV": self.attention_k_eq_v,
            "hiddenActivation": self.hidden_activation,
            "fullAttentionLayerMask": self.full_attention_layer_mask,
        });
        let o = m.as_object_mut().expect("object");
        if self.family != Family::Gemma4 {
            let ext = json!({
                "family": self.family.manifest_name(),
                "attnOutputGate": self.attn_output_gate,
                "attentionScale": self.attention_scale,
                "embeddingScaledBySqrtHidden": self.embedding_scaled_by_sqrt_hidden,
                "routerScaled": self.router_scaled,
                "ffnSandwichNorms": self.ffn_sandwich_norms,
                "sharedExpertGated": self.shared_expert_gated,
                "ropeNeoxSubdim": self.rope_neox_subdim,
                "linearNumKHeads": self.linear_num_k_heads,
                "linearNumVHeads": self.linear_num_v_heads,
                "linearKeyHeadDim": self.linear_key_head_dim,
                "linearValueHeadDim": self.linear_value_head_dim,
                "linearConvKernelSize": self.linear_conv_kernel_size,
            });
            o.extend(ext.as_object().expect("object").clone());
        }
        for (k, v) in &self.extra {
            o.insert(k.clone(), v.clone());
        }
        m
    }

    /// Parse `manifest.json -> arch`. Errors: [`FormatError::ManifestInvalid`] naming the field.
    pub fn from_json(v: &Value) -> Result<ArchInfo, FormatError> {
        let o = v.as_object().ok_or_else(|| merr("arch is not an object"))?;
        let u = |k: &str| {
            o.get(k)
                .and_then(|x| x.as_u64())
                .ok_or_else(|| merr(format!("arch.{k} missing")))
        };
        let f = |k: &str| {
            o.get(k)
                .and_then(|x| x.as_f64())
                .ok_or_else(|| merr(format!("arch.{k} missing")))
        };
        let b = |k: &str| {
            o.get(k)
                .and_then(|x| x.as_bool())
                .ok_or_else(|| merr(format!("arch.{k} missing")))
        };
        let family = match o.get("family") {
            None => Family::Gemma4,
            Some(s) => s
                .as_str()
                .and_then(Family::from_manifest_name)
                .ok_or_else(|| merr(format!("arch.family {s} is unknown")))?,
        };
        let ou = |k: &str, d: u64| o.get(k).and_then(|x| x.as_u64()).unwrap_or(d);
        let of = |k: &str, d: f64| o.get(k).and_then(|x| x.as_f64()).unwrap_or(d);
        let ob = |k: &str, d: bool| o.get(k).and_then(|x| x.as_bool()).unwrap_or(d);
        let mask = o
            .get("fullAttentionLayerMask")
            .and_then(|x| x.as_array())
            .ok_or_else(|| merr("arch.fullAttentionLayerMask missing"))?
            .iter()
            .map(|x| x.as_u64().filter(|&n| n <= 4).map(|n| n as u8))
            .collect::<Option<Vec<u8>>>()
            .ok_or_else(|| merr("arch.fullAttentionLayerMask has a value outside 0..=4"))?;
        const KNOWN: &[&str] = &[
            "hiddenSize",
            "ffnIntermediate",
            "moeIntermediateSize",
            "numHeads",
            "numKVHeads",
            "numFullKVHeads",
            "headDim",
            "fullHeadDim",
            "vocabSize",
            "slidingWindow",
            "finalLogitSoftcap",
            "ropeTheta",
            "fullRopeTheta",
            "partialRotaryFactor",
            "numLayers",
            "numExperts",
            "topKExperts",
            "tieWordEmbeddings",
            "attentionKEqV",
            "hiddenActivation",
            "fullAttentionLayerMask",
            "family",
            "attnOutputGate",
            "attentionScale",
            "embeddingScaledBySqrtHidden",
            "routerScaled",
            "ffnSandwichNorms",
            "sharedExpertGated",
            "ropeNeoxSubdim",
            "linearNumKHeads",
            "linearNumVHeads",
            "linearKeyHeadDim",
            "linearValueHeadDim",
            "linearConvKernelSize",
        ];
        Ok(ArchInfo {
            hidden_size: u("hiddenSize")?,
            ffn_intermediate: u("ffnIntermediate")?,
            moe_intermediate_size: u("moeIntermediateSize")?,
            num_heads: u("numHeads")?,
            num_kv_heads: u("numKVHeads")?,
            num_full_kv_heads: u("numFullKVHeads")?,
            head_dim: u("headDim")?,
            full_head_dim: u("fullHeadDim")?,
            vocab_size: u("vocabSize")?,
            sliding_window: u("slidingWindow")?,
            final_logit_softcap: f("finalLogitSoftcap")?,
            rope_theta: f("ropeTheta")?,
            full_rope_theta: f("fullRopeTheta")?,
            partial_rotary_factor: f("partialRotaryFactor")?,
            num_layers: u("numLayers")?,
            num_experts: u("numExperts")?,
            top_k_experts: u("topKExperts")?,
            tie_word_embeddings: b("tieWordEmbeddings")?,
            attention_k_eq_v: b("attentionKEqV")?,
            hidden_activation: o
                .get("hiddenActivation")
                .and_then(|x| x.as_str())
                .ok_or_else(|| merr("arch.hiddenActivation missing"))?
                .to_string(),
            full_attention_layer_mask: mask,
            family,
            attn_output_gate: ob("attnOutputGate", false),
            attention_scale: of("attentionScale", 1.0),
            embedding_scaled_by_sqrt_hidden: ob("embeddingScaledBySqrtHidden", true),
            router_scaled: ob("routerScaled", true),
            ffn_sandwich_norms: ob("ffnSandwichNorms", true),
            shared_expert_gated: ob("sharedExpertGated", false),
            rope_neox_subdim: ob("ropeNeoxSubdim", false),
            linear_num_k_heads: ou("linearNumKHeads", 0),
            linear_num_v_heads: ou("linearNumVHeads", 0),
            linear_key_head_dim: ou("linearKeyHeadDim", 0),
            linear_value_head_dim: ou("linearValueHeadDim", 0),
            linear_conv_kernel_size: ou("linearConvKernelSize", 0),
            extra: o
                .iter()
                .filter(|(k, _)| !KNOWN.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        })
    }

    /// Compare field by field (exactly, as the original does); the first difference is an
    /// [`FormatError::ArchMismatch`] naming the field and `against` (what was compared).
    pub fn check_matches(&self, other: &ArchInfo, against: &str) -> Result<(), FormatError> {
        let a = self.to_json();
        let b = other.to_json();
        let (a, b) = (
            a.as_object().expect("object"),
            b.as_object().expect("object"),
        );
        let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        for k in keys {
            if a.get(k) != b.get(k) {
                let show = |v: Option<&Value>| v.map_or("nothing".to_string(), |v| v.to_string());
                return Err(FormatError::ArchMismatch {
                    field: k.clone(),
                    manifest: show(a.get(k)),
                    against: against.to_string(),
                    other: show(b.get(k)),
                });
            }
        }
        Ok(())
    }
}

fn merr(detail: impl Into<String>) -> FormatError {
    FormatError::ManifestInvalid {
        detail: detail.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dsv4(extra: Value) -> Value {
        let mut c = json!({
            "model_type": "deepseek_v4", "hidden_size": 256, "moe_intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128, "vocab_size": 1024,
            "num_hidden_layers": 4, "n_routed_experts": 16, "num_experts_per_tok": 6,
            "sliding_window": 32, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "qk_rope_head_dim": 16, "q_lora_rank": 128
        });
        c.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        c
    }

    #[test]
    fn deepseek_v4_schedule_comes_from_compress_ratios_or_layer_types() {
        // The published list has one more (MTP) entry than layers.
        let a =
            ArchInfo::from_config(&dsv4(json!({"compress_ratios": [0, 4, 128, 4, 0]}))).unwrap();
        assert_eq!(a.family, Family::DeepseekV4);
        assert_eq!(a.full_attention_layer_mask, vec![0, 3, 4, 3]);
        assert_eq!(a.num_experts, 16);
        assert_eq!(a.partial_rotary_factor, 0.125);
        assert_eq!(a.extra["q_lora_rank"], json!(128));
        let types = json!({"layer_types": ["sliding_attention", "compressed_sparse_attention",
            "heavily_compressed_attention", "sliding_attention"]});
        let b = ArchInfo::from_config(&dsv4(types)).unwrap();
        assert_eq!(b.full_attention_layer_mask, vec![0, 3, 4, 0]);
        // The arch block round-trips through the manifest JSON.
        assert_eq!(ArchInfo::from_json(&a.to_json()).unwrap(), a);
        // No schedule (transformers would default to V4-Pro's), a short list, an unknown rate.
        for bad in [
            json!({}),
            json!({"compress_ratios": [0, 4, 128]}),
            json!({"compress_ratios": [0, 4, 8, 4]}),
        ] {
            assert!(ArchInfo::from_config(&dsv4(bad.clone())).is_err(), "{bad}");
        }
    }
}

#[cfg(test)]
mod maple_tests {
    use super::*;

    fn fixture() -> Value {
        serde_json::from_str(include_str!(
            "../../../assets/fixtures/maple/A/checkpoint/config.json"
        ))
        .unwrap()
    }

    #[test]
    fn maple_arch_comes_from_its_config() {
        let c = fixture();
        assert_eq!(Family::from_config(&c).unwrap(), Family::Maple);
        let a = ArchInfo::from_config(&c).unwrap();
        assert_eq!(a.full_attention_layer_mask, [0, 0, 0, 1, 0, 0, 0, 1]);
        assert_eq!(
            (a.num_experts, a.top_k_experts, a.sliding_window),
            (16, 8, 32)
        );
        assert_eq!(
            (a.rope_theta, a.full_rope_theta, a.partial_rotary_factor),
            (1e4, 0.0, 0.5)
        );
        assert!(!a.embedding_scaled_by_sqrt_hidden && !a.router_scaled && a.rope_neox_subdim);
        // The manifest form round-trips.
        let back = ArchInfo::from_json(&a.to_json()).unwrap();
        a.check_matches(&back, "round trip").unwrap();
    }

    #[test]
    fn maple_rope_on_full_layers_or_an_unknown_layer_type_is_refused() {
        let mut c = fixture();
        c["nope_on_global_attention"] = false.into();
        assert!(ArchInfo::from_config(&c).is_err());
        let mut c = fixture();
        c["layer_types"][0] = "linear_attention".into();
        assert!(ArchInfo::from_config(&c).is_err());
    }
}
