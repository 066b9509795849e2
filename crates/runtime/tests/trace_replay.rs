//! The expert cache's policies replayed over the recorded routing traces (`assets/traces/`),
//! token by token, through the real `ExpertStreamer`s of a `CachePlan` over a small layer file:
//! per-layer LFU hit rates per slot count against the ones the traces' README states (computed by
//! the traces' authors, not by this code), and every policy (lfu, lru, pool) against a
//! brute-force reference written here, exact miss counts, on a synthetic sequence and on the
//! traces. A policy change shows up here without a large checkpoint.

use std::io::Write;
use std::path::PathBuf;

use mference_runtime::streamer::IoPool;
use mference_runtime::{CachePlan, CacheSlots, ExpertPolicy, RoutingTrace};

fn trace(name: &str) -> RoutingTrace {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../assets/traces")
        .join(name);
    RoutingTrace::open(&p).expect("the bundled routing trace")
}

/// A layer file of `experts` blobs of `STRIDE` bytes (the bytes do not matter to the policy).
const STRIDE: u64 = 4096;

fn layer_file(dir: &tempfile::TempDir, experts: usize) -> PathBuf {
    let path = dir.path().join(format!("layer-{experts}.bin"));
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&vec![7u8; experts * STRIDE as usize]).unwrap();
    path
}

/// Hits and misses of the runtime's streamers under `policy` (decode-style replay through
/// [`CachePlan::replay`], the code `mference` runs).
fn replay_policy(
    t: &RoutingTrace,
    experts: usize,
    slots: usize,
    policy: ExpertPolicy,
) -> (u64, u64) {
    let dir = tempfile::tempdir().unwrap();
    let path = layer_file(&dir, experts);
    let plan = CachePlan::new(
        policy,
        CacheSlots::Fixed(slots),
        experts,
        STRIDE,
        t.layers,
        t.layers,
    )
    .unwrap();
    let stats = plan.replay(t, &path, IoPool::new(2)).unwrap();
    stats
        .iter()
        .fold((0, 0), |(h, m), s| (h + s.hits, m + s.misses))
}

/// Decode-style replay, LFU per layer: the hit rate over every lookup.
fn replay(t: &RoutingTrace, experts: usize, slots: usize) -> f64 {
    let (h, m) = replay_policy(t, experts, slots, ExpertPolicy::Lfu);
    h as f64 / (h + m) as f64
}

/// The brute-force reference the policies are checked against: a list of slots per cache, a
/// linear scan for every lookup and every victim. Per request (one layer's distinct experts):
/// every expert's use is counted at a new time step; a miss takes the lowest free slot, else the
/// slot of an expert outside this request with the smallest (uses, last use) (`lfu`, `pool`) or
/// last use (`lru`), the lowest slot among equals. `pool` is one cache of `slots × layers` slots
/// over (layer, expert) keys; the others are one cache of `slots` per layer.
fn reference_misses(
    requests: &[(usize, Vec<usize>)],
    layers: usize,
    slots: usize,
    policy: ExpertPolicy,
) -> u64 {
    let pooled = policy == ExpertPolicy::Pool;
    let caches = if pooled { 1 } else { layers };
    let size = if pooled { slots * layers } else { slots };
    let mut held: Vec<Vec<Option<(usize, usize)>>> = vec![vec![None; size]; caches];
    let mut uses: std::collections::HashMap<(usize, usize), (u64, u64)> = Default::default();
    let mut now = 0u64;
    let mut misses = 0;
    for (layer, ids) in requests {
        now += 1;
        let cache = &mut held[if pooled { 0 } else { *layer }];
        for &e in ids {
            let u = uses.entry((*layer, e)).or_default();
            u.0 += 1;
            u.1 = now;
        }
        for &e in ids {
            let key = (*layer, e);
            if cache.contains(&Some(key)) {
                continue;
            }
            misses += 1;
            let slot = match cache.iter().position(Option::is_none) {
                Some(free) => free,
                None => {
                    let mut best: Option<(usize, (u64, u64))> = None;
                    for (i, k) in cache.iter().enumerate() {
                        let k = k.expect("no free slot");
                        if k.0 == *layer && ids.contains(&k.1) {
                            continue; // pinned by this request
                        }
                        let (n, last) = uses[&k];
                        let rank = if policy == ExpertPolicy::Lru {
                            (0, last)
                        } else {
                            (n, last)
                        };
                        if best.is_none_or(|(_, r)| rank < r) {
                            best = Some((i, rank));
                        }
                    }
                    best.expect("a request fits the slots").0
                }
            };
            cache[slot] = Some(key);
        }
    }
    misses
}

