//! Prefill products: quantized products of [`min_rows`] or more rows of x on `qgemm_tc`
//! (ops/gemm.cu: the tensor cores, `mma.sync` m16n8k16 over BF16 codes and a three-term BF16 x,
//! f32 accumulation, the affine scale and bias folded per group) or, for 4-bit matrices, on
//! `qgemm_tc4` (the same bits, pipelined: x split into its terms once per product by
//! `qt_split_x`, codes and terms copied ahead by `cp.async`), or on `qgemm` (a tiled f32 GEMM on
//! the CUDA cores, `MFERENCE_CUDA_QG=f32`, kept for measurements). All dequantize each tile of an
//! MLX affine quantized matrix once for many rows of x, where `qmatmul` reads the codes again for
//! every 4 rows. Decode (one row) and short products stay on `qmatmul`. Also the
//! routed experts of a prefill chunk that the GPU slots hold, batched into a few launches.

use std::sync::OnceLock;

use cudarc::driver::LaunchConfig;
use mference_backend::{check, check_mlp, Act, Mlp, OpResult, QRef, Weights};

use crate::{qref_offsets, CudaBackend, CudaTensor, QJob, Scalar, QM_BLOCKS};

/// Rows of x from which a product runs on a GEMM kernel (unless `MFERENCE_CUDA_QG_MIN_ROWS`
/// says otherwise: [`min_rows`]): 2 for `qgemm_tc` (a tile of 32 rows of x costs the tensor
/// cores about what one row does, and a prefill expert of a few rows then joins its layer's
/// batched launch instead of taking three launches of its own; one row stays on the decode
/// kernels, in prefill as in decode, so an expert's bits do not depend on the GPU budget), 16
/// for `qgemm`. A large dense product of 2-7 rows pays for it (on the H200, Gemma 4 26B's q
/// projection, 4096 x 2816, takes 93 us on `qgemm_tc` at 2 rows against 19 us for one row on
/// `qmv`): a prompt or chunk that short costs a few milliseconds more.
const QT_MIN_ROWS: usize = 2;
const QG_MIN_ROWS: usize = 16;
/// `QG_BM` and `QG_BK` of ops/gemm.cu: output rows per block, columns per step (`QT_BK` is the
/// same 32).
const QG_BM: usize = 64;
const QG_BK: usize = 32;
/// `QT_BM`, `QT_BT` and `QT_THREADS` of ops/gemm.cu: `qgemm_tc`'s w rows and x rows per block,
/// and threads per block.
const QT_BM: usize = 128;
const QT_BT: usize = 32;
const QT_THREADS: u32 = 128;
/// `qgemm_tc4`'s w rows per block (= threads): 256, or 128 where a launch of 256-row tiles would
/// leave [`QM_BLOCKS`] slots idle (the tile never changes a result).
const Q4_BM: [usize; 2] = [256, 128];
/// Blocks a product's column splits aim for per tile of x rows, `qgemm` (a third of an H200's
/// SMs: the gate and up products of an expert, split, about fill the device) and `qgemm_tc` (16:
/// its blocks are twice as tall and each does 4x the work per step; a model-wide projection is
/// not split).
const QG_SPLIT_BLOCKS: usize = 48;
const QT_SPLIT_BLOCKS: usize = 16;
/// At most this many column splits, each of at least `QG_SPLIT_MIN_STEPS` steps of `QG_BK`.
const QG_MAX_SPLITS: usize = 8;
const QG_SPLIT_MIN_STEPS: usize = 8;

/// Which kernel runs the prefill products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// The tensor cores (the default): `qgemm_tc4` where a launch's matrices allow, else
    /// `qgemm_tc`.
    Tc,
    /// `qgemm_tc` only (`MFERENCE_CUDA_QG=tc-plain`, for measurements).
    TcPlain,
    /// `qgemm`, f32 on the CUDA cores (`MFERENCE_CUDA_QG=f32`).
    F32,
}

/// The prefill product kernel: the tensor cores, `qgemm_tc` alone with
/// `MFERENCE_CUDA_QG=tc-plain`, or `qgemm` with `MFERENCE_CUDA_QG=f32` (for measurements; any
/// other value is refused at the first product rather than ignored). Read once
/// per process, so every product of a run takes the same path.
fn kernel() -> Result<Kernel, String> {
    static K: OnceLock<Result<Kernel, String>> = OnceLock::new();
    K.get_or_init(|| match std::env::var("MFERENCE_CUDA_QG").as_deref() {
        Err(_) | Ok("tc") => Ok(Kernel::Tc),
        Ok("tc-plain") => Ok(Kernel::TcPlain),
        Ok("f32") => Ok(Kernel::F32),
        Ok(v) => Err(format!(
            "MFERENCE_CUDA_QG={v}: expected tc, tc-plain or f32"
        )),
    })
    .clone()
}

