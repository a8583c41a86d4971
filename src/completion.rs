//! Completion as a [`Future`]: [`StreamRef::completed`] and [`DeviceBuffer::to_vec_async`].
//!
//! Mechanism (chosen by measurement on an H200, BENCHMARKS.md "Completion mechanisms"): each
//! completion is a `cuStreamWriteValue64` of a sequence number into a slot of host-mapped memory
//! (`cuMemHostAlloc`, `DEVICEMAP`); the GPU writes it once the stream's earlier work has
//! completed. The future's `poll` reads its slot (a plain atomic load, no driver call); one
//! poller thread per context reads the slots of pending completions, also without any driver
//! call, and wakes their wakers: it reads without pause for 50 µs after a landing or a new
//! completion, then sleeps between sweeps (an eighth of the time since the last landing, up to
//! 1 ms), and is parked when nothing is pending. Measured against a host function that only
//! wakes (`cuLaunchHostFunc`) and a poller querying events, it had the lowest latency and the
//! highest throughput at 16 threads, because no driver call (which serialises across threads)
//! is made to observe completion.
//!
//! A quiet poller is woken by a doorbell instead (issue 22: a poller that costs no CPU while a
//! completion is pending): a completion made while no flag landed for 50 µs also records an
//! event before its write, and the context's doorbell stream (one per context, made on first
//! need, or by `Context::reserve`) waits for that event and runs a host function that unparks
//! the poller. While a single completion is pending, its doorbell has not rung and no other
//! doorbell is being made, the poller parks, for at most 1 ms (a doorbell can wait behind
//! someone else's host function: a context's host functions all run on one driver thread).
//! The completion's own stream gets no host function, so its later work never waits for the
//! driver's host-function thread. With two or more pending the poller reads their flags: the
//! doorbells ring in the order they were enqueued, so one could wait behind another
//! completion's work.
//!
//! Cancellation: a future holds its context, so the slots stay mapped while it lives; a dropped
//! future leaves its entry with the poller, which frees the slot once the write has landed, and
//! with the entry whatever host memory the GPU still writes into (the staging block of a
//! [`HostCopy`]), so nothing is freed early and nothing waits.

use crate::context::Context;
use crate::ctx_ref::CtxRef;
use crate::error::{Error, Result};
use crate::hub::{Entry, Staging};
use crate::memory::{DeviceBuffer, DeviceCopy};
use crate::pool::Slot;
use crate::stream::StreamRef;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskCx, Poll};
/// A future that resolves when the work enqueued on a stream before [`StreamRef::completed`]
/// was called has completed on the GPU. `Send`, `'static` (it borrows nothing; it keeps the
/// context alive), and blocks no thread: the GPU writes a host-mapped flag that the future's
/// `poll` reads without a driver call, and the context's poller thread wakes it.
///
/// Dropping it before it resolves is fine: nothing waits, nothing is freed early. The waker it
/// was last polled with stays with the context's poller until the work completes, and is then
/// woken and dropped there (so what the waker holds, an owner, a buffer, even the last clone of
/// the context, is kept until then).
#[must_use = "a completion does nothing unless awaited"]
pub struct Completion {
    ctx: CtxRef,
    entry: Arc<Entry>,
    /// The stream, the generation and the number of the marker's enqueue: once the marker
    /// landed, the stream's work up to it has completed (see `Slot::completed_through`).
    marker: Option<(Arc<Slot>, u64, crate::pool::Mark)>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("entry", &self.entry)
            .finish()
    }
}

impl Completion {
    /// Whether the work has completed (a read of the flag, no driver call).
    pub fn is_complete(&self) -> bool {
        self.entry.landed()
    }

