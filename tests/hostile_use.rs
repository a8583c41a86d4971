//! The safety contract (crate docs) attacked from safe code as a hostile user would, on the
//! simulated driver: the last context dropped by thread-local destructors and background
//! threads, user code that re-enters an owner during its own acquisition, loans ending with a
//! failing driver, teardown switches that fail; and, for what held, one failure at every call of
//! a composite scenario, re-entrant poller wakers, every guard and future forgotten, drops inside
//! host functions, foreign global captures, loans with borrower captures, racing threads. The
//! first tests pin the defects an adversarial review found (each says which, "R5-n": all failed
//! on d0d8a33 and pass now); the rest document what was tried and held.
//!
//! A deadlock is detected with a hang guard only ([`HANG`], generous): a scenario runs on a
//! thread of its own and fails when it has not finished by then. No verdict depends on timing
//! otherwise.

mod common;

#[path = "common/futures.rs"]
mod futures_util;

use cuda_stream_pool::driver::{stream_flags, CaptureMode, Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{
    release_pinned_cache, Context, ContextOptions, DeviceBuffer, ErrorCode, OwnedStream, Priority,
};
use futures_util::{poll, waker, Noop};
use std::any::Any;
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Wake, Waker};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

const HANG: Duration = Duration::from_secs(60);

/// Runs `f` on a thread of its own; fails ("deadlock") when it has not finished after [`HANG`].
fn finishes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(HANG) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("deadlock: {what} did not finish within {HANG:?}"),
    }
}

