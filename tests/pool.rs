//! The stream pool, owners and priorities: each scenario runs on the simulated driver and, as a GPU
//! test, on the real one.

mod common;

use common::Gate;
use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{Context, DeviceBuffer, Error, Priority, MAX_IDLE};
use std::sync::{Arc, Barrier};

fn gate(s: &cuda_stream_pool::StreamRef) -> Gate {
    Gate::on(&**s.context().driver(), s.raw())
}

/// MAX_IDLE + 8 owners alive at once on real threads get distinct streams; as they end, the
/// releases leave at most MAX_IDLE idle streams, and so does the next search.
fn concurrent_owners_get_distinct_streams(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let n = MAX_IDLE + 8;
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let (ctx, barrier) = (ctx.clone(), barrier.clone());
            std::thread::spawn(move || {
                let owner = ctx.owner();
                let s = owner.stream().unwrap();
                barrier.wait(); // everyone holds a stream now
                let raw = s.raw();
                barrier.wait();
                raw
            })
        })
        .collect();
    let mut raws: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    raws.sort();
    raws.dedup();
    assert_eq!(raws.len(), n, "concurrent owners shared a stream");
    let st = ctx.stats();
    assert_eq!(st.created, n as u64);
    // The releases beyond MAX_IDLE destroyed idle streams (the streams did no work: all idle).
    assert_eq!(st.live, MAX_IDLE as u64, "{st:?}");
    assert_eq!((st.trimmed, st.destroyed), (8, 8), "{st:?}");
    // The next search trims the idle streams beyond the limit.
    let o = ctx.owner();
    o.stream().unwrap();
    let st = ctx.stats();
    assert!(st.idle + st.retired_busy <= MAX_IDLE as u64, "{st:?}");
    // (The releases already trimmed to MAX_IDLE; the search took one of them.)
    assert_eq!(st.trimmed, (n - MAX_IDLE) as u64, "{st:?}");
    assert_eq!(st.hits, 1);
}

/// 1,024 sequential owners whose work completes use a single stream.
fn sequential_owners_share_one_stream(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let mut first = None;
    for _ in 0..1024 {
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        let mut b = DeviceBuffer::<u32>::alloc(&s, 256).unwrap();
        b.fill(&s, 7).unwrap();
        drop(b);
        s.synchronize().unwrap();
        let raw = s.raw();
        assert_eq!(*first.get_or_insert(raw), raw);
    }
    let st = ctx.stats();
    assert_eq!(st.created, 1, "{st:?}");
    assert_eq!(st.hits, 1023);
}

/// A retired stream whose work is still pending is skipped, never handed out (and nobody waits
/// for it); once its work completes it is reused.
fn busy_retired_stream_not_handed_out(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let ctx = common::ctx(d);
        let a = ctx.owner();
        let sa = a.stream().unwrap();
        let mut g = gate(&sa);
        let raw_a = sa.raw();
        drop(a);
        let st = ctx.stats();
        assert_eq!((st.retired_busy, st.idle, st.in_use), (1, 0, 0), "{st:?}");
        let b = ctx.owner();
        let sb = b.stream().unwrap();
        assert_ne!(sb.raw(), raw_a, "a busy stream was handed out");
        assert_eq!(ctx.stats().created, 2);
        let raw_b = sb.raw();
        drop(sb);
        drop(b);
        g.open();
        d.stream_synchronize(raw_a).unwrap();
        let c = ctx.owner();
        let sc = c.stream().unwrap();
        assert_eq!(
            ctx.stats().created,
            2,
            "an idle stream should have been reused"
        );
        assert!(sc.raw() == raw_a || sc.raw() == raw_b);
    }
}

/// An owner that lives long does not stop others from recycling.
fn long_lived_owner_does_not_block_recycling(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let long = ctx.owner();
    let ls = long.stream().unwrap();
    let _g = gate(&ls);
    for _ in 0..100 {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        assert!(!s.same_stream(&ls));
        s.synchronize().unwrap();
    }
    assert_eq!(ctx.stats().created, 2);
}

