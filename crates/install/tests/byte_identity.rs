//! Every source tensor, read back through the format crate (resident index and
//! layout.json), equals the source bytes. The source side is parsed with the independent
//! `safetensors` crate.

mod common;
use mference_format::{Install, ResidentIndex, VerifyPolicy};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

fn check_byte_identity(model: &str) {
    let (_tmp, inst) = install_and_compare(&common::asset(model), &[]);
    // The install is self-describing: config copied, tokenizer resolved from the pointer file.
    let tok = std::fs::metadata(inst.dir.join("tokenizer/tokenizer.json")).unwrap();
    assert!(
        tok.len() > 1024,
        "tokenizer.json should be the real tokenizer, not the pointer"
    );
}

/// Installs `src` and checks every tensor of every shard `model.safetensors.index.json` names
/// (or of `model.safetensors`) against what the install holds; tensors under `excluded` (the
/// multimodal towers) must be left out. Returns the opened install and its directory.
fn install_and_compare(src_dir: &Path, excluded: &[&str]) -> (tempfile::TempDir, Install) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gturbo");
    let report = mference_install::install_local(src_dir, &out, &common::quiet()).unwrap();
    assert!(report.ranges_fetched > 0);

    let inst = Install::open(&out, VerifyPolicy::FullSha256).unwrap();
    let weights = std::fs::read(inst.weights_path()).unwrap();
    let index = ResidentIndex::parse(&weights).unwrap();
    let experts = inst.manifest.experts_per_layer as u64;
    let stride = inst.layout.expert_stride;
    let mut checked = HashSet::new();
    let mut total = 0;
    for shard in shards(src_dir) {
        let src_bytes = std::fs::read(&shard).unwrap();
        let src = safetensors::SafeTensors::deserialize(&src_bytes).unwrap();
        total += src.len();
        for (name, view) in src.tensors() {
            if excluded.iter().any(|p| name.starts_with(p)) {
                assert!(index.get(&name).is_none(), "{name} should be excluded");
                checked.insert(name);
                continue;
            }
            let data = view.data();
            let (base, part) = match name.rsplit_once('.') {
                Some((b, "scales")) => (format!("{b}.weight"), 1),
                Some((b, "biases")) => (format!("{b}.weight"), 2),
                _ => (name.clone(), 0),
            };
            if let Some(e) = index.get(&base) {
                let got = match part {
                    0 => e.weight_bytes(&weights),
                    1 => e.scale_bytes(&weights),
                    _ => e.bias_bytes(&weights),
                };
                assert!(got == data, "{name} differs in model_weights.bin");
            } else {
                let layer: usize = base
                    .split(".layers.")
                    .nth(1)
                    .unwrap()
                    .split('.')
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap();
                let role = ["gate_proj", "up_proj", "down_proj"]
                    .iter()
                    .position(|r| base.contains(r))
                    .unwrap();
                let blob = inst.layout.layer(layer).unwrap().blob.as_ref().unwrap();
                let t = &[&blob.gate, &blob.up, &blob.down][role][part];
                let file = std::fs::read(inst.layer_path(layer)).unwrap();
                let per = data.len() as u64 / experts;
                assert_eq!(per, t.size, "{name} per-expert size");
                for e in 0..experts {
                    let at = (e * stride + t.offset) as usize;
                    assert!(
                        file[at..at + per as usize]
                            == data[(e * per) as usize..((e + 1) * per) as usize],
                        "{name} expert {e} differs"
                    );
                }
            }
            checked.insert(name);
        }
    }
    assert_eq!(checked.len(), total);
    for l in inst.layout.layers.iter().filter(|l| l.blob.is_some()) {
        inst.check_layer_file(l.layer).unwrap();
    }
    assert_eq!(
        inst.config_json,
        serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(src_dir.join("config.json")).unwrap()
        )
        .unwrap()
    );
    (tmp, inst)
}

