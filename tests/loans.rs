//! Loans keep what they lend: a stream lent to another crate (`StreamRef::lend`, the mechanism
//! behind `cudarc_stream`) keeps its context (primary or adopted, with what keeps an adopted one
//! alive) for as long as the loan lasts, even when the `Context` is dropped first; and a lent
//! stream counts against its key's cap, and shows in the statistics, until it comes back.

#[path = "common/futures.rs"]
mod futures;

use cuda_stream_pool::driver::{CaptureMode, CaptureStatus, Driver, SimDriver, Stream};
use cuda_stream_pool::{Context, ContextOptions, DeviceBuffer, Error, ErrorCode, StreamRef};
use futures::{poll, Noop, Yield};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::task::Waker;
use std::time::Duration;

/// A hang bound only: the scenarios finish at once when nothing deadlocks.
const TIMEOUT: Duration = Duration::from_secs(60);

fn setup() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    (sim, ctx)
}

/// Another crate's handle of a stream (what cudarc's `CudaStream` is).
#[derive(Debug)]
struct Foreign(Stream);

fn lend(s: &cuda_stream_pool::StreamRef<'_>) -> Arc<Foreign> {
    s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap()
}

/// What keeps an adopted context alive (cudarc's `Arc<CudaContext>` and keeper stream, in
/// `from_cudarc`): records when it is dropped.
struct KeepAlive(Arc<AtomicBool>);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The tests of this file run one at a time, every one of them: a state left lingering by one
/// would be torn down by another's operations (as it should), racing the first test's own checks.
/// (Five later tests did not take the lock; CI failed once, on a 2-core machine under load, with
/// `a_loan_keeps_its_primary_context_until_it_ends_then_everything_is_released` finding its
/// context still alive: another test's acquisition had taken its ended lingering state and was
/// tearing it down on its own thread.)
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Any later operation of the crate (here a new context's creation) ends what lingered for loans
/// that have ended since.
fn later_crate_operation(sim: &Arc<SimDriver>) {
    drop(Context::primary(sim.clone(), 0).unwrap());
}

// Regression: issue 19 defect 10 (an adopted context was released while a loan is out)
#[test]
fn a_loan_keeps_an_adopted_contexts_keep_alive_until_it_ends() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    d.init().unwrap();
    let dev = d.device_get(0).unwrap();
    let raw = d.primary_ctx_retain(dev).unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let keep: Box<dyn std::any::Any + Send + Sync> = Box::new(KeepAlive(dropped.clone()));
    // SAFETY: `raw` is retained above and released at the end, after everything made from it.
    let ctx = unsafe { Context::adopt(d.clone(), raw, Some(keep)) }.unwrap();
    let o = ctx.owner();
    let h = lend(&o.stream().unwrap());
    drop(o);
    drop(ctx);
    assert!(
        !dropped.load(Ordering::SeqCst),
        "the adopted context's keep-alive was dropped while a loan of its stream is out"
    );
    // The borrower's handle is still a live stream of a live context.
    // SAFETY: the loan keeps the stream alive (the simulation reports any misuse).
    assert!(unsafe { d.stream_query(h.0) }.unwrap());
    later_crate_operation(&sim);
    assert!(
        !dropped.load(Ordering::SeqCst),
        "dropped while the loan is out"
    );
    drop(h);
    later_crate_operation(&sim);
    assert!(
        dropped.load(Ordering::SeqCst),
        "the keep-alive outlived the loan"
    );
    assert_eq!(sim.counters().live_streams, 0, "{:?}", sim.counters());
    // SAFETY: retained once above; nothing of the state uses it any more.
    unsafe { d.primary_ctx_release(dev) }.unwrap();
    assert_eq!(sim.counters().live_contexts, 0);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Regression: issue 19 defect 3 (what a loan relies on died with the Context, or lived forever)
#[test]
fn a_loan_keeps_its_primary_context_until_it_ends_then_everything_is_released() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (ha, hb) = (lend(&a.stream().unwrap()), lend(&b.stream().unwrap()));
    drop((a, b));
    drop(ctx);
    assert_eq!(sim.counters().live_contexts, 1, "{:?}", sim.counters());
    // The borrower uses both streams after the `Context` is gone.
    sim.enqueue_work(ha.0, 1_000).unwrap();
    // SAFETY: the loans keep both streams alive.
    unsafe { sim.stream_synchronize(ha.0) }.unwrap();
    assert!(unsafe { sim.stream_query(hb.0) }.unwrap());
    drop(ha);
    later_crate_operation(&sim);
    assert_eq!(
        sim.counters().live_contexts,
        1,
        "released while a loan is still out"
    );
    // SAFETY: `hb`'s loan keeps its stream alive.
    assert!(unsafe { sim.stream_query(hb.0) }.unwrap());
    drop(hb);
    later_crate_operation(&sim);
    let c = sim.counters();
    assert_eq!(
        (c.live_contexts, c.live_streams, c.live_allocs),
        (0, 0, 0),
        "the state outlived its last loan: {c:?}"
    );
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Regression: issue 19 defect 13 (a lent stream let its key exceed the cap, and the excess stayed)
#[test]
fn a_lent_stream_counts_against_the_cap_until_it_comes_back() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let a = ctx.owner();
    let h = lend(&a.stream().unwrap());
    drop(a); // the owner is gone, the loan is out
    let st = ctx.stats();
    assert_eq!((st.live, st.lent, st.in_use), (1, 1, 1), "{st:?}");
    assert_eq!(st.live, st.in_use + st.idle + st.retired_busy + st.handed);
    // A second owner must wait for the lent stream (the key is at its cap), not create one.
    let (tx, rx) = mpsc::channel();
    let c = ctx.clone();
    let waiter = std::thread::spawn(move || {
        let o = c.owner();
        let raw = o.stream().map(|s| s.raw());
        tx.send(raw.map_err(|e| e.to_string())).unwrap();
        drop(o);
    });
    let early = loop {
        if let Ok(r) = rx.try_recv() {
            break Some(r);
        }
        if ctx.stats().waits == 1 {
            break None;
        }
        std::thread::yield_now();
    };
    assert!(
        early.is_none(),
        "a second owner got a stream while the only one allowed is lent: {early:?} {:?}",
        ctx.stats()
    );
    assert_eq!(ctx.stats().live, 1, "created beyond the cap");
    let lent_raw = h.0;
    drop(h); // the loan ends: the waiter gets the stream
    let got = rx.recv().unwrap().unwrap();
    waiter.join().unwrap();
    assert_eq!(got, lent_raw, "the lent stream came back");
    ctx.trim().unwrap();
    let st = ctx.stats();
    assert!(
        st.peak_live <= 1 && st.live <= 1 && st.created == 1,
        "{st:?}"
    );
    assert_eq!(st.lent, 0);
}

