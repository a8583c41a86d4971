//! The cap on live streams per key (`ContextOptions::max_live_streams_per_key`): blocking and
//! async acquisitions that wait, first come first served, for a stream to come back; cancellation
//! of waiters; owners holding several priorities; waking when a busy retired stream completes.
//! All on the simulated driver (manual clock).

mod common;
#[path = "common/futures.rs"]
mod futs;

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{Context, ContextOptions, ErrorCode, Owner, OwnerReady, Priority};
use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::task::{Context as Cx, Poll, Wake, Waker};
use std::time::{Duration, Instant};

fn capped(cap: usize) -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let opts = ContextOptions::default().max_live_streams_per_key(Some(cap));
    (sim, Context::primary_with(d, 0, opts).unwrap())
}

/// A waker that records, in a shared log, the index of the future it belongs to.
struct Logged(usize, Arc<Mutex<Vec<usize>>>);
impl Wake for Logged {
    fn wake(self: Arc<Self>) {
        self.1.lock().unwrap().push(self.0);
    }
}

struct Waiters {
    futs: Vec<Option<Pin<Box<OwnerReady>>>>,
    wakers: Vec<Waker>,
    log: Arc<Mutex<Vec<usize>>>,
}

impl Waiters {
    fn new(ctx: &Context, n: usize) -> Waiters {
        let log = Arc::new(Mutex::new(Vec::new()));
        Waiters {
            futs: (0..n)
                .map(|_| Some(Box::pin(ctx.owner().ready())))
                .collect(),
            wakers: (0..n)
                .map(|i| Waker::from(Arc::new(Logged(i, log.clone()))))
                .collect(),
            log,
        }
    }

    /// Polls waiter `i`: `Some(owner)` when it resolved.
    fn poll(&mut self, i: usize) -> Option<Owner> {
        let mut cx = Cx::from_waker(&self.wakers[i]);
        let f = self.futs[i].as_mut().expect("waiter already gone");
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(r) => {
                self.futs[i] = None;
                Some(r.unwrap())
            }
            Poll::Pending => None,
        }
    }

    fn woken(&self) -> Vec<usize> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }

    fn cancel(&mut self, i: usize) {
        self.futs[i] = None;
    }
}

fn assert_send<T: Send>(_: &T) {}

