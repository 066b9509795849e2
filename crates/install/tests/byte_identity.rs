//! Every source tensor, read back through the format crate (resident index and
//! layout.json), equals the source bytes. The source side is parsed with the independent
//! `safetensors` crate.

mod common;
use mference_format::{Install, ResidentIndex, VerifyPolicy};
use std::collections::HashSet;

fn check_byte_identity(model: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m.gturbo");
    let report =
        mference_install::install_local(&common::asset(model), &out, &common::quiet()).unwrap();
    assert!(report.ranges_fetched > 0);

    let inst = Install::open(&out, VerifyPolicy::FullSha256).unwrap();
    let weights = std::fs::read(inst.weights_path()).unwrap();
    let index = ResidentIndex::parse(&weights).unwrap();
    let src_bytes = std::fs::read(common::asset(model).join("model.safetensors")).unwrap();
    let src = safetensors::SafeTensors::deserialize(&src_bytes).unwrap();
    let experts = inst.manifest.experts_per_layer as u64;
    let stride = inst.layout.expert_stride;
    let mut checked = HashSet::new();
    for (name, view) in src.tensors() {
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
    assert_eq!(checked.len(), src.len());
    for l in inst.layout.layers.iter().filter(|l| l.blob.is_some()) {
        inst.check_layer_file(l.layer).unwrap();
    }
    // The install is self-describing: config copied, tokenizer resolved from the pointer file.
    let tok = std::fs::metadata(inst.dir.join("tokenizer/tokenizer.json")).unwrap();
    assert!(
        tok.len() > 1024,
        "tokenizer.json should be the real tokenizer, not the pointer"
    );
    assert_eq!(
        inst.config_json,
        serde_json::from_slice::<serde_json::Value>(
            &std::fs::read(common::asset(model).join("config.json")).unwrap()
        )
        .unwrap()
    );
}

#[test]
fn gemma4_tiny_round_trips_byte_for_byte() {
    check_byte_identity("gemma4-tiny");
}

#[test]
fn qwen3_6_tiny_round_trips_byte_for_byte() {
    check_byte_identity("qwen3_6-tiny");
}