// Regression: issue 19 defect 13 (a lent stream let its key exceed the cap: the async path)
#[test]
fn an_async_waiter_at_the_cap_waits_for_a_lent_stream_then_gets_it() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let a = ctx.owner();
    let h = lend(&a.stream().unwrap());
    drop(a);
    let (count, w) = futures::waker();
    let mut fut = Box::pin(ctx.owner().ready());
    assert!(
        futures::poll(fut.as_mut(), &w).is_pending(),
        "an async acquisition got a stream while the only one allowed is lent: {:?}",
        ctx.stats()
    );
    assert_eq!((ctx.stats().live, ctx.stats().waits), (1, 1));
    let lent_raw = h.0;
    drop(h); // nothing of the crate runs: the waiter looks for the loan's end itself
    let owner = loop {
        let seen = count.0.load(Ordering::SeqCst);
        match futures::poll(fut.as_mut(), &w) {
            std::task::Poll::Ready(r) => break r.unwrap(),
            std::task::Poll::Pending => {
                while count.0.load(Ordering::SeqCst) == seen {
                    std::thread::yield_now();
                }
            }
        }
    };
    assert_eq!(owner.stream().unwrap().raw(), lent_raw);
    let st = ctx.stats();
    assert!(st.live <= 1 && st.created == 1 && st.lent == 0, "{st:?}");
}

thread_local! {
    static KEPT: RefCell<Option<StreamRef<'static>>> = const { RefCell::new(None) };
    static LOAN: RefCell<Option<Arc<Foreign>>> = const { RefCell::new(None) };
}

