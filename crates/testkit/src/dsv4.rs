//! Synthetic DeepSeek-V4-Flash checkpoints at full width: the tensor table of the pinned 2-bit DQ
//! MLX checkpoint (the pinned checkpoint's `model.safetensors.index.json`: names, dtypes, stored shapes, mixed 2/4-bit
//! and group 32/64) for any number of layers and any attention schedule, its `config.json`, and a
//! streaming writer of a single-file checkpoint with random weights of sane scale (quantized
//! weights `N(0, 1/fan_in)`-like, norms 1, mHC bases 0 and scales 1, sinks and position biases 0,
//! `tid2eid` six distinct experts per token), optionally with the routed experts left as holes
//! and written into the install afterwards ([`Experts::Holes`], [`fill_experts`]); and the
//! golden fixture A widened to the tokenizer's vocabulary for the text commands
//! ([`write_text_checkpoint`]).

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use mference_format::layout::Layout;
use serde_json::{json, Value};

/// The real model's sizes, with the layer count and schedule to build.
#[derive(Clone, Debug)]
pub struct Dims {
    /// Per layer 0 (sliding), 4 (CSA) or 128 (HCA).
    pub compress_ratios: Vec<u64>,
    pub num_hash_layers: usize,
    pub hidden: u64,
    pub vocab: u64,
    pub experts: u64,
    pub moe: u64,
}

impl Dims {
    /// DeepSeek-V4-Flash's widths over `compress_ratios.len()` layers.
    pub fn flash(compress_ratios: Vec<u64>, num_hash_layers: usize) -> Self {
        Self {
            compress_ratios,
            num_hash_layers,
            hidden: 4096,
            vocab: 129_280,
            experts: 256,
            moe: 2048,
        }
    }

    /// The published 43-layer schedule: sliding 0-1, then CSA on even and HCA on odd layers.
    pub fn flash_schedule(layers: usize) -> Vec<u64> {
        (0..layers)
            .map(|l| match l {
                0 | 1 => 0,
                l if l % 2 == 0 => 4,
                _ => 128,
            })
            .collect()
    }

    fn layers(&self) -> usize {
        self.compress_ratios.len()
    }

    /// The routed `gate_proj` group: 32, except 64 on the real model's last layer (42).
    fn gate_group(&self, l: usize) -> u64 {
        if l == 42 {
            64
        } else {
            32
        }
    }
}

/// How a synthetic tensor is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Random packed codes (U32).
    Codes,
    /// BF16 scales / biases of a quantized module: `w = s·q + b` with mean 0 and std `1/√fan_in`.
    Scales {
        bits: u32,
        fan_in: u64,
    },
    Biases {
        bits: u32,
        fan_in: u64,
    },
    /// Uniform with this standard deviation (BF16 or F32).
    Uniform(f32),
    /// This constant (BF16 or F32).
    Const(f32),
    /// `tid2eid`: six distinct expert ids per row (I64).
    ExpertIds {
        experts: u64,
    },
}

/// One tensor of the table.
#[derive(Clone, Debug)]
pub struct SynthTensor {
    pub name: String,
    /// safetensors dtype (`U32`, `BF16`, `F32`, `I64`).
    pub dtype: &'static str,
    pub shape: Vec<u64>,
    pub fill: Fill,
}

impl SynthTensor {
    /// Bytes of its data.
    pub fn size(&self) -> u64 {
        let width = match self.dtype {
            "BF16" => 2,
            "I64" => 8,
            _ => 4,
        };
        self.shape.iter().product::<u64>() * width
    }
}

struct Table(Vec<SynthTensor>);

impl Table {
    fn add(&mut self, name: String, dtype: &'static str, shape: &[u64], fill: Fill) {
        self.0.push(SynthTensor {
            name,
            dtype,
            shape: shape.to_vec(),
            fill,
        });
    }

