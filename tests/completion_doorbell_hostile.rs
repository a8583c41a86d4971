//! The completion poller's doorbell against hostile use (an adversarial review's tests, on the
//! simulated driver): every single failed driver call of a doorbelled completion's life, and
//! each doorbell call failing once or twice, leak nothing and hang nothing; teardown with
//! doorbells pending; the last context dropped by a waker the doorbell woke or by a host
//! function; a waker that makes another completion; a killed context while the poller is parked
//! for a doorbell; other threads' captures in every mode while doorbells are made; concurrent
//! completions on several streams and contexts. The sweep found a teardown leak older than the
//! doorbell (`tests/teardown.rs`, `a_teardown_query_failing_once_leaks_no_stream`).

mod common;
#[path = "common/futures.rs"]
mod futures_util;

use cuda_stream_pool::driver::{CaptureMode, SimDriver};
use cuda_stream_pool::{Context, DeviceBuffer, ErrorCode};
use futures_util::{poll, waker, Counting};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Poll, Wake, Waker};
use std::time::{Duration, Instant};

const HANG: Duration = Duration::from_secs(60);

fn woken(c: &Counting, n: usize) {
    let t = Instant::now();
    while c.0.load(Ordering::SeqCst) < n {
        assert!(t.elapsed() < HANG, "a hang: the future was never woken");
        std::thread::yield_now();
    }
}

/// Until the poller is parked and cold (the next completion gets a doorbell).
fn parks(ctx: &Context) {
    let t = Instant::now();
    loop {
        match ctx.model_poller_progress() {
            Some((_, true)) if ctx.model_poller_cold() => return,
            _ if t.elapsed() > HANG => panic!("the poller never parked"),
            _ => std::thread::yield_now(),
        }
    }
}

/// After the context is gone: nothing left, no misuse.
fn clean(sim: &SimDriver, what: &str) {
    let t = Instant::now();
    // (An injected fault may hit the release itself: it is tried again.)
    let mut errors = 0;
    while sim.counters().live_contexts > 0 && errors < 5 && t.elapsed() < HANG {
        if cuda_stream_pool::release_pinned_cache(sim).is_err() {
            errors += 1;
        }
        std::thread::yield_now();
    }
    let c = sim.counters();
    assert_eq!(
        (
            c.live_contexts,
            c.live_streams,
            c.live_events,
            c.live_host_allocs
        ),
        (0, 0, 0, 0),
        "{what}: {c:?}"
    );
    assert!(sim.misuse().is_empty(), "{what}: {:?}", sim.misuse());
}

/// One belled completion's life: made cold (a doorbell), awaited (the poller parked), woken,
/// a second one made hot, the context dropped. Returns the number of driver calls it made.
fn belled_life(sim: &Arc<SimDriver>, inject: impl FnOnce()) -> u64 {
    let before = sim.call_count();
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        inject();
        let made = s.completed();
        if let Ok(done) = made {
            let mut done = Box::pin(done);
            let (count, w) = waker();
            match poll(done.as_mut(), &w) {
                Poll::Pending => {
                    sim.advance(1_000);
                    woken(&count, 1);
                    assert!(matches!(poll(done.as_mut(), &w), Poll::Ready(_)));
                }
                Poll::Ready(_) => {}
            }
            let b = DeviceBuffer::<u32>::zeroed(&s, 16);
            if let Ok(b) = b {
                if let Ok(c) = b.to_vec_async(&s) {
                    sim.advance(0);
                    let _ = common::block_on(c);
                }
            }
        } else {
            sim.advance(1_000);
        }
    }
    drop(ctx);
    sim.call_count() - before
}

/// Every driver call of a belled completion's life failing once (a transient fault: every
/// destroy-like call is tried again): no hang, no leak, no misuse.
#[test]
fn any_single_failed_call_of_a_belled_completions_life_leaks_nothing() {
    let calls = belled_life(&Arc::new(SimDriver::new()), || {});
    let mut bad = Vec::new();
    for n in 1..=calls + 2 {
        let sim = Arc::new(SimDriver::new());
        let s2 = sim.clone();
        common::finishes("a belled life with a fault", move || {
            let s3 = s2.clone();
            belled_life(&s2, move || s3.fail_nth_call(n, ErrorCode::ERROR_UNKNOWN));
        });
        let r = std::panic::catch_unwind(|| {
            clean(
                &sim,
                &format!("call {n} failed: {:?}", sim.injected_failures()),
            )
        });
        if let Err(p) = r {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "?".into());
            bad.push(msg.lines().next().unwrap_or("").to_string());
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {} faults leaked:\n{}",
        bad.len(),
        calls + 2,
        bad.join("\n")
    );
}

