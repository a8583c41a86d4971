//! The crate makes no call that waits for other streams' work where its user did not ask for a
//! wait: a context's teardown shelves its page-locked memory instead of freeing it
//! (`cuMemFreeHost` waits for every stream of the device, measured on the H200 in
//! `differential_implicit_sync.rs`).
//!
//! Regression: the issue-19 stress program hung at 16 threads on the H200: a short-lived
//! context's teardown, on a thread of its own, freed its completion slab with `cuMemFreeHost`,
//! which waited for a stream held by a host-written flag while holding a driver lock; the
//! thread that would write the flag waited for that lock in `cuLaunchHostFunc`.

mod common;

use common::stall::{with_watchdog, HostWord, Trigger};
use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{release_pinned_cache, Context, DeviceBuffer};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A state of `d`'s primary context that uses completion flags and a staging block, then is
/// torn down by the last drop.
fn use_and_drop_a_context(d: &Arc<dyn Driver>) {
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let b = DeviceBuffer::<u32>::from_slice(&s, &[1, 2, 3]).unwrap();
    let copy = b.to_vec_async(&s).unwrap();
    s.synchronize().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    assert_eq!(rt.block_on(copy).unwrap(), [1, 2, 3]);
    drop(b);
    drop(s);
    drop(owner);
    drop(ctx);
}

/// [`use_and_drop_a_context`] on the simulation, returning once the context's teardown has
/// completed (see [`common::await_teardown`]: a later round or a `release_pinned_cache` would
/// race a teardown still running on a thread of its own; this test failed so, 1 run in 8 beside
/// the others).
fn use_and_drop_on_sim(sim: &Arc<SimDriver>) {
    let before = common::primary_releases(sim);
    let d: Arc<dyn Driver> = sim.clone();
    use_and_drop_a_context(&d);
    common::await_teardown(sim, before);
}

/// A keep-alive for `Context::adopt` that says when it is dropped: after the state's teardown.
struct Signal(std::sync::mpsc::Sender<()>);

