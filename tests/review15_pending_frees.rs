//! Review 15: hand-overs of a stream whose previous owner's frees are still pending
//! (`Slot::enqueue_free`, `Slot::settled`). The simulated driver gives every `cuMemFreeAsync`
//! GPU time here (`SimDriver::set_free_time`), so a free enqueued on an idle stream is still
//! pending when the owner goes, as on a real GPU. The oracle is `SimDriver::misuse` (use after
//! free, races, streams destroyed under their work) and `SimDriver::is_busy_but_frees` at every
//! hand-over.

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{
    Context, ContextOptions, DeviceBuffer, ErrorCode, Priority, StreamRef, MAX_IDLE,
};
use std::sync::Arc;

/// GPU time of a free: long against everything else the tests enqueue (0 ns).
const FREE_NS: u64 = 10_000;

fn sim() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    sim.set_free_time(FREE_NS);
    let d: Arc<dyn Driver> = sim.clone();
    (sim, Context::primary(d, 0).unwrap())
}

fn queries(sim: &SimDriver) -> usize {
    sim.calls()
        .iter()
        .filter(|c| c.name == "cuStreamQuery")
        .count()
}

fn no_misuse(sim: &SimDriver) {
    assert!(sim.misuse().is_empty(), "{:#?}", sim.misuse());
}

/// The stream an owner was just handed has nothing pending but frees.
fn fresh(sim: &SimDriver, s: &StreamRef<'_>) {
    assert!(
        !sim.is_busy_but_frees(s.model_handle()),
        "a stream with pending work (not only frees) was handed out"
    );
}

/// The owner's task: a buffer worked on and read back (a synchronize), then freed: the free is
/// the stream's only pending work when the owner goes.
fn task(ctx: &Context, k: &Kernels) -> u64 {
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let mut b = DeviceBuffer::from_slice(&s, &[1u32; 64]).unwrap();
    k.add_u32(&s, &b, 2).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), vec![3; 64]);
    b.fill(&s, 0).unwrap();
    s.synchronize().unwrap();
    drop(b);
    s.model_handle().0
}

/// The premise: with a free taking GPU time, the sim shows a hand-over with a pending free, made
/// without a query; the next owner's work (on new memory, and on memory of a buffer that outlived
/// its owner) runs after it; nothing touches freed memory and no stream is destroyed under it.
#[test]
fn a_stream_is_handed_over_with_its_free_pending_and_nothing_touches_freed_memory() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    // A buffer of the first generation that outlives its owner.
    let (kept, raw) = {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let kept = DeviceBuffer::from_slice(&s, &[5u32; 16]).unwrap();
        let x = DeviceBuffer::from_slice(&s, &[1u32; 16]).unwrap();
        k.add_u32(&s, &x, 1).unwrap();
        k.add_u32(&s, &kept, 1).unwrap();
        s.synchronize().unwrap();
        drop(x); // pending for FREE_NS
        (kept, s.model_handle())
    };
    assert!(sim.is_busy(raw), "the premise: the free is still pending");
    sim.clear_calls();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    assert_eq!(s.model_handle(), raw);
    assert_eq!(queries(&sim), 0, "{:?}", sim.calls());
    fresh(&sim, &s);
    assert!(sim.is_busy(raw), "handed over with the free pending");
    // The kept buffer's last generation ended: used here without ordering, freed later on the
    // disposal stream unordered.
    k.add_u32(&s, &kept, 1).unwrap();
    let y = DeviceBuffer::from_slice(&s, &[9u32; 16]).unwrap();
    k.add_u32(&s, &y, 1).unwrap();
    assert_eq!(kept.to_vec(&s).unwrap(), vec![7; 16]);
    assert_eq!(y.to_vec(&s).unwrap(), vec![10; 16]);
    drop(y);
    drop(o);
    drop(kept);
    assert_eq!(ctx.stats().created, 1);
    sim.advance(10 * FREE_NS);
    ctx.trim().unwrap();
    no_misuse(&sim);
    drop(ctx);
    no_misuse(&sim);
}

