//! The decode products (`qmv`) of crates/cuda/src/ops/quant.cu, the delta rule of ops/recurrent.cu, DeepSeek-V4's mHC kernels
//! and the f32 `linear`, run on the CPU: tools/cuda-emu
//! builds the kernel's own source with g++ against a stand-in for the CUDA built-ins (one thread per CUDA thread, a barrier
//! for the shuffles) and checks every bit width, group, lane count and code alignment against a
//! double-precision product, and the gated launch bit-equal to its two one-matrix products. This
//! runs where no GPU is (CI); the GPU tests (`tools/cuda-test.sh`) run the same kernels on a device.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The C++ compiler (`CXX`, else g++), or `None` (said on stderr) when there is none.
fn compiler(what: &str) -> Option<String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        eprintln!("skipped the {what} emulation: no C++ compiler ({cxx})");
        return None;
    }
    Some(cxx)
}

/// Builds tools/cuda-emu/`src` with `defines` into `exe`, runs it, and returns its stdout once
/// it exits with success and prints `cases` lines starting with "ok".
fn build_and_run(cxx: &str, src: &str, defines: &[String], exe: &Path, cases: usize) -> String {
    let built = Command::new(cxx)
        .args(["-std=c++20", "-O1", "-pthread"])
        .args(defines)
        .arg("-I")
        .arg(repo().join("crates/cuda/src/ops"))
        .arg(repo().join("tools/cuda-emu").join(src))
        .arg("-o")
        .arg(exe)
        .output()
        .expect("run the C++ compiler");
    assert!(
        built.status.success(),
        "building {src} {defines:?} failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = Command::new(exe).output().expect("run the emulation");
    let text = String::from_utf8_lossy(&out.stdout);
    let ok = text.lines().filter(|l| l.starts_with("ok")).count();
    assert!(
        out.status.success() && ok == cases,
        "{src} {defines:?}: {ok} of {cases} cases passed:\n{text}"
    );
    text.into_owned()
}

#[test]
fn qmv_kernels_match_a_double_precision_product_on_the_cpu() {
    let Some(cxx) = compiler("qmv") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    // (QV_R, QV_U, QV_STAGE, passes): every row count, every unroll at the default rows, x read
    // from global memory (0), staged at every bit width (8) and at 2 bits only (2), the `_p`
    // kernels' passes per block over a staged x. Every build
    // writes the same bits (the digest line).
    let mut digests = Vec::new();
    for (rows, unroll, stage, passes) in [
        (2, 1, 8, 1),
        (2, 2, 8, 1),
        (2, 4, 8, 1),
        (2, 8, 8, 1),
        (4, 2, 8, 1),
        (8, 2, 8, 1),
        (2, 2, 0, 1),
        (2, 2, 8, 4),
        (4, 2, 8, 4),
        (2, 2, 2, 1),
    ] {
        let exe = dir
            .path()
            .join(format!("qmv_emu_{rows}_{unroll}_{stage}_{passes}"));
        let defines = [
            format!("-DQV_R={rows}"),
            format!("-DQV_U={unroll}"),
            format!("-DQV_STAGE={stage}"),
            format!("-DQV_P={passes}"),
        ];
        let out = build_and_run(&cxx, "qmv_emu.cpp", &defines, &exe, 52);
        let digest = out
            .lines()
            .find(|l| l.starts_with("digest"))
            .map(str::to_owned);
        digests.push((defines, digest.expect("the emulation prints a digest")));
    }
    assert!(
        digests.iter().all(|(_, d)| *d == digests[0].1),
        "the builds wrote different bits: {digests:#?}"
    );
}

/// ops/recurrent.cu's `gated_delta_rule` (one warp per state row) on the CPU through the same
/// stand-in: against a double-precision delta rule on five head shapes, the state carried over
/// calls of 4, 1 and 3 rows, and those calls bit-equal to one call of 8 (tools/cuda-emu/gdr_emu.cpp).
#[test]
fn the_delta_rule_kernel_matches_a_double_precision_recurrence_on_the_cpu() {
    let Some(cxx) = compiler("delta rule") else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    build_and_run(&cxx, "gdr_emu.cpp", &[], &dir.path().join("gdr_emu"), 5);
}

/// ops/deepseek_v4.cu's mHC entry (`hc_mix_parts` over column splits, then `hc_pre_row`) and exit
/// (`hc_post`), and ops/elementwise.cu's f32 `linear` (its 16-byte path and tail), on the CPU
/// through the same stand-in against double-precision twins of the reference: DeepSeek-V4-Flash's
/// 4 streams of 4096 columns among the shapes (tools/cuda-emu/mhc_emu.cpp).
#[test]
fn the_mhc_and_linear_kernels_match_a_double_precision_reference_on_the_cpu() {
    let Some(cxx) = compiler("mHC") else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    build_and_run(&cxx, "mhc_emu.cpp", &[], &dir.path().join("mhc_emu"), 24);
}
