//! The simulated driver's host-mapped memory and stream memory operations (`cuMemHostAlloc`,
//! `cuStreamWriteValue64`, `cuStreamWaitValue32`): writes land in stream order at the simulated
//! time the stream reaches them, waits hold the stream until the host writes (whatever the
//! clock), and misuse (frees under pending operations, double frees, capture) is reported. The
//! scenario that is safe on a GPU too is `host_mapped_write_and_wait` in `tests/differential.rs`.

use cuda_stream_pool::driver::{
    host_alloc_flags, CaptureMode, Device, DevicePtr, Driver, SimDriver, Stream, WaitValue,
};
use cuda_stream_pool::ErrorCode;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

const FLAGS: u32 = host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE;

fn sim() -> Arc<SimDriver> {
    // SAFETY: the context is retained here and lives as long as the simulation.
    unsafe {
        let sim = Arc::new(SimDriver::new());
        let ctx = sim.primary_ctx_retain(Device(0)).unwrap();
        sim.ctx_set_current(ctx).unwrap();
        sim
    }
}

fn mapped(sim: &SimDriver) -> (*mut u8, DevicePtr) {
    let host = sim.mem_host_alloc(64, FLAGS).unwrap();
    // SAFETY: `host` was just allocated.
    let dev = unsafe { sim.mem_host_get_device_pointer(host) }.unwrap();
    (host, dev)
}

fn word64(host: *mut u8) -> &'static AtomicU64 {
    // SAFETY: the tests keep the allocation (page-aligned, 64 bytes) alive while they read it.
    unsafe { &*(host as *const AtomicU64) }
}

