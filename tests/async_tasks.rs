//! Completion futures, async copies and attached owners on the simulated driver with its manual
//! clock: a completion is pending until the simulated work completes and is woken exactly then
//! (a counting waker); capturing streams refuse; futures and whole tasks dropped at every await
//! point leak nothing and free nothing early (the simulation's race and use-after-free findings
//! stay empty, every allocation is gone after the teardown); an attached owner is the current one
//! during each poll, restored after (also on panic), and a stream reference that escapes a poll
//! keeps its stream while the task continues on a fresh one.

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Error, StreamRef};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

mod common;
#[path = "common/futures.rs"]
mod futures_util;
use futures_util::{poll, waker, Counting, Yield};

/// Waits (real time, bounded) until the poller thread has called the waker `n` times.
fn woken(c: &Counting, n: usize) -> bool {
    let t = Instant::now();
    while c.0.load(Ordering::SeqCst) < n {
        if t.elapsed() > Duration::from_secs(20) {
            return false;
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    true
}

/// Waits (real time, bounded: a hang guard) until the context's completion poller has made `n`
/// more whole passes over its pending completions, or has none pending.
fn passes(ctx: &Context, n: u64) -> bool {
    let Some((first, _)) = ctx.model_poller_progress() else {
        return false;
    };
    let t = Instant::now();
    loop {
        match ctx.model_poller_progress() {
            Some((p, idle)) if p >= first + n || idle => return true,
            _ if t.elapsed() > Duration::from_secs(20) => return false,
            _ => std::thread::yield_now(),
        }
    }
}

fn setup() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    (sim, ctx)
}

#[test]
fn completion_is_pending_until_the_work_completes_and_woken_exactly_then() {
    let (sim, ctx) = setup();
    {
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let mut done = Box::pin(s.completed().unwrap());
        let (count, w) = waker();
        assert!(poll(done.as_mut(), &w).is_pending());
        sim.advance(999);
        // The flag has not landed, so nothing can wake the future: the poller looks at it
        // twice (two whole passes) and does not.
        assert!(passes(&ctx, 2), "the poller makes no pass");
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        assert!(poll(done.as_mut(), &w).is_pending());
        sim.advance(1);
        assert!(woken(&count, 1), "the poller did not wake the future");
        assert!(matches!(poll(done.as_mut(), &w), Poll::Ready(Ok(()))));
        assert!(passes(&ctx, 2), "the poller makes no pass");
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken more than once");
    }
    drop(ctx);
    common::assert_clean(&sim);
}

#[test]
fn completion_covers_only_work_enqueued_before_it() {
    let (sim, ctx) = setup();
    {
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        sim.enqueue_work(s.raw(), 100).unwrap();
        let first = s.completed().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let second = s.completed().unwrap();
        sim.advance(100);
        assert!(first.is_complete());
        assert!(!second.is_complete());
        sim.advance(1_000);
        assert!(second.is_complete());
    }
    drop(ctx);
    common::assert_clean(&sim);
}

#[test]
fn a_capturing_stream_refuses_before_any_driver_call() {
    let (sim, ctx) = setup();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let b = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    s.synchronize().unwrap();
    let g = s.begin_capture().unwrap();
    sim.clear_calls();
    assert!(matches!(s.completed(), Err(Error::CaptureInProgress(_))));
    assert!(matches!(
        b.to_vec_async(&s),
        Err(Error::CaptureInProgress(_))
    ));
    assert!(sim.calls().is_empty(), "{:?}", sim.calls());
    drop(g.end().unwrap());
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn to_vec_async_resolves_with_the_data_after_the_copy() {
    let (sim, ctx) = setup();
    {
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        let k = Kernels::load(&ctx).unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32, 2, 3, 4]).unwrap();
        sim.enqueue_work(s.raw(), 500).unwrap();
        k.add_u32(&s, &b, 10).unwrap();
        let mut copy = Box::pin(b.to_vec_async(&s).unwrap());
        let (count, w) = waker();
        assert!(poll(copy.as_mut(), &w).is_pending());
        sim.advance(500);
        assert!(woken(&count, 1));
        match poll(copy.as_mut(), &w) {
            Poll::Ready(Ok(v)) => assert_eq!(v, vec![11, 12, 13, 14]),
            other => panic!("{other:?}"),
        }
        // The copy was a use: the buffer's next use elsewhere is ordered after it.
        let o2 = ctx.owner();
        let s2 = o2.stream().unwrap();
        assert_eq!(b.to_vec(&s2).unwrap(), vec![11, 12, 13, 14]);
    }
    drop(ctx);
    common::assert_clean(&sim);
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
}