/// The first `tokens` positions of `t` as (layer, sorted distinct experts) requests.
fn requests(t: &RoutingTrace, tokens: usize) -> Vec<(usize, Vec<usize>)> {
    let mut out = Vec::new();
    for pos in 0..tokens {
        for l in 0..t.layers {
            let mut ids: Vec<usize> = t.ids(pos, l).iter().map(|&e| e as usize).collect();
            ids.sort_unstable();
            ids.dedup();
            out.push((l, ids));
        }
    }
    out
}

/// Every policy against the brute-force reference on a small skewed request sequence (3 layers of
/// 12 experts, top-3, 4 slots per layer: layer 0 hot and wide, layer 2 nearly fixed, so the pool
/// moves slots between layers), exact miss counts.
#[test]
fn every_policy_matches_the_brute_force_reference_on_a_synthetic_sequence() {
    let (layers, top_k, experts, slots) = (3, 3, 12, 4);
    let mut rng = 0x5EEDu64;
    let mut next = |n: u64| {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (rng >> 33) % n
    };
    let mut ids = Vec::new();
    for _ in 0..400 {
        for l in 0..layers {
            let spread = [12, 6, 4][l];
            let mut row: Vec<u8> = Vec::new();
            while row.len() < top_k {
                // Skewed: low ids more often.
                let e = (next(spread) * next(spread + 1) / spread) as u8;
                if !row.contains(&e) {
                    row.push(e);
                }
            }
            ids.extend(row);
        }
    }
    let t = RoutingTrace::from_ids(ids, 400, layers, top_k).unwrap();
    let reqs = requests(&t, t.tokens);
    let mut seen = Vec::new();
    for policy in ExpertPolicy::ALL {
        let want = reference_misses(&reqs, layers, slots, policy);
        let (h, m) = replay_policy(&t, experts, slots, policy);
        assert_eq!(h + m, reqs.iter().map(|(_, r)| r.len() as u64).sum::<u64>());
        assert_eq!(
            m,
            want,
            "policy {}: {m} misses, the reference {want}",
            policy.name()
        );
        seen.push(m);
    }
    assert!(
        seen[0] != seen[1] && seen[0] != seen[2],
        "the sequence must tell the policies apart: misses {seen:?}"
    );
}

/// Every policy against the brute-force reference on the first 1,500 tokens of each trace, at 8
/// and 32 slots per layer: exact miss counts.
#[test]
fn every_policy_matches_the_brute_force_reference_on_the_traces() {
    for (name, experts) in [
        ("gemma4-26b-a4b-routing.npy", 128),
        ("qwen3_6-35b-a3b-routing.npy", 256),
    ] {
        let full = trace(name);
        let reqs = requests(&full, 1500);
        // The first 1,500 tokens as a trace of their own (rows sorted, as the replay sorts them).
        let ids: Vec<u8> = reqs
            .iter()
            .flat_map(|(_, r)| r.iter().map(|&e| e as u8))
            .collect();
        let t = RoutingTrace::from_ids(ids, 1500, full.layers, full.top_k).unwrap();
        for slots in [8, 32] {
            for policy in ExpertPolicy::ALL {
                let want = reference_misses(&reqs, t.layers, slots, policy);
                let (h, m) = replay_policy(&t, experts, slots, policy);
                eprintln!(
                    "{name}, 1500 tokens, {slots} slots, {}: hit rate {:.2}%",
                    policy.name(),
                    100.0 * h as f64 / (h + m) as f64
                );
                assert_eq!(
                    m,
                    want,
                    "{name} at {slots} slots, policy {}: {m} misses, the reference {want}",
                    policy.name()
                );
            }
        }
    }
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
