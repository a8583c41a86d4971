//! [`DeviceBuffer`] ↔ cudarc's `CudaSlice`, without copies: the allocation changes owner, the
//! ordering goes with it.
//!
//! * Into cudarc ([`DeviceBuffer::into_cudarc`]): the lent stream is ordered after the buffer's
//!   last use, the buffer gives the allocation up without freeing it, and the slice lives on
//!   that lent stream, so the loan (and with it the crate's state and its memory pool) lasts as
//!   long as the slice. With cudarc's event tracking on, the slice's write event is recorded on
//!   the stream at once: cudarc work on another stream waits for everything the crate did.
//! * From cudarc ([`DeviceBuffer::from_cudarc`]): the stream waits for the slice's read and write
//!   events and for the slice's own stream, checked through the crate's driver layer, before the
//!   slice gives up its allocation; the buffer frees it ordered, as any other.
//!
//! A refused conversion gives the value back ([`ConvertError`]), so nothing is freed or leaked
//! by a failure.

use crate::driver::{self, CaptureStatus, DevicePtr, Driver};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, DeviceCopy};
use crate::stream::StreamRef;
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr as _, DevicePtrMut as _, SyncOnDrop};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// A refused conversion: why, and the value, given back unchanged (nothing was freed).
///
/// Converts into [`Error`] (dropping the value, which frees it as usual), so `?` works.
pub struct ConvertError<V> {
    /// Why the conversion was refused.
    pub error: Error,
    /// What was to be converted.
    pub value: V,
}

impl<V> std::fmt::Debug for ConvertError<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConvertError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<V> std::fmt::Display for ConvertError<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "conversion refused: {}", self.error)
    }
}

impl<V> std::error::Error for ConvertError<V> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<V> From<ConvertError<V>> for Error {
    fn from(e: ConvertError<V>) -> Error {
        e.error
    }
}

fn refused<V>(error: Error, value: V) -> ConvertError<V> {
    ConvertError { error, value }
}

/// Puts the thread's current context back when dropped, if it changed: cudarc's calls
/// (`bind_to_thread`) make cudarc's context current, and the crate leaves the caller's as it found
/// it (review 9, finding 4).
struct KeepCurrent<'d> {
    d: &'d dyn Driver,
    before: driver::Context,
}

impl<'d> KeepCurrent<'d> {
    fn new(d: &'d dyn Driver) -> Result<Self> {
        Ok(KeepCurrent {
            d,
            before: d.ctx_get_current()?,
        })
    }
}

impl Drop for KeepCurrent<'_> {
    fn drop(&mut self) {
        if self.d.ctx_get_current().ok() != Some(self.before) {
            // SAFETY: `before` was current on this thread when the conversion began (or null:
            // none); setting it back is what the caller had.
            driver::tries(|| unsafe { self.d.ctx_set_current(self.before) });
        }
    }
}

/// Refuses when cudarc's context holds an error an earlier cudarc call stored (cudarc's next
/// `bind_to_thread` would take it and fail, and its event creation `unwrap`s that failure: a
/// panic). The error stays stored for its owner, and is the refusal's (review 9, finding 5).
fn no_stored_error(cu: &CudaContext) -> Result<()> {
    cu.check_err().map_err(|e| {
        cu.record_err::<()>(Err(e));
        Error::from(e)
    })
}