    /// The context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

impl Future for Completion {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Result<()>> {
        let r = self.entry.poll(cx.waker());
        if let Poll::Ready(Ok(())) = r {
            if let Some((slot, gen, n)) = self.marker.take() {
                slot.completed_through(gen, n);
            }
        }
        r
    }
}

impl<'a> StreamRef<'a> {
    /// A future that resolves once all work enqueued on this stream so far has completed,
    /// without blocking a thread (see [`Completion`]). Enqueues one `cuStreamWriteValue64`.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{self, SimDriver}, Context};
    /// # use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// sim.enqueue_work(s.raw(), 1_000).unwrap();       // 1 µs of GPU work
    /// let done = s.completed().unwrap();
    /// assert!(!done.is_complete());
    /// sim.advance(1_000);
    /// assert!(done.is_complete());
    /// ```
    ///
    /// # Errors
    /// [`Error::CaptureInProgress`] while the stream is capturing (a completion cannot be part
    /// of a graph; nothing is enqueued); the driver's error (the slots are host-mapped memory,
    /// allocated on first use).
    pub fn completed(&self) -> Result<Completion> {
        self.not_capturing("awaiting completion")?;
        let hub = self.ctx().inner.hub();
        // The slab's host allocation runs relaxed, the context current: the device rules.
        let _scope = self.ctx().inner.scope();
        let mut n = crate::pool::Mark::default();
        let entry = hub.completion(|dev, seq, bell| {
            // Numbered and enqueued under the stream's lock, as the enqueues of other threads
            // (frees, event records of a buffer's ordering) are: every enqueue numbered before
            // the marker is before it on the stream too.
            let _st = self.slot().lock();
            // The doorbell's event, before the write (so that the marker covers it): the
            // doorbell rings once the stream got this far; refused, the poller reads the flag.
            // SAFETY: the stream is held by the holder this reference borrows (live) and not
            // capturing (checked; only this thread could begin one); the event is the hub's.
            let recorded = bell.is_some_and(|ev| {
                unsafe {
                    self.ctx()
                        .inner
                        .driver
                        .event_record(ev, self.slot().enqueue())
                }
                .is_ok()
            });
            let raw;
            (raw, n) = self.slot().enqueue_counted();
            // SAFETY: as above; `dev` is the device address of an 8-byte aligned slot of
            // host-mapped memory of the hub, which stays mapped until the write has landed, and
            // no one else writes it while the slot is taken.
            unsafe { self.ctx().inner.driver.stream_write_value64(raw, dev, seq) }?;
            Ok(recorded)
        })?;
        Ok(Completion {
            ctx: CtxRef::new(self.ctx()),
            entry,
            marker: Some((self.slot_arc(), self.gen, n)),
        })
    }
}

/// The future of [`DeviceBuffer::to_vec_async`]: resolves with the buffer's contents once the
/// copy has completed. The copy lands in pinned staging memory of the context; dropping the
/// future before it resolves leaves that memory with the context's poller until the copy has
/// completed.
#[must_use = "the copy's result is only available by awaiting it"]
pub struct HostCopy<T: DeviceCopy> {
    done: Completion,
    staging: Option<Staging>,
    len: usize,
    _t: std::marker::PhantomData<fn() -> T>,
}

impl<T: DeviceCopy> std::fmt::Debug for HostCopy<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCopy").field("len", &self.len).finish()
    }
}

impl<T: DeviceCopy> Future for HostCopy<T> {
    type Output = Result<Vec<T>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Result<Vec<T>>> {
        match Pin::new(&mut self.done).poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Ready(Ok(())) => {
                let Some(s) = self.staging.take() else {
                    return Poll::Ready(Err(Error::invalid("HostCopy polled after completion")));
                };
                let mut v: Vec<T> = Vec::with_capacity(self.len);
                // SAFETY: the copy into the staging block has completed (its completion, enqueued
                // after it on the same stream, landed); the block holds `len` elements of T, any
                // bytes of which are a valid T (DeviceCopy).
                unsafe {
                    std::ptr::copy_nonoverlapping(s.addr as *const T, v.as_mut_ptr(), self.len);
                    v.set_len(self.len);
                }
                self.done.ctx.inner.hub().return_staging(s);
                Poll::Ready(Ok(v))
            }
        }
    }
}

