//! cudarc and cuda-stream-pool together: the pool adopts cudarc's context, cudarc launches its
//! kernels on pooled streams, and buffers of both crates are ordered across streams.
//!
//!   cargo run --release --features cudarc --example cudarc_interop     # needs a GPU
//!
//! Ownership rules shown here:
//! * the context belongs to cudarc (`CudaContext`); `Context::adopt` never releases it, and keeps
//!   the `Arc<CudaContext>` it is given alive until everything of this crate made from it is gone;
//! * a pooled stream belongs to its owner: the cudarc wrapper from `wrap_borrowed_stream` (which
//!   never destroys the stream) and every cudarc slice used on it must be dropped before the owner;
//! * cudarc orders its own slices across its streams with events; between the crates, order with
//!   `StreamRef::wait_for` (or `DeviceBuffer::use_on` for this crate's buffers: launch on the
//!   `BufferUse::ptr` while the guard it returns lives).

use cuda_stream_pool::driver::{self, Choice};
use cuda_stream_pool::{Context, DeviceBuffer};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};

pub fn run() -> Result<(), Box<dyn std::error::Error>> {
    // This crate's loader first: without a GPU it returns an error, where cudarc's dynamic
    // loading would panic.
    let (drv, _) = driver::load(Choice::Cuda)?;
    let cu = CudaContext::new(0)?;
    let raw = driver::Context(cu.cu_ctx() as usize as u64);
    // SAFETY: `raw` is cudarc's live context, and the `Arc<CudaContext>` passed as `keep_alive`
    // keeps it alive until this state and everything made from it are gone.
    let ctx = unsafe { Context::adopt(drv, raw, Some(Box::new(cu.clone()))) }?;
    let src = cuda_stream_pool::kernels::PTX.trim_end_matches('\0');
    let module = cu.load_module(cudarc::nvrtc::Ptx::from_src(src))?;
    let (add_one, sum) = (
        module.load_function("csp_add_one_f32")?,
        module.load_function("csp_sum_f32")?,
    );
    let n = 1 << 16;
    let cfg = LaunchConfig {
        grid_dim: ((n as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut checked = 0;
    for _ in 0..100 {
        let (a, b) = (ctx.owner(), ctx.owner());
        let (sa, sb) = (a.stream()?, b.stream()?);
        {
            // SAFETY: the pooled streams are valid streams of cudarc's context and outlive the
            // wrappers (dropped at the end of this block, before the owners).
            let (ca, cb) = unsafe {
                (
                    cu.wrap_borrowed_stream(sa.raw().0 as usize as cudarc::driver::sys::CUstream),
                    cu.wrap_borrowed_stream(sb.raw().0 as usize as cudarc::driver::sys::CUstream),
                )
            };
            // cudarc's buffer, written by cudarc's launch on owner a's stream.
            let mut x = ca.alloc_zeros::<f32>(n)?;
            let n32 = n as u32;
            // SAFETY: csp_add_one_f32(float *x, unsigned n) with a slice of n floats.
            unsafe {
                ca.launch_builder(&add_one)
                    .arg(&mut x)
                    .arg(&n32)
                    .launch(cfg)?
            };
            // This crate's buffer on owner b's stream, ordered after a's work on the GPU.
            let out = DeviceBuffer::<f32>::zeroed(&sb, 1)?;
            sb.wait_for(&sa)?;
            {
                // The launch on sb uses `out`: it is enqueued while the buffer's use guard lives.
                let use_out = out.use_on(&sb)?;
                let out_ptr = use_out.ptr().0;
                // SAFETY: csp_sum_f32(const float *x, float *out, unsigned n); `out` is this
                // crate's allocation of one float, in use on sb (`use_out`) for this launch.
                unsafe {
                    cb.launch_builder(&sum)
                        .arg(&x)
                        .arg(&out_ptr)
                        .arg(&n32)
                        .launch(cfg)?
                };
            }
            let got = out.to_vec(&sb)?[0];
            if got != n as f32 {
                return Err(format!("wrong sum {got}, expected {n}").into());
            }
            // cudarc's slice is freed on its stream (a's), which a still owns.
            drop(x);
            checked += 1;
        }
    }
    let st = ctx.stats();
    println!(
        "ok: {checked} sums across cudarc and cuda-stream-pool buffers on pooled streams; \
         streams created {}, hand-overs {}",
        st.created, st.hits
    );
    Ok(())
}

#[allow(dead_code)]
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
