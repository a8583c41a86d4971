//! The driver layer: safe Rust signatures for the part of the CUDA driver API the crate uses,
//! with two implementations, [`CudaDriver`] (the real driver, loaded at run time) and
//! [`SimDriver`] (a pure-Rust model used by the tests, the fuzzer and the demo on machines
//! without a GPU). Everything above this module is written once against [`Driver`].
//!
//! Handles are plain numbers ([`Stream`], [`Event`], ...): the real driver stores its pointers in
//! them, the simulation its ids. They carry no ownership; the types above this layer do.

mod cuda;
mod hooked;
mod host_thread;
mod rules;
pub use hooked::{Hook, Hooked};
pub(crate) use host_thread::{as_host_fn_thread, on_host_fn_thread};
pub(crate) use rules::{outside_scopes, scopes_available, DeviceRules, Scope};
pub mod sim;

pub use cuda::CudaDriver;
pub use sim::{SimConfig, SimDriver, H200_CREATE_STALL_AT};

use crate::error::Result;
use cuda_stream_pool_sys::ffi;
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
            ///
            #[doc = concat!(
                "```\nuse cuda_stream_pool::driver::", stringify!($name), ";\n",
                "assert!(", stringify!($name), "::NULL.is_null());\n",
                "assert!(!", stringify!($name), "(0x10).is_null());\n```"
            )]
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

/// Conversions between the pointer-typed handles and the raw types of `cuda-stream-pool-sys`
/// (and, with the `cudarc` feature, cudarc's `driver::sys`), without `as usize as u64`.
/// Converting is safe; using the result with the driver is what needs care.
macro_rules! ptr_handle {
    ($($name:ident => $sys:ident),* $(,)?) => {$(
        impl From<ffi::$sys> for $name {
            fn from(p: ffi::$sys) -> $name {
                $name(p as usize as u64)
            }
        }
        impl From<$name> for ffi::$sys {
            fn from(h: $name) -> ffi::$sys {
                h.0 as usize as ffi::$sys
            }
        }
        #[cfg(feature = "cudarc")]
        impl From<cudarc::driver::sys::$sys> for $name {
            fn from(p: cudarc::driver::sys::$sys) -> $name {
                $name(p as usize as u64)
            }
        }
        #[cfg(feature = "cudarc")]
        impl From<$name> for cudarc::driver::sys::$sys {
            fn from(h: $name) -> cudarc::driver::sys::$sys {
                h.0 as usize as cudarc::driver::sys::$sys
            }
        }
    )*};
}

ptr_handle! {
    Context => CUcontext,
    Stream => CUstream,
    Event => CUevent,
    MemPool => CUmemoryPool,
    Graph => CUgraph,
    GraphExec => CUgraphExec,
    Module => CUmodule,
    Function => CUfunction,
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
    /// `CU_EVENT_BLOCKING_SYNC`: `cuEventSynchronize` on it blocks the thread (the driver wakes
    /// it) instead of spinning.
    pub const BLOCKING_SYNC: u32 = 1;
}

/// `cuMemHostAlloc` flags.
pub mod host_alloc_flags {
    /// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, not only the current one.
    pub const PORTABLE: u32 = 0x01;
    /// `CU_MEMHOSTALLOC_DEVICEMAP`: mapped into the device's address space
    /// ([`super::Driver::mem_host_get_device_pointer`]).
    pub const DEVICEMAP: u32 = 0x02;
}

/// The condition of a [`Driver::stream_wait_value32`] (`CUstreamWaitValue_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitValue {
    /// `CU_STREAM_WAIT_VALUE_GEQ`: until `(int32_t)(*addr - value) >= 0` (cyclic).
    Geq,
    /// `CU_STREAM_WAIT_VALUE_EQ`: until `*addr == value`.
    Eq,
    /// `CU_STREAM_WAIT_VALUE_AND`: until `(*addr & value) != 0`.
    And,
    /// `CU_STREAM_WAIT_VALUE_NOR`: until `!(*addr | value) != 0`.
    Nor,
}

