//! Host functions: crate calls made inside one are refused before they touch anything, and
//! leave nothing behind on the driver's host-function thread (which never exits); crate objects
//! dropped inside one (the last `Kernels`, the last `Context`) tear down without waiting for it.

#[path = "common/calls.rs"]
mod calls;

use calls::setup;
use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, Priority};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// How long a scenario that would hang may run before the test fails.
const HANG: Duration = Duration::from_secs(3);

// Regression: issue 19 defect 11 (Context::stream() inside a host function leaks the whole context)
#[test]
fn thread_owner_calls_in_a_host_function_are_refused_and_leak_nothing() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (tx, rx) = mpsc::channel();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let c2 = ctx.clone();
        s.launch_host_func(move || {
            let r = (
                c2.stream().map(|_| ()).is_err(),
                c2.with_thread_owner(|_| ()).is_err(),
                c2.set_priority(Priority::High).is_err(),
            );
            let _ = tx.send(r);
        })
        .unwrap();
        sim.advance(0);
        s.synchronize().unwrap();
    }
    let refused = rx.recv().unwrap();
    assert_eq!(
        refused,
        (true, true, true),
        "(stream, with_thread_owner, set_priority) in a host function"
    );
    drop(ctx);
    cuda_stream_pool::release_pinned_cache(&*sim).unwrap();
    let c = sim.counters();
    assert_eq!(
        c.live_contexts, 0,
        "the host-function thread's implicit owner keeps the context: {c:?}"
    );
    assert_eq!(c.live_streams, 0, "{c:?}");
}

// Pins the second review's finding: destructors called the driver in a host function (the last `Kernels` waited for itself)
/// A host function may not call the driver, but a closure that merely owns a crate object (all
/// of `Kernels`, `DeviceBuffer`, `Owner`, `Context`, `GraphExec` are `Send + 'static`) drops it
/// on the driver's host-function thread, and the crate's destructors call the driver there.
/// The worst one: the last `Kernels` runs `cuCtxSynchronize` before unloading its module, which
/// waits for the host function that is running it: the stream never completes.
#[test]
fn dropping_the_last_kernels_in_a_host_function_does_not_hang_its_stream() {
    let (_sim, ctx) = setup();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let k = Kernels::load(&ctx).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        s.launch_host_func(move || drop(k)).unwrap();
        let r = s.synchronize();
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let r = rx.recv_timeout(HANG);
    assert!(
        matches!(r, Ok(Ok(()))),
        "dropping the last Kernels inside a host function hung the stream: {r:?}"
    );
}

// Pins the second review's finding: destructors called the driver in a host function (the last `Context` waited for its stream)
/// The same with the last `Context` clone: its teardown waits for the retired stream that runs
/// the host function.
#[test]
fn dropping_the_last_context_in_a_host_function_does_not_wait_for_its_own_stream() {
    let (sim, ctx) = setup();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let s_raw;
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        s_raw = s.raw();
        let c2 = ctx.clone();
        s.launch_host_func(move || {
            let _ = go_rx.recv();
            drop(c2); // the last clone: CtxInner::drop runs here, on the host-function thread
            let _ = done_tx.send(());
        })
        .unwrap();
    }
    drop(ctx);
    go_tx.send(()).unwrap();
    let r = done_rx.recv_timeout(HANG);
    assert!(
        r.is_ok(),
        "the context's teardown, run by a host function, waited for its own stream (busy: {})",
        sim.is_busy(s_raw)
    );
}

// Pins the second review's finding: crate objects moved into a host function called the driver from its thread
/// Found by the second review: crate objects moved into a host function (an `Owner` is `Send`)
/// reached the driver from the host-function thread (the real driver may refuse or deadlock).
/// Every driver call of a context now fails there with CUDA_ERROR_NOT_PERMITTED, before the
/// driver is called.
#[test]
fn crate_calls_inside_a_host_function_never_reach_the_driver() {
    use cuda_stream_pool::driver::SimDriver;
    let sim = std::sync::Arc::new(SimDriver::new());
    let ctx = cuda_stream_pool::Context::primary(sim.clone(), 0).unwrap();
    let held = ctx.owner();
    held.stream().unwrap(); // holds a stream already: stream() needs no driver call
    let fresh = ctx.owner();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let c = ctx.clone();
    s.launch_host_func(move || {
        let a = fresh.stream().map(|_| ()); // would create or query a stream
        let b = held.stream().and_then(|s| s.synchronize()); // would wait for the GPU
        let c2 = c.synchronize();
        let _ = tx.send((a.is_err(), b.is_err(), c2.is_err()));
    })
    .unwrap();
    s.synchronize().unwrap();
    assert_eq!(rx.recv().unwrap(), (true, true, true));
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
