//! The differential suite: driver-level scenarios written once against the `Driver` trait, run
//! on the simulated driver (in CI) and on the real one (GPU tests). Each asserts the observable
//! outcome the crate depends on; where the real driver surprised us, the simulation was fixed and
//! the scenario kept.

mod common;

use common::{Env, Gate};
use cuda_stream_pool::driver::{
    stream_flags, CaptureMode, CaptureStatus, Device, DevicePtr, Driver, Stream,
};
use cuda_stream_pool::kernels::PTX;
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

fn code<T: std::fmt::Debug>(r: cuda_stream_pool::Result<T>) -> u32 {
    r.expect_err("expected a driver error")
        .code()
        .expect("expected a driver error code")
        .0
}

fn read_u32(d: &dyn Driver, p: DevicePtr, n: usize, s: Stream) -> Vec<u32> {
    let mut v = vec![0u32; n];
    // SAFETY: the caller's `p` (n u32s) and `s` are live; `v` lives until the synchronize below
    // has completed the copy.
    unsafe {
        d.memcpy_dtoh_async(v.as_mut_ptr() as *mut u8, p, n * 4, s)
            .unwrap();
        d.stream_synchronize(s).unwrap();
    }
    v
}

fn add_u32(
    d: &dyn Driver,
    f: cuda_stream_pool::driver::Function,
    p: DevicePtr,
    n: u32,
    v: u32,
    s: Stream,
) {
    let (mut a, mut b, mut c) = (p.0, n, v);
    let mut params = [
        &mut a as *mut u64 as *mut c_void,
        &mut b as *mut u32 as *mut c_void,
        &mut c as *mut u32 as *mut c_void,
    ];
    // SAFETY: csp_add_u32(unsigned *x, unsigned n, unsigned v) with a live allocation of n words.
    unsafe { d.launch_kernel(f, [n.div_ceil(256), 1, 1], [256, 1, 1], 0, s, &mut params) }.unwrap();
}

fn load_add_u32(d: &dyn Driver) -> cuda_stream_pool::driver::Function {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let m = d
            .module_load_data(CStr::from_bytes_with_nul(PTX.as_bytes()).unwrap())
            .unwrap();
        d.module_get_function(m, c"csp_add_u32").unwrap()
    }
}

/// cuStreamQuery: idle stream ready; a stream held by a host function not ready until released.
fn query_idle_and_busy(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        assert!(d.stream_query(s).unwrap());
        let mut g = Gate::on(&**d, s);
        assert!(!d.stream_query(s).unwrap());
        g.open();
        d.stream_synchronize(s).unwrap();
        assert!(d.stream_query(s).unwrap());
        d.stream_destroy(s).unwrap();
    }
}

/// An event recorded on a busy stream orders another stream's work after it.
fn event_orders_across_streams(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let (a, b) = (e.stream(), e.stream());
        let ev = d.event_create(0).unwrap();
        let p = d.mem_alloc_async(64, a).unwrap();
        d.memset_d32_async(p, 1, 16, a).unwrap();
        let mut g = Gate::on(&**d, a);
        d.memset_d32_async(p, 2, 16, a).unwrap();
        d.event_record(ev, a).unwrap();
        d.stream_wait_event(b, ev).unwrap();
        d.memset_d32_async(p, 3, 16, b).unwrap();
        assert!(!d.event_query(ev).unwrap());
        assert!(!d.stream_query(b).unwrap(), "b must wait for a's event");
        g.open();
        d.stream_synchronize(b).unwrap();
        assert!(d.event_query(ev).unwrap());
        assert_eq!(read_u32(&**d, p, 16, b), vec![3; 16]);
        d.mem_free_async(p, b).unwrap();
        d.stream_synchronize(b).unwrap();
        d.event_destroy(ev).unwrap();
        d.stream_destroy(a).unwrap();
        d.stream_destroy(b).unwrap();
    }
}

