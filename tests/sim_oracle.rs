//! The simulated driver as a strict oracle: happens-before race detection on device memory,
//! use after free, uninitialised reads, and the capture rules measured on an H200. Every test
//! drives the `SimDriver` directly through the `Driver` trait and checks both the bad case (the
//! finding or error is there) and the good case (it is not).

use cuda_stream_pool::driver::{
    CaptureMode, CaptureStatus, Device, DevicePtr, Driver, Event, SimDriver, Stream,
};
use cuda_stream_pool::ErrorCode;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

fn sim() -> Arc<SimDriver> {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = Arc::new(SimDriver::new());
        let ctx = sim.primary_ctx_retain(Device(0)).unwrap();
        sim.ctx_set_current(ctx).unwrap();
        sim
    }
}

fn stream(sim: &SimDriver) -> Stream {
    sim.stream_create(0, 0).unwrap()
}

/// 64 bytes allocated and initialised on `s`.
fn buffer(sim: &SimDriver, s: Stream) -> DevicePtr {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let p = sim.mem_alloc_async(64, s).unwrap();
        sim.memset_d32_async(p, 7, 16, s).unwrap();
        p
    }
}

fn order(sim: &SimDriver, from: Stream, to: Stream) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = sim.event_create(0).unwrap();
        sim.event_record(e, from).unwrap();
        sim.stream_wait_event(to, e).unwrap();
        sim.event_destroy(e).unwrap();
    }
}

fn has(v: &[String], prefix: &str) -> bool {
    v.iter().any(|m| m.starts_with(prefix))
}

fn code<T: std::fmt::Debug>(r: cuda_stream_pool::Result<T>) -> ErrorCode {
    r.expect_err("the call should fail").code().unwrap()
}

// ---- happens-before -------------------------------------------------------------------------

#[test]
fn race_unordered_free_is_reported() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        sim.mem_free_async(p, b).unwrap();
        let f = sim.findings();
        assert!(has(&f, "race: free"), "{f:?}");
    }
}

#[test]
fn ordered_free_is_clean() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        order(&sim, a, b);
        sim.mem_free_async(p, b).unwrap();
        sim.ctx_synchronize().unwrap();
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

#[test]
fn event_wait_orders_access() {
    let sim = sim();
    let (a, b) = (stream(&sim), stream(&sim));
    let p = buffer(&sim, a);
    sim.enqueue_access(b, p, 64, true, 0).unwrap();
    assert!(has(&sim.findings(), "race:"), "{:?}", sim.findings());

    let sim = self::sim();
    let (a, b) = (stream(&sim), stream(&sim));
    let p = buffer(&sim, a);
    order(&sim, a, b);
    sim.enqueue_access(b, p, 64, true, 0).unwrap();
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
}

#[test]
fn race_is_reported_even_when_timing_separates_the_accesses() {
    let sim = sim();
    let (a, b) = (stream(&sim), stream(&sim));
    let p = buffer(&sim, a);
    sim.enqueue_access(a, p, 64, true, 1_000).unwrap();
    sim.advance(5_000); // the write has completed, but nothing ordered it before the read
    sim.enqueue_access(b, p, 64, false, 0).unwrap();
    let f = sim.findings();
    assert!(
        has(&f, "race:") && f[0].contains("write then read"),
        "{f:?}"
    );
}

#[test]
fn concurrent_reads_are_not_a_race() {
    let sim = sim();
    let (a, b, c) = (stream(&sim), stream(&sim), stream(&sim));
    let p = buffer(&sim, a);
    order(&sim, a, b);
    order(&sim, a, c);
    sim.enqueue_access(b, p, 64, false, 0).unwrap();
    sim.enqueue_access(c, p, 64, false, 0).unwrap();
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    // ... but a write after them on the first stream is unordered with the read on the third.
    order(&sim, b, a);
    sim.enqueue_access(a, p, 64, true, 0).unwrap();
    let f = sim.findings();
    assert!(
        has(&f, "race:") && f[0].contains("read then write"),
        "{f:?}"
    );
}