/// A buffer last used in the generation whose frees are still pending is freed on the disposal
/// stream, unordered, after the hand-over: the only work left of that generation is the frees of
/// other pointers.
#[test]
fn an_old_generation_buffer_is_freed_unordered_while_the_frees_are_pending() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    let mut kept = Vec::new();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        for i in 0..4u32 {
            let b = DeviceBuffer::from_slice(&s, &[i; 32]).unwrap();
            k.add_u32(&s, &b, 1).unwrap();
            kept.push(b);
        }
        let x = DeviceBuffer::from_slice(&s, &[1u32; 32]).unwrap();
        s.synchronize().unwrap();
        drop(x);
        // Two more frees after the first, still no other work.
        kept.pop();
        kept.pop();
    }
    let o = ctx.owner();
    let s = o.stream().unwrap();
    fresh(&sim, &s);
    assert!(sim.is_busy(s.model_handle()));
    let disposal = ctx.disposal_stream();
    drop(kept); // on the disposal stream: the generation of their last use ended
    assert!(sim.is_busy(disposal));
    // The new owner's work runs after the frees.
    let y = DeviceBuffer::from_slice(&s, &[1u32; 32]).unwrap();
    k.add_u32(&s, &y, 1).unwrap();
    assert_eq!(y.to_vec(&s).unwrap(), vec![2; 32]);
    drop(y);
    drop(o);
    drop(ctx);
    no_misuse(&sim);
}

/// Trims and the teardown never destroy a stream under its pending frees (the destroy still
/// requires the stream known idle or a query): a trim right after the release leaves it, a trim
/// after the frees ran destroys it.
#[test]
fn a_stream_is_never_destroyed_under_its_pending_frees() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    let raw = task(&ctx, &k);
    assert!(sim.is_busy(cuda_stream_pool::driver::Stream(raw)));
    assert_eq!(ctx.trim().unwrap(), 0);
    assert_eq!(ctx.stats().live, 1);
    no_misuse(&sim);
    sim.advance(FREE_NS);
    assert_eq!(ctx.trim().unwrap(), 1);
    // Teardown right after a task: the drain waits for the free.
    task(&ctx, &k);
    drop(k);
    drop(ctx);
    no_misuse(&sim);
}

// DEFECT (PoolStats::idle): a retired stream with only frees pending is counted `idle` ("Retired
// streams whose work has completed"), yet `Context::trim` ("destroys every retired stream whose
// work has completed") leaves it: the two disagree.
#[test]
fn stats_idle_counts_only_streams_that_trim_can_destroy() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    task(&ctx, &k);
    let st = ctx.stats();
    let trimmed = ctx.trim().unwrap() as u64;
    assert_eq!(
        (st.idle, st.retired_busy),
        (trimmed, 1 - trimmed),
        "stats say {st:?}, but trim destroyed {trimmed}"
    );
    no_misuse(&sim);
}

// DEFECT (MAX_IDLE / PoolStats::idle): "every statistics reading reports at most MAX_IDLE idle
// streams per key" (pool.rs) no longer holds: streams released with only frees pending count idle
// (hand-over rule) but the reading's trim cannot destroy them (destroy rule).
#[test]
fn a_statistics_reading_reports_at_most_max_idle_idle_streams() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    let owners: Vec<_> = (0..MAX_IDLE + 8).map(|_| ctx.owner()).collect();
    let mut bufs = Vec::new();
    for o in &owners {
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
        k.add_u32(&s, &b, 1).unwrap();
        s.synchronize().unwrap();
        bufs.push(b);
    }
    drop(bufs); // one free pending on each stream
    drop(owners);
    let st = ctx.stats();
    assert!(
        st.idle <= MAX_IDLE as u64,
        "{} idle streams in a reading, more than MAX_IDLE = {MAX_IDLE}: {st:?}",
        st.idle
    );
    no_misuse(&sim);
}

/// Not a safety defect, a visible change: a stream just handed to an owner that enqueued nothing
/// may query busy (its predecessor's frees are pending; `StreamRef::query`'s example, on a sim
/// whose frees take no time, shows a fresh stream idle). A `synchronize` covers the frees.
#[test]
fn a_fresh_owners_stream_may_query_busy_until_the_frees_ran() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    task(&ctx, &k);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    assert!(!s.query().unwrap(), "the predecessor's free is pending");
    s.synchronize().unwrap();
    assert!(s.query().unwrap());
    no_misuse(&sim);
}