impl<T: DeviceCopy> Drop for HostCopy<T> {
    fn drop(&mut self) {
        let Some(s) = self.staging.take() else { return };
        // The GPU may still write into the block: given back once the copy landed.
        self.done
            .ctx
            .inner
            .hub()
            .return_when_landed(&self.done.entry, s);
    }
}

impl<T: DeviceCopy> DeviceBuffer<T> {
    /// Copies the buffer to the host on `stream`, asynchronously: returns a future that
    /// resolves with the contents once the copy has completed, blocking no thread. The copy is
    /// a use of the buffer (ordered after its previous use, recorded); it lands in pinned
    /// staging memory kept by the context, so the copy is truly asynchronous, and that memory
    /// stays alive until the copy has completed even if the future is dropped.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{self, SimDriver}, Context, DeviceBuffer};
    /// # use std::sync::Arc;
    /// # use std::future::Future;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::from_slice(&s, &[1u32, 2, 3]).unwrap();
    /// let mut copy = std::pin::pin!(b.to_vec_async(&s).unwrap());
    /// sim.advance(0);                                  // the simulated GPU runs the copy
    /// struct Noop;
    /// impl std::task::Wake for Noop { fn wake(self: Arc<Self>) {} }
    /// let waker = std::task::Waker::from(Arc::new(Noop));
    /// let mut cx = std::task::Context::from_waker(&waker);
    /// match copy.as_mut().poll(&mut cx) {
    ///     std::task::Poll::Ready(v) => assert_eq!(v.unwrap(), vec![1, 2, 3]),
    ///     std::task::Poll::Pending => unreachable!("the simulated copy has run"),
    /// }
    /// ```
    ///
    /// # Errors
    /// [`Error::CaptureInProgress`] while the stream is capturing (nothing is enqueued); as
    /// [`DeviceBuffer::use_on`]; the driver's error.
    pub fn to_vec_async(&self, stream: &StreamRef<'_>) -> Result<HostCopy<T>> {
        stream.not_capturing("copying to host memory")?;
        let ctx = stream.context();
        let hub = ctx.inner.hub();
        // The staging allocation runs relaxed, the context current: the device rules.
        let _scope = ctx.inner.scope();
        let bytes = self.len() * std::mem::size_of::<T>();
        let staging = hub.staging(bytes)?;
        // SAFETY: the staging block holds at least `len` elements of T (size class >= bytes,
        // page-aligned), is pinned memory of the hub that nobody else uses while taken, and stays
        // alive until the copy has completed: the HostCopy keeps it, and when dropped early
        // hands it to the completion's entry, which the poller releases after the copy landed.
        let dst = unsafe { std::slice::from_raw_parts_mut(staging.addr as *mut T, self.len()) };
        // SAFETY: as above: `dst` stays valid and untouched until the copy has completed.
        if let Err(e) = unsafe { self.copy_to_host_async(stream, dst) } {
            // Nothing was enqueued (the copy call failed): the block can be reused.
            hub.return_staging(staging);
            return Err(e);
        }
        match stream.completed() {
            Ok(done) => Ok(HostCopy {
                done,
                staging: Some(staging),
                len: self.len(),
                _t: std::marker::PhantomData,
            }),
            Err(e) => {
                // The copy is enqueued but no completion could be: wait for it (ordered), or
                // leak the block when even that fails.
                if stream.synchronize().is_ok() {
                    hub.return_staging(staging);
                } else {
                    // The copy may still be pending: the context keeps the block until the
                    // stream's work is known complete (leaked if never), the hub forgets it.
                    let kept = hub.detach_staging(staging);
                    ctx.inner
                        .keep_host(stream.slot_arc(), stream.gen, Box::new(kept));
                }
                Err(e)
            }
        }
    }

