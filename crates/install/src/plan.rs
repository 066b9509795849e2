//! The range plan (`docs/FORMAT.md`, "Installer"): every
//! tensor piece becomes a copy `(shard, source offset, size) → (dest file, dest offset)`;
//! copies are checked for overlapping destinations, sorted by source position and coalesced
//! into ranges of at most `max_range_bytes` (64 MiB by default, gap bytes included).

use crate::checkpoint::Checkpoint;
use crate::{maple, InstallError};
use mference_format::layout::{ExpertBlobLayout, ExpertTensor, LayerLayout, Layout};
use mference_format::quant::logical_shape;
use mference_format::{
    layer_file_name, round_up_to_page, ArchInfo, Dtype, Family, IndexEntry, QuantConfig, QuantSlot,
    QuantSlots, QuantSpec, ResidentIndex, TensorInfo, WEIGHTS_FILE,
};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};

/// Default and largest coalesced range, bytes.
pub const MAX_RANGE_BYTES: u64 = 64 << 20;
/// Copy tile, bytes: no buffer holding source bytes is larger.
pub const TILE_BYTES: usize = 512 << 10;
/// Tensor-name prefixes of multimodal towers, never installed.
pub const EXCLUDED_PREFIXES: &[&str] = &[
    "vision_tower.",
    "embed_vision.",
    "audio_tower.",
    "model.visual.",
    "model.audio.",
];

/// One copy: `len` bytes at `src` in shard `shard` go to `dst` in destination file `dest`
/// (an index into [`Plan::dest_files`]), unchanged or through a lossless [`Expand`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeCopy {
    pub shard: usize,
    pub src: u64,
    pub len: u64,
    pub dest: usize,
    pub dst: u64,
    pub expand: Option<Expand>,
}

impl RangeCopy {
    /// Bytes written at `dst`: `len`, or `len × count` for an expansion.
    pub fn dst_len(&self) -> u64 {
        match self.expand {
            None => self.len,
            Some(e) => self.len * e.count as u64,
        }
    }
}

/// The installer's only byte rewrite (Maple's `row_alpha`, `docs/FORMAT.md`): each 2-byte BF16
/// source value is written `count` times, its sign flipped when `negate`. A copy with an expansion
/// covers whole values and is at most [`TILE_BYTES`] of source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expand {
    pub count: u32,
    pub negate: bool,
}

/// A coalesced source range `start..end` of one shard (read in one request) and the copies
/// it feeds (`copies` indexes [`Plan::copies`]). Id `range-%08d`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoalescedRange {
    pub id: String,
    pub shard: usize,
    pub start: u64,
    pub end: u64,
    pub copies: std::ops::Range<usize>,
}

/// The whole install plan, computed before any byte is written.
#[derive(Clone, Debug)]
pub struct Plan {
    pub family: Family,
    pub arch: ArchInfo,
    pub quant: QuantConfig,
    pub quant_slots: QuantSlots,
    /// The resident index (offsets final); `encode()` gives the first `index_size` bytes.
    pub resident: ResidentIndex,
    pub layout: Layout,
    /// Destination files (relative path, final size in bytes); 0 is `model_weights.bin`.
    pub dest_files: Vec<(String, u64)>,
    pub copies: Vec<RangeCopy>,
    pub ranges: Vec<CoalescedRange>,
    /// Source shard file names (index = `RangeCopy::shard`).
    pub shard_files: Vec<String>,
    /// Multimodal tensors left out.
    pub excluded: Vec<String>,
    pub max_range_bytes: u64,
    /// SHA-256 over the ranges, copies, outputs, chunk size and resident index.
    pub fingerprint: String,
}

impl Plan {
    /// Bytes read from the source (gap bytes included).
    pub fn source_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.end - r.start).sum()
    }
    /// Bytes of all destination files.
    pub fn output_bytes(&self) -> u64 {
        self.dest_files.iter().map(|(_, s)| s).sum()
    }
    /// Number of MoE layers (layers with an expert file).
    pub fn expert_layers(&self) -> usize {
        self.layout
            .layers
            .iter()
            .filter(|l| l.blob.is_some())
            .count()
    }
}

fn invalid(detail: impl Into<String>) -> InstallError {
    InstallError::PlanInvalid {
        detail: detail.into(),
    }
}
fn shape_err(name: &str, detail: String) -> InstallError {
    mference_format::FormatError::ShapeMismatch {
        name: name.into(),
        detail,
    }
    .into()
}

