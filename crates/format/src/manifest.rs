//! `manifest.json` (`docs/FORMAT.md`): magic `GTURBO` v1.0, flags,
//! model id, source snapshot hash, `arch`, `quant`, `files`, expert geometry.

use crate::{ArchInfo, FormatError};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// Required `magic`.
pub const MAGIC: &str = "GTURBO";
/// Supported `versionMajor`.
pub const VERSION_MAJOR: u64 = 1;
/// `versionMinor` written by this tool.
pub const VERSION_MINOR: u64 = 0;
/// Largest `manifest.json` accepted, bytes.
pub const MANIFEST_MAX_BYTES: u64 = 4 * 1024 * 1024;

/// `manifest.json -> flags`. Unknown keys are rejected at parse time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flags {
    pub streaming_present: bool,
    /// Must be false: TurboQuant KV support was removed.
    pub turbo_quant_kv: bool,
    pub ane_shared_expert: bool,
}

/// One `quant` slot: `{weightBits, scheme, scaleType, biasType, groupSize}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantSlot {
    pub weight_bits: u32,
    /// `"affine"`, `"none"` or `"unquantized"`.
    pub scheme: String,
    /// `"BF16"` or `"none"`.
    pub scale_type: String,
    pub bias_type: String,
    pub group_size: u32,
}

impl QuantSlot {
    /// An affine slot with BF16 scales and biases.
    pub fn affine(bits: u32, group_size: u32) -> Self {
        QuantSlot {
            weight_bits: bits,
            scheme: "affine".into(),
            scale_type: "BF16".into(),
            bias_type: "BF16".into(),
            group_size,
        }
    }
}

/// `manifest.json -> quant`: one slot per weight class.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantSlots {
    pub embedding: QuantSlot,
    pub attention: QuantSlot,
    pub router: QuantSlot,
    pub shared_expert: QuantSlot,
    pub routed_expert: QuantSlot,
}

/// `manifest.json -> files[rel]`: size in bytes and lower-case hex SHA-256.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileEntry {
    pub size: u64,
    pub sha256: String,
}

/// The parsed manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    pub magic: String,
    pub version_major: u64,
    pub version_minor: u64,
    pub flags: Flags,
    /// e.g. `mlx-community/gemma-4-26b-a4b-it-4bit`.
    pub model_id: String,
    /// `sha256:<hex of model.safetensors.index.json>`.
    pub source_snapshot_hash: String,
    pub arch: ArchInfo,
    /// Required for production families; `None` only if absent in the file.
    pub quant: Option<QuantSlots>,
    /// Relative path → size and SHA-256, for every file except manifest and receipt.
    pub files: BTreeMap<String, FileEntry>,
    /// Routed experts per MoE layer (0 for a dense model).
    pub experts_per_layer: usize,
    pub num_layers: usize,
    /// Bytes between consecutive expert blobs in a layer file; a 16 KiB multiple.
    pub expert_stride: u64,
    /// Number of per-module quantization overrides in the source config.
    pub bit_width_overrides_honored: u64,
    /// Other top-level keys (`flashHead`, `sidecars`, ...), kept as written.
    pub extra: BTreeMap<String, Value>,
}

fn merr(detail: impl Into<String>) -> FormatError {
    FormatError::ManifestInvalid {
        detail: detail.into(),
    }
}

fn slot_json(s: &QuantSlot) -> Value {
    json!({"weightBits": s.weight_bits, "scheme": s.scheme, "scaleType": s.scale_type,
           "biasType": s.bias_type, "groupSize": s.group_size})
}

fn slot_parse(v: Option<&Value>, name: &str) -> Result<QuantSlot, FormatError> {
    let o = v
        .and_then(|v| v.as_object())
        .ok_or_else(|| merr(format!("quant.{name} missing")))?;
    let s = |k: &str| {
        o.get(k)
            .and_then(|x| x.as_str())
            .map(str::to_string)
            .ok_or_else(|| merr(format!("quant.{name}.{k} missing")))
    };
    let u = |k: &str| {
        o.get(k)
            .and_then(|x| x.as_u64())
            .map(|x| x as u32)
            .ok_or_else(|| merr(format!("quant.{name}.{k} missing")))
    };
    Ok(QuantSlot {
        weight_bits: u("weightBits")?,
        scheme: s("scheme")?,
        scale_type: s("scaleType")?,
        bias_type: s("biasType")?,
        group_size: u("groupSize")?,
    })
}

/// Recursively sort object keys (the manifest and layout are written with sorted keys).
pub fn sorted(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                out.insert(k.clone(), sorted(&m[k]));
            }
            Value::Object(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// Pretty-printed JSON with sorted keys and a trailing newline.
pub fn to_pretty_sorted(v: &Value) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(&sorted(v)).expect("serializable");
    out.push(b'\n');
    out
}

impl Manifest {
    /// How many per-layer expert files (`packed_experts/layer_NN.bin`) the manifest lists: the
    /// MoE layers.
    pub fn expert_layer_files(&self) -> usize {
        let prefix = format!("{}/layer_", crate::EXPERTS_DIR);
        self.files.keys().filter(|k| k.starts_with(&prefix)).count()
    }

