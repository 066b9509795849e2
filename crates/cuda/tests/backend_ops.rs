//! The op harness (`mference_backend::harness`) on the CUDA backend, plus shapes the harness does
//! not reach (model-sized heads, long rings, many experts) against the same f64 reference.
//!
//! On a machine without the CUDA driver each test prints that it skipped the CUDA backend and
//! passes; any other failure to start (no NVRTC, no device 0, a compile error) fails the test.

use std::sync::Arc;

use mference_backend::cpu::ResidentBytes;
use mference_backend::harness::{run_all, test_weights, Rng, EXACT_REL, F16_KV_REL};
use mference_backend::reference as refr;
use mference_backend::{
    Act, AttnShape, CoreOps, DeviceExpertOps, KvDtype, Mlp, Op, QRef, RouterSpec, Scoring, Tensor,
    VRef, Weights,
};
use mference_cuda::{
    CudaBackend, CudaError, ExpertCacheOptions, ExpertGeometry, GpuExpertBudget, KernelOrigin,
};

/// Bits the kernels implement.
const BITS: [usize; 3] = [2, 4, 8];

/// A backend on device 0 over `bytes`, or `None` (after saying so) when no driver is installed
/// or the driver sees no GPU.
fn start(bytes: &Arc<Vec<u8>>) -> Option<CudaBackend> {
    let resident: ResidentBytes = bytes.clone();
    match CudaBackend::new(0, resident) {
        Ok(be) => Some(be),
        Err(e @ (CudaError::NoDriver | CudaError::NoDevice { count: 0, .. })) => {
            eprintln!("skipped the CUDA backend: {e}");
            None
        }
        Err(e) => panic!("the CUDA driver is present but the backend did not start: {e}"),
    }
}

/// Ops the CUDA backend does not have yet (DeepSeek-V4's and Inkling's), as it says itself: the
/// harness may find these reported as missing by name (a case that needs one skips what follows
/// it), and nothing else may fail (the harness also checks `supports` against what ran).
fn not_yet() -> Vec<&'static str> {
    mference_backend::missing_ops::<CudaBackend>(Op::ALL)
        .into_iter()
        .map(Op::name)
        .collect()
}

#[test]
fn every_op_of_the_cuda_backend_matches_the_reference() {
    let mut fails = Vec::new();
    for seed in [1u64, 2, 3] {
        let mut rng = Rng(seed * 7919);
        let (bytes, w) = test_weights(&mut rng, &BITS);
        let resident = Arc::new(bytes);
        let Some(be) = start(&resident) else { return };
        eprintln!("{}: kernels {:?}", be.name(), be.kernel_origin());
        fails.extend(run_all(&be, &resident, &w, true, seed));
    }
    let missing = |op: &str| format!("has no op '{op}'");
    let not_yet_ops = not_yet();
    let (not_yet, fails): (Vec<String>, Vec<String>) = fails
        .into_iter()
        .partition(|f| not_yet_ops.iter().any(|op| f.ends_with(&missing(op))));
    let mut seen: Vec<&str> = not_yet_ops
        .iter()
        .copied()
        .filter(|op| not_yet.iter().any(|f| f.ends_with(&missing(op))))
        .collect();
    seen.dedup();
    eprintln!("missing on CUDA, as expected: {}", seen.join(", "));
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

/// Records a failure when `got` is further than `budget` from `want`.
fn expect(fails: &mut Vec<String>, name: String, got: &[f32], want: &[f32], budget: f64) {
    let e = rel(got, want);
    if e > budget {
        fails.push(format!("{name}: relative error {e:.3e} > {budget:.1e}"));
    }
}

/// `max |got − want| / max(max |want|, 1e-3)`, infinite on a non-finite value.
fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let m = want.iter().fold(1e-3f64, |m, &v| m.max(v.abs() as f64));
    let d = got
        .iter()
        .zip(want)
        .fold(0.0f64, |d, (&a, &b)| d.max((a as f64 - b as f64).abs()));
    d / m
}

/// Whether two results differ in any bit.
fn bits_differ(a: &[f32], b: &[f32]) -> bool {
    a.iter()
        .map(|v| v.to_bits())
        .ne(b.iter().map(|v| v.to_bits()))
}

