//! A leaked use is still a use: `mem::forget` of a [`BufferUse`] (or of a `CudarcUse`) is safe,
//! so the use is registered when the guard is made, and the buffer's free is ordered after the
//! work enqueued under the guard even when the guard never drops. What a leak costs instead: the
//! buffer's use lock stays taken (see `BufferUse`'s docs).

mod common;

use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::{Context, DeviceBuffer};
use std::sync::Arc;

// Regression: issue 19 defect 1 (a forgotten BufferUse's work was not ordered before the free)
#[test]
fn forgotten_buffer_use_still_orders_the_free_after_its_work() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    // Last use on `sa` (the memset); then a use on `sb` whose guard is forgotten.
    let buf = DeviceBuffer::<u32>::zeroed(&sa, 1024).unwrap();
    let u = buf.use_on(&sb).unwrap();
    sim.enqueue_access(sb.raw(), u.ptr(), u.bytes(), true, 1_000_000)
        .unwrap();
    std::mem::forget(u);
    drop(buf);
    ctx.synchronize().unwrap();
    let f = sim.findings();
    assert!(
        f.is_empty(),
        "the free was not ordered after the forgotten use's write: {f:?}"
    );
    assert_eq!(sim.counters().live_allocs, 0, "the buffer was not freed");
}

// Regression: issue 19 defect 1 (a forgotten use of several buffers, as the crate's own
// multi-buffer uses make them)
#[test]
fn forgotten_multi_buffer_use_still_orders_every_free() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    let x = DeviceBuffer::<u32>::zeroed(&sa, 256).unwrap();
    let y = DeviceBuffer::<u32>::zeroed(&sa, 256).unwrap();
    let uses = DeviceBuffer::use_all(&sb, &[&x, &y]).unwrap();
    for u in &uses {
        sim.enqueue_access(sb.raw(), u.ptr(), u.bytes(), true, 500_000)
            .unwrap();
    }
    std::mem::forget(uses);
    drop((x, y));
    ctx.synchronize().unwrap();
    let f = sim.findings();
    assert!(f.is_empty(), "a free was not ordered after the use: {f:?}");
    assert_eq!(sim.counters().live_allocs, 0);
}

// Regression: issue 19 defect 1 (what a leak costs: the leaking thread's later uses of the
// buffer are refused, never a deadlock, and the buffer is still freed)
#[test]
fn forgotten_buffer_use_refuses_later_uses_on_its_thread() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    std::mem::forget(buf.use_on(&s).unwrap());
    assert!(buf.use_on(&s).is_err());
    assert!(buf.fill(&s, 1).is_err());
    assert!(buf.last_use().is_none());
    drop(buf);
    ctx.synchronize().unwrap();
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    assert_eq!(sim.counters().live_allocs, 0);
}

/// On the GPU through cudarc's safe API: a `CudarcUse` forgotten after cudarc's `memset_zeros`,
/// queued behind a gate on the lent stream; the buffer is dropped and a buffer of the same size
/// is allocated and filled on another stream. The memset must not land in the new buffer.
#[cfg(feature = "cudarc")]
mod cudarc_use {
    use super::common;
    use cuda_stream_pool::{Context, DeviceBuffer};
    use cudarc::driver::CudaContext;

    // Regression: issue 19 defect 1 (a forgotten CudarcUse: cudarc's memset overwrote a
    // reallocated buffer on the H200)
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn forgotten_cudarc_use_still_orders_the_free_after_its_work() {
        let _serial = common::gpu_lock();
        let cu = CudaContext::new(0).unwrap();
        let ctx = Context::from_cudarc(&cu).unwrap();
        let n = 1 << 16;
        let (a, b) = (ctx.owner(), ctx.owner());
        let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
        let buf = DeviceBuffer::<u32>::zeroed(&sa, n).unwrap();
        sa.synchronize().unwrap();
        let cs = sb.cudarc_stream().unwrap();
        let mut gate = common::Gate::on(&**ctx.driver(), sb.raw());
        let mut u = buf.cudarc_use(&sb).unwrap();
        cs.memset_zeros(&mut u).unwrap(); // queued behind the gate
        std::mem::forget(u);
        drop(buf);
        let mut fresh = DeviceBuffer::<u32>::alloc(&sa, n).unwrap();
        fresh.fill(&sa, 7).unwrap();
        sa.synchronize().unwrap();
        gate.open();
        sb.synchronize().unwrap();
        let v = fresh.to_vec(&sa).unwrap();
        let hit = v.iter().filter(|&&w| w != 7).count();
        assert_eq!(hit, 0, "{hit} of {n} words of the new buffer overwritten");
    }
}
