//! Persistent worker pool for per-token work: workers spin briefly on an epoch counter, then park; the caller
//! thread runs share 0 itself. One parallel region costs a few hundred nanoseconds when the workers are spinning
//! (ggml's `ggml_barrier` idea), and nothing when idle (parked on a condition variable).

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::dispatch::with_scratch;
use crate::prepared::PreparedX;
use crate::{Kernels, QMatrix};

thread_local! {
    /// Per-thread output tile for row-split GEMM (`[n, chunk rows]`), reused across calls.
    static OUT_TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

type Job = dyn Fn(usize, usize) + Sync;

struct Shared {
    /// Bumped once per parallel region; workers look for work when they see a new value.
    epoch: AtomicU64,
    /// The current job, lifetime-erased. Written by the caller before it resets `claims` (Release); read by a
    /// worker only after it won its claim (AcqRel swap that saw the reset). The caller waits for every worker
    /// that won a claim before it returns, so the pointee outlives every use and no read overlaps a write.
    job: UnsafeCell<Option<*const Job>>,
    /// `claims[i - 1]`: share `i` of the current region has been taken (by worker `i`, or by the caller when
    /// the worker had not started by the time the caller finished its own share, e.g. because it was parked
    /// or descheduled by another process on a shared machine).
    claims: Box<[AtomicBool]>,
    /// Workers that finished the share they claimed in the current region.
    finished: AtomicUsize,
    /// Workers parked (or about to park) on `cv`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
    shutdown: AtomicBool,
    /// A worker panicked in the current region.
    panicked: AtomicBool,
    threads: usize,
    spin: Duration,
}

// SAFETY: `job` is written only by the caller holding `ThreadPool::busy`, while every claim is taken and every
// claiming worker has finished (so nobody reads it), and read only by a worker that won a claim afterwards.
// The pointee is `Sync`.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// Persistent worker pool (spin briefly then park; the caller thread takes a share). Sized by `--threads`.
///
/// `run` from inside a job of the same pool (or concurrently from two threads) does not deadlock: the second
/// caller runs all shares itself, serially.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    busy: Mutex<()>,
}

/// Default time a waiting thread spins before parking (workers) or yielding (caller).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(100);

impl ThreadPool {
    /// A pool of `threads` threads in total, the caller included (`threads - 1` workers are spawned).
    /// `threads == 0` is treated as 1. Workers spin for [`DEFAULT_SPIN`] before parking.
    pub fn new(threads: usize) -> Self {
        Self::with_spin(threads, DEFAULT_SPIN)
    }

