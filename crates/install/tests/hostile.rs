//! Hostile sources (issue 16 item 11): a checkpoint that names files outside itself, links a
//! shard to a pipe, or has a header whose lengths and offsets lie. Each is refused with an error
//! that says what was wrong, before anything is written, and without hanging or allocating what
//! a length field asks for.

mod common;
use mference_install::InstallError;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A copy of the tiny Gemma checkpoint in `tmp/src`: `config.json` copied, the shard linked,
/// the index edited by `edit`.
fn checkpoint(tmp: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let src = common::asset("gemma4-tiny");
    let dir = tmp.join("src");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    std::os::unix::fs::symlink(src.join("model.safetensors"), dir.join("model.safetensors"))
        .unwrap();
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    edit(&mut index);
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    dir
}

/// Installs `dir` and returns the error, checking it came quickly and left nothing behind.
fn refused(dir: &Path, tmp: &Path) -> String {
    let before = common::listing(tmp);
    let t0 = Instant::now();
    let err = mference_install::install_local(dir, &tmp.join("out/o.gturbo"), &common::quiet())
        .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "refusing took {:?}",
        t0.elapsed()
    );
    assert!(
        matches!(
            err,
            InstallError::SourceInvalid { .. } | InstallError::Format(_)
        ),
        "{err:?}"
    );
    assert_eq!(common::listing(tmp), before, "a refused install left files");
    err.to_string()
}

fn remap_first_tensor(to: &'static str) -> impl FnOnce(&mut serde_json::Value) {
    move |index| {
        let wm = index["weight_map"].as_object_mut().unwrap();
        let first = wm.keys().next().unwrap().clone();
        wm.insert(first, to.into());
    }
}

#[test]
fn an_index_naming_files_outside_the_checkpoint_is_refused() {
    for name in [
        "../model.safetensors",
        "/etc/passwd",
        "sub/../../x.safetensors",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = checkpoint(tmp.path(), remap_first_tensor(name));
        let err = refused(&dir, tmp.path());
        assert!(err.contains("outside the checkpoint"), "{name}: {err}");
    }
}

#[test]
fn a_shard_linked_to_a_pipe_or_a_device_is_refused_without_blocking() {
    for target in ["fifo", "/dev/zero"] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = checkpoint(tmp.path(), |_| {});
        std::fs::remove_file(dir.join("model.safetensors")).unwrap();
        let target = if target == "fifo" {
            let fifo = tmp.path().join("shard.fifo");
            let ok = std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap();
            assert!(ok.success());
            fifo
        } else {
            PathBuf::from(target)
        };
        std::os::unix::fs::symlink(&target, dir.join("model.safetensors")).unwrap();
        let err = refused(&dir, tmp.path());
        assert!(
            err.contains("model.safetensors is not a regular file"),
            "{}: {err}",
            target.display()
        );
    }
}

/// A single-shard checkpoint (no index) whose shard is `bytes`.
fn single_shard(tmp: &Path, bytes: &[u8]) -> PathBuf {
    let dir = tmp.join("src");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        common::asset("gemma4-tiny").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    dir
}

fn shard(header: &str, data: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    b.resize(b.len() + data, 0);
    b
}

#[test]
fn lying_header_lengths_and_offsets_are_refused() {
    // A header length of 2^63: refused from the 8 bytes, nothing allocated for it.
    let tmp = tempfile::tempdir().unwrap();
    let mut huge = (1u64 << 63).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    let err = refused(&single_shard(tmp.path(), &huge), tmp.path());
    assert!(err.contains("header length 9223372036854775808"), "{err}");

    // A tensor that promises more bytes than the file has.
    let tmp = tempfile::tempdir().unwrap();
    let h = r#"{"language_model.model.norm.weight":{"dtype":"BF16","shape":[1000000],"data_offsets":[0,2000000]}}"#;
    let err = refused(&single_shard(tmp.path(), &shard(h, 64)), tmp.path());
    assert!(err.contains("ends past the end of the file"), "{err}");

    // Offsets near u64::MAX must not wrap around the file-size check.
    let tmp = tempfile::tempdir().unwrap();
    let e = u64::MAX - 4;
    let h = format!(
        r#"{{"language_model.model.norm.weight":{{"dtype":"I64","shape":[1],"data_offsets":[{},{e}]}}}}"#,
        e - 8
    );
    let err = refused(&single_shard(tmp.path(), &shard(&h, 64)), tmp.path());
    assert!(err.contains("ends past the end of the file"), "{err}");

    // A shape whose byte count overflows u64.
    let tmp = tempfile::tempdir().unwrap();
    let h = r#"{"language_model.model.norm.weight":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}}"#;
    let err = refused(&single_shard(tmp.path(), &shard(h, 64)), tmp.path());
    assert!(err.contains("more bytes than 64 bits count"), "{err}");
}