fn panic_text(p: Box<dyn Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

/// Frees the page-locked memory kept for later states (and the primary retains kept with it),
/// until nothing of the simulation is left or a bound passes; returns the counters. (A teardown
/// handed to a thread of its own completes shortly after the drop; the bound only limits how
/// long a leak takes to report.)
fn settle(sim: &SimDriver) -> cuda_stream_pool::driver::sim::SimCounters {
    let t = Instant::now();
    loop {
        let _ = release_pinned_cache(sim);
        let c = sim.counters();
        let clean = c.live_streams == 0
            && c.live_contexts == 0
            && c.live_allocs == 0
            && c.live_host_allocs == 0
            && c.live_events == 0
            && c.live_modules == 0
            && c.live_graphs == 0
            && c.live_graph_execs == 0;
        // A teardown handed to a thread of its own completes shortly after the drop; leaked
        // state never does: give it a moment (a bound, not a verdict: a leak fails either way).
        if clean || t.elapsed() > Duration::from_secs(15) {
            return c;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn assert_nothing_left(sim: &SimDriver, what: &str) {
    let c = settle(sim);
    assert!(
        c.live_streams == 0
            && c.live_contexts == 0
            && c.live_allocs == 0
            && c.live_host_allocs == 0
            && c.live_events == 0
            && c.live_modules == 0
            && c.live_graphs == 0
            && c.live_graph_execs == 0,
        "{what}: left after everything was dropped: {c:?}"
    );
}

fn assert_clean(sim: &SimDriver) {
    assert!(sim.misuse().is_empty(), "misuse: {:?}", sim.misuse());
    assert!(
        sim.unrelaxed_calls().is_empty(),
        "unrelaxed: {:?}",
        sim.unrelaxed_calls()
    );
}

/// A handle lent to "another crate" with no behaviour of its own.
struct Foreign;

// =================================================================================================
// DEFECTS (these tests failed on d0d8a33; fixed since)
// =================================================================================================

// DEFECT R5-1 (severity: medium, a leak of a whole context: its streams, memory pool, events,
// modules and the primary context's retain).
//
// The last `Context` dropped by a thread-local destructor that runs after the device rules'
// own thread-local (`FRAMES`, src/driver/rules.rs) is gone: `Scope::relax_now` fails for want of
// thread-local state ("no thread-local state for a scope"), and `CtxInner::teardown`
// (src/context.rs, `if (0..3).all(|_| scope.relax_now().is_err()) { return; }`) then leaks the
// whole state, although every driver call would still work (`call_unscoped`). Thread-local
// destructors run in reverse order of registration; the implicit owner's (`IMPLICIT`,
// owner.rs) is registered before `FRAMES` when a thread's first use of the crate is
// `Context::stream()`, so it runs after `FRAMES` is gone. Defect 13's test only checks that the
// process survives this scenario, not what is left.
//
// Minimal reproduction: a thread whose first crate call is `c2.stream()`, which then drops
// `c2`; the main thread drops its clone; the thread exits. Nothing is released.
#[test]
fn thread_exit_with_the_last_context_in_its_implicit_owner_tears_it_down() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let c2 = ctx.clone();
    let (got_tx, got_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        c2.stream().unwrap(); // the thread's first use of the crate
        drop(c2); // the implicit owner keeps the context alive
        got_tx.send(()).unwrap();
        go_rx.recv().unwrap();
    });
    got_rx.recv().unwrap();
    drop(ctx); // the thread's implicit owner now holds the last Context
    go_tx.send(()).unwrap();
    t.join().unwrap(); // its thread-local destructors (and the teardown) have run
    assert_clean(&sim);
    assert_nothing_left(
        &sim,
        "the last Context, dropped by the implicit owner at thread exit",
    );
}

// DEFECT R5-1b (same cause, severity medium): the last `Context` kept in a thread-local of the
// user's, set before the thread's first crate call (an ordinary per-thread cache of a context):
// its destructor runs after `FRAMES`'s, and the teardown leaks everything.
#[test]
fn the_last_context_in_a_users_thread_local_is_torn_down_at_thread_exit() {
    thread_local! {
        static KEEP: RefCell<Option<Context>> = const { RefCell::new(None) };
    }
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let c2 = ctx.clone();
    drop(ctx);
    std::thread::spawn(move || {
        KEEP.with(|k| *k.borrow_mut() = Some(c2.clone()));
        // Any use of the crate now (the device rules' thread-local is registered after KEEP).
        let o = c2.owner();
        o.stream().unwrap().synchronize().unwrap();
        drop(o);
        drop(c2); // KEEP holds the last Context
    })
    .join()
    .unwrap();
    assert_clean(&sim);
    assert_nothing_left(
        &sim,
        "the last Context, dropped by a user's thread-local at exit",
    );
}

/// A lent handle whose drop (user code: another crate's stream handle) uses the crate on the
/// thread that drops it: `Context::stream()`, the thread's implicit owner.
struct ReentrantHandle {
    ctx: Mutex<Option<Context>>,
    on: ThreadId,
    seen: Arc<Mutex<Option<Result<bool, String>>>>,
}
impl Drop for ReentrantHandle {
    fn drop(&mut self) {
        if std::thread::current().id() != self.on {
            return;
        }
        let Some(ctx) = self.ctx.lock().unwrap().take() else {
            return;
        };
        let r = catch_unwind(AssertUnwindSafe(|| ctx.stream().map(|s| s.raw()).is_ok()));
        *self.seen.lock().unwrap() = Some(r.map_err(panic_text));
    }
}

// DEFECT R5-2 (severity: medium; a panic across the API from user code the crate runs under its
// own exclusive borrow).
//
// `Owner::stream` (and `Owner::select`, i.e. `set_priority`) hold `Owner::inner.borrow_mut()`
// (src/owner.rs, `stream()`: `let mut inner = self.inner.borrow_mut(); ... held_or_acquire`)
// across `CtxInner::acquire`, which flushes (`flush_deferred` when the key has parked loans; the
// waiter's `reclaim`), and a flush runs user code: the drop of a returned loan's last handle
// (`Slot::loan_returned`), wakers of the key's waiters (`Pool::release` -> `hand_to_waiter` /
// `Gate::notify`), and lingering teardowns (`reap_lingering`: wakers, keep-alives). User code
// that uses the thread's implicit (or attached) owner there, `Context::stream()`, re-borrows the
// same `RefCell`: "already mutably borrowed" panics. Here the panic comes out of the user's
// `ctx.stream()` inside the handle's drop; uncaught it unwinds through `CtxInner::flush` (which
// had taken the deferred frees, orphans and parked loans out of their lists: they are lost) and
// out of the outer `ctx.stream()`.
//
// Minimal reproduction: lend an owner's stream, drop the owner (parked lent), drop the user's
// clone of the handle; then `ctx.stream()` on a thread whose implicit owner has no stream yet:
// its acquisition reclaims the loan and drops the handle, whose `Drop` calls `ctx.stream()`.
#[test]
fn a_loan_handle_dropped_inside_an_acquisition_can_use_the_thread_owner() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (inner, outer) = finishes("the acquisition", move || {
        let seen = Arc::new(Mutex::new(None));
        let a = ctx.owner();
        let s = a.stream().unwrap();
        let h = s
            .lend(|_raw| {
                Ok(Arc::new(ReentrantHandle {
                    ctx: Mutex::new(Some(ctx.clone())),
                    on: std::thread::current().id(),
                    seen: seen.clone(),
                }))
            })
            .unwrap();
        drop(s);
        drop(a); // the stream is parked, lent
        drop(h); // the loan ended; the crate notices at its next flush
        let outer = catch_unwind(AssertUnwindSafe(|| ctx.stream().map(|s| s.raw()).is_ok()))
            .map_err(panic_text);
        let inner = seen.lock().unwrap().clone();
        (inner, outer)
    });
    assert_eq!(
        inner,
        Some(Ok(true)),
        "Context::stream() in a lent handle's drop, run by the crate inside an acquisition"
    );
    assert_eq!(outer, Ok(true), "the outer Context::stream()");
    assert_clean(&sim);
}

/// A waker that, woken on thread `on`, uses the thread's implicit owner (as an executor that
/// polls inline a task that calls `Context::stream()` would), once.
struct ReentrantWaker {
    ctx: Mutex<Option<Context>>,
    on: ThreadId,
    seen: Mutex<Option<Result<bool, String>>>,
}
impl Wake for ReentrantWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if std::thread::current().id() != self.on {
            return;
        }
        let Some(ctx) = self.ctx.lock().unwrap().take() else {
            return;
        };
        let r = catch_unwind(AssertUnwindSafe(|| ctx.stream().map(|s| s.raw()).is_ok()));
        *self.seen.lock().unwrap() = Some(r.map_err(panic_text));
    }
}

