//! Damaged installs give a clear, typed error — never a panic and never garbage text
//! (issue "Gemma 4 on CPU", item 9).

mod common;

use std::path::{Path, PathBuf};

use common::*;
use mference_models::{load, ModelError, Want};

fn fresh_install(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let work = tempfile::Builder::new()
        .prefix(tag)
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap();
    let inst = install(&repo().join("assets/models/gemma4-tiny"), work.path());
    (work, inst)
}

fn err_text<T>(r: Result<T, ModelError>) -> String {
    match r {
        Ok(_) => panic!("a damaged install was accepted"),
        Err(e) => e.to_string(),
    }
}

fn prompt() -> Vec<u32> {
    vec![2, 1509, 563, 496, 9043, 69127, 30285, 236764, 600]
}

#[test]
fn a_missing_layer_file_is_reported_by_name() {
    let (_w, inst) = fresh_install("missing");
    std::fs::remove_file(inst.join("packed_experts/layer_02.bin")).unwrap();
    let msg = match load(&inst, &opts(128, 512)) {
        Err(e) => e.to_string(),
        // Layer files may be checked on first use: the forward pass must fail then.
        Ok(mut m) => err_text(m.forward(&prompt(), Want::Last)),
    };
    assert!(
        msg.contains("layer_02.bin") && msg.contains("missing"),
        "{msg}"
    );
}

#[test]
fn a_flipped_byte_in_a_layer_file_is_detected_at_first_use() {
    let (_w, inst) = fresh_install("flipped");
    let path = inst.join("packed_experts/layer_03.bin");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    // Load hashes the common files only; the damaged layer file is hashed when layer 3 first runs.
    let mut m = load(&inst, &opts(128, 512)).expect("load checks only the common files");
    let msg = err_text(m.forward(&prompt(), Want::Last));
    assert!(
        msg.contains("layer_03.bin") && msg.contains("SHA-256"),
        "{msg}"
    );
}

/// A config.json that no longer describes the installed tensors (here: twice the experts) is refused
/// at load: its hash no longer matches the manifest. (The manifest-vs-config `arch` comparison
/// itself is covered by mference-format's `loader_checks_are_typed_errors`.)
#[test]
fn an_edited_config_is_refused_at_load() {
    let (_w, inst) = fresh_install("arch");
    let cfg_path = inst.join("tokenizer/config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap();
    assert!(text.contains("\"num_experts\": 16"), "fixture changed");
    std::fs::write(
        &cfg_path,
        text.replace("\"num_experts\": 16", "\"num_experts\": 32"),
    )
    .unwrap();
    let msg = err_text(load(&inst, &opts(128, 512)));
    assert!(
        msg.contains("config.json") && msg.contains("reinstall"),
        "{msg}"
    );
}

#[test]
fn a_truncated_weights_file_is_refused_at_load() {
    let (_w, inst) = fresh_install("trunc");
    let path: &Path = &inst.join("model_weights.bin");
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 4096).unwrap();
    let msg = err_text(load(&inst, &opts(128, 512)));
    assert!(msg.contains("model_weights.bin"), "{msg}");
}

/// A layer file damaged into NaN scales, loaded under `trusted-receipt` (which does not rehash
/// layer files): every way of asking for output ends in a non-finite error naming `mference
/// verify`, never in text.
#[test]
fn non_finite_weights_end_the_forward_pass_with_an_error() {
    let (_w, inst) = fresh_install("nan");
    let path = inst.join("packed_experts/layer_01.bin");
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    // 0xffff is a bf16 NaN: every scale and bias of every expert becomes NaN.
    std::fs::write(&path, vec![0xffu8; len]).unwrap();
    let o = mference_models::LoadOptions {
        verify: mference_format::VerifyPolicy::TrustedReceipt,
        ..opts(128, 512)
    };
    for want in [Want::Argmax, Want::Last, Want::All, Want::None] {
        let mut m = load(&inst, &o).expect("trusted-receipt checks only sizes of layer files");
        let msg = err_text(m.forward(&prompt(), want));
        assert!(
            msg.contains("non-finite") && msg.contains("mference verify"),
            "{want:?}: {msg}"
        );
    }
}

/// A same-size edit of a tokenizer file (the text side reads it) is refused at load under the
/// default policy, naming the file; `trusted-receipt` checks its size only (documented).
#[test]
fn a_same_size_edit_of_tokenizer_json_is_refused_under_full_sha256() {
    let (_w, inst) = fresh_install("tok");
    let path = inst.join("tokenizer/tokenizer.json");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes
        .iter()
        .rposition(|&b| b == b'a')
        .expect("an 'a' to change");
    bytes[at] = b'b';
    std::fs::write(&path, bytes).unwrap();
    let msg = err_text(load(&inst, &opts(128, 512)));
    assert!(
        msg.contains("tokenizer/tokenizer.json") && msg.contains("SHA-256"),
        "{msg}"
    );
    let trusted = mference_models::LoadOptions {
        verify: mference_format::VerifyPolicy::TrustedReceipt,
        ..opts(128, 512)
    };
    assert!(
        load(&inst, &trusted).is_ok(),
        "trusted-receipt checks sizes only"
    );
}
