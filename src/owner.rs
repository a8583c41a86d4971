//! Owners: units of work that hold at most one pooled stream per priority.

use crate::context::{Context, Priority};
use crate::driver::{stream_flags, CaptureStatus};
use crate::error::{Error, Result};
use crate::pool::{Pool, Slot};
use crate::stream::StreamRef;
use smallvec::SmallVec;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

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
/// The streams belong to the owner: a [`StreamRef`] kept beyond the owner's life turns stale
/// (its operations fail with [`Error::StaleStream`]); use an [`crate::OwnedStream`] for work that
/// outlives the owner.
///
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
/// drop(owner);                                  // streams go back to the pool
/// assert!(!s.is_current());
/// ```
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
    pub fn priority(&self) -> i32 {
        self.inner.borrow().current
    }

    /// The owner's stream at its selected priority, taken from the pool on first use.
    pub fn stream(&self) -> Result<StreamRef> {
        let mut inner = self.inner.borrow_mut();
        let p = inner.current;
        let h = self.held_or_acquire(&mut inner, p)?;
        Ok(StreamRef {
            ctx: self.ctx.clone(),
            slot: h.slot.clone(),
            gen: h.gen,
        })
    }

    fn held_or_acquire<'a>(&self, inner: &'a mut Inner, p: i32) -> Result<&'a Held> {
        if let Some(i) = inner.held.iter().position(|h| h.pool.priority == p) {
            return Ok(&inner.held[i]);
        }
        let ci = &self.ctx.inner;
        let pool = ci.pool(p, self.flags);
        let (slot, gen) = pool.acquire(ci)?;
        inner.held.push(Held { pool, slot, gen });
        Ok(inner.held.last().unwrap())
    }

    /// Selects the stream of priority `p` for subsequent work and orders it after the previously
    /// selected stream on the GPU (event record + wait; the CPU does not wait). Before the first
    /// GPU use nothing is created until [`Owner::stream`] is called; switching back reuses the
    /// earlier stream.
    ///
    /// Errors, changing nothing: `p` outside the context's range ([`Error::InvalidArgument`]
    /// naming the range), or the current stream being captured ([`Error::CaptureInProgress`]).
    pub fn set_priority(&self, p: Priority) -> Result<()> {
        let value = self.ctx.inner.range.resolve(p)?;
        self.select(value, true)
    }

    fn select(&self, value: i32, ordered: bool) -> Result<()> {
        let mut inner = self.inner.borrow_mut();
        if inner.current == value {
            return Ok(());
        }
        let d = &self.ctx.inner.driver;
        let prev = inner.find(inner.current).map(|h| h.slot.raw);
        if let Some(prev) = prev {
            if d.stream_is_capturing(prev)? != CaptureStatus::None {
                return Err(Error::CaptureInProgress(format!(
                    "cannot change priority from {} to {value} while the owner's stream is \
                     capturing",
                    inner.current
                )));
            }
            if ordered {
                let next = self.held_or_acquire(&mut inner, value)?.slot.raw;
                self.ctx.inner.order(prev, next)?;
            }
        }
        inner.current = value;
        Ok(())
    }

    /// Runs `f` with priority `p` selected, then restores the previous selection, ordered after
    /// `f`'s work. If `f` panics, the previous stream is selected again without ordering it after
    /// `f`'s work, and the panic continues.
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
        let restored = self.select(before, true);
        if restored.is_err() {
            self.inner.borrow_mut().current = before;
        }
        restored.map(|_| r)
    }

    /// The streams the owner holds now: (priority, stream).
    pub fn streams(&self) -> Vec<(i32, StreamRef)> {
        self.inner
            .borrow()
            .held
            .iter()
            .map(|h| {
                (
                    h.pool.priority,
                    StreamRef {
                        ctx: self.ctx.clone(),
                        slot: h.slot.clone(),
                        gen: h.gen,
                    },
                )
            })
            .collect()
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        for h in self.inner.get_mut().held.drain(..) {
            h.pool.release(h.slot);
        }
    }
}

/// The calling thread's implicit owners, one per context (keyed by the context state's id).
type ThreadOwners = RefCell<SmallVec<[(u64, Rc<Owner>); 1]>>;

thread_local! {
    static IMPLICIT: ThreadOwners = RefCell::new(SmallVec::new());
}

pub(crate) fn with_thread_owner<R>(ctx: &Context, f: impl FnOnce(&Owner) -> R) -> Result<R> {
    let id = ctx.inner.id;
    let owner = IMPLICIT
        .try_with(|m| {
            let mut m = m.borrow_mut();
            if let Some((_, o)) = m.iter().find(|(i, _)| *i == id) {
                return o.clone();
            }
            let o = Rc::new(Owner::new(ctx));
            m.push((id, o.clone()));
            o
        })
        .map_err(|_| Error::invalid("the thread's owner is gone (thread exiting)"))?;
    Ok(f(&owner))
}

/// Retires the calling thread's implicit owner of `ctx` now, instead of at thread exit.
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let s = ctx.stream().unwrap();
/// cuda_stream_pool::end_thread_owner(&ctx);
/// assert!(!s.is_current());
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
