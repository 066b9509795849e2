//! FP16 KV cache (`docs/ARCHITECTURE.md`, "Who owns which buffer").
//!
//! Sliding-window layers keep a ring of `window + prefill_chunk` rows: a chunk writes all its rows
//! before attending, and its first row still needs the `window - 1` rows before it. Full-attention
//! layers are linear, sized for the requested context. K and V are stored separately because Gemma 4's
//! full layers derive V from the raw K projection with a different norm and no RoPE.

use half::f16;

/// Element type of the KV cache. FP16 is the design default (half the memory); FP32 keeps K and V
/// exactly as computed, for bit-faithful comparisons with an f32 reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    #[default]
    F16,
    F32,
}

impl KvDtype {
    /// Parses `f16|f32`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(Self::F16),
            "f32" => Ok(Self::F32),
            _ => Err(format!(
                "invalid KV cache type '{s}': allowed values are f16, f32"
            )),
        }
    }
}

/// Rows of K or V.
#[derive(Clone)]
enum Store {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

/// One row of K or V for one head.
pub enum KvRow<'a> {
    F16(&'a [f16]),
    F32(&'a [f32]),
}

impl Store {
    fn new(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F16 => Store::F16(vec![f16::ZERO; n]),
            KvDtype::F32 => Store::F32(vec![0.0; n]),
        }
    }

    fn len(&self) -> usize {
        match self {
            Store::F16(v) => v.len(),
            Store::F32(v) => v.len(),
        }
    }

    fn elem_bytes(&self) -> usize {
        match self {
            Store::F16(_) => 2,
            Store::F32(_) => 4,
        }
    }

    fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Store::F16(v) => v[at..at + src.len()]
                .iter_mut()
                .zip(src)
                .for_each(|(d, s)| *d = f16::from_f32(*s)),
            Store::F32(v) => v[at..at + src.len()].copy_from_slice(src),
        }
    }

    /// Everything from element `at` on (several rows, for a caller that knows the stride).
    fn tail(&self, at: usize) -> KvRow<'_> {
        match self {
            Store::F16(v) => KvRow::F16(&v[at..]),
            Store::F32(v) => KvRow::F32(&v[at..]),
        }
    }

    #[inline]
    fn row(&self, at: usize, len: usize) -> KvRow<'_> {
        match self {
            Store::F16(v) => KvRow::F16(&v[at..at + len]),
            Store::F32(v) => KvRow::F32(&v[at..at + len]),
        }
    }
}

/// One layer's K and V rows, each row `[n_kv_heads, head_dim]`.
#[derive(Clone)]
pub struct KvLayer {
    rows: usize,
    ring: bool,
    n_kv_heads: usize,
    head_dim: usize,
    k: Store,
    v: Store,
}

impl KvLayer {
    /// A ring of `rows` rows (sliding window) or a linear buffer of `rows` positions (full attention).
    pub fn new(
        rows: usize,
        ring: bool,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        let n = rows * n_kv_heads * head_dim;
        Self {
            rows,
            ring,
            n_kv_heads,
            head_dim,
            k: Store::new(dtype, n),
            v: Store::new(dtype, n),
        }
    }

    /// Row capacity.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Whether rows are reused in a ring (sliding window).
    pub fn is_ring(&self) -> bool {
        self.ring
    }

