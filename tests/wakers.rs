//! Wakers that re-enter the crate: their wake or their drop runs crate code (an owner dropped,
//! a future polled inline). The crate runs no user code while it holds one of its locks, so
//! none of these deadlocks.
//!
//! A deadlock of the old code is a thread relocking a `std::sync::Mutex` it holds: each scenario
//! runs on a thread of its own, and the test fails when that thread has not finished after
//! [`HANG`] (a hang guard only: the scenarios finish in microseconds when nothing deadlocks).

#[path = "common/futures.rs"]
mod futures_util;
use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::DeviceBuffer;
use cuda_stream_pool::{Context, ContextOptions, Owner, OwnerReady};
use futures_util::{poll, waker, Noop};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Poll, Wake, Waker};
use std::time::Duration;

const HANG: Duration = Duration::from_secs(60);

/// Runs `f` on a thread of its own; fails the test ("deadlock") when it has not finished after
/// [`HANG`].
fn finishes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(HANG) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("deadlock: {what} did not finish within {HANG:?}"),
    }
}

fn capped(n: usize) -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(n));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    (sim, ctx)
}

/// A waker that owns an `Owner`: dropping the waker's last reference drops the owner, which
/// gives its stream back to the pool (and hands it to a waiter of the gate).
struct HoldsOwner(#[allow(dead_code)] Mutex<Option<Owner>>);
impl Wake for HoldsOwner {
    fn wake(self: Arc<Self>) {}
}

fn holding(o: Owner) -> Waker {
    Waker::from(Arc::new(HoldsOwner(Mutex::new(Some(o)))))
}

// Regression: issue 19 defect 5 (a waker replaced under the gate's queue lock drops an Owner)
#[test]
fn replacing_a_waiters_waker_that_owns_an_owner_does_not_deadlock() {
    let (_sim, ctx) = capped(1);
    let r = finishes("polling with a new waker", move || {
        let holder = ctx.owner();
        holder.stream().unwrap(); // the key's only stream
        let mut fut = Box::pin(ctx.owner().ready());
        let w1 = holding(holder);
        assert!(poll(fut.as_mut(), &w1).is_pending(), "at the cap: waits");
        drop(w1); // the gate's queue holds the last clone
        let (count, w2) = waker();
        // Another waker: the queue replaces (drops) the first one, which drops the holder: its
        // stream goes back and is handed to this very waiter.
        let second = poll(fut.as_mut(), &w2);
        let woken = count.0.load(Ordering::SeqCst);
        let third = poll(fut.as_mut(), &w2);
        (second.is_pending(), woken, third.map(|r| r.is_ok()))
    });
    assert!(r.0, "the second poll had no stream yet");
    assert_eq!(
        r.1, 1,
        "the stream handed to the waiter woke its new waker once"
    );
    assert_eq!(
        r.2,
        Poll::Ready(true),
        "the handed stream serves the waiter"
    );
}

// Regression: issue 19 defect 5 (a leaving waiter's waker dropped under the gate's queue lock)
#[test]
fn a_leaving_waiters_waker_that_owns_an_owner_does_not_deadlock() {
    let (_sim, ctx) = capped(1);
    let r = finishes("dropping a waiting future", move || {
        let holder = ctx.owner();
        holder.stream().unwrap();
        let mut first = Box::pin(ctx.owner().ready());
        let w1 = holding(holder);
        assert!(poll(first.as_mut(), &w1).is_pending());
        drop(w1);
        let mut second = Box::pin(ctx.owner().ready());
        let (count, w2) = waker();
        assert!(poll(second.as_mut(), &w2).is_pending());
        // The first waiter leaves: the queue drops its waker, which drops the holder; the
        // stream goes to the second waiter.
        drop(first);
        let woken = count.0.load(Ordering::SeqCst);
        (woken, poll(second.as_mut(), &w2).map(|r| r.is_ok()))
    });
    assert!(r.0 >= 1, "the second waiter was not woken");
    assert_eq!(
        r.1,
        Poll::Ready(true),
        "the stream serves the second waiter"
    );
}

/// A task whose waker polls its future inline (as some executors do), once enabled. A wake that
/// arrives while the future is being polled only counts.
struct Inline {
    fut: Mutex<Option<Pin<Box<OwnerReady>>>>,
    inline: AtomicBool,
    /// Wake-ups that only count although `inline` is set.
    skip: AtomicUsize,
    wakes: AtomicUsize,
    /// Set by a wake-up whose inline poll found the future being polled elsewhere.
    again: AtomicBool,
    got: Mutex<Option<bool>>,
}

impl Inline {
    fn new(f: OwnerReady) -> Arc<Inline> {
        Arc::new(Inline {
            fut: Mutex::new(Some(Box::pin(f))),
            inline: AtomicBool::new(false),
            skip: AtomicUsize::new(0),
            wakes: AtomicUsize::new(0),
            again: AtomicBool::new(false),
            got: Mutex::new(None),
        })
    }

    fn poll(self: &Arc<Self>) -> bool {
        loop {
            let Ok(mut g) = self.fut.try_lock() else {
                // Being polled on another thread: that poll polls again once it lets go (a
                // wake-up that arrives during a poll is one the executor must act on).
                self.again.store(true, Ordering::SeqCst);
                return false;
            };
            let Some(f) = g.as_mut() else {
                return true;
            };
            self.again.store(false, Ordering::SeqCst);
            let w = Waker::from(self.clone());
            match f.as_mut().poll(&mut std::task::Context::from_waker(&w)) {
                Poll::Pending => {
                    drop(g);
                    // A wake-up that found the future locked meanwhile: poll again.
                    if !self.again.load(Ordering::SeqCst) {
                        return false;
                    }
                }
                Poll::Ready(r) => {
                    *self.got.lock().unwrap() = Some(r.is_ok());
                    *g = None;
                    return true;
                }
            }
        }
    }
}

impl Wake for Inline {
    fn wake(self: Arc<Self>) {
        self.wakes.fetch_add(1, Ordering::SeqCst);
        if self.inline.load(Ordering::SeqCst)
            && self
                .skip
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_err()
        {
            self.poll();
        }
    }
}

impl Inline {
    /// What the future resolved to once no poll of it is in progress. A wake-up from another
    /// thread (the armed waiter's periodic fault poll, from the crate's background thread) may
    /// be polling it inline when the wake-up under test arrives: that one then finds it locked
    /// and leaves the poll to it, which polls again and is served, but may not have finished
    /// when the test reads the result (the test failed 5 times in 40 runs of its file).
    fn settled(&self) -> Option<bool> {
        let t = std::time::Instant::now();
        loop {
            if let Ok(_g) = self.fut.try_lock() {
                return *self.got.lock().unwrap();
            }
            assert!(t.elapsed() < HANG, "a hang: a poll never ended");
            std::thread::yield_now();
        }
    }
}

fn wait_idle(sim: &SimDriver, raw: cuda_stream_pool::driver::Stream) {
    let t = std::time::Instant::now();
    while sim.is_busy(raw) {
        assert!(t.elapsed() < HANG, "the stream never became idle");
        std::thread::yield_now();
    }
}

// Regression: issue 19 defect 6 (trim wakes a waiter under a shard lock; its inline poll relocks it)
#[test]
fn trim_wakes_an_inline_polling_waiter_after_releasing_the_pool() {
    let (sim, ctx) = capped(2);
    let task = finishes("trim waking an inline waiter", move || {
        let (a, b) = (ctx.owner(), ctx.owner());
        let (sa, sb) = (a.stream().unwrap().raw(), b.stream().unwrap().raw());
        sim.enqueue_work(sa, 1_000).unwrap();
        sim.enqueue_work(sb, 1_000_000_000).unwrap();
        drop((a, b)); // both retired, busy, in this thread's shard
        let task = Inline::new(ctx.owner().ready());
        assert!(!task.poll(), "at the cap, both retired streams busy: waits");
        sim.advance(1_000); // the first stream's work completes (its wake-up function runs)
        wait_idle(&sim, sa);
        task.inline.store(true, Ordering::SeqCst);
        // Destroys the idle stream: a stream of the key is gone, the waiter is woken and polls
        // inline, searching the pool's shards.
        ctx.trim().unwrap();
        task
    });
    assert_eq!(
        task.settled(),
        Some(true),
        "the waiter was not served by the destroyed stream's place (woken {} times)",
        task.wakes.load(Ordering::SeqCst)
    );
}

// Regression: issue 19 defect 6 (a release's trim of the excess wakes a waiter under a shard lock)
#[test]
fn trimming_the_excess_wakes_an_inline_polling_waiter_after_releasing_the_pool() {
    let n = cuda_stream_pool::MAX_IDLE + 2;
    let (sim, ctx) = capped(n);
    let task = finishes("a release trimming the excess", move || {
        let owners: Vec<Owner> = (0..n).map(|_| ctx.owner()).collect();
        let raws: Vec<_> = owners.iter().map(|o| o.stream().unwrap().raw()).collect();
        sim.enqueue_work(raws[0], 1_000).unwrap();
        for &r in &raws[1..] {
            sim.enqueue_work(r, 1_000_000_000).unwrap();
        }
        let task = Inline::new(ctx.owner().ready());
        assert!(!task.poll(), "at the cap: waits");
        let mut owners = owners.into_iter();
        let last = owners.next_back().unwrap();
        let _kept = owners.next_back().unwrap();
        drop(owners); // MAX_IDLE retired, all busy
        sim.advance(1_000); // the first one's work completes
        wait_idle(&sim, raws[0]);
        // The release notifies the waiter first (that wake-up only counts: polled then, the
        // waiter would take the idle stream), then trims: one more retired stream than kept
        // destroys the idle one, and the waiter, woken again, polls inline.
        task.skip.store(1, Ordering::SeqCst);
        task.inline.store(true, Ordering::SeqCst);
        drop(last);
        task
    });
    assert_eq!(
        task.settled(),
        Some(true),
        "the waiter was not served (woken {} times)",
        task.wakes.load(Ordering::SeqCst)
    );
}

// Regression: issue 19 defect 14 (a forgotten OwnerReady starves the later waiters of its key)
/// The documented limit (crate docs, "Leaks"): a forgotten waiting `OwnerReady` keeps its place
/// in the queue forever, like an owner that never drops; the stream that comes back first is
/// handed to it and lost with it (the key's cap is one stream smaller from then on), and the
/// waiters behind it are served by the releases after that.
#[test]
fn a_forgotten_waiter_costs_one_stream_and_later_waiters_are_served() {
    let (_sim, ctx) = capped(2);
    let (a, b) = (ctx.owner(), ctx.owner());
    a.stream().unwrap();
    b.stream().unwrap();
    let (_, w) = waker();
    let mut leaked = Box::pin(ctx.owner().ready());
    assert!(poll(leaked.as_mut(), &w).is_pending());
    std::mem::forget(leaked);
    let mut later = Box::pin(ctx.owner().ready());
    assert!(poll(later.as_mut(), &w).is_pending());
    drop(a); // handed to the forgotten waiter: lost with it
    assert!(poll(later.as_mut(), &w).is_pending());
    assert_eq!(ctx.stats().handed, 1, "the forgotten waiter's stream");
    drop(b); // the next release serves the later waiter
    match poll(later.as_mut(), &w) {
        Poll::Ready(Ok(o)) => drop(o),
        other => panic!("the waiter behind a forgotten one was not served: {other:?}"),
    }
}

/// A waker whose *clone* runs crate code: clone number `at` drops the `Owner` it holds (which
/// gives a stream back to the pool, and the pool offers it to the gate's queue). A
/// `RawWakerVTable` is the only way to make a clone user code; executors' clones are usually
/// a reference count, but nothing in `Waker`'s contract says so.
struct CloneDrops {
    owner: Mutex<Option<Owner>>,
    clones: AtomicUsize,
    at: usize,
}

fn clone_drops(o: Owner, at: usize) -> (Arc<CloneDrops>, Waker) {
    use std::task::{RawWaker, RawWakerVTable};
    unsafe fn clone(p: *const ()) -> RawWaker {
        // SAFETY: `p` came from `Arc::into_raw` of a `CloneDrops` that this waker keeps alive
        // (one count per waker); the count is raised for the new waker.
        let a = unsafe {
            Arc::increment_strong_count(p as *const CloneDrops);
            &*(p as *const CloneDrops)
        };
        if a.clones.fetch_add(1, Ordering::SeqCst) + 1 == a.at {
            let o = a.owner.lock().unwrap().take();
            drop(o); // crate code: the owner's stream goes back to the pool
        }
        RawWaker::new(p, &VTABLE)
    }
    unsafe fn drop_raw(p: *const ()) {
        // SAFETY: the count this waker held (see `clone`).
        unsafe { Arc::decrement_strong_count(p as *const CloneDrops) };
    }
    unsafe fn wake(p: *const ()) {
        // SAFETY: as `drop_raw`: waking by value consumes the waker.
        unsafe { drop_raw(p) }
    }
    unsafe fn wake_by_ref(_: *const ()) {}
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, wake, wake_by_ref, drop_raw);
    let a = Arc::new(CloneDrops {
        owner: Mutex::new(Some(o)),
        clones: AtomicUsize::new(0),
        at,
    });
    let raw = RawWaker::new(Arc::into_raw(a.clone()) as *const (), &VTABLE);
    // SAFETY: the vtable's functions keep the contract of `RawWakerVTable` (a clone is a new
    // strong count, a drop or wake by value gives one back; none is ever called after the last).
    (a, unsafe { Waker::from_raw(raw) })
}