/// Index of the decoder layer a tensor belongs to (`...layers.<N>....`).
pub fn layer_index(name: &str) -> Option<usize> {
    let i = name.find(".layers.")?;
    let tail = &name[i + 8..];
    tail[..tail.find('.')?].parse().ok()
}

const GEMMA_SLOTS: &[&str] = &[
    ".self_attn.q_proj.weight",
    ".self_attn.k_proj.weight",
    ".self_attn.v_proj.weight",
    ".self_attn.o_proj.weight",
    ".self_attn.q_norm.weight",
    ".self_attn.k_norm.weight",
    ".router.proj.weight",
    ".router.scale",
    ".router.per_expert_scale",
    ".mlp.gate_proj.weight",
    ".mlp.up_proj.weight",
    ".mlp.down_proj.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".pre_feedforward_layernorm.weight",
    ".pre_feedforward_layernorm_2.weight",
    ".post_feedforward_layernorm.weight",
    ".post_feedforward_layernorm_1.weight",
    ".post_feedforward_layernorm_2.weight",
    ".layer_scalar",
];
const QWEN_SLOTS: &[&str] = &[
    ".self_attn.q_proj.weight",
    ".self_attn.k_proj.weight",
    ".self_attn.v_proj.weight",
    ".self_attn.o_proj.weight",
    ".self_attn.q_norm.weight",
    ".self_attn.k_norm.weight",
    ".linear_attn.in_proj_qkv.weight",
    ".linear_attn.in_proj_z.weight",
    ".linear_attn.in_proj_a.weight",
    ".linear_attn.in_proj_b.weight",
    ".linear_attn.conv1d.weight",
    ".linear_attn.A_log",
    ".linear_attn.dt_bias",
    ".linear_attn.norm.weight",
    ".linear_attn.out_proj.weight",
    ".mlp.gate.weight",
    ".mlp.shared_expert_gate.weight",
    ".mlp.shared_expert.gate_proj.weight",
    ".mlp.shared_expert.up_proj.weight",
    ".mlp.shared_expert.down_proj.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
];

/// Inkling-Small (pipenetwork/Inkling-Small-MLX-4bit's tensor names): attention, the four short
/// convolutions,
/// norms, then the dense MLP or the router and the resident shared (sink) experts.
const INKLING_SLOTS: &[&str] = &[
    ".attn.wq_du.weight",
    ".attn.wk_dv.weight",
    ".attn.wv_dv.weight",
    ".attn.wr_du.weight",
    ".attn.wo_ud.weight",
    ".attn.q_norm.weight",
    ".attn.k_norm.weight",
    ".attn.k_sconv.weight",
    ".attn.v_sconv.weight",
    ".attn.rel_logits_proj.proj",
    ".attn_sconv.weight",
    ".attn_norm.weight",
    ".mlp_norm.weight",
    ".mlp_sconv.weight",
    ".mlp.gate_proj.weight",
    ".mlp.up_proj.weight",
    ".mlp.down_proj.weight",
    ".mlp.global_scale",
    ".mlp.gate.weight",
    ".mlp.gate.bias",
    ".mlp.gate.global_scale",
    ".mlp.shared_experts.gate_proj.weight",
    ".mlp.shared_experts.up_proj.weight",
    ".mlp.shared_experts.down_proj.weight",
];

/// DeepSeek-V4's per-layer slot order (mlx-community/DeepSeek-V4-Flash-2bit-DQ's tensor names).
const DSV4_SLOTS: &[&str] = &[
    ".attn.wq_a.weight",
    ".attn.q_norm.weight",
    ".attn.wq_b.weight",
    ".attn.wkv.weight",
    ".attn.kv_norm.weight",
    ".attn.attn_sink",
    ".attn.wo_a.weight",
    ".attn.wo_b.weight",
    ".attn.compressor.wkv.weight",
    ".attn.compressor.wgate.weight",
    ".attn.compressor.norm.weight",
    ".attn.compressor.ape",
    ".attn.indexer.compressor.wkv.weight",
    ".attn.indexer.compressor.wgate.weight",
    ".attn.indexer.compressor.norm.weight",
    ".attn.indexer.compressor.ape",
    ".attn.indexer.wq_b.weight",
    ".attn.indexer.weights_proj.weight",
    ".attn_norm.weight",
    ".ffn_norm.weight",
    ".attn_hc.fn",
    ".attn_hc.base",
    ".attn_hc.scale",
    ".ffn_hc.fn",
    ".ffn_hc.base",
    ".ffn_hc.scale",
    ".ffn.gate.weight",
    ".ffn.gate.e_score_correction_bias",
    ".ffn.gate.tid2eid",
    ".ffn.shared_experts.gate_proj.weight",
    ".ffn.shared_experts.up_proj.weight",
    ".ffn.shared_experts.down_proj.weight",
];

