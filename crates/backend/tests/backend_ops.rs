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
