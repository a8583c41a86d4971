//! The driver layer: safe Rust signatures for the part of the CUDA driver API the crate uses,
//! with two implementations, [`CudaDriver`] (the real driver, loaded at run time) and
//! [`SimDriver`] (a pure-Rust model used by the tests, the fuzzer and the demo on machines
//! without a GPU). Everything above this module is written once against [`Driver`].
//!
//! Handles are plain numbers ([`Stream`], [`Event`], ...): the real driver stores its pointers in
//! them, the simulation its ids. They carry no ownership; the types above this layer do.

mod cuda;
pub mod sim;

pub use cuda::CudaDriver;
pub use sim::{SimConfig, SimDriver};

use crate::error::Result;
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::Arc;

macro_rules! handle {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        pub struct $name(pub u64);
        impl $name {
            /// The null handle.
            pub const NULL: $name = $name(0);
            /// Whether this is the null handle.
            pub fn is_null(self) -> bool { self.0 == 0 }
        }
    )*};
}

handle! {
    /// A device ordinal's handle (`CUdevice`).
    Device,
    /// A context (`CUcontext`).
    Context,
    /// A stream (`CUstream`). [`Stream::NULL`] is the legacy default stream.
    Stream,
    /// An event (`CUevent`).
    Event,
    /// A device pointer (`CUdeviceptr`).
    DevicePtr,
    /// A memory pool (`CUmemoryPool`).
    MemPool,
    /// A captured graph (`CUgraph`).
    Graph,
    /// An instantiated graph (`CUgraphExec`).
    GraphExec,
    /// A loaded module (`CUmodule`).
    Module,
    /// A kernel (`CUfunction`).
    Function,
}

/// Stream creation flags.
pub mod stream_flags {
    /// `CU_STREAM_DEFAULT`: synchronizes with the legacy default stream.
    pub const DEFAULT: u32 = 0;
    /// `CU_STREAM_NON_BLOCKING`: does not synchronize with the legacy default stream.
    pub const NON_BLOCKING: u32 = 1;
}

/// Event creation flags.
pub mod event_flags {
    /// `CU_EVENT_DEFAULT`.
    pub const DEFAULT: u32 = 0;
    /// `CU_EVENT_DISABLE_TIMING`: cheaper, for ordering only.
    pub const DISABLE_TIMING: u32 = 2;
}

/// `CUstreamCaptureMode`: which API calls a capture forbids, and on which threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Unsafe calls are forbidden on every thread that is itself in global mode.
    Global,
    /// Unsafe calls are forbidden on the capturing thread only.
    ThreadLocal,
    /// No calls are forbidden.
    Relaxed,
}

impl CaptureMode {
    /// The driver's number for the mode.
    pub fn raw(self) -> u32 {
        match self {
            CaptureMode::Global => 0,
            CaptureMode::ThreadLocal => 1,
            CaptureMode::Relaxed => 2,
        }
    }
    /// The mode with the driver's number `raw`.
    pub fn from_raw(raw: u32) -> Option<CaptureMode> {
        match raw {
            0 => Some(CaptureMode::Global),
            1 => Some(CaptureMode::ThreadLocal),
            2 => Some(CaptureMode::Relaxed),
            _ => None,
        }
    }
}

/// `CUstreamCaptureStatus`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Not capturing.
    None,
    /// Capturing.
    Active,
    /// Capturing, but an illegal operation invalidated the capture; ending it fails.
    Invalidated,
}

/// `CUmemPool_attribute`s the crate reads or sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemPoolAttr {
    /// Bytes the pool keeps cached across synchronizations.
    ReleaseThreshold,
    /// Bytes currently reserved from the device.
    ReservedMemCurrent,
    /// Bytes currently handed out.
    UsedMemCurrent,
}

impl MemPoolAttr {
    /// The driver's number for the attribute.
    pub fn raw(self) -> u32 {
        match self {
            MemPoolAttr::ReleaseThreshold => 4,
            MemPoolAttr::ReservedMemCurrent => 5,
            MemPoolAttr::UsedMemCurrent => 7,
        }
    }
}

/// Device attributes the crate reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceAttr {
    /// Streaming multiprocessors.
    MultiprocessorCount,
    /// Compute capability, major.
    ComputeCapabilityMajor,
    /// Compute capability, minor.
    ComputeCapabilityMinor,
    /// Whether `cuMemAllocAsync` and memory pools are supported.
    MemoryPoolsSupported,
}