// Regression: issue 19 review finding (a waiter's waker cloned under the gate's queue lock when a
// release hands it a stream: a clone that gives back a stream relocked the queue)
#[test]
fn a_waker_whose_clone_releases_a_stream_does_not_deadlock_the_gate() {
    // Whichever clone gives the stream back (when the waiter joins, re-registers, or is handed
    // a stream by `a`'s release), the waiter is served and the key keeps its two streams.
    for at in 1..=4 {
        let (_sim, ctx) = capped(2);
        let r = finishes(
            "a release handing a stream to a cloning waiter",
            move || {
                let (a, b) = (ctx.owner(), ctx.owner());
                a.stream().unwrap();
                b.stream().unwrap();
                let (state, w) = clone_drops(b, at);
                let mut fut = Box::pin(ctx.owner().ready());
                let mut served = matches!(poll(fut.as_mut(), &w), Poll::Ready(Ok(_)));
                drop(a);
                for _ in 0..3 {
                    if !served {
                        served = matches!(poll(fut.as_mut(), &w), Poll::Ready(Ok(_)));
                    }
                }
                drop(fut);
                (
                    state.clones.load(Ordering::SeqCst),
                    served,
                    ctx.stats().live,
                )
            },
        );
        assert!(r.0 >= 1, "clone {at}: the waiter's waker was never cloned");
        assert!(r.1, "clone {at}: the waiter was not served");
        assert!(r.2 <= 2, "clone {at}: {} streams of a key capped at 2", r.2);
    }
}