const MAPLE_SLOTS: &[&str] = &[
    ".self_attn.q_proj.weight",
    ".self_attn.k_proj.weight",
    ".self_attn.v_proj.weight",
    ".self_attn.o_proj.weight",
    ".self_attn.q_norm.weight",
    ".self_attn.k_norm.weight",
    ".mlp.gate.weight",
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
];

/// Whether `name` has a prefix the family's checkpoints use: `language_model.` (Gemma 4, Qwen
/// 3.6: the multimodal wrappers), `model.` / `lm_head.` (DeepSeek-V4's and Maple's flat text
/// checkpoints) or `model.llm.` (Inkling's multimodal wrapper).
fn known_prefix(family: Family, name: &str) -> bool {
    match family {
        Family::DeepseekV4 => name.starts_with("model.") || name.starts_with("lm_head."),
        Family::Maple => maple::known_prefix(name),
        Family::Inkling => name.starts_with("model.llm."),
        _ => name.starts_with("language_model."),
    }
}

/// Deterministic resident order: embedding, then per layer in a fixed per-family slot
/// order, then other top-level tensors, the final norm and the head.
fn order_key(family: Family, n: &str) -> (u8, usize, usize, String) {
    match n.strip_prefix("language_model.").unwrap_or(n) {
        "model.embed_tokens.weight" | "model.word_embeddings.weight" | "model.llm.embed.weight" => {
            return (0, 0, 0, n.into())
        }
        "model.llm.embed_norm.weight" => return (0, 1, 0, n.into()),
        "model.norm.weight" | "model.llm.norm.weight" => return (3, 0, 0, n.into()),
        "lm_head.weight" | "model.llm.unembed.weight" => return (4, 0, 0, n.into()),
        _ => {}
    }
    let slots = match family {
        Family::Qwen3_5Moe => QWEN_SLOTS,
        Family::DeepseekV4 => DSV4_SLOTS,
        Family::Maple => MAPLE_SLOTS,
        Family::Inkling => INKLING_SLOTS,
        _ => GEMMA_SLOTS,
    };
    match layer_index(n) {
        Some(l) => {
            let slot = slots.iter().position(|s| n.ends_with(s)).unwrap_or(100);
            (1, l, slot, n.into())
        }
        None => (2, 0, 0, n.into()),
    }
}

fn routed_container(family: Family) -> &'static str {
    match family {
        Family::Qwen3_5Moe | Family::Maple => ".mlp.switch_mlp.",
        Family::DeepseekV4 => ".ffn.switch_mlp.",
        Family::Inkling => ".mlp.experts.",
        _ => ".experts.switch_glu.",
    }
}

fn role_of(name: &str) -> Option<usize> {
    [".gate_proj.", ".up_proj.", ".down_proj."]
        .iter()
        .position(|r| name.contains(r))
}

/// Cross-check shapes that config.json determines.
fn check_against_config(name: &str, shape: &[u64], a: &ArchInfo) -> Result<(), InstallError> {
    let hidden_norm = [
        "model.norm.weight",
        ".input_layernorm.weight",
        "model.llm.norm.weight",
        "model.llm.embed_norm.weight",
        ".attn_norm.weight",
        ".ffn_norm.weight",
        ".mlp_norm.weight",
    ];
    let want: Option<Vec<u64>> = if name.ends_with("model.embed_tokens.weight")
        || name == "model.word_embeddings.weight"
        || name.ends_with("lm_head.weight")
        || name == "model.llm.embed.weight"
        || name == "model.llm.unembed.weight"
    {
        Some(vec![a.vocab_size, a.hidden_size])
    } else if hidden_norm.iter().any(|s| name.ends_with(s)) {
        Some(vec![a.hidden_size])
    } else {
        None
    };
    match want {
        Some(w) if w != shape => Err(shape_err(
            name,
            format!("shape {shape:?} but config.json implies {w:?}"),
        )),
        _ => Ok(()),
    }
}

struct Resolved<'a> {
    map: HashMap<&'a str, (usize, &'a TensorInfo)>,
}
impl<'a> Resolved<'a> {
    fn get(&self, n: &str) -> Result<(usize, &'a TensorInfo), InstallError> {
        self.map
            .get(n)
            .copied()
            .ok_or_else(|| invalid(format!("tensor {n} is missing")))
    }
}

