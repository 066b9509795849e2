//! The op test harness (llama.cpp's `test-backend-ops` idea): every op of a backend runs against
//! its twin in [`crate::reference`] on random shapes, quantized weights at odd 2-byte-aligned
//! offsets with negative scales, 2/4/8-bit and groups 32/64/128. A backend that lacks an op fails
//! with the op's name. Each backend crate's tests call [`run_all`] on every backend it can start
//! (`crates/backend/tests/backend_ops.rs` for the CPU tables).

use crate::reference as refr;
use crate::{
    Act, AttnShape, Backend, DeltaShape, FRef, HcSpec, KvDtype, LogScaling, Mlp, Norm, OpError,
    PreNorm, QRef, RelBias, Rope, RouterSpec, Scoring, SinkRouter, Tensor, Unary, VRef, Weights,
    Yarn,
};

/// Exact f32 tables against the f64 reference: relative to the largest reference magnitude.
/// Observed: ≤ 2e-6 on these shapes; f32 summation over ≤ 1024 terms bounds it near 6e-5.
pub const EXACT_REL: f64 = 5e-5;
/// FP16 KV rounds K and V to 11 significant bits (relative 4.9e-4 per element).
pub const F16_KV_REL: f64 = 4e-3;
/// The int8-prefill table (`avx512vnni`) rounds prefill activations to 127 levels per group.
pub const Q8_REL: f64 = 3e-2;
/// A GLU MLP on that table chains two rounded products (gate/up, then down on their product), and
/// a clamped gate concentrates the output in a few large terms; observed up to 8.6e-2.
pub const Q8_GLU_REL: f64 = 1.5e-1;

/// splitmix64: a seeded stream, so a failure replays exactly.
pub struct Rng(pub u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Uniform in `[-a, a]`.
    fn sym(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
    fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.sym(a)).collect()
    }
}

fn bf16_bytes(v: f32) -> [u8; 2] {
    ((v.to_bits() >> 16) as u16).to_le_bytes()
}

/// A resident buffer in the install's layout, built tensor by tensor.
struct Buf {
    bytes: Vec<u8>,
    /// Tensors placed so far (each gets the next even offset modulo 16 of `RESIDUES`).
    placed: usize,
}

/// The offsets modulo 16 tensors start at in turn: every 2-byte alignment the install format
/// allows, starting with the worst (2 past a 4-byte boundary).
const RESIDUES: [usize; 8] = [2, 6, 10, 14, 4, 12, 8, 0];

impl Buf {
    /// Pads so the next tensor starts at the next of [`RESIDUES`] modulo 16.
    fn pad(&mut self) {
        let r = RESIDUES[self.placed % RESIDUES.len()];
        self.placed += 1;
        while self.bytes.len() % 16 != r {
            self.bytes.push(0);
        }
    }

    /// A random quantized `[rows, cols]` matrix: random codes, scales ±[0.002, 0.05] with random
    /// sign, biases ±0.2.
    fn q(&mut self, rng: &mut Rng, rows: usize, cols: usize, bits: usize, gs: usize) -> QRef {
        self.pad();
        let w0 = self.bytes.len();
        let wlen = rows * cols * bits / 8;
        self.bytes.extend((0..wlen).map(|_| rng.next() as u8));
        let groups = rows * cols / gs;
        self.pad();
        let s0 = self.bytes.len();
        for _ in 0..groups {
            let mag = 0.002 + (rng.sym(1.0).abs()) * 0.048;
            let s = if rng.below(2) == 0 { mag } else { -mag };
            self.bytes.extend(bf16_bytes(s));
        }
        self.pad();
        let b0 = self.bytes.len();
        for _ in 0..groups {
            self.bytes.extend(bf16_bytes(rng.sym(0.2)));
        }
        let total = self.bytes.len() + 64;
        QRef::from_parts(
            "test",
            rows,
            cols,
            (w0, wlen),
            (s0, 2 * groups),
            (b0, 2 * groups),
            total,
        )
        .expect("a well-formed test matrix")
    }

    /// `len` BF16 values around `center`.
    fn v(&mut self, rng: &mut Rng, len: usize, center: f32) -> VRef {
        self.pad();
        let off = self.bytes.len();
        for _ in 0..len {
            self.bytes.extend(bf16_bytes(center + rng.sym(0.5)));
        }
        VRef::at(off, len)
    }

    fn finish(mut self) -> Vec<u8> {
        self.bytes.extend([0u8; 64]);
        self.bytes
    }
}

/// `max |got − want| / max(max |want|, 1e-3)`.
fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let m = want
        .iter()
        .fold(0.0f64, |m, &v| m.max(v.abs() as f64))
        .max(1e-3);
    let d = got
        .iter()
        .zip(want)
        .fold(0.0f64, |d, (&a, &b)| d.max((a as f64 - b as f64).abs()));
    if got.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    d / m
}

/// Runs every op of one backend; returns the failures (op name and why).
struct Harness<'a, B: Backend> {
    be: &'a B,
    buf: &'a [u8],
    fails: Vec<String>,
    exact: bool,
}

impl<B: Backend> Harness<'_, B> {
    fn fail(&mut self, op: &str, why: String) {
        self.fails.push(format!("{}: {op}: {why}", self.be.name()));
    }

    /// Unwraps an op's result, recording an error (a missing op names itself).
    fn ok<T>(&mut self, op: &str, r: Result<T, OpError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.fail(op, e.to_string());
                None
            }
        }
    }

    fn up(&mut self, data: &[f32], cols: usize) -> Option<B::Tensor> {
        let r = self.be.upload(data, cols);
        self.ok("upload", r)
    }

    fn read(&mut self, x: &B::Tensor) -> Option<Vec<f32>> {
        let r = self.be.read(x);
        self.ok("read", r)
    }

    fn expect_close(&mut self, op: &str, got: &[f32], want: &[f32], budget: f64) {
        let e = rel(got, want);
        if e > budget {
            self.fail(op, format!("relative error {e:.3e} > budget {budget:.1e}"));
        }
    }

    fn budget_q(&self, rows: usize) -> f64 {
        if self.exact || rows < 4 {
            EXACT_REL
        } else {
            Q8_REL
        }
    }
}

/// Every op on `be` (its resident bytes are `buf`, laid out by `w`; `exact`: an f32-exact
/// backend, else the int8-prefill budgets apply to products of 4+ rows), seed `seed`. Returns the
/// failures, one line each: `backend: op: why`.
pub fn run_all<B: Backend>(
    be: &B,
    buf: &[u8],
    w: &TestWeights,
    exact: bool,
    seed: u64,
) -> Vec<String> {
    let mut h = Harness {
        be,
        buf,
        fails: Vec::new(),
        exact,
    };
    let mut rng = Rng(seed);
    data_ops(&mut h, &mut rng);
    products(&mut h, &mut rng, w);
    norms_and_elementwise(&mut h, &mut rng, w);
    rope_ops(&mut h, &mut rng, w);
    attention_ops(&mut h, &mut rng);
    recurrent_ops(&mut h, &mut rng);
    router_ops(&mut h, &mut rng, w);
    dsv4_ops(&mut h, &mut rng, w);
    inkling_ops(&mut h, &mut rng);
    h.fails
}

