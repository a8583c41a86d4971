//! Owners: units of work that hold at most one pooled stream per priority. Also the
//! [`Context`] methods that make owners (here rather than in the context module, which sits
//! below owners in the layering).

use crate::context::{Context, PoolKey, Priority};
use crate::ctx_ref::CtxRef;
use crate::driver::stream_flags;
use crate::error::{Error, Result};
use crate::hostfn::TaskWaker;
use crate::pool::{Mode, Slot, Ticket};
use crate::stream::StreamRef;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::Poll;

struct Held {
    /// The stream's pool, as a key of the owner's context (no reference count per owner).
    pool: PoolKey,
    priority: i32,
    slot: Arc<Slot>,
    gen: u64,
}

struct Inner {
    /// Only pushed to while the owner lives, drained by its drop: a [`StreamRef`] borrowed from
    /// the owner points at these slots (see [`StreamRef::new`]'s contract).
    held: SmallVec<[Held; 2]>,
    current: i32,
    /// A stream (and generation) that this owner's streams must be ordered after before their
    /// next use: the stream of an attached task's previous owner, kept by a `StreamRef` that
    /// escaped a poll (see [`Attached`]). Kept, and retried, until the ordering succeeds or that
    /// generation's work is known to be complete.
    after: Option<(Arc<Slot>, u64)>,
}

