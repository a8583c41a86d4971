//! The device layer below the pool: every driver call of a context runs under the same rules,
//! whichever operation makes it. Calls of the H200's invalidation table run in relaxed capture
//! mode (no capture of any thread is invalidated by the crate), the context is made current for
//! the call and the caller's current context is restored, and nothing is called on a
//! host-function thread.

mod common;

#[path = "common/calls.rs"]
mod calls;

use calls::{fmt_calls, setup};
use common::{capture_survives, ForeignCapture};
use cuda_stream_pool::driver::{CaptureMode, Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, ErrorCode, OwnedStream, Priority};
use std::sync::Arc;

fn capture_intact(r: cuda_stream_pool::Result<cuda_stream_pool::driver::Graph>) {
    match r {
        Ok(_) => {}
        Err(e) => panic!("the foreign capture was invalidated by the crate: {e}"),
    }
}

/// A context, a stream `s` that another thread captures in global mode, and a stream `t` of
/// the crate that the operation under test uses.
fn with_foreign_capture(
    d: &Arc<dyn Driver>,
    op: impl FnOnce(&Context, &cuda_stream_pool::StreamRef<'_>),
) {
    let ctx = common::ctx(d);
    let (a, b) = (ctx.owner(), ctx.owner());
    let (s, t) = (a.stream().unwrap(), b.stream().unwrap());
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    op(&ctx, &t);
    capture_intact(fc.end());
}

// Regression: issue 19 defect 8 (the hub's cuMemHostAlloc outside relaxed mode kills a capture)
fn completed_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    with_foreign_capture(d, |_, t| {
        let done = t.completed().unwrap();
        t.synchronize().unwrap();
        assert!(done.is_complete());
    });
}

// Regression: issue 19 defect 8 (to_vec_async's staging cuMemHostAlloc kills a capture)
fn to_vec_async_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (a, b) = (ctx.owner(), ctx.owner());
    let (s, t) = (a.stream().unwrap(), b.stream().unwrap());
    let buf = DeviceBuffer::<u32>::zeroed(&t, 64).unwrap();
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    let copy = buf.to_vec_async(&t).unwrap();
    t.synchronize().unwrap();
    capture_intact(fc.end());
    drop(copy);
}

// Regression: issue 19 defect 9 (Context::primary's cuMemPoolCreate kills a capture)
fn primary_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    with_foreign_capture(d, |_, _| {
        let other = Context::primary(d.clone(), 0).unwrap();
        drop(other);
    });
}

// Regression: issue 19 defect 9 (set_release_threshold's cuMemPoolSetAttribute kills a capture)
fn set_release_threshold_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    with_foreign_capture(d, |ctx, _| ctx.set_release_threshold(1 << 20).unwrap());
}

// Regression: issue 19 defect 9 (Graph::instantiate kills a capture)
fn instantiate_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (a, b) = (ctx.owner(), ctx.owner());
    let (s, t) = (a.stream().unwrap(), b.stream().unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed(&t, 64).unwrap();
    let g = t.begin_capture().unwrap();
    buf.fill(&t, 7).unwrap();
    let graph = g.end().unwrap();
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    let exec = graph.instantiate().unwrap();
    capture_intact(fc.end());
    exec.launch(&t).unwrap();
    assert_eq!(buf.to_vec(&t).unwrap(), vec![7; 64]);
}

// Regression: issue 19 defect 9 (Kernels::load returns Ok but the capture is dead)
fn kernels_load_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    with_foreign_capture(d, |ctx, t| {
        let k = Kernels::load(ctx).unwrap();
        let buf = DeviceBuffer::<f32>::zeroed(t, 16).unwrap();
        k.add_one(t, &buf).unwrap();
        assert_eq!(buf.to_vec(t).unwrap(), vec![1.0; 16]);
    });
}