/// Regression (review 2, finding 2: the crate joined and invalidated another crate's capture). `Owner::after_escape` (the
/// fresh owner an `Attached` task continues with after a `StreamRef<'static>` of its owner
/// escaped a poll) checks `prev.is_capturing()`, the crate's own capture flag only, not
/// `CtxInner::capturing`, which asks the driver for lent streams. When the escaped stream is lent
/// and the borrower has begun a capture of it (cudarc's safe `begin_capture`), the crate records
/// an event on the capturing stream and makes the fresh owner's stream wait for it: the fresh
/// stream is pulled into the borrower's capture (fork), and the borrower's end of capture fails
/// with an unjoined stream (CUDA_ERROR_STREAM_CAPTURE_UNJOINED on the GPU: invalidated).
#[test]
fn a_fresh_owner_after_an_escape_refuses_to_join_the_borrowers_capture_of_the_lent_stream() {
    let _serial = serial();
    let (sim, ctx) = setup();
    let owner = ctx.owner();
    let c = ctx.clone();
    let d: Arc<dyn Driver> = sim.clone();
    let mut t = Box::pin(owner.attach(async move {
        let s = c.stream().unwrap();
        let h = s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap();
        // The borrower begins a capture of its handle (relaxed: it forbids nothing).
        // SAFETY: the borrower's action; the loan keeps the stream alive.
        unsafe { d.stream_begin_capture(h.0, CaptureMode::Relaxed) }.unwrap();
        LOAN.with(|l| *l.borrow_mut() = Some(h));
        KEPT.with(|k| *k.borrow_mut() = Some(s)); // the reference escapes the poll
        Yield(false).await;
    }));
    let w = Waker::from(Arc::new(Noop));
    assert!(poll(t.as_mut(), &w).is_pending());
    let h = LOAN.with(|l| l.borrow_mut().take()).unwrap();
    // The fresh owner's next stream use must be ordered after the escaped (capturing) stream:
    // impossible while the borrower captures, so it is refused, enqueuing nothing.
    let fresh = t.owner().unwrap();
    match fresh.stream() {
        Err(cuda_stream_pool::Error::CaptureInProgress(_)) => {}
        other => panic!("the fresh owner used a stream unordered or joined the capture: {other:?}"),
    }
    // SAFETY: the borrower ends its own capture.
    let ended = unsafe { sim.stream_end_capture(h.0) };
    assert!(
        ended.is_ok(),
        "the borrower's capture was broken by the crate: {ended:?}"
    );
    // SAFETY: the graph was made by the borrower's capture.
    unsafe { sim.graph_destroy(ended.unwrap()) }.unwrap();
    // Now the ordering is possible, and the fresh owner gets its stream.
    let fresh_stream = fresh.stream().unwrap().raw();
    assert_ne!(fresh_stream, h.0);
    // SAFETY: the fresh owner holds its stream.
    let fresh_capturing = unsafe { sim.stream_is_capturing(fresh_stream) }.unwrap();
    assert_eq!(fresh_capturing, CaptureStatus::None);
    KEPT.with(|k| k.borrow_mut().take());
    drop(t);
    drop(h);
}

/// Regression (review 2, finding 5: host memory freed under a pending DtoH copy, heap corruption
/// in the simulation). `to_vec_async` keeps a staging block that it can neither watch nor return (the
/// completion could not be enqueued and the synchronize failed) "for the teardown, after its
/// streams were drained". A lent stream is not drained at teardown (it is parked while the
/// borrower holds it), so `Hub::shutdown` frees the block while the copy into it is pending on
/// the lent stream. The simulation writes DtoH copies through the raw pointer without checking
/// host allocations, so the late copy would corrupt the heap: this test stops before the copy
/// runs and checks that the block was not freed.
#[test]
fn teardown_keeps_a_staging_block_whose_copy_is_pending_on_a_lent_stream() {
    let _serial = serial();
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let h = s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap();
    let b = DeviceBuffer::from_slice(&s, &[5u32; 16]).unwrap();
    // Make the hub's slab exist first, so that only the staging block is in question.
    drop(s.completed().unwrap());
    s.synchronize().unwrap();
    let before = sim.counters().live_host_allocs;
    sim.enqueue_work(s.raw(), 1_000).unwrap();
    sim.fail_calls("cuStreamWriteValue64_v2", ErrorCode::ERROR_UNKNOWN, 1);
    sim.fail_calls("cuStreamSynchronize", ErrorCode::ERROR_UNKNOWN, 1);
    assert!(b.to_vec_async(&s).is_err());
    assert_eq!(sim.counters().live_host_allocs, before + 1);
    drop(b);
    drop(s);
    drop(o);
    drop(ctx); // the borrower still holds `h`: the stream and its pending copy stay
               // The slab may go (its write landed); the staging block must stay.
    let freed = sim.counters().live_host_allocs == 0;
    // Freed is only right once the copy has landed (the teardown may wait for it).
    // SAFETY: the loan keeps the stream alive.
    let copy_done = unsafe { sim.stream_query(h.0) } == Ok(true);
    // Keep the simulation from running the copy (into freed memory) before it is dropped.
    std::mem::forget(h);
    assert!(
        !freed || copy_done,
        "the staging block was freed while a DtoH copy into it is pending on the lent stream"
    );
}