// DEFECT R5-2b (same cause, severity medium): a waker woken inside an acquisition. The key has a
// waiter at its cap; the thread's implicit owner (holding a High stream) selects Normal, whose
// acquisition reclaims a returned loan and hands that stream to the waiter, waking it on this
// thread while `Owner::select` holds the implicit owner's `RefCell`. The waker's
// `Context::stream()` panics ("already mutably borrowed"); the crate's `wake_task` swallows the
// panic, so the task's inline poll is lost silently.
#[test]
fn a_waker_woken_inside_an_acquisition_can_use_the_thread_owner() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let seen = finishes("the priority switch", move || {
        ctx.set_priority(Priority::High).unwrap();
        ctx.stream().unwrap(); // the thread's owner holds a High stream
        let a = ctx.owner();
        let s = a.stream().unwrap(); // the only Normal stream
        let h = s.lend(|_| Ok(Arc::new(Foreign))).unwrap();
        drop(s);
        drop(a); // parked, lent: still counted against the cap
        let rw = Arc::new(ReentrantWaker {
            ctx: Mutex::new(Some(ctx.clone())),
            on: std::thread::current().id(),
            seen: Mutex::new(None),
        });
        let w = Waker::from(rw.clone());
        let mut fut = Box::pin(ctx.owner().ready());
        assert!(poll(fut.as_mut(), &w).is_pending(), "at the cap: waits");
        drop(h); // the loan ends
                 // Bypass (holds High): never waits; its acquisition reclaims the loan first.
        ctx.set_priority(Priority::Normal).unwrap();
        let seen = rw.seen.lock().unwrap().clone();
        drop(fut);
        seen
    });
    assert_eq!(
        seen,
        Some(Ok(true)),
        "Context::stream() in a waker woken inside Owner::select's acquisition"
    );
    assert_clean(&sim);
}

// DEFECT R5-3 (severity: low/medium; a stream leaked for ever, and with it, at the teardown,
// every module of the context (`drained` is false), after ONE transient driver failure).
//
// `CtxInner::end_loan` (src/context.rs) classifies a lent stream whose loan ended as `Stuck`
// ("left capturing by the other crate: never used again") on ANY result of
// `cuStreamIsCapturing` but `Ok(None)`, a failed query included: `_ => LoanEnd::Stuck`. A single
// transient failure of that query (fault injection, as the contract requires the crate to
// survive) therefore leaks the stream: it is forgotten (`Pool::forget_lent`), never destroyed,
// not even by the teardown. A failed query should keep the stream parked (`LoanEnd::Out`) and
// ask again at the next flush, as `capturing()` does elsewhere (a failed query counts as
// capturing, and the caller retries).
//
// Minimal reproduction: lend, drop the owner, drop the handle, fail the next
// `cuStreamGetCaptureInfo_v3`, `ctx.trim()`, drop the context.
#[test]
fn one_failed_capture_query_at_a_loans_end_leaks_nothing() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let a = ctx.owner();
    let s = a.stream().unwrap();
    let h = s.lend(|_| Ok(Arc::new(Foreign))).unwrap();
    drop(s);
    drop(a);
    drop(h);
    sim.fail_calls("cuStreamGetCaptureInfo_v3", ErrorCode::ERROR_UNKNOWN, 1);
    ctx.trim().unwrap(); // reclaims the loan; its capture query fails once
    let _ = ctx.trim();
    drop(ctx);
    assert_clean(&sim);
    assert_nothing_left(&sim, "a loan whose end met one failed capture query");
}

/// A completion waker that, run by the poller, calls `Context::stream()` (an executor that polls
/// a task inline from its waker, the task using the thread's implicit owner), then drops its
/// clone of the context.
struct UsesThreadOwner {
    ctx: Mutex<Option<Context>>,
    done: Mutex<Option<mpsc::Sender<bool>>>,
}
impl Wake for UsesThreadOwner {
    fn wake(self: Arc<Self>) {
        let Some(ctx) = self.ctx.lock().unwrap().take() else {
            return;
        };
        let ok = ctx.stream().is_ok();
        drop(ctx);
        if let Some(tx) = self.done.lock().unwrap().take() {
            let _ = tx.send(ok);
        }
    }
}

// DEFECT R5-4 (severity: medium; the whole context leaked for the life of the process, and one
// pooled stream held for ever: with a cap, the key has one stream fewer from then on).
//
// Defect 11 of issue 19 refused the thread's implicit owner in host functions, because that
// thread never exits and an owner made there keeps the context for ever. The crate's own
// background threads have the same property and are not covered: the completion poller
// ("cuda-stream-pool-completions", which exits only at the teardown of its context, which its
// implicit owner then prevents), the waker thread ("cuda-stream-pool-wake") and the loans thread
// ("cuda-stream-pool-loans"), which never exit. A waker run there that calls `Context::stream()`
// (an inline-polling executor whose task is not attached) makes an implicit owner in that
// thread's `IMPLICIT` (src/owner.rs, `thread_owner`), holding a Context clone and a stream
// until the thread exits: never. `thread_owner` refuses only `on_host_fn_thread()`.
//
// Minimal reproduction: a completion whose waker calls `ctx.stream()` and holds the last clone;
// the work lands; the poller runs the waker. The context is never torn down.
#[test]
fn a_waker_on_the_poller_thread_gets_no_thread_owner_and_keeps_nothing_alive() {
    let sim = Arc::new(SimDriver::new());
    {
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let (tx, rx) = mpsc::channel();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let mut c = Box::pin(s.completed().unwrap());
        let w = Waker::from(Arc::new(UsesThreadOwner {
            ctx: Mutex::new(Some(ctx.clone())),
            done: Mutex::new(Some(tx)),
        }));
        assert!(poll(c.as_mut(), &w).is_pending());
        drop((w, c, s));
        drop(o);
        drop(ctx); // the waker, left with the poller, holds the last clone
        sim.advance(1_000);
        let ok = rx
            .recv_timeout(HANG)
            .expect("the poller never ran the waker");
        // Either refused (as in a host function) or served: both are fine, if nothing leaks.
        let _ = ok;
    }
    assert_clean(&sim);
    assert_nothing_left(
        &sim,
        "a thread owner made by a waker on the completion poller",
    );
}