/// A capture begun by the next owner on a stream with the previous owner's free pending: the
/// free is not part of the graph, and the graph's launches run after it.
#[test]
fn a_capture_on_a_stream_with_a_pending_free() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    task(&ctx, &k);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    fresh(&sim, &s);
    assert!(sim.is_busy(s.model_handle()));
    let x = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
    let g = s.begin_capture().unwrap();
    k.add_u32(&s, &x, 2).unwrap();
    let exec = g.end().unwrap().instantiate().unwrap();
    exec.launch(&s).unwrap();
    exec.launch(&s).unwrap();
    assert_eq!(x.to_vec(&s).unwrap(), vec![5; 8]);
    drop(exec);
    drop(x);
    drop(o);
    drop(ctx);
    no_misuse(&sim);
}

/// A free deferred by a capture (the buffer dropped while its stream captured) is retried at the
/// capture's end, on the stream: then the owner goes, and the stream is handed on with that free
/// pending.
#[test]
fn a_deferred_free_retried_by_the_flush_then_handed_over() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
        k.add_u32(&s, &b, 1).unwrap();
        s.synchronize().unwrap();
        let g = s.begin_capture().unwrap();
        drop(b);
        assert_eq!(ctx.pending(), 1);
        drop(g);
        assert_eq!(ctx.pending(), 0);
    }
    let o = ctx.owner();
    let s = o.stream().unwrap();
    fresh(&sim, &s);
    let y = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
    k.add_u32(&s, &y, 1).unwrap();
    assert_eq!(y.to_vec(&s).unwrap(), vec![2; 8]);
    drop(y);
    drop(o);
    drop(ctx);
    no_misuse(&sim);
}

/// A free that the driver refuses on the stream goes to the disposal stream after an event wait
/// (`order(slot, disposal)`): that record is work on the stream, so the hand-over asks the driver
/// (and the stream is idle by then); nothing is freed early.
#[test]
fn a_refused_free_ordered_through_the_disposal_stream() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    let raw = {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
        let c = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
        k.add_u32(&s, &b, 1).unwrap();
        s.synchronize().unwrap();
        drop(c); // a free on the stream: still settled
        sim.fail_calls("cuMemFreeAsync", ErrorCode::ERROR_OUT_OF_MEMORY, 1);
        drop(b); // refused on the stream: ordered to the disposal stream
        s.model_handle()
    };
    assert!(sim.is_busy(raw));
    sim.clear_calls();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    fresh(&sim, &s);
    assert!(queries(&sim) > 0, "{:?}", sim.calls());
    drop(s);
    drop(o);
    drop(ctx);
    no_misuse(&sim);
}

/// A completion resolved after the hand-over (its stream's frees still pending then) and one of
/// the new generation: neither makes the stream known idle early, so no destroy runs under the
/// frees.
#[test]
fn completions_around_a_hand_over_with_pending_frees() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    let done = {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
        k.add_u32(&s, &b, 1).unwrap();
        let done = s.completed().unwrap();
        sim.advance(1);
        assert!(done.is_complete());
        drop(b);
        done
    };
    // Resolved in the next generation, with the free still pending.
    let o = ctx.owner();
    let s = o.stream().unwrap();
    fresh(&sim, &s);
    futures_lite_block_on(done).unwrap();
    // Behind the pending free (the completion poller's waits may move the manual clock, so
    // whether it has landed yet is not asserted).
    let c2 = s.completed().unwrap();
    drop(s);
    drop(o);
    ctx.trim().unwrap();
    no_misuse(&sim);
    sim.advance(10 * FREE_NS);
    futures_lite_block_on(c2).unwrap();
    ctx.trim().unwrap();
    assert_eq!(ctx.stats().live, 0);
    drop(ctx);
    no_misuse(&sim);
}

/// A loan (and an exposed raw handle) in the generation after a hand-over with pending frees:
/// the borrower's work is unseen, so the next hand-over asks the driver, whatever frees the crate
/// adds after it.
#[test]
fn a_raw_handle_after_a_pending_free_hand_over_makes_the_next_ask() {
    let (sim, ctx) = sim();
    let k = Kernels::load(&ctx).unwrap();
    task(&ctx, &k);
    let raw = {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        fresh(&sim, &s);
        let b = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
        s.synchronize().unwrap();
        let raw = s.raw();
        sim.enqueue_work(raw, 5 * FREE_NS).unwrap(); // unseen by the crate
        drop(b); // a free after it: must not make the stream settled
        raw
    };
    let o = ctx.owner();
    let s = o.stream().unwrap();
    if s.model_handle() == raw {
        fresh(&sim, &s);
    }
    drop(s);
    drop(o);
    drop(ctx);
    no_misuse(&sim);
}