    /// An MLX affine module `<base>.{weight, scales, biases}` of logical `[.., cols]`.
    fn quant(&mut self, base: &str, lead: &[u64], cols: u64, bits: u32, group: u64) {
        let shape = |last: u64| [lead, &[last]].concat();
        self.add(
            format!("{base}.weight"),
            "U32",
            &shape(cols * bits as u64 / 32),
            Fill::Codes,
        );
        let fan_in = cols;
        self.add(
            format!("{base}.scales"),
            "BF16",
            &shape(cols / group),
            Fill::Scales { bits, fan_in },
        );
        self.add(
            format!("{base}.biases"),
            "BF16",
            &shape(cols / group),
            Fill::Biases { bits, fan_in },
        );
    }
}

/// The checkpoint's `config.json` (flat, legacy keys as published).
pub fn config(d: &Dims) -> Value {
    let mut quant = serde_json::Map::new();
    quant.insert("group_size".into(), json!(64));
    quant.insert("bits".into(), json!(4));
    quant.insert("mode".into(), json!("affine"));
    for l in 0..d.layers() {
        for (p, g) in [
            ("gate_proj", d.gate_group(l)),
            ("up_proj", 64),
            ("down_proj", 64),
        ] {
            quant.insert(
                format!("model.layers.{l}.ffn.switch_mlp.{p}"),
                json!({"group_size": g, "bits": 2}),
            );
        }
    }
    let mut ratios = d.compress_ratios.clone();
    ratios.push(0); // the MTP entry, as in the real file
    json!({
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "bos_token_id": 0, "eos_token_id": 1,
        "compress_ratios": ratios, "compress_rope_theta": 160000.0, "hc_eps": 1e-6, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "hidden_size": d.hidden,
        "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
        "moe_intermediate_size": d.moe, "n_routed_experts": d.experts, "n_shared_experts": 1,
        "norm_topk_prob": true, "num_attention_heads": 64, "num_experts_per_tok": 6,
        "num_hash_layers": d.num_hash_layers, "num_hidden_layers": d.layers(),
        "num_key_value_heads": 1, "num_nextn_predict_layers": 1,
        "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
        "quantization": quant,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "rope_theta": 10000.0, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": false,
        "vocab_size": d.vocab
    })
}

