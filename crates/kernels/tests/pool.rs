//! The worker pool: every share runs exactly once per region, regions are separated, nested and concurrent
//! calls degrade to serial instead of deadlocking, panics reach the caller, and parked workers wake up.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use mference_kernels::ThreadPool;

#[test]
fn every_share_runs_once_per_region() {
    for (threads, regions) in [(1, 20_000), (2, 20_000), (4, 500)] {
        let pool = ThreadPool::new(threads);
        assert_eq!(pool.threads(), threads);
        let hits: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..regions {
            pool.run(|i, n| {
                assert_eq!(n, threads);
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        for h in &hits {
            assert_eq!(h.load(Ordering::Relaxed), regions);
        }
    }
}

#[test]
fn parked_workers_wake_up() {
    let pool = ThreadPool::with_spin(2, Duration::from_micros(10));
    let count = AtomicUsize::new(0);
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(5)); // long enough for the worker to park
        pool.run(|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
    }
    assert_eq!(count.load(Ordering::Relaxed), 10);
}

#[test]
fn nested_run_runs_serially_instead_of_deadlocking() {
    let pool = ThreadPool::new(2);
    let count = AtomicUsize::new(0);
    pool.run(|_, _| {
        pool.run(|_, _| {
            count.fetch_add(1, Ordering::Relaxed);
        });
    });
    assert_eq!(count.load(Ordering::Relaxed), 4);
}

#[test]
fn for_chunks_covers_the_range_exactly_once() {
    let pool = ThreadPool::new(2);
    let seen: Vec<AtomicUsize> = (0..1001).map(|_| AtomicUsize::new(0)).collect();
    pool.for_chunks(1001, 37, |s, e| {
        for v in &seen[s..e] {
            v.fetch_add(1, Ordering::Relaxed);
        }
    });
    assert!(seen.iter().all(|v| v.load(Ordering::Relaxed) == 1));
}

#[test]
fn a_worker_panic_reaches_the_caller_and_the_pool_survives() {
    let pool = ThreadPool::new(2);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.run(|i, _| {
            if i == 1 {
                panic!("boom");
            }
        })
    }));
    assert!(r.is_err());
    let count = AtomicUsize::new(0);
    pool.run(|_, _| {
        count.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(count.load(Ordering::Relaxed), 2);
}