// DEFECT R5-5 (severity: low; a whole context leaked after a transient failure).
//
// `CtxInner::teardown` (src/context.rs) starts with `if (0..3).all(|_|
// scope.relax_now().is_err()) { return; }`: three failed switches to relaxed mode (three
// injected failures of `cuThreadExchangeStreamCaptureMode` in a row) leak the whole state,
// with no later retry (unlike every other failure of a teardown, kept and retried). The bail is
// not needed for safety: every call of the teardown goes through the device rules, whose
// `prepare` switches to relaxed mode per call and refuses the call when that fails, so nothing
// would run unrelaxed; the teardown could proceed (each refused call tried again by `tries`), or
// the state be kept (as lingering states are) for a later attempt.
//
// Minimal reproduction: fail the next three `cuThreadExchangeStreamCaptureMode`, drop the
// context.
#[test]
fn three_failed_mode_switches_at_teardown_leave_the_state_for_a_later_teardown() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let _ = DeviceBuffer::<u32>::zeroed(&s, 8).unwrap();
    }
    sim.fail_calls(
        "cuThreadExchangeStreamCaptureMode",
        ErrorCode::ERROR_UNKNOWN,
        3,
    );
    drop(ctx);
    // A later use of the crate on this driver (a new state of the context) changes nothing.
    drop(Context::primary(sim.clone(), 0).unwrap());
    assert_clean(&sim);
    assert_nothing_left(&sim, "a teardown that met three failed mode switches");
}

// =================================================================================================
// ATTACKS THAT HELD (they document what was tried)
// =================================================================================================

/// The composite scenario of the fault sweep: every kind of operation, errors ignored (a
/// fault may land anywhere).
fn composite(sim: &Arc<SimDriver>) {
    let opts = ContextOptions::default().max_live_streams_per_key(Some(2));
    let Ok(ctx) = Context::primary_with(sim.clone(), 0, opts) else {
        return;
    };
    let run = || -> cuda_stream_pool::Result<()> {
        let (a, b) = (ctx.owner(), ctx.owner());
        let (sa, sb) = (a.stream()?, b.stream()?);
        let mut x = DeviceBuffer::<u32>::zeroed(&sa, 64)?;
        let y = DeviceBuffer::<u32>::from_slice(&sb, &[1; 64])?;
        sim.enqueue_work(sa.raw(), 5_000)?;
        x.fill(&sb, 3)?; // a use on another stream: ordered
        let k = Kernels::load(&ctx)?;
        k.add_u32(&sa, &x, 1)?;
        let exec = {
            let g = sa.begin_capture()?;
            x.fill(&sa, 5)?;
            g.end()?.instantiate()?
        };
        exec.launch(&sb)?;
        let copy = y.to_vec_async(&sa)?;
        let done = sb.completed()?;
        let h = sa.lend(|_| Ok(Arc::new(Foreign)))?;
        let os = OwnedStream::new(&ctx, Priority::High)?;
        x.fill(&os.stream(), 9)?;
        a.set_priority(Priority::High)?;
        let _ = a.stream()?;
        let v = y.to_vec(&os.stream())?;
        assert_eq!(v, vec![1; 64]);
        drop((copy, done)); // pending: left with the poller
        drop(os);
        drop(exec);
        drop(x);
        drop(k);
        drop(sa);
        drop(a); // parked lent
        drop(h);
        drop(sb);
        drop(b);
        drop(y);
        ctx.trim()?;
        let _ = ctx.stats();
        Ok(())
    };
    let _ = run();
    drop(ctx);
}

