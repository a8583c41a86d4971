//! Owners keep a key of their streams' pools (20d8821; these tests are review 12's): every
//! stream an owner held goes back to the pool of its own (priority, flags), for priorities at
//! both ends of several ranges (extreme ones included), flags 0, 1 and others, priority switches
//! back and forth, owners dropped on other threads, implicit thread owners, `Owner::ready`,
//! `Attached`, shared states, loans, and teardown while owners live.

mod common;

use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver};
use cuda_stream_pool::{Context, ContextOptions, Owner, PoolStats, Priority};
use std::collections::BTreeMap;
use std::sync::Arc;

const FLAGS: [u32; 5] = [0, 1, 2, 4, u32::MAX];

fn sim_with(range: (i32, i32)) -> Arc<SimDriver> {
    Arc::new(SimDriver::with_config(SimConfig {
        priority_range: range,
        ..SimConfig::default()
    }))
}

fn prios(least: i32, greatest: i32) -> Vec<i32> {
    let mut v = vec![least, greatest];
    if least > greatest {
        v.push(least - 1);
        v.push(greatest + 1);
    }
    v.push(least - (least - greatest) / 2);
    v.sort_unstable();
    v.dedup();
    v
}

fn stats(ctx: &Context, p: i32, f: u32) -> PoolStats {
    ctx.stats_for_key(Priority::Value(p), f).unwrap()
}

fn check_range(least: i32, greatest: i32) {
    let sim = sim_with((least, greatest));
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    // A second handle of the same (shared) state.
    let ctx2 = Context::primary(d.clone(), 0).unwrap();
    assert_eq!(ctx.priority_range().least, least);
    let ps = prios(least, greatest);
    // (p, f) -> the raw stream first handed out for it.
    let mut raws: BTreeMap<(i32, u32), u64> = BTreeMap::new();
    for (k, &f) in FLAGS.iter().enumerate() {
        let c = if k % 2 == 0 { &ctx } else { &ctx2 };
        let owner = Owner::with_flags(c, f);
        // Forward, back and forward again: the owner keeps one stream per priority.
        let order: Vec<i32> = ps
            .iter()
            .chain(ps.iter().rev())
            .chain(ps.iter())
            .copied()
            .collect();
        for p in order {
            owner.set_priority(Priority::Value(p)).unwrap();
            match owner.stream() {
                Ok(s) => {
                    assert_eq!((s.priority(), s.flags()), (p, f));
                    let raw = s.raw().0;
                    let e = raws.entry((p, f)).or_insert(raw);
                    assert_eq!(*e, raw, "one stream per priority for an owner");
                }
                Err(e) if f > 1 => {
                    // CUDA knows flags 0 and 1 only (the simulation refuses others): the
                    // `Other` key's pool counts nothing for the failed creation.
                    let st = stats(&ctx, p, f);
                    assert_eq!((st.in_use, st.live), (0, 0), "{e}: {st:?}");
                }
                Err(e) => panic!("flags {f:#x} priority {p}: {e}"),
            }
        }
        if f > 1 {
            continue;
        }
        // Nested with_priority at both ends, back to the first.
        owner
            .with_priority(Priority::High, || {
                assert_eq!(owner.stream().unwrap().priority(), greatest);
                owner
                    .with_priority(Priority::Low, || {
                        assert_eq!(owner.stream().unwrap().priority(), least)
                    })
                    .unwrap();
                assert_eq!(owner.stream().unwrap().priority(), greatest);
            })
            .unwrap();
        for &p in &ps {
            assert_eq!(stats(&ctx, p, f).in_use, 1, "p {p} f {f:#x}");
        }
        // Dropped on another thread.
        std::thread::spawn(move || drop(owner)).join().unwrap();
        for &p in &ps {
            let st = stats(&ctx2, p, f);
            assert_eq!(
                (st.in_use, st.created, st.live),
                (0, 1, 1),
                "p {p} f {f:#x}: {st:?}"
            );
        }
    }
    // Each key's stream is handed again to an owner of that key (a hit), never to another key.
    for (&(p, f), &raw) in &raws {
        let before = stats(&ctx, p, f);
        let o = Owner::with_flags(&ctx, f);
        o.set_priority(Priority::Value(p)).unwrap();
        let s = o.stream().unwrap();
        assert_eq!((s.raw().0, s.priority(), s.flags()), (raw, p, f));
        drop(s);
        let after = stats(&ctx, p, f);
        assert_eq!(after.hits, before.hits + 1);
        assert_eq!(after.in_use, 1);
        drop(o);
        assert_eq!(stats(&ctx, p, f).in_use, 0);
    }
    let total = ctx.stats();
    assert_eq!(total.in_use, 0);
    assert_eq!(total.created as usize, raws.len());
    assert_eq!(total.live as usize, raws.len());

    // The thread's implicit owner, both ends, the thread exits.
    let c = ctx.clone();
    std::thread::spawn(move || {
        c.set_priority(Priority::High).unwrap();
        assert_eq!(c.stream().unwrap().priority(), greatest);
        c.set_priority(Priority::Low).unwrap();
        assert_eq!(c.stream().unwrap().priority(), least);
        c.set_priority(Priority::High).unwrap();
        assert_eq!(c.stream().unwrap().priority(), greatest);
    })
    .join()
    .unwrap();
    assert_eq!(ctx.stats().in_use, 0);
    assert_eq!(ctx.stats().created as usize, raws.len());

    // Attached futures: the task's owner, switched inside.
    let o = Owner::with_flags(&ctx, 0);
    let c = ctx.clone();
    let got = common::block_on(o.attach(async move {
        c.set_priority(Priority::High).unwrap();
        let a = c.stream().unwrap().priority();
        c.set_priority(Priority::Low).unwrap();
        let b = c.stream().unwrap().priority();
        (a, b, c.stream().unwrap().flags())
    }));
    assert_eq!(got, (greatest, least, 0));
    assert_eq!(ctx.stats().in_use, 0);

    // Teardown while owners live: the owners outlive every handle of ours.
    let owners: Vec<Owner> = [0u32, 1]
        .iter()
        .map(|&f| {
            let o = Owner::with_flags(&ctx2, f);
            o.set_priority(Priority::High).unwrap();
            o.stream().unwrap();
            o.set_priority(Priority::Low).unwrap();
            o.stream().unwrap();
            o
        })
        .collect();
    drop(ctx);
    drop(ctx2);
    drop(d);
    let t = std::thread::spawn(move || drop(owners));
    t.join().unwrap();
    common::assert_clean(&sim);
}