/// Build the plan. Errors (all before any write): unknown architecture, missing or
/// incompatible quantization metadata, shapes contradicting config.json or the quant
/// metadata, unknown tensors, overlapping destinations.
pub fn build(ck: &Checkpoint, max_range_bytes: u64) -> Result<Plan, InstallError> {
    if max_range_bytes == 0 || max_range_bytes > MAX_RANGE_BYTES {
        return Err(InstallError::BadOption {
            detail: format!("range size must be 1..={MAX_RANGE_BYTES} bytes"),
        });
    }
    let family = Family::from_config(&ck.config)?;
    let arch = ArchInfo::from_config(&ck.config)?;
    let quant = QuantConfig::from_config(&ck.config)?;
    // Modules whose spec is not in the quantization block (Maple's FlashHead).
    let extra_specs = match family {
        Family::Maple => maple::flash_specs(&ck.config)?,
        _ => BTreeMap::new(),
    };
    let spec_for = |name: &str| {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        extra_specs
            .get(module)
            .copied()
            .unwrap_or_else(|| quant.spec_for(name))
    };
    let mut map = HashMap::new();
    for (si, s) in ck.shards.iter().enumerate() {
        for t in &s.header.tensors {
            if map.insert(t.name.as_str(), (si, t)).is_some() {
                return Err(invalid(format!("tensor {} appears in two shards", t.name)));
            }
        }
    }
    let reg = Resolved { map };
    let mut excluded = Vec::new();
    let mut resident_names = Vec::new();
    let mut routed: BTreeMap<usize, [Option<&str>; 3]> = BTreeMap::new();
    let mut consumed_companions = 0usize;
    let mut companions = 0usize;
    for &name in reg.map.keys() {
        if EXCLUDED_PREFIXES.iter().any(|p| name.starts_with(p)) {
            excluded.push(name.to_string());
            continue;
        }
        if name.ends_with(".scales")
            || name.ends_with(".biases")
            || (family == Family::Maple && name.ends_with(maple::ROW_ALPHA))
        {
            companions += 1;
            continue;
        }
        if !known_prefix(family, name) {
            return Err(invalid(format!(
                "tensor {name} has an unknown prefix for {family}"
            )));
        }
        if let Some(l) = layer_index(name) {
            if l as u64 >= arch.num_layers {
                return Err(shape_err(
                    name,
                    format!("layer {l} but config.json has {} layers", arch.num_layers),
                ));
            }
        }
        match (
            name.contains(routed_container(family)),
            role_of(name),
            layer_index(name),
        ) {
            (true, Some(role), Some(l)) => {
                let slot = &mut routed.entry(l).or_default()[role];
                if slot.replace(name).is_some() {
                    return Err(invalid(format!("two routed-expert tensors for layer {l}")));
                }
            }
            (true, _, _) => {
                return Err(invalid(format!(
                    "routed-expert tensor {name} has no role or layer"
                )))
            }
            _ => resident_names.push(name),
        }
    }
    excluded.sort();
    resident_names.sort_by_key(|n| order_key(family, n));

    // Resident file.
    let index_size = ResidentIndex::index_size_for(resident_names.iter().copied());
    let mut cursor = index_size;
    let mut entries = Vec::with_capacity(resident_names.len());
    let mut copies = Vec::new();
    for &name in &resident_names {
        let (si, w) = reg.get(name)?;
        let quantized = w.dtype == Dtype::U32 && name.ends_with(".weight");
        if quantized {
            let base = &name[..name.len() - ".weight".len()];
            let (logical, [sc, bi]) = companions_of(&reg, name, base, w, spec_for(name))?;
            consumed_companions += if sc.shard == bi.shard && sc.start == bi.start {
                1
            } else {
                2
            };
            check_against_config(name, &logical, &arch)?;
            let shape = pad4(name, &logical)?;
            let e = IndexEntry {
                name: name.to_string(),
                dtype: Dtype::U32,
                file_offset: cursor,
                size_bytes: w.size,
                shape,
                scale_offset: cursor + w.size,
                scale_size: sc.dst_len(),
                bias_offset: cursor + w.size + sc.dst_len(),
                bias_size: bi.dst_len(),
            };
            copies.push(RangeCopy {
                shard: si,
                src: w.start,
                len: w.size,
                dest: 0,
                dst: e.file_offset,
                expand: None,
            });
            for (p, dst) in [(sc, e.scale_offset), (bi, e.bias_offset)] {
                copies.push(RangeCopy {
                    shard: p.shard,
                    src: p.start,
                    len: p.len,
                    dest: 0,
                    dst,
                    expand: p.expand,
                });
            }
            cursor = e.bias_offset + e.bias_size;
            entries.push(e);
        } else {
            check_against_config(name, &w.shape, &arch)?;
            let e = IndexEntry {
                name: name.to_string(),
                dtype: w.dtype,
                file_offset: cursor,
                size_bytes: w.size,
                shape: pad4(name, &w.shape)?,
                scale_offset: 0,
                scale_size: 0,
                bias_offset: 0,
                bias_size: 0,
            };
            copies.push(RangeCopy {
                shard: si,
                src: w.start,
                len: w.size,
                dest: 0,
                dst: cursor,
                expand: None,
            });
            cursor += w.size;
            entries.push(e);
        }
    }
    let resident = ResidentIndex::new(index_size, cursor - index_size, entries);

    // Expert layers.
    let experts = arch.num_experts;
    // Per layer: the blob layout and its slices (one expert's part, blob offset).
    type Slice = (Part, u64);
    let mut blobs: BTreeMap<usize, (ExpertBlobLayout, Vec<Slice>)> = BTreeMap::new();
    for (&l, roles) in &routed {
        let mut cursor = 0u64;
        let mut tensors: Vec<ExpertTensor> = Vec::with_capacity(9);
        let mut slices: Vec<Slice> = Vec::with_capacity(9);
        for (r, name) in roles.iter().enumerate() {
            let name = name
                .ok_or_else(|| invalid(format!("layer {l} routed-expert bundle is incomplete")))?;
            let (si, w) = reg.get(name)?;
            if w.dtype != Dtype::U32 || w.shape.len() != 3 || w.shape[0] != experts {
                return Err(shape_err(
                    name,
                    format!(
                        "expected U32 [{experts}, out, in/pack], got {} {:?}",
                        w.dtype, w.shape
                    ),
                ));
            }
            let base = name.strip_suffix(".weight").unwrap_or(name);
            let spec = spec_for(name);
            let (logical, [sc, bi]) = companions_of(&reg, name, base, w, spec)?;
            consumed_companions += if sc.start == bi.start && sc.shard == bi.shard {
                1
            } else {
                2
            };
            let (h, m) = (arch.hidden_size, arch.moe_intermediate_size);
            let want = if r == 2 {
                [experts, h, m]
            } else {
                [experts, m, h]
            };
            if logical != want {
                return Err(shape_err(
                    name,
                    format!("logical shape {logical:?} but config.json implies {want:?}"),
                ));
            }
            let weights = Part {
                shard: si,
                start: w.start,
                len: w.size,
                expand: None,
                shape: logical.clone(),
            };
            for (k, (p, tname)) in [(weights, name), (sc, name), (bi, name)]
                .into_iter()
                .enumerate()
            {
                if p.len % experts != 0 {
                    return Err(shape_err(
                        tname,
                        format!("{} bytes do not split into {experts} experts", p.len),
                    ));
                }
                let per = p.len / experts;
                let e = Part { len: per, ..p };
                tensors.push(ExpertTensor {
                    offset: cursor,
                    size: e.dst_len(),
                    dtype: if k == 0 { Dtype::U32 } else { Dtype::BF16 },
                    shape: e.shape[1..].to_vec(),
                    bits: (k == 0).then_some(spec.bits),
                });
                let size = e.dst_len();
                slices.push((e, cursor));
                cursor += size;
            }
        }
        let mut it = tensors.into_iter();
        let mut three = || -> [ExpertTensor; 3] {
            [it.next().unwrap(), it.next().unwrap(), it.next().unwrap()]
        };
        let blob = ExpertBlobLayout {
            gate: three(),
            up: three(),
            down: three(),
        };
        blobs.insert(l, (blob, slices));
    }
    if consumed_companions != companions {
        return Err(invalid(format!(
            "{} .scales/.biases/.row_alpha tensors have no packed U32 .weight to belong to",
            companions - consumed_companions
        )));
    }
    let stride = blobs
        .values()
        .map(|(b, _)| round_up_to_page(b.used_bytes()))
        .max()
        .unwrap_or(0);
    let mut dest_files = vec![(
        WEIGHTS_FILE.to_string(),
        index_size + resident.resident_size,
    )];
    let mut layers = Vec::with_capacity(arch.num_layers as usize);
    for l in 0..arch.num_layers as usize {
        let file = layer_file_name(l);
        let blob = match blobs.remove(&l) {
            None => None,
            Some((blob, slices)) => {
                let dest = dest_files.len();
                dest_files.push((file.clone(), experts * stride));
                for e in 0..experts {
                    for (p, off) in &slices {
                        copies.push(RangeCopy {
                            shard: p.shard,
                            src: p.start + e * p.len,
                            len: p.len,
                            dest,
                            dst: e * stride + off,
                            expand: p.expand,
                        });
                    }
                }
                Some(blob)
            }
        };
        layers.push(LayerLayout {
            layer: l,
            file,
            blob,
        });
    }
    let experts_per_layer = if layers.iter().any(|l| l.blob.is_some()) {
        experts as usize
    } else {
        0
    };
    let layout = Layout {
        expert_stride: stride,
        num_layers: arch.num_layers as usize,
        experts_per_layer,
        layers,
    };

    check_destinations(&copies, &dest_files, index_size)?;
    let ranges = coalesce(&mut copies, max_range_bytes)?;
    let quant_slots = quant_slots(family, &quant, &reg);
    let shard_files: Vec<String> = ck.shards.iter().map(|s| s.file.clone()).collect();
    let fingerprint = fingerprint(
        &resident,
        &dest_files,
        &copies,
        &ranges,
        &shard_files,
        max_range_bytes,
    )?;
    Ok(Plan {
        family,
        arch,
        quant,
        quant_slots,
        resident,
        layout,
        dest_files,
        copies,
        ranges,
        shard_files,
        excluded,
        max_range_bytes,
        fingerprint,
    })
}

