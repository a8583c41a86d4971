//! Stream-ordered device memory that remembers the (stream, generation) of its last use.
//!
//! * A use of a buffer on a stream is a [`BufferUse`] guard: made by [`DeviceBuffer::use_on`],
//!   it orders the stream after the buffer's last use (when that stream's generation is
//!   unchanged; a recycled stream's work has completed, so nothing waits, and above all nothing
//!   waits on its new owner), records the stream as the last use at once (before the caller
//!   enqueues anything, so that a leaked guard is still a use), and holds the buffer's use lock
//!   while the caller enqueues its work. A second thread's use of the same buffer therefore
//!   orders after that work, never before it, and the free orders after it even when the guard
//!   is leaked (see [`BufferUse`] for what a leak costs).
//! * Freed (the last reference dropped): ordered after the last use, on its stream when its
//!   generation is unchanged, else on the context's disposal stream; in relaxed capture mode so
//!   that no capture anywhere is invalidated. A free that cannot be enqueued now (its stream is
//!   capturing, or the driver refuses) is kept and retried, ordered: never issued unordered.
//! * Used inside a capture: the buffer is registered with the capture, the graph keeps it alive,
//!   and every launch of the graph is a use of it.
//! * Not allowed on a capturing stream: allocation (allocate before `begin_capture`), blocking and
//!   host copies (a captured copy would read or write host memory on every launch).

use crate::context::Context;
use crate::ctx_ref::CtxRef;
use crate::driver::DevicePtr;
use crate::error::{Error, Result};
use crate::hostfn::off_host_fn_thread;
use crate::pool::{CapturedUse, Slot};
use crate::stream::StreamRef;
use crate::sync::{Mutex, MutexGuard};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Plain data that can live in device memory: every bit pattern is a valid value.
///
/// Implemented for the primitive integers and floats, and with the `half` feature for
/// `half::f16` and `half::bf16`. Not for `bool` or `char` (not every bit pattern is one: a
/// kernel writing 2 into a `bool` would make reading it back undefined behaviour); use `u8` and
/// `u32` on the device. Your own `#[repr(C)]` types without padding can implement it.
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
#[cfg(feature = "half")]
device_copy!(half::f16, half::bf16);

struct LastUse {
    slot: Arc<Slot>,
    gen: u64,
}

/// A small number per thread, for telling whether the calling thread already holds a buffer's
/// use lock (which would otherwise deadlock).
fn thread_tag() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TAG: u64 = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TAG.try_with(|t| *t).unwrap_or(u64::MAX)
}

/// The allocation and its last use, shared by the [`DeviceBuffer`] and the graphs whose work
/// uses it; freed (ordered) when the last of them is gone.
pub(crate) struct BufCore {
    ctx: CtxRef,
    ptr: DevicePtr,
    bytes: usize,
    last: Mutex<LastUse>,
    /// The tag of the thread holding `last` through a [`BufferUse`], 0 when none.
    holder: AtomicU64,
    /// Whether the allocation is still the crate's to free: `false` once it was handed to
    /// another owner of it ([`DeviceBuffer::into_raw_on`]).
    owned: bool,
}

impl Drop for BufCore {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let last = self.last.get_mut();
        let (ctx, ptr, slot, gen) = (self.ctx.clone(), self.ptr, last.slot.clone(), last.gen);
        off_host_fn_thread(move || {
            // SAFETY: the allocation is ours, freed only here; every use was recorded in `last`
            // when its `BufferUse` was made, before its work was enqueued, each ordered after
            // the one before, so all of them (a leaked guard's included: its record is already
            // there) precede the end of generation `gen` of `slot`'s stream.
            unsafe { ctx.inner.free_or_defer(ptr, &slot, gen) };
            ctx.inner.flush_deferred();
        });
    }
}

