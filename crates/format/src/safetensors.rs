//! safetensors shard headers: an 8-byte little-endian length, then a JSON object
//! `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`.
//! Offsets in the JSON are relative to the end of the header; [`TensorInfo::start`] is
//! absolute in the shard file.

use crate::{Dtype, FormatError};

/// Largest header accepted, bytes (real MLX shards have headers well under 1 MiB).
pub const MAX_HEADER_BYTES: u64 = 64 * 1024 * 1024;

/// One tensor of a shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    /// Stored shape (for packed U32 weights: `[.., in*bits/32]`).
    pub shape: Vec<u64>,
    /// Absolute byte offset of the first byte in the shard file.
    pub start: u64,
    /// Size in bytes (= product(shape) × element size).
    pub size: u64,
}

/// A parsed shard header.
#[derive(Clone, Debug)]
pub struct SafetensorsHeader {
    /// Length of the JSON header, bytes.
    pub header_len: u64,
    /// Absolute offset of the data region (8 + header_len).
    pub data_start: u64,
    /// Tensors in header order.
    pub tensors: Vec<TensorInfo>,
    /// `__metadata__` if present.
    pub metadata: Option<serde_json::Map<String, serde_json::Value>>,
}

/// The JSON header length from the first 8 bytes of a shard. Errors if above
/// [`MAX_HEADER_BYTES`].
pub fn header_len(first8: &[u8; 8], file: &str) -> Result<u64, FormatError> {
    let n = u64::from_le_bytes(*first8);
    if !(2..=MAX_HEADER_BYTES).contains(&n) {
        return Err(FormatError::SafetensorsInvalid {
            file: file.into(),
            detail: format!("header length {n} is not plausible"),
        });
    }
    Ok(n)
}

impl SafetensorsHeader {
    /// Parse the JSON header bytes (`json.len()` = header length). `file_size`, if known,
    /// bounds every tensor's data range.
    pub fn parse(json: &[u8], file: &str, file_size: Option<u64>) -> Result<Self, FormatError> {
        let err = |detail: String| FormatError::SafetensorsInvalid {
            file: file.into(),
            detail,
        };
        let header_len = json.len() as u64;
        let data_start = 8 + header_len;
        let v: serde_json::Value =
            serde_json::from_slice(json).map_err(|e| err(format!("header is not JSON: {e}")))?;
        let obj = v
            .as_object()
            .ok_or_else(|| err("header is not an object".into()))?;
        let mut tensors = Vec::with_capacity(obj.len());
        let mut metadata = None;
        for (name, t) in obj {
            if name == "__metadata__" {
                metadata = t.as_object().cloned();
                continue;
            }
            let dt = t.get("dtype").and_then(|d| d.as_str()).unwrap_or("");
            let dtype = Dtype::from_safetensors(dt)
                .ok_or_else(|| err(format!("tensor {name} has unsupported dtype \"{dt}\"")))?;
            let shape: Vec<u64> = t
                .get("shape")
                .and_then(|s| s.as_array())
                .ok_or_else(|| err(format!("tensor {name} has no shape")))?
                .iter()
                .map(|d| {
                    d.as_u64()
                        .ok_or_else(|| err(format!("tensor {name} has a bad shape")))
                })
                .collect::<Result<_, _>>()?;
            let offs = t
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .filter(|a| a.len() == 2)
                .ok_or_else(|| err(format!("tensor {name} has no data_offsets")))?;
            let (b, e) = match (offs[0].as_u64(), offs[1].as_u64()) {
                (Some(b), Some(e)) if e >= b => (b, e),
                _ => return Err(err(format!("tensor {name} has bad data_offsets"))),
            };
            let elems = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let expect = elems.and_then(|n| n.checked_mul(dtype.size_bytes()));
            match expect {
                None => {
                    return Err(err(format!(
                        "tensor {name}: shape {shape:?} {dtype} has more bytes than 64 bits count"
                    )))
                }
                Some(n) if n != e - b => {
                    return Err(err(format!(
                    "tensor {name}: shape {shape:?} {dtype} needs {n} bytes, data_offsets span {}",
                    e - b
                )))
                }
                Some(_) => {}
            }
            if let Some(fs) = file_size {
                if data_start.checked_add(e).is_none_or(|end| end > fs) {
                    return Err(err(format!("tensor {name} ends past the end of the file")));
                }
            }
            tensors.push(TensorInfo {
                name: name.clone(),
                dtype,
                shape,
                start: data_start + b,
                size: e - b,
            });
        }
        Ok(SafetensorsHeader {
            header_len,
            data_start,
            tensors,
            metadata,
        })
    }
}