/// The source of one piece of a quantized tensor (its weights, scales or biases): `len` bytes at
/// `start` of shard `shard`, copied as they are or through `expand`; `shape` is the stored shape
/// written to the install.
#[derive(Clone, Debug)]
struct Part {
    shard: usize,
    start: u64,
    len: u64,
    expand: Option<Expand>,
    shape: Vec<u64>,
}

impl Part {
    fn dst_len(&self) -> u64 {
        match self.expand {
            None => self.len,
            Some(e) => self.len * e.count as u64,
        }
    }
}

/// The scales and biases of the packed weight `name` (`base.weight`, `w`) and its logical shape:
/// `base.scales` / `base.biases` as stored, or (Maple) both made from `base.row_alpha`.
fn companions_of(
    reg: &Resolved,
    name: &str,
    base: &str,
    w: &TensorInfo,
    spec: QuantSpec,
) -> Result<(Vec<u64>, [Part; 2]), InstallError> {
    let alpha = format!("{base}{}", maple::ROW_ALPHA);
    if !reg.map.contains_key(format!("{base}.scales").as_str())
        && reg.map.contains_key(alpha.as_str())
    {
        let (sh, a) = reg.get(&alpha)?;
        let (logical, groups) = maple::row_alpha_shape(name, w, a, spec)?;
        let mut shape = a.shape.clone();
        shape.push(groups as u64);
        let part = |e: Expand| Part {
            shard: sh,
            start: a.start,
            len: a.size,
            expand: Some(e),
            shape: shape.clone(),
        };
        let [s, b] = maple::scale_bias_expansions(groups);
        return Ok((logical, [part(s), part(b)]));
    }
    let (ss, s) = reg.get(&format!("{base}.scales"))?;
    let (bs, b) = reg.get(&format!("{base}.biases"))?;
    if s.dtype != Dtype::BF16 || b.dtype != Dtype::BF16 {
        return Err(shape_err(
            name,
            format!("scales/biases are {}/{}, expected BF16", s.dtype, b.dtype),
        ));
    }
    let logical = logical_shape(name, &w.shape, &s.shape, &b.shape, spec)?;
    let part = |shard: usize, t: &TensorInfo| Part {
        shard,
        start: t.start,
        len: t.size,
        expand: None,
        shape: t.shape.clone(),
    };
    Ok((logical, [part(ss, s), part(bs, b)]))
}