// HELD: one injected failure (ERROR_UNKNOWN) at every driver call of a composite scenario (allocation, copies, kernels, capture, graph launch, async copy,
// completion, a loan, an owned stream, a priority switch, trim): no panic, no misuse, no call of
// the invalidation table outside relaxed mode, and nothing left after everything is dropped.
// EXCEPT at the call where R5-3 bites (the capture query at the loan's end): reported on stderr
// and excluded here, so that this test documents the rest (there it leaks the lent stream and,
// since the pools are then not drained, the kernels' module too).
#[test]
fn held_one_failure_at_every_call_of_a_composite_scenario() {
    let clean = Arc::new(SimDriver::new());
    let before = clean.call_count();
    composite(&clean);
    let total = clean.call_count() - before;
    assert_clean(&clean);
    assert_nothing_left(&clean, "the fault-free run");
    let mut leaks = Vec::new();
    for n in 1..=total + 5 {
        let sim = Arc::new(SimDriver::new());
        sim.fail_nth_call(n, ErrorCode::ERROR_UNKNOWN);
        let s2 = sim.clone();
        let r = catch_unwind(AssertUnwindSafe(|| composite(&s2)));
        assert!(
            r.is_ok(),
            "a panic with a failure at call {n}: {}",
            panic_text(r.unwrap_err())
        );
        assert!(
            sim.misuse().is_empty(),
            "call {n}: misuse {:?}",
            sim.misuse()
        );
        assert!(
            sim.unrelaxed_calls().is_empty(),
            "call {n}: {:?}",
            sim.unrelaxed_calls()
        );
        let c = settle(&sim);
        if c.live_streams
            + c.live_contexts
            + c.live_allocs
            + c.live_host_allocs
            + c.live_events
            + c.live_modules
            + c.live_graphs
            + c.live_graph_execs
            != 0
        {
            let failed = sim
                .calls()
                .iter()
                .find(|c| !c.ok)
                .map(|c| c.name)
                .unwrap_or("?");
            leaks.push(format!("call {n} ({failed}): {c:?}"));
        }
    }
    // Only R5-3's call may leak (the capture query at the loan's end).
    let other: Vec<_> = leaks
        .iter()
        .filter(|l| !l.contains("cuStreamGetCaptureInfo_v3"))
        .collect();
    assert!(other.is_empty(), "leaks after one failure: {other:#?}");
    eprintln!("leaks after one failed capture query (R5-3): {leaks:#?}");
}

/// A completion waker, run by the poller, that re-enters the crate in every way at once.
struct Busy {
    ctx: Mutex<Option<Context>>,
    owner: Mutex<Option<cuda_stream_pool::Owner>>,
    buf: Mutex<Option<DeviceBuffer<u32>>>,
    other: Mutex<Option<std::pin::Pin<Box<cuda_stream_pool::Completion>>>>,
    done: Mutex<Option<mpsc::Sender<String>>>,
}
impl Wake for Busy {
    fn wake(self: Arc<Self>) {
        let Some(ctx) = self.ctx.lock().unwrap().take() else {
            return;
        };
        let mut log = String::new();
        // Poll another future of the same hub inline.
        if let Some(mut f) = self.other.lock().unwrap().take() {
            let _ = poll(f.as_mut(), &Waker::from(Arc::new(Noop)));
        }
        // Drop an owner and a buffer of the context, trim, read stats, use the crate.
        drop(self.buf.lock().unwrap().take());
        drop(self.owner.lock().unwrap().take());
        log += &format!("trim {:?}; ", ctx.trim().map(|_| ()));
        let _ = ctx.stats();
        let o = ctx.owner();
        match o.stream() {
            Ok(s) => {
                let c = s.completed();
                log += &format!("completed {:?}; ", c.is_ok());
                let b = DeviceBuffer::<u32>::zeroed(&s, 4);
                log += &format!("alloc {:?}; ", b.is_ok());
            }
            Err(e) => log += &format!("stream {e}; "),
        }
        drop(o);
        // And drop the last Context, here on the poller's thread.
        drop(ctx);
        if let Some(tx) = self.done.lock().unwrap().take() {
            let _ = tx.send(log);
        }
    }
}

// HELD: a completion waker run by the poller that polls another completion of the same hub
// inline, drops an owner and a buffer, trims, reads stats, makes a new completion and a new
// buffer, and drops the last Context (teardown handed off the poller's thread): no deadlock, no
// misuse, nothing left.
#[test]
fn held_a_poller_waker_that_re_enters_the_crate_every_way_and_drops_the_last_context() {
    let sim = Arc::new(SimDriver::new());
    let s2 = sim.clone();
    finishes("the poller waker", move || {
        let sim = s2;
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let (tx, rx) = mpsc::channel();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let mut first = Box::pin(s.completed().unwrap());
        let other = Box::pin(s.completed().unwrap());
        drop(s);
        let busy = Arc::new(Busy {
            ctx: Mutex::new(Some(ctx)),
            owner: Mutex::new(Some(o)),
            buf: Mutex::new(Some(buf)),
            other: Mutex::new(Some(other)),
            done: Mutex::new(Some(tx)),
        });
        let w = Waker::from(busy);
        assert!(poll(first.as_mut(), &w).is_pending());
        drop(w);
        drop(first);
        sim.advance(1_000);
        let log = rx
            .recv_timeout(HANG)
            .expect("the poller never ran the waker");
        assert!(!log.contains("Err"), "{log}");
    });
    assert_clean(&sim);
    assert_nothing_left(&sim, "after a re-entrant poller waker");
}

/// A waker that drops the last clone of another context when woken.
struct DropsOther(Mutex<Option<Context>>);
impl Wake for DropsOther {
    fn wake(self: Arc<Self>) {
        drop(self.0.lock().unwrap().take());
    }
}