/// A use of a buffer on a stream, in progress: when the guard is made, the stream is ordered
/// after the buffer's last use and becomes the buffer's last use, and the buffer's use lock is
/// held until the guard is dropped. Enqueue the work that uses [`BufferUse::ptr`] while the
/// guard lives. Not `Send`: it holds a lock of the thread that made it.
///
/// A leaked guard (`mem::forget`, a reference cycle) is still a use: the buffer's free is
/// ordered after the work enqueued under it, as if it had been dropped. What the leak costs is
/// the use lock, kept for ever, as with a forgotten `MutexGuard`: later uses of the buffer from
/// the leaking thread fail with [`Error::InvalidArgument`] (and [`DeviceBuffer::last_use`]
/// returns `None` there); uses from other threads (and their `last_use`, and launches of graphs
/// that use the buffer) block for ever. Dropping the buffer (or the last graph that uses it) is
/// never blocked and frees it, ordered.
///
/// Captures: a use made inside a capture of the crate's ([`StreamRef::begin_capture`]) is
/// registered with it (its graph keeps the buffer); a use on a lent stream that its borrower is
/// capturing is refused ([`Error::CaptureInProgress`]: that graph would keep nothing). Enqueue the
/// work in the capture state the stream had when the guard was made: a capture begun later does
/// not know the buffer.
///
/// ```
/// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let (a, b) = (ctx.owner(), ctx.owner());
/// let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
/// let buf = DeviceBuffer::<f32>::zeroed(&sa, 256).unwrap();
/// {
///     let u = buf.use_on(&sb).unwrap();   // sb now waits for sa's memset, on the GPU
///     let _ptr = u.ptr();                 // launch work on sb with it here (e.g. with cudarc)
///     assert!(buf.use_on(&sa).is_err());  // this thread already holds the use lock
/// }                                       // the use lock is free again
/// assert!(buf.last_use().unwrap().0 == sb.raw());   // sb is the buffer's last use
/// ```
#[must_use = "the use lock is held while the guard lives: enqueue the work while it lives"]
pub struct BufferUse<'b> {
    core: &'b BufCore,
    /// The buffer's use lock; the last use it guards is already this use's stream.
    last: MutexGuard<'b, LastUse>,
}

impl std::fmt::Debug for BufferUse<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferUse")
            .field("ptr", &self.core.ptr)
            .field("bytes", &self.core.bytes)
            .finish()
    }
}

impl BufferUse<'_> {
    /// The device pointer, for the work enqueued while the guard lives.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let buf = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    /// {
    ///     let u = buf.use_on(&s).unwrap();
    ///     // SAFETY: the allocation holds 4 words and stays live, ordered on `s`, while `u`
    ///     // lives; `s` is held by its owner.
    ///     unsafe { ctx.driver().memset_d32_async(u.ptr(), 9, 4, s.raw()) }.unwrap();
    /// }                                              // `s` is the last use (since `use_on`)
    /// assert_eq!(buf.to_vec(&s).unwrap(), vec![9; 4]);
    /// ```
    pub fn ptr(&self) -> DevicePtr {
        self.core.ptr
    }

    /// The allocation's size in bytes.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let buf = DeviceBuffer::<f32>::zeroed(&s, 256).unwrap();
    /// assert_eq!(buf.use_on(&s).unwrap().bytes(), 1024);
    /// ```
    pub fn bytes(&self) -> usize {
        self.core.bytes
    }

    /// The buffer's context (a borrow: a leaked guard keeps no clone of it).
    #[cfg(feature = "cudarc")]
    pub(crate) fn context(&self) -> &Context {
        &self.core.ctx
    }
}

impl Drop for BufferUse<'_> {
    fn drop(&mut self) {
        // The use was recorded when the guard was made; dropping it only lets others in.
        self.core.holder.store(0, Ordering::Release);
    }
}

