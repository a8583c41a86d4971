//! Capture guards: each scenario runs on the simulated driver and, as a GPU test, on the real one.

mod common;

use cuda_stream_pool::driver::{CaptureMode, Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{CaptureModeGuard, Context, DeviceBuffer, Error, ErrorCode, Priority};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A nested begin fails with the driver's error; the outer capture still records, and its
/// graph, launched, increments the buffer exactly once.
fn nested_begin_keeps_outer_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let buf = DeviceBuffer::<u32>::zeroed(&s, 1000).unwrap();
    let guard = s.begin_capture().unwrap();
    let nested = s.begin_capture();
    assert_eq!(
        nested.as_ref().err().and_then(|e| e.code()),
        Some(ErrorCode::ERROR_ILLEGAL_STATE)
    );
    drop(nested);
    assert!(
        s.is_capturing().unwrap(),
        "the failed begin ended the outer capture"
    );
    k.add_u32(&s, &buf, 1).unwrap();
    let graph = guard.end().unwrap();
    assert_eq!(graph.node_count().unwrap(), 1);
    let exec = graph.instantiate().unwrap();
    assert_eq!(
        buf.to_vec(&s).unwrap(),
        vec![0; 1000],
        "capture must not execute"
    );
    exec.launch(&s).unwrap();
    assert_eq!(buf.to_vec(&s).unwrap(), vec![1; 1000]);
}

/// A guard dropped mid-capture (an early return) ends the capture and leaves the stream usable.
fn dropped_guard_leaves_stream_usable(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
    let mut early_return = || -> cuda_stream_pool::Result<()> {
        let _g = s.begin_capture()?;
        buf.fill(&s, 9)?;
        Err(Error::InvalidArgument("early return".into()))
    };
    assert!(early_return().is_err());
    assert!(!s.is_capturing().unwrap());
    buf.fill(&s, 3).unwrap();
    assert_eq!(buf.to_vec(&s).unwrap(), vec![3; 16]);
}

/// A panic inside a capture leaves the stream not capturing.
fn panic_in_capture_ends_it(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _g = s.begin_capture().unwrap();
        panic!("inside capture");
    }));
    assert!(r.is_err());
    assert!(!s.is_capturing().unwrap());
    s.synchronize().unwrap();
}

/// An operation forbidden during capture invalidates it: `end` reports the error and the stream
/// is left not capturing.
fn invalidated_capture_reports_at_end(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let ctx = common::ctx(d);
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let g = s.begin_capture_with(CaptureMode::Global).unwrap();
        assert_eq!(
            d.stream_query(s.raw()).err().and_then(|e| e.code()),
            Some(ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED)
        );
        let e = g.end().unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED));
        assert!(!s.is_capturing().unwrap());
        s.synchronize().unwrap();
    }
}

/// The mode guard restores the thread's previous mode, also when nested.
fn mode_guard_restores(d: &Arc<dyn Driver>) {
    let d2 = d.clone();
    std::thread::spawn(move || {
        let _ctx = common::ctx(&d2);
        {
            let g = CaptureModeGuard::new(&*d2, CaptureMode::Relaxed).unwrap();
            assert_eq!(g.previous(), CaptureMode::Global);
            let inner = CaptureModeGuard::new(&*d2, CaptureMode::ThreadLocal).unwrap();
            assert_eq!(inner.previous(), CaptureMode::Relaxed);
        }
        assert_eq!(
            d2.thread_exchange_capture_mode(CaptureMode::Global)
                .unwrap(),
            CaptureMode::Global
        );
    })
    .join()
    .unwrap();
}

/// A buffer dropped while its stream is capturing is not freed into the capture: the free waits
/// for the end of the capture and then goes on the stream.
fn free_during_capture_is_deferred(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let keep = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    let doomed = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    s.synchronize().unwrap();
    let g = s.begin_capture().unwrap();
    k.add_u32(&s, &keep, 2).unwrap();
    drop(doomed);
    let graph = g.end().unwrap();
    assert_eq!(
        graph.node_count().unwrap(),
        1,
        "the free entered the capture"
    );
    let exec = graph.instantiate().unwrap();
    exec.launch(&s).unwrap();
    assert_eq!(keep.to_vec(&s).unwrap(), vec![2; 64]);
}