// Regression: issue 19 review finding (a new waker cloned under the gate's queue lock when a
// waiting future is polled with another waker)
#[test]
fn polling_a_waiter_with_a_new_waker_whose_clone_releases_a_stream_does_not_deadlock() {
    let (_sim, ctx) = capped(1);
    let r = finishes("re-polling with a cloning waker", move || {
        let holder = ctx.owner();
        holder.stream().unwrap();
        let (_, plain) = waker();
        let mut fut = Box::pin(ctx.owner().ready());
        assert!(poll(fut.as_mut(), &plain).is_pending(), "at the cap: waits");
        let (state, w) = clone_drops(holder, 1);
        // The queue stores a clone of the new waker; cloning gives the only stream back.
        let second = poll(fut.as_mut(), &w);
        let served = match second {
            Poll::Ready(r) => r.is_ok(),
            Poll::Pending => matches!(poll(fut.as_mut(), &w), Poll::Ready(Ok(_))),
        };
        (state.clones.load(Ordering::SeqCst), served)
    });
    assert!(r.0 >= 1, "the new waker was never cloned");
    assert!(
        r.1,
        "the stream given back by the clone did not serve the waiter"
    );
}

// Regression: issue 19 review finding (the next waiter's waker cloned under the queue lock when
// the first waiter leaves and passes its turn on). Since review 26 a turn passed on wakes the
// waiter's kept waker by reference (no clone at all); the waker is cloned once, when the waiter
// registers it, and a clone that gave the stream back then would still deadlock nothing.
#[test]
fn a_leaving_waiter_passing_its_turn_to_a_cloning_waker_does_not_deadlock() {
    let (_sim, ctx) = capped(2);
    let r = finishes("leaving before a cloning waiter", move || {
        let (a, b) = (ctx.owner(), ctx.owner());
        a.stream().unwrap();
        b.stream().unwrap();
        let (_, plain) = waker();
        let mut first = Box::pin(ctx.owner().ready());
        assert!(poll(first.as_mut(), &plain).is_pending());
        let mut second = Box::pin(ctx.owner().ready());
        assert!(poll(second.as_mut(), &plain).is_pending());
        // The second waiter now waits with a waker whose clone gives back `b`'s stream.
        // Registering it makes the first clone; the second, when the stream is passed on to
        // this waiter, gives `b`'s stream back.
        let (state, w) = clone_drops(b, 2);
        assert!(poll(second.as_mut(), &w).is_pending());
        drop(a); // handed to the first waiter
        drop(first); // leaves with it: the stream goes to the second waiter
        let served = matches!(poll(second.as_mut(), &w), Poll::Ready(Ok(_)))
            || matches!(poll(second.as_mut(), &w), Poll::Ready(Ok(_)));
        (state.clones.load(Ordering::SeqCst), served)
    });
    assert!(r.0 >= 1, "the waker was not registered");
    assert!(r.1, "the second waiter was not served");
}

