//! A candle-style service on cudarc, with a pooled stream per request:
//!
//!   cargo run --release --features cudarc --example cudarc_interop     # needs a GPU
//!
//! * the context is cudarc's: `Context::from_cudarc` adopts it safely (keeps the
//!   `Arc<CudaContext>` alive, no `unsafe`);
//! * every request is an `Owner` and runs cudarc's own API (allocations, kernels, copies) on its
//!   pooled stream, lent as an `Arc<CudaStream>` (`StreamRef::cudarc_stream`);
//! * "weights" (a cudarc slice) and an accumulator (this crate's `DeviceBuffer`, passed to
//!   cudarc launches through `DeviceBuffer::cudarc_use`) are shared by all requests, across
//!   threads and streams: cudarc orders its slices with events, the crate orders its buffers
//!   by generation;
//! * some requests hand their result (a cudarc slice) to the caller: the slice outlives the
//!   request's owner, and its stream stays out of the pool until the slice is gone.
//!
//! Without a GPU it returns an error (no panic).

use cuda_stream_pool::{Context, DeviceBuffer};
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use std::sync::Arc;

const N: usize = 1 << 14;

struct Model {
    ctx: Context,
    add_one: CudaFunction,
    sum: CudaFunction,
    /// Shared read-only input, a cudarc slice.
    weights: CudaSlice<f32>,
    /// Shared accumulator, a buffer of this crate.
    total: DeviceBuffer<f32>,
}

fn cfg(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One request on its own pooled stream: x = weights + 1 (cudarc), total += sum(x) (a cudarc
/// launch on this crate's buffer). Returns x, which may outlive the request's owner.
fn request(m: &Model) -> Result<CudaSlice<f32>, Box<dyn std::error::Error>> {
    let owner = m.ctx.owner();
    let s = owner.stream()?;
    let cs = s.cudarc_stream()?;
    let mut x = cs.clone_dtod(&m.weights)?;
    let n = N as u32;
    // SAFETY: csp_add_one_f32(float *x, unsigned n) with a slice of n floats.
    unsafe {
        cs.launch_builder(&m.add_one)
            .arg(&mut x)
            .arg(&n)
            .launch(cfg(N))?
    };
    {
        let total = m.total.cudarc_use(&s)?;
        let (total_ptr, _record) = total.device_ptr(&cs);
        // SAFETY: csp_sum_f32(const float *x, float *out, unsigned n): x has n floats, `total`
        // one, in use on this stream while `total` (the guard) lives, i.e. past this launch.
        unsafe {
            cs.launch_builder(&m.sum)
                .arg(&x)
                .arg(&total_ptr)
                .arg(&n)
                .launch(cfg(N))?
        };
    }
    Ok(x)
}

pub fn run() -> Result<(), Box<dyn std::error::Error>> {
    // Probes the driver first: without a GPU this is an error, not a panic in cudarc's loader.
    let (cu, ctx) = Context::cudarc(0)?;
    let src = cuda_stream_pool::kernels::PTX.trim_end_matches('\0');
    let module = cu.load_module(cudarc::nvrtc::Ptx::from_src(src))?;
    let setup = ctx.owner();
    let s0 = setup.stream()?;
    let cs0 = s0.cudarc_stream()?;
    let model = Arc::new(Model {
        ctx: ctx.clone(),
        add_one: module.load_function("csp_add_one_f32")?,
        sum: module.load_function("csp_sum_f32")?,
        weights: cs0.clone_htod(&vec![1.0f32; N])?,
        total: DeviceBuffer::<f32>::zeroed(&s0, 1)?,
    });
    drop(cs0);
    drop(s0);
    drop(setup);

    let (threads, per_thread) = (4, 25);
    let kept = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let m = model.clone();
                sc.spawn(move || -> Result<Vec<CudaSlice<f32>>, String> {
                    let mut kept = Vec::new();
                    for i in 0..per_thread {
                        let x = request(&m).map_err(|e| e.to_string())?;
                        if (t + i) % 10 == 0 {
                            kept.push(x); // outlives its request's owner
                        }
                    }
                    Ok(kept)
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.join().map_err(|_| "a request thread panicked")??);
        }
        Ok::<_, Box<dyn std::error::Error>>(all)
    })?;
    let lent_out = ctx.stats().in_use;
    // Every kept slice is read on its own (lent) stream, then dropped: their streams return.
    for x in &kept {
        let v = x.stream().clone_dtoh(x)?;
        if v.iter().any(|&e| e != 2.0) {
            return Err("a kept slice does not hold weights + 1".into());
        }
    }
    let n_kept = kept.len();
    drop(kept);
    ctx.trim()?;
    let owner = ctx.owner();
    let total = model.total.to_vec(&owner.stream()?)?[0];
    let expected = (threads * per_thread * N * 2) as f32;
    if total != expected {
        return Err(format!("total {total}, expected {expected}").into());
    }
    drop(owner);
    let st = ctx.stats();
    println!(
        "ok: {} requests on pooled streams with cudarc kernels, total {total}; {n_kept} results \
         outlived their requests (streams still lent then: {lent_out}; after: {}); streams \
         created {}, hand-overs {}",
        threads * per_thread,
        st.in_use,
        st.created,
        st.hits
    );
    Ok(())
}

#[allow(dead_code)]
fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
