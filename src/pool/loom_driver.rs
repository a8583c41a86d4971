//! A driver for the loom models (`cfg(loom)`): streams, their queries and synchronizations, and
//! host functions, with every synchronisation of its own through `crate::sync` (loom's), so that
//! loom also interleaves a host function (run on a loom thread of its own) with the threads of
//! the model. A stream is busy exactly while a host function enqueued on it has not returned.
//! Every other entry point is unreachable: the pool paths under test make no other call.
//! (The simulated driver cannot stand in: its locks are std's and its host functions run on a
//! thread outside loom's model.)

use crate::driver::{
    CaptureMode, CaptureStatus, Context, Device, DeviceAttr, DevicePtr, Driver, Event, Function,
    Graph, GraphExec, HostFn, MemPool, MemPoolAttr, Module, Stream, WaitValue,
};
use crate::error::Result;
use crate::sync::{Condvar, Mutex};
use std::collections::HashMap;
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::Arc;

#[derive(Default)]
struct State {
    next: u64,
    /// Live streams: host functions enqueued and not yet returned.
    pending: HashMap<u64, usize>,
}

/// See the module's documentation. In an `Arc`, which its host-function threads share.
#[derive(Default)]
pub(crate) struct LoomDriver {
    me: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    idle: Condvar,
}

impl LoomDriver {
    fn create(&self) -> Result<Stream> {
        let mut st = self.me.state.lock();
        st.next += 0x10;
        let s = st.next;
        st.pending.insert(s, 0);
        Ok(Stream(s))
    }

    fn destroy(&self, s: Stream) -> Result<()> {
        let mut st = self.me.state.lock();
        let pending = st.pending.remove(&s.0).expect("a live stream destroyed");
        assert_eq!(
            pending, 0,
            "a stream destroyed with a host function pending"
        );
        Ok(())
    }

    fn query(&self, s: Stream) -> Result<bool> {
        Ok(self.me.state.lock().pending[&s.0] == 0)
    }

    fn synchronize(&self, s: Stream) -> Result<()> {
        let mut st = self.me.state.lock();
        while st.pending[&s.0] > 0 {
            st = self.me.idle.wait(st);
        }
        Ok(())
    }

    fn host_func(&self, s: Stream, f: HostFn) -> Result<()> {
        *self
            .me
            .state
            .lock()
            .pending
            .get_mut(&s.0)
            .expect("a live stream") += 1;
        let me = self.me.clone();
        // The stream's earlier work has completed (none is modelled): the function may run at
        // once, on its own thread, as the driver's host-function thread would run it.
        loom::thread::spawn(move || {
            f();
            *me.state
                .lock()
                .pending
                .get_mut(&s.0)
                .expect("a live stream") -= 1;
            me.idle.notify_all();
        });
        Ok(())
    }
}

