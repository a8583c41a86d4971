//! Streams lent to other crates (`StreamRef::lend`, the mechanism behind cudarc interop): a lent
//! stream is never handed to another owner or destroyed while a handle of it lives, and a
//! capture that the borrower begins on it is never joined, waited on or invalidated by the crate.
//! Scenarios run on the simulated driver, and on a GPU where they are safe there.

mod common;

use cuda_stream_pool::driver::{CaptureMode, Driver, SimDriver, Stream};
use cuda_stream_pool::{Context, DeviceBuffer, Error, OwnedStream, Priority};
use std::sync::Arc;

/// Another crate's handle of a stream (what cudarc's `CudaStream` is).
#[derive(Debug)]
struct Foreign(Stream);

fn lend(s: &cuda_stream_pool::StreamRef<'_>) -> Arc<Foreign> {
    s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap()
}

fn not_handed_over_while_lent(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let a = ctx.owner();
    let h = lend(&a.stream().unwrap());
    drop(a);
    // The stream is still the borrower's: the next owners get other streams.
    let owners: Vec<_> = (0..3).map(|_| ctx.owner()).collect();
    for o in &owners {
        assert_ne!(
            o.stream().unwrap().raw(),
            h.0,
            "a lent stream was handed over"
        );
    }
    // SAFETY: the loan keeps the stream alive.
    unsafe { d.stream_query(h.0) }.expect("the lent stream is alive");
    assert_eq!(ctx.stats().in_use, 4);
    drop(owners);
    drop(h);
    ctx.trim().unwrap();
    assert_eq!(
        ctx.stats().in_use,
        0,
        "the stream came back once the loan ended"
    );
    ctx.synchronize().unwrap();
}

