//! Findings of a hostile review (review2) of the loan, completion, attach and back-pressure code.
//! Each test breaks a clause of the crate's safety contract from safe code (the borrower's own
//! raw driver calls stand for what another crate's safe API, e.g. cudarc's, would do) on the
//! simulated driver, and asserts the correct behaviour: it fails until the defect is fixed.
//! Scenarios that could hang run their blocking part on a spawned thread with a bounded wait.

#[path = "common/calls.rs"]
mod calls;
#[path = "common/pausing.rs"]
mod pausing;

use cuda_stream_pool::driver::{CaptureMode, CaptureStatus, Driver, SimDriver, Stream};
use cuda_stream_pool::{
    Context, ContextOptions, DeviceBuffer, Error, ErrorCode, Owner, OwnerReady, StreamRef,
};
use std::cell::RefCell;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Poll, Wake, Waker};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);

/// Another crate's handle of a lent stream (what cudarc's `CudaStream` is).
#[derive(Debug)]
struct Foreign(Stream);

fn setup() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    (sim, ctx)
}

#[path = "common/futures.rs"]
mod futures_util;
use futures_util::{poll, Noop, Yield};

/// Finding 1 (high: the GPU writes host memory the caller got back; the heap corruption of the
/// model test). `copy_to_host` enqueues the DtoH copy and then calls `stream.synchronize()`
/// with `?`: when the synchronize fails (any driver error: the model's `fail_nth_call` hits
/// `cuStreamSynchronize` or the capture-mode switch before it; or, on a lent stream,
/// `CaptureInProgress` because the borrower began a capture meanwhile) it returns the error
/// while the copy is still pending. The caller's `dst` is free again (for `to_vec` the `Vec` is
/// dropped: the copy then lands in freed heap memory, which is the
/// "free(): unaligned chunk detected in tcache 2" / SIGSEGV that tests/proptest_model.rs hit:
/// `Op::ReadBack` calls `to_vec` while `Op::Fault` injects failures at random calls). Here the
/// destination stays alive, so the late write is observed instead of corrupting the heap.
#[test]
fn copy_to_host_returns_an_error_while_its_dtoh_copy_is_still_pending() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::from_slice(&s, &[7u64; 16]).unwrap();
    sim.enqueue_work(s.raw(), 1_000).unwrap(); // earlier work: the copy waits behind it
    sim.fail_calls("cuStreamSynchronize", ErrorCode::ERROR_UNKNOWN, 1);
    let mut dst = vec![0u64; 16];
    assert!(b.copy_to_host(&s, &mut dst).is_err());
    // `dst` is the caller's again. Nothing may write it any more.
    sim.advance(1_000);
    // SAFETY: `dst` is alive; read volatile because the simulation wrote it behind the borrow.
    let seen = unsafe { std::ptr::read_volatile(dst.as_ptr()) };
    assert_eq!(
        seen, 0,
        "the DtoH copy of a failed copy_to_host landed after the call returned (with to_vec: \
         into a dropped Vec, i.e. freed heap memory)"
    );
    drop(dst);
    drop(b);
    drop(s);
    drop(o);
}

thread_local! {
    static KEPT: RefCell<Option<StreamRef<'static>>> = const { RefCell::new(None) };
    static LOAN: RefCell<Option<Arc<Foreign>>> = const { RefCell::new(None) };
}

