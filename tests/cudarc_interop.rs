//! cudarc interop on a GPU: safe adoption, cudarc kernels on pooled streams, a cudarc slice that
//! outlives its owner, and cudarc launches on this crate's buffers (a use, ordered by
//! generation). Run them under compute-sanitizer (docs/gpu.md).
#![cfg(feature = "cudarc")]

mod common;

#[path = "../examples/cudarc_interop.rs"]
mod example;

/// The downstream crate's library code (ci/downstream, which CI builds with cudarc linked
/// dynamically), run here on the GPU.
#[path = "../ci/downstream/src/lib.rs"]
mod downstream;

use cuda_stream_pool::{Context, DeviceBuffer};
use cudarc::driver::{CudaContext, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

fn add_one(cu: &Arc<CudaContext>) -> cudarc::driver::CudaFunction {
    let src = cuda_stream_pool::kernels::PTX.trim_end_matches('\0');
    let m = cu.load_module(cudarc::nvrtc::Ptx::from_src(src)).unwrap();
    m.load_function("csp_add_one_f32").unwrap()
}

/// One `csp_add_one_f32` launch on cudarc stream `cs` over `buf`, in use on the pooled stream
/// `s` (a `CudarcUse`, which orders a launch on another stream than `s` both ways).
fn launch_add_one(
    f: &cudarc::driver::CudaFunction,
    cs: &Arc<cudarc::driver::CudaStream>,
    buf: &DeviceBuffer<f32>,
    s: &cuda_stream_pool::StreamRef<'_>,
) {
    let n = buf.len();
    let u = buf.cudarc_use(s).unwrap();
    let (p, record) = u.device_ptr(cs);
    // SAFETY: csp_add_one_f32(float*, unsigned) on the buffer's n floats, in use while `u`
    // lives; `record` (an ordering back to `s`) is dropped after the launch.
    unsafe { cs.launch_builder(f).arg(&p).arg(&(n as u32)).launch(cfg(n)) }.unwrap();
    drop(record);
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn candle_style_service_on_pooled_streams() {
    let _serial = common::gpu_lock();
    example::run().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn adoption_is_safe_and_keeps_cudarc_alive() {
    let _serial = common::gpu_lock();
    let cu = CudaContext::new(0).unwrap();
    let before = Arc::strong_count(&cu);
    let ctx = Context::from_cudarc(&cu).unwrap();
    assert!(
        Arc::strong_count(&cu) > before,
        "the state holds cudarc's context"
    );
    assert!(Arc::ptr_eq(&ctx.cudarc_context().unwrap(), &cu));
    drop(cu); // the user's handle goes; the state's keeps the context alive
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<f32>::zeroed(&s, 1024).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), vec![0.0; 1024]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn late_dropped_cudarc_slice_keeps_its_stream_out_of_the_pool() {
    let _serial = common::gpu_lock();
    let cu = CudaContext::new(0).unwrap();
    let f = add_one(&cu);
    let ctx = Context::from_cudarc(&cu).unwrap();
    let n = 1 << 20;
    let a = ctx.owner();
    let cs = a.stream().unwrap().cudarc_stream().unwrap();
    let raw = cs.cu_stream();
    let mut x = cs.alloc_zeros::<f32>(n).unwrap();
    for _ in 0..8 {
        // SAFETY: csp_add_one_f32(float *x, unsigned n) with n floats.
        unsafe {
            cs.launch_builder(&f)
                .arg(&mut x)
                .arg(&(n as u32))
                .launch(cfg(n))
        }
        .unwrap();
    }
    drop(cs);
    drop(a); // the owner is gone; x (and its Arc<CudaStream>) is not
    for _ in 0..64 {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        assert_ne!(
            cuda_stream_pool::driver::Stream::from(raw),
            s.raw(),
            "the stream of a live cudarc slice was handed to another owner"
        );
        DeviceBuffer::<f32>::zeroed(&s, 16).unwrap();
    }
    assert_eq!(ctx.stats().in_use, 1, "the lent stream is still out");
    let v = x.stream().clone_dtoh(&x).unwrap();
    assert!(v.iter().all(|&e| e == 8.0));
    drop(x); // cudarc frees on the lent stream, which no other owner has
    ctx.trim().unwrap();
    assert_eq!(ctx.stats().in_use, 0, "the stream came back");
    ctx.synchronize().unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cudarc_launch_on_another_owners_stream_is_a_use() {
    let _serial = common::gpu_lock();
    let cu = CudaContext::new(0).unwrap();
    let f = add_one(&cu);
    let ctx = Context::from_cudarc(&cu).unwrap();
    let n = 1 << 20;
    let (a, b) = (ctx.owner(), ctx.owner());
    let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    let buf = DeviceBuffer::<f32>::zeroed(&sa, n).unwrap();
    for round in 1..=4 {
        // Alternate the launching owner: every launch is ordered after the previous use.
        let s = if round % 2 == 0 { &sa } else { &sb };
        launch_add_one(&f, &s.cudarc_stream().unwrap(), &buf, s);
    }
    // A launch on a stream other than the use's: ordered both ways.
    launch_add_one(&f, &cu.new_stream().unwrap(), &buf, &sb);
    // Read back on the first owner's stream: ordered after all five launches.
    let v = buf.to_vec(&sa).unwrap();
    assert!(v.iter().all(|&e| e == 5.0), "{}", v[0]);
}

/// With cudarc's event tracking disabled (issue 21: cudarc then orders none of its slices
/// across streams), the crate's buffers are still ordered: launches that alternate between two
/// owners' lent streams, and one on a stream of cudarc's own, each see the previous one's
/// result.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn with_cudarc_event_tracking_off_the_crates_buffers_stay_ordered() {
    let _serial = common::gpu_lock();
    let cu = CudaContext::new(0).unwrap();
    // SAFETY: no cudarc slice of this test crosses streams; the crate orders its own buffers.
    unsafe { cu.disable_event_tracking() };
    let f = add_one(&cu);
    let ctx = Context::from_cudarc(&cu).unwrap();
    let n = 1 << 20;
    let (a, b) = (ctx.owner(), ctx.owner());
    let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    let buf = DeviceBuffer::<f32>::zeroed(&sa, n).unwrap();
    let other = cu.new_stream().unwrap();
    for round in 1..=6 {
        let s = if round % 2 == 0 { &sa } else { &sb };
        let cs = if round == 6 {
            other.clone()
        } else {
            s.cudarc_stream().unwrap()
        };
        launch_add_one(&f, &cs, &buf, s);
    }
    let v = buf.to_vec(&sb).unwrap();
    assert!(v.iter().all(|&e| e == 6.0), "{}", v[0]);
    // SAFETY: as above.
    unsafe { cu.enable_event_tracking() };
}

// Regression: issue 19 defect 3 (dropping the Context turned off cudarc's cross-stream ordering while lent streams are in use)
/// cudarc orders a slice's free after its uses on other streams only in its multi-stream mode,
/// which the state's keeper stream turns on. With the `Context` dropped while two streams are
/// lent, the mode must stay on: a slice written on one lent stream and freed on the other must
/// not be freed under the write (the memory, reallocated at once, would be overwritten).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dropping_the_context_keeps_cudarc_ordering_while_streams_are_lent() {
    let _serial = common::gpu_lock();
    let cu = CudaContext::new(0).unwrap();
    let f = add_one(&cu);
    let ctx = Context::from_cudarc(&cu).unwrap();
    assert!(cu.is_in_multi_stream_mode());
    let (a, b) = (ctx.owner(), ctx.owner());
    let cs_a = a.stream().unwrap().cudarc_stream().unwrap();
    let cs_b = b.stream().unwrap().cudarc_stream().unwrap();
    drop((a, b));
    drop(ctx); // the loans are out: what they rely on stays
    assert!(
        cu.is_in_multi_stream_mode(),
        "cudarc left its multi-stream mode while streams of the dropped context are lent"
    );
    let n = 1 << 16;
    let mut x = cs_a.alloc_zeros::<f32>(n).unwrap();
    for _ in 0..2_000 {
        // SAFETY: csp_add_one_f32 on x's n floats.
        unsafe {
            cs_b.launch_builder(&f)
                .arg(&mut x)
                .arg(&(n as u32))
                .launch(cfg(n))
        }
        .unwrap();
    }
    drop(x); // freed on cs_a: ordered after cs_b's launches only in multi-stream mode
    let y = cs_a.alloc_zeros::<f32>(n).unwrap();
    cs_b.synchronize().unwrap();
    let v = cs_a.clone_dtoh(&y).unwrap();
    let hit = v.iter().filter(|&&e| e != 0.0).count();
    assert_eq!(
        hit, 0,
        "{hit} of {n} words of a reallocated slice were overwritten"
    );
}

/// `Context::cudarc` (issue 21: the probe that makes "no GPU" an error, not a panic in cudarc's
/// loader) opens cudarc's primary context and adopts it, and leaves the calling thread's current
/// context as it found it (cudarc's `CudaContext::new` makes its context current).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cudarc_constructor_adopts_and_restores_the_callers_context() {
    use cuda_stream_pool::driver;
    let _serial = common::gpu_lock();
    let (drv, _) = driver::load(driver::Choice::Cuda).unwrap();
    drv.init().unwrap();
    // SAFETY: null: no context current on this thread.
    unsafe { drv.ctx_set_current(driver::Context::NULL) }.unwrap();
    let (cu, ctx) = Context::cudarc(0).unwrap();
    assert_eq!(drv.ctx_get_current().unwrap(), driver::Context::NULL);
    assert_eq!(ctx.raw(), driver::Context::from(cu.cu_ctx()));
    let o = ctx.owner();
    let s = o.stream().unwrap();
    let b = DeviceBuffer::<u32>::zeroed(&s, 64).unwrap();
    assert!(b.to_vec(&s).unwrap().iter().all(|&v| v == 0));
    assert!(Context::cudarc(usize::MAX).is_err());
}

/// Without a usable driver `Context::cudarc` is an error, never a panic (the example used to
/// panic in cudarc's loader on such a machine); with one, it agrees with the crate's loader.
#[test]
fn cudarc_constructor_without_a_driver_is_an_error() {
    let _serial = common::gpu_lock();
    let probe = cuda_stream_pool::driver::load(cuda_stream_pool::driver::Choice::Cuda);
    let r = std::panic::catch_unwind(|| Context::cudarc(0).map(|_| ()));
    let r = r.expect("Context::cudarc panicked");
    if probe.is_err() {
        assert!(r.is_err());
    }
}

/// Issue 21's downstream crate on the GPU: two libraries that adopt the same cudarc context
/// share one state (a buffer of one read on the other's stream), half-precision buffers, and a
/// cudarc kernel launched on the crate's buffer with `?` on cudarc's errors.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn the_downstream_crates_library_code_runs() {
    let _serial = common::gpu_lock();
    let cu = CudaContext::new(0).unwrap();
    assert!(
        downstream::shared(&cu).unwrap(),
        "the libraries' states differ"
    );
    let ctx = downstream::lib_a::open(&cu).unwrap();
    let (z, b) = downstream::half_roundtrip(&ctx).unwrap();
    assert_eq!(z, vec![half::f16::ZERO; 7]);
    assert_eq!(b, vec![half::bf16::from_f32(2.0); 3]);
    let f = add_one(&cu);
    assert_eq!(
        downstream::add_one(&ctx, &f, 1000).unwrap(),
        vec![1.0; 1000]
    );
}
