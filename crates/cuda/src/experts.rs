//! The GPU expert cache (issue 11): per MoE layer a slab of device slots holding expert blobs,
//! kept by the policy every tier shares (`mference_runtime::SlotTable`: LFU over the session,
//! the least recent among equals). Misses are copied in from the host streamer's slots (the
//! pinned host tier; below it the streamer's preads) on a copy stream of their own.
//!
//! Ordering across the two streams (implicit event tracking is off, so it is all here):
//! - a copy into slot `s` first waits, on the copy stream, for the event recorded after the last
//!   kernels that read `s`: no slot is refilled while a queued kernel still reads it;
//! - kernels that read `s` first wait, on the compute stream, for the event recorded after the
//!   copy into `s`;
//! - [`GpuExperts::copies_done`] blocks the host until the copies have left the host slots (DMA
//!   from page-locked memory runs after the call that queued it returns).
//!
//! Sizing happens on the first MoE step, after the weights and the KV cache are allocated, from
//! what the device has free then.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError};
use mference_backend::DeviceExpertStats;
use mference_runtime::SlotTable;

mod budget;
mod staging;

use budget::slots_for;
pub use budget::{auto_margin, ExpertCacheOptions, ExpertGeometry, GpuExpertBudget};
pub(crate) use staging::STAGED;
use staging::{staging_wanted, Staging};

/// Why a step of the expert cache failed: a driver call, or a refusal that says why.
pub(crate) enum CacheError {
    Driver(&'static str, DriverError),
    Refused(String),
}

/// Names the driver call `what` in its failure (as `lib.rs`'s `driver` does for start-up).
fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CacheError {
    move |e| CacheError::Driver(what, e)
}

/// One layer's device slots.
struct LayerSlots {
    slab: CudaSlice<u8>,
    table: SlotTable,
    /// Per slot: recorded on the copy stream after the copy into it.
    filled: Vec<CudaEvent>,
    /// Per slot: recorded on the compute stream after the kernels that read it.
    read: Vec<CudaEvent>,
    /// Once every expert of the layer is in a slot: each expert's slot address by expert id, on
    /// the device (kernels that read device-side ids). Nothing is copied into the layer again:
    /// every use is a hit.
    by_id: Option<CudaSlice<u64>>,
    /// Per slot: filled by a router lookahead copy ([`GpuExperts::prefetch`]) and not used yet.
    ahead: Vec<bool>,
}

/// A copy [`GpuExperts::copies_done`] waits for: into a slot (layer, slot) or a staging index.
enum Copy {
    Slot(usize, usize),
    Staged(usize),
}

/// Starts the copy of `blob` into slot `s` of `l` on `copy`, after the kernels that read the
/// slot last, and records `filled[s]` behind it.
fn copy_into_slot(
    copy: &Arc<CudaStream>,
    l: &LayerSlots,
    s: usize,
    blob: &[u8],
) -> Result<(), CacheError> {
    copy.wait(&l.read[s]).map_err(driver("cuStreamWaitEvent"))?;
    let (base, _sync) = l.slab.device_ptr(copy);
    // SAFETY: the destination lies in the slab (slot `s` of `blob.len()` = stride bytes, checked
    // by the callers); the source stays unchanged until `copies_done` has waited for this copy
    // (the callers' contract), and no kernel reads the slot before `filled[s]`.
    unsafe {
        cudarc::driver::result::memcpy_htod_async(
            base + (s * blob.len()) as u64,
            blob,
            copy.cu_stream(),
        )
    }
    .map_err(driver("cuMemcpyHtoDAsync (expert slot)"))?;
    l.filled[s].record(copy).map_err(driver("cuEventRecord"))
}

/// The cache state behind [`GpuExperts`]'s lock.
pub(crate) struct GpuExperts {
    opts: ExpertCacheOptions,
    copy: Arc<CudaStream>,
    layers: HashMap<usize, LayerSlots>,
    sized: bool,
    /// Copies started since the last [`copies_done`](Self::copies_done).
    in_flight: Vec<Copy>,
    /// The prefill staging area, when the slots hold less than a layer and it fits.
    staging: Option<Staging>,
    /// Host ranges page-locked by [`pin_host`](Self::pin_host), by layer.
    pinned: HashMap<usize, (usize, usize)>,
    stats: DeviceExpertStats,
}

impl GpuExperts {
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        opts: ExpertCacheOptions,
    ) -> Result<Self, DriverError> {
        Ok(Self {
            opts,
            copy: ctx.new_stream()?,
            layers: HashMap::new(),
            sized: false,
            in_flight: Vec::new(),
            staging: None,
            pinned: HashMap::new(),
            stats: DeviceExpertStats::default(),
        })
    }

