//! # cuda-stream-pool
//!
//! Exclusive, recycled CUDA streams for short-lived units of GPU work.
//!
//! CUDA gives you streams but no policy for them: a stream per task costs a `cuStreamCreate`
//! (about 40 µs) and 560 KiB of device memory for as long as it lives, while sharing streams
//! between tasks serializes their work and makes one task wait for another. This crate keeps the
//! streams of finished work in a pool and hands a stream to the next unit of work only once the
//! previous owner is gone **and** its GPU work has completed. Concurrent owners never share a
//! stream, and at most 32 idle streams per (priority, flags) are kept.
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
//! The stream an owner returns **belongs to the owner**. A [`StreamRef`] used after its owner is
//! gone returns [`Error::StaleStream`]; the raw handle ([`StreamRef::raw`]) cannot be checked, so
//! do not keep it. Work that must outlive any owner belongs on an [`OwnedStream`].
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
//! cannot return errors; where a driver call fails in one (a free, a stream or graph destroy),
//! the crate retries or falls back (a free that fails is retried on the disposal stream and, failing
//! that, kept until the next [`Context::trim`] or teardown) and otherwise ignores the failure.
//!
//! ## Drivers
//!
//! Everything runs on a [`driver::Driver`]: the real one ([`driver::CudaDriver`], `libcuda`
//! opened at run time, so the crate builds and links without CUDA) or the simulated one
//! ([`driver::SimDriver`]), a model of streams, events, capture and stream-ordered memory with a
//! manual clock, a call log, misuse detection and fault injection, on which the crate's tests,
//! property tests and fuzzer run.
#![warn(missing_docs, missing_debug_implementations)]

mod capture;
mod context;
pub mod driver;
mod error;
pub mod kernels;
mod memory;
mod owner;
mod pool;
mod stream;

pub use capture::{CaptureGuard, CaptureModeGuard, Graph, GraphExec};
pub use context::{Context, Priority, PriorityRange};
pub use error::{Error, ErrorCode, LoadError, MissingSymbol, Result};
pub use memory::{DeviceBuffer, DeviceCopy};
pub use owner::{end_thread_owner, Owner};
pub use pool::{PoolStats, MAX_IDLE};
pub use stream::{OwnedStream, StreamRef};