    /// Copies `src` into the buffer on `stream` without waiting and without `unsafe`: `src` is
    /// first copied into pinned staging memory of the context (a host `memcpy`), the copy to
    /// the device is enqueued from there, and the staging memory goes back to the context once
    /// that copy has completed. `src` may be changed or dropped as soon as this returns; the
    /// copy is a use of the buffer (ordered after its previous use, recorded), so work that
    /// uses the buffer afterwards, on any stream, sees the new contents.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let mut b = DeviceBuffer::<u16>::zeroed(&s, 3).unwrap();
    /// let mut src = vec![4u16, 5, 6];
    /// b.copy_from_host_staged(&s, &src).unwrap();   // returns at once
    /// src.clear();                                   // no longer needed by the copy
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![4, 5, 6]);
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the lengths differ; [`Error::CaptureInProgress`] while
    /// the stream is capturing (nothing is enqueued); as [`DeviceBuffer::use_on`]; the driver's
    /// error (for the staging memory, the copy, or its completion).
    pub fn copy_from_host_staged(&mut self, stream: &StreamRef<'_>, src: &[T]) -> Result<()> {
        if src.len() != self.len() {
            return Err(Error::invalid(format!(
                "copy_from_host_staged: {} host elements for a buffer of {}",
                src.len(),
                self.len()
            )));
        }
        stream.not_capturing("copying from host memory")?;
        let ctx = stream.context();
        let hub = ctx.inner.hub();
        // The staging allocation runs relaxed, the context current: the device rules.
        let _scope = ctx.inner.scope();
        let bytes = std::mem::size_of_val(src);
        let staging = hub.staging(bytes)?;
        // SAFETY: the staging block holds at least `bytes` bytes (size class >= bytes,
        // page-aligned, so aligned for T), is pinned memory of the hub that nobody else uses
        // while taken; `src` is `bytes` bytes of plain data (DeviceCopy).
        let data = unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr() as *const u8,
                staging.addr as *mut u8,
                bytes,
            );
            std::slice::from_raw_parts(staging.addr as *const T, src.len())
        };
        // SAFETY: `data` (the staging block) stays valid and unchanged until the copy has
        // completed: it goes back to the hub only after the completion enqueued behind the
        // copy landed, or after a synchronize of the stream, or never (kept below).
        if let Err(e) = unsafe { self.copy_from_host_async(stream, data) } {
            // Nothing was enqueued (the copy call failed): the block can be reused.
            hub.return_staging(staging);
            return Err(e);
        }
        match stream.completed() {
            Ok(done) => {
                // Given back by the poller once the copy landed (at once if it has).
                hub.return_when_landed(&done.entry, staging);
                Ok(())
            }
            Err(e) => {
                // The copy is enqueued but no completion could be: wait for it (ordered), or
                // keep the block until the stream's work is known complete.
                if stream.synchronize().is_ok() {
                    hub.return_staging(staging);
                    Ok(())
                } else {
                    let kept = hub.detach_staging(staging);
                    ctx.inner
                        .keep_host(stream.slot_arc(), stream.gen, Box::new(kept));
                    Err(e)
                }
            }
        }
    }

    /// Allocates on `stream` and copies `data` in through staging memory, without waiting (see
    /// [`DeviceBuffer::copy_from_host_staged`]); [`DeviceBuffer::from_slice`] waits for the copy.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::from_slice_staged(&s, &[1.5f32, 2.5]).unwrap();
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![1.5, 2.5]);
    /// ```
    ///
    /// # Errors
    /// As [`DeviceBuffer::alloc`] and [`DeviceBuffer::copy_from_host_staged`].
    pub fn from_slice_staged(stream: &StreamRef<'_>, data: &[T]) -> Result<Self> {
        let mut b = Self::alloc(stream, data.len())?;
        b.copy_from_host_staged(stream, data)?;
        Ok(b)
    }
}
