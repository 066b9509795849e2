//! The op harness (`mference_backend::harness`) on the CUDA backend, plus shapes the harness does
//! not reach (model-sized heads, long rings, many experts) against the same f64 reference.
//!
//! On a machine without the CUDA driver each test prints that it skipped the CUDA backend and
//! passes; any other failure to start (no NVRTC, no device 0, a compile error) fails the test.

mod common;

use std::sync::Arc;

use common::*;

use mference_backend::cpu::ResidentBytes;
use mference_backend::harness::{
    kv_rounded, run_all, test_weights, Numerics, Rng, EXACT_REL, F16_KV_REL,
};
use mference_backend::reference as refr;
use mference_backend::{AttnShape, CoreOps, KvDtype, RouterSpec, Scoring, Tensor, VRef, Weights};
use mference_cuda::{CudaBackend, CudaError, KernelOrigin};

#[test]
fn every_op_of_the_cuda_backend_matches_the_reference() {
    let mut fails = Vec::new();
    for seed in [1u64, 2, 3] {
        let mut rng = Rng(seed * 7919);
        let (bytes, w) = test_weights(&mut rng, &BITS);
        let resident = Arc::new(bytes);
        let Some(be) = start(&resident) else { return };
        eprintln!("{}: kernels {:?}", be.name(), be.kernel_origin());
        fails.extend(run_all(&be, &resident, &w, Numerics::Exact, seed));
    }
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

/// Products at model sizes (a Gemma-width GEMV and GEMM, an expert blob), the head's argmax over
/// many rows, attention with 256- and 512-wide heads over long rings and linear caches, and a
/// 128-expert router: shapes the harness's small cases do not reach.
#[test]
fn model_sized_shapes_match_the_reference() {
    let mut rng = Rng(4242);
    let mut buf = Vec::new();
    let mats = [
        qmatrix(&mut buf, &mut rng, 700, 2816, 4, 64),
        qmatrix(&mut buf, &mut rng, 333, 1536, 8, 32),
        qmatrix(&mut buf, &mut rng, 1000, 2048, 2, 128),
        qmatrix(&mut buf, &mut rng, 4100, 512, 8, 128),
    ];
    let head = qmatrix(&mut buf, &mut rng, 5003, 512, 4, 64);
    while buf.len() % 4 != 2 {
        buf.push(0);
    }
    let pes_off = buf.len();
    for s in vals(&mut rng, 128, 0.5) {
        buf.extend(bf16(1.0 + s));
    }
    let pes = VRef::at(pes_off, 128);
    buf.extend([0u8; 64]);
    let bytes = Arc::new(buf);
    let Some(be) = start(&bytes) else { return };
    let mut fails = Vec::new();

    // Decode (one row) and prefill GEMMs (the tensor-core `qgemm_tc` from 2 rows of x: one
    // partial tile, one row past a tile, whole tiles, many tiles) over row counts that are not
    // multiples of a tile, within the f32 budget; the resident copy and the staging buffer give
    // the same bits.
    for t in [1usize, 7, 16, 33, 64, 300] {
        for (i, m) in mats.iter().enumerate() {
            let x = vals(&mut rng, t * m.cols, 1.0);
            let xt = be.upload(&x, m.cols).expect("upload");
            let want = refr::matmul(m, &bytes, &x);
            let mut first: Option<Vec<f32>> = None;
            for (src, name) in [
                (Weights::Resident, "resident"),
                (Weights::Blob(&bytes), "blob"),
            ] {
                let y = be.matmul(&[m], src, &xt).expect("matmul").remove(0);
                let got = be.read(&y).expect("read");
                expect(
                    &mut fails,
                    format!("matmul {i} x {t} rows ({name})"),
                    &got,
                    &want,
                    EXACT_REL,
                );
                match &first {
                    None => first = Some(got),
                    Some(f) if bits_differ(f, &got) => fails.push(format!(
                        "matmul {i} x {t} rows: the blob's bits differ from the resident copy's"
                    )),
                    Some(_) => {}
                }
            }
        }
    }

    let x = vals(&mut rng, 512, 1.0);
    let xt = be.upload(&x, 512).expect("upload");
    let (id, logit) = be.head_argmax(&head, &xt).expect("head_argmax");
    let want = refr::matmul(&head, &bytes, &x);
    let best = want.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let tol = EXACT_REL as f32 * want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
    if (id as usize) >= want.len() || want[id as usize] < best - tol || (logit - best).abs() > tol {
        fails.push(format!("head_argmax: id {id} logit {logit}, best {best}"));
    }

    // (head_dim, heads, kv heads, window, dtype, sinks)
    let cases = [
        (256, 8, 2, Some(64), KvDtype::F16, false),
        (512, 4, 1, None, KvDtype::F32, false),
        (256, 4, 4, None, KvDtype::F16, true),
        (128, 6, 3, Some(17), KvDtype::F32, true),
    ];
    for (d, nh, nkv, window, dtype, sinks) in cases {
        let chunks = [40usize, 1, 90, 1, 1];
        let total: usize = chunks.iter().sum();
        let (rows, ring) = match window {
            Some(w) => (w + 90, true),
            None => (total, false),
        };
        let mut kv = be.new_kv(rows, ring, nkv, d, dtype).expect("new_kv");
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window,
            scale: 1.0 / (d as f32).sqrt(),
            sinks: sinks.then(|| vals(&mut rng, nh, 2.0)),
        };
        let (mut hk, mut hv) = (Vec::new(), Vec::new());
        let mut pos0 = 0;
        for t in chunks {
            let k = vals(&mut rng, t * nkv * d, 2.0);
            let v = vals(&mut rng, t * nkv * d, 1.0);
            let q = vals(&mut rng, t * nh * d, 2.0);
            hk.extend(kv_rounded(dtype, &k));
            hv.extend(kv_rounded(dtype, &v));
            let kt = be.upload(&k, nkv * d).expect("upload");
            let vt = be.upload(&v, nkv * d).expect("upload");
            let qt = be.upload(&q, nh * d).expect("upload");
            be.kv_write(&mut kv, pos0, &kt, &vt).expect("kv_write");
            let o = be.attention(&qt, &kv, pos0, &shape).expect("attention");
            let want = refr::attention(&q, &hk, &hv, pos0, &shape);
            let budget = if dtype == KvDtype::F16 {
                F16_KV_REL
            } else {
                EXACT_REL
            };
            let got = be.read(&o).expect("read");
            expect(
                &mut fails,
                format!(
                    "attention d{d} {nh}/{nkv} window {window:?} {dtype:?} sinks {sinks} at {pos0}"
                ),
                &got,
                &want,
                budget,
            );
            pos0 += t;
        }
    }

    let (t, n_exp) = (37, 128);
    let logits = vals(&mut rng, t * n_exp, 4.0);
    let lt = be.upload(&logits, n_exp).expect("upload");
    for (scoring, k, pes) in [
        (Scoring::SoftmaxOfTopK, 8, Some(&pes)),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: true,
            },
            8,
            None,
        ),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: false,
            },
            10,
            Some(&pes),
        ),
    ] {
        let spec = RouterSpec {
            forced: None,
            scoring,
            top_k: k,
            per_expert_scale: pes,
            trace: false,
        };
        let routes = be.route(&lt, &spec).expect("route");
        let want = refr::route(&logits, n_exp, &spec, &bytes);
        let mut got: Vec<Vec<(usize, f32)>> = vec![Vec::new(); t];
        for (&e, rows) in &routes.experts {
            for &(row, w) in rows {
                got[row].push((e, w));
            }
        }
        for (row, (g, w)) in got.iter().zip(&want).enumerate() {
            let gi: Vec<usize> = g.iter().map(|p| p.0).collect();
            let wi: Vec<usize> = w.iter().map(|p| p.0).collect();
            if gi != wi {
                fails.push(format!("route {scoring:?} row {row}: {gi:?} vs {wi:?}"));
                continue;
            }
            let gw: Vec<f32> = g.iter().map(|p| p.1).collect();
            let ww: Vec<f32> = w.iter().map(|p| p.1).collect();
            expect(
                &mut fails,
                format!("route {scoring:?} row {row} weights"),
                &gw,
                &ww,
                1e-6,
            );
        }
        if !routes.margins.is_empty() {
            fails.push("route: margins without trace".into());
        }
    }
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