/// A waker that polls its future inline when woken (legal: `Waker::wake` may do anything).
struct InlineSender {
    fut: Mutex<Option<Pin<Box<OwnerReady>>>>,
    tx: Mutex<mpsc::Sender<cuda_stream_pool::Result<Owner>>>,
}

impl Wake for InlineSender {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let Ok(mut g) = self.fut.try_lock() else {
            return;
        };
        let Some(f) = g.as_mut() else { return };
        let w = Waker::from(self.clone());
        if let Poll::Ready(r) = poll(f.as_mut(), &w) {
            *g = None;
            let _ = self.tx.lock().unwrap().send(r);
        }
    }
}

/// Regression (review 2, finding 3: driver calls from a host function; a spurious failure, a
/// deadlock on some drivers). The gate's wake-up host function (`Pool::arm`) calls `Gate::notify`, which runs the
/// user's `Waker` on the driver's host-function thread. A waker that polls the `OwnerReady`
/// inline reaches `OwnerReady::poll`, which sees `on_host_fn_thread()` and calls
/// `owner.stream()`: `Pool::acquire` (mode `Fail`) then calls `attempt`, i.e. the driver
/// (`cuThreadExchangeStreamCaptureMode`, `cuStreamQuery`, `cuStreamCreate`), from a host
/// function. The real driver refuses (CUDA_ERROR_NOT_PERMITTED) or deadlocks; the task loses its
/// owner to the error although a stream is free.
#[test]
fn a_waker_polling_inline_from_the_wake_up_host_function_makes_no_driver_call_there() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let first = ctx.owner();
    sim.enqueue_work(first.stream().unwrap().raw(), 1_000)
        .unwrap();
    drop(first); // the only stream is retired, busy for 1 µs
    let (tx, rx) = mpsc::channel();
    let inline = Arc::new(InlineSender {
        fut: Mutex::new(Some(Box::pin(ctx.owner().ready()))),
        tx: Mutex::new(tx),
    });
    {
        let mut g = inline.fut.lock().unwrap();
        let w = Waker::from(inline.clone());
        // At the cap, the retired stream busy: waits (arms the wake-up host function).
        assert!(poll(g.as_mut().unwrap().as_mut(), &w).is_pending());
    }
    sim.advance(1_000); // the stream's work completes: the host function wakes the waker
    let got = rx
        .recv_timeout(HANG)
        .expect("the waiter was never resolved");
    let misuse = sim.misuse();
    assert!(
        misuse.is_empty(),
        "the crate's host function led to driver calls: {misuse:?}"
    );
    let owner = got.expect("the waiter failed although the stream had come back");
    drop(owner);
}

