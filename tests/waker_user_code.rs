//! A waker's clone, wake and drop are user code: the crate runs them with the thread's current
//! context and capture mode as its caller left them (outside the device rules' scopes), so that
//! what a waker does there neither sees the crate's switched state nor misleads the crate's
//! next calls into skipping a switch.
//!
//! Pins review 26's finding 1: `OwnerReady::poll` ran `Pool::poll_acquire` in a scope of its
//! context, and the waker's clones (to join the gate's queue, to take a turn, to be woken after
//! a while) and the drops of replaced wakers ran there: in the crate's relaxed mode with its
//! context current. A waker that bound another context there made the pool create a stream of
//! device 1 for device 0's pool; one that left global mode made the acquisition's next query
//! invalidate another thread's global capture.

mod common;

use cuda_stream_pool::driver::{self, CaptureMode, CaptureModeGuard, Driver, SimDriver};
use cuda_stream_pool::{Context, ContextOptions};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::{RawWaker, RawWakerVTable, Waker};

/// The simulation whose thread state the waker records, and what it recorded.
static SIM: Mutex<Option<Arc<SimDriver>>> = Mutex::new(None);
static SEEN: Mutex<Vec<(&'static str, driver::Context, CaptureMode)>> = Mutex::new(Vec::new());
/// What the waker's clone does (once), after recording.
static ON_CLONE: Mutex<Option<Box<dyn FnOnce() + Send>>> = Mutex::new(None);

fn record(what: &'static str) {
    let sim = SIM.lock().unwrap().clone();
    if let Some(sim) = sim {
        let (c, m) = sim.thread_state();
        SEEN.lock().unwrap().push((what, c, m));
    }
}

fn vt_clone(_: *const ()) -> RawWaker {
    record("clone");
    let f = ON_CLONE.lock().unwrap().take();
    if let Some(f) = f {
        f();
    }
    RawWaker::new(std::ptr::null(), &VTABLE)
}
fn vt_wake(_: *const ()) {
    record("wake");
}
fn vt_drop(_: *const ()) {
    record("drop");
}
static VTABLE: RawWakerVTable = RawWakerVTable::new(vt_clone, vt_wake, vt_wake, vt_drop);

fn recording_waker() -> Waker {
    // SAFETY: the vtable's functions ignore the data pointer and free nothing.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

/// The tests share the statics: one at a time.
static ONE: Mutex<()> = Mutex::new(());

/// A context with a cap of one stream whose only stream is retired busy, so that an
/// `OwnerReady` queries it (a call in relaxed mode, the context current) and then waits.
fn at_cap(sim: &Arc<SimDriver>) -> Context {
    let d: Arc<dyn Driver> = sim.clone();
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(d, 0, opts).unwrap();
    let o = ctx.owner();
    sim.enqueue_work(o.stream().unwrap().raw(), 1_000_000)
        .unwrap();
    drop(o);
    ctx
}

#[test]
fn a_wakers_clone_and_drop_see_the_callers_context_and_capture_mode() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let sim = Arc::new(SimDriver::new());
    let ctx = at_cap(&sim);
    // The caller's state: no context current, global mode (every thread's default).
    sim.set_thread_context(driver::Context(0));
    let callers = sim.thread_state();
    assert_eq!(callers.1, CaptureMode::Global);
    SEEN.lock().unwrap().clear();
    *SIM.lock().unwrap() = Some(sim.clone());
    let w = recording_waker();
    let mut cx = std::task::Context::from_waker(&w);
    let mut fut = Box::pin(ctx.owner().ready());
    // Twice: the first poll joins the queue, the second takes a turn (a clone each, shared by
    // what the acquisition keeps).
    for _ in 0..2 {
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(
            sim.thread_state(),
            callers,
            "the poll left the thread's state as found"
        );
    }
    drop(fut); // leaves the queue (a clone kept for a wake-up after a while is dropped later)
    *SIM.lock().unwrap() = None;
    let seen = std::mem::take(&mut *SEEN.lock().unwrap());
    assert!(
        seen.iter().any(|s| s.0 == "clone"),
        "the crate cloned the waker: {seen:?}"
    );
    let wrong: Vec<_> = seen
        .iter()
        .filter(|(_, c, m)| (*c, *m) != callers)
        .collect();
    assert!(
        wrong.is_empty(),
        "user code ran in the crate's state, not the caller's {callers:?}: {wrong:?}"
    );
}

#[test]
fn a_waker_that_leaves_global_mode_does_not_make_the_acquisition_invalidate_a_capture() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let sim = Arc::new(SimDriver::new());
    let ctx = at_cap(&sim);
    let raw: Arc<dyn Driver> = sim.clone();
    // Another thread's capture in global mode.
    let foreign = {
        sim.set_thread_context(ctx.raw());
        let s = raw
            .stream_create(driver::stream_flags::NON_BLOCKING, 0)
            .unwrap();
        sim.set_thread_context(driver::Context(0));
        common::ForeignCapture::new(&raw, ctx.raw(), s)
    };
    // This thread runs in relaxed mode; the waker's clone puts it in global mode and leaves it
    // so (a forgotten guard: safe), as the user's code may.
    let relaxed = CaptureModeGuard::new(&*raw, CaptureMode::Relaxed).unwrap();
    let sim2 = sim.clone();
    *ON_CLONE.lock().unwrap() = Some(Box::new(move || {
        let d: &dyn Driver = &*sim2;
        std::mem::forget(CaptureModeGuard::new(d, CaptureMode::Global).unwrap());
    }));
    let before = sim.unrelaxed_calls().len();
    let w = recording_waker();
    let mut cx = std::task::Context::from_waker(&w);
    let mut fut = Box::pin(ctx.owner().ready());
    // The first poll queries (relaxed), clones the waker to join the queue, then arms a wake-up
    // on the busy stream; the second takes a turn and queries again.
    for _ in 0..2 {
        assert!(fut.as_mut().poll(&mut cx).is_pending());
    }
    drop(fut);
    *ON_CLONE.lock().unwrap() = None;
    let unrelaxed = sim.unrelaxed_calls()[before..].to_vec();
    assert!(
        unrelaxed.is_empty(),
        "the crate made calls of the invalidation table outside relaxed mode: {unrelaxed:?}"
    );
    common::capture_survives(foreign.end());
    drop(relaxed);
}