/// A wait targets the record that was latest when the wait was enqueued: recording the event
/// again elsewhere (the crate reuses ordering events) does not release it.
fn event_rerecord_keeps_earlier_wait(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let (a, b, c) = (e.stream(), e.stream(), e.stream());
        let ev = d
            .event_create(cuda_stream_pool::driver::event_flags::DISABLE_TIMING)
            .unwrap();
        let mut g = Gate::on(&**d, a);
        d.event_record(ev, a).unwrap();
        d.stream_wait_event(b, ev).unwrap();
        d.event_record(ev, c).unwrap();
        d.stream_synchronize(c).unwrap();
        assert!(
            d.event_query(ev).unwrap(),
            "the latest record (on c) has completed"
        );
        assert!(
            !d.stream_query(b).unwrap(),
            "b still waits for the record on a"
        );
        g.open();
        d.stream_synchronize(b).unwrap();
        d.event_destroy(ev).unwrap();
        for s in [a, b, c] {
            d.stream_destroy(s).unwrap();
        }
    }
}

/// The H200's priority range is 0 (least) ..= -5 (greatest).
fn priority_range(d: &Arc<dyn Driver>) {
    let _e = Env::new(d);
    assert_eq!(d.ctx_stream_priority_range().unwrap(), (0, -5));
}

/// Out-of-range priorities are clamped silently by the driver.
fn priority_clamped(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let _e = Env::new(d);
        let hi = d.stream_create(stream_flags::NON_BLOCKING, -100).unwrap();
        let lo = d.stream_create(stream_flags::NON_BLOCKING, 7).unwrap();
        let mid = d.stream_create(stream_flags::NON_BLOCKING, -3).unwrap();
        assert_eq!(d.stream_priority(hi).unwrap(), -5);
        assert_eq!(d.stream_priority(lo).unwrap(), 0);
        assert_eq!(d.stream_priority(mid).unwrap(), -3);
        for s in [hi, lo, mid] {
            d.stream_destroy(s).unwrap();
        }
    }
}

/// Stream flags round-trip.
fn stream_flags_round_trip(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let _e = Env::new(d);
        let nb = d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap();
        let df = d.stream_create(stream_flags::DEFAULT, 0).unwrap();
        assert_eq!(d.stream_flags(nb).unwrap(), stream_flags::NON_BLOCKING);
        assert_eq!(d.stream_flags(df).unwrap(), stream_flags::DEFAULT);
        d.stream_destroy(nb).unwrap();
        d.stream_destroy(df).unwrap();
    }
}

