//! Dead contexts and re-entrant user code, attacked from safe code on the simulated driver:
//! owners that acquire without their state borrowed (user code run by the acquisition uses the
//! same owner), the crate's background threads, lingering and relocated teardowns, and dead
//! contexts (issue 23: the device rules' count of sticky errors, the confirming probe,
//! `Context::health`, `SimDriver::kill_context`).
//!
//! The first tests pin defects an adversarial review found ("R6-n"; each FAILED on 4dc8298 and
//! passes now); each says what it showed, its severity, its cause and a minimal reproduction.
//! The rest document attacks that held. A hang is detected with a hang guard only ([`HANG`]); no verdict depends on timing
//! otherwise.

mod common;

#[path = "common/futures.rs"]
mod futures_util;

use cuda_stream_pool::driver::{CaptureMode, SimConfig, SimDriver};
use cuda_stream_pool::{
    end_thread_owner, Context, ContextOptions, DeviceBuffer, ErrorCode, OwnedStream, Priority,
};
use futures_util::{poll, Noop};
use std::any::Any;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Poll, Wake, Waker};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

const HANG: Duration = Duration::from_secs(60);
const FAULT: ErrorCode = ErrorCode::ERROR_ILLEGAL_ADDRESS;
/// A second of simulated GPU time (never reached unless the clock is advanced).
const LONG: u64 = 1_000_000_000;

fn panic_text(p: Box<dyn Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

fn two_devices() -> Arc<SimDriver> {
    Arc::new(SimDriver::with_config(SimConfig {
        devices: 2,
        ..SimConfig::default()
    }))
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

/// A lent handle whose drop (user code: another crate's stream handle) runs `f` when dropped on
/// thread `on` (the crate drops a returned loan's last handle inside a flush).
struct OnDrop {
    on: ThreadId,
    f: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}
impl Drop for OnDrop {
    fn drop(&mut self) {
        if std::thread::current().id() != self.on {
            return;
        }
        if let Some(f) = self.f.lock().unwrap().take() {
            f();
        }
    }
}

// =================================================================================================
// DEFECTS (these tests fail on 4dc8298)
// =================================================================================================

// DEFECT R6-1 (severity: high; a healthy context is declared dead for ever: every completion and
// host copy of it that waits more than a poller pass resolves with another device's sticky
// error, `health()` reports it dead, and the staging block of a given-up host copy is recycled
// while that copy is still pending on the live GPU).
//
// `DeviceRules::call` (src/driver/rules.rs, `fn call`: `if e.is_sticky() { self.fault.set(..) }`)
// records the first sticky error of ANY call made through the context's driver as the death of
// THIS context, without asking which context the call touched. `Context::driver()` is public
// and documented for the user's own calls; device-level calls through it name other devices: a
// `primary_ctx_retain` of a device whose context died (which the H200 answers with 700 for the
// rest of the process, docs/gpu.md) kills the healthy context in the crate's eyes. The same
// happens to a context B made with `Context::primary(a.driver().clone(), 1)` (B's calls go
// through A's rules too). Then the poller (src/hub.rs, `poll_loop`: `if let Some(error) =
// (self.health)(probe)`, no probe needed: the fault is already recorded) gives up every pending
// entry of A at its next pass, and `Entry::finish` drops what the entry keeps: a dropped (or
// failed, then dropped: `keep_until_landed` returns it at once once `done`) host copy's staging
// block goes back to the hub's free list (`return_staging`) while A's GPU still copies into it;
// the next `to_vec_async` of A takes that block (a host-memory race: the late copy overwrites the
// new one's result).
//
// Minimal reproduction: devices 2; A on 0 with a completion pending behind long work; B on 1
// killed; `A.driver().primary_ctx_retain(dev 1)` fails with 700; `A.health()` is Err and the
// completion resolves with 700 although its work completes.
//
// Suggested fix: record a sticky error only for calls that touch the rules' own context (a
// stream/event of it, or a call made with it current: not the device-level calls that `need()`
// lists as naming no context, e.g. `cuDevicePrimaryCtxRetain`), and confirm a recorded fault with
// a probe of the disposal stream before giving entries up; never recycle what a given-up entry
// keeps (leak it, as `Hub::shutdown` does: "nothing is known of the writes").
#[test]
fn another_devices_sticky_error_seen_through_a_healthy_contexts_driver_does_not_kill_it() {
    let r = common::finishes("the completion of a healthy context", || {
        let sim = two_devices();
        let a = Context::primary(sim.clone(), 0).unwrap();
        let b = Context::primary(sim.clone(), 1).unwrap();
        let o = a.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), LONG).unwrap();
        let done = s.completed().unwrap();
        sim.kill_context(b.raw(), FAULT); // device 1's context faults
        drop(b);
        // The user asks, through the driver at hand, whether device 1 can be used again.
        let d1 = a.driver().device_get(1).unwrap();
        let e = a.driver().primary_ctx_retain(d1).unwrap_err();
        assert_eq!(e.code(), Some(FAULT));
        let health = a.health().map_err(|e| e.to_string());
        // A's work completes a little later (a slow kernel, not a dead one).
        let sim2 = sim.clone();
        let later = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            sim2.advance(LONG);
        });
        let r = common::block_on(done).map_err(|e| e.to_string());
        later.join().unwrap();
        (health, r)
    });
    assert_eq!(
        r,
        (Ok(()), Ok(())),
        "(health() of device 0's context, alive and well; its completion, whose work completed)"
    );
}

