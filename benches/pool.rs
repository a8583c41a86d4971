//! Acquire + release of an owner's stream, against two baselines measured in the same run:
//! `cuStreamCreate` + `cuStreamDestroy`, and a pool behind one global lock with a linear scan over
//! every pooled stream (the design of the seed, CUDA.jl's first version).
//!
//!   cargo bench --bench pool                          # auto: the GPU when present
//!   CSP_BENCH_DRIVER=sim cargo bench --bench pool     # the simulation's latency model
//!
//! Groups: `uncontended`; `threads/{pool,global_lock}/N` (time per operation on each of N
//! threads; `threads/context_clone/N`, a user's `Context` clone and drop, the shared counts
//! that owners touched before they counted themselves per shard);
//! `live_owners/{pool,global_lock}/L` (with L other owners holding streams);
//! `waiters/queue_and_serve/N` (per waiter: N async acquisitions queued at a cap, served in turn;
//! always the simulated driver).

#[path = "common.rs"]
mod common;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use cuda_stream_pool::driver::{stream_flags, CaptureMode, Driver, Stream};
use cuda_stream_pool::{CaptureModeGuard, Context, Owner};
use std::future::Future;
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
            // What a shared reference count costs at `n` threads: a user's clone of the context
            // (an `Arc` and the count of handles; an owner made it too before cb01670).
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

/// A waker that does nothing: the waiters below are polled in turn by the bench itself.
struct Noop;
impl std::task::Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

/// `n` async acquisitions queue at a cap of 1 behind a held stream (each polled once: it joins
/// the gate's queue), then are served in turn (the holder's release hands the stream to the first,
/// whose owner's drop hands it to the next). The gate's queue is the crate's CPU work alone, so
/// this runs on the simulated driver whatever `CSP_BENCH_DRIVER` says. Returns the time of the
/// queueing and the serving.
fn queue_and_serve(ctx: &Context, n: usize) -> Duration {
    let waker = std::task::Waker::from(Arc::new(Noop));
    let mut cx = std::task::Context::from_waker(&waker);
    let holder = ctx.owner();
    holder.stream().unwrap();
    let t = Instant::now();
    let mut waiting: Vec<_> = (0..n).map(|_| Box::pin(ctx.owner().ready())).collect();
    for f in &mut waiting {
        assert!(f.as_mut().poll(&mut cx).is_pending());
    }
    drop(holder);
    for f in &mut waiting {
        match f.as_mut().poll(&mut cx) {
            std::task::Poll::Ready(owner) => drop(black_box(owner.unwrap())),
            std::task::Poll::Pending => panic!("a waiter was not served in turn"),
        }
    }
    t.elapsed()
}

fn waiter_benches(c: &mut Criterion) {
    let sim: Arc<dyn Driver> = Arc::new(cuda_stream_pool::driver::SimDriver::new());
    let opts = cuda_stream_pool::ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim, 0, opts).unwrap();
    let mut g = c.benchmark_group("waiters");
    for n in [100usize, 1_000, 10_000] {
        // Time per waiter: queueing behind `n - 1` others and being served.
        g.bench_with_input(BenchmarkId::new("queue_and_serve", n), &n, |b, &n| {
            b.iter_custom(|iters| {
                // Whole queues of `n`, the time scaled to `iters` waiters (criterion divides
                // by `iters`).
                let batches = iters.div_ceil(n as u64);
                let mut total = Duration::ZERO;
                for _ in 0..batches {
                    total += queue_and_serve(&ctx, n);
                }
                total.mul_f64(iters as f64 / (batches * n as u64) as f64)
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = pool;
    config = common::config();
    targets = benches, waiter_benches
}
criterion_main!(pool);
