//! The op capability check before any weight moves (issue 26 item 4) on the golden DeepSeek-V4
//! fixture (`assets/fixtures/deepseek_v4/A`), the family that lacked the most CUDA kernels until
//! issue 30: no op is named missing, `--device cuda` fails only where CUDA is missing, `--device
//! auto` then takes the CPU. A backend that lacks ops is refused naming them (the machinery's own
//! tests: `crates/backend/tests/backend_ops.rs`, `crates/backend/src/ops/tests.rs`).

use std::path::{Path, PathBuf};
use std::process::Command;

use mference_testkit::run_ok;

const BIN: &str = env!("CARGO_BIN_EXE_mference");

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/fixtures/deepseek_v4/A")
}

fn logits(inst: &Path, work: &Path, device: &str) -> std::process::Output {
    Command::new(BIN)
        .args(["logits", "--device", device, "--model"])
        .arg(inst)
        .arg("--ids")
        .arg(fixture().join("prompt_ids.json"))
        .arg("--out")
        .arg(work.join(format!("{device}.npy")))
        .output()
        .unwrap()
}

/// DeepSeek-V4, the family that lacked the most CUDA kernels, passes the capability check now:
/// `--device cuda` fails only for want of CUDA itself (the driver or a device, never an op), and
/// `--device auto` runs where CUDA is missing on the CPU with `--device cpu`'s bits.
#[test]
fn deepseek_v4_passes_the_capability_check_and_auto_takes_what_runs() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = work.path().join("dsv4.gturbo");
    let (src, out) = (fixture().join("checkpoint"), inst.clone());
    run_ok(
        BIN,
        &[
            "install",
            src.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--quiet",
        ],
    );

    let cuda = logits(&inst, work.path(), "cuda");
    let err = String::from_utf8_lossy(&cuda.stderr);
    assert!(
        !err.contains("has no kernel for"),
        "--device cuda refused an op of DeepSeek-V4:\n{err}"
    );
    let gpu = cuda.status.success();
    if !gpu {
        assert!(
            err.contains("no CUDA driver") || err.contains("the driver sees 0 device(s)"),
            "--device cuda failed for another reason than a missing GPU:\n{err}"
        );
    }

    let auto = logits(&inst, work.path(), "auto");
    let log = String::from_utf8_lossy(&auto.stderr);
    assert!(auto.status.success(), "--device auto failed:\n{log}");
    assert!(
        !log.contains("has no kernel for"),
        "--device auto names a missing op:\n{log}"
    );
    let cpu = logits(&inst, work.path(), "cpu");
    assert!(cpu.status.success());
    let read = |d: &str| std::fs::read(work.path().join(format!("{d}.npy"))).unwrap();
    if !gpu {
        assert_eq!(
            read("auto"),
            read("cpu"),
            "auto's CPU run differs from --device cpu"
        );
    }

    // A rounded kernel table for this family is refused before anything is read: with the
    // weights file emptied, the error is still the table's.
    std::fs::write(inst.join("model_weights.bin"), b"").unwrap();
    let out = Command::new(BIN)
        .args(["logits", "--kernels", "avx512i16", "--model"])
        .arg(&inst)
        .arg("--ids")
        .arg(fixture().join("prompt_ids.json"))
        .arg("--out")
        .arg(work.path().join("i16.npy"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a rounded table ran on DeepSeek-V4:\n{err}"
    );
    assert!(
        err.contains("is for Gemma 4 and Qwen 3.6 only") || err.contains("this CPU runs"),
        "the refusal does not name the kernel table, or came after the weights were read:\n{err}"
    );
}
