//! Interop with [cudarc](https://docs.rs/cudarc) (feature `cudarc`): adopt a cudarc context
//! safely, lend an owner's pooled stream to cudarc as an `Arc<CudaStream>`, and pass
//! [`DeviceBuffer`]s to cudarc's launches and copies through [`CudarcUse`].
//!
//! The rules the types carry:
//!
//! * [`Context::from_cudarc`] keeps cudarc's `Arc<CudaContext>` alive for as long as the crate's
//!   state lives, and puts cudarc in its multi-stream mode (cudarc then orders its own slices
//!   across streams with events, pooled streams included). Both last as long as any stream of
//!   the state is lent, even after the last [`Context`] is dropped (the state's teardown waits
//!   for the loans: see [`StreamRef::lend`]).
//! * [`StreamRef::cudarc_stream`] lends the stream ([`StreamRef::lend`]): whatever cudarc keeps
//!   of it (its slices hold an `Arc<CudaStream>`) keeps the stream out of the pool, so no work
//!   or free that cudarc enqueues later can land on a stream handed to another owner. Once the
//!   last cudarc handle is gone, the stream goes back to the pool after its work completed.
//! * [`DeviceBuffer::cudarc_use`] is a [`BufferUse`]: the stream is ordered after the buffer's
//!   previous use, and the use is recorded when the guard is made, before the cudarc work is
//!   enqueued (so a leaked guard is still a use: the buffer's free orders after its work). It is
//!   for work on that stream only (see [`CudarcUse`]).
//!
//! Slices that cudarc allocated before [`Context::from_cudarc`] switched it to multi-stream
//! mode carry events that nothing recorded until then: cudarc does not order their earlier uses
//! across streams (as with its own `new_stream`); allocate them afterwards, or order them
//! yourself. Every `Arc<CudaContext>` adopted (several of one CUDA context join one state) is
//! kept in multi-stream mode by a keeper stream of its own.
//!
//! What [`Context::from_cudarc`] changes of cudarc's context, for the whole process: it creates
//! one cudarc stream and holds it while the state lives, so cudarc is in multi-stream mode from
//! then on (its `new_stream` synchronizes the context the first time: in relaxed capture mode
//! here, so no capture of any thread is invalidated). Nothing else: not the current context of
//! any thread, not the device's memory pool, not event tracking.
//!
//! With cudarc's event tracking disabled (`CudaContext::disable_event_tracking`, an `unsafe`
//! call whose contract makes ordering slices across streams the caller's job) cudarc orders
//! none of its slices across the pooled streams either: that stays the caller's job, as with
//! cudarc's own streams. What the crate guarantees does not depend on it: a lent stream is
//! never handed to another owner while cudarc holds it (so a slice's free on it never lands on
//! someone else's stream), and [`CudarcUse`] orders the crate's buffers itself (tested with
//! tracking off in `tests/cudarc_interop.rs` on the GPU).

mod slices;

pub use slices::ConvertError;

use crate::context::{Context, ContextOptions};
use crate::driver::{self, CaptureModeGuard, CaptureStatus, Choice, Driver};
use crate::error::{Error, ErrorCode, Result};
use crate::memory::{BufferUse, DeviceBuffer, DeviceCopy};
use crate::stream::StreamRef;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use std::marker::PhantomData;
use std::sync::Arc;

/// What the crate's state keeps of cudarc's: its context, and one cudarc stream that keeps
/// cudarc in multi-stream mode (so that it records events for its slices).
struct CudarcKeep {
    _stream: Arc<CudaStream>,
    _ctx: Arc<CudaContext>,
}

impl Context {
    /// Adopts cudarc's context: the crate's state for it, keeping `cu` alive for as long as
    /// the state (and every owner, stream, buffer and graph made from it) lives. Loads the CUDA
    /// driver (libcuda, as cudarc does) and creates one cudarc stream, held for the state's
    /// lifetime, which switches cudarc to its multi-stream mode (it synchronizes the context
    /// the first time): cudarc then orders its slices across the pooled streams it is lent.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use cuda_stream_pool::Context;
    /// let cu = cudarc::driver::CudaContext::new(0)?;
    /// let ctx = Context::from_cudarc(&cu)?;
    /// let owner = ctx.owner();
    /// let cs = owner.stream()?.cudarc_stream()?;    // cudarc's handle of the pooled stream
    /// let x = cs.alloc_zeros::<f32>(1024)?;         // cudarc work on it
    /// drop(owner);                                  // the stream stays out of the pool ...
    /// drop(x);                                      // ... until cudarc's last handle is gone
    /// drop(cs);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The loader's error when libcuda cannot be used; the driver's (cudarc's, with its code)
    /// when the context cannot be adopted.
    pub fn from_cudarc(cu: &Arc<CudaContext>) -> Result<Context> {
        Self::from_cudarc_opt(cu, None)
    }