/// The steps of `kernels_load_keeps_foreign_capture` one by one, the foreign capture's status
/// checked after each: which of them invalidates it.
fn each_kernel_step_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (a, b) = (ctx.owner(), ctx.owner());
    let (s, t) = (a.stream().unwrap(), b.stream().unwrap());
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    let alive = |step: &str| {
        // SAFETY: `s` is held by `a` (live); the query is allowed during any capture.
        let st = unsafe { d.stream_is_capturing(s.raw()) }.unwrap();
        assert_eq!(
            st,
            cuda_stream_pool::driver::CaptureStatus::Active,
            "the foreign capture after {step}"
        );
    };
    alive("nothing");
    let k = Kernels::load(&ctx).unwrap();
    alive("Kernels::load");
    let buf = DeviceBuffer::<f32>::zeroed(&t, 16).unwrap();
    alive("DeviceBuffer::zeroed");
    k.add_one(&t, &buf).unwrap();
    alive("the first add_one");
    k.add_one(&t, &buf).unwrap();
    alive("the second add_one");
    let sum = DeviceBuffer::<f32>::zeroed(&t, 1).unwrap();
    k.sum(&t, &buf, &sum).unwrap();
    alive("the first sum");
    assert_eq!(sum.to_vec(&t).unwrap(), vec![32.0]);
    alive("to_vec");
    drop((buf, sum));
    alive("the buffers' drops");
    capture_intact(fc.end());
}

// Documents issue 19's finding on the H200: `Context::synchronize` is `cuCtxSynchronize`, which
// waits for a capturing stream of the context and so invalidates its capture, relaxed or not.
fn context_synchronize_fails_on_a_capturing_context(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let a = ctx.owner();
    let s = a.stream().unwrap();
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    let e = ctx.synchronize().unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED));
    let e = fc.end().unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED));
}

// Regression: issue 19 defect 9 on the H200 (dropping `Kernels` synchronized the context to
// unload its module, which killed another thread's capture; the module now lives with the context)
fn dropping_kernels_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    with_foreign_capture(d, |ctx, t| {
        let k = Kernels::load(ctx).unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(t, 16).unwrap();
        k.add_u32(t, &buf, 3).unwrap();
        drop(k);
        assert_eq!(buf.to_vec(t).unwrap(), vec![3; 16]);
    });
}

// Pins soundness review (issue 12) defect 9 (both drivers): owned-stream drops and teardowns killed another thread's capture
/// Defect 9 on both drivers: dropping an `OwnedStream`, and tearing a context down, on a thread
/// in global mode, while another thread captures in global mode: the capture survives.
fn owned_stream_drop_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let os = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    let other = common::ctx(d);
    other.owner().stream().unwrap();
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    drop(os);
    drop(other);
    capture_survives(fc.end());
}

// Pins soundness review (issue 12) defect 15 (both drivers): the crate's allocations and frees invalidated captures
/// Defect 15 on both drivers: allocations and frees of the crate, on a thread in global mode,
/// on a stream that is not capturing, while another thread captures in global mode (and while
/// this thread captures in thread-local mode): every capture survives.
fn alloc_free_keep_captures(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (oa, ob, oc) = (ctx.owner(), ctx.owner(), ctx.owner());
    let (s, t, u) = (
        oa.stream().unwrap(),
        ob.stream().unwrap(),
        oc.stream().unwrap(),
    );
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    let own = u.begin_capture().unwrap();
    for _ in 0..3 {
        let b = DeviceBuffer::<u32>::zeroed(&t, 256).unwrap();
        drop(b);
    }
    capture_survives(own.end());
    capture_survives(fc.end());
}

/// `from_slice` (an allocation, a copy and its wait in one scope of the device rules), `to_vec`
/// and `copy_from_host`, on a thread in global mode, while another thread captures in global
/// mode: the capture survives. Pins the scope that 3c7c9204 gave `from_slice`.
fn blocking_copies_keep_foreign_capture(d: &Arc<dyn Driver>) {
    with_foreign_capture(d, |_, t| {
        let mut b = DeviceBuffer::from_slice(t, &[5u32; 256]).unwrap();
        b.copy_from_host(t, &[6u32; 256]).unwrap();
        assert_eq!(b.to_vec(t).unwrap(), vec![6u32; 256]);
    });
}

