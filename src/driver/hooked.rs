//! [`Hooked`]: a [`Driver`] that makes every call through a [`Hook`], which may refuse it or act
//! around it, and forwards it to another driver. The crate wraps every context's driver in one
//! whose hook applies the device rules (`rules.rs`: no call on a host-function thread, the
//! context current for the call, the invalidation table in relaxed capture mode); the tests use
//! it to pause or schedule threads at chosen calls; users can instrument a driver with it.

use super::{
    CaptureMode, CaptureStatus, Context, Device, DeviceAttr, DevicePtr, Driver, Event, Function,
    Graph, GraphExec, HostFn, MemPool, MemPoolAttr, Module, Stream, WaitValue,
};
use crate::error::Result;
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::Arc;

/// Called before every call of a [`Hooked`] driver, on the calling thread, with the entry
/// point's name (as the simulation logs it, e.g. `"cuLaunchKernel"`; `stream_is_capturing` and
/// `stream_capture_info` are both `"cuStreamGetCaptureInfo_v3"`). An error is returned by the
/// call instead of calling the inner driver. It may block (to pause or schedule threads).
///
/// # Safety
///
/// A [`Hooked`] driver is a [`Driver`], whose contract the crate's safety depends on, so
/// implementing this trait is `unsafe`. An implementation of [`Hook::call`] must return either an
/// error without having called `f`, or the result of its last call of `f`; it may call `f` again
/// only after `f` returned an error (a failed driver call has no effect), never after it
/// returned `Ok` (a second stream destroy or free after a successful one is a double free), and
/// it must not change the calling thread's current context or capture mode. [`Hook::before`]
/// only allows or refuses the call, and may block.
///
/// The crate calls its driver while it holds its own locks (a stream's, a shard's of the pool,
/// the completion hub's), so a hook must not call into the crate (contexts, owners, streams,
/// buffers, futures) or wait for a thread that does: it would deadlock.
///
/// ```compile_fail,E0200
/// use cuda_stream_pool::driver::Hook;
/// struct Twice;
/// impl Hook for Twice { // error[E0200]: the trait requires an `unsafe impl`
///     fn before(&self, _: &'static str) -> cuda_stream_pool::Result<()> { Ok(()) }
/// }
/// ```
pub unsafe trait Hook: Send + Sync + 'static {
    /// Before the call `call`.
    ///
    /// # Errors
    /// What the call should return instead of being made.
    fn before(&self, call: &'static str) -> Result<()>;

    /// Makes the call `call`, which `f` forwards to the inner driver: by default asks
    /// [`Hook::before`] and calls `f` unless it refused. A hook that must act around the call
    /// (before and after it) overrides this; it may call `f` again after a failure (the crate's
    /// rules retry a free that the driver refused for want of a current context).
    ///
    /// # Errors
    /// What [`Hook::before`] returns, else the call's result.
    fn call<R>(&self, call: &'static str, mut f: impl FnMut() -> Result<R>) -> Result<R>
    where
        Self: Sized,
    {
        self.before(call)?;
        f()
    }
}

/// A driver that calls `hook.before(call)` and then `inner` (see the module docs).
///
/// ```
/// use cuda_stream_pool::driver::{Driver, Hook, Hooked, SimDriver};
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::Arc;
/// #[derive(Default)]
/// struct Count(AtomicUsize);
/// // SAFETY: `before` only counts; the default `call` calls the driver once.
/// unsafe impl Hook for Count {
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

// SAFETY: every call is forwarded to `inner`, a `Driver` (whose contract it keeps), through
// `H::call`, whose contract (`Hook`'s `# Safety`) returns the inner call's own result or an error
// without an effect; `world` and `kind` are the inner driver's.
unsafe impl<H: Hook> Driver for Hooked<H> {
    fn world(&self) -> usize {
        self.inner.world()
    }

    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn init(&self) -> Result<()> {
        self.hook.call("cuInit", || self.inner.init())
    }
    fn driver_version(&self) -> Result<i32> {
        self.hook
            .call("cuDriverGetVersion", || self.inner.driver_version())
    }
    fn device_count(&self) -> Result<i32> {
        self.hook
            .call("cuDeviceGetCount", || self.inner.device_count())
    }
    fn device_get(&self, ordinal: i32) -> Result<Device> {
        self.hook
            .call("cuDeviceGet", || self.inner.device_get(ordinal))
    }
    fn device_name(&self, dev: Device) -> Result<String> {
        self.hook
            .call("cuDeviceGetName", || self.inner.device_name(dev))
    }
    fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32> {
        self.hook.call("cuDeviceGetAttribute", || {
            self.inner.device_attribute(dev, attr)
        })
    }
    fn primary_ctx_retain(&self, dev: Device) -> Result<Context> {
        self.hook.call("cuDevicePrimaryCtxRetain", || {
            self.inner.primary_ctx_retain(dev)
        })
    }
    fn primary_ctx_state(&self, dev: Device) -> Result<(u32, bool)> {
        self.hook.call("cuDevicePrimaryCtxGetState", || {
            self.inner.primary_ctx_state(dev)
        })
    }
    unsafe fn primary_ctx_release(&self, dev: Device) -> Result<()> {
        self.hook.call("cuDevicePrimaryCtxRelease_v2", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.primary_ctx_release(dev) }
        })
    }
    fn ctx_get_current(&self) -> Result<Context> {
        self.hook
            .call("cuCtxGetCurrent", || self.inner.ctx_get_current())
    }
    unsafe fn ctx_set_current(&self, ctx: Context) -> Result<()> {
        self.hook.call("cuCtxSetCurrent", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.ctx_set_current(ctx) }
        })
    }
    fn ctx_get_device(&self) -> Result<Device> {
        self.hook
            .call("cuCtxGetDevice", || self.inner.ctx_get_device())
    }
    fn ctx_synchronize(&self) -> Result<()> {
        self.hook
            .call("cuCtxSynchronize", || self.inner.ctx_synchronize())
    }
    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)> {
        self.hook.call("cuCtxGetStreamPriorityRange", || {
            self.inner.ctx_stream_priority_range()
        })
    }
    fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream> {
        self.hook.call("cuStreamCreateWithPriority", || {
            self.inner.stream_create(flags, priority)
        })
    }
    unsafe fn stream_destroy(&self, stream: Stream) -> Result<()> {
        self.hook.call("cuStreamDestroy_v2", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_destroy(stream) }
        })
    }
    unsafe fn stream_query(&self, stream: Stream) -> Result<bool> {
        self.hook.call("cuStreamQuery", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_query(stream) }
        })
    }
    unsafe fn probe_sticky(&self, stream: Stream) -> Result<()> {
        self.hook.call("cuStreamQuery", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.probe_sticky(stream) }
        })
    }
    unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        self.hook.call("cuStreamSynchronize", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_synchronize(stream) }
        })
    }
    unsafe fn stream_priority(&self, stream: Stream) -> Result<i32> {
        self.hook.call("cuStreamGetPriority", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_priority(stream) }
        })
    }
    unsafe fn stream_flags(&self, stream: Stream) -> Result<u32> {
        self.hook.call("cuStreamGetFlags", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_flags(stream) }
        })
    }
    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.hook.call("cuStreamWaitEvent", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_wait_event(stream, event) }
        })
    }
    fn event_create(&self, flags: u32) -> Result<Event> {
        self.hook
            .call("cuEventCreate", || self.inner.event_create(flags))
    }
    unsafe fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        self.hook.call("cuEventRecord", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.event_record(event, stream) }
        })
    }
    unsafe fn event_query(&self, event: Event) -> Result<bool> {
        self.hook.call("cuEventQuery", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.event_query(event) }
        })
    }
    unsafe fn event_synchronize(&self, event: Event) -> Result<()> {
        self.hook.call("cuEventSynchronize", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.event_synchronize(event) }
        })
    }
    unsafe fn event_destroy(&self, event: Event) -> Result<()> {
        self.hook.call("cuEventDestroy_v2", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.event_destroy(event) }
        })
    }
    unsafe fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr> {
        self.hook.call("cuMemAllocAsync", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_alloc_async(bytes, stream) }
        })
    }
    unsafe fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) -> Result<DevicePtr> {
        self.hook.call("cuMemAllocFromPoolAsync", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_alloc_from_pool_async(bytes, pool, stream) }
        })
    }
    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.hook.call("cuMemFreeAsync", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_free_async(ptr, stream) }
        })
    }
    fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool> {
        self.hook.call("cuDeviceGetDefaultMemPool", || {
            self.inner.device_default_mem_pool(dev)
        })
    }
    fn mem_pool_create(&self, dev: Device) -> Result<MemPool> {
        self.hook
            .call("cuMemPoolCreate", || self.inner.mem_pool_create(dev))
    }
    unsafe fn mem_pool_destroy(&self, pool: MemPool) -> Result<()> {
        self.hook.call("cuMemPoolDestroy", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_pool_destroy(pool) }
        })
    }
    unsafe fn mem_pool_set_attribute(
        &self,
        pool: MemPool,
        attr: MemPoolAttr,
        value: u64,
    ) -> Result<()> {
        self.hook.call("cuMemPoolSetAttribute", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_pool_set_attribute(pool, attr, value) }
        })
    }
    unsafe fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64> {
        self.hook.call("cuMemPoolGetAttribute", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_pool_get_attribute(pool, attr) }
        })
    }
    fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.hook
            .call("cuMemGetInfo_v2", || self.inner.mem_get_info())
    }
    unsafe fn memset_d32_async(
        &self,
        dst: DevicePtr,
        value: u32,
        count: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.call("cuMemsetD32Async", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.memset_d32_async(dst, value, count, stream) }
        })
    }
    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.call("cuMemcpyHtoDAsync_v2", || {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { self.inner.memcpy_htod_async(dst, src, bytes, stream) }
        })
    }
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook.call("cuMemcpyDtoHAsync_v2", || {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe { self.inner.memcpy_dtoh_async(dst, src, bytes, stream) }
        })
    }
    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()> {
        self.hook.call("cuStreamBeginCapture_v2", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_begin_capture(stream, mode) }
        })
    }
    unsafe fn stream_end_capture(&self, stream: Stream) -> Result<Graph> {
        self.hook.call("cuStreamEndCapture", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_end_capture(stream) }
        })
    }
    unsafe fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus> {
        // The simulation answers this through cuStreamGetCaptureInfo_v3 (and logs that name).
        self.hook.call("cuStreamGetCaptureInfo_v3", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_is_capturing(stream) }
        })
    }
    unsafe fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)> {
        self.hook.call("cuStreamGetCaptureInfo_v3", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_capture_info(stream) }
        })
    }
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.hook.call("cuThreadExchangeStreamCaptureMode", || {
            self.inner.thread_exchange_capture_mode(mode)
        })
    }
    unsafe fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec> {
        self.hook.call("cuGraphInstantiateWithFlags", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.graph_instantiate(graph) }
        })
    }
    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.hook.call("cuGraphLaunch", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.graph_launch(exec, stream) }
        })
    }
    unsafe fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.hook.call("cuGraphUpload", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.graph_upload(exec, stream) }
        })
    }
    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()> {
        self.hook.call("cuGraphExecDestroy", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.graph_exec_destroy(exec) }
        })
    }
    unsafe fn graph_destroy(&self, graph: Graph) -> Result<()> {
        self.hook.call("cuGraphDestroy", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.graph_destroy(graph) }
        })
    }
    unsafe fn graph_node_count(&self, graph: Graph) -> Result<usize> {
        self.hook.call("cuGraphGetNodes", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.graph_node_count(graph) }
        })
    }
    fn module_load_data(&self, image: &CStr) -> Result<Module> {
        self.hook
            .call("cuModuleLoadData", || self.inner.module_load_data(image))
    }
    unsafe fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function> {
        self.hook.call("cuModuleGetFunction", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.module_get_function(module, name) }
        })
    }
    unsafe fn module_unload(&self, module: Module) -> Result<()> {
        self.hook.call("cuModuleUnload", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.module_unload(module) }
        })
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
        self.hook.call("cuLaunchKernel", || {
            // SAFETY: forwarded with the caller's guarantees.
            unsafe {
                self.inner
                    .launch_kernel(func, grid, block, shared_bytes, stream, params)
            }
        })
    }
    fn mem_host_alloc(&self, bytes: usize, flags: u32) -> Result<*mut u8> {
        self.hook
            .call("cuMemHostAlloc", || self.inner.mem_host_alloc(bytes, flags))
    }
    unsafe fn mem_host_get_device_pointer(&self, host: *mut u8) -> Result<DevicePtr> {
        self.hook.call("cuMemHostGetDevicePointer_v2", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_host_get_device_pointer(host) }
        })
    }
    unsafe fn mem_free_host(&self, host: *mut u8) -> Result<()> {
        self.hook.call("cuMemFreeHost", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.mem_free_host(host) }
        })
    }
    unsafe fn stream_write_value64(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        self.hook.call("cuStreamWriteValue64_v2", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_write_value64(stream, addr, value) }
        })
    }
    unsafe fn stream_wait_value32(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u32,
        cond: WaitValue,
    ) -> Result<()> {
        self.hook.call("cuStreamWaitValue32_v2", || {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.inner.stream_wait_value32(stream, addr, value, cond) }
        })
    }
    unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
        let mut f = Some(f);
        self.hook.call("cuLaunchHostFunc", || match f.take() {
            // SAFETY: forwarded with the caller's contract.
            Some(f) => unsafe { self.inner.launch_host_func(stream, f) },
            // A hook that calls again after a failed launch: `f` was dropped by the driver.
            None => Err(crate::Error::invalid(
                "cuLaunchHostFunc made twice by a hook: the host function is gone",
            )),
        })
    }
}
