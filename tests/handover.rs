//! Hand-overs without a driver call: a retired stream is handed on without `cuStreamQuery`
//! when the crate knows its work completed (nothing enqueued since it was handed out, or since a
//! `synchronize`, a blocking copy or a resolved completion of the crate), and with one whenever
//! it cannot know (the raw handle left the crate in that generation, the crate enqueued
//! something since). On the simulated driver, which counts every call.

mod common;

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{Context, DeviceBuffer};
use std::sync::Arc;

fn sim() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    (sim, Context::primary(d, 0).unwrap())
}

fn queries(sim: &SimDriver) -> usize {
    sim.calls()
        .iter()
        .filter(|c| c.name == "cuStreamQuery")
        .count()
}

/// Acquiring and releasing a stream that nobody used makes no driver call at all (issue 22's
/// "zero-call hand-over"): 100 owners in turn, after a first one that created the stream.
#[test]
fn an_untouched_stream_is_handed_on_with_no_driver_call() {
    let (sim, ctx) = sim();
    let first = ctx.owner();
    let raw = first.stream().unwrap().generation();
    drop(first);
    let before = sim.call_count();
    for _ in 0..100 {
        let o = ctx.owner();
        assert!(o.stream().unwrap().generation() > raw);
        drop(o);
    }
    assert_eq!(
        sim.call_count() - before,
        0,
        "driver calls made by 100 acquisitions and releases: {:?}",
        sim.calls().iter().map(|c| c.name).collect::<Vec<_>>()
    );
    assert_eq!(ctx.stats().created, 1);
}

/// After the crate's own work and a `synchronize`, the stream is handed on without a query.
#[test]
fn a_synchronized_stream_is_handed_on_without_a_query() {
    let (sim, ctx) = sim();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let buf = DeviceBuffer::from_slice(&s, &[1u32, 2, 3]).unwrap();
    let mut out = DeviceBuffer::<u32>::zeroed(&s, 3).unwrap();
    out.copy_from_host(&s, &[4, 5, 6]).unwrap();
    s.synchronize().unwrap();
    drop(s);
    sim.clear_calls();
    drop(o);
    let next = ctx.owner();
    next.stream().unwrap();
    assert_eq!(queries(&sim), 0, "{:?}", sim.calls());
    assert_eq!(ctx.stats().created, 1, "the same stream, handed on");
    drop((buf, out));
}

/// A resolved completion future makes the stream known idle too (up to its marker).
#[test]
fn a_resolved_completion_makes_the_stream_known_idle() {
    let (sim, ctx) = sim();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let buf = DeviceBuffer::from_slice(&s, &[7u32; 64]).unwrap();
    let done = s.completed().unwrap();
    common::block_on(done).unwrap();
    drop(s);
    sim.clear_calls();
    drop(o);
    ctx.owner().stream().unwrap();
    assert_eq!(queries(&sim), 0, "{:?}", sim.calls());
    drop(buf);
}

/// Once the raw handle left the crate in a generation, work may have been enqueued through it
/// unseen (here through a handle kept across the `synchronize`): the release asks the driver,
/// and a stream still busy is not handed on.
#[test]
fn an_exposed_handle_makes_the_hand_over_ask_the_driver() {
    let (sim, ctx) = sim();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let kept = s.raw();
    s.synchronize().unwrap();
    sim.enqueue_work(kept, 1_000).unwrap(); // unseen by the crate
    drop(s);
    drop(o);
    let next = ctx.owner();
    let got = next.stream().unwrap().raw();
    assert_ne!(got, kept, "a busy stream was handed on");
    assert!(!sim.is_busy(got));
    assert!(queries(&sim) > 0);
}

/// Work enqueued on the stream after the `synchronize` (a memset of a buffer, then the buffer's
/// free) makes the release ask the driver again. (A free alone does not:
/// `a_free_after_the_last_synchronize_needs_no_query_at_the_hand_over`.)
#[test]
fn an_enqueue_after_the_synchronize_makes_the_hand_over_ask_the_driver() {
    let (sim, ctx) = sim();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let mut buf = DeviceBuffer::from_slice(&s, &[1u32; 16]).unwrap();
    s.synchronize().unwrap();
    buf.fill(&s, 7).unwrap(); // a memset: work after the synchronize
    drop(buf); // and its free
    drop(s);
    sim.clear_calls();
    drop(o);
    ctx.owner().stream().unwrap();
    assert!(queries(&sim) > 0, "{:?}", sim.calls());
}

/// A completion made before later work covers only the work before it.
#[test]
fn a_completion_covers_only_the_work_before_it() {
    let (sim, ctx) = sim();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let done = s.completed().unwrap();
    let buf = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap(); // an async memset after the marker
    common::block_on(done).unwrap();
    drop(s);
    sim.clear_calls();
    drop(o);
    ctx.owner().stream().unwrap();
    assert!(queries(&sim) > 0, "{:?}", sim.calls());
    drop(buf);
}

