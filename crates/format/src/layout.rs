//! `packed_experts/layout.json` (`docs/FORMAT.md`). Each MoE layer file
//! `layer_NN.bin` holds `expertsPerLayer` blobs of `expertStride` bytes, expert `e` at
//! `e × expertStride`; inside a blob: gate w,s,b | up w,s,b | down w,s,b, contiguous.

use crate::{Dtype, FormatError};
use serde_json::{json, Map, Value};

/// Largest `layout.json` accepted, bytes.
pub const LAYOUT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// One tensor inside an expert blob. `offset` and `size` are bytes relative to the blob
/// start. `shape` is per expert: logical `[out, in]` for packed weights (`bits` = code
/// width), stored `[out, in/group]` for BF16 scales and biases (`bits` = None).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertTensor {
    pub offset: u64,
    pub size: u64,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub bits: Option<u32>,
}

/// The nine tensors of an expert blob, each `[weights, scales, biases]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertBlobLayout {
    pub gate: [ExpertTensor; 3],
    pub up: [ExpertTensor; 3],
    pub down: [ExpertTensor; 3],
}

/// One layer of the layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerLayout {
    pub layer: usize,
    /// Path relative to the install directory, e.g. `packed_experts/layer_03.bin`.
    pub file: String,
    /// `None` for a dense layer (no routed experts, no file).
    pub blob: Option<ExpertBlobLayout>,
}

/// The whole layout. `expert_stride` in bytes (a 16 KiB multiple, one for all layers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub expert_stride: u64,
    pub num_layers: usize,
    pub experts_per_layer: usize,
    pub layers: Vec<LayerLayout>,
}

const ROLES: [&str; 3] = ["gate", "up", "down"];
const PARTS: [&str; 3] = ["", "_scales", "_biases"];

fn lerr(detail: impl Into<String>) -> FormatError {
    FormatError::LayoutInvalid {
        detail: detail.into(),
    }
}

impl ExpertBlobLayout {
    /// The tensors in blob order: gate w,s,b, up w,s,b, down w,s,b.
    pub fn in_order(&self) -> [&ExpertTensor; 9] {
        let [g, u, d] = [&self.gate, &self.up, &self.down];
        [
            &g[0], &g[1], &g[2], &u[0], &u[1], &u[2], &d[0], &d[1], &d[2],
        ]
    }

    /// Bytes used by the nine tensors (before rounding to the stride).
    pub fn used_bytes(&self) -> u64 {
        self.in_order()
            .iter()
            .map(|t| t.offset + t.size)
            .max()
            .unwrap_or(0)
    }

    fn to_json(&self) -> Value {
        let mut m = Map::new();
        for (r, role) in [&self.gate, &self.up, &self.down].iter().enumerate() {
            for (p, t) in role.iter().enumerate() {
                let mut tj = json!({"offset": t.offset, "size": t.size, "dtype": t.dtype.name(), "shape": t.shape});
                if let Some(b) = t.bits {
                    tj["bits"] = json!(b);
                }
                m.insert(format!("{}{}", ROLES[r], PARTS[p]), tj);
            }
        }
        Value::Object(m)
    }

    fn from_json(v: &Value, stride: u64) -> Result<Self, FormatError> {
        let get = |key: &str| -> Result<ExpertTensor, FormatError> {
            let t = v
                .get(key)
                .ok_or_else(|| lerr(format!("tensor {key} missing")))?;
            let u = |k: &str| {
                t.get(k)
                    .and_then(|x| x.as_u64())
                    .ok_or_else(|| lerr(format!("{key}.{k} missing")))
            };
            let dt = t.get("dtype").and_then(|x| x.as_str()).unwrap_or("");
            let t = ExpertTensor {
                offset: u("offset")?,
                size: u("size")?,
                dtype: Dtype::from_safetensors(dt)
                    .ok_or_else(|| lerr(format!("{key}.dtype \"{dt}\" unknown")))?,
                shape: t
                    .get("shape")
                    .and_then(|s| s.as_array())
                    .and_then(|a| a.iter().map(|d| d.as_u64()).collect::<Option<Vec<u64>>>())
                    .ok_or_else(|| lerr(format!("{key}.shape missing")))?,
                bits: t.get("bits").and_then(|b| b.as_u64()).map(|b| b as u32),
            };
            if t.offset + t.size > stride {
                return Err(lerr(format!(
                    "{key} ends at {} beyond the stride {stride}",
                    t.offset + t.size
                )));
            }
            Ok(t)
        };
        let role = |r: &str| -> Result<[ExpertTensor; 3], FormatError> {
            Ok([
                get(r)?,
                get(&format!("{r}_scales"))?,
                get(&format!("{r}_biases"))?,
            ])
        };
        let blob = ExpertBlobLayout {
            gate: role("gate")?,
            up: role("up")?,
            down: role("down")?,
        };
        let mut spans: Vec<(u64, u64)> = blob
            .in_order()
            .iter()
            .map(|t| (t.offset, t.offset + t.size))
            .collect();
        spans.sort();
        if spans.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err(lerr("tensors inside an expert blob overlap"));
        }
        Ok(blob)
    }
}

