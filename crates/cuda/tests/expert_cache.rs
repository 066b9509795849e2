//! The CUDA backend's expert paths against the f64 reference and against each other, bit for
//! bit: a decode step's experts routed on the device against the readback path, and prefill
//! experts from a GPU slot, the staging buffer and a batch; a decode row's misses split between
//! the GPU and the host CPU.
//!
//! On a machine without the CUDA driver each test prints that it skipped the CUDA backend and
//! passes.

mod common;

use std::sync::Arc;

use common::*;

use mference_backend::harness::{Rng, EXACT_REL};
use mference_backend::reference as refr;
use mference_backend::{Act, CoreOps, DeviceExpertOps, Mlp, RouterSpec, Scoring, VRef, Weights};
use mference_cuda::{ExpertCacheOptions, ExpertGeometry, GpuExpertBudget, MissSplit};

/// `routed_experts_held` (a decode step's experts from device-side router ids, no readback)
/// against the f64-checked reference (route, each expert's GLU MLP from its blob, the weighted
/// sum in ascending id) and bit for bit against the readback path it replaces (`route`,
/// `glu_mlp_rows` over held experts in expert order, `scatter_add`; and `glu_mlp_combine`, the
/// readback path's one call): Gemma's scoring with a
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
        // The readback path of the decode step with a GPU cache: one `glu_mlp_combine`.
        let weights: Vec<f32> = pairs.iter().map(|p| p.1).collect();
        let mut acc = be.upload(&acc0, hidden).expect("upload");
        be.glu_mlp_combine(&mlp, act, &srcs, &weights, &xt, &mut acc)
            .expect("glu_mlp_combine");
        let combined = be.read(&acc).expect("read");
        if combined
            .iter()
            .map(|v| v.to_bits())
            .ne(got.iter().map(|v| v.to_bits()))
        {
            fails.push(format!(
                "glu_mlp_combine case {case}: not bit-identical to routed_experts_held \
                 (max difference {:e})",
                rel(&got, &combined)
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
/// g64) on one row (the decode kernels) and 5, 16, 33 and 64 rows (the tensor-core GEMM, its
/// columns split): within the f64 reference's f32 budget, bit for bit the same from a GPU slot as from the
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
        // Padded to a multiple of 16 bytes, as an install's stride (16 KiB multiples) is: every
        // slot then starts at the staging buffer's alignment, which the one-row (decode) kernels'
        // bits depend on.
        b.resize((b.len() + 16).next_multiple_of(16), 0);
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
    let cases = [(1usize, 16usize), (0, 5), (2, 33), (0, 64), (2, 1)];
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

/// Eight experts' blobs of one shape (4-bit gate and up in groups of 64, a `bits`-bit down in
/// groups of 32, 16 spare bytes each) and the matrices' places in a blob.
fn eight_experts(rng: &mut Rng, hidden: usize, inner: usize, bits: usize) -> (Mlp, Vec<Vec<u8>>) {
    let mut blobs = Vec::new();
    let mut mlp = None;
    for _ in 0..8 {
        let mut b = Vec::new();
        mlp = Some(Mlp {
            gate_proj: qmatrix(&mut b, rng, inner, hidden, 4, 64),
            up_proj: qmatrix(&mut b, rng, inner, hidden, 4, 64),
            down_proj: qmatrix(&mut b, rng, hidden, inner, bits, 32),
        });
        b.extend([0u8; 16]);
        blobs.push(b);
    }
    (mlp.expect("experts"), blobs)
}

/// `glu_mlp_combine` of one decode row over distinct experts (staged blobs) where the down rows
/// are long (2048 columns: 32 lanes per row, fewer lane groups in a block than experts) and short
/// (96: 4 lanes), with 8 and 5 experts (5 does not divide a block's lane groups) and 2-, 4- and
/// 8-bit down matrices: within the f64 reference's budget and bit for bit `glu_mlp_rows` into a
/// stack followed by `scatter_add`.
#[test]
fn decode_experts_combined_in_one_call_equal_the_stack_and_scatter() {
    let mut rng = Rng(4321);
    let mut fails = Vec::new();
    for (hidden, inner, bits) in [(256usize, 2048usize, 4usize), (512, 96, 2), (320, 512, 8)] {
        let (mlp, blobs) = eight_experts(&mut rng, hidden, inner, bits);
        let Some(be) = start(&Arc::new(vec![0u8; 64])) else {
            return;
        };
        for k in [8usize, 5] {
            let x = vals(&mut rng, hidden, 1.0);
            let acc0 = vals(&mut rng, hidden, 0.5);
            let weights = vals(&mut rng, k, 1.0);
            let srcs: Vec<Weights> = blobs[..k].iter().map(|b| Weights::Blob(b)).collect();
            let xt = be.upload(&x, hidden).expect("upload");
            let mut acc = be.upload(&acc0, hidden).expect("upload");
            be.glu_mlp_combine(&mlp, Act::GeluTanh, &srcs, &weights, &xt, &mut acc)
                .expect("glu_mlp_combine");
            let got = be.read(&acc).expect("read");
            let mut want = acc0.clone();
            for (b, &w) in blobs.iter().zip(&weights) {
                let (g, u, d) = (&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj);
                let y = refr::glu_mlp(g, u, d, Act::GeluTanh, b, &x);
                for (a, v) in want.iter_mut().zip(y) {
                    *a += w * v;
                }
            }
            let name = format!("glu_mlp_combine {hidden}x{inner} {bits}-bit, {k} experts");
            expect(&mut fails, name.clone(), &got, &want, EXACT_REL);
            let mut stack = be.zeros(k, hidden).expect("zeros");
            let rows: Vec<usize> = (0..k).collect();
            be.glu_mlp_rows(&mlp, Act::GeluTanh, &srcs, &xt, &mut stack, &rows)
                .expect("glu_mlp_rows");
            let pairs: Vec<(usize, f32)> = weights.iter().map(|&w| (0, w)).collect();
            let mut acc = be.upload(&acc0, hidden).expect("upload");
            be.scatter_add(&mut acc, &stack, &pairs)
                .expect("scatter_add");
            if bits_differ(&got, &be.read(&acc).expect("read")) {
                fails.push(format!("{name}: not the bits of the stack and scatter_add"));
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

/// `glu_mlp_combine_split` (issue 29): a decode row whose experts are partly computed by the
/// host CPU (the exact CPU table, from the blobs where they lie) and partly on the GPU, added in
/// expert order on the GPU. For 8 and 5 experts, with none, every other, the last one and all of
/// them on the host: within the f64 reference's budget; bit for bit `glu_mlp_combine` with none
/// on the host; the same bits run to run; and the host counter counts what the host computed.
#[test]
fn decode_experts_split_with_the_host_cpu_stay_exact() {
    let mut rng = Rng(2929);
    let mut fails = Vec::new();
    let mut on_host_total = 0u64;
    let bytes = Arc::new(vec![0u8; 64]);
    let Some(be) = start(&bytes) else {
        return;
    };
    let cpu = mference_backend::cpu::CpuBackend::new(
        mference_kernels::Kernels::detect(),
        2,
        bytes.clone(),
    );
    // A one-layer GPU cache only for its counters (the blobs here are staged, not held).
    let opts = ExpertCacheOptions {
        geometry: ExpertGeometry {
            layers: vec![0],
            experts: 8,
            stride: 1,
            top_k: 8,
        },
        budget: GpuExpertBudget::Bytes(8),
        force_miss: false,
    };
    let be = be
        .with_expert_cache(opts)
        .expect("expert cache")
        .with_host_experts(cpu, MissSplit::Percent(50));
    for (hidden, inner, bits) in [(256usize, 2048usize, 4usize), (512, 96, 2), (320, 512, 8)] {
        let (mlp, blobs) = eight_experts(&mut rng, hidden, inner, bits);
        for k in [8usize, 5] {
            let x = vals(&mut rng, hidden, 1.0);
            let acc0 = vals(&mut rng, hidden, 0.5);
            let weights = vals(&mut rng, k, 1.0);
            let srcs: Vec<Weights> = blobs[..k].iter().map(|b| Weights::Blob(b)).collect();
            let xt = be.upload(&x, hidden).expect("upload");
            let mut want = acc0.clone();
            for (b, &w) in blobs.iter().zip(&weights) {
                let (g, u, d) = (&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj);
                let y = refr::glu_mlp(g, u, d, Act::GeluTanh, b, &x);
                for (a, v) in want.iter_mut().zip(y) {
                    *a += w * v;
                }
            }
            let mut plain = be.upload(&acc0, hidden).expect("upload");
            be.glu_mlp_combine(&mlp, Act::GeluTanh, &srcs, &weights, &xt, &mut plain)
                .expect("glu_mlp_combine");
            let plain = be.read(&plain).expect("read");
            let patterns: [Vec<bool>; 4] = [
                vec![false; k],
                (0..k).map(|j| j % 2 == 1).collect(),
                (0..k).map(|j| j == k - 1).collect(),
                vec![true; k],
            ];
            for on_host in patterns {
                let run = || {
                    let mut acc = be.upload(&acc0, hidden).expect("upload");
                    be.glu_mlp_combine_split(
                        &mlp,
                        Act::GeluTanh,
                        &srcs,
                        &weights,
                        &on_host,
                        &xt,
                        &x,
                        &mut acc,
                    )
                    .expect("glu_mlp_combine_split");
                    be.read(&acc).expect("read")
                };
                let got = run();
                let name = format!(
                    "split {hidden}x{inner} {bits}-bit, {k} experts, on the host {on_host:?}"
                );
                expect(&mut fails, name.clone(), &got, &want, EXACT_REL);
                if on_host.iter().all(|&h| !h) && bits_differ(&got, &plain) {
                    fails.push(format!("{name}: not the bits of glu_mlp_combine"));
                }
                if bits_differ(&got, &run()) {
                    fails.push(format!("{name}: differs run to run"));
                }
                on_host_total += 2 * on_host.iter().filter(|&&h| h).count() as u64;
            }
        }
    }
    let stats = be.device_expert_stats().expect("a GPU cache");
    assert_eq!(stats.host_computed, on_host_total);
    assert_eq!(stats.host_share, Some(50));
    // 50% of a row's misses, the least used first (none counted in layer 0: the highest ids).
    be.size_expert_cache().expect("sized");
    let misses = [1, 3, 5, 6];
    let pick = be.host_misses(0, &misses).expect("host_misses");
    assert_eq!(pick, [false, false, true, true], "50% of 4 misses");
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.join("\n")
    );
}
