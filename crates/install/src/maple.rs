//! Maple Preview's checkpoint layout (deepgrove/maple-preview-2bit-mlx): tensor names without the
//! `language_model.` prefix, ternary projections stored as 2-bit codes plus one BF16 `row_alpha`
//! per output row (no scales or biases), and the optional FlashHead tensors whose bits and group
//! sizes live in `config.json -> flash_head`, not in the quantization block.
//!
//! The one byte rewrite: `row_alpha` becomes MLX affine scales `a` and biases `-a`, each value
//! repeated once per group of the row (`maple.py` `sanitize`, `docs/FORMAT.md`). With codes
//! `q ∈ {0, 1, 2}` the installed `w = a·q − a = a·(q − 1)` is the source's ternary value exactly:
//! `a·q` is exact for `q ≤ 2` (a power-of-two multiple) and so is the subtraction.

use crate::plan::Expand;
use crate::InstallError;
use mference_format::{Dtype, FormatError, QuantSpec, TensorInfo};
use std::collections::BTreeMap;

/// The companion suffix of a ternary weight.
pub const ROW_ALPHA: &str = ".row_alpha";

/// Whether `name` has a prefix Maple checkpoints use (`model.`, `lm_head`, `lm_head_flash.`).
pub fn known_prefix(name: &str) -> bool {
    name.starts_with("model.") || name.starts_with("lm_head")
}

fn shape_err(name: &str, detail: String) -> InstallError {
    FormatError::ShapeMismatch {
        name: name.into(),
        detail,
    }
    .into()
}

/// The specs of the FlashHead modules (`lm_head_flash.centroids`: `bits`/`group_size`;
/// `lm_head_flash.head`: `head_bits`/`head_group_size`, mlx-lm's defaults 4/64), keyed by module
/// path. Empty without a `flash_head` block. Errors: a block whose values are not integers.
pub fn flash_specs(
    config: &serde_json::Value,
) -> Result<BTreeMap<String, QuantSpec>, InstallError> {
    let mut out = BTreeMap::new();
    let Some(f) = config.get("flash_head").filter(|f| !f.is_null()) else {
        return Ok(out);
    };
    let num = |k: &str, default: u64| -> Result<u32, InstallError> {
        match f.get(k) {
            None => Ok(default as u32),
            Some(v) => v.as_u64().map(|n| n as u32).ok_or_else(|| {
                FormatError::QuantInvalid {
                    detail: format!("flash_head.{k} is not an integer"),
                }
                .into()
            }),
        }
    };
    out.insert(
        "lm_head_flash.centroids".into(),
        QuantSpec {
            bits: num("bits", 4)?,
            group_size: num("group_size", 64)?,
        },
    );
    out.insert(
        "lm_head_flash.head".into(),
        QuantSpec {
            bits: num("head_bits", 4)?,
            group_size: num("head_group_size", 64)?,
        },
    );
    Ok(out)
}

/// A ternary weight `w` (`U32 [.., out, in/16]`) with its `row_alpha` (`BF16 [.., out]`) under
/// `spec`: the logical shape `[.., out, in]` and the number of groups per row, which is how many
/// times each alpha is written as a scale and, negated, as a bias.
///
/// Errors: alpha not BF16 or not one value per output row, a spec other than 2-bit, an input width
/// that is not a whole number of groups.
pub fn row_alpha_shape(
    name: &str,
    w: &TensorInfo,
    alpha: &TensorInfo,
    spec: QuantSpec,
) -> Result<(Vec<u64>, u32), InstallError> {
    let r = w.shape.len().saturating_sub(1);
    if alpha.dtype != Dtype::BF16 || w.shape.is_empty() || alpha.shape[..] != w.shape[..r] {
        return Err(shape_err(
            name,
            format!(
                "row_alpha is {} {:?}; expected BF16 {:?} (one value per output row)",
                alpha.dtype,
                alpha.shape,
                &w.shape[..r]
            ),
        ));
    }
    if spec.bits != 2 {
        return Err(shape_err(
            name,
            format!(
                "a row_alpha (ternary) weight must be 2-bit, config.json says {} bits",
                spec.bits
            ),
        ));
    }
    let input = w.shape[r] * 16;
    let group = spec.group_size as u64;
    if !input.is_multiple_of(group) {
        return Err(shape_err(
            name,
            format!("input width {input} is not a whole number of groups of {group}"),
        ));
    }
    let mut logical = w.shape.clone();
    logical[r] = input;
    Ok((logical, (input / group) as u32))
}

/// The two rewrites of one `row_alpha`: scales (`a`, repeated) and biases (`-a`, repeated).
pub fn scale_bias_expansions(groups: u32) -> [Expand; 2] {
    [
        Expand {
            count: groups,
            negate: false,
        },
        Expand {
            count: groups,
            negate: true,
        },
    ]
}

/// The per-expert shape of an expanded scale or bias (`[out, groups]`) from alpha's `[E, out]`.
pub fn expanded_shape(alpha: &TensorInfo, groups: u32) -> Vec<u64> {
    let mut s = alpha.shape[1..].to_vec();
    s.push(groups as u64);
    s
}

/// Apply `e` to the BF16 values `src` (an even number of bytes), appending to `out`.
pub fn expand_into(e: Expand, src: &[u8], out: &mut Vec<u8>) {
    for v in src.chunks_exact(2) {
        let mut bits = u16::from_le_bytes([v[0], v[1]]);
        if e.negate {
            bits ^= 0x8000;
        }
        for _ in 0..e.count {
            out.extend_from_slice(&bits.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion_repeats_and_negates_bf16_values() {
        let src = [0x80, 0x3f, 0x00, 0xc0]; // 1.0, -2.0
        let mut out = Vec::new();
        expand_into(
            Expand {
                count: 2,
                negate: true,
            },
            &src,
            &mut out,
        );
        assert_eq!(out, [0x80, 0xbf, 0x80, 0xbf, 0x00, 0x40, 0x00, 0x40]);
    }
}
