//! Acquire + release of an owner's stream, against two baselines measured in the same run:
//! `cuStreamCreate` + `cuStreamDestroy`, and a pool behind one global lock with a linear scan over
//! every pooled stream (the design of the seed, CUDA.jl's first version).
//!
//!   cargo bench --bench pool                          # auto: the GPU when present
//!   CSP_BENCH_DRIVER=sim cargo bench --bench pool     # the simulation's latency model
//!
//! Groups: `uncontended`; `threads/{pool,global_lock}/N` (time per operation on each of N
//! threads; `threads/context_clone/N`, a context's clone and drop, the shared reference count
//! every owner touches); `live_owners/{pool,global_lock}/L` (with L other owners holding streams).

#[path = "common.rs"]
mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use cuda_stream_pool::driver::{stream_flags, CaptureMode, Driver, Stream};
use cuda_stream_pool::{CaptureModeGuard, Context, Owner};
use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

/// The seed's design: every pooled stream in one list behind one lock; a new owner scans the list
/// for a stream whose owner is gone and whose work has completed.
struct GlobalLockPool {
    d: Arc<dyn Driver>,
    streams: Mutex<Vec<(Stream, bool)>>,
}

impl GlobalLockPool {
    fn new(d: Arc<dyn Driver>) -> Self {
        GlobalLockPool {
            d,
            streams: Mutex::new(Vec::new()),
        }
    }

    fn acquire(&self) -> usize {
        // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
        unsafe {
            let mut list = self.streams.lock().unwrap();
            let _relaxed = CaptureModeGuard::new(&*self.d, CaptureMode::Relaxed).unwrap();
            for (i, (s, in_use)) in list.iter_mut().enumerate() {
                if !*in_use && self.d.stream_query(*s).unwrap() {
                    *in_use = true;
                    return i;
                }
            }
            let s = self.d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap();
            list.push((s, true));
            list.len() - 1
        }
    }

    fn release(&self, i: usize) {
        self.streams.lock().unwrap()[i].1 = false;
    }
}

impl Drop for GlobalLockPool {
    fn drop(&mut self) {
        // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
        unsafe {
            for (s, _) in self.streams.get_mut().unwrap().drain(..) {
                let _ = self.d.stream_destroy(s);
            }
        }
    }
}

fn pool_op(ctx: &Context) {
    let o = ctx.owner();
    black_box(o.stream().unwrap());
}

/// Runs `op` `iters` times on each of `threads` threads; returns the slowest thread's time.
fn on_threads(threads: usize, iters: u64, op: impl Fn() + Sync) -> Duration {
    let barrier = Barrier::new(threads);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| {
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..iters {
                        op();
                    }
                    t.elapsed()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).max().unwrap()
    })
}

fn benches(c: &mut Criterion) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let d = common::driver();
        let ctx = Context::primary(d.clone(), 0).unwrap();
        ctx.bind().unwrap();

        let mut g = c.benchmark_group("uncontended");
        g.bench_function("pool", |b| b.iter(|| pool_op(&ctx)));
        g.bench_function("create_destroy", |b| {
            b.iter(|| {
                let s = d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap();
                d.stream_destroy(black_box(s)).unwrap();
            })
        });
        let global = GlobalLockPool::new(d.clone());
        g.bench_function("global_lock", |b| {
            b.iter(|| {
                let i = global.acquire();
                global.release(black_box(i));
            })
        });
        g.finish();

        let mut g = c.benchmark_group("threads");
        for n in [1usize, 4, 16] {
            // The driver's floor: each thread queries its own idle stream in relaxed capture mode,
            // which is the one driver call the pool makes per hand-over.
            let own: Vec<Stream> = (0..n)
                .map(|_| d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap())
                .collect();
            let next = std::sync::atomic::AtomicUsize::new(0);
            g.bench_with_input(BenchmarkId::new("query_only", n), &n, |b, &n| {
                b.iter_custom(|iters| {
                    next.store(0, std::sync::atomic::Ordering::Relaxed);
                    on_threads(n, 1, || {
                        let s = own[next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % n];
                        let _relaxed = CaptureModeGuard::new(&*d, CaptureMode::Relaxed).unwrap();
                        for _ in 0..iters {
                            black_box(d.stream_query(s).unwrap());
                        }
                    })
                })
            });
            for s in own {
                d.stream_destroy(s).unwrap();
            }
            g.bench_with_input(BenchmarkId::new("pool", n), &n, |b, &n| {
                b.iter_custom(|iters| on_threads(n, iters, || pool_op(&ctx)))
            });
            // What one shared reference count costs at `n` threads: an owner clones the context
            // (an `Arc`) when made and drops it when dropped, on every thread alike.
            g.bench_with_input(BenchmarkId::new("context_clone", n), &n, |b, &n| {
                b.iter_custom(|iters| on_threads(n, iters, || drop(black_box(ctx.clone()))))
            });
            g.bench_with_input(BenchmarkId::new("global_lock", n), &n, |b, &n| {
                b.iter_custom(|iters| {
                    on_threads(n, iters, || {
                        ctx.bind().unwrap();
                        let i = global.acquire();
                        global.release(i);
                    })
                })
            });
        }
        g.finish();

        let mut g = c.benchmark_group("live_owners");
        for live in [1usize, 100, 1_000, 10_000] {
            let holders: Vec<Owner> = (0..live)
                .map(|_| {
                    let o = ctx.owner();
                    o.stream().unwrap();
                    o
                })
                .collect();
            g.bench_with_input(BenchmarkId::new("pool", live), &live, |b, _| {
                b.iter(|| pool_op(&ctx))
            });
            drop(holders);
            ctx.trim().unwrap();
            let global = GlobalLockPool::new(d.clone());
            let held: Vec<usize> = (0..live).map(|_| global.acquire()).collect();
            g.bench_with_input(BenchmarkId::new("global_lock", live), &live, |b, _| {
                b.iter(|| {
                    let i = global.acquire();
                    global.release(black_box(i));
                })
            });
            drop(held);
            drop(global);
        }
        g.finish();
    }
}

criterion_group! {
    name = pool;
    config = common::config();
    targets = benches
}
criterion_main!(pool);