#[test]
fn write_lands_when_the_clock_reaches_it() {
    let sim = sim();
    let s: Stream = sim.stream_create(0, 0).unwrap();
    let (host, dev) = mapped(&sim);
    assert_eq!(sim.counters().live_host_allocs, 1);
    sim.enqueue_work(s, 1_000).unwrap();
    // SAFETY: `s` and the mapped memory are live until the end of the test.
    unsafe { sim.stream_write_value64(s, dev, 42) }.unwrap();
    assert_eq!(word64(host).load(Ordering::Acquire), 0);
    sim.advance(999);
    assert_eq!(
        word64(host).load(Ordering::Acquire),
        0,
        "landed before the work completed"
    );
    sim.advance(1);
    assert_eq!(word64(host).load(Ordering::Acquire), 42);
    // SAFETY: the stream is idle; nothing targets the memory any more.
    unsafe {
        sim.stream_destroy(s).unwrap();
        sim.mem_free_host(host).unwrap();
    }
    assert_eq!(sim.counters().live_host_allocs, 0);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn wait_holds_the_stream_until_the_host_writes_whatever_the_clock() {
    let sim = sim();
    let s = sim.stream_create(0, 0).unwrap();
    let (host, dev) = mapped(&sim);
    // SAFETY: the word at host+8 lies in the 64-byte allocation, 4-byte aligned.
    let word = unsafe { &*(host.add(8) as *const AtomicU32) };
    // SAFETY: live stream and mapped memory; the host writes the word below.
    unsafe {
        sim.stream_wait_value32(s, DevicePtr(dev.0 + 8), 3, WaitValue::Eq)
            .unwrap();
        sim.stream_write_value64(s, dev, 1).unwrap();
    }
    sim.advance(1_000_000_000);
    assert!(sim.is_busy(s));
    word.store(2, Ordering::Release);
    sim.advance(0);
    assert!(sim.is_busy(s), "EQ 3 passed on 2");
    assert_eq!(word64(host).load(Ordering::Acquire), 0);
    word.store(3, Ordering::Release);
    sim.advance(0);
    assert!(!sim.is_busy(s));
    assert_eq!(word64(host).load(Ordering::Acquire), 1);
    // SAFETY: idle stream, nothing pending on the memory.
    unsafe {
        sim.stream_destroy(s).unwrap();
        sim.mem_free_host(host).unwrap();
    }
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn synchronize_behind_a_wait_sees_another_threads_write() {
    let sim = sim();
    let s = sim.stream_create(0, 0).unwrap();
    let (host, dev) = mapped(&sim);
    let addr = host as usize;
    // SAFETY: live stream and mapped memory; the thread below writes the word.
    unsafe { sim.stream_wait_value32(s, dev, 1, WaitValue::Geq) }.unwrap();
    let t = std::thread::spawn(move || {
        // SAFETY: the allocation outlives the thread (joined before the free).
        unsafe { &*(addr as *const AtomicU32) }.store(1, Ordering::Release);
    });
    // SAFETY: live stream.
    unsafe { sim.stream_synchronize(s) }.unwrap();
    t.join().unwrap();
    // SAFETY: idle stream, nothing pending on the memory.
    unsafe {
        sim.stream_destroy(s).unwrap();
        sim.mem_free_host(host).unwrap();
    }
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn wait_conditions() {
    assert!(WaitValue::Geq.holds(5, 5));
    assert!(WaitValue::Geq.holds(0, u32::MAX), "cyclic comparison");
    assert!(!WaitValue::Geq.holds(4, 5));
    assert!(WaitValue::Eq.holds(5, 5) && !WaitValue::Eq.holds(6, 5));
    assert!(WaitValue::And.holds(6, 2) && !WaitValue::And.holds(4, 2));
    assert!(WaitValue::Nor.holds(0, 0) && !WaitValue::Nor.holds(u32::MAX, 0));
}

#[test]
fn free_under_a_pending_write_is_misuse() {
    let sim = sim();
    let s = sim.stream_create(0, 0).unwrap();
    let (host, dev) = mapped(&sim);
    sim.enqueue_work(s, 1_000).unwrap();
    // SAFETY: deliberately wrong: the memory is freed while the write is pending; the simulation
    // never writes freed memory (it reports it instead).
    unsafe {
        sim.stream_write_value64(s, dev, 1).unwrap();
        sim.mem_free_host(host).unwrap();
    }
    sim.advance(1_000);
    let m = sim.misuse();
    assert!(
        m.iter().any(|m| m.contains("freed while a stream write")),
        "{m:?}"
    );
    assert!(
        m.iter().any(|m| m.contains("landed in freed host memory")),
        "{m:?}"
    );
}

#[test]
fn double_free_and_foreign_pointers_are_refused() {
    let sim = sim();
    let (host, _) = mapped(&sim);
    let mut local = 0u64;
    // SAFETY: deliberately wrong calls the simulation must refuse without touching the memory.
    unsafe {
        sim.mem_free_host(host).unwrap();
        let e = sim.mem_free_host(host).unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::ERROR_INVALID_VALUE));
        let p = &mut local as *mut u64 as *mut u8;
        assert!(sim.mem_host_get_device_pointer(p).is_err());
    }
    assert_eq!(sim.misuse().len(), 2, "{:?}", sim.misuse());
}

#[test]
fn memory_operations_are_refused_in_a_capture() {
    let sim = sim();
    let s = sim.stream_create(0, 0).unwrap();
    let (host, dev) = mapped(&sim);
    // SAFETY: live stream and memory; the capture is ended before the stream is destroyed.
    unsafe {
        sim.stream_begin_capture(s, CaptureMode::ThreadLocal)
            .unwrap();
        let e = sim.stream_write_value64(s, dev, 1).unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED));
        assert!(
            sim.stream_end_capture(s).is_err(),
            "the capture is invalidated"
        );
        sim.stream_destroy(s).unwrap();
        sim.mem_free_host(host).unwrap();
    }
}

#[test]
fn host_memory_left_allocated_is_released_with_the_simulation() {
    let sim = sim();
    let (host, _) = mapped(&sim);
    word64(host).store(1, Ordering::Relaxed);
    drop(sim); // frees the allocation (LeakSanitizer in the fuzz runs would see a leak)
}