/// Products one GEMM launch takes at most (`QG_JOBS` of ops/gemm.cu): a Gemma 4 layer's routed
/// gate and up products of a prefill chunk (2 x 128 experts) in one launch, where the decode
/// kernels' `QM_JOBS` (32) took eight.
const QG_JOBS: usize = 256;

/// Products per GEMM launch: [`QG_JOBS`], or `MFERENCE_CUDA_QG_JOBS` (1 to 256; for measurements;
/// the same bits at every value), read once per process.
fn jobs_per_launch() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("MFERENCE_CUDA_QG_JOBS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=QG_JOBS).contains(n))
            .unwrap_or(QG_JOBS)
    })
}

/// The `QGJobs` argument of the GEMM kernels: per product its matrix's codes, scales and
/// biases, its x, its y and its rows of x.
#[repr(C)]
#[derive(Clone, Copy)]
struct QGJobs {
    w: [u64; QG_JOBS],
    s: [u64; QG_JOBS],
    b: [u64; QG_JOBS],
    x: [u64; QG_JOBS],
    y: [u64; QG_JOBS],
    t_rows: [i32; QG_JOBS],
}

impl QGJobs {
    fn new() -> Self {
        Self {
            w: [0; QG_JOBS],
            s: [0; QG_JOBS],
            b: [0; QG_JOBS],
            x: [0; QG_JOBS],
            y: [0; QG_JOBS],
            t_rows: [0; QG_JOBS],
        }
    }
}

// SAFETY: `repr(C)` u64 and i32 arrays, laid out as `struct QGJobs` in ops/gemm.cu.
unsafe impl Scalar for QGJobs {}

/// The `QGSums` argument of `qgemm_sum`: per product its split sums, its output, and the floats
/// of one split.
#[repr(C)]
#[derive(Clone, Copy)]
struct QGSums {
    part: [u64; QG_JOBS],
    y: [u64; QG_JOBS],
    n: [u64; QG_JOBS],
}

// SAFETY: plain `repr(C)` u64 arrays, laid out as `struct QGSums` in ops/gemm.cu.
unsafe impl Scalar for QGSums {}

