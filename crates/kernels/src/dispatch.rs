//! The kernel table: one set of function pointers per instruction set, chosen once at startup.

use std::cell::RefCell;
use std::sync::OnceLock;

use half::f16;

use crate::prepared::{PreparedX, XLayout, AMX_MIN_ROWS, Q8_MIN_ROWS};
use crate::{scalar, QMatrix};

pub(crate) type GemvFn = fn(&QMatrix, &PreparedX, &mut [f32], usize, usize);
pub(crate) type DotFn = fn(&[f32], &[f32]) -> f32;
pub(crate) type AxpyFn = fn(f32, &[f32], &mut [f32]);
pub(crate) type ToF16Fn = fn(&[f32], &mut [f16]);
pub(crate) type FromF16Fn = fn(&[f16], &mut [f32]);
pub(crate) type DotF16Fn = fn(&[f32], &[f16]) -> f32;
pub(crate) type AxpyF16Fn = fn(f32, &[f16], &mut [f32]);
pub(crate) type WsumF16Fn = fn(&[f32], &[f16], usize, &mut [f32]);
pub(crate) type DotsF16Fn = fn(&[f32], &[f16], usize, &mut [f32]);
/// `(q, g, rows, stride, n, out, ld)`: [`Kernels::dots_f16_group`]; `None` when not done.
pub(crate) type DotsGroupFn = fn(&[f32], usize, &[f16], usize, usize, &mut [f32], usize) -> bool;
/// `(w, ld, n, rows, stride, out, g)`: [`Kernels::wsum_f16_group`]; `None` when not done.
pub(crate) type WsumGroupFn = fn(&[f32], usize, usize, &[f16], usize, &mut [f32], usize) -> bool;

/// Kernel table picked once at startup (scalar / avx2 / avx512), function pointers.
///
/// Obtain with [`Kernels::detect`] (best available, overridable with `MFERENCE_KERNELS=<table>`),
/// [`Kernels::scalar`] (the reference), or [`Kernels::by_name`]. All methods panic on shape mismatches
/// (programming errors), never on data values.
pub struct Kernels {
    pub(crate) name: &'static str,
    /// Layout of prepared activations for 4-bit matrices (8-bit always uses natural order).
    pub(crate) layout4: XLayout,
    /// Layout of prepared activations for 2-bit matrices (never int8-quantized: `q8` is 4-bit only).
    pub(crate) layout2: XLayout,
    /// 4-bit GEMM with group size 64/128 and at least `Q8_MIN_ROWS` rows uses int8-quantized
    /// activations (`XLayout::Q8Lanes16`).
    pub(crate) q8: bool,
    /// 4-bit products with group size 64/128 take int16 activations (`q16_gemv`, and
    /// `XLayout::Q16Lanes16` from `q16_lanes` tokens), GEMV and GEMM alike.
    pub(crate) q16: bool,
    /// With `q16`: from this many tokens the GEMM takes `XLayout::Q16Lanes16` (16 tokens a block;
    /// `Q16_MIN_ROWS` for AVX-512, fewer for AVX2's 8-token registers); `None`: every batch stays
    /// `XLayout::Q16EvenOdd64`.
    pub(crate) q16_lanes: Option<usize>,
    /// With `q16`: the layout of the int16 GEMV's activations (below `q16_lanes` tokens):
    /// `XLayout::Q16EvenOdd64`, or `XLayout::Q16Nib64` (`avx2i16`).
    pub(crate) q16_gemv: XLayout,
    /// With `q16`: the GEMM from `Q16_MIN_ROWS` tokens runs on AMX tiles (`XLayout::Q16Amx`), with
    /// the same bits as the int16 GEMV.
    pub(crate) amx: bool,
    /// What the table rounds beyond f32 arithmetic, in words for the load line; `None` for the
    /// exact tables (errors are f32 rounding only), the only ones `detect()` picks.
    pub(crate) rounding: Option<&'static str>,
    pub(crate) gemv: GemvFn,
    pub(crate) gemm: GemvFn,
    pub(crate) dot_f32: DotFn,
    pub(crate) axpy: AxpyFn,
    pub(crate) f32_to_f16: ToF16Fn,
    pub(crate) f16_to_f32: FromF16Fn,
    pub(crate) dot_f16: DotF16Fn,
    pub(crate) axpy_f16: AxpyF16Fn,
    /// A register-blocked [`Kernels::wsum_f16`]; `None` loops over `axpy_f16`.
    pub(crate) wsum_f16: Option<WsumF16Fn>,
    /// A [`Kernels::dots_f16`] that keeps the query in registers; `None` loops over `dot_f16`.
    pub(crate) dots_f16: Option<DotsF16Fn>,
    /// A [`Kernels::dots_f16_group`] that converts each row once for every query (returns false
    /// for a shape it does not cover); `None` loops over `dots_f16`.
    pub(crate) dots_f16_group: Option<DotsGroupFn>,
    /// A [`Kernels::wsum_f16_group`] that converts each row once for every output (returns
    /// false for a shape it does not cover); `None` loops over `wsum_f16`.
    pub(crate) wsum_f16_group: Option<WsumGroupFn>,
}