    /// Like [`ThreadPool::new`], with an explicit spin budget before a worker parks.
    pub fn with_spin(threads: usize, spin: Duration) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            claims: (1..threads).map(|_| AtomicBool::new(true)).collect(),
            finished: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            threads,
            spin,
        });
        let workers = (1..threads)
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("mference-worker-{i}"))
                    .spawn(move || worker_loop(&s, i))
                    .expect("spawn worker thread")
            })
            .collect();
        Self {
            shared,
            workers,
            busy: Mutex::new(()),
        }
    }

    /// Total threads, the caller included.
    pub fn threads(&self) -> usize {
        self.shared.threads
    }

    /// Runs `f(share, n_shares)` for every share `0..threads()` and returns when all are done. The caller runs
    /// share 0, workers the others; a share whose worker has not started by the time the caller finished its
    /// own (parked, or descheduled by another process) is run by the caller instead, so each share runs exactly
    /// once but not necessarily on a fixed thread. A panic in any share is re-raised on the caller after every
    /// share has finished.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, f: F) {
        let n = self.shared.threads;
        if n == 1 {
            f(0, 1);
            return;
        }
        let _guard = match self.busy.try_lock() {
            Ok(g) => g,
            Err(_) => {
                (0..n).for_each(|i| f(i, n));
                return;
            }
        };
        let s = &*self.shared;
        let job: &(dyn Fn(usize, usize) + Sync + '_) = &f;
        // SAFETY: erasing the lifetime is sound because this function does not return (or unwind) before
        // every worker that claimed a share has finished it, and later workers cannot win a claim.
        let job: *const Job = unsafe {
            std::mem::transmute::<&(dyn Fn(usize, usize) + Sync + '_), &'static Job>(job)
        };
        // SAFETY: nobody reads `job` now: every claim of the previous region is taken and its claimants are done.
        unsafe { *s.job.get() = Some(job) };
        s.panicked.store(false, Ordering::Relaxed);
        s.finished.store(0, Ordering::Relaxed);
        for c in s.claims.iter() {
            c.store(false, Ordering::Release);
        }
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.cv.notify_all();
        }
        let mut result = catch_unwind(AssertUnwindSafe(|| f(0, n)));
        let mut stolen = 0;
        for (i, c) in s.claims.iter().enumerate() {
            if !c.swap(true, Ordering::AcqRel) {
                stolen += 1;
                let r = catch_unwind(AssertUnwindSafe(|| f(i + 1, n)));
                if result.is_ok() {
                    result = r;
                }
            }
        }
        let expect = n - 1 - stolen;
        let start = Instant::now();
        let mut spins = 0u32;
        while s.finished.load(Ordering::Acquire) != expect {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > s.spin {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if let Err(p) = result {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a ThreadPool worker panicked");
        }
    }

    /// Splits `0..total` into chunks of `chunk` and runs `f(start, end)` on each, threads taking chunks from a
    /// shared counter (so a descheduled thread does not hold up the others).
    pub fn for_chunks<F: Fn(usize, usize) + Sync>(&self, total: usize, chunk: usize, f: F) {
        let chunk = chunk.max(1);
        let chunks = total.div_ceil(chunk);
        if chunks <= 1 || self.threads() == 1 {
            let mut s = 0;
            while s < total {
                f(s, (s + chunk).min(total));
                s += chunk;
            }
            return;
        }
        let next = AtomicUsize::new(0);
        self.run(|_, _| loop {
            let c = next.fetch_add(1, Ordering::Relaxed);
            if c >= chunks {
                break;
            }
            let s = c * chunk;
            f(s, (s + chunk).min(total));
        });
    }

    /// Rows per work item for a product over `rows` rows: several items per thread for balance, multiples
    /// of 16 rows, and at least ~64 KiB of weights per item so the counter is not contended.
    fn row_chunk(&self, m: &QMatrix) -> usize {
        let per_row = m.row_bytes() + 4 * m.groups_per_row();
        let min_rows = (64 * 1024 / per_row.max(1)).max(16);
        let balanced = m.rows.div_ceil(self.threads() * 4);
        balanced.max(min_rows).div_ceil(16) * 16
    }

    /// Work items `(job, first row, end row)`: the rows of each matrix in chunks of
    /// [`ThreadPool::row_chunk`], job by job.
    fn row_items<'a>(&self, mats: impl Iterator<Item = QMatrix<'a>>) -> Vec<(usize, usize, usize)> {
        let mut items = Vec::new();
        for (j, m) in mats.enumerate() {
            let chunk = self.row_chunk(&m);
            let mut r = 0;
            while r < m.rows {
                let e = (r + chunk).min(m.rows);
                items.push((j, r, e));
                r = e;
            }
        }
        items
    }

    /// [`Kernels::prepare`] with the int16 layouts' blocks of 16 tokens quantized over the
    /// pool's threads: the same bytes. A prompt chunk's preparation ran on one thread while the
    /// others waited (~2 µs a token at 2,816 columns, before each of a layer's dense products).
    pub fn prepare(&self, k: &Kernels, m: &QMatrix, x: &[f32], n: usize) -> PreparedX {
        let mut p = PreparedX::new();
        p.fill_each(
            k.layout_for(m.bits, m.group_size, n),
            m,
            x,
            n,
            |blocks, work| self.for_chunks(blocks, 1, |a, b| (a..b).for_each(work)),
        );
        p
    }

    /// Parallel `y[rows] = W x`, rows split across threads.
    pub fn gemv(&self, k: &Kernels, m: &QMatrix, x: &[f32], y: &mut [f32]) {
        with_scratch(|p| {
            k.prepare_into(m, x, 1, p);
            self.gemv_prepared(k, m, p, y);
        })
    }

    /// Parallel `y[rows] = W x` for activations prepared by `k` (share one preparation across matrices that
    /// read the same input).
    pub fn gemv_prepared(&self, k: &Kernels, m: &QMatrix, p: &PreparedX, y: &mut [f32]) {
        assert_eq!(p.n(), 1, "gemv_prepared: expected one activation row");
        self.gemm_batch(k, &mut [MatJob { m: *m, x: p, y }]);
    }

    /// Parallel `Y[n, rows] = X[n, cols] · Wᵀ`, rows of W split across threads (each thread reads its weight
    /// rows once for the whole batch).
    pub fn gemm(&self, k: &Kernels, m: &QMatrix, x: &[f32], n: usize, y: &mut [f32]) {
        if n > 16 {
            // Two or more 16-token blocks: prepared over the threads (the same bytes).
            let p = self.prepare(k, m, x, n);
            return self.gemm_prepared(k, m, &p, y);
        }
        with_scratch(|p| {
            k.prepare_into(m, x, n, p);
            self.gemm_prepared(k, m, p, y);
        })
    }

    /// Parallel `Y[n, rows] = X · Wᵀ` for activations prepared by `k`; `y` is `[p.n(), rows]`.
    pub fn gemm_prepared(&self, k: &Kernels, m: &QMatrix, p: &PreparedX, y: &mut [f32]) {
        self.gemm_batch(k, &mut [MatJob { m: *m, x: p, y }]);
    }

    /// Several independent products in one parallel region (one synchronisation instead of one per matrix):
    /// e.g. the gate and up projections of every selected expert of a layer. Each job's rows are cut into
    /// chunks and all chunks of all jobs are shared out between threads. Results are bit-identical to running
    /// the jobs one by one.
    ///
    /// Panics if a job's `x` was not prepared by `k` for its matrix, or `y.len() != x.n() · m.rows`.
    pub fn gemm_batch(&self, k: &Kernels, jobs: &mut [MatJob<'_>]) {
        let mut outs = Vec::with_capacity(jobs.len());
        for job in jobs.iter_mut() {
            assert_eq!(
                job.y.len(),
                job.x.n() * job.m.rows,
                "gemm_batch: y must be [n, rows]"
            );
            outs.push(SyncPtr(job.y.as_mut_ptr()));
        }
        let items = self.row_items(jobs.iter().map(|j| j.m));
        let jobs = &*jobs;
        self.for_chunks(items.len(), 1, |i0, i1| {
            for &(j, r0, r1) in &items[i0..i1] {
                let MatJob { m, x, .. } = &jobs[j];
                let (n, rows, w) = (x.n(), m.rows, r1 - r0);
                let out = outs[j];
                if n == 1 {
                    // SAFETY: chunks are disjoint row ranges inside job j's `y`, which outlives the region.
                    let ys = unsafe { std::slice::from_raw_parts_mut(out.get().add(r0), w) };
                    k.gemv_prepared(m, x, ys, r0, r1);
                    continue;
                }
                OUT_TILE.with(|cell| {
                    let mut tile = cell.borrow_mut();
                    tile.clear();
                    tile.resize(n * w, 0.0);
                    k.gemm_prepared(m, x, &mut tile, r0, r1);
                    for t in 0..n {
                        // SAFETY: row t of job j's Y, columns [r0, r1): disjoint across chunks, inside `y`.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(out.get().add(t * rows + r0), w)
                        };
                        dst.copy_from_slice(&tile[t * w..(t + 1) * w]);
                    }
                });
            }
        });
    }

    /// For every job, `y = A x` and `B x` with rows split across threads, then `f(y[r0..r1],
    /// (B x)[r0..r1])` on each chunk of rows inside the same work item: an elementwise combine (a
    /// GLU's activation) runs in parallel with the products that feed it, in one region for all
    /// jobs. With an elementwise `f`, bit-identical to the two products one by one and `f` over
    /// the whole vectors.
    ///
    /// Panics if a job's `x` was not prepared by `k` for both matrices as one row, the matrices'
    /// rows differ, or `y.len() != a.rows`.
    pub fn gemv_pairs<F: Fn(&mut [f32], &[f32]) + Sync>(
        &self,
        k: &Kernels,
        jobs: &mut [PairJob<'_>],
        f: F,
    ) {
        let mut outs = Vec::with_capacity(jobs.len());
        for job in jobs.iter_mut() {
            assert!(
                job.x.n() == 1 && job.a.rows == job.b.rows && job.y.len() == job.a.rows,
                "gemv_pairs: one row into y[rows] of two matrices of the same rows"
            );
            outs.push(SyncPtr(job.y.as_mut_ptr()));
        }
        let items = self.row_items(jobs.iter().map(|j| j.a));
        let jobs = &*jobs;
        self.for_chunks(items.len(), 1, |i0, i1| {
            for &(j, r0, r1) in &items[i0..i1] {
                let PairJob { a, b, x, .. } = &jobs[j];
                // SAFETY: chunks are disjoint row ranges inside job j's `y`, which outlives the region.
                let ya = unsafe { std::slice::from_raw_parts_mut(outs[j].get().add(r0), r1 - r0) };
                k.gemv_prepared(a, x, ya, r0, r1);
                OUT_TILE.with(|cell| {
                    let mut yb = cell.borrow_mut();
                    yb.clear();
                    yb.resize(r1 - r0, 0.0);
                    k.gemv_prepared(b, x, &mut yb, r0, r1);
                    f(ya, &yb);
                });
            }
        });
    }

    /// Fused greedy head: `argmax_r (W x)_r`, computing logits in per-thread tiles (never the full vector).
    ///
    /// Returns `(index, logit)`; with `softcap = Some(c)` the returned logit is `c · tanh(logit / c)` (monotonic,
    /// so the index is the same as without it). Ties go to the lowest index; NaN logits are never chosen.
    pub fn gemv_argmax(
        &self,
        k: &Kernels,
        m: &QMatrix,
        x: &[f32],
        softcap: Option<f32>,
    ) -> (usize, f32) {
        with_scratch(|p| {
            k.prepare_into(m, x, 1, p);
            self.gemv_argmax_prepared(k, m, p, softcap)
        })
    }

    /// [`ThreadPool::gemv_argmax`] for activations prepared by `k`.
    pub fn gemv_argmax_prepared(
        &self,
        k: &Kernels,
        m: &QMatrix,
        p: &PreparedX,
        softcap: Option<f32>,
    ) -> (usize, f32) {
        let best = Mutex::new((usize::MAX, f32::NAN));
        self.for_chunks(m.rows, self.row_chunk(m), |r0, r1| {
            let (i, v) = k.gemv_argmax_prepared(m, p, r0, r1);
            if v.is_nan() {
                return;
            }
            let mut b = best.lock().unwrap_or_else(|e| e.into_inner());
            if b.0 == usize::MAX || v > b.1 || (v == b.1 && i < b.0) {
                *b = (i, v);
            }
        });
        let (i, v) = best.into_inner().unwrap_or_else(|e| e.into_inner());
        if i == usize::MAX {
            return (0, f32::NAN);
        }
        match softcap {
            Some(c) => (i, c * (v / c).tanh()),
            None => (i, v),
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        {
            let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.cv.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads())
            .finish()
    }
}

fn worker_loop(s: &Shared, index: usize) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < s.spin {
                std::hint::spin_loop();
                continue;
            }
            let g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            // Re-check after announcing ourselves: the caller bumps the epoch, then reads `sleepers` (both
            // SeqCst), so either we see the bump here or it sees us and notifies under the lock.
            let g = if s.epoch.load(Ordering::SeqCst) == seen {
                s.cv.wait(g).unwrap_or_else(|e| e.into_inner())
            } else {
                g
            };
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(g);
        }
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        if s.claims[index - 1].swap(true, Ordering::AcqRel) {
            continue; // the caller already ran our share
        }
        // SAFETY: winning the claim (AcqRel, after the caller's Release reset) makes the job written before the
        // reset visible, and the caller keeps it alive until we bump `finished` below.
        let job = unsafe { (*s.job.get()).expect("job set before claims reset") };
        // SAFETY: see above; the pointee is a live `Fn + Sync`.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(index, s.threads) }));
        if r.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.finished.fetch_add(1, Ordering::Release);
    }
}