#[test]
fn streams_go_back_to_their_own_key_for_every_range() {
    for (least, greatest) in [
        (0, -5),
        (0, 0),
        (3, -2),
        (5, 5),
        (i32::MAX, i32::MAX - 3),
        (i32::MIN + 3, i32::MIN),
        (0, -1024),
        (1024, 0),
    ] {
        check_range(least, greatest);
    }
}

/// `Owner::ready` at a cap: the waiter's stream comes from (and goes back to) its own key.
#[test]
fn owner_ready_at_a_cap_keeps_its_key() {
    let sim = sim_with((0, -5));
    let d: Arc<dyn Driver> = sim.clone();
    let mut opts = ContextOptions::server();
    opts.max_live_streams_per_key = Some(1);
    let ctx = Context::primary_with(d.clone(), 0, opts).unwrap();
    for f in [0u32, 1] {
        for pr in [Priority::High, Priority::Low, Priority::Value(-3)] {
            let p = ctx.priority_range().resolve(pr).unwrap();
            let a = Owner::with_flags(&ctx, f);
            a.set_priority(pr).unwrap();
            let raw = a.stream().unwrap().raw();
            let b = Owner::with_flags(&ctx, f);
            b.set_priority(pr).unwrap();
            let mut fut = Box::pin(b.ready());
            let w = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(w);
            assert!(fut.as_mut().poll(&mut cx).is_pending(), "at the cap");
            std::thread::spawn(move || drop(a)).join().unwrap();
            let b = common::block_on(fut).unwrap();
            let s = b.stream().unwrap();
            assert_eq!((s.raw(), s.priority(), s.flags()), (raw, p, f));
            drop(s);
            let st = stats(&ctx, p, f);
            assert_eq!((st.in_use, st.created, st.waits), (1, 1, 1), "{st:?}");
            std::thread::spawn(move || drop(b)).join().unwrap();
            let st = stats(&ctx, p, f);
            assert_eq!((st.in_use, st.live), (0, 1), "{st:?}");
        }
    }
    drop(ctx);
    drop(d);
    common::assert_clean(&sim);
}