/// The shard files of a checkpoint: those its index names, else `model.safetensors`.
fn shards(dir: &Path) -> Vec<PathBuf> {
    let Ok(index) = std::fs::read(dir.join("model.safetensors.index.json")) else {
        return vec![dir.join("model.safetensors")];
    };
    let v: serde_json::Value = serde_json::from_slice(&index).unwrap();
    let mut files: Vec<String> = v["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    files.sort();
    files.dedup();
    files.into_iter().map(|f| dir.join(f)).collect()
}

#[test]
fn gemma4_tiny_round_trips_byte_for_byte() {
    check_byte_identity("gemma4-tiny");
}

#[test]
fn qwen3_6_tiny_round_trips_byte_for_byte() {
    check_byte_identity("qwen3_6-tiny");
}

/// The Inkling golden fixtures (`assets/fixtures/inkling/{A,B}`): shard
/// `model-00001-of-00001.safetensors`, vision/audio towers left out, dense first layers resident,
/// routed experts in the layer files, the shared sink experts resident.
#[test]
fn inkling_fixtures_round_trip_byte_for_byte() {
    for case in ["A", "B"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets/fixtures/inkling")
            .join(case)
            .join("checkpoint");
        let (_tmp, inst) = install_and_compare(&dir, &["model.visual.", "model.audio."]);
        let dense = inst.manifest.arch.extra["denseMlpIdx"].as_u64().unwrap() as usize;
        for l in &inst.layout.layers {
            assert_eq!(
                l.blob.is_some(),
                l.layer >= dense,
                "case {case} layer {}",
                l.layer
            );
        }
        let index = ResidentIndex::parse(&std::fs::read(inst.weights_path()).unwrap()).unwrap();
        let shared = format!("model.llm.layers.{dense}.mlp.shared_experts.down_proj.weight");
        assert!(
            index.get(&shared).is_some(),
            "case {case}: {shared} is not resident"
        );
    }
}

/// A DeepSeek-V4 fixture checkpoint (`assets/fixtures/deepseek_v4/<case>/checkpoint`, the
/// mlx-community/DeepSeek-V4-Flash-2bit-DQ layout at tiny sizes).
fn dsv4_fixture(case: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/fixtures/deepseek_v4")
        .join(case)
        .join("checkpoint")
}

/// Mixed 2-bit g32 / g64 routed experts, BF16 router, F32 correction bias and hyper-connection
/// tensors, I64 `tid2eid`, 2-D `wo_a`: every byte lands unchanged, the expert stride is the one
/// global stride padded to the widest blob (g32 gate layers), and the narrower g64-gate layer's
/// blob is laid out at that same stride.
fn check_dsv4(case: &str) {
    let (_tmp, inst) = install_and_compare(&dsv4_fixture(case), &[]);
    let m = &inst.manifest;
    assert_eq!(m.arch.family, mference_format::Family::DeepseekV4);
    assert_eq!(m.arch.full_attention_layer_mask, vec![0, 0, 3, 4, 3, 4, 3]);
    let used: Vec<u64> = inst
        .layout
        .layers
        .iter()
        .map(|l| l.blob.as_ref().unwrap().used_bytes())
        .collect();
    let widest = *used.iter().max().unwrap();
    assert!(
        used[6] < widest,
        "layer 6 (g64 gate) should be narrower: {used:?}"
    );
    assert_eq!(
        inst.layout.expert_stride,
        mference_format::round_up_to_page(widest)
    );
    let blob = inst.layout.layers[0].blob.as_ref().unwrap();
    assert_eq!(blob.gate[0].bits, Some(2));
    let index = ResidentIndex::parse(&std::fs::read(inst.weights_path()).unwrap()).unwrap();
    let dtype = |n: &str| index.get(n).unwrap().dtype;
    use mference_format::Dtype;
    assert_eq!(dtype("model.layers.0.ffn.gate.tid2eid"), Dtype::I64);
    assert_eq!(
        dtype("model.layers.3.ffn.gate.e_score_correction_bias"),
        Dtype::F32
    );
    assert_eq!(dtype("model.layers.3.ffn.gate.weight"), Dtype::BF16);
    assert_eq!(dtype("model.layers.0.attn.wo_a.weight"), Dtype::U32);
}

#[test]
fn deepseek_v4_fixture_a_round_trips_byte_for_byte() {
    check_dsv4("A");
}

#[test]
fn deepseek_v4_fixture_b_round_trips_byte_for_byte() {
    check_dsv4("B");
}
