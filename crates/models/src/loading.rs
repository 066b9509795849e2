//! What every family does while it loads: read its `config.json` section, resolve resident and
//! expert tensors, and check their dimensions against the config.

use mference_backend::QRef;
use mference_format::{ExpertTensor, ResidentIndex};
use serde::de::DeserializeOwned;

use crate::ModelError;

/// The `text_config` of a multimodal `config.json`, or the whole of it.
pub(crate) fn text_config(v: &serde_json::Value) -> &serde_json::Value {
    v.get("text_config").unwrap_or(v)
}

/// `v` as a family's `Config`.
///
/// Errors: [`ModelError::Config`] saying `"{what}: {serde's message}"`.
pub(crate) fn parse_config<C: DeserializeOwned>(
    v: &serde_json::Value,
    what: &str,
) -> Result<C, ModelError> {
    serde_json::from_value(v.clone()).map_err(|e| ModelError::Config(format!("{what}: {e}")))
}

/// Refuses a `config.json` whose sizes a forward pass divides or windows by when one is 0 (a head
/// count, a width, a window, the routed top-k), whose top-k exceeds the expert count, or whose
/// RMSNorm epsilon is not in (0, 1), naming the key: such a checkpoint would otherwise install and then panic or compute garbage.
///
/// Errors: [`ModelError::Config`] naming the first bad key.
pub(crate) fn check_sizes(
    family: &str,
    sizes: &[(&str, usize)],
    (top_k, experts): (usize, usize),
    rms_norm_eps: f32,
) -> Result<(), ModelError> {
    // An epsilon of 1 or more swamps the mean square (every row normed to ~0).
    if !(rms_norm_eps > 0.0 && rms_norm_eps < 1.0) {
        return Err(ModelError::Config(format!(
            "{family}: config.json rms_norm_eps {rms_norm_eps} (it must be above 0 and below 1)"
        )));
    }
    if let Some((key, _)) = sizes.iter().find(|(_, v)| *v == 0) {
        return Err(ModelError::Config(format!(
            "{family}: config.json {key} is 0 (it must be at least 1)"
        )));
    }
    if top_k > experts {
        return Err(ModelError::Config(format!(
            "{family}: config.json routes {top_k} experts per token of {experts}"
        )));
    }
    Ok(())
}

/// The error for a config feature a family does not implement.
pub(crate) fn unsupported<T>(family: &str, what: &str) -> Result<T, ModelError> {
    Err(ModelError::Config(format!(
        "{family}: {what} is not supported by this runtime"
    )))
}

/// A tensor `name` has the dimensions config.json implies.
pub(crate) fn check_dims(
    name: &str,
    got: (usize, usize),
    want: (usize, usize),
) -> Result<(), ModelError> {
    if got == want {
        Ok(())
    } else {
        Err(ModelError::Config(format!(
            "{name} is {got:?}, config.json implies {want:?}"
        )))
    }
}

/// The resident quantized Linear `base` (in a resident file of `len` bytes), which must be
/// `[rows, cols]`.
pub(crate) fn linear(
    idx: &ResidentIndex,
    len: usize,
    base: &str,
    rows: usize,
    cols: usize,
) -> Result<QRef, ModelError> {
    let r = QRef::resident(idx, len, base)?;
    check_dims(base, (r.rows, r.cols), (rows, cols))?;
    Ok(r)
}

/// The quantized Linear `name` at `t` inside every expert blob (blobs `stride` bytes apart),
/// which must be `[rows, cols]`.
pub(crate) fn expert_linear(
    name: &str,
    t: &[ExpertTensor; 3],
    stride: usize,
    rows: usize,
    cols: usize,
) -> Result<QRef, ModelError> {
    let r = QRef::expert(name, t, stride)?;
    check_dims(name, (r.rows, r.cols), (rows, cols))?;
    Ok(r)
}