/// One thread captures in global mode while others churn owners through the pool and switch
/// priorities: the pool's queries run in relaxed mode, so the capture stays valid and its graph
/// runs right.
fn capture_survives_pool_churn(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let k = Kernels::load(&ctx).unwrap();
    // Warm the pool so that the churn recycles (queries) rather than only creates.
    drop((0..8).map(|_| ctx.owner()).collect::<Vec<_>>());
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let buf = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
    s.synchronize().unwrap();
    let g = s.begin_capture_with(CaptureMode::Global).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let churners: Vec<_> = (0..4)
        .map(|_| {
            let (ctx, stop) = (ctx.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u32;
                while n < 2_000 || !stop.load(Ordering::Relaxed) {
                    let owner = ctx.owner();
                    owner.stream().unwrap();
                    if n % 10 == 0 {
                        owner.set_priority(Priority::High).unwrap();
                        owner.stream().unwrap();
                    }
                    n += 1;
                    if n > 20_000 {
                        break;
                    }
                }
                n
            })
        })
        .collect();
    for _ in 0..5 {
        k.add_u32(&s, &buf, 1).unwrap();
        std::thread::yield_now();
    }
    stop.store(true, Ordering::Relaxed);
    let total: u32 = churners.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(total >= 8_000);
    let graph = g.end().expect("the churn invalidated the capture");
    assert_eq!(graph.node_count().unwrap(), 5);
    let exec = graph.instantiate().unwrap();
    exec.launch(&s).unwrap();
    exec.launch(&s).unwrap();
    assert_eq!(buf.to_vec(&s).unwrap(), vec![10; 256]);
}

/// Allocating on a capturing stream is refused with a clear error (allocate before
/// `begin_capture`), and the capture goes on intact. A buffer allocated before the capture and
/// dropped inside it belongs to the graph: the graph keeps it alive, and every launch computes.
fn allocation_in_capture_is_refused(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let out = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    let mut tmp = DeviceBuffer::<u32>::alloc(&s, 64).unwrap();
    s.synchronize().unwrap();
    let g = s.begin_capture().unwrap();
    assert!(matches!(
        DeviceBuffer::<u32>::alloc(&s, 64),
        Err(Error::CaptureInProgress(_))
    ));
    assert!(matches!(
        DeviceBuffer::<u32>::zeroed(&s, 64),
        Err(Error::CaptureInProgress(_))
    ));
    assert!(
        s.is_capturing().unwrap(),
        "the refused allocation ended the capture"
    );
    tmp.fill(&s, 5).unwrap();
    k.add_u32(&s, &tmp, 1).unwrap();
    k.add_u32(&s, &out, 1).unwrap();
    drop(tmp); // its free waits for the graph, which uses it
    let graph = g.end().unwrap();
    assert_eq!(graph.node_count().unwrap(), 3, "memset, 2 kernels");
    let exec = graph.instantiate().unwrap();
    for _ in 0..3 {
        exec.launch(&s).unwrap();
    }
    assert_eq!(out.to_vec(&s).unwrap(), vec![3; 64]);
}

on_both_drivers! {
    allocation_in_capture_is_refused,
    nested_begin_keeps_outer_capture,
    dropped_guard_leaves_stream_usable,
    panic_in_capture_ends_it,
    invalidated_capture_reports_at_end,
    mode_guard_restores,
    free_during_capture_is_deferred,
    capture_survives_pool_churn,
}

/// Simulation only: a failed instantiate destroys the graph; nothing leaks.
#[test]
fn failed_instantiate_leaks_nothing() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d, 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let g = s.begin_capture().unwrap().end().unwrap();
    assert_eq!(sim.counters().live_graphs, 1);
    sim.fail_calls(
        "cuGraphInstantiateWithFlags",
        ErrorCode::ERROR_OUT_OF_MEMORY,
        1,
    );
    assert!(g.instantiate().is_err());
    let c = sim.counters();
    assert_eq!((c.live_graphs, c.live_graph_execs), (0, 0));
}

/// Simulation only: a buffer dropped inside a capture is freed once its graph is gone; nothing
/// leaks.
#[test]
fn graph_memory_does_not_leak() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    allocation_in_capture_is_refused(&d);
    let c = sim.counters();
    assert_eq!(c.live_allocs, 0, "{c:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Simulation only: the deferred free reaches the stream after the capture, in the call log.
#[test]
fn deferred_free_follows_end_capture_in_log() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d, 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    let p = b.as_raw();
    let g = s.begin_capture().unwrap();
    sim.clear_calls();
    drop(b);
    assert!(sim.calls().iter().all(|c| c.name != "cuMemFreeAsync"));
    drop(g.end().unwrap());
    let calls = sim.calls();
    let end = calls
        .iter()
        .position(|c| c.name == "cuStreamEndCapture")
        .unwrap();
    let free = calls
        .iter()
        .position(|c| c.name == "cuMemFreeAsync" && c.ptr == Some(p))
        .expect("free after the capture");
    assert!(free > end);
    assert_eq!(calls[free].stream, Some(s.raw()));
    s.synchronize().unwrap();
    assert_eq!(sim.counters().live_allocs, 0);
    assert!(sim.misuse().is_empty());
}
