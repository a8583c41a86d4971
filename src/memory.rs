//! Stream-ordered device memory that remembers the (stream, generation) of its last use.
//!
//! * Used on another stream: when the last stream's generation is unchanged, the new stream is
//!   ordered after the last use on the GPU (one event record + wait; the CPU never waits). When it
//!   changed, the last stream was handed to a new owner, which only happens once its work had
//!   completed: nothing waits, and above all nothing waits on the new owner's work.
//! * Freed (dropped): on the last stream when its generation is unchanged; on the context's
//!   disposal stream when it was recycled or destroyed. The check and the enqueue happen under the
//!   stream's lock, so a hand-over cannot slip in between.
//! * Dropped while its last stream is being captured (by a [`crate::CaptureGuard`]): the free is
//!   never put into the capture. It is deferred until the capture ends, then enqueued on the
//!   stream (or on the disposal stream if the stream was recycled meanwhile).
//! * Allocated inside a capture: the allocation is a node of the graph, which owns the memory.
//!   Dropped inside the same capture, its free becomes a node too, so that every launch of the
//!   graph allocates and frees it (the usual pattern for temporaries). Dropped after the capture,
//!   it is freed on its stream, which CUDA allows once the graph has run; dropping it before the
//!   graph ever ran is an error of the driver that a destructor cannot report (it is ignored).

use crate::context::Context;
use crate::driver::DevicePtr;
use crate::error::{Error, ErrorCode, Result};
use crate::pool::Slot;
use crate::stream::StreamRef;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// Plain data that can live in device memory: every bit pattern is a valid value.
///
/// # Safety
/// Implement only for `Copy` types without padding for which any bit pattern is valid.
pub unsafe trait DeviceCopy: Copy + Send + Sync + 'static {}

macro_rules! device_copy {
    ($($t:ty),*) => { $(
        // SAFETY: primitive numbers: no padding, every bit pattern valid.
        unsafe impl DeviceCopy for $t {}
    )* };
}
device_copy!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, usize, isize);

struct LastUse {
    slot: Arc<Slot>,
    gen: u64,
}

/// A typed device allocation from `cuMemAllocAsync` that remembers the (stream, generation) of
/// its last use.
///
/// * [`DeviceBuffer::use_on`] another stream: when the last stream's generation is unchanged, the
///   new stream is ordered after the last use on the GPU (event record + wait, no CPU wait); when
///   it changed (the stream was handed to a new owner, which only happens once its work had
///   completed), nothing waits: above all, nothing waits on the new owner's work.
/// * Dropped: freed on the last stream when its generation is unchanged, else on the context's
///   disposal stream (the recycled stream's new owner may be capturing it). The generation check
///   and the enqueue happen under the stream's lock, so a hand-over cannot slip in between.
/// * Dropped while a [`crate::CaptureGuard`] captures its last stream: the free never enters the
///   capture; it is enqueued when the capture ends.
/// * Allocated inside a capture: the graph owns the allocation; drop it inside the same capture
///   (its free becomes a graph node, so every launch allocates and frees it).
///
/// ```
/// use cuda_stream_pool::{driver, Context, DeviceBuffer};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// let a = ctx.owner();
/// let s = a.stream().unwrap();
/// let buf = DeviceBuffer::from_slice(&s, &[1.0f32, 2.0, 3.0]).unwrap();
/// let b = ctx.owner();
/// let t = b.stream().unwrap();
/// buf.use_on(&t).unwrap();                      // t waits for s's copy, on the GPU
/// assert_eq!(buf.to_vec(&t).unwrap(), vec![1.0, 2.0, 3.0]);
/// ```
pub struct DeviceBuffer<T: DeviceCopy> {
    ctx: Context,
    ptr: DevicePtr,
    len: usize,
    last: Mutex<LastUse>,
    /// Allocated while its stream was being captured: the allocation is a node of the graph.
    captured: bool,
    _t: PhantomData<T>,
}