impl WaitValue {
    /// The driver's number for the condition.
    pub fn raw(self) -> u32 {
        match self {
            WaitValue::Geq => 0,
            WaitValue::Eq => 1,
            WaitValue::And => 2,
            WaitValue::Nor => 3,
        }
    }
    /// Whether `current` (the word in memory) satisfies the condition against `value`.
    pub fn holds(self, current: u32, value: u32) -> bool {
        match self {
            WaitValue::Geq => (current.wrapping_sub(value) as i32) >= 0,
            WaitValue::Eq => current == value,
            WaitValue::And => current & value != 0,
            WaitValue::Nor => !(current | value) != 0,
        }
    }
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
    ///
    /// ```
    /// use cuda_stream_pool::driver::CaptureMode;
    /// assert_eq!(CaptureMode::Relaxed.raw(), 2);     // CU_STREAM_CAPTURE_MODE_RELAXED
    /// ```
    pub fn raw(self) -> u32 {
        match self {
            CaptureMode::Global => 0,
            CaptureMode::ThreadLocal => 1,
            CaptureMode::Relaxed => 2,
        }
    }
    /// The mode with the driver's number `raw`.
    ///
    /// ```
    /// use cuda_stream_pool::driver::CaptureMode;
    /// for m in [CaptureMode::Global, CaptureMode::ThreadLocal, CaptureMode::Relaxed] {
    ///     assert_eq!(CaptureMode::from_raw(m.raw()), Some(m));
    /// }
    /// assert_eq!(CaptureMode::from_raw(3), None);
    /// ```
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

/// `CUmemPool_attribute`s the crate reads or sets (`#[non_exhaustive]`: more are added as the
/// crate needs them, without a breaking change).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
    ///
    /// ```
    /// use cuda_stream_pool::driver::MemPoolAttr;
    /// assert_eq!(MemPoolAttr::ReleaseThreshold.raw(), 4);   // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    /// ```
    pub fn raw(self) -> u32 {
        match self {
            MemPoolAttr::ReleaseThreshold => 4,
            MemPoolAttr::ReservedMemCurrent => 5,
            MemPoolAttr::UsedMemCurrent => 7,
        }
    }
}

/// Device attributes the crate reads (`#[non_exhaustive]`: more are added as the crate needs
/// them, without a breaking change).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
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
    ///
    /// ```
    /// use cuda_stream_pool::driver::{self, DeviceAttr};
    /// assert_eq!(DeviceAttr::MultiprocessorCount.raw(), 16);  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// drv.init().unwrap();
    /// let dev = drv.device_get(0).unwrap();
    /// assert_eq!(drv.device_attribute(dev, DeviceAttr::ComputeCapabilityMajor).unwrap(), 9);
    /// ```
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