    /// Opens device `ordinal` through cudarc and adopts its context: `(cudarc's context, this
    /// crate's state of it)`. The driver is probed with this crate's loader first, so a machine
    /// without a usable libcuda gets an error here where `CudaContext::new` would panic in
    /// cudarc's loader.
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context};
    /// match Context::cudarc(0) {
    ///     Ok((cu, ctx)) => assert_eq!(ctx.cudarc_context().unwrap().cu_ctx(), cu.cu_ctx()),
    ///     // No GPU here: the same error as the crate's own loader gives, no panic.
    ///     Err(e) => assert!(driver::load(driver::Choice::Cuda).is_err(), "{e}"),
    /// }
    /// ```
    ///
    /// # Errors
    /// The loader's error when libcuda cannot be used; the driver's (cudarc's, with its code)
    /// when the device cannot be opened or its context adopted.
    pub fn cudarc(ordinal: usize) -> Result<(Arc<CudaContext>, Context)> {
        let (drv, _) = driver::load(Choice::Cuda)?;
        // Through the device rules: refused on a host-function thread before any call.
        let rules = Context::device_layer(drv);
        rules.init()?;
        let count = rules.device_count()?;
        if i32::try_from(ordinal).map_or(true, |o| o >= count) {
            return Err(Error::invalid(format!(
                "no CUDA device {ordinal}: the driver reports {count}"
            )));
        }
        // cudarc makes its context current on this thread: the caller's is put back.
        let before = rules.ctx_get_current()?;
        let cu = CudaContext::new(ordinal);
        let ctx = cu
            .map_err(Error::from)
            .and_then(|cu| Ok((Context::from_cudarc(&cu)?, cu)));
        // SAFETY: `before` was current on this thread a moment ago (or null: none); setting it
        // back is what the caller had.
        driver::tries(|| unsafe { rules.ctx_set_current(before) });
        let (ctx, cu) = ctx?;
        Ok((cu, ctx))
    }

    /// [`Context::from_cudarc`] with options.
    ///
    /// # Errors
    /// As [`Context::from_cudarc`] and [`Context::primary_with`].
    pub fn from_cudarc_with(cu: &Arc<CudaContext>, options: ContextOptions) -> Result<Context> {
        Self::from_cudarc_opt(cu, Some(options))
    }

    /// [`Context::from_cudarc_with`]; `None`: any options of a shared state.
    fn from_cudarc_opt(cu: &Arc<CudaContext>, options: Option<ContextOptions>) -> Result<Context> {
        let (drv, _) = driver::load(Choice::Cuda)?;
        let raw = driver::Context::from(cu.cu_ctx());
        // Already shared and keeping this very `Arc<CudaContext>` (with its keeper stream,
        // which keeps it in multi-stream mode): joined as it is, so that adopting again and
        // again adds nothing (not even a keeper stream). Another `Arc` of the same CUDA context
        // joins too, below, but with a keeper of its own: cudarc's multi-stream mode is per
        // `CudaContext` object, and without it the slices of that `Arc` carry no ordering across
        // the lent streams (review 9, finding 3).
        let keeps_this = |list: &[Box<dyn std::any::Any + Send + Sync>]| {
            list.iter().any(|k| {
                k.downcast_ref::<CudarcKeep>()
                    .is_some_and(|k| Arc::ptr_eq(&k._ctx, cu))
            })
        };
        let keeps_cudarc = |s: &crate::context::CtxInner| {
            s.find_keep_alive(|k| {
                k.downcast_ref::<CudarcKeep>()
                    .filter(|k| Arc::ptr_eq(&k._ctx, cu))
                    .map(|_| ())
            })
            .is_some()
        };
        let isolated = options.is_some_and(|o| o.isolated);
        if !isolated {
            if let Some(joined) = Context::shared_if(&drv, raw, options, keeps_cudarc) {
                return joined;
            }
        }
        // cudarc synchronizes in `new_stream`: in relaxed mode, so that no capture of any
        // thread is invalidated.
        let stream = {
            let _relaxed = CaptureModeGuard::relaxed(&*drv)?;
            cu.new_stream()?
        };
        let keep = CudarcKeep {
            _stream: stream,
            _ctx: cu.clone(),
        };
        let keep: Option<Box<dyn std::any::Any + Send + Sync>> = Some(Box::new(keep));
        // A shared state that keeps this `Arc` already (another thread adopted it meanwhile)
        // needs no second keeper of it; one that keeps only other `Arc`s of the same CUDA
        // context keeps this one too, so that it stays in multi-stream mode (its streams are
        // still lent through the first).
        let lacks_keeper = |list: &[Box<dyn std::any::Any + Send + Sync>]| !keeps_this(list);
        // SAFETY: `raw` is cudarc's live context, loaded from the same libcuda; the
        // `Arc<CudaContext>` in `keep` keeps it alive until this state's teardown is over.
        unsafe { Context::adopt_keeping(drv, raw, keep, options, &lacks_keeper) }
    }

    /// The cudarc context this state lends its streams through ([`StreamRef::cudarc_stream`]):
    /// the one it was adopted from ([`Context::from_cudarc`]), or, for a state that several
    /// `Arc<CudaContext>`s of one CUDA context joined, the first of them; `None` for a state
    /// that no `from_cudarc` made or joined.
    pub fn cudarc_context(&self) -> Option<Arc<CudaContext>> {
        self.inner
            .find_keep_alive(|k| k.downcast_ref::<CudarcKeep>().map(|k| k._ctx.clone()))
    }
}