    pub(crate) fn stats(&self) -> DeviceExpertStats {
        self.stats
    }

    /// Experts per MoE layer.
    pub(crate) fn experts(&self) -> usize {
        self.opts.geometry.experts
    }

    /// Bytes per slot.
    pub(crate) fn stride(&self) -> usize {
        self.opts.geometry.stride
    }

    /// Allocates every layer's slots, once (after the load, or on the first MoE step).
    pub(crate) fn ensure_sized(&mut self, compute: &Arc<CudaStream>) -> Result<(), CacheError> {
        if self.sized {
            return Ok(());
        }
        self.size(compute)
    }

    fn size(&mut self, compute: &Arc<CudaStream>) -> Result<(), CacheError> {
        let ctx = compute.context();
        let (free, total) = ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
        let g = self.opts.geometry.clone();
        let mut slots =
            slots_for(&g, self.opts.budget, free, total).map_err(CacheError::Refused)?;
        if self.opts.budget == GpuExpertBudget::Auto && slots < g.experts && staging_wanted() {
            // The automatic budget leaves room for the prefill staging area (one layer).
            let rest = free.saturating_sub(g.experts * g.stride);
            if let Ok(fewer) = slots_for(&g, self.opts.budget, rest, total) {
                slots = fewer;
            }
        }
        for &l in &g.layers {
            // SAFETY: a slot is read only after its copy (the `filled` event orders it).
            let slab = unsafe { compute.alloc::<u8>(slots * g.stride) }
                .map_err(driver("allocating the GPU expert slots"))?;
            let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            let mut filled = Vec::with_capacity(slots);
            let mut read = Vec::with_capacity(slots);
            for _ in 0..slots {
                filled.push(ctx.new_event(flags).map_err(driver("cuEventCreate"))?);
                read.push(ctx.new_event(flags).map_err(driver("cuEventCreate"))?);
            }
            self.layers.insert(
                l,
                LayerSlots {
                    slab,
                    table: SlotTable::new(g.experts, slots),
                    filled,
                    read,
                    by_id: None,
                    ahead: vec![false; slots],
                },
            );
        }
        // The allocations are ordered on the compute stream; the copy stream uses them next.
        compute
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        self.stats.slots_per_layer = slots;
        self.stats.slab_bytes = (slots * g.stride * g.layers.len()) as u64;
        self.sized = true;
        self.size_staging(compute, slots)
    }

    /// [`DeviceExpertOps::held_experts`](mference_backend::DeviceExpertOps::held_experts): counts a use of each
    /// expert and says which are in a device slot, pinning those slots until they are read.
    pub(crate) fn held(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
        experts: &[usize],
    ) -> Result<Vec<bool>, CacheError> {
        self.ensure_sized(compute)?;
        let force_miss = self.opts.force_miss;
        let Some(l) = self.layers.get_mut(&layer) else {
            return Err(CacheError::Refused(format!(
                "layer {layer} has no GPU expert slots (the install's expert layers are {:?})",
                self.opts.geometry.layers
            )));
        };
        l.table.tick();
        let mut out = Vec::with_capacity(experts.len());
        for &e in experts {
            if e >= l.table.experts() {
                return Err(CacheError::Refused(format!(
                    "expert {e} out of range ({} experts)",
                    l.table.experts()
                )));
            }
            l.table.touch(e);
            let slot = l.table.slot_of(e).filter(|_| !force_miss);
            if let Some(s) = slot {
                // Kept until the kernels reading it are queued (`after_read`): the copies of
                // the same step's misses must not evict it.
                l.table.set_pinned(s, true);
                self.stats.hits += 1;
                if std::mem::take(&mut l.ahead[s]) {
                    self.stats.prefetch_hits += 1;
                }
            }
            let hit = slot.is_some();
            out.push(hit);
        }
        Ok(out)
    }

