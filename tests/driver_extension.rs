//! The extension policy of [`Driver`] (see its docs, "Implementing it outside the crate"): a
//! driver written outside the crate that implements exactly the methods without a default keeps
//! compiling. This file is that driver: it forwards every required method of the trait as the
//! crate publishes it to a simulation, and leaves the methods with a default (`world`,
//! `probe_sticky`) to their defaults.
//!
//! When this file stops compiling because the trait gained a method without a default, that is
//! a breaking change for every such driver: give the new method a default implementation
//! instead. (Before the first release, 0.1.0, the trait may still change: then add the method
//! here as well.)

mod common;

use cuda_stream_pool::driver::{
    CaptureMode, CaptureStatus, Context, Device, DeviceAttr, DevicePtr, Driver, Event, Function,
    Graph, GraphExec, HostFn, MemPool, MemPoolAttr, Module, SimDriver, Stream, WaitValue,
};
use cuda_stream_pool::{DeviceBuffer, Result};
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::Arc;

/// The trait's required methods, each forwarded to the simulation in `self.0` (a mock or an
/// instrumented driver would do more).
macro_rules! forward_required {
    () => {
        fn kind(&self) -> &'static str {
            self.0.kind()
        }
        fn init(&self) -> Result<()> {
            self.0.init()
        }
        fn driver_version(&self) -> Result<i32> {
            self.0.driver_version()
        }
        fn device_count(&self) -> Result<i32> {
            self.0.device_count()
        }
        fn device_get(&self, ordinal: i32) -> Result<Device> {
            self.0.device_get(ordinal)
        }
        fn device_name(&self, dev: Device) -> Result<String> {
            self.0.device_name(dev)
        }
        fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32> {
            self.0.device_attribute(dev, attr)
        }
        fn primary_ctx_retain(&self, dev: Device) -> Result<Context> {
            self.0.primary_ctx_retain(dev)
        }
        unsafe fn primary_ctx_release(&self, dev: Device) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.primary_ctx_release(dev) }
        }
        fn primary_ctx_state(&self, dev: Device) -> Result<(u32, bool)> {
            self.0.primary_ctx_state(dev)
        }
        fn ctx_get_current(&self) -> Result<Context> {
            self.0.ctx_get_current()
        }
        unsafe fn ctx_set_current(&self, ctx: Context) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.ctx_set_current(ctx) }
        }
        fn ctx_get_device(&self) -> Result<Device> {
            self.0.ctx_get_device()
        }
        fn ctx_synchronize(&self) -> Result<()> {
            self.0.ctx_synchronize()
        }
        fn ctx_stream_priority_range(&self) -> Result<(i32, i32)> {
            self.0.ctx_stream_priority_range()
        }
        fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream> {
            self.0.stream_create(flags, priority)
        }
        unsafe fn stream_destroy(&self, stream: Stream) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_destroy(stream) }
        }
        unsafe fn stream_query(&self, stream: Stream) -> Result<bool> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_query(stream) }
        }
        unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_synchronize(stream) }
        }
        unsafe fn stream_priority(&self, stream: Stream) -> Result<i32> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_priority(stream) }
        }
        unsafe fn stream_flags(&self, stream: Stream) -> Result<u32> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_flags(stream) }
        }
        unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_wait_event(stream, event) }
        }
        fn event_create(&self, flags: u32) -> Result<Event> {
            self.0.event_create(flags)
        }
        unsafe fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.event_record(event, stream) }
        }
        unsafe fn event_query(&self, event: Event) -> Result<bool> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.event_query(event) }
        }
        unsafe fn event_synchronize(&self, event: Event) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.event_synchronize(event) }
        }
        unsafe fn event_destroy(&self, event: Event) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.event_destroy(event) }
        }
        unsafe fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_alloc_async(bytes, stream) }
        }
        unsafe fn mem_alloc_from_pool_async(
            &self,
            bytes: usize,
            pool: MemPool,
            stream: Stream,
        ) -> Result<DevicePtr> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_alloc_from_pool_async(bytes, pool, stream) }
        }
        unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_free_async(ptr, stream) }
        }
        fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool> {
            self.0.device_default_mem_pool(dev)
        }
        fn mem_pool_create(&self, dev: Device) -> Result<MemPool> {
            self.0.mem_pool_create(dev)
        }
        unsafe fn mem_pool_destroy(&self, pool: MemPool) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_pool_destroy(pool) }
        }
        unsafe fn mem_pool_set_attribute(
            &self,
            pool: MemPool,
            attr: MemPoolAttr,
            value: u64,
        ) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_pool_set_attribute(pool, attr, value) }
        }
        unsafe fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_pool_get_attribute(pool, attr) }
        }
        fn mem_get_info(&self) -> Result<(usize, usize)> {
            self.0.mem_get_info()
        }
        unsafe fn memset_d32_async(
            &self,
            dst: DevicePtr,
            value: u32,
            count: usize,
            stream: Stream,
        ) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.memset_d32_async(dst, value, count, stream) }
        }
        unsafe fn memcpy_htod_async(
            &self,
            dst: DevicePtr,
            src: *const u8,
            bytes: usize,
            stream: Stream,
        ) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.memcpy_htod_async(dst, src, bytes, stream) }
        }
        unsafe fn memcpy_dtoh_async(
            &self,
            dst: *mut u8,
            src: DevicePtr,
            bytes: usize,
            stream: Stream,
        ) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.memcpy_dtoh_async(dst, src, bytes, stream) }
        }
        fn mem_host_alloc(&self, bytes: usize, flags: u32) -> Result<*mut u8> {
            self.0.mem_host_alloc(bytes, flags)
        }
        unsafe fn mem_host_get_device_pointer(&self, host: *mut u8) -> Result<DevicePtr> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_host_get_device_pointer(host) }
        }
        unsafe fn mem_free_host(&self, host: *mut u8) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.mem_free_host(host) }
        }
        unsafe fn stream_write_value64(
            &self,
            stream: Stream,
            addr: DevicePtr,
            value: u64,
        ) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_write_value64(stream, addr, value) }
        }
        unsafe fn stream_wait_value32(
            &self,
            stream: Stream,
            addr: DevicePtr,
            value: u32,
            cond: WaitValue,
        ) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_wait_value32(stream, addr, value, cond) }
        }
        unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_begin_capture(stream, mode) }
        }
        unsafe fn stream_end_capture(&self, stream: Stream) -> Result<Graph> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_end_capture(stream) }
        }
        unsafe fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_is_capturing(stream) }
        }
        unsafe fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.stream_capture_info(stream) }
        }
        fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
            self.0.thread_exchange_capture_mode(mode)
        }
        unsafe fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.graph_instantiate(graph) }
        }
        unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.graph_launch(exec, stream) }
        }
        unsafe fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.graph_upload(exec, stream) }
        }
        unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.graph_exec_destroy(exec) }
        }
        unsafe fn graph_destroy(&self, graph: Graph) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.graph_destroy(graph) }
        }
        unsafe fn graph_node_count(&self, graph: Graph) -> Result<usize> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.graph_node_count(graph) }
        }
        fn module_load_data(&self, image: &CStr) -> Result<Module> {
            self.0.module_load_data(image)
        }
        unsafe fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.module_get_function(module, name) }
        }
        unsafe fn module_unload(&self, module: Module) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.module_unload(module) }
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
            // SAFETY: forwarded with the caller's contract.
            unsafe {
                self.0
                    .launch_kernel(func, grid, block, shared_bytes, stream, params)
            }
        }
        unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
            // SAFETY: forwarded with the caller's contract.
            unsafe { self.0.launch_host_func(stream, f) }
        }
    };
}

