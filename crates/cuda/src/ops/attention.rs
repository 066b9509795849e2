//! RoPE, the KV cache and causal attention (kernels: attention.cu).

use crate::*;

impl CudaBackend {
    pub(crate) fn new_kv(
        &self,
        rows: usize,
        ring: bool,
        n_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> OpResult<CudaKv> {
        let op = "new_kv";
        let n = rows * n_kv_heads * head_dim;
        let store = || -> OpResult<Store> {
            Ok(match dtype {
                KvDtype::F16 => {
                    Store::F16(self.stream.alloc_zeros(n).map_err(|e| self.dev(op, e))?)
                }
                KvDtype::F32 => Store::F32(self.zeros_f32(op, n)?),
            })
        };
        Ok(CudaKv {
            rows,
            ring,
            n_kv_heads,
            head_dim,
            k: store()?,
            v: store()?,
        })
    }

    pub(crate) fn rope(
        &self,
        x: &mut CudaTensor,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
    ) -> OpResult<()> {
        self.rope_rows("rope", x, rope, head_dim, pos0, None)
    }

    /// RoPE of row `r` of `x` at `positions[r]` when given, else at `pos0 + r` (`rope`).
    pub(crate) fn rope_rows(
        &self,
        op: &'static str,
        x: &mut CudaTensor,
        rope: &Rope,
        head_dim: usize,
        pos0: usize,
        positions: Option<&[usize]>,
    ) -> OpResult<()> {
        check(op, positions.is_none_or(|p| p.len() == x.rows), || {
            format!(
                "{:?} positions for {} rows",
                positions.map(<[_]>::len),
                x.rows
            )
        })?;
        let Some((freq, style)) = self.rope_args(op, x, rope, head_dim)? else {
            return Ok(());
        };
        let pos = match positions {
            Some(p) => {
                let p: Vec<i32> = p.iter().map(|&v| v as i32).collect();
                Some(self.to_device(op, &p)?)
            }
            None => None,
        };
        let pos_at = pos.as_ref().map_or(0, |p| self.addr(p));
        let (t, cols, hd, rot, p0) = (
            x.rows as u64,
            x.cols as i32,
            head_dim as i32,
            rope.rotated as i32,
            pos0 as i32,
        );
        let n = x.rows * (x.cols / head_dim) * (rope.rotated / 2);
        launch!(
            self,
            op,
            "rope",
            elems(n),
            &mut *x.buf,
            &t,
            &cols,
            &hd,
            &rot,
            &style,
            &*freq,
            &p0,
            &pos_at,
            &rope.mscale
        )
    }

    pub(crate) fn kv_clone(&self, kv: &CudaKv) -> OpResult<CudaKv> {
        let op = "kv_clone";
        let copy = |s: &Store| -> OpResult<Store> {
            Ok(match s {
                Store::F16(x) => {
                    Store::F16(self.stream.clone_dtod(x).map_err(|e| self.dev(op, e))?)
                }
                Store::F32(x) => {
                    Store::F32(self.stream.clone_dtod(x).map_err(|e| self.dev(op, e))?)
                }
            })
        };
        Ok(CudaKv {
            rows: kv.rows,
            ring: kv.ring,
            n_kv_heads: kv.n_kv_heads,
            head_dim: kv.head_dim,
            k: copy(&kv.k)?,
            v: copy(&kv.v)?,
        })
    }

    pub(crate) fn kv_write(
        &self,
        kv: &mut CudaKv,
        pos0: usize,
        k: &CudaTensor,
        v: &CudaTensor,
    ) -> OpResult<()> {
        let op = "kv_write";
        same_shape(op, k, v)?;
        let w = kv.width();
        check(op, k.cols == w, || {
            format!("rows of {} into a KV row of {w}", k.cols)
        })?;
        check_kv_room(op, kv, pos0, k.rows)?;
        let (t, wi, rows, ring, p0) = (
            k.rows as i32,
            w as i32,
            kv.rows as i32,
            kv.ring as i32,
            pos0 as i32,
        );
        let (kernel, ks, vs) = self.kv_ptrs(kv, "kv_write_f16", "kv_write_f32");
        launch!(
            self,
            op,
            kernel,
            elems(k.len()),
            &ks,
            &vs,
            &*k.buf,
            &*v.buf,
            &t,
            &wi,
            &rows,
            &ring,
            &p0
        )
    }

    pub(crate) fn attention(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        pos0: usize,
        s: &AttnShape,
    ) -> OpResult<CudaTensor> {
        self.attention_with("attention", q, kv, pos0, s, None, None)
    }

    /// [`CudaBackend::attention`], with Inkling's relative-position bias when `bias` is given
    /// (`attention_rel`: `d_rel` <= 32), and with DeepSeek-V4's compressed entries when `sparse`
    /// is: row `r` also attends to the rows `visible[r]` of `entries` (K = V; `attention_sparse`,
    /// always the split kernel, the entries one more part of each row).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_with(
        &self,
        op: &'static str,
        q: &CudaTensor,
        kv: &CudaKv,
        pos0: usize,
        s: &AttnShape,
        bias: Option<&RelBias<CudaTensor>>,
        sparse: Option<(&CudaTensor, &[Vec<usize>])>,
    ) -> OpResult<CudaTensor> {
        check(
            op,
            q.cols == s.n_heads * s.head_dim
                && s.n_kv_heads > 0
                && s.n_heads.is_multiple_of(s.n_kv_heads)
                && kv.width() == s.n_kv_heads * s.head_dim
                && s.head_dim <= ATTN_MAX_HEAD_DIM
                && s.sinks.as_ref().is_none_or(|v| v.len() == s.n_heads),
            || {
                format!(
                    "q rows of {} for {} heads of {} (at most {ATTN_MAX_HEAD_DIM}) over KV rows of {}",
                    q.cols,
                    s.n_heads,
                    s.head_dim,
                    kv.width()
                )
            },
        )?;
        let ra = self.rel_args(op, q, s, bias)?;
        check(
            op,
            if kv.ring {
                s.window.is_some()
            } else {
                pos0 + q.rows <= kv.rows
            },
            || {
                format!(
                    "positions {pos0}..{} over a {}-row {} KV cache (window {:?})",
                    pos0 + q.rows,
                    kv.rows,
                    if kv.ring { "ring" } else { "linear" },
                    s.window
                )
            },
        )?;
        let sinks = match &s.sinks {
            Some(v) => Some(self.constant(op, v)?),
            None => None,
        };
        let sp = sinks.as_deref().map_or(0, |b| self.addr(b));
        let mut out = self.uninit_tensor(op, q.rows, q.cols)?;
        // Few (row, head) items (decode): the visible positions are cut into runs of about
        // ATTN_SPLIT_POSITIONS, one block each, merged by a second kernel.
        let items = q.rows * s.n_heads;
        let last = pos0 + q.rows - 1;
        let visible = match s.window {
            Some(w) => (last + 1).min(w),
            None => last + 1,
        };
        if q.rows > 1
            && items >= ATTN_SPLIT_BELOW_ITEMS
            && s.head_dim.is_multiple_of(4)
            && sparse.is_none()
            && tiled()
        {
            return self.attention_tiled(op, q, kv, pos0, s, sp, ra, out);
        }
        // The entries' part: their rows' offsets into one list of indices.
        let (sa, _lists) = self.sparse_args(op, q, kv, sparse)?;
        let splits = if items >= ATTN_SPLIT_BELOW_ITEMS {
            1
        } else {
            visible
                .div_ceil(ATTN_SPLIT_POSITIONS)
                .clamp(1, ATTN_MAX_SPLITS)
        };
        let n_parts = splits + sparse.is_some() as usize;
        // (maximum, sum) per part, then each part's output row.
        let parts = self.uninit_tensor(op, items * n_parts, s.head_dim + 2)?;
        let pa = self.addr(&*parts.buf);
        let (pm, pl, po) = (
            pa,
            pa + (4 * items * n_parts) as u64,
            pa + (8 * items * n_parts) as u64,
        );
        let [t, nh, nkv, d, rows, ring, p0, win] = attn_ints(q, kv, pos0, s);
        let (ni, si, pi) = (items as i32, splits as i32, n_parts as i32);
        let (kernel, ks, vs) = self.kv_ptrs(kv, "attention_f16", "attention_f32");
        launch!(
            self,
            op,
            kernel,
            LaunchConfig {
                grid_dim: (items as u32, n_parts as u32, 1),
                block_dim: (32 * ATTN_WARPS, 1, 1),
                shared_mem_bytes: 0,
            },
            &*q.buf,
            &ks,
            &vs,
            &t,
            &nh,
            &nkv,
            &d,
            &rows,
            &ring,
            &p0,
            &win,
            &s.scale,
            &si,
            &ra,
            &sa,
            &pm,
            &pl,
            &po
        )?;
        launch!(
            self,
            op,
            "attention_merge",
            blocks(items, 256),
            &pm,
            &pl,
            &po,
            &ni,
            &nh,
            &d,
            &pi,
            &sp,
            &mut *out.buf
        )?;
        Ok(out)
    }