// DEFECT R6-1b (same cause; the memory consequence): once the healthy context is taken for dead,
// the poller gives up its pending host copy and the copy's staging block is recycled while the
// copy is still pending on the (live) GPU; the next `to_vec_async` takes the same block, and the
// late copy overwrites its result: `HostCopy` of buffer B resolves with buffer A's contents (on
// real hardware the DMA write races the host's read of the block: a data race on memory a safe
// `Vec` is built from). Cause: `Entry::finish` (src/hub.rs) drops the entry's `keep` (the
// staging block's `Back`) on a give-up, and `keep_until_landed` returns a failed copy's block at
// once (`st.done`), so `HostCopy::drop` -> `return_staging` puts it back in the free list.
#[test]
fn a_given_up_host_copys_staging_block_is_not_reused_while_the_copy_is_pending() {
    // Since R6-1's fix, A is no longer taken for dead by another device's error, so its copy is
    // not given up; the block of a copy given up for a real fault is never reused (leaked:
    // `Entry::finish`), which this scenario can no longer reach. Checked here: A's copies both
    // resolve with their own buffer's contents.
    let got = common::finishes("host copies", || {
        let sim = two_devices();
        let a = Context::primary(sim.clone(), 0).unwrap();
        let b = Context::primary(sim.clone(), 1).unwrap();
        let (o1, o2) = (a.owner(), a.owner());
        let (s1, s2) = (o1.stream().unwrap(), o2.stream().unwrap());
        let b1 = DeviceBuffer::from_slice(&s1, &[1u32; 256]).unwrap();
        let b2 = DeviceBuffer::from_slice(&s2, &[2u32; 256]).unwrap();
        s2.synchronize().unwrap();
        sim.enqueue_work(s1.raw(), LONG).unwrap(); // a slow kernel before the first copy
        let c1 = b1.to_vec_async(&s1).unwrap();
        sim.kill_context(b.raw(), FAULT);
        let d1 = a.driver().device_get(1).unwrap();
        let _ = a.driver().primary_ctx_retain(d1); // another device's error, through A's driver
        assert!(a.health().is_ok(), "A taken for dead by device 1's error");
        let c2 = b2.to_vec_async(&s2).unwrap();
        sim.advance(LONG);
        let v1 = common::block_on(c1).map_err(|e| e.to_string());
        let v2 = common::block_on(c2).map_err(|e| e.to_string());
        (v1.map(|v| v[0]), v2.map(|v| v[0]))
    });
    assert_eq!(got, (Ok(1), Ok(2)));
}

// DEFECT R6-2 (known gap, confirmed; severity: medium: a thread or task hung for ever, and
// nothing (not `health()`, not the poller) can release it).
//
// A waiter at the cap (blocking `Owner::stream`, async `Owner::ready`) that has armed the busy
// retired streams of its key (`Pool::arm`, src/pool.rs: a host function on each that notifies
// the gate) and parked (`crate::sync::park()`, no timeout unless loans are parked) is woken only
// by that host function, a release or a destroy. When the context dies, its host functions never
// run (docs/gpu.md: "a host function behind that gate never ran"), nobody releases a stream of a
// dead context any more, and the poller's fault handling (src/hub.rs) finishes completions only:
// the waiter waits for ever. (A waiter that attempts after the death gets the error: `arm`'s
// `cuLaunchHostFunc` fails; see `held_a_waiter_at_the_cap_gets_the_error_when_a_stream_comes_back_after_the_death`.)
//
// Minimal reproduction: cap 1; an owner's stream retired busy (long work); a second owner's
// `stream()` waits; `kill_context`.
//
// Suggested fix: when the rules record a fault (or the poller finds one), notify every gate of the
// context (`Gate::notify` for all waiters); a waiter's attempt then fails in `arm` with the sticky
// error; or let parked waiters poll `fault(false)` with a timeout.
#[test]
fn a_blocking_waiter_at_the_cap_is_released_when_the_context_dies() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    {
        let a = ctx.owner();
        let s = a.stream().unwrap();
        sim.enqueue_work(s.raw(), LONG).unwrap();
    } // retired, busy
    let (tx, rx) = mpsc::channel();
    let c2 = ctx.clone();
    std::thread::spawn(move || {
        let o = c2.owner();
        let r = o.stream().map(|_| ()).map_err(|e| e.code());
        let _ = tx.send(r);
    });
    let t = Instant::now();
    while ctx.stats().waits == 0 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(100)); // armed and parked
    sim.kill_context(ctx.raw(), FAULT);
    assert!(ctx.health().is_err());
    match rx.recv_timeout(HANG) {
        Ok(r) => assert_eq!(r, Err(Some(FAULT)), "the waiter's result"),
        Err(_) => panic!("hung: a waiter at the cap of a dead context is never woken"),
    }
}

