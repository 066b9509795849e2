//! Per-sequence state that a family keeps beside its KV cache, and how it is rewound.

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