// HELD: nested teardowns. A dropped completion of context A (its entry pending with the poller)
// has a waker that holds the last clone of context B (same driver, same primary context, an isolated state). A is
// dropped: its teardown stops the poller (which hands back the pending entry), drains the
// streams (the write lands), and finishes the entry in `Hub::shutdown` on the dropping thread:
// the waker drops B there, whose teardown runs inside A's. No deadlock, nothing left.
#[test]
fn held_a_teardown_that_runs_a_waker_dropping_another_last_context() {
    let sim = Arc::new(SimDriver::new());
    let s2 = sim.clone();
    finishes("the nested teardowns", move || {
        let sim = s2;
        let a = Context::primary(sim.clone(), 0).unwrap();
        // A state of its own (a shared one would be `a`, which the waker would then keep).
        let isolated = ContextOptions::default().isolated(true);
        let b = Context::primary_with(sim.clone(), 0, isolated).unwrap();
        {
            let o = b.owner();
            let s = o.stream().unwrap();
            let _ = DeviceBuffer::<u32>::zeroed(&s, 8).unwrap();
            let _c = s.completed().unwrap();
        }
        let o = a.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 10_000_000).unwrap(); // the manual clock stands still
        let mut c = Box::pin(s.completed().unwrap());
        let w = Waker::from(Arc::new(DropsOther(Mutex::new(Some(b)))));
        assert!(poll(c.as_mut(), &w).is_pending());
        drop((w, c, s));
        drop(o);
        drop(a);
    });
    assert_clean(&sim);
    assert_nothing_left(&sim, "nested teardowns");
}

// HELD: every guard and future of the crate leaked (`mem::forget`) in the middle of work on
// several streams: no misuse (no use after free, no race, no destroyed handle used, no
// invalidated capture); the buffers whose uses were leaked are freed ordered.
#[test]
fn held_forgetting_every_guard_and_future_frees_nothing_early() {
    let sim = Arc::new(SimDriver::new());
    {
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let (a, b, c) = (ctx.owner(), ctx.owner(), ctx.owner());
        let (sa, sb, sc) = (
            a.stream().unwrap(),
            b.stream().unwrap(),
            c.stream().unwrap(),
        );
        let x = DeviceBuffer::<u32>::zeroed(&sa, 256).unwrap();
        let y = DeviceBuffer::<u32>::zeroed(&sb, 256).unwrap();
        // A leaked use, with work under it.
        let u = x.use_on(&sb).unwrap();
        sim.enqueue_access(sb.raw(), u.ptr(), u.bytes(), true, 100_000)
            .unwrap();
        std::mem::forget(u);
        // A leaked capture guard on c's stream, with y used in it.
        let mut y2 = DeviceBuffer::<u32>::zeroed(&sc, 16).unwrap();
        sc.synchronize().unwrap();
        let g = sc.begin_capture().unwrap();
        y2.fill(&sc, 1).unwrap();
        std::mem::forget(g);
        // Leaked futures.
        std::mem::forget(y.to_vec_async(&sa).unwrap());
        std::mem::forget(sb.completed().unwrap());
        std::mem::forget(ctx.owner().ready());
        // A leaked owned stream and attached future.
        std::mem::forget(OwnedStream::new(&ctx, Priority::Low).unwrap());
        std::mem::forget(ctx.owner().attach(async {}));
        drop(x);
        drop(y);
        drop(y2);
        drop((sa, sb, sc));
        drop((a, b, c));
        let o = ctx.owner();
        let s = o.stream().unwrap();
        // New allocations reuse freed memory; they must not meet the leaked use's write.
        let z = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
        s.synchronize().unwrap();
        drop(z);
        let _ = ctx.trim();
        drop(s);
        drop(o);
        drop(ctx);
    }
    sim.advance(1_000_000);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// HELD: drops at the wrong moment inside host functions: an owner, a buffer, an owned stream, a
// graph and the last Context moved into host functions and dropped there (the crate moves
// their driver work off the host-function thread). No driver call from a host function, no
// misuse, nothing left once the teardown has run.
#[test]
fn held_everything_dropped_inside_host_functions() {
    let sim = Arc::new(SimDriver::new());
    {
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let victim = ctx.owner();
        victim.stream().unwrap();
        let buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
        let os = OwnedStream::new(&ctx, Priority::Low).unwrap();
        let graph = {
            let g = os.stream().begin_capture().unwrap();
            g.end().unwrap()
        };
        let c2 = ctx.clone();
        s.launch_host_func(move || {
            drop(victim);
            drop(buf);
            drop(os);
            drop(graph);
            // Host functions cannot use the thread's owner; the refusal is no panic.
            assert!(c2.stream().is_err());
            drop(c2);
        })
        .unwrap();
        let last = ctx.clone();
        drop(ctx);
        s.synchronize().unwrap();
        drop(s);
        drop(o);
        // The last Context dropped inside a host function.
        let o2 = last.owner();
        let s2 = o2.stream().unwrap();
        sim.enqueue_work(s2.raw(), 1_000).unwrap();
        let keep = last.clone();
        drop(last);
        s2.launch_host_func(move || drop(keep)).unwrap();
        drop(s2);
        drop(o2);
        sim.advance(1_000);
    }
    assert_clean(&sim);
    assert_nothing_left(&sim, "drops inside host functions");
}

// HELD: the user's own capture modes and current context around every kind of crate call, while
// another thread captures globally: no call of the table outside relaxed mode, the foreign
// capture survives, the caller's mode and context are restored.
#[test]
fn held_foreign_global_capture_survives_crate_calls_in_global_mode() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let os = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    let cap = common::ForeignCapture::new(&d, ctx.raw(), os.stream().raw());
    // The test thread in global mode, no context current.
    sim.set_thread_state(cuda_stream_pool::driver::Context::NULL, CaptureMode::Global);
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::<u32>::from_slice(&s, &[1, 2, 3, 4]).unwrap();
        let _ = b.to_vec(&s).unwrap();
        let mut cf = Box::pin(b.to_vec_async(&s).unwrap());
        s.synchronize().unwrap();
        let _ = poll(cf.as_mut(), &Waker::from(Arc::new(Noop)));
        let k = Kernels::load(&ctx).unwrap();
        let mut b2 = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
        k.add_u32(&s, &b2, 1).unwrap();
        let g = s.begin_capture().unwrap();
        b2.fill(&s, 3).unwrap();
        let e = g.end().unwrap().instantiate().unwrap();
        e.launch(&s).unwrap();
        let _ = ctx.stats();
        let _ = ctx.trim();
        drop((e, k, b, b2, cf));
        let owned = OwnedStream::new(&ctx, Priority::High).unwrap();
        drop(owned);
    }
    assert_eq!(
        sim.thread_state(),
        (cuda_stream_pool::driver::Context::NULL, CaptureMode::Global)
    );
    assert!(
        cap.end().is_ok(),
        "the foreign global capture was invalidated"
    );
    drop(os);
    drop(ctx);
    assert_clean(&sim);
}