impl BufCore {
    /// Begins a use of the buffer on `stream` (see [`BufferUse`]).
    fn begin_use<'b>(self: &'b Arc<Self>, stream: &StreamRef<'_>) -> Result<BufferUse<'b>> {
        if !self.ctx.same(stream.ctx()) {
            return Err(Error::invalid(
                "the buffer belongs to another context than the stream",
            ));
        }
        let me = thread_tag();
        if self.holder.load(Ordering::Acquire) == me {
            return Err(Error::invalid(
                "the buffer is already in use on this thread (a BufferUse of it is alive)",
            ));
        }
        let mut last = self.last.lock();
        last.held_by_user();
        self.holder.store(me, Ordering::Release);
        let mut u = BufferUse { core: self, last };
        let (slot, gen) = (stream.slot(), stream.gen);
        let capturing = stream.capturing_now();
        if capturing && !slot.is_capturing() {
            // A capture the crate did not begin: the borrower of a lent stream captures it. Work
            // enqueued now would go into the borrower's graph, which keeps nothing of the
            // crate's alive (only a `CaptureGuard` hands its uses to a graph).
            return Err(foreign_capture());
        }
        let same = stream.is_slot(&u.last.slot) && u.last.gen == gen;
        if !same {
            let prev = u.last.slot.clone();
            let st = prev.lock();
            // SAFETY (capturing): the previous stream is live (generation current, under its
            // lock).
            if st.is_live(u.last.gen) {
                if st.capturing || unsafe { self.ctx.inner.capturing(&prev) } {
                    return Err(Error::CaptureInProgress(
                        "the buffer's last use is in a capture in progress on another stream; \
                         end the capture before using the buffer elsewhere"
                            .into(),
                    ));
                }
                let ci = &self.ctx.inner;
                if capturing {
                    // A capturing stream cannot wait on work outside its capture (the driver
                    // invalidates the capture, CUDA_ERROR_STREAM_CAPTURE_ISOLATION): that work
                    // must have completed already.
                    // SAFETY: the previous stream is live (generation current, under its lock);
                    // the query runs in relaxed mode (the device rules).
                    if !unsafe { ci.driver.stream_query(prev.observe()) }? {
                        return Err(Error::CaptureInProgress(
                            "the buffer's last use, on another stream, may still be running: a \
                             capture cannot wait for it; synchronize that stream (or use the \
                             buffer on this stream) before begin_capture"
                                .into(),
                        ));
                    }
                } else {
                    // SAFETY: both streams are live (the previous one under its lock, the new
                    // one held by the reference's holder) and neither is capturing.
                    unsafe { ci.order(&prev, slot) }?;
                }
            }
        }
        if capturing {
            let r: CapturedUse = self.clone();
            slot.lock().add_captured(r);
        }
        // The use is registered now, before the caller enqueues anything: the free (and every
        // later use) orders after `stream` even if the guard is leaked and never dropped.
        if !same {
            *u.last = LastUse {
                slot: stream.slot_arc(),
                gen,
            };
        }
        Ok(u)
    }
}

/// The error for buffer work on a stream that its borrower is capturing.
pub(crate) fn foreign_capture() -> Error {
    Error::CaptureInProgress(
        "the stream is lent and its borrower is capturing it: the crate's work would go into a \
         graph that does not keep the crate's buffers alive; end that capture first (or capture \
         with the crate's begin_capture)"
            .into(),
    )
}

/// Begins uses of `cores` on `stream`, taking the use locks in address order (one global order:
/// no deadlock between threads); the uses are returned in the order given.
pub(crate) fn begin_uses<'b>(
    stream: &StreamRef<'_>,
    cores: &[&'b Arc<BufCore>],
) -> Result<Vec<BufferUse<'b>>> {
    let mut order: Vec<usize> = (0..cores.len()).collect();
    order.sort_by_key(|&i| Arc::as_ptr(cores[i]) as usize);
    if order
        .windows(2)
        .any(|w| Arc::ptr_eq(cores[w[0]], cores[w[1]]))
    {
        return Err(Error::invalid("one buffer appears twice in a use"));
    }
    let mut taken: Vec<Option<BufferUse<'b>>> = (0..cores.len()).map(|_| None).collect();
    for i in order {
        taken[i] = Some(cores[i].begin_use(stream)?);
    }
    Ok(taken.into_iter().flatten().collect())
}

/// Runs `launch` (a graph launch on `stream`) as a use of every buffer in `uses`: the stream is
/// ordered after each one's last use and recorded as its last use before the launch. The buffers'
/// use locks are taken in address order, so concurrent launches cannot deadlock.
pub(crate) fn launch_with_uses(
    uses: &[CapturedUse],
    stream: &StreamRef<'_>,
    launch: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let cores: Vec<Arc<BufCore>> = uses
        .iter()
        .filter_map(|u| u.clone().downcast::<BufCore>().ok())
        .collect();
    let refs: Vec<&Arc<BufCore>> = cores.iter().collect();
    let _uses = begin_uses(stream, &refs)?;
    launch()
}