// Review 2's finding 6 (a borrower beginning a capture of a lent stream on another thread between the
// crate's capture check and its enqueue) is a race inherent to sharing one CUDA stream between
// threads, as cudarc's `Send + Sync` handle does: no check-then-enqueue can close it. It is a
// documented limit of `StreamRef::lend` (begin captures of a lent stream on the owner's thread,
// or while the crate does not use it), not tested here.

/// Regression (review 2, finding 7: a deadlock from safe code). `StreamRef::lend` runs `wrap` under the slot's
/// loan mutex; a `wrap` that asks for the loan of the same stream again (for instance through a
/// helper that calls `cudarc_stream()`) relocks it on the same thread: `std::sync::Mutex`
/// deadlocks (or panics). The docs say "must not call back into the crate for this stream", but
/// the function is safe, and the contract promises no deadlocks.
#[test]
fn lend_whose_wrap_lends_the_same_stream_again_returns_without_deadlock() {
    let _serial = serial();
    let (_sim, ctx) = setup();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let r = s.lend(|raw| {
            let inner = s.lend(|raw| Ok(Arc::new(Foreign(raw))));
            inner.map(|_| Arc::new(Foreign(raw)))
        });
        let _ = tx.send(r.is_ok() || matches!(r, Err(Error::InvalidArgument(_))));
    });
    assert!(
        rx.recv_timeout(TIMEOUT).is_ok(),
        "StreamRef::lend deadlocked (wrap lent the same stream)"
    );
}

/// Regression (review 2, finding 8: a deadlock from safe code, a lost wake-up). With a cap, a stream whose holder
/// is gone while its loan is out is parked in `CtxInner::lent` and still counts as live. When the
/// borrower drops its last handle, nothing notices: the gate is notified only by releases,
/// destroys and the wake-up host functions of retired streams, and a waiter's attempts look at
/// the pool's shards, never at the parked list (only a later release, allocation, free or trim
/// flushes it). A thread waiting at the cap (here the only other user of the context) parks
/// forever although the stream is free.
#[test]
fn a_waiter_at_the_cap_is_woken_when_a_parked_loans_last_handle_is_dropped() {
    let _serial = serial();
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let a = ctx.owner();
    let h = a
        .stream()
        .unwrap()
        .lend(|raw| Ok(Arc::new(Foreign(raw))))
        .unwrap();
    drop(a); // parked: the loan is out
    let (tx, rx) = mpsc::channel();
    let c = ctx.clone();
    std::thread::spawn(move || {
        let o = c.owner();
        let r = o.stream().map(|s| s.raw());
        let _ = tx.send(r.map_err(|e| format!("{e}")));
    });
    // The waiter has begun to wait at the cap (it may not have parked yet: a wake-up that
    // comes before it parks must not be lost either).
    let t = std::time::Instant::now();
    while ctx.stats().waits == 0 {
        assert!(t.elapsed() < TIMEOUT, "a hang: the waiter never waited");
        std::thread::yield_now();
    }
    drop(h); // the loan ends: the stream is free
    let got = rx.recv_timeout(TIMEOUT);
    assert!(
        got.is_ok(),
        "the waiter was never woken after the lent stream's last handle was dropped"
    );
}

/// Regression (review 2, finding 9: a lent handle outlived its stream). `lend` promises that while anyone holds
/// a clone of the returned `Arc` the stream is not destroyed. The context's teardown leaves a
/// parked lent stream alone but then releases the primary context it retained
/// (`cuDevicePrimaryCtxRelease`): when that was the last retain (no cudarc context keeping it),
/// CUDA resets the primary context and destroys every stream of it, the lent one included, so the
/// borrower's handle names a destroyed stream. The state should keep the context retained while
/// a loan is out (or refuse to release it).
#[test]
fn teardown_keeps_the_primary_context_retained_while_a_loan_is_out() {
    let _serial = serial();
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let h = o
        .stream()
        .unwrap()
        .lend(|raw| Ok(Arc::new(Foreign(raw))))
        .unwrap();
    drop(o);
    assert_eq!(sim.counters().live_contexts, 1);
    drop(ctx);
    let retained = sim.counters().live_contexts;
    drop(h);
    assert_eq!(
        retained, 1,
        "the primary context (and with it, on CUDA, the lent stream) was released while the \
         borrower still holds a handle of its stream"
    );
}