use std::future::Future;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[derive(Debug)]
struct Foreign(#[allow(dead_code)] cuda_stream_pool::driver::Stream);

/// Loans outliving their owners (and then the context): each stream parks with, and comes back
/// to, the pool of its own key.
#[test]
fn lent_streams_come_back_to_their_own_key() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for drop_ctx in [false, true] {
        let sim = sim_with((0, -5));
        let d: Arc<dyn Driver> = sim.clone();
        let ctx = Context::primary(d.clone(), 0).unwrap();
        let mut loans = Vec::new();
        let mut raws = Vec::new();
        for f in [0u32, 1] {
            for pr in [Priority::High, Priority::Low] {
                let p = ctx.priority_range().resolve(pr).unwrap();
                let o = Owner::with_flags(&ctx, f);
                o.set_priority(pr).unwrap();
                let s = o.stream().unwrap();
                raws.push(((p, f), s.raw()));
                loans.push(s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap());
                drop(s);
                std::thread::spawn(move || drop(o)).join().unwrap();
                let st = stats(&ctx, p, f);
                assert_eq!((st.in_use, st.live), (1, 1), "lent: {st:?}");
            }
        }
        if drop_ctx {
            drop(ctx);
            drop(loans);
            // A later operation of the crate tears the lingering state down.
            drop(Context::primary(d.clone(), 0).unwrap());
            drop(d);
            common::assert_clean(&sim);
            continue;
        }
        drop(loans);
        for &((p, f), raw) in &raws {
            let o = Owner::with_flags(&ctx, f);
            o.set_priority(Priority::Value(p)).unwrap();
            let s = o.stream().unwrap();
            assert_eq!((s.raw(), s.priority(), s.flags()), (raw, p, f));
            drop(s);
            drop(o);
            let st = stats(&ctx, p, f);
            assert_eq!((st.in_use, st.live, st.created), (0, 1, 1), "{st:?}");
        }
        drop(ctx);
        drop(d);
        common::assert_clean(&sim);
    }
}

/// Every priority of a range, both flags: `std_pool`'s (priority, flags) from the index is the
/// key `slot_index` made it from (a stream's priority and flags, and where it goes back).
#[test]
fn every_priority_of_a_range_round_trips_its_index() {
    for (least, greatest) in [
        (0, -5),
        (3, -2),
        (i32::MIN + 3, i32::MIN),
        (i32::MAX, i32::MAX - 2),
        (1024, 0),
    ] {
        let sim = sim_with((least, greatest));
        let d: Arc<dyn Driver> = sim.clone();
        let ctx = Context::primary(d.clone(), 0).unwrap();
        for p in greatest..=least {
            for f in [0u32, 1] {
                let o = Owner::with_flags(&ctx, f);
                o.set_priority(Priority::Value(p)).unwrap();
                let s = o.stream().unwrap();
                assert_eq!((s.priority(), s.flags()), (p, f));
                drop(s);
                drop(o);
                let st = stats(&ctx, p, f);
                assert_eq!(
                    (st.in_use, st.live, st.created),
                    (0, 1, 1),
                    "p {p} f {f}: {st:?}"
                );
            }
        }
        let n = 2 * (least - greatest + 1) as u64;
        let t = ctx.stats();
        assert_eq!((t.in_use, t.created, t.live), (0, n, n));
        drop(ctx);
        drop(d);
        common::assert_clean(&sim);
    }
}