impl<T: DeviceCopy> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// Allocates `len` elements on `stream`, uninitialised (any bit pattern is a valid `T`).
    pub fn alloc(stream: &StreamRef, len: usize) -> Result<Self> {
        stream.check()?;
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|b| *b > 0)
            .ok_or_else(|| Error::invalid(format!("cannot allocate {len} elements")))?;
        let ci = &stream.ctx.inner;
        // The allocation comes from the pool of the stream's device; a current context is only
        // needed when the driver asks for one.
        let ptr = match ci.driver.mem_alloc_async(bytes, stream.slot.raw) {
            Err(e) if e.code() == Some(ErrorCode::ERROR_INVALID_CONTEXT) => {
                ci.bind()?;
                ci.driver.mem_alloc_async(bytes, stream.slot.raw)?
            }
            r => r?,
        };
        Ok(DeviceBuffer {
            ctx: stream.ctx.clone(),
            ptr,
            len,
            last: Mutex::new(LastUse {
                slot: stream.slot.clone(),
                gen: stream.gen,
            }),
            captured: stream.slot.is_capturing(),
            _t: PhantomData,
        })
    }

    /// Allocates `len` zeroed elements on `stream`.
    pub fn zeroed(stream: &StreamRef, len: usize) -> Result<Self> {
        let b = Self::alloc(stream, len)?;
        let words = len * std::mem::size_of::<T>();
        b.ctx.inner.bind()?;
        if words % 4 == 0 {
            b.ctx
                .inner
                .driver
                .memset_d32_async(b.ptr, 0, words / 4, stream.slot.raw)?;
        } else {
            let zeros = vec![0u8; words];
            b.copy_bytes_in(stream, &zeros)?;
        }
        Ok(b)
    }

    /// Allocates on `stream` and copies `data` in (blocking until the copy has completed).
    pub fn from_slice(stream: &StreamRef, data: &[T]) -> Result<Self> {
        let mut b = Self::alloc(stream, data.len())?;
        b.copy_from_host(stream, data)?;
        Ok(b)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements (never: empty allocations are rejected).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device pointer, for kernel parameters. Order the stream first with
    /// [`DeviceBuffer::use_on`].
    pub fn as_raw(&self) -> DevicePtr {
        self.ptr
    }

    /// The context the memory belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Prepares the buffer for work on `stream` and records it as the last use: when the last
    /// stream's generation is unchanged, `stream` is ordered after the last use on the GPU; when
    /// it changed (recycled), nothing waits.
    pub fn use_on(&self, stream: &StreamRef) -> Result<()> {
        stream.check()?;
        if !self.ctx.same(&stream.ctx) {
            return Err(Error::invalid(
                "the buffer belongs to another context than the stream",
            ));
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        if Arc::ptr_eq(&last.slot, &stream.slot) && last.gen == stream.gen {
            return Ok(());
        }
        {
            let st = last.slot.lock();
            if st.generation == last.gen && !st.destroyed {
                if st.capturing {
                    return Err(Error::CaptureInProgress(
                        "the buffer's last stream is capturing; end the capture before using \
                         the buffer on another stream"
                            .into(),
                    ));
                }
                self.ctx.inner.order(last.slot.raw, stream.slot.raw)?;
            }
        }
        *last = LastUse {
            slot: stream.slot.clone(),
            gen: stream.gen,
        };
        Ok(())
    }

    /// Enqueues a host-to-device copy of `data` (bytes of this buffer) on `stream`.
    ///
    /// # Safety
    /// `data` must stay valid and unmodified until the copy has completed.
    unsafe fn enqueue_copy_in(&self, stream: &StreamRef, data: &[u8]) -> Result<()> {
        self.use_on(stream)?;
        // Async copies fail with CUDA_ERROR_INVALID_VALUE unless the stream's context is current
        // on the calling thread (measured on two H200s).
        self.ctx.inner.bind()?;
        // SAFETY: the caller keeps `data` valid until the copy completes; the device range is
        // this allocation (callers check the length).
        unsafe {
            self.ctx.inner.driver.memcpy_htod_async(
                self.ptr,
                data.as_ptr(),
                data.len(),
                stream.slot.raw,
            )
        }
    }

    /// Waits for `stream` after a blocking copy, naming the capture when that is the problem.
    fn finish_copy(&self, stream: &StreamRef) -> Result<()> {
        match self.ctx.inner.driver.stream_synchronize(stream.slot.raw) {
            Err(e) if e.code() == Some(ErrorCode::ERROR_STREAM_CAPTURE_UNSUPPORTED) => {
                Err(Error::CaptureInProgress(
                    "a blocking copy cannot run while its stream is capturing".into(),
                ))
            }
            r => r,
        }
    }

    fn check_len(&self, n: usize, what: &str) -> Result<()> {
        if n == self.len {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "{what}: {n} host elements for a buffer of {}",
                self.len
            )))
        }
    }

    fn copy_bytes_in(&self, stream: &StreamRef, data: &[u8]) -> Result<()> {
        // SAFETY: `data` outlives the call and the stream is synchronized before returning.
        unsafe { self.enqueue_copy_in(stream, data)? };
        self.finish_copy(stream)
    }

    /// Copies `src` into the buffer on `stream`; returns once the copy has completed.
    pub fn copy_from_host(&mut self, stream: &StreamRef, src: &[T]) -> Result<()> {
        self.check_len(src.len(), "copy_from_host")?;
        // SAFETY: `src` outlives the call, which returns only after the copy has completed.
        unsafe { self.copy_from_host_async(stream, src)? };
        self.finish_copy(stream)
    }

    /// Copies the buffer into `dst` on `stream`; returns once the copy has completed.
    pub fn copy_to_host(&self, stream: &StreamRef, dst: &mut [T]) -> Result<()> {
        // SAFETY: `dst` is exclusively borrowed until we return, and we return only after the
        // stream (and so the copy) has completed.
        unsafe { self.copy_to_host_async(stream, dst)? };
        self.finish_copy(stream)
    }

    /// Enqueues a copy of `src` into the buffer on `stream` and returns without waiting.
    ///
    /// # Safety
    /// `src` must stay valid and unmodified until the copy has completed on the GPU (for example
    /// until `stream.synchronize()` returns). For pageable memory the driver reads `src` before
    /// returning; for page-locked memory it reads it later.
    pub unsafe fn copy_from_host_async(&mut self, stream: &StreamRef, src: &[T]) -> Result<()> {
        self.check_len(src.len(), "copy_from_host")?;
        // SAFETY: T is DeviceCopy (plain data without padding), so its bytes may be read as u8;
        // the caller keeps `src` valid until the copy completes.
        unsafe {
            let bytes =
                std::slice::from_raw_parts(src.as_ptr() as *const u8, std::mem::size_of_val(src));
            self.enqueue_copy_in(stream, bytes)
        }
    }

    /// Enqueues a copy of the buffer into `dst` on `stream` and returns without waiting.
    ///
    /// # Safety
    /// `dst` must stay valid, and must be neither read nor written by the host, until the copy has
    /// completed on the GPU (for example until `stream.synchronize()` returns).
    pub unsafe fn copy_to_host_async(&self, stream: &StreamRef, dst: &mut [T]) -> Result<()> {
        self.check_len(dst.len(), "copy_to_host")?;
        self.use_on(stream)?;
        self.ctx.inner.bind()?;
        // SAFETY: the caller keeps `dst` valid and untouched until the copy completes; any bytes
        // are a valid T (DeviceCopy).
        unsafe {
            self.ctx.inner.driver.memcpy_dtoh_async(
                dst.as_mut_ptr() as *mut u8,
                self.ptr,
                std::mem::size_of_val(dst),
                stream.slot.raw,
            )
        }
    }

    /// Copies the buffer into a new vector on `stream`; returns once the copy has completed.
    pub fn to_vec(&self, stream: &StreamRef) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: T is DeviceCopy: the zeroed bytes are a valid T; all of them are overwritten.
        unsafe {
            std::ptr::write_bytes(v.as_mut_ptr(), 0, self.len);
            v.set_len(self.len);
        }
        self.copy_to_host(stream, &mut v)?;
        Ok(v)
    }

    /// Sets every element to `value` on `stream` (asynchronously). `T` must be 4 bytes wide.
    pub fn fill(&mut self, stream: &StreamRef, value: T) -> Result<()> {
        if std::mem::size_of::<T>() != 4 {
            return Err(Error::invalid("fill needs a 4-byte element type"));
        }
        self.use_on(stream)?;
        self.ctx.inner.bind()?;
        // SAFETY: T is 4 bytes of plain data (checked above), so it can be read as a u32.
        let word: u32 = unsafe { std::mem::transmute_copy(&value) };
        self.ctx
            .inner
            .driver
            .memset_d32_async(self.ptr, word, self.len, stream.slot.raw)
    }

    /// The stream and generation of the last use, for tests and diagnostics: (raw stream,
    /// generation, whether that generation is still current).
    pub fn last_use(&self) -> (crate::driver::Stream, u64, bool) {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let st = last.slot.lock();
        (
            last.slot.raw,
            last.gen,
            st.generation == last.gen && !st.destroyed,
        )
    }
}