impl Drop for Signal {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// A keep-alive and the receiver that hears of its drop (the end of the adopted state's
/// teardown, which may run on a thread of its own: see [`use_and_drop_on_sim`]).
fn signal() -> (
    Box<dyn std::any::Any + Send + Sync>,
    std::sync::mpsc::Receiver<()>,
) {
    let (tx, rx) = std::sync::mpsc::channel();
    (Box::new(Signal(tx)), rx)
}

/// While another stream of the device is held, a context is used and torn down on another
/// thread; returns whether that returned only after the held stream was released.
fn teardown_waited_for_a_held_stream(d: &Arc<dyn Driver>, trigger: Trigger) -> bool {
    let e = common::Env::new(d);
    let word = HostWord::new(d);
    let w = e.stream();
    // SAFETY: `w` is live and not capturing; the watchdog sets the word before `w` is
    // synchronized and destroyed, and before the word is dropped.
    unsafe { word.hold(w, 1) };
    let d2 = d.clone();
    let late = with_watchdog(&word, 1, &trigger, move |released| {
        use_and_drop_a_context(&d2);
        released.load(Ordering::Acquire)
    });
    // SAFETY: released above; nothing else uses `w`.
    unsafe {
        d.stream_synchronize(w).unwrap();
        d.stream_destroy(w).unwrap();
    }
    late
}

#[test]
fn a_teardown_makes_no_call_that_waits_for_other_streams() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let late =
        teardown_waited_for_a_held_stream(&d, Trigger::After(std::time::Duration::from_millis(20)));
    assert!(!late, "the simulation never blocks");
    assert_eq!(sim.device_waits(), Vec::<String>::new());
    release_pinned_cache(&*d).unwrap();
    let c = sim.counters();
    assert_eq!((c.live_host_allocs, c.live_contexts), (0, 0), "{c:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn later_states_of_a_context_reuse_its_page_locked_memory() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    use_and_drop_on_sim(&sim);
    let kept = sim.counters().live_host_allocs;
    assert_eq!(kept, 2, "a completion slab and a staging block are kept");
    for _ in 0..5 {
        use_and_drop_on_sim(&sim);
    }
    assert_eq!(sim.counters().live_host_allocs, kept);
    assert_eq!(release_pinned_cache(&*d).unwrap(), 2);
    let c = sim.counters();
    assert_eq!((c.live_host_allocs, c.live_contexts), (0, 0), "{c:?}");
    // Nothing is left to release, and a new state allocates again.
    assert_eq!(release_pinned_cache(&*d).unwrap(), 0);
    use_and_drop_on_sim(&sim);
    assert_eq!(release_pinned_cache(&*d).unwrap(), 2);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn the_shelf_is_per_driver() {
    let (a, b) = (Arc::new(SimDriver::new()), Arc::new(SimDriver::new()));
    let (da, db): (Arc<dyn Driver>, Arc<dyn Driver>) = (a.clone(), b.clone());
    use_and_drop_on_sim(&a);
    use_and_drop_on_sim(&b);
    assert_eq!(release_pinned_cache(&*da).unwrap(), 2);
    assert_eq!(b.counters().live_host_allocs, 2, "b's blocks are b's");
    assert_eq!(release_pinned_cache(&*db).unwrap(), 2);
    assert!(a.misuse().is_empty() && b.misuse().is_empty());
}

#[test]
fn releasing_on_a_host_function_thread_is_refused_and_keeps_the_shelf() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    use_and_drop_on_sim(&sim);
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let d2 = d.clone();
    s.launch_host_func(move || {
        let _ = tx.send(release_pinned_cache(&*d2).map_err(|e| e.code()));
    })
    .unwrap();
    s.synchronize().unwrap();
    let r = rx.recv().unwrap();
    assert_eq!(
        r,
        Err(Some(cuda_stream_pool::ErrorCode::ERROR_NOT_PERMITTED))
    );
    drop(s);
    drop(owner);
    drop(ctx);
    assert_eq!(release_pinned_cache(&*d).unwrap(), 2, "the shelf was kept");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

mod gpu {
    use super::common::stall::Trigger;
    use std::time::Duration;

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn a_teardown_returns_while_another_stream_is_held() {
        let _serial = super::common::gpu_lock();
        let d = super::common::cuda();
        // The primary context's first state allocates; the measured one reuses nothing of it
        // (its teardown shelves what it allocated: no `cuMemFreeHost`).
        let late =
            super::teardown_waited_for_a_held_stream(&d, Trigger::After(Duration::from_secs(2)));
        assert!(!late, "the teardown waited for another stream's work");
    }
}

// Pins issue 19 review finding 4: a block whose free failed was dropped from its shelf (lost,
// never freed), and the shelf's retain released although the block still needed its context.
#[test]
fn a_failed_free_keeps_the_block_and_its_retain_for_a_later_release() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    use_and_drop_on_sim(&sim);
    assert_eq!(sim.counters().live_host_allocs, 2);
    sim.fail_calls(
        "cuMemFreeHost",
        cuda_stream_pool::ErrorCode::ERROR_UNKNOWN,
        1,
    );
    let e = release_pinned_cache(&*d).unwrap_err();
    assert_eq!(e.code(), Some(cuda_stream_pool::ErrorCode::ERROR_UNKNOWN));
    let c = sim.counters();
    assert_eq!(
        (c.live_host_allocs, c.live_contexts),
        (1, 1),
        "the block not freed stays, and its context with it: {c:?}"
    );
    assert_eq!(release_pinned_cache(&*d).unwrap(), 1);
    let c = sim.counters();
    assert_eq!((c.live_host_allocs, c.live_contexts), (0, 0), "{c:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// A retain whose release failed is kept and released by the next call (it was `let _`).
#[test]
fn a_failed_release_keeps_the_retain_for_a_later_release() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    use_and_drop_on_sim(&sim);
    sim.fail_calls(
        "cuDevicePrimaryCtxRelease_v2",
        cuda_stream_pool::ErrorCode::ERROR_UNKNOWN,
        1,
    );
    assert!(release_pinned_cache(&*d).is_err());
    let c = sim.counters();
    assert_eq!((c.live_host_allocs, c.live_contexts), (0, 1), "{c:?}");
    assert_eq!(release_pinned_cache(&*d).unwrap(), 0);
    assert_eq!(sim.counters().live_contexts, 0);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// What `Context::adopt` documents (issue 19 review finding 2): an adopted primary context's
// page-locked memory is shelved only when a keep-alive is given; without one the teardown frees it.
#[test]
fn an_adopted_primary_context_shelves_its_memory_only_with_a_keep_alive() {
    for keep in [false, true] {
        let sim = Arc::new(SimDriver::new());
        let d: Arc<dyn Driver> = sim.clone();
        d.init().unwrap();
        let dev = d.device_get(0).unwrap();
        let raw = d.primary_ctx_retain(dev).unwrap();
        let (alive, dropped) = signal();
        let keep_alive = keep.then_some(alive);
        // SAFETY: retained above, released below after the state and everything made from it.
        let ctx = unsafe { Context::adopt(d.clone(), raw, keep_alive) }.unwrap();
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        let done = s.completed().unwrap();
        sim.advance(0);
        assert!(done.is_complete());
        drop(done);
        drop(s);
        drop(owner);
        drop(ctx);
        if keep {
            dropped.recv().unwrap();
        } else {
            // No keep-alive to tell the teardown's end: it frees the block last.
            let hang = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while sim.counters().live_host_allocs > 0 {
                assert!(
                    std::time::Instant::now() < hang,
                    "a hang: the block was kept"
                );
                std::thread::yield_now();
            }
        }
        let kept = sim.counters().live_host_allocs;
        assert_eq!(
            kept,
            u64::from(keep),
            "keep-alive {keep}: {kept} blocks kept"
        );
        assert_eq!(release_pinned_cache(&*d).unwrap(), kept as usize);
        // SAFETY: retained once above; nothing uses it any more.
        unsafe { d.primary_ctx_release(dev) }.unwrap();
        let c = sim.counters();
        assert_eq!((c.live_host_allocs, c.live_contexts), (0, 0), "{c:?}");
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

// Issue 19 review finding 6: `release_pinned_cache` freed in the caller's capture mode, so a free
// made in global mode while another thread captured in global mode would be refused and
// invalidate that capture (the simulation treats `cuMemFreeHost` as `cuMemHostAlloc`: see its
// `do_mem_free_host`). The device rules now relax it.
#[test]
fn releasing_the_cache_leaves_another_threads_global_capture_intact() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    use_and_drop_on_sim(&sim);
    let e = common::Env::new(&d);
    let s = e.stream();
    let cap = common::ForeignCapture::new(&d, e.ctx, s);
    assert_eq!(release_pinned_cache(&*d).unwrap(), 2);
    let g = cap.end().expect("the foreign capture survived the frees");
    // SAFETY: made above, destroyed once; nothing uses them any more.
    unsafe {
        d.graph_destroy(g).unwrap();
        d.stream_destroy(s).unwrap();
    }
    assert_eq!(sim.unrelaxed_calls(), Vec::<String>::new());
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Issue 19 review finding 3: the teardown of an adopted context asked whether it was the primary
// one by retaining the primary context, which activated (created) an inactive one as a side
// effect. It now asks `cuDevicePrimaryCtxGetState` first.
#[test]
fn tearing_down_an_adopted_context_does_not_activate_the_primary_one() {
    use cuda_stream_pool::driver::Device;
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    d.init().unwrap();
    let raw = sim.create_context(Device(0)).unwrap();
    // SAFETY: `raw` is destroyed below, after the state and everything made from it.
    let (alive, dropped) = signal();
    let ctx = unsafe { Context::adopt(d.clone(), raw, Some(alive)) }.unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let done = s.completed().unwrap();
    sim.advance(0);
    assert!(done.is_complete());
    drop(done);
    drop(s);
    drop(owner);
    sim.clear_calls();
    drop(ctx);
    dropped.recv().unwrap();
    let retains: Vec<_> = sim
        .calls()
        .into_iter()
        .filter(|c| c.name == "cuDevicePrimaryCtxRetain")
        .collect();
    assert!(
        retains.is_empty(),
        "the teardown retained the primary context: {retains:?}"
    );
    assert_eq!(sim.primary_ctx_state(Device(0)).unwrap(), (0, false));
    // Not the primary context: its page-locked memory was freed, not shelved.
    assert_eq!(sim.counters().live_host_allocs, 0);
    sim.destroy_context(raw).unwrap();
    assert_eq!(sim.counters().live_contexts, 0);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
