//! Maple fixtures (`assets/fixtures/maple/{A,B}`) install with one documented rewrite: each
//! ternary `row_alpha` becomes scales `a` and biases `-a` per group (`docs/FORMAT.md`). Every other
//! tensor is byte-identical to the source, and every rewritten weight dequantizes (`s·q + b` in
//! f32, as the runtime computes it) to exactly the source's ternary value `a·(code − 1)`. The source
//! side is parsed with the independent `safetensors` crate.

mod common;
use mference_format::{Family, Install, ResidentIndex, VerifyPolicy};
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/fixtures/maple")
        .join(case)
        .join("checkpoint")
}

fn bf16(b: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
}

fn code(words: &[u8], bits: usize, i: usize) -> u32 {
    let per = 32 / bits;
    let w = &words[4 * (i / per)..4 * (i / per) + 4];
    (u32::from_le_bytes([w[0], w[1], w[2], w[3]]) >> ((i % per) * bits)) & ((1 << bits) - 1)
}

/// Installed bytes of one quantized matrix (or one expert of it): weights, scales, biases.
struct Installed<'a> {
    w: &'a [u8],
    s: &'a [u8],
    b: &'a [u8],
}

/// `rows × cols` ternary values of the source (`a·(code − 1)`, f32) against the installed
/// dequantization `s·q + b` (f32): bit-identical, and the installed codes are the source's bytes.
fn check_ternary(name: &str, src_w: &[u8], alpha: &[u8], got: &Installed, cols: usize, gs: usize) {
    assert!(got.w == src_w, "{name}: packed codes changed");
    let rows = alpha.len() / 2;
    let groups = cols / gs;
    assert_eq!(got.s.len(), rows * groups * 2, "{name}: scales size");
    assert_eq!(got.b.len(), rows * groups * 2, "{name}: biases size");
    for r in 0..rows {
        let a = bf16(alpha, r);
        for c in 0..cols {
            let q = code(src_w, 2, r * cols + c);
            assert!(q <= 2, "{name}: code {q} is not ternary");
            let want = a * (q as f32 - 1.0);
            let g = r * groups + c / gs;
            let have = bf16(got.s, g) * code(got.w, 2, r * cols + c) as f32 + bf16(got.b, g);
            assert_eq!(
                have.to_bits(),
                want.to_bits(),
                "{name}[{r}, {c}]: installed {have} != source {want}"
            );
        }
    }
}