static SCALAR: Kernels = Kernels {
    name: "scalar",
    layout4: XLayout::Natural,
    layout2: XLayout::Natural,
    q8: false,
    q16: false,
    q16_lanes: None,
    q16_gemv: XLayout::Q16EvenOdd64,
    amx: false,
    rounding: None,
    gemv: scalar::gemv,
    gemm: scalar::gemm,
    dot_f32: scalar::dot_f32,
    axpy: scalar::axpy,
    f32_to_f16: scalar::f32_to_f16,
    f16_to_f32: scalar::f16_to_f32,
    dot_f16: scalar::dot_f16,
    axpy_f16: scalar::axpy_f16,
    wsum_f16: None,
    dots_f16: None,
    dots_f16_group: None,
    wsum_f16_group: None,
};

thread_local! {
    static SCRATCH: RefCell<PreparedX> = RefCell::new(PreparedX::new());
}

/// Runs `f` with this thread's scratch `PreparedX` (a fresh one if it is already borrowed).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut PreparedX) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut p) => f(&mut p),
        Err(_) => f(&mut PreparedX::new()),
    })
}

impl Kernels {
    /// The best table for this CPU, detected once (`is_x86_feature_detected!`) and cached.
    ///
    /// Only exact (pure f32) tables are picked here ([`Kernels::detect_int16`] is the int16 choice
    /// for the families checked with it). The environment variable `MFERENCE_KERNELS`
    /// (`scalar`, `avx2`, `avx512`, `avx512vnni`) forces a table if the CPU supports it (for debugging and A/B
    /// benchmarks); an unknown or unsupported value is said on stderr and falls back to detection.
    pub fn detect() -> &'static Kernels {
        static PICK: OnceLock<&'static Kernels> = OnceLock::new();
        PICK.get_or_init(|| Self::forced_by_env().unwrap_or_else(Self::best_exact))
    }

    /// The fastest exact (f32) table this CPU runs, whatever `MFERENCE_KERNELS` says.
    pub fn best_exact() -> &'static Kernels {
        Self::available()
            .into_iter()
            .rfind(|k| k.is_exact())
            .unwrap_or(&SCALAR)
    }

    /// The table `MFERENCE_KERNELS` names, if it names one this CPU runs; a value that does not
    /// is said on stderr (once) and ignored; an empty value is no value.
    fn forced_by_env() -> Option<&'static Kernels> {
        static SAID: std::sync::Once = std::sync::Once::new();
        let want = std::env::var("MFERENCE_KERNELS")
            .ok()
            .filter(|v| !v.trim().is_empty())?;
        let k = Self::by_name(want.trim());
        if k.is_none() {
            SAID.call_once(|| {
                let here: Vec<&str> = Self::available().iter().map(|k| k.name()).collect();
                eprintln!(
                    "mference: MFERENCE_KERNELS='{want}' is not a kernel table this CPU runs \
                     ({}); ignored",
                    here.join(", ")
                )
            });
        }
        k
    }

    /// The table `auto` takes for a model whose family was checked with int16 activations (Gemma 4
    /// and Qwen 3.6): `amx` where this CPU has AMX-INT8, else `avx512i16` where it has AVX-512
    /// VNNI (int16 activations in every 4-bit product: perplexity within 0.002% of the exact
    /// table's on the bundled models, faster prompts and decode, batch-invariant), else `avx2i16`
    /// where it has AVX2 (the same rounding, within 0.006% of `avx2`'s perplexity; prompts
    /// 1.3-2.2x and decode 0.96-1.25x `avx2`'s on an AMD Zen 3), else [`Kernels::detect`]'s exact
    /// table. `MFERENCE_KERNELS` naming a table this CPU runs overrides it as it does `detect` (an
    /// unknown or unsupported value is said on stderr and ignored by both).
    pub fn detect_int16() -> &'static Kernels {
        if Self::forced_by_env().is_some() {
            return Self::detect();
        }
        Self::by_name("amx")
            .or_else(|| Self::by_name("avx512i16"))
            .or_else(|| Self::by_name("avx2i16"))
            .unwrap_or_else(Self::detect)
    }

    /// What this table rounds beyond the f32 arithmetic of the exact tables, in words for the load
    /// line (`None` for an exact table).
    pub fn rounding(&self) -> Option<&'static str> {
        self.rounding
    }

    /// The scalar f32 reference table (always available; slow).
    pub fn scalar() -> &'static Kernels {
        &SCALAR
    }

    /// Every table this CPU can run, slowest (scalar) first.
    pub fn available() -> Vec<&'static Kernels> {
        #[allow(unused_mut)]
        let mut v = vec![&SCALAR];
        #[cfg(target_arch = "x86_64")]
        v.extend(crate::x86::available());
        v
    }

    /// The table called `name` (`"scalar"`, `"avx2"`, `"avx2i16"`, `"avx512"`, `"avx512i16"`,
    /// `"amx"`, `"avx512vnni"`), if this CPU supports it.
    pub fn by_name(name: &str) -> Option<&'static Kernels> {
        Self::available().into_iter().find(|k| k.name == name)
    }

    /// What the table called `name` needs of the CPU, in words (`None` for a name that is no
    /// table): for saying why a table this CPU lacks is refused.
    pub fn needs(name: &str) -> Option<&'static str> {
        Some(match name {
            "scalar" => "nothing",
            "avx2" | "avx2i16" => "AVX2, FMA and F16C",
            "avx512" => "AVX-512 F/BW/VL",
            "avx512i16" | "avx512vnni" => "AVX-512 F/BW/VL and VNNI",
            "amx" => "AVX-512 VNNI and AMX-INT8 (Intel Xeon from Sapphire Rapids on)",
            _ => return None,
        })
    }

    /// Short name of this table: `"scalar"`, `"avx2"`, `"avx2i16"`, `"avx512"`, `"avx512i16"`,
    /// `"amx"` or `"avx512vnni"`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    pub(crate) fn layout_for(&self, bits: u32, group_size: usize, n: usize) -> XLayout {
        match bits {
            4 if self.q8 && group_size.is_multiple_of(64) && n >= Q8_MIN_ROWS => XLayout::Q8Lanes16,
            4 if self.amx && group_size.is_multiple_of(64) && n >= AMX_MIN_ROWS => XLayout::Q16Amx,
            4 if self.q16
                && group_size.is_multiple_of(64)
                && self.q16_lanes.is_some_and(|from| n >= from) =>
            {
                XLayout::Q16Lanes16
            }
            4 if self.q16 && group_size.is_multiple_of(64) => self.q16_gemv,
            4 => self.layout4,
            2 => self.layout2,
            _ => XLayout::Natural,
        }
    }

    /// Whether this table computes in f32 throughout (scalar, avx2, avx512). The `avx512vnni` table
    /// quantizes prefill (GEMM) activations of 4-bit matrices to int8 per group (ggml's q8 idea; its GEMV,
    /// and its GEMM of 2- and 8-bit matrices, are the exact AVX-512 ones) and is only used when asked for by
    /// name.
    pub fn is_exact(&self) -> bool {
        self.rounding.is_none()
    }

    /// Whether a token's row of a batched product has the bits of its one-token product, so a
    /// prompt row's result does not depend on the chunk it was computed in: every table but
    /// `avx512vnni` (whose int8 activations are only in the GEMM).
    pub fn is_batch_invariant(&self) -> bool {
        !self.q8
    }

    /// Prepares activations `x[n, cols]` (row-major f32) for products with matrices of `m`'s
    /// cols/bits/group size, into a reusable buffer. Panics if `x.len() != n · m.cols`.
    pub fn prepare_into(&self, m: &QMatrix, x: &[f32], n: usize, out: &mut PreparedX) {
        out.fill(self.layout_for(m.bits, m.group_size, n), m, x, n);
    }

    /// Like [`Kernels::prepare_into`], allocating a new buffer.
    pub fn prepare(&self, m: &QMatrix, x: &[f32], n: usize) -> PreparedX {
        let mut p = PreparedX::new();
        self.prepare_into(m, x, n, &mut p);
        p
    }

    /// `y[rows] = W x`. `x.len() == cols`, `y.len() == rows`.
    pub fn gemv(&self, m: &QMatrix, x: &[f32], y: &mut [f32]) {
        self.gemv_rows(m, x, y, 0, m.rows);
    }

    /// Rows `[r0, r1)` of `W x` into `y` (`y.len() == r1 - r0`), so callers can split rows across threads.
    pub fn gemv_rows(&self, m: &QMatrix, x: &[f32], y: &mut [f32], r0: usize, r1: usize) {
        with_scratch(|p| {
            self.prepare_into(m, x, 1, p);
            self.gemv_prepared(m, p, y, r0, r1);
        })
    }

    /// Rows `[r0, r1)` of `W x` for activations prepared by this table (`p.n() == 1`).
    pub fn gemv_prepared(&self, m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
        assert!(
            r0 <= r1 && r1 <= m.rows,
            "gemv rows [{r0}, {r1}) out of range (rows {})",
            m.rows
        );
        assert_eq!(y.len(), r1 - r0, "gemv: y must have r1 - r0 elements");
        assert_eq!(p.n, 1, "gemv_prepared: expected one activation row");
        (self.gemv)(m, p, y, r0, r1)
    }

    /// `Y[n, rows] = X[n, cols] · Wᵀ` (batched for prefill: each weight tile is read once per batch).
    pub fn gemm(&self, m: &QMatrix, x: &[f32], n: usize, y: &mut [f32]) {
        self.gemm_rows(m, x, n, y, 0, m.rows);
    }

    /// Columns `[r0, r1)` of `Y = X · Wᵀ` into `y`, which is `[n, r1 - r0]` row-major.
    pub fn gemm_rows(&self, m: &QMatrix, x: &[f32], n: usize, y: &mut [f32], r0: usize, r1: usize) {
        with_scratch(|p| {
            self.prepare_into(m, x, n, p);
            self.gemm_prepared(m, p, y, r0, r1);
        })
    }

    /// Columns `[r0, r1)` of `Y = X · Wᵀ` for activations prepared by this table; `y` is `[p.n(), r1 - r0]`.
    pub fn gemm_prepared(&self, m: &QMatrix, p: &PreparedX, y: &mut [f32], r0: usize, r1: usize) {
        assert!(
            r0 <= r1 && r1 <= m.rows,
            "gemm rows [{r0}, {r1}) out of range (rows {})",
            m.rows
        );
        assert_eq!(y.len(), p.n * (r1 - r0), "gemm: y must be [n, r1 - r0]");
        if p.n == 1 {
            (self.gemv)(m, p, y, r0, r1)
        } else {
            (self.gemm)(m, p, y, r0, r1)
        }
    }

    /// `Σ a_i b_i` in f32. Panics if lengths differ.
    pub fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot_f32: length mismatch");
        (self.dot_f32)(a, b)
    }

    /// `y += a · x`. Panics if lengths differ.
    pub fn axpy(&self, a: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len(), "axpy: length mismatch");
        (self.axpy)(a, x, y)
    }

    /// f32 → f16 (round to nearest even; overflow → ±inf), for writing KV cache rows. Panics if lengths differ.
    pub fn f32_to_f16(&self, src: &[f32], dst: &mut [f16]) {
        assert_eq!(src.len(), dst.len(), "f32_to_f16: length mismatch");
        (self.f32_to_f16)(src, dst)
    }

    /// f16 → f32 (exact). Panics if lengths differ.
    pub fn f16_to_f32(&self, src: &[f16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "f16_to_f32: length mismatch");
        (self.f16_to_f32)(src, dst)
    }

    /// `Σ q_i · k_i` with an f32 query and an f16 key row (attention scores). Panics if lengths differ.
    pub fn dot_f16(&self, q: &[f32], k: &[f16]) -> f32 {
        assert_eq!(q.len(), k.len(), "dot_f16: length mismatch");
        (self.dot_f16)(q, k)
    }

    /// `y += a · v` with an f16 value row (attention output). Panics if lengths differ.
    pub fn axpy_f16(&self, a: f32, v: &[f16], y: &mut [f32]) {
        assert_eq!(v.len(), y.len(), "axpy_f16: length mismatch");
        (self.axpy_f16)(a, v, y)
    }

    /// `out[i] = q · rows[i·stride .. i·stride + q.len()]` for every `i < out.len()`: attention's
    /// scores against f16 K rows. Bit-identical to one [`Kernels::dot_f16`] per row. Panics if the
    /// last row runs past `rows`.
    pub fn dots_f16(&self, q: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
        assert_rows_fit("dots_f16", out.len(), stride, q.len(), rows.len());
        match self.dots_f16 {
            Some(f) => f(q, rows, stride, out),
            None => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = (self.dot_f16)(q, &rows[i * stride..i * stride + q.len()]);
                }
            }
        }
    }

    /// `out += Σ_i w[i] · rows[i·stride .. i·stride + out.len()]`: attention's weighted sum of f16
    /// V rows. Bit-identical to one [`Kernels::axpy_f16`] per row in order (the same fused
    /// multiply-add per element); SIMD tables keep `out` in registers across the rows. Panics if
    /// the last row runs past `rows`.
    pub fn wsum_f16(&self, w: &[f32], rows: &[f16], stride: usize, out: &mut [f32]) {
        assert_rows_fit("wsum_f16", w.len(), stride, out.len(), rows.len());
        match self.wsum_f16 {
            Some(f) => f(w, rows, stride, out),
            None => {
                for (i, &wi) in w.iter().enumerate() {
                    (self.axpy_f16)(wi, &rows[i * stride..i * stride + out.len()], out);
                }
            }
        }
    }

    /// [`Kernels::dots_f16`] of `g` queries against the same rows (the query heads of one KV
    /// head): `out[h·ld + i] = q[h·d .. (h+1)·d] · rows[i·stride .. i·stride + d]` for `h < g`,
    /// `i < n`, `d = q.len() / g`. Bit-identical to one `dots_f16` per query; SIMD tables convert
    /// each f16 row once for all `g`. Panics if `q` does not split into `g` queries, `ld < n`, or
    /// a row or an output runs past its slice.
    #[allow(clippy::too_many_arguments)]
    pub fn dots_f16_group(
        &self,
        q: &[f32],
        g: usize,
        rows: &[f16],
        stride: usize,
        n: usize,
        out: &mut [f32],
        ld: usize,
    ) {
        assert!(
            g > 0 && q.len().is_multiple_of(g) && ld >= n,
            "dots_f16_group: {g} queries in {} values, ld {ld} < n {n}",
            q.len()
        );
        let d = q.len() / g;
        assert_rows_fit("dots_f16_group", n, stride, d, rows.len());
        assert_rows_fit("dots_f16_group", g, ld, n, out.len());
        if n == 0
            || self
                .dots_f16_group
                .is_some_and(|f| f(q, g, rows, stride, n, out, ld))
        {
            return;
        }
        for h in 0..g {
            self.dots_f16(
                &q[h * d..(h + 1) * d],
                rows,
                stride,
                &mut out[h * ld..h * ld + n],
            );
        }
    }

    /// [`Kernels::wsum_f16`] of `g` outputs over the same rows: `out[h·d .. (h+1)·d] += Σ_i
    /// w[h·ld + i] · rows[i·stride .. i·stride + d]` for `h < g`, `i < n`, `d = out.len() / g`.
    /// Bit-identical to one `wsum_f16` per output; SIMD tables convert each f16 row once for all
    /// `g`. Panics if `out` does not split into `g` outputs, `ld < n`, or a row or a weight runs
    /// past its slice.
    #[allow(clippy::too_many_arguments)]
    pub fn wsum_f16_group(
        &self,
        w: &[f32],
        ld: usize,
        n: usize,
        rows: &[f16],
        stride: usize,
        out: &mut [f32],
        g: usize,
    ) {
        assert!(
            g > 0 && out.len().is_multiple_of(g) && ld >= n,
            "wsum_f16_group: {g} outputs in {} values, ld {ld} < n {n}",
            out.len()
        );
        let d = out.len() / g;
        assert_rows_fit("wsum_f16_group", n, stride, d, rows.len());
        assert_rows_fit("wsum_f16_group", g, ld, n, w.len());
        if n == 0
            || self
                .wsum_f16_group
                .is_some_and(|f| f(w, ld, n, rows, stride, out, g))
        {
            return;
        }
        for h in 0..g {
            self.wsum_f16(
                &w[h * ld..h * ld + n],
                rows,
                stride,
                &mut out[h * d..(h + 1) * d],
            );
        }
    }

    /// Index and value of the largest element of rows `[r0, r1)` of `W x` (single thread), computing logits in
    /// small tiles (never all of them at once). Ties go to the lowest index; NaN logits are never chosen
    /// (all-NaN returns `(r0, NaN)`). Returns the raw (pre-softcap) logit; see [`crate::ThreadPool::gemv_argmax`].
    pub fn gemv_argmax_prepared(
        &self,
        m: &QMatrix,
        p: &PreparedX,
        r0: usize,
        r1: usize,
    ) -> (usize, f32) {
        const TILE: usize = 64;
        let mut tile = [0.0f32; TILE];
        let mut best = (usize::MAX, f32::NEG_INFINITY);
        let mut r = r0;
        while r < r1 {
            let e = (r + TILE).min(r1);
            let t = &mut tile[..e - r];
            self.gemv_prepared(m, p, t, r, e);
            for (i, &v) in t.iter().enumerate() {
                if v > best.1 || (best.0 == usize::MAX && v == f32::NEG_INFINITY) {
                    best = (r + i, v);
                }
            }
            r = e;
        }
        if best.0 == usize::MAX {
            (r0, f32::NAN)
        } else {
            best
        }
    }
}

/// Panics unless `n` rows of `width` elements, `stride` apart, fit in `len` elements.
fn assert_rows_fit(what: &str, n: usize, stride: usize, width: usize, len: usize) {
    if let Some(last) = n.checked_sub(1) {
        assert!(
            last * stride + width <= len,
            "{what}: {n} rows of stride {stride} and width {width} overrun {len} elements"
        );
    }
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("name", &self.name).finish()
    }
}
