//! Stream handles: [`StreamRef`], an owner's (or an [`OwnedStream`]'s) stream, and
//! [`OwnedStream`], a plain stream outside the pool.

use crate::context::{Context, Priority};
use crate::driver::{self, stream_flags, HostFn};
use crate::error::{Error, Result};
use crate::pool::Slot;
use std::sync::Arc;

/// A handle to a stream of the crate, valid for one generation of the stream.
///
/// An owner's stream belongs to the owner: once the owner is dropped, the stream goes back to the
/// pool and may be handed to someone else. The handle notices: every operation through it returns
/// [`Error::StaleStream`] after that (check with [`StreamRef::is_current`]). The raw handle from
/// [`StreamRef::raw`] cannot be checked; do not use it beyond the owner's life. Work that must
/// outlive its owner belongs on an [`OwnedStream`].
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// s.synchronize().unwrap();
/// drop(owner);
/// assert_eq!(s.synchronize(), Err(cuda_stream_pool::Error::StaleStream));
/// ```
#[derive(Clone)]
pub struct StreamRef {
    pub(crate) ctx: Context,
    pub(crate) slot: Arc<Slot>,
    pub(crate) gen: u64,
}

impl std::fmt::Debug for StreamRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamRef")
            .field("raw", &self.slot.raw)
            .field("priority", &self.slot.priority)
            .field("generation", &self.gen)
            .finish()
    }
}

impl StreamRef {
    /// The raw `CUstream`, for launching with other crates. Valid while the owner holds the
    /// stream (or the [`OwnedStream`] lives).
    pub fn raw(&self) -> driver::Stream {
        self.slot.raw
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The stream's priority.
    pub fn priority(&self) -> i32 {
        self.slot.priority
    }

    /// The stream's creation flags.
    pub fn flags(&self) -> u32 {
        self.slot.flags
    }

    /// The generation this handle was made for.
    pub fn generation(&self) -> u64 {
        self.gen
    }

    /// Whether the stream still belongs to the owner this handle came from.
    pub fn is_current(&self) -> bool {
        self.slot.is_current(self.gen)
    }

    /// Whether two handles name the same stream (by object, never by handle value).
    pub fn same_stream(&self, other: &StreamRef) -> bool {
        Arc::ptr_eq(&self.slot, &other.slot)
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.is_current() {
            Ok(())
        } else {
            Err(Error::StaleStream)
        }
    }

    /// Blocks until the stream's work has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.check()?;
        self.ctx.inner.driver.stream_synchronize(self.slot.raw)
    }

    /// Whether the stream's work has completed.
    pub fn query(&self) -> Result<bool> {
        self.check()?;
        self.ctx.inner.driver.stream_query(self.slot.raw)
    }

    /// Orders later work on this stream after the work enqueued so far on `other` (event record
    /// + wait, on the GPU).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// let (sa, sb) = (a.stream().unwrap(), b.stream().unwrap());
    /// sb.wait_for(&sa).unwrap();                      // sb's later work runs after sa's
    /// ```
    pub fn wait_for(&self, other: &StreamRef) -> Result<()> {
        self.check()?;
        other.check()?;
        if !self.ctx.same(&other.ctx) {
            return Err(Error::invalid("streams of different contexts"));
        }
        self.ctx.inner.order(other.slot.raw, self.slot.raw)
    }

    /// Enqueues a host function; it runs on a driver thread once earlier work has completed and
    /// must not call the driver.
    pub fn launch_host_func(&self, f: impl FnOnce() + Send + 'static) -> Result<()> {
        self.check()?;
        let f: HostFn = Box::new(f);
        self.ctx.inner.driver.launch_host_func(self.slot.raw, f)
    }

    /// Whether the stream is being captured (`cuStreamIsCapturing`).
    pub fn is_capturing(&self) -> Result<bool> {
        self.check()?;
        Ok(
            self.ctx.inner.driver.stream_is_capturing(self.slot.raw)?
                != driver::CaptureStatus::None,
        )
    }
}

/// A stream of your own, outside the pool: for work that must outlive any owner. Synchronized
/// and destroyed when dropped.
///
/// ```
/// use cuda_stream_pool::{driver, Context, OwnedStream, Priority};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// let s = OwnedStream::new(&ctx, Priority::High).unwrap();
/// assert_eq!(s.priority(), ctx.priority_range().greatest);
/// ```
#[derive(Debug)]
pub struct OwnedStream {
    stream: StreamRef,
}

impl OwnedStream {
    /// Creates a non-blocking stream of the given priority.
    pub fn new(ctx: &Context, priority: Priority) -> Result<OwnedStream> {
        Self::with_flags(ctx, priority, stream_flags::NON_BLOCKING)
    }

    /// Creates a stream with explicit flags.
    pub fn with_flags(ctx: &Context, priority: Priority, flags: u32) -> Result<OwnedStream> {
        let p = ctx.inner.range.resolve(priority)?;
        ctx.inner.bind()?;
        let raw = ctx.inner.driver.stream_create(flags, p)?;
        Ok(OwnedStream {
            stream: StreamRef {
                ctx: ctx.clone(),
                slot: Arc::new(Slot::new(raw, p, flags)),
                gen: 1,
            },
        })
    }
}

impl std::ops::Deref for OwnedStream {
    type Target = StreamRef;
    fn deref(&self) -> &StreamRef {
        &self.stream
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        let d = &self.stream.ctx.inner.driver;
        let mut st = self.stream.slot.lock();
        let _ = d.stream_synchronize(self.stream.slot.raw);
        st.destroy();
        let _ = d.stream_destroy(self.stream.slot.raw);
    }
}