// SAFETY: only for the loom models, whose pool paths call the stream entry points below, which
// keep the contract (a stream is idle once its host functions have returned; each host function
// runs once); every other entry point panics without an effect.
unsafe impl Driver for LoomDriver {
    fn kind(&self) -> &'static str {
        "loom"
    }

    fn init(&self) -> Result<()> {
        unreachable!("the loom driver has no init")
    }

    fn driver_version(&self) -> Result<i32> {
        unreachable!("the loom driver has no driver_version")
    }

    fn device_count(&self) -> Result<i32> {
        unreachable!("the loom driver has no device_count")
    }

    fn device_get(&self, _ordinal: i32) -> Result<Device> {
        unreachable!("the loom driver has no device_get")
    }

    fn device_name(&self, _dev: Device) -> Result<String> {
        unreachable!("the loom driver has no device_name")
    }

    fn device_attribute(&self, _dev: Device, _attr: DeviceAttr) -> Result<i32> {
        unreachable!("the loom driver has no device_attribute")
    }

    fn primary_ctx_retain(&self, _dev: Device) -> Result<Context> {
        unreachable!("the loom driver has no primary_ctx_retain")
    }

    unsafe fn primary_ctx_release(&self, _dev: Device) -> Result<()> {
        unreachable!("the loom driver has no primary_ctx_release")
    }

    fn primary_ctx_state(&self, _dev: Device) -> Result<(u32, bool)> {
        unreachable!("the loom driver has no primary_ctx_state")
    }

    fn ctx_get_current(&self) -> Result<Context> {
        unreachable!("the loom driver has no ctx_get_current")
    }

    unsafe fn ctx_set_current(&self, _ctx: Context) -> Result<()> {
        unreachable!("the loom driver has no ctx_set_current")
    }

    fn ctx_get_device(&self) -> Result<Device> {
        unreachable!("the loom driver has no ctx_get_device")
    }

    fn ctx_synchronize(&self) -> Result<()> {
        unreachable!("the loom driver has no ctx_synchronize")
    }

    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)> {
        unreachable!("the loom driver has no ctx_stream_priority_range")
    }

    fn stream_create(&self, _flags: u32, _priority: i32) -> Result<Stream> {
        self.create()
    }

    unsafe fn stream_destroy(&self, stream: Stream) -> Result<()> {
        self.destroy(stream)
    }

    unsafe fn stream_query(&self, stream: Stream) -> Result<bool> {
        self.query(stream)
    }

    unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        self.synchronize(stream)
    }

    unsafe fn stream_priority(&self, _stream: Stream) -> Result<i32> {
        unreachable!("the loom driver has no stream_priority")
    }

    unsafe fn stream_flags(&self, _stream: Stream) -> Result<u32> {
        unreachable!("the loom driver has no stream_flags")
    }

    unsafe fn stream_wait_event(&self, _stream: Stream, _event: Event) -> Result<()> {
        unreachable!("the loom driver has no stream_wait_event")
    }

    fn event_create(&self, _flags: u32) -> Result<Event> {
        unreachable!("the loom driver has no event_create")
    }

    unsafe fn event_record(&self, _event: Event, _stream: Stream) -> Result<()> {
        unreachable!("the loom driver has no event_record")
    }

    unsafe fn event_query(&self, _event: Event) -> Result<bool> {
        unreachable!("the loom driver has no event_query")
    }

    unsafe fn event_synchronize(&self, _event: Event) -> Result<()> {
        unreachable!("the loom driver has no event_synchronize")
    }

    unsafe fn event_destroy(&self, _event: Event) -> Result<()> {
        unreachable!("the loom driver has no event_destroy")
    }

    unsafe fn mem_alloc_async(&self, _bytes: usize, _stream: Stream) -> Result<DevicePtr> {
        unreachable!("the loom driver has no mem_alloc_async")
    }

    unsafe fn mem_alloc_from_pool_async(
        &self,
        _bytes: usize,
        _pool: MemPool,
        _stream: Stream,
    ) -> Result<DevicePtr> {
        unreachable!("the loom driver has no mem_alloc_from_pool_async")
    }

    unsafe fn mem_free_async(&self, _ptr: DevicePtr, _stream: Stream) -> Result<()> {
        unreachable!("the loom driver has no mem_free_async")
    }

    fn device_default_mem_pool(&self, _dev: Device) -> Result<MemPool> {
        unreachable!("the loom driver has no device_default_mem_pool")
    }

    fn mem_pool_create(&self, _dev: Device) -> Result<MemPool> {
        unreachable!("the loom driver has no mem_pool_create")
    }

    unsafe fn mem_pool_destroy(&self, _pool: MemPool) -> Result<()> {
        unreachable!("the loom driver has no mem_pool_destroy")
    }

    unsafe fn mem_pool_set_attribute(
        &self,
        _pool: MemPool,
        _attr: MemPoolAttr,
        _value: u64,
    ) -> Result<()> {
        unreachable!("the loom driver has no mem_pool_set_attribute")
    }

    unsafe fn mem_pool_get_attribute(&self, _pool: MemPool, _attr: MemPoolAttr) -> Result<u64> {
        unreachable!("the loom driver has no mem_pool_get_attribute")
    }

    fn mem_get_info(&self) -> Result<(usize, usize)> {
        unreachable!("the loom driver has no mem_get_info")
    }

    unsafe fn memset_d32_async(
        &self,
        _dst: DevicePtr,
        _value: u32,
        _count: usize,
        _stream: Stream,
    ) -> Result<()> {
        unreachable!("the loom driver has no memset_d32_async")
    }

    unsafe fn memcpy_htod_async(
        &self,
        _dst: DevicePtr,
        _src: *const u8,
        _bytes: usize,
        _stream: Stream,
    ) -> Result<()> {
        unreachable!("the loom driver has no memcpy_htod_async")
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        _dst: *mut u8,
        _src: DevicePtr,
        _bytes: usize,
        _stream: Stream,
    ) -> Result<()> {
        unreachable!("the loom driver has no memcpy_dtoh_async")
    }

    fn mem_host_alloc(&self, _bytes: usize, _flags: u32) -> Result<*mut u8> {
        unreachable!("the loom driver has no mem_host_alloc")
    }

    unsafe fn mem_host_get_device_pointer(&self, _host: *mut u8) -> Result<DevicePtr> {
        unreachable!("the loom driver has no mem_host_get_device_pointer")
    }

    unsafe fn mem_free_host(&self, _host: *mut u8) -> Result<()> {
        unreachable!("the loom driver has no mem_free_host")
    }

    unsafe fn stream_write_value64(
        &self,
        _stream: Stream,
        _addr: DevicePtr,
        _value: u64,
    ) -> Result<()> {
        unreachable!("the loom driver has no stream_write_value64")
    }

    unsafe fn stream_wait_value32(
        &self,
        _stream: Stream,
        _addr: DevicePtr,
        _value: u32,
        _cond: WaitValue,
    ) -> Result<()> {
        unreachable!("the loom driver has no stream_wait_value32")
    }

    unsafe fn stream_begin_capture(&self, _stream: Stream, _mode: CaptureMode) -> Result<()> {
        unreachable!("the loom driver has no stream_begin_capture")
    }

    unsafe fn stream_end_capture(&self, _stream: Stream) -> Result<Graph> {
        unreachable!("the loom driver has no stream_end_capture")
    }

    unsafe fn stream_is_capturing(&self, _stream: Stream) -> Result<CaptureStatus> {
        unreachable!("the loom driver has no stream_is_capturing")
    }

    unsafe fn stream_capture_info(&self, _stream: Stream) -> Result<(CaptureStatus, u64)> {
        unreachable!("the loom driver has no stream_capture_info")
    }

    fn thread_exchange_capture_mode(&self, _mode: CaptureMode) -> Result<CaptureMode> {
        unreachable!("the loom driver has no thread_exchange_capture_mode")
    }

    unsafe fn graph_instantiate(&self, _graph: Graph) -> Result<GraphExec> {
        unreachable!("the loom driver has no graph_instantiate")
    }

    unsafe fn graph_launch(&self, _exec: GraphExec, _stream: Stream) -> Result<()> {
        unreachable!("the loom driver has no graph_launch")
    }

    unsafe fn graph_upload(&self, _exec: GraphExec, _stream: Stream) -> Result<()> {
        unreachable!("the loom driver has no graph_upload")
    }

    unsafe fn graph_exec_destroy(&self, _exec: GraphExec) -> Result<()> {
        unreachable!("the loom driver has no graph_exec_destroy")
    }

    unsafe fn graph_destroy(&self, _graph: Graph) -> Result<()> {
        unreachable!("the loom driver has no graph_destroy")
    }

    unsafe fn graph_node_count(&self, _graph: Graph) -> Result<usize> {
        unreachable!("the loom driver has no graph_node_count")
    }

    fn module_load_data(&self, _image: &CStr) -> Result<Module> {
        unreachable!("the loom driver has no module_load_data")
    }

    unsafe fn module_get_function(&self, _module: Module, _name: &CStr) -> Result<Function> {
        unreachable!("the loom driver has no module_get_function")
    }

    unsafe fn module_unload(&self, _module: Module) -> Result<()> {
        unreachable!("the loom driver has no module_unload")
    }

    unsafe fn launch_kernel(
        &self,
        _func: Function,
        _grid: [u32; 3],
        _block: [u32; 3],
        _shared_bytes: u32,
        _stream: Stream,
        _params: &mut [*mut c_void],
    ) -> Result<()> {
        unreachable!("the loom driver has no launch_kernel")
    }

    unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
        self.host_func(stream, f)
    }
}
