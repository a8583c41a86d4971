//! The crate's objects hold their context through per-shard counts (`src/refs.rs`,
//! `src/ctx_ref.rs`), not the `Arc`'s shared count: a state lives while a user handle or an
//! object lives (on any thread, dropped on any other), is torn down once after the last of
//! them, and a handle made again from an object's context keeps it as any handle does. Each
//! test observes the teardown through the simulation (the primary context's release, and
//! nothing left).

mod common;

use cuda_stream_pool::driver::sim::SimDriver;
use cuda_stream_pool::{Context, DeviceBuffer, Owner};
use std::sync::Arc;

fn setup() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    (sim, ctx)
}

/// Owners made on eight threads (eight shards) outlive every handle and are dropped on other
/// threads than their own, in turn: the state stays usable until the last goes, then is torn
/// down once.
#[test]
fn objects_made_and_dropped_on_many_threads_keep_the_state_until_the_last_goes() {
    let (sim, ctx) = setup();
    let owners: Vec<Owner> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..8)
            .map(|_| {
                let ctx = &ctx;
                sc.spawn(move || {
                    // Owners that come and go on this thread first (the shard keeps its
                    // reference while the handle lives), then one that stays.
                    for _ in 0..3 {
                        let o = ctx.owner();
                        o.stream().unwrap();
                    }
                    let o = ctx.owner();
                    o.stream().unwrap();
                    o
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let before = common::primary_releases(&sim);
    drop(ctx);
    let mut owners = owners;
    while let Some(o) = owners.pop() {
        assert_eq!(
            common::primary_releases(&sim),
            before,
            "the state was torn down with {} owners alive",
            owners.len() + 1
        );
        // Still usable: a buffer on the owner's stream, read back.
        let s = o.stream().unwrap();
        let b = DeviceBuffer::from_slice(&s, &[owners.len() as u32]).unwrap();
        assert_eq!(b.to_vec(&s).unwrap(), vec![owners.len() as u32]);
        drop((b, s));
        std::thread::spawn(move || drop(o)).join().unwrap();
    }
    common::await_teardown(&sim, before);
    assert_eq!(common::primary_releases(&sim), before + 1);
    common::assert_clean(&sim);
}

/// A handle cloned from an owner's context after every other handle is gone keeps the state
/// as any handle does, after the owner goes too; new owners of it work; its drop tears down.
#[test]
fn a_handle_cloned_from_an_objects_context_keeps_the_state() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    o.stream().unwrap();
    drop(ctx);
    let again = o.context().clone();
    drop(o);
    let before = common::primary_releases(&sim);
    let o2 = again.owner();
    let s = o2.stream().unwrap();
    let b = DeviceBuffer::from_slice(&s, &[7u32; 4]).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), vec![7; 4]);
    drop((b, s));
    drop(o2);
    assert_eq!(
        common::primary_releases(&sim),
        before,
        "the state was torn down under a live handle"
    );
    drop(again);
    common::await_teardown(&sim, before);
    common::assert_clean(&sim);
}

/// The process's shared state is joined (not made again) while only an object keeps it: a
/// second user's `Context::primary` gets the same state, and the state goes after both.
#[test]
fn the_shared_state_kept_only_by_an_object_is_joined_by_a_new_user() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    drop(ctx);
    let joined = Context::primary(sim.clone(), 0).unwrap();
    assert_eq!(
        &joined,
        o.context(),
        "a second state was made for the context"
    );
    let before = common::primary_releases(&sim);
    drop(joined);
    assert_eq!(common::primary_releases(&sim), before);
    drop(o);
    common::await_teardown(&sim, before);
    common::assert_clean(&sim);
}

/// A forgotten object (`mem::forget`) leaks the state: it is never torn down, and nothing of
/// it is destroyed or freed (its stream and buffer stay alive in the simulation).
#[test]
fn a_forgotten_object_leaks_the_state_and_frees_nothing_under_it() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let b = DeviceBuffer::<u32>::zeroed(&o.stream().unwrap(), 16).unwrap();
    let before = common::primary_releases(&sim);
    let streams = sim.counters().live_streams;
    std::mem::forget(b);
    drop(o);
    drop(ctx);
    assert_eq!(
        common::primary_releases(&sim),
        before,
        "the state of a forgotten buffer was torn down"
    );
    let c = sim.counters();
    assert_eq!(c.live_streams, streams, "{c:?}");
    assert_eq!(c.live_allocs, 1, "{c:?}");
}

