//! MLX affine quantization metadata (as mlx-lm `mlx_lm/utils.py` writes it): the `config.json`
//! `"quantization"` block with per-module overrides, and the cross-check of bits and group
//! size against the stored shapes.

use crate::FormatError;
use std::collections::BTreeMap;

/// Bits and group size of one quantized module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    /// Bits per code: 2, 3, 4, 5, 6 or 8.
    pub bits: u32,
    /// Elements per (scale, bias) group along the input axis: 32, 64 or 128.
    pub group_size: u32,
}

/// The checkpoint-wide quantization block.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantConfig {
    /// Default for modules without an override.
    pub base: QuantSpec,
    /// `"affine"` (the only mode accepted).
    pub mode: String,
    /// Overrides keyed by module path (tensor name without `.weight`).
    pub overrides: BTreeMap<String, QuantSpec>,
}

fn qerr(detail: impl Into<String>) -> FormatError {
    FormatError::QuantInvalid {
        detail: detail.into(),
    }
}

fn spec_from(v: &serde_json::Value, what: &str) -> Result<QuantSpec, FormatError> {
    let bits = v
        .get("bits")
        .and_then(|b| b.as_u64())
        .ok_or_else(|| qerr(format!("{what} has no integer \"bits\"")))? as u32;
    let group_size =
        v.get("group_size")
            .and_then(|b| b.as_u64())
            .ok_or_else(|| qerr(format!("{what} has no integer \"group_size\"")))? as u32;
    if ![2, 3, 4, 5, 6, 8].contains(&bits) {
        return Err(qerr(format!(
            "{what}: bits {bits} is not one of 2,3,4,5,6,8"
        )));
    }
    if ![32, 64, 128].contains(&group_size) {
        return Err(qerr(format!(
            "{what}: group_size {group_size} is not one of 32,64,128"
        )));
    }
    Ok(QuantSpec { bits, group_size })
}

impl QuantConfig {
    /// Read the `"quantization"` block (falling back to `"quantization_config"`) of a
    /// checkpoint `config.json`. Errors: block missing, mode other than `affine`, bits or
    /// group size out of range, malformed override.
    pub fn from_config(config: &serde_json::Value) -> Result<Self, FormatError> {
        let q = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))
            .ok_or_else(|| qerr("config.json has no \"quantization\" block"))?;
        let obj = q
            .as_object()
            .ok_or_else(|| qerr("\"quantization\" is not an object"))?;
        let mode = obj
            .get("mode")
            .and_then(|m| m.as_str())
            .unwrap_or("affine")
            .to_string();
        if mode != "affine" {
            return Err(qerr(format!(
                "mode \"{mode}\" is not supported (only \"affine\")"
            )));
        }
        let base = spec_from(q, "quantization")?;
        let mut overrides = BTreeMap::new();
        for (k, v) in obj {
            if matches!(k.as_str(), "bits" | "group_size" | "mode") {
                continue;
            }
            // inkling-mlx's converter names its recipe; "uniform" quantizes every target module
            // with the base bits (pipenetwork/Inkling-Small-MLX-4bit's `config.json`), so no
            // override follows.
            if k == "recipe" {
                match v.as_str() {
                    Some("uniform") => continue,
                    _ => {
                        return Err(qerr(format!(
                            "recipe {v} is not supported (only \"uniform\")"
                        )))
                    }
                }
            }
            match v {
                serde_json::Value::Object(_) => {
                    overrides.insert(k.clone(), spec_from(v, &format!("override {k}"))?);
                }
                // mlx-lm writes `false` for a module its predicate left unquantized.
                serde_json::Value::Bool(false) => {}
                _ => return Err(qerr(format!("override {k} is neither an object nor false"))),
            }
        }
        Ok(QuantConfig {
            base,
            mode,
            overrides,
        })
    }

    /// The spec that applies to the packed weight tensor `weight_name` (`P.weight`).
    pub fn spec_for(&self, weight_name: &str) -> QuantSpec {
        let module = weight_name.strip_suffix(".weight").unwrap_or(weight_name);
        self.overrides.get(module).copied().unwrap_or(self.base)
    }
}

/// Cross-check a packed weight `[.., in*bits/32]` and its scales/biases `[.., in/group]`
/// against `spec`, returning the logical shape `[.., in]`. Errors name the tensor and say
/// which dimension disagrees.
pub fn logical_shape(
    name: &str,
    weight: &[u64],
    scales: &[u64],
    biases: &[u64],
    spec: QuantSpec,
) -> Result<Vec<u64>, FormatError> {
    let err = |detail: String| FormatError::ShapeMismatch {
        name: name.into(),
        detail,
    };
    if weight.is_empty() || scales.len() != weight.len() || biases != scales {
        return Err(err(format!(
            "packed weight {weight:?}, scales {scales:?}, biases {biases:?} do not have matching ranks"
        )));
    }
    let r = weight.len() - 1;
    if weight[..r] != scales[..r] {
        return Err(err(format!(
            "leading dims of weight {weight:?} and scales {scales:?} differ"
        )));
    }
    let packed = weight[r];
    if !(packed * 32).is_multiple_of(spec.bits as u64) {
        return Err(err(format!(
            "packed width {packed} is not a whole number of {}-bit codes",
            spec.bits
        )));
    }
    let input = packed * 32 / spec.bits as u64;
    if scales[r] * spec.group_size as u64 != input {
        return Err(err(format!(
            "{} bits gives input width {input} but scales have {} groups of {} (= {}): bits or group size in config.json are wrong",
            spec.bits,
            scales[r],
            spec.group_size,
            scales[r] * spec.group_size as u64
        )));
    }
    let mut out = weight.to_vec();
    out[r] = input;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_wins_and_shapes_cross_check() {
        let cfg: serde_json::Value = serde_json::json!({"quantization": {"group_size": 64, "bits": 4, "mode": "affine",
            "m.router.proj": {"group_size": 64, "bits": 8}}});
        let q = QuantConfig::from_config(&cfg).unwrap();
        assert_eq!(q.spec_for("m.router.proj.weight").bits, 8);
        assert_eq!(q.spec_for("m.q_proj.weight").bits, 4);
        // 4-bit [256, 32] u32 words = 256 inputs = 4 groups of 64.
        assert_eq!(
            logical_shape("x", &[256, 32], &[256, 4], &[256, 4], q.base).unwrap(),
            vec![256, 256]
        );
        // Claiming 8 bits for a 4-bit tensor contradicts the group count.
        let eight = QuantSpec {
            bits: 8,
            group_size: 64,
        };
        assert!(logical_shape("x", &[256, 32], &[256, 4], &[256, 4], eight).is_err());
    }

    #[test]
    fn the_uniform_recipe_is_the_base_spec() {
        let cfg =
            serde_json::json!({"quantization": {"group_size": 64, "bits": 4, "recipe": "uniform"}});
        let q = QuantConfig::from_config(&cfg).unwrap();
        assert_eq!(q.spec_for("model.llm.embed.weight").bits, 4);
        assert!(q.overrides.is_empty());
        let mixed =
            serde_json::json!({"quantization": {"group_size": 64, "bits": 4, "recipe": "mixed"}});
        assert!(QuantConfig::from_config(&mixed).is_err());
    }

    #[test]
    fn missing_or_non_affine_block_is_rejected() {
        assert!(QuantConfig::from_config(&serde_json::json!({})).is_err());
        let mx =
            serde_json::json!({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}});
        assert!(QuantConfig::from_config(&mx).is_err());
    }
}