/// The raw event in a `SyncOnDrop::Record`, taken out so that dropping the guard records nothing.
fn take_event(sync: &mut SyncOnDrop<'_>) -> Option<driver::Event> {
    match sync {
        SyncOnDrop::Record(target) => target.take().map(|(e, _)| e.cu_event().into()),
        SyncOnDrop::Sync(_) => None,
    }
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// The buffer as a cudarc `CudaSlice` on `stream` (lent to cudarc, as by
    /// [`StreamRef::cudarc_stream`]), without a copy: `stream` is ordered after the buffer's
    /// last use, and the slice owns the allocation from then on (cudarc frees it, on that
    /// stream, when the slice is dropped). The loan lasts as long as the slice: the stream stays
    /// out of the pool, and the crate's state (its memory pool, which the allocation may come
    /// from) stays alive. With cudarc's event tracking on (its default), the slice's write event
    /// is recorded on `stream`, so cudarc work on any other stream waits for the crate's work on
    /// the buffer; with tracking off, ordering the slice across streams is the caller's job, as
    /// for every cudarc slice.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use cuda_stream_pool::{Context, DeviceBuffer};
    /// let (_cu, ctx) = Context::cudarc(0)?;
    /// let owner = ctx.owner();
    /// let s = owner.stream()?;
    /// let buf = DeviceBuffer::from_slice(&s, &[1.0f32, 2.0, 3.0])?;
    /// let slice = buf.into_cudarc(&s)?;                  // no copy: the same allocation
    /// let cs = s.cudarc_stream()?;
    /// assert_eq!(cs.clone_dtoh(&slice)?, vec![1.0, 2.0, 3.0]);
    /// let back = DeviceBuffer::from_cudarc(slice, &s)?;  // and back, again without a copy
    /// assert_eq!(back.to_vec(&s)?, vec![1.0, 2.0, 3.0]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The buffer back, in a [`ConvertError`], with [`Error::InvalidArgument`] when the context
    /// was not adopted from cudarc, the stream is lent as another type or is of another context
    /// than the buffer, or a graph still uses the buffer; an error stored in cudarc's context by
    /// an earlier cudarc call (it stays stored for its owner); [`Error::CaptureInProgress`] when
    /// the stream is capturing or the buffer's last use is in a capture in progress; the driver's
    /// error of the ordering or of the event record (then the buffer is back, and cudarc
    /// created nothing that outlives the call).
    pub fn into_cudarc(
        self,
        stream: &StreamRef<'_>,
    ) -> std::result::Result<CudaSlice<T>, ConvertError<Self>> {
        let cs = match stream.cudarc_stream() {
            Ok(cs) => cs,
            Err(e) => return Err(refused(e, self)),
        };
        let keep = match KeepCurrent::new(&*stream.ctx().inner.driver) {
            Ok(k) => k,
            Err(e) => return Err(refused(e, self)),
        };
        if let Err(e) = no_stored_error(cs.context()) {
            return Err(refused(e, self));
        }
        let (ptr, len) = self.into_raw_on(stream).map_err(|(e, b)| refused(e, b))?;
        // Back to a buffer: the allocation is still ours and ordered on `stream`.
        // SAFETY: `ptr` is the allocation of `len` elements that `into_raw_on` gave up, of
        // `stream`'s context, from a memory pool (freed by `cuMemFreeAsync`); nobody else owns
        // it, and its uses are ordered before `stream`'s current work.
        let back = |e: Error| refused(e, unsafe { DeviceBuffer::from_raw_on(stream, ptr, len) });
        // cudarc creates the slice's events with `unwrap`: a failure there is its panic, caught
        // before the slice exists (with `panic = "abort"` it aborts, as cudarc would).
        // SAFETY: `ptr` is a live allocation of cudarc's context (the state's) of `len` elements
        // of `T` (any bit pattern is a valid `T`: `DeviceCopy`), which `cuMemFreeAsync` on the
        // slice's stream frees (it is stream-ordered memory, and cudarc frees that way on a
        // device with memory pools, which the allocation proves); the crate gave it up.
        let made = catch_unwind(AssertUnwindSafe(|| unsafe {
            cs.upgrade_device_ptr::<T>(ptr.0, len)
        }));
        let mut slice =
            match made {
                Ok(slice) => slice,
                Err(_) => return Err(back(Error::invalid(
                    "cudarc could not create the slice's events (its upgrade_device_ptr panicked)",
                ))),
            };
        if cs.context().is_managing_stream_synchronization() {
            // The write event, recorded on `stream` (checked, where cudarc's own record would
            // only note an error): later cudarc work on other streams waits for it. cudarc's
            // waits in `device_ptr_mut` are on never-recorded events: nothing.
            let (_, mut sync) = slice.device_ptr_mut(&cs);
            let event = take_event(&mut sync);
            drop(sync);
            if let Some(event) = event {
                let ci = &stream.ctx().inner;
                // SAFETY: the event is the slice's, alive while the slice is; the stream is
                // held and not capturing (checked by `into_raw_on`).
                if let Err(e) = unsafe { ci.driver.event_record(event, stream.slot().enqueue()) } {
                    // The slice gives the allocation back (its waits are on unrecorded events).
                    let _ = slice.leak();
                    return Err(back(e));
                }
            }
        }
        drop(keep);
        Ok(slice)
    }

    /// A cudarc `CudaSlice` as a buffer used on `stream`, without a copy: `stream` waits for
    /// the slice's read and write events (cudarc's record of its uses on every stream) and for
    /// the slice's own stream, each wait checked, and the buffer then owns the allocation (it is
    /// freed, ordered after its last use, as every buffer is, with `cuMemFreeAsync`, as cudarc
    /// would free it).
    ///
    /// What cudarc records is what the crate can wait for, and cudarc's own drop of the slice
    /// relies on no more:
    /// * cudarc keeps one read event per slice, re-recorded at every read: of several reads on
    ///   different streams only the last is seen. Synchronize the other readers (or their
    ///   streams) first. Launches of a cudarc graph record no events at all.
    /// * With cudarc's event tracking off, the slice has no events: uses on streams other than
    ///   its own must be complete or ordered before `stream` by the caller, as cudarc requires.
    /// * An event last recorded inside a capture in progress (another thread's capture that
    ///   used the slice) cannot be told from a plain one: the wait joins that capture, which
    ///   then fails to end (`CUDA_ERROR_STREAM_CAPTURE_UNJOINED`), as cudarc's drop of the slice
    ///   would. Do not convert a slice a capture in progress has used.
    /// * The capture checks and the waits are separate calls: a capture that another thread
    ///   begins in between on a stream involved (the slice's, or the legacy stream that
    ///   blocking streams wait for) is joined or invalidated, as with any two threads sharing a
    ///   CUDA stream (see the limit at [`StreamRef::lend`]).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use cuda_stream_pool::{Context, DeviceBuffer};
    /// let (cu, ctx) = Context::cudarc(0)?;
    /// let slice = cu.default_stream().clone_htod(&[7u32; 4])?;   // cudarc's allocation
    /// let owner = ctx.owner();
    /// let s = owner.stream()?;
    /// let buf = DeviceBuffer::from_cudarc(slice, &s)?;           // s waits for the copy
    /// assert_eq!(buf.to_vec(&s)?, vec![7; 4]);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The slice back, in a [`ConvertError`], with [`Error::InvalidArgument`] when the slice is
    /// of another CUDA context than the stream (any state of the slice's CUDA context takes it,
    /// adopted from cudarc or not), empty, or on the per-thread default stream, or the device has no memory pools (cudarc's slices are then not
    /// stream-ordered memory); [`Error::CaptureInProgress`] when `stream` or the slice's stream is
    /// capturing; an error stored in cudarc's context by an earlier cudarc call (it stays
    /// stored for its owner); the driver's error of a wait (nothing of the slice was given up
    /// then).
    pub fn from_cudarc(
        mut slice: CudaSlice<T>,
        stream: &StreamRef<'_>,
    ) -> std::result::Result<Self, ConvertError<CudaSlice<T>>> {
        let ci = &stream.ctx().inner;
        let keep = match KeepCurrent::new(&*ci.driver) {
            Ok(k) => k,
            Err(e) => return Err(refused(e, slice)),
        };
        if driver::Context::from(slice.context().cu_ctx()) != stream.ctx().raw() {
            let e = Error::invalid("the slice belongs to another CUDA context than the stream");
            return Err(refused(e, slice));
        }
        let len = slice.len();
        if len == 0 {
            return Err(refused(
                Error::invalid("an empty slice has no allocation"),
                slice,
            ));
        }
        if let Err(e) = stream.not_capturing("taking a cudarc slice") {
            return Err(refused(e, slice));
        }
        // cudarc allocates with `cuMemAllocAsync` where its context found memory pools, else
        // with `cuMemAlloc`, which the crate's `cuMemFreeAsync` must not free.
        if !slice.context().has_async_alloc() {
            let e = Error::invalid(
                "the device has no memory pools: cudarc's slices are not stream-ordered memory \
                 there, and the crate frees only that",
            );
            return Err(refused(e, slice));
        }
        if let Err(e) = no_stored_error(slice.context()) {
            return Err(refused(e, slice));
        }
        // The per-thread default stream's handle names another stream on every thread: the
        // slice's work may be on another thread's (review 9, finding 3).
        if slice.stream().cu_stream() as usize == 0x2 {
            let e = Error::invalid(
                "the slice is on the per-thread default stream, which names another stream on \
                 each thread: move it to a stream of its own (or synchronize) first",
            );
            return Err(refused(e, slice));
        }
        let theirs = driver::Stream::from(slice.stream().cu_stream());
        let mine = stream.slot().enqueue();
        let ordered = (|| -> Result<()> {
            let _scope = ci.scope();
            // SAFETY: the slice's stream is alive (the slice holds it); the query is allowed in
            // every capture mode and invalidates nothing.
            if unsafe { ci.driver.stream_is_capturing(theirs) }? != CaptureStatus::None {
                return Err(Error::CaptureInProgress(
                    "the slice's stream is capturing: its work cannot be waited for".into(),
                ));
            }
            // The slice's own stream first (its work that no event records: the allocation,
            // and every use when cudarc's event tracking is off) ...
            if theirs != mine {
                // SAFETY: both streams are alive and neither is capturing (checked above).
                unsafe { ci.order_raw(theirs, mine) }?;
            }
            // ... then the slice's events (its last read and last write, on any stream), taken
            // out of cudarc's guards, which would record them when dropped: not wanted, nothing
            // is enqueued for the slice. cudarc makes the slice's own stream wait on them when
            // they are asked for (as its `leak` below does too); that wait comes after the
            // ordering above, so it orders nothing for `stream`: the crate's own waits below
            // do, checked.
            let own = slice.stream().clone();
            let write = take_event(&mut slice.device_ptr_mut(&own).1);
            let read = take_event(&mut slice.device_ptr(&own).1);
            for event in [write, read].into_iter().flatten() {
                // SAFETY: the event is the slice's (alive while it is); `stream` is held and not
                // capturing.
                unsafe { ci.driver.stream_wait_event(mine, event) }?;
            }
            Ok(())
        })();
        if let Err(e) = ordered {
            return Err(refused(e, slice));
        }
        // cudarc's `leak` makes the slice's stream wait for its events too (noting a failure in
        // cudarc's context only): not needed, `stream` already waits for all of it.
        let ptr = DevicePtr(slice.leak());
        drop(keep);
        // SAFETY: `ptr` is the slice's allocation of `len` elements of `T`, of `stream`'s
        // context (checked), which the slice gave up; it is stream-ordered memory, freed by
        // `cuMemFreeAsync` (how cudarc frees it on a device with memory pools: checked above);
        // every use of it so far is ordered before `stream`'s current work (the
        // waits above).
        Ok(unsafe { DeviceBuffer::from_raw_on(stream, ptr, len) })
    }
}