/// Whether `raw` is alive and still captured by the capture a leaked guard began (never ended,
/// invalidated or destroyed by the crate).
fn still_capturing(sim: &SimDriver, raw: Stream) -> bool {
    // SAFETY: asked only of a stream that exists (checked first); `cuStreamIsCapturing` is
    // allowed in every capture mode and invalidates nothing.
    sim.stream_exists(raw) && unsafe { sim.stream_is_capturing(raw) } == Ok(CaptureStatus::Active)
}

// Regression: proptest seed 14 finding (tests/findings: a leaked capture guard's stream whose
// loan had ended stayed counted in `in_use`, in no list, after its owner's drop, where a stream
// never lent is retired busy)
#[test]
fn a_leaked_capture_of_a_stream_lent_before_is_counted_as_a_never_lent_ones_is() {
    let _serial = serial();
    let (sim, ctx) = setup();
    let before = ctx.stats();
    // A stream never lent, left capturing by a leaked guard when its owner is dropped: retired,
    // busy for good (never handed out, never destroyed).
    let a = ctx.owner();
    let never_lent = {
        let s = a.stream().unwrap();
        std::mem::forget(s.begin_capture().unwrap());
        s.raw()
    };
    drop(a);
    let st = ctx.stats();
    assert_eq!(
        (st.live, st.in_use, st.retired_busy, st.lent),
        (1, before.in_use, 1, 0),
        "{st:?}"
    );
    // The same leak on a stream lent earlier, whose loan ended before the capture began.
    let b = ctx.owner();
    let lent_before = {
        let s = b.stream().unwrap();
        drop(lend(&s)); // the loan ends: the borrower holds no handle any more
        std::mem::forget(s.begin_capture().unwrap());
        s.raw()
    };
    assert_ne!(lent_before, never_lent, "a capturing stream was handed out");
    drop(b);
    let st = ctx.stats();
    assert_eq!(
        (st.live, st.in_use, st.retired_busy, st.lent),
        (2, before.in_use, 2, 0),
        "the leaked capture's stream lent before is not counted as the never-lent one: {st:?}"
    );
    assert_eq!(st.live, st.in_use + st.idle + st.retired_busy + st.handed);
    // Neither is handed to a new owner, nor destroyed or touched by a trim.
    ctx.trim().unwrap();
    let c = ctx.owner();
    let got = c.stream().unwrap().raw();
    assert!(
        got != never_lent && got != lent_before,
        "a stream captured by a leaked guard was handed to a new owner"
    );
    drop(c);
    for raw in [never_lent, lent_before] {
        assert!(
            still_capturing(&sim, raw),
            "the leaked guard's capture of {raw:?} was ended or its stream destroyed"
        );
    }
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Regression: proptest seed 14 finding (the same leak on a stream whose loan is still out when
// its owner is dropped: parked, then, once the loan ends, it stayed counted in `in_use`)
#[test]
fn a_leaked_capture_of_a_stream_whose_loan_ends_after_its_owner_is_retired_busy() {
    let _serial = serial();
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let (h, raw) = {
        let s = o.stream().unwrap();
        let h = lend(&s);
        std::mem::forget(s.begin_capture().unwrap());
        (h, s.raw())
    };
    drop(o);
    // Parked while the borrower holds its handle: lent, in use.
    let st = ctx.stats();
    assert_eq!((st.live, st.in_use, st.lent), (1, 1, 1), "{st:?}");
    drop(h);
    // A flush finds the loan ended: the stream goes where a never-lent one goes.
    ctx.trim().unwrap();
    let st = ctx.stats();
    assert_eq!(
        (st.live, st.in_use, st.retired_busy, st.lent),
        (1, 0, 1, 0),
        "{st:?}"
    );
    let n = ctx.owner();
    assert_ne!(
        n.stream().unwrap().raw(),
        raw,
        "a stream captured by a leaked guard was handed to a new owner"
    );
    drop(n);
    assert!(
        still_capturing(&sim, raw),
        "the leaked guard's capture was ended or its stream destroyed"
    );
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
