//! [`Hooked`]: a [`Driver`] that asks a [`Hook`] before every call and forwards the call to
//! another driver unless the hook refuses it. The crate wraps every context's driver in one
//! whose hook refuses calls on the crate's host-function threads ([`HostFnRule`]); the tests
//! use it to pause or schedule threads at chosen calls; users can instrument a driver with it.

use super::{
    CaptureMode, CaptureStatus, Context, Device, DeviceAttr, DevicePtr, Driver, Event, Function,
    Graph, GraphExec, HostFn, MemPool, MemPoolAttr, Module, Stream, WaitValue,
};
use crate::error::{Error, ErrorCode, Result};
use crate::hostfn::on_host_fn_thread;
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::Arc;

/// Called before every call of a [`Hooked`] driver, on the calling thread, with the entry
/// point's name (as the simulation logs it, e.g. `"cuLaunchKernel"`; `stream_is_capturing` and
/// `stream_capture_info` are both `"cuStreamGetCaptureInfo_v3"`). An error is returned by the
/// call instead of calling the inner driver. It may block (to pause or schedule threads).
pub trait Hook: Send + Sync + 'static {
    /// Before the call `call`.
    ///
    /// # Errors
    /// What the call should return instead of being made.
    fn before(&self, call: &'static str) -> Result<()>;
}

/// A driver that calls `hook.before(call)` and then `inner` (see the module docs).
///
/// ```
/// use cuda_stream_pool::driver::{Driver, Hook, Hooked, SimDriver};
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// #[derive(Default)]
/// struct Count(AtomicUsize);
/// impl Hook for Count {
///     fn before(&self, _call: &'static str) -> cuda_stream_pool::Result<()> {
///         self.0.fetch_add(1, Ordering::Relaxed);
///         Ok(())
///     }
/// }
/// let d = Arc::new(Hooked { inner: Arc::new(SimDriver::new()), hook: Count::default() });
/// d.init().unwrap();
/// assert_eq!(d.hook.0.load(Ordering::Relaxed), 1);
/// ```
pub struct Hooked<H> {
    /// The driver the calls go to.
    pub inner: Arc<dyn Driver>,
    /// Asked before every call.
    pub hook: H,
}

impl<H> std::fmt::Debug for Hooked<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked")
            .field("driver", &self.inner.kind())
            .finish_non_exhaustive()
    }
}

/// The crate's hook: refuses every call on a thread running one of the crate's host functions
/// (`CUDA_ERROR_NOT_PERMITTED`): the driver must not be called there (the real driver may
/// refuse, or deadlock), whatever a host function owns or calls (an [`crate::Owner`] moved into
/// it, a waker).
#[derive(Debug, Default)]
pub(crate) struct HostFnRule;

impl Hook for HostFnRule {
    fn before(&self, call: &'static str) -> Result<()> {
        if on_host_fn_thread() {
            return Err(Error::driver(ErrorCode::ERROR_NOT_PERMITTED, call));
        }
        Ok(())
    }
}