/// A nested begin on a capturing stream fails with CUDA_ERROR_ILLEGAL_STATE (401); the outer
/// capture stays active, ends cleanly, and its graph runs the captured work.
fn nested_begin_capture(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let f = load_add_u32(&**d);
        let p = d.mem_alloc_async(16 * 4, s).unwrap();
        d.memset_d32_async(p, 10, 16, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_begin_capture(s, CaptureMode::Global).unwrap();
        assert_eq!(code(d.stream_begin_capture(s, CaptureMode::Global)), 401);
        assert_eq!(d.stream_is_capturing(s).unwrap(), CaptureStatus::Active);
        add_u32(&**d, f, p, 16, 1, s);
        let g = d.stream_end_capture(s).unwrap();
        assert_eq!(d.stream_is_capturing(s).unwrap(), CaptureStatus::None);
        assert_eq!(d.graph_node_count(g).unwrap(), 1);
        let x = d.graph_instantiate(g).unwrap();
        d.graph_launch(x, s).unwrap();
        assert_eq!(read_u32(&**d, p, 16, s), vec![11; 16]);
        d.graph_launch(x, s).unwrap();
        assert_eq!(read_u32(&**d, p, 16, s), vec![12; 16]);
        d.graph_exec_destroy(x).unwrap();
        d.graph_destroy(g).unwrap();
        d.mem_free_async(p, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// Ending a capture on a stream that is not capturing is CUDA_ERROR_ILLEGAL_STATE.
fn end_capture_not_capturing(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        assert_eq!(code(d.stream_end_capture(s)), 401);
        d.stream_destroy(s).unwrap();
    }
}

/// Querying a capturing stream is forbidden: CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900); the
/// capture is invalidated, ending it reports CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901), and the
/// stream is left not capturing.
fn query_capturing_stream_invalidates(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        d.stream_begin_capture(s, CaptureMode::Global).unwrap();
        assert_eq!(code(d.stream_query(s)), 900);
        assert_eq!(
            d.stream_is_capturing(s).unwrap(),
            CaptureStatus::Invalidated
        );
        assert_eq!(code(d.stream_end_capture(s)), 901);
        assert_eq!(d.stream_is_capturing(s).unwrap(), CaptureStatus::None);
        assert!(d.stream_query(s).unwrap());
        d.stream_destroy(s).unwrap();
    }
}

/// Synchronizing a capturing stream is forbidden in the same way.
fn synchronize_capturing_stream_invalidates(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        d.stream_begin_capture(s, CaptureMode::ThreadLocal).unwrap();
        assert_eq!(code(d.stream_synchronize(s)), 900);
        assert_eq!(code(d.stream_end_capture(s)), 901);
        assert_eq!(d.stream_is_capturing(s).unwrap(), CaptureStatus::None);
        d.stream_destroy(s).unwrap();
    }
}

/// While another thread captures in global mode, a query of an unrelated stream from a thread
/// in relaxed mode is allowed and leaves the capture valid.
fn relaxed_query_during_global_capture(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let (a, b) = (e.stream(), e.stream());
        let capture = common::ForeignCapture::new(d, e.ctx, a);
        let old = d
            .thread_exchange_capture_mode(CaptureMode::Relaxed)
            .unwrap();
        assert!(d.stream_query(b).unwrap());
        d.thread_exchange_capture_mode(old).unwrap();
        assert_eq!(d.stream_is_capturing(a).unwrap(), CaptureStatus::Active);
        let g = capture.end().expect("capture stays valid");
        d.graph_destroy(g).unwrap();
        d.stream_destroy(a).unwrap();
        d.stream_destroy(b).unwrap();
    }
}

/// cuThreadExchangeStreamCaptureMode returns the previous mode; threads start in global mode.
fn capture_mode_exchange(d: &Arc<dyn Driver>) {
    let _e = Env::new(d);
    let d2 = d.clone();
    std::thread::spawn(move || {
        assert_eq!(
            d2.thread_exchange_capture_mode(CaptureMode::Relaxed)
                .unwrap(),
            CaptureMode::Global
        );
        assert_eq!(
            d2.thread_exchange_capture_mode(CaptureMode::ThreadLocal)
                .unwrap(),
            CaptureMode::Relaxed
        );
        assert_eq!(
            d2.thread_exchange_capture_mode(CaptureMode::Global)
                .unwrap(),
            CaptureMode::ThreadLocal
        );
    })
    .join()
    .unwrap();
}

