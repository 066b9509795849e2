//! Clear errors before any byte is written: quantization metadata, architecture, shapes
//! against config.json, free disk. Loader-side typed errors in the format crate.

mod common;
use mference_format::{FormatError, Install, VerifyPolicy};
use mference_install::InstallError;
use std::path::{Path, PathBuf};

/// A copy of a tiny checkpoint (safetensors symlinked) with an edited config.json.
fn variant(tmp: &Path, model: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let src = common::asset(model);
    let dir = tmp.join("src");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "model.safetensors.index.json"] {
        std::os::unix::fs::symlink(src.join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    dir
}

/// Install `dir` into a directory that does not exist yet; the error, after checking that
/// nothing at all was left on disk (no output, partial, journal, lock file or parent).
fn refused(dir: &Path, tmp: &Path) -> InstallError {
    refused_with(dir, tmp, &common::quiet())
}

fn refused_with(dir: &Path, tmp: &Path, opts: &mference_install::InstallOptions) -> InstallError {
    let before = common::listing(tmp);
    let err = mference_install::install_local(dir, &tmp.join("new/o.gturbo"), opts).unwrap_err();
    assert_eq!(
        common::listing(tmp),
        before,
        "the refused install left files: {err}"
    );
    err
}

#[test]
fn missing_quantization_block_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = variant(tmp.path(), "gemma4-tiny", |c| {
        c.as_object_mut().unwrap().remove("quantization");
        c.as_object_mut().unwrap().remove("quantization_config");
    });
    assert!(matches!(
        refused(&d, tmp.path()),
        InstallError::Format(FormatError::QuantInvalid { .. })
    ));
}

#[test]
fn incompatible_bits_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = variant(tmp.path(), "gemma4-tiny", |c| {
        c["quantization"]["bits"] = 8.into()
    });
    assert!(matches!(
        refused(&d, tmp.path()),
        InstallError::Format(FormatError::ShapeMismatch { .. })
    ));
}

#[test]
fn unknown_architecture_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = variant(tmp.path(), "gemma4-tiny", |c| {
        c["model_type"] = "llama".into();
        c["text_config"]["model_type"] = "llama".into();
    });
    let err = refused(&d, tmp.path());
    assert!(
        matches!(
            err,
            InstallError::Format(FormatError::UnknownArchitecture { .. })
        ),
        "{err}"
    );
    // The message lists every model_type of every family in the registry (it listed Gemma's and
    // Qwen's only).
    let msg = err.to_string();
    for spec in mference_format::REGISTRY {
        for mt in spec.model_types {
            assert!(msg.contains(mt), "{mt} missing from: {msg}");
        }
    }
}

#[test]
fn a_shape_contradicting_config_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = variant(tmp.path(), "qwen3_6-tiny", |c| {
        c["text_config"]["moe_intermediate_size"] = 256.into()
    });
    let err = refused(&d, tmp.path());
    assert!(
        matches!(err, InstallError::Format(FormatError::ShapeMismatch { .. })),
        "{err}"
    );
}

#[test]
fn not_enough_free_disk_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let o = mference_install::InstallOptions {
        disk_reserve_bytes: Some(u64::MAX / 4),
        ..common::quiet()
    };
    let err = refused_with(&common::asset("gemma4-tiny"), tmp.path(), &o);
    let InstallError::DiskFull { remaining, .. } = err else {
        panic!("expected DiskFull, got {err}");
    };
    // The output still to write counts the tokenizer files too (33 MB of the demo model's 80 MB:
    // a check that left them out let an install fill the disk), not only weights and experts.
    let size = |p: PathBuf| std::fs::metadata(p).unwrap().len();
    let weights = size(common::asset("gemma4-tiny").join("model.safetensors"));
    let tokenizer = size(common::asset("../tokenizers/gemma4/tokenizer.json"));
    assert!(
        remaining >= weights + tokenizer - (1 << 20),
        "{remaining} bytes counted to write; the weights alone are {weights}, the tokenizer {tokenizer}"
    );
}

#[test]
fn an_unreadable_source_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let d = variant(tmp.path(), "gemma4-tiny", |_| {});
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let err = refused(&d, tmp.path());
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn loader_checks_are_typed_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("g.gturbo");
    mference_install::install_local(&common::asset("gemma4-tiny"), &out, &common::quiet()).unwrap();
    let copy = |name: &str| {
        let d = tmp.path().join(name);
        std::process::Command::new("cp")
            .arg("-a")
            .arg(&out)
            .arg(&d)
            .status()
            .unwrap();
        d
    };
    let edit_manifest = |d: &Path, f: &dyn Fn(&mut serde_json::Value)| {
        let p = d.join("manifest.json");
        let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        f(&mut m);
        std::fs::write(p, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    };
    let open = |d: &Path| Install::open(d, VerifyPolicy::FullSha256).unwrap_err();

    let d = copy("flag");
    edit_manifest(&d, &|m| m["flags"]["newFeature"] = true.into());
    assert!(matches!(open(&d), FormatError::UnknownFlag { .. }));

    let d = copy("arch");
    edit_manifest(&d, &|m| m["arch"]["numHeads"] = 8.into());
    assert!(matches!(open(&d), FormatError::ArchMismatch { .. }));

    let d = copy("stride");
    edit_manifest(&d, &|m| {
        m["expertStride"] = 65536u64.saturating_add(100).into()
    });
    assert!(matches!(open(&d), FormatError::StrideNotPageAligned { .. }));

    let d = copy("missing");
    std::fs::remove_file(d.join("packed_experts/layer_02.bin")).unwrap();
    assert!(matches!(open(&d), FormatError::MissingFile { .. }));

    let d = copy("size");
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.join("model_weights.bin"))
        .unwrap()
        .set_len(100)
        .unwrap();
    assert!(matches!(open(&d), FormatError::SizeMismatch { .. }));

    let d = copy("sha");
    let p = d.join("packed_experts/layer_01.bin");
    let mut b = std::fs::read(&p).unwrap();
    b[10] ^= 1;
    std::fs::write(&p, b).unwrap();
    let inst = Install::open(&d, VerifyPolicy::FullSha256).unwrap();
    assert!(matches!(
        inst.check_layer_file(1),
        Err(FormatError::ShaMismatch { .. })
    ));
    assert!(inst.check_layer_file(0).is_ok());
    // trusted-receipt: the receipt is bound to the original directory, not the copy.
    assert!(matches!(
        Install::open(&d, VerifyPolicy::TrustedReceipt),
        Err(FormatError::ReceiptInvalid { .. })
    ));
    let ok = Install::open(&out, VerifyPolicy::TrustedReceipt).unwrap();
    assert!(ok.check_layer_file(1).is_ok());
}

/// `verify` on a directory that holds nothing of an install says so (it said the install was
/// incomplete and to reinstall it).
#[test]
fn verify_of_a_directory_that_is_no_install_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let err = mference_install::state::verify(tmp.path()).unwrap_err();
    assert!(matches!(err, InstallError::NotAnInstall { .. }), "{err:?}");
    assert!(err.to_string().contains("is not an install"), "{err}");
}
