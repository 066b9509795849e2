//! The per-sequence KV cache: one backend-owned [`KvState`] per attention layer plus the number of
//! positions cached.

/// What the sequence needs to know about one layer's KV store.
pub trait KvState {
    /// Row capacity (positions for a linear layer, ring rows for a sliding one).
    fn rows(&self) -> usize;
    /// Whether rows are reused in a ring (sliding window).
    fn is_ring(&self) -> bool;
    /// Bytes of K and V.
    fn bytes(&self) -> usize;
}

impl KvState for mference_runtime::KvLayer {
    fn rows(&self) -> usize {
        mference_runtime::KvLayer::rows(self)
    }
    fn is_ring(&self) -> bool {
        mference_runtime::KvLayer::is_ring(self)
    }
    fn bytes(&self) -> usize {
        mference_runtime::KvLayer::bytes(self)
    }
}

/// Every attention layer's KV store plus the number of positions already cached.
pub struct KvCache<K> {
    pub layers: Vec<K>,
    /// Positions written so far (the next token's position).
    pub len: usize,
}

impl<K: KvState> KvCache<K> {
    pub fn new(layers: Vec<K>) -> Self {
        Self { layers, len: 0 }
    }

    /// Total bytes of K and V.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvState::bytes).sum()
    }

    /// Forgets every cached position (capacity is kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keeps the first `n` positions (for a retained prefix). Ring layers can only be truncated
    /// when no row of the kept prefix has been overwritten; `n == 0` (keep nothing) always works.
    pub fn truncate(&mut self, n: usize) -> bool {
        if self.can_truncate(n) {
            self.len = n;
            true
        } else {
            false
        }
    }

    /// Whether [`KvCache::truncate`] to `n` would succeed.
    pub fn can_truncate(&self, n: usize) -> bool {
        n <= self.len
            && (n == 0
                || self
                    .layers
                    .iter()
                    .all(|l| !l.is_ring() || self.len <= l.rows()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mference_runtime::{KvDtype, KvLayer};

    #[test]
    fn truncate_refuses_a_wrapped_ring_except_to_zero() {
        let mut c = KvCache::new(vec![KvLayer::new(4, true, 1, 2, KvDtype::F16)]);
        c.len = 3;
        assert!(c.truncate(2) && c.len == 2);
        c.len = 6; // positions 4 and 5 overwrote rows 0 and 1
        assert!(!c.truncate(3));
        assert_eq!(c.len, 6);
        assert!(c.truncate(0) && c.len == 0);
    }
}
