//! A disk that fills up in the middle of an install (issue 16 item 11): the failpoint
//! `MFERENCE_FAILPOINT_ENOSPC_AFTER` makes a destination write fail with ENOSPC, as a full disk
//! does. The error says the disk filled and how to continue; the ranges written so far stay as a
//! resumable partial install, and `--resume` with space again completes byte-identical to a clean
//! install. (Its own test binary: the failpoint is a process-wide environment variable.)

mod common;
use mference_install::{InstallError, InstallOptions, OutPaths};

#[test]
fn a_disk_that_fills_mid_install_leaves_a_resumable_partial_and_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("full.gturbo");
    let paths = OutPaths::new(&out).unwrap();
    let opts = common::tiny_opts(4 << 20);
    // About a third of the 45 MB of tensor data, then the disk is "full".
    std::env::set_var("MFERENCE_FAILPOINT_ENOSPC_AFTER", (15u64 << 20).to_string());
    let err =
        mference_install::install_local(&common::asset("gemma4-tiny"), &out, &opts).unwrap_err();
    std::env::remove_var("MFERENCE_FAILPOINT_ENOSPC_AFTER");
    assert!(matches!(err, InstallError::DiskFilled { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("disk filled up") && msg.contains("--resume"),
        "{msg}"
    );
    assert!(!out.exists(), "a half-written install was promoted");
    assert!(paths.partial.is_dir() && paths.journal.is_file());
    let j = mference_install::journal::Journal::load(&paths.journal).unwrap();
    assert!(
        !j.completed_ranges.is_empty(),
        "nothing before the full disk was kept"
    );
    let resume = InstallOptions {
        resume: true,
        ..opts.clone()
    };
    let r = mference_install::install_local(&common::asset("gemma4-tiny"), &out, &resume).unwrap();
    assert!(r.ranges_reused > 0, "{r:?}");
    common::assert_same_as_local(&out, "gemma4-tiny", &opts);
}
