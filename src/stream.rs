//! Stream handles: [`StreamRef`], a borrowed handle to an owner's (or an [`OwnedStream`]'s)
//! stream, and [`OwnedStream`], a plain stream outside the pool.
//!
//! A `StreamRef<'a>` borrows what holds the stream, so the holder cannot be dropped (and the
//! stream cannot go back to the pool) while a reference is in use: that is checked by the
//! compiler, not at run time. It is neither `Send` nor `Sync`: the stream's capture state is
//! only ever changed by the one thread that holds it.

use crate::context::{Context, Priority};
use crate::ctx_ref::CtxRef;
use crate::driver::{self, stream_flags, HostFn};
use crate::error::{Error, Result};
use crate::hostfn::{host_fn, off_host_fn_thread};
use crate::pool::Slot;
use std::any::Any;
use std::cell::Cell;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;

/// A handle to a stream of the crate, borrowed from the [`crate::Owner`] (or [`OwnedStream`])
/// that holds it: the holder cannot be dropped while the handle lives, so every operation acts on
/// a stream that nobody else owns.
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// s.synchronize().unwrap();
/// ```
///
/// A stream reference cannot outlive its owner:
///
/// ```compile_fail
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// drop(owner);                 // error: `owner` is borrowed by `s`
/// s.synchronize().unwrap();
/// ```
///
/// nor change threads:
///
/// ```compile_fail
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// std::thread::scope(|sc| { sc.spawn(|| s.synchronize()); });
/// ```
#[derive(Clone)]
pub struct StreamRef<'a> {
    /// The holder's context and stream, pointed at rather than reference-counted: an owner's
    /// hand-over touches no shared count (every `Context` clone and drop writes one cache line
    /// that all threads share). Valid while the reference lives (see [`StreamRef::new`]).
    ctx: NonNull<Context>,
    slot: NonNull<Slot>,
    pub(crate) gen: u64,
    /// Keeps the thread's implicit owner alive for a `StreamRef<'static>` of it.
    _keep: Option<Rc<dyn Any>>,
    _holder: PhantomData<&'a Cell<()>>,
}

impl std::fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamRef")
            .field("raw", &self.slot().observe())
            .field("priority", &self.slot().priority)
            .field("generation", &self.gen)
            .finish()
    }
}

impl<'a> StreamRef<'a> {
    /// A reference to a stream held by something that `'a` borrows (or that `keep` keeps alive).
    ///
    /// # Safety
    /// `ctx` and the `Arc` that `slot` is stay alive and in place for as long as the reference
    /// (or a clone of it) lives: they belong to the holder that `'a` borrows, or that `keep`
    /// keeps alive (in an `Rc`, which does not move it), and the holder neither drops nor moves
    /// them while it is borrowed or kept (an owner gives no stream back before it is dropped).
    pub(crate) unsafe fn new(
        ctx: &Context,
        slot: &Arc<Slot>,
        gen: u64,
        keep: Option<Rc<dyn Any>>,
    ) -> Self {
        StreamRef {
            ctx: NonNull::from(ctx),
            // `Arc::as_ptr`, not a reference's address: the pointer keeps the provenance of the
            // whole allocation, counts included, which `slot_arc` needs.
            slot: NonNull::new(Arc::as_ptr(slot).cast_mut()).expect("an Arc's pointer"),
            gen,
            _keep: keep,
            _holder: PhantomData,
        }
    }

