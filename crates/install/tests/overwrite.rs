//! `--overwrite` moves the previous install to `<out>.old` while it promotes the new one; an
//! interruption there must neither leak that copy nor lose it.

mod common;
use mference_format::{Install, VerifyPolicy};
use mference_install::{install_local, state, InstallOptions, OutPaths};

fn opts(overwrite: bool) -> InstallOptions {
    InstallOptions {
        overwrite,
        ..common::quiet()
    }
}

#[test]
fn a_leftover_old_install_is_removed_by_the_next_overwrite() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = dir.path().join("m.gturbo");
    let src = common::asset("gemma4-tiny");
    install_local(&src, &out, &opts(false)).unwrap();
    let paths = OutPaths::new(&out).unwrap();
    // What an install killed right after moving the previous copy aside leaves behind.
    std::fs::create_dir_all(paths.old().join("packed_experts")).unwrap();
    std::fs::write(paths.old().join("model_weights.bin"), b"previous install").unwrap();
    install_local(&src, &out, &opts(true)).unwrap();
    assert!(!paths.old().exists(), "{} leaked", paths.old().display());
    Install::open(&out, VerifyPolicy::FullSha256).expect("the new install loads");
}

#[test]
fn discard_restores_a_previous_install_left_aside() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = dir.path().join("m.gturbo");
    install_local(&common::asset("gemma4-tiny"), &out, &opts(false)).unwrap();
    let paths = OutPaths::new(&out).unwrap();
    // Interrupted between moving the previous install aside and promoting the new one.
    std::fs::rename(&out, paths.old()).unwrap();
    assert!(
        state::discard(&out).unwrap(),
        "discard reported nothing to do"
    );
    assert!(!paths.old().exists());
    Install::open(&out, VerifyPolicy::FullSha256).expect("the previous install is back and loads");
}