impl StreamRef<'_> {
    /// The stream as a cudarc stream, lent for as long as cudarc holds it (see
    /// [`StreamRef::lend`]): launch, allocate and copy on it with cudarc's own API. Every call
    /// for the same stream returns the same `Arc`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the context was not adopted from cudarc
    /// ([`Context::from_cudarc`]) or the stream is lent as another type.
    pub fn cudarc_stream(&self) -> Result<Arc<CudaStream>> {
        let cu = self.context().cudarc_context().ok_or_else(|| {
            Error::invalid("cudarc_stream needs a context adopted with Context::from_cudarc")
        })?;
        self.lend(|raw| {
            // SAFETY: `raw` is a stream of cudarc's context (the state adopted it). The loan
            // keeps the stream alive, and out of other owners' hands, for as long as this
            // wrapper or anything cloned from it lives; cudarc orders its own slices with
            // events (multi-stream mode, set by `from_cudarc`) and the crate's buffers are
            // ordered by `CudarcUse`.
            Ok(unsafe { cu.wrap_borrowed_stream(raw.into()) })
        })
    }
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// Begins a use of the buffer on `stream` for cudarc work: a [`BufferUse`] that cudarc's
    /// launches and copies take as a `DevicePtr` / `DevicePtrMut`. Enqueue the cudarc work while
    /// the guard lives. The use is recorded when the guard is made: a leaked guard is still a
    /// use (see [`BufferUse`] for what the leak costs; a leaked `CudarcUse` also keeps its
    /// stream lent for ever).
    ///
    /// # Errors
    /// As [`DeviceBuffer::use_on`] and [`StreamRef::cudarc_stream`].
    pub fn cudarc_use<'b>(&'b self, stream: &'b StreamRef<'_>) -> Result<CudarcUse<'b, T>> {
        let cs = stream.cudarc_stream()?;
        let inner = self.use_on(stream)?;
        // SAFETY: the stream is held by the reference's holder: live. The query is allowed in
        // every capture mode and invalidates nothing.
        let capture = match unsafe { stream.ctx().inner.driver.stream_capture_info(stream.raw()) }?
        {
            (CaptureStatus::None, _) => None,
            (_, id) => Some(id),
        };
        Ok(CudarcUse {
            ptr: inner.ptr().0,
            inner,
            capture,
            stream: cs,
            len: self.len(),
            _t: PhantomData,
        })
    }
}