fn data_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    let d = rng.vec(5 * 12, 1.0);
    let Some(x) = h.up(&d, 12) else { return };
    if (x.rows(), x.cols()) != (5, 12) {
        h.fail("upload", format!("shape [{}, {}]", x.rows(), x.cols()));
    }
    if let Some(back) = h.read(&x) {
        if back != d {
            h.fail("read", "upload then read changed values".into());
        }
    }
    let r = h.be.zeros(3, 7);
    if let Some(z) = h.ok("zeros", r) {
        if h.read(&z) != Some(vec![0.0; 21]) {
            h.fail("zeros", "not 21 zeros".into());
        }
    }
    let r = h.be.all_finite(&x);
    if h.ok("all_finite", r) != Some(true) {
        h.fail("all_finite", "finite values reported non-finite".into());
    }
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut e = d.clone();
        let at = rng.below(e.len());
        e[at] = bad;
        if let Some(et) = h.up(&e, 12) {
            let r = h.be.all_finite(&et);
            if h.ok("all_finite", r) != Some(false) {
                h.fail("all_finite", format!("missed {bad}"));
            }
        }
    }
    let r = h.be.copy(&x);
    if let Some(c) = h.ok("copy", r) {
        if h.read(&c).as_deref() != Some(&d[..]) {
            h.fail("copy", "copy differs".into());
        }
    }
    let rows = [4usize, 0, 4, 2];
    let r = h.be.gather_rows(&x, &rows);
    if let Some(g) = h.ok("gather_rows", r) {
        let want: Vec<f32> = rows
            .iter()
            .flat_map(|&r| d[r * 12..(r + 1) * 12].to_vec())
            .collect();
        if h.read(&g) != Some(want) {
            h.fail("gather_rows", "rows differ".into());
        }
    }
    // Rows of 12 = 2 groups of 6 = [2 | 1 | 3].
    let r = h.be.split(&x, 6, &[2, 1, 3]);
    if let Some(parts) = h.ok("split", r) {
        for (j, (p, (o, n))) in parts.iter().zip([(0, 2), (2, 1), (3, 3)]).enumerate() {
            let want: Vec<f32> = d
                .chunks_exact(6)
                .flat_map(|g| g[o..o + n].to_vec())
                .collect();
            if h.read(p) != Some(want) || p.cols() != 2 * n {
                h.fail("split", format!("part {j} differs"));
            }
        }
    }
}

/// Quantized matrices of every format the families use, laid out once per seed.
pub struct TestWeights {
    /// `(matrix, bits, group)` with `cols` = 256 (one input for all).
    mats: Vec<(QRef, usize, usize)>,
    /// An embedding table `[50, 128]`.
    table: QRef,
    /// A GLU MLP 256 → 96 → 256 (4-bit g64) and one in 8-bit g32 / 4-bit g128 (mixed layouts).
    mlps: Vec<Mlp>,
    /// Norm weights of 256 and of 32 (a head).
    w256: VRef,
    w32: VRef,
    /// Per-expert scales of 16 experts.
    pes: VRef,
    /// A grouped projection `[4·24, 64]` (2-bit g32: 4 groups of 24 rows over 64 inputs each).
    grouped: QRef,
    /// An F32 per-expert selection bias of 16 experts.
    bias: FRef,
    /// An unquantized BF16 router `[16, 256]`.
    dense: VRef,
}

/// Random weights of every tested format (`bits` each with groups 32, 64, 128) in one resident
/// buffer, returned with their views.
pub fn test_weights(rng: &mut Rng, bits: &[usize]) -> (Vec<u8>, TestWeights) {
    let mut b = Buf {
        bytes: Vec::new(),
        placed: 0,
    };
    let mut mats = Vec::new();
    for &bits in bits {
        for gs in [32, 64, 128] {
            let rows = 1 + rng.below(90);
            mats.push((b.q(rng, rows, 256, bits, gs), bits, gs));
        }
    }
    let table = b.q(rng, 50, 128, 4, 64);
    let mlp =
        |b: &mut Buf, rng: &mut Rng, (gb, gg): (usize, usize), (db, dg): (usize, usize)| Mlp {
            gate_proj: b.q(rng, 96, 256, gb, gg),
            up_proj: b.q(rng, 96, 256, gb, gg),
            down_proj: b.q(rng, 256, 96, db, dg),
        };
    let mlps = vec![
        mlp(&mut b, rng, (4, 64), (4, 32)),
        mlp(&mut b, rng, (8, 32), (4, 32)),
    ];
    let w256 = b.v(rng, 256, 1.0);
    let w32 = b.v(rng, 32, 0.0);
    let pes = b.v(rng, 16, 1.0);
    let grouped = b.q(rng, 96, 64, 2, 32);
    b.pad();
    let off = b.bytes.len();
    for _ in 0..16 {
        b.bytes.extend(rng.sym(0.3).to_le_bytes());
    }
    let bias = FRef::at(off, 16);
    let dense = b.v(rng, 16 * 256, 0.0);
    (
        b.finish(),
        TestWeights {
            mats,
            table,
            mlps,
            w256,
            w32,
            pes,
            grouped,
            bias,
            dense,
        },
    )
}

/// `glu_mlp_experts` of two experts (the blob twice: two staged copies on a GPU) on the rows
/// `xt`: each bit for bit `glu_mlp`'s `want` from that blob.
fn glu_experts<B: Backend>(
    h: &mut Harness<B>,
    mlp: &Mlp,
    act: Act,
    blob: &[u8],
    xt: &B::Tensor,
    want: &[f32],
) {
    let r =
        h.be.glu_mlp_experts(mlp, act, &[Weights::Blob(blob); 2], &[xt, xt]);
    let Some(ys) = h.ok("glu_mlp_experts", r) else {
        return;
    };
    for (j, y) in ys.iter().enumerate() {
        if let Some(got) = h.read(y) {
            if got
                .iter()
                .map(|v| v.to_bits())
                .ne(want.iter().map(|v| v.to_bits()))
            {
                h.fail(
                    "glu_mlp_experts",
                    format!(
                        "{act:?} x {} rows, expert {j}: not glu_mlp's bits",
                        xt.rows()
                    ),
                );
            }
        }
    }
}

/// `glu_mlp_rows`: three experts (a blob, the resident bytes, the blob again) of one row into
/// rows 2, 0, 3 of a 4-row stack whose row 1 must stay zero.
fn glu_rows<B: Backend>(
    h: &mut Harness<B>,
    w: &TestWeights,
    blob: &[u8],
    x: &[f32],
    xt: &B::Tensor,
) {
    let buf = h.buf;
    for (i, mlp) in w.mlps.iter().enumerate() {
        let want = refr::glu_mlp(
            &mlp.gate_proj,
            &mlp.up_proj,
            &mlp.down_proj,
            Act::Silu,
            buf,
            x,
        );
        let r = h.be.zeros(4, 256);
        let Some(mut out) = h.ok("zeros", r) else {
            return;
        };
        let srcs = [Weights::Blob(blob), Weights::Resident, Weights::Blob(blob)];
        let r =
            h.be.glu_mlp_rows(mlp, Act::Silu, &srcs, xt, &mut out, &[2, 0, 3]);
        if h.ok("glu_mlp_rows", r).is_none() {
            continue;
        }
        let Some(got) = h.read(&out) else { continue };
        let budget = match h.budget_q(1) {
            EXACT_REL => EXACT_REL,
            _ => Q8_GLU_REL,
        };
        for row in [2, 0, 3] {
            let op = format!("glu_mlp_rows {i} row {row}");
            h.expect_close(&op, &got[row * 256..(row + 1) * 256], &want, budget);
        }
        if got[256..512].iter().any(|&v| v != 0.0) {
            h.fail(
                "glu_mlp_rows",
                format!("mlp {i}: an unnamed row was written"),
            );
        }
        // Rows out of range or named twice are refused.
        for bad in [[2usize, 0, 4], [2, 2, 3]] {
            if h.be
                .glu_mlp_rows(mlp, Act::Silu, &srcs, xt, &mut out, &bad)
                .is_ok()
            {
                h.fail("glu_mlp_rows", format!("rows {bad:?} were accepted"));
            }
        }
    }
}

