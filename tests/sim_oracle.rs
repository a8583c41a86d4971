//! The simulated driver as a strict oracle: happens-before race detection on device memory,
//! use after free, uninitialised reads, and the capture rules measured on an H200. Every test
//! drives the `SimDriver` directly through the `Driver` trait and checks both the bad case (the
//! finding or error is there) and the good case (it is not).
//! The capture rules that can be checked on the real driver too (isolation, fork and join,
//! frees into a capture, which calls invalidate which capture) are differential scenarios in
//! `tests/differential_capture.rs`; only the ones unsafe or unobservable on a GPU stay here.

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

/// Found by the docs review: huge sizes and durations overflowed (a panic in debug builds).
#[test]
fn huge_access_sizes_and_durations_do_not_overflow() {
    let sim = std::sync::Arc::new(cuda_stream_pool::driver::SimDriver::new());
    let d: std::sync::Arc<dyn cuda_stream_pool::driver::Driver> = sim.clone();
    let ctx = cuda_stream_pool::Context::primary(d, 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let buf = cuda_stream_pool::DeviceBuffer::<u8>::zeroed(&s, 16).unwrap();
    let u = buf.use_on(&s).unwrap();
    assert!(sim
        .enqueue_access(s.raw(), u.ptr(), usize::MAX, true, 1)
        .is_err());
    drop(u);
    sim.advance(10);
    sim.enqueue_work(s.raw(), u64::MAX).unwrap();
    assert!(!s.query().unwrap());
}
