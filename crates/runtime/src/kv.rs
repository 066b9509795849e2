//! FP16 KV cache (`shared/docs/DESIGN.md` §3).
//!
//! Sliding-window layers keep a ring of `window + prefill_chunk` rows: a chunk writes all its rows
//! before attending, and its first row still needs the `window - 1` rows before it. Full-attention
//! layers are linear, sized for the requested context. K and V are stored separately because Gemma 4's
//! full layers derive V from the raw K projection with a different norm and no RoPE.

use half::f16;

/// One layer's K and V rows, each row `[n_kv_heads, head_dim]` in FP16.
pub struct KvLayer {
    rows: usize,
    ring: bool,
    n_kv_heads: usize,
    head_dim: usize,
    k: Vec<f16>,
    v: Vec<f16>,
}

impl KvLayer {
    /// A ring of `rows` rows (sliding window) or a linear buffer of `rows` positions (full attention).
    pub fn new(rows: usize, ring: bool, n_kv_heads: usize, head_dim: usize) -> Self {
        let n = rows * n_kv_heads * head_dim;
        Self {
            rows,
            ring,
            n_kv_heads,
            head_dim,
            k: vec![f16::ZERO; n],
            v: vec![f16::ZERO; n],
        }
    }

    /// Row capacity.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held by K and V.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * 2
    }

    fn row_index(&self, pos: usize) -> usize {
        if self.ring {
            pos % self.rows
        } else {
            assert!(
                pos < self.rows,
                "position {pos} beyond the {}-row KV cache",
                self.rows
            );
            pos
        }
    }

    /// Stores K and V (each `[n_kv_heads * head_dim]`, f32) for absolute position `pos`.
    pub fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let w = self.n_kv_heads * self.head_dim;
        let r = self.row_index(pos) * w;
        for (d, s) in self.k[r..r + w].iter_mut().zip(k) {
            *d = f16::from_f32(*s);
        }
        for (d, s) in self.v[r..r + w].iter_mut().zip(v) {
            *d = f16::from_f32(*s);
        }
    }

    /// K of `head` at absolute position `pos` (`[head_dim]`).
    #[inline]
    pub fn k(&self, pos: usize, head: usize) -> &[f16] {
        let o = (self.row_index(pos) * self.n_kv_heads + head) * self.head_dim;
        &self.k[o..o + self.head_dim]
    }

    /// V of `head` at absolute position `pos` (`[head_dim]`).
    #[inline]
    pub fn v(&self, pos: usize, head: usize) -> &[f16] {
        let o = (self.row_index(pos) * self.n_kv_heads + head) * self.head_dim;
        &self.v[o..o + self.head_dim]
    }
}

/// Every layer's KV rows plus the number of positions already cached.
pub struct KvCache {
    pub layers: Vec<KvLayer>,
    /// Positions written so far (the next token's position).
    pub len: usize,
}

impl KvCache {
    /// Total bytes of K and V.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(KvLayer::bytes).sum()
    }

    /// Forgets every cached position (capacity is kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Keeps the first `n` positions (for a retained prefix). Ring layers can only be truncated
    /// when no row of the kept prefix has been overwritten.
    pub fn truncate(&mut self, n: usize) -> bool {
        let ok = self.layers.iter().all(|l| !l.ring || self.len <= l.rows);
        if ok && n <= self.len {
            self.len = n;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_last_rows() {
        let mut l = KvLayer::new(5, true, 2, 4);
        for pos in 0..13 {
            let k: Vec<f32> = (0..8).map(|i| (pos * 10 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            l.write(pos, &k, &v);
        }
        for pos in 8..13 {
            assert_eq!(l.k(pos, 1)[0].to_f32(), (pos * 10 + 4) as f32);
            assert_eq!(l.v(pos, 0)[3].to_f32(), -((pos * 10 + 3) as f32));
        }
    }
}