fn products<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    // Embedding.
    let ids = [0u32, 49, 7, 7, 23];
    let r = h.be.embed(&w.table, &ids, Some(3.5));
    if let Some(e) = h.ok("embed", r) {
        let d = refr::dequantize(&w.table, buf);
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| {
                d[i as usize * 128..(i as usize + 1) * 128]
                    .iter()
                    .map(|v| (v * 3.5) as f32)
            })
            .collect();
        if let Some(got) = h.read(&e) {
            h.expect_close("embed", &got, &want, EXACT_REL);
        }
    }
    // Products, one by one and all sharing one input, for decode (1 row) and prefill rows (33:
    // a GPU GEMM's last tile of x rows holds one row).
    for t in [1usize, 3, 17, 33] {
        let x = rng.vec(t * 256, 1.0);
        let Some(xt) = h.up(&x, 256) else { return };
        let all: Vec<&QRef> = w.mats.iter().map(|m| &m.0).collect();
        let r = h.be.matmul(&all, Weights::Resident, &xt);
        let Some(ys) = h.ok("matmul", r) else {
            continue;
        };
        for ((m, bits, gs), y) in w.mats.iter().zip(&ys) {
            let want = refr::matmul(m, buf, &x);
            if let Some(got) = h.read(y) {
                let op = format!("matmul {bits}-bit g{gs} [{}, 256] x {t} rows", m.rows);
                let budget = h.budget_q(t);
                h.expect_close(&op, &got, &want, budget);
            }
        }
        // An unquantized BF16 matrix (exact on every table: no int8 prefill for it).
        let r = h.be.matmul_bf16(&w.dense, 16, &xt);
        if let Some(y) = h.ok("matmul_bf16", r) {
            let want = refr::matmul_bf16(&w.dense, buf, 16, &x);
            if let Some(got) = h.read(&y) {
                h.expect_close(&format!("matmul_bf16 x {t} rows"), &got, &want, EXACT_REL);
            }
        }
        // An expert blob: the same matrix read from a separate buffer at the same offsets.
        let blob = buf.to_vec();
        let r = h.be.matmul(&[&w.mats[0].0], Weights::Blob(&blob), &xt);
        if let Some(ys) = h.ok("matmul", r) {
            let want = refr::matmul(&w.mats[0].0, buf, &x);
            if let Some(got) = h.read(&ys[0]) {
                let budget = h.budget_q(t);
                h.expect_close("matmul (expert blob)", &got, &want, budget);
            }
        }
        for (i, mlp) in w.mlps.iter().enumerate() {
            for act in [Act::GeluTanh, Act::Silu, Act::SiluClamped(0.05)] {
                let r = h.be.glu_mlp(mlp, act, Weights::Blob(&blob), &xt);
                let Some(y) = h.ok("glu_mlp", r) else {
                    continue;
                };
                let want =
                    refr::glu_mlp(&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj, act, buf, &x);
                if let Some(got) = h.read(&y) {
                    let budget = match h.budget_q(t) {
                        EXACT_REL => EXACT_REL,
                        _ => Q8_GLU_REL,
                    };
                    h.expect_close(
                        &format!("glu_mlp {i} {act:?} x {t} rows"),
                        &got,
                        &want,
                        budget,
                    );
                    glu_experts(h, mlp, act, &blob, &xt, &got);
                }
            }
        }
        if t == 1 {
            glu_rows(h, w, &blob, &x, &xt);
            for (m, bits, gs) in &w.mats {
                let r = h.be.head_argmax(m, &xt);
                let Some((id, _)) = h.ok("head_argmax", r) else {
                    continue;
                };
                let want = refr::matmul(m, buf, &x);
                let best = want.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let tol = EXACT_REL as f32 * want.iter().fold(1e-3f32, |a, v| a.max(v.abs()));
                if (id as usize) >= want.len() || want[id as usize] < best - tol {
                    h.fail(
                        "head_argmax",
                        format!("{bits}-bit g{gs}: id {id} is not the argmax"),
                    );
                }
            }
        }
    }
}

