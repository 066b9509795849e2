//! Expert-cache policies A/B on the recorded routing traces (issue 15 item 3): hit rate and bytes
//! read per token of per-layer LFU (today's policy, `SlotTable`), per-layer LRU, and one global LFU
//! pool shared by every layer (hot layers take slots from cold ones), at the same total slots.
//! Decode-style replay: each token's experts per layer are requested together (pinned while
//! placed), as `ExpertStreamer::acquire` does. Deterministic: no timing.
//!
//!     cargo run --release -p mference-runtime --example policy_ab -- \
//!         assets/traces/gemma4-26b-a4b-routing.npy 128 3358720

use std::path::PathBuf;

use mference_runtime::{RoutingTrace, SlotTable};

/// A cache of `slots` slots per table; `touch` per request, `place` per miss.
trait Policy {
    /// Returns the number of misses of one request of distinct `ids` in `table`.
    fn request(&mut self, table: usize, ids: &[usize]) -> usize;
}

/// `SlotTable` per layer (or one for all): LFU, least recent among equals.
struct Lfu(Vec<SlotTable>, usize);

impl Policy for Lfu {
    fn request(&mut self, table: usize, ids: &[usize]) -> usize {
        let (t, base) = if self.0.len() == 1 {
            (&mut self.0[0], table * self.1)
        } else {
            (&mut self.0[table], 0)
        };
        t.tick();
        let keys: Vec<usize> = ids.iter().map(|&e| base + e).collect();
        for &k in &keys {
            t.touch(k);
            if let Some(s) = t.slot_of(k) {
                t.set_pinned(s, true);
            }
        }
        let mut misses = 0;
        for &k in &keys {
            if t.slot_of(k).is_none() {
                let s = t.victim(|_| true).expect("a request fits the slots");
                t.assign(s, k);
                t.set_pinned(s, true);
                misses += 1;
            }
        }
        for &k in &keys {
            if let Some(s) = t.slot_of(k) {
                t.set_pinned(s, false);
            }
        }
        misses
    }
}

/// Per-layer LRU: the least recently used expert leaves.
struct Lru {
    /// Per layer: (expert, last use) of the cached experts.
    held: Vec<Vec<(usize, u64)>>,
    slots: usize,
    clock: u64,
}

impl Policy for Lru {
    fn request(&mut self, table: usize, ids: &[usize]) -> usize {
        self.clock += 1;
        let now = self.clock;
        let held = &mut self.held[table];
        let mut misses = 0;
        for &e in ids {
            match held.iter_mut().find(|(x, _)| *x == e) {
                Some(h) => h.1 = now,
                None => {
                    misses += 1;
                    if held.len() < self.slots {
                        held.push((e, now));
                    } else {
                        // Never evict an expert of this same request (they carry `now`).
                        let v = held
                            .iter_mut()
                            .filter(|(_, t)| *t < now)
                            .min_by_key(|(_, t)| *t)
                            .expect("a request fits the slots");
                        *v = (e, now);
                    }
                }
            }
        }
        misses
    }
}

fn replay(t: &RoutingTrace, p: &mut dyn Policy) -> (u64, u64) {
    let (mut lookups, mut misses) = (0u64, 0u64);
    for pos in 0..t.tokens {
        for l in 0..t.layers {
            let mut ids: Vec<usize> = t.ids(pos, l).iter().map(|&e| e as usize).collect();
            ids.sort_unstable();
            ids.dedup();
            lookups += ids.len() as u64;
            misses += p.request(l, &ids) as u64;
        }
    }
    (lookups, misses)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: policy_ab TRACE.npy EXPERTS_PER_LAYER EXPERT_STRIDE_BYTES");
        std::process::exit(2);
    }
    let t = RoutingTrace::open(&PathBuf::from(&args[1])).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    let experts: usize = args[2].parse().expect("EXPERTS_PER_LAYER");
    let stride: f64 = args[3].parse().expect("EXPERT_STRIDE_BYTES");
    println!(
        "{}: {} tokens x {} layers x top-{}; hit % and MiB read per token",
        args[1], t.tokens, t.layers, t.top_k
    );
    println!("slots/layer | LFU per layer | LRU per layer | LFU global pool");
    for slots in [8usize, 16, 24, 32, 64] {
        let layers = t.layers;
        let mut runs: Vec<Box<dyn Policy>> = vec![
            Box::new(Lfu(
                (0..layers)
                    .map(|_| SlotTable::new(experts, slots))
                    .collect(),
                experts,
            )),
            Box::new(Lru {
                held: vec![Vec::new(); layers],
                slots,
                clock: 0,
            }),
            Box::new(Lfu(
                vec![SlotTable::new(experts * layers, slots * layers)],
                experts,
            )),
        ];
        let cells: Vec<String> = runs
            .iter_mut()
            .map(|p| {
                let (n, m) = replay(&t, p.as_mut());
                let hit = 100.0 * (n - m) as f64 / n as f64;
                let mib = m as f64 * stride / t.tokens as f64 / (1u64 << 20) as f64;
                format!("{hit:5.1}% {mib:7.1}")
            })
            .collect();
        println!("{slots:11} | {}", cells.join(" | "));
    }
}
