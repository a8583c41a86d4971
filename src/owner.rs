//! Owners: units of work that hold at most one pooled stream per priority. Also the
//! [`Context`] methods that make owners (here rather than in the context module, which sits
//! below owners in the layering).

use crate::context::{Context, Priority};
use crate::driver::stream_flags;
use crate::error::{Error, Result};
use crate::pool::{Mode, Pool, Slot, Ticket};
use crate::stream::StreamRef;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;

struct Held {
    pool: Arc<Pool>,
    slot: Arc<Slot>,
    gen: u64,
}

struct Inner {
    held: SmallVec<[Held; 2]>,
    current: i32,
}

impl Inner {
    fn find(&self, priority: i32) -> Option<&Held> {
        self.held.iter().find(|h| h.pool.priority == priority)
    }
}

/// A unit of work (a thread, an async task, a request) that gets its own streams from the pool:
/// at most one per priority, taken on first use and given back, without waiting for their work,
/// when the owner is dropped. Concurrent owners never share a stream.
///
/// The [`StreamRef`]s an owner hands out borrow it, so it cannot be dropped while one is in use.
/// An owner is `Send` (move it with its task) but not `Sync`.
///
/// ```
/// use cuda_stream_pool::{driver, Context, Priority};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();              // taken from the pool
/// owner.with_priority(Priority::High, || {
///     let hi = owner.stream().unwrap();         // the owner's high-priority stream,
///     assert!(!hi.same_stream(&s));             // ordered after `s` on the GPU
/// }).unwrap();
/// assert!(owner.stream().unwrap().same_stream(&s)); // back to the earlier stream
/// drop(s);
/// drop(owner);                                  // streams go back to the pool
/// assert_eq!(ctx.stats().in_use, 0);
/// ```
#[must_use = "an owner gives its streams back when dropped"]
pub struct Owner {
    ctx: Context,
    flags: u32,
    inner: RefCell<Inner>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = self.inner.borrow();
        f.debug_struct("Owner")
            .field("priority", &i.current)
            .field("streams", &i.held.len())
            .finish()
    }
}

impl Owner {
    /// A new owner at normal priority, holding no stream yet.
    pub fn new(ctx: &Context) -> Owner {
        Self::with_flags(ctx, stream_flags::NON_BLOCKING)
    }

    /// A new owner whose streams are created with `flags` (non-blocking by default).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, driver::stream_flags, Context, Owner};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = Owner::with_flags(&ctx, stream_flags::DEFAULT);
    /// assert_eq!(o.stream().unwrap().flags(), stream_flags::DEFAULT);
    /// ```
    pub fn with_flags(ctx: &Context, flags: u32) -> Owner {
        let normal = ctx
            .inner
            .range
            .resolve(Priority::Normal)
            .unwrap_or(ctx.inner.range.least);
        Owner {
            ctx: ctx.clone(),
            flags,
            inner: RefCell::new(Inner {
                held: SmallVec::new(),
                current: normal,
            }),
        }
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The selected priority's number.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, Priority};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// o.set_priority(Priority::High).unwrap();
    /// assert_eq!(o.priority(), ctx.priority_range().greatest);
    /// ```
    pub fn priority(&self) -> i32 {
        self.inner.borrow().current
    }

    /// The owner's stream at its selected priority, taken from the pool on first use.
    ///
    /// With a cap on live streams ([`crate::ContextOptions`]), the owner's first stream may have
    /// to wait for another owner to give one back: the thread parks (first come, first served).
    /// In async code use [`Owner::ready`] first, which waits without blocking the thread. An
    /// owner that already holds a stream never waits.
    ///
    /// # Errors
    /// The driver's error when a stream has to be created and cannot be; at the cap on a
    /// host-function thread (which must not wait), [`Error::InvalidArgument`].
    pub fn stream(&self) -> Result<StreamRef<'_>> {
        let mut inner = self.inner.borrow_mut();
        let p = inner.current;
        let h = self.held_or_acquire(&mut inner, p)?;
        Ok(StreamRef::new(&self.ctx, &h.slot, h.gen, None))
    }

