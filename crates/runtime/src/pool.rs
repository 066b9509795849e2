//! Where each MoE layer's expert slots come from, by policy (`--expert-cache-policy`):
//!
//! - `lfu` (default): every layer owns `N` slots in its own slab, evicting by LFU (use count over
//!   the session, least recent among equals).
//! - `lru`: the same per-layer slots, evicting the least recently used expert.
//! - `pool`: one slab of `N × layers` slots shared by every layer, one LFU table over
//!   (layer, expert): a layer whose experts are used more keeps more slots, taken from the colder
//!   layers. Only the slots of the request being served (one layer's tile, or a token's top-k) and
//!   of speculative reads in flight are pinned, so a request fits whenever it fits the
//!   per-layer budget `N`; an oversized one is refused with an error, never waited on.
//!
//! The policy decides only which bytes stay cached, never the arithmetic: outputs are the same
//! under every policy. The simulator (`examples/policy_ab.rs`) and the trace test
//! (`tests/trace_replay.rs`) drive these same types.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::slab::Slab;
use crate::slots::{Eviction, SlotTable};
use crate::streamer::{CacheSlots, ExpertStreamer, IoPool};
use crate::RuntimeError;

/// The host expert-cache policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertPolicy {
    /// Per-layer slots, LFU with recency tie-break.
    #[default]
    Lfu,
    /// Per-layer slots, least recently used.
    Lru,
    /// One LFU pool of every layer's slots.
    Pool,
}

impl ExpertPolicy {
    /// Every policy, in the order the A/B reports them.
    pub const ALL: [Self; 3] = [Self::Lfu, Self::Lru, Self::Pool];

    /// Parses `lfu|lru|pool`.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                format!("invalid expert cache policy '{s}': allowed values are lfu, lru, pool")
            })
    }

    /// The name `parse` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Lfu => "lfu",
            Self::Lru => "lru",
            Self::Pool => "pool",
        }
    }
}

/// Per-slot state of a [`SlotPool`], behind its lock.
#[derive(Debug)]
pub(crate) struct PoolState {
    /// Which slot holds which key (`first_key + expert` of a layer) and the policy's counters.
    pub table: SlotTable,
    /// slot → a speculative read is landing there: neither handed out nor reused until settled.
    pub landing: Vec<bool>,
    /// slot → holds a prefetched expert no request has used yet.
    pub prefetched: Vec<bool>,
}

impl PoolState {
    /// The slot to fill next ([`SlotTable::victim`]), never one a speculative read lands in.
    pub fn victim(&self) -> Option<usize> {
        self.table.victim(|s| !self.landing[s])
    }

    /// Slots a request may take now: neither pinned nor landing.
    pub fn usable(&self) -> usize {
        (0..self.table.slots())
            .filter(|&i| !self.table.is_pinned(i) && !self.landing[i])
            .count()
    }
}

/// Slots of `stride` bytes in one 2 MiB-aligned slab, and the table that assigns them: owned by
/// one layer's streamer, or shared by every layer (`pool`).
pub struct SlotPool {
    slab: Slab,
    /// Address of the slab's first byte (reads land through it from the I/O threads).
    base: usize,
    stride: usize,
    state: Mutex<PoolState>,
}

impl std::fmt::Debug for SlotPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotPool")
            .field("slots", &(self.slab.len() / self.stride.max(1)))
            .field("stride", &self.stride)
            .finish()
    }
}

impl SlotPool {
    /// `slots` slots of `stride` bytes for `keys` distinct keys (`slab_slots` of them backed by
    /// slab memory: 0 when the layer file is mapped instead).
    ///
    /// Errors: [`RuntimeError::Slab`] when the slab cannot be mapped; [`RuntimeError::Invalid`]
    /// for more slots than the table can name.
    pub fn new(
        keys: usize,
        slots: usize,
        slab_slots: usize,
        stride: usize,
        eviction: Eviction,
    ) -> Result<Self, RuntimeError> {
        if slots > i32::MAX as usize || keys > i32::MAX as usize {
            return Err(RuntimeError::Invalid(format!(
                "{slots} slots for {keys} experts exceed the slot table"
            )));
        }
        let mut slab = Slab::new(slab_slots * stride)?;
        let base = slab.as_mut_ptr() as usize;
        Ok(Self {
            slab,
            base,
            stride,
            state: Mutex::new(PoolState {
                table: SlotTable::with_eviction(keys, slots, eviction),
                landing: vec![false; slots],
                prefetched: vec![false; slots],
            }),
        })
    }