fn norms_and_elementwise<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    let t = 3;
    let x = rng.vec(t * 256, 2.0);
    let cases: [(usize, Norm, &str); 5] = [
        (256, Norm::NoScale, "no-scale"),
        (256, Norm::Weight(&w.w256), "weight"),
        (32, Norm::Weight(&w.w32), "per-head weight"),
        (32, Norm::OnePlusWeight(&w.w32), "1+w per head"),
        (32, Norm::Scaled(0.125), "scaled (L2) per head"),
    ];
    for (dim, norm, name) in cases {
        let Some(mut xt) = h.up(&x, 256) else { return };
        let want = refr::rms_norm(&x, dim, norm, buf, 1e-6);
        // Out of place first: the source must come back unchanged.
        let r = h.be.rms_norm_to(&xt, dim, norm, 1e-6);
        if let Some(yt) = h.ok("rms_norm_to", r) {
            if let (Some(got), Some(src)) = (h.read(&yt), h.read(&xt)) {
                h.expect_close(&format!("rms_norm_to {name}"), &got, &want, EXACT_REL);
                if src != x {
                    h.fail("rms_norm_to", format!("{name}: the source was changed"));
                }
            }
        }
        let r = h.be.rms_norm(&mut xt, dim, norm, 1e-6);
        if h.ok("rms_norm", r).is_some() {
            if let Some(got) = h.read(&xt) {
                h.expect_close(&format!("rms_norm {name}"), &got, &want, EXACT_REL);
            }
        }
        // Into a residual: (r + norm(x)) · 0.75, x unchanged.
        let res = rng.vec(t * 256, 1.0);
        let (Some(mut rt), Some(xt)) = (h.up(&res, 256), h.up(&x, 256)) else {
            return;
        };
        let r = h.be.add_rms_norm(&mut rt, &xt, dim, norm, 1e-6, 0.75);
        if h.ok("add_rms_norm", r).is_some() {
            let want: Vec<f32> = res.iter().zip(&want).map(|(a, n)| (a + n) * 0.75).collect();
            if let (Some(got), Some(src)) = (h.read(&rt), h.read(&xt)) {
                h.expect_close(&format!("add_rms_norm {name}"), &got, &want, EXACT_REL);
                if src != x {
                    h.fail(
                        "add_rms_norm",
                        format!("{name}: the normed input was changed"),
                    );
                }
            }
        }
    }
    // A block's output into the residual (normed, or a plain add), then pre-norms of the new
    // residual (one with a column scale), over whole rows and over 32-wide pieces: against the
    // reference, and bit-equal to the ops it stands for on the same backend.
    for (dim, wd, normed) in [
        (256, &w.w256, true),
        (32, &w.w32, true),
        (256, &w.w256, false),
    ] {
        let post = normed.then_some(Norm::Weight(wd));
        let res = rng.vec(t * 256, 1.0);
        let pre = [
            PreNorm {
                norm: Norm::NoScale,
                cols: Some((&w.w256, 0.5)),
            },
            PreNorm {
                norm: Norm::Weight(wd),
                cols: None,
            },
            PreNorm {
                norm: Norm::Scaled(0.125),
                cols: None,
            },
        ];
        let (Some(mut rt), Some(xt), Some(mut st)) =
            (h.up(&res, 256), h.up(&x, 256), h.up(&res, 256))
        else {
            return;
        };
        let name = format!("add_rms_norm_pre (pieces of {dim}, normed {normed})");
        let r =
            h.be.add_rms_norm_pre(&mut rt, &xt, dim, post, 1e-6, 0.75, &pre);
        let Some(outs) = h.ok("add_rms_norm_pre", r) else {
            continue;
        };
        let n = match post {
            Some(post) => refr::rms_norm(&x, dim, post, buf, 1e-6),
            None => x.clone(),
        };
        let new_x: Vec<f32> = res.iter().zip(&n).map(|(a, n)| (a + n) * 0.75).collect();
        if let Some(got) = h.read(&rt) {
            h.expect_close(&format!("{name} residual"), &got, &new_x, EXACT_REL);
        }
        // The separate ops on a copy of the residual.
        let sep = match post {
            Some(post) => h.be.add_rms_norm(&mut st, &xt, dim, post, 1e-6, 0.75),
            None => h.be.add(&mut st, &xt, 0.75),
        };
        let sep_x = h.ok("add_rms_norm", sep).and_then(|_| h.read(&st));
        if let (Some(a), Some(b)) = (h.read(&rt), sep_x) {
            if a != b {
                h.fail(
                    "add_rms_norm_pre",
                    format!("{name}: residual differs from the separate op's"),
                );
            }
        }
        for (i, (p, out)) in pre.iter().zip(&outs).enumerate() {
            let mut want = refr::rms_norm(&new_x, dim, p.norm, buf, 1e-6);
            if let Some((cw, c)) = p.cols {
                for (j, v) in want.iter_mut().enumerate() {
                    *v = (*v as f64 * cw.get(buf, j % 256) as f64 * c as f64) as f32;
                }
            }
            let Some(got) = h.read(out) else { continue };
            h.expect_close(&format!("{name} output {i}"), &got, &want, EXACT_REL);
            let mut one = h.be.rms_norm_to(&st, dim, p.norm, 1e-6);
            if let (Ok(o), Some((cw, c))) = (&mut one, p.cols) {
                if let Err(e) = h.be.mul_cols(o, cw, c) {
                    h.fail("mul_cols", e.to_string());
                }
            }
            if let Some(sep) = h.ok("rms_norm_to", one).and_then(|o| h.read(&o)) {
                if sep != got {
                    h.fail(
                        "add_rms_norm_pre",
                        format!("{name}: output {i} differs from the separate ops'"),
                    );
                }
            }
        }
    }
    let z = rng.vec(t * 256, 3.0);
    if let (Some(mut xt), Some(zt)) = (h.up(&x, 256), h.up(&z, 256)) {
        let r = h.be.rms_norm_gated(&mut xt, 32, &w.w32, &zt, 1e-6);
        if h.ok("rms_norm_gated", r).is_some() {
            let n = refr::rms_norm(&x, 32, Norm::Weight(&w.w32), buf, 1e-6);
            let want: Vec<f32> = n
                .iter()
                .zip(&z)
                .map(|(&a, &g)| a * refr::unary(g, Unary::Silu))
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("rms_norm_gated", &got, &want, EXACT_REL);
            }
        }
    }
    for op in [
        Unary::Scale(-1.7),
        Unary::Softcap(30.0),
        Unary::Clamp(-0.5, 1.25),
        Unary::Silu,
        Unary::GeluTanh,
        Unary::Sigmoid,
    ] {
        let v: Vec<f32> = rng.vec(200, 12.0);
        let Some(mut vt) = h.up(&v, 20) else { return };
        let r = h.be.unary(&mut vt, op);
        if h.ok("unary", r).is_some() {
            let want: Vec<f32> = v.iter().map(|&a| refr::unary(a, op)).collect();
            if let Some(got) = h.read(&vt) {
                h.expect_close(&format!("unary {op:?}"), &got, &want, 1e-6);
            }
        }
    }
    let y = rng.vec(t * 256, 1.0);
    let g = rng.vec(t, 4.0);
    type Case<'w> = (&'w str, fn(&[f32], &[f32], &[f32], f32) -> Vec<f32>);
    let _: Option<Case> = None;
    // mul_cols
    if let Some(mut xt) = h.up(&x, 256) {
        let r = h.be.mul_cols(&mut xt, &w.w256, 0.0625);
        if h.ok("mul_cols", r).is_some() {
            let want: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, &a)| (a as f64 * w.w256.get(buf, i % 256) as f64 * 0.0625) as f32)
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("mul_cols", &got, &want, 1e-6);
            }
        }
    }
    if let (Some(mut xt), Some(yt)) = (h.up(&x, 256), h.up(&y, 256)) {
        let r = h.be.mul_sigmoid(&mut xt, &yt);
        if h.ok("mul_sigmoid", r).is_some() {
            let want: Vec<f32> = x
                .iter()
                .zip(&y)
                .map(|(&a, &b)| a * refr::unary(b, Unary::Sigmoid))
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("mul_sigmoid", &got, &want, 1e-6);
            }
        }
    }
    if let (Some(mut xt), Some(gt)) = (h.up(&x, 256), h.up(&g, 1)) {
        let r = h.be.mul_rows_sigmoid(&mut xt, &gt);
        if h.ok("mul_rows_sigmoid", r).is_some() {
            let want: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, &a)| a * refr::unary(g[i / 256], Unary::Sigmoid))
                .collect();
            if let Some(got) = h.read(&xt) {
                h.expect_close("mul_rows_sigmoid", &got, &want, 1e-6);
            }
        }
    }
    for s in [1.0f32, 0.7] {
        if let (Some(mut xt), Some(yt)) = (h.up(&x, 256), h.up(&y, 256)) {
            let r = h.be.add(&mut xt, &yt, s);
            if h.ok("add", r).is_some() {
                let want: Vec<f32> = x
                    .iter()
                    .zip(&y)
                    .map(|(&a, &b)| ((a as f64 + b as f64) * s as f64) as f32)
                    .collect();
                if let Some(got) = h.read(&xt) {
                    h.expect_close(&format!("add s={s}"), &got, &want, 1e-6);
                }
            }
        }
    }
    // scatter_add: expert outputs for rows [2, 0, 2] of a 3-row accumulator.
    let rows = [(2usize, 0.25f32), (0, -1.5), (2, 0.75)];
    let ye = rng.vec(3 * 256, 1.0);
    if let (Some(mut acc), Some(yt)) = (h.up(&x, 256), h.up(&ye, 256)) {
        let r = h.be.scatter_add(&mut acc, &yt, &rows);
        if h.ok("scatter_add", r).is_some() {
            let mut want: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            for (j, &(row, wt)) in rows.iter().enumerate() {
                for i in 0..256 {
                    want[row * 256 + i] += wt as f64 * ye[j * 256 + i] as f64;
                }
            }
            let want: Vec<f32> = want.into_iter().map(|v| v as f32).collect();
            if let Some(got) = h.read(&acc) {
                h.expect_close("scatter_add", &got, &want, 1e-6);
            }
        }
    }
}

fn rope_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let yarn = Yarn {
        factor: 16.0,
        original_max_position_embeddings: 4096.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: None,
    };
    let ropes = [
        ("neox full", Rope::neox(64, 10000.0)),
        ("neox partial 16 of 64", Rope::neox(16, 1e7)),
        ("proportional 16 of 64", Rope::proportional(64, 16, 1e6)),
        ("interleaved 32 of 64", Rope::interleaved(32, 10000.0)),
        (
            "yarn interleaved",
            Rope::interleaved(64, 10000.0).yarn(&yarn, 10000.0),
        ),
    ];
    for (name, rope) in ropes {
        let (t, cols, pos0) = (4, 4 * 64, 1000 + rng.below(3000));
        let x = rng.vec(t * cols, 1.0);
        let Some(mut xt) = h.up(&x, cols) else { return };
        let r = h.be.rope(&mut xt, &rope, 64, pos0);
        if h.ok("rope", r).is_some() {
            let want = refr::rope(&x, cols, &rope, 64, pos0);
            if let Some(got) = h.read(&xt) {
                // Angles of ~3000 rad are formed in f32 on both sides; sin/cos differ by ulps.
                h.expect_close(&format!("rope {name}"), &got, &want, 2e-6);
            }
        }
    }
    // The per-head norm and the rotation in one op.
    let fused = [
        (
            "neox 32, weight",
            Rope::neox(32, 10000.0),
            32,
            Norm::Weight(&w.w32),
        ),
        (
            "interleaved 16 of 32, 1 + w",
            Rope::interleaved(16, 10000.0),
            32,
            Norm::OnePlusWeight(&w.w32),
        ),
        (
            "neox 16 of 64, no scale",
            Rope::neox(16, 1e7),
            64,
            Norm::NoScale,
        ),
    ];
    for (name, rope, d, norm) in fused {
        let (t, cols, pos0) = (3, 4 * d, 1000 + rng.below(3000));
        let x = rng.vec(t * cols, 2.0);
        let Some(mut xt) = h.up(&x, cols) else { return };
        let r = h.be.rms_norm_rope(&mut xt, norm, 1e-6, &rope, d, pos0);
        if h.ok("rms_norm_rope", r).is_some() {
            let normed = refr::rms_norm(&x, d, norm, h.buf, 1e-6);
            let want = refr::rope(&normed, cols, &rope, d, pos0);
            if let Some(got) = h.read(&xt) {
                h.expect_close(&format!("rms_norm_rope {name}"), &got, &want, 2e-6);
            }
        }
    }
}

