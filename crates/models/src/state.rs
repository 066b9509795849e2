//! Per-sequence state that a family keeps beside its KV cache, and how it is rewound.

use mference_backend::{Backend, KvCache, KvState};

/// One saved copy of a family's recurrent state `S` and the position it describes
/// ([`crate::Model::checkpoint`]): the cut rules of a model whose state cannot be cut open.
pub struct Snapshot<S> {
    saved: Option<(usize, S)>,
}

impl<S: Clone> Snapshot<S> {
    pub fn new() -> Self {
        Self { saved: None }
    }

    /// Keeps a copy of `state` as it is at position `pos` (replacing the previous one in place).
    pub fn save(&mut self, pos: usize, state: &S) {
        match &mut self.saved {
            Some((p, s)) => {
                *p = pos;
                s.clone_from(state);
            }
            None => self.saved = Some((pos, state.clone())),
        }
    }

    /// Forgets the copy (the prefix it described is gone).
    pub fn forget(&mut self) {
        self.saved = None;
    }

    /// Whether the copy describes position `n`.
    pub fn is_at(&self, n: usize) -> bool {
        matches!(self.saved, Some((p, _)) if p == n)
    }

    /// Copies the saved state into `state`, if the copy describes position `n`.
    pub fn restore(&self, n: usize, state: &mut S) -> bool {
        match &self.saved {
            Some((p, s)) if *p == n => {
                state.clone_from(s);
                true
            }
            _ => false,
        }
    }

    /// [`crate::Model::rewind_point`] of a model at position `len`: `len` itself, the checkpoint
    /// if it is at or below `n`, else 0.
    pub fn rewind_point(&self, n: usize, len: usize) -> usize {
        match self.saved {
            _ if n >= len => len,
            Some((p, _)) if p <= n && p <= len => p,
            _ => 0,
        }
    }
}

impl<S: Clone> Default for Snapshot<S> {
    fn default() -> Self {
        Self::new()
    }
}

/// One saved copy of the sliding-window rings of a KV cache ([`crate::Model::checkpoint`]): the
/// cut rules of a family whose whole state is its KV cache (Gemma 4, Maple), so a follow-up turn
/// can rewind after the rings have wrapped. Full layers are never copied: their rows below a cut
/// are never overwritten.
pub struct RingSnapshot<B: Backend> {
    /// The position and a copy of every ring (`None` for full layers).
    saved: Option<(usize, Vec<Option<B::Kv>>)>,
}

impl<B: Backend> Default for RingSnapshot<B> {
    fn default() -> Self {
        Self { saved: None }
    }
}

impl<B: Backend> RingSnapshot<B> {
    /// [`crate::Model::truncate`]: any `n` while no ring has wrapped past it, else only the
    /// checkpoint's position (its rings copied back).
    pub fn truncate(&mut self, be: &B, kv: &mut KvCache<B::Kv>, n: usize) -> bool {
        if kv.truncate(n) {
            // Positions from `n` on will be written again: a checkpoint beyond `n` is stale.
            if self.saved.as_ref().is_some_and(|(p, _)| *p > n) {
                self.saved = None;
            }
            return true;
        }
        // The rings have wrapped past `n`: only the checkpoint's copy holds their rows.
        let Some((pos, rings)) = &self.saved else {
            return false;
        };
        if *pos != n || n > kv.len {
            return false;
        }
        for (layer, ring) in kv.layers.iter_mut().zip(rings) {
            if let Some(ring) = ring {
                match be.kv_clone(ring) {
                    Ok(copy) => *layer = copy,
                    Err(_) => {
                        // Some rings restored, some not: nothing but a cleared cache is sound.
                        kv.clear();
                        return false;
                    }
                }
            }
        }
        kv.len = n;
        true
    }

    /// [`crate::Model::checkpoint`]: copies every ring.
    pub fn checkpoint(&mut self, be: &B, kv: &KvCache<B::Kv>) {
        let rings: Result<Vec<Option<B::Kv>>, _> = kv
            .layers
            .iter()
            .map(|l| l.is_ring().then(|| be.kv_clone(l)).transpose())
            .collect();
        // A backend that cannot copy its KV keeps no checkpoint (follow-ups then start over).
        self.saved = rings.ok().map(|r| (kv.len, r));
    }

    /// [`crate::Model::is_recurrent`]: whether any layer is a ring.
    pub fn is_recurrent(kv: &KvCache<B::Kv>) -> bool {
        kv.layers.iter().any(|l| l.is_ring())
    }

    /// [`crate::Model::rewind_point`].
    pub fn rewind_point(&self, kv: &KvCache<B::Kv>, n: usize) -> usize {
        let n = n.min(kv.len);
        match &self.saved {
            _ if kv.can_truncate(n) => n,
            Some((pos, _)) if *pos <= n && *pos <= kv.len => *pos,
            _ => 0,
        }
    }
}