// DEFECT R6-2b (known gap, async form; same cause and severity): an `Owner::ready` future waiting
// at the cap is never woken once the context dies (its task stays pending for ever).
#[test]
fn an_async_waiter_at_the_cap_is_woken_when_the_context_dies() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    {
        let a = ctx.owner();
        let s = a.stream().unwrap();
        sim.enqueue_work(s.raw(), LONG).unwrap();
    }
    struct Tell(Mutex<mpsc::Sender<()>>);
    impl Wake for Tell {
        fn wake(self: Arc<Self>) {
            let _ = self.0.lock().unwrap().send(());
        }
    }
    let (tx, rx) = mpsc::channel();
    let w = Waker::from(Arc::new(Tell(Mutex::new(tx))));
    let mut fut = Box::pin(ctx.owner().ready());
    assert!(poll(fut.as_mut(), &w).is_pending(), "at the cap: waits");
    sim.kill_context(ctx.raw(), FAULT);
    assert!(ctx.health().is_err());
    let woken = rx.recv_timeout(HANG).is_ok();
    let r = match poll(fut.as_mut(), &w) {
        Poll::Ready(r) => Some(r.map(|_| ()).map_err(|e| e.code())),
        Poll::Pending => None,
    };
    assert!(
        woken,
        "the waiting task was never woken after the context died"
    );
    assert_eq!(r, Some(Err(Some(FAULT))), "the waiter's result");
}

// DEFECT R6-6 (severity: high; the crate touches a stream that another crate left capturing:
// its `cuStreamQuery` invalidates that crate's capture (on the H200 a query of a capturing stream
// fails and ends the capture), and the stream goes back into the pool as an ordinary retired
// stream, queried (and, were the query to succeed, handed out or destroyed) again and again:
// exactly what `LoanEnd::Stuck` exists to prevent ("never used again, nor destroyed: ending or
// destroying it could invalidate streams joined to that capture"). One transient failure of one
// capture query suffices, as in R5-3; also the key's parked-loan count stays one too high for ever
// (`stats().lent == 1` with `in_use == 0`, every acquisition of the key flushes, every waiter
// polls).
//
// R5-3's fix (src/context.rs, `end_loan`: `Err(_) => LoanEnd::Out`, "kept and asked again by a
// later flush") does not ask again: the failed attempt went through `Slot::loan_returned`
// (src/pool.rs), which already took the handle and cleared the slot's `lent` flag
// (`self.lent.store(false, ..)`) BEFORE the query. At the next flush `release_slot`
// (src/context.rs) finds `slot.is_lent()` false, skips `end_loan` (no capture query) and calls
// `pool.release`, whose `is_idle`/trim queries (`cuStreamQuery`) hit the capturing stream. It
// also skips `pool.unpark_lent()`, which sits inside the `if slot.is_lent()` branch.
//
// Minimal reproduction: lend an owner's stream; drop the owner (parked, lent); the borrower
// begins a capture of it (relaxed mode) and drops its handle; fail the next
// `cuStreamGetCaptureInfo_v3` once; `trim()` twice: the borrower's capture is invalidated,
// `stats().lent` stays 1. (The call log shows `cuStreamQuery` on the lent stream.)
//
// Suggested fix: keep "the loan ended, its capture state unknown" as state of the slot (do not
// clear `lent` in `loan_returned` until the query has succeeded, or add a `check_pending` flag
// that `release_slot` honours), so that the next flush queries again before releasing; call
// `unpark_lent` on every path that takes a stream out of the parked list.
#[test]
fn a_stream_left_capturing_by_a_borrower_is_never_touched_after_one_failed_query() {
    use cuda_stream_pool::driver::Driver;
    struct Raw(cuda_stream_pool::driver::Stream);
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let a = ctx.owner();
    let s = a.stream().unwrap();
    let h = s.lend(|raw| Ok(Arc::new(Raw(raw)))).unwrap();
    let lent_raw = h.0;
    drop(s);
    drop(a); // the owner is gone: the stream is parked, lent
             // The other crate begins a capture of the stream and keeps it going (its graph), then drops
             // its handle.
             // SAFETY: the borrower's own use of the lent stream, as another crate would.
    unsafe { sim.stream_begin_capture(lent_raw, CaptureMode::Relaxed) }.unwrap();
    drop(h);
    sim.fail_calls("cuStreamGetCaptureInfo_v3", ErrorCode::ERROR_UNKNOWN, 1);
    let _ = ctx.trim(); // the loan's end: the capture query fails once
    let _ = ctx.trim(); // "asked again by a later flush"
    let next = ctx.owner();
    let s = next.stream().unwrap();
    let handed = s.raw() == lent_raw;
    drop(s);
    drop(next);
    // SAFETY: a query of a live stream (the borrower's own check of its capture).
    let capture = unsafe { sim.stream_is_capturing(lent_raw) }.map(|c| format!("{c:?}"));
    let lent = ctx.stats().lent;
    let queried = sim
        .calls()
        .iter()
        .filter(|c| c.stream == Some(lent_raw) && c.name == "cuStreamQuery")
        .count();
    assert!(
        !handed,
        "the stream left capturing was handed to a new owner"
    );
    assert_eq!(
        (capture, queried, lent),
        (Ok("Active".to_string()), 0, 0),
        "(the borrower's capture, cuStreamQuery calls on its stream, the key's parked loans)"
    );
}

