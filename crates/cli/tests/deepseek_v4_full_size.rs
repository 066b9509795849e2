//! DeepSeek-V4-Flash at full width (`mference_testkit::dsv4`: the pinned 2-bit DQ checkpoint's
//! tensor table, mlx-community/DeepSeek-V4-Flash-2bit-DQ).
//!
//! - The 43-layer plan from headers alone: accepted, one 8 MiB expert stride (the g32-gate blob;
//!   layer 42's g64 blob is 7.5 MiB), and the installed size the original measured on the real
//!   repository (96,689,373,952 bytes) within 1%.
//! - `#[ignore]`d (about 5 GB of disk while it runs, 2.2 GB more per further layer): a
//!   layer-truncated full-width checkpoint with random weights (layer 0 CSA + hash routing,
//!   layer 1 HCA + learned routing; the first `MFERENCE_DSV4_LAYERS` layers of the published
//!   schedule when set) written with its routed experts as holes, installed, the experts filled
//!   in place (`dsv4::fill_experts`: the checkpoint is never on disk twice), and benchmarked
//!   with 16 expert slots and O_DIRECT, shadow prefetch on and off; run with
//!   `--ignored --nocapture` to see the numbers. With `MFERENCE_DSV4_KEEP=DIR` the install is
//!   made at `DIR` and kept, unbenchmarked (for `docs/BENCHMARKS.md`'s runs; open it with
//!   `--verify trusted-receipt`, `bench`'s default, since the filled layer files no longer match
//!   the manifest's hashes).

use mference_format::safetensors::{SafetensorsHeader, TensorInfo};
use mference_format::Dtype;
use mference_install::checkpoint::{Checkpoint, Shard};
use mference_testkit::dsv4::{config, fill_experts, tensors, write_checkpoint_with, Dims, Experts};
use mference_testkit::run_ok;

const BIN: &str = env!("CARGO_BIN_EXE_mference");

#[test]
fn full_size_plan_matches_the_measured_install() {
    let d = Dims::flash(Dims::flash_schedule(43), 3);
    let mut start = 8 + 4096;
    let list = tensors(&d)
        .into_iter()
        .map(|t| {
            let info = TensorInfo {
                dtype: Dtype::from_safetensors(t.dtype).unwrap(),
                size: t.size(),
                start,
                shape: t.shape,
                name: t.name,
            };
            start += info.size;
            info
        })
        .collect();
    let ck = Checkpoint {
        config: config(&d),
        config_bytes: Vec::new(),
        index_bytes: None,
        index_sha256: "0".repeat(64),
        shards: vec![Shard {
            file: "model.safetensors".into(),
            header: SafetensorsHeader {
                header_len: 4096,
                data_start: 8 + 4096,
                tensors: list,
                metadata: None,
            },
            size: start,
        }],
        sidecars: vec![("config.json".into(), 10_000)],
    };
    let plan = mference_install::plan::build(&ck, mference_install::plan::MAX_RANGE_BYTES).unwrap();
    assert_eq!(plan.expert_layers(), 43);
    assert_eq!(plan.layout.expert_stride, 8 << 20);
    let l42 = plan.layout.layers[42].blob.as_ref().unwrap().used_bytes();
    assert_eq!(l42, (15 << 20) / 2);
    let out = plan.output_bytes();
    let measured = 96_689_373_952u64;
    let rel = (out as f64 - measured as f64).abs() / measured as f64;
    eprintln!(
        "plan: {out} output bytes ({:.3} GB; measured install {measured}: {:+.3}%), source {} bytes, {} ranges",
        out as f64 / 1e9,
        (out as f64 / measured as f64 - 1.0) * 100.0,
        plan.source_bytes(),
        plan.ranges.len()
    );
    assert!(
        rel < 0.01,
        "plan output {out} is {rel:.4} away from {measured}"
    );
}

#[test]
#[ignore = "writes about 5 GB; run with --ignored"]
fn full_width_truncated_bench() {
    let d = match std::env::var("MFERENCE_DSV4_LAYERS") {
        Ok(n) => Dims::flash(Dims::flash_schedule(n.parse().unwrap()), 3),
        Err(_) => Dims::flash(vec![4, 128], 1),
    };
    let work = tempfile::tempdir_in(std::env::temp_dir()).unwrap();
    let keep = std::env::var_os("MFERENCE_DSV4_KEEP").map(std::path::PathBuf::from);
    let inst = keep
        .clone()
        .unwrap_or_else(|| work.path().join("dsv4.gturbo"));
    let src = work.path().join("src");
    let t0 = std::time::Instant::now();
    let bytes = write_checkpoint_with(&d, &src, 7, Experts::Holes).unwrap();
    eprintln!(
        "wrote {bytes} bytes (experts as holes) in {:.1}s",
        t0.elapsed().as_secs_f64()
    );
    run_ok(
        BIN,
        &[
            "install",
            src.to_str().unwrap(),
            "--output",
            inst.to_str().unwrap(),
            "--quiet",
        ],
    );
    std::fs::remove_dir_all(&src).unwrap();
    let t1 = std::time::Instant::now();
    let filled = fill_experts(&d, &inst, 8).unwrap();
    eprintln!(
        "filled {filled} expert bytes in {:.1}s",
        t1.elapsed().as_secs_f64()
    );
    if keep.is_some() {
        eprintln!("kept {}", inst.display());
        return;
    }
    for shadow in ["on", "off"] {
        let o = run_ok(
            BIN,
            &[
                "bench",
                "--model",
                inst.to_str().unwrap(),
                "--prompts",
                "64",
                "--gen",
                "16",
                "--repeats",
                "1",
                "--slots",
                "16",
                "--direct-io",
                "--max-context",
                "4096",
                "--shadow-prefetch",
                shadow,
            ],
        );
        let stdout = String::from_utf8(o.stdout).unwrap();
        let doc: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let r = &doc["runs"][0];
        eprintln!("shadow {shadow}: {r}");
        assert_eq!(r["finite"], true, "{r}");
    }
}