/// A typed device allocation from the context's memory pool ([`Context::mem_pool`];
/// `cuMemAllocFromPoolAsync`, or `cuMemAllocAsync` for [`crate::MemPoolChoice::DeviceDefault`]) that remembers the (stream, generation) of
/// its last use. In short (the crate docs' safety contract has the rules), every use goes through a
/// [`BufferUse`] (the crate's copies and kernels make one), and the free is always ordered after
/// the last use.
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
/// assert_eq!(buf.to_vec(&t).unwrap(), vec![1.0, 2.0, 3.0]);   // t waits for s's copy
/// ```
pub struct DeviceBuffer<T: DeviceCopy> {
    core: Arc<BufCore>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: DeviceCopy> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &self.core.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// Allocates `len` elements on `stream`, uninitialised (any bit pattern is a valid `T`). The
    /// allocation runs in relaxed capture mode: it invalidates no capture of any thread.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// let b = DeviceBuffer::<u8>::alloc(&s, 100).unwrap();
    /// assert_eq!(b.len(), 100);
    /// assert!(DeviceBuffer::<u8>::alloc(&s, 0).is_err());
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero elements or a size that overflows;
    /// [`Error::CaptureInProgress`] on a capturing stream (allocate before the capture); the
    /// driver's error, e.g. out of memory.
    pub fn alloc(stream: &StreamRef<'_>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .filter(|b| *b > 0)
            .ok_or_else(|| Error::invalid(format!("cannot allocate {len} elements")))?;
        // Rounded up to whole 4-byte words, so that a 32-bit memset can zero any buffer
        // (`DeviceBuffer::zeroed`) without a host copy.
        let padded = bytes
            .checked_next_multiple_of(4)
            .ok_or_else(|| Error::invalid(format!("cannot allocate {len} elements")))?;
        stream.not_capturing("allocating")?;
        let ci = &stream.ctx().inner;
        // One scope for the retried frees and the allocation (relaxed mode once).
        let _scope = ci.scope();
        ci.flush_deferred();
        let d = &*ci.driver;
        // From the pool the crate chose: its own pool by name (`cuMemAllocAsync` would take the
        // device's current pool, the default one), else the device's current pool. Relaxed
        // mode and the context: the device rules.
        // SAFETY: the stream is held by the reference's holder (live); the crate's own pool
        // lives as long as the context (`ci`); the memory is freed by `BufCore::drop`, ordered
        // after its last use.
        let ptr = unsafe {
            if ci.own_pool {
                d.mem_alloc_from_pool_async(padded, ci.mem_pool, stream.slot().enqueue())
            } else {
                d.mem_alloc_async(padded, stream.slot().enqueue())
            }
        }?;
        Ok(Self::owning(stream, ptr, bytes, len))
    }

    /// The buffer that owns allocation `ptr` (`bytes` of it in use, `len` elements), its last
    /// use `stream`'s current generation.
    fn owning(stream: &StreamRef<'_>, ptr: DevicePtr, bytes: usize, len: usize) -> Self {
        DeviceBuffer {
            core: Arc::new(BufCore {
                ctx: CtxRef::new(stream.ctx()),
                ptr,
                bytes,
                last: Mutex::new(LastUse {
                    slot: stream.slot_arc(),
                    gen: stream.gen,
                }),
                holder: AtomicU64::new(0),
                owned: true,
            }),
            len,
            _t: PhantomData,
        }
    }

    /// A buffer of an allocation that another owner hands to the crate (cudarc's `CudaSlice`),
    /// its last use `stream`.
    ///
    /// # Safety
    /// `ptr` is a live device allocation of `stream`'s context, of at least `len` elements of
    /// `T` (`len * size_of::<T>()` bytes, `len > 0`), that `cuMemFreeAsync` frees (stream-ordered
    /// memory); nobody else frees or uses it from now on, and every use of it so far is ordered
    /// before the work `stream` has now (the crate frees it ordered after that).
    #[cfg(feature = "cudarc")]
    pub(crate) unsafe fn from_raw_on(stream: &StreamRef<'_>, ptr: DevicePtr, len: usize) -> Self {
        Self::owning(stream, ptr, len * std::mem::size_of::<T>(), len)
    }