fn pad4(name: &str, shape: &[u64]) -> Result<[u32; 4], InstallError> {
    if shape.len() > 4 {
        return Err(shape_err(name, format!("rank {} is above 4", shape.len())));
    }
    let mut out = [0u32; 4];
    for (o, &d) in out.iter_mut().zip(shape) {
        *o = u32::try_from(d)
            .map_err(|_| shape_err(name, format!("dimension {d} does not fit u32")))?;
    }
    Ok(out)
}

/// Destinations must lie inside their files (resident copies after the index) and never
/// overlap one another.
pub fn check_destinations(
    copies: &[RangeCopy],
    dest_files: &[(String, u64)],
    index_size: u64,
) -> Result<(), InstallError> {
    let mut by_dest: Vec<Vec<(u64, u64)>> = vec![Vec::new(); dest_files.len()];
    for c in copies {
        let end = c
            .dst
            .checked_add(c.dst_len())
            .ok_or_else(|| invalid("destination offset overflows"))?;
        if end > dest_files[c.dest].1 || (c.dest == 0 && c.dst < index_size) {
            return Err(invalid(format!(
                "a copy to {} at {}..{end} is outside the file",
                dest_files[c.dest].0, c.dst
            )));
        }
        by_dest[c.dest].push((c.dst, end));
    }
    for (d, mut v) in by_dest.into_iter().enumerate() {
        v.sort_unstable();
        if let Some(w) = v.windows(2).find(|w| w[0].1 > w[1].0) {
            return Err(invalid(format!(
                "destinations overlap in {}: {}..{} and {}..{}",
                dest_files[d].0, w[0].0, w[0].1, w[1].0, w[1].1
            )));
        }
    }
    Ok(())
}

