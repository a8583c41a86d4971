//! Differential capture scenarios: the stream-capture rules the crate depends on (isolation,
//! fork and join, frees into a capture, and which calls invalidate which capture), written once
//! against the `Driver` trait and run on the simulated driver (in CI) and on the real one (GPU
//! tests). Every capture begun here is ended and every handle made here is destroyed.

mod common;

use common::Env;
use cuda_stream_pool::driver::{CaptureMode, CaptureStatus, Driver, Stream};
use cuda_stream_pool::ErrorCode;
use std::sync::{mpsc, Arc};

fn code<T: std::fmt::Debug>(r: cuda_stream_pool::Result<T>) -> ErrorCode {
    r.expect_err("expected a driver error")
        .code()
        .expect("expected a driver error code")
}

/// Ends a capture and reports whether it was still valid: a valid one's graph is destroyed, an
/// invalidated one must fail with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
fn end_alive(d: &dyn Driver, r: cuda_stream_pool::Result<cuda_stream_pool::driver::Graph>) -> bool {
    match r {
        Ok(g) => {
            // SAFETY: `g` was just returned by an end of capture and is destroyed once.
            unsafe { d.graph_destroy(g) }.unwrap();
            true
        }
        Err(e) => {
            assert_eq!(e.code(), Some(ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED));
            false
        }
    }
}

/// A capture in `mode` on stream `s`, begun and ended on another thread (a generalisation of
/// `common::ForeignCapture`, which captures in global mode only).
struct Foreign {
    go: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<cuda_stream_pool::Result<cuda_stream_pool::driver::Graph>>,
}

impl Foreign {
    fn new(
        d: &Arc<dyn Driver>,
        ctx: cuda_stream_pool::driver::Context,
        s: Stream,
        mode: CaptureMode,
    ) -> Foreign {
        let (began, wait_begin) = mpsc::channel();
        let (go, wait_go) = mpsc::channel::<()>();
        let d = d.clone();
        let thread = std::thread::spawn(move || {
            // SAFETY: `ctx` is the caller's retained primary context and `s` its live stream,
            // which stays live until this thread has ended the capture.
            unsafe {
                d.ctx_set_current(ctx).unwrap();
                d.stream_begin_capture(s, mode).unwrap();
                began.send(()).unwrap();
                wait_go.recv().unwrap();
                d.stream_end_capture(s)
            }
        });
        wait_begin.recv().unwrap();
        Foreign { go, thread }
    }

    /// Ends the capture; true when it was still valid.
    fn end(self, d: &dyn Driver) -> bool {
        self.go.send(()).unwrap();
        end_alive(d, self.thread.join().unwrap())
    }
}

/// A capturing stream waiting on an event recorded outside the capture (on a stream that is not
/// capturing) fails with `CUDA_ERROR_STREAM_CAPTURE_ISOLATION` and invalidates the capture. A
/// never-recorded event is a no-op.
fn capture_isolation_905(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let (a, b) = (e.stream(), e.stream());
        let outside = d.event_create(0).unwrap();
        let never = d.event_create(0).unwrap();
        d.event_record(outside, b).unwrap();
        d.stream_begin_capture(a, CaptureMode::Global).unwrap();
        d.stream_wait_event(a, never).unwrap();
        assert_eq!(d.stream_is_capturing(a).unwrap(), CaptureStatus::Active);
        assert_eq!(
            code(d.stream_wait_event(a, outside)),
            ErrorCode::ERROR_STREAM_CAPTURE_ISOLATION
        );
        assert_eq!(
            d.stream_is_capturing(a).unwrap(),
            CaptureStatus::Invalidated
        );
        assert_eq!(
            code(d.stream_end_capture(a)),
            ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED
        );
        assert_eq!(d.stream_is_capturing(a).unwrap(), CaptureStatus::None);
        d.stream_synchronize(b).unwrap();
        d.event_destroy(outside).unwrap();
        d.event_destroy(never).unwrap();
        d.stream_destroy(a).unwrap();
        d.stream_destroy(b).unwrap();
    }
}

