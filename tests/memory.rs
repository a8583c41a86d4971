//! Generation-tracked device memory: scenarios on both drivers, call-log assertions on the
//! simulation.

#[path = "common/calls.rs"]
mod calls;
mod common;

use calls::setup;

use common::Gate;
use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver};
use cuda_stream_pool::{Context, DeviceBuffer, Error, ErrorCode};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The seed's test: memory last used on a recycled stream is usable, and freed, without waiting
/// for the stream's new owner, whose stream is held busy by a host function.
fn recycled_memory_does_not_wait_for_new_owner(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let ctx = common::ctx(d);
        let a = ctx.owner();
        let sa = a.stream().unwrap();
        let raw = sa.raw();
        let mut used = DeviceBuffer::<u32>::zeroed(&sa, 256).unwrap();
        used.fill(&sa, 5).unwrap();
        let dropped = DeviceBuffer::<u32>::zeroed(&sa, 256).unwrap();
        sa.synchronize().unwrap();
        drop(a);
        let b = ctx.owner();
        let sb = b.stream().unwrap();
        assert_eq!(sb.raw(), raw, "the idle stream is recycled");
        let mut gate = Gate::on(&**d, sb.raw());
        let start = Instant::now();
        // Use on a third owner's stream: nothing waits on b's (busy) stream.
        let c = ctx.owner();
        let sc = c.stream().unwrap();
        assert_eq!(used.to_vec(&sc).unwrap(), vec![5; 256]);
        // Free: on the disposal stream, which does not wait for b either.
        drop(dropped);
        d.stream_synchronize(ctx.disposal_stream()).unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "waited for the new owner's work"
        );
        assert!(!sb.query().unwrap(), "b's stream is still held busy");
        gate.open();
        sb.synchronize().unwrap();
    }
}

/// Memory used by two live owners in turn: the second stream is ordered after the first use on
/// the GPU (no CPU wait), so it sees the first owner's writes.
fn same_generation_use_is_ordered(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let (a, b) = (ctx.owner(), ctx.owner());
    let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    let mut buf = DeviceBuffer::<u32>::zeroed(&sa, 1024).unwrap();
    let mut gate = Gate::on(&**d, sa.raw());
    buf.fill(&sa, 1).unwrap();
    drop(buf.use_on(&sb).unwrap());
    assert!(!sb.query().unwrap(), "b must wait for a's pending write");
    buf.fill(&sb, 2).unwrap();
    gate.open();
    assert_eq!(buf.to_vec(&sb).unwrap(), vec![2; 1024]);
    let (raw, _, current) = buf.last_use().unwrap();
    assert_eq!((raw, current), (sb.raw(), true));
}

/// Out of memory, mismatched lengths and empty allocations are errors, not panics.
fn memory_errors(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let e = DeviceBuffer::<u8>::alloc(&s, 1 << 50).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ERROR_OUT_OF_MEMORY), "{e}");
    assert!(matches!(
        DeviceBuffer::<u8>::alloc(&s, 0),
        Err(Error::InvalidArgument(_))
    ));
    let mut b = DeviceBuffer::<f32>::zeroed(&s, 8).unwrap();
    assert!(matches!(
        b.copy_from_host(&s, &[1.0; 7]),
        Err(Error::InvalidArgument(_))
    ));
    let mut out = [0.0f32; 9];
    assert!(matches!(
        b.copy_to_host(&s, &mut out),
        Err(Error::InvalidArgument(_))
    ));
    let mut wide = DeviceBuffer::<u64>::zeroed(&s, 2).unwrap();
    assert!(matches!(wide.fill(&s, 1), Err(Error::InvalidArgument(_))));
    b.copy_from_host(&s, &[1.5; 8]).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), vec![1.5; 8]);
    // The asynchronous forms, with the host memory kept alive until the stream is synchronized.
    let src = [2.5f32; 8];
    let mut dst = [0.0f32; 8];
    // SAFETY: `src` and `dst` outlive the synchronize below and are not touched before it.
    unsafe {
        b.copy_from_host_async(&s, &src).unwrap();
        b.copy_to_host_async(&s, &mut dst).unwrap();
    }
    s.synchronize().unwrap();
    assert_eq!(dst, [2.5; 8]);
}