/// Each doorbell call failing once in the completion's making and at the teardown.
#[test]
fn doorbell_calls_failing_once_leak_nothing() {
    for name in [
        "cuEventCreate",
        "cuEventRecord",
        "cuStreamWaitEvent",
        "cuLaunchHostFunc",
        "cuStreamCreateWithPriority",
        "cuStreamSynchronize",
        "cuStreamDestroy_v2",
        "cuEventDestroy_v2",
    ] {
        for times in [1, 2] {
            let sim = Arc::new(SimDriver::new());
            let s2 = sim.clone();
            common::finishes("a belled life with failures", move || {
                let s3 = s2.clone();
                belled_life(&s2, move || {
                    s3.fail_calls(name, ErrorCode::ERROR_UNKNOWN, times)
                });
            });
            clean(&sim, &format!("{name} x{times}"));
        }
    }
}

/// The context dropped while a doorbell is pending (its future dropped, then forgotten): the
/// teardown returns and frees everything.
#[test]
fn teardown_with_pending_doorbells_returns_and_frees_everything() {
    for forget in [false, true] {
        let sim = Arc::new(SimDriver::new());
        let s2 = sim.clone();
        common::finishes("teardown with a pending doorbell", move || {
            let sim = s2;
            let ctx = Context::primary(sim.clone(), 0).unwrap();
            let (a, b) = (ctx.owner(), ctx.owner());
            let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
            sim.enqueue_work(sa.raw(), 1_000_000).unwrap();
            sim.enqueue_work(sb.raw(), 2_000_000).unwrap();
            let x = sa.completed().unwrap();
            let buf = DeviceBuffer::<u32>::zeroed(&sb, 64).unwrap();
            let y = buf.to_vec_async(&sb).unwrap();
            parks_or_not(&ctx);
            if forget {
                // A leak: the context stays (the forgotten future holds it).
                std::mem::forget(y);
            } else {
                drop(y);
            }
            drop(x);
            drop((buf, sa, sb));
            drop((a, b, ctx));
        });
        if !forget {
            clean(&sim, "dropped futures");
        } else {
            assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
        }
    }
}

fn parks_or_not(ctx: &Context) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(1) {
        let _ = ctx.model_poller_progress();
        std::thread::yield_now();
    }
}

#[test]
fn the_last_context_dropped_by_a_belled_completions_waker() {
    let sim = Arc::new(SimDriver::new());
    let s2 = sim.clone();
    common::finishes("drop from the waker", move || {
        let sim = s2;
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let (tx, rx) = mpsc::channel();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let mut first = Box::pin(s.completed().unwrap());
        let w = common::DropsContext::waker(ctx.clone(), tx);
        assert!(poll(first.as_mut(), &w).is_pending());
        parks(&ctx);
        drop(ctx);
        drop((w, first, s));
        drop(o);
        sim.advance(1_000);
        rx.recv_timeout(HANG)
            .expect("the poller never ran the waker");
    });
    clean(&sim, "dropped by the waker");
}

/// The last context dropped by a host function (of the user's) while a doorbell is pending.
#[test]
fn the_last_context_dropped_by_a_host_function_with_a_doorbell_pending() {
    let sim = Arc::new(SimDriver::new());
    let s2 = sim.clone();
    common::finishes("drop from a host function", move || {
        let sim = s2;
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000).unwrap();
        let done = s.completed().unwrap();
        let c = Mutex::new(Some(ctx.clone()));
        s.launch_host_func(move || drop(c.lock().unwrap().take()))
            .unwrap();
        let other = ctx.owner();
        let t = other.stream().unwrap();
        sim.enqueue_work(t.raw(), 5_000).unwrap();
        let late = t.completed().unwrap();
        drop((done, late, s, t));
        drop((o, other, ctx));
        sim.advance(10_000);
    });
    clean(&sim, "dropped by a host function");
}

/// A waker that makes another completion (re-entering the crate) when woken by the poller
/// after a doorbell: that one resolves too.
#[test]
fn a_waker_that_makes_another_completion_after_a_doorbell() {
    let sim = Arc::new(SimDriver::new());
    let s2 = sim.clone();
    common::finishes("re-entrant waker", move || {
        let sim = s2;
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let o = Arc::new(Mutex::new(ctx.owner()));
        struct Again(Arc<Mutex<cuda_stream_pool::Owner>>, mpsc::Sender<bool>);
        impl Wake for Again {
            fn wake(self: Arc<Self>) {
                let o = self.0.lock().unwrap();
                let s = o.stream().unwrap();
                let c = s.completed().unwrap();
                let _ = self.1.send(c.is_complete());
                drop(c);
            }
        }
        let (tx, rx) = mpsc::channel();
        let w = Waker::from(Arc::new(Again(o.clone(), tx)));
        {
            let g = o.lock().unwrap();
            let s = g.stream().unwrap();
            sim.enqueue_work(s.raw(), 1_000).unwrap();
            let mut f = Box::pin(s.completed().unwrap());
            assert!(poll(f.as_mut(), &w).is_pending());
            drop(s);
            drop(g);
            parks(&ctx);
            sim.advance(1_000);
            rx.recv_timeout(HANG).unwrap();
        }
        drop(w);
        drop(o);
        drop(ctx);
    });
    clean(&sim, "re-entrant waker");
}

