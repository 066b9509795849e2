//! Kernel microbenchmark: GB/s of packed bytes (weights + scales + biases) streamed by the quantized GEMV for
//! Gemma-4-26B-A4B shapes, per kernel table and thread count, plus prefill GEMM throughput.
//!
//! `cargo run --release -p mference-kernels --example bench_kernels [-- quick] [only=roof|expert|bits|moe|gemm|head]`
//! (`MFERENCE_KERNELS=avx2` etc. changes which table `detect()` picks; all available tables are measured.)
//!
//! - "expert hot": one expert matrix read again and again (stays in L2/L3: kernel compute ceiling).
//! - "expert cold": round-robin over 48 experts (~150 MiB, larger than L3), as in decode from the slot slab.
//! - "bits": single-thread hot GEMV GFLOP/s of one 704 × 2816 matrix at 4 and at 2 bits (group 64).
//! - "moe": one decode MoE layer (top-8 experts; gate+up of all 8 in one pool region, downs in a second).
//! - "head": the tied 262144 × 2816 head (~415 MB, DRAM-bound), plain GEMV and the fused argmax.
//! - "read roof": a plain f32 sum over a 512 MiB buffer, the memory-bandwidth roof for comparison.

use std::hint::black_box;
use std::time::{Duration, Instant};

use mference_kernels::{Kernels, MatJob, QMatrix, ThreadPool};

struct Owned {
    w: Vec<u8>,
    s: Vec<u8>,
    b: Vec<u8>,
    rows: usize,
    cols: usize,
    bits: u32,
}

impl Owned {
    fn random(rows: usize, cols: usize, seed: u64) -> Self {
        Self::random_bits(rows, cols, 4, seed)
    }
    fn random_bits(rows: usize, cols: usize, bits: u32, seed: u64) -> Self {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let w: Vec<u8> = (0..rows * cols * bits as usize / 8)
            .map(|_| next() as u8)
            .collect();
        let g = rows * cols / 64;
        let bf = |v: f32| ((v.to_bits() >> 16) as u16).to_le_bytes();
        let mut s = Vec::with_capacity(2 * g);
        let mut b = Vec::with_capacity(2 * g);
        for _ in 0..g {
            let r = next();
            s.extend(bf(
                if r & 1 == 0 { 0.01 } else { -0.01 } * (1.0 + (r >> 40) as f32 / 16777216.0)
            ));
            b.extend(bf(((r >> 8) & 0xff) as f32 / 1024.0 - 0.125));
        }
        Self {
            w,
            s,
            b,
            rows,
            cols,
            bits,
        }
    }
    fn view(&self) -> QMatrix<'_> {
        QMatrix::new(
            &self.w, &self.s, &self.b, self.rows, self.cols, self.bits, 64,
        )
        .unwrap()
    }
}

/// Fastest wall time of `f` over `iters` runs after one warm-up (the minimum filters out preemption by other
/// processes on a shared machine; memory bandwidth contention still shows).
fn time(iters: usize, mut f: impl FnMut()) -> Duration {
    f();
    let mut v: Vec<Duration> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    v.sort();
    v[0]
}