#[test]
fn disjoint_ranges_do_not_race() {
    let sim = sim();
    let (a, b) = (stream(&sim), stream(&sim));
    let p = buffer(&sim, a);
    order(&sim, a, b);
    sim.enqueue_access(a, p, 32, true, 0).unwrap();
    sim.enqueue_access(b, DevicePtr(p.0 + 32), 32, true, 0)
        .unwrap();
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    sim.enqueue_access(b, DevicePtr(p.0 + 28), 8, true, 0)
        .unwrap();
    assert!(has(&sim.findings(), "race:"), "{:?}", sim.findings());
}

#[test]
fn host_sync_orders_later_work() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        // Every host observation orders the stream's earlier work before later work.
        type Observe = fn(&SimDriver, Stream);
        let observations: [(&str, Observe); 5] = [
            ("stream_synchronize", |s, a| {
                s.stream_synchronize(a).unwrap()
            }),
            ("stream_query", |s, a| assert!(s.stream_query(a).unwrap())),
            ("ctx_synchronize", |s, _| s.ctx_synchronize().unwrap()),
            ("event_synchronize", |s, a| {
                let e = s.event_create(0).unwrap();
                s.event_record(e, a).unwrap();
                s.event_synchronize(e).unwrap();
            }),
            ("event_query", |s, a| {
                let e = s.event_create(0).unwrap();
                s.event_record(e, a).unwrap();
                assert!(s.event_query(e).unwrap());
            }),
        ];
        for (name, observe) in observations {
            let sim = sim();
            let (a, b) = (stream(&sim), stream(&sim));
            let p = buffer(&sim, a);
            observe(&sim, a);
            sim.enqueue_access(b, p, 64, true, 0).unwrap();
            assert!(sim.findings().is_empty(), "{name}: {:?}", sim.findings());
        }
        // Time passing is not an observation.
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        sim.advance(1_000_000);
        sim.enqueue_access(b, p, 64, true, 0).unwrap();
        assert!(has(&sim.findings(), "race:"), "{:?}", sim.findings());
    }
}

#[test]
fn pending_query_does_not_order() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        sim.enqueue_access(a, p, 64, true, 1_000).unwrap();
        assert!(!sim.stream_query(a).unwrap());
        sim.enqueue_access(b, p, 64, false, 0).unwrap();
        sim.advance(1_000);
        assert!(has(&sim.findings(), "race:"), "{:?}", sim.findings());
    }
}

#[test]
fn wait_on_never_recorded_event_orders_nothing() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        let e = sim.event_create(0).unwrap();
        sim.stream_wait_event(b, e).unwrap();
        sim.event_record(e, a).unwrap(); // recorded after the wait: the wait does not see it
        sim.enqueue_access(b, p, 64, false, 0).unwrap();
        assert!(has(&sim.findings(), "race:"), "{:?}", sim.findings());
    }
}

#[test]
fn allocation_is_stream_ordered() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = sim.mem_alloc_async(64, a).unwrap();
        sim.memset_d32_async(p, 0, 16, b).unwrap();
        let f = sim.findings();
        assert!(
            has(&f, "race:") && f[0].contains("cuMemAllocAsync"),
            "{f:?}"
        );

        let sim = self::sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = sim.mem_alloc_async(64, a).unwrap();
        order(&sim, a, b);
        sim.memset_d32_async(p, 0, 16, b).unwrap();
        assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    }
}

#[test]
fn use_after_free_is_reported() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        sim.stream_synchronize(a).unwrap();
        sim.enqueue_work(a, 1_000).unwrap();
        sim.enqueue_access(a, p, 64, false, 0).unwrap(); // pending behind the work
        sim.mem_free_async(p, b).unwrap(); // executes at once
        sim.stream_synchronize(a).unwrap();
        let f = sim.findings();
        assert!(has(&f, "use-after-free:"), "{f:?}");

        // Ordered: the free waits for the read.
        let sim = self::sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        sim.enqueue_work(a, 1_000).unwrap();
        sim.enqueue_access(a, p, 64, false, 0).unwrap();
        order(&sim, a, b);
        sim.mem_free_async(p, b).unwrap();
        sim.ctx_synchronize().unwrap();
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

