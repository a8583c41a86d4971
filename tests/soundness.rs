//! Regression tests for the soundness defects found in review (issue 12): one test per defect,
//! named after it, each stating the correct behaviour, on the simulated driver (with the pausing
//! wrapper of `tests/common/pausing.rs` where two threads must interleave at a precise point).
//! Every test here failed on commit 2864b32. Defects that are now compile errors (a `StreamRef`
//! outliving its owner or changing threads, a guard sent to another thread, a raw-handle driver
//! call without `unsafe`) are pinned by `compile_fail` doctests in the crate, and here by a
//! run-time probe of the auto traits where that applies.

#[path = "common/calls.rs"]
mod calls;
mod common;
#[path = "common/pausing.rs"]
mod pausing;

use calls::{fmt_calls, pausing, recorded_on, setup};

use common::ForeignCapture;
use cuda_stream_pool::driver::sim::Call;
use cuda_stream_pool::driver::{CaptureStatus, Driver, SimDriver, Stream};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{
    CaptureGuard, CaptureModeGuard, Context, DeviceBuffer, ErrorCode, OwnedStream, Priority,
    MAX_IDLE,
};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(5);

/// Whether, before index `free_at`, some successful `cuStreamWaitEvent` on `waiter` waited for an
/// event whose record was enqueued on `on` at or after index `since`.
fn waited_after(calls: &[Call], waiter: Stream, on: Stream, since: usize, free_at: usize) -> bool {
    (since..free_at).any(|i| {
        let c = &calls[i];
        c.name == "cuStreamWaitEvent"
            && c.ok
            && c.stream == Some(waiter)
            && c.event.is_some_and(|e| {
                calls[since..i].iter().any(|r| {
                    r.name == "cuEventRecord" && r.ok && r.event == Some(e) && r.stream == Some(on)
                })
            })
    })
}

/// Whether a type is `Send`, at run time (autoref specialization: the inherent method exists
/// only when `T: Send` and wins over the trait's fallback).
struct SendProbe<T: ?Sized>(PhantomData<T>);
trait NotSend {
    fn is_send(&self) -> bool {
        false
    }
}
impl<T: ?Sized> NotSend for SendProbe<T> {}
impl<T: ?Sized + Send> SendProbe<T> {
    fn is_send(&self) -> bool {
        true
    }
}
macro_rules! is_send {
    ($t:ty) => {
        SendProbe::<$t>(PhantomData).is_send()
    };
}

/// The same probe for `Sync`.
struct SyncProbe<T: ?Sized>(PhantomData<T>);
trait NotSync {
    fn is_sync(&self) -> bool {
        false
    }
}
impl<T: ?Sized> NotSync for SyncProbe<T> {}
impl<T: ?Sized + Sync> SyncProbe<T> {
    fn is_sync(&self) -> bool {
        true
    }
}
macro_rules! is_sync {
    ($t:ty) => {
        SyncProbe::<$t>(PhantomData).is_sync()
    };
}

// ---- 1 ------------------------------------------------------------------------------------------

#[test]
fn defect_01_host_func_in_capture() {
    let (_sim, ctx) = setup();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let guard = s.begin_capture().unwrap();
    let r = s.launch_host_func(|| {});
    drop(guard);
    assert!(
        r.is_err(),
        "launch_host_func on a capturing stream must be refused (a captured host node runs on \
         every graph launch with the same boxed FnOnce), got {r:?}"
    );
}

// ---- 3 ------------------------------------------------------------------------------------------