impl Inner {
    fn find(&self, priority: i32) -> Option<&Held> {
        self.held.iter().find(|h| h.priority == priority)
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
    ctx: CtxRef,
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
    /// A new owner at normal priority, holding no stream yet (the same as [`Context::owner`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, Owner};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = Owner::new(&ctx);
    /// assert!(o.streams().is_empty());              // nothing taken before the first use
    /// assert_eq!(o.priority(), 0);                  // normal priority
    /// o.stream().unwrap();
    /// assert_eq!(ctx.stats().in_use, 1);
    /// ```
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
            ctx: CtxRef::new(ctx),
            flags,
            inner: RefCell::new(Inner {
                held: SmallVec::new(),
                current: normal,
                after: None,
            }),
        }
    }

    /// The context.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// assert_eq!(o.context().raw(), ctx.raw());
    /// ```
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

    /// The owner's stream at its selected priority, taken from the pool on first use (a retired
    /// stream whose work has completed, else a new one); later calls return the same stream.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let o = ctx.owner();
    /// let s = o.stream().unwrap();
    /// assert!(s.same_stream(&o.stream().unwrap()));  // one stream per priority
    /// drop(s);
    /// drop(o);                                       // the stream goes back to the pool ...
    /// let next = ctx.owner();
    /// next.stream().unwrap();                        // ... and is handed to the next owner
    /// assert_eq!((ctx.stats().created, ctx.stats().hits), (1, 1));
    /// ```
    ///
    /// With a cap on live streams ([`crate::ContextOptions`]), the owner's first stream may have
    /// to wait for another owner to give one back: the thread parks (first come, first served).
    /// In async code use [`Owner::ready`] first, which waits without blocking the thread (a
    /// parked worker of a one-thread runtime waits for ever), or [`Owner::try_stream`], which
    /// never waits. An owner that already holds a stream never waits.
    ///
    /// # Errors
    /// The driver's error when a stream has to be created and cannot be; at the cap on a
    /// host-function thread (which must not wait), [`Error::InvalidArgument`].
    pub fn stream(&self) -> Result<StreamRef<'_>> {
        self.stream_in(Mode::Wait)
    }

    /// [`Owner::stream`] without waiting: when the owner's first stream would wait at the cap
    /// (the key is at its cap, or other owners wait for it and are served first),
    /// [`Error::AtCap`] at once. For code that must not block a thread (async code without
    /// [`Owner::ready`], a latency-bound path); never waits, with or without a cap.
    ///
    /// ```
    /// use cuda_stream_pool::{driver, Context, ContextOptions, Error};
    /// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
    /// let ctx = Context::primary_with(drv, 0, opts).unwrap();
    /// let first = ctx.owner();
    /// let _s = first.try_stream().unwrap();                   // under the cap
    /// let second = ctx.owner();
    /// assert!(matches!(second.try_stream(), Err(Error::AtCap { cap: 1, .. })));
    /// ```
    ///
    /// # Errors
    /// [`Error::AtCap`]; otherwise as [`Owner::stream`].
    pub fn try_stream(&self) -> Result<StreamRef<'_>> {
        self.stream_in(Mode::Try)
    }

    /// [`Owner::stream`]; `first` is the mode of the owner's first stream's acquisition.
    fn stream_in(&self, first: Mode) -> Result<StreamRef<'_>> {
        loop {
            let p = self.inner.borrow().current;
            self.hold(p, first)?;
            let mut inner = self.inner.borrow_mut();
            if inner.current != p {
                // User code run by the acquisition selected another priority: that one's.
                continue;
            }
            let h = self.held_settled(&mut inner, p)?;
            // SAFETY: the reference borrows `self`, whose context field and held streams stay
            // in place until it is dropped (an owner gives no stream back while it lives).
            return Ok(unsafe { StreamRef::new(&self.ctx, &h.slot, h.gen, None) });
        }
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
        let s = self.stream()?;
        let keep: Rc<dyn std::any::Any> = self.clone();
        // SAFETY: `s` borrows the owner in `self`'s `Rc`, which `keep` keeps alive (an `Rc`
        // does not move what it holds).
        Ok(unsafe { s.kept_by(keep) })
    }

    /// Makes the owner hold a stream of priority `p`, acquiring one if it holds none. The
    /// acquisition runs user code (wakers it wakes, the last handles of returned loans, lingering
    /// teardowns), which may use this very owner (it may be the thread's implicit owner): the
    /// owner's state is not borrowed meanwhile. A stream of `p` that such code took for the owner
    /// in the meantime is kept, and the one acquired here given back.
    fn hold(&self, p: i32, first: Mode) -> Result<()> {
        let mode = {
            let inner = self.inner.borrow();
            if inner.find(p).is_some() {
                return Ok(());
            }
            // Only the first stream waits at the cap: an owner that holds one never waits, so
            // no waiting owner holds a stream and waits cannot form a cycle (see
            // `ContextOptions`).
            if inner.held.is_empty() {
                first
            } else {
                Mode::Bypass
            }
        };
        let ci = &self.ctx.inner;
        let key = ci.pool_key(p, self.flags);
        let pool = ci.pool_of(&key);
        // Declared first, dropped last: after the stream is the owner's.
        let _defer = crate::context::DeferLoanDrops::begin();
        let (slot, gen) = ci.acquire(pool, mode)?;
        let mut inner = self.inner.borrow_mut();
        if inner.find(p).is_some() {
            drop(inner);
            ci.release(pool, slot);
            return Ok(());
        }
        inner.held.push(Held {
            pool: key,
            priority: p,
            slot,
            gen,
        });
        Ok(())
    }

    /// The owner's held stream of priority `p` ([`Owner::hold`] first), ordered after
    /// `inner.after` if set.
    fn held_settled<'a>(&self, inner: &'a mut Inner, p: i32) -> Result<&'a Held> {
        let Some(i) = inner.held.iter().position(|h| h.priority == p) else {
            // Not reached: an owner gives no stream back while it lives (`hold` just made it
            // hold one); an error rather than a panic all the same.
            return Err(Error::invalid(
                "the owner's stream was given back while it was being acquired",
            ));
        };
        if inner.after.is_some() {
            self.settle_after(inner, i)?;
        }
        Ok(&inner.held[i])
    }

    /// Orders held stream `i` after `inner.after` (see [`Inner::after`]), then forgets it; or
    /// keeps it and fails, enqueuing nothing, when that is not possible now.
    fn settle_after(&self, inner: &mut Inner, i: usize) -> Result<()> {
        let Some((prev, gen)) = inner.after.clone() else {
            return Ok(());
        };
        let next = inner.held[i].slot.clone();
        let ci = &self.ctx.inner;
        {
            let st = prev.lock();
            if st.is_live(gen) {
                // SAFETY: `prev` is live (its generation is current, under its lock); `next` is
                // held by this owner.
                let capturing = st.capturing
                    || unsafe { ci.capturing(&prev) }
                    || unsafe { ci.capturing(&next) };
                if capturing {
                    return Err(Error::CaptureInProgress(
                        "the task's earlier stream (kept by a StreamRef that escaped a poll) or this one \
                         is capturing: the task's work cannot be ordered after its earlier work \
                         until that capture ends"
                            .into(),
                    ));
                }
                // SAFETY: both live (above) and neither capturing.
                unsafe { ci.order(&prev, &next) }?;
            }
            // (A generation that is no longer live was handed over or destroyed only after its
            // work had completed: nothing to wait for.)
        }
        inner.after = None;
        Ok(())
    }

    /// A future that resolves to this owner once it holds its stream of the selected priority:
    /// the async form of the wait in [`Owner::stream`], for a cap on live streams
    /// ([`crate::ContextOptions`]). Waiters are served first come, first served; the thread is
    /// never blocked (a task is woken when a stream comes back, or when a retired stream's work
    /// completes). Dropping the future before it resolves drops the owner and leaves the queue
    /// (the next waiter gets the turn). The future is `Send`.
    ///
    /// A future that waits in the queue keeps its place there until it is polled to the end or
    /// dropped: one that is leaked (`mem::forget`) or never polled again holds up the waiters
    /// behind it (see "Limits that follow from the rules" in the crate's docs). Drop such
    /// futures instead.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, ContextOptions};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let opts = ContextOptions::default().max_live_streams_per_key(Some(1));
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
    /// range), or the current stream, or the owner's stream of priority `p`, being captured
    /// ([`Error::CaptureInProgress`]). The driver's error when the new stream cannot be made or
    /// ordered (the priority stays as it was; a stream already taken stays with the owner).
    pub fn set_priority(&self, p: Priority) -> Result<()> {
        let value = self.ctx.inner.range.resolve(p)?;
        self.select(value)
    }

    fn select(&self, value: i32) -> Result<()> {
        if self.inner.borrow().current == value {
            return Ok(());
        }
        // The new stream is acquired before the owner's state is borrowed (user code may run:
        // see `hold`), and only once the current one is known not to be capturing (a refused
        // switch takes nothing).
        let current = {
            let inner = self.inner.borrow();
            inner
                .find(inner.current)
                .map(|h| (h.slot.clone(), inner.current))
        };
        if let Some((prev, from)) = current {
            // SAFETY: held by this owner: live.
            if unsafe { self.ctx.inner.capturing(&prev) } {
                return Err(Error::CaptureInProgress(format!(
                    "cannot change priority from {from} to {value} while the owner's stream is \
                     capturing"
                )));
            }
            self.hold(value, Mode::Wait)?;
        }
        let mut inner = self.inner.borrow_mut();
        if inner.current == value {
            return Ok(());
        }
        if let Some(prev) = inner.find(inner.current).map(|h| h.slot.clone()) {
            // SAFETY: held by this owner: live.
            if unsafe { self.ctx.inner.capturing(&prev) } {
                return Err(Error::CaptureInProgress(format!(
                    "cannot change priority from {} to {value} while the owner's stream is \
                     capturing",
                    inner.current
                )));
            }
            let next = self.held_settled(&mut inner, value)?.slot.clone();
            // SAFETY: held by this owner: live.
            if unsafe { self.ctx.inner.capturing(&next) } {
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

    /// The streams the owner holds now: (priority, stream), in the order they were taken.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::Priority;
    /// let o = ctx.owner();
    /// assert!(o.streams().is_empty());
    /// o.stream().unwrap();
    /// o.set_priority(Priority::High).unwrap();
    /// let held: Vec<i32> = o.streams().iter().map(|(p, _)| *p).collect();
    /// assert_eq!(held, vec![0, ctx.priority_range().greatest]);
    /// ```
    pub fn streams(&self) -> Vec<(i32, StreamRef<'_>)> {
        self.inner
            .borrow()
            .held
            .iter()
            // SAFETY: each reference borrows `self`, whose context field and held streams stay
            // in place until it is dropped (an owner gives no stream back while it lives).
            .map(|h| {
                (h.priority, unsafe {
                    StreamRef::new(&self.ctx, &h.slot, h.gen, None)
                })
            })
            .collect()
    }
}

impl Owner {
    /// Makes this owner the current one of its context for `fut`: set during each poll (on
    /// whichever thread polls), restored after, also when the poll panics. See [`Attached`].
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let mine = owner.stream().unwrap().raw();
    /// let c = ctx.clone();
    /// let task = owner.attach(async move {
    ///     // Library code deep inside the task: the task's stream, not the thread's.
    ///     c.stream().unwrap().raw()
    /// });
    /// fn assert_send<T: Send>(_: &T) {}
    /// assert_send(&task);
    /// let seen = futures_lite_block_on(task);
    /// assert_eq!(seen, mine);
    /// # fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     struct W; impl std::task::Wake for W { fn wake(self: std::sync::Arc<Self>) {} }
    /// #     let w = std::task::Waker::from(std::sync::Arc::new(W));
    /// #     let mut cx = std::task::Context::from_waker(&w);
    /// #     let mut f = std::pin::pin!(f);
    /// #     loop { if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; } }
    /// # }
    /// ```
    pub fn attach<F: std::future::Future>(self, fut: F) -> Attached<F> {
        Attached {
            owner: Some(self),
            fut,
        }
    }

    /// A fresh owner to continue with after `escaped` was kept by references that outlived a
    /// poll: same flags and priority, its stream ordered after the escaped one's work.
    fn after_escape(escaped: &Owner) -> Owner {
        let fresh = Owner::with_flags(&escaped.ctx, escaped.flags);
        if let Ok(i) = escaped.inner.try_borrow() {
            let after = i
                .find(i.current)
                .map(|h| (h.slot.clone(), h.gen))
                .or_else(|| i.after.clone());
            let mut f = fresh.inner.borrow_mut();
            f.current = i.current;
            // Ordered (or found complete) at the fresh owner's next stream use; nothing is
            // acquired here, in a destructor that runs at the end of a poll.
            f.after = after;
        }
        fresh
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
            inner.held.is_empty() && !crate::hostfn::on_host_fn_thread()
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
        if let Some(e) = ci.fault(false) {
            // A dead context hands out nothing, as `CtxInner::acquire` (R7-1). A queued waiter
            // leaves as failed: it passes its turn on (dropped as cancelled, it could pass
            // nothing, and the waiters behind it slept for ever: a hang CI saw once).
            if let Some(t) = this.ticket.take() {
                t.failed();
            }
            this.owner = None;
            return Poll::Ready(Err(e));
        }
        let (p, flags) = (owner.inner.borrow().current, owner.flags);
        let key = ci.pool_key(p, flags);
        let pool = ci.pool_of(&key);
        if this.ticket.is_none() && pool.lent_out() > 0 {
            // Parked loans that ended come back first (they count against the cap).
            ci.reclaim_loans();
        }
        let reclaim = || ci.reclaim_loans();
        // The task's waker, cloned before the scope (user code never runs in one: a clone that
        // changed the thread's context or capture mode there would mislead the scope, review
        // 26), and shared by what the acquisition keeps of it; dropped after the scope.
        let waker = Arc::new(TaskWaker::new(cx.waker()));
        let scope = ci.scope();
        let fault = || ci.fault_now_and_then();
        let polled = pool.poll_acquire(&*ci.driver, &reclaim, &fault, &mut this.ticket, cx, &waker);
        drop(scope);
        drop(waker);
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => {
                this.owner = None;
                Poll::Ready(Err(e))
            }
            Poll::Ready(Ok((slot, gen))) => {
                owner.inner.borrow_mut().held.push(Held {
                    pool: key,
                    priority: p,
                    slot,
                    gen,
                });
                Poll::Ready(this.owner.take().ok_or_else(|| Error::invalid("no owner")))
            }
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        let ci = &self.ctx.inner;
        for h in self.inner.get_mut().held.drain(..) {
            ci.release(ci.pool_of(&h.pool), h.slot);
        }
    }
}

/// The calling thread's implicit owners, one per context (keyed by the context state's id).
type ThreadOwners = RefCell<SmallVec<[(u64, Rc<Owner>); 1]>>;

thread_local! {
    static IMPLICIT: ThreadOwners = RefCell::new(SmallVec::new());
    /// Owners made current by [`Attached`] futures while they are polled, innermost last.
    static ATTACHED: ThreadOwners = RefCell::new(SmallVec::new());
}

/// A future with an [`Owner`] that is the *current* owner of its context while the future is
/// polled: [`Context::stream`], [`Context::with_thread_owner`] and [`Context::set_priority`]
/// called (by any code, however deep) during a poll act on this owner, not on the worker
/// thread's implicit owner. Made by [`Owner::attach`]. `Send` when the future is (an `Owner` is
/// `Send`); the owner and its streams are dropped with it, without waiting.
///
/// Why the thread's implicit owner is wrong in async code: an async runtime runs many tasks on
/// each worker thread, interleaved at every `.await`, and moves a task between threads. The
/// thread's owner would give all tasks of a worker one stream (serializing unrelated requests on
/// the GPU and ordering each after the others' work), and a task resumed on another worker would
/// continue on a different stream, unordered after its own earlier work. The attached owner
/// follows the task: one stream per task, wherever it runs.
///
/// A [`StreamRef`] obtained through [`Context::stream`] inside a poll should be dropped before
/// the poll returns (do not hold one across `.await`; take it again after). If one escapes (kept
/// in a thread-local, or held across `.await` by a future that is not `Send`), the escaped
/// references keep the owner's streams, on that thread, until they are dropped; the task
/// continues with a fresh owner whose stream is ordered after the escaped stream's work on the
/// GPU at its next use. When that ordering is not possible then (either stream is capturing),
/// that use fails with [`crate::Error::CaptureInProgress`] and the ordering is retried at the
/// next one: the task's stream order is never given up. So two threads never use one owner, and
/// no stream goes back to the pool while a reference to it lives.
#[must_use = "futures do nothing unless polled"]
pub struct Attached<F> {
    owner: Option<Owner>,
    fut: F,
}

impl<F> std::fmt::Debug for Attached<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attached")
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl<F> Attached<F> {
    /// The attached owner (between polls).
    pub fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }
}

/// Makes `rc` the current owner of its context on this thread until dropped; then takes the
/// owner back (or, when a reference escaped, leaves it to the references and puts a fresh owner,
/// ordered after it, in its place). Runs on panic too.
struct Current<'a> {
    id: u64,
    rc: Option<Rc<Owner>>,
    back: &'a mut Option<Owner>,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        let id = self.id;
        let _ = ATTACHED.try_with(|a| {
            let mut a = a.borrow_mut();
            if let Some(pos) = a.iter().rposition(|(i, _)| *i == id) {
                drop(a.remove(pos));
            }
        });
        let Some(rc) = self.rc.take() else { return };
        match Rc::try_unwrap(rc) {
            Ok(owner) => *self.back = Some(owner),
            Err(escaped) => *self.back = Some(Owner::after_escape(&escaped)),
        }
    }
}