// Regression: issue 22's 16-thread cost. `Context::primary` registered its new state by
// uncounting the handle and counting it again: the handles went to zero, which marks every shard
// `CLOSING` for good, and then every owner took and gave back a strong reference of the `Arc` that
// all threads share (found with `perf` at two threads: 26 % of the time in `CtxRef`'s drop, on
// the `Arc`'s count).
/// A state made by `Context::primary` (and joined by a second user) has no `CLOSING` shard while
/// its handles live, before and after owners come and go on several threads.
#[test]
fn no_shard_is_closing_while_a_handle_lives() {
    let (_sim, ctx) = setup();
    assert_eq!(ctx.model_closing_shards(), 0, "after Context::primary");
    let joined = Context::primary(ctx.driver().clone(), 0).unwrap();
    std::thread::scope(|sc| {
        for _ in 0..4 {
            let ctx = &ctx;
            sc.spawn(move || {
                for _ in 0..10 {
                    let o = ctx.owner();
                    o.stream().unwrap();
                }
            });
        }
    });
    assert_eq!(ctx.model_closing_shards(), 0, "after owners came and went");
    drop(joined);
    assert_eq!(ctx.model_closing_shards(), 0, "after a second user left");
}

// Regression (review 19): a handle made again after every handle was gone left every shard
// `CLOSING` for as long as the state lived: a `Context::primary` that joined a state kept only
// by an owner (or by the thread's own owner, behind `Context::stream`), or a clone of an owner's
// context. Safe, but each owner then wrote the count that all threads share.
/// A `Context::primary` that joins a state only an owner kept clears every shard's `CLOSING`;
/// the state is still torn down once everything is gone.
#[test]
fn a_primary_that_joins_a_state_kept_by_an_owner_clears_closing() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    o.stream().unwrap();
    drop(ctx);
    assert!(
        o.context().model_closing_shards() > 0,
        "the last handle's drop marks the shards"
    );
    let joined = Context::primary(sim.clone(), 0).unwrap();
    assert_eq!(joined.model_closing_shards(), 0, "after the join");
    drop(o);
    assert_eq!(
        joined.model_closing_shards(),
        0,
        "after the owner that kept it"
    );
    let before = common::primary_releases(&sim);
    drop(joined);
    assert_eq!(common::primary_releases(&sim), before + 1, "torn down once");
    common::assert_clean(&sim);
}

/// The thread's own owner (behind `Context::stream`) keeps the state after the handle goes;
/// the next `Context::primary` on the thread joins it with no shard `CLOSING`.
#[test]
fn a_primary_that_joins_a_state_kept_by_the_threads_own_owner_clears_closing() {
    let sim = Arc::new(SimDriver::new());
    let d = sim.clone();
    std::thread::spawn(move || {
        let c = Context::primary(d.clone(), 0).unwrap();
        c.stream().unwrap().synchronize().unwrap();
        drop(c);
        let again = Context::primary(d, 0).unwrap();
        for _ in 0..3 {
            let o = again.owner();
            o.stream().unwrap();
        }
        assert_eq!(again.model_closing_shards(), 0);
    })
    .join()
    .unwrap();
    common::assert_clean(&sim);
}

/// A clone of an owner's context, made after every handle was dropped, clears `CLOSING`; its
/// drop marks the shards again, and the owner's drop then tears the state down.
#[test]
fn a_handle_cloned_from_an_owner_clears_closing_and_its_drop_marks_again() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    o.stream().unwrap();
    drop(ctx);
    let again = o.context().clone();
    assert_eq!(again.model_closing_shards(), 0, "after the clone");
    drop(again);
    assert!(
        o.context().model_closing_shards() > 0,
        "the clone's drop (the last handle) marks the shards again"
    );
    let before = common::primary_releases(&sim);
    drop(o);
    assert_eq!(
        common::primary_releases(&sim),
        before + 1,
        "torn down with the owner"
    );
    common::assert_clean(&sim);
}
