//! A sequence's state, written once for every family (in the spirit of mlx-lm's
//! `mlx_lm/models/cache.py`): the attention KV cache ([`KvCache`]: full layers and
//! sliding-window rings) and, per layer, the parts a family declares when it builds its state
//! (mlx-lm's `make_cache`): recurrent and convolution arrays (mlx-lm's `ArraysCache`) and
//! compressed KV caches ([`CompressedKv`], DeepSeek-V4's compressors). How a sequence is cut back
//! and how large it is follow from which parts it has:
//! - KV only (Gemma 4, Maple): cut anywhere while no ring has wrapped past the cut (mlx-lm's
//!   `is_trimmable` / `trim`); once one has, only at the checkpoint, whose copy of the rings is
//!   put back.
//! - With arrays or compressed caches (Qwen 3.6's DeltaNet, Inkling's short convolutions,
//!   DeepSeek-V4's compressors), which summarise the whole prefix and cannot be cut open: at 0, at
//!   the end, or at the checkpoint (its arrays, the compressors' marks and the rings put back).

use mference_backend::{Backend, CoreOps, KvCache, KvState, OpError, Tensor};

/// One sequence's state ([`crate::Model::truncate`], [`crate::Model::checkpoint`]).
pub struct SequenceState<B: Backend> {
    /// Every attention layer's KV; `kv.len` is the sequence's position.
    pub kv: KvCache<B::Kv>,
    /// Per layer, the parts beyond its KV (empty for a family whose whole state is its KV).
    pub layers: Vec<LayerState<B>>,
    rings: Rings,
    /// The checkpoint, if one was taken (and not cut away since).
    saved: Option<Saved<B>>,
}

/// One layer's state beyond its KV.
pub struct LayerState<B: Backend> {
    /// Recurrent and convolution states (FP32), in the order the family lays them out.
    pub arrays: Vec<B::State>,
    /// Compressed KV caches, in the order the family lays them out.
    pub compressed: Vec<CompressedKv<B>>,
}

impl<B: Backend> LayerState<B> {
    /// A layer with only recurrent / convolution states.
    pub fn arrays(arrays: Vec<B::State>) -> Self {
        Self {
            arrays,
            compressed: Vec::new(),
        }
    }

    /// A layer with only compressed caches.
    pub fn compressed(compressed: Vec<CompressedKv<B>>) -> Self {
        Self {
            arrays: Vec::new(),
            compressed,
        }
    }
}

/// A compressed KV cache (DeepSeek-V4's compressor, or its indexer's): append-only entries, each
/// pooled from a window of `rate` positions, plus the unfinished window's projected rows. Rows
/// below `count` are never written again, so a checkpoint keeps the count, not the entries.
pub struct CompressedKv<B: Backend> {
    /// `[max_context / rate, dim]`; the first `count` rows are valid.
    pub entries: B::Tensor,
    pub count: usize,
    /// Projected kv and gate rows of the unfinished window, `[rate, c·dim]`; `pending` are valid.
    pub pending_kv: B::Tensor,
    pub pending_gate: B::Tensor,
    pub pending: usize,
    /// The previous window's slice kept for overlapping windows: kv and gate + ape, `[rate, dim]`.
    pub prior: Prior<B>,
}

/// A compressed cache's prior slice (kv, gate + ape), once a window has closed.
pub type Prior<B> = Option<(<B as CoreOps>::Tensor, <B as CoreOps>::Tensor)>;

/// How a checkpoint gets the sliding rings back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rings {
    /// The checkpoint copies every ring and puts the copy back.
    Copied,
    /// The rings are this many positions longer than the window: a checkpoint at most that far
    /// behind the end still has its window in them and needs no copy (Inkling).
    Reach(usize),
}

/// [`SequenceState::checkpoint`]'s copy of the state at `pos`.
struct Saved<B: Backend> {
    pos: usize,
    /// A copy of every ring (`None` for full layers, and every layer under [`Rings::Reach`]).
    rings: Vec<Option<B::Kv>>,
    arrays: Vec<Vec<B::State>>,
    /// Per layer, each compressed cache less its entries.
    marks: Vec<Vec<Mark<B>>>,
}

/// A compressed cache less its entries.
struct Mark<B: Backend> {
    count: usize,
    pending: usize,
    pending_kv: B::Tensor,
    pending_gate: B::Tensor,
    prior: Prior<B>,
}

impl<B: Backend> SequenceState<B> {
    /// The state of a family whose whole state is its KV; rings copied by the checkpoint.
    pub fn new(kv: KvCache<B::Kv>) -> Self {
        Self {
            kv,
            layers: Vec::new(),
            rings: Rings::Copied,
            saved: None,
        }
    }

