//! The tokenizer and chat template are parsed at install the way `run` parses them, and the
//! tokenizer must fit the model's vocabulary (issue 32 papercuts): a file that does not parse,
//! or a tokenizer with more ids than the embedding has rows, is refused naming the file (or both
//! sizes) before anything is written. The tokenizer files' download is reported with sizes.

mod common;
use mference_install::InstallError;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `tmp/src`: the files of `from` linked, then `extra` (name → bytes) written over them.
fn checkpoint(tmp: &Path, from: &Path, extra: &[(&str, &[u8])]) -> PathBuf {
    let dir = tmp.join("src");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, path) in common::server::checkpoint_files(from) {
        std::os::unix::fs::symlink(path, dir.join(name)).unwrap();
    }
    for (name, bytes) in extra {
        let _ = std::fs::remove_file(dir.join(name));
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    dir
}

/// Install `dir` and return the error, checking nothing was left on disk.
fn refused(dir: &Path, tmp: &Path) -> InstallError {
    let before = common::listing(tmp);
    let err = mference_install::install_local(dir, &tmp.join("out/o.gturbo"), &common::quiet())
        .unwrap_err();
    assert_eq!(
        common::listing(tmp),
        before,
        "the refused install left files: {err}"
    );
    err
}

fn sidecar_error(err: InstallError, want_file: &str) -> String {
    match &err {
        InstallError::SidecarInvalid { file, .. } if file == want_file => err.to_string(),
        _ => panic!("expected {want_file} to be refused, got: {err}"),
    }
}

#[test]
fn a_tokenizer_that_does_not_parse_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    // Valid JSON, not a tokenizer.
    let tok: &[u8] = br#"{"version": "1.0", "model": {"type": "BPE", "vocab": 5}}"#;
    let d = checkpoint(
        tmp.path(),
        &common::asset("gemma4-tiny"),
        &[("tokenizer.json", tok)],
    );
    let msg = sidecar_error(refused(&d, tmp.path()), "tokenizer.json");
    assert!(msg.contains("does not parse"), "{msg}");
}

#[test]
fn a_chat_template_that_does_not_parse_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let bad: &[u8] = b"{% for m in messages %}{{ m.content }}";
    let d = checkpoint(
        tmp.path(),
        &common::asset("qwen3_6-tiny"),
        &[("chat_template.jinja", bad)],
    );
    let msg = sidecar_error(refused(&d, tmp.path()), "chat_template.jinja");
    assert!(
        msg.to_lowercase().contains("endfor") || msg.contains("end of input"),
        "{msg}"
    );
}

#[test]
fn a_fixture_with_a_full_tokenizer_is_refused_naming_both_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let assets = common::asset("..");
    let tokenizer = assets.join("tokenizers/deepseek_v4");
    let tok = std::fs::read(tokenizer.join("tokenizer.json")).unwrap();
    let cfg = std::fs::read(tokenizer.join("tokenizer_config.json")).unwrap();
    let d = checkpoint(
        tmp.path(),
        &assets.join("fixtures/deepseek_v4/A/checkpoint"),
        &[("tokenizer.json", &tok), ("tokenizer_config.json", &cfg)],
    );
    let err = refused(&d, tmp.path());
    let msg = err.to_string();
    // The count of the tokenizer's ids, read from the file itself: its vocabulary plus the added
    // tokens that are not in it.
    let v: serde_json::Value = serde_json::from_slice(&tok).unwrap();
    let vocab = v["model"]["vocab"].as_object().unwrap();
    let added = v["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| !vocab.contains_key(t["content"].as_str().unwrap()))
        .count();
    let ids = (vocab.len() + added) as u64;
    assert!(
        matches!(err, InstallError::VocabMismatch { tokenizer, model: 1024 } if tokenizer == ids),
        "{msg} (the tokenizer has {ids} ids)"
    );
    assert!(
        msg.contains(&ids.to_string()) && msg.contains("1024"),
        "{msg}"
    );
}

#[test]
fn the_tokenizer_download_is_reported_with_its_size() {
    let tmp = tempfile::tempdir().unwrap();
    let src = common::asset("gemma4-tiny");
    let o = Command::new(env!("CARGO_BIN_EXE_gturbo-install"))
        .arg("--dir")
        .arg(&src)
        .arg("--out")
        .arg(tmp.path().join("g.gturbo"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let size = common::server::checkpoint_files(&src)["tokenizer.json"]
        .metadata()
        .unwrap()
        .len();
    let want = format!("tokenizer.json ({size} bytes)");
    let line = stderr.lines().position(|l| l.contains(&want));
    let copy = stderr.lines().position(|l| l.starts_with("copying"));
    assert!(
        line.is_some() && line < copy,
        "no progress line naming {want} before the copy:\n{stderr}"
    );
}