#[test]
fn uninitialised_read_is_reported() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let s = stream(&sim);
        let p = sim.mem_alloc_async(64, s).unwrap();
        let mut host = [0u8; 64];
        sim.memcpy_dtoh_async(host.as_mut_ptr(), p, 64, s).unwrap();
        sim.stream_synchronize(s).unwrap();
        assert!(
            has(&sim.findings(), "uninitialised read:"),
            "{:?}",
            sim.findings()
        );

        // Partly initialised: only the written part may be read.
        let sim = self::sim();
        let s = stream(&sim);
        let p = sim.mem_alloc_async(64, s).unwrap();
        let src = [1u8; 32];
        sim.memcpy_htod_async(p, src.as_ptr(), 32, s).unwrap();
        sim.memcpy_dtoh_async(host.as_mut_ptr(), p, 32, s).unwrap();
        sim.stream_synchronize(s).unwrap();
        assert!(sim.findings().is_empty(), "{:?}", sim.findings());
        assert_eq!(&host[..32], &src);
        sim.enqueue_access(s, p, 33, false, 0).unwrap();
        assert!(
            has(&sim.findings(), "uninitialised read:"),
            "{:?}",
            sim.findings()
        );
    }
}

#[test]
fn kernel_accesses_are_tracked() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let m = sim
            .module_load_data(c".version 8.0\n.target sm_90\n")
            .unwrap();
        let add_one = sim.module_get_function(m, c"csp_add_one_f32").unwrap();
        let sum = sim.module_get_function(m, c"csp_sum_f32").unwrap();
        let x = buffer(&sim, a);
        let out = sim.mem_alloc_async(4, a).unwrap();
        // `out` is read before it was written: uninitialised; `x` is written by `b` unordered.
        let (mut px, mut pout, mut n) = (x.0, out.0, 16u32);
        let mut params = [
            &mut px as *mut u64 as *mut c_void,
            &mut n as *mut u32 as *mut c_void,
        ];
        sim.launch_kernel(add_one, [1; 3], [16, 1, 1], 0, b, &mut params)
            .unwrap();
        let f = sim.findings();
        assert!(
            has(&f, "race:") && f[0].contains("kernel csp_add_one_f32"),
            "{f:?}"
        );
        let mut params = [
            &mut px as *mut u64 as *mut c_void,
            &mut pout as *mut u64 as *mut c_void,
            &mut n as *mut u32 as *mut c_void,
        ];
        sim.launch_kernel(sum, [1; 3], [16, 1, 1], 0, a, &mut params)
            .unwrap();
        assert!(
            has(&sim.findings(), "uninitialised read:"),
            "{:?}",
            sim.findings()
        );
    }
}

#[test]
fn graph_launch_work_is_ordered_by_the_launch_stream() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        sim.stream_synchronize(a).unwrap();
        sim.stream_begin_capture(a, CaptureMode::Global).unwrap();
        sim.memset_d32_async(p, 1, 16, a).unwrap();
        let g = sim.stream_end_capture(a).unwrap();
        let x = sim.graph_instantiate(g).unwrap();
        sim.graph_launch(x, a).unwrap();
        sim.enqueue_access(b, p, 64, false, 0).unwrap();
        let f = sim.findings();
        assert!(has(&f, "race:") && f[0].contains("graph launched"), "{f:?}");

        let sim = self::sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, a);
        sim.stream_begin_capture(a, CaptureMode::Global).unwrap();
        sim.memset_d32_async(p, 1, 16, a).unwrap();
        let g = sim.stream_end_capture(a).unwrap();
        let x = sim.graph_instantiate(g).unwrap();
        sim.graph_launch(x, a).unwrap();
        order(&sim, a, b);
        sim.enqueue_access(b, p, 64, false, 0).unwrap();
        assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    }
}

// ---- capture --------------------------------------------------------------------------------

fn status(sim: &SimDriver, s: Stream) -> CaptureStatus {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe { sim.stream_is_capturing(s).unwrap() }
}