impl DeviceAttr {
    /// The driver's number for the attribute.
    pub fn raw(self) -> u32 {
        match self {
            DeviceAttr::MultiprocessorCount => 16,
            DeviceAttr::ComputeCapabilityMajor => 75,
            DeviceAttr::ComputeCapabilityMinor => 76,
            DeviceAttr::MemoryPoolsSupported => 115,
        }
    }
}

/// A host function enqueued with [`Driver::launch_host_func`]. It runs on a driver thread once
/// the stream's earlier work has completed and must not call the driver.
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// The driver API subset, with safe signatures where the operation cannot break memory safety by
/// itself. Every method returns the driver's error as [`crate::Error::Driver`] (code, name,
/// entry point), or [`crate::Error::MissingSymbol`] when the loaded driver lacks the entry point.
///
/// Methods that create resources or synchronize the context act on the calling thread's current
/// context ([`Driver::ctx_set_current`]).
pub trait Driver: Send + Sync + 'static {
    /// `"cuda"` or `"sim"`.
    fn kind(&self) -> &'static str;

    /// `cuInit`.
    fn init(&self) -> Result<()>;
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    fn driver_version(&self) -> Result<i32>;
    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<i32>;
    /// `cuDeviceGet`.
    fn device_get(&self, ordinal: i32) -> Result<Device>;
    /// `cuDeviceGetName`.
    fn device_name(&self, dev: Device) -> Result<String>;
    /// `cuDeviceGetAttribute`.
    fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32>;

    /// `cuDevicePrimaryCtxRetain`.
    fn primary_ctx_retain(&self, dev: Device) -> Result<Context>;
    /// `cuDevicePrimaryCtxRelease_v2`.
    fn primary_ctx_release(&self, dev: Device) -> Result<()>;
    /// `cuCtxGetCurrent`; [`Context::NULL`] when none is current.
    fn ctx_get_current(&self) -> Result<Context>;
    /// `cuCtxSetCurrent`.
    fn ctx_set_current(&self, ctx: Context) -> Result<()>;
    /// `cuCtxGetDevice` of the current context.
    fn ctx_get_device(&self) -> Result<Device>;
    /// `cuCtxSynchronize` of the current context.
    fn ctx_synchronize(&self) -> Result<()>;
    /// `cuCtxGetStreamPriorityRange`: (least, greatest), e.g. (0, -5).
    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)>;

    /// `cuStreamCreateWithPriority` (the driver clamps the priority into the range).
    fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream>;
    /// `cuStreamDestroy_v2`.
    fn stream_destroy(&self, stream: Stream) -> Result<()>;
    /// `cuStreamQuery`: `Ok(true)` when all work has completed, `Ok(false)` for
    /// `CUDA_ERROR_NOT_READY`.
    fn stream_query(&self, stream: Stream) -> Result<bool>;
    /// `cuStreamSynchronize`.
    fn stream_synchronize(&self, stream: Stream) -> Result<()>;
    /// `cuStreamGetPriority`.
    fn stream_priority(&self, stream: Stream) -> Result<i32>;
    /// `cuStreamGetFlags`.
    fn stream_flags(&self, stream: Stream) -> Result<u32>;
    /// `cuStreamWaitEvent`: later work on `stream` waits for the event's last record.
    fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()>;

    /// `cuEventCreate`.
    fn event_create(&self, flags: u32) -> Result<Event>;
    /// `cuEventRecord`.
    fn event_record(&self, event: Event, stream: Stream) -> Result<()>;
    /// `cuEventQuery`: `Ok(true)` when the recorded work has completed.
    fn event_query(&self, event: Event) -> Result<bool>;
    /// `cuEventSynchronize`.
    fn event_synchronize(&self, event: Event) -> Result<()>;
    /// `cuEventDestroy_v2`.
    fn event_destroy(&self, event: Event) -> Result<()>;

    /// `cuMemAllocAsync`.
    fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr>;
    /// `cuMemAllocFromPoolAsync`.
    fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) -> Result<DevicePtr>;
    /// `cuMemFreeAsync`.
    fn mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()>;
    /// `cuDeviceGetDefaultMemPool`.
    fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool>;
    /// `cuMemPoolSetAttribute` with a 64-bit value.
    fn mem_pool_set_attribute(&self, pool: MemPool, attr: MemPoolAttr, value: u64) -> Result<()>;
    /// `cuMemPoolGetAttribute` with a 64-bit value.
    fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64>;
    /// `cuMemGetInfo_v2`: (free, total) bytes.
    fn mem_get_info(&self) -> Result<(usize, usize)>;
    /// `cuMemsetD32Async`: `count` 32-bit words.
    fn memset_d32_async(
        &self,
        dst: DevicePtr,
        value: u32,
        count: usize,
        stream: Stream,
    ) -> Result<()>;
    /// `cuMemcpyHtoDAsync_v2`.
    ///
    /// # Safety
    /// `src` must be valid for reads of `bytes` bytes until the copy has completed on the GPU,
    /// and `dst` must be a device allocation of at least `bytes` bytes.
    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()>;
    /// `cuMemcpyDtoHAsync_v2`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `bytes` bytes, and not otherwise accessed, until the copy
    /// has completed on the GPU; `src` must be a device allocation of at least `bytes` bytes.
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()>;

    /// `cuStreamBeginCapture_v2`.
    fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()>;
    /// `cuStreamEndCapture`.
    fn stream_end_capture(&self, stream: Stream) -> Result<Graph>;
    /// `cuStreamIsCapturing`.
    fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus>;
    /// `cuStreamGetCaptureInfo_v3`: status and the capture's unique id.
    fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)>;
    /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's mode, returns the old one.
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode>;
    /// `cuGraphInstantiateWithFlags` with no flags.
    fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec>;
    /// `cuGraphLaunch`.
    fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()>;
    /// `cuGraphUpload`.
    fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()>;
    /// `cuGraphExecDestroy`.
    fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()>;
    /// `cuGraphDestroy`.
    fn graph_destroy(&self, graph: Graph) -> Result<()>;
    /// `cuGraphGetNodes` with no output array: the number of nodes.
    fn graph_node_count(&self, graph: Graph) -> Result<usize>;

    /// `cuModuleLoadData` from a NUL-terminated PTX image.
    fn module_load_data(&self, image: &CStr) -> Result<Module>;
    /// `cuModuleGetFunction`.
    fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function>;
    /// `cuModuleUnload`.
    fn module_unload(&self, module: Module) -> Result<()>;
    /// `cuLaunchKernel`.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, each pointing to a value of the type
    /// the kernel declares, and the kernel's memory accesses must be valid.
    unsafe fn launch_kernel(
        &self,
        func: Function,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()>;
    /// `cuLaunchHostFunc`: runs `f` after the stream's earlier work. If the launch fails, `f` is
    /// dropped without running.
    fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()>;
}

