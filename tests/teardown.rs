//! The context's teardown where it cannot run in place: on the completion poller's thread (a
//! waker the poller runs drops the last `Context`), and on a thread the poller's waker waits for.
//! The teardown is handed to a thread where it can complete; it frees everything once it has.
//! And a thread whose implicit owner holds the last `Context` tears it down at its exit.
//!
//! Waits are hang guards only ([`HANG`]): each scenario finishes in milliseconds.

mod common;

#[path = "common/futures.rs"]
mod futures_util;
use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{release_pinned_cache, Context, StreamRef};
use futures_util::poll;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

/// Frees the page-locked memory that teardowns keep for a context's next state (with the
/// primary context's retain), so that a leak check sees only what is really left; `true`.
fn release(sim: &SimDriver) -> bool {
    cuda_stream_pool::release_pinned_cache(sim).unwrap();
    true
}

const HANG: Duration = Duration::from_secs(60);

/// Waits until the simulated context is released (the teardown's last step).
fn until_released(sim: &SimDriver) {
    let t = Instant::now();
    while release(sim) && sim.counters().live_contexts != 0 {
        assert!(
            t.elapsed() < HANG,
            "deadlock: the context was never torn down"
        );
        std::thread::yield_now();
    }
}

/// Runs the scenario: a completion's waker, run by the poller, drops the last context while a
/// second completion (its future dropped) that landed with it is still in the poller's list.
/// `hold` keeps the stream busy (so that both are pending when polled), `release` lets its work
/// complete.
fn last_context_dropped_by_a_poller_waker(
    d: Arc<dyn Driver>,
    hold: impl FnOnce(&StreamRef<'_>),
    release: impl FnOnce(),
) {
    let ctx = Context::primary(d, 0).unwrap();
    let (tx, rx) = mpsc::channel();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    hold(&s);
    let mut first = Box::pin(s.completed().unwrap());
    let second = s.completed().unwrap();
    let w = common::DropsContext::waker(ctx, tx);
    assert!(poll(first.as_mut(), &w).is_pending(), "the stream is held");
    drop((w, first, second, s));
    drop(o);
    release();
    rx.recv_timeout(HANG)
        .expect("the poller never ran the waker");
}

// Regression: issue 19 defect 4 (teardown on the completion poller's thread: slabs leaked, flags read after release)
#[test]
fn last_context_dropped_by_a_poller_waker_is_torn_down_completely() {
    let sim = Arc::new(SimDriver::new());
    let (s1, s2) = (sim.clone(), sim.clone());
    last_context_dropped_by_a_poller_waker(
        sim.clone(),
        move |s| s1.enqueue_work(s.raw(), 1_000).unwrap(),
        move || s2.advance(1_000),
    );
    until_released(&sim);
    let c = sim.counters();
    assert_eq!(
        c.live_host_allocs, 0,
        "the completion slabs were leaked by the teardown on the poller's thread: {c:?}"
    );
    assert_eq!(c.live_streams, 0, "{c:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// The same on the H200: the old code released the primary context (freeing the slabs' pinned
/// memory) on the poller's thread, which then read the second completion's flag: SIGSEGV.
// Regression: issue 19 defect 4 (teardown on the completion poller's thread: SIGSEGV on the H200)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_last_context_dropped_by_a_poller_waker_does_not_crash() {
    for _ in 0..20 {
        let (gate_tx, gate_rx) = mpsc::channel::<()>();
        last_context_dropped_by_a_poller_waker(
            common::cuda(),
            move |s| {
                // Holds the stream until released (a host function may block; it calls no
                // driver function).
                s.launch_host_func(move || {
                    let _ = gate_rx.recv_timeout(HANG);
                })
                .unwrap()
            },
            move || gate_tx.send(()).unwrap(),
        );
    }
}

/// A waker that waits until another thread has dropped the last `Context` (a hang guard of
/// [`HANG`] instead of forever), and records whether it saw that.
struct WaitsForDrop {
    started: Mutex<mpsc::Sender<()>>,
    dropped: Mutex<mpsc::Receiver<()>>,
    saw: AtomicBool,
}
impl Wake for WaitsForDrop {
    fn wake(self: Arc<Self>) {
        let _ = self.started.lock().unwrap().send(());
        let ok = self.dropped.lock().unwrap().recv_timeout(HANG).is_ok();
        self.saw.store(ok, Ordering::SeqCst);
    }
}

// Regression: issue 19 defect 7 (dropping the last Context joins the poller running a waker that waits for the dropping thread)
#[test]
fn dropping_the_last_context_does_not_wait_for_a_poller_waker_that_waits_for_it() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (started_tx, started_rx) = mpsc::channel();
    let (dropped_tx, dropped_rx) = mpsc::channel();
    let waker = Arc::new(WaitsForDrop {
        started: Mutex::new(started_tx),
        dropped: Mutex::new(dropped_rx),
        saw: AtomicBool::new(false),
    });
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let mut done = Box::pin(s.completed().unwrap());
        assert!(poll(done.as_mut(), &Waker::from(waker.clone())).is_pending());
    }
    sim.advance(1_000); // the completion lands: the poller runs the waker, which waits
    started_rx
        .recv_timeout(HANG)
        .expect("the poller never ran the waker");
    let dropper = std::thread::spawn(move || {
        drop(ctx); // the last reference: the teardown
        let _ = dropped_tx.send(());
    });
    dropper.join().unwrap();
    until_released(&sim);
    assert!(
        waker.saw.load(Ordering::SeqCst),
        "deadlock: the teardown waited for the poller, whose waker waited for the teardown"
    );
    let c = sim.counters();
    assert_eq!(c.live_host_allocs, 0, "{c:?}");
    assert_eq!(c.live_streams, 0, "{c:?}");
}