/// The kernel cache: a second start loads the entry the first one wrote; a damaged entry is
/// recompiled (and rewritten), never loaded.
#[test]
fn the_kernel_cache_is_reused_and_a_damaged_entry_is_recompiled() {
    let bytes = Arc::new(vec![0u8; 64]);
    let resident = || -> ResidentBytes { bytes.clone() };
    // Probe first: without a driver there is nothing to cache.
    let Some(_) = start(&bytes) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let cache = Some(dir.path().to_path_buf());
    let first = CudaBackend::with_cache(0, resident(), cache.clone()).expect("first start");
    let KernelOrigin::Compiled(Some(path)) = first.kernel_origin().clone() else {
        panic!(
            "an empty cache compiles and writes: {:?}",
            first.kernel_origin()
        );
    };
    drop(first);
    let second = CudaBackend::with_cache(0, resident(), cache.clone()).expect("second start");
    assert_eq!(second.kernel_origin(), &KernelOrigin::Cached(path.clone()));
    drop(second);
    let mut b = std::fs::read(&path).expect("entry");
    let mid = b.len() / 2;
    b[mid] ^= 0x40;
    std::fs::write(&path, &b).expect("damage");
    let third = CudaBackend::with_cache(0, resident(), cache.clone()).expect("third start");
    assert_eq!(
        third.kernel_origin(),
        &KernelOrigin::Compiled(Some(path.clone()))
    );
    // It still computes: one op through the recompiled kernels.
    let x = third.upload(&[1.0, f32::NAN], 2).expect("upload");
    assert!(!third.all_finite(&x).expect("all_finite"));
    drop(third);
    let fourth = CudaBackend::with_cache(0, resident(), cache).expect("fourth start");
    assert_eq!(fourth.kernel_origin(), &KernelOrigin::Cached(path));
}