/// An event recorded in capturing stream A and waited on by stream B pulls B into A's capture:
/// B's work goes into the graph; after the join, ending A succeeds and releases B.
fn fork_join_pulls_stream_into_capture(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let (a, b) = (e.stream(), e.stream());
        let p = d.mem_alloc_async(128, a).unwrap();
        d.memset_d32_async(p, 0, 32, a).unwrap();
        d.stream_synchronize(a).unwrap();
        let (fork, join) = (d.event_create(0).unwrap(), d.event_create(0).unwrap());
        d.stream_begin_capture(a, CaptureMode::Global).unwrap();
        let (status, id) = d.stream_capture_info(a).unwrap();
        assert_eq!(status, CaptureStatus::Active);
        assert_eq!(d.stream_is_capturing(b).unwrap(), CaptureStatus::None);
        d.memset_d32_async(p, 3, 16, a).unwrap();
        d.event_record(fork, a).unwrap();
        d.stream_wait_event(b, fork).unwrap();
        assert_eq!(
            d.stream_capture_info(b).unwrap(),
            (CaptureStatus::Active, id)
        );
        let q = cuda_stream_pool::driver::DevicePtr(p.0 + 64);
        d.memset_d32_async(q, 4, 16, b).unwrap();
        d.event_record(join, b).unwrap();
        d.stream_wait_event(a, join).unwrap();
        let g = d.stream_end_capture(a).unwrap();
        assert_eq!(d.stream_is_capturing(a).unwrap(), CaptureStatus::None);
        assert_eq!(d.stream_is_capturing(b).unwrap(), CaptureStatus::None);
        assert_eq!(d.graph_node_count(g).unwrap(), 2, "one memset from each");
        // Nothing ran at capture time; the graph does both.
        let mut host = [9u32; 32];
        d.memcpy_dtoh_async(host.as_mut_ptr().cast(), p, 128, a)
            .unwrap();
        d.stream_synchronize(a).unwrap();
        assert_eq!(host, [0; 32]);
        let x = d.graph_instantiate(g).unwrap();
        d.graph_launch(x, a).unwrap();
        d.memcpy_dtoh_async(host.as_mut_ptr().cast(), p, 128, a)
            .unwrap();
        d.stream_synchronize(a).unwrap();
        assert_eq!(host[..16], [3; 16]);
        assert_eq!(host[16..], [4; 16]);
        d.graph_exec_destroy(x).unwrap();
        d.graph_destroy(g).unwrap();
        d.mem_free_async(p, a).unwrap();
        d.stream_synchronize(a).unwrap();
        d.event_destroy(fork).unwrap();
        d.event_destroy(join).unwrap();
        d.stream_destroy(a).unwrap();
        d.stream_destroy(b).unwrap();
    }
}

/// A forked stream that is not joined back (never, or work was added to it after the join)
/// makes the end of the capture fail with `CUDA_ERROR_STREAM_CAPTURE_UNJOINED`; both streams
/// leave capture.
fn unjoined_fork_fails_end_904(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        for join_then_more in [false, true] {
            let (a, b) = (e.stream(), e.stream());
            let p = d.mem_alloc_async(64, a).unwrap();
            d.memset_d32_async(p, 0, 16, a).unwrap();
            d.stream_synchronize(a).unwrap();
            let (fork, join) = (d.event_create(0).unwrap(), d.event_create(0).unwrap());
            d.stream_begin_capture(a, CaptureMode::Global).unwrap();
            d.event_record(fork, a).unwrap();
            d.stream_wait_event(b, fork).unwrap();
            if join_then_more {
                d.event_record(join, b).unwrap();
                d.stream_wait_event(a, join).unwrap();
            }
            d.memset_d32_async(p, 3, 16, b).unwrap();
            assert_eq!(
                code(d.stream_end_capture(a)),
                ErrorCode::ERROR_STREAM_CAPTURE_UNJOINED,
                "join then more work: {join_then_more}"
            );
            assert_eq!(d.stream_is_capturing(a).unwrap(), CaptureStatus::None);
            assert_eq!(d.stream_is_capturing(b).unwrap(), CaptureStatus::None);
            // The captured memset never ran.
            let mut host = [9u32; 16];
            d.memcpy_dtoh_async(host.as_mut_ptr().cast(), p, 64, a)
                .unwrap();
            d.stream_synchronize(a).unwrap();
            assert_eq!(host, [0; 16]);
            d.mem_free_async(p, a).unwrap();
            d.stream_synchronize(a).unwrap();
            d.stream_synchronize(b).unwrap();
            d.event_destroy(fork).unwrap();
            d.event_destroy(join).unwrap();
            d.stream_destroy(a).unwrap();
            d.stream_destroy(b).unwrap();
        }
    }
}