// DEFECT R6-4 (severity: medium; a deadlock from safe code. R5-2's fix turned the "already
// mutably borrowed" panic into a hang when the key has a cap).
//
// `Owner::hold` (src/owner.rs) now lets user code run by the acquisition use the same owner, as
// intended; but with a cap, the acquisition's flush (`CtxInner::acquire` -> `flush_deferred`,
// because `pool.lent_out() > 0`) drops the returned loan's last handle (`Slot::loan_returned`, in
// `CtxInner::end_loan`) BEFORE it puts that very stream back into the pool
// (`release_slot` -> `pool.release`). A handle whose drop uses the thread's owner (here
// `Context::stream()`, which R5-2's test shows is meant to work) starts a nested acquisition of
// the same key: the key is at its cap (the parked stream still counts), the only stream that
// could come back is the one whose return is waiting for this drop to finish, so the nested
// waiter parks (`Pool::acquire`: `park_timeout(LOAN_POLL)` in a loop, its `reclaim` finding the
// lists empty: they were taken by the outer flush) for ever. The same happens with an explicit
// owner in the drop (`ctx.owner().stream()`: the same path, not pinned here), so the root cause
// predates the change.
//
// Minimal reproduction: cap 1; lend the only stream with a handle whose drop calls
// `ctx.stream()`; drop the owner (parked lent) and the user's clone of the handle; call
// `ctx.stream()` on the thread the handle's drop runs on.
//
// Suggested fix: drop a returned loan's handle only after its stream is back in the pool (take it
// out in `loan_returned`, release the slot, then drop the handle outside the flush), or never run
// a loan's drop inside an acquisition (defer the drops to the end of `acquire`).
#[test]
fn a_loan_handle_dropped_inside_an_acquisition_at_the_cap_can_use_the_thread_owner() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let (inner, outer) = common::finishes("an acquisition at the cap", move || {
        let seen: Arc<Mutex<Option<Result<bool, String>>>> = Arc::new(Mutex::new(None));
        let a = ctx.owner();
        let s = a.stream().unwrap(); // the only stream of the key
        let (c2, seen2) = (ctx.clone(), seen.clone());
        let h = s
            .lend(|_| {
                Ok(Arc::new(OnDrop {
                    on: std::thread::current().id(),
                    f: Mutex::new(Some(Box::new(move || {
                        let r = catch_unwind(AssertUnwindSafe(|| c2.stream().is_ok()));
                        *seen2.lock().unwrap() = Some(r.map_err(panic_text));
                    }))),
                }))
            })
            .unwrap();
        drop(s);
        drop(a); // parked, lent: still counts against the cap
        drop(h); // the loan ended; the crate notices at its next flush
        let outer = catch_unwind(AssertUnwindSafe(|| ctx.stream().is_ok())).map_err(panic_text);
        let inner = seen.lock().unwrap().clone();
        (inner, outer)
    });
    assert_eq!(
        inner,
        Some(Ok(true)),
        "Context::stream() in the handle's drop"
    );
    assert_eq!(outer, Ok(true), "the outer Context::stream()");
    assert_clean(&sim);
}

// DEFECT R6-5 (severity: low; an ordering surprise, no memory hazard: buffers order their own
// uses across streams).
//
// `Owner::stream` (src/owner.rs) reads the selected priority `p` BEFORE `hold(p)` runs user code,
// and returns the owner's stream of that stale `p` afterwards (`held_settled(&mut inner, p)`),
// even when that user code selected another priority of the same owner meanwhile (a loan
// handle's drop calling `Context::set_priority`, R5-2's use case). The caller gets a stream that
// is not the owner's selected one, and it is not ordered after the work the user code enqueued
// on the selected stream: `Context::stream()` ("the current stream of the calling thread's
// implicit owner") returns a non-current stream. (`select` re-reads `inner.current` after `hold`;
// `stream` does not.)
//
// Minimal reproduction: lend a stream of key Normal, park it, drop the handle; the handle's drop
// calls `ctx.set_priority(High)` and enqueues work on `ctx.stream()`; the outer `ctx.stream()`
// (implicit owner holding nothing yet) returns the Normal stream while the owner's priority is
// High, idle while the High stream's work is pending.
//
// Suggested fix: after `hold`, re-read `inner.current` and loop (`hold` the new priority) until
// the selected priority's stream is held, or return an error.
#[test]
fn context_stream_returns_the_owners_selected_stream_after_reentrant_priority_changes() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let sim2 = sim.clone();
    let (outer_prio, selected, outer_idle_while_high_busy) =
        common::finishes("the acquisition", move || {
            let a = ctx.owner();
            let s = a.stream().unwrap();
            let c2 = ctx.clone();
            let h = s
                .lend(|_| {
                    Ok(Arc::new(OnDrop {
                        on: std::thread::current().id(),
                        f: Mutex::new(Some(Box::new(move || {
                            c2.set_priority(Priority::High).unwrap();
                            let hi = c2.stream().unwrap();
                            sim2.enqueue_work(hi.raw(), LONG).unwrap();
                        }))),
                    }))
                })
                .unwrap();
            drop(s);
            drop(a);
            drop(h);
            let s = ctx.stream().unwrap(); // its acquisition runs the handle's drop
            let selected = ctx.with_thread_owner(|o| o.priority()).unwrap();
            let idle = s.query().unwrap();
            let r = (s.priority(), selected, idle);
            drop(s);
            end_thread_owner(&ctx);
            r
        });
    assert_eq!(
        (outer_prio, outer_idle_while_high_busy),
        (selected, false),
        "(the priority of the stream Context::stream() returned, whether it is idle while the \
         selected stream's work is pending); the owner's selected priority is {selected}"
    );
}

// =================================================================================================
// ATTACKS THAT HELD
// =================================================================================================