    /// [`attention`](Self::attention) over many (row, head) items (prefill) with heads of a
    /// multiple of 4: one `attention_tiled` launch (ops/attention.cu), blocks of `AT_ITEMS` items
    /// of one KV head's group sharing each K and V row through shared memory. `sp`: the sinks'
    /// device address or 0.
    #[allow(clippy::too_many_arguments)]
    fn attention_tiled(
        &self,
        op: &'static str,
        q: &CudaTensor,
        kv: &CudaKv,
        pos0: usize,
        s: &AttnShape,
        sp: u64,
        ra: RelArgs,
        mut out: CudaTensor,
    ) -> OpResult<CudaTensor> {
        let group_items = q.rows * (s.n_heads / s.n_kv_heads);
        let [t, nh, nkv, d, rows, ring, p0, win] = attn_ints(q, kv, pos0, s);
        // Dims of a head per lane: 4, 8 or 16 (a kernel each).
        let names = match s.head_dim {
            0..=128 => ("attention_tiled4_f16", "attention_tiled4_f32"),
            129..=256 => ("attention_tiled8_f16", "attention_tiled8_f32"),
            _ => ("attention_tiled16_f16", "attention_tiled16_f32"),
        };
        let (kernel, ks, vs) = self.kv_ptrs(kv, names.0, names.1);
        launch!(
            self,
            op,
            kernel,
            LaunchConfig {
                grid_dim: (
                    group_items.div_ceil(AT_ITEMS) as u32,
                    s.n_kv_heads as u32,
                    1
                ),
                block_dim: (32 * AT_WARPS, 1, 1),
                shared_mem_bytes: 0,
            },
            &*q.buf,
            &ks,
            &vs,
            &t,
            &nh,
            &nkv,
            &d,
            &rows,
            &ring,
            &p0,
            &win,
            &s.scale,
            &sp,
            &ra,
            &mut *out.buf
        )?;
        Ok(out)
    }