    /// Bytes held by K and V.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * self.k.elem_bytes()
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
        self.k.write(r, &k[..w]);
        self.v.write(r, &v[..w]);
    }

    /// K of `head` at absolute position `pos` (`[head_dim]`).
    #[inline]
    pub fn k(&self, pos: usize, head: usize) -> KvRow<'_> {
        let o = (self.row_index(pos) * self.n_kv_heads + head) * self.head_dim;
        self.k.row(o, self.head_dim)
    }

    /// Elements between consecutive positions' rows of one head (`n_kv_heads · head_dim`).
    pub fn row_stride(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// K of `head` for the absolute positions `lo..=hi` (all still cached) in position order, as at
    /// most two runs of consecutive rows (a ring wraps at most once): `(positions in the run, the
    /// store from the run's first row of `head` on)`, rows [`KvLayer::row_stride`] apart.
    pub fn k_runs(
        &self,
        lo: usize,
        hi: usize,
        head: usize,
    ) -> impl Iterator<Item = (usize, KvRow<'_>)> {
        self.runs(&self.k, lo, hi, head)
    }

    /// V of `head` for the positions `lo..=hi`, as [`KvLayer::k_runs`].
    pub fn v_runs(
        &self,
        lo: usize,
        hi: usize,
        head: usize,
    ) -> impl Iterator<Item = (usize, KvRow<'_>)> {
        self.runs(&self.v, lo, hi, head)
    }

    fn runs<'a>(
        &'a self,
        store: &'a Store,
        lo: usize,
        hi: usize,
        head: usize,
    ) -> impl Iterator<Item = (usize, KvRow<'a>)> {
        let n = hi + 1 - lo;
        let r0 = self.row_index(lo);
        let first = if self.ring { n.min(self.rows - r0) } else { n };
        [(first, r0), (n - first, 0)]
            .into_iter()
            .filter(|&(count, _)| count > 0)
            .map(move |(count, r)| {
                let at = (r * self.n_kv_heads + head) * self.head_dim;
                (count, store.tail(at))
            })
    }

    /// V of `head` at absolute position `pos` (`[head_dim]`).
    #[inline]
    pub fn v(&self, pos: usize, head: usize) -> KvRow<'_> {
        let o = (self.row_index(pos) * self.n_kv_heads + head) * self.head_dim;
        self.v.row(o, self.head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `k_runs` / `v_runs` walk the same rows as `k` / `v(pos, head)` position by position, wrapped
    /// ring included.
    #[test]
    fn k_and_v_runs_cover_the_positions_in_order() {
        for (rows, ring, lo, hi) in [
            (5, true, 8, 12),
            (5, true, 10, 12),
            (5, true, 9, 9),
            (16, false, 3, 11),
        ] {
            let mut l = KvLayer::new(rows, ring, 2, 4, KvDtype::F32);
            for pos in 0..=hi {
                let v: Vec<f32> = (0..8).map(|i| (pos * 10 + i) as f32).collect();
                let k: Vec<f32> = v.iter().map(|x| -x).collect();
                l.write(pos, &k, &v);
            }
            for head in 0..2 {
                let mut seen = Vec::new();
                for (count, run) in l.v_runs(lo, hi, head) {
                    let KvRow::F32(r) = run else { panic!("dtype") };
                    for i in 0..count {
                        seen.push(r[i * l.row_stride()..i * l.row_stride() + 4].to_vec());
                    }
                }
                let want: Vec<Vec<f32>> = (lo..=hi)
                    .map(|pos| match l.v(pos, head) {
                        KvRow::F32(r) => r.to_vec(),
                        KvRow::F16(_) => panic!("dtype"),
                    })
                    .collect();
                assert_eq!(
                    seen, want,
                    "rows {rows} ring {ring} {lo}..={hi} head {head}"
                );
                let stride = l.row_stride();
                let mut ks = Vec::new();
                for (count, run) in l.k_runs(lo, hi, head) {
                    let KvRow::F32(r) = run else { panic!("dtype") };
                    ks.extend((0..count).map(|i| r[i * stride]));
                }
                let kw: Vec<f32> = want.iter().map(|v| -v[0]).collect();
                assert_eq!(
                    ks, kw,
                    "K runs: rows {rows} ring {ring} {lo}..={hi} head {head}"
                );
            }
        }
    }

    #[test]
    fn ring_keeps_the_last_rows() {
        let mut l = KvLayer::new(5, true, 2, 4, KvDtype::F16);
        for pos in 0..13 {
            let k: Vec<f32> = (0..8).map(|i| (pos * 10 + i) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            l.write(pos, &k, &v);
        }
        for pos in 8..13 {
            let (KvRow::F16(k), KvRow::F16(v)) = (l.k(pos, 1), l.v(pos, 0)) else {
                panic!("dtype")
            };
            assert_eq!(k[0].to_f32(), (pos * 10 + 4) as f32);
            assert_eq!(v[3].to_f32(), -((pos * 10 + 3) as f32));
        }
    }
}