#[test]
fn host_node_launched_twice_is_misuse() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        const MSG: &str = "host node launched twice";
        for launches in [1, 2] {
            let sim = sim();
            let s = stream(&sim);
            sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
            sim.launch_host_func(s, Box::new(|| {})).unwrap();
            let g = sim.stream_end_capture(s).unwrap();
            let x = sim.graph_instantiate(g).unwrap();
            for _ in 0..launches {
                sim.graph_launch(x, s).unwrap();
            }
            sim.stream_synchronize(s).unwrap();
            assert_eq!(has(&sim.misuse(), MSG), launches == 2, "{:?}", sim.misuse());
        }
    }
}

#[test]
fn fork_join_pulls_stream_into_capture() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (origin, side) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, origin);
        sim.stream_synchronize(origin).unwrap();
        let (fork, join) = (sim.event_create(0).unwrap(), sim.event_create(0).unwrap());
        sim.stream_begin_capture(origin, CaptureMode::Global)
            .unwrap();
        let (_, id) = sim.stream_capture_info(origin).unwrap();
        sim.event_record(fork, origin).unwrap();
        sim.stream_wait_event(side, fork).unwrap();
        assert_eq!(
            sim.stream_capture_info(side).unwrap(),
            (CaptureStatus::Active, id)
        );
        sim.memset_d32_async(p, 3, 16, side).unwrap();
        assert!(
            !sim.is_busy(side),
            "the side stream's work went into the graph"
        );
        sim.event_record(join, side).unwrap();
        sim.stream_wait_event(origin, join).unwrap();
        let g = sim.stream_end_capture(origin).unwrap();
        assert_eq!(sim.graph_node_count(g).unwrap(), 1);
        assert_eq!(status(&sim, side), CaptureStatus::None);
        assert_eq!(status(&sim, origin), CaptureStatus::None);
        let x = sim.graph_instantiate(g).unwrap();
        sim.graph_launch(x, origin).unwrap();
        let mut host = [0u32; 16];
        sim.memcpy_dtoh_async(host.as_mut_ptr().cast(), p, 64, origin)
            .unwrap();
        sim.stream_synchronize(origin).unwrap();
        assert_eq!(host, [3; 16]);
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

#[test]
fn unjoined_fork_fails_end_capture_904() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (origin, side) = (stream(&sim), stream(&sim));
        let p = buffer(&sim, origin);
        sim.stream_synchronize(origin).unwrap();
        let (fork, join) = (sim.event_create(0).unwrap(), sim.event_create(0).unwrap());
        sim.stream_begin_capture(origin, CaptureMode::Global)
            .unwrap();
        sim.event_record(fork, origin).unwrap();
        sim.stream_wait_event(side, fork).unwrap();
        sim.event_record(join, side).unwrap();
        sim.stream_wait_event(origin, join).unwrap();
        sim.memset_d32_async(p, 3, 16, side).unwrap(); // after the join: unjoined again
        assert_eq!(
            code(sim.stream_end_capture(origin)),
            ErrorCode::ERROR_STREAM_CAPTURE_UNJOINED
        );
        assert_eq!(status(&sim, side), CaptureStatus::None);
        assert_eq!(status(&sim, origin), CaptureStatus::None);
        assert!(!sim.is_busy(side));
    }
}

#[test]
fn capture_isolation_905() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let outside = sim.event_create(0).unwrap();
        let never = sim.event_create(0).unwrap();
        sim.event_record(outside, b).unwrap();
        sim.stream_begin_capture(a, CaptureMode::Global).unwrap();
        sim.stream_wait_event(a, never).unwrap(); // never recorded: a no-op
        assert_eq!(status(&sim, a), CaptureStatus::Active);
        assert_eq!(
            code(sim.stream_wait_event(a, outside)),
            ErrorCode::ERROR_STREAM_CAPTURE_ISOLATION
        );
        assert_eq!(status(&sim, a), CaptureStatus::Invalidated);
        assert_eq!(
            code(sim.stream_end_capture(a)),
            ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED
        );
    }
}

