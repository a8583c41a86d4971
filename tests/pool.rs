//! The stream pool, owners and priorities: each scenario runs on the simulated driver and, as a GPU
//! test, on the real one; call-log checks on the simulation (a retired capturing stream is never
//! touched, a priority switch never waits into a capture).

#[path = "common/calls.rs"]
mod calls;
mod common;

use calls::{fmt_calls, recorded_on, setup};
use common::Gate;
use cuda_stream_pool::driver::sim::Call;
use cuda_stream_pool::driver::{CaptureStatus, Driver, SimDriver, Stream};
use cuda_stream_pool::{Context, DeviceBuffer, Error, Priority, PriorityRange, MAX_IDLE};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

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
    // The handle leaves the crate: the release must query the stream (untouched, it would be
    // known idle and handed on without a driver call).
    o.stream().unwrap().raw();
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

/// `cuStreamWaitEvent`s on `capturing` (from index `since`) for events recorded on another
/// stream: on the GPU, CUDA_ERROR_STREAM_CAPTURE_ISOLATION, and the capture is invalidated.
fn waits_into_capture(calls: &[Call], capturing: Stream, since: usize) -> Vec<Call> {
    (since..calls.len())
        .filter(|&i| {
            let c = &calls[i];
            c.name == "cuStreamWaitEvent"
                && c.stream == Some(capturing)
                && c.event
                    .and_then(|e| recorded_on(calls, e, i))
                    .is_some_and(|on| on != capturing)
        })
        .map(|i| calls[i].clone())
        .collect()
}

// Pins soundness review (issue 12) defect 8: the pool's search killed a live capture on a retired stream
#[test]
fn the_pool_never_hands_out_nor_touches_a_retired_stream_still_capturing() {
    let (_sim, ctx) = setup();
    let a = ctx.owner();
    let s = a.stream().unwrap();
    let raw = s.raw();
    // The guard borrows the owner now (dropping the owner under it does not compile); a guard
    // leaked with `mem::forget` still leaves a retired stream capturing.
    std::mem::forget(s.begin_capture().unwrap());
    drop(s);
    drop(a);
    let b = ctx.owner();
    let sb = b.stream().unwrap();
    // SAFETY: `raw` is alive: a stream that is captured is never destroyed by the pool.
    let status = unsafe { ctx.driver().stream_capture_info(raw) }.map(|(st, _)| st);
    // SAFETY: as above; the capture was begun by this thread.
    let end = unsafe { ctx.driver().stream_end_capture(raw) };
    assert!(
        sb.raw() != raw && status == Ok(CaptureStatus::Active) && end.is_ok(),
        "the next acquire touched the retired capturing stream: capture status {status:?}, \
         end {:?}, handed out the capturing stream: {}",
        end.map(|_| ()),
        sb.raw() == raw
    );
}

// Pins soundness review (issue 12) defect 12: `live_streams()` and `stats()` underflowed while streams were trimmed
#[test]
fn live_streams_never_underflows_while_other_threads_retire_and_trim_streams() {
    let (_sim, ctx) = setup();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut bad: Option<String> = None;
    std::thread::scope(|sc| {
        for _ in 0..3 {
            sc.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // Churn: more than MAX_IDLE streams retired, so the pool trims (destroys)
                    // some on the next acquire; trim() destroys the rest.
                    let owners: Vec<_> = (0..MAX_IDLE + 4).map(|_| ctx.owner()).collect();
                    for o in &owners {
                        o.stream().unwrap();
                    }
                    drop(owners);
                    ctx.owner().stream().unwrap();
                    let _ = ctx.trim();
                }
            });
        }
        let until = Instant::now() + Duration::from_secs(4);
        let mut n = 0u64;
        while Instant::now() < until && bad.is_none() {
            for _ in 0..1000 {
                n += 1;
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ctx.live_streams()))
                {
                    Ok(v) if v < 1_000_000 => {}
                    Ok(v) => {
                        bad = Some(format!("sample {n}: live_streams() = {v}"));
                        break;
                    }
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_default();
                        bad = Some(format!("sample {n}: live_streams() panicked: {msg}"));
                        break;
                    }
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert!(bad.is_none(), "{}", bad.unwrap());
}

