//! Where a product's bytes are on the device: the resident copy, a staged expert blob, or a slot of
//! the expert cache.

use crate::*;

impl CudaBackend {
    /// Checks a BF16 vector lies in the resident copy, 2-byte aligned; returns its offset.
    pub(crate) fn vref(&self, op: &'static str, w: &VRef, len: usize) -> OpResult<u64> {
        let off = w.offset();
        check(
            op,
            w.len == len && off.is_multiple_of(2) && off + 2 * len <= self.resident.len(),
            || {
                format!(
                    "a BF16 vector of {} at byte {off} for {len} values in {} resident bytes",
                    w.len,
                    self.resident.len()
                )
            },
        )?;
        Ok(off as u64)
    }

    /// Runs `f` on the device address and valid length of the bytes `src` names: the resident
    /// copy, a GPU expert slot, or the staging buffer after copying the blob into it.
    pub(crate) fn with_weights<R>(
        &self,
        op: &'static str,
        src: Weights,
        f: impl FnOnce(u64, usize) -> OpResult<R>,
    ) -> OpResult<R> {
        match src {
            Weights::Resident => f(self.addr(&self.resident), self.resident.len()),
            Weights::Held { layer, expert } => {
                let mut cache = self.cache();
                let (addr, len, slot) = self.held_addr(op, cache.as_deref(), layer, expert)?;
                let cache = cache.as_mut().expect("held_addr found the cache");
                let r = f(addr, len);
                cache
                    .after_read(&self.stream, layer, slot)
                    .map_err(|e| self.cache_err(op, e))?;
                r
            }
            Weights::Blob(b) => {
                let at = self.stage(op, &[b])?;
                f(at[0], b.len())
            }
        }
    }

    /// The device address, valid length and slot of expert `expert` of `layer` in `cache`, the
    /// compute stream made to wait for its copy (the caller calls `after_read` once the kernels
    /// reading it are queued).
    pub(crate) fn held_addr(
        &self,
        op: &'static str,
        cache: Option<&GpuExperts>,
        layer: usize,
        expert: usize,
    ) -> OpResult<(u64, usize, usize)> {
        let Some(c) = cache else {
            return Err(OpError::Shape {
                op,
                why: format!("expert {expert} of layer {layer}: no GPU expert cache"),
            });
        };
        let (addr, slot) = c
            .slot_addr(&self.stream, layer, expert)
            .map_err(|e| self.cache_err(op, e))?;
        Ok((addr, c.stride(), slot))
    }

    /// Where each source's bytes are: the resident copy, a GPU slot (the compute stream made to
    /// wait for its copy) or the staging buffer (the blobs staged together). The caller queues
    /// the kernels reading them, then calls [`CudaBackend::after_reads`].
    pub(crate) fn sources(&self, op: &'static str, srcs: &[Weights]) -> OpResult<Sources<'_>> {
        let blobs: Vec<&[u8]> = srcs
            .iter()
            .filter_map(|s| match s {
                Weights::Blob(b) => Some(*b),
                _ => None,
            })
            .collect();
        let staged = self.stage(op, &blobs)?;
        let mut staged = staged.iter().zip(&blobs);
        let cache = self.cache();
        let mut held = Vec::new();
        let mut at = Vec::with_capacity(srcs.len());
        for src in srcs {
            at.push(match *src {
                Weights::Resident => (self.addr(&self.resident), self.resident.len()),
                Weights::Blob(_) => {
                    let (&a, b) = staged.next().expect("one staged copy per blob");
                    (a, b.len())
                }
                Weights::Held { layer, expert } => {
                    let (a, len, slot) = self.held_addr(op, cache.as_deref(), layer, expert)?;
                    held.push((layer, slot));
                    (a, len)
                }
            });
        }
        Ok(Sources { at, held, cache })
    }

    /// Records the reads of the held slots of `src` after the kernels queued so far.
    pub(crate) fn after_reads(&self, op: &'static str, mut src: Sources) -> OpResult<()> {
        if let Some(c) = src.cache.as_mut() {
            for &(layer, slot) in &src.held {
                c.after_read(&self.stream, layer, slot)
                    .map_err(|e| self.cache_err(op, e))?;
            }
        }
        Ok(())
    }

    /// Copies the blobs into the staging buffer, each at a 256-byte boundary (their alignment
    /// modulo 256 is that of a GPU slot); returns each one's device address.
    pub(crate) fn stage(&self, op: &'static str, blobs: &[&[u8]]) -> OpResult<Vec<u64>> {
        let at: Vec<usize> = blobs
            .iter()
            .scan(0usize, |end, b| {
                let o = *end;
                *end += b.len().div_ceil(256) * 256;
                Some(o)
            })
            .collect();
        let total = blobs
            .last()
            .map_or(0, |b| at[at.len() - 1] + b.len().div_ceil(256) * 256);
        let mut g = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if g.as_ref().is_none_or(|s| s.len() < total) {
            *g = None; // free the smaller buffer first
            *g = Some(
                self.stream
                    .alloc_zeros(total)
                    .map_err(|e| self.dev(op, e))?,
            );
        }
        let base = self.addr(g.as_ref().expect("allocated above"));
        for (b, &o) in blobs.iter().zip(&at) {
            // SAFETY: the destination lies in the staging buffer (`total` bytes checked above).
            // From pageable memory the copy is staged before this returns, and it is ordered
            // after every queued kernel that reads the previous contents.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    base + o as u64,
                    b,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| self.dev(op, e))?;
        }
        Ok(at.iter().map(|&o| base + o as u64).collect())
    }
}