    /// The slot table and per-slot flags.
    pub(crate) fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.lock().table.slots()
    }

    /// The slab (every slot's bytes).
    pub fn bytes(&self) -> &[u8] {
        self.slab.bytes()
    }

    /// The bytes of `slot`.
    pub fn slot(&self, slot: usize) -> &[u8] {
        &self.slab.bytes()[slot * self.stride..(slot + 1) * self.stride]
    }

    /// Address of the first byte of `slot` (the destination of a read).
    pub(crate) fn slot_addr(&self, slot: usize) -> usize {
        self.base + slot * self.stride
    }
}

/// Opens every MoE layer's streamer under one policy: the same slots per layer on average, either
/// per layer or pooled (module docs).
pub struct CachePlan {
    policy: ExpertPolicy,
    slots: CacheSlots,
    experts: usize,
    stride: u64,
    /// `pool`: the shared slots; layer `l`'s experts are keys `l × experts ..`.
    shared: Option<Arc<SlotPool>>,
}

impl CachePlan {
    /// A plan for `layers` MoE layers (layer indices below `max_layer`) of `experts` experts of
    /// `stride` bytes, `slots` per layer. The pool's slab (`slots × layers` slots) is mapped here,
    /// committed by the kernel only as slots fill.
    ///
    /// Errors: a slab that cannot be mapped. `pool` with `resident` needs no sharing (every
    /// expert has its own slot): the layers then keep their own, as under `lfu`.
    pub fn new(
        policy: ExpertPolicy,
        slots: CacheSlots,
        experts: usize,
        stride: u64,
        layers: usize,
        max_layer: usize,
    ) -> Result<Self, RuntimeError> {
        let shared = match (policy, slots) {
            (ExpertPolicy::Pool, CacheSlots::Fixed(_)) => {
                let total = slots.count(experts) * layers;
                let pool = SlotPool::new(
                    experts * max_layer.max(1),
                    total,
                    total,
                    stride as usize,
                    Eviction::Lfu,
                )?;
                Some(Arc::new(pool))
            }
            _ => None,
        };
        Ok(Self {
            policy,
            slots,
            experts,
            stride,
            shared,
        })
    }

    /// The policy the plan applies.
    pub fn policy(&self) -> ExpertPolicy {
        self.policy
    }

    /// Opens MoE layer `layer`'s file `path` (`experts × stride` bytes).
    ///
    /// Errors: as [`ExpertStreamer::open`].
    pub fn open(
        &self,
        layer: usize,
        path: &Path,
        direct_io: bool,
        io: Arc<IoPool>,
    ) -> Result<ExpertStreamer, RuntimeError> {
        let (e, stride) = (self.experts, self.stride);
        let s = match &self.shared {
            Some(pool) => {
                let share = self.slots.count(e);
                ExpertStreamer::open_shared(path, e, stride, direct_io, io, pool, layer * e, share)
            }
            None => {
                let eviction = match self.policy {
                    ExpertPolicy::Lru => Eviction::Lru,
                    _ => Eviction::Lfu,
                };
                ExpertStreamer::open_with(path, e, stride, self.slots, eviction, direct_io, io)
            }
        }?;
        Ok(s.for_layer(layer))
    }