on_both_drivers! {
    blocking_copies_keep_foreign_capture,
    context_synchronize_fails_on_a_capturing_context,
    dropping_kernels_keeps_foreign_capture,
    each_kernel_step_keeps_foreign_capture,
    completed_keeps_foreign_capture,
    to_vec_async_keeps_foreign_capture,
    primary_keeps_foreign_capture,
    set_release_threshold_keeps_foreign_capture,
    instantiate_keeps_foreign_capture,
    kernels_load_keeps_foreign_capture,
    owned_stream_drop_keeps_foreign_capture,
    alloc_free_keep_captures,
}

// Regression: issue 19 defect 12 (Context::primary inside a host function calls cuInit)
#[test]
fn primary_in_a_host_function_refuses_before_any_driver_call() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let d: Arc<dyn Driver> = sim.clone();
    let calls = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = calls.clone();
    let probe = sim.clone();
    s.launch_host_func(move || {
        let before = probe.call_count();
        let r = Context::primary(d, 0).map(|_| ());
        seen.store(
            probe.call_count() - before,
            std::sync::atomic::Ordering::SeqCst,
        );
        let _ = tx.send(r.err().and_then(|e| e.code()));
    })
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(rx.recv().unwrap(), Some(ErrorCode::ERROR_NOT_PERMITTED));
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(
        sim.misuse().is_empty(),
        "the driver was called from a host function: {:?}",
        sim.misuse()
    );
}

/// Every public operation of one context, once (each result checked). `Context::synchronize`
/// only with `sync_ctx`: it waits for a capturing stream too, which invalidates the capture in
/// any mode (documented; `context_synchronize_fails_on_a_capturing_context`).
fn every_operation(
    d: &Arc<dyn Driver>,
    ctx: &Context,
    sync_ctx: bool,
    check: &mut dyn FnMut(&str),
) {
    let other = Context::primary(d.clone(), 0).unwrap();
    check("Context::primary");
    drop(other);
    check("Context drop");
    let o = ctx.owner();
    let s = o.stream().unwrap();
    check("Owner::stream");
    let mut buf = DeviceBuffer::<f32>::zeroed(&s, 64).unwrap();
    check("DeviceBuffer::zeroed");
    let up = DeviceBuffer::from_slice(&s, &[3.0f32; 64]).unwrap();
    check("DeviceBuffer::from_slice");
    drop(up);
    check("DeviceBuffer drop after from_slice");
    buf.copy_from_host(&s, &[2.0; 64]).unwrap();
    check("copy_from_host");
    assert_eq!(buf.to_vec(&s).unwrap(), vec![2.0; 64]);
    check("to_vec");
    let copy = buf.to_vec_async(&s).unwrap();
    check("to_vec_async");
    let done = s.completed().unwrap();
    check("completed");
    s.synchronize().unwrap();
    check("synchronize");
    assert!(s.query().unwrap());
    check("query");
    assert!(done.is_complete());
    drop(copy);
    let k = Kernels::load(ctx).unwrap();
    check("Kernels::load");
    k.add_one(&s, &buf).unwrap();
    check("add_one");
    let g = s.begin_capture_with(CaptureMode::ThreadLocal).unwrap();
    k.add_one(&s, &buf).unwrap();
    let graph = g.end().unwrap();
    check("capture");
    let exec = graph.instantiate().unwrap();
    check("instantiate");
    exec.launch(&s).unwrap();
    check("launch");
    assert_eq!(buf.to_vec(&s).unwrap(), vec![4.0; 64]);
    drop(exec);
    check("GraphExec drop");
    drop(k);
    check("Kernels drop");
    drop(buf);
    check("DeviceBuffer drop");
    ctx.set_release_threshold(1 << 20).unwrap();
    check("set_release_threshold");
    ctx.reserve(cuda_stream_pool::Priority::High, 2).unwrap();
    check("reserve");
    let _ = ctx.stats();
    check("stats");
    if sync_ctx {
        ctx.synchronize().unwrap();
        check("Context::synchronize");
    }
    drop(s);
    drop(o);
    check("Owner drop");
    ctx.trim().unwrap();
    check("trim");
}

