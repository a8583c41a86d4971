//! Waiters at the cap are woken whenever what they wait for happens: a stream that a cancelled
//! waiter's mailbox gives back to the pool, a context that died after the wake-up host function
//! of the only busy stream ran. Pinned by review 7 (an attack on the cap's queue after the
//! mailbox fix and the zero-call hand-overs), on the simulated driver.

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{Context, ContextOptions, ErrorCode};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::task::{Poll, Wake, Waker};
use std::time::{Duration, Instant};

const FAULT: ErrorCode = ErrorCode::ERROR_ILLEGAL_ADDRESS;

#[derive(Default)]
struct Counting(AtomicUsize);
impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn waker() -> (Arc<Counting>, Waker) {
    let c = Arc::new(Counting::default());
    (c.clone(), Waker::from(c))
}

fn poll<F: Future + ?Sized>(f: Pin<&mut F>, w: &Waker) -> Poll<F::Output> {
    f.poll(&mut std::task::Context::from_waker(w))
}

fn capped(cap: usize) -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(cap));
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary_with(d, 0, opts).unwrap();
    (sim, ctx)
}

/// Waits until every host function the simulation started has returned.
fn host_fns_done(sim: &SimDriver) {
    let t0 = Instant::now();
    loop {
        let (started, done) = sim.host_fn_progress();
        if started == done {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "host functions hang"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs `f` on a thread; its result, or `None` when it has not returned after `secs`.
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).ok()
}

/// A retired stream whose wake-up host function (armed by a waiter that then left) has run,
/// in a context that died afterwards: the cap's only stream.
fn ran_wake_up_then_fault() -> (Arc<SimDriver>, Context) {
    let (sim, ctx) = capped(1);
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
    }
    // An async waiter arms the wake-up on the busy retired stream, then is cancelled.
    let (_, w) = waker();
    let mut fut = Box::pin(ctx.owner().ready());
    assert!(poll(fut.as_mut(), &w).is_pending());
    drop(fut);
    // The work completes and the wake-up runs (the stream's `armed` is RAN), nobody takes it.
    sim.advance(1_000);
    host_fns_done(&sim);
    sim.kill_context(ctx.raw(), FAULT);
    (sim, ctx)
}

// Pins review 7's finding R7-1: a waiter at the cap of a dead context sleeps for ever when the only retired
// stream's wake-up host function has run (`armed == RAN`): `is_idle` and `finish_wake_up` swallow
// the sticky error, `Pool::arm` skips RAN streams without reporting them armed, so the waiter
// parks with no fault poll (blocking: `park()`; async: `Pending` with no wake-up scheduled).
#[test]
fn a_blocking_waiter_at_the_cap_of_a_dead_context_gets_the_error_after_a_wake_up_ran() {
    let (_sim, ctx) = ran_wake_up_then_fault();
    let c = ctx.clone();
    let r = within(5, move || {
        c.owner().stream().map(|_| ()).map_err(|e| e.code())
    });
    assert_eq!(
        r,
        Some(Err(Some(FAULT))),
        "the acquisition at the cap of the dead context (None: still blocked after 5 s)"
    );
}