/// The driver API subset. Methods that take a raw handle of a stream, event, graph, module,
/// memory pool or device allocation are `unsafe fn`: the driver cannot check that a handle is
/// live (an event query on a destroyed event segfaults on the H200), so each states what its
/// handles must be in a `# Safety` section. Methods that take no such handle (creating streams
/// and events, loading modules, device queries, the thread's capture mode) are safe. Errors:
/// [below](Driver#errors).
///
/// A raw-handle call does not compile without `unsafe`:
///
/// ```compile_fail,E0133
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// ctx.driver().stream_destroy(ctx.disposal_stream()).unwrap(); // error: unsafe call
/// ```
///
/// Methods that create resources or synchronize the context act on the calling thread's current
/// context ([`Driver::ctx_set_current`]).
///
/// # Errors
///
/// Every method that returns a `Result` fails with the driver's result code, as
/// [`crate::Error::Driver`] (code, name, entry point), or with [`crate::Error::MissingSymbol`]
/// when the loaded driver lacks the entry point; a method's own `# Errors` section names the codes
/// worth handling.
///
/// ```
/// use cuda_stream_pool::driver::{self, Driver};
/// use cuda_stream_pool::{Error, ErrorCode};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// drv.init().unwrap();
/// let e = drv.device_get(7).unwrap_err();
/// assert!(matches!(e, Error::Driver { call: "cuDeviceGet", .. }));
/// assert_eq!(e.code(), Some(ErrorCode::ERROR_INVALID_DEVICE));
/// ```
///
/// # Safety
///
/// The crate's safe API is sound only if its driver keeps the driver API's contract, so
/// implementing this trait is `unsafe` (the crate implements it for [`CudaDriver`],
/// [`SimDriver`] and [`Hooked`]). An implementation must:
///
/// - return `Ok` only for what happened: a handle returned as created (a stream, an event, an
///   allocation, a module, a graph) is live and belongs to nobody else until the crate destroys
///   or frees it; an operation reported as enqueued is enqueued, in order, on the stream given,
///   and one reported as failed had no effect (the crate keeps the resource and retries);
/// - report a stream as idle ([`Driver::stream_query`]) or synchronized only once every
///   operation enqueued on it before has completed, and call a host function once, after the
///   stream's earlier work;
/// - make every call on the calling thread's current context (no other thread's) and leave the
///   thread's current context and capture mode as the crate set them;
/// - return from [`Driver::world`] a value shared only by drivers that see the same handles;
/// - never call into this crate from any of its methods (query a [`crate::Context`]'s statistics,
///   make an owner, drop the last reference of a context...): the crate calls the driver while
///   it holds locks of its own (a stream's, a pool shard's, the module list's), so such a call
///   may deadlock (a [`Hook`]'s contract says the same; review 26). [`Driver::world`] alone is
///   called under no lock of the crate (review 24).
///
/// A driver that breaks these may make the crate free memory the GPU still uses or destroy a
/// stream twice.
///
/// # Implementing it outside the crate
///
/// The trait is public and not sealed: a mock, a fault injector or a driver with extra checks
/// may implement it. To instrument or refuse calls of an existing driver, prefer [`Hooked`] with
/// a [`Hook`]: it forwards every method, including those added later, so the hook never needs to
/// change. The extension policy, from 0.1.0 on:
///
/// - a method added in a minor or patch release has a default implementation (forwarding to
///   existing methods, as [`Driver::probe_sticky`] does, or failing with
///   `CUDA_ERROR_NOT_SUPPORTED`), so a driver that implements every method without a default
///   keeps compiling and working;
/// - removing a method, changing a signature, or adding a method without a default is a breaking
///   change (a major release);
/// - the crate may start calling a method it did not call before (its default then applies to
///   drivers that do not override it).
///
/// `tests/driver_extension.rs` is such a driver, outside the crate, with only the required
/// methods: it fails to compile when a method without a default is added.
///
/// ```compile_fail,E0200
/// use cuda_stream_pool::driver::Driver;
/// struct Mine;
/// impl Driver for Mine { /* ... */ } // error[E0200]: the trait requires an `unsafe impl`
/// ```
pub unsafe trait Driver: Send + Sync + 'static {
    /// `"cuda"` or `"sim"`.
    fn kind(&self) -> &'static str;

    /// Which drivers share their handles: two drivers with the same value see the same contexts
    /// and memory. The default, this object's address, makes each object a world of its own
    /// (each simulation is); every instance of the real driver returns the same value (they
    /// all drive the process's libcuda), and a wrapper returns its inner driver's.
    fn world(&self) -> usize {
        self as *const Self as *const () as usize
    }

    /// `cuInit`.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn init(&self) -> Result<()>;
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn driver_version(&self) -> Result<i32>;
    /// `cuDeviceGetCount`.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn device_count(&self) -> Result<i32>;
    /// `cuDeviceGet`.
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_DEVICE` for an ordinal that names no device; otherwise as every method
    /// (see [`Driver`](Driver#errors)).
    fn device_get(&self, ordinal: i32) -> Result<Device>;
    /// `cuDeviceGetName`.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn device_name(&self, dev: Device) -> Result<String>;
    /// `cuDeviceGetAttribute`.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32>;

    /// `cuDevicePrimaryCtxRetain`.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn primary_ctx_retain(&self, dev: Device) -> Result<Context>;
    /// `cuDevicePrimaryCtxRelease_v2`.
    ///
    /// # Safety
    /// `dev` must have been retained with [`Driver::primary_ctx_retain`] by the caller, once per release, and nothing may use the context after its last release.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn primary_ctx_release(&self, dev: Device) -> Result<()>;
    /// `cuDevicePrimaryCtxGetState`: the primary context's flags and whether it is active
    /// (retained by someone). Asking does not activate it (a retain would).
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn primary_ctx_state(&self, dev: Device) -> Result<(u32, bool)>;
    /// `cuCtxGetCurrent`; [`Context::NULL`] when none is current.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn ctx_get_current(&self) -> Result<Context>;
    /// `cuCtxSetCurrent`.
    ///
    /// # Safety
    /// `ctx` must be a live context of this driver (or null).
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn ctx_set_current(&self, ctx: Context) -> Result<()>;
    /// `cuCtxGetDevice` of the current context.
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_CONTEXT` when no context is current; otherwise as every method (see
    /// [`Driver`](Driver#errors)).
    fn ctx_get_device(&self) -> Result<Device>;
    /// `cuCtxSynchronize` of the current context.
    ///
    /// # Errors
    /// A sticky error of earlier work, or `CUDA_ERROR_INVALID_CONTEXT` when no context is current;
    /// otherwise as every method (see [`Driver`](Driver#errors)).
    fn ctx_synchronize(&self) -> Result<()>;
    /// `cuCtxGetStreamPriorityRange`: (least, greatest), e.g. (0, -5).
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)>;

    /// `cuStreamCreateWithPriority` (the driver clamps the priority into the range).
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream>;
    /// `cuStreamDestroy_v2`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver that nothing (no pool, owner or capture) uses afterwards.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn stream_destroy(&self, stream: Stream) -> Result<()>;
    /// `cuStreamQuery`: `Ok(true)` when all work has completed, `Ok(false)` for
    /// `CUDA_ERROR_NOT_READY`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver (or null).
    ///
    /// # Errors
    /// `CUDA_ERROR_NOT_READY` is `Ok(false)`, not an error.
    /// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` for a capturing stream (the capture is
    /// invalidated); otherwise as every method (see [`Driver`](Driver#errors)).
    unsafe fn stream_query(&self, stream: Stream) -> Result<bool>;
    /// Asks whether the context of `stream` has met a sticky error ([`crate::ErrorCode::is_sticky`]),
    /// by the cheapest call that reports one: `cuStreamQuery`, whose other results are ignored.
    /// The crate's completion poller asks it every few milliseconds while completions wait and
    /// none lands (a dead context never writes their flags). The simulated driver answers
    /// without counting, logging or observing anything (so that this background call cannot
    /// shift injected faults or order work for its race checks).
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver that is not capturing.
    ///
    /// # Errors
    /// The sticky error, if any; otherwise as every method (see [`Driver`](Driver#errors)).
    unsafe fn probe_sticky(&self, stream: Stream) -> Result<()> {
        // SAFETY: the caller's contract.
        match unsafe { self.stream_query(stream) } {
            Err(e) if e.is_sticky() => Err(e),
            _ => Ok(()),
        }
    }
    /// `cuStreamSynchronize`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver (or null).
    ///
    /// # Errors
    /// A sticky error of earlier work; `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` for a capturing
    /// stream (the capture is invalidated); otherwise as every method (see
    /// [`Driver`](Driver#errors)).
    unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()>;
    /// `cuStreamGetPriority`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn stream_priority(&self, stream: Stream) -> Result<i32>;
    /// `cuStreamGetFlags`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn stream_flags(&self, stream: Stream) -> Result<u32>;
    /// `cuStreamWaitEvent`: later work on `stream` waits for the event's last record.
    ///
    /// # Safety
    /// `stream` and `event` must be live handles of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()>;

    /// `cuEventCreate`.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn event_create(&self, flags: u32) -> Result<Event>;
    /// `cuEventRecord`.
    ///
    /// # Safety
    /// `event` and `stream` must be live handles of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn event_record(&self, event: Event, stream: Stream) -> Result<()>;
    /// `cuEventQuery`: `Ok(true)` when the recorded work has completed.
    ///
    /// # Safety
    /// `event` must be a live event of this driver (a destroyed one segfaults on the H200).
    ///
    /// # Errors
    /// `CUDA_ERROR_NOT_READY` is `Ok(false)`, not an error; otherwise as every method (see
    /// [`Driver`](Driver#errors)).
    unsafe fn event_query(&self, event: Event) -> Result<bool>;
    /// `cuEventSynchronize`.
    ///
    /// # Safety
    /// `event` must be a live event of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn event_synchronize(&self, event: Event) -> Result<()>;
    /// `cuEventDestroy_v2`.
    ///
    /// # Safety
    /// `event` must be a live event of this driver that nothing uses afterwards.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn event_destroy(&self, event: Event) -> Result<()>;

    /// `cuMemAllocAsync`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver; the memory must be freed, ordered after its last use.
    ///
    /// # Errors
    /// `CUDA_ERROR_OUT_OF_MEMORY`; otherwise as every method (see [`Driver`](Driver#errors)).
    unsafe fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr>;
    /// `cuMemAllocFromPoolAsync`.
    ///
    /// # Safety
    /// `pool` and `stream` must be live handles of this driver.
    ///
    /// # Errors
    /// `CUDA_ERROR_OUT_OF_MEMORY`; otherwise as every method (see [`Driver`](Driver#errors)).
    unsafe fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) -> Result<DevicePtr>;
    /// `cuMemFreeAsync`.
    ///
    /// # Safety
    /// `ptr` must be a live stream-ordered allocation, freed once, and every use of it must be ordered before the free on `stream`, a live stream.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()>;
    /// `cuDeviceGetDefaultMemPool`.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool>;
    /// `cuMemPoolCreate`: a new stream-ordered memory pool of pinned device memory on `dev`,
    /// with the driver's default attributes (release threshold 0).
    fn mem_pool_create(&self, dev: Device) -> Result<MemPool>;
    /// `cuMemPoolDestroy`. Allocations still outstanding keep the pool's memory until they are
    /// freed (the driver releases it then).
    ///
    /// # Safety
    /// `pool` must be a pool made by [`Driver::mem_pool_create`], not yet destroyed, and nothing
    /// may allocate from it afterwards.
    unsafe fn mem_pool_destroy(&self, pool: MemPool) -> Result<()>;
    /// `cuMemPoolSetAttribute` with a 64-bit value.
    ///
    /// # Safety
    /// `pool` must be a live memory pool of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn mem_pool_set_attribute(
        &self,
        pool: MemPool,
        attr: MemPoolAttr,
        value: u64,
    ) -> Result<()>;
    /// `cuMemPoolGetAttribute` with a 64-bit value.
    ///
    /// # Safety
    /// `pool` must be a live memory pool of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64>;
    /// `cuMemGetInfo_v2`: (free, total) bytes.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn mem_get_info(&self) -> Result<(usize, usize)>;
    /// `cuMemsetD32Async`: `count` 32-bit words.
    ///
    /// # Safety
    /// `dst` must be a device allocation of at least `4 * count` bytes that stays live until the memset has run, and `stream` a live stream.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn memset_d32_async(
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
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
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
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()>;

    /// `cuMemHostAlloc` of `bytes` bytes of page-locked host memory with `flags`
    /// ([`host_alloc_flags`]), in the current context; zero-filled by the simulation only.
    /// The memory must be freed with [`Driver::mem_free_host`].
    fn mem_host_alloc(&self, bytes: usize, flags: u32) -> Result<*mut u8>;
    /// `cuMemHostGetDevicePointer_v2`: the device address of host memory allocated with
    /// [`host_alloc_flags::DEVICEMAP`].
    ///
    /// # Safety
    /// `host` must point into a live allocation of [`Driver::mem_host_alloc`] of this driver.
    unsafe fn mem_host_get_device_pointer(&self, host: *mut u8) -> Result<DevicePtr>;
    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `host` must be the start of a live allocation of [`Driver::mem_host_alloc`] of this
    /// driver, freed once, that no host code and no pending GPU work (a stream write or wait
    /// on its device address, a copy) uses afterwards.
    unsafe fn mem_free_host(&self, host: *mut u8) -> Result<()>;
    /// `cuStreamWriteValue64_v2` with default flags: once the stream's earlier work has
    /// completed (and its memory writes are visible), writes the 64-bit `value` to `addr`.
    ///
    /// # Safety
    /// `stream` must be a live stream that is not being captured, and `addr` an 8-byte aligned
    /// device address (of host-mapped memory, for the host to read) that stays valid until the
    /// write has happened and that nothing else writes concurrently.
    unsafe fn stream_write_value64(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()>;
    /// `cuStreamWaitValue32_v2`: the stream's later work waits until the 32-bit word at `addr`
    /// satisfies `cond` against `value`.
    ///
    /// # Safety
    /// `stream` must be a live stream that is not being captured, and `addr` a 4-byte aligned
    /// device address that stays valid until the wait is satisfied. The stream (and whatever
    /// waits for it, `cuCtxSynchronize` included) blocks until someone writes the value: the
    /// caller must make sure that happens.
    unsafe fn stream_wait_value32(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u32,
        cond: WaitValue,
    ) -> Result<()>;

    /// `cuStreamBeginCapture_v2`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver.
    ///
    /// # Errors
    /// `CUDA_ERROR_ILLEGAL_STATE` when the stream is already capturing (the capture in progress
    /// goes on); otherwise as every method (see [`Driver`](Driver#errors)).
    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()>;
    /// `cuStreamEndCapture`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver.
    ///
    /// # Errors
    /// `CUDA_ERROR_ILLEGAL_STATE` when the stream is not capturing;
    /// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` for an invalidated capture,
    /// `CUDA_ERROR_STREAM_CAPTURE_UNJOINED` when a stream forked into it was not joined back,
    /// `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD` from another thread outside relaxed mode (each
    /// ending the capture); otherwise as every method (see [`Driver`](Driver#errors)).
    unsafe fn stream_end_capture(&self, stream: Stream) -> Result<Graph>;
    /// `cuStreamIsCapturing`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus>;
    /// `cuStreamGetCaptureInfo_v3`: status and the capture's unique id.
    ///
    /// # Safety
    /// `stream` must be a live stream of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)>;
    /// `cuThreadExchangeStreamCaptureMode`: sets the calling thread's mode, returns the old one.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode>;
    /// `cuGraphInstantiateWithFlags` with no flags.
    ///
    /// # Safety
    /// `graph` must be a live graph of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec>;
    /// `cuGraphLaunch`.
    ///
    /// # Safety
    /// `exec` and `stream` must be live handles, and every resource the graph uses (memory, host data) must stay valid until the launch has run.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()>;
    /// `cuGraphUpload`.
    ///
    /// # Safety
    /// `exec` and `stream` must be live handles of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()>;
    /// `cuGraphExecDestroy`.
    ///
    /// # Safety
    /// `exec` must be a live executable graph that nothing uses afterwards.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()>;
    /// `cuGraphDestroy`.
    ///
    /// # Safety
    /// `graph` must be a live graph that nothing uses afterwards.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn graph_destroy(&self, graph: Graph) -> Result<()>;
    /// `cuGraphGetNodes` with no output array: the number of nodes.
    ///
    /// # Safety
    /// `graph` must be a live graph of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn graph_node_count(&self, graph: Graph) -> Result<usize>;

    /// `cuModuleLoadData` from a NUL-terminated PTX image.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    fn module_load_data(&self, image: &CStr) -> Result<Module>;
    /// `cuModuleGetFunction`.
    ///
    /// # Safety
    /// `module` must be a live module of this driver.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function>;
    /// `cuModuleUnload`.
    ///
    /// # Safety
    /// `module` must be a live module whose functions are no longer launched.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
    unsafe fn module_unload(&self, module: Module) -> Result<()>;
    /// `cuLaunchKernel`.
    ///
    /// # Safety
    /// `params` must hold one pointer per kernel parameter, each pointing to a value of the type
    /// the kernel declares, and the kernel's memory accesses must be valid.
    ///
    /// # Errors
    /// The driver's error (see [`Driver`](Driver#errors)).
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
    ///
    /// # Safety
    /// `stream` must be a live stream that is not being captured: a host function captured into a graph runs on every launch with the same data, and `f` is freed after its first run.
    ///
    /// # Errors
    /// As every method (see [`Driver`](Driver#errors)); `f` is dropped without running.
    unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()>;
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
/// simulation is returned beside it. The real driver is opened once per process: every later
/// call returns the same object, so that [`crate::Context`]s of one CUDA context made by
/// independent users share one state. Each [`Choice::Sim`] is a new simulation.
///
/// ```
/// use cuda_stream_pool::driver::{self, Choice};
/// let (drv, why_not_cuda) = driver::load(Choice::Auto).unwrap();
/// if drv.kind() == "sim" {
///     println!("no GPU: {}", why_not_cuda.unwrap());
/// }
/// let (sim, none) = driver::load(Choice::Sim).unwrap();
/// assert_eq!((sim.kind(), none), ("sim", None));
/// if let Ok((cuda, _)) = driver::load(Choice::Cuda) {
///     assert!(std::sync::Arc::ptr_eq(&cuda, &driver::load(Choice::Cuda).unwrap().0));
/// }
/// ```
///
/// # Errors
/// Only for [`Choice::Cuda`]: [`crate::Error::LibraryNotFound`] when no driver library opens,
/// [`crate::Error::MissingSymbol`] when it lacks `cuInit` or `cuDeviceGetCount`, the driver's
/// error from those calls, or `CUDA_ERROR_NO_DEVICE` when it sees no device.
pub fn load(choice: Choice) -> Result<(Arc<dyn Driver>, Option<crate::Error>)> {
    /// The process's real driver, once it opened with a device.
    static REAL: std::sync::OnceLock<Arc<dyn Driver>> = std::sync::OnceLock::new();
    let real = || -> Result<Arc<dyn Driver>> {
        if let Some(d) = REAL.get() {
            return Ok(d.clone());
        }
        let d = CudaDriver::open()?;
        d.init()?;
        if d.device_count()? < 1 {
            return Err(crate::Error::driver(
                crate::ErrorCode::ERROR_NO_DEVICE,
                "cuDeviceGetCount",
            ));
        }
        // Two threads may both open it: one object is kept, the other closed.
        let d: Arc<dyn Driver> = Arc::new(d);
        Ok(REAL.get_or_init(|| d).clone())
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

/// Sets the calling thread's capture mode (`cuThreadExchangeStreamCaptureMode`) and restores the
/// previous mode when dropped. Capture modes are per thread, so the guard is neither `Send` nor
/// `Sync`: it restores the mode of the thread that set it.
///
/// ```
/// use cuda_stream_pool::{driver::{self, CaptureMode}, CaptureModeGuard};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// {
///     let g = CaptureModeGuard::new(&*drv, CaptureMode::Relaxed).unwrap();
///     assert_eq!(g.previous(), CaptureMode::Global);
/// }
/// assert_eq!(drv.thread_exchange_capture_mode(CaptureMode::Global).unwrap(), CaptureMode::Global);
/// ```
///
/// ```compile_fail,E0277
/// # use cuda_stream_pool::{driver::{self, CaptureMode}, CaptureModeGuard};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let g = CaptureModeGuard::new(&*drv, CaptureMode::Relaxed).unwrap();
/// std::thread::scope(|s| { s.spawn(move || drop(g)); }); // a mode guard cannot change threads
/// ```
#[must_use = "the previous mode is restored when the guard is dropped"]
pub struct CaptureModeGuard<'d> {
    driver: &'d dyn Driver,
    previous: CaptureMode,
    _thread: std::marker::PhantomData<*const ()>,
}

impl std::fmt::Debug for CaptureModeGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureModeGuard")
            .field("previous", &self.previous)
            .finish()
    }
}