    /// The kernels' [`SparseArgs`] for `sparse` (zero without it) and the device lists they point
    /// into (kept alive until the launch is queued), its operands checked against `q` and `kv`.
    #[allow(clippy::type_complexity)]
    fn sparse_args(
        &self,
        op: &'static str,
        q: &CudaTensor,
        kv: &CudaKv,
        sparse: Option<(&CudaTensor, &[Vec<usize>])>,
    ) -> OpResult<(SparseArgs, Option<(CudaSlice<i32>, CudaSlice<i32>)>)> {
        let Some((entries, visible)) = sparse else {
            return Ok((SparseArgs::default(), None));
        };
        check(
            op,
            entries.cols == kv.width()
                && visible.len() == q.rows
                && visible.iter().flatten().all(|&e| e < entries.rows),
            || {
                format!(
                    "{} entries of {} for KV rows of {}, {} visible lists for {} rows",
                    entries.rows,
                    entries.cols,
                    kv.width(),
                    visible.len(),
                    q.rows
                )
            },
        )?;
        let mut off = Vec::with_capacity(visible.len() + 1);
        off.push(0i32);
        let mut idx = Vec::new();
        for v in visible {
            idx.extend(v.iter().map(|&e| e as i32));
            off.push(idx.len() as i32);
        }
        idx.push(0); // never empty
        let (off, idx) = (self.to_device(op, &off)?, self.to_device(op, &idx)?);
        let sa = SparseArgs {
            ent: self.addr(&*entries.buf),
            vis_off: self.addr(&off),
            vis_idx: self.addr(&idx),
        };
        Ok((sa, Some((off, idx))))
    }

