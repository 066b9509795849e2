//! The CPU backend: activations in host `Vec<f32>`, quantized products through the kernel table
//! (`mference-kernels`, picked once at startup) on the persistent worker pool, KV in
//! [`mference_runtime::KvLayer`], recurrent state in `Vec<f32>`. Resident weights are read in place
//! from the mapped `model_weights.bin`; expert weights from the streamer's slot blobs.

mod core;
mod deepseek_v4;
mod inkling;

pub use inkling::sink_routes;
pub mod ops;
mod recurrent;

use std::ops::Deref;
use std::sync::{Arc, Mutex, OnceLock};

use mference_kernels::{Kernels, MatJob, PairJob, PreparedX, QMatrix, ThreadPool};
use mference_runtime::KvLayer;

use crate::{check, Act, AttnShape, Mlp, OpResult, RelBias, Tensor, Weights};

/// Resident bytes the backend reads weights from (the mapped `model_weights.bin`, or any buffer
/// in that layout: the op harness uses a `Vec<u8>`).
pub type ResidentBytes = Arc<dyn Deref<Target = [u8]> + Send + Sync>;

/// Values from which the row-wise ops (norms, adds, the prefill's gated activation) run over the
/// pool ([`CpuBackend::rows_in_parallel`]): 32K, a dozen rows of 2,816. On the main thread alone
/// they held the other threads of a 512-token prompt idle for ~5% of its time on 2 threads
/// (`perf`, Gemma 4 26B: `rms_norm` 4%), a larger share with more threads.
const PAR_MIN_VALUES: usize = 1 << 15;

/// Activations `[rows, cols]` in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuTensor {
    data: Vec<f32>,
    cols: usize,
}

impl CpuTensor {
    fn new(data: Vec<f32>, cols: usize) -> Self {
        debug_assert!(cols > 0 && data.len().is_multiple_of(cols));
        Self { data, cols }
    }
}

impl Tensor for CpuTensor {
    fn rows(&self) -> usize {
        self.data.len() / self.cols
    }
    fn cols(&self) -> usize {
        self.cols
    }
}

/// The CPU backend: a kernel table, a worker pool and the resident bytes.
pub struct CpuBackend {
    kernels: &'static Kernels,
    pool: ThreadPool,
    resident: ResidentBytes,
}

impl CpuBackend {
    /// A backend running `kernels` on `threads` threads (the caller counts as one) over `resident`.
    pub fn new(kernels: &'static Kernels, threads: usize, resident: ResidentBytes) -> Self {
        Self {
            kernels,
            pool: ThreadPool::new(threads.max(1)),
            resident,
        }
    }