/// Stream-ordered allocation, use and free on one stream; a zero-byte allocation succeeds with
/// the null pointer (measured on the H200), and freeing null is allowed.
fn async_alloc_free(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let p = d.mem_alloc_async(1024 * 4, s).unwrap();
        assert!(!p.is_null());
        d.memset_d32_async(p, 0xdead_beef, 1024, s).unwrap();
        let v = read_u32(&**d, p, 1024, s);
        assert!(v.iter().all(|&x| x == 0xdead_beef));
        d.mem_free_async(p, s).unwrap();
        d.stream_synchronize(s).unwrap();
        let z = d.mem_alloc_async(0, s).unwrap();
        assert!(z.is_null());
        d.mem_free_async(z, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// An event never recorded counts as complete; waiting on it waits for nothing.
fn unrecorded_event(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let ev = d.event_create(0).unwrap();
        assert!(d.event_query(ev).unwrap());
        d.stream_wait_event(s, ev).unwrap();
        assert!(d.stream_query(s).unwrap());
        d.event_destroy(ev).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// Creating a stream on a thread with no current context is CUDA_ERROR_INVALID_CONTEXT.
fn stream_create_without_context(d: &Arc<dyn Driver>) {
    let _e = Env::new(d);
    let d2 = d.clone();
    let c = std::thread::spawn(move || code(d2.stream_create(0, 0)))
        .join()
        .unwrap();
    assert_eq!(c, 201);
}

/// Stream-ordered allocation needs no current context on the calling thread: the memory comes
/// from the pool of the stream's device.
fn alloc_without_current_context(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let d2 = d.clone();
        let p = std::thread::spawn(move || {
            let p = d2.mem_alloc_async(256, s).unwrap();
            d2.mem_free_async(p, s).unwrap();
            p
        })
        .join()
        .unwrap();
        assert!(!p.is_null());
        d.stream_synchronize(s).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// A host function runs after the stream's earlier work, and later work waits for it.
fn host_func_order(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let seen = Arc::new(AtomicU32::new(0));
        let p = d.mem_alloc_async(4, s).unwrap();
        d.memset_d32_async(p, 5, 1, s).unwrap();
        let mut g = Gate::on(&**d, s);
        let s2 = seen.clone();
        d.launch_host_func(s, Box::new(move || s2.store(1, Ordering::SeqCst)))
            .unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 0);
        g.open();
        d.stream_synchronize(s).unwrap();
        assert_eq!(seen.load(Ordering::SeqCst), 1);
        d.mem_free_async(p, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// Ending a global-mode capture from another thread is CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
/// (908) and, as measured on the H200, terminates the capture: the stream is left not capturing
/// and its own thread's end then fails with CUDA_ERROR_ILLEGAL_STATE.
fn end_capture_wrong_thread(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        d.stream_begin_capture(s, CaptureMode::Global).unwrap();
        let d2 = d.clone();
        let ctx = e.ctx;
        let c = std::thread::spawn(move || {
            d2.ctx_set_current(ctx).unwrap();
            code(d2.stream_end_capture(s))
        })
        .join()
        .unwrap();
        assert_eq!(c, 908);
        assert_eq!(d.stream_is_capturing(s).unwrap(), CaptureStatus::None);
        assert_eq!(code(d.stream_end_capture(s)), 401);
        d.stream_destroy(s).unwrap();
    }
}

/// The embedded PTX loads; an unknown kernel name is CUDA_ERROR_NOT_FOUND; text that is not PTX
/// is rejected.
fn module_loading(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let _e = Env::new(d);
        let m = d
            .module_load_data(CStr::from_bytes_with_nul(PTX.as_bytes()).unwrap())
            .unwrap();
        d.module_get_function(m, c"csp_add_one_f32").unwrap();
        assert_eq!(code(d.module_get_function(m, c"no_such_kernel")), 500);
        d.module_unload(m).unwrap();
        assert!(d.module_load_data(c"this is not ptx").is_err());
    }
}

/// Capture ids are unique and reported only while capturing.
fn capture_info(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        assert_eq!(d.stream_capture_info(s).unwrap().0, CaptureStatus::None);
        d.stream_begin_capture(s, CaptureMode::Relaxed).unwrap();
        let (st, id1) = d.stream_capture_info(s).unwrap();
        assert_eq!(st, CaptureStatus::Active);
        d.graph_destroy(d.stream_end_capture(s).unwrap()).unwrap();
        d.stream_begin_capture(s, CaptureMode::Relaxed).unwrap();
        let (_, id2) = d.stream_capture_info(s).unwrap();
        assert_ne!(id1, id2);
        d.graph_destroy(d.stream_end_capture(s).unwrap()).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// Stream-ordered allocation inside a capture becomes an allocation node owned by the graph; a
/// free in the same capture a free node; every launch allocates and frees.
fn alloc_and_free_inside_capture(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        d.stream_begin_capture(s, CaptureMode::ThreadLocal).unwrap();
        let p = d.mem_alloc_async(1024, s).unwrap();
        d.memset_d32_async(p, 3, 256, s).unwrap();
        d.mem_free_async(p, s).unwrap();
        let g = d.stream_end_capture(s).unwrap();
        assert_eq!(d.graph_node_count(g).unwrap(), 3);
        let x = d.graph_instantiate(g).unwrap();
        d.graph_destroy(g).unwrap();
        for _ in 0..3 {
            d.graph_launch(x, s).unwrap();
        }
        d.stream_synchronize(s).unwrap();
        d.graph_exec_destroy(x).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// A capture of nothing gives a graph with no nodes that instantiates and launches.
fn empty_capture(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        d.stream_begin_capture(s, CaptureMode::ThreadLocal).unwrap();
        let g = d.stream_end_capture(s).unwrap();
        assert_eq!(d.graph_node_count(g).unwrap(), 0);
        let x = d.graph_instantiate(g).unwrap();
        d.graph_launch(x, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.graph_exec_destroy(x).unwrap();
        d.graph_destroy(g).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

/// The default memory pool's release threshold can be set and read back.
fn mem_pool_release_threshold(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        use cuda_stream_pool::driver::MemPoolAttr;
        let e = Env::new(d);
        let pool = d.device_default_mem_pool(e.dev).unwrap();
        let old = d
            .mem_pool_get_attribute(pool, MemPoolAttr::ReleaseThreshold)
            .unwrap();
        d.mem_pool_set_attribute(pool, MemPoolAttr::ReleaseThreshold, 1 << 30)
            .unwrap();
        assert_eq!(
            d.mem_pool_get_attribute(pool, MemPoolAttr::ReleaseThreshold)
                .unwrap(),
            1 << 30
        );
        d.mem_pool_set_attribute(pool, MemPoolAttr::ReleaseThreshold, old)
            .unwrap();
    }
}

/// Host-mapped memory and stream memory operations: a `cuStreamWriteValue64` lands in host
/// memory only after the stream's earlier work (held by a host function) and is then visible to a
/// plain host read; a `cuStreamWaitValue32` holds the stream, and everything behind it, until the
/// host writes the word, and the write-value behind it lands after that.
fn host_mapped_write_and_wait(d: &Arc<dyn Driver>) {
    use cuda_stream_pool::driver::{host_alloc_flags, WaitValue};
    use std::sync::atomic::AtomicU64;
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live;
    // the host memory is freed after both streams were synchronized (nothing targets it then).
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let host = d
            .mem_host_alloc(64, host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE)
            .unwrap();
        let flag = &*(host as *const AtomicU64);
        let word = &*(host.add(8) as *const AtomicU32);
        assert_eq!(flag.load(Ordering::Acquire), 0);
        let dev = d.mem_host_get_device_pointer(host).unwrap();
        let mut g = Gate::on(&**d, s);
        d.stream_write_value64(s, dev, 7).unwrap();
        assert!(!d.stream_query(s).unwrap());
        assert_eq!(
            flag.load(Ordering::Acquire),
            0,
            "landed before earlier work"
        );
        g.open();
        d.stream_synchronize(s).unwrap();
        assert_eq!(flag.load(Ordering::Acquire), 7);

        // A GPU-side wait on the host word.
        let dev_word = DevicePtr(dev.0 + 8);
        d.stream_wait_value32(s, dev_word, 1, WaitValue::Geq)
            .unwrap();
        d.stream_write_value64(s, dev, 8).unwrap();
        assert!(!d.stream_query(s).unwrap());
        assert_eq!(
            flag.load(Ordering::Acquire),
            7,
            "passed an unsatisfied wait"
        );
        word.store(1, Ordering::Release);
        d.stream_synchronize(s).unwrap();
        assert_eq!(flag.load(Ordering::Acquire), 8);
        assert!(d.stream_query(s).unwrap());
        d.stream_destroy(s).unwrap();
        d.mem_free_host(host).unwrap();
    }
}

/// A copy to the device from page-locked host memory (`cuMemHostAlloc`) reads its source when
/// it runs, not when it is enqueued: the driver stages only pageable memory. Changing the
/// source after the enqueue and before the copy runs (the stream held by a GPU-side wait on a
/// host word) changes what lands. The crate's staged uploads depend on it: their staging block
/// must not be reused before the copy ran (`DeviceBuffer::copy_from_host_staged`).
fn pinned_copy_reads_its_source_when_it_runs(d: &Arc<dyn Driver>) {
    use cuda_stream_pool::driver::{host_alloc_flags, WaitValue};
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live;
    // the host memory is freed after the stream was synchronized (nothing reads it then).
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        let host = d
            .mem_host_alloc(
                4096,
                host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE,
            )
            .unwrap();
        let gate = &*(host as *const AtomicU32);
        let src = host.add(256) as *mut u32;
        for i in 0..64 {
            src.add(i).write_volatile(1);
        }
        let dev = d.mem_host_get_device_pointer(host).unwrap();
        let buf = d.mem_alloc_async(256, s).unwrap();
        d.stream_wait_value32(s, dev, 1, WaitValue::Geq).unwrap();
        d.memcpy_htod_async(buf, src as *const u8, 256, s).unwrap();
        assert!(
            !d.stream_query(s).unwrap(),
            "the copy waits behind the gate"
        );
        for i in 0..64 {
            src.add(i).write_volatile(2);
        }
        gate.store(1, Ordering::Release);
        let v = read_u32(&**d, buf, 64, s);
        assert_eq!(
            v,
            vec![2; 64],
            "the copy read its source when it was enqueued"
        );
        d.mem_free_async(buf, s).unwrap();
        d.stream_synchronize(s).unwrap();
        d.stream_destroy(s).unwrap();
        d.mem_free_host(host).unwrap();
    }
}

/// `cuDevicePrimaryCtxGetState` reports a retained primary context as active, and asking
/// does not retain it (the crate asks before it would retain: a retain activates an inactive
/// one).
fn primary_ctx_state_reports_a_retained_context_active(d: &Arc<dyn Driver>) {
    d.init().unwrap();
    let dev = d.device_get(0).unwrap();
    let _c = d.primary_ctx_retain(dev).unwrap();
    let (_, active) = d.primary_ctx_state(dev).unwrap();
    assert!(active, "a retained primary context is active");
    // SAFETY: retained once above; nothing uses it.
    unsafe { d.primary_ctx_release(dev) }.unwrap();
    assert!(
        d.primary_ctx_state(Device(u32::MAX as u64)).is_err(),
        "no such device"
    );
}

on_both_drivers! {
    primary_ctx_state_reports_a_retained_context_active,
    query_idle_and_busy,
    event_orders_across_streams,
    event_rerecord_keeps_earlier_wait,
    priority_range,
    priority_clamped,
    stream_flags_round_trip,
    nested_begin_capture,
    end_capture_not_capturing,
    query_capturing_stream_invalidates,
    synchronize_capturing_stream_invalidates,
    relaxed_query_during_global_capture,
    capture_mode_exchange,
    async_alloc_free,
    unrecorded_event,
    stream_create_without_context,
    alloc_without_current_context,
    host_func_order,
    end_capture_wrong_thread,
    module_loading,
    capture_info,
    empty_capture,
    alloc_and_free_inside_capture,
    mem_pool_release_threshold,
    host_mapped_write_and_wait,
    pinned_copy_reads_its_source_when_it_runs,
}