/// A dead context with a doorbell pending (the poller parked for it): the future resolves with
/// the sticky error, the teardown returns.
#[test]
fn a_killed_context_with_a_parked_doorbell_resolves_and_tears_down() {
    let sim = Arc::new(SimDriver::new());
    let s2 = sim.clone();
    common::finishes("killed context", move || {
        let sim = s2;
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        sim.enqueue_work(s.raw(), 1_000_000_000).unwrap();
        let done = s.completed().unwrap();
        let mut done = Box::pin(done);
        let (count, w) = waker();
        assert!(poll(done.as_mut(), &w).is_pending());
        parks(&ctx);
        sim.kill_context(ctx.raw(), ErrorCode::ERROR_ILLEGAL_ADDRESS);
        woken(&count, 1);
        assert!(matches!(poll(done.as_mut(), &w), Poll::Ready(Err(_))));
        drop((done, s));
        drop((o, ctx));
    });
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Another thread captures (every mode) while completions are made cold (the doorbell stream
/// created, events created and recorded, waits and host functions enqueued): no capture is
/// invalidated, no call of the invalidation table is made outside relaxed mode.
#[test]
fn captures_of_another_thread_survive_doorbells() {
    for mode in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ] {
        let sim = Arc::new(SimDriver::new());
        let ctx = Context::primary(sim.clone(), 0).unwrap();
        let (a, b) = (ctx.owner(), ctx.owner());
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (ready_tx, ready_rx) = mpsc::channel::<()>();
        let c2 = ctx.clone();
        let capturer = std::thread::spawn(move || {
            let o = c2.owner();
            let s = o.stream().unwrap();
            let g = s.begin_capture_with(mode).unwrap();
            ready_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            let graph = g.end();
            graph.map(drop)
        });
        ready_rx.recv().unwrap();
        for i in 0..4 {
            // Made cold, each (a doorbell): the poller goes cold a millisecond after the last.
            if ctx.model_poller_progress().is_some() {
                parks(&ctx);
            }
            let s = if i % 2 == 0 { a.stream() } else { b.stream() }.unwrap();
            sim.enqueue_work(s.raw(), 1_000).unwrap();
            let mut f = Box::pin(s.completed().unwrap());
            let (count, w) = waker();
            if poll(f.as_mut(), &w).is_pending() {
                parks(&ctx);
                sim.advance(1_000);
                woken(&count, 1);
            }
        }
        go_tx.send(()).unwrap();
        capturer
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("{mode:?}: capture invalidated: {e}"));
        assert!(
            sim.unrelaxed_calls().is_empty(),
            "{:?}",
            sim.unrelaxed_calls()
        );
        drop((a, b, ctx));
        clean(&sim, &format!("{mode:?}"));
    }
}

/// Threads making belled and unbelled completions concurrently on several streams of two
/// contexts (two devices), awaited by blocking: all resolve, nothing leaks.
#[test]
fn concurrent_completions_on_several_streams_and_contexts() {
    let sim = Arc::new(SimDriver::with_config(
        cuda_stream_pool::driver::SimConfig {
            devices: 2,
            ..Default::default()
        },
    ));
    let s2 = sim.clone();
    common::finishes("concurrent completions", move || {
        let sim = s2;
        let ctxs = [
            Context::primary(sim.clone(), 0).unwrap(),
            Context::primary(sim.clone(), 1).unwrap(),
        ];
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ticker = {
            let (sim, stop) = (sim.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    sim.advance(100);
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };
        std::thread::scope(|sc| {
            for t in 0..4 {
                let ctx = ctxs[t % 2].clone();
                let sim = sim.clone();
                sc.spawn(move || {
                    let o = ctx.owner();
                    for i in 0..60u64 {
                        let s = o.stream().unwrap();
                        sim.enqueue_work(s.raw(), (i * 37 + t as u64 * 101) % 900)
                            .unwrap();
                        let c = s.completed().unwrap();
                        if i % 3 == 0 {
                            drop(c);
                        } else {
                            common::block_on(c).unwrap();
                        }
                        if i % 7 == 0 {
                            std::thread::sleep(Duration::from_micros(300));
                        }
                    }
                });
            }
        });
        stop.store(true, Ordering::Release);
        ticker.join().unwrap();
        drop(ctxs);
    });
    clean(&sim, "concurrent");
}
