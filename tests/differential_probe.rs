//! Differential scenarios about forbidden or dangling operations, kept apart from the main suite
//! because on the real driver they touch undefined corners (a dangling handle could crash the
//! process, which would take the other scenarios with it).

mod common;

use common::Env;
use cuda_stream_pool::driver::{CaptureMode, CaptureStatus, Driver};
use std::sync::Arc;

fn code<T: std::fmt::Debug>(r: cuda_stream_pool::Result<T>) -> u32 {
    r.expect_err("expected a driver error")
        .code()
        .expect("driver code")
        .0
}

/// A query of an unrelated stream from a thread in global mode, while another thread captures
/// in global mode, is a "potentially unsafe" call: it fails with
/// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates that capture. This is why the pool
/// queries in relaxed mode.
fn global_query_during_global_capture(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let (a, b) = (e.stream(), e.stream());
        let capture = common::ForeignCapture::new(d, e.ctx, a);
        let q = d.stream_query(b);
        let status = d.stream_is_capturing(a).unwrap();
        let ended = capture.end().map(|g| d.graph_destroy(g));
        eprintln!("global query during global capture: {q:?}, status {status:?}, end {ended:?}");
        assert_eq!(code(q), 900);
        assert_eq!(status, CaptureStatus::Invalidated);
        assert_eq!(code(ended), 901);
        d.stream_destroy(a).unwrap();
        d.stream_destroy(b).unwrap();
    }
}

/// Synchronizing the context while this thread captures is forbidden and invalidates the
/// capture.
fn ctx_synchronize_during_capture(d: &Arc<dyn Driver>) {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let e = Env::new(d);
        let s = e.stream();
        d.stream_begin_capture(s, CaptureMode::ThreadLocal).unwrap();
        let r = d.ctx_synchronize();
        eprintln!("cuCtxSynchronize during capture: {r:?}");
        assert_eq!(code(r), 900);
        assert_eq!(code(d.stream_end_capture(s)), 901);
        d.stream_destroy(s).unwrap();
    }
}

/// Operations on a destroyed event: the simulation reports them as errors and misuse. The real
/// driver (580, H200) crashes the process with a segmentation fault, so the crate must never
/// touch a destroyed handle (pooled streams are tracked by object and generation for this reason),
/// and this scenario runs on the simulation only.
#[test]
fn destroyed_event() {
    // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
    unsafe {
        let d = common::sim();
        let _e = Env::new(&d);
        let ev = d.event_create(0).unwrap();
        d.event_destroy(ev).unwrap();
        let r = d.event_query(ev);
        eprintln!("cuEventQuery on a destroyed event: {r:?}");
        assert!(r.is_err());
    }
}

on_both_drivers! {
    global_query_during_global_capture,
    ctx_synchronize_during_capture,
}