// HELD (R6-3 attempted): a dead context's teardown with a stream lent at the time lingers, and is
// torn down again once the borrower returns the handle; it does not linger for ever: the second
// attempt's capture query fails (`LoanEnd::Out`), but the one after finds the slot no longer
// `is_lent` and returns it (see R6-6 for why that is itself a defect), so the retries stop and the
// primary retain is released. Later flushes of a healthy context on the other device make no
// failing call on the dead one.
#[test]
fn held_a_dead_contexts_lingering_teardown_is_not_retried_by_every_flush_of_other_contexts() {
    let sim = two_devices();
    let dead = Context::primary(sim.clone(), 0).unwrap();
    let healthy = Context::primary(sim.clone(), 1).unwrap();
    let h = {
        let o = dead.owner();
        let s = o.stream().unwrap();
        s.lend(|_| Ok(Arc::new(Foreign))).unwrap()
    }; // the owner is gone: the stream is parked, lent
    sim.kill_context(dead.raw(), FAULT);
    common::finishes("the dead context's teardown", move || drop(dead));
    drop(h); // the borrower returns the stream
    let failing = || sim.calls().iter().filter(|c| !c.ok).count();
    // The healthy context's flushes tear the dead state down again, a bounded number of times.
    // The list of lingering teardowns is the process's: a flush on another thread (another
    // test's) may take this one and tear it down, so its last calls can come after this
    // thread's flushes; wait until the retain is released (regression: this test failed under
    // load, on CI's 2 cores with busy loops and on a 16-core GPU machine, when it expected two
    // flushes of its own to finish the teardown). A 60 s bound reports a hang only: a teardown
    // retried for ever never releases the retain.
    let hang = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut flushes = 0u32;
    while sim.counters().live_contexts != 1 {
        assert!(
            std::time::Instant::now() < hang,
            "a hang: the dead context's lingering teardown never finished ({flushes} flushes)"
        );
        let o = healthy.owner();
        o.stream().unwrap();
        drop(o);
        flushes += 1;
        std::thread::yield_now();
    }
    sim.clear_calls();
    for _ in 0..20 {
        let o = healthy.owner();
        o.stream().unwrap();
    }
    let n = failing();
    let names: std::collections::BTreeSet<&str> = sim
        .calls()
        .iter()
        .filter(|c| !c.ok)
        .map(|c| c.name)
        .collect();
    assert_eq!(
        sim.counters().live_contexts,
        1,
        "the dead context's retain released"
    );
    assert_eq!(
        n, 0,
        "20 owner drops of a healthy context on another device made {n} failing driver calls on \
         the dead context ({names:?}): its teardown is retried at every flush"
    );
}

// HELD: an `Owner::attach`ed task whose waker polls it inline on the completion poller's thread
// (marked as a crate thread) still gets its owner's stream through `Context::stream()` and
// `Context::set_priority` (the attached owner comes before the background-thread refusal), while
// an unattached one is refused (R5-4) without panicking.
#[test]
fn held_an_attached_task_polled_inline_by_the_poller_gets_its_owners_stream() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    type Task = std::pin::Pin<Box<dyn Future<Output = (bool, bool, bool)> + Send>>;
    struct Inline {
        task: Mutex<Option<Task>>,
        tx: Mutex<Option<mpsc::Sender<(bool, bool, bool)>>>,
        me: Mutex<Option<Waker>>,
    }
    impl Wake for Inline {
        fn wake(self: Arc<Self>) {
            let w = self.me.lock().unwrap().clone();
            let Some(w) = w else { return };
            let mut t = self.task.lock().unwrap();
            if let Some(f) = t.as_mut() {
                if let Poll::Ready(v) = poll(f.as_mut(), &w) {
                    *t = None;
                    if let Some(tx) = self.tx.lock().unwrap().take() {
                        let _ = tx.send(v);
                    }
                }
            }
        }
    }
    let owner = ctx.owner();
    let mine = owner.stream().unwrap().raw();
    sim.enqueue_work(owner.stream().unwrap().raw(), 1_000)
        .unwrap();
    let done = owner.stream().unwrap().completed().unwrap();
    let c = ctx.clone();
    let task: Task = Box::pin(owner.attach(async move {
        done.await.unwrap();
        // Polled by the poller now (its waker polls inline).
        let same = c.stream().map(|s| s.raw() == mine).unwrap_or(false);
        let prio = c.set_priority(Priority::High).is_ok();
        let c2 = c.clone();
        let unattached = std::thread::spawn(move || drop(c2)).join().is_ok();
        (same, prio, unattached)
    }));
    let (tx, rx) = mpsc::channel();
    let inline = Arc::new(Inline {
        task: Mutex::new(Some(task)),
        tx: Mutex::new(Some(tx)),
        me: Mutex::new(None),
    });
    let w = Waker::from(inline.clone());
    *inline.me.lock().unwrap() = Some(w.clone());
    {
        let mut t = inline.task.lock().unwrap();
        assert!(poll(t.as_mut().unwrap().as_mut(), &w).is_pending());
    }
    sim.advance(1_000);
    let (same, prio, _) = rx.recv_timeout(HANG).expect("the task never completed");
    assert!(
        same,
        "the attached task got its owner's stream on the poller thread"
    );
    assert!(
        prio,
        "set_priority on the attached owner, on the poller thread"
    );
    // And an unattached use on the poller thread is refused, not served nor panicking.
    type Reply = mpsc::Sender<Result<(), String>>;
    struct Unattached(Mutex<Option<(Context, Reply)>>);
    impl Wake for Unattached {
        fn wake(self: Arc<Self>) {
            if let Some((c, tx)) = self.0.lock().unwrap().take() {
                let r = c.stream().map(|_| ()).map_err(|e| e.to_string());
                let _ = tx.send(r);
            }
        }
    }
    let (tx, rx) = mpsc::channel();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    sim.enqueue_work(s.raw(), 1_000).unwrap();
    let mut d = Box::pin(s.completed().unwrap());
    let w = Waker::from(Arc::new(Unattached(Mutex::new(Some((ctx.clone(), tx))))));
    assert!(poll(d.as_mut(), &w).is_pending());
    sim.advance(1_000);
    let r = rx.recv_timeout(HANG).expect("the waker never ran");
    assert!(r.is_err(), "an implicit owner on the poller thread: {r:?}");
    drop(d);
    drop(s);
    drop(o);
    drop((inline, ctx));
    assert_clean(&sim);
}