/// Selecting a priority before the first GPU use creates only that stream; switching back
/// reuses the earlier stream; priorities outside the range are errors naming the range.
fn priority_selection(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let ctx = common::ctx(d);
        let o = ctx.owner();
        assert_eq!(o.priority(), 0);
        o.set_priority(Priority::High).unwrap();
        let hi = o.stream().unwrap();
        assert_eq!(hi.priority(), -5);
        assert_eq!(d.stream_priority(hi.raw()).unwrap(), -5);
        assert_eq!(
            ctx.stats().created,
            1,
            "only the requested stream is created"
        );
        o.set_priority(Priority::Normal).unwrap();
        let lo = o.stream().unwrap();
        assert_eq!(lo.priority(), 0);
        o.set_priority(Priority::Value(-5)).unwrap();
        assert!(
            o.stream().unwrap().same_stream(&hi),
            "switching back reuses"
        );
        o.set_priority(Priority::Value(-3)).unwrap();
        assert_eq!(o.stream().unwrap().priority(), -3);
        assert_eq!(ctx.stats().created, 3);
        for bad in [1, -6, 100] {
            match o.set_priority(Priority::Value(bad)) {
                Err(Error::InvalidArgument(m)) => {
                    assert!(m.contains("0 (least) ..= -5 (greatest)"), "{m}")
                }
                other => panic!("priority {bad}: {other:?}"),
            }
        }
        assert_eq!(o.priority(), -3, "a rejected priority changes nothing");
    }
}

/// Switching priority orders the new stream after the previous one on the GPU.
fn priority_switch_orders_streams(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    let mut g = gate(&s);
    buf.fill(&s, 1).unwrap();
    o.set_priority(Priority::High).unwrap();
    let hi = o.stream().unwrap();
    assert!(
        !hi.query().unwrap(),
        "the high stream must wait for the normal one"
    );
    buf.fill(&hi, 2).unwrap();
    g.open();
    assert_eq!(buf.to_vec(&hi).unwrap(), vec![2; 64]);
}

/// A scoped priority restores the previous selection, also when the closure panics.
fn scoped_priority_restores(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let inner = o
        .with_priority(Priority::High, || o.stream().unwrap())
        .unwrap();
    assert_eq!(inner.priority(), -5);
    assert!(o.stream().unwrap().same_stream(&s));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        o.with_priority(Priority::Value(-2), || panic!("boom"))
            .unwrap()
    }));
    assert!(r.is_err());
    assert_eq!(o.priority(), 0);
    assert!(o.stream().unwrap().same_stream(&s));
}

/// Changing priority while the current stream is capturing is rejected and changes nothing.
fn priority_change_during_capture_rejected(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let guard = s.begin_capture().unwrap();
    match o.set_priority(Priority::High) {
        Err(Error::CaptureInProgress(_)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(o.priority(), 0);
    assert!(o.stream().unwrap().same_stream(&s));
    assert_eq!(ctx.stats().created, 1);
    drop(guard.end().unwrap());
    o.set_priority(Priority::High).unwrap();
}

/// New threads start at normal priority; a thread's implicit owner is retired at thread exit.
fn thread_owner_lifecycle(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    ctx.set_priority(Priority::High).unwrap();
    assert_eq!(ctx.stream().unwrap().priority(), -5);
    let c2 = ctx.clone();
    let (p, raw) = std::thread::spawn(move || {
        let s = c2.stream().unwrap();
        (s.priority(), s.raw())
    })
    .join()
    .unwrap();
    assert_eq!(p, 0, "new threads start at normal priority");
    let st = ctx.stats();
    assert_eq!(st.in_use, 1, "the exited thread's stream went back: {st:?}");
    assert_eq!(st.idle, 1);
    cuda_stream_pool::end_thread_owner(&ctx);
    assert_eq!(ctx.stats().in_use, 0);
    let _ = raw;
}

/// The counters add up.
fn stats_add_up(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let ctx = common::ctx(d);
        let mut held: Vec<_> = (0..5).map(|_| ctx.owner()).collect();
        for o in &held {
            o.stream().unwrap();
        }
        let busy = ctx.owner();
        let bs = busy.stream().unwrap();
        let mut g = gate(&bs);
        let bs_raw = bs.raw();
        drop(bs);
        drop(busy);
        drop(held.split_off(3));
        let st = ctx.stats();
        assert_eq!(
            st.live,
            st.in_use + st.idle + st.retired_busy + st.handed,
            "{st:?}"
        );
        assert_eq!(st.live, st.created - st.destroyed);
        assert_eq!((st.in_use, st.idle, st.retired_busy), (3, 2, 1), "{st:?}");
        assert_eq!(st.misses, st.created);
        g.open();
        ctx.driver().stream_synchronize(bs_raw).unwrap();
        assert_eq!(ctx.trim().unwrap(), 3);
        let st = ctx.stats();
        assert_eq!((st.live, st.destroyed), (3, 3), "{st:?}");
    }
}

on_both_drivers! {
    concurrent_owners_get_distinct_streams,
    sequential_owners_share_one_stream,
    busy_retired_stream_not_handed_out,
    long_lived_owner_does_not_block_recycling,
    priority_selection,
    priority_switch_orders_streams,
    scoped_priority_restores,
    priority_change_during_capture_rejected,
    thread_owner_lifecycle,
    stats_add_up,
}

/// Simulation only: at teardown every stream the pool created is destroyed and every byte freed.
#[test]
fn teardown_leaks_nothing() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    {
        let ctx = Context::primary(d.clone(), 0).unwrap();
        let owners: Vec<_> = (0..10).map(|_| ctx.owner()).collect();
        let bufs: Vec<_> = owners
            .iter()
            .map(|o| DeviceBuffer::<f32>::zeroed(&o.stream().unwrap(), 100).unwrap())
            .collect();
        drop(owners);
        drop(bufs);
    }
    let c = sim.counters();
    assert_eq!(c.live_streams, 0, "{c:?}");
    assert_eq!(c.live_allocs, 0, "{c:?}");
    assert_eq!(c.live_events, 0, "{c:?}");
    assert_eq!(c.live_contexts, 0, "{c:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Simulation only: a driver failure while creating a stream is an error, not a panic, and leaves
/// the pool consistent.
#[test]
fn stream_create_failure_is_an_error() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d, 0).unwrap();
    sim.fail_calls(
        "cuStreamCreateWithPriority",
        cuda_stream_pool::ErrorCode::ERROR_OUT_OF_MEMORY,
        1,
    );
    let o = ctx.owner();
    let e = o.stream().unwrap_err();
    assert_eq!(e.code(), Some(cuda_stream_pool::ErrorCode(2)));
    assert!(e.to_string().contains("cuStreamCreateWithPriority"));
    let s = o.stream().unwrap();
    assert!(s.is_current());
    assert_eq!(ctx.stats().created, 1);
}