impl<T: DeviceCopy> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        let ci = &self.ctx.inner;
        let last = self.last.get_mut().unwrap_or_else(|p| p.into_inner());
        let st = last.slot.lock();
        if self.captured {
            // The graph owns the allocation: a free during the same capture becomes the graph's
            // free node; after the capture, a stream-ordered free (valid once the graph has run).
            // It is tried twice and not kept for later (a later retry would be outside the graph).
            let on = if st.generation == last.gen && !st.destroyed {
                last.slot.raw
            } else {
                ci.disposal.raw
            };
            if ci.driver.mem_free_async(self.ptr, on).is_err() {
                let _ = ci.driver.mem_free_async(self.ptr, on);
            }
            return;
        }
        if st.generation == last.gen && !st.destroyed {
            if st.capturing {
                drop(st);
                ci.deferred.lock().unwrap_or_else(|p| p.into_inner()).push((
                    self.ptr,
                    last.slot.clone(),
                    last.gen,
                ));
                return;
            }
            if ci.driver.mem_free_async(self.ptr, last.slot.raw).is_ok() {
                return;
            }
            // Dropped on a thread where another context is current? Bind and try again.
            if ci.bind().is_ok() && ci.driver.mem_free_async(self.ptr, last.slot.raw).is_ok() {
                return;
            }
            // The free could not be enqueued on the last stream: free on the disposal stream,
            // ordered after the last use (its generation is current, so its work may be pending).
            let _ = ci.order(last.slot.raw, ci.disposal.raw);
        }
        drop(st);
        if ci.free_on_disposal(self.ptr).is_err()
            && (ci.bind().is_err() || ci.free_on_disposal(self.ptr).is_err())
        {
            // Retried by the next `Context::trim`, the end of a capture, or teardown.
            let gen = ci.disposal.lock().generation;
            ci.deferred.lock().unwrap_or_else(|p| p.into_inner()).push((
                self.ptr,
                ci.disposal.clone(),
                gen,
            ));
        }
    }
}