/// `x` as the KV cache stores it.
fn kv_rounded(dtype: KvDtype, x: &[f32]) -> Vec<f32> {
    match dtype {
        KvDtype::F16 => x.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect(),
        KvDtype::F32 => x.to_vec(),
    }
}

fn attention_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    // (dtype, ring rows / window, GQA heads, sinks, chunks); the long ones give one-row steps
    // over more than a hundred positions (a backend may split those over several blocks).
    let short: &[usize] = &[5, 1, 3, 1];
    let long: &[usize] = &[150, 1, 70, 1];
    // A ring of window + 5 rows takes chunks of at most 6 rows (a longer chunk overwrites rows
    // its own first queries still see): 121 positions in chunks of 6.
    let ring_long: &[usize] = &[
        6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 1,
    ];
    let cases = [
        (KvDtype::F32, None, (4, 2), false, short),
        (KvDtype::F16, None, (4, 1), false, short),
        (KvDtype::F32, Some(5), (2, 2), false, short),
        (KvDtype::F16, Some(4), (6, 2), true, short),
        (KvDtype::F32, None, (3, 3), true, short),
        (KvDtype::F16, None, (4, 2), true, long),
        (KvDtype::F32, Some(100), (2, 1), false, ring_long),
    ];
    for (dtype, window, (nh, nkv), sinks, chunks) in cases {
        let chunks = chunks.to_vec();
        let d = 32;
        let total: usize = chunks.iter().sum();
        let (rows, ring) = match window {
            Some(w) => (w + 5, true),
            None => (total, false),
        };
        let r = h.be.new_kv(rows, ring, nkv, d, dtype);
        let Some(mut kv) = h.ok("new_kv", r) else {
            return;
        };
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window,
            scale: 1.0 / (d as f32).sqrt(),
            sinks: sinks.then(|| rng.vec(nh, 2.0)),
        };
        let (mut hk, mut hv) = (Vec::new(), Vec::new());
        let mut pos0 = 0;
        // A copy taken after the second chunk, with the host rows it holds.
        let mut snap = None;
        for (i, t) in chunks.into_iter().enumerate() {
            if i == 2 {
                let r = h.be.kv_clone(&kv);
                snap = h
                    .ok("kv_clone", r)
                    .map(|c| (c, pos0, hk.clone(), hv.clone()));
            }
            let name = format!(
                "attention {dtype:?} window {window:?} heads {nh}/{nkv} sinks {sinks} at {pos0}"
            );
            let rows = (&mut hk, &mut hv);
            if !write_and_attend(h, rng, &mut kv, rows, pos0, t, &shape, dtype, &name) {
                return;
            }
            pos0 += t;
        }
        // The copy still holds the state at its position, untouched by the later writes: a
        // row written there attends over exactly the rows the cache had then.
        if let Some((mut c, p, mut sk, mut sv)) = snap {
            let name = format!("kv_clone {dtype:?} window {window:?} at {p}");
            let rows = (&mut sk, &mut sv);
            write_and_attend(h, rng, &mut c, rows, p, 1, &shape, dtype, &name);
        }
    }
}

/// Writes `t` random K/V rows at `pos0` into `kv` (and their stored values into the host copies
/// `rows`), attends with `t` random queries and compares with the reference over the host rows.
/// `false` when an op failed (recorded).
#[allow(clippy::too_many_arguments)]
fn write_and_attend<B: Backend>(
    h: &mut Harness<B>,
    rng: &mut Rng,
    kv: &mut B::Kv,
    (hk, hv): (&mut Vec<f32>, &mut Vec<f32>),
    pos0: usize,
    t: usize,
    shape: &AttnShape,
    dtype: KvDtype,
    name: &str,
) -> bool {
    let (nh, nkv, d) = (shape.n_heads, shape.n_kv_heads, shape.head_dim);
    let k = rng.vec(t * nkv * d, 2.0);
    let v = rng.vec(t * nkv * d, 1.0);
    let q = rng.vec(t * nh * d, 2.0);
    hk.extend(kv_rounded(dtype, &k));
    hv.extend(kv_rounded(dtype, &v));
    let (Some(kt), Some(vt), Some(qt)) = (h.up(&k, nkv * d), h.up(&v, nkv * d), h.up(&q, nh * d))
    else {
        return false;
    };
    let r = h.be.kv_write(kv, pos0, &kt, &vt);
    if h.ok("kv_write", r).is_none() {
        return false;
    }
    let r = h.be.attention(&qt, kv, pos0, shape);
    if let Some(o) = h.ok("attention", r) {
        let want = refr::attention(&q, hk, hv, pos0, shape);
        let budget = if dtype == KvDtype::F16 {
            F16_KV_REL
        } else {
            EXACT_REL
        };
        if let Some(got) = h.read(&o) {
            h.expect_close(name, &got, &want, budget);
        }
    }
    true
}