/// Simulation only: pool queries run in relaxed capture mode, restoring the thread's mode.
#[test]
fn pool_queries_run_in_relaxed_mode() {
    use cuda_stream_pool::driver::{sim::Call, CaptureMode};
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    drop(ctx.owner().stream().unwrap());
    let o = ctx.owner();
    o.stream().unwrap(); // retired stream reused once above? no: the first owner is gone
    sim.clear_calls();
    drop(o);
    let o2 = ctx.owner();
    o2.stream().unwrap();
    let names: Vec<&str> = sim.calls().iter().map(|c: &Call| c.name).collect();
    let q = names.iter().position(|n| *n == "cuStreamQuery").unwrap();
    assert_eq!(names[q - 1], "cuThreadExchangeStreamCaptureMode");
    assert_eq!(names[q + 1], "cuThreadExchangeStreamCaptureMode");
    assert_eq!(
        d.thread_exchange_capture_mode(CaptureMode::Global).unwrap(),
        CaptureMode::Global
    );
}

// Regression: issue 19 defect 15 ("at most MAX_IDLE idle streams per key" was false at a quiescent point)
/// Simulation only: MAX_IDLE + 8 owners whose streams are busy when they are dropped (the
/// releases cannot trim busy streams); once the work has completed, the statistics never report
/// more than MAX_IDLE idle streams of the key, and the next acquisition or release leaves no more
/// than MAX_IDLE retired streams alive.
#[test]
fn idle_streams_of_a_key_never_exceed_max_idle_once_their_work_completed() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let n = MAX_IDLE + 8;
    let owners: Vec<_> = (0..n).map(|_| ctx.owner()).collect();
    for o in &owners {
        sim.enqueue_work(o.stream().unwrap().raw(), 1_000).unwrap();
    }
    drop(owners); // every stream busy: retired, none trimmed
    ctx.synchronize().unwrap(); // the work completes: a quiescent point
    let st = ctx.stats();
    assert!(st.idle <= MAX_IDLE as u64, "{st:?}");
    assert!(st.idle + st.retired_busy <= MAX_IDLE as u64, "{st:?}");
    assert_eq!(st.live, st.in_use + st.idle + st.retired_busy + st.handed);
    let o = ctx.owner();
    o.stream().unwrap();
    drop(o);
    let st = ctx.stats();
    assert!(st.idle + st.retired_busy <= MAX_IDLE as u64, "{st:?}");
    // One disposal stream besides the pool's.
    assert!(
        sim.counters().live_streams <= MAX_IDLE as u64 + 1,
        "{:?}",
        sim.counters()
    );
}
