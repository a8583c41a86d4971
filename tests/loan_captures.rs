//! A borrower's capture of a lent stream: the crate's buffer work on a stream that another crate
//! is capturing (through its own handle, behind the crate's back) would go into a graph that
//! does not keep the crate's buffers alive, so it is refused with `Error::CaptureInProgress`;
//! the borrower's capture is left intact and ends cleanly, and nothing leaks.

mod common;

use cuda_stream_pool::driver::{CaptureMode, Driver, SimDriver, Stream};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Error};
use std::sync::Arc;

/// Another crate's handle of a stream (what cudarc's `CudaStream` is).
#[derive(Debug)]
struct Foreign(Stream);

fn refused<T: std::fmt::Debug>(what: &str, r: cuda_stream_pool::Result<T>) {
    assert!(
        matches!(r, Err(Error::CaptureInProgress(_))),
        "{what} on a stream its borrower captures: {r:?}"
    );
}

// Regression: issue 19 defect 2 (crate work inside a borrower's capture kept nothing alive: the
// graph, launched after the buffers were dropped, wrote freed memory; and the context leaked)
#[test]
fn crate_work_on_a_stream_its_borrower_captures_is_refused() {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    let ctx = Context::primary(d.clone(), 0).unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let mut x = DeviceBuffer::<f32>::zeroed(&s, 256).unwrap();
    let mut y = DeviceBuffer::<u32>::zeroed(&s, 256).unwrap();
    let h = s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap();
    // The borrower captures the stream through its own handle.
    // SAFETY: the loan keeps the stream alive.
    unsafe { d.stream_begin_capture(h.0, CaptureMode::Global) }.unwrap();
    refused("a memset", x.fill(&s, 1.0));
    refused("a kernel", k.add_one(&s, &x));
    refused("a u32 kernel", k.add_u32(&s, &y, 3));
    refused("a use", y.use_on(&s).map(|_| ()));
    refused("a copy from the host", y.copy_from_host(&s, &[7; 256]));
    refused("a copy to the host", x.to_vec(&s));
    // The borrower's capture is intact, ends cleanly, and holds none of the crate's work.
    // SAFETY: as above.
    let g = unsafe { d.stream_end_capture(h.0) }.expect("the borrower's capture ends cleanly");
    // SAFETY: `g` was just made by the end of the capture.
    assert_eq!(unsafe { d.graph_node_count(g) }.unwrap(), 0);
    // Launched after the buffers are gone, the graph touches nothing of theirs.
    drop((x, y));
    // The borrower's own raw calls run with the context current (the crate leaves the thread's
    // current context as it found it).
    ctx.bind().unwrap();
    // SAFETY: `g` is live; the exec is made, launched and destroyed here on the live lent stream.
    unsafe {
        let e = d.graph_instantiate(g).unwrap();
        d.graph_launch(e, h.0).unwrap();
        d.stream_synchronize(h.0).unwrap();
        d.graph_exec_destroy(e).unwrap();
        d.graph_destroy(g).unwrap();
    }
    // The stream is usable by the crate again once the borrower's capture is over.
    let z = DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    k.add_one(&s, &z).unwrap();
    assert_eq!(z.to_vec(&s).unwrap(), vec![1.0; 16]);
    drop(z);
    drop(h);
    drop(s);
    drop(o);
    drop(k);
    drop(ctx);
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    let c = sim.counters();
    assert_eq!(
        (
            c.live_allocs,
            c.live_streams,
            c.live_contexts,
            c.live_modules
        ),
        (0, 0, 0, 0),
        "left after every handle is gone: {c:?}"
    );
}

// Regression: issue 19 defect 2 (the crate's own capture of a lent stream still works: the
// buffers are registered with the crate's graph)
#[test]
fn crate_capture_of_a_lent_stream_still_keeps_its_buffers() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let k = Kernels::load(&ctx).unwrap();
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let x = DeviceBuffer::<f32>::zeroed(&s, 64).unwrap();
    let h = s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap();
    let g = s.begin_capture().unwrap();
    k.add_one(&s, &x).unwrap();
    let exec = g.end().unwrap().instantiate().unwrap();
    drop(x); // the graph keeps it
    exec.launch(&s).unwrap();
    s.synchronize().unwrap();
    drop((exec, h, s));
    drop((o, k, ctx));
    assert!(sim.findings().is_empty(), "{:?}", sim.findings());
    let c = sim.counters();
    assert_eq!((c.live_allocs, c.live_contexts), (0, 0), "{c:?}");
}

/// The same through cudarc's safe capture API on a GPU.
#[cfg(feature = "cudarc")]
mod cudarc_capture {
    use super::{common, refused};
    use cuda_stream_pool::{Context, DeviceBuffer};
    use cudarc::driver::sys::CUstreamCaptureMode;
    use cudarc::driver::CudaContext;

    // Regression: issue 19 defect 2 (crate work inside cudarc's capture of a lent stream)
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn crate_work_inside_cudarcs_capture_is_refused() {
        let _serial = common::gpu_lock();
        let cu = CudaContext::new(0).unwrap();
        let ctx = Context::from_cudarc(&cu).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let mut x = DeviceBuffer::<u32>::zeroed(&s, 1 << 16).unwrap();
        let cs = s.cudarc_stream().unwrap();
        cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        refused("a memset", x.fill(&s, 7));
        refused("a cudarc use", x.cudarc_use(&s).map(|_| ()));
        let g = cs
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .expect("cudarc's capture ends cleanly");
        drop(x);
        if let Some(g) = g {
            g.launch().unwrap();
        }
        cs.synchronize().unwrap();
    }

    // Regression: issue 19 defect 2 (a CudarcUse made before cudarc's capture began: the work
    // would go into a graph that does not keep the buffer)
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn cudarc_use_made_before_cudarcs_capture_refuses_to_join_it() {
        let _serial = common::gpu_lock();
        let cu = CudaContext::new(0).unwrap();
        let ctx = Context::from_cudarc(&cu).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let x = DeviceBuffer::<u32>::zeroed(&s, 1 << 16).unwrap();
        let cs = s.cudarc_stream().unwrap();
        let mut u = x.cudarc_use(&s).unwrap();
        cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = cs.memset_zeros(&mut u);
        }));
        let g = cs.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        assert!(
            r.is_err(),
            "the memset joined a capture begun after the use"
        );
        assert!(g.is_ok(), "cudarc's capture ends cleanly");
        drop(u);
    }

    /// `CudarcUse::device_ptr_on` returns the refusal that `device_ptr` panics with (issue 21:
    /// cudarc's trait cannot return an error; the fallible call can), and enqueues nothing: the
    /// borrower's capture ends cleanly and holds no node.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn device_ptr_on_returns_the_refusal_as_an_error() {
        let _serial = common::gpu_lock();
        let cu = CudaContext::new(0).unwrap();
        let ctx = Context::from_cudarc(&cu).unwrap();
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let x = DeviceBuffer::<u32>::zeroed(&s, 1 << 16).unwrap();
        let cs = s.cudarc_stream().unwrap();
        let u = x.cudarc_use(&s).unwrap();
        cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let r = u.device_ptr_on(&cs).map(|(p, _)| p);
        let g = cs.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        assert!(
            matches!(r, Err(cuda_stream_pool::Error::CaptureInProgress(_))),
            "{r:?}"
        );
        assert!(g.is_ok(), "cudarc's capture ends cleanly");
        drop(u);
    }
}