/// Split copies at `max` bytes (an expansion at whole BF16 values and at most [`TILE_BYTES`]),
/// sort by (shard, source offset), and merge while the span stays within `max`. Reorders
/// `copies` so each range's copies are contiguous. Two copies may read the same source bytes
/// only as a whole (a `row_alpha` feeding both scales and biases).
pub fn coalesce(
    copies: &mut Vec<RangeCopy>,
    max: u64,
) -> Result<Vec<CoalescedRange>, InstallError> {
    let mut split = Vec::with_capacity(copies.len());
    for c in copies.iter() {
        let (piece, per) = match c.expand {
            None => (max, 1),
            Some(e) if c.len.is_multiple_of(2) && max >= 2 => {
                (max.min(TILE_BYTES as u64) & !1, e.count as u64)
            }
            Some(_) => {
                return Err(InstallError::BadOption {
                    detail: format!(
                        "a row_alpha copy of {} bytes needs ranges of at least 2 bytes and whole \
                         BF16 values",
                        c.len
                    ),
                })
            }
        };
        let mut off = 0;
        while off < c.len {
            let n = (c.len - off).min(piece);
            split.push(RangeCopy {
                src: c.src + off,
                len: n,
                dst: c.dst + off * per,
                ..*c
            });
            off += n;
        }
    }
    split.sort_unstable_by_key(|c| (c.shard, c.src, c.dest, c.dst));
    if let Some(w) = split.windows(2).find(|w| {
        w[0].shard == w[1].shard
            && w[0].src + w[0].len > w[1].src
            && (w[0].src, w[0].len) != (w[1].src, w[1].len)
    }) {
        return Err(invalid(format!(
            "two copies read overlapping source bytes at {}",
            w[1].src
        )));
    }
    *copies = split;
    let mut ranges: Vec<CoalescedRange> = Vec::new();
    for (i, c) in copies.iter().enumerate() {
        match ranges.last_mut() {
            Some(r) if r.shard == c.shard && c.src + c.len - r.start <= max => {
                r.end = c.src + c.len;
                r.copies.end = i + 1;
            }
            _ => ranges.push(CoalescedRange {
                id: format!("range-{:08}", ranges.len()),
                shard: c.shard,
                start: c.src,
                end: c.src + c.len,
                copies: i..i + 1,
            }),
        }
    }
    Ok(ranges)
}

fn fingerprint(
    resident: &ResidentIndex,
    dest_files: &[(String, u64)],
    copies: &[RangeCopy],
    ranges: &[CoalescedRange],
    shard_files: &[String],
    max: u64,
) -> Result<String, InstallError> {
    let mut h = Sha256::new();
    h.update(format!("gturbo-plan v1\nchunk {max}\nlayout identity\n"));
    h.update(format!(
        "resident-index {}\n",
        mference_format::hash::sha256_hex(&resident.encode()?)
    ));
    for (rel, size) in dest_files {
        h.update(format!("out {rel} {size}\n"));
    }
    for r in ranges {
        h.update(format!(
            "{} {} {} {}\n",
            r.id, shard_files[r.shard], r.start, r.end
        ));
        for c in &copies[r.copies.clone()] {
            h.update(format!(" {} {} {} {}", c.src, c.len, c.dest, c.dst));
            if let Some(e) = c.expand {
                h.update(format!(
                    " expand {} {}",
                    e.count,
                    if e.negate { "-" } else { "+" }
                ));
            }
            h.update("\n");
        }
    }
    Ok(mference_format::hash::hex(&h.finalize()))
}