/// A free of the crate's memory enqueued after the crate saw the stream's work complete leaves
/// the stream known idle for a hand-over (its work touches no memory in use, and the next owner's
/// work runs after it): the seed's short task (upload, read back, free) hands its stream on
/// without `cuStreamQuery` (issue 22: that query and its capture-mode pair were the three driver
/// calls by which an owner per task exceeded the thread's own stream). Other work still makes
/// the hand-over ask (`an_enqueue_after_the_synchronize_makes_the_hand_over_ask_the_driver`), an
/// allocation too (a buffer that outlives its owner must not take a pending allocation for done).
#[test]
fn a_free_after_the_last_synchronize_needs_no_query_at_the_hand_over() {
    let (sim, ctx) = sim();
    let task = || {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32; 64]).unwrap();
        assert_eq!(b.to_vec(&s).unwrap(), vec![1; 64]);
        drop(b); // the free, after the read-back's synchronize
    };
    task();
    sim.clear_calls();
    task();
    assert_eq!(queries(&sim), 0, "{:?}", sim.calls());
    // An allocation after the synchronize is work: the next hand-over asks.
    let kept = {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        s.synchronize().unwrap();
        DeviceBuffer::<u32>::alloc(&s, 64).unwrap()
    };
    sim.clear_calls();
    ctx.owner().stream().unwrap();
    assert!(queries(&sim) > 0, "{:?}", sim.calls());
    drop(kept);
    assert_eq!(ctx.stats().created, 1);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// A free enqueued after a completion's marker, before the completion resolves (an async
/// request's buffer dropped once its read-back is enqueued), does not make the next hand-over
/// ask either: the marker covers all the work, and frees do not count as work (issue 22: the
/// async server's request paid the query and its mode pair).
#[test]
fn a_free_after_a_completions_marker_needs_no_query_at_the_hand_over() {
    let (sim, ctx) = sim();
    let request = || {
        let o = ctx.owner();
        let copy = {
            let s = o.stream().unwrap();
            let mut b = DeviceBuffer::<u32>::alloc(&s, 64).unwrap();
            b.fill(&s, 5).unwrap();
            b.to_vec_async(&s).unwrap()
            // `b` is freed here, after the copy and its marker
        };
        sim.advance(1_000_000);
        assert_eq!(common::block_on(copy).unwrap(), vec![5; 64]);
    };
    request();
    sim.clear_calls();
    request();
    assert_eq!(queries(&sim), 0, "{:?}", sim.calls());
    assert_eq!(ctx.stats().created, 1);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// The driver calls of the seed's short task (an owner, a 4 KiB upload, a read-back, the
/// owner's release) and of a buffer's allocation and free, counted on the simulated driver once
/// warm. Fails when they grow: a change that adds a driver call to the hot path must change
/// this number on purpose (issue 22).
#[test]
fn driver_calls_per_task_do_not_grow() {
    let (sim, ctx) = sim();
    let task = || {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32; 1024]).unwrap();
        assert_eq!(b.to_vec(&s).unwrap().len(), 1024);
        drop(b);
        drop(s);
        drop(o);
    };
    let alloc_free = || {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        drop(DeviceBuffer::<u32>::alloc(&s, 1024).unwrap());
    };
    for _ in 0..3 {
        task();
        alloc_free();
    }
    let names = |f: &dyn Fn()| {
        sim.clear_calls();
        f();
        sim.calls().iter().map(|c| c.name).collect::<Vec<_>>()
    };
    let t = names(&task);
    let a = names(&alloc_free);
    assert!(
        t.len() <= TASK_CALLS,
        "the short task makes {} driver calls: {t:?}",
        t.len()
    );
    assert!(
        a.len() <= ALLOC_FREE_CALLS,
        "alloc+free makes {} driver calls: {a:?}",
        a.len()
    );
}

/// Measured 2026-12-03: the acquisition's query (the previous owner, `alloc_free`'s, allocated
/// after the stream was last seen idle: work, so the stream is not known idle; a task's own free
/// after its read-back no longer asks, since 2026-12-06) with its mode pair (3); `from_slice`'s
/// allocation, copy and synchronize in one scope (8: one mode pair, one context switch and its
/// restore; 11 before the scope, when the allocation had a mode pair of its own); the read-back's
/// copy with its context switch and its synchronize with its mode pair (7); the free with its
/// pair (3).
const TASK_CALLS: usize = 21;
/// The acquisition's query (3), the allocation (3) and the free (3), each in relaxed mode
/// (allocations and frees invalidate another thread's global capture otherwise: docs/gpu.md).
const ALLOC_FREE_CALLS: usize = 9;

