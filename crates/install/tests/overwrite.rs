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

/// A fresh install of the tiny Gemma 4 at `<tmp>/m.gturbo`: (tmp, paths).
fn installed() -> (tempfile::TempDir, OutPaths) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = dir.path().join("m.gturbo");
    install_local(&common::asset("gemma4-tiny"), &out, &opts(false)).unwrap();
    let paths = OutPaths::new(&out).unwrap();
    (dir, paths)
}

#[test]
fn a_leftover_old_install_is_removed_by_the_next_overwrite() {
    let (_dir, paths) = installed();
    let (out, src) = (&paths.out, common::asset("gemma4-tiny"));
    // What an install killed right after moving the previous copy aside leaves behind.
    std::fs::create_dir_all(paths.old().join("packed_experts")).unwrap();
    std::fs::write(paths.old().join("model_weights.bin"), b"previous install").unwrap();
    install_local(&src, out, &opts(true)).unwrap();
    assert!(!paths.old().exists(), "{} leaked", paths.old().display());
    Install::open(out, VerifyPolicy::FullSha256).expect("the new install loads");
}

#[test]
fn discard_restores_a_previous_install_left_aside() {
    let (_dir, paths) = installed();
    let out = &paths.out;
    // Interrupted between moving the previous install aside and promoting the new one.
    std::fs::rename(out, paths.old()).unwrap();
    assert!(
        state::discard(out).unwrap(),
        "discard reported nothing to do"
    );
    assert!(!paths.old().exists());
    Install::open(out, VerifyPolicy::FullSha256).expect("the previous install is back and loads");
}

#[test]
fn a_dry_run_onto_an_install_says_it_exists_and_what_overwrite_would_do() {
    let (dir, paths) = installed();
    let (out, src) = (&paths.out, common::asset("gemma4-tiny"));
    let before = common::tree_digest(dir.path());
    let dry = |overwrite: bool| {
        let o = InstallOptions {
            dry_run: true,
            ..opts(overwrite)
        };
        install_local(&src, out, &o).unwrap().notes.join("\n")
    };
    let refused = dry(false);
    assert!(
        refused.contains(&format!("{} already exists", out.display()))
            && refused.contains("would fail")
            && refused.contains("--overwrite to replace it"),
        "{refused}"
    );
    let replacing = dry(true);
    assert!(
        replacing.contains("already exists") && replacing.contains("--overwrite would replace it"),
        "{replacing}"
    );
    assert_eq!(common::tree_digest(dir.path()), before, "a dry run wrote");

    // Without --dry-run the refusal names --overwrite, and comes before the source is read (a
    // checkpoint without weights would fail otherwise).
    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("config.json"), b"{}").unwrap();
    let err = install_local(empty.path(), out, &opts(false)).unwrap_err();
    assert!(
        matches!(err, mference_install::InstallError::OutputExists { .. })
            && err.to_string().contains("--overwrite"),
        "{err}"
    );
    assert_eq!(common::tree_digest(dir.path()), before);

    // A saved partial install next to it: the dry run names --resume and discard instead.
    std::fs::remove_dir_all(out).unwrap();
    std::fs::create_dir(&paths.partial).unwrap();
    let partial = dry(false);
    assert!(
        partial.contains("--resume") && partial.contains("mference discard"),
        "{partial}"
    );
}

/// `--overwrite` replaces an install and nothing else: a directory of the user's files, or the
/// source checkpoint itself, named as the output is refused and left exactly as it was.
#[test]
fn overwrite_refuses_a_directory_that_is_not_an_install() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let notes = dir.path().join("notes");
    std::fs::create_dir_all(&notes).unwrap();
    std::fs::write(notes.join("precious.txt"), b"keep me").unwrap();
    let err = install_local(&common::asset("gemma4-tiny"), &notes, &opts(true)).unwrap_err();
    assert!(
        err.to_string().contains("is not an mference install"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(notes.join("precious.txt")).unwrap(),
        b"keep me"
    );
    assert_eq!(
        std::fs::read_dir(&notes).unwrap().count(),
        1,
        "files were added"
    );

    // The source checkpoint as its own output.
    let src = dir.path().join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    for e in std::fs::read_dir(common::asset("gemma4-tiny")).unwrap() {
        let e = e.unwrap().path();
        if e.is_file() {
            std::fs::copy(&e, src.join(e.file_name().unwrap())).unwrap();
        }
    }
    let before = std::fs::read_dir(&src).unwrap().count();
    let err = install_local(&src, &src, &opts(true)).unwrap_err();
    assert!(
        err.to_string().contains("is not an mference install"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&src).unwrap().count(), before);
    assert!(src.join("config.json").exists());
}