    /// The stream of a shared owner, as a reference that keeps the owner alive (like
    /// [`Context::stream`] for the thread's implicit owner): for holding a stream, or a
    /// [`crate::CaptureGuard`] of it, in the same structure as the owner.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, CaptureGuard};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use std::rc::Rc;
    /// struct Job { guard: CaptureGuard<'static> }   // no borrow to keep beside it
    /// let owner = Rc::new(ctx.owner());
    /// let job = Job { guard: owner.stream_shared().unwrap().begin_capture().unwrap() };
    /// drop(owner);                                   // the guard keeps it alive
    /// job.guard.end().unwrap();
    /// ```
    ///
    /// # Errors
    /// As [`Owner::stream`].
    pub fn stream_shared(self: &Rc<Self>) -> Result<StreamRef<'static>> {
        let (slot, gen) = {
            let s = self.stream()?;
            (s.slot.clone(), s.gen)
        };
        let keep: Rc<dyn std::any::Any> = self.clone();
        Ok(StreamRef::new(&self.ctx, &slot, gen, Some(keep)))
    }

    fn held_or_acquire<'a>(&self, inner: &'a mut Inner, p: i32) -> Result<&'a Held> {
        if let Some(i) = inner.held.iter().position(|h| h.pool.priority == p) {
            return Ok(&inner.held[i]);
        }
        let ci = &self.ctx.inner;
        let pool = ci.pool(p, self.flags);
        // Only the first stream waits at the cap: an owner that holds one never waits, so no
        // waiting owner holds a stream and waits cannot form a cycle (see `ContextOptions`).
        let mode = if inner.held.is_empty() {
            Mode::Wait
        } else {
            Mode::Bypass
        };
        let (slot, gen) = ci.acquire(&pool, mode)?;
        inner.held.push(Held { pool, slot, gen });
        Ok(&inner.held[inner.held.len() - 1])
    }

    /// A future that resolves to this owner once it holds its stream of the selected priority:
    /// the async form of the wait in [`Owner::stream`], for a cap on live streams
    /// ([`crate::ContextOptions`]). Waiters are served first come, first served; the thread is
    /// never blocked (a task is woken when a stream comes back, or when a retired stream's work
    /// completes). Dropping the future before it resolves drops the owner and leaves the queue
    /// (the next waiter gets the turn). The future is `Send`.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, ContextOptions};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let opts = ContextOptions { max_live_streams_per_key: Some(1), ..Default::default() };
    /// let ctx = Context::primary_with(drv, 0, opts).unwrap();
    /// let first = ctx.owner();
    /// first.stream().unwrap();                             // the only stream
    /// use std::future::Future;
    /// let mut next = Box::pin(ctx.owner().ready());
    /// struct Noop;
    /// impl std::task::Wake for Noop { fn wake(self: std::sync::Arc<Self>) {} }
    /// let waker = std::task::Waker::from(std::sync::Arc::new(Noop));
    /// let mut cx = std::task::Context::from_waker(&waker);
    /// assert!(next.as_mut().poll(&mut cx).is_pending());   // waits for `first`
    /// drop(first);
    /// let owner = match next.as_mut().poll(&mut cx) {
    ///     std::task::Poll::Ready(o) => o.unwrap(),
    ///     _ => unreachable!(),
    /// };
    /// owner.stream().unwrap();                             // no wait: it holds it
    /// ```
    pub fn ready(self) -> OwnerReady {
        OwnerReady {
            owner: Some(self),
            ticket: None,
        }
    }

    /// Selects the stream of priority `p` for subsequent work and orders it after the previously
    /// selected stream on the GPU (event record + wait; the CPU does not wait). Before the first
    /// GPU use nothing is created until [`Owner::stream`] is called; switching back reuses the
    /// earlier stream.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, Priority};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// o.stream().unwrap();
    /// o.set_priority(Priority::High).unwrap();      // a second stream, ordered after the first
    /// assert_eq!(o.streams().len(), 2);
    /// assert!(o.set_priority(Priority::Value(-99)).is_err());
    /// ```
    ///
    /// # Errors
    /// Changing nothing: `p` outside the context's range ([`Error::InvalidArgument`] naming the
    /// range), or the current stream being captured ([`Error::CaptureInProgress`]); the driver's
    /// error when the new stream cannot be made or ordered.
    pub fn set_priority(&self, p: Priority) -> Result<()> {
        let value = self.ctx.inner.range.resolve(p)?;
        self.select(value)
    }

    fn select(&self, value: i32) -> Result<()> {
        let mut inner = self.inner.borrow_mut();
        if inner.current == value {
            return Ok(());
        }
        if let Some(prev) = inner.find(inner.current).map(|h| h.slot.clone()) {
            if prev.is_capturing() {
                return Err(Error::CaptureInProgress(format!(
                    "cannot change priority from {} to {value} while the owner's stream is \
                     capturing",
                    inner.current
                )));
            }
            let next = self.held_or_acquire(&mut inner, value)?.slot.clone();
            if next.is_capturing() {
                // A reference taken while it was selected began a capture of it: waiting on
                // outside work would invalidate that capture.
                return Err(Error::CaptureInProgress(format!(
                    "cannot change priority from {} to {value}: the owner's stream of priority \
                     {value} is capturing",
                    inner.current
                )));
            }
            // SAFETY: both streams are held by this owner (live), and neither is capturing
            // (both checked; only this thread, which holds the owner, could begin a capture).
            unsafe { self.ctx.inner.order(&prev, &next) }?;
        }
        inner.current = value;
        Ok(())
    }

    /// Runs `f` with priority `p` selected, then restores the previous selection, ordered after
    /// `f`'s work. If `f` panics, the previous stream is selected again without ordering it after
    /// `f`'s work, and the panic continues.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, Priority};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let p = o.with_priority(Priority::High, || o.priority()).unwrap();
    /// assert_eq!(p, ctx.priority_range().greatest);
    /// assert_eq!(o.priority(), 0);
    /// ```
    ///
    /// # Errors
    /// As [`Owner::set_priority`], for the switch and for the restore (after a failed restore the
    /// previous priority is selected all the same).
    pub fn with_priority<R>(&self, p: Priority, f: impl FnOnce() -> R) -> Result<R> {
        let before = self.priority();
        self.set_priority(p)?;
        struct Restore<'a> {
            owner: &'a Owner,
            before: i32,
            armed: bool,
        }
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                if self.armed {
                    if let Ok(mut i) = self.owner.inner.try_borrow_mut() {
                        i.current = self.before;
                    }
                }
            }
        }
        let mut guard = Restore {
            owner: self,
            before,
            armed: true,
        };
        let r = f();
        guard.armed = false;
        let restored = self.select(before);
        if restored.is_err() {
            self.inner.borrow_mut().current = before;
        }
        restored.map(|_| r)
    }

    /// The streams the owner holds now: (priority, stream).
    pub fn streams(&self) -> Vec<(i32, StreamRef<'_>)> {
        self.inner
            .borrow()
            .held
            .iter()
            .map(|h| {
                (
                    h.pool.priority,
                    StreamRef::new(&self.ctx, &h.slot, h.gen, None),
                )
            })
            .collect()
    }
}