    /// Parse and validate the structure of `manifest.json`. Errors: bad magic or major
    /// version, unknown flag keys ([`FormatError::UnknownFlag`]), `turboQuantKV: true`
    /// ([`FormatError::UnsupportedFeature`]), missing fields.
    pub fn parse(bytes: &[u8]) -> Result<Manifest, FormatError> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| merr(format!("not JSON: {e}")))?;
        let o = v.as_object().ok_or_else(|| merr("not an object"))?;
        let magic = o.get("magic").and_then(|m| m.as_str()).unwrap_or("");
        if magic != MAGIC {
            return Err(merr(format!("magic is \"{magic}\", expected \"{MAGIC}\"")));
        }
        let u = |k: &str| {
            o.get(k)
                .and_then(|x| x.as_u64())
                .ok_or_else(|| merr(format!("{k} missing")))
        };
        let version_major = u("versionMajor")?;
        if version_major != VERSION_MAJOR {
            return Err(merr(format!(
                "versionMajor {version_major} is not supported (expected 1)"
            )));
        }
        let flags_obj = o
            .get("flags")
            .and_then(|f| f.as_object())
            .ok_or_else(|| merr("flags missing"))?;
        let mut flags = Flags {
            streaming_present: false,
            turbo_quant_kv: false,
            ane_shared_expert: false,
        };
        for (k, val) in flags_obj {
            let b = val
                .as_bool()
                .ok_or_else(|| merr(format!("flag {k} is not a boolean")))?;
            match k.as_str() {
                "streamingPresent" => flags.streaming_present = b,
                "turboQuantKV" => flags.turbo_quant_kv = b,
                "aneSharedExpert" => flags.ane_shared_expert = b,
                _ => return Err(FormatError::UnknownFlag { flag: k.clone() }),
            }
        }
        if flags.turbo_quant_kv {
            return Err(FormatError::UnsupportedFeature {
                feature: "turboQuantKV (removed TurboQuant KV runtime support)".into(),
            });
        }
        let s = |k: &str| {
            o.get(k)
                .and_then(|x| x.as_str())
                .map(str::to_string)
                .ok_or_else(|| merr(format!("{k} missing")))
        };
        let arch = ArchInfo::from_json(o.get("arch").ok_or_else(|| merr("arch missing"))?)?;
        let quant = match o.get("quant") {
            None => None,
            Some(q) => Some(QuantSlots {
                embedding: slot_parse(q.get("embedding"), "embedding")?,
                attention: slot_parse(q.get("attention"), "attention")?,
                router: slot_parse(q.get("router"), "router")?,
                shared_expert: slot_parse(q.get("sharedExpert"), "sharedExpert")?,
                routed_expert: slot_parse(q.get("routedExpert"), "routedExpert")?,
            }),
        };
        let files: BTreeMap<String, FileEntry> = serde_json::from_value(
            o.get("files")
                .cloned()
                .ok_or_else(|| merr("files missing"))?,
        )
        .map_err(|e| merr(format!("files: {e}")))?;
        for rel in files.keys() {
            if rel.starts_with('/') || rel.split('/').any(|c| c == ".." || c.is_empty()) {
                return Err(merr(format!(
                    "file path \"{rel}\" escapes the install directory"
                )));
            }
        }
        const KNOWN: &[&str] = &[
            "magic",
            "versionMajor",
            "versionMinor",
            "flags",
            "modelID",
            "sourceSnapshotHash",
            "arch",
            "quant",
            "files",
            "expertsPerLayer",
            "numLayers",
            "expertStride",
            "bitWidthOverridesHonored",
        ];
        Ok(Manifest {
            magic: magic.to_string(),
            version_major,
            version_minor: u("versionMinor")?,
            flags,
            model_id: s("modelID")?,
            source_snapshot_hash: s("sourceSnapshotHash")?,
            arch,
            quant,
            files,
            experts_per_layer: u("expertsPerLayer")? as usize,
            num_layers: u("numLayers")? as usize,
            expert_stride: u("expertStride")?,
            bit_width_overrides_honored: o
                .get("bitWidthOverridesHonored")
                .and_then(|x| x.as_u64())
                .unwrap_or(0),
            extra: o
                .iter()
                .filter(|(k, _)| !KNOWN.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        })
    }

    /// The manifest as a JSON value (keys unsorted; see [`Manifest::to_bytes`]).
    pub fn to_json(&self) -> Value {
        let mut m = json!({
            "magic": self.magic,
            "versionMajor": self.version_major,
            "versionMinor": self.version_minor,
            "flags": {"streamingPresent": self.flags.streaming_present,
                      "turboQuantKV": self.flags.turbo_quant_kv,
                      "aneSharedExpert": self.flags.ane_shared_expert},
            "modelID": self.model_id,
            "sourceSnapshotHash": self.source_snapshot_hash,
            "arch": self.arch.to_json(),
            "files": serde_json::to_value(&self.files).expect("serializable"),
            "expertsPerLayer": self.experts_per_layer,
            "numLayers": self.num_layers,
            "expertStride": self.expert_stride,
            "bitWidthOverridesHonored": self.bit_width_overrides_honored,
        });
        let o = m.as_object_mut().expect("object");
        if let Some(q) = &self.quant {
            o.insert(
                "quant".into(),
                json!({"embedding": slot_json(&q.embedding), "attention": slot_json(&q.attention),
                       "router": slot_json(&q.router), "sharedExpert": slot_json(&q.shared_expert),
                       "routedExpert": slot_json(&q.routed_expert)}),
            );
        }
        for (k, v) in &self.extra {
            o.insert(k.clone(), v.clone());
        }
        m
    }

    /// The bytes of `manifest.json`: pretty-printed, sorted keys, trailing newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        to_pretty_sorted(&self.to_json())
    }
}