#[test]
fn dropped_futures_free_nothing_early_and_leak_nothing() {
    let (sim, ctx) = setup();
    {
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[7u32; 64]).unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let copy = b.to_vec_async(&s).unwrap();
        let done = s.completed().unwrap();
        drop(copy); // the staging block stays with the poller until the copy lands
        drop(done);
        drop(b); // the free is ordered after the copy
        let raw = s.raw();
        drop(s);
        let before = ctx.stats();
        drop(owner); // returns the stream at once, busy
        let after = ctx.stats();
        assert_eq!(after.in_use + 1, before.in_use);
        assert!(sim.is_busy(raw), "the owner waited for its stream");
        sim.advance(1_000);
    }
    drop(ctx);
    common::assert_clean(&sim);
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
}

/// One request of the server: allocate, launch, copy back asynchronously, await completion.
async fn request(ctx: Context, k: Arc<Kernels>, sim: Arc<SimDriver>, i: u32) -> Vec<u32> {
    let copy = {
        let s = ctx.stream().unwrap(); // the attached owner's stream
        let b = DeviceBuffer::from_slice(&s, &[i; 16]).unwrap();
        sim.enqueue_work(s.raw(), 300).unwrap();
        k.add_u32(&s, &b, 1).unwrap();
        b.to_vec_async(&s).unwrap()
    };
    let v = copy.await.unwrap();
    let done = ctx.stream().unwrap().completed().unwrap();
    done.await.unwrap();
    v
}

#[test]
fn tasks_dropped_at_every_await_point_leak_nothing() {
    for stop_after in 0..6 {
        let (sim, ctx) = setup();
        {
            let k = Arc::new(Kernels::load(&ctx).unwrap());
            let mut task = Box::pin(ctx.owner().attach(request(ctx.clone(), k, sim.clone(), 5)));
            let (_count, w) = waker();
            let mut finished = false;
            for _ in 0..stop_after {
                if let Poll::Ready(v) = poll(task.as_mut(), &w) {
                    assert_eq!(v, vec![6; 16]);
                    finished = true;
                    break;
                }
                sim.advance(100);
            }
            drop(task);
            let _ = finished;
            sim.advance(10_000);
        }
        drop(ctx);
        common::assert_clean(&sim);
        assert!(
            sim.findings().is_empty(),
            "stop after {stop_after}: {:?}",
            sim.findings()
        );
    }
}

#[test]
fn attached_owner_is_current_during_polls_only() {
    let (sim, ctx) = setup();
    let thread_stream = ctx.stream().unwrap().raw();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (sa, sb) = (a.stream().unwrap().raw(), b.stream().unwrap().raw());
    let seen = |c: Context| async move {
        let first = c.stream().unwrap().raw();
        Yield(false).await;
        (first, c.stream().unwrap().raw())
    };
    let mut ta = Box::pin(a.attach(seen(ctx.clone())));
    let mut tb = Box::pin(b.attach(seen(ctx.clone())));
    let (_c, w) = waker();
    assert!(poll(ta.as_mut(), &w).is_pending());
    assert!(poll(tb.as_mut(), &w).is_pending());
    assert_eq!(ctx.stream().unwrap().raw(), thread_stream, "not restored");
    // The second polls run on another thread: the owner follows the task.
    let (ra, rb) = std::thread::scope(|sc| {
        sc.spawn(|| {
            let Poll::Ready(ra) = poll(ta.as_mut(), &w) else {
                panic!()
            };
            let Poll::Ready(rb) = poll(tb.as_mut(), &w) else {
                panic!()
            };
            (ra, rb)
        })
        .join()
        .unwrap()
    });
    assert_eq!(ra, (sa, sa));
    assert_eq!(rb, (sb, sb));
    assert_ne!(sa, thread_stream);
    drop((ta, tb));
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn attached_owner_is_restored_when_a_poll_panics() {
    let (_sim, ctx) = setup();
    let thread_stream = ctx.stream().unwrap().raw();
    let c = ctx.clone();
    let mut t = Box::pin(ctx.owner().attach(async move {
        let _ = c.stream().unwrap();
        panic!("in the task");
    }));
    let (_c, w) = waker();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| poll(t.as_mut(), &w)));
    assert!(r.is_err());
    assert_eq!(ctx.stream().unwrap().raw(), thread_stream);
    assert!(t.owner().is_some(), "the owner went back to the task");
}

thread_local! {
    static KEPT: std::cell::RefCell<Option<StreamRef<'static>>> = const { std::cell::RefCell::new(None) };
}