    /// Hands the allocation over (to cudarc's `CudaSlice`): once `stream` is ordered after the
    /// buffer's last use, the buffer gives up the allocation without freeing it and returns
    /// `(pointer, elements)`; the caller then owns the memory, and work it enqueues on `stream`
    /// comes after every use the crate made of it. On an error the buffer is given back,
    /// unchanged but for an ordering that may have been enqueued.
    ///
    /// Refused (with the buffer back) when the buffer is of another context than the stream,
    /// when the stream is capturing, when a graph (or a pending operation of the crate) still
    /// keeps the allocation, when its last use is in a capture in progress, and on the driver's
    /// error of the ordering.
    #[cfg(feature = "cudarc")]
    pub(crate) fn into_raw_on(
        self,
        stream: &StreamRef<'_>,
    ) -> std::result::Result<(DevicePtr, usize), (Error, Self)> {
        let len = self.len;
        if !self.core.ctx.same(stream.ctx()) {
            let e = Error::invalid("the buffer belongs to another context than the stream");
            return Err((e, self));
        }
        if let Err(e) = stream.not_capturing("handing a buffer over") {
            return Err((e, self));
        }
        let mut core = match Arc::try_unwrap(self.core) {
            Ok(core) => core,
            Err(core) => {
                let e = Error::invalid(
                    "the buffer is still kept by a graph (or a pending operation of the crate): \
                     drop the graphs that use it first",
                );
                return Err((
                    e,
                    DeviceBuffer {
                        core,
                        len,
                        _t: PhantomData,
                    },
                ));
            }
        };
        // No guard can be alive (the buffer is ours by value); a leaked one's use is recorded in
        // `last` already, and its lock is not taken here (`get_mut`).
        let last = core.last.get_mut();
        let (slot, gen) = (stream.slot(), stream.gen);
        let ordered = if stream.is_slot(&last.slot) && last.gen == gen {
            Ok(())
        } else {
            let prev = last.slot.clone();
            let st = prev.lock();
            if !st.is_live(last.gen) {
                Ok(()) // recycled: that generation's work has completed
                       // SAFETY: the previous stream is live (generation current, under its lock).
            } else if st.capturing || unsafe { core.ctx.inner.capturing(&prev) } {
                Err(Error::CaptureInProgress(
                    "the buffer's last use is in a capture in progress on another stream; end \
                     the capture before handing the buffer over"
                        .into(),
                ))
            } else {
                // SAFETY: both streams are live (the previous one under its lock, `stream` held
                // by the reference's holder) and neither is capturing.
                unsafe { core.ctx.inner.order(&prev, slot) }
            }
        };
        if let Err(e) = ordered {
            let core = Arc::new(core);
            return Err((
                e,
                DeviceBuffer {
                    core,
                    len,
                    _t: PhantomData,
                },
            ));
        }
        core.owned = false;
        Ok((core.ptr, len))
    }