// Pins review 7's finding R7-3 (minor; `last_use` is documented "for tests and diagnostics"): the raw stream
// handle returned by `DeviceBuffer::last_use` leaves the crate through `Slot::observe`, not
// `Slot::expose`, so work enqueued through it (while the owner still holds the stream, as with
// `StreamRef::raw`) is not counted: after a `synchronize` the stream stays "known idle" and is
// handed to the next owner without `cuStreamQuery`, busy, and the buffer, whose last use is in
// the old generation, is freed unordered on the disposal stream under that work.
#[test]
fn work_through_the_handle_of_last_use_is_seen_before_the_hand_over() {
    let (sim, ctx) = sim();
    let buf;
    let raw;
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        buf = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
        s.synchronize().unwrap();
        let (r, _, live) = buf.last_use().unwrap();
        assert!(live);
        // A diagnostic tool (or another crate) enqueues work on the buffer's last stream
        // while its owner holds it.
        sim.enqueue_access(r, buf.as_raw(), 1024, true, 1_000_000)
            .unwrap();
        raw = r;
    }
    let o2 = ctx.owner();
    let s2 = o2.stream().unwrap();
    let busy = sim.is_busy(raw);
    // The same pooled stream, in its second generation.
    let same = s2.generation() == 2;
    drop(buf);
    s2.synchronize().unwrap();
    let misuse = sim.misuse();
    assert!(
        !(same && busy) && misuse.is_empty(),
        "handed over busy: {}; misuse: {misuse:?}",
        same && busy
    );
}

/// A buffer whose last use was on a stream handed on because a resolved completion showed its
/// work complete is freed on the disposal stream with no wait: correct on the GPU (the host saw
/// the marker land after that work), and the simulation's race detector must agree (the host
/// read of a landed `cuStreamWriteValue64` word is an observation of the work before it).
/// Regression: CI's `the_sanitizer_stress_passes_without_gates` reported this free as a race.
#[test]
fn a_free_after_a_hand_over_seen_through_a_completion_is_no_race() {
    let (sim, ctx) = sim();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let buf = DeviceBuffer::<u32>::zeroed(&s, 1 << 12).unwrap(); // an async memset on s
    let done = s.completed().unwrap();
    common::block_on(done).unwrap();
    drop(s);
    sim.clear_calls();
    drop(o);
    let next = ctx.owner();
    next.stream().unwrap();
    assert_eq!(
        queries(&sim),
        0,
        "handed on without a query: {:?}",
        sim.calls()
    );
    drop(buf);
    drop(next);
    ctx.synchronize().unwrap();
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// An async waiter's poll at the cap, with the key's only stream retired busy (it queries the
/// stream and arms a wake-up on it), makes those calls in one scope of the device rules: no
/// capture-mode switch between its first query and the wake-up's launch. Pins the cost of review
/// 26's fix as first made (the waker cloned inside the scope, between the query and the arming,
/// outside its switches: a second pair of mode switches per waiting poll, 10 calls instead of
/// 8); the waker is now cloned before the scope. (Only that stretch is counted: after the
/// arming, a poll asks now and then whether the context died, which a slow run reaches.)
#[test]
fn a_waiting_poll_at_the_cap_switches_the_capture_mode_once() {
    use std::future::Future;
    use std::task::{Wake, Waker};
    struct Noop;
    impl Wake for Noop {
        fn wake(self: Arc<Self>) {}
    }
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let opts = cuda_stream_pool::ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(d, 0, opts).unwrap();
    let w = Waker::from(Arc::new(Noop));
    let mut cx = std::task::Context::from_waker(&w);
    let o1 = ctx.owner();
    sim.enqueue_work(o1.stream().unwrap().raw(), 1_000).unwrap();
    drop(o1);
    sim.clear_calls();
    let mut f = Box::pin(ctx.owner().ready());
    assert!(f.as_mut().poll(&mut cx).is_pending());
    let calls: Vec<_> = sim.calls().iter().map(|c| c.name).collect();
    let query = calls.iter().position(|&c| c == "cuStreamQuery");
    let launch = calls.iter().position(|&c| c == "cuLaunchHostFunc");
    let (Some(query), Some(launch)) = (query, launch) else {
        panic!("the waiter queried the stream and armed a wake-up: {calls:?}")
    };
    assert_eq!(
        calls[..query],
        ["cuThreadExchangeStreamCaptureMode"],
        "one switch to relaxed mode, before the first query: {calls:?}"
    );
    assert!(
        !calls[query..launch].contains(&"cuThreadExchangeStreamCaptureMode"),
        "no switch between the query and the launch: {calls:?}"
    );
}
