//! The op test harness (llama.cpp's `test-backend-ops` idea): every op of a backend runs against
//! its twin in [`crate::reference`] on random shapes, quantized weights at odd 2-byte-aligned
//! offsets with negative scales, 2/4/8-bit and groups 32/64/128. A backend that lacks an op fails
//! with the op's name. Each backend crate's tests call [`run_all`] on every backend it can start
//! (`crates/backend/tests/backend_ops.rs` for the CPU tables).
//!
//! The cases follow the op groups ([`crate::ops`]): `core/` (data, products, norms, attention,
//! router), `recurrent`, `deepseek_v4`, `inkling`. After them, the backend's
//! [`CoreOps::supports`](crate::CoreOps::supports) answer is checked against what its ops did:
//! an op it claims must have run without [`OpError::Missing`], an op it disclaims must not have run.

mod core;
mod deepseek_v4;
mod inkling;
mod recurrent;

use std::collections::BTreeSet;

pub use self::core::kv_rounded;
use self::core::{
    attention_ops, check_routes, data_ops, norm_rope_kv, norms_and_elementwise, products, rope_ops,
    router_ops, two_into_residual,
};
use deepseek_v4::dsv4_ops;
use inkling::inkling_ops;
use recurrent::recurrent_ops;

use crate::reference as refr;
use crate::{
    Act, AttnShape, Backend, DeltaShape, FRef, HcSpec, KvDtype, LogScaling, Mlp, Norm, Op, OpError,
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
/// The int16 tables (`avx512i16`, `amx`, `avx2i16`) round the activations of every 4-bit product to 32767 levels of
/// the group's max|x|; observed ≤ 5e-5 for one product.
pub const Q16_REL: f64 = 5e-4;
/// A GLU MLP on that table (two rounded products, see [`Q8_GLU_REL`]); observed up to 1.7e-4.
pub const Q16_GLU_REL: f64 = 2e-3;

/// What a backend's quantized products round, which picks the budgets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numerics {
    /// f32 throughout (the exact CPU tables, CUDA).
    Exact,
    /// Prefill (4+ rows) activations of 4-bit products rounded to int8 (`avx512vnni`).
    Int8Prefill,
    /// Every 4-bit product's activations rounded to int16 (`avx512i16`, `amx`, `avx2i16`).
    Int16,
}

impl Numerics {
    /// The class of a CPU kernel table.
    pub fn of(k: &mference_kernels::Kernels) -> Self {
        match (k.is_exact(), k.is_batch_invariant()) {
            (true, _) => Self::Exact,
            // Rounded in the GEMV as in the GEMM: the int16 table.
            (false, true) => Self::Int16,
            (false, false) => Self::Int8Prefill,
        }
    }
}

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
    numerics: Numerics,
    /// Ops that failed with [`OpError::Missing`], by the name they reported.
    missing: BTreeSet<&'static str>,
    /// Labels of the calls that returned anything else (a result or another error).
    reached: BTreeSet<String>,
}

impl<B: Backend> Harness<'_, B> {
    fn fail(&mut self, op: &str, why: String) {
        self.fails.push(format!("{}: {op}: {why}", self.be.name()));
    }

    /// Unwraps an op's result, recording an error (a missing op names itself).
    fn ok<T>(&mut self, op: &str, r: Result<T, OpError>) -> Option<T> {
        match &r {
            Err(OpError::Missing { op: name, .. }) => {
                self.missing.insert(name);
            }
            _ => {
                self.reached.insert(op.to_string());
            }
        }
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

    /// The budget of one quantized product of `rows` rows.
    fn budget_q(&self, rows: usize) -> f64 {
        match self.numerics {
            Numerics::Int8Prefill if rows >= 4 => Q8_REL,
            Numerics::Int16 => Q16_REL,
            _ => EXACT_REL,
        }
    }

    /// The budget of a GLU MLP (two chained products) of `rows` rows.
    fn budget_glu(&self, rows: usize) -> f64 {
        match self.numerics {
            Numerics::Int8Prefill if rows >= 4 => Q8_GLU_REL,
            Numerics::Int16 => Q16_GLU_REL,
            _ => EXACT_REL,
        }
    }
}

/// Every op on `be` (its resident bytes are `buf`, laid out by `w`; `numerics`: what its products
/// round, which picks their budgets), seed `seed`. Returns the
/// failures, one line each: `backend: op: why`.
pub fn run_all<B: Backend>(
    be: &B,
    buf: &[u8],
    w: &TestWeights,
    numerics: Numerics,
    seed: u64,
) -> Vec<String> {
    let mut h = Harness {
        be,
        buf,
        fails: Vec::new(),
        numerics,
        missing: BTreeSet::new(),
        reached: BTreeSet::new(),
    };
    let mut rng = Rng(seed);
    data_ops(&mut h, &mut rng);
    products(&mut h, &mut rng, w);
    norms_and_elementwise(&mut h, &mut rng, w);
    // Its own stream, so the later cases see the numbers they always saw.
    two_into_residual(&mut h, &mut Rng(seed ^ 0x5EED), w);
    norm_rope_kv(&mut h, &mut Rng(seed ^ 0x0A77), w);
    rope_ops(&mut h, &mut rng, w);
    attention_ops(&mut h, &mut rng);
    recurrent_ops(&mut h, &mut rng);
    router_ops(&mut h, &mut rng, w);
    dsv4_ops(&mut h, &mut rng, w);
    inkling_ops(&mut h, &mut rng);
    capability(&mut h);
    h.fails
}

/// [`CoreOps::supports`](crate::CoreOps::supports) against what the cases saw, per [`Op`]: a
/// supported op must have been reached and never reported missing; an unsupported one must never
/// have run (it may go unreached when a case stops at an earlier missing op).
fn capability<B: Backend>(h: &mut Harness<B>) {
    for &op in Op::ALL {
        let (name, says) = (op.name(), B::supports(op));
        let missing = h.missing.contains(name);
        let reached = h.reached.contains(name);
        if says && missing {
            h.fail(name, "supports() says yes, but the op is missing".into());
        } else if says && !reached {
            h.fail(
                name,
                "supports() says yes, but no case reached the op".into(),
            );
        } else if !says && reached {
            h.fail(name, "supports() says no, but the op ran".into());
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