fn recurrent_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    // Causal conv, continued across calls.
    let (c, kernel) = (24, 4);
    let w = rng.vec(c * kernel, 0.5);
    let r = h.be.new_state((kernel - 1) * c);
    let Some(mut st) = h.ok("new_state", r) else {
        return;
    };
    let Some(wt) = h.up(&w, kernel) else { return };
    let mut ref_state = vec![0.0f32; (kernel - 1) * c];
    for t in [5usize, 1, 2] {
        let x = rng.vec(t * c, 1.5);
        let Some(xt) = h.up(&x, c) else { return };
        let r = h.be.conv1d_silu(&xt, &mut st, &wt, kernel);
        let Some(o) = h.ok("conv1d_silu", r) else {
            return;
        };
        let (want, next) = refr::conv1d_silu(&x, &ref_state, &w, c, kernel);
        ref_state = next;
        if let Some(got) = h.read(&o) {
            h.expect_close(&format!("conv1d_silu {t} rows"), &got, &want, EXACT_REL);
        }
    }
    if h.be.state_bytes(&st) != 4 * (kernel - 1) * c {
        h.fail(
            "state_bytes",
            format!("{} for {} floats", h.be.state_bytes(&st), (kernel - 1) * c),
        );
    }
    let r = h.be.zero_state(&mut st);
    if h.ok("zero_state", r).is_some() {
        // After zeroing, one row convolves only itself: the reference from a zero state.
        let x = rng.vec(c, 1.0);
        if let Some(xt) = h.up(&x, c) {
            let r = h.be.conv1d_silu(&xt, &mut st, &wt, kernel);
            if let Some(o) = h.ok("conv1d_silu", r) {
                let (want, _) = refr::conv1d_silu(&x, &vec![0.0; (kernel - 1) * c], &w, c, kernel);
                if let Some(got) = h.read(&o) {
                    h.expect_close("zero_state then conv1d_silu", &got, &want, EXACT_REL);
                }
            }
        }
    }
    // Gates and the delta rule, continued across calls.
    let s = DeltaShape {
        n_k_heads: 2,
        n_v_heads: 4,
        head_k_dim: 16,
        head_v_dim: 8,
    };
    let nv = s.n_v_heads;
    let a = rng
        .vec(nv, 1.0)
        .iter()
        .map(|v| v.abs() + 0.5)
        .collect::<Vec<_>>();
    let dt = rng.vec(nv, 0.5);
    let (Some(at), Some(dtt)) = (h.up(&a, nv), h.up(&dt, nv)) else {
        return;
    };
    let r = h.be.new_state(nv * s.head_v_dim * s.head_k_dim);
    let Some(mut ds) = h.ok("new_state", r) else {
        return;
    };
    let mut ref_ds = vec![0.0f32; nv * s.head_v_dim * s.head_k_dim];
    for t in [4usize, 1, 3] {
        let b = rng.vec(t * nv, 3.0);
        let alpha = rng.vec(t * nv, 3.0);
        let (Some(bt), Some(alt)) = (h.up(&b, nv), h.up(&alpha, nv)) else {
            return;
        };
        let r = h.be.delta_gates(&bt, &alt, &at, &dtt);
        let Some((beta, decay)) = h.ok("delta_gates", r) else {
            return;
        };
        let (want_b, want_d) = refr::delta_gates(&b, &alpha, &a, &dt);
        if let (Some(gb), Some(gd)) = (h.read(&beta), h.read(&decay)) {
            h.expect_close("delta_gates beta", &gb, &want_b, 1e-6);
            h.expect_close("delta_gates decay", &gd, &want_d, 1e-5);
        }
        let kd = s.n_k_heads * s.head_k_dim;
        // q and k L2-normalised per head, as the family feeds them.
        let unit = |rng: &mut Rng| -> Vec<f32> {
            let v = rng.vec(t * kd, 1.0);
            v.chunks_exact(s.head_k_dim)
                .flat_map(|hd| {
                    let n = hd.iter().map(|x| x * x).sum::<f32>().sqrt();
                    hd.iter().map(|x| x / n).collect::<Vec<_>>()
                })
                .collect()
        };
        let (q, k) = (unit(rng), unit(rng));
        let v = rng.vec(t * nv * s.head_v_dim, 1.0);
        let (Some(qt), Some(kt), Some(vt)) =
            (h.up(&q, kd), h.up(&k, kd), h.up(&v, nv * s.head_v_dim))
        else {
            return;
        };
        let r =
            h.be.gated_delta_rule(&qt, &kt, &vt, &decay, &beta, &mut ds, &s);
        let Some(o) = h.ok("gated_delta_rule", r) else {
            return;
        };
        let gd = h.read(&decay).unwrap_or_default();
        let gb = h.read(&beta).unwrap_or_default();
        let (want, next) = refr::gated_delta_rule(&q, &k, &v, &gd, &gb, &ref_ds, &s);
        ref_ds = next;
        if let Some(got) = h.read(&o) {
            h.expect_close(
                &format!("gated_delta_rule {t} rows"),
                &got,
                &want,
                EXACT_REL,
            );
        }
    }
}

/// A router's readback against the reference's per-row `(expert, weight)` pairs (ids exactly,
/// weights within 1e-6).
fn check_routes<B: Backend>(
    h: &mut Harness<B>,
    name: &str,
    routes: &crate::Routes,
    want: &[Vec<(usize, f32)>],
) {
    let mut got: Vec<Vec<(usize, f32)>> = vec![Vec::new(); want.len()];
    for (&e, rows) in &routes.experts {
        for &(row, wt) in rows {
            got[row].push((e, wt));
        }
    }
    for (row, (g, wnt)) in got.iter().zip(want).enumerate() {
        let ids_g: Vec<usize> = g.iter().map(|p| p.0).collect();
        let ids_w: Vec<usize> = wnt.iter().map(|p| p.0).collect();
        if ids_g != ids_w {
            h.fail(
                name,
                format!("row {row}: experts {ids_g:?}, reference {ids_w:?}"),
            );
            continue;
        }
        let gw: Vec<f32> = g.iter().map(|p| p.1).collect();
        let ww: Vec<f32> = wnt.iter().map(|p| p.1).collect();
        h.expect_close(name, &gw, &ww, 1e-6);
    }
}

fn router_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    let n_exp = 16;
    let t = 6;
    let logits = rng.vec(t * n_exp, 4.0);
    let Some(lt) = h.up(&logits, n_exp) else {
        return;
    };
    let specs = [
        (Scoring::SoftmaxOfTopK, Some(&w.pes), 4),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: true,
            },
            None,
            8,
        ),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: false,
            },
            None,
            2,
        ),
    ];
    // A replayed trace: distinct ids per row, not the top-k.
    let forced: Vec<usize> = (0..t)
        .flat_map(|r| [(3 * r) % n_exp, (3 * r + 5) % n_exp, 15 - r])
        .collect();
    let specs = specs.into_iter().map(|(s, p, k)| (s, p, k, None)).chain([
        (Scoring::SoftmaxOfTopK, Some(&w.pes), 3, Some(&forced[..])),
        (
            Scoring::TopKOfSoftmax {
                norm_topk_prob: true,
            },
            None,
            3,
            Some(&forced[..]),
        ),
    ]);
    for (scoring, pes, k, forced) in specs {
        let spec = RouterSpec {
            scoring,
            top_k: k,
            per_expert_scale: pes,
            trace: true,
            forced,
        };
        let r = h.be.route(&lt, &spec);
        let Some(routes) = h.ok("route", r) else {
            continue;
        };
        let name = format!("route {scoring:?} top-{k} forced {}", forced.is_some());
        check_routes(h, &name, &routes, &refr::route(&logits, n_exp, &spec, buf));
        // Margins: the k-th minus the (k+1)-th largest raw logit.
        let want_m: Vec<f32> = logits
            .chunks_exact(n_exp)
            .map(|r| {
                let mut v = r.to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v[k - 1] - v[k]
            })
            .collect();
        if routes.margins != want_m {
            h.fail(
                &name,
                format!("margins {:?}, want {want_m:?}", routes.margins),
            );
        }
    }
}

