//! Alloc + free of 4 KiB through `DeviceBuffer` against raw `cuMemAllocAsync` + `cuMemFreeAsync`
//! on the same stream, in the same run. Both synchronize the stream every 1,024 iterations.
//!
//!   cargo bench --bench memory                        # auto: the GPU when present
//!   CSP_BENCH_DRIVER=sim cargo bench --bench memory

#[path = "common.rs"]
mod common;

use criterion::{criterion_group, criterion_main, Criterion};
use cuda_stream_pool::{Context, DeviceBuffer};
use std::hint::black_box;

fn benches(c: &mut Criterion) {
    let d = common::driver();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let raw = s.raw();
    let mut g = c.benchmark_group("alloc_free_4KiB");
    let mut n = 0u32;
    g.bench_function("raw", |b| {
        b.iter(|| {
            let p = d.mem_alloc_async(4096, raw).unwrap();
            d.mem_free_async(black_box(p), raw).unwrap();
            n = n.wrapping_add(1);
            if n % 1024 == 0 {
                d.stream_synchronize(raw).unwrap();
            }
        })
    });
    g.bench_function("device_buffer", |b| {
        b.iter(|| {
            let buf = DeviceBuffer::<f32>::alloc(&s, 1024).unwrap();
            drop(black_box(buf));
            n = n.wrapping_add(1);
            if n % 1024 == 0 {
                s.synchronize().unwrap();
            }
        })
    });
    g.bench_function("raw_with_ctx_get_current", |b| {
        b.iter(|| {
            black_box(d.ctx_get_current().unwrap());
            let p = d.mem_alloc_async(4096, raw).unwrap();
            d.mem_free_async(black_box(p), raw).unwrap();
            n = n.wrapping_add(1);
            if n % 1024 == 0 {
                d.stream_synchronize(raw).unwrap();
            }
        })
    });
    g.bench_function("raw_again", |b| {
        b.iter(|| {
            let p = d.mem_alloc_async(4096, raw).unwrap();
            d.mem_free_async(black_box(p), raw).unwrap();
            n = n.wrapping_add(1);
            if n % 1024 == 0 {
                d.stream_synchronize(raw).unwrap();
            }
        })
    });
    g.finish();
}

criterion_group! {
    name = memory;
    config = common::config();
    targets = benches
}
criterion_main!(memory);
