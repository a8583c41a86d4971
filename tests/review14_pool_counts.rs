//! Review 14: the pool's per-shard `taken`/`pushed` counters (commit 270b761) are written with a
//! load and a store under the shard's list lock. These tests drive acquisitions and releases on
//! many threads (so many home shards), through the list, the waiters' mailboxes (a cap), waiters
//! that leave after a stream was handed to them, reserves and trims, and check the statistics
//! at quiescent points: every acquisition counted once as a hit or a miss, every release once,
//! and `live == in_use + idle + retired_busy + handed`.

#[path = "common/futures.rs"]
mod futures_util;

use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::{Context, ContextOptions, PoolStats, Priority};
use futures_util::{poll, Noop};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::task::Waker;

fn balanced(s: &PoolStats) {
    assert_eq!(
        s.live,
        s.in_use + s.idle + s.retired_busy + s.handed,
        "live != in_use + idle + retired_busy + handed: {s:?}"
    );
    assert_eq!(s.created, s.misses + s.reserved, "{s:?}");
    assert_eq!(s.live, s.created - s.destroyed, "{s:?}");
}

const THREADS: usize = 8;
const ROUNDS: usize = 300;

// Probes review 14 (270b761): list hits and releases counted under the shard locks of many
// threads' home shards sum exactly.
#[test]
fn every_acquisition_and_release_on_many_threads_is_counted_once() {
    let sim = Arc::new(SimDriver::new());
    let ctx =
        Context::primary_with(sim.clone(), 0, ContextOptions::default().isolated(true)).unwrap();
    let start = Barrier::new(THREADS);
    std::thread::scope(|sc| {
        for t in 0..THREADS {
            let (ctx, start, sim) = (&ctx, &start, &sim);
            sc.spawn(move || {
                start.wait();
                for i in 0..ROUNDS {
                    let o = ctx.owner();
                    let s = o.stream().unwrap();
                    if (i + t) % 7 == 0 {
                        // Some streams are given back busy (retired busy, not handed out).
                        sim.enqueue_work(s.raw(), 50).unwrap();
                    } else if i % 11 == 0 {
                        sim.advance(100);
                    }
                    drop(s);
                    drop(o);
                }
            });
        }
    });
    let s = ctx.stats();
    assert_eq!(s.hits + s.misses, (THREADS * ROUNDS) as u64, "{s:?}");
    assert_eq!(s.in_use, 0, "{s:?}");
    assert_eq!(s.handed, 0, "{s:?}");
    balanced(&s);
}

// Probes review 14 (270b761): with a cap, releases go to waiters' mailboxes (counted in the
// mailbox counters) or into the lists (counted under the lock); both sum with the hits.
#[test]
fn capped_hand_overs_through_mailboxes_and_lists_keep_the_counts_balanced() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default()
        .isolated(true)
        .max_live_streams_per_key(Some(2));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let acquisitions = AtomicU64::new(0);
    let start = Barrier::new(THREADS);
    std::thread::scope(|sc| {
        for _ in 0..THREADS {
            let (ctx, start, acquisitions) = (&ctx, &start, &acquisitions);
            sc.spawn(move || {
                start.wait();
                for _ in 0..ROUNDS / 3 {
                    let o = ctx.owner();
                    let s = o.stream().unwrap();
                    acquisitions.fetch_add(1, Ordering::Relaxed);
                    std::thread::yield_now();
                    drop(s);
                    drop(o);
                }
            });
        }
    });
    let s = ctx.stats();
    assert!(s.live <= 2, "{s:?}");
    assert_eq!(
        s.hits + s.misses,
        acquisitions.load(Ordering::Relaxed),
        "{s:?}"
    );
    assert_eq!(s.in_use, 0, "{s:?}");
    balanced(&s);
}

// Probes review 14 (270b761): a waiter that leaves after a stream was handed to it: the stream
// goes back into a list without being counted as a release or an acquisition.
#[test]
fn a_stream_handed_to_a_waiter_that_leaves_is_neither_a_hit_nor_a_release() {
    let sim = Arc::new(SimDriver::new());
    let opts = ContextOptions::default()
        .isolated(true)
        .max_live_streams_per_key(Some(1));
    let ctx = Context::primary_with(sim.clone(), 0, opts).unwrap();
    let w = Waker::from(Arc::new(Noop));
    let first = ctx.owner();
    first.stream().unwrap();
    let mut waiting = Box::pin(ctx.owner().ready());
    assert!(poll(waiting.as_mut(), &w).is_pending());
    drop(first); // handed to the waiter's mailbox (idle: nothing enqueued)
    let s = ctx.stats();
    balanced(&s);
    assert_eq!((s.in_use, s.handed), (0, 1), "{s:?}");
    drop(waiting); // leaves without taking it
    let s = ctx.stats();
    balanced(&s);
    assert_eq!(
        (s.hits, s.misses, s.in_use, s.handed),
        (0, 1, 0, 0),
        "{s:?}"
    );
    assert_eq!(s.idle, 1, "{s:?}");
    // The next owner takes it from the list: one hit.
    let next = ctx.owner();
    next.stream().unwrap();
    let s = ctx.stats();
    balanced(&s);
    assert_eq!((s.hits, s.in_use), (1, 1), "{s:?}");
    drop(next);
    let s = ctx.stats();
    balanced(&s);
    assert_eq!(s.in_use, 0, "{s:?}");
}

// Probes review 14 (270b761): reserved streams pushed into the lists uncounted, taken as hits,
// released (counted) and trimmed.
#[test]
fn reserved_streams_taken_released_and_trimmed_keep_the_counts_balanced() {
    let sim = Arc::new(SimDriver::new());
    let ctx =
        Context::primary_with(sim.clone(), 0, ContextOptions::default().isolated(true)).unwrap();
    assert_eq!(ctx.reserve(Priority::Normal, 6).unwrap(), 6);
    let s = ctx.stats();
    balanced(&s);
    assert_eq!((s.idle, s.in_use, s.hits), (6, 0, 0), "{s:?}");
    std::thread::scope(|sc| {
        for _ in 0..4 {
            sc.spawn(|| {
                for _ in 0..50 {
                    let o = ctx.owner();
                    o.stream().unwrap();
                }
            });
        }
    });
    let s = ctx.stats();
    balanced(&s);
    assert_eq!(s.hits + s.misses, 200, "{s:?}");
    assert_eq!(s.in_use, 0, "{s:?}");
    ctx.trim().unwrap();
    let s = ctx.stats();
    balanced(&s);
    assert_eq!(s.in_use, 0, "{s:?}");
}