    /// Allocates `len` zeroed elements on `stream`.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// assert_eq!(DeviceBuffer::<u16>::zeroed(&s, 3).unwrap().to_vec(&s).unwrap(), vec![0; 3]);
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`]; the driver's error for the memset.
    pub fn zeroed(stream: &StreamRef<'_>, len: usize) -> Result<Self> {
        let mut b = Self::alloc(stream, len)?;
        // Every size: the allocation is padded to whole words (`alloc`). No host copy, no wait.
        let words = b.core.bytes.div_ceil(4);
        b.memset_words(stream, 0, words)?;
        Ok(b)
    }

    /// Allocates on `stream` and copies `data` in (blocking until the copy has completed).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::from_slice(&s, &[1u8, 2, 3]).unwrap();
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![1, 2, 3]);
    /// assert!(DeviceBuffer::<u8>::from_slice(&s, &[]).is_err());   // no empty allocations
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`] and [`DeviceBuffer::copy_from_host`].
    pub fn from_slice(stream: &StreamRef<'_>, data: &[T]) -> Result<Self> {
        // One scope for the allocation, the copy and its wait: relaxed mode once (both the
        // allocation and the wait need it), the context made current once. No user code runs
        // in it (`T` is plain data; a failed copy drops the buffer: the crate's own free).
        let _scope = stream.ctx().inner.scope();
        let mut b = Self::alloc(stream, data.len())?;
        b.copy_from_host(stream, data)?;
        Ok(b)
    }

    /// Number of elements.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::<u16>::alloc(&s, 7).unwrap();
    /// assert_eq!(b.len(), 7);
    /// ```
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements (never: empty allocations are rejected).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// assert!(!DeviceBuffer::<u8>::alloc(&s, 1).unwrap().is_empty());
    /// assert!(DeviceBuffer::<u8>::alloc(&s, 0).is_err());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device pointer. Work that uses it must be enqueued while a [`BufferUse`] of the
    /// buffer on that stream is alive ([`DeviceBuffer::use_on`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::<f64>::zeroed(&s, 2).unwrap();
    /// assert_eq!(b.as_raw(), b.use_on(&s).unwrap().ptr());
    /// ```
    pub fn as_raw(&self) -> DevicePtr {
        self.core.ptr
    }

    /// The context the memory belongs to.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::<f32>::zeroed(&s, 2).unwrap();
    /// assert_eq!(b.context().raw(), ctx.raw());
    /// ```
    pub fn context(&self) -> &Context {
        &self.core.ctx
    }

    /// Begins a use of the buffer on `stream`: orders `stream` after the buffer's last use (on
    /// the GPU, when the last stream's generation is unchanged; not at all when it was
    /// recycled), records `stream` as the last use, and returns the guard while which the work
    /// is enqueued (holding the buffer's use lock). See [`BufferUse`].
    ///
    /// ```
    /// use cuda_stream_pool::{driver::SimDriver, Context, DeviceBuffer};
    /// use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    /// let buf = DeviceBuffer::<u32>::zeroed(&sa, 1024).unwrap();
    /// {
    ///     let u = buf.use_on(&sa).unwrap();
    ///     // work on `sa` that writes the buffer (here simulated: 1000 ns of writes)
    ///     sim.enqueue_access(sa.raw(), u.ptr(), u.bytes(), true, 1_000).unwrap();
    /// }
    /// {
    ///     let u = buf.use_on(&sb).unwrap();          // `sb` now waits for that work, on the GPU
    ///     sim.enqueue_access(sb.raw(), u.ptr(), u.bytes(), false, 1_000).unwrap();
    /// }
    /// assert_eq!(buf.last_use().unwrap().0, sb.raw());
    /// sb.synchronize().unwrap();
    /// assert!(sim.findings().is_empty());            // the simulation saw no race
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream of another context, or when this thread already
    /// holds a use of the buffer; [`Error::CaptureInProgress`] when the last use is in a capture
    /// in progress on another stream, or when `stream` is capturing and the last use on another
    /// stream may still be running (a capture cannot wait for outside work); the driver's error.
    pub fn use_on<'b>(&'b self, stream: &'b StreamRef<'_>) -> Result<BufferUse<'b>> {
        self.core.begin_use(stream)
    }

    /// Begins uses of several buffers on one stream (see [`DeviceBuffer::use_on`]), returned in
    /// the order given. The buffers' use locks are taken in one global order, so two threads
    /// using the same buffers in different orders cannot deadlock (taking them one by one with
    /// `use_on` can).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// let (x, y) = (DeviceBuffer::<f32>::zeroed(&s, 4).unwrap(), DeviceBuffer::<f32>::zeroed(&s, 4).unwrap());
    /// let uses = DeviceBuffer::use_all(&s, &[&y, &x]).unwrap();
    /// assert_eq!(uses[0].ptr(), y.as_raw());
    /// assert!(DeviceBuffer::use_all(&s, &[&x, &x]).is_err());   // one buffer twice
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a buffer appears twice; as [`DeviceBuffer::use_on`].
    pub fn use_all<'b>(
        stream: &'b StreamRef<'_>,
        bufs: &[&'b DeviceBuffer<T>],
    ) -> Result<Vec<BufferUse<'b>>> {
        let cores: Vec<&'b Arc<BufCore>> = bufs.iter().map(|b| &b.core).collect();
        begin_uses(stream, &cores)
    }

    /// Enqueues a host-to-device copy of `data` (bytes of this buffer) on `stream`.
    ///
    /// # Safety
    /// `data` must stay valid and unmodified until the copy has completed.
    unsafe fn enqueue_copy_in(&self, stream: &StreamRef<'_>, data: &[u8]) -> Result<()> {
        stream.not_capturing("copying from host memory")?;
        let u = self.use_on(stream)?;
        // Async copies fail with CUDA_ERROR_INVALID_VALUE unless the stream's context is current
        // on the calling thread (measured on two H200s): the device rules make it current.
        // SAFETY: the caller keeps `data` valid until the copy completes; the device range is
        // this allocation (callers check the length), kept alive and ordered by `u`; the stream
        // is held and not capturing.
        unsafe {
            self.core.ctx.inner.driver.memcpy_htod_async(
                u.ptr(),
                data.as_ptr(),
                data.len(),
                stream.slot().enqueue(),
            )
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

    fn memset32(&mut self, stream: &StreamRef<'_>, word: u32) -> Result<()> {
        let words = self.core.bytes / 4;
        self.memset_words(stream, word, words)
    }

    /// Sets the first `words` 32-bit words of the allocation to `word` on `stream`; `words` is
    /// at most `bytes.div_ceil(4)` (the allocation is padded to whole words: `alloc`).
    fn memset_words(&mut self, stream: &StreamRef<'_>, word: u32, words: usize) -> Result<()> {
        debug_assert!(words <= self.core.bytes.div_ceil(4));
        let u = self.use_on(stream)?;
        // SAFETY: the allocation holds `bytes.div_ceil(4)` words (`alloc` pads it), of which
        // `words` are set; kept alive and ordered by `u`; the stream is held (live). A memset
        // into a capture becomes a node, and the capture keeps the buffer (registered by
        // `use_on`).
        unsafe {
            self.core.ctx.inner.driver.memset_d32_async(
                u.ptr(),
                word,
                words,
                stream.slot().enqueue(),
            )
        }
    }

    /// Copies `src` into the buffer on `stream`; returns once the copy has completed.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// let mut b = DeviceBuffer::<i32>::alloc(&s, 2).unwrap();
    /// b.copy_from_host(&s, &[5, 6]).unwrap();
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![5, 6]);
    /// assert!(b.copy_from_host(&s, &[1]).is_err());   // wrong length
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; [`Error::CaptureInProgress`] on a
    /// capturing stream; as [`DeviceBuffer::use_on`]; the driver's error.
    pub fn copy_from_host(&mut self, stream: &StreamRef<'_>, src: &[T]) -> Result<()> {
        self.check_len(src.len(), "copy_from_host")?;
        // The copy reads a staging copy of `src`: if the wait fails, the copy may still be
        // pending, and `src` is the caller's again once this returns.
        let staging = src.to_vec();
        // SAFETY: `staging` is kept until the copy has completed: below, or by the context.
        unsafe { self.copy_from_host_async(stream, &staging)? };
        finish_host_copy(stream, Box::new(staging))
    }

    /// Copies the buffer into `dst` on `stream`; returns once the copy has completed.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// let b = DeviceBuffer::from_slice(&s, &[1u64, 2]).unwrap();
    /// let mut out = [0u64; 2];
    /// b.copy_to_host(&s, &mut out).unwrap();
    /// assert_eq!(out, [1, 2]);
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::copy_from_host`].
    pub fn copy_to_host(&self, stream: &StreamRef<'_>, dst: &mut [T]) -> Result<()> {
        self.check_len(dst.len(), "copy_to_host")?;
        let v = self.to_vec(stream)?;
        dst.copy_from_slice(&v);
        Ok(())
    }

    /// Enqueues a copy of `src` into the buffer on `stream` and returns without waiting.
    ///
    /// # Safety
    /// `src` must stay valid and unmodified until the copy has completed on the GPU (for example
    /// until `stream.synchronize()` returns). For pageable memory the driver reads `src` before
    /// returning; for page-locked memory it reads it later.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let mut b = DeviceBuffer::<i32>::alloc(&s, 3).unwrap();
    /// let src = vec![7, 8, 9];
    /// // SAFETY: `src` is neither dropped nor changed before `s.synchronize()` returns.
    /// unsafe { b.copy_from_host_async(&s, &src) }.unwrap();
    /// s.synchronize().unwrap();
    /// assert_eq!(b.to_vec(&s).unwrap(), src);
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::copy_from_host`].
    pub unsafe fn copy_from_host_async(&mut self, stream: &StreamRef<'_>, src: &[T]) -> Result<()> {
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
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::from_slice(&s, &[1.5f32, 2.5]).unwrap();
    /// let mut dst = vec![0.0f32; 2];
    /// // SAFETY: `dst` is neither read, written nor dropped before `s.synchronize()` returns.
    /// unsafe { b.copy_to_host_async(&s, &mut dst) }.unwrap();
    /// s.synchronize().unwrap();
    /// assert_eq!(dst, [1.5, 2.5]);
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::copy_from_host`].
    pub unsafe fn copy_to_host_async(&self, stream: &StreamRef<'_>, dst: &mut [T]) -> Result<()> {
        self.check_len(dst.len(), "copy_to_host")?;
        stream.not_capturing("copying to host memory")?;
        let u = self.use_on(stream)?;
        // SAFETY: the caller keeps `dst` valid and untouched until the copy completes; any bytes
        // are a valid T (DeviceCopy); the device range is this allocation, kept alive and
        // ordered by `u`; the stream is held and not capturing.
        unsafe {
            self.core.ctx.inner.driver.memcpy_dtoh_async(
                dst.as_mut_ptr() as *mut u8,
                u.ptr(),
                std::mem::size_of_val(dst),
                stream.slot().enqueue(),
            )
        }
    }

    /// Copies the buffer into a new vector on `stream`; returns once the copy has completed.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::from_slice(&s, &[4u32, 5, 6]).unwrap();
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![4, 5, 6]);
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::copy_to_host`].
    pub fn to_vec(&self, stream: &StreamRef<'_>) -> Result<Vec<T>> {
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: T is DeviceCopy: the zeroed bytes are a valid T; all of them are overwritten.
        unsafe {
            std::ptr::write_bytes(v.as_mut_ptr(), 0, self.len);
            v.set_len(self.len);
        }
        // SAFETY: `v` is kept until the copy has completed: returned after the wait, or kept by
        // the context when the wait fails (the copy may still be pending then).
        unsafe { self.copy_to_host_async(stream, &mut v)? };
        let mut v = Some(v);
        match stream.synchronize() {
            Ok(()) => Ok(v.take().unwrap_or_default()),
            Err(e) => {
                if let Some(v) = v.take() {
                    keep_for_copy(stream, Box::new(v));
                }
                Err(e)
            }
        }
    }

    /// Sets every element to `value` on `stream` (asynchronously). `T` must be 4 bytes wide.
    /// Allowed in a capture (the graph then keeps the buffer).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// let mut b = DeviceBuffer::<f32>::alloc(&s, 3).unwrap();
    /// b.fill(&s, 1.5).unwrap();
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![1.5; 3]);
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an element type that is not 4 bytes wide; as
    /// [`DeviceBuffer::use_on`]; the driver's error.
    pub fn fill(&mut self, stream: &StreamRef<'_>, value: T) -> Result<()> {
        if std::mem::size_of::<T>() != 4 {
            return Err(Error::invalid("fill needs a 4-byte element type"));
        }
        // SAFETY: T is 4 bytes of plain data (checked above), so it can be read as a u32.
        let word: u32 = unsafe { std::mem::transmute_copy(&value) };
        self.memset32(stream, word)
    }

    /// The stream and generation of the last use, for tests and diagnostics: (raw stream,
    /// generation, whether that generation is still live).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let buf = {
    ///     let first = ctx.owner();
    ///     let s = first.stream().unwrap();
    ///     let buf = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    ///     assert_eq!(buf.last_use().unwrap(), (s.raw(), s.generation(), true));
    ///     buf
    /// };                                         // the owner is gone, its stream retired
    /// assert!(buf.last_use().unwrap().2);                 // not handed over yet: still live
    /// let next = ctx.owner();
    /// let s = next.stream().unwrap();            // the same stream, a new generation
    /// assert_eq!(buf.last_use().unwrap().0, s.raw());
    /// assert!(!buf.last_use().unwrap().2);                // `buf` neither waits for `next` nor frees on `s`
    /// ```
    ///
    /// Blocks while another thread holds a [`BufferUse`] of the buffer; `None` while the calling
    /// thread holds one (its work may not be enqueued yet, and waiting for it would never end).
    pub fn last_use(&self) -> Option<(crate::driver::Stream, u64, bool)> {
        if self.core.holder.load(Ordering::Acquire) == thread_tag() {
            return None;
        }
        let last = self.core.last.lock();
        let live = last.slot.lock().is_live(last.gen);
        // The handle leaves the crate: while its generation is live, work enqueued through it
        // is unseen, so that generation is no longer known idle (R7-3).
        let raw = if live {
            last.slot.expose(last.gen)
        } else {
            last.slot.observe()
        };
        Some((raw, last.gen, live))
    }
}

/// Waits for a host copy on `stream` whose host memory is `mem`; when the wait fails the copy
/// may still be pending, so `mem` is kept by the context until the stream's work is known to be
/// complete.
fn finish_host_copy(stream: &StreamRef<'_>, mem: Box<dyn std::any::Any + Send>) -> Result<()> {
    match stream.synchronize() {
        Ok(()) => Ok(()),
        Err(e) => {
            keep_for_copy(stream, mem);
            Err(e)
        }
    }
}

/// Hands host memory that a pending copy on `stream` may still access to the context.
fn keep_for_copy(stream: &StreamRef<'_>, mem: Box<dyn std::any::Any + Send>) {
    stream
        .ctx()
        .inner
        .keep_host(stream.slot_arc(), stream.gen, mem);
}
