//! The op harness (`mference_backend::harness`) on the CPU backend: every kernel table this CPU
//! has, and a backend without ops (which must be reported op by op).

use std::sync::Arc;

use mference_backend::cpu::{CpuBackend, ResidentBytes};
use mference_backend::harness::{run_all, test_weights, Rng};
use mference_backend::{Backend, Tensor};
use mference_kernels::Kernels;

fn cpu_backends(resident: &Arc<Vec<u8>>) -> Vec<(CpuBackend, bool)> {
    Kernels::available()
        .into_iter()
        .map(|k| {
            let bytes: ResidentBytes = resident.clone();
            (CpuBackend::new(k, 2, bytes), k.is_exact())
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
        for (be, exact) in cpu_backends(&resident) {
            fails.extend(run_all(&be, &resident, &w, exact, seed));
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

impl Backend for Empty {
    type Tensor = EmptyTensor;
    type Kv = EmptyKv;
    type State = ();
    fn name(&self) -> String {
        "empty".into()
    }
}

#[test]
fn a_backend_that_lacks_an_op_fails_with_the_ops_name() {
    let mut rng = Rng(5);
    let (bytes, w) = test_weights(&mut rng, &BITS);
    let fails = run_all(&Empty, &bytes, &w, true, 5);
    for op in ["upload", "new_kv", "new_state"] {
        assert!(
            fails
                .iter()
                .any(|f| f.contains(&format!("backend 'empty' has no op '{op}'"))),
            "no failure names '{op}': {fails:?}"
        );
    }
}