/// 16 threads, cap 3: never more than 3 streams of the key alive, concurrent owners never share
/// a stream; half of the owners drop their stream with work pending (woken by the completion,
/// driven by a ticking thread), half synchronize first.
#[test]
fn cap_respected_under_threads() {
    let (sim, ctx) = capped(3);
    let held = Arc::new(Mutex::new(HashSet::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = {
        let (sim, stop) = (sim.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) {
                sim.advance(100);
                std::thread::yield_now();
            }
        })
    };
    // The cap is reached before the workers start, and given back only once one of them waits
    // (`waits` counts an acquisition that joined the queue): someone waits, whatever the
    // machine's load.
    let first: Vec<_> = (0..3)
        .map(|_| {
            let o = ctx.owner();
            o.stream().unwrap();
            o
        })
        .collect();
    let workers: Vec<_> = (0..16)
        .map(|t| {
            let (ctx, sim, held) = (ctx.clone(), sim.clone(), held.clone());
            std::thread::spawn(move || {
                for i in 0..40 {
                    let o = ctx.owner();
                    let s = o.stream().unwrap();
                    assert!(held.lock().unwrap().insert(s.raw()), "stream shared");
                    sim.enqueue_work(s.raw(), 500).unwrap();
                    if (t + i) % 2 == 0 {
                        s.synchronize().unwrap();
                    }
                    assert!(held.lock().unwrap().remove(&s.raw()));
                }
            })
        })
        .collect();
    while ctx.stats().waits == 0 {
        std::thread::yield_now();
    }
    drop(first);
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    ticker.join().unwrap();
    let st = ctx.stats();
    assert!(st.peak_live <= 3, "{st:?}");
    assert!(st.created <= 3, "{st:?}");
    assert!(
        st.waits > 0,
        "nobody waited: the test proves nothing ({st:?})"
    );
    assert_eq!((st.in_use, st.over_cap), (0, 0), "{st:?}");
    // The disposal stream plus at most 3 pooled ones.
    assert!(sim.counters().peak_streams <= 4);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Async waiters are served in arrival order, each woken exactly when it is its turn.
#[test]
fn async_waiters_fifo() {
    let (_sim, ctx) = capped(1);
    let mut holder = Some(ctx.owner());
    holder.as_ref().unwrap().stream().unwrap();
    let mut w = Waiters::new(&ctx, 5);
    assert_send(w.futs[0].as_ref().unwrap());
    for i in 0..5 {
        assert!(w.poll(i).is_none());
    }
    assert!(w.woken().is_empty());
    let mut order = Vec::new();
    let mut current = holder.take();
    for _ in 0..5 {
        assert!(w.woken().is_empty(), "woken before its turn");
        drop(current.take());
        let woken = w.woken();
        assert_eq!(woken.len(), 1, "exactly one waiter woken: {woken:?}");
        // Polling the others first changes nothing: only the first in line is served.
        for i in (0..5).rev() {
            if w.futs[i].is_some() && i != woken[0] {
                assert!(w.poll(i).is_none());
            }
        }
        current = Some(w.poll(woken[0]).expect("the woken waiter is served"));
        current.as_ref().unwrap().stream().unwrap();
        order.push(woken[0]);
    }
    assert_eq!(order, [0, 1, 2, 3, 4]);
    drop(current);
    let st = ctx.stats();
    assert_eq!((st.created, st.waits, st.in_use), (1, 5, 0), "{st:?}");
}

/// A waiter dropped at any point (before its first poll, queued, first in line, notified but
/// not yet polled, resolved) loses no wake-up for the others and leaks no stream or place.
#[test]
fn cancellation_at_every_point() {
    for point in 0..5 {
        for victim in 0..3 {
            let (sim, ctx) = capped(1);
            let holder = ctx.owner();
            holder.stream().unwrap();
            let mut w = Waiters::new(&ctx, 3);
            let mut served = Vec::new();
            match point {
                // Never polled: not in the queue at all.
                0 => {
                    w.cancel(victim);
                    for i in (0..3).filter(|&i| i != victim) {
                        assert!(w.poll(i).is_none());
                    }
                    drop(holder);
                }
                // Queued (first or not), not notified.
                1 => {
                    for i in 0..3 {
                        assert!(w.poll(i).is_none());
                    }
                    w.cancel(victim);
                    drop(holder);
                }
                // Notified (the holder released) but dropped before polling again.
                2 => {
                    for i in 0..3 {
                        assert!(w.poll(i).is_none());
                    }
                    drop(holder);
                    w.cancel(victim);
                }
                // Released with work pending: the first waiter armed a completion; dropped then.
                3 => {
                    sim.enqueue_work(holder.stream().unwrap().raw(), 1_000)
                        .unwrap();
                    for i in 0..3 {
                        assert!(w.poll(i).is_none());
                    }
                    drop(holder);
                    for i in 0..3 {
                        assert!(w.poll(i).is_none(), "served a busy stream");
                    }
                    w.cancel(victim);
                    sim.advance(1_000);
                }
                // Resolved, then the owner dropped at once.
                _ => {
                    for i in 0..3 {
                        assert!(w.poll(i).is_none());
                    }
                    drop(holder);
                    let first = w.woken()[0];
                    let o = w.poll(first).unwrap();
                    served.push(first);
                    drop(o);
                }
            }
            // Every remaining waiter is served in turn, each woken when it is first (a host
            // function on the simulation's thread wakes them at point 3). The deadline only turns
            // a lost wake-up into a failure instead of a hang.
            let deadline = Instant::now() + Duration::from_secs(20);
            while w.futs.iter().any(Option::is_some) {
                let woken = w.woken();
                if woken.is_empty() {
                    assert!(
                        Instant::now() < deadline,
                        "point {point}, victim {victim}: nobody woken, served {served:?}"
                    );
                    std::thread::yield_now();
                    continue;
                }
                for i in woken {
                    if w.futs[i].is_some() {
                        if let Some(o) = w.poll(i) {
                            served.push(i);
                            drop(o);
                        }
                    }
                }
            }
            let left: Vec<usize> = (0..3).filter(|&i| w.futs[i].is_some()).collect();
            let expect = if point == 4 { 3 } else { 2 };
            assert_eq!(
                (served.len(), left.len()),
                (expect, 0),
                "point {point}, victim {victim}: served {served:?}, stuck {left:?}"
            );
            // Nothing leaked: a new owner gets the (single) stream at once.
            let mut fresh = Waiters::new(&ctx, 1);
            assert!(fresh.poll(0).is_some(), "point {point}: the cap leaked");
            let st = ctx.stats();
            assert_eq!(st.created, 1, "{st:?}");
            assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
        }
    }
}

/// Cap 1 per key, two owners on two threads each holding one priority and then asking for the
/// other's: waiting while holding would deadlock; an owner that holds a stream never waits.
#[test]
fn no_deadlock_with_multi_priority_owners() {
    let (_sim, ctx) = capped(1);
    let barrier = Arc::new(Barrier::new(2));
    let run = |first: Priority, second: Priority| {
        let (ctx, barrier) = (ctx.clone(), barrier.clone());
        std::thread::spawn(move || {
            let o = ctx.owner();
            o.set_priority(first).unwrap();
            o.stream().unwrap();
            barrier.wait(); // both hold their first stream: each key is at its cap
            o.with_priority(second, || o.stream().map(|s| s.raw()))
                .unwrap()
                .unwrap();
            barrier.wait();
        })
    };
    let a = run(Priority::Normal, Priority::High);
    let b = run(Priority::High, Priority::Normal);
    a.join().unwrap();
    b.join().unwrap();
    let st = ctx.stats();
    assert_eq!((st.over_cap, st.waits), (2, 0), "{st:?}");
    // A first stream still waits at the cap (and is served once the owners are gone).
    let st = ctx.stats_for(Priority::Normal).unwrap();
    assert_eq!(st.live, 2, "{st:?}");
}

/// An owner at the cap of another key takes a second stream without waiting (over the cap), but
/// the creation fails: no stream was created, so none counts over the cap or in the peak.
// Regression: a failed creation for an owner already holding a stream counted in `over_cap` and
// `peak_live` (counted when the creation was reserved, not undone when it failed); found by the
// model's check that streams over the cap come from owners holding a stream.
#[test]
fn failed_creation_over_the_cap_counts_nothing() {
    let (sim, ctx) = capped(1);
    let high = ctx.owner();
    high.set_priority(Priority::High).unwrap();
    high.stream().unwrap(); // the High key is at its cap
    let o = ctx.owner();
    o.stream().unwrap(); // holds a Normal stream: its High stream bypasses the cap
    sim.fail_calls("cuStreamCreateWithPriority", ErrorCode::ERROR_UNKNOWN, 1);
    assert!(o.set_priority(Priority::High).is_err());
    assert_eq!(o.streams().len(), 1, "no High stream was taken");
    let st = ctx.stats_for(Priority::High).unwrap();
    assert_eq!((st.live, st.created), (1, 1), "{st:?}");
    assert_eq!((st.over_cap, st.peak_live), (0, 1), "{st:?}");
    // The next attempt creates it, over the cap, and counts it.
    o.set_priority(Priority::High).unwrap();
    let st = ctx.stats_for(Priority::High).unwrap();
    assert_eq!((st.live, st.over_cap, st.peak_live), (2, 1, 2), "{st:?}");
}

/// An owner that holds nothing waits while owners holding several priorities run on; they never
/// wait, so the waiter is served when they finish.
#[test]
fn waiter_behind_multi_priority_owners() {
    let (_sim, ctx) = capped(1);
    let a = ctx.owner();
    a.stream().unwrap();
    let mut w = Waiters::new(&ctx, 1);
    assert!(w.poll(0).is_none());
    a.with_priority(Priority::High, || a.stream().map(|_| ()))
        .unwrap()
        .unwrap();
    assert!(w.woken().is_empty());
    drop(a);
    assert_eq!(w.woken(), [0]);
    assert!(w.poll(0).is_some());
}

/// A blocking acquisition at the cap whose only candidate is a retired stream with work pending
/// parks (one host function armed on that stream, no polling of the driver), and wakes when the
/// work completes: the clock is moved by the test.
#[test]
fn blocking_acquire_wakes_when_busy_retired_stream_completes() {
    let (sim, ctx) = capped(1);
    let a = ctx.owner();
    let raw = a.stream().unwrap().raw();
    sim.enqueue_work(raw, 1_000).unwrap();
    drop(a); // retired, busy
    sim.clear_calls();
    let waiter = {
        let ctx = ctx.clone();
        std::thread::spawn(move || ctx.owner().stream().map(|s| s.raw()))
    };
    // Until the waiter has armed a host function on the busy stream.
    while !sim
        .calls()
        .iter()
        .any(|c| c.name == "cuLaunchHostFunc" && c.stream == Some(raw))
    {
        std::thread::yield_now();
    }
    let queries = |sim: &SimDriver| {
        sim.calls()
            .iter()
            .filter(|c| c.name == "cuStreamQuery")
            .count()
    };
    let before = queries(&sim);
    for _ in 0..100 {
        std::thread::yield_now();
    }
    assert_eq!(queries(&sim), before, "the waiter polls the driver");
    assert!(!waiter.is_finished(), "served a busy stream");
    assert_eq!(ctx.stats().created, 1);
    sim.advance(1_000);
    assert_eq!(waiter.join().unwrap().unwrap(), raw);
    let st = ctx.stats();
    assert_eq!((st.created, st.waits, st.in_use), (1, 1, 0), "{st:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Blocking waiters on threads are served first come, first served.
#[test]
fn blocking_waiters_fifo() {
    let (_sim, ctx) = capped(1);
    let holder = ctx.owner();
    holder.stream().unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let arrived = Arc::new(AtomicUsize::new(0));
    let mut hs = Vec::new();
    for i in 0..4 {
        let (c, order, arrived) = (ctx.clone(), order.clone(), arrived.clone());
        hs.push(std::thread::spawn(move || {
            let o = c.owner();
            arrived.fetch_add(1, Ordering::AcqRel);
            o.stream().unwrap();
            order.lock().unwrap().push(i);
        }));
        // The next thread starts only once this one waits in the queue.
        while ctx.stats().waits < i as u64 + 1 {
            std::thread::yield_now();
        }
    }
    drop(holder);
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), [0, 1, 2, 3]);
    assert_eq!(arrived.load(Ordering::Acquire), 4);
}

/// A cap of 0 is refused; the reserve may not exceed the cap.
#[test]
fn invalid_options() {
    let d: Arc<dyn Driver> = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(0));
    assert!(Context::primary_with(d.clone(), 0, opts).is_err());
    let (_sim, ctx) = capped(4);
    assert!(ctx.reserve(Priority::Normal, 5).is_err());
    assert_eq!(ctx.reserve(Priority::Normal, 4).unwrap(), 4);
    assert_eq!(ctx.stats().reserved, 4);
    assert_eq!(ContextOptions::default(), ContextOptions::unbounded());
    assert_eq!(ContextOptions::server().max_live_streams_per_key, Some(64));
}