#[test]
fn free_into_capture_of_outside_memory_is_invalid_value() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let s = stream(&sim);
        let outside = buffer(&sim, s);
        sim.stream_synchronize(s).unwrap();
        sim.stream_begin_capture(s, CaptureMode::Global).unwrap();
        assert_eq!(
            code(sim.mem_free_async(outside, s)),
            ErrorCode::ERROR_INVALID_VALUE
        );
        assert_eq!(status(&sim, s), CaptureStatus::Active);
        // The graph's own allocation can be freed in the graph.
        let inside = sim.mem_alloc_async(64, s).unwrap();
        sim.mem_free_async(inside, s).unwrap();
        let g = sim.stream_end_capture(s).unwrap();
        assert_eq!(sim.graph_node_count(g).unwrap(), 2);
        // The outside memory is still live and freeable outside.
        sim.mem_free_async(outside, s).unwrap();
        sim.stream_synchronize(s).unwrap();
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

#[test]
fn graph_owned_memory_access_before_launch_is_misuse() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        const MSG: &str = "access to graph-owned memory before the graph ran";
        for launch_first in [false, true] {
            let sim = sim();
            let (a, b) = (stream(&sim), stream(&sim));
            sim.stream_begin_capture(a, CaptureMode::Global).unwrap();
            let p = sim.mem_alloc_async(64, a).unwrap();
            sim.memset_d32_async(p, 5, 16, a).unwrap();
            let g = sim.stream_end_capture(a).unwrap();
            let x = sim.graph_instantiate(g).unwrap();
            if launch_first {
                sim.graph_launch(x, a).unwrap();
                sim.stream_synchronize(a).unwrap();
            }
            sim.enqueue_access(b, p, 64, false, 0).unwrap();
            assert_eq!(
                has(&sim.findings(), MSG),
                !launch_first,
                "{:?}",
                sim.findings()
            );
            if launch_first {
                assert!(sim.findings().is_empty(), "{:?}", sim.findings());
            }
        }
    }
}

#[test]
fn driver_call_from_a_host_function_is_not_permitted() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let s = stream(&sim);
        let (tx, rx) = mpsc::channel();
        let inner = sim.clone();
        sim.launch_host_func(
            s,
            Box::new(move || {
                tx.send(inner.stream_query(s).map_err(|e| e.code()))
                    .unwrap();
            }),
        )
        .unwrap();
        sim.stream_synchronize(s).unwrap();
        assert_eq!(
            rx.recv().unwrap(),
            Err(Some(ErrorCode::ERROR_NOT_PERMITTED))
        );
        assert!(has(&sim.misuse(), "driver call from a host function"));
        // Host functions that do not call the driver are fine.
        let sim = self::sim();
        let s = stream(&sim);
        sim.launch_host_func(s, Box::new(|| {})).unwrap();
        sim.stream_synchronize(s).unwrap();
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

#[test]
fn host_functions_run_one_at_a_time_in_start_order() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let (release, gate) = mpsc::channel::<()>();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let r = ran.clone();
        sim.launch_host_func(
            a,
            Box::new(move || {
                gate.recv().unwrap();
                r.lock().unwrap().push("a");
            }),
        )
        .unwrap();
        let second_ran = Arc::new(AtomicBool::new(false));
        let (r, flag) = (ran.clone(), second_ran.clone());
        sim.launch_host_func(
            b,
            Box::new(move || {
                r.lock().unwrap().push("b");
                flag.store(true, Ordering::SeqCst);
            }),
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(100));
        sim.advance(0);
        assert!(
            !second_ran.load(Ordering::SeqCst),
            "a blocked host function delays every other one"
        );
        assert!(sim.is_busy(b));
        release.send(()).unwrap();
        sim.stream_synchronize(b).unwrap();
        sim.stream_synchronize(a).unwrap();
        assert_eq!(*ran.lock().unwrap(), ["a", "b"]);
    }
}

// ---- which calls invalidate which capture (the H200 table) ----------------------------------