    /// Starts the copy of `blob` (expert `e` of `layer`) into a slot; the blob must stay
    /// unchanged until [`copies_done`](Self::copies_done).
    pub(crate) fn load(&mut self, layer: usize, e: usize, blob: &[u8]) -> Result<(), CacheError> {
        let copy = Arc::clone(&self.copy);
        let stride = self.opts.geometry.stride;
        let l = self
            .layers
            .get_mut(&layer)
            .ok_or_else(|| CacheError::Refused(format!("layer {layer} has no GPU expert slots")))?;
        if blob.len() != stride {
            return Err(CacheError::Refused(format!(
                "an expert blob of {} bytes for {stride}-byte slots",
                blob.len()
            )));
        }
        if l.by_id.is_some() {
            return Err(CacheError::Refused(format!(
                "expert {e} of layer {layer}: the layer holds every expert, nothing is copied in"
            )));
        }
        if let Some(st) = self.staging.as_mut().filter(|st| st.layer == Some(layer)) {
            let n = st.at.len();
            let i = *st.at.entry(e).or_insert(n);
            if !st.waited {
                // The area's last layer's kernels are done with it before it is refilled.
                copy.wait(&st.read).map_err(driver("cuStreamWaitEvent"))?;
                st.waited = true;
            }
            let (base, _sync) = st.buf.device_ptr(&copy);
            // SAFETY: index i < experts lies in the area (`stride` bytes each, `blob.len()`
            // checked equal); the source stays unchanged until `copies_done` has waited for this
            // copy, and no kernel reads the index before `filled[i]`.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + (i * stride) as u64,
                    blob,
                    copy.cu_stream(),
                )
            }
            .map_err(driver("cuMemcpyHtoDAsync (prefill staging)"))?;
            st.filled[i]
                .record(&copy)
                .map_err(driver("cuEventRecord"))?;
            self.in_flight.push(Copy::Staged(i));
            self.stats.misses += 1;
            self.stats.h2d_bytes += stride as u64;
            return Ok(());
        }
        let s = match l.table.slot_of(e) {
            Some(s) => s, // forced miss: copy it again into its own slot
            None => {
                let s = l.table.victim(|_| true).ok_or_else(|| {
                    CacheError::Refused("every GPU expert slot is pinned".to_string())
                })?;
                l.table.assign(s, e);
                s
            }
        };
        // Not given up before the kernels reading it are queued (`after_read`): the experts of
        // one token may be copied in before any of them is computed.
        l.table.set_pinned(s, true);
        l.ahead[s] = false;
        copy_into_slot(&copy, l, s, blob)?;
        self.in_flight.push(Copy::Slot(layer, s));
        self.stats.misses += 1;
        self.stats.h2d_bytes += stride as u64;
        Ok(())
    }

    /// Router lookahead (issue 29 item 2): starts the copy of `blob` (expert `e` of `layer`,
    /// predicted for the next step of that layer) into a slot, unpinned, unless the layer holds
    /// it already or holds every expert, a prefill is staging (any layer), every use is a forced
    /// miss, or the eviction victim (never a slot an earlier guess filled and no step has used
    /// yet) has been used more often than `e` (a guess never evicts a hotter expert). The blob
    /// must stay unchanged until [`copies_done`](Self::copies_done). Returns whether a copy
    /// started. A use of the slot by a later step counts as a prefetch hit.
    pub(crate) fn prefetch(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
        e: usize,
        blob: &[u8],
    ) -> Result<bool, CacheError> {
        self.ensure_sized(compute)?;
        let stride = self.opts.geometry.stride;
        let staged = self.staging.as_ref().is_some_and(|st| st.layer.is_some());
        let Some(l) = self.layers.get_mut(&layer) else {
            return Ok(false);
        };
        if self.opts.force_miss
            || staged
            || blob.len() != stride
            || l.by_id.is_some()
            || e >= l.table.experts()
            || l.table.slot_of(e).is_some()
        {
            return Ok(false);
        }
        let Some(s) = l.table.victim(|s| !l.ahead[s]) else {
            return Ok(false);
        };
        if let Some(old) = l.table.expert_in(s) {
            if l.table.uses(old).0 > l.table.uses(e).0 {
                return Ok(false);
            }
        }
        l.table.assign(s, e);
        l.ahead[s] = true;
        copy_into_slot(&self.copy, l, s, blob)?;
        self.in_flight.push(Copy::Slot(layer, s));
        self.stats.prefetched += 1;
        self.stats.h2d_bytes += stride as u64;
        Ok(true)
    }

    /// The device address of expert `e` of `layer`, after making `compute` wait for its copy;
    /// `after` must be called once the kernels reading it are queued.
    pub(crate) fn slot_addr(
        &self,
        compute: &Arc<CudaStream>,
        layer: usize,
        e: usize,
    ) -> Result<(u64, usize), CacheError> {
        let l = self
            .layers
            .get(&layer)
            .ok_or_else(|| CacheError::Refused(format!("layer {layer} has no GPU expert slots")))?;
        if let Some(st) = self.staging.as_ref().filter(|st| st.layer == Some(layer)) {
            if let Some(&i) = st.at.get(&e) {
                compute
                    .wait(&st.filled[i])
                    .map_err(driver("cuStreamWaitEvent"))?;
                let (base, _sync) = st.buf.device_ptr(compute);
                return Ok((base + (i * self.opts.geometry.stride) as u64, STAGED));
            }
        }
        let s = l.table.slot_of(e).ok_or_else(|| {
            CacheError::Refused(format!("expert {e} of layer {layer} is not in a GPU slot"))
        })?;
        compute
            .wait(&l.filled[s])
            .map_err(driver("cuStreamWaitEvent"))?;
        let (base, _sync) = l.slab.device_ptr(compute);
        Ok((base + (s * self.opts.geometry.stride) as u64, s))
    }

    /// The device address of `layer`'s slot addresses by expert id (`u64` each) once every
    /// expert of the layer is in a slot, else `None` (always `None` with `force_miss`). The
    /// table is built once, the compute stream made to wait for every slot's copy first; from
    /// then on no copy goes into the layer ([`load`](Self::load) refuses), so kernels may read
    /// any slot without per-slot events.
    pub(crate) fn slots_by_id(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
    ) -> Result<Option<u64>, CacheError> {
        if self.opts.force_miss {
            return Ok(None);
        }
        self.ensure_sized(compute)?;
        let stride = self.opts.geometry.stride;
        let Some(l) = self.layers.get_mut(&layer) else {
            return Ok(None);
        };
        if l.by_id.is_none() {
            let mut slots = Vec::with_capacity(l.table.experts());
            for e in 0..l.table.experts() {
                match l.table.slot_of(e) {
                    Some(s) => slots.push(s),
                    None => return Ok(None),
                }
            }
            for &s in &slots {
                compute
                    .wait(&l.filled[s])
                    .map_err(driver("cuStreamWaitEvent"))?;
                // Nothing is evicted from a complete layer: slots loaded without a reader
                // (`not_yet_held`) need no pin.
                l.table.set_pinned(s, false);
            }
            let (base, _sync) = l.slab.device_ptr(compute);
            let addrs: Vec<u64> = slots.iter().map(|&s| base + (s * stride) as u64).collect();
            l.by_id = Some(
                compute
                    .clone_htod(&addrs)
                    .map_err(driver("copying the slot table"))?,
            );
        }
        let t = l.by_id.as_ref().expect("built above");
        let (addr, _sync) = t.device_ptr(compute);
        Ok(Some(addr))
    }

    /// The experts of `layer` not in a slot, when the layer has a slot for every expert
    /// (and `force_miss` is off); else none.
    pub(crate) fn not_yet_held(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
    ) -> Result<Vec<usize>, CacheError> {
        self.ensure_sized(compute)?;
        match self.layers.get(&layer) {
            Some(l) if !self.opts.force_miss && l.table.slots() >= l.table.experts() => {
                Ok((0..l.table.experts())
                    .filter(|&e| l.table.slot_of(e).is_none())
                    .collect())
            }
            _ => Ok(Vec::new()),
        }
    }

    /// Marks the `n` of `misses` of `layer` used least so far (the fewest uses, then the least
    /// recently, then the highest id): the ones a copy would least likely serve again, which
    /// `--gpu-miss-split` computes on the host instead.
    pub(crate) fn least_used(&self, layer: usize, misses: &[usize], n: usize) -> Vec<bool> {
        let mut out = vec![false; misses.len()];
        let Some(l) = self.layers.get(&layer) else {
            return out;
        };
        let mut order: Vec<usize> = (0..misses.len()).collect();
        order.sort_by_key(|&i| {
            let (uses, last) = l.table.uses(misses[i]);
            (uses, last, std::cmp::Reverse(misses[i]))
        });
        for &i in order.iter().take(n) {
            out[i] = true;
        }
        out
    }

    /// Counts `n` misses computed on the host instead of copied in: misses all the same (the
    /// hit rate is of every use).
    pub(crate) fn count_host_misses(&mut self, n: usize) {
        self.stats.misses += n as u64;
    }

    /// Counts a decode step of `layer` routed on the device: `uses` hits.
    pub(crate) fn count_device_step(&mut self, uses: usize) {
        self.stats.hits += uses as u64;
        self.stats.device_routed += 1;
    }

    /// Records that the kernels reading slot `s` of `layer` are queued on `compute`; the slot
    /// may be refilled from now on (its copy waits for that record).
    pub(crate) fn after_read(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
        s: usize,
    ) -> Result<(), CacheError> {
        if s == STAGED {
            return match self.staging.as_ref() {
                Some(st) => st.read.record(compute).map_err(driver("cuEventRecord")),
                None => Ok(()),
            };
        }
        let l = self
            .layers
            .get_mut(&layer)
            .ok_or_else(|| CacheError::Refused(format!("layer {layer} has no GPU expert slots")))?;
        l.table.set_pinned(s, false);
        l.read[s].record(compute).map_err(driver("cuEventRecord"))
    }

    /// Blocks until every copy since the last call has left its host slot.
    pub(crate) fn copies_done(&mut self) -> Result<(), CacheError> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        for c in std::mem::take(&mut self.in_flight) {
            let ev = match c {
                Copy::Slot(layer, s) => &self.layers[&layer].filled[s],
                Copy::Staged(i) => match self.staging.as_ref() {
                    Some(st) => &st.filled[i],
                    None => continue,
                },
            };
            ev.synchronize().map_err(driver("cuEventSynchronize"))?;
        }
        self.stats.copy_wait += t0.elapsed();
        Ok(())
    }

    /// Page-locks `layer`'s host slot memory once, so copies out of it are DMA at full speed.
    pub(crate) fn pin_host(&mut self, layer: usize, mem: &[u8]) -> Result<(), CacheError> {
        if mem.is_empty() || self.pinned.contains_key(&layer) {
            return Ok(());
        }
        // SAFETY: `mem` is a live allocation of the host streamer; it is unregistered in `Drop`.
        // Registration does not change its contents.
        unsafe {
            cudarc::driver::sys::cuMemHostRegister_v2(
                mem.as_ptr() as *mut _,
                mem.len(),
                0,
            )
        }
        .result()
        .map_err(driver("cuMemHostRegister (page-locking the host expert slots; lower --host-expert-cache or raise `ulimit -l`)"))?;
        self.pinned
            .insert(layer, (mem.as_ptr() as usize, mem.len()));
        Ok(())
    }
}

impl Drop for GpuExperts {
    fn drop(&mut self) {
        // Copies out of the host slots end before the slots are unlocked.
        let _ = self.copy.synchronize();
        for &(p, _) in self.pinned.values() {
            // SAFETY: `p` was registered by `pin_host`; failure (memory already gone) is harmless.
            let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(p as *mut _) };
        }
    }
}