/// Every tensor of the checkpoint, in a fixed order.
pub fn tensors(d: &Dims) -> Vec<SynthTensor> {
    let (h, v, e, moe) = (d.hidden, d.vocab, d.experts, d.moe);
    let mut t = Table(Vec::new());
    t.quant("model.embed_tokens", &[v], h, 4, 64);
    t.quant("lm_head", &[v], h, 4, 64);
    t.add("model.norm.weight".into(), "BF16", &[h], Fill::Const(1.0));
    let fan = (4 * h) as f32;
    t.add(
        "model.hc_head.fn".into(),
        "F32",
        &[4, 4 * h],
        Fill::Uniform(fan.powf(-0.5)),
    );
    t.add("model.hc_head.base".into(), "F32", &[4], Fill::Const(0.0));
    t.add("model.hc_head.scale".into(), "F32", &[1], Fill::Const(1.0));
    for (l, &ratio) in d.compress_ratios.iter().enumerate() {
        let b = format!("model.layers.{l}");
        let a = format!("{b}.attn");
        t.quant(&format!("{a}.wq_a"), &[1024], h, 4, 64);
        t.add(
            format!("{a}.q_norm.weight"),
            "BF16",
            &[1024],
            Fill::Const(1.0),
        );
        t.quant(&format!("{a}.wq_b"), &[32768], 1024, 4, 64);
        t.quant(&format!("{a}.wkv"), &[512], h, 4, 64);
        t.add(
            format!("{a}.kv_norm.weight"),
            "BF16",
            &[512],
            Fill::Const(1.0),
        );
        t.add(format!("{a}.attn_sink"), "F32", &[64], Fill::Const(0.0));
        t.quant(&format!("{a}.wo_a"), &[8192], h, 4, 64);
        t.quant(&format!("{a}.wo_b"), &[h], 8192, 4, 64);
        if ratio > 0 {
            let c = format!("{a}.compressor");
            let width = if ratio == 4 { 1024 } else { 512 };
            t.quant(&format!("{c}.wkv"), &[width], h, 4, 64);
            t.quant(&format!("{c}.wgate"), &[width], h, 4, 64);
            t.add(format!("{c}.norm.weight"), "BF16", &[512], Fill::Const(1.0));
            t.add(
                format!("{c}.ape"),
                "BF16",
                &[ratio, width],
                Fill::Const(0.0),
            );
        }
        if ratio == 4 {
            let i = format!("{a}.indexer");
            t.quant(&format!("{i}.compressor.wkv"), &[256], h, 4, 64);
            t.quant(&format!("{i}.compressor.wgate"), &[256], h, 4, 64);
            t.add(
                format!("{i}.compressor.norm.weight"),
                "BF16",
                &[128],
                Fill::Const(1.0),
            );
            t.add(
                format!("{i}.compressor.ape"),
                "BF16",
                &[4, 256],
                Fill::Const(0.0),
            );
            t.quant(&format!("{i}.wq_b"), &[8192], 1024, 4, 64);
            t.quant(&format!("{i}.weights_proj"), &[64], h, 4, 64);
        }
        for n in ["attn_norm", "ffn_norm"] {
            t.add(format!("{b}.{n}.weight"), "BF16", &[h], Fill::Const(1.0));
        }
        for site in ["attn_hc", "ffn_hc"] {
            t.add(
                format!("{b}.{site}.fn"),
                "F32",
                &[24, 4 * h],
                Fill::Uniform(fan.powf(-0.5)),
            );
            t.add(format!("{b}.{site}.base"), "F32", &[24], Fill::Const(0.0));
            t.add(format!("{b}.{site}.scale"), "F32", &[3], Fill::Const(1.0));
        }
        t.add(
            format!("{b}.ffn.gate.weight"),
            "BF16",
            &[e, h],
            Fill::Uniform((h as f32).powf(-0.5)),
        );
        if l < d.num_hash_layers {
            t.add(
                format!("{b}.ffn.gate.tid2eid"),
                "I64",
                &[v, 6],
                Fill::ExpertIds { experts: e },
            );
        } else {
            t.add(
                format!("{b}.ffn.gate.e_score_correction_bias"),
                "F32",
                &[e],
                Fill::Const(0.0),
            );
        }
        let s = format!("{b}.ffn.shared_experts");
        t.quant(&format!("{s}.gate_proj"), &[moe], h, 4, 64);
        t.quant(&format!("{s}.up_proj"), &[moe], h, 4, 64);
        t.quant(&format!("{s}.down_proj"), &[h], moe, 4, 64);
        let r = format!("{b}.ffn.switch_mlp");
        t.quant(&format!("{r}.gate_proj"), &[e, moe], h, 2, d.gate_group(l));
        t.quant(&format!("{r}.up_proj"), &[e, moe], h, 2, 64);
        t.quant(&format!("{r}.down_proj"), &[e, h], moe, 2, 64);
    }
    t.0
}

fn bf16(v: f32) -> [u8; 2] {
    ((v.to_bits() >> 16) as u16).to_le_bytes()
}

/// Where a written checkpoint's routed experts (`ffn.switch_mlp.*`) come from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Experts {
    /// Random bytes, written like every other tensor.
    Random,
    /// Left as holes of the sparse file (zeros that take no disk): an install of it then holds
    /// zero experts until [`fill_experts`] writes random ones in place, so a full-width
    /// checkpoint never sits on disk twice.
    Holes,
}

