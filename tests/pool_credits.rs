//! The pool's count of retired streams is kept per shard where it can be (`ShardData::credit` in
//! `src/pool.rs`): a stream taken from a shard leaves its count there for the next release into
//! it, so that a thread taking and releasing its own streams writes no shared counter. The
//! count is then an upper bound, and the bounds that depend on it must stay exact: at most
//! `MAX_IDLE` idle streams are kept, and a trim never destroys below the reserve. Streams moved
//! between shards (an owner on one thread taking another thread's released streams) give the
//! shards credits that no list holds, which is what these tests make.

mod common;

use cuda_stream_pool::driver::sim::SimDriver;
use cuda_stream_pool::{Context, ContextOptions, Owner, Priority, MAX_IDLE};
use std::sync::{Arc, Barrier};

fn setup() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    (sim, ctx)
}

/// `threads` threads each hold `each` owners' streams at once (taking from every shard once the
/// home one is empty), then release them on their own thread (into their home shard): the
/// shards they took from keep credits.
fn take_all_and_release_at_home(ctx: &Context, threads: usize, each: usize) {
    let barrier = Barrier::new(threads);
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| {
                let owners: Vec<Owner> = (0..each)
                    .map(|_| {
                        let o = ctx.owner();
                        o.stream().unwrap();
                        o
                    })
                    .collect();
                barrier.wait();
                drop(owners);
            });
        }
    });
}

/// Before the counts were exact at a trim, a trim could take the shards' credits for streams
/// and destroy reserved ones.
#[test]
fn a_trim_never_destroys_below_the_reserve_after_streams_moved_between_shards() {
    let (sim, ctx) = setup();
    let n = MAX_IDLE + 8;
    assert_eq!(ctx.reserve(Priority::Normal, n).unwrap(), n);
    for _ in 0..3 {
        take_all_and_release_at_home(&ctx, 4, n / 4);
        ctx.trim().unwrap();
        let s = ctx.stats();
        assert_eq!(s.destroyed, 0, "a reserved stream was destroyed: {s:?}");
        assert_eq!(s.idle, n as u64, "{s:?}");
    }
    // All of them still serve owners at once without creating one.
    take_all_and_release_at_home(&ctx, 4, n / 4);
    let s = ctx.stats();
    assert_eq!(s.misses, 0, "an acquisition created a stream: {s:?}");
    drop(ctx);
    common::assert_clean(&sim);
}

/// The idle bound is exact: after streams moved between shards, releases keep `MAX_IDLE` idle
/// streams, not fewer (a trim counting credits as streams would destroy more) and not more.
#[test]
fn the_idle_bound_is_exact_after_streams_moved_between_shards() {
    let (sim, ctx) = setup();
    for round in 0..4 {
        take_all_and_release_at_home(&ctx, 8, 10);
        let s = ctx.stats();
        assert_eq!(
            s.idle, MAX_IDLE as u64,
            "round {round}: the idle streams kept after 80 releases: {s:?}"
        );
        assert_eq!(s.live, MAX_IDLE as u64, "round {round}: {s:?}");
    }
    drop(ctx);
    common::assert_clean(&sim);
}

/// Review 17 (a70513d): a release that used its shard's credit wrote no count and so never
/// trimmed, even with more than `MAX_IDLE` idle streams retired (released here on a host-function
/// thread, which never trims): 41 stayed retired after the release (before a70513d, 32).
#[test]
fn a_release_that_uses_a_credit_still_trims_to_max_idle() {
    let sim = Arc::new(SimDriver::new());
    let ctx =
        Context::primary_with(sim.clone(), 0, ContextOptions::default().isolated(true)).unwrap();
    let base = sim.counters().live_streams;
    let extra = 8;
    let owners: Vec<_> = (0..MAX_IDLE + extra)
        .map(|_| {
            let o = ctx.owner();
            o.stream().unwrap();
            o
        })
        .collect();
    let launcher = ctx.owner();
    launcher.stream().unwrap();
    // A stream released and taken again from this thread's home shard: a credit there.
    let a = ctx.owner();
    a.stream().unwrap();
    drop(a);
    let a = ctx.owner();
    a.stream().unwrap();
    // MAX_IDLE + extra idle streams released on a host-function thread (no trim there).
    let (tx, rx) = std::sync::mpsc::channel();
    launcher
        .stream()
        .unwrap()
        .launch_host_func(move || {
            drop(owners);
            tx.send(()).unwrap();
        })
        .unwrap();
    sim.advance(1_000);
    rx.recv().unwrap();
    let before = sim.counters().live_streams - base;
    // This thread's release, outside host functions: the key's next release.
    drop(a);
    let alive = sim.counters().live_streams - base;
    eprintln!("pool streams alive: {before} before the release, {alive} after (1 held)");
    assert!(
        alive <= MAX_IDLE as u64 + 1,
        "after a release outside host functions, {alive} streams of the key are alive: one held \
         and {} retired, all idle: more than MAX_IDLE = {MAX_IDLE}",
        alive - 1
    );
    drop(launcher);
}
