//! The expert streamer: one per MoE layer, holding N slots of `expert_stride` bytes in a 2 MiB-aligned
//! slab and filling them from the layer's packed expert file with bounded `pread`s.
//!
//! Cache policy (`docs/ARCHITECTURE.md`, [`crate::pool`]): an expert → slot table; LFU eviction
//! (use count over the whole session) with recency as the tie-break by default, LRU, or one LFU
//! table over every layer's slots (`pool`); a slot pinned by the current step is never evicted;
//! distinct misses are read in parallel on a shared I/O pool, each into its own slot, so no two reads
//! ever target one slot.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use crate::io::IoPool;
use crate::io::{Batch, Job};
use crate::layer_file;
use crate::pool::SlotPool;
pub use crate::slots::CacheSlots;
use crate::slots::Eviction;
use crate::RuntimeError;

/// Per-layer cache counters. Bytes are payload bytes read from the layer file.
#[derive(Clone, Copy, Debug, Default)]
pub struct StreamerStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    /// Time the compute thread spent blocked waiting for expert reads.
    pub read_wait: Duration,
    /// Speculative reads started by [`ExpertStreamer::prefetch`] (their bytes are in `bytes_read`).
    pub prefetch_reads: u64,
    /// Prefetched experts later routed to (each also counted as a hit).
    pub prefetch_used: u64,
}

impl StreamerStats {
    /// Adds another layer's counters into this one.
    pub fn add(&mut self, o: &StreamerStats) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.bytes_read += o.bytes_read;
        self.read_wait += o.read_wait;
        self.prefetch_reads += o.prefetch_reads;
        self.prefetch_used += o.prefetch_used;
    }
}

/// Slot cache over one layer file of `experts × stride` bytes.
pub struct ExpertStreamer {
    /// The MoE layer served (its name in a backend's own expert cache).
    layer: usize,
    path: PathBuf,
    file: Arc<File>,
    experts: usize,
    stride: usize,
    /// The slots, their table and per-slot flags: this layer's own, or shared by every layer
    /// (`--expert-cache-policy pool`; [`crate::pool`]).
    pool: Arc<SlotPool>,
    /// This layer's expert `e` is key `first_key + e` of the pool's table.
    first_key: usize,
    /// Slots this layer counts on (its own count, or its share of a pool).
    share: usize,
    /// Resident mode without O_DIRECT: the whole layer file mapped read-only, slot = expert. The page
    /// cache is then the only copy (no slab, no pread copies), as with a plain mmap runtime.
    mapped: Option<memmap2::Mmap>,
    io: Arc<IoPool>,
    pending: Option<Arc<Batch>>,
    /// Speculative reads in flight ([`ExpertStreamer::prefetch`]) and the slots they write.
    prefetching: Option<(Arc<Batch>, Vec<usize>)>,
    stats: StreamerStats,
}

impl ExpertStreamer {
    /// Opens `path` (which must hold exactly `experts × stride` bytes) with `slots` slots of its own,
    /// LFU.
    ///
    /// `direct_io` opens the file with O_DIRECT so the page cache keeps no second copy; the slab and
    /// the stride are page-aligned, as O_DIRECT requires.
    pub fn open(
        path: &Path,
        experts: usize,
        stride: u64,
        slots: CacheSlots,
        direct_io: bool,
        io: Arc<IoPool>,
    ) -> Result<Self, RuntimeError> {
        Self::open_with(path, experts, stride, slots, Eviction::Lfu, direct_io, io)
    }

    /// [`open`](Self::open) with `slots` of its own evicting by `eviction`.
    pub fn open_with(
        path: &Path,
        experts: usize,
        stride: u64,
        slots: CacheSlots,
        eviction: Eviction,
        direct_io: bool,
        io: Arc<IoPool>,
    ) -> Result<Self, RuntimeError> {
        let (file, shown) = layer_file::open(path, experts, stride, direct_io)?;
        let n = slots.count(experts);
        let mapped = if slots == CacheSlots::Resident && !direct_io {
            Some(layer_file::map(&file, &shown)?)
        } else {
            None
        };
        let slab_slots = if mapped.is_some() { 0 } else { n };
        let pool = SlotPool::new(experts, n, slab_slots, stride as usize, eviction)?;
        Ok(Self::assemble(
            path,
            file,
            experts,
            stride,
            Arc::new(pool),
            0,
            n,
            mapped,
            io,
        ))
    }