    /// The kernel table.
    pub fn kernels(&self) -> &'static Kernels {
        self.kernels
    }

    /// Worker threads, the caller included.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    fn buf<'a>(&'a self, src: Weights<'a>) -> &'a [u8] {
        match src {
            Weights::Resident => &self.resident,
            Weights::Blob(b) => b,
            // The CPU holds no experts of its own (`held_experts` is the default): nothing
            // lies there, so every matrix range check fails with its shape.
            Weights::Held { .. } => &[],
        }
    }

    /// Several products of the same rows `x` in one parallel region, `x` prepared once per
    /// quantization layout (bit-identical to one product at a time).
    fn products(&self, mats: &[QMatrix], x: &[f32], t: usize) -> Vec<Vec<f32>> {
        self.batched_products(&[(mats, x, t)])
            .pop()
            .expect("one group")
    }

    /// [`CpuBackend::products`] of several inputs in one parallel region: group `i` is
    /// `(matrices, rows x [t, cols], t)` and gets one output per matrix (bit-identical to one
    /// product at a time).
    fn batched_products(&self, groups: &[(&[QMatrix], &[f32], usize)]) -> Vec<Vec<Vec<f32>>> {
        let k = self.kernels;
        let layouts: Vec<Vec<((usize, u32), PreparedX)>> = groups
            .iter()
            .map(|&(mats, x, t)| {
                let mut layouts: Vec<((usize, u32), PreparedX)> = Vec::new();
                for m in mats {
                    let key = (m.group_size, m.bits);
                    if !layouts.iter().any(|(l, _)| *l == key) {
                        layouts.push((key, self.pool.prepare(k, m, x, t)));
                    }
                }
                layouts
            })
            .collect();
        let mut ys: Vec<Vec<Vec<f32>>> = groups
            .iter()
            .map(|&(mats, _, t)| mats.iter().map(|m| vec![0.0f32; t * m.rows]).collect())
            .collect();
        let mut jobs: Vec<MatJob> = Vec::new();
        for ((&(mats, _, _), ys), layouts) in groups.iter().zip(ys.iter_mut()).zip(&layouts) {
            for (m, y) in mats.iter().zip(ys.iter_mut()) {
                let x = &layouts
                    .iter()
                    .find(|(l, _)| *l == (m.group_size, m.bits))
                    .expect("prepared above")
                    .1;
                jobs.push(MatJob { m: *m, x, y });
            }
        }
        self.pool.gemm_batch(k, &mut jobs);
        ys
    }

    /// `f(item, values)` for every item of `data` (`item_len` values each): over the pool's
    /// threads where `data` holds at least [`PAR_MIN_VALUES`] (a prompt chunk's rows), else here
    /// (a decode row, where a parallel region would cost more than the work). Each item's
    /// arithmetic is `f`'s alone, so the results do not depend on the threads.
    pub(crate) fn rows_in_parallel(
        &self,
        data: &mut [f32],
        item_len: usize,
        f: impl Fn(usize, &mut [f32]) + Sync,
    ) {
        if item_len == 0 {
            return;
        }
        if data.len() < PAR_MIN_VALUES || self.pool.threads() == 1 {
            data.chunks_exact_mut(item_len)
                .enumerate()
                .for_each(|(i, v)| f(i, v));
        } else {
            ops::par_items(&self.pool, data, item_len, |_: &mut (), i, v| f(i, v));
        }
    }

    /// [`CpuBackend::glu_mlps`] of several experts' own prefill rows (`xs[j]`: `[t_j, cols]` for
    /// `srcs[j]`) in three parallel regions for all of them: the inputs prepared (an expert per
    /// work item) and every gate and up product; the activations and the down inputs prepared;
    /// every down product. Bit for bit one `glu_mlps` per expert (the same preparations and
    /// products); `None` where gate and up differ in bits or group size (no shared input).
    fn glu_mlp_batch(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        xs: &[(&[f32], usize)],
    ) -> Option<Vec<Vec<f32>>> {
        let (g, u) = (&mlp.gate_proj, &mlp.up_proj);
        if (g.bits, g.group_size) != (u.bits, u.group_size) {
            return None;
        }
        let k = self.kernels;
        let bufs: Vec<&[u8]> = srcs.iter().map(|w| self.buf(*w)).collect();
        let gate_up: Vec<[QMatrix; 2]> = bufs.iter().map(|b| [g.mat(b), u.mat(b)]).collect();
        let prepared = |mats: &[QMatrix], ins: &[(&[f32], usize)]| -> Vec<PreparedX> {
            let cells: Vec<OnceLock<PreparedX>> = ins.iter().map(|_| OnceLock::new()).collect();
            self.pool.for_chunks(ins.len(), 1, |a, b| {
                for j in a..b {
                    let (x, t) = ins[j];
                    let _ = cells[j].set(k.prepare(&mats[j], x, t));
                }
            });
            cells
                .into_iter()
                .map(|c| c.into_inner().expect("every input prepared"))
                .collect()
        };
        let gates: Vec<QMatrix> = gate_up.iter().map(|[g, _]| *g).collect();
        let px = prepared(&gates, xs);
        let mut hg: Vec<Vec<f32>> = xs.iter().map(|&(_, t)| vec![0.0; t * g.rows]).collect();
        let mut hu: Vec<Vec<f32>> = xs.iter().map(|&(_, t)| vec![0.0; t * u.rows]).collect();
        let mut jobs: Vec<MatJob> = Vec::with_capacity(2 * xs.len());
        for ((([gm, um], x), yg), yu) in gate_up.iter().zip(&px).zip(&mut hg).zip(&mut hu) {
            jobs.push(MatJob { m: *gm, x, y: yg });
            jobs.push(MatJob { m: *um, x, y: yu });
        }
        self.pool.gemm_batch(k, &mut jobs);
        drop(jobs);
        let hg: Vec<Mutex<Vec<f32>>> = hg.into_iter().map(Mutex::new).collect();
        self.pool.for_chunks(xs.len(), 1, |a, b| {
            for j in a..b {
                let mut h = hg[j].lock().unwrap_or_else(|e| e.into_inner());
                ops::glu(act, &mut h, &hu[j]);
            }
        });
        let hg: Vec<Vec<f32>> = hg
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
            .collect();
        let downs: Vec<QMatrix> = bufs.iter().map(|b| mlp.down_proj.mat(b)).collect();
        let ins: Vec<(&[f32], usize)> = hg.iter().zip(xs).map(|(h, &(_, t))| (&h[..], t)).collect();
        let pd = prepared(&downs, &ins);
        let mut ys: Vec<Vec<f32>> = xs
            .iter()
            .map(|&(_, t)| vec![0.0; t * mlp.down_proj.rows])
            .collect();
        let mut jobs: Vec<MatJob> = downs
            .iter()
            .zip(&pd)
            .zip(&mut ys)
            .map(|((m, x), y)| MatJob { m: *m, x, y })
            .collect();
        self.pool.gemm_batch(k, &mut jobs);
        drop(jobs);
        Some(ys)
    }

    /// `down(act(gate(x)) ⊙ up(x))` of the same rows `x` (`[t, cols]`) for every weight source
    /// in `srcs` (the experts of one decode token): every gate and up projection in one parallel
    /// region, every down projection in a second (bit-identical to one MLP at a time).
    fn glu_mlps(
        &self,
        mlp: &Mlp,
        act: Act,
        srcs: &[Weights],
        x: &[f32],
        t: usize,
    ) -> Vec<Vec<f32>> {
        let bufs: Vec<&[u8]> = srcs.iter().map(|w| self.buf(*w)).collect();
        let gate_up: Vec<[QMatrix; 2]> = bufs
            .iter()
            .map(|b| [mlp.gate_proj.mat(b), mlp.up_proj.mat(b)])
            .collect();
        let (g, u) = (&mlp.gate_proj, &mlp.up_proj);
        if t != 1 || (g.bits, g.group_size) != (u.bits, u.group_size) {
            // Prefill: one MLP at a time (its rows are the batch); the row preparations reuse
            // the thread's scratch.
            return gate_up
                .iter()
                .zip(&bufs)
                .map(|([g, u], buf)| {
                    let mut gu = self.products(&[*g, *u], x, t);
                    let u = gu.pop().expect("two products");
                    let mut g = gu.pop().expect("two products");
                    let c = g.len() / t.max(1);
                    self.rows_in_parallel(&mut g, c, |r, gr| {
                        ops::glu(act, gr, &u[r * c..(r + 1) * c])
                    });
                    let mut y = vec![0.0f32; t * mlp.down_proj.rows];
                    let down = mlp.down_proj.mat(buf);
                    self.pool.gemm(self.kernels, &down, &g, t, &mut y);
                    y
                })
                .collect();
        }
        // Decode: one preparation of the row for every expert, the activation applied to each
        // chunk of rows by the thread that computed it, then every down projection.
        let (k, rows) = (self.kernels, mlp.gate_proj.rows);
        let mut hidden = vec![vec![0.0f32; rows]; srcs.len()];
        let Some([g0, _]) = gate_up.first() else {
            return Vec::new();
        };
        let p = k.prepare(g0, x, 1);
        let mut jobs: Vec<PairJob> = gate_up
            .iter()
            .zip(hidden.iter_mut())
            .map(|([a, b], y)| PairJob {
                a: *a,
                b: *b,
                x: &p,
                y,
            })
            .collect();
        self.pool
            .gemv_pairs(k, &mut jobs, |g, u| ops::glu(act, g, u));
        let downs: Vec<[QMatrix; 1]> = bufs.iter().map(|b| [mlp.down_proj.mat(b)]).collect();
        let groups: Vec<(&[QMatrix], &[f32], usize)> = downs
            .iter()
            .zip(&hidden)
            .map(|(m, g)| (&m[..], &g[..], 1))
            .collect();
        self.batched_products(&groups)
            .into_iter()
            .map(|mut y| y.pop().expect("one product"))
            .collect()
    }
}

