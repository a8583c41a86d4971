//! Library code as a cudarc user writes it with this crate (issue 21): two independent
//! libraries of one process that each adopt cudarc's context and share one state of it,
//! half-precision buffers, a cudarc kernel launched on the crate's buffer, `CudaSlice` ↔
//! `DeviceBuffer` without copies, and `?` on both
//! error types. No `unsafe` but the kernel launch, which cudarc itself marks unsafe. CI builds
//! it (cudarc linked dynamically: it runs where libcuda is).

use cuda_stream_pool::{Context, DeviceBuffer, Error};
use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use std::sync::Arc;

/// One library: keeps its own `Context` of the cudarc context it is given.
pub mod lib_a {
    use super::*;
    pub fn open(cu: &Arc<CudaContext>) -> Result<Context, Error> {
        Context::from_cudarc(cu)
    }
}

/// Another, written independently: the same call, the same state.
pub mod lib_b {
    use super::*;
    pub fn open(cu: &Arc<CudaContext>) -> Result<Context, Error> {
        Context::from_cudarc(cu)
    }
}

/// Both libraries' states are one: a buffer of A is read back on a stream of B.
pub fn shared(cu: &Arc<CudaContext>) -> Result<bool, Error> {
    let (a, b) = (lib_a::open(cu)?, lib_b::open(cu)?);
    let (oa, ob) = (a.owner(), b.owner());
    let buf = DeviceBuffer::from_slice_staged(&oa.stream()?, &[f16::from_f32(1.5); 8])?;
    let back = buf.to_vec(&ob.stream()?)?;
    Ok(a == b && back == vec![f16::from_f32(1.5); 8])
}

/// Half-precision buffers: zeroed of any length (one memset), uploaded without waiting.
pub fn half_roundtrip(ctx: &Context) -> Result<(Vec<f16>, Vec<bf16>), Error> {
    let owner = ctx.owner();
    let s = owner.stream()?;
    let z = DeviceBuffer::<f16>::zeroed(&s, 7)?;
    let mut b = DeviceBuffer::<bf16>::alloc(&s, 3)?;
    b.copy_from_host_staged(&s, &[bf16::from_f32(2.0); 3])?;
    Ok((z.to_vec(&s)?, b.to_vec(&s)?))
}

/// A cudarc kernel (`add_one(float* x, unsigned n)`, loaded by the caller) on the crate's buffer
/// on a pooled stream: cudarc's `DriverError` converts into the crate's `Error` with `?`.
pub fn add_one(ctx: &Context, f: &CudaFunction, n: usize) -> Result<Vec<f32>, Error> {
    let owner = ctx.owner();
    let s = owner.stream()?;
    let cs = s.cudarc_stream()?;
    let buf = DeviceBuffer::<f32>::zeroed(&s, n)?;
    {
        let u = buf.cudarc_use(&s)?;
        let (p, _record) = u.device_ptr_on(&cs)?;
        let n32 = n as u32;
        let cfg = LaunchConfig {
            grid_dim: (n32.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `f` is `add_one(float*, unsigned)`; `p` is the buffer's `n` floats, in use
        // on `cs` (the pooled stream) while `u` lives.
        unsafe { cs.launch_builder(f).arg(&p).arg(&n32).launch(cfg) }?;
    }
    buf.to_vec(&s)
}

/// Memory that changes hands without copies: a cudarc slice (allocated and written by cudarc)
/// becomes the crate's buffer, the crate works on it, and it goes back to cudarc as a
/// `CudaSlice` that cudarc's own kernel launch takes as an ordinary argument, on a stream of
/// cudarc's own. Returns what cudarc reads back and whether the allocation stayed the same.
pub fn slices_change_hands(
    ctx: &Context,
    cu: &Arc<CudaContext>,
    f: &CudaFunction,
) -> Result<(Vec<f32>, bool), Error> {
    use cudarc::driver::DevicePtr;
    let n = 4096;
    let theirs = cu.new_stream()?;
    let x = theirs.clone_htod(&vec![1.0f32; n])?;
    let owner = ctx.owner();
    let s = owner.stream()?;
    let addr = x.device_ptr(&theirs).0;
    let mut buf = DeviceBuffer::from_cudarc(x, &s)?; // s waits for the upload
    let same_in = buf.as_raw().0 == addr;
    buf.fill(&s, 2.0)?; // the crate's work on it
    let mut y = buf.into_cudarc(&s)?; // cudarc's slice again, ordered after the fill
    let same_out = y.device_ptr(&theirs).0 == addr;
    let n32 = n as u32;
    let cfg = LaunchConfig {
        grid_dim: (n32.div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: `f` is `add_one(float*, unsigned)` on `y`'s `n` floats.
    unsafe { theirs.launch_builder(f).arg(&mut y).arg(&n32).launch(cfg) }?;
    Ok((theirs.clone_dtoh(&y)?, same_in && same_out))
}