    /// The kernels' [`RelArgs`] for `bias` (zero without one), its operands checked against `q`.
    fn rel_args(
        &self,
        op: &'static str,
        q: &CudaTensor,
        s: &AttnShape,
        bias: Option<&RelBias<CudaTensor>>,
    ) -> OpResult<RelArgs> {
        let Some(b) = bias else {
            return Ok(RelArgs::default());
        };
        let (d_rel, extent) = (b.proj.rows, b.proj.cols);
        check(
            op,
            (1..=32).contains(&d_rel)
                && b.rel.rows == q.rows
                && b.rel.cols == s.n_heads * d_rel
                && b.log_scaling.is_none_or(|l| l.n_floor > 0.0),
            || {
                format!(
                    "rel [{}, {}] for {} rows of {} heads with d_rel {d_rel} (at most 32), \
                     log scaling {:?} (n_floor > 0)",
                    b.rel.rows,
                    b.rel.cols,
                    q.rows,
                    s.n_heads,
                    b.log_scaling.map(|l| l.n_floor)
                )
            },
        )?;
        let (alpha, n_floor) = b.log_scaling.map_or((0.0, 0.0), |l| (l.alpha, l.n_floor));
        Ok(RelArgs {
            rel: self.addr(&*b.rel.buf),
            proj: self.addr(&*b.proj.buf),
            d_rel: d_rel as i32,
            extent: extent as i32,
            alpha,
            n_floor,
        })
    }

    /// RoPE's checks, and its kernel arguments (frequencies on the device, style code); `None`
    /// when nothing rotates.
    pub(crate) fn rope_args(
        &self,
        op: &'static str,
        x: &CudaTensor,
        rope: &Rope,
        head_dim: usize,
    ) -> OpResult<Option<(Arc<CudaSlice<f32>>, i32)>> {
        check(
            op,
            head_dim > 0
                && x.cols.is_multiple_of(head_dim)
                && rope.rotated <= head_dim
                && rope.inv_freq.len() == rope.rotated / 2,
            || {
                format!(
                    "heads of {head_dim} (rotating {}, {} frequencies) in rows of {}",
                    rope.rotated,
                    rope.inv_freq.len(),
                    x.cols
                )
            },
        )?;
        if rope.inv_freq.is_empty() {
            return Ok(None);
        }
        let style = match rope.style {
            RopeStyle::NeoX => 0i32,
            RopeStyle::Interleaved => 1,
        };
        Ok(Some((self.constant(op, &rope.inv_freq)?, style)))
    }
}

/// Whether prefill attention runs on `attention_tiled` (the default) or, with
/// `MFERENCE_CUDA_ATTN=rows`, on the block-per-(row, head) kernel decode uses (for
/// measurements). Read once per process.
fn tiled() -> bool {
    static T: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *T.get_or_init(|| std::env::var("MFERENCE_CUDA_ATTN").as_deref() != Ok("rows"))
}

/// The attention kernels' int arguments: rows of q, heads, KV heads, head size, KV rows, ring,
/// first position, window (0: none).
fn attn_ints(q: &CudaTensor, kv: &CudaKv, pos0: usize, s: &AttnShape) -> [i32; 8] {
    [
        q.rows as i32,
        s.n_heads as i32,
        s.n_kv_heads as i32,
        s.head_dim as i32,
        kv.rows as i32,
        kv.ring as i32,
        pos0 as i32,
        s.window.unwrap_or(0) as i32,
    ]
}

/// A linear KV cache has room for `t` rows from `pos0` (a ring always has).
pub(crate) fn check_kv_room(op: &'static str, kv: &CudaKv, pos0: usize, t: usize) -> OpResult<()> {
    check(op, kv.ring || pos0 + t <= kv.rows, || {
        format!(
            "positions {pos0}..{} beyond the {}-row KV cache",
            pos0 + t,
            kv.rows
        )
    })
}