/// Freeing memory allocated outside the capture into a capturing stream fails with
/// `CUDA_ERROR_INVALID_VALUE`; the capture stays valid, the graph's own allocation can be freed
/// in the graph, and the outside memory is still live and freeable outside.
fn free_into_capture_of_outside_memory_is_invalid_value(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let outside = d.mem_alloc_async(64, s).unwrap();
        d.memset_d32_async(outside, 7, 16, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_begin_capture(s, CaptureMode::Global).unwrap();
        assert_eq!(
            code(d.mem_free_async(outside, s)),
            ErrorCode::ERROR_INVALID_VALUE
        );
        assert_eq!(d.stream_is_capturing(s).unwrap(), CaptureStatus::Active);
        let inside = d.mem_alloc_async(64, s).unwrap();
        d.mem_free_async(inside, s).unwrap();
        let g = d.stream_end_capture(s).unwrap();
        assert_eq!(
            d.graph_node_count(g).unwrap(),
            2,
            "an alloc and a free node"
        );
        d.graph_destroy(g).unwrap();
        let mut host = [0u32; 16];
        d.memcpy_dtoh_async(host.as_mut_ptr().cast(), outside, 64, s)
            .unwrap();
        d.stream_synchronize(s).unwrap();
        assert_eq!(host, [7; 16]);
        d.mem_free_async(outside, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

// ---- which calls invalidate which capture ---------------------------------------------------

/// A "potentially unsafe" call, made on stream `y` that is not capturing.
#[derive(Clone, Copy, Debug)]
enum Call {
    Alloc,
    Free,
    Query,
    Sync,
    EventQuery,
    /// `cuMemHostAlloc` (page-locked, device-mapped).
    HostAlloc,
    /// `cuMemFreeHost` of a block allocated before any capture began.
    HostFree,
}

/// Makes `call` on a stream that is not capturing, by this thread in `caller` mode, while
/// another thread captures in `foreign` mode (if any) and this thread captures in `own` mode (if
/// any). Returns (the call's error code if it failed, foreign capture alive, own capture alive).
fn call_under_capture(
    e: &Env,
    call: Call,
    caller: CaptureMode,
    foreign: Option<CaptureMode>,
    own: Option<CaptureMode>,
) -> (Option<ErrorCode>, Option<bool>, Option<bool>) {
    let d = &e.d;
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let y = e.stream();
        let ev = d.event_create(0).unwrap();
        // For the free: memory allocated (and ready) before any capture begins.
        let pre = d.mem_alloc_async(64, y).unwrap();
        d.stream_synchronize(y).unwrap();
        let host_flags = cuda_stream_pool::driver::host_alloc_flags::DEVICEMAP;
        let pre_host = d.mem_host_alloc(64, host_flags).unwrap();
        let mut host_allocated = None;
        let mut host_freed = false;
        let fs = foreign.map(|m| {
            let s = e.stream();
            (s, Foreign::new(d, e.ctx, s, m))
        });
        let x = own.map(|m| {
            let x = e.stream();
            d.stream_begin_capture(x, m).unwrap();
            x
        });
        let old = d.thread_exchange_capture_mode(caller).unwrap();
        let mut allocated = None;
        let mut freed = false;
        let r = match call {
            Call::Alloc => d.mem_alloc_async(64, y).map(|p| allocated = Some(p)),
            Call::Free => d.mem_free_async(pre, y).map(|()| freed = true),
            Call::Query => d.stream_query(y).map(drop),
            Call::Sync => d.stream_synchronize(y),
            Call::EventQuery => d.event_query(ev).map(drop),
            Call::HostAlloc => d
                .mem_host_alloc(64, host_flags)
                .map(|p| host_allocated = Some(p)),
            Call::HostFree => d.mem_free_host(pre_host).map(|()| host_freed = true),
        };
        let r = r.err().map(|e| e.code().expect("a driver error code"));
        assert_eq!(d.thread_exchange_capture_mode(old).unwrap(), caller);
        let own_alive = x.map(|x| {
            let alive = end_alive(&**d, d.stream_end_capture(x));
            d.stream_destroy(x).unwrap();
            alive
        });
        let foreign_alive = fs.map(|(s, f)| {
            let alive = f.end(&**d);
            d.stream_destroy(s).unwrap();
            alive
        });
        if let Some(p) = allocated {
            d.mem_free_async(p, y).unwrap();
        }
        if !freed {
            d.mem_free_async(pre, y).unwrap();
        }
        if let Some(p) = host_allocated {
            d.mem_free_host(p).unwrap();
        }
        if !host_freed {
            d.mem_free_host(pre_host).unwrap();
        }
        d.stream_synchronize(y).unwrap();
        d.event_destroy(ev).unwrap();
        d.stream_destroy(y).unwrap();
        (r, foreign_alive, own_alive)
    }
}

/// The table's row for one unsafe call.
fn check_row(d: &Arc<dyn Driver>, call: Call) {
    use CaptureMode::*;
    const UNSUPPORTED: Option<ErrorCode> = Some(ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED);
    let e = Env::new(d);
    // Another thread's global capture: a global-mode caller fails with 900 and kills it ...
    assert_eq!(
        call_under_capture(&e, call, Global, Some(Global), None),
        (UNSUPPORTED, Some(false), None),
        "{call:?}: global caller, foreign global capture"
    );
    // ... a thread-local or relaxed caller does not, and a global caller does not touch another
    // thread's thread-local or relaxed capture.
    for (caller, foreign) in [
        (Relaxed, Global),
        (ThreadLocal, Global),
        (Global, ThreadLocal),
        (Global, Relaxed),
    ] {
        assert_eq!(
            call_under_capture(&e, call, caller, Some(foreign), None),
            (None, Some(true), None),
            "{call:?}: caller {caller:?}, foreign capture {foreign:?}"
        );
    }
    // The caller's own global or thread-local capture (on another stream) dies unless the
    // caller is relaxed.
    for own in [Global, ThreadLocal] {
        for caller in [Global, ThreadLocal] {
            assert_eq!(
                call_under_capture(&e, call, caller, None, Some(own)),
                (UNSUPPORTED, None, Some(false)),
                "{call:?}: caller {caller:?}, own capture {own:?}"
            );
        }
        assert_eq!(
            call_under_capture(&e, call, Relaxed, None, Some(own)),
            (None, None, Some(true)),
            "{call:?}: relaxed caller, own capture {own:?}"
        );
    }
}

/// cuMemAllocAsync on a stream that is not capturing.
fn alloc_under_capture_invalidates_unless_relaxed(d: &Arc<dyn Driver>) {
    check_row(d, Call::Alloc);
}

/// cuMemFreeAsync on a stream that is not capturing.
fn free_under_capture_invalidates_unless_relaxed(d: &Arc<dyn Driver>) {
    check_row(d, Call::Free);
}

/// cuStreamQuery, cuStreamSynchronize and cuEventQuery, on handles outside any capture.
fn queries_and_syncs_under_capture_invalidate_unless_relaxed(d: &Arc<dyn Driver>) {
    for call in [Call::Query, Call::Sync, Call::EventQuery] {
        check_row(d, call);
    }
}

/// `cuMemHostAlloc`, and `cuMemFreeHost` (which the device rules relax on that assumption, and
/// the simulation treats the same way: this row checks it on the H200).
fn host_alloc_and_free_under_capture_invalidate_unless_relaxed(d: &Arc<dyn Driver>) {
    for call in [Call::HostAlloc, Call::HostFree] {
        check_row(d, call);
    }
}

/// Calls that are not "potentially unsafe" leave another thread's global capture (and the
/// caller's own global capture) alone, with the caller in global mode.
fn harmless_calls_keep_global_captures(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let p = d.mem_alloc_async(64, s).unwrap();
        d.stream_synchronize(s).unwrap();
        let fs = e.stream();
        let foreign = Foreign::new(d, e.ctx, fs, CaptureMode::Global);
        let own = e.stream();
        d.stream_begin_capture(own, CaptureMode::Global).unwrap();
        assert_eq!(
            d.thread_exchange_capture_mode(CaptureMode::Global).unwrap(),
            CaptureMode::Global
        );
        let t = e.stream();
        let idle = e.stream();
        d.stream_destroy(idle).unwrap();
        let ev = d.event_create(0).unwrap();
        d.event_record(ev, s).unwrap();
        d.stream_wait_event(t, ev).unwrap();
        d.event_destroy(ev).unwrap();
        d.launch_host_func(s, Box::new(|| {})).unwrap();
        d.memset_d32_async(p, 0, 16, s).unwrap();
        d.mem_get_info().unwrap();
        let ctx = d.ctx_get_current().unwrap();
        d.ctx_set_current(ctx).unwrap();
        assert_eq!(d.stream_is_capturing(own).unwrap(), CaptureStatus::Active);
        assert!(end_alive(&**d, d.stream_end_capture(own)), "own capture");
        assert!(foreign.end(&**d), "foreign capture");
        d.mem_free_async(p, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_synchronize(t).unwrap();
        for x in [s, t, fs, own] {
            d.stream_destroy(x).unwrap();
        }
    }
}

/// `cuCtxSynchronize` and `cuModuleUnload` by a relaxed caller while another thread captures a
/// stream of the same context, in each mode: (error code, capture alive). Relaxed mode protects
/// a capture only from calls on other streams; a context synchronize waits for the capturing
/// stream too (measured on the H200: issue 19's `Kernels` drop, which synchronized the context
/// before unloading its module, killed a foreign global capture).
fn ctx_sync_and_module_unload_under_a_foreign_capture(d: &Arc<dyn Driver>) {
    const UNSUPPORTED: Option<ErrorCode> = Some(ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED);
    let e = Env::new(d);
    let mut seen = Vec::new();
    for mode in [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ] {
        for unload in [false, true] {
            // SAFETY: a raw driver scenario: every handle below is made here and used only
            // while live.
            unsafe {
                let module = unload.then(|| {
                    let image = std::ffi::CStr::from_bytes_with_nul(
                        cuda_stream_pool::kernels::PTX.as_bytes(),
                    )
                    .unwrap();
                    d.module_load_data(image).unwrap()
                });
                let s = e.stream();
                let f = Foreign::new(d, e.ctx, s, mode);
                let old = d
                    .thread_exchange_capture_mode(CaptureMode::Relaxed)
                    .unwrap();
                let r = match module {
                    Some(m) => d.module_unload(m),
                    None => d.ctx_synchronize(),
                };
                d.thread_exchange_capture_mode(old).unwrap();
                let alive = f.end(&**d);
                d.stream_destroy(s).unwrap();
                let what = if unload {
                    "cuModuleUnload"
                } else {
                    "cuCtxSynchronize"
                };
                seen.push((what, mode, r.err().and_then(|e| e.code()), alive));
            }
        }
    }
    let expected: Vec<_> = [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ]
    .into_iter()
    .flat_map(|m| {
        [
            ("cuCtxSynchronize", m, UNSUPPORTED, false),
            ("cuModuleUnload", m, None, true),
        ]
    })
    .collect();
    assert_eq!(
        seen, expected,
        "(call, foreign mode, error, foreign capture alive)"
    );
}

on_both_drivers! {
    ctx_sync_and_module_unload_under_a_foreign_capture,
    capture_isolation_905,
    fork_join_pulls_stream_into_capture,
    unjoined_fork_fails_end_904,
    free_into_capture_of_outside_memory_is_invalid_value,
    alloc_under_capture_invalidates_unless_relaxed,
    free_under_capture_invalidates_unless_relaxed,
    queries_and_syncs_under_capture_invalidate_unless_relaxed,
    host_alloc_and_free_under_capture_invalidate_unless_relaxed,
    harmless_calls_keep_global_captures,
}