fn quant_slots(family: Family, q: &QuantConfig, reg: &Resolved) -> QuantSlots {
    let find = |suffixes: &[&str]| -> QuantSlot {
        let mut names: Vec<&&str> = reg
            .map
            .keys()
            .filter(|n| suffixes.iter().any(|s| n.ends_with(s)))
            .collect();
        names.sort_by_key(|n| (layer_index(n), n.to_string()));
        match names.iter().find(|n| reg.map[**n].1.dtype == Dtype::U32) {
            Some(n) => {
                let s = q.spec_for(n);
                QuantSlot::affine(s.bits, s.group_size)
            }
            None => QuantSlot {
                weight_bits: 0,
                scheme: "none".into(),
                scale_type: "none".into(),
                bias_type: "none".into(),
                group_size: 0,
            },
        }
    };
    let routed = find(&[
        ".switch_glu.gate_proj.weight",
        ".switch_mlp.gate_proj.weight",
    ]);
    match family {
        Family::Inkling => QuantSlots {
            embedding: find(&["model.llm.embed.weight"]),
            attention: find(&[".attn.wq_du.weight"]),
            router: find(&[".mlp.gate.weight"]),
            shared_expert: find(&[".mlp.shared_experts.gate_proj.weight"]),
            routed_expert: find(&[".mlp.experts.gate_proj.weight"]),
        },
        Family::Qwen3_5Moe => QuantSlots {
            embedding: find(&["model.embed_tokens.weight"]),
            attention: find(&[
                ".self_attn.q_proj.weight",
                ".linear_attn.in_proj_qkv.weight",
            ]),
            router: find(&[".mlp.gate.weight"]),
            shared_expert: find(&[".mlp.shared_expert.gate_proj.weight"]),
            routed_expert: routed,
        },
        Family::DeepseekV4 => QuantSlots {
            embedding: find(&["model.embed_tokens.weight"]),
            attention: find(&[".attn.wq_a.weight"]),
            router: find(&[".ffn.gate.weight"]),
            shared_expert: find(&[".ffn.shared_experts.gate_proj.weight"]),
            routed_expert: routed,
        },
        Family::Maple => QuantSlots {
            embedding: find(&["model.word_embeddings.weight"]),
            attention: find(&[".self_attn.q_proj.weight"]),
            router: find(&[".mlp.gate.weight"]),
            shared_expert: find(&[".mlp.shared_expert.gate_proj.weight"]),
            routed_expert: routed,
        },
        _ => QuantSlots {
            embedding: find(&["model.embed_tokens.weight"]),
            attention: find(&[".self_attn.q_proj.weight"]),
            router: find(&[".router.proj.weight"]),
            shared_expert: find(&[".mlp.gate_proj.weight"]),
            routed_expert: routed,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(shard: usize, src: u64, len: u64, dst: u64) -> RangeCopy {
        RangeCopy {
            shard,
            src,
            len,
            dest: 0,
            dst,
            expand: None,
        }
    }

    #[test]
    fn coalescing_splits_large_copies_and_respects_the_limit() {
        let mut v = vec![c(0, 100, 10, 0), c(0, 0, 25, 10), c(1, 0, 5, 35)];
        let r = coalesce(&mut v, 20).unwrap();
        // Source order: (0,0..20) (0,20..25) (0,100..110) (1,0..5).
        assert_eq!(v.len(), 4);
        let spans: Vec<(usize, u64, u64)> = r.iter().map(|r| (r.shard, r.start, r.end)).collect();
        assert_eq!(
            spans,
            vec![(0, 0, 20), (0, 20, 25), (0, 100, 110), (1, 0, 5)]
        );
        let mut v = vec![c(0, 0, 5, 0), c(0, 8, 5, 5)];
        let r = coalesce(&mut v, 20).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].start, r[0].end), (0, 13));
    }

    #[test]
    fn overlapping_destinations_are_rejected() {
        let files = vec![("a".to_string(), 100u64)];
        assert!(check_destinations(&[c(0, 0, 10, 0), c(0, 10, 10, 5)], &files, 0).is_err());
        assert!(check_destinations(&[c(0, 0, 10, 0), c(0, 10, 10, 10)], &files, 0).is_ok());
        assert!(check_destinations(&[c(0, 0, 10, 95)], &files, 0).is_err());
    }
}
