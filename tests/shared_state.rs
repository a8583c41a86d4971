//! One state per (driver, CUDA context) in the process (issue 21): independent users of the
//! crate that ask for the same context share its streams, cap, memory pool and buffers; options
//! that conflict are an error; an isolated state is nobody else's; a dead context's state is
//! never joined; the state lives while any user holds it and its teardown runs once, after the
//! last, with what keeps an adopted context alive dropped after it. Simulated driver.

mod common;

use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver};
use cuda_stream_pool::{Context, ContextOptions, DeviceBuffer, ErrorCode};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

fn sim() -> (Arc<SimDriver>, Arc<dyn Driver>) {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    (sim, d)
}

#[test]
fn two_users_of_one_context_share_its_streams_and_buffers() {
    let (sim, d) = sim();
    let lib_a = Context::primary(d.clone(), 0).unwrap();
    let lib_b = Context::primary(d.clone(), 0).unwrap();
    assert_eq!(lib_a, lib_b, "one state for one (driver, context)");
    let streams = sim.counters().live_streams;
    let (oa, ob) = (lib_a.owner(), lib_b.owner());
    let buf = DeviceBuffer::from_slice(&oa.stream().unwrap(), &[7u32; 16]).unwrap();
    // A's buffer on B's stream: ordered, not refused as "another context's".
    assert_eq!(buf.to_vec(&ob.stream().unwrap()).unwrap(), vec![7; 16]);
    drop(buf);
    drop((oa, ob));
    ctx_sync(&lib_a);
    // A stream A's owner retired is handed to B's next owner: one pool.
    let before = sim.counters().live_streams;
    let o = lib_a.owner();
    o.stream().unwrap();
    drop(o);
    let o = lib_b.owner();
    o.stream().unwrap();
    assert_eq!(sim.counters().live_streams, before, "B reused A's stream");
    assert!(before >= streams);
}

fn ctx_sync(c: &Context) {
    c.synchronize().unwrap();
}

#[test]
fn a_cap_is_shared_by_every_user_of_the_state() {
    let (_sim, d) = sim();
    let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    let lib_a = Context::primary_with(d.clone(), 0, opts).unwrap();
    let lib_b = Context::primary(d.clone(), 0).unwrap(); // joins, whatever the options
    assert_eq!(lib_a, lib_b);
    let oa = lib_a.owner();
    let _s = oa.stream().unwrap();
    // B's first stream waits for A's: one cap for both.
    let mut ready = Box::pin(lib_b.owner().ready());
    let waker = std::task::Waker::from(Arc::new(NoWake));
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(
        ready.as_mut().poll(&mut cx).is_pending(),
        "B got a stream beyond A's cap of 1"
    );
    drop(_s);
    drop(oa);
    ctx_sync(&lib_a);
    let ob = common::block_on(ready).unwrap();
    ob.stream().unwrap();
}

struct NoWake;
impl std::task::Wake for NoWake {
    fn wake(self: Arc<Self>) {}
}

#[test]
fn options_that_conflict_with_the_shared_state_are_an_error_that_says_what_to_do() {
    let (_sim, d) = sim();
    let _server = Context::primary_with(d.clone(), 0, ContextOptions::server()).unwrap();
    let e = Context::primary_with(d.clone(), 0, ContextOptions::unbounded()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("other options") && msg.contains("isolated"),
        "{msg}"
    );
    // The same options join.
    let same = Context::primary_with(d.clone(), 0, ContextOptions::server()).unwrap();
    assert_eq!(same, _server);
}

#[test]
fn an_isolated_state_is_neither_joined_nor_joining() {
    let (sim, d) = sim();
    let shared = Context::primary(d.clone(), 0).unwrap();
    let iso = ContextOptions::default().isolated(true);
    let mine = Context::primary_with(d.clone(), 0, iso).unwrap();
    assert_ne!(shared, mine);
    assert_eq!(shared.raw(), mine.raw(), "one CUDA context, two states");
    // Nobody joins the isolated one: a later user gets the shared state.
    assert_eq!(Context::primary(d.clone(), 0).unwrap(), shared);
    // Two states cannot use each other's buffers (an error, not disorder).
    let (o1, o2) = (shared.owner(), mine.owner());
    let buf = DeviceBuffer::<u8>::zeroed(&o1.stream().unwrap(), 8).unwrap();
    assert!(buf.to_vec(&o2.stream().unwrap()).is_err());
    drop((buf, o1, o2, shared, mine));
    assert_eq!(sim.counters().live_streams, 0);
}

#[test]
fn the_state_is_torn_down_once_after_its_last_user_and_a_later_user_gets_a_new_one() {
    let (sim, d) = sim();
    let a = Context::primary(d.clone(), 0).unwrap();
    let b = Context::primary(d.clone(), 0).unwrap();
    let before = common::primary_releases(&sim);
    drop(a);
    assert_eq!(
        common::primary_releases(&sim),
        before,
        "a user is left: no teardown"
    );
    assert!(sim.counters().live_streams > 0, "the disposal stream lives");
    drop(b);
    assert_eq!(common::primary_releases(&sim), before + 1, "one teardown");
    assert_eq!(sim.counters().live_streams, 0);
    // A new user: a new state that works.
    let c = Context::primary(d.clone(), 0).unwrap();
    let o = c.owner();
    let buf = DeviceBuffer::from_slice(&o.stream().unwrap(), &[1u8, 2]).unwrap();
    assert_eq!(buf.to_vec(&o.stream().unwrap()).unwrap(), vec![1, 2]);
}