// Regression: issue 19 defect 16 (every operation leaves the crate's context current)
#[test]
fn every_operation_restores_the_callers_current_context() {
    let sim = common::sim_two_devices();
    let d: Arc<dyn Driver> = sim.clone();
    let mine = Context::primary(d.clone(), 1).unwrap();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    // SAFETY: `mine` keeps its primary context retained.
    unsafe { sim.ctx_set_current(mine.raw()) }.unwrap();
    every_operation(&d, &ctx, true, &mut |op| {
        assert_eq!(
            sim.ctx_get_current().unwrap(),
            mine.raw(),
            "{op} left another context current"
        );
    });
    drop(ctx);
    assert_eq!(sim.ctx_get_current().unwrap(), mine.raw(), "teardown");
}

// Regression: issue 19 defect 16 (on a thread with no current context, none is left current)
#[test]
fn operations_leave_no_context_current_on_a_fresh_thread() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            every_operation(&d, &ctx, true, &mut |op| {
                assert!(
                    sim.ctx_get_current().unwrap().is_null(),
                    "{op} left a context current"
                );
            });
        });
    });
}

// Regression: issue 19 defects 8 and 9 (the invalidation table applied call site by call site)
#[test]
fn no_invalidating_call_outside_relaxed_mode_while_a_capture_is_live() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let fc = ForeignCapture::new(&d, ctx.raw(), s.raw());
    every_operation(&d, &ctx, false, &mut |op| {
        let bad = sim.unrelaxed_calls();
        assert!(bad.is_empty(), "{op}: {bad:?}");
    });
    capture_intact(fc.end());
    drop(s);
    drop(o);
    drop(ctx);
    assert!(
        sim.unrelaxed_calls().is_empty(),
        "teardown: {:?}",
        sim.unrelaxed_calls()
    );
}

// The sim's check itself: a call of the table made outside relaxed mode is reported.
#[test]
fn the_sim_reports_an_unrelaxed_invalidating_call() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (s, t) = (a.stream().unwrap(), b.stream().unwrap());
    let fc = ForeignCapture::new(&d, ctx.raw(), s.raw());
    // SAFETY: `t` is held by `b`: live.
    let r = unsafe { sim.stream_query(t.raw()) };
    assert_eq!(
        r.unwrap_err().code(),
        Some(ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED)
    );
    assert_eq!(sim.unrelaxed_calls().len(), 1);
    assert!(fc.end().is_err());
}

// Each of the table's calls that the sim now applies: outside relaxed mode, during a foreign
// global capture, it invalidates the capture (module loads succeed and still invalidate).
#[test]
fn the_sim_applies_the_invalidation_table_to_host_alloc_pools_instantiate_and_module_loads() {
    type Call = fn(&dyn Driver) -> bool;
    let calls: [(&str, Call); 4] = [
        ("cuMemHostAlloc", |d| d.mem_host_alloc(64, 0).is_err()),
        ("cuMemPoolCreate", |d| {
            d.mem_pool_create(d.device_get(0).unwrap()).is_err()
        }),
        ("cuMemPoolSetAttribute", |d| {
            let pool = d.device_default_mem_pool(d.device_get(0).unwrap()).unwrap();
            // SAFETY: the default pool lives as long as the driver.
            unsafe {
                d.mem_pool_set_attribute(
                    pool,
                    cuda_stream_pool::driver::MemPoolAttr::ReleaseThreshold,
                    0,
                )
            }
            .is_err()
        }),
        ("cuModuleLoadData", |d| {
            let ptx = cuda_stream_pool::kernels::PTX.as_bytes();
            d.module_load_data(std::ffi::CStr::from_bytes_with_nul(ptx).unwrap())
                .is_ok()
        }),
    ];
    for (name, call) in calls {
        let d = common::sim();
        let e = common::Env::new(&d);
        let s = e.stream();
        let fc = ForeignCapture::new(&d, e.ctx, s);
        assert!(call(&*d), "{name}: unexpected result");
        assert!(fc.end().is_err(), "{name} left the foreign capture intact");
    }
}