fn same_shape(op: &'static str, a: &CpuTensor, b: &CpuTensor) -> OpResult<()> {
    check(op, a.data.len() == b.data.len() && a.cols == b.cols, || {
        format!("[{}, {}] vs [{}, {}]", a.rows(), a.cols, b.rows(), b.cols)
    })
}

impl crate::DeviceExpertOps for CpuBackend {
    fn computes_in_place(&self) -> bool {
        true
    }
}

impl CpuBackend {
    /// [`CoreOps::attention`], with `bias` [`InklingOps::attention_rel`], with `entries` (the
    /// rows and each query row's selection) [`DeepSeekV4Ops::attention_sparse`].
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        op: &'static str,
        q: &CpuTensor,
        kv: &KvLayer,
        pos0: usize,
        s: &AttnShape,
        bias: Option<&RelBias<CpuTensor>>,
        entries: Option<(&CpuTensor, &[Vec<usize>])>,
    ) -> OpResult<CpuTensor> {
        let d_rel = bias.map_or(0, |b| b.proj.rows());
        check(
            op,
            q.cols == s.n_heads * s.head_dim
                && s.n_kv_heads > 0
                && s.n_heads.is_multiple_of(s.n_kv_heads)
                && kv.row_stride() == s.n_kv_heads * s.head_dim
                && s.sinks.as_ref().is_none_or(|v| v.len() == s.n_heads)
                && bias.is_none_or(|b| b.rel.rows() == q.rows() && b.rel.cols == s.n_heads * d_rel)
                && entries.is_none_or(|(e, visible)| {
                    e.cols == kv.row_stride()
                        && visible.len() == q.rows()
                        && visible.iter().flatten().all(|&i| i < e.rows())
                }),
            || {
                format!(
                    "q rows of {} for {} heads of {} (rel rows of {:?}, d_rel {d_rel}; entries \
                     [{:?}, {:?}])",
                    q.cols,
                    s.n_heads,
                    s.head_dim,
                    bias.map(|b| b.rel.cols),
                    entries.map(|(e, _)| e.rows()),
                    entries.map(|(e, _)| e.cols),
                )
            },
        )?;
        let slices = bias.map(|b| ops::RelSlices {
            rel: &b.rel.data,
            proj: &b.proj.data,
            d_rel,
            extent: b.proj.cols,
            log_scaling: b.log_scaling,
        });
        let entries = entries.map(|(e, visible)| ops::Entries {
            rows: &e.data,
            visible,
        });
        let mut out = vec![0.0f32; q.data.len()];
        ops::attention(
            &self.pool,
            self.kernels,
            &q.data,
            kv,
            pos0,
            s,
            slices.as_ref(),
            entries.as_ref(),
            &mut out,
        );
        Ok(CpuTensor::new(out, q.cols))
    }
}

/// The depthwise causal conv of `op` (`conv1d_silu`, `conv1d`) with activation `act`.
fn conv(
    op: &'static str,
    x: &CpuTensor,
    state: &mut [f32],
    w: &CpuTensor,
    kernel: usize,
    act: impl Fn(f32) -> f32,
) -> OpResult<CpuTensor> {
    let c = x.cols;
    check(
        op,
        kernel >= 2 && w.data.len() == c * kernel && state.len() == (kernel - 1) * c,
        || format!("kernel {kernel} over {c} channels"),
    )?;
    let mut out = vec![0.0f32; x.data.len()];
    ops::causal_conv1d(&x.data, state, &w.data, c, kernel, &mut out, act);
    Ok(CpuTensor::new(out, c))
}

/// The k-th largest logit minus the (k+1)-th (`+∞` when there is no (k+1)-th).
pub fn top_k_margin(logits: &[f32], k: usize) -> f32 {
    if k == 0 || k >= logits.len() {
        return f32::INFINITY;
    }
    let mut v = logits.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[k - 1] - v[k]
}