/// One product of a [`ThreadPool::gemm_batch`]: `y[n, rows] = X · Wᵀ` with `X` prepared by the same
/// [`Kernels`] for `m` (`n = x.n()`; `n == 1` is a GEMV).
pub struct MatJob<'a> {
    /// The quantized matrix.
    pub m: QMatrix<'a>,
    /// Activations prepared for `m` by the `Kernels` passed to `gemm_batch`.
    pub x: &'a PreparedX,
    /// Output, `[x.n(), m.rows]` row-major.
    pub y: &'a mut [f32],
}

/// One pair of a [`ThreadPool::gemv_pairs`]: `y ← f(A x, B x)` for one prepared row `x`.
pub struct PairJob<'a> {
    /// The first matrix (its product is written to `y`, then combined in place).
    pub a: QMatrix<'a>,
    /// The second matrix, of the same rows.
    pub b: QMatrix<'a>,
    /// One activation row prepared by the `Kernels` passed to `gemv_pairs` for both matrices.
    pub x: &'a PreparedX,
    /// Output, `[a.rows]`.
    pub y: &'a mut [f32],
}

/// A raw output pointer shared across a parallel region whose shares write disjoint ranges.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: only used for disjoint writes inside one parallel region, while the owning slice is borrowed.
unsafe impl Sync for SyncPtr {}
// SAFETY: as above.
unsafe impl Send for SyncPtr {}
impl SyncPtr {
    #[inline(always)]
    fn get(self) -> *mut f32 {
        self.0
    }
}
