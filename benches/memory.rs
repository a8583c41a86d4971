//! Alloc + free of 4 KiB through `DeviceBuffer` against raw `cuMemAllocAsync` +
//! `cuMemFreeAsync` on the same stream, in the same run, and against `raw_relaxed`: the same two
//! calls each inside its own relaxed capture-mode pair (`cuThreadExchangeStreamCaptureMode`
//! before and after), the floor of a design that never invalidates another thread's global-mode
//! capture (docs/gpu.md): what `DeviceBuffer` costs beyond that rule is its own.
//!
//! The two variants run interleaved in chunks of 256 iterations (each benchmark times its own
//! chunks and runs the other's untimed in between, then synchronizes the stream), so that drift
//! of the GPU's or the allocator's state affects both alike.
//!
//!   cargo bench --bench memory                        # auto: the GPU when present
//!   CSP_BENCH_DRIVER=sim cargo bench --bench memory

#[path = "common.rs"]
mod common;

use criterion::{criterion_group, criterion_main, Criterion};
use cuda_stream_pool::driver::{CaptureMode, Driver, Stream};
use cuda_stream_pool::{CaptureModeGuard, Context, DeviceBuffer, StreamRef};
use std::hint::black_box;
use std::time::{Duration, Instant};

const CHUNK: u64 = 256;

fn raw(d: &dyn Driver, s: Stream) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let p = d.mem_alloc_async(4096, s).unwrap();
        d.mem_free_async(black_box(p), s).unwrap();
    }
}

fn raw_relaxed(d: &dyn Driver, s: Stream) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let p = {
            let _relaxed = CaptureModeGuard::new(d, CaptureMode::Relaxed).unwrap();
            d.mem_alloc_async(4096, s).unwrap()
        };
        let _relaxed = CaptureModeGuard::new(d, CaptureMode::Relaxed).unwrap();
        d.mem_free_async(black_box(p), s).unwrap();
    }
}

fn buffer(s: &StreamRef) {
    let b = DeviceBuffer::<f32>::alloc(s, 1024).unwrap();
    drop(black_box(b));
}

/// Times `iters` runs of `mine`, interleaved chunk by chunk with untimed runs of `other`.
fn interleaved(iters: u64, sync: &dyn Fn(), mine: &dyn Fn(), other: &dyn Fn()) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(CHUNK);
        let t = Instant::now();
        for _ in 0..n {
            mine();
        }
        total += t.elapsed();
        for _ in 0..n {
            other();
        }
        sync();
        left -= n;
    }
    total
}

fn benches(c: &mut Criterion) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let d = common::driver();
        let ctx = Context::primary(d.clone(), 0).unwrap();
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        let r = s.raw();
        let sync = || d.stream_synchronize(r).unwrap();
        let run_raw = || raw(&*d, r);
        let run_relaxed = || raw_relaxed(&*d, r);
        let run_buf = || buffer(&s);
        let mut g = c.benchmark_group("alloc_free_4KiB");
        g.bench_function("raw", |b| {
            b.iter_custom(|iters| interleaved(iters, &sync, &run_raw, &run_buf))
        });
        g.bench_function("raw_relaxed", |b| {
            b.iter_custom(|iters| interleaved(iters, &sync, &run_relaxed, &run_buf))
        });
        g.bench_function("device_buffer", |b| {
            b.iter_custom(|iters| interleaved(iters, &sync, &run_buf, &run_raw))
        });
        g.finish();
    }
}

criterion_group! {
    name = memory;
    config = common::config();
    targets = benches
}
criterion_main!(memory);