fn check_case(case: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gturbo");
    let report = mference_install::install_local(&fixture(case), &out, &common::quiet()).unwrap();
    assert_eq!(report.family, Family::Maple);

    let inst = Install::open(&out, VerifyPolicy::FullSha256).unwrap();
    let weights = std::fs::read(inst.weights_path()).unwrap();
    let index = ResidentIndex::parse(&weights).unwrap();
    let index_json: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixture(case).join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mut shards: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for f in index_json["weight_map"].as_object().unwrap().values() {
        let f = f.as_str().unwrap().to_string();
        let bytes = std::fs::read(fixture(case).join(&f)).unwrap();
        shards.insert(f, bytes);
    }
    let experts = inst.manifest.experts_per_layer;
    let stride = inst.layout.expert_stride as usize;
    let gs = 128;
    let mut checked = HashSet::new();
    let mut ternary = 0;
    for bytes in shards.values() {
        let src = safetensors::SafeTensors::deserialize(bytes).unwrap();
        for (name, view) in src.tensors() {
            let data = view.data();
            if let Some(base) = name.strip_suffix(".row_alpha") {
                let w = src.tensor(&format!("{base}.weight")).unwrap();
                let cols = w.shape().last().unwrap() * 16;
                match index.get(&format!("{base}.weight")) {
                    Some(e) => {
                        let got = Installed {
                            w: e.weight_bytes(&weights),
                            s: e.scale_bytes(&weights),
                            b: e.bias_bytes(&weights),
                        };
                        check_ternary(&name, w.data(), data, &got, cols, gs);
                    }
                    None => {
                        let layer: usize = base.split('.').nth(2).unwrap().parse().unwrap();
                        let role = ["gate_proj", "up_proj", "down_proj"]
                            .iter()
                            .position(|r| base.ends_with(r))
                            .unwrap();
                        let blob = inst.layout.layer(layer).unwrap().blob.as_ref().unwrap();
                        let t = &[&blob.gate, &blob.up, &blob.down][role];
                        let file = std::fs::read(inst.layer_path(layer)).unwrap();
                        let (wper, aper) = (w.data().len() / experts, data.len() / experts);
                        for x in 0..experts {
                            let at = |k: usize| {
                                let o = x * stride + t[k].offset as usize;
                                &file[o..o + t[k].size as usize]
                            };
                            let got = Installed {
                                w: at(0),
                                s: at(1),
                                b: at(2),
                            };
                            let label = format!("{name} expert {x}");
                            check_ternary(
                                &label,
                                &w.data()[x * wper..(x + 1) * wper],
                                &data[x * aper..(x + 1) * aper],
                                &got,
                                cols,
                                gs,
                            );
                        }
                    }
                }
                ternary += 1;
                checked.insert(name.clone());
                continue;
            }
            let (base, part) = match name.rsplit_once('.') {
                Some((b, "scales")) => (format!("{b}.weight"), 1),
                Some((b, "biases")) => (format!("{b}.weight"), 2),
                _ => (name.clone(), 0),
            };
            if src
                .tensor(&format!("{}.row_alpha", base.trim_end_matches(".weight")))
                .is_ok()
            {
                // The packed codes of a ternary weight: checked with its row_alpha above.
                checked.insert(name.clone());
                continue;
            }
            let e = index
                .get(&base)
                .unwrap_or_else(|| panic!("{name} is not resident"));
            let got = match part {
                0 => e.weight_bytes(&weights),
                1 => e.scale_bytes(&weights),
                _ => e.bias_bytes(&weights),
            };
            assert!(got == data, "{name} differs in model_weights.bin");
            checked.insert(name);
        }
    }
    let total: usize = shards
        .values()
        .map(|b| safetensors::SafeTensors::deserialize(b).unwrap().len())
        .sum();
    assert_eq!(checked.len(), total, "every source tensor checked");
    // 4 attention projections per layer resident, 3 expert projections streamed.
    assert_eq!(ternary, 7 * inst.manifest.num_layers);
    for l in inst.layout.layers.iter().filter(|l| l.blob.is_some()) {
        inst.check_layer_file(l.layer).unwrap();
    }
}

#[test]
fn maple_a_installs_with_only_the_row_alpha_rewrite() {
    check_case("A");
}

/// B adds a second shard with the FlashHead tensors (4-bit g64 per `flash_head`, I32 token map).
#[test]
fn maple_b_with_flash_head_installs_with_only_the_row_alpha_rewrite() {
    check_case("B");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gturbo");
    mference_install::install_local(&fixture("B"), &out, &common::quiet()).unwrap();
    let inst = Install::open(&out, VerifyPolicy::FullSha256).unwrap();
    let weights = std::fs::read(inst.weights_path()).unwrap();
    let index = ResidentIndex::parse(&weights).unwrap();
    let c = index.get("lm_head_flash.centroids.weight").unwrap();
    assert_eq!(c.logical_shape(), vec![32, 256], "centroids are 4-bit g64");
    let h = index.get("lm_head_flash.head.weight").unwrap();
    assert_eq!(h.logical_shape(), vec![32, 32, 256]);
}

/// A ternary weight whose row_alpha is not one value per output row is refused by the plan.
#[test]
fn maple_row_alpha_of_the_wrong_shape_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    for f in ["config.json", "model.safetensors.index.json"] {
        std::fs::copy(fixture("A").join(f), src.join(f)).unwrap();
    }
    // Rewrite the shard with one row_alpha cut short.
    let bytes = std::fs::read(fixture("A").join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let bad = "model.layers.0.self_attn.q_proj.row_alpha";
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, v) in st.tensors() {
        let (shape, data) = if name == bad {
            (vec![v.shape()[0] - 1], v.data()[2..].to_vec())
        } else {
            (v.shape().to_vec(), v.data().to_vec())
        };
        owned.push((name, v.dtype(), shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &src.join("model.safetensors")).unwrap();
    let err = mference_install::install_local(&src, &tmp.path().join("m.gturbo"), &common::quiet())
        .unwrap_err()
        .to_string();
    assert!(err.contains("q_proj") && err.contains("row_alpha"), "{err}");
}
