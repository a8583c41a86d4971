//! [`CtxRef`]: how the crate's objects (owners, buffers, completions, captures, graphs, owned
//! streams, kernels) hold their context: counted in the calling thread's shard of the state's
//! [`Refs`](crate::refs::Refs), not in the `Arc`'s one count that every thread writes. Making
//! and dropping an owner on 16 threads at once then writes no shared cache line for its context
//! (`benches/pool.rs`: `threads/pool/16`; `threads/context_clone` measures what a clone of the
//! shared count costs).
use crate::context::{Context, CtxInner};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// A counted reference to a context's state that derefs to a [`Context`] (see the module docs).
pub(crate) struct CtxRef {
    /// A bitwise copy of a handle, never dropped and not counted in the state's handles: the
    /// state lives while this reference is counted in `shard` (the shard then holds a strong
    /// reference; see `refs.rs`). Cloned (`Context::clone`), it gives a counted handle.
    ctx: ManuallyDrop<Context>,
    shard: usize,
}

impl CtxRef {
    /// A reference to `ctx`'s state, counted in the calling thread's shard.
    pub(crate) fn new(ctx: &Context) -> CtxRef {
        let p = Arc::as_ptr(&ctx.inner);
        let shard = ctx.inner.refs.enter(
            crate::pool::home_index(),
            // SAFETY (both): `p` comes from a live `Arc` (the caller's `ctx`, which is alive
            // across the call and keeps the count above zero); the shard's reference is given
            // back by the exit or the last handle's drop that clears its `HOLDS`, and an extra
            // one at once.
            || unsafe { Arc::increment_strong_count(p) },
            || unsafe { Arc::decrement_strong_count(p) },
        );
        CtxRef {
            // SAFETY: a copy of the handle's fields that is never dropped (`ManuallyDrop`), used
            // only while this reference is counted: its shard then holds a strong reference
            // (entered above, exited in `drop`), so the `Arc` it copies stays valid.
            ctx: ManuallyDrop::new(unsafe { std::ptr::read(ctx) }),
            shard,
        }
    }
}

impl Clone for CtxRef {
    fn clone(&self) -> CtxRef {
        CtxRef::new(&self.ctx)
    }
}

impl std::ops::Deref for CtxRef {
    type Target = Context;
    fn deref(&self) -> &Context {
        &self.ctx
    }
}

impl Drop for CtxRef {
    fn drop(&mut self) {
        let inner: &Arc<CtxInner> = &self.ctx.inner;
        let p = Arc::as_ptr(inner);
        if inner.refs.exit(self.shard) {
            // SAFETY: the shard's strong reference, taken in `CtxRef::new` (of this or another
            // reference of the shard) and given up once (its `HOLDS` cleared by this exit). `p`
            // was taken before the exit: once the exit's compare-exchange has uncounted this
            // reference, another thread may free the state (whatever the exit returned), so
            // nothing of it is read after; this may be its last reference (the teardown runs
            // here).
            unsafe { Arc::decrement_strong_count(p) };
        }
    }
}

impl std::fmt::Debug for CtxRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&*self.ctx, f)
    }
}