// A failure at a teardown's call leaked what the call was to free (its result was `let _`: the
// proptest model found a stream and a module left after a fault it had injected landed in a
// teardown). A failed call has no effect, so the teardown tries it again.
#[test]
fn one_failure_at_any_teardown_call_leaks_nothing() {
    use cuda_stream_pool::{kernels::Kernels, DeviceBuffer, ErrorCode};
    for call in [
        "cuStreamSynchronize",
        "cuStreamDestroy_v2",
        "cuModuleUnload",
        "cuEventDestroy_v2",
        "cuMemPoolDestroy",
        "cuDevicePrimaryCtxRelease_v2",
    ] {
        let sim = Arc::new(SimDriver::new());
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let k = Kernels::load(&ctx).unwrap();
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        let b = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
        k.add_one(&s, &b).unwrap();
        // A buffer used on a second owner's stream: the crate orders the two with an event.
        let other = ctx.owner();
        let t = other.stream().unwrap();
        k.add_one(&t, &b).unwrap();
        drop(b);
        drop((s, t));
        drop((owner, other));
        drop(k);
        sim.fail_calls(call, ErrorCode::ERROR_UNKNOWN, 1);
        drop(ctx);
        assert_eq!(
            sim.injected_failures(),
            vec![call],
            "the teardown made {call} (and it failed once)"
        );
        sim.clear_faults();
        release_pinned_cache(&*sim).unwrap();
        let c = sim.counters();
        assert_eq!(
            (
                c.live_streams,
                c.live_modules,
                c.live_events,
                c.live_allocs,
                c.live_contexts,
                c.live_host_allocs
            ),
            (0, 0, 0, 0, 0, 0),
            "{call} failed once at the teardown: {c:?}"
        );
        assert!(sim.misuse().is_empty(), "{call}: {:?}", sim.misuse());
    }
}

/// Marks the child process of the test below, which runs its scenario.
const LAST_CONTEXT_CHILD: &str = "CSP_LAST_CONTEXT_IN_IMPLICIT_OWNER_CHILD";
/// The child's waits for its thread (a hang guard).
const CHILD_TIMEOUT: Duration = Duration::from_secs(5);

// Pins soundness review (issue 12) defect 13: a thread exiting with the last `Context` in its implicit owner aborted
#[test]
fn a_thread_exiting_with_the_last_context_in_its_implicit_owner_does_not_abort() {
    if std::env::var_os(LAST_CONTEXT_CHILD).is_some() {
        // The scenario, in a child process: a thread whose implicit owner holds the last Context.
        // The thread's first use of the crate is `ctx.stream()` (the context is made here), so
        // its implicit owner is set up before the driver's own thread state, and torn down after.
        let sim: Arc<dyn Driver> = Arc::new(SimDriver::new());
        let ctx = Context::primary(sim, 0).unwrap();
        let (dropped_tx, dropped_rx) = std::sync::mpsc::channel::<()>();
        let (got_tx, got_rx) = std::sync::mpsc::channel::<()>();
        let c2 = ctx.clone();
        let t = std::thread::spawn(move || {
            c2.stream().unwrap();
            drop(c2); // the implicit owner keeps the context alive
            got_tx.send(()).unwrap();
            let _ = dropped_rx.recv_timeout(CHILD_TIMEOUT);
        });
        got_rx.recv_timeout(CHILD_TIMEOUT).unwrap();
        drop(ctx); // now the thread's implicit owner holds the last Context
        dropped_tx.send(()).unwrap();
        t.join().expect("the thread exited with a panic");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_thread_exiting_with_the_last_context_in_its_implicit_owner_does_not_abort",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(LAST_CONTEXT_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(3)
        .collect::<Vec<_>>()
        .join(" | ");
    assert!(
        out.status.success(),
        "a thread exiting with the last Context in its implicit owner killed the process \
         ({}): {last}",
        out.status
    );
}

/// Regression (found by the review of the completion doorbell's fault sweep; older than the
/// doorbell): the teardown's drain synchronized a retired stream, then queried it; a query that
/// failed once was read as "busy", `destroy_idle` returned `Ok(false)`, which was not tried
/// again, and the idle stream was leaked. A failed query there is now an error, tried again.
#[test]
fn a_teardown_query_failing_once_leaks_no_stream() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
    }
    sim.fail_calls(
        "cuStreamQuery",
        cuda_stream_pool::ErrorCode::ERROR_UNKNOWN,
        1,
    );
    drop(ctx);
    while cuda_stream_pool::release_pinned_cache(&*sim).is_ok() && sim.counters().live_contexts > 0
    {
    }
    assert_eq!(sim.injected_failures(), ["cuStreamQuery"]);
    let c = sim.counters();
    assert_eq!(c.live_streams, 0, "{c:?}");
}
