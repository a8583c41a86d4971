//! A driver wrapper that can stop a thread right before a chosen driver call, so that a test can
//! interleave two threads at a precise point (between a check and the call it guards, between
//! an enqueue and the bookkeeping after it, ...).
//!
//! [`PausingDriver`] implements [`Driver`] by delegating every method to an inner
//! `Arc<SimDriver>` (whose call log, clock, fault injection and misuse detection stay usable
//! through [`PausingDriver::sim`]). Before delegating, each method passes its entry-point name
//! (the same name the simulation logs, e.g. `"cuLaunchKernel"`, `"cuMemcpyHtoDAsync_v2"`,
//! `"cuStreamGetCaptureInfo_v3"` for both `stream_is_capturing` and `stream_capture_info`) to a
//! hook. When the wrapper is armed ([`PausingDriver::arm`]) for that name (optionally only for
//! one thread, and for the n-th matching call), the calling thread blocks there, *before* the
//! call reaches the simulation, until the test calls [`PausingDriver::release`].
//!
//! Typical use:
//!
//! ```ignore
//! let pd = PausingDriver::new(Arc::new(SimDriver::new()));
//! let ctx = Context::primary(pd.clone(), 0).unwrap();
//! std::thread::scope(|sc| {
//!     let a = sc.spawn(|| { pd.arm_here("cuLaunchKernel", 1); k.add_one(&sa, &buf) });
//!     assert!(pd.wait_paused(TIMEOUT));       // thread A is now stopped before its launch
//!     /* ... the other thread's part of the interleaving ... */
//!     pd.release();                           // A makes its call
//!     a.join().unwrap().unwrap();
//! });
//! ```
//!
//! No test can hang on it: a paused thread continues on its own after [`PAUSE_LIMIT`] (and
//! [`PausingDriver::timed_out`] then says so), and [`PausingDriver::wait_paused`] takes a timeout.
//! One pause at a time: arming again replaces a pending arm.
#![allow(dead_code)]

use cuda_stream_pool::driver::{
    CaptureMode, CaptureStatus, Context, Device, DeviceAttr, DevicePtr, Driver, Event, Function,
    Graph, GraphExec, HostFn, MemPool, MemPoolAttr, Module, SimDriver, Stream,
};
use cuda_stream_pool::Result;
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

/// The longest a thread stays paused when the test never releases it.
pub const PAUSE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
struct Arm {
    name: &'static str,
    /// Matching calls still to let through before the one that pauses, plus one.
    remaining: u64,
    /// Only calls of this thread match (any thread when `None`).
    thread: Option<ThreadId>,
}

#[derive(Debug)]
enum Phase {
    Idle,
    Armed(Arm),
    Paused { thread: ThreadId },
    Released,
}

#[derive(Debug)]
struct Ctl {
    phase: Phase,
    timed_out: bool,
    /// Entry points that paused so far, in order (for diagnostics).
    history: Vec<&'static str>,
}

/// A [`Driver`] delegating to a [`SimDriver`], able to pause a thread before a chosen call.
pub struct PausingDriver {
    inner: Arc<SimDriver>,
    ctl: Mutex<Ctl>,
    cv: Condvar,
}

impl std::fmt::Debug for PausingDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PausingDriver")
            .field("inner", &self.inner)
            .finish()
    }
}

impl PausingDriver {
    /// Wraps `inner`; not armed.
    pub fn new(inner: Arc<SimDriver>) -> Arc<PausingDriver> {
        Arc::new(PausingDriver {
            inner,
            ctl: Mutex::new(Ctl {
                phase: Phase::Idle,
                timed_out: false,
                history: Vec::new(),
            }),
            cv: Condvar::new(),
        })
    }

    /// The simulation underneath (log, clock, faults, misuse).
    pub fn sim(&self) -> &Arc<SimDriver> {
        &self.inner
    }

    fn ctl(&self) -> std::sync::MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Arms the wrapper: the `nth` (1 = the next) call of the entry point `name`, made by
    /// `thread` (or by any thread when `None`), blocks before reaching the simulation until
    /// [`PausingDriver::release`].
    pub fn arm(&self, name: &'static str, nth: u64, thread: Option<ThreadId>) {
        assert!(nth >= 1, "nth counts from 1");
        let mut c = self.ctl();
        c.phase = Phase::Armed(Arm {
            name,
            remaining: nth,
            thread,
        });
    }

    /// [`PausingDriver::arm`] for calls of the calling thread only.
    pub fn arm_here(&self, name: &'static str, nth: u64) {
        self.arm(name, nth, Some(std::thread::current().id()));
    }

    /// Waits until a thread is paused at the armed call; false after `timeout` (the arm is then
    /// still pending).
    pub fn wait_paused(&self, timeout: Duration) -> bool {
        let c = self.ctl();
        let (c, _) = self
            .cv
            .wait_timeout_while(c, timeout, |c| !matches!(c.phase, Phase::Paused { .. }))
            .unwrap_or_else(|p| p.into_inner());
        matches!(c.phase, Phase::Paused { .. })
    }