// HELD: the poller's health probes (a completion pending > 5 ms with nothing landing) while
// another thread captures in GLOBAL mode on the same context: the probe runs relaxed, the
// capture survives; `health()` called on the capturing thread itself does not invalidate its own
// capture either.
#[test]
fn held_health_probes_during_a_global_capture_leave_it_intact() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    sim.enqueue_work(s.raw(), LONG).unwrap();
    let done = s.completed().unwrap(); // the poller probes every 5 ms from now on
    let c2 = ctx.clone();
    let r = std::thread::spawn(move || {
        let o = c2.owner();
        let s = o.stream().unwrap();
        let mut b = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
        let g = s.begin_capture_with(CaptureMode::Global).unwrap();
        b.fill(&s, 7).unwrap();
        std::thread::sleep(Duration::from_millis(60)); // ~12 probes
        let h = c2.health().is_ok(); // on the capturing thread
        let graph = g.end().map(|_| ()).map_err(|e| e.to_string());
        (h, graph)
    })
    .join()
    .unwrap();
    assert_eq!(
        r,
        (true, Ok(())),
        "health inside, and the global capture's end"
    );
    sim.advance(LONG);
    common::block_on(done).unwrap();
    assert_clean(&sim);
}

// HELD: a context killed with everything at once: completions and host copies pending (one with
// a waker that drops the last Context clone, from the poller), buffers dropped, an owned stream,
// a live capture guard, a stream with a loan out: nothing panics, every future resolves with the
// error, the teardown returns, and a healthy context on the other device keeps working (and its
// completions still resolve with success).
#[test]
fn held_a_context_killed_with_everything_in_flight() {
    let sim = two_devices();
    let healthy = Context::primary(sim.clone(), 1).unwrap();
    let sim2 = sim.clone();
    let r = common::finishes("a killed context", move || {
        let ctx = Context::primary(sim2.clone(), 0).unwrap();
        let owners: Vec<_> = (0..3).map(|_| ctx.owner()).collect();
        let mut waits = Vec::new();
        let mut copies = Vec::new();
        let mut bufs = Vec::new();
        for o in &owners {
            let s = o.stream().unwrap();
            let b = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
            sim2.enqueue_work(s.raw(), LONG).unwrap();
            waits.push(s.completed().unwrap());
            copies.push(b.to_vec_async(&s).unwrap());
            bufs.push(b);
        }
        // A completion whose waker (run by the poller) drops the last clone of the context.
        struct DropCtx(Mutex<Option<Context>>);
        impl Wake for DropCtx {
            fn wake(self: Arc<Self>) {
                drop(self.0.lock().unwrap().take());
            }
        }
        let extra = owners[0].stream().unwrap().completed().unwrap();
        let mut extra = Box::pin(extra);
        let w = Waker::from(Arc::new(DropCtx(Mutex::new(Some(ctx.clone())))));
        assert!(poll(extra.as_mut(), &w).is_pending());
        let owned = OwnedStream::new(&ctx, Priority::Normal).unwrap();
        sim2.enqueue_work(owned.stream().raw(), LONG).unwrap();
        let lent_owner = ctx.owner();
        let handle = lent_owner
            .stream()
            .unwrap()
            .lend(|_| Ok(Arc::new(Foreign)))
            .unwrap();
        let cap_owner = ctx.owner();
        let cs = cap_owner.stream().unwrap();
        let mut cb = DeviceBuffer::<u32>::zeroed(&cs, 8).unwrap();
        let guard = cs.begin_capture().unwrap();
        cb.fill(&cs, 1).unwrap();
        sim2.kill_context(ctx.raw(), FAULT);
        let mut results = Vec::new();
        for wt in waits {
            results.push(common::block_on(wt).map_err(|e| e.code()));
        }
        for c in copies {
            results.push(common::block_on(c).map(|_| ()).map_err(|e| e.code()));
        }
        let end = guard.end().map(|_| ()).map_err(|e| e.code());
        drop(cb);
        drop(cs);
        drop(cap_owner);
        drop(bufs);
        drop(owned);
        drop(lent_owner);
        drop(owners);
        drop(extra);
        drop(ctx);
        drop(handle);
        (results, end)
    });
    assert!(
        r.0.iter().all(|x| *x == Err(Some(FAULT))),
        "every pending future resolved with the sticky error: {:?}",
        r.0
    );
    assert!(r.1.is_err(), "ending a capture of a dead context fails");
    let o = healthy.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::from_slice(&s, &[1u32, 2, 3]).unwrap();
    sim.enqueue_work(s.raw(), 1_000).unwrap();
    let c = b.to_vec_async(&s).unwrap();
    sim.advance(1_000);
    assert_eq!(common::block_on(c).unwrap(), vec![1, 2, 3]);
    assert!(healthy.health().is_ok());
    assert!(sim.misuse().is_empty(), "misuse: {:?}", sim.misuse());
}