/// The future of [`Owner::ready`]: resolves to the owner holding its stream.
#[must_use = "futures do nothing unless polled"]
pub struct OwnerReady {
    owner: Option<Owner>,
    /// Its place in the queue of the pool's gate while it waits.
    ticket: Option<Ticket>,
}

impl std::fmt::Debug for OwnerReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnerReady")
            .field("owner", &self.owner)
            .field("waiting", &self.ticket.is_some())
            .finish()
    }
}

impl Future for OwnerReady {
    type Output = Result<Owner>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Result<Owner>> {
        let this = &mut *self;
        let Some(owner) = this.owner.as_ref() else {
            return Poll::Ready(Err(Error::invalid("OwnerReady polled after it resolved")));
        };
        let waits = {
            let inner = owner.inner.borrow();
            inner.held.is_empty() && !crate::context::on_host_fn_thread()
        };
        if !waits {
            // Holds a stream already (never waits), or runs in a host function (must not
            // wait): as `stream()`.
            this.ticket = None;
            let r = owner.stream().map(|_| ());
            let owner = this.owner.take();
            return Poll::Ready(r.and_then(|_| owner.ok_or_else(|| Error::invalid("no owner"))));
        }
        let ci = &owner.ctx.inner;
        let (p, flags) = (owner.inner.borrow().current, owner.flags);
        let pool = ci.pool(p, flags);
        match pool.poll_acquire(&*ci.driver, &|| ci.bind(), &mut this.ticket, cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => {
                this.owner = None;
                Poll::Ready(Err(e))
            }
            Poll::Ready(Ok((slot, gen))) => {
                owner.inner.borrow_mut().held.push(Held { pool, slot, gen });
                Poll::Ready(this.owner.take().ok_or_else(|| Error::invalid("no owner")))
            }
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        for h in self.inner.get_mut().held.drain(..) {
            self.ctx.inner.release(&h.pool, h.slot);
        }
    }
}

/// The calling thread's implicit owners, one per context (keyed by the context state's id).
type ThreadOwners = RefCell<SmallVec<[(u64, Rc<Owner>); 1]>>;

thread_local! {
    static IMPLICIT: ThreadOwners = RefCell::new(SmallVec::new());
}

fn thread_owner(ctx: &Context) -> Result<Rc<Owner>> {
    let id = ctx.inner.id;
    IMPLICIT
        .try_with(|m| {
            let mut m = m.borrow_mut();
            if let Some((_, o)) = m.iter().find(|(i, _)| *i == id) {
                return o.clone();
            }
            let o = Rc::new(Owner::new(ctx));
            m.push((id, o.clone()));
            o
        })
        .map_err(|_| Error::invalid("the thread's owner is gone (thread exiting)"))
}

impl Context {
    /// A new explicit owner at normal priority.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// assert!(!a.stream().unwrap().same_stream(&b.stream().unwrap()));
    /// ```
    pub fn owner(&self) -> Owner {
        Owner::new(self)
    }