/// A user's driver: forwards to a simulation, with only the required methods.
struct Forward(SimDriver);

// SAFETY: every call is forwarded to a `Driver` (which keeps the contract) with its own
// arguments, and its result returned unchanged.
unsafe impl Driver for Forward {
    forward_required!();
}

#[test]
fn a_driver_outside_the_crate_with_only_the_required_methods_runs_a_context() {
    let drv = Arc::new(Forward(SimDriver::new()));
    let ctx = cuda_stream_pool::Context::primary(drv.clone(), 0).unwrap();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let buf = DeviceBuffer::from_slice(&s, &[1u32, 2, 3]).unwrap();
    assert_eq!(buf.to_vec(&s).unwrap(), [1, 2, 3]);
    // The defaults: a world of its own (the object's address), and the sticky-error probe
    // through `stream_query`.
    assert_eq!(drv.world(), Arc::as_ptr(&drv) as usize);
    // SAFETY: `s` is a live stream of this driver that is not capturing.
    unsafe { drv.probe_sticky(s.raw()) }.unwrap();
}

/// A user's driver whose `world` (a method with a default, overridden) calls back into the
/// crate: `release_pinned_cache` of its simulation, which takes the pinned cache's lock.
struct ReentrantWorld(SimDriver);

// SAFETY: as `Forward`'s; `world` returns the simulation's world, the same value every time.
unsafe impl Driver for ReentrantWorld {
    forward_required!();
    fn world(&self) -> usize {
        cuda_stream_pool::release_pinned_cache(&self.0).unwrap();
        self.0.world()
    }
}

// Regression: review 24 (2026-12-07), `release_pinned_cache` asked each shelf's driver for its
// `world` while it held the pinned cache's lock: a driver whose `world` called the crate
// relocked it (a deadlock; a panic under the model's lock checks).
/// A driver's own code (here `world`) runs under no lock of the crate: a state of the driver is
/// torn down, its completion flags go on a shelf, and releasing the cache, which asks the driver
/// for its world, frees them.
#[test]
fn a_drivers_world_runs_under_no_lock_of_the_crate() {
    let drv = Arc::new(ReentrantWorld(SimDriver::new()));
    {
        let ctx = cuda_stream_pool::Context::primary(drv.clone(), 0).unwrap();
        let owner = ctx.owner();
        let s = owner.stream().unwrap();
        let done = s.completed().unwrap();
        drv.0.advance(1_000_000);
        common::block_on(done).unwrap();
    }
    assert_eq!(
        drv.0.counters().live_host_allocs,
        1,
        "the flags are shelved"
    );
    // `world`'s own release, before the outer one takes anything off a shelf, frees the block.
    assert_eq!(cuda_stream_pool::release_pinned_cache(&*drv).unwrap(), 0);
    assert_eq!(drv.0.counters().live_host_allocs, 0);
    assert_eq!(drv.0.counters().live_contexts, 0);
}
