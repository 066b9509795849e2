//! kernels/qmv.cu, the decode products, run on the CPU: tools/cuda-emu builds the kernel's own
//! source with g++ against a stand-in for the CUDA built-ins (one thread per CUDA thread, a barrier
//! for the shuffles) and checks every bit width, group, lane count and code alignment against a
//! double-precision product, and the gated launch bit-equal to its two one-matrix products. This
//! runs where no GPU is (CI); the GPU tests (`tools/cuda-test.sh`) run the same kernels on a device.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn qmv_kernels_match_a_double_precision_product_on_the_cpu() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        eprintln!("skipped the qmv emulation: no C++ compiler ({cxx})");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    for rows in [2, 4, 8] {
        let exe = dir.path().join(format!("qmv_emu_{rows}"));
        let built = Command::new(&cxx)
            .args([
                "-std=c++20",
                "-O1",
                "-pthread",
                &format!("-DQV_R={rows}"),
                "-I",
            ])
            .arg(repo().join("crates/cuda/kernels"))
            .arg(repo().join("tools/cuda-emu/qmv_emu.cpp"))
            .arg("-o")
            .arg(&exe)
            .output()
            .expect("run the C++ compiler");
        assert!(
            built.status.success(),
            "building the emulation (QV_R {rows}) failed:\n{}",
            String::from_utf8_lossy(&built.stderr)
        );
        let out = Command::new(&exe).output().expect("run the emulation");
        let text = String::from_utf8_lossy(&out.stdout);
        let cases = text.lines().filter(|l| l.starts_with("ok")).count();
        assert!(
            out.status.success() && cases == 40,
            "QV_R {rows}: {cases} of 40 cases passed:\n{text}"
        );
    }
}