    /// With per-layer parts beyond the KV.
    pub fn with_layers(self, layers: Vec<LayerState<B>>) -> Self {
        Self { layers, ..self }
    }

    /// With rings that a checkpoint reaches without a copy ([`Rings::Reach`]).
    pub fn with_rings(self, rings: Rings) -> Self {
        Self { rings, ..self }
    }

    /// Whether some part summarises the whole prefix (cannot be cut open).
    fn summarises(&self) -> bool {
        self.layers
            .iter()
            .any(|l| !l.arrays.is_empty() || !l.compressed.is_empty())
    }

    /// [`crate::Model::is_recurrent`]: a part summarises the prefix, or a layer is a ring.
    pub fn is_recurrent(&self) -> bool {
        self.summarises() || self.kv.layers.iter().any(|l| l.is_ring())
    }

    /// [`crate::Model::truncate`]: `n == position()` and `n == 0` always; any other `n` while
    /// nothing summarises the prefix and no ring has wrapped past it; else only the checkpoint's
    /// position (its copy put back; under [`Rings::Reach`] only while the rings still hold its
    /// window). Anything else is refused and changes nothing.
    pub fn truncate(&mut self, be: &B, n: usize) -> bool {
        let len = self.kv.len;
        if n == len {
            return true;
        }
        if n > len {
            return false;
        }
        if n == 0 {
            return self.clear(be);
        }
        if !self.summarises() && self.kv.truncate(n) {
            // Positions from `n` on will be written again: a checkpoint beyond `n` is stale.
            if self.saved.as_ref().is_some_and(|s| s.pos > n) {
                self.saved = None;
            }
            return true;
        }
        if self.saved.as_ref().is_none_or(|s| s.pos != n) || !self.reaches(n) {
            return false;
        }
        if self.restore(be).is_err() {
            // Part restored, part not: nothing but a cleared state is sound.
            self.clear(be);
            return false;
        }
        true
    }

    /// [`crate::Model::rewind_point`]: the largest position `≤ n` that [`Self::truncate`] can
    /// cut to now.
    pub fn rewind_point(&self, n: usize) -> usize {
        let len = self.kv.len;
        if n >= len {
            return len;
        }
        if !self.summarises() && self.kv.can_truncate(n) {
            return n;
        }
        match &self.saved {
            Some(s) if s.pos <= n && self.reaches(s.pos) => s.pos,
            _ => 0,
        }
    }

    /// Whether the rings still hold the window before position `n` without a copy.
    fn reaches(&self, n: usize) -> bool {
        match self.rings {
            Rings::Copied => true,
            Rings::Reach(reach) => self.kv.len - n <= reach,
        }
    }

    /// [`crate::Model::checkpoint`]: saves what a later [`Self::truncate`] to the current
    /// position needs (the rings under [`Rings::Copied`], the arrays, the compressors' marks),
    /// replacing the previous copy. A backend that cannot copy keeps no checkpoint (follow-ups
    /// then start over).
    pub fn checkpoint(&mut self, be: &B) {
        let previous = self.saved.take();
        self.saved = self.save(be, previous).ok();
    }

    /// Bytes of the whole state: the KV, the arrays and the compressed caches (f32 rows).
    pub fn bytes(&self, be: &B) -> usize {
        let arrays: usize = self
            .layers
            .iter()
            .flat_map(|l| &l.arrays)
            .map(|s| be.state_bytes(s))
            .sum();
        let t = |x: &B::Tensor| 4 * x.rows() * x.cols();
        let compressed: usize = self
            .layers
            .iter()
            .flat_map(|l| &l.compressed)
            .map(|c| {
                t(&c.entries)
                    + t(&c.pending_kv)
                    + t(&c.pending_gate)
                    + c.prior.as_ref().map_or(0, |(k, g)| t(k) + t(g))
            })
            .sum();
        self.kv.bytes() + arrays + compressed
    }

    /// Position 0: no KV rows, arrays zeroed, no compressed entries, no checkpoint. False when
    /// the backend could not zero an array (the sequence is then unusable).
    fn clear(&mut self, be: &B) -> bool {
        self.saved = None;
        self.kv.clear();
        for l in &mut self.layers {
            for c in &mut l.compressed {
                c.count = 0;
                c.pending = 0;
                c.prior = None;
            }
            for s in &mut l.arrays {
                if be.zero_state(s).is_err() {
                    return false;
                }
            }
        }
        true
    }