/// Begins a capture in `mode` on a new stream on a new thread, which then waits; returns the
/// stream and a sender that lets the thread end the capture and report the result.
fn capture_on_other_thread(
    sim: &Arc<SimDriver>,
    mode: CaptureMode,
) -> (Stream, mpsc::Sender<()>, mpsc::Receiver<bool>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let (go, wait) = mpsc::channel::<()>();
        let (ready_tx, ready) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let sim = sim.clone();
        let ctx = sim.ctx_get_current().unwrap();
        std::thread::spawn(move || {
            sim.ctx_set_current(ctx).unwrap();
            let s = sim.stream_create(0, 0).unwrap();
            sim.stream_begin_capture(s, mode).unwrap();
            ready_tx.send(s).unwrap();
            wait.recv().unwrap();
            done_tx.send(sim.stream_end_capture(s).is_ok()).unwrap();
        });
        (ready.recv().unwrap(), go, done)
    }
}

type Call = fn(&SimDriver, Stream) -> cuda_stream_pool::Result<()>;

fn alloc_call(sim: &SimDriver, s: Stream) -> cuda_stream_pool::Result<()> {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe { sim.mem_alloc_async(64, s).map(|_| ()) }
}

fn free_call(sim: &SimDriver, s: Stream) -> cuda_stream_pool::Result<()> {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        // Allocated in relaxed mode so that only the free is under test.
        let old = sim
            .thread_exchange_capture_mode(CaptureMode::Relaxed)
            .unwrap();
        let p = sim.mem_alloc_async(64, s).unwrap();
        sim.thread_exchange_capture_mode(old).unwrap();
        sim.mem_free_async(p, s)
    }
}

fn query_call(sim: &SimDriver, s: Stream) -> cuda_stream_pool::Result<()> {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe { sim.stream_query(s).map(|_| ()) }
}

fn sync_call(sim: &SimDriver, s: Stream) -> cuda_stream_pool::Result<()> {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe { sim.stream_synchronize(s) }
}

fn event_query_call(sim: &SimDriver, _: Stream) -> cuda_stream_pool::Result<()> {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = sim.event_create(0).unwrap();
        let r = sim.event_query(e).map(|_| ());
        sim.event_destroy(e).unwrap();
        r
    }
}

/// The table's rule for an unsafe call made on a stream that is not capturing, by a thread in
/// `caller` mode, while another thread captures in `other` mode and (when `own` is set) the
/// calling thread itself captures in `own` mode. Returns (call ok, other alive, own alive).
fn unsafe_call_under_capture(
    call: Call,
    caller: CaptureMode,
    other: CaptureMode,
    own: Option<CaptureMode>,
) -> (bool, bool, Option<bool>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (other_s, go, done) = capture_on_other_thread(&sim, other);
        let own_s = own.map(|m| {
            let s = stream(&sim);
            sim.stream_begin_capture(s, m).unwrap();
            s
        });
        let target = stream(&sim);
        sim.thread_exchange_capture_mode(caller).unwrap();
        let ok = call(&sim, target).is_ok();
        sim.thread_exchange_capture_mode(CaptureMode::Global)
            .unwrap();
        let own_alive = own_s.map(|s| status(&sim, s) == CaptureStatus::Active);
        let other_alive = status(&sim, other_s) == CaptureStatus::Active;
        go.send(()).unwrap();
        assert_eq!(done.recv().unwrap(), other_alive);
        (ok, other_alive, own_alive)
    }
}

fn check_unsafe_row(name: &str, call: Call) {
    use CaptureMode::*;
    // (i) another thread's global capture dies when the caller is in global mode ...
    assert_eq!(
        unsafe_call_under_capture(call, Global, Global, None),
        (false, false, None),
        "{name}"
    );
    // ... but not when the caller is thread-local or relaxed, nor a thread-local or relaxed
    // capture of another thread.
    for (caller, other) in [
        (ThreadLocal, Global),
        (Relaxed, Global),
        (Global, ThreadLocal),
        (Global, Relaxed),
    ] {
        assert_eq!(
            unsafe_call_under_capture(call, caller, other, None),
            (true, true, None),
            "{name}: caller {caller:?}, other capture {other:?}"
        );
    }
    // (ii) the caller's own global or thread-local capture dies unless the caller is relaxed.
    for own in [Global, ThreadLocal] {
        assert_eq!(
            unsafe_call_under_capture(call, ThreadLocal, Relaxed, Some(own)),
            (false, true, Some(false)),
            "{name}: own {own:?}"
        );
        assert_eq!(
            unsafe_call_under_capture(call, Relaxed, Relaxed, Some(own)),
            (true, true, Some(true)),
            "{name}: own {own:?}, relaxed caller"
        );
    }
}