/// Rows of x from which a product runs on a GEMM kernel: [`QT_MIN_ROWS`] (`qgemm_tc`) or
/// [`QG_MIN_ROWS`] (`qgemm`), or `MFERENCE_CUDA_QG_MIN_ROWS` (2 to 4096; decode's one row
/// always stays on `qmatmul`), read once per process so every product of a run takes the same
/// path (for measurements).
pub(crate) fn min_rows() -> usize {
    static MIN: OnceLock<usize> = OnceLock::new();
    *MIN.get_or_init(|| {
        std::env::var("MFERENCE_CUDA_QG_MIN_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (2..=4096).contains(n))
            .unwrap_or(match kernel() {
                Ok(Kernel::F32) => QG_MIN_ROWS,
                _ => QT_MIN_ROWS,
            })
    })
}

/// Whether `qgemm` computes products of `w`: 2/4/8 bits, a multiple of `QG_BK` columns, groups a
/// power of two of at least `QG_BK` columns (a step's columns of a row share one scale).
fn fits(w: &QRef) -> bool {
    matches!(w.bits, 2 | 4 | 8)
        && w.cols.is_multiple_of(QG_BK)
        && w.group_size.is_power_of_two()
        && w.group_size >= QG_BK
}

/// Column splits and steps per split for a `[rows, cols]` matrix on a kernel of `bm` output rows
/// per block aiming at `blocks` blocks per tile of x rows. A function of the shape (and the
/// kernel) alone, so a product gives the same bits whatever else its launch holds and wherever
/// its matrix lies.
fn splits(rows: usize, cols: usize, (bm, blocks): (usize, usize)) -> (usize, usize) {
    let steps = cols / QG_BK;
    let want = blocks
        .div_ceil(rows.div_ceil(bm))
        .min(steps / QG_SPLIT_MIN_STEPS)
        .clamp(1, QG_MAX_SPLITS);
    let per = steps.div_ceil(want);
    (steps.div_ceil(per), per)
}

impl CudaBackend {
    /// Runs the products of `jobs` (each `[t_rows, cols]` rows of x into `[t_rows, rows]`) that
    /// `qgemm` computes; returns the others, for `qmatmul`.
    pub(crate) fn gemm_products<'a>(
        &self,
        op: &'static str,
        jobs: &[QJob<'a>],
        t_rows: usize,
    ) -> OpResult<Vec<QJob<'a>>> {
        let (fit, rest): (Vec<QJob>, Vec<QJob>) = jobs.iter().partition(|j| fits(j.w));
        let fit: Vec<(QJob, usize)> = fit.into_iter().map(|j| (j, t_rows)).collect();
        self.gemm_jobs(op, &fit)?;
        Ok(rest)
    }

    /// [`CoreOps::glu_mlp_experts`](mference_backend::CoreOps::glu_mlp_experts): experts of
    /// [`min_rows`] or more rows in a few `qgemm` launches (every gate and up product
    /// together, one `glu_act` over all their rows, every down product together), the others by
    /// `glu_mlp` each. The products run on the same kernels, bytes and split counts as in
    /// `glu_mlp`, so each result has its bits.
    pub(crate) fn gemm_glu_experts(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        xs: &[&CudaTensor],
    ) -> OpResult<Vec<CudaTensor>> {
        let op = "glu_mlp_experts";
        check(op, srcs.len() == xs.len(), || {
            format!("{} sources for {} inputs", srcs.len(), xs.len())
        })?;
        for x in xs {
            check_mlp(op, mlp, x.cols)?;
        }
        let mats = [&mlp.gate_proj, &mlp.up_proj, &mlp.down_proj];
        let batched = |x: &CudaTensor| x.rows >= min_rows() && mats.iter().all(|w| fits(w));
        let mut out: Vec<Option<CudaTensor>> = xs.iter().map(|_| None).collect();
        // Before the expert cache is locked below: glu_mlp locks it itself.
        for (j, (src, x)) in srcs.iter().zip(xs).enumerate() {
            if !batched(x) {
                out[j] = Some(self.glu_mlp(mlp, act, *src, x)?);
            }
        }
        let js: Vec<usize> = (0..xs.len()).filter(|&j| batched(xs[j])).collect();
        if !js.is_empty() {
            let picked: Vec<Weights> = js.iter().map(|&j| srcs[j]).collect();
            let src = self.sources(op, &picked)?;
            let (inner, h) = (mlp.gate_proj.rows, mlp.down_proj.rows);
            let total: usize = js.iter().map(|&j| xs[j].rows).sum();
            // Every expert's gate and up rows, stacked in the order of `js`.
            let mut g = self.uninit_tensor(op, total, inner)?;
            let u = self.uninit_tensor(op, total, inner)?;
            let ys = js
                .iter()
                .map(|&j| self.uninit_tensor(op, xs[j].rows, h))
                .collect::<OpResult<Vec<_>>>()?;
            let (ga, ua) = (self.addr(&*g.buf), self.addr(&*u.buf));
            let mut gate_up = Vec::with_capacity(2 * js.len());
            let mut down = Vec::with_capacity(js.len());
            let mut r0 = 0;
            for ((&j, &(buf, len)), y) in js.iter().zip(&src.at).zip(&ys) {
                let (t, x) = (xs[j].rows, self.addr(&*xs[j].buf));
                let (gj, uj) = (ga + (4 * r0 * inner) as u64, ua + (4 * r0 * inner) as u64);
                let job = |w, x, y| (QJob { w, buf, len, x, y }, t);
                gate_up.push(job(&mlp.gate_proj, x, gj));
                gate_up.push(job(&mlp.up_proj, x, uj));
                down.push(job(&mlp.down_proj, gj, self.addr(&*y.buf)));
                r0 += t;
            }
            self.gemm_jobs(op, &gate_up)?;
            self.glu_act(op, act, &mut g, &u)?;
            self.gemm_jobs(op, &down)?;
            self.after_reads(op, src)?;
            for (&j, y) in js.iter().zip(ys) {
                out[j] = Some(y);
            }
        }
        Ok(out
            .into_iter()
            .map(|y| y.expect("every expert ran"))
            .collect())
    }

    /// Runs `jobs` (products that [`fits`], each with its rows of x), one `qgemm` launch per
    /// shape and [`jobs_per_launch`] jobs.
    fn gemm_jobs(&self, op: &'static str, jobs: &[(QJob, usize)]) -> OpResult<()> {
        let shape = |w: &QRef| (w.rows, w.cols, w.bits, w.group_size);
        let mut shapes: Vec<_> = jobs.iter().map(|j| shape(j.0.w)).collect();
        shapes.sort_unstable();
        shapes.dedup();
        for sh in shapes {
            let same: Vec<(QJob, usize)> = jobs
                .iter()
                .copied()
                .filter(|j| shape(j.0.w) == sh)
                .collect();
            for chunk in same.chunks(jobs_per_launch()) {
                self.qgemm(op, chunk)?;
            }
        }
        Ok(())
    }

    /// One `qgemm_tc` or `qgemm` launch ([`kernel`]; and its `qgemm_sum` where the columns are
    /// split): at most [`QG_JOBS`] products of one shape that [`fits`], each with its rows of x.
    fn qgemm(&self, op: &'static str, jobs: &[(QJob, usize)]) -> OpResult<()> {
        let kernel = kernel().map_err(|why| mference_backend::OpError::Device {
            backend: self.name.clone(),
            op,
            why,
        })?;
        let w = jobs[0].0.w;
        let (rows, cols) = (w.rows, w.cols);
        let (bm, blocks) = match kernel {
            Kernel::Tc | Kernel::TcPlain => (QT_BM, QT_SPLIT_BLOCKS),
            Kernel::F32 => (QG_BM, QG_SPLIT_BLOCKS),
        };
        // `qgemm_tc4` takes `qgemm_tc`'s splits: the same sums in the same order.
        let (n_split, per) = splits(rows, cols, (bm, blocks));
        let tc4 = kernel == Kernel::Tc && w.bits == 4;
        let mut a = QGJobs::new();
        for (i, &(j, t)) in jobs.iter().enumerate() {
            let [wo, so, bo] = qref_offsets(op, j.w, j.len)?;
            (a.w[i], a.s[i], a.b[i]) = (j.buf + wo, j.buf + so, j.buf + bo);
            (a.x[i], a.y[i], a.t_rows[i]) = (j.x, j.y, t as i32);
        }
        // Split sums: job i's [n_split, t_i, rows] planes, one job after another.
        let planes: Vec<usize> = jobs.iter().map(|&(_, t)| t * rows).collect();
        let part = if n_split > 1 {
            let p = self.uninit_tensor(op, 1, n_split * planes.iter().sum::<usize>())?;
            let mut at = self.addr(&*p.buf);
            let mut starts = Vec::with_capacity(jobs.len());
            for (i, &n) in planes.iter().enumerate() {
                a.y[i] = at;
                starts.push(at);
                at += (4 * n_split * n) as u64;
            }
            Some((p, starts))
        } else {
            None
        };
        let row_tiles = rows.div_ceil(bm);
        let t_max = jobs.iter().map(|&(_, t)| t).max().unwrap_or(0);
        // 64 rows of x per block once the launch has blocks enough, else 32 (twice the blocks,
        // each half the work); the choice never changes a result.
        let bn = if row_tiles * jobs.len() * n_split * t_max.div_ceil(64) >= QM_BLOCKS {
            64
        } else {
            32
        };
        let (ri, ci, bi, gi, bni, si, pi) = (
            rows as i32,
            cols as i32,
            w.bits as i32,
            w.group_size as i32,
            bn as i32,
            n_split as i32,
            per as i32,
        );
        // `qgemm_tc`'s tile of x rows is fixed; `qgemm` takes `bn` as an argument.
        let (x_tile, threads) = match kernel {
            Kernel::Tc | Kernel::TcPlain => (QT_BT, QT_THREADS),
            Kernel::F32 => (bn, 4 * bn as u32),
        };
        let x_tiles = t_max.div_ceil(x_tile).min(65535 / n_split);
        let cfg = LaunchConfig {
            grid_dim: (
                row_tiles as u32,
                jobs.len() as u32,
                (x_tiles * n_split) as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let _terms;
        if tc4 {
            _terms = self.split_x(op, &mut a, jobs.len(), cols)?;
            let bm4 = Q4_BM
                .into_iter()
                .find(|&m| rows.div_ceil(m) * jobs.len() * n_split * x_tiles >= QM_BLOCKS)
                .unwrap_or(Q4_BM[1]);
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(bm4) as u32, cfg.grid_dim.1, cfg.grid_dim.2),
                block_dim: (bm4 as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, op, "qgemm_tc4", cfg, &a, &ri, &ci, &gi, &si, &pi)?;
        } else {
            match kernel {
                Kernel::Tc | Kernel::TcPlain => {
                    launch!(self, op, "qgemm_tc", cfg, &a, &ri, &ci, &bi, &gi, &si, &pi)?
                }
                Kernel::F32 => {
                    launch!(self, op, "qgemm", cfg, &a, &ri, &ci, &bi, &gi, &bni, &si, &pi)?
                }
            }
        }
        if let Some((_p, starts)) = part {
            let mut s = QGSums {
                part: [0; QG_JOBS],
                y: [0; QG_JOBS],
                n: [0; QG_JOBS],
            };
            for (i, (&(j, _), &n)) in jobs.iter().zip(&planes).enumerate() {
                (s.part[i], s.y[i], s.n[i]) = (starts[i], j.y, n as u64);
            }
            launch!(
                self,
                op,
                "qgemm_sum",
                crate::launch::elems_per_job(planes.iter().sum(), jobs.len()),
                &s,
                &si
            )?;
        }
        Ok(())
    }
}

impl CudaBackend {
    /// `qt_split_x` for the jobs of a `qgemm_tc4` launch: each distinct x (jobs that share one,
    /// as an expert's gate and up do, share its terms) split into `QT_TERMS` BF16 planes and its
    /// step sums (the layout at `qt_split_x` in ops/gemm.cu), in one buffer, returned; each job's
    /// `q.x` then points at its terms.
    fn split_x(
        &self,
        op: &'static str,
        a: &mut QGJobs,
        n: usize,
        cols: usize,
    ) -> OpResult<CudaTensor> {
        let terms = crate::compile::qt_terms();
        // The distinct (x, rows) pairs, and which one each job reads.
        let mut distinct: Vec<(u64, usize)> = Vec::new();
        let mut which = Vec::with_capacity(n);
        for i in 0..n {
            let x = (a.x[i], a.t_rows[i] as usize);
            which.push(distinct.iter().position(|&d| d == x).unwrap_or_else(|| {
                distinct.push(x);
                distinct.len() - 1
            }));
        }
        // Bytes of one x's terms and sums, rounded to 16 so the next starts aligned.
        let bytes = |t: usize| {
            (2 * terms * t * cols + 4 * (cols / QG_BK) * t.next_multiple_of(QT_BT))
                .next_multiple_of(16)
        };
        let total: usize = distinct.iter().map(|&(_, t)| bytes(t)).sum();
        let buf = self.uninit_tensor(op, 1, total / 4)?;
        let mut split = QGJobs::new();
        let mut at = self.addr(&*buf.buf);
        for (d, &(x, t)) in distinct.iter().enumerate() {
            (split.x[d], split.y[d], split.t_rows[d]) = (x, at, t as i32);
            at += bytes(t) as u64;
        }
        for (i, &d) in which.iter().enumerate() {
            a.x[i] = split.y[d];
        }
        // A thread per (row, step) of each distinct x.
        let cells: usize = distinct
            .iter()
            .map(|&(_, t)| t.next_multiple_of(QT_BT) * (cols / QG_BK))
            .sum();
        let ci = cols as i32;
        launch!(
            self,
            op,
            "qt_split_x",
            crate::launch::elems_per_job(cells, distinct.len()),
            &split,
            &ci
        )?;
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cover_the_columns_and_follow_the_shape() {
        for (rows, cols) in [
            (704, 2816),
            (2816, 704),
            (4096, 2816),
            (128, 2816),
            (1, 32),
            (7, 256),
            (262_144, 2816),
            (512, 2048),
        ] {
            for k in [(QG_BM, QG_SPLIT_BLOCKS), (QT_BM, QT_SPLIT_BLOCKS)] {
                let (n, per) = splits(rows, cols, k);
                let steps = cols / QG_BK;
                assert!(
                    (1..=QG_MAX_SPLITS).contains(&n),
                    "{rows}x{cols}: {n} splits"
                );
                // Every split has at least one step and together they cover every step once.
                assert!(
                    (n - 1) * per < steps && n * per >= steps,
                    "{rows}x{cols}: {n} x {per}"
                );
                if n > 1 {
                    assert!(
                        per >= QG_SPLIT_MIN_STEPS,
                        "{rows}x{cols}: {per} steps a split"
                    );
                }
            }
        }
        // A Gemma expert's gate/up is split, a model-wide projection is not.
        for k in [(QG_BM, QG_SPLIT_BLOCKS), (QT_BM, QT_SPLIT_BLOCKS)] {
            assert!(splits(704, 2816, k).0 > 1);
            assert_eq!(splits(4096, 2816, k).0, 1);
        }
    }
}