// HELD: a loan outstanding at teardown, with its borrower capturing the lent stream from another
// thread (raw driver, as cudarc would), then the capture ended and the handle dropped: the
// state lingers while the loan is out, then a later crate call (a new context) tears it down.
#[test]
fn held_teardown_with_a_loan_out_and_the_borrower_capturing() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let raw = s.raw();
    let h = s.lend(|_| Ok(Arc::new(Foreign))).unwrap();
    let cap = common::ForeignCapture::new(&d, ctx.raw(), raw);
    drop(s);
    drop(o);
    let ctx_raw = ctx.raw();
    drop(ctx); // lingers: the loan is out
    assert!(sim.counters().live_contexts > 0, "released under a loan");
    let g = cap.end().unwrap();
    // SAFETY: the borrower's graph, destroyed once.
    unsafe { d.graph_destroy(g) }.unwrap();
    let _ = ctx_raw;
    drop(h);
    let later = Context::primary(d.clone(), 0).unwrap(); // reaps the lingering state
    drop(later);
    assert_clean(&sim);
    assert_nothing_left(&sim, "a lingering state reaped");
}

// HELD: a waker that re-enters the gate while it is woken by `Gate::offer` from another thread's
// owner drop: it drops its own `OwnerReady` future (leaving the queue with a stream handed to
// it), which must pass the stream on to the next waiter. No deadlock, the next waiter served.
struct DropsOwnFuture(Mutex<Option<std::pin::Pin<Box<cuda_stream_pool::OwnerReady>>>>);
impl Wake for DropsOwnFuture {
    fn wake(self: Arc<Self>) {
        drop(self.0.lock().unwrap().take());
    }
}

#[test]
fn held_a_waker_that_drops_its_own_waiting_future_passes_the_stream_on() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let r = finishes("the gate", move || {
        let holder = ctx.owner();
        holder.stream().unwrap();
        let cell = Arc::new(DropsOwnFuture(Mutex::new(None)));
        let mut first = Box::pin(ctx.owner().ready());
        let w1 = Waker::from(cell.clone());
        assert!(poll(first.as_mut(), &w1).is_pending());
        *cell.0.lock().unwrap() = Some(first);
        drop(w1);
        let (count, w2) = waker();
        let mut second = Box::pin(ctx.owner().ready());
        assert!(poll(second.as_mut(), &w2).is_pending());
        drop(holder); // offered to the first, whose waker drops it: passed to the second
        let woken = count.0.load(Ordering::SeqCst);
        let got = poll(second.as_mut(), &w2).map(|r| r.map(|o| o.streams().len()).ok());
        (woken, got, ctx.stats())
    });
    assert!(r.0 >= 1, "the second waiter was not woken");
    assert_eq!(r.1, std::task::Poll::Ready(Some(1)), "stats {:?}", r.2);
    assert!(r.2.live <= 1, "{:?}", r.2);
}