fn gbs(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let only = std::env::args().find_map(|a| a.strip_prefix("only=").map(str::to_owned));
    let want = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let threads_list = [1usize, 2];
    let pools: Vec<ThreadPool> = threads_list.iter().map(|&t| ThreadPool::new(t)).collect();
    let tables = Kernels::available();
    println!(
        "detected: {}; tables: {:?}",
        Kernels::detect().name(),
        tables.iter().map(|k| k.name()).collect::<Vec<_>>()
    );

    // Memory-bandwidth roof: sum of f32 over 512 MiB, split across threads.
    let big = vec![1.0f32; 128 << 20];
    for pool in pools.iter().filter(|_| want("roof")) {
        let n = big.len();
        let d = time(5, || {
            let parts: Vec<std::sync::Mutex<f32>> = (0..pool.threads())
                .map(|_| std::sync::Mutex::new(0.0))
                .collect();
            pool.run(|i, t| {
                let chunk = &big[i * n / t..(i + 1) * n / t];
                *parts[i].lock().unwrap() = Kernels::detect().dot_f32(chunk, chunk);
            });
            black_box(&parts);
        });
        println!(
            "read roof       threads {}: {:6.1} GB/s",
            pool.threads(),
            gbs(n * 4, d)
        );
    }
    drop(big);

    // Cost of one parallel region with nothing to do (workers spinning between regions).
    for pool in pools.iter().filter(|_| want("roof")) {
        let d = time(5, || {
            for _ in 0..10_000 {
                pool.run(|i, _| {
                    black_box(i);
                });
            }
        });
        println!(
            "empty region    threads {}: {:6.2} us",
            pool.threads(),
            d.as_secs_f64() * 1e6 / 10_000.0
        );
    }

    let hidden = 2816;
    let inter = 704;
    let x_h: Vec<f32> = (0..hidden)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let x_i: Vec<f32> = (0..inter)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0)
        .collect();

    // Expert matrices.
    let n_experts = if quick { 8 } else { 48 };
    let experts: Vec<[Owned; 3]> = (0..n_experts as u64)
        .map(|e| {
            [
                Owned::random(inter, hidden, 3 * e + 1),
                Owned::random(inter, hidden, 3 * e + 2),
                Owned::random(hidden, inter, 3 * e + 3),
            ]
        })
        .collect();
    let mut y_i = vec![0.0f32; inter];
    let mut y_h = vec![0.0f32; hidden];
    for k in tables.iter().filter(|_| want("expert")) {
        let iters = if k.name() == "scalar" { 20 } else { 200 };
        for pool in &pools {
            let gate = experts[0][0].view();
            let d = time(iters, || pool.gemv(k, &gate, &x_h, &mut y_i));
            let gu = gbs(gate.total_bytes(), d);
            let down = experts[0][2].view();
            let d = time(iters, || pool.gemv(k, &down, &x_i, &mut y_h));
            let dn = gbs(down.total_bytes(), d);
            // Cold: a full expert (gate, up, down) per step, cycling through all experts.
            let mut e = 0;
            let bytes: usize = experts[0].iter().map(|m| m.view().total_bytes()).sum();
            let d = time(iters, || {
                let ex = &experts[e % n_experts];
                e += 1;
                pool.gemv(k, &ex[0].view(), &x_h, &mut y_i);
                pool.gemv(k, &ex[1].view(), &x_h, &mut y_i);
                pool.gemv(k, &ex[2].view(), &x_i, &mut y_h);
            });
            println!(
                "{:7} threads {}: expert hot gate/up 704x2816 {:6.1} GB/s  down 2816x704 {:6.1} GB/s | expert cold (3 mats) {:6.1} GB/s, {:6.1} us/expert",
                k.name(),
                pool.threads(),
                gu,
                dn,
                gbs(bytes, d),
                d.as_secs_f64() * 1e6
            );
        }
    }
    black_box((&y_i, &y_h));

    // 2-bit against 4-bit: the same shape and input, one thread, matrix hot in cache.
    let by_bits = [4u32, 2].map(|bits| Owned::random_bits(inter, hidden, bits, 7));
    for k in tables.iter().filter(|_| want("bits")) {
        let iters = if k.name() == "scalar" { 20 } else { 400 };
        let line: Vec<String> = by_bits
            .iter()
            .map(|o| {
                let m = o.view();
                let d = time(iters, || k.gemv(&m, &x_h, &mut y_i));
                let flops = 2.0 * (inter * hidden) as f64;
                format!(
                    "{}-bit {:6.1} GFLOP/s ({:5.1} us)",
                    o.bits,
                    flops / d.as_secs_f64() / 1e9,
                    d.as_secs_f64() * 1e6
                )
            })
            .collect();
        println!(
            "{:7} threads 1: gemv 704x2816 g64 hot: {}",
            k.name(),
            line.join(" | ")
        );
    }

    // One MoE layer of decode as the runtime would run it: top-8 experts, gate+up of all 8 in one parallel
    // region (activations prepared once), then the 8 downs in a second region. Experts cycle through the
    // whole set, so weights come from DRAM (plus whatever L3 still holds).
    for k in tables
        .iter()
        .filter(|k| k.name() != "scalar" && want("moe"))
    {
        for pool in &pools {
            let mut outs_gu = vec![vec![0.0f32; inter]; 16];
            let mut outs_d = vec![vec![0.0f32; hidden]; 8];
            let mut e = 0usize;
            let bytes: usize = 8 * experts[0]
                .iter()
                .map(|m| m.view().total_bytes())
                .sum::<usize>();
            let d = time(60, || {
                let sel: Vec<&[Owned; 3]> =
                    (0..8).map(|j| &experts[(e + j * 5) % n_experts]).collect();
                e += 8;
                let ph = k.prepare(&sel[0][0].view(), &x_h, 1);
                let mut jobs: Vec<MatJob> = outs_gu
                    .iter_mut()
                    .enumerate()
                    .map(|(j, y)| MatJob {
                        m: sel[j / 2][j % 2].view(),
                        x: &ph,
                        y,
                    })
                    .collect();
                pool.gemm_batch(k, &mut jobs);
                let pi = k.prepare(&sel[0][2].view(), &x_i, 1);
                let mut jobs: Vec<MatJob> = outs_d
                    .iter_mut()
                    .enumerate()
                    .map(|(j, y)| MatJob {
                        m: sel[j][2].view(),
                        x: &pi,
                        y,
                    })
                    .collect();
                pool.gemm_batch(k, &mut jobs);
            });
            println!(
                "{:7} threads {}: moe decode layer (8 experts, 2 regions) {:6.1} GB/s, {:6.1} us/layer",
                k.name(),
                pool.threads(),
                gbs(bytes, d),
                d.as_secs_f64() * 1e6
            );
        }
    }

    // Prefill GEMM on one expert's gate projection.
    for &n in [2usize, 4, 5, 6, 7, 8, 32, 128]
        .iter()
        .filter(|_| want("gemm"))
    {
        let x: Vec<f32> = (0..n * hidden)
            .map(|i| ((i * 31 % 113) as f32 - 56.0) / 56.0)
            .collect();
        let mut y = vec![0.0f32; n * inter];
        for k in tables.iter().filter(|k| k.name() != "scalar") {
            let m = experts[0][0].view();
            let d = time(20, || {
                black_box(k.prepare(&m, &x, n));
            });
            println!(
                "{:7} prepare n={n:3} x 2816: {:7.1} us (serial, before the pool's region)",
                k.name(),
                d.as_secs_f64() * 1e6
            );
            for pool in &pools {
                let d = time(20, || {
                    black_box(pool.prepare(k, &m, &x, n));
                });
                println!(
                    "{:7} threads {}: prepare n={n:3} x 2816: {:7.1} us (its 16-token blocks over the pool)",
                    k.name(),
                    pool.threads(),
                    d.as_secs_f64() * 1e6
                );
                let d = time(20, || pool.gemm(k, &m, &x, n, &mut y));
                let flops = 2.0 * (n * inter * hidden) as f64;
                println!(
                    "{:7} threads {}: gemm n={n:3} 704x2816: {:7.1} GFLOP/s, {:7.1} us ({:5.1} us/token)",
                    k.name(),
                    pool.threads(),
                    flops / d.as_secs_f64() / 1e9,
                    d.as_secs_f64() * 1e6,
                    d.as_secs_f64() * 1e6 / n as f64
                );
            }
        }
    }
    drop(experts);

    // Head.
    let vocab = if quick { 65536 } else { 262144 };
    let head = Owned::random(vocab, hidden, 99);
    let hv = head.view();
    let mut logits = vec![0.0f32; vocab];
    for k in tables.iter().filter(|_| want("head")) {
        let iters = if k.name() == "scalar" { 2 } else { 10 };
        for pool in &pools {
            let d = time(iters, || pool.gemv(k, &hv, &x_h, &mut logits));
            let da = time(iters, || {
                black_box(pool.gemv_argmax(k, &hv, &x_h, Some(30.0)));
            });
            println!(
                "{:7} threads {}: head {vocab}x{hidden} gemv {:6.1} GB/s ({:6.2} ms) | argmax {:6.1} GB/s ({:6.2} ms)",
                k.name(),
                pool.threads(),
                gbs(hv.total_bytes(), d),
                d.as_secs_f64() * 1e3,
                gbs(hv.total_bytes(), da),
                da.as_secs_f64() * 1e3
            );
        }
    }
    black_box(&logits);
}
