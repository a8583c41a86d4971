//! Capture guards, and what is refused on a capturing stream (with the capture left intact): each
//! scenario runs on the simulated driver and, as a GPU test, on the real one; call-log and
//! interleaving checks on the simulation.

#[path = "common/calls.rs"]
mod calls;
mod common;

use calls::{fmt_calls, recorded_on, setup};
use common::capture_survives;
use cuda_stream_pool::driver::sim::Call;
use cuda_stream_pool::driver::{CaptureMode, Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{
    CaptureModeGuard, Context, DeviceBuffer, Error, ErrorCode, OwnedStream, Priority,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// How long a scenario that would hang may run before the test fails.
const HANG: Duration = Duration::from_secs(3);

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

// Pins soundness review (issue 12) defect 1: a host function in a capture (on both drivers)
/// Defect 1 on both drivers: a host function into a capture is refused; the capture survives.
fn host_func_refused_in_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let g = s.begin_capture().unwrap();
    assert!(matches!(
        s.launch_host_func(|| {}),
        Err(Error::CaptureInProgress(_))
    ));
    capture_survives(g.end());
}

// Pins soundness review (issue 12) defect 3: a wait from a capturing stream pulled the waiting stream into the capture
/// Defect 3's real-driver path: a wait from a capturing stream would pull the waiting stream
/// into the capture (and a free on it would then fail twice). The wait is refused, the capture
/// survives, and a buffer last used on the would-be-joined stream frees cleanly.
fn fork_into_capture_refused(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<u32>::zeroed(&t, 1024).unwrap();
    let g = s.begin_capture().unwrap();
    assert!(matches!(t.wait_for(&s), Err(Error::CaptureInProgress(_))));
    drop(buf);
    assert_eq!(ctx.pending(), 0, "the free on t must not be deferred");
    capture_survives(g.end());
    ctx.synchronize().unwrap();
}

// Pins soundness review (issue 12) defect 7: a use in a capture waited on outside work (905 on the H200)
/// Defect 7 on both drivers: a buffer whose last use may still run on another stream cannot be
/// used in a capture (a capturing stream waiting on outside work invalidates the capture with
/// CUDA_ERROR_STREAM_CAPTURE_ISOLATION); once that work is done, it can.
fn use_in_capture_refused_while_outside_work_may_run(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let k = Kernels::load(&ctx).unwrap();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<f32>::zeroed(&t, 1 << 16).unwrap();
    let gate = common::Gate::on(&**d, t.raw());
    k.add_one(&t, &buf).unwrap(); // pending behind the gate
    let g = s.begin_capture().unwrap();
    assert!(matches!(
        k.add_one(&s, &buf),
        Err(Error::CaptureInProgress(_))
    ));
    capture_survives(g.end());
    drop(gate);
    t.synchronize().unwrap();
    let g = s.begin_capture().unwrap();
    k.add_one(&s, &buf).unwrap(); // t's work is done: nothing to wait for
    let exec = g.end().unwrap().instantiate().unwrap();
    exec.launch(&s).unwrap();
    assert_eq!(buf.to_vec(&t).unwrap()[0], 2.0);
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
    host_func_refused_in_capture,
    fork_into_capture_refused,
    use_in_capture_refused_while_outside_work_may_run,
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

// Pins soundness review (issue 12) defect 1: a host function in a capture ran on every graph launch (its closure freed twice)
#[test]
fn a_host_function_on_a_capturing_stream_is_refused() {
    let (_sim, ctx) = setup();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let guard = s.begin_capture().unwrap();
    let r = s.launch_host_func(|| {});
    drop(guard);
    assert!(
        r.is_err(),
        "launch_host_func on a capturing stream must be refused (a captured host node runs on \
         every graph launch with the same boxed FnOnce), got {r:?}"
    );
}

// Pins soundness review (issue 12) defect 7: `use_on` into a capture waited on an outside event (905, capture invalidated)
#[test]
fn use_on_into_a_capture_never_waits_on_an_event_recorded_outside_it() {
    let (sim, ctx) = setup();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<u32>::zeroed(&t, 64).unwrap();
    t.synchronize().unwrap();
    sim.enqueue_work(t.raw(), 1_000).unwrap(); // last use on busy t
    let guard = s.begin_capture().unwrap();
    let begin = sim.calls().len();
    let r = buf.use_on(&s);
    let calls = sim.calls();
    let end = guard.end();
    // Waits into the capturing stream on events recorded outside the capture (on the H200:
    // CUDA_ERROR_STREAM_CAPTURE_ISOLATION, and the capture is invalidated).
    let bad: Vec<&Call> = (begin..calls.len())
        .filter(|&i| {
            let c = &calls[i];
            c.name == "cuStreamWaitEvent"
                && c.stream == Some(s.raw())
                && c.event
                    .and_then(|e| recorded_on(&calls, e, i))
                    .is_some_and(|on| on != s.raw())
        })
        .map(|i| &calls[i])
        .collect();
    assert!(
        (r.is_err() && end.is_ok()) || bad.is_empty(),
        "use_on into a capture made cuStreamWaitEvent(capturing stream, event recorded outside \
         the capture): {} (use_on: {r:?}, end: {:?})",
        fmt_calls(&bad.into_iter().cloned().collect::<Vec<_>>()),
        end.map(|_| ())
    );
}

// Pins soundness review (issue 12) defect 10: an `OwnedStream` dropped under its capture guard destroyed a capturing stream
#[test]
fn an_owned_stream_dropped_under_a_leaked_capture_guard_is_not_destroyed_capturing() {
    let (sim, ctx) = setup();
    let os = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    // The guard borrows the stream now (dropping the stream under it does not compile); a guard
    // leaked with `mem::forget` must not make the drop destroy a capturing stream.
    std::mem::forget(os.stream().begin_capture().unwrap());
    drop(os);
    assert!(
        sim.misuse().is_empty(),
        "an OwnedStream dropped under its live capture guard: {:?}",
        sim.misuse()
    );
}

// Pins soundness review (issue 12) defects 1 and 3, and the review's other refusals: each leaves the capture intact
/// Each operation that the real driver would turn into something unsafe inside a capture (a
/// host copy that reads or writes host memory on every launch, an allocation the graph would
/// own, a fork/join wait, a nested graph launch), or that would invalidate the capture (a
/// synchronize or query), is refused with `CaptureInProgress`, and the capture still ends fine.
#[test]
fn capture_refusals_leave_the_capture_intact() {
    let (sim, ctx) = setup();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
    s.synchronize().unwrap();
    let exec = {
        let g = s.begin_capture().unwrap();
        buf.fill(&s, 1).unwrap();
        g.end().unwrap().instantiate().unwrap()
    };
    let g = s.begin_capture().unwrap();
    let refused = |what: &str, r: cuda_stream_pool::Result<()>| {
        assert!(
            matches!(r, Err(cuda_stream_pool::Error::CaptureInProgress(_))),
            "{what}: {r:?}"
        );
    };
    refused("alloc", DeviceBuffer::<u32>::alloc(&s, 4).map(|_| ()));
    refused("to_vec", buf.to_vec(&s).map(|_| ()));
    refused("copy_from_host", buf.copy_from_host(&s, &[0; 16]));
    refused("synchronize", s.synchronize());
    refused("query", s.query().map(|_| ()));
    refused("wait_for (capturing waits)", s.wait_for(&t));
    refused("wait_for (waits on capturing)", t.wait_for(&s));
    refused("host function", s.launch_host_func(|| {}));
    refused("graph launch", exec.launch(&s));
    buf.fill(&s, 2).unwrap(); // plain captured work is fine
    let graph = g.end().expect("the capture survived every refusal");
    assert_eq!(graph.node_count().unwrap(), 1);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Pins the second review's finding: `begin_capture` dropped a stale capture list under the slot's lock (a deadlock)
/// After an invalidated capture whose end cannot be confirmed (the status query fails), the
/// stream stays flagged capturing and keeps the capture's buffers in `SlotState::captured`.
/// The next `begin_capture` succeeds in the driver and clears that list *under the slot's lock*:
/// dropping a buffer's last reference there frees it through `free_ordered`, which locks the same
/// slot again: the thread deadlocks on its own mutex (std's `Mutex` may also panic).
#[test]
fn a_new_capture_after_an_unconfirmed_end_drops_its_stale_buffers_without_deadlock() {
    let (sim, ctx) = setup();
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let mut buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
        s.synchronize().unwrap();
        let g = s.begin_capture().unwrap();
        buf.fill(&s, 1).unwrap(); // registers buf with the capture
                                  // A safe driver call that this thread may not make during its own capture: the capture
                                  // is invalidated (as on the GPU). Any invalidation will do.
                                  // (The raw driver: the context's own driver runs it in relaxed mode.)
        ctx.bind().unwrap();
        assert!(cuda_stream_pool::driver::Driver::ctx_synchronize(&*sim).is_err());
        sim.fail_calls("cuStreamGetCaptureInfo_v3", ErrorCode::ERROR_UNKNOWN, 2);
        let end = g.end();
        sim.clear_faults();
        let _ = tx.send(format!("end: {:?}", end.map(|_| ())));
        drop(buf); // the stale capture list holds the last reference now
        let _ = tx.send(format!("driver capturing: {:?}", s.is_capturing()));
        let g2 = s.begin_capture();
        let _ = tx.send(format!("second begin: {:?}", g2.as_ref().map(|_| ())));
        drop(g2);
        let _ = tx.send("done".into());
    });
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(HANG) {
            Ok(m) if m == "done" => break,
            Ok(m) => seen.push(m),
            Err(e) => panic!("the thread hung or died ({e:?}) after: {seen:?}"),
        }
    }
}