// The cost of the rules: one alloc + drop of a buffer makes one pair of mode exchanges each and
// no context switch, whether no context or another one is current on the thread.
#[test]
fn alloc_and_drop_make_one_mode_exchange_pair_and_no_context_switch() {
    let sim = common::sim_two_devices();
    let other = Context::primary(sim.clone(), 1).unwrap();
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    drop(DeviceBuffer::<f32>::alloc(&s, 16).unwrap());
    for bind_other in [false, true] {
        if bind_other {
            other.bind().unwrap();
        }
        sim.clear_calls();
        let b = DeviceBuffer::<f32>::alloc(&s, 16).unwrap();
        let alloc: Vec<&str> = sim.calls().iter().map(|c| c.name).collect();
        sim.clear_calls();
        drop(b);
        let free: Vec<&str> = sim.calls().iter().map(|c| c.name).collect();
        eprintln!("another context current: {bind_other}\nalloc: {alloc:?}\nfree: {free:?}");
        for calls in [&alloc, &free] {
            let exchanges = calls
                .iter()
                .filter(|c| **c == "cuThreadExchangeStreamCaptureMode")
                .count();
            assert_eq!(exchanges, 2, "{calls:?}");
            assert!(!calls.contains(&"cuCtxSetCurrent"), "{calls:?}");
            assert_eq!(calls.len(), 3, "{calls:?}");
        }
    }
}

// The device layer restores the caller's capture mode, set with the caller's own guard.
#[test]
fn every_operation_keeps_the_callers_capture_mode() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    for mode in [
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
        CaptureMode::Global,
    ] {
        let _mine = cuda_stream_pool::CaptureModeGuard::new(&*sim, mode).unwrap();
        every_operation(&d, &ctx, true, &mut |op| {
            let now = sim.thread_exchange_capture_mode(mode).unwrap();
            assert_eq!(now, mode, "{op} changed the thread's capture mode");
        });
    }
}

/// A hook that panics at one call, to unwind through the crate's scopes.
struct PanicAt(&'static str);
// SAFETY: `before` only panics or allows; the default `call` calls the driver once.
unsafe impl cuda_stream_pool::driver::Hook for PanicAt {
    fn before(&self, call: &'static str) -> cuda_stream_pool::Result<()> {
        if call == self.0 {
            panic!("the test's hook panics at {call}");
        }
        Ok(())
    }
}

// The device layer's scopes are guards: they restore the thread's state when a call unwinds.
#[test]
fn a_panic_inside_an_operation_restores_mode_and_context() {
    let sim = common::sim_two_devices();
    let mine = Context::primary(sim.clone(), 1).unwrap();
    let hooked: Arc<dyn Driver> = Arc::new(cuda_stream_pool::driver::Hooked {
        inner: sim.clone(),
        hook: PanicAt("cuMemFreeAsync"),
    });
    let ctx = Context::primary(hooked, 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    mine.bind().unwrap();
    let _guard = cuda_stream_pool::CaptureModeGuard::new(&*sim, CaptureMode::ThreadLocal).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(b)));
    assert!(r.is_err(), "the hook did not panic");
    assert_eq!(sim.ctx_get_current().unwrap(), mine.raw());
    assert_eq!(
        sim.thread_exchange_capture_mode(CaptureMode::ThreadLocal)
            .unwrap(),
        CaptureMode::ThreadLocal
    );
}

// Switches nest: an operation that makes several relaxed calls switches the mode once.
#[test]
fn an_operation_with_several_queries_makes_one_mode_exchange_pair() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let owners: Vec<_> = (0..3).map(|_| ctx.owner()).collect();
    for o in &owners {
        // The handle leaves the crate: only a query tells whether the stream is idle.
        o.stream().unwrap().raw();
    }
    drop(owners);
    sim.clear_calls();
    assert_eq!(ctx.stats().idle, 3);
    let names: Vec<&str> = sim.calls().iter().map(|c| c.name).collect();
    let count = |n: &str| names.iter().filter(|c| **c == n).count();
    assert_eq!(count("cuStreamQuery"), 3, "{names:?}");
    assert_eq!(count("cuThreadExchangeStreamCaptureMode"), 2, "{names:?}");
}