// Pins review 7's finding R7-1 (async form): the same for `Owner::ready`.
#[test]
fn an_async_waiter_at_the_cap_of_a_dead_context_gets_the_error_after_a_wake_up_ran() {
    let (_sim, ctx) = ran_wake_up_then_fault();
    let (count, w) = waker();
    let mut fut = Box::pin(ctx.owner().ready());
    let t0 = Instant::now();
    let mut polls = 0;
    let r = loop {
        polls += 1;
        if let Poll::Ready(r) = poll(fut.as_mut(), &w) {
            break Some(r.map(|_| ()).map_err(|e| e.code()));
        }
        if t0.elapsed() > Duration::from_secs(2) {
            break None;
        }
        // Polled again only when woken (as an executor would), or after 50 ms regardless.
        let seen = count.0.load(Ordering::SeqCst);
        let t1 = Instant::now();
        while count.0.load(Ordering::SeqCst) == seen && t1.elapsed() < Duration::from_millis(50) {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    assert_eq!(
        r,
        Some(Err(Some(FAULT))),
        "OwnerReady at the cap of the dead context after {polls} polls, woken {} times \
         (None: still pending after 2 s)",
        count.0.load(Ordering::SeqCst)
    );
}

// Pins review 7's finding R7-2: a stream put in a waiter's mailbox (`Gate::offer`) by a release, whose waiter
// is then cancelled while it is not first and every other waiter already has a stream in its
// mailbox, goes to `Gate::returned` with no notification (`Gate::leave` passes notifications
// only when the leaving waiter was first, and the returned stream is not counted as one). A
// waiter that joins behind the first one afterwards is never woken and never attempts, while
// that stream lies idle in `returned`.
#[test]
fn a_waiter_is_served_by_a_stream_returned_from_a_cancelled_waiters_mailbox() {
    let (_sim, ctx) = capped(2);
    let (o1, o2) = (ctx.owner(), ctx.owner());
    o1.stream().unwrap();
    o2.stream().unwrap();
    let (_, w) = waker();
    // Two async waiters at the cap.
    let mut w1 = Box::pin(ctx.owner().ready());
    assert!(poll(w1.as_mut(), &w).is_pending());
    let mut w2 = Box::pin(ctx.owner().ready());
    assert!(poll(w2.as_mut(), &w).is_pending());
    // Two releases of idle streams: one into each waiter's mailbox.
    drop(o1);
    drop(o2);
    // The second waiter is cancelled: its stream goes back (nobody else lacks one).
    drop(w2);
    // A third waiter joins behind the first.
    let (count3, w3w) = waker();
    let mut w3 = Box::pin(ctx.owner().ready());
    assert!(poll(w3.as_mut(), &w3w).is_pending());
    // The first waiter takes its stream and keeps it.
    let first = match poll(w1.as_mut(), &w) {
        Poll::Ready(o) => o.unwrap(),
        Poll::Pending => panic!("the first waiter had a stream in its mailbox"),
    };
    // One stream is held (`first`), the other is idle, handed to nobody: the third waiter
    // should get it (woken, and ready when polled).
    let woken = count3.0.load(Ordering::SeqCst);
    let ready = poll(w3.as_mut(), &w3w).is_ready();
    let st = ctx.stats();
    assert!(
        woken > 0 && ready,
        "third waiter woken {woken} times, ready when polled: {ready}; stats: {st:?}"
    );
    drop(first);
}

// Pins a hang CI saw once (`device_faults::sim_a_faulted_context_resolves_every_future_and_waiter`):
// an async waiter that met a known death at its poll dropped its place in the queue as if
// cancelled, passing on nothing, and the waiters behind it slept for ever.
/// A queued async waiter that returns the context's death passes its turn on: the next waiter
/// is woken (and meets the error itself).
#[test]
fn a_waiter_that_meets_the_death_wakes_the_next_one() {
    let (sim, ctx) = capped(1);
    let holder = ctx.owner();
    holder.stream().unwrap();
    let (c0, w0) = waker();
    let (c1, w1) = waker();
    let mut first = Box::pin(ctx.owner().ready());
    let mut second = Box::pin(ctx.owner().ready());
    assert!(poll(first.as_mut(), &w0).is_pending());
    assert!(poll(second.as_mut(), &w1).is_pending());
    sim.kill_context(ctx.raw(), FAULT);
    assert!(ctx.health().is_err(), "the death is known now");
    let woken = c1.0.load(Ordering::SeqCst);
    match poll(first.as_mut(), &w0) {
        Poll::Ready(Err(e)) => assert_eq!(e.code(), Some(FAULT), "{e}"),
        other => panic!("the first waiter: {:?}", other.map(|r| r.map(|_| ()))),
    }
    assert!(
        c1.0.load(Ordering::SeqCst) > woken,
        "the waiter behind it was not woken"
    );
    match poll(second.as_mut(), &w1) {
        Poll::Ready(Err(e)) => assert_eq!(e.code(), Some(FAULT), "{e}"),
        other => panic!("the second waiter: {:?}", other.map(|r| r.map(|_| ()))),
    }
    let _ = c0;
}