    /// The thread paused now, if any.
    pub fn paused_thread(&self) -> Option<ThreadId> {
        match self.ctl().phase {
            Phase::Paused { thread } => Some(thread),
            _ => None,
        }
    }

    /// Lets the paused thread make its call (and disarms a pending arm that never matched).
    pub fn release(&self) {
        let mut c = self.ctl();
        match c.phase {
            Phase::Paused { .. } => c.phase = Phase::Released,
            Phase::Armed(_) => c.phase = Phase::Idle,
            _ => {}
        }
        self.cv.notify_all();
    }

    /// Whether a paused thread gave up waiting for [`PausingDriver::release`].
    pub fn timed_out(&self) -> bool {
        self.ctl().timed_out
    }

    /// The entry points that paused so far.
    pub fn history(&self) -> Vec<&'static str> {
        self.ctl().history.clone()
    }

    /// Called by every delegating method before the call reaches the simulation.
    fn hook(&self, name: &'static str) {
        let me = std::thread::current().id();
        let mut c = self.ctl();
        let hit = match &mut c.phase {
            Phase::Armed(a) if a.name == name && a.thread.is_none_or(|t| t == me) => {
                a.remaining -= 1;
                a.remaining == 0
            }
            _ => false,
        };
        if !hit {
            return;
        }
        c.phase = Phase::Paused { thread: me };
        c.history.push(name);
        self.cv.notify_all();
        let (mut c, r) = self
            .cv
            .wait_timeout_while(c, PAUSE_LIMIT, |c| matches!(c.phase, Phase::Paused { .. }))
            .unwrap_or_else(|p| p.into_inner());
        if r.timed_out() {
            c.timed_out = true;
        }
        c.phase = Phase::Idle;
        self.cv.notify_all();
    }
}

