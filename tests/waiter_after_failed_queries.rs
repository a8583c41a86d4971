//! A waiter at the cap whose turn's queries fail after its wake-up ran neither sleeps for ever
//! nor loops: it resolves with the driver's error, and the next waiter is served once the
//! failure has passed.
//!
//! Pins review 26's finding 2: after the armed wake-up ran, the waiter's turn asked the driver
//! (`cuStreamQuery`, then `cuStreamSynchronize` and `cuStreamQuery` again); a failed query
//! counts as busy, so the stream was not taken, and `Pool::arm` then found the wake-up spent
//! (`RAN`), enqueued nothing and reported the waiter armed ("only a dead context does that").
//! Nothing notified the waiter again: it slept for ever beside the key's idle stream (an async
//! waiter was woken every few milliseconds to look for a fault, and never attempted again).
//!
//! Pins review 27's finding: the first fix armed the spent wake-up again, and while the query
//! kept failing each turn launched a host function on the idle stream, which ran at once and
//! notified the waiter, which attempted and armed again (120-140 host functions in 50 polls).
//! Now a failed synchronize or query of a stream whose wake-up ran is the turn's error.

#[path = "common/futures.rs"]
mod futures_util;
use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::OwnerReady;
use cuda_stream_pool::{Context, ContextOptions, ErrorCode};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Poll, Waker};

/// Lets the simulation run the host functions that are due, and waits until every one that
/// started has returned (a condition, not a time: the wait only spaces the readings).
fn settle(sim: &SimDriver) {
    for _ in 0..60_000 {
        sim.advance(0);
        let (started, returned) = sim.host_fn_progress();
        if started == returned {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    panic!("hung: a host function did not return within a minute");
}

/// A cap of 1, the key's only stream busy and retired, and an async waiter armed on it.
fn armed_waiter() -> (
    Arc<SimDriver>,
    Context,
    Pin<Box<OwnerReady>>,
    cuda_stream_pool::driver::Stream,
) {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(d, 0, opts).unwrap();
    let o1 = ctx.owner();
    let raw = o1.stream().unwrap().raw();
    sim.enqueue_work(raw, 1_000_000).unwrap();
    drop(o1);
    let mut fut = Box::pin(ctx.owner().ready());
    assert!(
        futures_util::poll(fut.as_mut(), &noop()).is_pending(),
        "at the cap, busy: waits"
    );
    assert_eq!(
        launches(&sim),
        1,
        "the waiter armed a wake-up on the busy stream"
    );
    (sim, ctx, fut, raw)
}

fn noop() -> Waker {
    Waker::from(Arc::new(futures_util::Noop))
}

fn launches(sim: &SimDriver) -> usize {
    sim.calls()
        .iter()
        .filter(|c| c.name == "cuLaunchHostFunc")
        .count()
}

/// Polls `fut` after each settle of the simulation's host functions, up to `polls` times.
fn resolve<F: Future + ?Sized>(
    sim: &SimDriver,
    mut fut: Pin<&mut F>,
    polls: usize,
) -> Option<F::Output> {
    for _ in 0..polls {
        settle(sim);
        if let Poll::Ready(r) = futures_util::poll(fut.as_mut(), &noop()) {
            return Some(r);
        }
    }
    None
}

#[test]
fn an_async_waiter_at_the_cap_whose_turns_queries_fail_gets_the_error_and_the_next_is_served() {
    let (sim, ctx, mut fut, raw) = armed_waiter();
    // The next two queries fail; then the work completes and the wake-up runs.
    sim.fail_calls("cuStreamQuery", ErrorCode::ERROR_UNKNOWN, 2);
    sim.advance(2_000_000);
    let r = resolve(&sim, fut.as_mut(), 20).expect("the waiter resolves (it slept for ever)");
    let Err(e) = r else {
        panic!("the turn's failed query is its error: the waiter was served")
    };
    assert_eq!(e.code(), Some(ErrorCode::ERROR_UNKNOWN), "{e}");
    assert_eq!(sim.injected_failures().len(), 2, "both queries failed");
    // The failure has passed: the next waiter gets the key's one stream.
    let mut next = Box::pin(ctx.owner().ready());
    let owner = resolve(&sim, next.as_mut(), 20)
        .expect("the next waiter resolves")
        .expect("and is served");
    assert_eq!(owner.stream().unwrap().raw(), raw, "the key's one stream");
}

#[test]
fn a_waiter_whose_turns_queries_keep_failing_launches_no_host_function_per_turn() {
    let (sim, _ctx, mut fut, _raw) = armed_waiter();
    sim.fail_calls("cuStreamQuery", ErrorCode::ERROR_UNKNOWN, u64::MAX);
    sim.advance(2_000_000);
    let before = launches(&sim);
    let r = resolve(&sim, fut.as_mut(), 50);
    let n = launches(&sim) - before;
    sim.clear_faults();
    assert!(
        n <= 1,
        "{n} wake-ups launched on the idle stream for one waiter: a loop"
    );
    let r = r.expect("the waiter resolves");
    assert_eq!(
        r.err().and_then(|e| e.code()),
        Some(ErrorCode::ERROR_UNKNOWN)
    );
}