#[test]
fn a_join_holds_no_retain_of_its_own() {
    // Each join retains the primary context to find it and releases that retain again: only
    // the state's retain is left, released at its teardown.
    let (sim, d) = sim();
    let retains = |sim: &SimDriver| {
        sim.calls()
            .iter()
            .filter(|c| c.name == "cuDevicePrimaryCtxRetain")
            .count()
    };
    let a = Context::primary(d.clone(), 0).unwrap();
    let joins: Vec<_> = (0..5)
        .map(|_| Context::primary(d.clone(), 0).unwrap())
        .collect();
    assert_eq!(retains(&sim), 6);
    assert_eq!(
        common::primary_releases(&sim),
        5,
        "each join released its retain"
    );
    drop(joins);
    drop(a);
    assert_eq!(common::primary_releases(&sim), 6);
    assert_eq!(sim.counters().live_contexts, 0, "no retain left");
}

#[test]
fn concurrent_first_users_all_get_one_state_and_the_losers_leave_nothing() {
    for _ in 0..20 {
        let (sim, d) = sim();
        let n = 4;
        let barrier = Arc::new(Barrier::new(n));
        let threads: Vec<_> = (0..n)
            .map(|_| {
                let (d, barrier) = (d.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    Context::primary(d, 0).unwrap()
                })
            })
            .collect();
        let ctxs: Vec<Context> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(ctxs.iter().all(|c| *c == ctxs[0]), "one state for all");
        // States that lost the race were torn down: one disposal stream left.
        drop(ctxs);
        let c = sim.counters();
        assert_eq!((c.live_streams, c.live_contexts), (0, 0), "{c:?}");
    }
}

#[test]
fn a_dead_contexts_state_is_not_joined() {
    let (sim, d) = sim();
    let a = Context::primary(d.clone(), 0).unwrap();
    sim.kill_context(a.raw(), ErrorCode::ERROR_ILLEGAL_ADDRESS);
    assert!(a.health().is_err(), "the state knows its context died");
    // A new user is not handed the dead state: it tries a new one (which the dead context
    // refuses, as on the H200).
    match Context::primary(d.clone(), 0) {
        Ok(b) => assert_ne!(b, a, "a dead state was joined"),
        Err(e) => assert!(e.is_sticky(), "{e}"),
    }
}

/// What an adopter passes to keep its context alive: records whether the state's teardown was
/// over (the state's streams destroyed) when it was dropped.
struct Keep {
    sim: Arc<SimDriver>,
    dropped: Arc<AtomicUsize>,
    after_teardown: Arc<AtomicBool>,
}

impl Drop for Keep {
    fn drop(&mut self) {
        if self.sim.counters().live_streams == 0 {
            self.after_teardown.store(true, Ordering::SeqCst);
        }
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

// The first adopter's keep-alive keeps the shared state's context alive until after its
// teardown, whichever user leaves last; a joiner's is not needed (the state keeps its context
// alive already) and is dropped at the join, so adopting again and again adds nothing (review 8,
// defect 2).
#[test]
fn the_first_keep_alive_lives_until_after_the_teardown_and_joiners_are_dropped_at_once() {
    let (sim, d) = sim();
    let env = common::Env::new(&d);
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut states = Vec::new();
    let mut flags = Vec::new();
    for i in 0..3 {
        let after = Arc::new(AtomicBool::new(false));
        flags.push(after.clone());
        let keep = Keep {
            sim: sim.clone(),
            dropped: dropped.clone(),
            after_teardown: after,
        };
        // SAFETY: `env.ctx` is the retained primary context, live for the whole test; the
        // keep-alive holds nothing the state needs.
        let c = unsafe { Context::adopt(d.clone(), env.ctx, Some(Box::new(keep))) }.unwrap();
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            i,
            "joiners' dropped at the join"
        );
        states.push(c);
    }
    assert!(states.iter().all(|c| *c == states[0]));
    // The first user leaves first: its keep-alive stays with the state.
    states.remove(0);
    states.remove(0);
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        2,
        "the first one dropped early"
    );
    drop(states);
    assert_eq!(dropped.load(Ordering::SeqCst), 3);
    assert!(
        flags[0].load(Ordering::SeqCst),
        "the first keep-alive dropped before the teardown ended"
    );
    assert!(!flags[1].load(Ordering::SeqCst) && !flags[2].load(Ordering::SeqCst));
}

#[test]
fn states_of_two_devices_are_two_states() {
    let sim = Arc::new(SimDriver::with_config(SimConfig {
        devices: 2,
        ..SimConfig::default()
    }));
    let d: Arc<dyn Driver> = sim.clone();
    let a = Context::primary(d.clone(), 0).unwrap();
    let b = Context::primary(d.clone(), 1).unwrap();
    assert_ne!(a, b);
    assert_eq!(Context::primary(d.clone(), 1).unwrap(), b);
}

#[test]
fn two_simulations_are_two_drivers_with_states_of_their_own() {
    let (_s1, d1) = sim();
    let (_s2, d2) = sim();
    let a = Context::primary(d1, 0).unwrap();
    let b = Context::primary(d2, 0).unwrap();
    assert_ne!(a, b);
}

#[test]
fn joining_leaves_the_threads_current_context_as_it_was() {
    let (_sim, d) = sim();
    let a = Context::primary(d.clone(), 0).unwrap();
    let before = d.ctx_get_current().unwrap();
    let b = Context::primary(d.clone(), 0).unwrap();
    assert_eq!(a, b);
    assert_eq!(d.ctx_get_current().unwrap(), before);
}