impl Driver for PausingDriver {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn init(&self) -> Result<()> {
        self.hook("cuInit");
        self.inner.init()
    }
    fn driver_version(&self) -> Result<i32> {
        self.hook("cuDriverGetVersion");
        self.inner.driver_version()
    }
    fn device_count(&self) -> Result<i32> {
        self.hook("cuDeviceGetCount");
        self.inner.device_count()
    }
    fn device_get(&self, ordinal: i32) -> Result<Device> {
        self.hook("cuDeviceGet");
        self.inner.device_get(ordinal)
    }
    fn device_name(&self, dev: Device) -> Result<String> {
        self.hook("cuDeviceGetName");
        self.inner.device_name(dev)
    }
    fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32> {
        self.hook("cuDeviceGetAttribute");
        self.inner.device_attribute(dev, attr)
    }
    fn primary_ctx_retain(&self, dev: Device) -> Result<Context> {
        self.hook("cuDevicePrimaryCtxRetain");
        self.inner.primary_ctx_retain(dev)
    }
    unsafe fn primary_ctx_release(&self, dev: Device) -> Result<()> {
        self.hook("cuDevicePrimaryCtxRelease_v2");
        self.inner.primary_ctx_release(dev)
    }
    fn ctx_get_current(&self) -> Result<Context> {
        self.hook("cuCtxGetCurrent");
        self.inner.ctx_get_current()
    }
    unsafe fn ctx_set_current(&self, ctx: Context) -> Result<()> {
        self.hook("cuCtxSetCurrent");
        self.inner.ctx_set_current(ctx)
    }
    fn ctx_get_device(&self) -> Result<Device> {
        self.hook("cuCtxGetDevice");
        self.inner.ctx_get_device()
    }
    fn ctx_synchronize(&self) -> Result<()> {
        self.hook("cuCtxSynchronize");
        self.inner.ctx_synchronize()
    }
    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)> {
        self.hook("cuCtxGetStreamPriorityRange");
        self.inner.ctx_stream_priority_range()
    }
    fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream> {
        self.hook("cuStreamCreateWithPriority");
        self.inner.stream_create(flags, priority)
    }
    unsafe fn stream_destroy(&self, stream: Stream) -> Result<()> {
        self.hook("cuStreamDestroy_v2");
        self.inner.stream_destroy(stream)
    }
    unsafe fn stream_query(&self, stream: Stream) -> Result<bool> {
        self.hook("cuStreamQuery");
        self.inner.stream_query(stream)
    }
    unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        self.hook("cuStreamSynchronize");
        self.inner.stream_synchronize(stream)
    }
    unsafe fn stream_priority(&self, stream: Stream) -> Result<i32> {
        self.hook("cuStreamGetPriority");
        self.inner.stream_priority(stream)
    }
    unsafe fn stream_flags(&self, stream: Stream) -> Result<u32> {
        self.hook("cuStreamGetFlags");
        self.inner.stream_flags(stream)
    }
    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.hook("cuStreamWaitEvent");
        self.inner.stream_wait_event(stream, event)
    }
    fn event_create(&self, flags: u32) -> Result<Event> {
        self.hook("cuEventCreate");
        self.inner.event_create(flags)
    }
    unsafe fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        self.hook("cuEventRecord");
        self.inner.event_record(event, stream)
    }
    unsafe fn event_query(&self, event: Event) -> Result<bool> {
        self.hook("cuEventQuery");
        self.inner.event_query(event)
    }
    unsafe fn event_synchronize(&self, event: Event) -> Result<()> {
        self.hook("cuEventSynchronize");
        self.inner.event_synchronize(event)
    }
    unsafe fn event_destroy(&self, event: Event) -> Result<()> {
        self.hook("cuEventDestroy_v2");
        self.inner.event_destroy(event)
    }
    unsafe fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr> {
        self.hook("cuMemAllocAsync");
        self.inner.mem_alloc_async(bytes, stream)
    }
    unsafe fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) -> Result<DevicePtr> {
        self.hook("cuMemAllocFromPoolAsync");
        self.inner.mem_alloc_from_pool_async(bytes, pool, stream)
    }
    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.hook("cuMemFreeAsync");
        self.inner.mem_free_async(ptr, stream)
    }
    fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool> {
        self.hook("cuDeviceGetDefaultMemPool");
        self.inner.device_default_mem_pool(dev)
    }
    unsafe fn mem_pool_set_attribute(
        &self,
        pool: MemPool,
        attr: MemPoolAttr,
        value: u64,
    ) -> Result<()> {
        self.hook("cuMemPoolSetAttribute");
        self.inner.mem_pool_set_attribute(pool, attr, value)
    }
    unsafe fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64> {
        self.hook("cuMemPoolGetAttribute");
        self.inner.mem_pool_get_attribute(pool, attr)
    }
    fn mem_get_info(&self) -> Result<(usize, usize)> {
        self.hook("cuMemGetInfo_v2");
        self.inner.mem_get_info()
    }
    unsafe fn memset_d32_async(
        &self,
        dst: DevicePtr,
        value: u32,
        count: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook("cuMemsetD32Async");
        self.inner.memset_d32_async(dst, value, count, stream)
    }
    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.hook("cuMemcpyHtoDAsync_v2");
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
        self.hook("cuMemcpyDtoHAsync_v2");
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.memcpy_dtoh_async(dst, src, bytes, stream) }
    }
    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()> {
        self.hook("cuStreamBeginCapture_v2");
        self.inner.stream_begin_capture(stream, mode)
    }
    unsafe fn stream_end_capture(&self, stream: Stream) -> Result<Graph> {
        self.hook("cuStreamEndCapture");
        self.inner.stream_end_capture(stream)
    }
    unsafe fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus> {
        // The simulation answers this through cuStreamGetCaptureInfo_v3 (and logs that name).
        self.hook("cuStreamGetCaptureInfo_v3");
        self.inner.stream_is_capturing(stream)
    }
    unsafe fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)> {
        self.hook("cuStreamGetCaptureInfo_v3");
        self.inner.stream_capture_info(stream)
    }
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.hook("cuThreadExchangeStreamCaptureMode");
        self.inner.thread_exchange_capture_mode(mode)
    }
    unsafe fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec> {
        self.hook("cuGraphInstantiateWithFlags");
        self.inner.graph_instantiate(graph)
    }
    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.hook("cuGraphLaunch");
        self.inner.graph_launch(exec, stream)
    }
    unsafe fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.hook("cuGraphUpload");
        self.inner.graph_upload(exec, stream)
    }
    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()> {
        self.hook("cuGraphExecDestroy");
        self.inner.graph_exec_destroy(exec)
    }
    unsafe fn graph_destroy(&self, graph: Graph) -> Result<()> {
        self.hook("cuGraphDestroy");
        self.inner.graph_destroy(graph)
    }
    unsafe fn graph_node_count(&self, graph: Graph) -> Result<usize> {
        self.hook("cuGraphGetNodes");
        self.inner.graph_node_count(graph)
    }
    fn module_load_data(&self, image: &CStr) -> Result<Module> {
        self.hook("cuModuleLoadData");
        self.inner.module_load_data(image)
    }
    unsafe fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function> {
        self.hook("cuModuleGetFunction");
        self.inner.module_get_function(module, name)
    }
    unsafe fn module_unload(&self, module: Module) -> Result<()> {
        self.hook("cuModuleUnload");
        self.inner.module_unload(module)
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
        self.hook("cuLaunchKernel");
        // SAFETY: forwarded with the caller's guarantees.
        unsafe {
            self.inner
                .launch_kernel(func, grid, block, shared_bytes, stream, params)
        }
    }
    unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
        self.hook("cuLaunchHostFunc");
        self.inner.launch_host_func(stream, f)
    }
}