#[test]
fn defect_03_failed_ordering_frees_unordered() {
    let (sim, ctx) = setup();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let mut buf = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
    s.synchronize().unwrap();
    sim.enqueue_work(s.raw(), 1_000).unwrap(); // s busy ...
    buf.fill(&s, 7).unwrap(); // ... and the buffer's last use pending behind that work
    let ptr = buf.as_raw();
    sim.clear_calls();
    // The free on s fails (first try and the retry after bind), and so does the ordering of the
    // disposal stream after s.
    sim.fail_calls("cuMemFreeAsync", ErrorCode::ERROR_UNKNOWN, 2);
    sim.fail_calls("cuEventRecord", ErrorCode::ERROR_UNKNOWN, 1);
    sim.fail_calls("cuStreamWaitEvent", ErrorCode::ERROR_UNKNOWN, 1);
    drop(buf);
    sim.clear_faults();
    let calls = sim.calls();
    let log = fmt_calls(&calls);
    sim.advance(2_000); // the memset on s runs now
    let disposal = ctx.disposal_stream();
    let unordered_free = calls.iter().enumerate().any(|(i, c)| {
        c.name == "cuMemFreeAsync"
            && c.ok
            && c.ptr == Some(ptr)
            && c.stream == Some(disposal)
            && !waited_after(&calls, disposal, s.raw(), 0, i)
    });
    assert!(
        !unordered_free && sim.misuse().is_empty(),
        "the free was issued on the disposal stream although ordering it after the buffer's \
         pending use failed; misuse: {:?}; calls: {log}",
        sim.misuse()
    );
}

// ---- 4 ------------------------------------------------------------------------------------------

#[test]
fn defect_04_concurrent_use_on_misses_pending_kernel() {
    let (pd, sim, ctx) = pausing();
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s0 = o.stream().unwrap();
    let buf = DeviceBuffer::<f32>::zeroed(&s0, 256).unwrap();
    s0.synchronize().unwrap();
    sim.clear_calls();
    let (buf2, k, ctx2, pd2, sim2) = (&buf, &k, &ctx, &pd, &sim);
    let sa_raw = std::thread::scope(|sc| {
        let a = sc.spawn(move || {
            // Thread A: its use of the buffer begins inside add_one; it pauses right before
            // cuLaunchKernel, with the use begun but the kernel not yet enqueued.
            let oa = ctx2.owner();
            let sa = oa.stream().unwrap();
            pd2.hook.arm_here("cuLaunchKernel", 1);
            k.add_one(&sa, buf2).unwrap();
            sim2.enqueue_work(sa.raw(), 1_000).unwrap(); // keeps A's stream busy afterwards
            sa.raw()
        });
        assert!(
            pd.hook.wait_paused(TIMEOUT),
            "thread A did not reach cuLaunchKernel"
        );
        // Thread B: uses the buffer on its own stream in A's window.
        let b = sc.spawn(move || {
            let ob = ctx2.owner();
            let sb = ob.stream().unwrap();
            drop(buf2.use_on(&sb).unwrap());
        });
        std::thread::sleep(Duration::from_millis(50)); // let B reach the buffer (not needed for the assertion)
        pd.hook.release();
        let raw = a.join().unwrap();
        b.join().unwrap();
        raw
    });
    assert!(!pd.hook.timed_out());
    let calls = sim.calls();
    let launch = calls
        .iter()
        .position(|c| c.name == "cuLaunchKernel" && c.ok && c.stream == Some(sa_raw))
        .expect("A's kernel launch");
    // Every later use (B's) waits for an event recorded on A's stream after A's kernel.
    let after_kernel = calls[launch + 1..]
        .iter()
        .any(|c| c.name == "cuEventRecord" && c.ok && c.stream == Some(sa_raw));
    drop(buf);
    sim.advance(2_000);
    assert!(
        after_kernel && sim.misuse().is_empty(),
        "a concurrent use of the buffer did not order after thread A's kernel; misuse: {:?}; \
         calls: {}",
        sim.misuse(),
        fmt_calls(&sim.calls())
    );
}

// ---- 5 ------------------------------------------------------------------------------------------