/// DeepSeek-V4's ops: dense products, row writes, RoPE at given positions, the grouped product,
/// both mHC sites (and the head's collapse), window pooling with and without overlap (and a prior
/// window), attention over a sliding ring plus selected entries, the indexer's top-k, and the
/// sqrt-softplus router with a selection bias and with forced (hash) ids.
fn dsv4_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng, w: &TestWeights) {
    let buf = h.buf;
    // linear
    let (t, c, n) = (5, 96, 24);
    let (x, wd) = (rng.vec(t * c, 1.0), rng.vec(n * c, 0.5));
    if let (Some(xt), Some(wt)) = (h.up(&x, c), h.up(&wd, c)) {
        let r = h.be.linear(&xt, &wt);
        if let Some(got) = h.ok("linear", r).and_then(|y| h.read(&y)) {
            h.expect_close("linear", &got, &refr::linear(&x, &wd, c), EXACT_REL);
        }
    }
    // set_rows
    let (a, b) = (rng.vec(6 * 8, 1.0), rng.vec(2 * 8, 1.0));
    if let (Some(mut at), Some(bt)) = (h.up(&a, 8), h.up(&b, 8)) {
        let r = h.be.set_rows(&mut at, 3, &bt);
        if h.ok("set_rows", r).is_some() {
            let mut want = a.clone();
            want[24..40].copy_from_slice(&b);
            if let Some(got) = h.read(&at) {
                h.expect_close("set_rows", &got, &want, 0.0);
            }
        }
        if h.be.set_rows(&mut at, 5, &bt).is_ok() {
            h.fail("set_rows", "rows past the end were accepted".into());
        }
    }
    // rope_at (interleaved, the trailing half of each head rotated via zero frequencies)
    let mut rope = Rope::interleaved(16, 160000.0);
    rope.inv_freq = std::iter::repeat_n(0.0, 8).chain(rope.inv_freq).collect();
    rope.rotated = 32;
    let x = rng.vec(3 * 64, 1.0);
    let positions = [0usize, 4, 1024];
    if let Some(mut xt) = h.up(&x, 64) {
        let r = h.be.rope_at(&mut xt, &rope, 32, &positions);
        if h.ok("rope_at", r).is_some() {
            let want = refr::rope_at(&x, 64, &rope, 32, &positions);
            if let Some(got) = h.read(&xt) {
                h.expect_close("rope_at", &got, &want, 2e-6);
            }
        }
    }
    // matmul_grouped
    for t in [1, 7] {
        let x = rng.vec(t * 4 * 64, 1.0);
        let Some(xt) = h.up(&x, 4 * 64) else { return };
        let r = h.be.matmul_grouped(&w.grouped, 4, Weights::Resident, &xt);
        if let Some(got) = h.ok("matmul_grouped", r).and_then(|y| h.read(&y)) {
            let want = refr::matmul_grouped(&w.grouped, 4, buf, &x);
            let budget = h.budget_q(t);
            h.expect_close(&format!("matmul_grouped T={t}"), &got, &want, budget);
        }
    }
    // hc_pre / hc_post (and the head)
    let spec = HcSpec {
        streams: 4,
        sinkhorn_iters: 20,
        hc_eps: 1e-6,
        norm_eps: 1e-6,
    };
    let (t, d) = (3, 32);
    let x = rng.vec(t * 4 * d, 2.0);
    for m in [24, 4] {
        let f = rng.vec(m * 4 * d, 0.3);
        let base = rng.vec(m, 0.5);
        let scale = rng.vec(if m == 4 { 1 } else { 3 }, 1.0);
        let (Some(xt), Some(ft)) = (h.up(&x, 4 * d), h.up(&f, 4 * d)) else {
            return;
        };
        let r = h.be.hc_pre(&xt, &ft, &base, &scale, &spec);
        let Some((col, rest)) = h.ok("hc_pre", r) else {
            continue;
        };
        let (wc, wrest) = refr::hc_pre(&x, 4 * d, &f, &base, &scale, &spec);
        if let Some(got) = h.read(&col) {
            h.expect_close(&format!("hc_pre collapse rows_f {m}"), &got, &wc, EXACT_REL);
        }
        match (rest, wrest) {
            (None, None) => {}
            (Some((post, comb)), Some((wp, wcomb))) => {
                let (Some(gp), Some(gc)) = (h.read(&post), h.read(&comb)) else {
                    return;
                };
                h.expect_close("hc_pre post", &gp, &wp, EXACT_REL);
                h.expect_close("hc_pre comb", &gc, &wcomb, EXACT_REL);
                let out = rng.vec(t * d, 1.0);
                let Some(ot) = h.up(&out, d) else { return };
                let r = h.be.hc_post(&xt, &ot, &post, &comb);
                if let Some(got) = h.ok("hc_post", r).and_then(|y| h.read(&y)) {
                    let want = refr::hc_post(&x, &out, &wp, &wcomb, 4);
                    h.expect_close("hc_post", &got, &want, EXACT_REL);
                }
            }
            _ => h.fail("hc_pre", format!("rows_f {m}: post/comb presence differs")),
        }
    }
    // compress_pool: HCA-like (no overlap), CSA-like (overlap) without and with a prior window
    for (rate, overlap, with_prior) in [(8, false, false), (4, true, false), (4, true, true)] {
        let (d, n_win) = (16, 3);
        let width = if overlap { 2 * d } else { d };
        let kv = rng.vec(n_win * rate * width, 1.0);
        let gate = rng.vec(n_win * rate * width, 3.0);
        let ape = rng.vec(rate * width, 1.0);
        let (pk, pg) = (rng.vec(rate * d, 1.0), rng.vec(rate * d, 3.0));
        let (Some(kt), Some(gt), Some(at), Some(pkt), Some(pgt)) = (
            h.up(&kv, width),
            h.up(&gate, width),
            h.up(&ape, width),
            h.up(&pk, d),
            h.up(&pg, d),
        ) else {
            return;
        };
        let prior = with_prior.then_some((&pkt, &pgt));
        let r = h.be.compress_pool(&kt, &gt, &at, rate, overlap, prior);
        if let Some(got) = h.ok("compress_pool", r).and_then(|y| h.read(&y)) {
            let p = with_prior.then_some((&pk[..], &pg[..]));
            let want = refr::compress_pool(&kv, &gate, &ape, rate, width, overlap, p);
            let name = format!("compress_pool rate {rate} overlap {overlap} prior {with_prior}");
            h.expect_close(&name, &got, &want, EXACT_REL);
        }
    }
    // attention_sparse: a sliding FP32/FP16 ring (K = V as the family uses it) plus entries
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let (nh, d, win) = (4, 32, 6);
        let Some(mut kv) = h.ok("new_kv", h.be.new_kv(win + 3, true, 1, d, dtype)) else {
            return;
        };
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: 1,
            head_dim: d,
            window: Some(win),
            scale: 1.0 / (d as f32).sqrt(),
            sinks: Some(rng.vec(nh, 2.0)),
        };
        let entries = rng.vec(5 * d, 2.0);
        let Some(et) = h.up(&entries, d) else { return };
        let mut hist = Vec::new();
        let mut pos0 = 0;
        for t in [7usize, 1, 3] {
            let k = rng.vec(t * d, 2.0);
            hist.extend(match dtype {
                KvDtype::F16 => k.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect(),
                KvDtype::F32 => k.clone(),
            });
            let q = rng.vec(t * nh * d, 2.0);
            let (Some(kt), Some(qt)) = (h.up(&k, d), h.up(&q, nh * d)) else {
                return;
            };
            if h.ok("kv_write", h.be.kv_write(&mut kv, pos0, &kt, &kt))
                .is_none()
            {
                return;
            }
            let visible: Vec<Vec<usize>> = (0..t)
                .map(|r| (0..5).filter(|e| (e + r + pos0) % 3 != 0).collect())
                .collect();
            let r = h.be.attention_sparse(&qt, &kv, pos0, &shape, &et, &visible);
            if let Some(got) = h.ok("attention_sparse", r).and_then(|y| h.read(&y)) {
                let want =
                    refr::attention_sparse(&q, &hist, &hist, pos0, &shape, &entries, &visible);
                let budget = if dtype == KvDtype::F16 {
                    F16_KV_REL
                } else {
                    EXACT_REL
                };
                h.expect_close(
                    &format!("attention_sparse {dtype:?} at {pos0}"),
                    &got,
                    &want,
                    budget,
                );
            }
            pos0 += t;
        }
    }
    // index_top_k: truncating and not, rows seeing different numbers of entries
    let (t, nh, d, n) = (4, 3, 16, 9);
    let (q, keys, wts) = (
        rng.vec(t * nh * d, 1.0),
        rng.vec(n * d, 1.0),
        rng.vec(t * nh, 1.0),
    );
    let visible = [0usize, 2, 5, 9];
    if let (Some(qt), Some(kt), Some(wt)) = (h.up(&q, nh * d), h.up(&keys, d), h.up(&wts, nh)) {
        for top_k in [3, 16] {
            let r = h.be.index_top_k(&qt, &kt, &wt, nh, &visible, top_k);
            let Some(got) = h.ok("index_top_k", r) else {
                continue;
            };
            let want = refr::index_top_k(&q, &keys, &wts, nh, d, &visible, top_k);
            for (row, (g, (wi, _))) in got.iter().zip(&want).enumerate() {
                if g != wi {
                    h.fail(
                        "index_top_k",
                        format!("top-{top_k} row {row}: {g:?}, reference {wi:?}"),
                    );
                }
            }
        }
    }
    // route: sqrt-softplus with and without the selection bias, and forced (hash) ids
    let (t, n_exp) = (6, 16);
    let logits = rng.vec(t * n_exp, 4.0);
    let Some(lt) = h.up(&logits, n_exp) else {
        return;
    };
    let forced: Vec<usize> = (0..t)
        .flat_map(|r| {
            [
                (5 * r + 1) % n_exp,
                (5 * r + 2) % n_exp,
                (5 * r + 3) % n_exp,
            ]
        })
        .collect();
    for (bias, forced) in [
        (Some(w.bias), None),
        (None, None),
        (None, Some(&forced[..])),
    ] {
        let spec = RouterSpec {
            scoring: Scoring::SqrtSoftplus {
                routed_scaling_factor: 1.5,
                correction_bias: bias,
            },
            top_k: if forced.is_some() { 3 } else { 6 },
            per_expert_scale: None,
            trace: false,
            forced,
        };
        let r = h.be.route(&lt, &spec);
        let Some(routes) = h.ok("route", r) else {
            continue;
        };
        let name = format!(
            "route sqrt-softplus bias {} forced {}",
            bias.is_some(),
            forced.is_some()
        );
        check_routes(h, &name, &routes, &refr::route(&logits, n_exp, &spec, buf));
    }
}