/// Buffers dropped on other threads (frees under the slot's lock) while their stream's owner
/// works, releases, and the stream is handed on: every hand-over finds nothing but frees pending,
/// and nothing touches freed memory. Frees take GPU time, so they are often pending.
#[test]
fn frees_from_other_threads_race_the_owners_work_and_the_hand_overs() {
    let sim = Arc::new(SimDriver::new());
    sim.set_free_time(200);
    sim.set_logging(false);
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary_with(
        d,
        0,
        ContextOptions::default().max_live_streams_per_key(Some(2)),
    )
    .unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let (tx, rx) = crossbeam_channel::unbounded::<DeviceBuffer<u32>>();
    let dropper = std::thread::spawn(move || {
        for b in rx {
            drop(b);
        }
    });
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ticker = {
        let (sim, stop) = (sim.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                sim.advance(37);
                std::thread::yield_now();
            }
        })
    };
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let (ctx, tx, sim) = (ctx.clone(), tx.clone(), sim.clone());
            let k = Kernels::load(&ctx).unwrap();
            std::thread::spawn(move || {
                for i in 0..300u32 {
                    let o = ctx.owner();
                    let s = o.stream().unwrap();
                    fresh(&sim, &s);
                    let mut a = DeviceBuffer::from_slice(&s, &[i; 16]).unwrap();
                    let b = DeviceBuffer::from_slice(&s, &[w; 16]).unwrap();
                    k.add_u32(&s, &a, 1).unwrap();
                    match i % 4 {
                        0 => s.synchronize().unwrap(),
                        1 => {
                            assert_eq!(a.to_vec(&s).unwrap(), vec![i + 1; 16]);
                        }
                        2 => a.fill(&s, 3).unwrap(),
                        _ => {}
                    }
                    tx.send(b).unwrap();
                    if i % 3 == 0 {
                        s.synchronize().unwrap();
                    }
                    if i % 2 == 0 {
                        tx.send(a).unwrap();
                    } else {
                        drop(a);
                    }
                    drop(s);
                    drop(o);
                    if i % 50 == 0 {
                        let _ = ctx.stats();
                        let _ = ctx.trim();
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    drop(tx);
    dropper.join().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    ticker.join().unwrap();
    sim.advance(1_000_000);
    ctx.trim().unwrap();
    drop(k);
    drop(ctx);
    no_misuse(&sim);
}

/// A waiter at the cap is handed the stream that comes back with only its owner's free pending
/// (`hand_to_waiter`), without a query; its work runs after the free.
#[test]
fn a_waiter_at_the_cap_gets_a_stream_with_its_free_pending() {
    let sim = Arc::new(SimDriver::new());
    sim.set_free_time(FREE_NS);
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary_with(
        d,
        0,
        ContextOptions::default().max_live_streams_per_key(Some(1)),
    )
    .unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
    k.add_u32(&s, &b, 1).unwrap();
    s.synchronize().unwrap();
    let (ctx2, sim2) = (ctx.clone(), sim.clone());
    let k2 = Kernels::load(&ctx).unwrap();
    let waiter = std::thread::spawn(move || {
        let o = ctx2.owner();
        let s = o.stream().unwrap();
        fresh(&sim2, &s);
        let y = DeviceBuffer::from_slice(&s, &[1u32; 8]).unwrap();
        k2.add_u32(&s, &y, 1).unwrap();
        assert_eq!(y.to_vec(&s).unwrap(), vec![2; 8]);
    });
    while ctx.stats().waits == 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    drop(b);
    drop(s);
    drop(o);
    waiter.join().unwrap();
    let _ = Priority::Low;
    drop(k);
    drop(ctx);
    no_misuse(&sim);
}

/// A minimal executor for one future (the crate's completions need no runtime).
fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context as Cx, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Cx::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(std::time::Duration::from_millis(1));
    }
}