    /// A copy of the state at the current position, reusing `previous`'s array buffers.
    fn save(&self, be: &B, previous: Option<Saved<B>>) -> Result<Saved<B>, OpError> {
        let rings = match self.rings {
            Rings::Copied => self
                .kv
                .layers
                .iter()
                .map(|l| l.is_ring().then(|| be.kv_clone(l)).transpose())
                .collect::<Result<_, _>>()?,
            Rings::Reach(_) => Vec::new(),
        };
        let mark = |c: &CompressedKv<B>| -> Result<Mark<B>, OpError> {
            Ok(Mark {
                count: c.count,
                pending: c.pending,
                pending_kv: copy(be, &c.pending_kv)?,
                pending_gate: copy(be, &c.pending_gate)?,
                prior: copy_prior(be, &c.prior)?,
            })
        };
        let marks = self
            .layers
            .iter()
            .map(|l| l.compressed.iter().map(mark).collect())
            .collect::<Result<_, OpError>>()?;
        let arrays = match previous {
            Some(mut p) if p.arrays.len() == self.layers.len() => {
                for (saved, live) in p.arrays.iter_mut().zip(&self.layers) {
                    saved.clone_from(&live.arrays);
                }
                p.arrays
            }
            _ => self.layers.iter().map(|l| l.arrays.clone()).collect(),
        };
        Ok(Saved {
            pos: self.kv.len,
            rings,
            arrays,
            marks,
        })
    }

    /// Puts the checkpoint's copy back (it stays, for a later rewind to the same position).
    fn restore(&mut self, be: &B) -> Result<(), OpError> {
        let saved = self.saved.as_ref().expect("a checkpoint to restore");
        for (layer, ring) in self.kv.layers.iter_mut().zip(&saved.rings) {
            if let Some(ring) = ring {
                *layer = be.kv_clone(ring)?;
            }
        }
        for (l, (arrays, marks)) in self
            .layers
            .iter_mut()
            .zip(saved.arrays.iter().zip(&saved.marks))
        {
            l.arrays.clone_from(arrays);
            for (c, m) in l.compressed.iter_mut().zip(marks) {
                c.count = m.count;
                c.pending = m.pending;
                be.set_rows(&mut c.pending_kv, 0, &m.pending_kv)?;
                be.set_rows(&mut c.pending_gate, 0, &m.pending_gate)?;
                c.prior = copy_prior(be, &m.prior)?;
            }
        }
        self.kv.len = saved.pos;
        Ok(())
    }
}

/// An independent copy of `x`.
fn copy<B: Backend>(be: &B, x: &B::Tensor) -> Result<B::Tensor, OpError> {
    be.gather_rows(x, &(0..x.rows()).collect::<Vec<_>>())
}