/// Inkling's ops: the f32 `linear`, the plain causal `conv1d` continued across calls,
/// `attention_rel` (extent shorter and longer than what a query sees, sliding ring and linear
/// layers, FP16/FP32 KV, GQA, the log position scale active from position 3) and `route_sinks`.
fn inkling_ops<B: Backend>(h: &mut Harness<B>, rng: &mut Rng) {
    // linear
    let (t, cols, rows) = (5, 40, 7);
    let x = rng.vec(t * cols, 1.5);
    let w = rng.vec(rows * cols, 0.5);
    if let (Some(xt), Some(wt)) = (h.up(&x, cols), h.up(&w, cols)) {
        let r = h.be.linear(&xt, &wt);
        if let Some(got) = h.ok("linear", r).and_then(|y| h.read(&y)) {
            let want = refr::linear(&x, &w, cols);
            h.expect_close("linear", &got, &want, EXACT_REL);
        }
    }
    // conv1d, continued across calls
    let (c, kernel) = (20, 4);
    let w = rng.vec(c * kernel, 0.5);
    let r = h.be.new_state((kernel - 1) * c);
    let (Some(mut st), Some(wt)) = (h.ok("new_state", r), h.up(&w, kernel)) else {
        return;
    };
    let mut ref_state = vec![0.0f32; (kernel - 1) * c];
    for t in [4usize, 1, 3] {
        let x = rng.vec(t * c, 1.5);
        let Some(xt) = h.up(&x, c) else { return };
        let r = h.be.conv1d(&xt, &mut st, &wt, kernel);
        let Some(o) = h.ok("conv1d", r) else { return };
        let (want, next) = refr::conv1d(&x, &ref_state, &w, c, kernel);
        ref_state = next;
        if let Some(got) = h.read(&o) {
            h.expect_close(&format!("conv1d {t} rows"), &got, &want, EXACT_REL);
        }
    }
    // attention_rel: (dtype, window, extent, heads, log scaling)
    let log = Some(LogScaling {
        n_floor: 3.0,
        alpha: 0.3,
    });
    let cases = [
        (KvDtype::F32, None, 6, (4, 2), log),
        (KvDtype::F32, Some(5), 3, (2, 1), None),
        (KvDtype::F16, Some(4), 4, (4, 2), None),
        (KvDtype::F16, None, 20, (3, 3), log),
    ];
    for (dtype, window, extent, (nh, nkv), log_scaling) in cases {
        let (d, d_rel) = (16, 5);
        let chunks = [5usize, 1, 3, 1];
        let (kv_rows, ring) = match window {
            Some(w) => (w + 5, true),
            None => (chunks.iter().sum(), false),
        };
        let r = h.be.new_kv(kv_rows, ring, nkv, d, dtype);
        let Some(mut kv) = h.ok("new_kv", r) else {
            return;
        };
        let shape = AttnShape {
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: d,
            window,
            scale: 1.0 / d as f32,
            sinks: None,
        };
        let proj = rng.vec(d_rel * extent, 1.0);
        let Some(pt) = h.up(&proj, extent) else {
            return;
        };
        let (mut hk, mut hv) = (Vec::new(), Vec::new());
        let mut pos0 = 0;
        for t in chunks {
            let k = rng.vec(t * nkv * d, 2.0);
            let v = rng.vec(t * nkv * d, 1.0);
            let q = rng.vec(t * nh * d, 2.0);
            let rel = rng.vec(t * nh * d_rel, 1.0);
            let round = |x: &[f32]| -> Vec<f32> {
                match dtype {
                    KvDtype::F16 => x.iter().map(|&a| half::f16::from_f32(a).to_f32()).collect(),
                    KvDtype::F32 => x.to_vec(),
                }
            };
            hk.extend(round(&k));
            hv.extend(round(&v));
            let (Some(kt), Some(vt), Some(qt), Some(rt)) = (
                h.up(&k, nkv * d),
                h.up(&v, nkv * d),
                h.up(&q, nh * d),
                h.up(&rel, nh * d_rel),
            ) else {
                return;
            };
            let r = h.be.kv_write(&mut kv, pos0, &kt, &vt);
            if h.ok("kv_write", r).is_none() {
                return;
            }
            let bias = RelBias {
                rel: &rt,
                proj: &pt,
                log_scaling,
            };
            let r = h.be.attention_rel(&qt, &kv, pos0, &shape, &bias);
            if let Some(got) = h.ok("attention_rel", r).and_then(|o| h.read(&o)) {
                let want = refr::attention_rel(
                    &q,
                    &hk,
                    &hv,
                    pos0,
                    &shape,
                    &rel,
                    &proj,
                    d_rel,
                    log_scaling,
                );
                let budget = if dtype == KvDtype::F16 {
                    F16_KV_REL
                } else {
                    EXACT_REL
                };
                let name = format!(
                    "attention_rel {dtype:?} window {window:?} extent {extent} heads {nh}/{nkv} \
                     log {} at {pos0}",
                    log_scaling.is_some()
                );
                h.expect_close(&name, &got, &want, budget);
            }
            pos0 += t;
        }
    }
    // route_sinks: 12 routed + 2 shared, plain and forced.
    let (n_routed, n_shared, t) = (12, 2, 5);
    let n_all = n_routed + n_shared;
    let logits = rng.vec(t * n_all, 4.0);
    let bias = rng.vec(n_routed, 0.3);
    let forced: Vec<usize> = (0..t).flat_map(|r| [r % n_routed, 11 - r, 6]).collect();
    let (Some(lt), Some(bt)) = (h.up(&logits, n_all), h.up(&bias, n_routed)) else {
        return;
    };
    let router = SinkRouter {
        bias: &bt,
        n_shared,
        scale: 2.5,
    };
    for (k, forced) in [(6, None), (3, Some(&forced[..]))] {
        let spec = RouterSpec {
            scoring: Scoring::SoftmaxOfTopK,
            top_k: k,
            per_expert_scale: None,
            trace: true,
            forced,
        };
        let r = h.be.route_sinks(&lt, &router, &spec);
        let Some(routes) = h.ok("route_sinks", r) else {
            continue;
        };
        let want = refr::route_sinks(&logits, n_all, &bias, router.scale, &spec);
        let name = format!("route_sinks top-{k} forced {}", forced.is_some());
        check_routes(h, &name, &routes, &want);
        // Margins: the k-th minus the (k+1)-th largest selection score.
        let want_m: Vec<f32> = logits
            .chunks_exact(n_all)
            .map(|r| {
                let mut v: Vec<f32> = r[..n_routed]
                    .iter()
                    .zip(&bias)
                    .map(|(&l, &b)| 1.0 / (1.0 + (-l).exp()) + b)
                    .collect();
                v.sort_by(|a, b| b.total_cmp(a));
                v[k - 1] - v[k]
            })
            .collect();
        let close = routes.margins.len() == want_m.len()
            && routes
                .margins
                .iter()
                .zip(&want_m)
                .all(|(a, b)| (a - b).abs() <= 1e-6);
        if !close {
            h.fail(
                &name,
                format!("margins {:?}, want {want_m:?}", routes.margins),
            );
        }
    }
}