impl Layout {
    /// Parse `layout.json`. Checks every expert sits at `e × stride` with size `stride`
    /// and the same tensor layout as expert 0, and that no tensor crosses the stride.
    pub fn parse(bytes: &[u8]) -> Result<Layout, FormatError> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| lerr(format!("not JSON: {e}")))?;
        let u = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_u64())
                .ok_or_else(|| lerr(format!("{k} missing")))
        };
        let expert_stride = u("expertStride")?;
        let num_layers = u("numLayers")? as usize;
        let experts_per_layer = u("expertsPerLayer")? as usize;
        let arr = v
            .get("layers")
            .and_then(|l| l.as_array())
            .ok_or_else(|| lerr("layers missing"))?;
        let mut layers = Vec::with_capacity(arr.len());
        for l in arr {
            let layer = l
                .get("layer")
                .and_then(|x| x.as_u64())
                .ok_or_else(|| lerr("layer index missing"))? as usize;
            let file = l
                .get("file")
                .and_then(|x| x.as_str())
                .ok_or_else(|| lerr("layer file missing"))?;
            if file.contains('/') || file.contains("..") {
                return Err(lerr(format!(
                    "layer file \"{file}\" is not a plain file name"
                )));
            }
            let experts = l
                .get("experts")
                .and_then(|x| x.as_array())
                .ok_or_else(|| lerr("experts missing"))?;
            let blob = if experts.is_empty() {
                None
            } else {
                if experts.len() != experts_per_layer {
                    return Err(lerr(format!(
                        "layer {layer} has {} experts, expected {experts_per_layer}",
                        experts.len()
                    )));
                }
                let t0 = experts[0]
                    .get("tensors")
                    .ok_or_else(|| lerr("tensors missing"))?;
                let blob = ExpertBlobLayout::from_json(t0, expert_stride)?;
                for (e, x) in experts.iter().enumerate() {
                    let ok = x.get("expert").and_then(|y| y.as_u64()) == Some(e as u64)
                        && x.get("offset").and_then(|y| y.as_u64())
                            == Some(e as u64 * expert_stride)
                        && x.get("size").and_then(|y| y.as_u64()) == Some(expert_stride);
                    if !ok {
                        return Err(lerr(format!(
                            "layer {layer} expert {e} is not at e × stride with size stride"
                        )));
                    }
                    if e > 0 && x.get("tensors") != Some(t0) {
                        return Err(lerr(format!(
                            "layer {layer} expert {e} has a different tensor layout"
                        )));
                    }
                }
                Some(blob)
            };
            layers.push(LayerLayout {
                layer,
                file: format!("{}/{file}", crate::EXPERTS_DIR),
                blob,
            });
        }
        Ok(Layout {
            expert_stride,
            num_layers,
            experts_per_layer,
            layers,
        })
    }

    /// The JSON document (every expert listed, identity order).
    pub fn to_json(&self) -> Value {
        let layers: Vec<Value> = self
            .layers
            .iter()
            .map(|l| {
                let experts: Vec<Value> = match &l.blob {
                    None => Vec::new(),
                    Some(b) => {
                        let tensors = b.to_json();
                        (0..self.experts_per_layer)
                            .map(|e| {
                                json!({"expert": e, "offset": e as u64 * self.expert_stride,
                                       "size": self.expert_stride, "tensors": tensors})
                            })
                            .collect()
                    }
                };
                let file = l.file.rsplit('/').next().unwrap_or(&l.file);
                json!({"layer": l.layer, "file": file, "experts": experts})
            })
            .collect();
        json!({"expertStride": self.expert_stride, "numLayers": self.num_layers,
               "expertsPerLayer": self.experts_per_layer, "layers": layers})
    }

    /// Bytes of `layout.json`: pretty-printed, sorted keys, trailing newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        crate::manifest::to_pretty_sorted(&self.to_json())
    }

    /// The layout of `layer`, if listed.
    pub fn layer(&self, layer: usize) -> Option<&LayerLayout> {
        self.layers.iter().find(|l| l.layer == layer)
    }
}