    /// This reference, kept valid by `keep` instead of a borrow.
    ///
    /// # Safety
    /// `keep` keeps alive (and in place) the holder that `'a` borrows.
    pub(crate) unsafe fn kept_by(self, keep: Rc<dyn Any>) -> StreamRef<'static> {
        StreamRef {
            ctx: self.ctx,
            slot: self.slot,
            gen: self.gen,
            _keep: Some(keep),
            _holder: PhantomData,
        }
    }

    /// The holder's context.
    pub(crate) fn ctx(&self) -> &Context {
        // SAFETY: `new`'s contract: the holder keeps the context in place while `self` lives.
        unsafe { self.ctx.as_ref() }
    }

    /// The holder's stream.
    pub(crate) fn slot(&self) -> &Slot {
        // SAFETY: `new`'s contract: the holder keeps an `Arc` of the slot while `self` lives.
        unsafe { self.slot.as_ref() }
    }

    /// The holder's stream, as a counted reference of its own (for what outlives `self`: a
    /// buffer's last use, a completion's marker).
    pub(crate) fn slot_arc(&self) -> Arc<Slot> {
        let p = self.slot.as_ptr().cast_const();
        // SAFETY: `p` is the pointer of an `Arc<Slot>` (`new` took it from one) that the holder
        // keeps alive while `self` lives (`new`'s contract): its strong count is at least one
        // here, so raising it and taking the new count's `Arc` is sound.
        unsafe {
            Arc::increment_strong_count(p);
            Arc::from_raw(p)
        }
    }

    /// Whether `other` is this reference's stream.
    pub(crate) fn is_slot(&self, other: &Arc<Slot>) -> bool {
        std::ptr::eq(self.slot.as_ptr(), Arc::as_ptr(other))
    }

    /// The raw `CUstream`, for launching with other crates. Using it is `unsafe` (every raw
    /// driver call is): it is valid while this reference's holder holds the stream, and work
    /// enqueued through it must not use the crate's buffers unless a [`crate::BufferUse`] of them
    /// is alive, nor leave the stream capturing.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// // SAFETY: `s` borrows the owner that holds the stream: the handle is live.
    /// let p = unsafe { ctx.driver().stream_priority(s.raw()) }.unwrap();
    /// assert_eq!(p, s.priority());
    /// ```
    pub fn raw(&self) -> driver::Stream {
        // The handle leaves the crate: work enqueued through it is unseen, so from now on only
        // a query tells whether this generation's work completed.
        self.slot().expose(self.gen)
    }

    /// The handle, without it leaving the crate (no exposure, unlike [`StreamRef::raw`]): for a
    /// model of the crate that names streams in its own bookkeeping, so that naming one does not
    /// change what the crate knows of it (a stream whose handle was exposed is never known idle,
    /// and its hand-over always queries). Builds with the `model-hooks` feature only.
    #[cfg(feature = "model-hooks")]
    #[doc(hidden)]
    pub fn model_handle(&self) -> driver::Stream {
        self.slot().observe()
    }

    /// The handle, for an enqueue by the crate itself (counted: see `Slot::enqueue`).
    #[cfg_attr(not(feature = "kernels"), allow(dead_code))]
    pub(crate) fn enqueue_handle(&self) -> driver::Stream {
        self.slot().enqueue()
    }

    /// Lends the stream to another crate as a shared handle of that crate's type, made by `wrap`
    /// from the raw stream (cudarc's is `StreamRef::cudarc_stream`, with the `cudarc` feature). The handle may outlive this
    /// reference and its holder: while anyone holds a clone of the returned `Arc` (or of one
    /// made from it), the stream is neither handed to another owner nor destroyed; once the last
    /// clone is gone, a later release, acquisition, allocation, free or [`Context::trim`] returns
    /// it to the pool (or destroys an [`OwnedStream`]'s), after its work has completed, as usual.
    ///
    /// A lent pooled stream whose holder is gone still counts against its key's cap
    /// ([`crate::ContextOptions::max_live_streams_per_key`]) and in [`crate::PoolStats::in_use`]
    /// (and `lent`) until it comes back: an acquisition waiting at the cap waits for it (looking
    /// for the loan's end every few milliseconds: nothing tells the crate when the other crate
    /// drops its last handle).
    ///
    /// The handle may outlive the [`Context`] too: then everything the stream relies on (its
    /// context, retained or kept alive as at adoption, and cudarc's keeper stream) is kept with
    /// the state, whose teardown completes at a later call of the crate (of any context: an owner
    /// drop, an allocation, `trim`, a new context) once the loan ended. Every
    /// call on the same stream returns the same handle. While lent, the crate asks the driver
    /// (not its own bookkeeping) whether the stream is capturing, so a capture that the other
    /// crate begins on it is never joined or invalidated by the crate; a stream the other crate
    /// leaves capturing is never used again.
    ///
    /// Buffer work of the crate (memsets, copies, kernels, [`crate::BufferUse`]s, graph
    /// launches) on a stream that the borrower is capturing is refused with
    /// [`Error::CaptureInProgress`]: the borrower's graph would not keep the crate's buffers
    /// alive. Only a capture of the crate's own ([`StreamRef::begin_capture`]) takes crate work,
    /// and its graph keeps the buffers.
    ///
    /// Limit: the check (`cuStreamIsCapturing`) is made when the crate's use of a buffer begins,
    /// before its work is enqueued; CUDA has no check-and-enqueue. A borrower on *another*
    /// thread that begins a capture of the stream inside that window (between the check and the
    /// enqueue, as any two threads sharing one CUDA stream can race) gets the crate's work in its
    /// graph: launching that graph after the buffers are freed touches freed memory, and other
    /// calls of the crate in the window may invalidate that capture. Begin captures of a lent
    /// stream only on the thread that holds its owner, or while that thread is known not to be
    /// using the stream (for example after a synchronization with it).
    ///
    /// `wrap` runs at most once per loan; if it lends the same stream again, that inner call
    /// fails with [`Error::InvalidArgument`].
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use std::sync::Arc;
    /// struct Foreign(driver::Stream);                 // another crate's stream handle
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let h = s.lend(|raw| Ok(Arc::new(Foreign(raw)))).unwrap();
    /// assert_eq!(h.0, s.raw());
    /// drop(s);
    /// drop(owner);                                   // the stream stays out of the pool
    /// assert_eq!(ctx.stats().in_use, 1);
    /// drop(h);                                       // the loan ends
    /// ctx.trim().unwrap();                           // a flush returns it
    /// assert_eq!(ctx.stats().in_use, 0);
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the stream is already lent as a handle of another type;
    /// `wrap`'s error.
    pub fn lend<H: Any + Send + Sync>(
        &self,
        wrap: impl FnOnce(driver::Stream) -> Result<Arc<H>>,
    ) -> Result<Arc<H>> {
        let raw = self.slot().expose(self.gen);
        let loan = self
            .slot()
            .lend(|| wrap(raw).map(|h| h as crate::pool::Loan))?;
        loan.downcast::<H>()
            .map_err(|_| Error::invalid("the stream is already lent as a handle of another type"))
    }

    /// The context.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// assert_eq!(owner.stream().unwrap().context().raw(), ctx.raw());
    /// ```
    pub fn context(&self) -> &Context {
        self.ctx()
    }

    /// The stream's priority (fixed at creation).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::Priority;
    /// let owner = ctx.owner();
    /// assert_eq!(owner.stream().unwrap().priority(), 0);
    /// owner.set_priority(Priority::Value(-2)).unwrap();
    /// assert_eq!(owner.stream().unwrap().priority(), -2);
    /// ```
    pub fn priority(&self) -> i32 {
        self.slot().priority
    }

    /// The stream's creation flags ([`stream_flags`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::driver::stream_flags;
    /// let owner = ctx.owner();
    /// assert_eq!(owner.stream().unwrap().flags(), stream_flags::NON_BLOCKING);
    /// ```
    pub fn flags(&self) -> u32 {
        self.slot().flags
    }

    /// The generation of the stream this reference holds (bumped each time the pool hands the
    /// stream to a new owner).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let (raw, gen) = {
    ///     let first = ctx.owner();
    ///     let s = first.stream().unwrap();
    ///     (s.raw(), s.generation())
    /// };                                         // `first` is dropped: its stream is retired
    /// let next = ctx.owner();
    /// let s = next.stream().unwrap();            // the same stream, handed to a new owner
    /// assert_eq!((s.raw(), s.generation()), (raw, gen + 1));
    /// ```
    pub fn generation(&self) -> u64 {
        self.gen
    }

    /// Whether the stream still belongs to the holder this handle came from (always, while the
    /// handle exists; kept for diagnostics).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// assert!(owner.stream().unwrap().is_current());
    /// ```
    pub fn is_current(&self) -> bool {
        self.slot().is_current(self.gen)
    }

    /// Whether two handles name the same stream (by object, never by handle value).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// let s = a.stream().unwrap();
    /// assert!(s.same_stream(&a.stream().unwrap()));
    /// assert!(!s.same_stream(&b.stream().unwrap()));
    /// ```
    pub fn same_stream(&self, other: &StreamRef<'_>) -> bool {
        self.slot == other.slot
    }

    /// Whether the stream is capturing (a capture of the crate, or, for a stream lent to
    /// cudarc, any capture the driver reports).
    pub(crate) fn capturing_now(&self) -> bool {
        // SAFETY: the holder that this reference borrows holds the stream: it is live.
        unsafe { self.ctx().inner.capturing(self.slot()) }
    }

    pub(crate) fn not_capturing(&self, what: &str) -> Result<()> {
        if self.capturing_now() {
            return Err(Error::CaptureInProgress(format!(
                "{what} is not possible while the stream is capturing"
            )));
        }
        Ok(())
    }

    /// Blocks until the stream's work has completed. Runs in relaxed capture mode, so it
    /// invalidates no other thread's capture.
    ///
    /// ```
    /// use cuda_stream_pool::{driver::SimDriver, Context, Error};
    /// use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// sim.enqueue_work(s.raw(), 5_000).unwrap();     // simulated GPU work
    /// assert!(!s.query().unwrap());
    /// s.synchronize().unwrap();                      // the simulated clock runs to its end
    /// assert!(s.query().unwrap());
    /// let _capture = s.begin_capture().unwrap();
    /// assert!(matches!(s.synchronize(), Err(Error::CaptureInProgress(_))));
    /// ```
    ///
    /// # Errors
    /// [`Error::CaptureInProgress`] while the stream is capturing (the capture is left intact);
    /// the driver's error otherwise.
    pub fn synchronize(&self) -> Result<()> {
        self.not_capturing("synchronizing")?;
        let d = &*self.ctx().inner.driver;
        // Read before the synchronization: what it covers.
        let n = self.slot().mark_settled();
        // SAFETY: the holder that this reference borrows holds the stream: it is live. Relaxed
        // mode: the device rules.
        unsafe { d.stream_synchronize(self.slot().observe()) }?;
        // Known idle from now until the next enqueue: the owner's release hands it on without
        // a query (unless its handle left the crate in this generation).
        self.slot().completed_through(self.gen, n);
        Ok(())
    }

    /// Whether the stream's work has completed. Runs in relaxed capture mode. A stream just
    /// handed to a new owner may still report work: its previous owner's frees of the crate's
    /// memory, which a hand-over does not wait for (they touch no memory in use, and this
    /// owner's work runs after them); [`StreamRef::synchronize`] waits for them too.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// assert!(owner.stream().unwrap().query().unwrap());   // nothing enqueued yet
    /// ```
    ///
    /// # Errors
    /// [`Error::CaptureInProgress`] while the stream is capturing; the driver's error otherwise.
    pub fn query(&self) -> Result<bool> {
        self.not_capturing("querying")?;
        let d = &*self.ctx().inner.driver;
        // SAFETY: the holder that this reference borrows holds the stream: it is live. Relaxed
        // mode: the device rules.
        unsafe { d.stream_query(self.slot().observe()) }
    }

    /// Orders later work on this stream after the work enqueued so far on `other` (event record
    /// + wait, on the GPU).
    ///
    /// ```
    /// use cuda_stream_pool::{driver::SimDriver, Context};
    /// use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    /// sim.enqueue_work(sa.raw(), 1_000).unwrap();
    /// sb.wait_for(&sa).unwrap();                      // sb's later work runs after sa's
    /// assert!(!sb.query().unwrap());                  // sb waits for sa's work, on the GPU
    /// sim.advance(1_000);
    /// assert!(sb.query().unwrap());
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for streams of different contexts;
    /// [`Error::CaptureInProgress`] when either stream is capturing (on the real driver the wait
    /// would pull this stream into the capture, or invalidate it); the driver's error otherwise.
    pub fn wait_for(&self, other: &StreamRef<'_>) -> Result<()> {
        if !self.ctx().same(other.ctx()) {
            return Err(Error::invalid("streams of different contexts"));
        }
        self.not_capturing("waiting for another stream")?;
        other.not_capturing("waiting for a capturing stream")?;
        // SAFETY: both streams are held by the holders these references borrow, and neither is
        // capturing (checked above; only their holders' threads could begin one).
        unsafe { self.ctx().inner.order(other.slot(), self.slot()) }
    }

    /// Enqueues a host function; it runs on a driver thread once earlier work has completed. It
    /// must not call the driver (the real driver refuses, or deadlocks), and should not block:
    /// all host functions of a context share one driver thread.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let (tx, rx) = std::sync::mpsc::channel();
    /// s.launch_host_func(move || tx.send(42).unwrap()).unwrap();
    /// s.synchronize().unwrap();
    /// assert_eq!(rx.recv().unwrap(), 42);
    /// ```
    ///
    /// # Errors
    /// [`Error::CaptureInProgress`] while the stream is capturing: a captured host function
    /// would run on every launch of the graph with the same data. The driver's error otherwise.
    pub fn launch_host_func(&self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        self.not_capturing("launching a host function")?;
        let f: HostFn = host_fn(f);
        // SAFETY: the stream is held (live) and not capturing; only this thread, which holds
        // it, could begin a capture.
        unsafe {
            self.ctx()
                .inner
                .driver
                .launch_host_func(self.slot().enqueue(), f)
        }
    }

    /// Whether the stream is being captured (`cuStreamIsCapturing`; allowed during capture).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// assert!(!s.is_capturing().unwrap());
    /// let g = s.begin_capture().unwrap();
    /// assert!(s.is_capturing().unwrap());
    /// g.end().unwrap();
    /// assert!(!s.is_capturing().unwrap());
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn is_capturing(&self) -> Result<bool> {
        // SAFETY: the holder that this reference borrows holds the stream: it is live.
        let st = unsafe {
            self.ctx()
                .inner
                .driver
                .stream_is_capturing(self.slot().observe())
        }?;
        Ok(st != driver::CaptureStatus::None)
    }
}

