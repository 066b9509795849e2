//! `--expert-cache-slots auto`: size the expert slot cache to the memory this process may use
//! (issue "bounded memory", item 2), so that under a cap the slots hold the hot experts and the
//! page cache holds no second copy of what they read.

use crate::CacheSlots;

/// What the auto sizing is given, in bytes (and counts).
#[derive(Clone, Copy, Debug)]
pub struct SizingInput {
    /// The memory this process may use (the tighter of the cgroup limit and MemAvailable).
    pub limit: u64,
    /// `model_weights.bin` (mapped; its pages count against the same limit).
    pub resident_weights: u64,
    /// KV cache at the requested context, plus recurrent state.
    pub kv: u64,
    /// Activations, logits and I/O buffers.
    pub scratch: u64,
    /// All layer files together.
    pub expert_files: u64,
    /// MoE layers (layers with an expert file).
    pub moe_layers: u64,
    /// Bytes of one expert slot (the install's expert stride).
    pub stride: u64,
    pub experts_per_layer: usize,
    /// Experts one token routes to per layer: the cache never has fewer than 2x this.
    pub top_k: usize,
}

/// The choice and the numbers behind it (for the load line).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizing {
    pub slots: CacheSlots,
    /// O_DIRECT reads: the slots are the only copy (chosen when the cache is smaller than the
    /// expert files, so the page cache would otherwise hold a second copy).
    pub direct_io: bool,
    /// Bytes left for expert slots after weights, KV and scratch.
    pub budget: u64,
}

/// `resident` (layer files mapped, the page cache their only copy) when the expert files fit in
/// 80% of what is left after weights, KV and scratch; otherwise as many slots per layer as that
/// budget holds (at least `2 x top_k`, at most every expert), read with O_DIRECT.
pub fn auto_slots(i: &SizingInput) -> Sizing {
    let budget = i
        .limit
        .saturating_sub(i.resident_weights)
        .saturating_sub(i.kv)
        .saturating_sub(i.scratch);
    if i.moe_layers == 0 || i.expert_files.saturating_mul(5) <= budget.saturating_mul(4) {
        return Sizing {
            slots: CacheSlots::Resident,
            direct_io: false,
            budget,
        };
    }
    let per_layer = budget / (i.moe_layers * i.stride.max(1));
    let floor = 2 * i.top_k.max(1);
    let n = (per_layer as usize).clamp(floor, i.experts_per_layer.max(floor));
    Sizing {
        slots: CacheSlots::Fixed(n),
        direct_io: true,
        budget,
    }
}

/// Bytes a memory cgroup still has room for: `limit - (usage - file cache)`. The cgroup's usage
/// counts the page cache charged to it (v1 `memory.usage_in_bytes`, v2 `memory.current`), which
/// the kernel reclaims under the limit; counting it as used would size the slots to whatever an
/// earlier process left cached (the weights' own pages would be subtracted twice). `memory_stat` is
/// the cgroup's `memory.stat`: the file cache is `total_active_file + total_inactive_file` (v1,
/// hierarchical) or `active_file + inactive_file` (v1 local, v2); without them nothing is excused.
pub fn cgroup_headroom(limit: u64, usage: u64, memory_stat: &str) -> u64 {
    let field = |k: &str| -> Option<u64> {
        memory_stat.lines().find_map(|l| {
            let (key, v) = l.split_once(' ')?;
            (key == k).then(|| v.trim().parse().ok())?
        })
    };
    let file = match (field("total_active_file"), field("total_inactive_file")) {
        (Some(a), Some(i)) => a + i,
        _ => field("active_file").unwrap_or(0) + field("inactive_file").unwrap_or(0),
    };
    limit.saturating_sub(usage.saturating_sub(file))
}