// Pins soundness review (issue 12) defect 9: dropping an `OwnedStream` invalidated another thread's global capture
#[test]
fn dropping_an_owned_stream_keeps_another_threads_global_capture() {
    let (sim, ctx) = setup();
    let d: Arc<dyn Driver> = sim.clone();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let os = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    let fc = ForeignCapture::new(&d, ctx.raw(), s.raw());
    drop(os); // this thread is in global mode
    let r = fc.end();
    assert!(
        r.is_ok(),
        "dropping an OwnedStream invalidated another thread's global capture: {:?}",
        r.map(|_| ())
    );
}

// Pins soundness review (issue 12) defect 15: implicit allocations and frees invalidated another thread's global capture
#[test]
fn alloc_and_free_switch_to_relaxed_mode_and_keep_another_threads_global_capture() {
    let (sim, ctx) = setup();
    let d: Arc<dyn Driver> = sim.clone();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let fc = ForeignCapture::new(&d, ctx.raw(), s.raw());
    sim.clear_calls();
    let buf = DeviceBuffer::<u32>::alloc(&t, 64).unwrap();
    drop(buf);
    let calls = sim.calls();
    let r = fc.end();
    let relaxed_before = |name: &str| {
        let i = calls
            .iter()
            .position(|c| c.name.starts_with(name))
            .unwrap_or(0);
        calls[..i]
            .iter()
            .any(|c| c.name == "cuThreadExchangeStreamCaptureMode")
    };
    let (alloc_ok, free_ok) = (
        relaxed_before("cuMemAlloc"),
        relaxed_before("cuMemFreeAsync"),
    );
    assert!(
        r.is_ok() && alloc_ok && free_ok,
        "an allocation and a free on a global-mode thread while another thread captures in \
         global mode: capture end {:?}; mode switched before the alloc: {alloc_ok}, before the \
         free: {free_ok}; calls: {}",
        r.as_ref().map(|_| ()),
        fmt_calls(&calls)
    );
}

/// `from_slice` failing at each of its driver calls in turn (the allocation, the context switch,
/// the copy, the wait, the restores), on a thread where another context is current and the
/// caller's own capture mode is thread-local: the thread's state is as the caller left it, no
/// device memory is left behind once the context is synchronized, and the simulation saw no
/// misuse. Pins the scope that 3c7c9204 gave `from_slice` on its error paths.
#[test]
fn a_failing_from_slice_restores_the_thread_and_leaks_nothing() {
    let sim = common::sim_two_devices();
    let mine = Context::primary(sim.clone(), 1).unwrap();
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    drop(DeviceBuffer::from_slice(&s, &[1u32; 64]).unwrap());
    ctx.synchronize().unwrap();
    let base = sim.counters().live_allocs;
    mine.bind().unwrap();
    let _guard = cuda_stream_pool::CaptureModeGuard::new(&*sim, CaptureMode::ThreadLocal).unwrap();
    sim.clear_calls();
    drop(DeviceBuffer::from_slice(&s, &[1u32; 64]).unwrap());
    let calls = sim.calls().len() as u64;
    assert!(calls >= 6, "{:?}", fmt_calls(&sim.calls()));
    let mut failed = 0;
    for n in 1..=calls {
        sim.fail_nth_call(n, ErrorCode::ERROR_UNKNOWN);
        let r = DeviceBuffer::from_slice(&s, &[2u32; 64]);
        sim.clear_faults();
        if let Ok(b) = &r {
            assert_eq!(b.to_vec(&s).unwrap(), vec![2u32; 64], "call {n}");
        }
        failed += r.is_err() as usize;
        drop(r);
        assert_eq!(
            sim.ctx_get_current().unwrap(),
            mine.raw(),
            "a from_slice failing at its call {n} left another context current"
        );
        assert_eq!(
            sim.thread_exchange_capture_mode(CaptureMode::ThreadLocal)
                .unwrap(),
            CaptureMode::ThreadLocal,
            "a from_slice failing at its call {n} changed the thread's capture mode"
        );
        ctx.synchronize().unwrap();
        assert_eq!(
            sim.counters().live_allocs,
            base,
            "a from_slice failing at its call {n} left memory behind"
        );
    }
    assert!(failed >= 3, "only {failed} of {calls} faults made it fail");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