/// Errors name what is missing: a device ordinal the driver does not have.
#[test]
fn a_missing_device_ordinal_is_named() {
    let bytes = Arc::new(vec![0u8; 64]);
    let Some(_) = start(&bytes) else { return };
    match CudaBackend::new(4096, bytes.clone()) {
        Err(e @ CudaError::NoDevice { ordinal: 4096, .. }) => {
            assert!(e.to_string().contains("no CUDA device 4096"), "{e}")
        }
        Err(e) => panic!("expected NoDevice, got {e}"),
        Ok(_) => panic!("device 4096 exists?"),
    }
}

/// Ops refuse operands that do not fit instead of reading out of bounds on the device.
#[test]
fn ops_refuse_operands_that_do_not_fit() {
    let bytes = Arc::new(vec![0u8; 64]);
    let Some(be) = start(&bytes) else { return };
    let x = be.upload(&[0.0; 8], 4).expect("upload");
    let mut kv = be.new_kv(2, false, 1, 4, KvDtype::F16).expect("new_kv");
    // A linear cache of 2 rows cannot take positions 1..3.
    assert!(be.kv_write(&mut kv, 1, &x, &x).is_err());
    // A norm weight beyond the 64 resident bytes.
    let mut y = be.copy(&x).expect("copy");
    let far = VRef::at(60, 4);
    assert!(be
        .rms_norm(&mut y, 4, mference_backend::Norm::Weight(&far), 1e-6)
        .is_err());
    assert_eq!(x.rows(), 2);
}

/// The capability answer needs no device: CUDA lacks no op (the harness run above checks each
/// answer against what the op does on a GPU: every op must pass there).
#[test]
fn the_cuda_backend_names_what_it_lacks_without_a_device() {
    assert!(not_yet().is_empty(), "CUDA lacks {:?}", not_yet());
}

