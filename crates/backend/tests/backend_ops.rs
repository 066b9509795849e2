//! The op harness (`mference_backend::harness`) on the CPU backend: every kernel table this CPU
//! has, and a backend without ops (which must be reported op by op).

use std::sync::Arc;

use mference_backend::cpu::{CpuBackend, ResidentBytes};
use mference_backend::harness::{run_all, test_weights, Numerics, Rng};
use mference_backend::{
    CoreOps, DeepSeekV4Ops, DeviceExpertOps, InklingOps, Op, RecurrentOps, Tensor,
};
use mference_kernels::Kernels;

fn cpu_backends(resident: &Arc<Vec<u8>>) -> Vec<(CpuBackend, Numerics)> {
    Kernels::available()
        .into_iter()
        .map(|k| {
            let bytes: ResidentBytes = resident.clone();
            (CpuBackend::new(k, 2, bytes), Numerics::of(k))
        })
        .collect()
}

/// Bits the kernels implement.
const BITS: [usize; 3] = [2, 4, 8];

#[test]
fn every_op_of_every_backend_matches_the_reference() {
    let mut fails = Vec::new();
    let mut ran = 0;
    for seed in [1u64, 2, 3] {
        let mut rng = Rng(seed * 7919);
        let (bytes, w) = test_weights(&mut rng, &BITS);
        let resident = Arc::new(bytes);
        for (be, numerics) in cpu_backends(&resident) {
            fails.extend(run_all(&be, &resident, &w, numerics, seed));
            ran += 1;
        }
    }
    assert!(ran >= 3, "the scalar table always runs");
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

/// A backend with no ops: the harness must name each op it lacks.
struct Empty;
struct EmptyKv;
struct EmptyTensor;

impl Tensor for EmptyTensor {
    fn rows(&self) -> usize {
        0
    }
    fn cols(&self) -> usize {
        0
    }
}

impl mference_backend::KvState for EmptyKv {
    fn rows(&self) -> usize {
        0
    }
    fn is_ring(&self) -> bool {
        false
    }
    fn bytes(&self) -> usize {
        0
    }
}

impl CoreOps for Empty {
    type Tensor = EmptyTensor;
    type Kv = EmptyKv;
    type State = ();
    fn name(&self) -> String {
        "empty".into()
    }
    fn kernels(&self) -> &'static str {
        "empty"
    }
    fn supports(_op: Op) -> bool {
        false
    }
}
impl RecurrentOps for Empty {}
impl DeepSeekV4Ops for Empty {}
impl InklingOps for Empty {}
impl DeviceExpertOps for Empty {}

/// [`Empty`] claiming `upload`, which it lacks: the harness must catch the claim.
struct Claims;

impl CoreOps for Claims {
    type Tensor = EmptyTensor;
    type Kv = EmptyKv;
    type State = ();
    fn name(&self) -> String {
        "claims".into()
    }
    fn kernels(&self) -> &'static str {
        "claims"
    }
    fn supports(op: Op) -> bool {
        op == Op::Upload
    }
}
impl RecurrentOps for Claims {}
impl DeepSeekV4Ops for Claims {}
impl InklingOps for Claims {}
impl DeviceExpertOps for Claims {}

#[test]
fn a_backend_that_lacks_an_op_fails_with_the_ops_name() {
    let mut rng = Rng(5);
    let (bytes, w) = test_weights(&mut rng, &BITS);
    let fails = run_all(&Empty, &bytes, &w, Numerics::Exact, 5);
    for op in ["upload", "new_kv", "new_state"] {
        assert!(
            fails
                .iter()
                .any(|f| f.contains(&format!("backend 'empty' has no op '{op}'"))),
            "no failure names '{op}': {fails:?}"
        );
    }
}

#[test]
fn a_backend_that_claims_an_op_it_lacks_fails_the_capability_check() {
    let mut rng = Rng(5);
    let (bytes, w) = test_weights(&mut rng, &BITS);
    let empty = run_all(&Empty, &bytes, &w, Numerics::Exact, 5);
    assert!(
        !empty.iter().any(|f| f.contains("supports()")),
        "an honest backend without ops: {empty:?}"
    );
    let fails = run_all(&Claims, &bytes, &w, Numerics::Exact, 5);
    assert!(
        fails
            .iter()
            .any(|f| f == "claims: upload: supports() says yes, but the op is missing"),
        "{fails:?}"
    );
}

#[test]
fn the_cpu_backend_supports_every_op() {
    assert!(mference_backend::missing_ops::<CpuBackend>(Op::ALL).is_empty());
}

/// Attention's work split follows the thread count (a decode row's few KV heads split into parts
/// of their query heads when the pool has more threads than heads), never its results: the
/// same bits at 1, 2, 3, 5 and 16 threads, for one decode row and a 5-row chunk, FP16 and FP32
/// caches, grouped heads with and without sinks.
#[test]
fn attention_has_the_same_bits_at_every_thread_count() {
    use mference_backend::{AttnShape, KvDtype};
    let resident: ResidentBytes = Arc::new(Vec::new());
    let k = Kernels::detect();
    let mut state = 7u64;
    let mut vec = |n: usize, a: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
            })
            .collect()
    };
    for (dtype, (nh, nkv), sinks) in [
        (KvDtype::F16, (16, 2), false),
        (KvDtype::F32, (8, 1), true),
        (KvDtype::F16, (6, 3), true),
    ] {
        let d = 32;
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window: None,
            scale: 1.0 / (d as f32).sqrt(),
            sinks: sinks.then(|| vec(nh, 2.0)),
        };
        let (kr, vr) = (vec(40 * nkv * d, 2.0), vec(40 * nkv * d, 1.0));
        let q = vec(5 * nh * d, 2.0);
        let run = |threads: usize, t: usize| {
            let be = CpuBackend::new(k, threads, resident.clone());
            let mut kv = be.new_kv(40, false, nkv, d, dtype).unwrap();
            let (kt, vt) = (
                be.upload(&kr, nkv * d).unwrap(),
                be.upload(&vr, nkv * d).unwrap(),
            );
            be.kv_write(&mut kv, 0, &kt, &vt).unwrap();
            let qt = be.upload(&q[..t * nh * d], nh * d).unwrap();
            be.read(&be.attention(&qt, &kv, 40 - t, &shape).unwrap())
                .unwrap()
        };
        for t in [1, 5] {
            let one = run(1, t);
            for threads in [2, 3, 5, 16] {
                let got = run(threads, t);
                let same = one
                    .iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same && one.len() == got.len(),
                    "{dtype:?} heads {nh}/{nkv} sinks {sinks}, {t} rows: {threads} threads differ from 1"
                );
            }
        }
    }
}
