//! # cuda-stream-pool
//!
//! Exclusive, recycled CUDA streams for short-lived units of GPU work.
//!
//! CUDA gives you streams but no policy for them: a stream per task costs a `cuStreamCreate` and
//! a `cuStreamDestroy` (together an order of magnitude slower than taking an idle stream from a
//! pool) and 560 KiB of device memory for as long as it lives, while sharing streams
//! between tasks serializes their work and makes one task wait for another. This crate keeps the
//! streams of finished work in a pool and hands a stream to the next unit of work only once the
//! previous owner is gone **and** its GPU work has completed. Concurrent owners never share a
//! stream, and at most 32 idle streams per (priority, flags) are kept (exactly when: [`MAX_IDLE`]).
//!
//! ```
//! use cuda_stream_pool::{driver, Context, DeviceBuffer};
//! // The real driver when there is a GPU, else the simulation.
//! let (drv, _why_not_cuda) = driver::load(driver::Choice::Auto).unwrap();
//! let ctx = Context::primary(drv, 0).unwrap();
//! for _ in 0..100 {
//!     let owner = ctx.owner();                  // one unit of work
//!     let s = owner.stream().unwrap();          // its own stream, from the pool
//!     let buf = DeviceBuffer::<f32>::zeroed(&s, 1024).unwrap();
//!     assert_eq!(buf.to_vec(&s).unwrap()[0], 0.0);
//! }                                             // stream back to the pool, no waiting
//! assert!(ctx.stats().created <= 2);
//! ```
//!
//! ## Owners and `stream()`
//!
//! An [`Owner`] is a unit of work: a request, an async task, a job. It takes at most one stream
//! per priority from the pool, on first use, and gives them back when dropped, without waiting
//! for their work (a busy stream is simply not handed out again until its work completes). Every
//! thread also has an implicit owner per context ([`Context::with_thread_owner`],
//! [`Context::stream`]), retired when the thread exits.
//!
//! The [`StreamRef`] an owner returns **borrows the owner**: the owner cannot be dropped (and its
//! streams cannot go back to the pool) while a reference is in use, and a reference never leaves
//! its thread. Work that must outlive any owner belongs on an [`OwnedStream`].
//!
//! ## Back-pressure and reserve
//!
//! Exclusive streams mean one live stream per concurrent owner. [`ContextOptions`] can cap the
//! live streams per (priority, flags) key: an owner's first stream then waits, first come first
//! served, until another owner gives one back ([`Owner::stream`] parks the thread,
//! [`Owner::ready`] is a future); an owner that already holds a stream never waits, so waits
//! cannot form a cycle. [`Context::reserve`] creates streams up front so that acquisitions never
//! create in steady state.
//!
//! ## Priorities
//!
//! CUDA fixes a stream's priority at creation; work is scheduled per owner. [`Owner::set_priority`]
//! selects the owner's stream of that priority (creating or taking it from the pool on first use)
//! and orders it after the previously selected stream on the GPU; [`Owner::with_priority`]
//! restores the previous selection after a closure, also when it panics. A number outside the
//! context's [`PriorityRange`] is an error (the driver would silently clamp it), and so is a
//! change while the current stream is capturing.
//!
//! ## Memory and generations
//!
//! Each pooled stream has a generation, bumped whenever it is handed to a new owner. A
//! [`DeviceBuffer`] remembers the (stream, generation) of its last use: used on another stream,
//! it orders that stream after its last use only when the generation is unchanged (a recycled
//! stream's earlier work is known to be complete, and waiting on it would wait for its new
//! owner); freed, it goes on its last stream, or on the context's disposal stream when that was
//! recycled, which its new owner might be capturing.
//!
//! ## Capture
//!
//! [`CaptureGuard`] wraps `cuStreamBeginCapture`/`cuStreamEndCapture`: a failed (for example
//! nested) begin leaves the capture in progress untouched, and a guard dropped without `end`
//! ends the capture and discards the partial graph. The pool's own queries run in relaxed
//! capture mode, so they never invalidate a capture that another thread runs in global mode.
//!
//! ## Errors
//!
//! No public function panics on bad input or on a driver failure: every driver result is checked
//! and returned as [`Error`] (with the driver's code, its name and the entry point). Destructors
//! cannot return errors: a free the driver refuses is kept and retried, ordered, by later
//! operations of the context (never issued unordered); a stream whose synchronization fails is
//! kept rather than destroyed under its work.
//!
//! ## Safety contract
//!
//! From safe code, whatever the threads, captures and drop order, the crate guarantees:
//!
//! * **No GPU use of freed memory.** Every use of a [`DeviceBuffer`] (the crate's copies,
//!   memsets and kernels, a [`BufferUse`] for work of your own, every launch of a graph that
//!   captured the buffer) is ordered after the buffer's previous use and recorded before its work
//!   is enqueued, so a leaked guard is still a use; the free is ordered after the last use. A free that cannot be ordered is kept
//!   and retried, never issued unordered. Graphs keep their buffers (and their context, with its
//!   kernel modules, which are unloaded only by the context's teardown) alive.
//! * **No double free, no use of a destroyed handle.** Streams go back to the pool only once
//!   their owner is gone (enforced by borrows) and their work has completed; a stream is
//!   destroyed only when idle and not captured; host functions are refused in captures (a
//!   captured host node would run its boxed closure on every launch).
//! * **No invalidated capture, no changed thread state.** Every driver call of a context goes
//!   through one device layer (its [`Context::driver`]), which refuses calls on the crate's
//!   host-function threads, makes the context current for the call and restores the thread's
//!   current context, and runs every call that can invalidate a capture (queries,
//!   synchronizations, allocations and frees, host allocations, pool creation and attributes,
//!   graph instantiation, module loads: the H200's table) in relaxed capture mode, restoring the
//!   thread's mode (they invalidate no capture of any thread); operations that a
//!   capture cannot contain (host copies, allocations, synchronize, waits between a capturing and
//!   another stream, host functions, nested graph launches) are refused with
//!   [`Error::CaptureInProgress`] before any driver call; a capture guard borrows its stream's
//!   holder and is not `Send`, so the capture ends on its own thread.
//! * **No user code under the crate's locks.** Wakers are cloned before a lock is taken (a
//!   waiting task's waker is shared in an `Arc`, so the queue copies only a reference count
//!   under its lock), woken and, when replaced, dropped after it; and
//!   owners, buffers, contexts and streams taken out of the crate's lists dropped only after the
//!   lock that guarded them is released, so a waker whose wake or drop re-enters the crate (drops
//!   an [`Owner`], polls its future inline, drops the last [`Context`]) cannot deadlock it.
//!   Every waker the crate keeps is held by one type whose clone, wake and drop run with the
//!   thread's context and capture mode as the crate's caller left them (never the crate's
//!   switched state), on no host-function thread, and with no lock of the crate held: checked
//!   in every test build, which counts the locks each thread holds.
//! * **Teardown where it can complete.** The last [`Context`] dropped on a host-function thread,
//!   on the completion poller's thread (by a waker it runs), or while the poller runs a waker
//!   (which may wait for the dropping thread) is torn down on a thread of its own, which waits
//!   for the poller to exit before freeing the memory it reads. The drop returns at once then;
//!   the context's streams, memory and primary-context retain go shortly after.
//!
//! What is `unsafe`, and what it requires of you:
//!
//! * The [`driver::Driver`] methods that take raw handles (streams, events, graphs, modules,
//!   memory pools, device pointers): each `# Safety` section says which handles must be live. The
//!   raw handles the crate hands out ([`StreamRef::raw`], [`DeviceBuffer::as_raw`],
//!   [`BufferUse::ptr`]) are valid while their holder lives; work you enqueue with them must use a
//!   buffer only while a [`BufferUse`] of it on that stream is alive (not dropped nor
//!   forgotten) and in the capture the stream was in when the use was made (a use made before
//!   a capture began is not registered with it), and must not leave the
//!   stream capturing.
//! * [`Context::adopt`]: the adopted context must outlive the state (pass what keeps it alive).
//! * [`DeviceBuffer::copy_from_host_async`] / [`DeviceBuffer::copy_to_host_async`]: the host
//!   memory must stay valid (and untouched, for a copy to host) until the copy has completed.
//! * [`DeviceCopy`]: implement it only for plain data where every bit pattern is valid.
//!
//! ### Limits that follow from the rules
//!
//! * A buffer whose last use is on a stream that has since begun a capture cannot be used on
//!   another stream until that capture ends ([`Error::CaptureInProgress`]): an event recorded
//!   there now would belong to the capture.
//! * A buffer used in a capture must have no pending use on another stream (a capture cannot wait
//!   for outside work); synchronize that stream, or use the buffer on the capturing stream first.
//! * Allocation inside a capture (graph-owned memory) is refused: allocate before the capture.
//! * [`Context::synchronize`] is `cuCtxSynchronize`, which waits for capturing streams too: while
//!   any stream of the context captures (any thread, any mode) it fails and invalidates that
//!   capture, relaxed mode or not (measured on the H200). The crate itself never synchronizes a
//!   context; synchronize streams instead.
//! * No call of the crate waits for other streams' work unless you asked for a wait. On the
//!   H200 `cuCtxSynchronize`, `cuMemFreeHost`, `cuModuleLoadData` and `cuModuleUnload` wait for
//!   every stream of the device while holding a lock of the driver that every other thread's
//!   call in the context needs: in a process where a stream waits for a flag that the host
//!   writes after its next driver call, such a call deadlocks it. So a context's teardown never
//!   frees its page-locked memory (completion flags, staging blocks): it keeps it for the
//!   context's next state, with the primary context retained, until
//!   [`release_pinned_cache`]. Exceptions: the teardown of an adopted context that is not the
//!   primary one frees it; `kernels::Kernels` (the demo's kernels) loads its module on first
//!   use in a context and unloads it at the teardown.
//! * A leaked (`mem::forget`) [`CaptureGuard`] leaves its stream captured: the pool never hands it
//!   out or destroys it, and frees ordered on it stay pending. A leaked [`BufferUse`] is still a
//!   use (the free orders after it) and keeps the buffer's use lock: other threads' uses of that
//!   buffer block for ever, the leaking thread's are refused.
//! * A stream lent to another crate ([`StreamRef::lend`], cudarc's `Arc<CudaStream>`) stays out
//!   of the pool while any handle of it lives, even after its owner is gone, and is never
//!   destroyed then; it counts against its key's cap until it comes back. What a loan relies on
//!   lives as long as the loan, even when the [`Context`] is dropped first: the state's teardown
//!   then waits (without blocking: the state is kept aside) and keeps the context (the primary
//!   context's retain, or what keeps an adopted one alive, with cudarc's keeper stream and so its
//!   multi-stream mode) until a later call of the crate finds the loans ended. The crate's buffer
//!   work on a lent stream while the borrower captures it is refused
//!   ([`Error::CaptureInProgress`]). A capture that the borrower begins on it from *another*
//!   thread while the owner's thread uses it through the crate races with that check (see
//!   [`StreamRef::lend`]): if it begins between the check and the enqueue, the crate's work is in
//!   a graph that does not keep its buffers alive. Begin such captures only on the owner's
//!   thread, or while that thread is not using the stream.
//! * Inside the crate's host functions (and code they run, such as an [`Owner`] moved into one)
//!   every driver call of a context fails with `CUDA_ERROR_NOT_PERMITTED` instead of reaching the
//!   driver.
//! * A host copy whose wait fails keeps its (staging) host memory with the context until the copy
//!   is known complete; it is leaked if that never happens.
//! * The thread's implicit owner ([`Context::stream`], [`Context::with_thread_owner`],
//!   [`Context::set_priority`]) is refused in a host function and on the crate's own background
//!   threads (the completion poller, which runs wakers that may poll their task inline, and the
//!   waker, loans and teardown threads): those threads never exit, or outlive the context, so an
//!   owner made there would keep the context forever. An [`Owner::attach`]ed task polled there
//!   gets its own owner's stream.
//! * Every [`Context::primary`] (or other constructor) call is a user of its own, with its own
//!   implicit owner on each thread that calls [`Context::stream`] with it; that owner and its
//!   stream stay until the thread exits or [`end_thread_owner`], even after the user's handles
//!   are gone (an object of the user can make a handle again, and the thread's stream must stay
//!   the one stream it was). Make a `Context` once per library and clone it: a thread that calls
//!   `Context::primary(..)?.stream()` per request keeps one stream per call.
//! * User code that the crate runs during an owner's acquisition (a waker it wakes, the last
//!   handle of a loan it finds returned, dropped after the acquisition) may use that same owner.
//! * A kernel that faults its context (a sticky error, [`ErrorCode::is_sticky`]) kills it: every
//!   later call fails with the error. Pending [`Completion`]s and [`HostCopy`]s and waiters at a
//!   cap resolve with it (the crate asks the driver every few milliseconds while they wait and
//!   nothing moves), [`Context::health`] reports it, and what a given-up future kept (a copy's
//!   staging memory) is leaked, as is the dead context's host memory (the driver refuses to free
//!   it).
//! * A forgotten (`mem::forget`) [`OwnerReady`] that is waiting at the cap keeps its place in
//!   the key's queue forever, as an owner that is never dropped keeps its stream: the first stream
//!   released idle while it waits is handed to it and lost with it (the key has one stream fewer
//!   under its cap from then on), and while it is the first waiter the notifications that make
//!   the first waiter try again (a stream released busy that completes later, a destroy) go to it
//!   alone, so the waiters behind it are served only by streams released idle (each handed to the
//!   next waiter in turn). The crate does not try to detect a forgotten waiter: without a timeout
//!   it cannot be told from a slow one. This is the choice tokio makes for its fair `Semaphore`,
//!   whose `Acquire` future, if forgotten, keeps its place in the queue and the permits assigned
//!   to it: leaking is safe, and what a leaked value holds stays taken.
//! * In general, a leaked value of the crate never frees anything early; it keeps what it
//!   holds. Every value that holds a [`Context`] clone (owners, stream references, buffers and
//!   their uses, capture guards, graphs, [`Completion`] and [`HostCopy`] futures, [`OwnerReady`],
//!   kernels) keeps the whole state of that context alive when leaked: its streams, its memory
//!   pool and the primary context's retain are never released. A state kept aside for its loans
//!   is torn down by the first call of the crate (for any context of the process) that finds a
//!   loan of it ended.
//!
//! ## Drivers
//!
//! Everything runs on a [`driver::Driver`]: the real one ([`driver::CudaDriver`], `libcuda`
//! opened at run time, so the crate builds and links without CUDA) or the simulated one
//! ([`driver::SimDriver`]), a model of streams, events, capture and stream-ordered memory with a
//! manual clock, a call log, misuse detection and fault injection, on which the crate's tests,
//! property tests and fuzzer run.
#![warn(missing_docs, missing_debug_implementations)]
// docs.rs builds with `--cfg docsrs` on nightly: label the items of optional features.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod capture;
mod completion;
mod context;
mod ctx_ref;
#[cfg(feature = "cudarc")]
#[cfg_attr(docsrs, doc(cfg(feature = "cudarc")))]
pub mod cudarc;
pub mod driver;
mod error;
mod hostfn;
mod hub;
#[cfg(feature = "kernels")]
#[cfg_attr(docsrs, doc(cfg(feature = "kernels")))]
pub mod kernels;
mod memory;
mod owner;
mod pinned;
mod pool;
mod refs;
mod registry;
mod retry;
mod stream;
mod sync;
/// The model tests' hooks (hidden feature `model-hooks`): the synchronisation layer's
/// (`sync::hook`), and what spans layers.
#[cfg(feature = "model-hooks")]
#[doc(hidden)]
pub mod __model_hooks {
    pub use crate::pinned::model_shelved;
    pub use crate::sync::hook::*;

    /// Makes the calling thread look new to the crate (for a test that reuses its threads
    /// where it would start new ones): it is not listed as parked, no unpark of an earlier use
    /// is pending for it, and its next acquisition picks its home shard as a new thread's
    /// would. Call it where the thread would have been started, with nothing of the crate's in
    /// use on it.
    pub fn fresh_thread() {
        crate::sync::hook::fresh_thread_sync();
        crate::pool::forget_home();
    }
}

#[cfg(feature = "cudarc")]
pub use self::cudarc::{ConvertError, CudarcUse};
pub use capture::{CaptureGuard, Graph, GraphExec};
pub use completion::{Completion, HostCopy};
pub use context::{Context, ContextOptions, MemPoolChoice, Priority, PriorityRange};
pub use driver::CaptureModeGuard;
pub use error::{Error, ErrorCode, LoadError, MissingSymbol, Result};
pub use memory::{BufferUse, DeviceBuffer, DeviceCopy};
pub use owner::{end_thread_owner, Attached, Owner, OwnerReady};
pub use pinned::release_pinned_cache;
pub use pool::{PoolStats, MAX_IDLE};
pub use stream::{OwnedStream, StreamRef};