/// A waker that panics (for instance an executor's `expect` on a closed channel).
struct Panicking(AtomicBool);
impl Wake for Panicking {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
        panic!("review2: a waker that panics");
    }
}

/// Regression (review 2, finding 4: host memory the GPU still wrote was handed to another copy,
/// and every later completion of the context was never woken). The poller thread calls wakers inside
/// `mine.retain(..)` without catching panics: a panicking waker unwinds the poller, which drops
/// `mine`, the entries it was watching. A dropped `HostCopy`'s entry keeps its staging block in
/// `EntryState::keep` (a `Back`), whose destructor returns the block to the free list: the block
/// goes back while the DtoH copy into it is still pending, the next `to_vec_async` of that size
/// takes it, and the old copy overwrites the new copy's result. (The poller is also dead for good:
/// `submit` never restarts it, so later `Completion`s are never woken.)
#[test]
fn a_panicking_waker_neither_stops_the_poller_nor_recycles_a_staging_block_under_a_pending_copy() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (a, b, c) = (ctx.owner(), ctx.owner(), ctx.owner());
    let (sa, sb, sc) = (
        a.stream().unwrap(),
        b.stream().unwrap(),
        c.stream().unwrap(),
    );
    let old = DeviceBuffer::from_slice(&sb, &[2u32; 16]).unwrap();
    let new = DeviceBuffer::from_slice(&sc, &[3u32; 16]).unwrap();
    // A copy to the host on `sb`, behind long work; its future is dropped (the entry keeps the
    // staging block until the copy has landed).
    sim.enqueue_work(sb.raw(), 1_000_000).unwrap();
    drop(old.to_vec_async(&sb).unwrap());
    // A completion on `sa`, awaited by a waker that panics.
    sim.enqueue_work(sa.raw(), 1_000).unwrap();
    let mut done = Box::pin(sa.completed().unwrap());
    let p = Arc::new(Panicking(AtomicBool::new(false)));
    assert!(poll(done.as_mut(), &Waker::from(p.clone())).is_pending());
    // Let the poller take both entries: two whole passes after both were submitted.
    let passes = || ctx.model_poller_progress().map_or(0, |p| p.0);
    let first = passes();
    let t = std::time::Instant::now();
    while passes() < first + 2 {
        assert!(t.elapsed() < HANG, "a hang: the poller makes no pass");
        std::thread::yield_now();
    }
    sim.advance(1_000); // `sa`'s work completes: the poller runs the panicking waker
    while !p.0.load(Ordering::SeqCst) {
        assert!(t.elapsed() < HANG, "a hang: the waker was never called");
        std::thread::yield_now();
    }
    // The poller goes on (it contains the panic): a later pass has run.
    let after = passes();
    while passes() < after + 1 {
        assert!(
            t.elapsed() < HANG,
            "the poller stopped after the panicking waker"
        );
        std::thread::yield_now();
    }
    // A new copy of the same size class; it lands at once.
    let mut copy = Box::pin(new.to_vec_async(&sc).unwrap());
    sim.advance(0);
    // The old copy lands later (its stream's work ends), before the new one is read.
    sim.advance(1_000_000);
    let w = Waker::from(Arc::new(Noop));
    let Poll::Ready(v) = poll(copy.as_mut(), &w) else {
        panic!("the copy has landed")
    };
    assert_eq!(
        v.unwrap(),
        vec![3u32; 16],
        "the staging block of a pending copy was handed to another copy"
    );
    drop(done);
    ctx.synchronize().unwrap();
}