/// `n` values uniform in `[-a, a]` (the harness's Rng stream; its helpers are private).
fn vals(rng: &mut Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n)
        .map(|_| ((next(rng) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a)
        .collect()
}

/// splitmix64, as the harness's Rng.
fn next(r: &mut Rng) -> u64 {
    r.0 = r.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = r.0;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn bf16(v: f32) -> [u8; 2] {
    ((v.to_bits() >> 16) as u16).to_le_bytes()
}

/// A model-sized quantized matrix at a 2-byte-aligned (not 4-byte) offset of `buf`.
fn qmatrix(
    buf: &mut Vec<u8>,
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    bits: usize,
    gs: usize,
) -> QRef {
    let pad = |b: &mut Vec<u8>| {
        while b.len() % 4 != 2 {
            b.push(0)
        }
    };
    pad(buf);
    let w0 = buf.len();
    let wlen = rows * cols * bits / 8;
    buf.extend((0..wlen).map(|_| next(rng) as u8));
    let groups = rows * cols / gs;
    pad(buf);
    let s0 = buf.len();
    for s in vals(rng, groups, 0.05) {
        buf.extend(bf16(s));
    }
    pad(buf);
    let b0 = buf.len();
    for b in vals(rng, groups, 0.2) {
        buf.extend(bf16(b));
    }
    QRef::from_parts(
        "big",
        rows,
        cols,
        (w0, wlen),
        (s0, 2 * groups),
        (b0, 2 * groups),
        buf.len(),
    )
    .expect("a well-formed matrix")
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

    // Decode, the short-product kernel, and prefill GEMMs (16 rows of x and up: one partial
    // tile, one row past a tile, whole tiles, many tiles) over row counts that are not
    // multiples of a tile; the resident copy and the staging buffer give the same bits.
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
            let round = |x: &[f32]| -> Vec<f32> {
                match dtype {
                    KvDtype::F16 => x.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect(),
                    KvDtype::F32 => x.to_vec(),
                }
            };
            hk.extend(round(&k));
            hv.extend(round(&v));
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

/// `routed_experts_held` (a decode step's experts from device-side router ids, no readback)
/// against the f64-checked reference (route, each expert's GLU MLP from its blob, the weighted
/// sum in ascending id) and bit for bit against the readback path it replaces (`route`,
/// `glu_mlp_rows` over held experts in expert order, `scatter_add`): Gemma's scoring with a
/// per-expert scale and Qwen's, chosen and forced ids.
#[test]
fn decode_experts_routed_on_the_device_equal_the_readback_path() {
    let (n_exp, k, hidden, inner) = (32usize, 8usize, 512usize, 256usize);
    let mut rng = Rng(777);
    // Every blob has the same layout (built from an empty buffer by the same calls).
    let mut blobs = Vec::new();
    let mut mlp = None;
    for _ in 0..n_exp {
        let mut b = Vec::new();
        let m = Mlp {
            gate_proj: qmatrix(&mut b, &mut rng, inner, hidden, 4, 64),
            up_proj: qmatrix(&mut b, &mut rng, inner, hidden, 4, 64),
            down_proj: qmatrix(&mut b, &mut rng, hidden, inner, 4, 32),
        };
        b.extend([0u8; 16]);
        mlp = Some(m);
        blobs.push(b);
    }
    let mlp = mlp.expect("experts");
    let stride = blobs[0].len();
    let mut buf = Vec::new();
    while buf.len() % 4 != 2 {
        buf.push(0);
    }
    let pes_off = buf.len();
    for s in vals(&mut rng, n_exp, 0.5) {
        buf.extend(bf16(1.0 + s));
    }
    let pes = VRef::at(pes_off, n_exp);
    buf.extend([0u8; 64]);
    let bytes = Arc::new(buf);
    let Some(be) = start(&bytes) else { return };
    let opts = ExpertCacheOptions {
        geometry: ExpertGeometry {
            layers: vec![0],
            experts: n_exp,
            stride,
            top_k: k,
        },
        budget: GpuExpertBudget::Resident,
        force_miss: false,
    };
    let be = be.with_expert_cache(opts).expect("expert cache");
    be.size_expert_cache().expect("sized");
    assert!(
        !be.routes_on_device(0, k).expect("routes_on_device"),
        "an empty layer was routed on the device"
    );
    let all: Vec<usize> = (0..n_exp).collect();
    assert_eq!(be.experts_to_complete(0).expect("to complete"), all);
    be.held_experts(0, &all).expect("held");
    for (e, b) in blobs.iter().enumerate() {
        be.load_expert(0, e, b).expect("load_expert");
    }
    be.expert_copies_done().expect("copies");
    assert!(be.experts_to_complete(0).expect("to complete").is_empty());
    assert!(be.routes_on_device(0, k).expect("routes_on_device"));
    assert!(!be.routes_on_device(0, 17).expect("routes_on_device"));

    let mut fails = Vec::new();
    let qwen = Scoring::TopKOfSoftmax {
        norm_topk_prob: true,
    };
    for (case, (scoring, pes, act, forced)) in [
        (Scoring::SoftmaxOfTopK, Some(&pes), Act::GeluTanh, false),
        (qwen, None, Act::Silu, false),
        (Scoring::SoftmaxOfTopK, Some(&pes), Act::GeluTanh, true),
    ]
    .into_iter()
    .enumerate()
    {
        let x = vals(&mut rng, hidden, 1.0);
        let logits = vals(&mut rng, n_exp, 4.0);
        let acc0 = vals(&mut rng, hidden, 0.5);
        let ids: Vec<usize> = (0..k).map(|j| (5 * j + 3 * case) % n_exp).collect();
        let spec = RouterSpec {
            scoring,
            top_k: k,
            per_expert_scale: pes,
            trace: false,
            forced: forced.then_some(ids.as_slice()),
        };
        let (xt, lt) = (
            be.upload(&x, hidden).expect("upload"),
            be.upload(&logits, n_exp).expect("upload"),
        );
        let mut acc = be.upload(&acc0, hidden).expect("upload");
        be.routed_experts_held(0, &mlp, act, &xt, &lt, &spec, &mut acc)
            .expect("routed_experts_held");
        let got = be.read(&acc).expect("read");

        // The reference: its routes, each expert from its own blob, summed in ascending id.
        let mut chosen = refr::route(&logits, n_exp, &spec, &bytes).remove(0);
        chosen.sort_by_key(|p| p.0);
        let mut want = acc0.clone();
        for &(e, w) in &chosen {
            let (g, u, d) = (&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj);
            let y = refr::glu_mlp(g, u, d, act, &blobs[e], &x);
            for (a, v) in want.iter_mut().zip(y) {
                *a += w * v;
            }
        }
        expect(
            &mut fails,
            format!("routed_experts_held case {case}"),
            &got,
            &want,
            EXACT_REL,
        );

        // The readback path over the same held experts.
        let routes = be.route(&lt, &spec).expect("route");
        let experts: Vec<usize> = routes.experts.keys().copied().collect();
        let srcs: Vec<Weights> = experts
            .iter()
            .map(|&e| Weights::Held {
                layer: 0,
                expert: e,
            })
            .collect();
        let mut stack = be.zeros(experts.len(), hidden).expect("zeros");
        let rows: Vec<usize> = (0..experts.len()).collect();
        be.glu_mlp_rows(&mlp, act, &srcs, &xt, &mut stack, &rows)
            .expect("glu_mlp_rows");
        let pairs: Vec<(usize, f32)> = experts
            .iter()
            .map(|e| (0, routes.experts[e][0].1))
            .collect();
        let mut acc = be.upload(&acc0, hidden).expect("upload");
        be.scatter_add(&mut acc, &stack, &pairs)
            .expect("scatter_add");
        let readback = be.read(&acc).expect("read");
        if readback
            .iter()
            .map(|v| v.to_bits())
            .ne(got.iter().map(|v| v.to_bits()))
        {
            fails.push(format!(
                "routed_experts_held case {case}: not bit-identical to the readback path \
                 (max difference {:e})",
                rel(&got, &readback)
            ));
        }
    }
    let stats = be.device_expert_stats().expect("stats");
    if stats.device_routed != 3 {
        fails.push(format!(
            "{} device-routed steps counted, 3 ran",
            stats.device_routed
        ));
    }
    // Refused: a traced router, two rows.
    let xt = be
        .upload(&vals(&mut rng, 2 * hidden, 1.0), hidden)
        .expect("upload");
    let lt = be
        .upload(&vals(&mut rng, n_exp, 1.0), n_exp)
        .expect("upload");
    let mut acc = be.zeros(1, hidden).expect("zeros");
    let spec = |trace| RouterSpec {
        scoring: Scoring::SoftmaxOfTopK,
        top_k: k,
        per_expert_scale: None,
        trace,
        forced: None,
    };
    let one = be.gather_rows(&xt, &[0]).expect("gather_rows");
    for (x, trace, what) in [(&xt, false, "two rows"), (&one, true, "a traced router")] {
        if be
            .routed_experts_held(0, &mlp, Act::Silu, x, &lt, &spec(trace), &mut acc)
            .is_ok()
        {
            fails.push(format!("routed_experts_held accepted {what}"));
        }
    }
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

/// Prefill experts at Gemma 4 26B-A4B's sizes (gate/up [704, 2816], down [2816, 704], 4-bit
/// g64) on 5 rows (the short-product kernel) and 16, 33 and 64 rows (the GEMM, its columns
/// split): within the f64 reference's budget, bit for bit the same from a GPU slot as from the
/// staging buffer (so prefill does not depend on the GPU expert budget), and `glu_mlp_experts`
/// over all of them at once bit for bit what `glu_mlp` gives for each.
#[test]
fn prefill_experts_give_the_same_bits_from_a_slot_the_staging_buffer_and_a_batch() {
    let (n_exp, hidden, inner) = (3usize, 2816usize, 704usize);
    let mut rng = Rng(99);
    // Every blob has the same layout (built from an empty buffer by the same calls).
    let mut blobs = Vec::new();
    let mut mlp = None;
    for _ in 0..n_exp {
        let mut b = Vec::new();
        mlp = Some(Mlp {
            gate_proj: qmatrix(&mut b, &mut rng, inner, hidden, 4, 64),
            up_proj: qmatrix(&mut b, &mut rng, inner, hidden, 4, 64),
            down_proj: qmatrix(&mut b, &mut rng, hidden, inner, 4, 64),
        });
        b.extend([0u8; 16]);
        blobs.push(b);
    }
    let mlp = mlp.expect("experts");
    let bytes = Arc::new(vec![0u8; 64]);
    let Some(be) = start(&bytes) else { return };
    let opts = ExpertCacheOptions {
        geometry: ExpertGeometry {
            layers: vec![0],
            experts: n_exp,
            stride: blobs[0].len(),
            top_k: 1,
        },
        budget: GpuExpertBudget::Resident,
        force_miss: false,
    };
    let be = be.with_expert_cache(opts).expect("expert cache");
    be.size_expert_cache().expect("sized");
    let all: Vec<usize> = (0..n_exp).collect();
    be.held_experts(0, &all).expect("held");
    for (e, b) in blobs.iter().enumerate() {
        be.load_expert(0, e, b).expect("load_expert");
    }
    be.expert_copies_done().expect("copies");
    let mut fails = Vec::new();
    // (expert, rows): expert 0 twice, as two tiles' worth of rows would never be, to check the
    // batch keeps its inputs apart.
    let cases = [(1usize, 16usize), (0, 5), (2, 33), (0, 64)];
    let mut xs = Vec::new();
    let mut one_by_one = Vec::new();
    for &(e, t) in &cases {
        let x = vals(&mut rng, t * hidden, 1.0);
        let xt = be.upload(&x, hidden).expect("upload");
        let (g, u, d) = (&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj);
        let want = refr::glu_mlp(g, u, d, Act::GeluTanh, &blobs[e], &x);
        let held = Weights::Held {
            layer: 0,
            expert: e,
        };
        let mut got = Vec::new();
        for src in [held, Weights::Blob(&blobs[e])] {
            let y = be.glu_mlp(&mlp, Act::GeluTanh, src, &xt).expect("glu_mlp");
            got.push(be.read(&y).expect("read"));
        }
        expect(
            &mut fails,
            format!("glu_mlp expert {e} x {t} rows (slot)"),
            &got[0],
            &want,
            EXACT_REL,
        );
        if bits_differ(&got[0], &got[1]) {
            fails.push(format!(
                "glu_mlp expert {e} x {t} rows: the slot's and the staging buffer's bits differ"
            ));
        }
        one_by_one.push(got.remove(0));
        xs.push(xt);
    }
    let held: Vec<Weights> = cases
        .iter()
        .map(|&(expert, _)| Weights::Held { layer: 0, expert })
        .collect();
    let staged: Vec<Weights> = cases
        .iter()
        .map(|&(e, _)| Weights::Blob(&blobs[e]))
        .collect();
    let x_refs: Vec<&_> = xs.iter().collect();
    for (srcs, name) in [(&held, "slots"), (&staged, "staging buffer")] {
        let ys = be
            .glu_mlp_experts(&mlp, Act::GeluTanh, srcs, &x_refs)
            .expect("glu_mlp_experts");
        for ((y, want), &(e, t)) in ys.iter().zip(&one_by_one).zip(&cases) {
            let got = be.read(y).expect("read");
            if bits_differ(&got, want) {
                fails.push(format!(
                    "glu_mlp_experts ({name}) expert {e} x {t} rows: not glu_mlp's bits \
                     (max difference {:e})",
                    rel(&got, want)
                ));
            }
        }
    }
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

/// The capability answer needs no device: what CUDA lacks today, in [`Op::ALL`]'s order (the
/// harness run above checks each answer against what the op does on a GPU).
#[test]
fn the_cuda_backend_names_what_it_lacks_without_a_device() {
    assert_eq!(
        not_yet(),
        [
            "set_rows",
            "linear",
            "route (sqrt-softplus)",
            "conv1d",
            "rope_at",
            "matmul_grouped",
            "hc_pre",
            "hc_post",
            "compress_pool",
            "attention_sparse",
            "index_top_k",
            "attention_rel",
            "route_sinks",
        ]
    );
}