/// Bytes this process can use and where that number comes from: MemAvailable, lowered to the
/// memory cgroup's limit minus its usage when one is set (cgroup v1 `memory.limit_in_bytes` or v2
/// `memory.max`), the page cache charged to the cgroup not counted as used
/// ([`cgroup_headroom`]).
pub fn usable_memory() -> (u64, &'static str) {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail = meminfo
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024);
    let read = |p: String| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut limit = u64::MAX;
    let mut from = "MemAvailable";
    // A cgroup's room: its limit file less its usage file, under `base`.
    let mut consider = |base: String, files: [&str; 2], name: &'static str| {
        if let (Some(l), Some(u)) = (
            read(format!("{base}/{}", files[0])),
            read(format!("{base}/{}", files[1])),
        ) {
            let stat = std::fs::read_to_string(format!("{base}/memory.stat")).unwrap_or_default();
            let room = cgroup_headroom(l, u, &stat);
            if room < limit {
                limit = room;
                from = name;
            }
        }
    };
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (
            parts.next(),
            parts.next().unwrap_or(""),
            parts.next().unwrap_or(""),
        );
        if controllers.split(',').any(|c| c == "memory") {
            consider(
                format!("/sys/fs/cgroup/memory{path}"),
                ["memory.limit_in_bytes", "memory.usage_in_bytes"],
                "cgroup v1 memory.limit_in_bytes",
            );
        } else if controllers.is_empty() {
            consider(
                format!("/sys/fs/cgroup{path}"),
                ["memory.max", "memory.current"],
                "cgroup v2 memory.max",
            );
        }
    }
    if avail <= limit {
        (avail, "MemAvailable")
    } else {
        (limit, from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_headroom_excuses_the_reclaimable_file_cache() {
        let gib = 1u64 << 30;
        // v1: 8 GiB limit, 3 GiB used of which 2.5 GiB page cache (an earlier run's weights).
        let v1 = format!(
            "cache {}\nrss {}\nactive_file {}\ninactive_file {}\ntotal_active_file {}\ntotal_inactive_file {}\n",
            5 * gib / 2, gib / 2, gib, gib, gib, 3 * gib / 2
        );
        assert_eq!(cgroup_headroom(8 * gib, 3 * gib, &v1), 15 * gib / 2);
        // v2 keys; anonymous memory still counts.
        let v2 = format!(
            "anon {}\nfile {}\nactive_file {}\ninactive_file {}\n",
            gib,
            gib,
            gib / 4,
            3 * gib / 4
        );
        assert_eq!(cgroup_headroom(4 * gib, 2 * gib, &v2), 3 * gib);
        // No file counters: all of the usage counts; a usage above the limit leaves nothing.
        assert_eq!(cgroup_headroom(4 * gib, gib, ""), 3 * gib);
        assert_eq!(cgroup_headroom(gib, 2 * gib, "total_active_file 1\n"), 0);
    }

    const GIB: u64 = 1 << 30;

    /// The full-size Gemma 26B install: 1.35 GB weights, 30 MoE layers of 128 experts at a
    /// 3,358,720-byte stride (12.9 GB of expert files), top-8.
    fn gemma(limit: u64) -> SizingInput {
        SizingInput {
            limit,
            resident_weights: 1_353_771_068,
            kv: 200 << 20,
            scratch: 256 << 20,
            expert_files: 30 * 128 * 3_358_720,
            moe_layers: 30,
            stride: 3_358_720,
            experts_per_layer: 128,
            top_k: 8,
        }
    }

    #[test]
    fn everything_fits_so_the_files_are_mapped() {
        let s = auto_slots(&gemma(32 * GIB));
        assert_eq!(s.slots, CacheSlots::Resident);
        assert!(!s.direct_io);
    }

    #[test]
    fn under_a_cap_the_slots_use_the_budget_and_read_around_the_page_cache() {
        // 8 GiB: (8 GiB - weights - KV - scratch) / (30 x stride) = 67 slots per layer.
        let s = auto_slots(&gemma(8 * GIB));
        let CacheSlots::Fixed(n) = s.slots else {
            panic!("{s:?}")
        };
        assert_eq!(n as u64, s.budget / (30 * 3_358_720));
        assert!((64..=70).contains(&n), "{n}");
        assert!(s.direct_io);
        assert!(n as u64 * 30 * 3_358_720 <= s.budget);
        // 4 GiB: fewer slots, still at least 2 x top-k; 1 GiB: the floor.
        let CacheSlots::Fixed(m) = auto_slots(&gemma(4 * GIB)).slots else {
            panic!()
        };
        assert!(m < n && m >= 16, "{m}");
        assert_eq!(auto_slots(&gemma(GIB)).slots, CacheSlots::Fixed(16));
    }
}
