//! The op capability check before any weight moves (issue 26 item 4): on an install whose family
//! needs ops the CUDA backend has no kernel for (the golden DeepSeek-V4 fixture,
//! `assets/fixtures/deepseek_v4/A`), `--device cuda` is refused at once naming those ops, and
//! `--device auto` takes the CPU and says why on the load line. Neither needs a GPU: the check
//! asks the backend type what it supports, before the driver is touched.

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

#[test]
fn a_family_whose_ops_cuda_lacks_is_refused_on_cuda_and_runs_on_the_cpu_under_auto() {
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
        !cuda.status.success(),
        "--device cuda ran a family CUDA lacks ops for:\n{err}"
    );
    for op in [
        "hc_pre",
        "hc_post",
        "compress_pool",
        "attention_sparse",
        "index_top_k",
    ] {
        assert!(err.contains(op), "the refusal does not name {op}:\n{err}");
    }
    assert!(
        err.contains("DeepSeek-V4"),
        "the refusal does not name the family:\n{err}"
    );
    assert!(
        !work.path().join("cuda.npy").exists(),
        "a refused run wrote logits"
    );

    let auto = logits(&inst, work.path(), "auto");
    let log = String::from_utf8_lossy(&auto.stderr);
    assert!(auto.status.success(), "--device auto failed:\n{log}");
    assert!(
        log.contains("--device auto: the CUDA backend has no kernel for")
            && log.contains("hc_post"),
        "the load line does not say why auto took the CPU:\n{log}"
    );
    let cpu = logits(&inst, work.path(), "cpu");
    assert!(cpu.status.success());
    let read = |d: &str| std::fs::read(work.path().join(format!("{d}.npy"))).unwrap();
    assert_eq!(
        read("auto"),
        read("cpu"),
        "auto's CPU run differs from --device cpu"
    );

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
        err.contains("is checked only for Gemma 4 and Qwen 3.6") || err.contains("this CPU runs"),
        "the refusal does not name the kernel table, or came after the weights were read:\n{err}"
    );
}