    /// Replays `trace` decode-style through one streamer per layer opened by this plan, all over
    /// `layer_file` (any file of `experts × stride` bytes: the bytes do not matter here): per
    /// token and layer, acquire the sorted distinct experts, wait, release. Returns each layer's
    /// counters. This is the simulator of `examples/policy_ab.rs` and `tests/trace_replay.rs`:
    /// the same code the runtime runs, only the file is small.
    ///
    /// Errors: a layer file that does not fit the plan, a failed read, an oversized request.
    pub fn replay(
        &self,
        trace: &crate::RoutingTrace,
        layer_file: &Path,
        io: Arc<IoPool>,
    ) -> Result<Vec<crate::StreamerStats>, RuntimeError> {
        let mut layers = (0..trace.layers)
            .map(|l| self.open(l, layer_file, false, Arc::clone(&io)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ids = Vec::with_capacity(trace.top_k);
        for pos in 0..trace.tokens {
            for (l, s) in layers.iter_mut().enumerate() {
                ids.clear();
                ids.extend(trace.ids(pos, l).iter().map(|&e| e as usize));
                ids.sort_unstable();
                ids.dedup();
                s.acquire(&ids)?;
                s.wait()?;
                s.release(&ids);
            }
        }
        Ok(layers.iter().map(|s| s.stats()).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A layer file of `experts` blobs of 4096 bytes, blob `e` filled with byte `e`.
    fn layer_file(experts: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        for e in 0..experts {
            f.write_all(&[e as u8; 4096]).unwrap();
        }
        f.flush().unwrap();
        f
    }

    #[test]
    fn policies_parse_by_name_and_refuse_others() {
        for p in ExpertPolicy::ALL {
            assert_eq!(ExpertPolicy::parse(p.name()), Ok(p));
        }
        let e = ExpertPolicy::parse("lfu2").unwrap_err();
        assert!(e.contains("lfu, lru, pool"), "{e}");
    }

    /// Two layers of 8 experts share a pool of 2 × 4 slots: a hot layer borrows the cold one's
    /// slots, the cold one takes them back when it needs them, every blob holds its expert's
    /// bytes, and a request larger than the unpinned slots is an error, not a wait.
    #[test]
    fn a_pool_lends_slots_across_layers_and_refuses_what_cannot_fit() {
        let f = layer_file(8);
        let plan = CachePlan::new(ExpertPolicy::Pool, CacheSlots::Fixed(4), 8, 4096, 2, 2).unwrap();
        let io = IoPool::new(2);
        let mut l0 = plan.open(0, f.path(), false, io.clone()).unwrap();
        let mut l1 = plan.open(1, f.path(), false, io).unwrap();
        assert_eq!((l0.slots(), l1.slots()), (4, 4));
        let check = |s: &ExpertStreamer, ids: &[usize], got: &[(usize, bool)]| {
            for (&e, &(slot, _)) in ids.iter().zip(got) {
                assert!(s.blob(slot).iter().all(|&b| b == e as u8), "expert {e}");
            }
        };
        // Layer 0 uses 6 distinct experts, two requests apart: more than its share of 4.
        for ids in [[0, 1, 2], [3, 4, 5]] {
            let got = l0.acquire(&ids).unwrap();
            l0.wait().unwrap();
            check(&l0, &ids, &got);
            l0.release(&ids);
        }
        let again = l0.acquire(&[0, 1, 2, 3, 4, 5]).unwrap();
        assert!(again.iter().all(|&(_, hit)| hit), "the six stayed cached");
        l0.wait().unwrap();
        // While they are pinned, layer 1 has the 2 slots left; 3 is an error.
        let err = l1.acquire(&[0, 1, 2]).unwrap_err();
        assert!(
            err.to_string().contains("exceeds the 2 unpinned slots"),
            "{err}"
        );
        l0.release(&[0, 1, 2, 3, 4, 5]);
        // Released, they can be taken back: layer 1's experts evict layer 0's coldest.
        let ids = [5, 6, 7];
        let got = l1.acquire(&ids).unwrap();
        l1.wait().unwrap();
        check(&l1, &ids, &got);
        l1.release(&ids);
        assert_eq!(l1.stats().misses, 3);
        let got = l0.acquire(&[4]).unwrap();
        l0.wait().unwrap();
        check(&l0, &[4], &got);
        assert_eq!(
            l0.stats().hits,
            7,
            "6 hits, then layer 0's expert 4 survived"
        );
    }
}