/// A stream of your own, outside the pool: for work that must outlive any owner. Synchronized
/// (in relaxed capture mode) and destroyed when dropped (when that fails, for instance under a
/// leaked capture guard, the context keeps the stream and destroys it once it is idle). `Send`, not `Sync`: only the thread that
/// has it can take [`StreamRef`]s of it, so its capture state has one writer.
///
/// ```
/// use cuda_stream_pool::{driver, Context, OwnedStream, Priority};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// let s = OwnedStream::new(&ctx, Priority::High).unwrap();
/// assert_eq!(s.stream().priority(), ctx.priority_range().greatest);
/// ```
#[derive(Debug)]
#[must_use = "the stream is synchronized and destroyed when dropped"]
pub struct OwnedStream {
    ctx: CtxRef,
    slot: Arc<Slot>,
    _not_sync: PhantomData<Cell<()>>,
}

impl OwnedStream {
    /// Creates a non-blocking stream of the given priority.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::{driver::stream_flags, OwnedStream, Priority};
    /// let s = OwnedStream::new(&ctx, Priority::Low).unwrap();
    /// assert_eq!(s.stream().flags(), stream_flags::NON_BLOCKING);
    /// assert_eq!(ctx.stats().created, 0);            // not a pool's stream
    /// assert!(OwnedStream::new(&ctx, Priority::Value(7)).is_err());   // outside 0 ..= -5
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a priority outside the context's range; the driver's error.
    pub fn new(ctx: &Context, priority: Priority) -> Result<OwnedStream> {
        Self::with_flags(ctx, priority, stream_flags::NON_BLOCKING)
    }