/// A wake from a host function goes to the waker thread, whatever locks the thread that runs the
/// host function holds: the check that no lock of the crate is held applies where the waker
/// runs. Pins review 27's finding: the check came first, so a wake-up host function run inline
/// in a driver call made under the pool's locks (as a driver may run one when it has no thread
/// for it) panicked, and the waiter's wake-up was lost.
#[test]
fn a_wake_sent_from_a_host_function_is_not_refused_for_the_callers_locks() {
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    static MSGS: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        MSGS.lock().unwrap().push(info.to_string());
        prev(info);
    }));
    let sim = Arc::new(SimDriver::realtime());
    let d: Arc<dyn Driver> = sim.clone();
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(d, 0, opts).unwrap();
    let o1 = ctx.owner();
    let raw = o1.stream().unwrap().raw();
    let enqueued = std::time::Instant::now();
    sim.enqueue_work(raw, 1_000_000).unwrap(); // 1 ms
    drop(o1);
    let w = recording_waker();
    let mut cx = std::task::Context::from_waker(&w);
    let mut fut = Box::pin(ctx.owner().ready());
    assert!(fut.as_mut().poll(&mut cx).is_pending());
    // No host-function thread can be started: the wake-up, once due, runs inline in the
    // driver call that finds it due.
    sim.fail_host_thread_spawns(1);
    // Until the 1 ms of work has ended on the simulation's real-time clock (asked without a
    // call into the simulation, which would run the due host function there).
    while enqueued.elapsed() < std::time::Duration::from_millis(2) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // A statistics reading queries the retired stream under the pool's locks: the wake-up host
    // function runs inside that query.
    let _ = ctx.stats();
    assert_eq!(sim.host_fn_progress(), (1, 1), "the wake-up ran");
    let msgs = MSGS.lock().unwrap().clone();
    assert!(
        !msgs.iter().any(|m| m.contains("would run under")),
        "the gate's wake-up panicked in its host function: {msgs:?}"
    );
}
