//! Expert-cache policies A/B on the recorded routing traces (issue 15 item 3): hit rate and bytes
//! read per token of every `--expert-cache-policy` (per-layer LFU, per-layer LRU, one LFU pool of
//! every layer's slots) at the same total slots. The replay runs the runtime's own streamers
//! ([`CachePlan::replay`]) over a small scratch layer file; bytes per token are the misses times
//! the full-size stride given. Deterministic: no timing, so no read-wait.
//!
//!     cargo run --release -p mference-runtime --example policy_ab -- \
//!         assets/traces/gemma4-26b-a4b-routing.npy 128 3358720

use std::io::Write;
use std::path::PathBuf;

use mference_runtime::streamer::IoPool;
use mference_runtime::{CachePlan, CacheSlots, ExpertPolicy, RoutingTrace};

/// Bytes per expert in the scratch layer file (the policy never looks at them).
const SCRATCH_STRIDE: u64 = 4096;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: policy_ab TRACE.npy EXPERTS_PER_LAYER EXPERT_STRIDE_BYTES");
        std::process::exit(2);
    }
    let fail = |e: String| -> ! {
        eprintln!("{e}");
        std::process::exit(1)
    };
    let t = RoutingTrace::open(&PathBuf::from(&args[1])).unwrap_or_else(|e| fail(e.to_string()));
    let experts: usize = args[2]
        .parse()
        .unwrap_or_else(|_| fail("EXPERTS_PER_LAYER: a count".into()));
    let stride: f64 = args[3]
        .parse()
        .unwrap_or_else(|_| fail("EXPERT_STRIDE_BYTES: a byte count".into()));
    if t.max_id() as usize >= experts {
        fail(format!(
            "the trace names expert {}, beyond {experts} experts",
            t.max_id()
        ));
    }
    let dir = std::env::temp_dir().join(format!("policy_ab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| fail(e.to_string()));
    let file = dir.join("layer.bin");
    std::fs::File::create(&file)
        .and_then(|mut f| f.write_all(&vec![0u8; experts * SCRATCH_STRIDE as usize]))
        .unwrap_or_else(|e| fail(e.to_string()));
    println!(
        "{}: {} tokens x {} layers x top-{}; hit % and MiB read per token",
        args[1], t.tokens, t.layers, t.top_k
    );
    let names: Vec<&str> = ExpertPolicy::ALL.iter().map(|p| p.name()).collect();
    println!("slots/layer | {}", names.join(" | "));
    let io = IoPool::new(2);
    for slots in [8usize, 16, 22, 24, 32, 64] {
        let cells: Vec<String> = ExpertPolicy::ALL
            .iter()
            .map(|&policy| {
                let plan = CachePlan::new(
                    policy,
                    CacheSlots::Fixed(slots),
                    experts,
                    SCRATCH_STRIDE,
                    t.layers,
                    t.layers,
                )
                .and_then(|p| p.replay(&t, &file, io.clone()))
                .unwrap_or_else(|e| fail(e.to_string()));
                let (h, m) = plan
                    .iter()
                    .fold((0u64, 0u64), |(h, m), s| (h + s.hits, m + s.misses));
                let hit = 100.0 * h as f64 / (h + m) as f64;
                let mib = m as f64 * stride / t.tokens as f64 / (1u64 << 20) as f64;
                format!("{hit:5.1}% {mib:7.1}")
            })
            .collect();
        println!("{slots:11} | {}", cells.join(" | "));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
