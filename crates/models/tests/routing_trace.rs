//! A recorded routing trace replaces the routers' choice (`LoadOptions::routing_trace`): with a
//! trace that names the same experts at every token, every lookup after the first per layer is a
//! hit, which a model's own router on the bundled Gemma never gives; a trace recorded for another
//! shape is refused at load.

mod common;

use common::*;
use mference_models::{load, LoadOptions, Want};

/// A uint8 `.npy` of shape `[tokens, layers, k]`.
fn write_trace(path: &std::path::Path, tokens: usize, layers: usize, ids: &[u8]) {
    let header = format!(
        "{{'descr': '|u1', 'fortran_order': False, 'shape': ({tokens}, {layers}, {}), }}",
        ids.len()
    );
    let mut h = header.into_bytes();
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(b' ');
    }
    h.push(b'\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend((h.len() as u16).to_le_bytes());
    b.extend(h);
    for _ in 0..tokens * layers {
        b.extend_from_slice(ids);
    }
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_routing_trace_drives_the_expert_cache_and_a_mismatched_one_is_refused() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = install(&repo().join("assets/models/gemma4-tiny"), work.path());
    let prompt: Vec<u32> = (0..40).map(|i| 2 + (i * 37) % 5000).collect();
    // The tiny Gemma: 6 layers, 16 experts, top-4.
    let trace = work.path().join("trace.npy");
    write_trace(&trace, 10, 6, &[3, 9, 12, 0]);
    let with = |t: Option<&std::path::Path>, chunk| LoadOptions {
        routing_trace: t.map(|p| p.to_path_buf()),
        slots: mference_runtime::CacheSlots::Fixed(8),
        ..opts(chunk, 512)
    };
    for chunk in [1, 7] {
        let mut m = load(&inst, &with(Some(&trace), chunk)).expect("a matching trace loads");
        let out = m.forward(&prompt, Want::Last).expect("forward");
        assert!(
            matches!(out, mference_models::Logits::Rows(ref r) if r.iter().all(|v| v.is_finite()))
        );
        let (h, mi) = m
            .expert_stats()
            .iter()
            .fold((0, 0), |(h, mi), s| (h + s.hits, mi + s.misses));
        assert_eq!(
            mi,
            6 * 4,
            "chunk {chunk}: only the first lookup of each expert misses"
        );
        assert!(h > 0, "chunk {chunk}: later lookups hit");
        assert_eq!(m.engine().routing(), format!("trace {}", trace.display()));
    }
    // The model's own router spreads over more than the trace's four experts.
    let mut m = load(&inst, &with(None, 7)).unwrap();
    m.forward(&prompt, Want::Last).unwrap();
    let own_misses: u64 = m.expert_stats().iter().map(|s| s.misses).sum();
    assert!(own_misses > 6 * 4, "own router: {own_misses} misses");
    // Five layers, or an expert id past the 16 experts: refused at load.
    for (layers, ids) in [
        (5, vec![3u8, 9, 12, 0]),
        (6, vec![3, 9, 12, 16]),
        (6, vec![3, 9, 12]),
    ] {
        write_trace(&trace, 10, layers, &ids);
        let e = match load(&inst, &with(Some(&trace), 7)) {
            Ok(_) => panic!("a trace of {layers} layers, ids {ids:?} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("routing trace"), "{e}");
    }
}

/// Reports name what runs the products as the backend says it ([`CoreOps::kernels`]): on the
/// CPU, the table the load picked (`scalar` when asked for); a CUDA backend says `cuda`
/// (crates/cli/tests/cuda.rs checks the `logits` line on a GPU; a run on CUDA once reported `amx`).
///
/// [`CoreOps::kernels`]: mference_backend::CoreOps::kernels
#[test]
fn the_kernels_label_is_the_backends_own() {
    let work = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let inst = install(&repo().join("assets/models/gemma4-tiny"), work.path());
    for table in [mference_kernels::Kernels::detect().name(), "scalar"] {
        let o = LoadOptions {
            kernels: Some(table.to_string()),
            ..opts(7, 512)
        };
        let m = load(&inst, &o).expect("load");
        assert_eq!(m.engine().kernels_label, table);
        assert_eq!(m.engine().kernels_label, m.engine().kernels.name());
    }
}