impl<F: std::future::Future> std::future::Future for Attached<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        // SAFETY: `fut` is structurally pinned: it is never moved out of `self` (only polled
        // through this pinned reference, and dropped in place); `owner` is not pinned.
        let this = unsafe { self.get_unchecked_mut() };
        let Some(owner) = this.owner.take() else {
            // Only possible after a panic in `Owner::after_escape`'s caller; poll without one.
            // SAFETY: as above.
            return unsafe { std::pin::Pin::new_unchecked(&mut this.fut) }.poll(cx);
        };
        let id = owner.ctx.user;
        let rc = Rc::new(owner);
        let pushed = ATTACHED
            .try_with(|a| a.borrow_mut().push((id, rc.clone())))
            .is_ok();
        let _current = Current {
            id: if pushed { id } else { u64::MAX },
            rc: Some(rc),
            back: &mut this.owner,
        };
        // SAFETY: as above.
        unsafe { std::pin::Pin::new_unchecked(&mut this.fut) }.poll(cx)
    }
}

fn thread_owner(ctx: &Context) -> Result<Rc<Owner>> {
    // Per user of the state (see `Context::user`), not per state.
    let id = ctx.user;
    let attached = ATTACHED
        .try_with(|a| {
            a.borrow()
                .iter()
                .rev()
                .find(|(i, _)| *i == id)
                .map(|(_, o)| o.clone())
        })
        .ok()
        .flatten();
    if let Some(o) = attached {
        return Ok(o);
    }
    if crate::hostfn::on_host_fn_thread() {
        // Refused before anything is made: an implicit owner made here would live in the
        // driver's host-function thread, which never exits, and keep the context forever.
        return Err(Error::invalid(
            "the thread's implicit owner cannot be used in a host function (the driver's \
             host-function thread never exits: it would keep the context alive forever)",
        ));
    }
    if crate::hostfn::on_crate_thread() {
        // The same for the crate's own background threads (a waker that the completion poller
        // runs and that polls its task inline): they outlive the context or never exit.
        return Err(Error::invalid(
            "the thread's implicit owner cannot be used on the crate's background threads (the \
             completion poller, waker, loans and teardown threads, which a waker polling its \
             task inline runs on): use an explicit Owner, or Owner::attach for async tasks",
        ));
    }
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
    /// [`Error::InvalidArgument`] when called while the thread is exiting, or in a host function
    /// (nothing is made there).
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
    /// assert!(s.same_stream(&ctx.stream().unwrap()));   // the thread's one stream
    /// s.synchronize().unwrap();
    /// ```
    ///
    /// # Errors
    /// As [`Owner::stream`]; [`Error::InvalidArgument`] while the thread is exiting, or in a host
    /// function (refused before an implicit owner is made: the driver's host-function thread
    /// never exits, so that owner would keep the context forever).
    pub fn stream(&self) -> Result<StreamRef<'static>> {
        thread_owner(self)?.stream_shared()
    }

    /// Selects the priority of the calling thread's implicit owner (see [`Owner::set_priority`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::Priority;
    /// ctx.set_priority(Priority::High).unwrap();
    /// assert_eq!(ctx.stream().unwrap().priority(), ctx.priority_range().greatest);
    /// assert!(ctx.set_priority(Priority::Value(1)).is_err());   // outside 0 ..= -5
    /// ```
    ///
    /// # Errors
    /// As [`Owner::set_priority`]; [`Error::InvalidArgument`] while the thread is exiting, or
    /// in a host function.
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
    let id = ctx.user;
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
