//! Uses the interop API, so that the check compiles it.
use std::sync::Arc;

pub fn adopt(cu: &Arc<cudarc::driver::CudaContext>) -> cuda_stream_pool::Result<()> {
    let ctx = cuda_stream_pool::Context::from_cudarc(cu)?;
    let owner = ctx.owner();
    let _stream: Arc<cudarc::driver::CudaStream> = owner.stream()?.cudarc_stream()?;
    Ok(())
}