    /// Creates a stream with explicit flags.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, driver::stream_flags, Context, OwnedStream, Priority};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let s = OwnedStream::with_flags(&ctx, Priority::Normal, stream_flags::DEFAULT).unwrap();
    /// assert_eq!(s.stream().flags(), stream_flags::DEFAULT);
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a priority outside the context's range; the driver's error.
    pub fn with_flags(ctx: &Context, priority: Priority, flags: u32) -> Result<OwnedStream> {
        let p = ctx.inner.range.resolve(priority)?;
        let raw = ctx.inner.driver.stream_create(flags, p)?;
        Ok(OwnedStream {
            ctx: CtxRef::new(ctx),
            slot: Arc::new(Slot::new(raw, p, flags)),
            _not_sync: PhantomData,
        })
    }

    /// A reference to the stream, valid while the `OwnedStream` lives.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::{OwnedStream, Priority};
    /// let owned = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    /// let s = owned.stream();
    /// assert!(s.same_stream(&owned.stream()));
    /// s.synchronize().unwrap();
    /// ```
    pub fn stream(&self) -> StreamRef<'_> {
        // SAFETY: the reference borrows `self`, which keeps its context and stream in place
        // until it is dropped.
        unsafe { StreamRef::new(&self.ctx, &self.slot, 1, None) }
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        let (ctx, slot) = (self.ctx.clone(), self.slot.clone());
        off_host_fn_thread(move || destroy_owned(&ctx, slot));
    }
}

/// Synchronizes and destroys an owned stream (kept instead, when that is not safe).
fn destroy_owned(ctx: &Context, slot: Arc<Slot>) {
    // Waits for the stream's work, then destroys it; if that fails (a leaked capture guard, a
    // driver error), the context keeps the stream and destroys it once it is idle: buffers last
    // used on it free on it, ordered, meanwhile.
    ctx.inner.destroy_or_keep(slot, true);
}