on_both_drivers! {
    recycled_memory_does_not_wait_for_new_owner,
    same_generation_use_is_ordered,
    memory_errors,
}

fn sim_ctx() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    (sim, Context::primary(d, 0).unwrap())
}

/// Call log: recycled memory is used without any wait on the new owner's stream and freed on
/// the disposal stream.
#[test]
fn recycled_memory_call_log() {
    let (sim, ctx) = sim_ctx();
    let a = ctx.owner();
    let sa = a.stream().unwrap();
    let buf = DeviceBuffer::<u32>::zeroed(&sa, 16).unwrap();
    sa.synchronize().unwrap();
    let raw_a = sa.raw();
    drop(sa);
    drop(a);
    let b = ctx.owner();
    let sb = b.stream().unwrap();
    assert_eq!(sb.raw(), raw_a);
    let c = ctx.owner();
    let sc = c.stream().unwrap();
    sim.clear_calls();
    drop(buf.use_on(&sc).unwrap());
    let p = buf.as_raw();
    drop(buf);
    let calls = sim.calls();
    assert!(
        calls
            .iter()
            .all(|c| c.name != "cuStreamWaitEvent" && c.name != "cuEventRecord"),
        "{calls:?}"
    );
    let frees: Vec<_> = calls
        .iter()
        .filter(|c| c.name == "cuMemFreeAsync")
        .collect();
    assert_eq!(frees.len(), 1);
    assert_eq!(frees[0].ptr, Some(p));
    assert_eq!(
        frees[0].stream,
        Some(sc.raw()),
        "last used on sc, whose generation is current"
    );
    // Memory whose last stream was recycled goes to the disposal stream.
    let d2 = ctx.owner();
    let s2 = d2.stream().unwrap();
    let buf2 = DeviceBuffer::<u32>::zeroed(&s2, 16).unwrap();
    s2.synchronize().unwrap();
    let raw_2 = s2.raw();
    drop(s2);
    drop(d2);
    let e = ctx.owner();
    assert_eq!(e.stream().unwrap().raw(), raw_2);
    sim.clear_calls();
    drop(buf2);
    // (The free runs in relaxed capture mode: the thread's mode exchanges are not stream work.)
    let calls: Vec<_> = sim
        .calls()
        .into_iter()
        .filter(|c| c.name != "cuThreadExchangeStreamCaptureMode")
        .collect();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].name, "cuMemFreeAsync");
    assert_eq!(calls[0].stream, Some(ctx.disposal_stream()));
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Call log: same-generation cross-stream use inserts exactly one event record + wait, and a
/// repeated use on the same stream none.
#[test]
fn same_generation_inserts_exactly_one_wait() {
    let (sim, ctx) = sim_ctx();
    let (a, b) = (ctx.owner(), ctx.owner());
    let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    let buf = DeviceBuffer::<u32>::zeroed(&sa, 16).unwrap();
    sim.clear_calls();
    drop(buf.use_on(&sb).unwrap());
    drop(buf.use_on(&sb).unwrap());
    let calls = sim.calls();
    let rec: Vec<_> = calls.iter().filter(|c| c.name == "cuEventRecord").collect();
    let wait: Vec<_> = calls
        .iter()
        .filter(|c| c.name == "cuStreamWaitEvent")
        .collect();
    assert_eq!((rec.len(), wait.len()), (1, 1), "{calls:?}");
    assert_eq!(rec[0].stream, Some(sa.raw()));
    assert_eq!(wait[0].stream, Some(sb.raw()));
    assert_eq!(rec[0].event, wait[0].event);
}

/// Using a buffer with a stream of another context is an error.
#[test]
fn buffer_of_another_context() {
    let sim = Arc::new(SimDriver::with_config(SimConfig {
        devices: 2,
        ..SimConfig::default()
    }));
    let d: Arc<dyn Driver> = sim.clone();
    let c0 = Context::primary(d.clone(), 0).unwrap();
    let c1 = Context::primary(d, 1).unwrap();
    let (o0, o1) = (c0.owner(), c1.owner());
    let b = DeviceBuffer::<u32>::zeroed(&o0.stream().unwrap(), 4).unwrap();
    assert!(matches!(
        b.use_on(&o1.stream().unwrap()),
        Err(Error::InvalidArgument(_))
    ));
}

