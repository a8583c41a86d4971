//! The real driver: `libcuda` opened at run time through `cuda-stream-pool-sys`.
//!
//! Every entry point is looked up in the library's table when it is first used; a missing one is
//! [`Error::MissingSymbol`] naming the symbol and the CUDA version that introduced it. Every
//! result code is checked.

use super::*;
use crate::error::{Error, ErrorCode, MissingSymbol};
use cuda_stream_pool_sys::{ffi, introduced_in, Library};
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_uint, c_void};

/// The CUDA driver, loaded from `libcuda.so.1` (or the path in `CUDA_STREAM_POOL_LIBCUDA`).
#[derive(Debug)]
pub struct CudaDriver {
    lib: Library,
}

/// Fetches an entry point from the table, or returns `MissingSymbol` from the calling function.
macro_rules! sym {
    ($self:ident . $name:ident) => {
        match &$self.lib.table().$name {
            Ok(f) => *f,
            Err(_) => {
                return Err(Error::MissingSymbol(MissingSymbol {
                    symbol: stringify!($name),
                    since: introduced_in(stringify!($name)),
                }))
            }
        }
    };
}

fn ptr<T>(h: u64) -> *mut T {
    h as usize as *mut T
}

fn handle<T>(p: *mut T) -> u64 {
    p as usize as u64
}

impl CudaDriver {
    /// Opens the driver library (the path in `CUDA_STREAM_POOL_LIBCUDA` when set, else
    /// `libcuda.so.1`, then `libcuda.so`). Does not call `cuInit`.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::{CudaDriver, Driver}, Error};
    /// match CudaDriver::open() {
    ///     Ok(d) => assert_eq!(d.kind(), "cuda"),
    ///     // Without a driver library: every path tried, with the loader's reason.
    ///     Err(Error::LibraryNotFound(e)) => assert!(!e.tried.is_empty()),
    ///     Err(e) => panic!("{e}"),
    /// }
    /// ```
    ///
    /// # Errors
    /// [`Error::LibraryNotFound`] when no candidate opens; nothing else (a missing entry point
    /// is reported when it is first used).
    pub fn open() -> Result<CudaDriver> {
        Ok(CudaDriver {
            lib: Library::open()?,
        })
    }

    /// The path the library was opened from.
    ///
    /// ```
    /// use cuda_stream_pool::driver::CudaDriver;
    /// if let Ok(d) = CudaDriver::open() {
    ///     assert!(!d.library_path().is_empty());     // e.g. "libcuda.so.1"
    /// }
    /// ```
    pub fn library_path(&self) -> &str {
        self.lib.path()
    }

    fn check(&self, r: ffi::CUresult, call: &'static str) -> Result<()> {
        if r == ffi::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let code = ErrorCode(r.0);
        let name = code.known_name().or_else(|| self.driver_error_name(r));
        Err(Error::Driver {
            code,
            name: name.unwrap_or("CUDA_ERROR_(unnamed)"),
            call,
        })
    }

    fn driver_error_name(&self, r: ffi::CUresult) -> Option<&'static str> {
        let f = self.lib.table().cuGetErrorName.as_ref().ok()?;
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static, NUL-terminated string owned by the
        // driver (valid for the life of the process) or leaves it null for an unknown code.
        let ok = unsafe { f(r, &mut s) } == ffi::CUresult::CUDA_SUCCESS;
        if !ok || s.is_null() {
            return None;
        }
        // SAFETY: `s` is non-null and points to a static C string (see above).
        unsafe { CStr::from_ptr(s) }.to_str().ok()
    }

    /// `cuGetErrorString` for a code, when the driver knows it.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::CudaDriver, ErrorCode};
    /// if let Ok(d) = CudaDriver::open() {
    ///     // a description such as "out of memory", when the driver has one
    ///     if let Some(text) = d.error_string(ErrorCode::ERROR_OUT_OF_MEMORY) {
    ///         assert!(!text.is_empty());
    ///     }
    /// }
    /// ```
    pub fn error_string(&self, code: ErrorCode) -> Option<String> {
        let f = self.lib.table().cuGetErrorString.as_ref().ok()?;
        let mut s: *const c_char = std::ptr::null();
        // SAFETY: as for cuGetErrorName: the driver returns a static string or leaves s null.
        let ok = unsafe { f(ffi::CUresult(code.0), &mut s) } == ffi::CUresult::CUDA_SUCCESS;
        if !ok || s.is_null() {
            return None;
        }
        // SAFETY: non-null static C string.
        Some(unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned())
    }

    fn status(raw: ffi::CUstreamCaptureStatus) -> CaptureStatus {
        match raw.0 {
            1 => CaptureStatus::Active,
            2 => CaptureStatus::Invalidated,
            _ => CaptureStatus::None,
        }
    }
}