/// Which driver [`load`] should return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The real driver when it loads and has a device, else the simulation.
    Auto,
    /// The real driver, or the error that prevents it.
    Cuda,
    /// The simulation.
    Sim,
}

/// Opens a driver as `choice` asks; with [`Choice::Auto`], the error that made it fall back to the
/// simulation is returned beside it.
///
/// ```
/// use cuda_stream_pool::driver::{self, Choice};
/// let (drv, why_not_cuda) = driver::load(Choice::Auto).unwrap();
/// if drv.kind() == "sim" {
///     println!("no GPU: {}", why_not_cuda.unwrap());
/// }
/// ```
pub fn load(choice: Choice) -> Result<(Arc<dyn Driver>, Option<crate::Error>)> {
    let real = || -> Result<Arc<dyn Driver>> {
        let d = CudaDriver::open()?;
        d.init()?;
        if d.device_count()? < 1 {
            return Err(crate::Error::driver(
                crate::ErrorCode::ERROR_NO_DEVICE,
                "cuDeviceGetCount",
            ));
        }
        Ok(Arc::new(d))
    };
    match choice {
        Choice::Cuda => Ok((real()?, None)),
        Choice::Sim => Ok((Arc::new(SimDriver::new()), None)),
        Choice::Auto => match real() {
            Ok(d) => Ok((d, None)),
            Err(e) => Ok((Arc::new(SimDriver::new()), Some(e))),
        },
    }
}