/// splitmix64 from `seed`: the writer's random stream.
fn splitmix(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed;
    move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Appends the bytes of elements `elems` of `t` (row-major) to `buf`.
fn fill(
    t: &SynthTensor,
    elems: std::ops::Range<usize>,
    next: &mut impl FnMut() -> u64,
    buf: &mut Vec<u8>,
) {
    for i in elems {
        let r = next();
        let u = (r >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0; // [-1, 1)
        match (t.fill, t.dtype) {
            (Fill::Codes, _) => buf.extend((r as u32).to_le_bytes()),
            (Fill::Scales { bits, fan_in } | Fill::Biases { bits, fan_in }, _) => {
                let levels = ((1u32 << bits) - 1) as f32;
                let sd_q = ((levels + 1.0).powi(2) - 1.0).sqrt() / 12f32.sqrt();
                let scale = (fan_in as f32).powf(-0.5) / sd_q;
                let v = match t.fill {
                    Fill::Scales { .. } => scale,
                    _ => -scale * levels / 2.0,
                };
                buf.extend(bf16(v));
            }
            (Fill::Uniform(sd), "BF16") => buf.extend(bf16(u * sd * 3f32.sqrt())),
            (Fill::Uniform(sd), _) => buf.extend((u * sd * 3f32.sqrt()).to_le_bytes()),
            (Fill::Const(c), "BF16") => buf.extend(bf16(c)),
            (Fill::Const(c), _) => buf.extend(c.to_le_bytes()),
            (Fill::ExpertIds { experts }, _) => {
                let (row, j) = (i / 6, i % 6);
                let first = (row as u64).wrapping_mul(2_654_435_761) % experts;
                buf.extend((((first + 43 * j as u64) % experts) as i64).to_le_bytes());
            }
        }
    }
}

fn is_routed_expert(name: &str) -> bool {
    name.contains(".ffn.switch_mlp.")
}

/// Writes `dir/model.safetensors` and `dir/config.json` for `d` (random weights from `seed`),
/// streaming tensor by tensor. Returns the bytes written.
pub fn write_checkpoint(d: &Dims, dir: &Path, seed: u64) -> std::io::Result<u64> {
    write_checkpoint_with(d, dir, seed, Experts::Random)
}

/// [`write_checkpoint`] with the routed experts' bytes as `experts` says. Returns the file's
/// length (holes included).
pub fn write_checkpoint_with(
    d: &Dims,
    dir: &Path,
    seed: u64,
    experts: Experts,
) -> std::io::Result<u64> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("config.json"), config(d).to_string())?;
    let table = tensors(d);
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for t in &table {
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [off, off + t.size()]}),
        );
        off += t.size();
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let total = 8 + h.len() as u64 + off;
    let f = std::fs::File::create(dir.join("model.safetensors"))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, f);
    w.write_all(&(h.len() as u64).to_le_bytes())?;
    w.write_all(&h)?;
    let mut next = splitmix(seed);
    let mut buf: Vec<u8> = Vec::with_capacity(8 << 20);
    for t in &table {
        if experts == Experts::Holes && is_routed_expert(&t.name) {
            w.seek(SeekFrom::Current(t.size() as i64))?;
            continue;
        }
        let n = t.shape.iter().product::<u64>() as usize;
        let mut done = 0;
        while done < n {
            let m = (n - done).min(1 << 20);
            buf.clear();
            fill(t, done..done + m, &mut next, &mut buf);
            w.write_all(&buf)?;
            done += m;
        }
    }
    w.flush()?;
    // A trailing hole needs the length set explicitly.
    w.get_ref().set_len(total)?;
    Ok(total)
}