// HELD: a waiter at the cap that attempts after the death (a stream comes back after the kill)
// gets the sticky error instead of waiting (blocking and async): `arm`'s host function fails.
#[test]
fn held_a_waiter_at_the_cap_gets_the_error_when_a_stream_comes_back_after_the_death() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let holder = ctx.owner();
    // Work through the raw handle: the crate cannot know the stream idle, so its return asks
    // the driver (an untouched stream would be handed on without a driver call, and the error
    // met at the new owner's first call).
    let raw = holder.stream().unwrap().raw();
    sim.enqueue_work(raw, 1_000).unwrap();
    let mut fut = Box::pin(ctx.owner().ready());
    let (counter, w) = futures_util::waker();
    assert!(poll(fut.as_mut(), &w).is_pending());
    let c2 = ctx.clone();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let o = c2.owner();
        let _ = tx.send(o.stream().map(|_| ()).map_err(|e| e.code()));
    });
    std::thread::sleep(Duration::from_millis(100));
    sim.kill_context(ctx.raw(), FAULT);
    drop(holder); // its stream comes back, busy for ever
    let t = Instant::now();
    let mut r = None;
    while t.elapsed() < HANG {
        if counter.0.load(Ordering::SeqCst) > 0 {
            if let Poll::Ready(x) = poll(fut.as_mut(), &w) {
                r = Some(x.map(|_| ()).map_err(|e| e.code()));
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let blocking = rx.recv_timeout(HANG).expect("the blocking waiter hung");
    assert_eq!(blocking, Err(Some(FAULT)));
    assert_eq!(r, Some(Err(Some(FAULT))), "the async waiter");
    assert_clean(&sim);
}

// HELD: a dead context: `Owner::stream`, `set_priority`, `with_priority`, `OwnedStream::new`,
// allocations, `trim`, `stats`, `reserve` return errors or values, never panic; `health` reports
// the fault on every clone; the teardown returns.
#[test]
fn held_every_operation_on_a_dead_context_returns() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let held = ctx.owner();
    let s = held.stream().unwrap();
    sim.kill_context(ctx.raw(), FAULT);
    let c2 = ctx.clone();
    let r = common::finishes("operations on a dead context", move || {
        let ctx = c2;
        catch_unwind(AssertUnwindSafe(|| {
            let o = ctx.owner();
            let _ = o.stream().map(|_| ());
            let _ = o.set_priority(Priority::High);
            let _ = o.with_priority(Priority::Low, || ());
            let _ = OwnedStream::new(&ctx, Priority::Normal).map(|_| ());
            let _ = ctx.trim();
            let _ = ctx.stats();
            let _ = ctx.reserve(Priority::Normal, 2);
            let _ = ctx.set_priority(Priority::High);
            let _ = ctx.stream().map(|_| ());
            end_thread_owner(&ctx);
            ctx.health().map_err(|e| e.code())
        }))
        .map_err(panic_text)
    });
    assert_eq!(r, Ok(Err(Some(FAULT))));
    assert!(DeviceBuffer::<u8>::zeroed(&s, 8).is_err());
    let _ = held.set_priority(Priority::High);
    drop(s);
    drop(held);
    common::finishes("the teardown", move || drop(ctx));
    assert!(sim.misuse().is_empty(), "misuse: {:?}", sim.misuse());
}

// HELD: re-entrant user code inside an acquisition that takes the same priority's stream for the
// same owner (two acquisitions of one key for one owner): the owner keeps one stream of the
// priority, the other goes back to the pool (no second stream held, none leaked), and the
// reference returned is of the stream the owner holds. Also `end_thread_owner` inside: the outer
// reference keeps the old owner alive; everything comes back once dropped.
#[test]
fn held_reentrant_acquisitions_of_the_same_key_for_the_same_owner() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let c = ctx.clone();
    let (same, in_use_during, in_use_after) = common::finishes("the acquisition", move || {
        let a = c.owner();
        let s = a.stream().unwrap();
        let c2 = c.clone();
        let inner_raw = Arc::new(Mutex::new(None));
        let ir = inner_raw.clone();
        let h = s
            .lend(|_| {
                Ok(Arc::new(OnDrop {
                    on: std::thread::current().id(),
                    f: Mutex::new(Some(Box::new(move || {
                        *ir.lock().unwrap() = c2.stream().ok().map(|s| s.raw());
                        end_thread_owner(&c2);
                    }))),
                }))
            })
            .unwrap();
        drop(s);
        drop(a);
        drop(h);
        let outer = c.stream().unwrap();
        let inner = *inner_raw.lock().unwrap();
        let same = inner == Some(outer.raw());
        let during = c.stats().in_use;
        drop(outer);
        end_thread_owner(&c);
        (same, during, c.stats().in_use)
    });
    assert!(same, "the outer reference is the stream the inner use got");
    assert_eq!(in_use_during, 1, "one stream held for the owner");
    assert_eq!(in_use_after, 0, "nothing held once everything is dropped");
    drop(ctx);
    assert_clean(&sim);
    let c = sim.counters();
    assert_eq!(
        (c.live_streams, c.live_contexts),
        (0, 0),
        "left after everything was dropped: {c:?}"
    );
}

