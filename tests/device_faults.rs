//! A kernel that faults its context (issue 23): the driver's sticky error (for example
//! `CUDA_ERROR_ILLEGAL_ADDRESS`) makes every later call of the context fail, and work enqueued in
//! it never completes (docs/gpu.md, measured on the H200). On the simulation
//! `SimDriver::kill_context` does the same. What the crate must do: resolve every pending future
//! with the error instead of leaving it pending for ever, report the fault, and hang nothing.

mod common;

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{Context, DeviceBuffer, ErrorCode};
use std::future::Future;
use std::sync::{mpsc, Arc};
use std::task::{Poll, Wake, Waker};
use std::time::Duration;

/// Polls `f` on this thread until it is ready, parking between wake-ups (each wake-up unparks).
fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Runs `f` on a thread of its own and returns its result; a hang guard only (a hang is
/// reported as such after 60 s, never decides a pass).
fn no_hang<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what}: hung (no result after 60 s)"))
}

const FAULT: ErrorCode = ErrorCode::ERROR_ILLEGAL_ADDRESS;

// Regression: issue 23 (a faulted context left every pending completion pending for ever: the
// GPU never writes its flag, and the poller only read host memory)
/// Completions and host copies pending on three streams when the context dies resolve with the
/// sticky error; the thread waiting on them is woken (no poll loop of the test's own).
#[test]
fn pending_futures_resolve_with_the_contexts_sticky_error() {
    no_hang("pending futures", || {
        let sim = Arc::new(SimDriver::new());
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let owners: Vec<_> = (0..3).map(|_| ctx.owner()).collect();
        let mut waits = Vec::new();
        let mut copies = Vec::new();
        for o in &owners {
            let s = o.stream().unwrap();
            let b = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
            sim.enqueue_work(s.raw(), 1_000_000_000).unwrap(); // never ends before the fault
            waits.push(s.completed().unwrap());
            copies.push(b.to_vec_async(&s).unwrap());
        }
        sim.kill_context(ctx.raw(), FAULT);
        for w in waits {
            let e = block_on(w).unwrap_err();
            assert_eq!(e.code(), Some(FAULT), "{e}");
            assert!(e.is_sticky());
        }
        for c in copies {
            let e = block_on(c).unwrap_err();
            assert_eq!(e.code(), Some(FAULT), "{e}");
        }
        assert_eq!(ctx.health().unwrap_err().code(), Some(FAULT));
    });
}

/// A completion whose work finished before the fault still resolves with success (its flag
/// landed); one made after the fault is refused at once with the error.
#[test]
fn landed_completions_succeed_and_later_ones_fail_at_once() {
    no_hang("landed and later completions", || {
        let sim = Arc::new(SimDriver::new());
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let done = s.completed().unwrap();
        sim.advance(0);
        sim.kill_context(ctx.raw(), FAULT);
        block_on(done).expect("its work completed before the fault");
        let e = s.completed().unwrap_err();
        assert_eq!(e.code(), Some(FAULT), "{e}");
        let e = DeviceBuffer::<u8>::zeroed(&s, 16).unwrap_err();
        assert_eq!(e.code(), Some(FAULT), "{e}");
    });
}

/// The fault is known to the context whichever call met it first (every call goes through the
/// device rules), and `health` finds it by itself when no call has met it yet.
#[test]
fn health_reports_the_fault() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    assert!(ctx.health().is_ok());
    sim.kill_context(ctx.raw(), FAULT);
    assert_eq!(ctx.health().unwrap_err().code(), Some(FAULT));
    // A second context of another device is not affected.
    let other = Context::primary(
        Arc::new(SimDriver::with_config(
            cuda_stream_pool::driver::SimConfig {
                devices: 2,
                ..Default::default()
            },
        )),
        1,
    )
    .unwrap();
    assert!(other.health().is_ok());
}

/// Dropping everything of a dead context returns (nothing waits for work that never ends) and
/// touches nothing of a healthy context of the same simulation.
#[test]
fn a_dead_contexts_teardown_returns() {
    no_hang("teardown of a dead context", || {
        let sim = Arc::new(SimDriver::with_config(
            cuda_stream_pool::driver::SimConfig {
                devices: 2,
                ..Default::default()
            },
        ));
        let d: Arc<dyn Driver> = sim.clone();
        let ctx = Context::primary(d.clone(), 0).unwrap();
        let healthy = Context::primary(d, 1).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
        sim.enqueue_work(s.raw(), 1_000_000_000).unwrap();
        let pending = s.completed().unwrap();
        sim.kill_context(ctx.raw(), FAULT);
        drop(pending);
        drop(b);
        drop(s);
        drop(o);
        drop(ctx);
        let o = healthy.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32, 2, 3]).unwrap();
        assert_eq!(b.to_vec(&s).unwrap(), vec![1, 2, 3]);
        assert!(healthy.health().is_ok());
    });
}

/// A context with a cap of one stream per key whose only stream was given back busy (its work
/// never ends before the fault): the next acquisition waits at the cap for that work.
fn at_the_cap_behind_busy_work() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let opts = cuda_stream_pool::ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    sim.enqueue_work(s.raw(), 1_000_000_000).unwrap();
    drop(s);
    drop(o);
    (sim, ctx)
}

// Regression: issue 23 (waiters at the cap waited for the wake-up host functions they armed on
// busy streams, which a faulted context never runs)
/// Three threads blocked at the cap behind busy work are released with the sticky error when
/// the context dies; none hangs.
#[test]
fn blocked_waiters_at_the_cap_get_the_sticky_error() {
    no_hang("blocked waiters", || {
        let (sim, ctx) = at_the_cap_behind_busy_work();
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let ctx = ctx.clone();
                std::thread::spawn(move || ctx.owner().stream().map(|_| ()))
            })
            .collect();
        // Each waiter is queued (or about to be) before the fault: the cap's queue says so.
        while ctx.stats().waits < 3 {
            std::thread::yield_now();
        }
        sim.kill_context(ctx.raw(), FAULT);
        for w in waiters {
            let e = w.join().unwrap().unwrap_err();
            assert_eq!(e.code(), Some(FAULT), "{e}");
        }
    });
}

/// The same for an async waiter (`Owner::ready`): it resolves with the error.
#[test]
fn an_async_waiter_at_the_cap_gets_the_sticky_error() {
    no_hang("async waiter", || {
        let (sim, ctx) = at_the_cap_behind_busy_work();
        let waiter = {
            let ctx = ctx.clone();
            std::thread::spawn(move || block_on(ctx.owner().ready()).map(|_| ()))
        };
        while ctx.stats().waits < 1 {
            std::thread::yield_now();
        }
        sim.kill_context(ctx.raw(), FAULT);
        let e = waiter.join().unwrap().unwrap_err();
        assert_eq!(e.code(), Some(FAULT), "{e}");
        // Later acquisitions fail at once.
        let e = ctx.owner().stream().map(|_| ()).unwrap_err();
        assert_eq!(e.code(), Some(FAULT), "{e}");
    });
}
