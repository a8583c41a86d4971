//! A waiter at the cap whose turn's queries fail (a transient driver error) is served once the
//! stream is idle: its next turn arms a new wake-up instead of taking the spent one for a sign
//! of a dead context.
//!
//! Pins review 26's finding 2: after the armed wake-up ran, the waiter's turn asked the driver
//! (`cuStreamQuery`, then `cuStreamSynchronize` and `cuStreamQuery` again); a failed query
//! counts as busy, so the stream was not taken, and `Pool::arm` then found the wake-up spent
//! (`RAN`), enqueued nothing and reported the waiter armed ("only a dead context does that").
//! Nothing notified the waiter again: it slept for ever beside the key's idle stream (an async
//! waiter was woken every few milliseconds to look for a fault, and never attempted again).

#[path = "common/futures.rs"]
mod futures_util;
use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{Context, ContextOptions, ErrorCode};
use std::future::Future;
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

#[test]
fn an_async_waiter_at_the_cap_is_served_after_its_turns_queries_failed() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(d, 0, opts).unwrap();
    // The key's only stream, busy, retired.
    let o1 = ctx.owner();
    let raw = o1.stream().unwrap().raw();
    sim.enqueue_work(raw, 1_000_000).unwrap();
    drop(o1);

    let w = Waker::from(Arc::new(futures_util::Noop));
    let mut cx = std::task::Context::from_waker(&w);
    let mut fut = Box::pin(ctx.owner().ready());
    assert!(
        fut.as_mut().poll(&mut cx).is_pending(),
        "at the cap, the stream busy: waits"
    );
    assert!(
        sim.calls().iter().any(|c| c.name == "cuLaunchHostFunc"),
        "the waiter armed a wake-up on the busy stream"
    );
    // The next two queries fail; then the work completes and the wake-up runs.
    sim.fail_calls("cuStreamQuery", ErrorCode::ERROR_UNKNOWN, 2);
    sim.advance(2_000_000);
    let mut polls = 0;
    let owner = loop {
        settle(&sim);
        polls += 1;
        if let Poll::Ready(r) = fut.as_mut().poll(&mut cx) {
            break r.expect("the waiter gets the stream");
        }
        assert!(
            polls < 20,
            "not served after {polls} polls, the key's only stream idle (busy: {}); failures \
             injected: {:?}",
            sim.is_busy(raw),
            sim.injected_failures()
        );
    };
    assert_eq!(sim.injected_failures().len(), 2, "both queries failed");
    assert_eq!(owner.stream().unwrap().raw(), raw, "the key's one stream");
}