#[test]
fn lent_stream_is_not_handed_over_while_a_handle_lives() {
    not_handed_over_while_lent(&common::sim());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn lent_stream_is_not_handed_over_while_a_handle_lives_gpu() {
    let _g = common::gpu_lock();
    not_handed_over_while_lent(&common::cuda());
}

#[test]
fn lent_owned_stream_is_not_destroyed_while_a_handle_lives() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = common::ctx(&d);
    let owned = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    let h = lend(&owned.stream());
    drop(owned);
    assert_eq!(ctx.pending(), 1, "the dropped stream is kept while lent");
    // SAFETY: the loan keeps the stream alive: querying it is no use of a destroyed handle.
    assert!(unsafe { d.stream_query(h.0) }.unwrap());
    drop(h);
    ctx.trim().unwrap();
    assert_eq!(ctx.pending(), 0, "destroyed once the loan ended");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

fn foreign_capture_respected(d: &Arc<dyn Driver>) {
    let ctx = common::ctx(d);
    let o = ctx.owner();
    let other = ctx.owner();
    let t = other.stream().unwrap();
    let buf = DeviceBuffer::<f32>::zeroed(&t, 256).unwrap();
    t.synchronize().unwrap();
    let s = o.stream().unwrap();
    let h = lend(&s);
    // The borrower begins a capture behind the crate's back (as cudarc's begin_capture does).
    // SAFETY: the loan keeps the stream alive; the capture is ended below.
    unsafe { d.stream_begin_capture(h.0, CaptureMode::ThreadLocal) }.unwrap();
    let refused = |r: cuda_stream_pool::Result<()>, what: &str| match r {
        Err(Error::CaptureInProgress(_)) => {}
        other => panic!("{what} on a stream captured by its borrower: {other:?}"),
    };
    refused(s.synchronize(), "synchronize");
    refused(s.query().map(|_| ()), "query");
    refused(buf.to_vec(&s).map(|_| ()), "to_vec");
    refused(s.launch_host_func(|| {}), "a host function");
    refused(s.wait_for(&t), "wait_for");
    refused(o.set_priority(Priority::High), "a priority switch");
    // The capture was neither joined nor invalidated by any of that.
    // SAFETY: as above.
    let g = unsafe { d.stream_end_capture(h.0) }.expect("the borrower's capture is intact");
    // SAFETY: the graph was just made by this capture.
    unsafe { d.graph_destroy(g) }.unwrap();
    s.synchronize().unwrap();
    assert_eq!(buf.to_vec(&s).unwrap(), vec![0.0; 256]);
}

#[test]
fn borrowers_capture_is_never_joined_or_invalidated() {
    foreign_capture_respected(&common::sim());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn borrowers_capture_is_never_joined_or_invalidated_gpu() {
    let _g = common::gpu_lock();
    foreign_capture_respected(&common::cuda());
}

#[test]
fn free_into_a_borrowers_capture_is_deferred_then_ordered() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = common::ctx(&d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let buf = DeviceBuffer::<f32>::zeroed(&s, 64).unwrap();
    let h = lend(&s);
    // SAFETY: the loan keeps the stream alive; the capture is ended below.
    unsafe { d.stream_begin_capture(h.0, CaptureMode::ThreadLocal) }.unwrap();
    drop(buf);
    assert_eq!(ctx.pending(), 1, "the free waits for the capture to end");
    // SAFETY: as above.
    let g = unsafe { d.stream_end_capture(h.0) }.expect("not invalidated by the free");
    // SAFETY: made by this capture.
    unsafe { d.graph_destroy(g) }.unwrap();
    ctx.trim().unwrap();
    assert_eq!(ctx.pending(), 0);
    drop(s);
    drop(o);
    drop(h);
    ctx.synchronize().unwrap();
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
}

#[test]
fn stream_left_capturing_by_its_borrower_is_never_reused() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = common::ctx(&d);
    let o = ctx.owner();
    let h = lend(&o.stream().unwrap());
    let raw = h.0;
    // SAFETY: the loan keeps the stream alive; the capture is abandoned on purpose.
    unsafe { d.stream_begin_capture(raw, CaptureMode::ThreadLocal) }.unwrap();
    drop(h);
    drop(o);
    ctx.trim().unwrap();
    for _ in 0..4 {
        let n = ctx.owner();
        assert_ne!(
            n.stream().unwrap().raw(),
            raw,
            "an abandoned capture was reused"
        );
    }
    // A context with a capturing stream cannot be synchronized (the H200 refuses it: 900).
    assert!(ctx.synchronize().is_err());
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn context_dropped_while_lent_leaves_the_stream_alive() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = common::ctx(&d);
    let o = ctx.owner();
    let h = lend(&o.stream().unwrap());
    drop(o);
    drop(ctx);
    // The borrower may still use its handle: the crate's teardown did not destroy the stream.
    // SAFETY: the stream was never destroyed (asserted by the simulation's misuse log).
    assert!(unsafe { d.stream_query(h.0) }.unwrap());
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

#[test]
fn one_handle_per_loan_and_one_type() {
    let d = common::sim();
    let ctx: Context = common::ctx(&d);
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let a = lend(&s);
    let b = lend(&s);
    assert!(Arc::ptr_eq(&a, &b), "every call lends the same handle");
    match s.lend(|raw| Ok(Arc::new(raw.0))) {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("lent as a second type: {other:?}"),
    }
    // A weak reference counts as a holder too.
    let w = Arc::downgrade(&a);
    drop((a, b));
    drop(s);
    drop(o);
    ctx.trim().unwrap();
    assert_eq!(
        ctx.stats().in_use,
        1,
        "a Weak of the handle keeps the loan out"
    );
    drop(w);
    ctx.trim().unwrap();
    assert_eq!(ctx.stats().in_use, 0);
}

/// Found on the H200 (the cudarc example created a stream per request): a returned loan must be
/// picked up by the next owner's release, not only by `trim`.
#[test]
fn returned_loans_come_back_at_the_next_release() {
    let d = common::sim();
    let ctx = common::ctx(&d);
    for _ in 0..10 {
        let o = ctx.owner();
        let h = lend(&o.stream().unwrap());
        drop(o); // parked: `h` still lives
        drop(h); // returned, noticed by the next release
    }
    assert!(
        ctx.stats().created <= 2,
        "streams were not reused: {:?}",
        ctx.stats()
    );
}