    /// Runs `f` with the calling thread's implicit owner of this context (created on first use,
    /// retired when the thread exits or at [`end_thread_owner`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let s = ctx.stream().unwrap();                  // the thread's stream
    /// let same = ctx.with_thread_owner(|o| s.same_stream(&o.stream().unwrap())).unwrap();
    /// assert!(same);
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when called while the thread is exiting.
    pub fn with_thread_owner<R>(&self, f: impl FnOnce(&Owner) -> R) -> Result<R> {
        let owner = thread_owner(self)?;
        Ok(f(&owner))
    }

    /// The current stream of the calling thread's implicit owner. The reference keeps that
    /// owner alive: its streams go back to the pool once the thread has exited (or called
    /// [`end_thread_owner`]) and every such reference is dropped.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let s = ctx.stream().unwrap();
    /// s.synchronize().unwrap();
    /// ```
    ///
    /// # Errors
    /// As [`Owner::stream`]; [`Error::InvalidArgument`] while the thread is exiting.
    pub fn stream(&self) -> Result<StreamRef<'static>> {
        thread_owner(self)?.stream_shared()
    }

    /// Selects the priority of the calling thread's implicit owner (see [`Owner::set_priority`]).
    ///
    /// # Errors
    /// As [`Owner::set_priority`].
    pub fn set_priority(&self, p: Priority) -> Result<()> {
        self.with_thread_owner(|o| o.set_priority(p))?
    }
}

/// Retires the calling thread's implicit owner of `ctx` now, instead of at thread exit (its
/// streams go back once no [`Context::stream`] reference keeps it).
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// ctx.stream().unwrap();
/// assert_eq!(ctx.stats().in_use, 1);
/// cuda_stream_pool::end_thread_owner(&ctx);
/// assert_eq!(ctx.stats().in_use, 0);
/// ```
pub fn end_thread_owner(ctx: &Context) {
    let id = ctx.inner.id;
    let taken = IMPLICIT
        .try_with(|m| {
            let mut m = m.borrow_mut();
            m.iter()
                .position(|(i, _)| *i == id)
                .map(|pos| m.remove(pos))
        })
        .ok()
        .flatten();
    drop(taken);
}