/// The reserve, with a cap equal to it: every acquisition takes a reserved stream or waits for
/// one; none creates.
#[test]
fn reserve_with_cap_never_creates() {
    let (sim, ctx) = capped(8);
    assert_eq!(ctx.reserve(Priority::Normal, 8).unwrap(), 8);
    let created = sim.counters().streams_created;
    let hs: Vec<_> = (0..8)
        .map(|_| {
            let ctx = ctx.clone();
            std::thread::spawn(move || {
                for _ in 0..50 {
                    let o = ctx.owner();
                    o.stream().unwrap().synchronize().unwrap();
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    assert_eq!(sim.counters().streams_created, created);
    let st = ctx.stats();
    assert_eq!((st.misses, st.live, st.idle), (0, 8, 8), "{st:?}");
}

/// Reserved streams beyond MAX_IDLE stay through releases and `trim`; teardown destroys them.
#[test]
fn reserve_beyond_max_idle_stays() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d, 0).unwrap();
    assert_eq!(ctx.reserve(Priority::High, 40).unwrap(), 40);
    assert_eq!(ctx.reserve(Priority::High, 40).unwrap(), 0, "already there");
    let owners: Vec<_> = (0..40)
        .map(|_| {
            let o = ctx.owner();
            o.set_priority(Priority::High).unwrap();
            o.stream().unwrap();
            o
        })
        .collect();
    drop(owners);
    ctx.trim().unwrap();
    let st = ctx.stats();
    assert_eq!((st.idle, st.trimmed, st.misses), (40, 0, 0), "{st:?}");
    drop(ctx);
    assert_eq!(sim.counters().live_streams, 0);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// A release hands its idle stream straight to the first waiter (no attempt, no queue turn);
/// a waiter that leaves without taking it passes it to the next one, or back to the pool.
#[test]
fn a_handed_stream_is_never_lost() {
    let (sim, ctx) = capped(1);
    let holder = ctx.owner();
    let first = holder.stream().unwrap().raw();
    let mut w = Waiters::new(&ctx, 3);
    for i in 0..3 {
        assert!(w.poll(i).is_none());
    }
    drop(holder); // idle: handed to waiter 0
    assert_eq!(w.woken(), [0]);
    w.cancel(0); // leaves without it: handed to waiter 1
    assert_eq!(w.woken(), [1]);
    let o1 = w.poll(1).expect("served from its mailbox");
    assert_eq!(
        o1.stream().unwrap().raw(),
        first,
        "the same stream, handed on"
    );
    drop(o1); // handed to waiter 2, which leaves: back to the pool
    assert_eq!(w.woken(), [2]);
    w.cancel(2);
    let st = ctx.stats();
    assert_eq!((st.created, st.in_use, st.live), (1, 0, 1), "{st:?}");
    let again = ctx.owner();
    assert_eq!(
        again.stream().unwrap().raw(),
        first,
        "taken back from the pool"
    );
    drop(again);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// A waiter served from its mailbox (a stream a release handed to it) passes on the
/// notifications it had not acted on: each stands for a stream that came back to the pool.
/// Pins the fuzzer's finding `not-woken-at-cap-efdd1817` (campaign 7): the mailbox path counted
/// as an attempt that used one, so the next waiter was never woken while an idle stream lay in
/// the pool.
#[test]
fn a_waiter_served_from_its_mailbox_passes_on_what_came_back() {
    let (sim, ctx) = capped(3);
    let (a, b, c) = (ctx.owner(), ctx.owner(), ctx.owner());
    let busy = [a.stream().unwrap().raw(), b.stream().unwrap().raw()];
    c.stream().unwrap();
    let mut w = Waiters::new(&ctx, 3);
    for i in 0..3 {
        assert!(w.poll(i).is_none());
    }
    for s in busy {
        sim.enqueue_work(s, 1_000).unwrap();
    }
    drop((a, b)); // busy: back to the pool, waiter 0 notified twice
    assert_eq!(w.woken(), [0, 0]);
    sim.advance(1_000); // both idle now
    let o0 = w.poll(0).expect("served by one of them");
    assert_eq!(
        w.woken(),
        [1],
        "waiter 1 inherits the other one's notification"
    );
    drop(c); // idle: handed to waiter 1's mailbox (waiter 1 not polled since)
    assert_eq!(w.woken(), [1]);
    let o1 = w.poll(1).expect("served from its mailbox");
    assert_eq!(
        w.woken(),
        [2],
        "the next waiter is woken: an idle stream is still in the pool"
    );
    let o2 = w.poll(2).expect("served by the stream in the pool");
    assert!(busy.contains(&o2.stream().unwrap().raw()));
    drop((o0, o1, o2));
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// `Owner::try_stream` (issue 21: async code that must not park its worker at the cap): at the
// cap it fails at once with `Error::AtCap`; it never passes a queued waiter (first come, first
// served, also when a stream comes back while the waiter has not polled again); once nobody
// waits and a stream is free, it succeeds. An owner that holds a stream already tries nothing.
#[test]
fn try_stream_fails_at_the_cap_and_never_passes_a_queued_waiter() {
    let (sim, ctx) = capped(1);
    let a = ctx.owner();
    let sa = a.try_stream().unwrap();
    let c = ctx.owner();
    let e = c.try_stream().unwrap_err();
    assert!(
        matches!(e, cuda_stream_pool::Error::AtCap { cap: 1, .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("cap of 1"), "{e}");
    let mut w = Waiters::new(&ctx, 1);
    assert!(w.poll(0).is_none(), "the waiter queues");
    drop(sa);
    drop(a);
    sim.advance(0);
    // The stream that came back is the waiter's, though it has not polled since.
    assert!(
        matches!(c.try_stream(), Err(cuda_stream_pool::Error::AtCap { .. })),
        "try_stream took the stream of a queued waiter"
    );
    let b = w.poll(0).expect("the waiter is served");
    let sb = b.stream().unwrap();
    assert!(c.try_stream().is_err(), "B holds the only stream");
    drop(sb);
    drop(b);
    sim.advance(0);
    let sc = c.try_stream().expect("free, nobody waits");
    // Holding one, it is a plain `stream()`.
    assert_eq!(c.try_stream().unwrap().raw(), sc.raw());
    assert_eq!(ctx.stats().over_cap, 0);
}

/// A long queue of async waiters, some of which leave from its middle, is served in the order
/// they joined, each exactly when its turn comes (the queue finds a waiter by binary search over
/// the ids, in join order: issue 22, the cap-64 server; a search that found the wrong waiter, or
/// none after a removal from the middle, would serve out of order or never).
#[test]
fn a_long_queue_with_waiters_leaving_from_its_middle_is_served_in_join_order() {
    let (_sim, ctx) = capped(1);
    let w = Waker::from(Arc::new(futs::Noop));
    let holder = ctx.owner();
    holder.stream().unwrap();
    let mut waiting: Vec<Option<Pin<Box<OwnerReady>>>> = (0..300)
        .map(|_| Some(Box::pin(ctx.owner().ready())))
        .collect();
    for f in waiting.iter_mut().flatten() {
        assert!(futs::poll(f.as_mut(), &w).is_pending());
    }
    // Every third waiter leaves, and the 200th: from the front half, the middle and the back.
    for (i, f) in waiting.iter_mut().enumerate() {
        if i % 3 == 1 || i == 200 {
            *f = None;
        }
    }
    drop(holder);
    let order: Vec<usize> = (0..waiting.len())
        .filter(|i| waiting[*i].is_some())
        .collect();
    for (k, &i) in order.iter().enumerate() {
        // Every later waiter still waits: the stream is the current one's.
        for &j in order[k + 1..].iter().take(3) {
            let f = waiting[j].as_mut().unwrap();
            assert!(
                futs::poll(f.as_mut(), &w).is_pending(),
                "waiter {j} was served before waiter {i}"
            );
        }
        let f = waiting[i].as_mut().unwrap();
        match futs::poll(f.as_mut(), &w) {
            Poll::Ready(owner) => drop(owner.unwrap()),
            Poll::Pending => panic!("waiter {i} was not served in its turn"),
        }
    }
    let st = ctx.stats();
    assert_eq!((st.live, st.in_use, st.handed), (1, 0, 0), "{st:?}");
}