// HELD: two threads racing acquisitions, releases, trims and stats on one key with a cap, while
// a third holds a capture of its own stream in global mode: the cap holds, no stream is shared,
// at most MAX_IDLE idle at the end, nothing invalidated.
#[test]
fn held_racing_threads_with_a_global_capture_and_trims() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(3));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let c0 = ctx.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let (began_tx, began_rx) = mpsc::channel();
    let st = stop.clone();
    let capturer = std::thread::spawn(move || {
        let o = c0.owner();
        o.set_priority(Priority::High).unwrap();
        let s = o.stream().unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
        s.synchronize().unwrap();
        let g = s.begin_capture_with(CaptureMode::Global).unwrap();
        began_tx.send(()).unwrap();
        while !st.load(Ordering::SeqCst) {
            b.fill(&s, 1).unwrap();
            std::thread::yield_now();
        }
        g.end().map(|_| ())
    });
    began_rx.recv().unwrap();
    let seen = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let max_in_use = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let (ctx, seen, max_in_use) = (ctx.clone(), seen.clone(), max_in_use.clone());
            std::thread::spawn(move || {
                for n in 0..300 {
                    let o = ctx.owner();
                    let s = o.stream().unwrap();
                    assert!(seen.lock().unwrap().insert(s.raw()), "a stream shared");
                    let b = DeviceBuffer::<u32>::zeroed(&s, 8).unwrap();
                    let _ = b.to_vec(&s).unwrap();
                    // The gate's peak, not `live`: a reading of `live` (created minus
                    // destroyed, read one after the other) made while another thread's trim
                    // destroys a stream and a new one is created counts both (CI-like load
                    // made it 4 once).
                    let st = ctx.stats_for(Priority::Normal).unwrap();
                    max_in_use.fetch_max(st.peak_live as usize, Ordering::SeqCst);
                    seen.lock().unwrap().remove(&s.raw());
                    drop(b);
                    drop(s);
                    drop(o);
                    if (n + i) % 37 == 0 {
                        let _ = ctx.trim();
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    assert!(
        capturer.join().unwrap().is_ok(),
        "the global capture was invalidated"
    );
    assert!(
        max_in_use.load(Ordering::SeqCst) <= 3,
        "the cap was exceeded"
    );
    let st = ctx.stats_for(Priority::Normal).unwrap();
    assert!(st.idle <= cuda_stream_pool::MAX_IDLE as u64, "{st:?}");
    drop(ctx);
    assert_clean(&sim);
    assert_nothing_left(&sim, "racing threads");
}

// HELD: a raw handle kept too long. A stream's raw handle kept after its owner is gone and the
// stream destroyed by `trim`: the crate itself never touches it again (the later owner gets a
// fresh stream; a buffer whose last use was on it frees on the disposal stream, not on the dead
// handle).
#[test]
fn held_a_buffer_last_used_on_a_trimmed_stream_frees_without_touching_it() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let buf = {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        DeviceBuffer::<u32>::zeroed(&s, 32).unwrap()
    };
    // The stream is retired and busy (manual clock): trim keeps it; synchronize-free route:
    sim.advance(1_000_000);
    assert_eq!(ctx.trim().unwrap(), 1);
    let (_, _, live) = buf.last_use().unwrap();
    assert!(!live, "the destroyed stream's generation is live");
    drop(buf);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    s.synchronize().unwrap();
    drop(s);
    drop(o);
    drop(ctx);
    assert_clean(&sim);
    assert_nothing_left(&sim, "a buffer on a trimmed stream");
}

// HELD: idle streams per key never exceed MAX_IDLE after releases, including releases of many
// busy streams that complete later and of owners holding two priorities, at the quiescent point
// after a stats reading.
#[test]
fn held_idle_streams_stay_under_max_idle_after_busy_releases() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let owners: Vec<_> = (0..80).map(|_| ctx.owner()).collect();
    for o in &owners {
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        drop(s);
        o.set_priority(Priority::High).unwrap();
        o.stream().unwrap();
    }
    drop(owners); // all busy: kept
    sim.advance(10_000);
    for p in [Priority::Normal, Priority::High] {
        let st = ctx.stats_for(p).unwrap();
        assert!(
            st.idle <= cuda_stream_pool::MAX_IDLE as u64,
            "{p:?}: {st:?}"
        );
        assert!(
            st.live <= cuda_stream_pool::MAX_IDLE as u64,
            "{p:?}: {st:?}"
        );
    }
    drop(ctx);
    assert_clean(&sim);
    assert_nothing_left(&sim, "idle cap");
}

// HELD: flags other than the common ones (a DEFAULT-flag owner) and a blocking acquisition at
// the cap released by an async waiter's future dropped from another thread.
#[test]
fn held_blocking_waiter_released_by_a_dropped_async_waiter() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let c2 = ctx.clone();
    finishes("the blocking waiter", move || {
        let ctx = c2;
        let holder = cuda_stream_pool::Owner::with_flags(&ctx, stream_flags::DEFAULT);
        holder.stream().unwrap();
        let mut fut =
            Box::pin(cuda_stream_pool::Owner::with_flags(&ctx, stream_flags::DEFAULT).ready());
        assert!(poll(fut.as_mut(), &Waker::from(Arc::new(Noop))).is_pending());
        let c3 = ctx.clone();
        let blocked = std::thread::spawn(move || {
            let o = cuda_stream_pool::Owner::with_flags(&c3, stream_flags::DEFAULT);
            o.stream().map(|s| s.raw())
        });
        // The async waiter leaves (dropped on another thread), then the holder goes.
        std::thread::spawn(move || drop(fut)).join().unwrap();
        drop(holder);
        assert!(blocked.join().unwrap().is_ok());
    });
    drop(ctx);
    assert_clean(&sim);
    assert_nothing_left(&sim, "blocking waiter");
}
