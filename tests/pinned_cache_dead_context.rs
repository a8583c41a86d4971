//! The pinned-memory cache when the context dies: blocks that a torn-down state shelved before a
//! kernel faulted the context cannot be freed (every call in the context fails with its sticky
//! error). `release_pinned_cache` gives them up, once, and releases the shelf's retain, so that
//! nothing is left for a later call, whose free would come after the device's reset (the way
//! out of a fault) and free memory that is gone. On the simulated driver and on the GPU (in a
//! binary of its own: the fault ends GPU work on device 0 for the process).

mod common;

use cuda_stream_pool::driver::{Context as RawCtx, Driver, SimDriver};
use cuda_stream_pool::{release_pinned_cache, Context, ErrorCode};
use std::sync::Arc;

// Regression: 2026-12-07, found by the model's new check of the pinned cache after each input
// (a dead context's shelved blocks stayed on the cache for good: every later release failed
// again, and kept the context retained)
/// A state uses its completion flags (a host-mapped slab) and is torn down: the slab goes on its
/// context's shelf, with the shelf's retain of the context. `kill` then faults the context.
/// The first release returns the sticky error; nothing is left for the second.
fn shelved_blocks_of_a_dead_context_are_given_up_once(
    d: &Arc<dyn Driver>,
    kill: impl FnOnce(RawCtx) -> ErrorCode,
) {
    let raw = {
        let ctx = Context::primary(d.clone(), 0).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        s.synchronize().unwrap();
        let done = s.completed().unwrap();
        common::block_on(done).unwrap();
        ctx.raw()
    };
    let code = kill(raw);
    let e = release_pinned_cache(&**d).unwrap_err();
    assert!(e.is_sticky(), "the first release: {e}");
    assert_eq!(e.code(), Some(code), "{e}");
    assert_eq!(
        release_pinned_cache(&**d).unwrap(),
        0,
        "the second release: nothing is left on the shelves"
    );
}

#[test]
fn sim_shelved_blocks_of_a_dead_context_are_given_up_once() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let s = sim.clone();
    shelved_blocks_of_a_dead_context_are_given_up_once(&d, move |raw| {
        // The state is gone: its slab is shelved, and the shelf keeps the context retained.
        assert_eq!(s.counters().live_host_allocs, 1);
        assert_eq!(s.counters().live_contexts, 1);
        s.kill_context(raw, ErrorCode::ERROR_ILLEGAL_ADDRESS);
        ErrorCode::ERROR_ILLEGAL_ADDRESS
    });
    assert_eq!(
        sim.counters().live_contexts,
        0,
        "the shelf's retain is released"
    );
}

/// On the GPU the fault is a kernel that writes to address 0x10, launched through the raw
/// driver in the context that the shelf keeps alive.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_shelved_blocks_of_a_dead_context_are_given_up_once() {
    let d = common::cuda();
    let raw_driver = d.clone();
    shelved_blocks_of_a_dead_context_are_given_up_once(&d, move |ctx| {
        let r = &raw_driver;
        // SAFETY: the context is alive (the shelf retains it); this thread's current context is
        // put back to none below.
        unsafe { r.ctx_set_current(ctx) }.unwrap();
        let fault = common::faulting_kernel(r);
        let s = r.stream_create(1, 0).unwrap();
        fault(s);
        // SAFETY: `s` is live.
        let e = unsafe { r.stream_synchronize(s) }.unwrap_err();
        // SAFETY: no context current on this thread, as before.
        unsafe { r.ctx_set_current(RawCtx::NULL) }.unwrap();
        eprintln!("the fault: {e}");
        e.code().expect("a driver error")
    });
}

// Regression: review 23 (2026-12-07, helper), finding 1: the first version gave a block up on
// one sticky code from its free, without asking the context (a call may report another
// context's fault): a block of a live context was lost for good.
/// A free that fails once with a sticky code while the context lives (an injected failure) keeps
/// the block: the context, asked, is not dead, and the next release frees it.
#[test]
fn a_sticky_code_from_a_free_in_a_live_context_keeps_the_block() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    // Keeps the context alive and healthy; the isolated state below shelves its slab.
    let keeper = Context::primary(d.clone(), 0).unwrap();
    let before = common::primary_releases(&sim);
    {
        let ctx = Context::primary_with(
            d.clone(),
            0,
            cuda_stream_pool::ContextOptions::default().isolated(true),
        )
        .unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let done = s.completed().unwrap();
        sim.advance(0);
        common::block_on(done).unwrap();
    }
    common::await_teardown(&sim, before);
    assert_eq!(sim.counters().live_host_allocs, 1, "the shelved slab");
    sim.fail_calls("cuMemFreeHost", ErrorCode::ERROR_ILLEGAL_ADDRESS, 1);
    let e = release_pinned_cache(&*sim).unwrap_err();
    assert!(e.is_sticky(), "{e}");
    keeper.health().expect("the context is healthy");
    assert_eq!(
        release_pinned_cache(&*sim).unwrap(),
        1,
        "freed by the next release"
    );
    assert_eq!(sim.counters().live_host_allocs, 0);
    drop(keeper);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