// Pins soundness review (issue 12) defect 16: the idle cap was 33, one more than `MAX_IDLE`
#[test]
fn releases_keep_at_most_max_idle_streams_idle() {
    let (_sim, ctx) = setup();
    let owners: Vec<_> = (0..40).map(|_| ctx.owner()).collect();
    for o in &owners {
        o.stream().unwrap();
    }
    drop(owners);
    let st = ctx.stats();
    assert!(
        st.idle <= MAX_IDLE as u64,
        "{} idle streams kept, more than MAX_IDLE = {MAX_IDLE}",
        st.idle
    );
}

// Pins the second review's finding: a priority switch made a capturing stream wait on outside work (905 on the H200)
/// `Owner::select` checks only that the *previously selected* stream is not capturing; its
/// SAFETY claim "`next` could only capture while selected" is false: a `StreamRef` taken while
/// that priority was selected stays valid after a switch, and can begin a capture on a stream that
/// is not the selected one. Switching back then records an event on the selected stream and makes
/// the capturing stream wait for it: a capture waiting on outside work, which the GPU answers with
/// CUDA_ERROR_STREAM_CAPTURE_ISOLATION and an invalidated capture.
#[test]
fn set_priority_onto_a_capturing_stream_is_refused_without_a_wait_into_its_capture() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let s_normal = o.stream().unwrap();
    o.set_priority(Priority::High).unwrap(); // s_normal stays valid (it borrows `o`)
    let guard = s_normal.begin_capture().unwrap(); // capture on a stream that is not selected
    let begin = sim.calls().len();
    let r = o.set_priority(Priority::Normal); // prev = high (idle), next = s_normal (capturing)
    let calls = sim.calls();
    let bad = waits_into_capture(&calls, s_normal.raw(), begin);
    let end = guard.end();
    assert!(
        bad.is_empty() && matches!(r, Err(Error::CaptureInProgress(_))),
        "set_priority made the capturing stream wait for an event recorded outside its capture \
         ({}); set_priority: {r:?}; end: {:?}",
        fmt_calls(&bad),
        end.map(|_| ())
    );
}

// Pins the second review's finding: `with_priority`'s restore made a capturing stream wait on outside work (905 on the H200)
/// The same through `with_priority`'s restore: the closure begins a capture on the stream of the
/// priority that was selected before, and returns the guard; the restore orders that capturing
/// stream after the closure's stream.
#[test]
fn with_priority_restore_makes_no_wait_into_a_capture_begun_in_the_closure() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let s_normal = o.stream().unwrap();
    let begin = sim.calls().len();
    let r = o.with_priority(Priority::High, || {
        // Not selected now, but its reference is still valid.
        let g = s_normal.begin_capture().unwrap();
        (g, sim.calls().len())
    });
    let calls = sim.calls();
    let (bad, end) = match r {
        Ok((g, since)) => (
            waits_into_capture(&calls, s_normal.raw(), since.max(begin)),
            Some(g.end().map(|_| ())),
        ),
        Err(_) => (Vec::new(), None), // refused: the guard was dropped inside, the capture ended
    };
    assert!(
        bad.is_empty(),
        "with_priority's restore made the capturing stream wait for outside work ({}); end: {end:?}",
        fmt_calls(&bad)
    );
}

// Pins the second review's finding: `PriorityRange::resolve` (so `Context::owner()`) panicked on a reversed range
/// "No public function panics on bad input": `PriorityRange` has public fields, and `resolve`
/// uses `i32::clamp(greatest, least)`, which panics when `greatest > least`. `Context::build`
/// takes the range from the driver unchecked, so a driver (or `SimConfig`) reporting the range
/// the other way round makes `Context::owner()` panic too.
#[test]
fn priority_range_resolve_does_not_panic_on_a_reversed_range() {
    let r = PriorityRange {
        least: -5,
        greatest: 0,
    };
    let out = std::panic::catch_unwind(|| r.resolve(Priority::Normal));
    assert!(
        out.is_ok(),
        "PriorityRange::resolve(Normal) panicked on a reversed range"
    );
}