/// Finding 2 (high: joins/invalidates another crate's capture). `Owner::after_escape` (the
/// fresh owner an `Attached` task continues with after a `StreamRef<'static>` of its owner
/// escaped a poll) checks `prev.is_capturing()`, the crate's own capture flag only, not
/// `CtxInner::capturing`, which asks the driver for lent streams. When the escaped stream is lent
/// and the borrower has begun a capture of it (cudarc's safe `begin_capture`), the crate records
/// an event on the capturing stream and makes the fresh owner's stream wait for it: the fresh
/// stream is pulled into the borrower's capture (fork), and the borrower's end of capture fails
/// with an unjoined stream (CUDA_ERROR_STREAM_CAPTURE_UNJOINED on the GPU: invalidated).
#[test]
fn after_escape_joins_the_borrowers_capture_of_a_lent_escaped_stream() {
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

/// A waker that polls its future inline when woken (legal: `Waker::wake` may do anything).
struct Inline {
    fut: Mutex<Option<Pin<Box<OwnerReady>>>>,
    tx: Mutex<mpsc::Sender<cuda_stream_pool::Result<Owner>>>,
}

impl Wake for Inline {
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

/// Finding 3 (medium: driver calls from a host function; spurious failure, a deadlock on some
/// drivers). The gate's wake-up host function (`Pool::arm`) calls `Gate::notify`, which runs the
/// user's `Waker` on the driver's host-function thread. A waker that polls the `OwnerReady`
/// inline reaches `OwnerReady::poll`, which sees `on_host_fn_thread()` and calls
/// `owner.stream()`: `Pool::acquire` (mode `Fail`) then calls `attempt`, i.e. the driver
/// (`cuThreadExchangeStreamCaptureMode`, `cuStreamQuery`, `cuStreamCreate`), from a host
/// function. The real driver refuses (CUDA_ERROR_NOT_PERMITTED) or deadlocks; the task loses its
/// owner to the error although a stream is free.
#[test]
fn wake_up_host_function_runs_a_waker_that_polls_and_calls_the_driver() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let first = ctx.owner();
    sim.enqueue_work(first.stream().unwrap().raw(), 1_000)
        .unwrap();
    drop(first); // the only stream is retired, busy for 1 µs
    let (tx, rx) = mpsc::channel();
    let inline = Arc::new(Inline {
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
        .recv_timeout(TIMEOUT)
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

/// Finding 4 (high: host memory the GPU still writes is handed to another copy; and every later
/// completion of the context is never woken). The poller thread calls wakers inside
/// `mine.retain(..)` without catching panics: a panicking waker unwinds the poller, which drops
/// `mine`, the entries it was watching. A dropped `HostCopy`'s entry keeps its staging block in
/// `EntryState::keep` (a `Back`), whose destructor returns the block to the free list: the block
/// goes back while the DtoH copy into it is still pending, the next `to_vec_async` of that size
/// takes it, and the old copy overwrites the new copy's result. (The poller is also dead for good:
/// `submit` never restarts it, so later `Completion`s are never woken.)
#[test]
fn a_panicking_waker_kills_the_poller_and_recycles_staging_memory_under_a_pending_copy() {
    let (sim, ctx) = setup();
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
    // Let the poller take both entries (it spins on them), then complete `sa`'s work.
    std::thread::sleep(Duration::from_millis(200));
    sim.advance(1_000);
    let t = std::time::Instant::now();
    while !p.0.load(Ordering::SeqCst) && t.elapsed() < TIMEOUT {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(p.0.load(Ordering::SeqCst), "the waker was never called");
    std::thread::sleep(Duration::from_millis(200)); // the poller unwinds
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

/// Finding 5 (high: host memory freed under a pending DtoH copy, heap corruption in the
/// simulation). `to_vec_async` keeps a staging block that it can neither watch nor return (the
/// completion could not be enqueued and the synchronize failed) "for the teardown, after its
/// streams were drained". A lent stream is not drained at teardown (it is parked while the
/// borrower holds it), so `Hub::shutdown` frees the block while the copy into it is pending on
/// the lent stream. The simulation writes DtoH copies through the raw pointer without checking
/// host allocations, so the late copy would corrupt the heap: this test stops before the copy
/// runs and checks that the block was not freed.
#[test]
fn teardown_frees_a_staging_block_whose_copy_is_pending_on_a_lent_stream() {
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

// Finding 6 (a borrower beginning a capture of a lent stream on another thread between the
// crate's capture check and its enqueue) is a race inherent to sharing one CUDA stream between
// threads, as cudarc's `Send + Sync` handle does: no check-then-enqueue can close it. It is a
// documented limit of `StreamRef::lend` (begin captures of a lent stream on the owner's thread,
// or while the crate does not use it), not tested here.

/// Finding 7 (low: a deadlock from safe code). `StreamRef::lend` runs `wrap` under the slot's
/// loan mutex; a `wrap` that asks for the loan of the same stream again (for instance through a
/// helper that calls `cudarc_stream()`) relocks it on the same thread: `std::sync::Mutex`
/// deadlocks (or panics). The docs say "must not call back into the crate for this stream", but
/// the function is safe, and the contract promises no deadlocks.
#[test]
fn lend_deadlocks_when_wrap_lends_the_same_stream() {
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
        rx.recv_timeout(Duration::from_secs(5)).is_ok(),
        "StreamRef::lend deadlocked (wrap lent the same stream)"
    );
}

/// Finding 8 (high: a deadlock from safe code, lost wake-up). With a cap, a stream whose holder
/// is gone while its loan is out is parked in `CtxInner::lent` and still counts as live. When the
/// borrower drops its last handle, nothing notices: the gate is notified only by releases,
/// destroys and the wake-up host functions of retired streams, and a waiter's attempts look at
/// the pool's shards, never at the parked list (only a later release, allocation, free or trim
/// flushes it). A thread waiting at the cap (here the only other user of the context) parks
/// forever although the stream is free.
#[test]
fn a_waiter_at_the_cap_is_never_woken_when_a_parked_loan_ends() {
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
    // Let the waiter park at the cap (a bounded wait, not an assertion on time).
    std::thread::sleep(Duration::from_millis(200));
    drop(h); // the loan ends: the stream is free
    let got = rx.recv_timeout(TIMEOUT);
    assert!(
        got.is_ok(),
        "the waiter was never woken after the lent stream's last handle was dropped"
    );
}

/// Finding 9 (medium: a lent handle outlives its stream). `lend` promises that while anyone holds
/// a clone of the returned `Arc` the stream is not destroyed. The context's teardown leaves a
/// parked lent stream alone but then releases the primary context it retained
/// (`cuDevicePrimaryCtxRelease`): when that was the last retain (no cudarc context keeping it),
/// CUDA resets the primary context and destroys every stream of it, the lent one included, so the
/// borrower's handle names a destroyed stream. The state should keep the context retained while
/// a loan is out (or refuse to release it).
#[test]
fn teardown_releases_the_primary_context_while_a_loan_is_out() {
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