#[test]
fn an_escaped_stream_reference_keeps_its_stream_and_the_task_moves_on() {
    let (sim, ctx) = setup();
    let owner = ctx.owner();
    let first = owner.stream().unwrap().raw();
    let c = ctx.clone();
    let sim2 = sim.clone();
    let mut t = Box::pin(owner.attach(async move {
        let s = c.stream().unwrap();
        sim2.enqueue_work(s.raw(), 1_000).unwrap();
        KEPT.with(|k| *k.borrow_mut() = Some(s)); // escapes the poll
        Yield(false).await;
        c.stream().unwrap().raw()
    }));
    let (_c, w) = waker();
    assert!(poll(t.as_mut(), &w).is_pending());
    let Poll::Ready(second) = poll(t.as_mut(), &w) else {
        panic!()
    };
    assert_ne!(second, first, "the escaped stream was shared");
    // The escaped reference still holds its stream, which is not back in the pool.
    let kept = KEPT.with(|k| k.borrow().as_ref().map(|s| s.raw()));
    assert_eq!(kept, Some(first));
    assert!(sim.stream_exists(first));
    KEPT.with(|k| k.borrow_mut().take());
    drop(t);
    sim.advance(1_000);
    drop(ctx);
    common::assert_clean(&sim);
}

#[test]
fn completions_and_owners_are_send() {
    fn send<T: Send + 'static>() {}
    send::<cuda_stream_pool::Completion>();
    send::<cuda_stream_pool::HostCopy<f32>>();
    send::<cuda_stream_pool::Attached<std::future::Ready<()>>>();
    let _ = Driver::kind(&SimDriver::new());
}

thread_local! {
    static KEPT_CAPTURE: std::cell::RefCell<Option<cuda_stream_pool::CaptureGuard<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// The task's work after an escape is ordered after the escaped stream's work, also when that
/// stream is capturing at the escape: the task's next stream use then fails (retryable) instead
/// of running unordered, and succeeds, ordered, once the capture ended.
#[test]
fn after_an_escape_the_task_stays_ordered_even_across_a_capture() {
    let (sim, ctx) = setup();
    let owner = ctx.owner();
    let buf = {
        let s = owner.stream().unwrap();
        let b = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
        s.synchronize().unwrap();
        b
    };
    let ptr = buf.as_raw();
    let c = ctx.clone();
    let sim2 = sim.clone();
    let refused = Arc::new(AtomicUsize::new(0));
    let refused2 = refused.clone();
    let mut t = Box::pin(owner.attach(async move {
        let s = c.stream().unwrap();
        // Raw work on the task's stream that writes the buffer (no BufferUse on purpose: only
        // the owner-level stream order protects the read below).
        sim2.enqueue_access(s.raw(), ptr, 1024, true, 5_000)
            .unwrap();
        let g = s.begin_capture().unwrap();
        KEPT_CAPTURE.with(|k| *k.borrow_mut() = Some(g));
        KEPT.with(|k| *k.borrow_mut() = Some(s)); // escapes, capturing
        Yield(false).await;
        loop {
            match c.stream() {
                Err(Error::CaptureInProgress(_)) => {
                    refused2.fetch_add(1, Ordering::SeqCst);
                    Yield(false).await;
                }
                Ok(s2) => {
                    sim2.enqueue_access(s2.raw(), ptr, 1024, false, 1).unwrap();
                    return;
                }
                Err(e) => panic!("{e}"),
            }
        }
    }));
    let (_c, w) = waker();
    assert!(poll(t.as_mut(), &w).is_pending());
    assert!(
        poll(t.as_mut(), &w).is_pending(),
        "ran while the escaped stream captured"
    );
    assert_eq!(refused.load(Ordering::SeqCst), 1);
    // The capture ends (on the thread that holds the escaped reference).
    let graph = KEPT_CAPTURE.with(|k| k.borrow_mut().take().unwrap().end().unwrap());
    drop(graph);
    assert!(poll(t.as_mut(), &w).is_ready());
    KEPT.with(|k| k.borrow_mut().take());
    drop(t);
    sim.advance(10_000);
    // The raw accesses were no `BufferUse`s: wait for them before the buffer is freed.
    ctx.synchronize().unwrap();
    drop(buf);
    // No race: the read on the task's new stream was ordered after the escaped stream's write.
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    drop(ctx);
    common::assert_clean(&sim);
}

// Issue 21 ("the simulated driver as a user meets it"): on `SimDriver::realtime()` a completion
// of work longer than the poller's spin (here 2 ms) resolves by itself, with no other driver call
// after it: the simulation's clock runs in real time and the poller's reads see the flag land.
#[test]
fn a_realtime_simulations_completion_resolves_without_another_call() {
    common::finishes("a completion on the real-time simulation", || {
        let sim = Arc::new(SimDriver::realtime());
        let d: Arc<dyn Driver> = sim.clone();
        let ctx = Context::primary(d, 0).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 2_000_000).unwrap();
        let done = s.completed().unwrap();
        common::block_on(done).unwrap();
    });
}