extern "C" fn host_trampoline(data: *mut c_void) {
    // SAFETY: `data` is the `Box<HostFn>` leaked by `launch_host_func`; the driver calls the
    // trampoline exactly once per successful launch, so ownership is taken back exactly once.
    let f = unsafe { Box::from_raw(data as *mut HostFn) };
    // A panic must not unwind into the driver's thread.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

// SAFETY: every method calls the loaded libcuda entry point of its name with the arguments it
// documents and returns its result code unchanged (`Ok` only for `CUDA_SUCCESS`): the contract is
// the real driver's own.
unsafe impl Driver for CudaDriver {
    fn world(&self) -> usize {
        // Not an address (addresses are aligned): the same for every instance.
        1
    }

    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn init(&self) -> Result<()> {
        let f = sym!(self.cuInit);
        // SAFETY: cuInit takes its flags by value; 0 is the documented value.
        self.check(unsafe { f(0) }, "cuInit")
    }

    fn driver_version(&self) -> Result<i32> {
        let f = sym!(self.cuDriverGetVersion);
        let mut v: c_int = 0;
        // SAFETY: `v` is a live local the driver writes one int into.
        self.check(unsafe { f(&mut v) }, "cuDriverGetVersion")?;
        Ok(v)
    }

    fn device_count(&self) -> Result<i32> {
        let f = sym!(self.cuDeviceGetCount);
        let mut n: c_int = 0;
        // SAFETY: out-parameter is a live local.
        self.check(unsafe { f(&mut n) }, "cuDeviceGetCount")?;
        Ok(n)
    }

    fn device_get(&self, ordinal: i32) -> Result<Device> {
        let f = sym!(self.cuDeviceGet);
        let mut d: ffi::CUdevice = 0;
        // SAFETY: out-parameter is a live local; the driver validates the ordinal.
        self.check(unsafe { f(&mut d, ordinal) }, "cuDeviceGet")?;
        Ok(Device(d as u32 as u64))
    }

    fn device_name(&self, dev: Device) -> Result<String> {
        let f = sym!(self.cuDeviceGetName);
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        self.check(
            unsafe { f(buf.as_mut_ptr(), buf.len() as c_int, dev.0 as ffi::CUdevice) },
            "cuDeviceGetName",
        )?;
        // SAFETY: the buffer is NUL-terminated by the driver (and zero-initialised besides).
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }

    fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32> {
        let f = sym!(self.cuDeviceGetAttribute);
        let mut v: c_int = 0;
        // SAFETY: out-parameter is a live local; attribute and device are validated by the driver.
        self.check(
            unsafe {
                f(
                    &mut v,
                    ffi::CUdevice_attribute(attr.raw()),
                    dev.0 as ffi::CUdevice,
                )
            },
            "cuDeviceGetAttribute",
        )?;
        Ok(v)
    }

    fn primary_ctx_retain(&self, dev: Device) -> Result<Context> {
        let f = sym!(self.cuDevicePrimaryCtxRetain);
        let mut c: ffi::CUcontext = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local.
        self.check(
            unsafe { f(&mut c, dev.0 as ffi::CUdevice) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Context(handle(c)))
    }

    fn primary_ctx_state(&self, dev: Device) -> Result<(u32, bool)> {
        let f = sym!(self.cuDevicePrimaryCtxGetState);
        let (mut flags, mut active): (std::os::raw::c_uint, std::os::raw::c_int) = (0, 0);
        // SAFETY: out-parameters are live locals; the device is a plain value.
        self.check(
            unsafe { f(dev.0 as ffi::CUdevice, &mut flags, &mut active) },
            "cuDevicePrimaryCtxGetState",
        )?;
        Ok((flags, active != 0))
    }

    unsafe fn primary_ctx_release(&self, dev: Device) -> Result<()> {
        let f = sym!(self.cuDevicePrimaryCtxRelease_v2);
        // SAFETY: plain value argument; releases one retain made by primary_ctx_retain.
        self.check(
            unsafe { f(dev.0 as ffi::CUdevice) },
            "cuDevicePrimaryCtxRelease_v2",
        )
    }

    fn ctx_get_current(&self) -> Result<Context> {
        let f = sym!(self.cuCtxGetCurrent);
        let mut c: ffi::CUcontext = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local.
        self.check(unsafe { f(&mut c) }, "cuCtxGetCurrent")?;
        Ok(Context(handle(c)))
    }

    unsafe fn ctx_set_current(&self, ctx: Context) -> Result<()> {
        let f = sym!(self.cuCtxSetCurrent);
        // SAFETY: the handle came from the driver (or is null, which unbinds).
        self.check(unsafe { f(ptr(ctx.0)) }, "cuCtxSetCurrent")
    }

    fn ctx_get_device(&self) -> Result<Device> {
        let f = sym!(self.cuCtxGetDevice);
        let mut d: ffi::CUdevice = 0;
        // SAFETY: out-parameter is a live local.
        self.check(unsafe { f(&mut d) }, "cuCtxGetDevice")?;
        Ok(Device(d as u32 as u64))
    }

    fn ctx_synchronize(&self) -> Result<()> {
        let f = sym!(self.cuCtxSynchronize);
        // SAFETY: no arguments.
        self.check(unsafe { f() }, "cuCtxSynchronize")
    }

    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)> {
        let f = sym!(self.cuCtxGetStreamPriorityRange);
        let (mut least, mut greatest): (c_int, c_int) = (0, 0);
        // SAFETY: both out-parameters are live locals.
        self.check(
            unsafe { f(&mut least, &mut greatest) },
            "cuCtxGetStreamPriorityRange",
        )?;
        Ok((least, greatest))
    }

    fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream> {
        let f = sym!(self.cuStreamCreateWithPriority);
        let mut s: ffi::CUstream = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local; flags and priority are validated by the driver.
        self.check(
            unsafe { f(&mut s, flags as c_uint, priority) },
            "cuStreamCreateWithPriority",
        )?;
        Ok(Stream(handle(s)))
    }

    unsafe fn stream_destroy(&self, stream: Stream) -> Result<()> {
        let f = sym!(self.cuStreamDestroy_v2);
        // SAFETY: the caller passes a stream it created and no longer uses.
        self.check(unsafe { f(ptr(stream.0)) }, "cuStreamDestroy_v2")
    }

    unsafe fn stream_query(&self, stream: Stream) -> Result<bool> {
        let f = sym!(self.cuStreamQuery);
        // SAFETY: value argument; the driver validates the handle.
        let r = unsafe { f(ptr(stream.0)) };
        if r == ffi::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        self.check(r, "cuStreamQuery").map(|_| true)
    }

    unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        let f = sym!(self.cuStreamSynchronize);
        // SAFETY: value argument.
        self.check(unsafe { f(ptr(stream.0)) }, "cuStreamSynchronize")
    }

    unsafe fn stream_priority(&self, stream: Stream) -> Result<i32> {
        let f = sym!(self.cuStreamGetPriority);
        let mut p: c_int = 0;
        // SAFETY: out-parameter is a live local.
        self.check(unsafe { f(ptr(stream.0), &mut p) }, "cuStreamGetPriority")?;
        Ok(p)
    }

    unsafe fn stream_flags(&self, stream: Stream) -> Result<u32> {
        let f = sym!(self.cuStreamGetFlags);
        let mut v: c_uint = 0;
        // SAFETY: out-parameter is a live local.
        self.check(unsafe { f(ptr(stream.0), &mut v) }, "cuStreamGetFlags")?;
        Ok(v)
    }

    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        let f = sym!(self.cuStreamWaitEvent);
        // SAFETY: value arguments; flags must be 0.
        self.check(
            unsafe { f(ptr(stream.0), ptr(event.0), 0) },
            "cuStreamWaitEvent",
        )
    }

    fn event_create(&self, flags: u32) -> Result<Event> {
        let f = sym!(self.cuEventCreate);
        let mut e: ffi::CUevent = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local.
        self.check(unsafe { f(&mut e, flags as c_uint) }, "cuEventCreate")?;
        Ok(Event(handle(e)))
    }

    unsafe fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        let f = sym!(self.cuEventRecord);
        // SAFETY: value arguments.
        self.check(unsafe { f(ptr(event.0), ptr(stream.0)) }, "cuEventRecord")
    }

    unsafe fn event_query(&self, event: Event) -> Result<bool> {
        let f = sym!(self.cuEventQuery);
        // SAFETY: value argument.
        let r = unsafe { f(ptr(event.0)) };
        if r == ffi::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        self.check(r, "cuEventQuery").map(|_| true)
    }

    unsafe fn event_synchronize(&self, event: Event) -> Result<()> {
        let f = sym!(self.cuEventSynchronize);
        // SAFETY: value argument.
        self.check(unsafe { f(ptr(event.0)) }, "cuEventSynchronize")
    }

    unsafe fn event_destroy(&self, event: Event) -> Result<()> {
        let f = sym!(self.cuEventDestroy_v2);
        // SAFETY: the caller passes an event it created and no longer uses.
        self.check(unsafe { f(ptr(event.0)) }, "cuEventDestroy_v2")
    }

    unsafe fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr> {
        let f = sym!(self.cuMemAllocAsync);
        let mut p: ffi::CUdeviceptr = 0;
        // SAFETY: out-parameter is a live local.
        self.check(
            unsafe { f(&mut p, bytes, ptr(stream.0)) },
            "cuMemAllocAsync",
        )?;
        Ok(DevicePtr(p))
    }

    unsafe fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) -> Result<DevicePtr> {
        let f = sym!(self.cuMemAllocFromPoolAsync);
        let mut p: ffi::CUdeviceptr = 0;
        // SAFETY: out-parameter is a live local.
        self.check(
            unsafe { f(&mut p, bytes, ptr(pool.0), ptr(stream.0)) },
            "cuMemAllocFromPoolAsync",
        )?;
        Ok(DevicePtr(p))
    }

    unsafe fn mem_free_async(&self, p: DevicePtr, stream: Stream) -> Result<()> {
        let f = sym!(self.cuMemFreeAsync);
        // SAFETY: the caller frees an allocation it owns, once; the GPU orders the free after the
        // stream's earlier work.
        self.check(unsafe { f(p.0, ptr(stream.0)) }, "cuMemFreeAsync")
    }

    fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool> {
        let f = sym!(self.cuDeviceGetDefaultMemPool);
        let mut p: ffi::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local.
        self.check(
            unsafe { f(&mut p, dev.0 as ffi::CUdevice) },
            "cuDeviceGetDefaultMemPool",
        )?;
        Ok(MemPool(handle(p)))
    }

    fn mem_pool_create(&self, dev: Device) -> Result<MemPool> {
        let f = sym!(self.cuMemPoolCreate);
        let props = ffi::CUmemPoolProps {
            allocType: ffi::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: ffi::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
            location: ffi::CUmemLocation {
                type_: ffi::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: dev.0 as i32,
            },
            win32SecurityAttributes: std::ptr::null_mut(),
            reserved: [0; 64],
        };
        let mut p: ffi::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local; `props` is a fully initialised CUmemPoolProps
        // (88 bytes, the layout every CUDA version since 11.2 accepts; see wrapper.h).
        self.check(unsafe { f(&mut p, &props) }, "cuMemPoolCreate")?;
        Ok(MemPool(handle(p)))
    }

    unsafe fn mem_pool_destroy(&self, pool: MemPool) -> Result<()> {
        let f = sym!(self.cuMemPoolDestroy);
        // SAFETY: the caller's contract: a pool of ours, destroyed once.
        self.check(unsafe { f(ptr(pool.0)) }, "cuMemPoolDestroy")
    }

    unsafe fn mem_pool_set_attribute(
        &self,
        pool: MemPool,
        attr: MemPoolAttr,
        value: u64,
    ) -> Result<()> {
        let f = sym!(self.cuMemPoolSetAttribute);
        let mut v: u64 = value;
        // SAFETY: the attributes this crate names all take a cuuint64_t, which `v` is.
        self.check(
            unsafe {
                f(
                    ptr(pool.0),
                    ffi::CUmemPool_attribute(attr.raw()),
                    &mut v as *mut u64 as *mut c_void,
                )
            },
            "cuMemPoolSetAttribute",
        )
    }

    unsafe fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64> {
        let f = sym!(self.cuMemPoolGetAttribute);
        let mut v: u64 = 0;
        // SAFETY: as for set: each named attribute is a cuuint64_t written into `v`.
        self.check(
            unsafe {
                f(
                    ptr(pool.0),
                    ffi::CUmemPool_attribute(attr.raw()),
                    &mut v as *mut u64 as *mut c_void,
                )
            },
            "cuMemPoolGetAttribute",
        )?;
        Ok(v)
    }

    fn mem_get_info(&self) -> Result<(usize, usize)> {
        let f = sym!(self.cuMemGetInfo_v2);
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-parameters are live locals.
        self.check(unsafe { f(&mut free, &mut total) }, "cuMemGetInfo_v2")?;
        Ok((free, total))
    }

    unsafe fn memset_d32_async(
        &self,
        dst: DevicePtr,
        value: u32,
        count: usize,
        stream: Stream,
    ) -> Result<()> {
        let f = sym!(self.cuMemsetD32Async);
        // SAFETY: writes device memory only; the driver validates the range against the
        // allocation and reports an error for a bad pointer.
        self.check(
            unsafe { f(dst.0, value, count, ptr(stream.0)) },
            "cuMemsetD32Async",
        )
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let f = sym!(self.cuMemcpyHtoDAsync_v2);
        // SAFETY: the caller guarantees `src` stays readable for `bytes` until the copy completes.
        self.check(
            unsafe { f(dst.0, src as *const c_void, bytes, ptr(stream.0)) },
            "cuMemcpyHtoDAsync_v2",
        )
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let f = sym!(self.cuMemcpyDtoHAsync_v2);
        // SAFETY: the caller guarantees `dst` stays writable for `bytes` until the copy completes.
        self.check(
            unsafe { f(dst as *mut c_void, src.0, bytes, ptr(stream.0)) },
            "cuMemcpyDtoHAsync_v2",
        )
    }

    fn mem_host_alloc(&self, bytes: usize, flags: u32) -> Result<*mut u8> {
        let f = sym!(self.cuMemHostAlloc);
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local; size and flags are validated by the driver.
        self.check(
            unsafe { f(&mut p, bytes, flags as c_uint) },
            "cuMemHostAlloc",
        )?;
        Ok(p as *mut u8)
    }

    unsafe fn mem_host_get_device_pointer(&self, host: *mut u8) -> Result<DevicePtr> {
        let f = sym!(self.cuMemHostGetDevicePointer_v2);
        let mut d: ffi::CUdeviceptr = 0;
        // SAFETY: out-parameter is a live local; the caller passes host-mapped memory; flags
        // must be 0.
        self.check(
            unsafe { f(&mut d, host as *mut c_void, 0) },
            "cuMemHostGetDevicePointer_v2",
        )?;
        Ok(DevicePtr(d))
    }

    unsafe fn mem_free_host(&self, host: *mut u8) -> Result<()> {
        let f = sym!(self.cuMemFreeHost);
        // SAFETY: the caller passes a live allocation of cuMemHostAlloc that nothing uses any more.
        self.check(unsafe { f(host as *mut c_void) }, "cuMemFreeHost")
    }

    unsafe fn stream_write_value64(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        let f = sym!(self.cuStreamWriteValue64_v2);
        // SAFETY: value arguments; the caller keeps `addr` valid until the write has happened.
        self.check(
            unsafe { f(ptr(stream.0), addr.0, value, 0) },
            "cuStreamWriteValue64_v2",
        )
    }

    unsafe fn stream_wait_value32(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u32,
        cond: WaitValue,
    ) -> Result<()> {
        let f = sym!(self.cuStreamWaitValue32_v2);
        // SAFETY: value arguments; the caller keeps `addr` valid until the wait is satisfied.
        self.check(
            unsafe { f(ptr(stream.0), addr.0, value, cond.raw() as c_uint) },
            "cuStreamWaitValue32_v2",
        )
    }

    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()> {
        let f = sym!(self.cuStreamBeginCapture_v2);
        // SAFETY: value arguments.
        self.check(
            unsafe { f(ptr(stream.0), ffi::CUstreamCaptureMode(mode.raw())) },
            "cuStreamBeginCapture_v2",
        )
    }

    unsafe fn stream_end_capture(&self, stream: Stream) -> Result<Graph> {
        let f = sym!(self.cuStreamEndCapture);
        let mut g: ffi::CUgraph = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local.
        let r = unsafe { f(ptr(stream.0), &mut g) };
        if r != ffi::CUresult::CUDA_SUCCESS && !g.is_null() {
            // Not expected, but never leak a graph the driver handed back with an error.
            let d = sym!(self.cuGraphDestroy);
            // SAFETY: `g` is a graph the driver just created and nobody else has seen.
            let _ = unsafe { d(g) };
        }
        self.check(r, "cuStreamEndCapture")?;
        Ok(Graph(handle(g)))
    }

    unsafe fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus> {
        let f = sym!(self.cuStreamIsCapturing);
        let mut st = ffi::CUstreamCaptureStatus(0);
        // SAFETY: out-parameter is a live local.
        self.check(unsafe { f(ptr(stream.0), &mut st) }, "cuStreamIsCapturing")?;
        Ok(Self::status(st))
    }

    unsafe fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)> {
        let mut st = ffi::CUstreamCaptureStatus(0);
        let mut id: ffi::cuuint64_t = 0;
        // CUDA 12.3 and newer: _v3; older drivers (from 11.3): _v2, the same answer for the two
        // outputs used here.
        if let Ok(f) = &self.lib.table().cuStreamGetCaptureInfo_v3 {
            // SAFETY: status and id are live locals; every other output is optional and passed
            // null.
            self.check(
                unsafe {
                    f(
                        ptr(stream.0),
                        &mut st,
                        &mut id,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                },
                "cuStreamGetCaptureInfo_v3",
            )?;
        } else {
            let f = sym!(self.cuStreamGetCaptureInfo_v2);
            // SAFETY: as above.
            self.check(
                unsafe {
                    f(
                        ptr(stream.0),
                        &mut st,
                        &mut id,
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                    )
                },
                "cuStreamGetCaptureInfo_v2",
            )?;
        }
        Ok((Self::status(st), id))
    }

    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        let f = sym!(self.cuThreadExchangeStreamCaptureMode);
        let mut m = ffi::CUstreamCaptureMode(mode.raw());
        // SAFETY: in/out parameter is a live local holding a valid mode.
        self.check(unsafe { f(&mut m) }, "cuThreadExchangeStreamCaptureMode")?;
        Ok(CaptureMode::from_raw(m.0).unwrap_or(CaptureMode::Global))
    }

    unsafe fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec> {
        let f = sym!(self.cuGraphInstantiateWithFlags);
        let mut e: ffi::CUgraphExec = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local; flags 0.
        self.check(
            unsafe { f(&mut e, ptr(graph.0), 0) },
            "cuGraphInstantiateWithFlags",
        )?;
        Ok(GraphExec(handle(e)))
    }

    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        let f = sym!(self.cuGraphLaunch);
        // SAFETY: value arguments.
        self.check(unsafe { f(ptr(exec.0), ptr(stream.0)) }, "cuGraphLaunch")
    }

    unsafe fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        let f = sym!(self.cuGraphUpload);
        // SAFETY: value arguments.
        self.check(unsafe { f(ptr(exec.0), ptr(stream.0)) }, "cuGraphUpload")
    }

    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()> {
        let f = sym!(self.cuGraphExecDestroy);
        // SAFETY: the caller owns the executable graph and no longer uses it.
        self.check(unsafe { f(ptr(exec.0)) }, "cuGraphExecDestroy")
    }

    unsafe fn graph_destroy(&self, graph: Graph) -> Result<()> {
        let f = sym!(self.cuGraphDestroy);
        // SAFETY: the caller owns the graph and no longer uses it.
        self.check(unsafe { f(ptr(graph.0)) }, "cuGraphDestroy")
    }

    unsafe fn graph_node_count(&self, graph: Graph) -> Result<usize> {
        let f = sym!(self.cuGraphGetNodes);
        let mut n: usize = 0;
        // SAFETY: a null node array asks only for the count, written into the live local `n`.
        self.check(
            unsafe { f(ptr(graph.0), std::ptr::null_mut(), &mut n) },
            "cuGraphGetNodes",
        )?;
        Ok(n)
    }

    fn module_load_data(&self, image: &CStr) -> Result<Module> {
        let f = sym!(self.cuModuleLoadData);
        let mut m: ffi::CUmodule = std::ptr::null_mut();
        // SAFETY: `image` is a NUL-terminated PTX text alive for the call; the driver copies it.
        self.check(
            unsafe { f(&mut m, image.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        Ok(Module(handle(m)))
    }

    unsafe fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function> {
        let f = sym!(self.cuModuleGetFunction);
        let mut k: ffi::CUfunction = std::ptr::null_mut();
        // SAFETY: out-parameter is a live local; `name` is NUL-terminated.
        self.check(
            unsafe { f(&mut k, ptr(module.0), name.as_ptr()) },
            "cuModuleGetFunction",
        )?;
        Ok(Function(handle(k)))
    }

    unsafe fn module_unload(&self, module: Module) -> Result<()> {
        let f = sym!(self.cuModuleUnload);
        // SAFETY: the caller owns the module and no longer launches its functions.
        self.check(unsafe { f(ptr(module.0)) }, "cuModuleUnload")
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
        let f = sym!(self.cuLaunchKernel);
        // SAFETY: the caller guarantees `params` matches the kernel's parameters and that its
        // memory accesses are valid; the driver copies the parameter values during the call.
        self.check(
            unsafe {
                f(
                    ptr(func.0),
                    grid[0],
                    grid[1],
                    grid[2],
                    block[0],
                    block[1],
                    block[2],
                    shared_bytes,
                    ptr(stream.0),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }

    unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
        let launch = sym!(self.cuLaunchHostFunc);
        let data = Box::into_raw(Box::new(f)) as *mut c_void;
        // SAFETY: the trampoline takes back the box exactly once when the driver runs it; on a
        // failed launch the driver never calls it, and the box is reclaimed below.
        let r = unsafe { launch(ptr(stream.0), Some(host_trampoline), data) };
        if r != ffi::CUresult::CUDA_SUCCESS {
            // SAFETY: the launch failed, so the driver holds no reference to `data`.
            drop(unsafe { Box::from_raw(data as *mut HostFn) });
        }
        self.check(r, "cuLaunchHostFunc")
    }
}