// HELD: the poller's probes racing teardowns: contexts torn down while completions are pending
// behind long work (the poller probing the disposal stream every 5 ms) and after a kill: no use
// of a destroyed stream, no misuse, every teardown returns.
#[test]
fn held_probes_racing_teardowns() {
    let sim = Arc::new(SimDriver::new());
    let sim2 = sim.clone();
    common::finishes("teardowns with probes", move || {
        for i in 0..20 {
            let ctx = Context::primary(sim2.clone(), 0).unwrap();
            let o = ctx.owner();
            let s = o.stream().unwrap();
            sim2.enqueue_work(s.raw(), 1_000).unwrap();
            let mut d = Box::pin(s.completed().unwrap());
            assert!(poll(d.as_mut(), &Waker::from(Arc::new(Noop))).is_pending());
            std::thread::sleep(Duration::from_millis(6 + i % 4));
            let h = std::thread::spawn({
                let c = ctx.clone();
                move || {
                    for _ in 0..50 {
                        let _ = c.health();
                    }
                }
            });
            h.join().unwrap();
            drop(d);
            drop(s);
            drop(o);
            drop(ctx); // waits for the work (sync jumps the clock), then tears down
        }
    });
    assert_clean(&sim);
    let c = sim.counters();
    assert_eq!(c.live_streams, 0, "{c:?}");
}

// HELD: a killed context then a healthy context on the other device: every operation of the
// healthy one succeeds, its completions and host copies resolve with success, `health()` is Ok,
// while the dead one's pending completion resolved with the error (the poller threads and the
// device rules are per context).
#[test]
fn held_a_dead_context_does_not_affect_a_healthy_one_on_another_device() {
    let sim = two_devices();
    let sim2 = sim.clone();
    common::finishes("two devices", move || {
        let dead = Context::primary(sim2.clone(), 0).unwrap();
        let healthy = Context::primary(sim2.clone(), 1).unwrap();
        let od = dead.owner();
        let sd = od.stream().unwrap();
        sim2.enqueue_work(sd.raw(), LONG).unwrap();
        let dd = sd.completed().unwrap();
        let oh = healthy.owner();
        let sh = oh.stream().unwrap();
        sim2.enqueue_work(sh.raw(), 50_000_000).unwrap();
        let b = DeviceBuffer::from_slice(&sh, &[5u32; 32]).unwrap();
        let dh = sh.completed().unwrap();
        let ch = b.to_vec_async(&sh).unwrap();
        sim2.kill_context(dead.raw(), FAULT);
        assert_eq!(common::block_on(dd).unwrap_err().code(), Some(FAULT));
        std::thread::sleep(Duration::from_millis(30)); // the healthy poller probes meanwhile
        sim2.advance(50_000_000);
        common::block_on(dh).unwrap();
        assert_eq!(common::block_on(ch).unwrap(), vec![5u32; 32]);
        assert!(healthy.health().is_ok());
        drop(sd);
        drop(od);
        drop(dead);
        drop(b);
        drop(sh);
        drop(oh);
        drop(healthy);
    });
    assert!(sim.misuse().is_empty(), "misuse: {:?}", sim.misuse());
}

// HELD: a priority switch whose acquisition runs user code that switches the same owner's
// priority again (to a third priority) and takes streams: the outer `set_priority` completes
// with a consistent state (one stream per priority, the selected one held), no panic, no stream
// leaked once the owner is dropped.
#[test]
fn held_set_priority_racing_reentrant_priority_switches_on_the_same_owner() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let c = ctx.clone();
    let r = common::finishes("the priority switch", move || {
        c.stream().unwrap(); // the thread's owner holds a Normal stream
                             // A parked, returned loan of key High: the switch's acquisition flushes it.
        let a = c.owner();
        a.set_priority(Priority::High).unwrap();
        let s = a.stream().unwrap();
        let c2 = c.clone();
        let h = s
            .lend(|_| {
                Ok(Arc::new(OnDrop {
                    on: std::thread::current().id(),
                    f: Mutex::new(Some(Box::new(move || {
                        let _ = c2.set_priority(Priority::Low);
                        let _ = c2.stream().map(|_| ());
                        let _ = c2.set_priority(Priority::High);
                        let _ = c2.stream().map(|_| ());
                    }))),
                }))
            })
            .unwrap();
        drop(s);
        drop(a);
        drop(h);
        let r = catch_unwind(AssertUnwindSafe(|| c.set_priority(Priority::High).is_ok()))
            .map_err(panic_text);
        let (prio, held) = c
            .with_thread_owner(|o| {
                let held: Vec<i32> = o.streams().iter().map(|(p, _)| *p).collect();
                (o.priority(), held)
            })
            .unwrap();
        let s = c.stream().unwrap();
        let sp = s.priority();
        drop(s);
        end_thread_owner(&c);
        (r, prio, sp, held, c.stats().in_use)
    });
    let (ok, prio, sp, mut held, in_use) = r;
    assert_eq!(ok, Ok(true));
    assert_eq!(prio, sp, "the selected priority's stream");
    let n = held.len();
    held.sort();
    held.dedup();
    assert_eq!(n, held.len(), "one stream per priority: {held:?}");
    assert_eq!(in_use, 0);
    drop(ctx);
    assert_clean(&sim);
    assert_eq!(sim.counters().live_streams, 0);
}
