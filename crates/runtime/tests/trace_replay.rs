//! The expert cache's eviction policy replayed over the recorded routing traces
//! (`assets/traces/`), token by token, through the real `ExpertStreamer` over a small layer file:
//! hit rates per slot count against the ones the traces' README states for a per-layer LFU cache
//! with recency tie-break (computed by the traces' authors, not by this code). A policy change
//! shows up here without a large checkpoint.

use std::io::Write;
use std::path::PathBuf;

use mference_runtime::streamer::IoPool;
use mference_runtime::{CacheSlots, ExpertStreamer, RoutingTrace};

fn trace(name: &str) -> RoutingTrace {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/traces")
        .join(name);
    RoutingTrace::open(&p).expect("the bundled routing trace")
}

/// Decode-style replay: per token and layer, acquire the (sorted, distinct) experts, wait, release.
/// Returns the hit rate over every lookup.
fn replay(t: &RoutingTrace, experts: usize, slots: usize) -> f64 {
    const STRIDE: u64 = 4096;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("layer.bin");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![7u8; experts * STRIDE as usize]).unwrap();
    drop(f);
    let io = IoPool::new(2);
    let mut layers: Vec<ExpertStreamer> = (0..t.layers)
        .map(|_| {
            ExpertStreamer::open(
                &path,
                experts,
                STRIDE,
                CacheSlots::Fixed(slots),
                false,
                io.clone(),
            )
            .unwrap()
        })
        .collect();
    for pos in 0..t.tokens {
        for (l, s) in layers.iter_mut().enumerate() {
            let mut ids: Vec<usize> = t.ids(pos, l).iter().map(|&e| e as usize).collect();
            ids.sort_unstable();
            ids.dedup();
            s.acquire(&ids).unwrap();
            s.wait().unwrap();
            s.release(&ids);
        }
    }
    let (h, m) = layers.iter().fold((0u64, 0u64), |(h, m), s| {
        let st = s.stats();
        (h + st.hits, m + st.misses)
    });
    h as f64 / (h + m) as f64
}

/// The traces' README, LFU row, in percent.
const GEMMA_LFU: [(usize, f64); 4] = [(8, 15.1), (16, 33.4), (32, 55.1), (64, 82.2)];
const QWEN_LFU: [(usize, f64); 4] = [(8, 10.4), (16, 23.7), (32, 40.9), (64, 64.4)];
/// Percentage points: the README rounds to 0.1, and its simulator may break exact ties between
/// equal (use count, last use) pairs differently.
const TOLERANCE_PP: f64 = 1.0;

fn check(name: &str, experts: usize, want: &[(usize, f64)]) {
    let t = trace(name);
    assert!(
        (t.max_id() as usize) < experts,
        "{name}: ids within {experts} experts"
    );
    for &(slots, pct) in want {
        let got = 100.0 * replay(&t, experts, slots);
        eprintln!("{name}: {slots} slots: LFU hit rate {got:.2}% (README {pct}%)");
        assert!(
            (got - pct).abs() <= TOLERANCE_PP,
            "{name} at {slots} slots: {got:.2}% hits, the trace's README says {pct}%"
        );
    }
}

#[test]
fn lfu_hit_rates_on_the_gemma_trace_match_its_readme() {
    check("gemma4-26b-a4b-routing.npy", 128, &GEMMA_LFU);
}

#[test]
fn lfu_hit_rates_on_the_qwen_trace_match_its_readme() {
    check("qwen3_6-35b-a3b-routing.npy", 256, &QWEN_LFU);
}
