//! The cache a prefill leaves for decode, replayed over the recorded Gemma 4 routing trace
//! (`assets/traces/`) through the real `ExpertStreamer` and [`prefill_tiles`]: per layer, a
//! 512-row prefill (tiles acquired one ahead, as `moe::routed_experts` does), then decode token by
//! token. Checked against a brute-force count of the trace's rows: after the prefill, every
//! cached expert was routed to at least as many rows as any expert left out (the policy counts
//! rows, not tiles), and the decode's hit rate is at least what counting one use per tile in id
//! order (the earlier policy) gives.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use mference_backend::moe::{host_tile, prefill_tiles};
use mference_backend::Routes;
use mference_runtime::streamer::IoPool;
use mference_runtime::{CacheSlots, ExpertStreamer, RoutingTrace};

const EXPERTS: usize = 128;
const SLOTS: usize = 64;
const PROMPT: usize = 512;
const DECODE: usize = 31;

fn streamer(path: &std::path::Path, io: &std::sync::Arc<IoPool>) -> ExpertStreamer {
    ExpertStreamer::open(
        path,
        EXPERTS,
        4096,
        CacheSlots::Fixed(SLOTS),
        false,
        io.clone(),
    )
    .unwrap()
}

/// Prefill rows `start..start + PROMPT` of `layer`, then `DECODE` tokens; returns the streamer
/// after the prefill's tiles (for inspection) and the decode's hit rate. `by_rows`: today's
/// tiles; otherwise one use per tile in expert order.
fn replay(
    t: &RoutingTrace,
    layer: usize,
    start: usize,
    by_rows: bool,
    path: &std::path::Path,
) -> (Vec<bool>, f64) {
    let io = IoPool::new(2);
    let mut s = streamer(path, &io);
    let mut routes = Routes::default();
    for row in 0..PROMPT {
        for &e in t.ids(start + row, layer) {
            routes
                .experts
                .entry(e as usize)
                .or_default()
                .push((row, 1.0));
        }
    }
    let routed: Vec<usize> = routes.experts.keys().copied().collect();
    let tiles: Vec<(Vec<usize>, Vec<u64>)> = if by_rows {
        prefill_tiles(routed, &routes, host_tile(SLOTS))
    } else {
        routed
            .chunks(8)
            .map(|c| (c.to_vec(), vec![1; c.len()]))
            .collect()
    };
    s.acquire_uses(&tiles[0].0, &tiles[0].1).unwrap();
    for i in 0..tiles.len() {
        s.wait().unwrap();
        if let Some((next, uses)) = tiles.get(i + 1) {
            s.acquire_uses(next, uses).unwrap();
        }
        s.release(&tiles[i].0);
    }
    s.wait().unwrap();
    let cached: Vec<bool> = (0..EXPERTS).map(|e| s.cached(e)).collect();
    let before = s.stats();
    for pos in start + PROMPT..start + PROMPT + DECODE {
        let mut ids: Vec<usize> = t.ids(pos, layer).iter().map(|&e| e as usize).collect();
        ids.sort_unstable();
        ids.dedup();
        s.acquire(&ids).unwrap();
        s.wait().unwrap();
        s.release(&ids);
    }
    let after = s.stats();
    let hits = after.hits - before.hits;
    let lookups = hits + after.misses - before.misses;
    (cached, hits as f64 / lookups as f64)
}

#[test]
fn a_prefill_leaves_its_most_routed_experts_cached() {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/traces/gemma4-26b-a4b-routing.npy");
    let t = RoutingTrace::open(&p).expect("the bundled routing trace");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("layer.bin");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![7u8; EXPERTS * 4096]).unwrap();
    drop(f);
    let (mut new_hits, mut old_hits) = (0.0, 0.0);
    let starts = [0, 2048, 5120];
    for layer in 0..t.layers {
        for &start in &starts {
            let mut rows: BTreeMap<usize, usize> = BTreeMap::new();
            for row in start..start + PROMPT {
                for &e in t.ids(row, layer) {
                    *rows.entry(e as usize).or_default() += 1;
                }
            }
            let (cached, hit) = replay(&t, layer, start, true, &path);
            let count = |e: usize| rows.get(&e).copied().unwrap_or(0);
            let least_kept = (0..EXPERTS)
                .filter(|&e| cached[e])
                .map(count)
                .min()
                .unwrap();
            let most_left = (0..EXPERTS)
                .filter(|&e| !cached[e])
                .map(count)
                .max()
                .unwrap_or(0);
            assert!(
                least_kept >= most_left,
                "layer {layer}, rows {start}..: a cached expert has {least_kept} rows, one left out {most_left}"
            );
            new_hits += hit;
            old_hits += replay(&t, layer, start, false, &path).1;
        }
    }
    let n = (t.layers * starts.len()) as f64;
    let (new_hits, old_hits) = (100.0 * new_hits / n, 100.0 * old_hits / n);
    eprintln!("decode hit rate after a {PROMPT}-row prefill, {SLOTS} slots: {new_hits:.1}% (rows counted, most used last), {old_hits:.1}% (one use per tile, id order)");
    assert!(new_hits >= old_hits, "{new_hits:.1}% < {old_hits:.1}%");
}