impl<H: Hook> Driver for Hooked<H> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn init(&self) -> Result<()> {
        self.hook.before("cuInit")?;
        self.inner.init()
    }
    fn driver_version(&self) -> Result<i32> {
        self.hook.before("cuDriverGetVersion")?;
        self.inner.driver_version()
    }
    fn device_count(&self) -> Result<i32> {
        self.hook.before("cuDeviceGetCount")?;
        self.inner.device_count()
    }
    fn device_get(&self, ordinal: i32) -> Result<Device> {
        self.hook.before("cuDeviceGet")?;
        self.inner.device_get(ordinal)
    }
    fn device_name(&self, dev: Device) -> Result<String> {
        self.hook.before("cuDeviceGetName")?;
        self.inner.device_name(dev)
    }
    fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32> {
        self.hook.before("cuDeviceGetAttribute")?;
        self.inner.device_attribute(dev, attr)
    }
    fn primary_ctx_retain(&self, dev: Device) -> Result<Context> {
        self.hook.before("cuDevicePrimaryCtxRetain")?;
        self.inner.primary_ctx_retain(dev)
    }
    unsafe fn primary_ctx_release(&self, dev: Device) -> Result<()> {
        self.hook.before("cuDevicePrimaryCtxRelease_v2")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.primary_ctx_release(dev) }
    }
    fn ctx_get_current(&self) -> Result<Context> {
        self.hook.before("cuCtxGetCurrent")?;
        self.inner.ctx_get_current()
    }
    unsafe fn ctx_set_current(&self, ctx: Context) -> Result<()> {
        self.hook.before("cuCtxSetCurrent")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.ctx_set_current(ctx) }
    }
    fn ctx_get_device(&self) -> Result<Device> {
        self.hook.before("cuCtxGetDevice")?;
        self.inner.ctx_get_device()
    }
    fn ctx_synchronize(&self) -> Result<()> {
        self.hook.before("cuCtxSynchronize")?;
        self.inner.ctx_synchronize()
    }
    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)> {
        self.hook.before("cuCtxGetStreamPriorityRange")?;
        self.inner.ctx_stream_priority_range()
    }
    fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream> {
        self.hook.before("cuStreamCreateWithPriority")?;
        self.inner.stream_create(flags, priority)
    }
    unsafe fn stream_destroy(&self, stream: Stream) -> Result<()> {
        self.hook.before("cuStreamDestroy_v2")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_destroy(stream) }
    }
    unsafe fn stream_query(&self, stream: Stream) -> Result<bool> {
        self.hook.before("cuStreamQuery")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_query(stream) }
    }
    unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        self.hook.before("cuStreamSynchronize")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_synchronize(stream) }
    }
    unsafe fn stream_priority(&self, stream: Stream) -> Result<i32> {
        self.hook.before("cuStreamGetPriority")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_priority(stream) }
    }
    unsafe fn stream_flags(&self, stream: Stream) -> Result<u32> {
        self.hook.before("cuStreamGetFlags")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_flags(stream) }
    }
    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.hook.before("cuStreamWaitEvent")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_wait_event(stream, event) }
    }
    fn event_create(&self, flags: u32) -> Result<Event> {
        self.hook.before("cuEventCreate")?;
        self.inner.event_create(flags)
    }
    unsafe fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        self.hook.before("cuEventRecord")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.event_record(event, stream) }
    }
    unsafe fn event_query(&self, event: Event) -> Result<bool> {
        self.hook.before("cuEventQuery")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.event_query(event) }
    }
    unsafe fn event_synchronize(&self, event: Event) -> Result<()> {
        self.hook.before("cuEventSynchronize")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.event_synchronize(event) }
    }
    unsafe fn event_destroy(&self, event: Event) -> Result<()> {
        self.hook.before("cuEventDestroy_v2")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.event_destroy(event) }
    }
    unsafe fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr> {
        self.hook.before("cuMemAllocAsync")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_alloc_async(bytes, stream) }
    }
    unsafe fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) -> Result<DevicePtr> {
        self.hook.before("cuMemAllocFromPoolAsync")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_alloc_from_pool_async(bytes, pool, stream) }
    }
    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.hook.before("cuMemFreeAsync")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_free_async(ptr, stream) }
    }
    fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool> {
        self.hook.before("cuDeviceGetDefaultMemPool")?;
        self.inner.device_default_mem_pool(dev)
    }
    fn mem_pool_create(&self, dev: Device) -> Result<MemPool> {
        self.hook.before("cuMemPoolCreate")?;
        self.inner.mem_pool_create(dev)
    }
    unsafe fn mem_pool_destroy(&self, pool: MemPool) -> Result<()> {
        self.hook.before("cuMemPoolDestroy")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_pool_destroy(pool) }
    }
    unsafe fn mem_pool_set_attribute(
        &self,
        pool: MemPool,
        attr: MemPoolAttr,
        value: u64,
    ) -> Result<()> {
        self.hook.before("cuMemPoolSetAttribute")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_pool_set_attribute(pool, attr, value) }
    }
    unsafe fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64> {
        self.hook.before("cuMemPoolGetAttribute")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_pool_get_attribute(pool, attr) }
    }
    fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.hook.before("cuMemGetInfo_v2")?;
        self.inner.mem_get_info()
    }
    unsafe fn memset_d32_async(
        &self,
        dst: DevicePtr,
        value: u32,
        count: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.before("cuMemsetD32Async")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.memset_d32_async(dst, value, count, stream) }
    }
    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.before("cuMemcpyHtoDAsync_v2")?;
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.memcpy_htod_async(dst, src, bytes, stream) }
    }
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.before("cuMemcpyDtoHAsync_v2")?;
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.memcpy_dtoh_async(dst, src, bytes, stream) }
    }
    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()> {
        self.hook.before("cuStreamBeginCapture_v2")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_begin_capture(stream, mode) }
    }
    unsafe fn stream_end_capture(&self, stream: Stream) -> Result<Graph> {
        self.hook.before("cuStreamEndCapture")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_end_capture(stream) }
    }
    unsafe fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus> {
        // The simulation answers this through cuStreamGetCaptureInfo_v3 (and logs that name).
        self.hook.before("cuStreamGetCaptureInfo_v3")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_is_capturing(stream) }
    }
    unsafe fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)> {
        self.hook.before("cuStreamGetCaptureInfo_v3")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_capture_info(stream) }
    }
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.hook.before("cuThreadExchangeStreamCaptureMode")?;
        self.inner.thread_exchange_capture_mode(mode)
    }
    unsafe fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec> {
        self.hook.before("cuGraphInstantiateWithFlags")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.graph_instantiate(graph) }
    }
    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.hook.before("cuGraphLaunch")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.graph_launch(exec, stream) }
    }
    unsafe fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.hook.before("cuGraphUpload")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.graph_upload(exec, stream) }
    }
    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()> {
        self.hook.before("cuGraphExecDestroy")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.graph_exec_destroy(exec) }
    }
    unsafe fn graph_destroy(&self, graph: Graph) -> Result<()> {
        self.hook.before("cuGraphDestroy")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.graph_destroy(graph) }
    }
    unsafe fn graph_node_count(&self, graph: Graph) -> Result<usize> {
        self.hook.before("cuGraphGetNodes")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.graph_node_count(graph) }
    }
    fn module_load_data(&self, image: &CStr) -> Result<Module> {
        self.hook.before("cuModuleLoadData")?;
        self.inner.module_load_data(image)
    }
    unsafe fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function> {
        self.hook.before("cuModuleGetFunction")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.module_get_function(module, name) }
    }
    unsafe fn module_unload(&self, module: Module) -> Result<()> {
        self.hook.before("cuModuleUnload")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.module_unload(module) }
    }
    unsafe fn launch_kernel(
        &self,
        func: Function,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.hook.before("cuLaunchKernel")?;
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            self.inner
                .launch_kernel(func, grid, block, shared_bytes, stream, params)
        }
    }
    fn mem_host_alloc(&self, bytes: usize, flags: u32) -> Result<*mut u8> {
        self.hook.before("cuMemHostAlloc")?;
        self.inner.mem_host_alloc(bytes, flags)
    }
    unsafe fn mem_host_get_device_pointer(&self, host: *mut u8) -> Result<DevicePtr> {
        self.hook.before("cuMemHostGetDevicePointer_v2")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_host_get_device_pointer(host) }
    }
    unsafe fn mem_free_host(&self, host: *mut u8) -> Result<()> {
        self.hook.before("cuMemFreeHost")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.mem_free_host(host) }
    }
    unsafe fn stream_write_value64(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        self.hook.before("cuStreamWriteValue64_v2")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_write_value64(stream, addr, value) }
    }
    unsafe fn stream_wait_value32(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u32,
        cond: WaitValue,
    ) -> Result<()> {
        self.hook.before("cuStreamWaitValue32_v2")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.stream_wait_value32(stream, addr, value, cond) }
    }
    unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
        self.hook.before("cuLaunchHostFunc")?;
        // SAFETY: forwarded with the caller's contract.
        unsafe { self.inner.launch_host_func(stream, f) }
    }
}