/// Writes random routed experts (the same fills as [`Experts::Random`]) into the layer files of
/// an install of a checkpoint written with [`Experts::Holes`], in place, per its
/// `packed_experts/layout.json`. The layer files then differ from the manifest's SHA-256s: open
/// the install with `--verify trusted-receipt` (size checks only). Returns the bytes written.
pub fn fill_experts(d: &Dims, install: &Path, seed: u64) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let bad = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
    let raw = std::fs::read(install.join("packed_experts/layout.json"))?;
    let layout = Layout::parse(&raw).map_err(|e| bad(e.to_string()))?;
    let table = tensors(d);
    let mut next = splitmix(seed);
    let (mut written, mut buf) = (0u64, Vec::new());
    for ll in &layout.layers {
        let Some(blob) = &ll.blob else { continue };
        let mut sources = Vec::new();
        for role in ["gate", "up", "down"] {
            for part in ["weight", "scales", "biases"] {
                let name = format!(
                    "model.layers.{}.ffn.switch_mlp.{role}_proj.{part}",
                    ll.layer
                );
                let t = table.iter().find(|t| t.name == name);
                sources.push(t.ok_or_else(|| bad(format!("{name} is not in the table of {d:?}")))?);
            }
        }
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(install.join(&ll.file))?;
        let mut bytes = vec![0u8; blob.used_bytes() as usize];
        for e in 0..layout.experts_per_layer {
            for (t, piece) in sources.iter().zip(blob.in_order()) {
                let per_expert = t.size() / d.experts;
                if per_expert != piece.size {
                    return Err(bad(format!(
                        "{}: layout piece of {} bytes, table slice of {per_expert}",
                        t.name, piece.size
                    )));
                }
                let n = (per_expert / (t.size() / t.shape.iter().product::<u64>())) as usize;
                buf.clear();
                fill(t, 0..n, &mut next, &mut buf);
                bytes[piece.offset as usize..][..buf.len()].copy_from_slice(&buf);
            }
            f.write_all_at(&bytes, e as u64 * layout.expert_stride)?;
            written += bytes.len() as u64;
        }
        f.sync_all()?;
    }
    Ok(written)
}

/// The DeepSeek-V4 tokenizer's vocabulary.
pub const TEXT_VOCAB: usize = 129_280;

/// The golden fixture A (`assets/fixtures/deepseek_v4/A/checkpoint`) with its vocabulary widened
/// to the tokenizer's [`TEXT_VOCAB`] ids (`model.embed_tokens`, `lm_head` and each `tid2eid` row
/// `r` taken from row `r mod 1024`, so the model still reads `id mod 1024`) plus the bundled
/// DeepSeek-V4 tokenizer files and chat template: a single-file checkpoint in `dir` for `run`,
/// `serve` and the server's tests (its text is gibberish).
pub fn write_text_checkpoint(dir: &Path) {
    let vocab = TEXT_VOCAB;
    let fixture = || crate::repo().join("assets/fixtures/deepseek_v4/A/checkpoint");
    let src = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let hlen = u64::from_le_bytes(src[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&src[8..8 + hlen]).unwrap();
    let data = &src[8 + hlen..];
    let mut out_header = serde_json::Map::new();
    let mut out_data: Vec<u8> = Vec::new();
    let mut names: Vec<&String> = header.keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    for name in names {
        let t = &header[name];
        let off = t["data_offsets"].as_array().unwrap();
        let (a, b) = (
            off[0].as_u64().unwrap() as usize,
            off[1].as_u64().unwrap() as usize,
        );
        let mut shape: Vec<u64> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let bytes = &data[a..b];
        let widen = name.starts_with("model.embed_tokens.")
            || name.starts_with("lm_head.")
            || name.ends_with(".tid2eid");
        let start = out_data.len();
        if widen {
            let row = bytes.len() / shape[0] as usize;
            for r in 0..vocab {
                let r = r % shape[0] as usize;
                out_data.extend_from_slice(&bytes[r * row..(r + 1) * row]);
            }
            shape[0] = vocab as u64;
        } else {
            out_data.extend_from_slice(bytes);
        }
        out_header.insert(
            name.clone(),
            json!({"dtype": t["dtype"], "shape": shape, "data_offsets": [start, out_data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&Value::Object(out_header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h);
    file.extend(out_data);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    config["vocab_size"] = json!(vocab);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tok = crate::repo().join("assets/tokenizers/deepseek_v4");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        std::fs::copy(tok.join(f), dir.join(f)).unwrap();
    }
}