/// One row of x through matrices of one column count, bit width and group but different row
/// counts (Gemma's q, k and v), which share a `qmv` launch: each within the f64 reference's
/// budget and bit for bit the product of its matrix alone.
#[test]
fn one_row_products_of_different_row_counts_share_a_launch() {
    let mut rng = Rng(2718);
    let mut buf = Vec::new();
    let mats = [
        qmatrix(&mut buf, &mut rng, 4096, 2816, 4, 64),
        qmatrix(&mut buf, &mut rng, 1024, 2816, 4, 64),
        qmatrix(&mut buf, &mut rng, 7, 2816, 4, 64),
        qmatrix(&mut buf, &mut rng, 1024, 2816, 4, 64),
    ];
    buf.extend([0u8; 64]);
    let bytes = Arc::new(buf);
    let Some(be) = start(&bytes) else { return };
    let x = vals(&mut rng, 2816, 1.0);
    let xt = be.upload(&x, 2816).expect("upload");
    let refs: Vec<_> = mats.iter().collect();
    let ys = be.matmul(&refs, Weights::Resident, &xt).expect("matmul");
    let mut fails = Vec::new();
    for (i, (m, y)) in mats.iter().zip(&ys).enumerate() {
        let got = be.read(y).expect("read");
        expect(
            &mut fails,
            format!("product {i} [{}, 2816]", m.rows),
            &got,
            &refr::matmul(m, &bytes, &x),
            EXACT_REL,
        );
        let alone = be.matmul(&[m], Weights::Resident, &xt).expect("matmul");
        if bits_differ(&got, &be.read(&alone[0]).expect("read")) {
            fails.push(format!("product {i}: not the bits of the matrix alone"));
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}

/// The same 4-bit matrix with its codes 16-byte aligned and 2 to 14 bytes past (`qgemm_tc4` reads
/// the aligned pieces around them and shifts): prefill products of 2 to 300 rows, gate and up
/// sharing one x in a launch, every result within the f64 reference's budget and the same bits at
/// every place. Two 4096-row products of 300 rows fill a launch of 256-row tiles, alone one
/// takes 128-row tiles: the same bits.
#[test]
fn prefill_products_have_the_same_bits_wherever_the_codes_lie() {
    let mut rng = Rng(1618);
    let mut buf = Vec::new();
    let mut pairs = Vec::new();
    for (rows, cols, gs) in [
        (700, 2816, 64),
        (2816, 704, 64),
        (40, 256, 32),
        (300, 512, 128),
        (4096, 512, 64),
    ] {
        let mut at = [None; 6];
        let codes: Vec<u8> = (0..rows * cols / 2).map(|_| next(&mut rng) as u8).collect();
        let scales = vals(&mut rng, rows * cols / gs, 0.05);
        let biases = vals(&mut rng, rows * cols / gs, 0.2);
        for (k, residue) in [0usize, 2, 4, 6, 10, 14].into_iter().enumerate() {
            while buf.len() % 16 != residue {
                buf.push(0);
            }
            let w0 = buf.len();
            buf.extend(&codes);
            let s0 = buf.len();
            scales.iter().for_each(|&s| buf.extend(bf16(s)));
            let b0 = buf.len();
            biases.iter().for_each(|&b| buf.extend(bf16(b)));
            let groups = rows * cols / gs;
            at[k] = Some((w0, (s0, 2 * groups), (b0, 2 * groups)));
        }
        pairs.push((rows, cols, at.map(|a| a.expect("placed"))));
    }
    buf.extend([0u8; 64]);
    let len = buf.len();
    let mats: Vec<[mference_backend::QRef; 6]> = pairs
        .iter()
        .map(|&(rows, cols, at)| {
            at.map(|(w0, s, b)| {
                mference_backend::QRef::from_parts(
                    "m",
                    rows,
                    cols,
                    (w0, rows * cols / 2),
                    s,
                    b,
                    len,
                )
                .expect("a well-formed matrix")
            })
        })
        .collect();
    let bytes = Arc::new(buf);
    let Some(be) = start(&bytes) else { return };
    let mut fails = Vec::new();
    for t in [2usize, 7, 33, 64, 300] {
        for (i, placed) in mats.iter().enumerate() {
            let aligned = &placed[0];
            let x = vals(&mut rng, t * aligned.cols, 1.0);
            let xt = be.upload(&x, aligned.cols).expect("upload");
            let want = refr::matmul(aligned, &bytes, &x);
            let name = format!("[{}, {}] x {t} rows", aligned.rows, aligned.cols);
            // Twice in one launch (as an expert's gate and up share x), then at each other place.
            let two = be
                .matmul(&[aligned, aligned], Weights::Resident, &xt)
                .expect("matmul");
            let first = be.read(&two[0]).expect("read");
            expect(
                &mut fails,
                format!("{name} (aligned)"),
                &first,
                &want,
                EXACT_REL,
            );
            if bits_differ(&first, &be.read(&two[1]).expect("read")) {
                fails.push(format!(
                    "matrix {i}, {name}: the launch's second product differs"
                ));
            }
            for (k, m) in placed.iter().enumerate().skip(1) {
                let y = be
                    .matmul(&[m], Weights::Resident, &xt)
                    .expect("matmul")
                    .remove(0);
                let got = be.read(&y).expect("read");
                expect(
                    &mut fails,
                    format!("{name} (place {k})"),
                    &got,
                    &want,
                    EXACT_REL,
                );
                if bits_differ(&first, &got) {
                    fails.push(format!("matrix {i}, {name}: place {k}'s bits differ"));
                }
            }
        }
    }
    assert!(fails.is_empty(), "{}", fails.join("\n"));
}