#[test]
fn alloc_on_other_stream_invalidates_global_capture_unless_relaxed() {
    check_unsafe_row("cuMemAllocAsync", alloc_call);
}

#[test]
fn free_on_other_stream_invalidates_global_capture_unless_relaxed() {
    check_unsafe_row("cuMemFreeAsync", free_call);
}

#[test]
fn queries_and_syncs_invalidate_like_allocations() {
    check_unsafe_row("cuStreamQuery", query_call);
    check_unsafe_row("cuStreamSynchronize", sync_call);
    check_unsafe_row("cuEventQuery", event_query_call);
}

#[test]
fn harmless_calls_do_not_invalidate_any_capture() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (other_s, go, done) = capture_on_other_thread(&sim, CaptureMode::Global);
        let own = stream(&sim);
        sim.stream_begin_capture(own, CaptureMode::Global).unwrap();
        let s = stream(&sim);
        let idle = stream(&sim);
        sim.stream_destroy(idle).unwrap();
        let e = sim.event_create(0).unwrap();
        sim.event_record(e, s).unwrap();
        sim.stream_wait_event(s, e).unwrap();
        sim.event_destroy(e).unwrap();
        sim.launch_host_func(s, Box::new(|| {})).unwrap();
        let p = {
            let old = sim
                .thread_exchange_capture_mode(CaptureMode::Relaxed)
                .unwrap();
            let p = sim.mem_alloc_async(64, s).unwrap();
            sim.thread_exchange_capture_mode(old).unwrap();
            p
        };
        sim.memset_d32_async(p, 0, 16, s).unwrap();
        sim.mem_get_info().unwrap();
        let ctx = sim.ctx_get_current().unwrap();
        sim.ctx_set_current(ctx).unwrap();
        assert_eq!(status(&sim, own), CaptureStatus::Active);
        assert_eq!(status(&sim, other_s), CaptureStatus::Active);
        sim.stream_end_capture(own).unwrap();
        go.send(()).unwrap();
        assert!(done.recv().unwrap());
        // The control: one unsafe call kills both.
        let sim = self::sim();
        let (_other_s, go, done) = capture_on_other_thread(&sim, CaptureMode::Global);
        let own = stream(&sim);
        sim.stream_begin_capture(own, CaptureMode::Global).unwrap();
        let s = stream(&sim);
        assert_eq!(
            code(sim.stream_query(s)),
            ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        assert_eq!(status(&sim, own), CaptureStatus::Invalidated);
        go.send(()).unwrap();
        assert!(!done.recv().unwrap());
    }
}

#[test]
fn unused_event_handle_is_not_an_error() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        // Sanity: an `Event` handle can be made up and is rejected as misuse.
        let sim = sim();
        assert!(sim.event_query(Event(12345)).is_err());
        assert!(has(
            &sim.misuse(),
            "cuEventQuery on unknown or destroyed event"
        ));
    }
}

#[test]
fn waiting_on_another_captures_event_is_merge_902() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let sim = sim();
        let (a, b) = (stream(&sim), stream(&sim));
        let e = sim.event_create(0).unwrap();
        sim.stream_begin_capture(a, CaptureMode::Global).unwrap();
        sim.stream_begin_capture(b, CaptureMode::Global).unwrap();
        // Inside one capture, a record and a wait are an edge.
        sim.event_record(e, a).unwrap();
        sim.stream_wait_event(a, e).unwrap();
        assert_eq!(status(&sim, a), CaptureStatus::Active);
        // Across captures, they would merge them.
        assert_eq!(
            code(sim.stream_wait_event(b, e)),
            ErrorCode::ERROR_STREAM_CAPTURE_MERGE
        );
        assert_eq!(status(&sim, b), CaptureStatus::Invalidated);
        assert_eq!(status(&sim, a), CaptureStatus::Active);
        sim.stream_end_capture(a).unwrap();
    }
}