/// Many buffers crossing owners and priorities on 16 threads: nothing is used after free,
/// freed twice or leaked (the simulation's misuse detector is the oracle).
#[test]
fn buffers_cross_owners_without_misuse() {
    let (sim, ctx) = sim_ctx();
    let threads: Vec<_> = (0..16)
        .map(|t| {
            let ctx = ctx.clone();
            let sim = sim.clone();
            std::thread::spawn(move || {
                let mut carried: Option<DeviceBuffer<u32>> = None;
                for i in 0..300u32 {
                    let o = ctx.owner();
                    if i % 3 == 0 {
                        o.set_priority(cuda_stream_pool::Priority::High).unwrap();
                    }
                    let s = o.stream().unwrap();
                    sim.enqueue_work(s.raw(), 1_000 + (t * 37 + i as u64) % 5_000)
                        .unwrap();
                    let mut b = DeviceBuffer::<u32>::zeroed(&s, 32).unwrap();
                    b.fill(&s, i).unwrap();
                    if let Some(mut c) = carried.take() {
                        c.fill(&s, i).unwrap();
                        if i % 7 == 0 {
                            assert_eq!(c.to_vec(&s).unwrap()[0], i);
                        }
                    }
                    carried = Some(b);
                    if i % 5 == 0 {
                        sim.advance(2_000);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    drop(ctx);
    let c = sim.counters();
    assert_eq!((c.live_allocs, c.live_streams), (0, 0), "{c:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// Regression (review 2, finding 1: the GPU wrote host memory the caller got back, the heap
/// corruption of the model test). `copy_to_host` enqueues the DtoH copy and then calls `stream.synchronize()`
/// with `?`: when the synchronize fails (any driver error: the model's `fail_nth_call` hits
/// `cuStreamSynchronize` or the capture-mode switch before it; or, on a lent stream,
/// `CaptureInProgress` because the borrower began a capture meanwhile) it returns the error
/// while the copy is still pending. The caller's `dst` is free again (for `to_vec` the `Vec` is
/// dropped: the copy then lands in freed heap memory, which is the
/// "free(): unaligned chunk detected in tcache 2" / SIGSEGV that tests/proptest_model.rs hit:
/// `Op::ReadBack` calls `to_vec` while `Op::Fault` injects failures at random calls). Here the
/// destination stays alive, so the late write is observed instead of corrupting the heap.
#[test]
fn a_failed_copy_to_host_leaves_no_copy_pending_into_its_destination() {
    let (sim, ctx) = sim_ctx();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::from_slice(&s, &[7u64; 16]).unwrap();
    sim.enqueue_work(s.raw(), 1_000).unwrap(); // earlier work: the copy waits behind it
    sim.fail_calls("cuStreamSynchronize", ErrorCode::ERROR_UNKNOWN, 1);
    let mut dst = vec![0u64; 16];
    assert!(b.copy_to_host(&s, &mut dst).is_err());
    // `dst` is the caller's again. Nothing may write it any more.
    sim.advance(1_000);
    // SAFETY: `dst` is alive; read volatile because the simulation wrote it behind the borrow.
    let seen = unsafe { std::ptr::read_volatile(dst.as_ptr()) };
    assert_eq!(
        seen, 0,
        "the DtoH copy of a failed copy_to_host landed after the call returned (with to_vec: \
         into a dropped Vec, i.e. freed heap memory)"
    );
    drop(dst);
    drop(b);
    drop(s);
    drop(o);
}

/// Half-precision buffers (issue 21: inference crates are mostly `f16`/`bf16`, which the crate
/// could not hold and users cannot add, by the orphan rule): uploaded, zeroed and read back with
/// their bits intact, on the simulation, with no misuse.
#[test]
fn half_precision_buffers_round_trip() {
    use half::{bf16, f16};
    let (sim, ctx) = sim_ctx();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let h: Vec<f16> = (0..1000)
        .map(|i| f16::from_f32(i as f32 * 0.25 - 7.0))
        .collect();
    let b = DeviceBuffer::from_slice(&s, &h).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), h);
    let z = DeviceBuffer::<bf16>::zeroed(&s, 333).unwrap();
    assert!(z.to_vec(&s).unwrap().iter().all(|v| v.to_bits() == 0));
    let g: Vec<bf16> = h.iter().map(|v| bf16::from_f32(v.to_f32())).collect();
    let b2 = DeviceBuffer::from_slice(&s, &g).unwrap();
    assert_eq!(b2.to_vec(&s).unwrap(), g);
    drop((b, z, b2));
    drop(s);
    drop(o);
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

// Pins soundness review (issue 12) defect 14: deferred frees missed their capture's end; failed frees waited for `trim()`
#[test]
fn deferred_frees_run_at_capture_end_and_at_later_operations_without_trim() {
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

// Pins soundness review (issue 12) defect 17 (found after the review): a failed wait freed memory a copy still targets
/// Found while hunting a heap corruption of the model test: a host copy whose synchronize failed
/// returned the error while the copy was still pending, and the host memory (to_vec's vector,
/// or the caller's slice) was freed or reused while the copy could still write it (read it).
/// The copy must target memory that outlives it: staging memory that is leaked when the wait
/// fails.
#[test]
fn a_failed_wait_never_frees_memory_a_copy_still_targets() {
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

// Issue 21: `zeroed` of a size that is not a whole number of 4-byte words (u8, u16, f16 of odd
// length) used to stage a host buffer, copy it and synchronize. The allocation is now padded to
// whole words and zeroed with one memset: no copy, no wait, on the buffer's stream.
#[test]
fn zeroed_of_any_size_is_one_memset_without_a_copy_or_a_wait() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d, 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    // Dirty memory first, so that zeros are written, not found.
    drop(DeviceBuffer::from_slice(&s, &[0xffu8; 7]).unwrap());
    for len in [1usize, 2, 3, 5, 7] {
        sim.clear_calls();
        let b = DeviceBuffer::<u8>::zeroed(&s, len).unwrap();
        let names: Vec<_> = sim.calls().iter().map(|c| c.name).collect();
        assert!(
            !names
                .iter()
                .any(|n| n.contains("Memcpy") || n.contains("Synchronize")),
            "len {len}: {names:?}"
        );
        assert_eq!(
            names
                .iter()
                .filter(|n| n.starts_with("cuMemsetD32"))
                .count(),
            1
        );
        assert_eq!(b.to_vec(&s).unwrap(), vec![0u8; len]);
        let h = DeviceBuffer::<u16>::zeroed(&s, len).unwrap();
        assert_eq!(h.to_vec(&s).unwrap(), vec![0u16; len]);
    }
}

// Issue 21: a safe upload that does not wait. `copy_from_host_staged` copies the host data into
// pinned staging memory and returns before the device copy runs: the caller's vector may be
// overwritten at once, and a staging block is not reused while a copy from it is pending (two
// uploads of one size behind a busy stream each land their own data).
#[test]
fn a_staged_upload_neither_waits_nor_reuses_its_staging_before_the_copy_ran() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d, 0).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let mut a = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    let mut b = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    sim.advance(0);
    sim.enqueue_work(s.raw(), 1_000).unwrap(); // the copies wait behind this
    sim.clear_calls();
    let mut src = vec![1u32; 64];
    a.copy_from_host_staged(&s, &src).unwrap();
    src.fill(2); // the caller's memory is free again
    b.copy_from_host_staged(&s, &src).unwrap();
    drop(src);
    let names: Vec<_> = sim.calls().iter().map(|c| c.name).collect();
    assert!(
        !names.iter().any(|n| n.contains("Synchronize")),
        "{names:?}"
    );
    let other = ctx.owner();
    let t = other.stream().unwrap();
    sim.advance(1_000);
    assert_eq!(a.to_vec(&t).unwrap(), vec![1; 64]);
    assert_eq!(b.to_vec(&t).unwrap(), vec![2; 64]);
    // Wrong lengths and captures are refused before anything is enqueued.
    assert!(a.copy_from_host_staged(&s, &[0; 3]).is_err());
    let g = s.begin_capture().unwrap();
    assert!(matches!(
        a.copy_from_host_staged(&s, &[0; 64]),
        Err(Error::CaptureInProgress(_))
    ));
    drop(g);
}