    /// Opens `path` over slots shared with other layers: this layer's expert `e` is key
    /// `first_key + e` of `pool`, and `share` is the slot count it is budgeted (what
    /// [`slots`](Self::slots) reports).
    #[allow(clippy::too_many_arguments)]
    pub fn open_shared(
        path: &Path,
        experts: usize,
        stride: u64,
        direct_io: bool,
        io: Arc<IoPool>,
        pool: &Arc<SlotPool>,
        first_key: usize,
        share: usize,
    ) -> Result<Self, RuntimeError> {
        let (file, _) = layer_file::open(path, experts, stride, direct_io)?;
        let keys = pool.lock().table.experts();
        if first_key + experts > keys {
            return Err(RuntimeError::Invalid(format!(
                "experts {first_key}..{} are outside the pool's {keys}",
                first_key + experts
            )));
        }
        Ok(Self::assemble(
            path,
            file,
            experts,
            stride,
            Arc::clone(pool),
            first_key,
            share,
            None,
            io,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        path: &Path,
        file: File,
        experts: usize,
        stride: u64,
        pool: Arc<SlotPool>,
        first_key: usize,
        share: usize,
        mapped: Option<memmap2::Mmap>,
        io: Arc<IoPool>,
    ) -> Self {
        Self {
            layer: 0,
            path: path.to_path_buf(),
            file: Arc::new(file),
            experts,
            stride: stride as usize,
            pool,
            first_key,
            share,
            mapped,
            io,
            pending: None,
            prefetching: None,
            stats: StreamerStats::default(),
        }
    }

    /// Names the MoE layer this streamer serves (0 until set).
    pub fn for_layer(mut self, layer: usize) -> Self {
        self.layer = layer;
        self
    }

    /// The MoE layer this streamer serves.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The slot memory (empty in resident mode without O_DIRECT, where the file is mapped; the
    /// whole shared slab under `pool`): a GPU backend pins it so its copies from the slots run at
    /// full bus speed.
    pub fn slot_memory(&self) -> &[u8] {
        match &self.mapped {
            Some(_) => &[],
            None => self.pool.bytes(),
        }
    }

    /// Maps every page of a mapped (`resident`) layer file into this process now, reading what
    /// the page cache lacks, as llama.cpp's mapping does at load (`MAP_POPULATE`): the first
    /// prompt then finds its experts mapped instead of taking a page fault per 4 KiB to 64 KiB of
    /// them (a 64-token prompt of the full-size Gemma 4 26B-A4B touches 10.6 GB of its experts).
    /// `MADV_POPULATE_READ` (Linux 5.14+). `Ok(true)` when the pages are mapped; `Ok(false)`
    /// where the kernel would not (an older kernel, a filter on `madvise`, no memory to spare):
    /// the file is then only read ahead (`MADV_WILLNEED`) and mapped on first use, as before.
    /// `Ok(true)` for a layer with slots of its own (nothing to map).
    ///
    /// Errors: the file cannot be read where it is mapped (an I/O error, or a file cut short
    /// under the mapping), which would otherwise raise SIGBUS at the first prompt.
    pub fn populate(&self) -> Result<bool, RuntimeError> {
        match &self.mapped {
            Some(map) => layer_file::populate(map, &self.path),
            None => Ok(true),
        }
    }

    /// Whether expert `e` has a slot (cached, or a read is landing there).
    pub fn cached(&self, e: usize) -> bool {
        e < self.experts && self.pool.lock().table.slot_of(self.first_key + e).is_some()
    }

    /// Whether every one of `experts` is in a slot already, so that
    /// [`acquire`](Self::acquire) of them starts no read and refills no slot.
    pub fn holds(&self, experts: &[usize]) -> bool {
        let st = self.pool.lock();
        experts
            .iter()
            .all(|&e| e < self.experts && st.table.slot_of(self.first_key + e).is_some())
    }

    /// Whether the layer file is mapped (`resident` without O_DIRECT): every expert has its own
    /// slot, so [`acquire`](Self::acquire) never reads into or refills a slot.
    pub fn is_mapped(&self) -> bool {
        self.mapped.is_some()
    }

    /// Number of slots this layer counts on (its share of the pool under `pool`).
    pub fn slots(&self) -> usize {
        self.share
    }

    /// Counters since open.
    pub fn stats(&self) -> StreamerStats {
        self.stats
    }

    /// Makes the distinct `experts` present, pins their slots, and starts reads for the misses
    /// without waiting for them. Returns, per requested expert, its slot and whether it was a hit.
    ///
    /// Errors when an expert is out of range, or the request plus the already pinned slots exceed
    /// the slot count: callers tile their requests (prefill uses tiles of at most half the slots).
    pub fn acquire(&mut self, experts: &[usize]) -> Result<Vec<(usize, bool)>, RuntimeError> {
        self.acquire_counted(experts, |_| 1)
    }

    /// [`acquire`](Self::acquire) where `experts[i]` counts `uses[i]` uses for the eviction
    /// policy (a prefill tile: the rows routed to each expert). Errors as `acquire`, and when the
    /// two slices differ in length.
    pub fn acquire_uses(
        &mut self,
        experts: &[usize],
        uses: &[u64],
    ) -> Result<Vec<(usize, bool)>, RuntimeError> {
        if uses.len() != experts.len() {
            return Err(RuntimeError::Invalid(format!(
                "{} use counts for {} experts",
                uses.len(),
                experts.len()
            )));
        }
        self.acquire_counted(experts, |i| uses[i])
    }

    /// [`acquire`](Self::acquire) with `uses(i)` uses counted for `experts[i]`.
    fn acquire_counted(
        &mut self,
        experts: &[usize],
        uses: impl Fn(usize) -> u64,
    ) -> Result<Vec<(usize, bool)>, RuntimeError> {
        if let Some(&e) = experts.iter().find(|&&e| e >= self.experts) {
            return Err(RuntimeError::Invalid(format!(
                "expert {e} out of range ({} experts)",
                self.experts
            )));
        }
        let k0 = self.first_key;
        // Speculative reads: settle the landed ones; join them only when this request needs one
        // of their experts or their slots.
        self.settle_prefetch(false);
        let joins = {
            let st = self.pool.lock();
            experts
                .iter()
                .any(|&e| st.table.slot_of(k0 + e).is_some_and(|s| st.landing[s]))
        };
        if self.prefetching.is_some() && joins {
            self.settle_prefetch(true);
        }
        let room = |s: &Self| {
            let st = s.pool.lock();
            let needed = experts
                .iter()
                .filter(|&&e| {
                    st.table
                        .slot_of(k0 + e)
                        .is_none_or(|x| !st.table.is_pinned(x))
                })
                .count();
            (needed, st.usable())
        };
        let (needed, usable) = room(self);
        if needed > usable {
            self.settle_prefetch(true);
        }
        let (needed, usable) = room(self);
        if needed > usable {
            return Err(RuntimeError::Invalid(format!(
                "request for {needed} experts exceeds the {usable} unpinned slots"
            )));
        }
        let mut st = self.pool.lock();
        if self.mapped.is_some() {
            // Every expert has its own "slot" in the mapping; a first use counts as the miss that
            // brings it in (through page faults rather than a pread).
            let mut out = Vec::with_capacity(experts.len());
            for &e in experts {
                let hit = st.table.slot_of(e).is_some();
                if hit {
                    self.stats.hits += 1;
                } else {
                    st.table.assign(e, e);
                    self.stats.misses += 1;
                    self.stats.bytes_read += self.stride as u64;
                }
                out.push((e, hit));
            }
            return Ok(out);
        }
        st.table.tick();
        // Count and pin every requested expert that is cached before choosing any victim, so a
        // miss never evicts an expert this same request needs.
        for (i, &e) in experts.iter().enumerate() {
            st.table.touch_uses(k0 + e, uses(i));
            if let Some(s) = st.table.slot_of(k0 + e) {
                st.table.set_pinned(s, true);
            }
        }
        let mut out = Vec::with_capacity(experts.len());
        let mut misses = Vec::new();
        for &e in experts {
            // Requests hold distinct experts, so a cached one was cached before this call.
            if let Some(s) = st.table.slot_of(k0 + e) {
                self.stats.hits += 1;
                if std::mem::take(&mut st.prefetched[s]) {
                    self.stats.prefetch_used += 1;
                }
                out.push((s, true));
                continue;
            }
            let slot = st.victim().expect("capacity checked above");
            st.table.assign(slot, k0 + e);
            st.prefetched[slot] = false;
            st.table.set_pinned(slot, true);
            self.stats.misses += 1;
            self.stats.bytes_read += self.stride as u64;
            misses.push((e, slot));
            out.push((slot, false));
        }
        drop(st);
        if !misses.is_empty() {
            // Reads of an earlier batch may still target other slots; they stay tracked until `wait`.
            self.wait()?;
            self.pending = Some(self.submit_reads(&misses));
        }
        Ok(out)
    }

    /// Blocks until every read started by [`acquire`](Self::acquire) has landed.
    ///
    /// Errors: a failed read; its slot is invalidated so a later step reads it again.
    pub fn wait(&mut self) -> Result<(), RuntimeError> {
        let Some(b) = self.pending.take() else {
            return Ok(());
        };
        let t0 = Instant::now();
        let mut left = b.remaining.lock().expect("io batch poisoned");
        while *left > 0 {
            left = b.done.wait(left).expect("io batch poisoned");
        }
        drop(left);
        self.stats.read_wait += t0.elapsed();
        if let Some((expert, source)) = b.error.lock().expect("io error poisoned").take() {
            self.pool.lock().table.forget(self.first_key + expert);
            return Err(RuntimeError::Read {
                path: self.path.display().to_string(),
                expert,
                source,
            });
        }
        Ok(())
    }

    /// Starts speculative reads of the uncached `experts` (in order, as free or evictable slots
    /// allow) without waiting and without pinning: a later [`acquire`](Self::acquire) that requests
    /// one of them waits for it (the join) and counts a hit; one never requested costs nothing but
    /// its slot. Never blocks: while an earlier speculative batch is still landing, or in resident
    /// mode without O_DIRECT (the mapping needs no reads), it starts nothing. Returns the number of
    /// reads started. Cached bytes are the file's bytes either way, so results do not change.
    pub fn prefetch(&mut self, experts: &[usize]) -> usize {
        if self.mapped.is_some() {
            return 0;
        }
        self.settle_prefetch(false);
        if self.prefetching.is_some() {
            return 0;
        }
        let k0 = self.first_key;
        let mut jobs = Vec::new();
        {
            let mut st = self.pool.lock();
            for &e in experts {
                if e >= self.experts
                    || st.table.slot_of(k0 + e).is_some()
                    || jobs.iter().any(|&(x, _)| x == e)
                {
                    continue;
                }
                let Some(slot) = st.victim() else { break };
                st.table.assign(slot, k0 + e);
                st.landing[slot] = true;
                st.prefetched[slot] = true;
                jobs.push((e, slot));
            }
        }
        if jobs.is_empty() {
            return 0;
        }
        let b = self.submit_reads(&jobs);
        self.stats.prefetch_reads += jobs.len() as u64;
        self.stats.bytes_read += (jobs.len() * self.stride) as u64;
        self.prefetching = Some((b, jobs.iter().map(|&(_, s)| s).collect()));
        jobs.len()
    }

    /// Retires the speculative batch once it has landed (`join`: waits for it first, counted as
    /// read wait). A failed speculative read leaves its expert uncached, so a request reads it
    /// again and reports the error there.
    fn settle_prefetch(&mut self, join: bool) {
        let Some((b, _)) = &self.prefetching else {
            return;
        };
        let t0 = Instant::now();
        let mut left = b.remaining.lock().expect("io batch poisoned");
        if *left > 0 && !join {
            return;
        }
        while *left > 0 {
            left = b.done.wait(left).expect("io batch poisoned");
        }
        drop(left);
        if join {
            self.stats.read_wait += t0.elapsed();
        }
        let (b, slots) = self.prefetching.take().expect("checked above");
        let mut st = self.pool.lock();
        for s in slots {
            st.landing[s] = false;
        }
        let failed = b.error.lock().expect("io error poisoned").take();
        if let Some((expert, _)) = failed {
            let key = self.first_key + expert;
            if let Some(slot) = st.table.slot_of(key) {
                st.prefetched[slot] = false;
            }
            st.table.forget(key);
        }
    }

    /// Unpins the slots of `experts` (their bytes stay cached).
    pub fn release(&mut self, experts: &[usize]) {
        let mut st = self.pool.lock();
        for &e in experts.iter().filter(|&&e| e < self.experts) {
            if let Some(s) = st.table.slot_of(self.first_key + e) {
                st.table.set_pinned(s, false);
            }
        }
    }

    /// The bytes of expert `e` when they sit in a slot and no read of this streamer is in
    /// flight, without pinning the slot or counting a use (a backend's router lookahead copies
    /// them into its own cache); `None` otherwise, and always for a mapped layer (not host slot
    /// memory). The bytes stay until a read refills the slot: the caller is done with them
    /// before the next [`acquire`](Self::acquire) or [`prefetch`](Self::prefetch) that reads.
    pub fn landed_blob(&self, e: usize) -> Option<&[u8]> {
        if self.mapped.is_some()
            || self.pending.is_some()
            || self.prefetching.is_some()
            || e >= self.experts
        {
            return None;
        }
        let slot = {
            let st = self.pool.lock();
            st.table
                .slot_of(self.first_key + e)
                .filter(|&s| !st.landing[s])?
        };
        Some(self.pool.slot(slot))
    }

    /// The bytes of the expert blob in `slot` (valid after [`wait`](Self::wait)).
    pub fn blob(&self, slot: usize) -> &[u8] {
        match &self.mapped {
            Some(map) => &map[slot * self.stride..(slot + 1) * self.stride],
            None => self.pool.slot(slot),
        }
    }

    /// Submits one pread per `(expert, slot)` to the I/O pool, as one batch.
    fn submit_reads(&mut self, reads: &[(usize, usize)]) -> Arc<Batch> {
        let b = Arc::new(Batch {
            remaining: Mutex::new(reads.len()),
            done: Condvar::new(),
            error: Mutex::new(None),
        });
        for &(e, slot) in reads {
            self.io.submit(Job {
                file: Arc::clone(&self.file),
                offset: (e * self.stride) as u64,
                len: self.stride,
                dst: self.pool.slot_addr(slot),
                expert: e,
                batch: Arc::clone(&b),
            });
        }
        b
    }
}

impl Drop for ExpertStreamer {
    fn drop(&mut self) {
        // Reads in flight write into the slab: let them land before it is unmapped.
        let _ = self.wait();
        self.settle_prefetch(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn layer_file(experts: usize, stride: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        for e in 0..experts {
            let blob: Vec<u8> = (0..stride).map(|i| (e * 31 + i * 7) as u8).collect();
            f.write_all(&blob).unwrap();
        }
        f.flush().unwrap();
        f
    }

    /// 8 slots over `f` with `io_threads` readers, pread.
    fn open8(
        f: &tempfile::NamedTempFile,
        experts: usize,
        stride: usize,
        io_threads: usize,
    ) -> ExpertStreamer {
        let io = IoPool::new(io_threads);
        let slots = CacheSlots::Fixed(8);
        ExpertStreamer::open(f.path(), experts, stride as u64, slots, false, io).unwrap()
    }

    fn expected(e: usize, stride: usize) -> Vec<u8> {
        (0..stride).map(|i| (e * 31 + i * 7) as u8).collect()
    }

    #[test]
    fn slots_hold_the_right_bytes_under_churn() {
        let (experts, stride) = (12, 16384);
        let f = layer_file(experts, stride);
        let mut s = open8(&f, experts, stride, 3);
        let mut rng = 12345u64;
        for _ in 0..200 {
            let mut req = Vec::new();
            while req.len() < 4 {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let e = (rng >> 33) as usize % experts;
                if !req.contains(&e) {
                    req.push(e);
                }
            }
            let slots = s.acquire(&req).unwrap();
            s.wait().unwrap();
            for (&e, &(slot, _)) in req.iter().zip(&slots) {
                assert_eq!(
                    s.blob(slot),
                    &expected(e, stride)[..],
                    "expert {e} in slot {slot}"
                );
            }
            s.release(&req);
        }
        let st = s.stats();
        assert_eq!(st.hits + st.misses, 800);
        assert!(st.misses >= 8 && st.hits > 0);
        assert_eq!(st.bytes_read, st.misses * stride as u64);
    }

    #[test]
    fn a_landed_blob_is_the_file_s_and_only_when_no_read_is_in_flight() {
        let (experts, stride) = (12, 16384);
        let f = layer_file(experts, stride);
        let mut s = open8(&f, experts, stride, 3);
        assert!(s.landed_blob(2).is_none(), "nothing cached yet");
        s.acquire(&[2, 5]).unwrap();
        assert!(s.landed_blob(2).is_none(), "a read is in flight");
        s.wait().unwrap();
        s.release(&[2, 5]);
        let before = s.stats();
        for e in [2, 5] {
            assert_eq!(
                s.landed_blob(e).unwrap(),
                &expected(e, stride)[..],
                "expert {e}"
            );
        }
        assert!(s.landed_blob(7).is_none() && s.landed_blob(experts).is_none());
        let after = s.stats();
        assert_eq!(
            (after.hits, after.misses),
            (before.hits, before.misses),
            "no use counted"
        );
    }

    /// Speculative reads interleaved with real requests (right and wrong guesses, some landing while
    /// the next request runs): every blob handed out holds its expert's bytes, used guesses count as
    /// hits, and nothing is read twice for one guess.
    #[test]
    fn prefetched_slots_hold_the_right_bytes() {
        let (experts, stride) = (12, 16384);
        let f = layer_file(experts, stride);
        let mut s = open8(&f, experts, stride, 2);
        let mut rng = 99u64;
        let mut next = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as usize % experts
        };
        let mut started = 0;
        for step in 0..300 {
            let mut req = Vec::new();
            while req.len() < 4 {
                let e = next();
                if !req.contains(&e) {
                    req.push(e);
                }
            }
            let slots = s.acquire(&req).unwrap();
            s.wait().unwrap();
            for (&e, &(slot, _)) in req.iter().zip(&slots) {
                assert_eq!(
                    s.blob(slot),
                    &expected(e, stride)[..],
                    "step {step} expert {e}"
                );
            }
            s.release(&req);
            // Guess two experts of the next request (often wrong).
            started += s.prefetch(&[next(), next()]);
        }
        let st = s.stats();
        assert_eq!(st.hits + st.misses, 1200);
        assert_eq!(st.prefetch_reads, started as u64);
        assert!(
            st.prefetch_reads > 0 && st.prefetch_used > 0 && st.prefetch_used <= st.prefetch_reads
        );
        assert_eq!(
            st.bytes_read,
            (st.misses + st.prefetch_reads) * stride as u64
        );
    }

    #[test]
    fn pinned_slots_are_never_evicted() {
        let (experts, stride) = (10, 16384);
        let f = layer_file(experts, stride);
        let mut s = ExpertStreamer::open(
            f.path(),
            experts,
            stride as u64,
            CacheSlots::Fixed(8),
            false,
            IoPool::new(2),
        )
        .unwrap();
        let first = s.acquire(&[0, 1, 2, 3]).unwrap();
        s.wait().unwrap();
        let second = s.acquire(&[4, 5, 6, 7]).unwrap();
        s.wait().unwrap();
        // All 8 slots pinned: a 9th expert cannot be placed.
        assert!(s.acquire(&[8]).is_err());
        for (i, &(slot, _)) in first.iter().enumerate() {
            assert_eq!(s.blob(slot), &expected(i, stride)[..]);
        }
        for (i, &(slot, _)) in second.iter().enumerate() {
            assert_eq!(s.blob(slot), &expected(4 + i, stride)[..]);
        }
        s.release(&[0, 1, 2, 3]);
        let third = s.acquire(&[8, 9]).unwrap();
        s.wait().unwrap();
        for &(slot, _) in &third {
            assert!(
                first.iter().any(|&(f, _)| f == slot),
                "evicted a pinned slot"
            );
        }
    }

    #[test]
    fn lfu_keeps_the_frequent_expert() {
        let (experts, stride) = (10, 16384);
        let f = layer_file(experts, stride);
        let mut s = ExpertStreamer::open(
            f.path(),
            experts,
            stride as u64,
            CacheSlots::Fixed(8),
            false,
            IoPool::new(1),
        )
        .unwrap();
        for _ in 0..5 {
            s.acquire(&[0]).unwrap();
            s.wait().unwrap();
            s.release(&[0]);
        }
        for e in 1..10 {
            s.acquire(&[e]).unwrap();
            s.wait().unwrap();
            s.release(&[e]);
        }
        let hits = s.stats().hits;
        s.acquire(&[0]).unwrap();
        assert_eq!(s.stats().hits, hits + 1, "the most used expert was evicted");
    }

    #[test]
    fn populate_maps_a_resident_layer_and_names_a_file_cut_short_under_it() {
        let (experts, stride) = (6, 16384);
        let f = layer_file(experts, stride);
        let open = |slots| {
            ExpertStreamer::open(
                f.path(),
                experts,
                stride as u64,
                slots,
                false,
                IoPool::new(1),
            )
            .unwrap()
        };
        let (resident, slotted) = (open(CacheSlots::Resident), open(CacheSlots::Fixed(8)));
        let mapped = resident.populate().unwrap();
        assert!(slotted.populate().unwrap());
        // The file loses its second half after it was mapped: the pages past the end cannot be
        // mapped, and the load says which file, where touching them would raise SIGBUS later.
        std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .unwrap()
            .set_len((experts / 2 * stride) as u64)
            .unwrap();
        if !mapped {
            eprintln!("skipped the cut-short check: this kernel lacks MADV_POPULATE_READ");
            return;
        }
        let err = resident.populate().unwrap_err().to_string();
        assert!(err.contains(&f.path().display().to_string()), "{err}");
        assert!(slotted.populate().unwrap());
    }

    #[test]
    fn resident_mode_maps_the_file_and_counts_first_use_as_miss() {
        let (experts, stride) = (6, 16384);
        let f = layer_file(experts, stride);
        let mut s = ExpertStreamer::open(
            f.path(),
            experts,
            stride as u64,
            CacheSlots::Resident,
            false,
            IoPool::new(1),
        )
        .unwrap();
        for round in 0..2 {
            let req = [5, 0, 3];
            let got = s.acquire(&req).unwrap();
            s.wait().unwrap();
            for (&e, &(slot, hit)) in req.iter().zip(&got) {
                assert_eq!(hit, round == 1);
                assert_eq!(s.blob(slot), &expected(e, stride)[..]);
            }
            s.release(&req);
        }
        assert_eq!((s.stats().hits, s.stats().misses), (3, 3));
    }

    #[test]
    fn wrong_file_size_is_a_clear_error() {
        let f = layer_file(3, 16384);
        let err = ExpertStreamer::open(
            f.path(),
            4,
            16384,
            CacheSlots::Fixed(8),
            false,
            IoPool::new(1),
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("expected 65536"), "{err}");
    }
}
