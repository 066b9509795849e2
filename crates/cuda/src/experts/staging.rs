//! The prefill staging area of the GPU expert cache (issue 28 item 2): a chunk's misses are
//! copied into room for one whole layer instead of into the layer's slots, then its most used
//! experts go into the slots device to device.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};

use super::{auto_margin, driver, CacheError, GpuExperts};

/// The slot index [`GpuExperts::slot_addr`] gives for an expert read from the prefill staging
/// area ([`Staging`]) rather than a slot.
pub(crate) const STAGED: usize = usize::MAX;

/// The prefill staging area (issue 28 item 2): room for every expert of one layer. While a
/// prefill chunk's MoE step runs ([`GpuExperts::begin_staging`] .. [`GpuExperts::end_staging`]),
/// its misses are copied here instead of into the layer's slots, so no copy waits for a kernel
/// still reading the slot it would refill (with a few slots, each tile's copies waited for the
/// previous tile's products) and the copy stream runs back to back; afterwards the chunk's most
/// used experts go into the slots device to device, as the tile path would have left them.
pub(super) struct Staging {
    pub(super) buf: CudaSlice<u8>,
    /// Per index: recorded on the copy stream after the copy into it.
    pub(super) filled: Vec<CudaEvent>,
    /// Recorded on the compute stream after the kernels reading the area so far.
    pub(super) read: CudaEvent,
    /// The layer staged now, and where each of its experts is.
    pub(super) layer: Option<usize>,
    pub(super) at: HashMap<usize, usize>,
    /// Whether the copy stream has waited for `read` since the layer began.
    pub(super) waited: bool,
}

/// Whether prefill staging is on: unless `MFERENCE_CUDA_STAGING=0` (for A/B measurements).
pub(super) fn staging_wanted() -> bool {
    std::env::var_os("MFERENCE_CUDA_STAGING").is_none_or(|v| v != "0")
}

impl GpuExperts {
    /// The staging area, where the slots hold less than a layer and one layer's experts fit in
    /// what is left with [`auto_margin`] to spare; otherwise prefill copies into the slots.
    pub(super) fn size_staging(
        &mut self,
        compute: &Arc<CudaStream>,
        slots: usize,
    ) -> Result<(), CacheError> {
        let g = &self.opts.geometry;
        if g.layers.is_empty() || slots >= g.experts || !staging_wanted() {
            return Ok(());
        }
        let ctx = compute.context();
        let (free, total) = ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
        let need = g.experts * g.stride;
        if free < need + auto_margin(total) {
            return Ok(());
        }
        // SAFETY: an index is read only after its copy (its `filled` event orders it).
        let buf = unsafe { compute.alloc::<u8>(need) }
            .map_err(driver("allocating the prefill staging area"))?;
        let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let filled = (0..g.experts)
            .map(|_| ctx.new_event(flags))
            .collect::<Result<Vec<_>, _>>()
            .map_err(driver("cuEventCreate"))?;
        let read = ctx.new_event(flags).map_err(driver("cuEventCreate"))?;
        read.record(compute).map_err(driver("cuEventRecord"))?;
        compute
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        self.staging = Some(Staging {
            buf,
            filled,
            read,
            layer: None,
            at: HashMap::new(),
            waited: false,
        });
        self.stats.staging_bytes = need as u64;
        Ok(())
    }

    /// Starts staging `layer`'s misses (a prefill chunk's MoE step); false without a staging
    /// area.
    pub(crate) fn begin_staging(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
    ) -> Result<bool, CacheError> {
        self.ensure_sized(compute)?;
        if !self.layers.contains_key(&layer) {
            return Ok(false);
        }
        let Some(st) = self.staging.as_mut() else {
            return Ok(false);
        };
        st.layer = Some(layer);
        st.at.clear();
        st.waited = false;
        Ok(true)
    }

    /// Ends `layer`'s staging once the kernels reading it are queued. `uses`: the step's routed
    /// experts and their row counts (empty: keep nothing). The slots are left holding the step's
    /// most used experts (the most rows, then the lower id), as many as there are slots, as the
    /// tile path's copies (most used last) left them: each staged one among those goes device to
    /// device (on the compute stream) into a free slot or the LFU victim among the slots not
    /// holding one of them.
    pub(crate) fn end_staging(
        &mut self,
        compute: &Arc<CudaStream>,
        layer: usize,
        uses: &[(usize, u64)],
    ) -> Result<(), CacheError> {
        let stride = self.opts.geometry.stride;
        let (Some(st), Some(l)) = (self.staging.as_mut(), self.layers.get_mut(&layer)) else {
            return Ok(());
        };
        if st.layer != Some(layer) {
            return Ok(());
        }
        st.layer = None;
        let staged: HashMap<usize, usize> = st.at.drain().collect();
        let mut ranked: Vec<(usize, u64)> = uses.to_vec();
        ranked.sort_by_key(|&(e, n)| (std::cmp::Reverse(n), e));
        ranked.truncate(l.table.slots());
        let mut keep = vec![false; l.table.slots()];
        for &(e, _) in &ranked {
            if let Some(s) = l.table.slot_of(e) {
                keep[s] = true;
            }
        }
        let (sbase, _sync) = st.buf.device_ptr(compute);
        let (base, _sync) = l.slab.device_ptr(compute);
        for (e, _) in ranked {
            let Some(&i) = staged.get(&e).filter(|_| l.table.slot_of(e).is_none()) else {
                continue;
            };
            let Some(s) = l.table.victim(|s| !keep[s]) else {
                break;
            };
            keep[s] = true;
            l.table.assign(s, e);
            l.ahead[s] = false;
            compute
                .wait(&st.filled[i])
                .map_err(driver("cuStreamWaitEvent"))?;
            compute
                .wait(&l.filled[s])
                .map_err(driver("cuStreamWaitEvent"))?;
            // SAFETY: both ranges lie in their buffers (`stride` bytes at index i / slot s); the
            // copy is ordered on the compute stream after the kernels reading either.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    base + (s * stride) as u64,
                    sbase + (i * stride) as u64,
                    stride,
                    compute.cu_stream(),
                )
            }
            .map_err(driver("cuMemcpyDtoDAsync (staged expert into a slot)"))?;
            // Later copies into the slot wait for this one; later readers follow it in order.
            l.filled[s]
                .record(compute)
                .map_err(driver("cuEventRecord"))?;
            l.read[s].record(compute).map_err(driver("cuEventRecord"))?;
        }
        st.read.record(compute).map_err(driver("cuEventRecord"))
    }
}
