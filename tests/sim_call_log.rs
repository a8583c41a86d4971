//! The simulated driver's call log stays bounded in a long run (issue 21: a million allocations
//! and frees logged six million calls, +960 MiB): it keeps the most recent calls only, counts
//! those it dropped, and every call is still counted.

use cuda_stream_pool::driver::sim::DEFAULT_CALL_LOG;
use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::{Context, DeviceBuffer};
use std::sync::Arc;

/// Allocates and frees a buffer `n` times on one pooled stream.
fn alloc_free(ctx: &Context, n: usize) {
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    for _ in 0..n {
        drop(DeviceBuffer::<u32>::alloc(&s, 16).unwrap());
    }
}

#[test]
fn the_default_log_keeps_the_most_recent_calls_only() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    sim.clear_calls();
    let before = sim.call_count();
    // More calls than the log keeps (an allocation and a free make several calls each).
    let mut n = 0;
    while sim.call_count() - before <= 2 * DEFAULT_CALL_LOG as u64 {
        alloc_free(&ctx, 1000);
        n += 1000;
    }
    let made = sim.call_count() - before;
    let calls = sim.calls();
    assert_eq!(
        calls.len(),
        DEFAULT_CALL_LOG,
        "after {n} allocations and frees"
    );
    assert_eq!(sim.calls_dropped() + calls.len() as u64, made);
    // The most recent calls are the ones kept: the last is the last free's.
    assert!(
        calls
            .iter()
            .rev()
            .take(20)
            .any(|c| c.name == "cuMemFreeAsync"),
        "{:?}",
        &calls[calls.len() - 20..]
    );
    sim.clear_calls();
    assert!(sim.calls().is_empty());
    assert_eq!(sim.calls_dropped(), 0);
}

#[test]
fn a_small_limit_bounds_the_log_and_an_unbounded_one_keeps_every_call() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    sim.set_call_log_limit(100);
    for _ in 0..10 {
        alloc_free(&ctx, 100);
        assert!(sim.calls().len() <= 100);
    }
    assert_eq!(sim.calls().len(), 100);
    assert!(sim.calls_dropped() > 0);

    sim.set_call_log_limit(usize::MAX);
    sim.clear_calls();
    let before = sim.call_count();
    alloc_free(&ctx, 100);
    assert_eq!(sim.calls().len() as u64, sim.call_count() - before);
    assert_eq!(sim.calls_dropped(), 0);

    // Lowering the limit forgets the oldest calls at once.
    let last = sim.calls().last().cloned();
    sim.set_call_log_limit(1);
    assert_eq!(sim.calls().len(), 1);
    assert_eq!(sim.calls().last().cloned(), last);

    // Off: nothing is kept, the calls are still counted; on again: the same limit.
    sim.set_logging(false);
    let before = sim.call_count();
    alloc_free(&ctx, 10);
    assert!(sim.calls().is_empty());
    assert!(sim.call_count() > before);
    sim.set_logging(true);
    alloc_free(&ctx, 10);
    assert_eq!(sim.calls().len(), 1);
}