/// A use of a [`DeviceBuffer`] on a lent stream, for cudarc: implements cudarc's
/// `DeviceSlice`, `DevicePtr` and `DevicePtrMut`.
///
/// It is for work on the use's own stream (the lent stream it was made on): `device_ptr` for
/// another stream is refused. Ordering that stream's work back before the buffer's free would
/// rest on the returned `SyncOnDrop` (cudarc synchronizes at its drop), which a `mem::forget`
/// skips (review 26). For another lent stream make a use there; for a stream of cudarc's own,
/// hand the buffer to cudarc ([`DeviceBuffer::into_cudarc`]), whose events order its slices.
///
/// Made on a stream that its borrower (cudarc) is capturing, the use is refused
/// ([`Error::CaptureInProgress`]); made inside a capture of the crate's, the buffer is kept by
/// that capture's graph. The cudarc work must go into the capture the use was made in (or into
/// none): a capture that began on the use's stream after the use was made keeps nothing of the
/// crate's alive, so `device_ptr` refuses it.
///
/// # Panics
/// `device_ptr` / `device_ptr_mut` panic, before enqueuing anything, where
/// [`CudarcUse::device_ptr_on`] returns an error: when asked for another stream than the use's,
/// when the use's stream is in another capture than the one it was in when the use was made,
/// and when the driver fails the capture query; the cudarc traits have no way to return the
/// error. Call `device_ptr_on` first where a panic is not acceptable.
#[must_use = "the buffer's use lock is held while the guard lives: enqueue the cudarc work while it lives"]
pub struct CudarcUse<'b, T> {
    inner: BufferUse<'b>,
    ptr: u64,
    /// The id of the capture the use's stream was in when the use was made, if any.
    capture: Option<u64>,
    stream: Arc<CudaStream>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> std::fmt::Debug for CudarcUse<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudarcUse")
            .field("use", &self.inner)
            .field("len", &self.len)
            .finish()
    }
}

impl<T> CudarcUse<'_, T> {
    /// The buffer's device address for work on `stream`, which must be the use's own stream
    /// (checked, with its capture still the one the use was made in); nothing is enqueued, and
    /// the returned `SyncOnDrop` does nothing. What `device_ptr` does, as a `Result`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for another stream (see [`CudarcUse`]);
    /// [`Error::CaptureInProgress`] when the use's stream is in another capture than the one it
    /// was in when the use was made (that capture's graph would not keep the buffer alive); the
    /// driver's error of the capture query.
    pub fn device_ptr_on<'a>(&'a self, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)> {
        Ok((self.ptr, self.order_other(stream)?))
    }

    /// Checks that `other` is the use's stream, in the capture the use was made in (see
    /// [`CudarcUse::device_ptr_on`]).
    fn order_other<'a>(&'a self, other: &'a CudaStream) -> Result<SyncOnDrop<'a>> {
        let mine = driver::Stream::from(self.stream.cu_stream());
        let theirs = driver::Stream::from(other.cu_stream());
        if mine != theirs {
            // Work on another stream would be ordered back only by the `SyncOnDrop` (cudarc's
            // synchronize, outside the crate's device rules), which a `mem::forget` skips: the
            // buffer's free would then not wait for that work (review 26).
            return Err(Error::invalid(
                "a CudarcUse is for work on its own stream: for another lent stream make a use                  there (DeviceBuffer::cudarc_use with that stream's StreamRef); for a stream of                  cudarc's own, hand the buffer to cudarc (DeviceBuffer::into_cudarc)",
            ));
        }
        let ci = &self.inner.context().inner;
        // SAFETY: the use's stream is held (the guard borrows its reference); the query is
        // allowed in every capture mode and invalidates nothing.
        match unsafe { ci.driver.stream_capture_info(mine) }? {
            (CaptureStatus::None, _) => Ok(SyncOnDrop::Sync(None)),
            (_, id) if self.capture == Some(id) => Ok(SyncOnDrop::Sync(None)),
            _ => Err(Error::CaptureInProgress(
                "CudarcUse: its stream began a capture after the use was made; that capture's \
                 graph would not keep the buffer alive (make the use inside the capture)"
                    .into(),
            )),
        }
    }
}

impl<T> DeviceSlice<T> for CudarcUse<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for CudarcUse<'_, T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.device_ptr_on(stream)
            .unwrap_or_else(|e| panic!("CudarcUse::device_ptr: {e}"))
    }
}

impl<T> DevicePtrMut<T> for CudarcUse<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        let s: &'a Self = self;
        s.device_ptr_on(stream)
            .unwrap_or_else(|e| panic!("CudarcUse::device_ptr_mut: {e}"))
    }
}

/// cudarc's driver errors keep their code (and the code's name from the crate's table), so `?`
/// works in code that mixes both crates; the entry point is not known (`"cudarc"`).
///
/// ```
/// use cuda_stream_pool::{Error, ErrorCode};
/// use cudarc::driver::{sys::CUresult, DriverError};
/// let e: Error = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY).into();
/// assert_eq!(e.code(), Some(ErrorCode::ERROR_OUT_OF_MEMORY));
/// ```
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Error {
        Error::driver(ErrorCode(e.0 as u32), "cudarc")
    }
}