/// An independent copy of a compressed cache's prior slice.
fn copy_prior<B: Backend>(be: &B, prior: &Prior<B>) -> Result<Prior<B>, OpError> {
    prior
        .as_ref()
        .map(|(k, g)| Ok((copy(be, k)?, copy(be, g)?)))
        .transpose()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use mference_backend::cpu::{CpuBackend, ResidentBytes};
    use mference_backend::{CoreOps, KvCache, KvDtype, RecurrentOps};
    use mference_kernels::Kernels;

    use super::*;

    fn cpu() -> CpuBackend {
        let bytes: ResidentBytes = Arc::new(Vec::<u8>::new());
        CpuBackend::new(Kernels::scalar(), 1, bytes)
    }

    /// One KV layer of `rows` positions (`ring`: a sliding ring).
    fn kv(be: &CpuBackend, rows: usize, ring: bool) -> KvCache<<CpuBackend as CoreOps>::Kv> {
        KvCache::new(vec![be.new_kv(rows, ring, 1, 4, KvDtype::F32).unwrap()])
    }

    #[test]
    fn a_kv_only_state_is_cut_anywhere_until_a_ring_wraps_then_at_its_checkpoint() {
        let be = cpu();
        let mut s = SequenceState::<CpuBackend>::new(kv(&be, 4, true));
        assert!(s.is_recurrent(), "a ring");
        s.kv.len = 3;
        assert_eq!(s.rewind_point(2), 2);
        assert!(s.truncate(&be, 2) && s.kv.len == 2);
        s.kv.len = 3;
        s.checkpoint(&be);
        s.kv.len = 7; // wrapped past everything below 3
        assert_eq!(s.rewind_point(5), 3);
        assert!(!s.truncate(&be, 5), "a cut into wrapped rows");
        assert_eq!(s.kv.len, 7, "a refused cut changes nothing");
        assert!(s.truncate(&be, 3) && s.kv.len == 3, "the checkpoint");
        // The ring is back as it was at 3 (not wrapped): any cut below works again, and the
        // checkpoint above the cut is forgotten.
        assert!(s.truncate(&be, 1) && s.kv.len == 1);
        s.kv.len = 7;
        assert_eq!(s.rewind_point(5), 0);
        assert!(!s.truncate(&be, 3));
        assert!(s.truncate(&be, 7), "the end always");
        assert!(s.truncate(&be, 0) && s.kv.len == 0, "the start always");
    }

    #[test]
    fn arrays_are_cut_only_at_the_checkpoint_which_puts_them_back() {
        let be = cpu();
        let layer = LayerState::arrays(vec![be.new_state(3).unwrap(), be.new_state(2).unwrap()]);
        let mut s = SequenceState::<CpuBackend>::new(kv(&be, 64, false)).with_layers(vec![layer]);
        assert!(s.is_recurrent());
        s.layers[0].arrays[0].copy_from_slice(&[1.0, 2.0, 3.0]);
        s.kv.len = 4;
        assert_eq!(s.rewind_point(2), 0, "no checkpoint yet");
        s.checkpoint(&be);
        s.layers[0].arrays[0].copy_from_slice(&[7.0, 8.0, 9.0]);
        s.layers[0].arrays[1].copy_from_slice(&[5.0, 5.0]);
        s.kv.len = 9;
        assert_eq!(s.rewind_point(8), 4);
        assert_eq!(s.rewind_point(3), 0, "below the checkpoint");
        assert!(!s.truncate(&be, 6), "a recurrent state cannot be cut open");
        assert_eq!((s.kv.len, s.layers[0].arrays[0][0]), (9, 7.0));
        assert!(s.truncate(&be, 4));
        assert_eq!(s.kv.len, 4);
        assert_eq!(s.layers[0].arrays[0], [1.0, 2.0, 3.0]);
        assert_eq!(s.layers[0].arrays[1], [0.0, 0.0]);
        // A second checkpoint reuses the first's buffers and replaces its position.
        s.kv.len = 5;
        s.layers[0].arrays[1][0] = 4.0;
        s.checkpoint(&be);
        s.kv.len = 6;
        assert_eq!(s.rewind_point(5), 5);
        assert!(!s.truncate(&be, 4), "the old checkpoint is gone");
        assert!(s.truncate(&be, 0));
        assert_eq!(s.layers[0].arrays[0], [0.0; 3], "zeroed at 0");
        assert_eq!(s.rewind_point(0), 0);
        assert_eq!(s.bytes(&be), s.kv.bytes() + 4 * 5);
    }

    #[test]
    fn rings_reached_without_a_copy_only_while_the_window_is_still_there() {
        let be = cpu();
        let layer = LayerState::arrays(vec![be.new_state(1).unwrap()]);
        let mut s = SequenceState::<CpuBackend>::new(kv(&be, 8, true))
            .with_layers(vec![layer])
            .with_rings(Rings::Reach(2));
        s.kv.len = 4;
        s.checkpoint(&be);
        s.kv.len = 6;
        assert_eq!(s.rewind_point(5), 4, "2 positions past the checkpoint");
        s.kv.len = 7;
        assert_eq!(
            s.rewind_point(5),
            0,
            "3 past it: the window before it is gone"
        );
        assert!(!s.truncate(&be, 4));
        s.kv.len = 6;
        assert!(s.truncate(&be, 4) && s.kv.len == 4);
    }

    #[test]
    fn compressed_caches_keep_their_entries_and_get_their_marks_back() {
        let be = cpu();
        let cache = CompressedKv::<CpuBackend> {
            entries: be.zeros(4, 2).unwrap(),
            count: 1,
            pending_kv: be.upload(&[1.0, 2.0, 0.0, 0.0], 2).unwrap(),
            pending_gate: be.upload(&[3.0, 4.0, 0.0, 0.0], 2).unwrap(),
            pending: 1,
            prior: None,
        };
        let layer = LayerState::compressed(vec![cache]);
        let mut s = SequenceState::new(kv(&be, 64, false)).with_layers(vec![layer]);
        s.kv.len = 5;
        s.checkpoint(&be);
        let c = &mut s.layers[0].compressed[0];
        (c.count, c.pending) = (2, 0);
        c.pending_kv = be.upload(&[9.0; 4], 2).unwrap();
        c.prior = Some((be.zeros(2, 2).unwrap(), be.zeros(2, 2).unwrap()));
        s.kv.len = 8;
        assert!(!s.truncate(&be, 6));
        assert!(s.truncate(&be, 5));
        let c = &s.layers[0].compressed[0];
        assert_eq!((c.count, c.pending, c.prior.is_none()), (1, 1, true));
        assert_eq!(be.read(&c.pending_kv).unwrap(), [1.0, 2.0, 0.0, 0.0]);
        assert!(s.truncate(&be, 0));
        let c = &s.layers[0].compressed[0];
        assert_eq!((c.count, c.pending), (0, 0));
    }
}