#[test]
fn defect_05_stale_check_then_act() {
    // The check-then-act window is gone: a `StreamRef` borrows its owner, so the owner cannot be
    // dropped while a reference is in use, and a reference cannot reach another thread (compile
    // errors, pinned by the `compile_fail` doctests of `StreamRef`). What is left to check at run
    // time is that the types really are neither `Send` nor `Sync`.
    assert!(
        is_sync!(u32) && !is_sync!(std::cell::Cell<u32>),
        "the probe works"
    );
    assert!(!is_send!(cuda_stream_pool::StreamRef<'static>));
    assert!(!is_sync!(cuda_stream_pool::StreamRef<'static>));
    assert!(
        !is_sync!(cuda_stream_pool::Owner),
        "an owner's streams have one thread"
    );
    assert!(
        !is_sync!(OwnedStream),
        "an owned stream's references have one thread"
    );
    assert!(is_send!(cuda_stream_pool::Owner) && is_send!(OwnedStream));
}

// ---- 6 ------------------------------------------------------------------------------------------

#[test]
fn defect_06_graph_launch_is_not_a_use() {
    let (sim, ctx) = setup();
    let k = Kernels::load(&ctx).unwrap();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<f32>::zeroed(&s, 256).unwrap();
    s.synchronize().unwrap();
    let g = s.begin_capture().unwrap();
    k.add_one(&s, &buf).unwrap();
    let exec = g.end().unwrap().instantiate().unwrap();
    sim.enqueue_work(t.raw(), 1_000).unwrap(); // the graph's work stays pending on t
    exec.launch(&t).unwrap();
    let ptr = buf.as_raw();
    sim.clear_calls();
    drop(buf);
    let calls = sim.calls();
    let log = fmt_calls(&calls);
    sim.advance(2_000);
    let free = calls
        .iter()
        .position(|c| c.name == "cuMemFreeAsync" && c.ok && c.ptr == Some(ptr));
    let ordered = free.is_none_or(|i| {
        calls[i].stream == Some(t.raw())
            || waited_after(&calls, calls[i].stream.unwrap(), t.raw(), 0, i)
    });
    assert!(
        ordered && sim.misuse().is_empty(),
        "the free is not ordered after the graph launch on t that uses the buffer; misuse: {:?}; \
         calls of the drop: {log}",
        sim.misuse()
    );
    drop(exec);
}

// ---- 7 ------------------------------------------------------------------------------------------

#[test]
fn defect_07_use_on_into_capture_waits_on_outside_event() {
    let (sim, ctx) = setup();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<u32>::zeroed(&t, 64).unwrap();
    t.synchronize().unwrap();
    sim.enqueue_work(t.raw(), 1_000).unwrap(); // last use on busy t
    let guard = s.begin_capture().unwrap();
    let begin = sim.calls().len();
    let r = buf.use_on(&s);
    let calls = sim.calls();
    let end = guard.end();
    // Waits into the capturing stream on events recorded outside the capture (on the H200:
    // CUDA_ERROR_STREAM_CAPTURE_ISOLATION, and the capture is invalidated).
    let bad: Vec<&Call> = (begin..calls.len())
        .filter(|&i| {
            let c = &calls[i];
            c.name == "cuStreamWaitEvent"
                && c.stream == Some(s.raw())
                && c.event
                    .and_then(|e| recorded_on(&calls, e, i))
                    .is_some_and(|on| on != s.raw())
        })
        .map(|i| &calls[i])
        .collect();
    assert!(
        (r.is_err() && end.is_ok()) || bad.is_empty(),
        "use_on into a capture made cuStreamWaitEvent(capturing stream, event recorded outside \
         the capture): {} (use_on: {r:?}, end: {:?})",
        fmt_calls(&bad.into_iter().cloned().collect::<Vec<_>>()),
        end.map(|_| ())
    );
}

// ---- 8 ------------------------------------------------------------------------------------------

#[test]
fn defect_08_pool_search_kills_live_capture() {
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

// ---- 9 ------------------------------------------------------------------------------------------

#[test]
fn defect_09_owned_stream_drop_kills_foreign_global_capture() {
    let (sim, ctx) = setup();
    let d: Arc<dyn Driver> = sim.clone();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let os = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    let fc = ForeignCapture::new(&d, ctx.raw(), s.raw());
    drop(os); // this thread is in global mode
    let r = fc.end();
    assert!(
        r.is_ok(),
        "dropping an OwnedStream invalidated another thread's global capture: {:?}",
        r.map(|_| ())
    );
}

// ---- 10 -----------------------------------------------------------------------------------------

#[test]
fn defect_10_owned_stream_dropped_while_capturing() {
    let (sim, ctx) = setup();
    let os = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    // The guard borrows the stream now (dropping the stream under it does not compile); a guard
    // leaked with `mem::forget` must not make the drop destroy a capturing stream.
    std::mem::forget(os.stream().begin_capture().unwrap());
    drop(os);
    assert!(
        sim.misuse().is_empty(),
        "an OwnedStream dropped under its live capture guard: {:?}",
        sim.misuse()
    );
}

// ---- 11 -----------------------------------------------------------------------------------------

#[test]
fn defect_11_capture_guards_are_send() {
    // The probe itself works.
    assert!(is_send!(u32));
    assert!(!is_send!(std::rc::Rc<u32>));
    let guard = is_send!(CaptureGuard<'static>);
    let mode = is_send!(CaptureModeGuard<'static>);
    assert!(
        !guard && !mode,
        "capture guards must not be Send (a capture ends on its own thread; a thread's capture \
         mode is per thread): CaptureGuard Send = {guard}, CaptureModeGuard Send = {mode}"
    );
}

// ---- 12 -----------------------------------------------------------------------------------------

#[test]
fn defect_12_live_streams_underflow() {
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

// ---- 13 -----------------------------------------------------------------------------------------

const CHILD_13: &str = "CSP_SOUNDNESS_DEFECT_13_CHILD";

#[test]
fn defect_13_thread_owner_holding_last_context_aborts() {
    if std::env::var_os(CHILD_13).is_some() {
        // The scenario, in a child process: a thread whose implicit owner holds the last Context.
        // The thread's first use of the crate is `ctx.stream()` (the context is made here), so
        // its implicit owner is set up before the driver's own thread state, and torn down after.
        let sim: Arc<dyn Driver> = Arc::new(SimDriver::new());
        let ctx = Context::primary(sim, 0).unwrap();
        let (dropped_tx, dropped_rx) = std::sync::mpsc::channel::<()>();
        let (got_tx, got_rx) = std::sync::mpsc::channel::<()>();
        let c2 = ctx.clone();
        let t = std::thread::spawn(move || {
            c2.stream().unwrap();
            drop(c2); // the implicit owner keeps the context alive
            got_tx.send(()).unwrap();
            let _ = dropped_rx.recv_timeout(TIMEOUT);
        });
        got_rx.recv_timeout(TIMEOUT).unwrap();
        drop(ctx); // now the thread's implicit owner holds the last Context
        dropped_tx.send(()).unwrap();
        t.join().expect("the thread exited with a panic");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "defect_13_thread_owner_holding_last_context_aborts",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(CHILD_13, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(3)
        .collect::<Vec<_>>()
        .join(" | ");
    assert!(
        out.status.success(),
        "a thread exiting with the last Context in its implicit owner killed the process \
         ({}): {last}",
        out.status
    );
}

// ---- 14 -----------------------------------------------------------------------------------------

#[test]
fn defect_14_deferred_frees_wait_for_trim() {
    let (sim, ctx) = setup();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    // (a) Dropped during a capture of its stream: freed when the capture ends, without trim().
    // (The race of the review, the slot lock released before the entry is pushed, is not
    // reproduced: its window holds no driver call, so the pausing driver cannot stop a thread
    // inside it. This part checks the sequential behaviour only.)
    let a = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    s.synchronize().unwrap();
    let pa = a.as_raw();
    let g = s.begin_capture().unwrap();
    drop(a);
    drop(g.end().unwrap());
    let freed = |p| {
        sim.calls()
            .iter()
            .any(|c| c.name == "cuMemFreeAsync" && c.ok && c.ptr == Some(p))
    };
    let a_freed = freed(pa);
    // (b) A free that failed everywhere is retried by later ordinary operations, without trim().
    let b = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    s.synchronize().unwrap();
    let pb = b.as_raw();
    sim.fail_calls("cuMemFreeAsync", ErrorCode::ERROR_UNKNOWN, 4);
    drop(b);
    sim.clear_faults();
    assert!(!freed(pb), "setup: the free should have failed");
    for _ in 0..3 {
        let o2 = ctx.owner();
        let s2 = o2.stream().unwrap();
        let x = DeviceBuffer::<u32>::zeroed(&s2, 16).unwrap();
        s2.synchronize().unwrap();
        drop(x);
        drop(o2);
    }
    drop(o);
    let b_freed = freed(pb);
    assert!(
        a_freed && b_freed,
        "deferred frees wait for trim()/teardown: freed at the end of its capture: {a_freed}; \
         failed free retried by later operations: {b_freed}"
    );
}

// ---- 15 -----------------------------------------------------------------------------------------

#[test]
fn defect_15_implicit_alloc_free_under_foreign_global_capture() {
    let (sim, ctx) = setup();
    let d: Arc<dyn Driver> = sim.clone();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let fc = ForeignCapture::new(&d, ctx.raw(), s.raw());
    sim.clear_calls();
    let buf = DeviceBuffer::<u32>::alloc(&t, 64).unwrap();
    drop(buf);
    let calls = sim.calls();
    let r = fc.end();
    let relaxed_before = |name: &str| {
        let i = calls
            .iter()
            .position(|c| c.name.starts_with(name))
            .unwrap_or(0);
        calls[..i]
            .iter()
            .any(|c| c.name == "cuThreadExchangeStreamCaptureMode")
    };
    let (alloc_ok, free_ok) = (
        relaxed_before("cuMemAlloc"),
        relaxed_before("cuMemFreeAsync"),
    );
    assert!(
        r.is_ok() && alloc_ok && free_ok,
        "an allocation and a free on a global-mode thread while another thread captures in \
         global mode: capture end {:?}; mode switched before the alloc: {alloc_ok}, before the \
         free: {free_ok}; calls: {}",
        r.as_ref().map(|_| ()),
        fmt_calls(&calls)
    );
}

// ---- 16 -----------------------------------------------------------------------------------------

#[test]
fn defect_16_idle_cap() {
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

// ---- refused on a capturing stream, with the capture left intact -------------------------------

/// Each operation that the real driver would turn into something unsafe inside a capture (a
/// host copy that reads or writes host memory on every launch, an allocation the graph would
/// own, a fork/join wait, a nested graph launch), or that would invalidate the capture (a
/// synchronize or query), is refused with `CaptureInProgress`, and the capture still ends fine.
#[test]
fn capture_refusals_leave_the_capture_intact() {
    let (sim, ctx) = setup();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
    s.synchronize().unwrap();
    let exec = {
        let g = s.begin_capture().unwrap();
        buf.fill(&s, 1).unwrap();
        g.end().unwrap().instantiate().unwrap()
    };
    let g = s.begin_capture().unwrap();
    let refused = |what: &str, r: cuda_stream_pool::Result<()>| {
        assert!(
            matches!(r, Err(cuda_stream_pool::Error::CaptureInProgress(_))),
            "{what}: {r:?}"
        );
    };
    refused("alloc", DeviceBuffer::<u32>::alloc(&s, 4).map(|_| ()));
    refused("to_vec", buf.to_vec(&s).map(|_| ()));
    refused("copy_from_host", buf.copy_from_host(&s, &[0; 16]));
    refused("synchronize", s.synchronize());
    refused("query", s.query().map(|_| ()));
    refused("wait_for (capturing waits)", s.wait_for(&t));
    refused("wait_for (waits on capturing)", t.wait_for(&s));
    refused("host function", s.launch_host_func(|| {}));
    refused("graph launch", exec.launch(&s));
    buf.fill(&s, 2).unwrap(); // plain captured work is fine
    let graph = g.end().expect("the capture survived every refusal");
    assert_eq!(graph.node_count().unwrap(), 1);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Two graphs that share a buffer, launched on two threads at once, each a use of the buffer:
/// no deadlock (use locks are taken in address order), and the buffer's free is ordered after
/// both launches.
#[test]
fn concurrent_graph_launches_share_buffers() {
    let (sim, ctx) = setup();
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let x = DeviceBuffer::<f32>::zeroed(&s, 64).unwrap();
    let y = DeviceBuffer::<f32>::zeroed(&s, 1).unwrap();
    s.synchronize().unwrap();
    let capture = |a: &DeviceBuffer<f32>, b: &DeviceBuffer<f32>| {
        let g = s.begin_capture().unwrap();
        k.sum(&s, a, b).unwrap();
        g.end().unwrap().instantiate().unwrap()
    };
    let (e1, e2) = (capture(&x, &y), capture(&x, &y));
    drop(s);
    drop(o);
    std::thread::scope(|sc| {
        for e in [&e1, &e2] {
            let ctx = &ctx;
            sc.spawn(move || {
                for _ in 0..50 {
                    let o = ctx.owner();
                    e.launch(&o.stream().unwrap()).unwrap();
                }
            });
        }
    });
    drop((x, y, e1, e2));
    ctx.synchronize().unwrap();
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// ---- the same defects on both drivers (the H200 runs the `gpu` module) --------------------------

use cuda_stream_pool::Error;

fn capture_intact<G>(r: cuda_stream_pool::Result<G>) {
    if let Err(e) = r {
        panic!("the capture must survive: {e}");
    }
}

/// Defect 1 on both drivers: a host function into a capture is refused; the capture survives.
fn host_func_refused_in_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let g = s.begin_capture().unwrap();
    assert!(matches!(
        s.launch_host_func(|| {}),
        Err(Error::CaptureInProgress(_))
    ));
    capture_intact(g.end());
}

/// Defect 3's real-driver path: a wait from a capturing stream would pull the waiting stream
/// into the capture (and a free on it would then fail twice). The wait is refused, the capture
/// survives, and a buffer last used on the would-be-joined stream frees cleanly.
fn fork_into_capture_refused(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<u32>::zeroed(&t, 1024).unwrap();
    let g = s.begin_capture().unwrap();
    assert!(matches!(t.wait_for(&s), Err(Error::CaptureInProgress(_))));
    drop(buf);
    assert_eq!(ctx.pending(), 0, "the free on t must not be deferred");
    capture_intact(g.end());
    ctx.synchronize().unwrap();
}

/// Defect 7 on both drivers: a buffer whose last use may still run on another stream cannot be
/// used in a capture (a capturing stream waiting on outside work invalidates the capture with
/// CUDA_ERROR_STREAM_CAPTURE_ISOLATION); once that work is done, it can.
fn use_in_capture_after_outside_use(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let k = Kernels::load(&ctx).unwrap();
    let (oa, ob) = (ctx.owner(), ctx.owner());
    let (s, t) = (oa.stream().unwrap(), ob.stream().unwrap());
    let buf = DeviceBuffer::<f32>::zeroed(&t, 1 << 16).unwrap();
    let gate = common::Gate::on(&**d, t.raw());
    k.add_one(&t, &buf).unwrap(); // pending behind the gate
    let g = s.begin_capture().unwrap();
    assert!(matches!(
        k.add_one(&s, &buf),
        Err(Error::CaptureInProgress(_))
    ));
    capture_intact(g.end());
    drop(gate);
    t.synchronize().unwrap();
    let g = s.begin_capture().unwrap();
    k.add_one(&s, &buf).unwrap(); // t's work is done: nothing to wait for
    let exec = g.end().unwrap().instantiate().unwrap();
    exec.launch(&s).unwrap();
    assert_eq!(buf.to_vec(&t).unwrap()[0], 2.0);
}

/// Defect 9 on both drivers: dropping an `OwnedStream`, and tearing a context down, on a thread
/// in global mode, while another thread captures in global mode: the capture survives.
fn owned_stream_drop_keeps_foreign_capture(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let os = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    let other = common::ctx(d);
    other.owner().stream().unwrap();
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    drop(os);
    drop(other);
    capture_intact(fc.end());
}

/// Defect 15 on both drivers: allocations and frees of the crate, on a thread in global mode,
/// on a stream that is not capturing, while another thread captures in global mode (and while
/// this thread captures in thread-local mode): every capture survives.
fn alloc_free_keep_captures(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (oa, ob, oc) = (ctx.owner(), ctx.owner(), ctx.owner());
    let (s, t, u) = (
        oa.stream().unwrap(),
        ob.stream().unwrap(),
        oc.stream().unwrap(),
    );
    let fc = ForeignCapture::new(d, ctx.raw(), s.raw());
    let own = u.begin_capture().unwrap();
    for _ in 0..3 {
        let b = DeviceBuffer::<u32>::zeroed(&t, 256).unwrap();
        drop(b);
    }
    capture_intact(own.end());
    capture_intact(fc.end());
}

on_both_drivers! {
    host_func_refused_in_capture,
    fork_into_capture_refused,
    use_in_capture_after_outside_use,
    owned_stream_drop_keeps_foreign_capture,
    alloc_free_keep_captures,
}

/// Found while hunting a heap corruption of the model test: a host copy whose synchronize failed
/// returned the error while the copy was still pending, and the host memory (to_vec's vector,
/// or the caller's slice) was freed or reused while the copy could still write it (read it).
/// The copy must target memory that outlives it: staging memory that is leaked when the wait
/// fails.
#[test]
fn defect_17_a_failed_wait_never_frees_memory_a_copy_still_targets() {
    use cuda_stream_pool::driver::SimDriver;
    use cuda_stream_pool::ErrorCode;
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<u8>::zeroed(&s, 1 << 16).unwrap();
    s.synchronize().unwrap();
    let mut reads = Vec::new();
    for round in 0..3 {
        sim.enqueue_work(s.raw(), 1_000_000).unwrap(); // the copy waits behind this
        sim.fail_calls("cuStreamSynchronize", ErrorCode::ERROR_UNKNOWN, 1);
        let r = match round {
            0 => b.to_vec(&s).map(|_| ()),
            1 => {
                let mut dst = vec![7u8; 1 << 16];
                let r = b.copy_to_host(&s, &mut dst);
                reads.push(dst); // the caller reuses its slice
                r
            }
            _ => {
                let mut b2 = DeviceBuffer::<u8>::zeroed(&s, 1 << 16).unwrap();
                let src = vec![1u8; 1 << 16];
                let r = b2.copy_from_host(&s, &src);
                drop(src); // freed: the pending copy must not read it
                s.synchronize().unwrap();
                drop(b2);
                r
            }
        };
        assert!(r.is_err(), "the injected fault did not hit the wait");
        // The pending copy lands now: into memory the crate kept, not into freed memory.
        sim.advance(2_000_000);
        s.synchronize().unwrap();
    }
    // The caller's slice was not written after the call returned.
    assert!(
        reads[0].iter().all(|&x| x == 7),
        "a copy wrote the caller's slice after the call"
    );
    // The kept staging memory is released once its copies are known complete.
    ctx.trim().unwrap();
    assert_eq!(ctx.pending(), 0);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}