impl<'d> CaptureModeGuard<'d> {
    /// Switches the calling thread to `mode`.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::{self, CaptureMode}, CaptureModeGuard};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let outer = CaptureModeGuard::new(&*drv, CaptureMode::ThreadLocal).unwrap();
    /// let inner = CaptureModeGuard::new(&*drv, CaptureMode::Relaxed).unwrap();
    /// assert_eq!(inner.previous(), CaptureMode::ThreadLocal);
    /// drop(inner);                                   // back to thread-local
    /// assert_eq!(drv.thread_exchange_capture_mode(CaptureMode::ThreadLocal).unwrap(),
    ///            CaptureMode::ThreadLocal);
    /// drop(outer);                                   // back to the thread's default, global
    /// ```
    ///
    /// # Errors
    /// The driver's error from `cuThreadExchangeStreamCaptureMode` (the mode is unchanged).
    pub fn new(driver: &'d dyn Driver, mode: CaptureMode) -> Result<Self> {
        let previous = driver.thread_exchange_capture_mode(mode)?;
        Ok(CaptureModeGuard {
            driver,
            previous,
            _thread: std::marker::PhantomData,
        })
    }

    /// Switches the calling thread to relaxed mode, in which no call of this thread can
    /// invalidate a capture (its own or another thread's). Every call of the crate that could
    /// invalidate a capture runs in relaxed mode (a context's device rules switch it, and
    /// restore your mode, around each operation): use a guard for raw driver calls of your own.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::{self, CaptureMode, Driver}, Context, CaptureModeGuard};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let ctx = Context::primary(drv.clone(), 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// let (s, t) = (a.stream().unwrap(), b.stream().unwrap());
    /// let g = s.begin_capture_with(CaptureMode::Global).unwrap();
    /// {
    ///     let _relaxed = CaptureModeGuard::relaxed(&*drv).unwrap();
    ///     // In global mode this query would fail and invalidate the capture of `s`.
    ///     // SAFETY: `t` is held by `b`: live.
    ///     assert!(unsafe { drv.stream_query(t.raw()) }.unwrap());
    /// }
    /// assert!(g.end().is_ok());
    /// ```
    ///
    /// # Errors
    /// As [`CaptureModeGuard::new`].
    pub fn relaxed(driver: &'d dyn Driver) -> Result<Self> {
        Self::new(driver, CaptureMode::Relaxed)
    }

    /// The mode that will be restored.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::{self, CaptureMode}, CaptureModeGuard};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let g = CaptureModeGuard::relaxed(&*drv).unwrap();
    /// assert_eq!(g.previous(), CaptureMode::Global);  // every thread starts in global mode
    /// ```
    pub fn previous(&self) -> CaptureMode {
        self.previous
    }
}

impl Drop for CaptureModeGuard<'_> {
    fn drop(&mut self) {
        // A refused switch back is tried again; if every try fails, the thread stays relaxed,
        // which invalidates no capture.
        tries(|| {
            self.driver
                .thread_exchange_capture_mode(self.previous)
                .map(drop)
        });
    }
}

/// How many times [`tries`] makes a call.
const TRIES: usize = 3;

/// Makes `f`, a driver call that frees, destroys, releases or restores something, until it
/// succeeds, at most three times; returns whether it succeeded. A failed call has no effect
/// ([`Driver`]'s contract), so a transient failure (or an injected one) leaks nothing. Where
/// every try fails, the caller leaks what the driver refuses to free (safe) or reports it.
pub(crate) fn tries(mut f: impl FnMut() -> Result<()>) -> bool {
    (0..TRIES).any(|_| f().is_ok())
}
