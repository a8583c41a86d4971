//! Graph capture with guards that leave the capture state as they found it.
//!
//! * [`StreamRef::begin_capture`] returns a [`CaptureGuard`] that borrows the stream's holder
//!   (so the owner or [`crate::OwnedStream`] cannot be dropped while it captures) and is not
//!   `Send` (a capture ends on the thread that began it). If the begin fails (for instance a
//!   nested begin on a stream that is already capturing, which the driver rejects with
//!   `CUDA_ERROR_ILLEGAL_STATE`), the error is returned and the capture in progress is untouched:
//!   no guard exists that could end it.
//! * [`CaptureGuard::end`] returns the [`Graph`]. A guard dropped without `end` (early return,
//!   `?`, panic) ends the capture and destroys the partial graph, leaving the stream usable.
//! * The buffers that captured work uses are kept alive by the graph, and every
//!   [`GraphExec::launch`] is a use of each of them (ordered after their last use, and recorded
//!   as their new last use), so none is freed before a launch that uses it has run.
//! * What the crate refuses on a capturing stream, because the real driver would turn it into
//!   something unsafe or invalidate the capture: host functions (a captured host node runs on
//!   every launch with the same data), blocking copies, synchronize/query, waits between a
//!   capturing and another stream (fork/join), allocations, and graph launches.
//!
//! The default mode of [`StreamRef::begin_capture`] is [`CaptureMode::ThreadLocal`]: calls that
//! are unsafe during capture are rejected on the capturing thread (where they are bugs), while
//! other threads are not affected. Pass [`CaptureMode::Global`] to
//! [`StreamRef::begin_capture_with`] to get CUDA's default. Either way the crate's own queries,
//! synchronizations, allocations and frees run in relaxed mode and invalidate no capture.

use crate::ctx_ref::CtxRef;
use crate::driver::{self, CaptureMode, CaptureStatus};
use crate::error::{Error, ErrorCode, Result};
use crate::hostfn::off_host_fn_thread;
use crate::memory::launch_with_uses;
use crate::pool::CapturedUse;
use crate::stream::StreamRef;

/// An active capture of a stream (RAII around `cuStreamBeginCapture` / `cuStreamEndCapture`).
///
/// * Made by [`StreamRef::begin_capture`] (thread-local mode) or
///   [`StreamRef::begin_capture_with`]. If the begin fails, the error is returned and the
///   capture in progress is untouched.
/// * [`CaptureGuard::end`] returns the [`Graph`]; an invalidated capture reports its error there.
/// * Dropped without `end`, the guard ends the capture and destroys the partial graph.
/// * When the driver fails the end three times and does not say the stream stopped capturing,
///   the stream may still be capturing: it is never used again (never handed to another owner,
///   never queried or destroyed), and it keeps its place under its key's cap
///   ([`crate::ContextOptions::max_live_streams_per_key`]) for the rest of the state's life: a
///   waiter at that cap is served only by the key's other streams. (Found by the fuzzer; a
///   later retry of the end is not implemented.)
///
/// ```
/// use cuda_stream_pool::{driver, Context, DeviceBuffer};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// let mut buf = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
/// let guard = s.begin_capture().unwrap();
/// assert!(s.begin_capture().is_err());          // nested begin fails ...
/// buf.fill(&s, 7).unwrap();                      // ... and the outer capture goes on
/// let exec = guard.end().unwrap().instantiate().unwrap();
/// exec.launch(&s).unwrap();
/// assert_eq!(buf.to_vec(&s).unwrap(), vec![7; 4]);
/// ```
///
/// The guard borrows the stream's owner, and stays on its thread:
///
/// ```compile_fail
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let g = owner.stream().unwrap().begin_capture().unwrap();
/// drop(owner);                  // error: `owner` is borrowed by the guard
/// drop(g);
/// ```
///
/// ```compile_fail
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let g = owner.stream().unwrap().begin_capture().unwrap();
/// std::thread::scope(|sc| { sc.spawn(move || g.end()); }); // error: the guard is not Send
/// ```
#[must_use = "dropping the guard ends the capture at once and discards the graph"]
pub struct CaptureGuard<'a> {
    stream: StreamRef<'a>,
    done: bool,
}

impl<'a> StreamRef<'a> {
    /// Begins capturing this stream in thread-local mode.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::DeviceBuffer;
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let mut b = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    /// let g = s.begin_capture().unwrap();
    /// b.fill(&s, 1).unwrap();                        // recorded, not run
    /// let graph = g.end().unwrap();
    /// assert_eq!(graph.node_count().unwrap(), 1);
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![0; 4]);
    /// ```
    ///
    /// # Errors
    /// As [`StreamRef::begin_capture_with`].
    pub fn begin_capture(&self) -> Result<CaptureGuard<'a>> {
        self.begin_capture_with(CaptureMode::ThreadLocal)
    }

    /// Begins capturing this stream in `mode`. On failure the stream's capture state, whatever
    /// it was, is unchanged.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{self, CaptureMode}, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let g = s.begin_capture_with(CaptureMode::Global).unwrap();
    /// assert!(s.is_capturing().unwrap());
    /// drop(g);                                       // ends it, discarding the graph
    /// assert!(!s.is_capturing().unwrap());
    /// ```
    ///
    /// # Errors
    /// The driver's error, e.g. `CUDA_ERROR_ILLEGAL_STATE` for a nested begin.
    pub fn begin_capture_with(&self, mode: CaptureMode) -> Result<CaptureGuard<'a>> {
        let mut st = self.slot().lock();
        // SAFETY: the stream is held by the holder this reference borrows: live.
        unsafe {
            self.ctx()
                .inner
                .driver
                .stream_begin_capture(self.slot().enqueue(), mode)
        }?;
        let stale = st.begin_capture();
        drop(st);
        drop(stale);
        Ok(CaptureGuard {
            stream: self.clone(),
            done: false,
        })
    }
}

impl std::fmt::Debug for CaptureGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureGuard")
            .field("stream", &self.stream)
            .field("done", &self.done)
            .finish()
    }
}

impl<'a> CaptureGuard<'a> {
    /// The stream being captured.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let g = s.begin_capture().unwrap();
    /// assert!(g.stream().same_stream(&s));
    /// ```
    pub fn stream(&self) -> &StreamRef<'a> {
        &self.stream
    }

    /// The capture's status and unique id (`cuStreamGetCaptureInfo`).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{self, CaptureStatus}, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let g = s.begin_capture().unwrap();
    /// assert_eq!(g.info().unwrap().0, CaptureStatus::Active);
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn info(&self) -> Result<(CaptureStatus, u64)> {
        // SAFETY: the stream is held by the holder the guard borrows: live.
        unsafe {
            self.stream
                .ctx()
                .inner
                .driver
                .stream_capture_info(self.stream.slot().observe())
        }
    }

    fn finish(&mut self) -> (Result<driver::Graph>, Vec<CapturedUse>) {
        self.done = true;
        let ci = &self.stream.ctx().inner;
        let raw = self.stream.slot().observe();
        // SAFETY (both closures): the stream is held by the holder the guard borrows: live.
        let status =
            || unsafe { ci.driver.stream_is_capturing(raw) }.map(|s| s != CaptureStatus::None);
        let end = || unsafe { ci.driver.stream_end_capture(raw) };
        let mut r = end();
        // A failed end that left the capture running (a transient failure) is retried, so that the
        // stream is not left capturing; the first error is the one reported.
        for _ in 0..2 {
            if r.is_ok() || status() == Ok(false) {
                break;
            }
            match end() {
                Ok(g) => r = Ok(g),
                Err(e) if e.code() == Some(ErrorCode::ERROR_ILLEGAL_STATE) => break,
                Err(_) => {}
            }
        }
        let mut uses = Vec::new();
        // A successful end ended the capture whatever a status query says; after a failed end,
        // only a query that answers "not capturing" does (else the stream stays flagged, and the
        // pool never hands it out).
        if r.is_ok() || status() == Ok(false) {
            uses = self.stream.slot().lock().end_capture();
            ci.flush_deferred();
        } else {
            // The driver may still be capturing: the stream stays flagged (the pool never hands
            // it out) until a later begin on it succeeds.
        }
        (r, uses)
    }

    /// Ends the capture and returns the graph. An invalidated capture reports its error here and
    /// leaves the stream not capturing.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv.clone(), 0).unwrap();
    /// use cuda_stream_pool::ErrorCode;
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let g = s.begin_capture().unwrap();
    /// // A call that a capture forbids, made on the capturing thread outside the crate (with
    /// // the raw driver: the context's own driver would run it in relaxed mode):
    /// ctx.bind().unwrap();
    /// assert!(drv.ctx_synchronize().is_err());
    /// let e = g.end().unwrap_err();
    /// assert_eq!(e.code(), Some(ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED));
    /// assert!(!s.is_capturing().unwrap());           // the stream is usable again
    /// ```
    ///
    /// # Errors
    /// The driver's error, e.g. `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
    pub fn end(mut self) -> Result<Graph> {
        let (raw, uses) = self.finish();
        Ok(Graph {
            ctx: CtxRef::new(self.stream.ctx()),
            raw: raw?,
            uses,
        })
    }
}

impl Drop for CaptureGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            if let (Ok(raw), uses) = self.finish() {
                drop(Graph {
                    ctx: CtxRef::new(self.stream.ctx()),
                    raw,
                    uses,
                });
            }
        }
    }
}

/// A captured graph; destroyed when dropped. It keeps alive the buffers its work uses. See
/// [`CaptureGuard`] for an example.
#[must_use = "a graph is destroyed when dropped"]
pub struct Graph {
    ctx: CtxRef,
    raw: driver::Graph,
    uses: Vec<CapturedUse>,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("raw", &self.raw)
            .field("buffers", &self.uses.len())
            .finish()
    }
}

impl Graph {
    /// The raw handle, valid while the graph lives.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let graph = s.begin_capture().unwrap().end().unwrap();
    /// // SAFETY: the handle is live while `graph` is.
    /// let n = unsafe { ctx.driver().graph_node_count(graph.raw()) }.unwrap();
    /// assert_eq!(n, graph.node_count().unwrap());
    /// ```
    pub fn raw(&self) -> driver::Graph {
        self.raw
    }

    /// Number of nodes.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::DeviceBuffer;
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let mut b = DeviceBuffer::<f32>::zeroed(&s, 4).unwrap();
    /// let g = s.begin_capture().unwrap();
    /// b.fill(&s, 1.0).unwrap();
    /// b.fill(&s, 2.0).unwrap();
    /// assert_eq!(g.end().unwrap().node_count().unwrap(), 2);
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn node_count(&self) -> Result<usize> {
        // SAFETY: the graph is ours and live until dropped.
        unsafe { self.ctx.inner.driver.graph_node_count(self.raw) }
    }

    /// Instantiates the graph. The graph is destroyed either way (on failure too: nothing leaks).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::DeviceBuffer;
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let mut b = DeviceBuffer::<u32>::zeroed(&s, 2).unwrap();
    /// let g = s.begin_capture().unwrap();
    /// b.fill(&s, 5).unwrap();
    /// let exec = g.end().unwrap().instantiate().unwrap();
    /// exec.launch(&s).unwrap();
    /// assert_eq!(b.to_vec(&s).unwrap(), vec![5, 5]);
    /// ```
    ///
    /// # Errors
    /// The driver's error.
    pub fn instantiate(mut self) -> Result<GraphExec> {
        // SAFETY: the graph is ours and live until dropped. Relaxed mode and the context
        // current: the device rules.
        let raw = unsafe { self.ctx.inner.driver.graph_instantiate(self.raw) }?;
        Ok(GraphExec {
            ctx: self.ctx.clone(),
            raw,
            uses: std::mem::take(&mut self.uses),
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let (ctx, raw, uses) = (self.ctx.clone(), self.raw, std::mem::take(&mut self.uses));
        off_host_fn_thread(move || {
            let d = &*ctx.inner.driver;
            // SAFETY: the graph is ours; nothing uses it after this.
            crate::driver::tries(|| unsafe { d.graph_destroy(raw) });
            drop(uses);
        });
    }
}

/// An instantiated graph; destroyed when dropped. It keeps alive the buffers its work uses, and
/// each launch is a use of every one of them.
///
/// ```
/// # use cuda_stream_pool::{driver, Context, DeviceBuffer};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// let mut x = DeviceBuffer::<u32>::zeroed(&s, 8).unwrap();
/// let g = s.begin_capture().unwrap();
/// x.fill(&s, 3).unwrap();
/// let exec = g.end().unwrap().instantiate().unwrap();
/// exec.upload(&s).unwrap();
/// let other = ctx.owner();
/// exec.launch(&other.stream().unwrap()).unwrap();   // ordered after x's last use
/// assert_eq!(x.to_vec(&s).unwrap(), vec![3; 8]);    // ordered after the launch
/// ```
pub struct GraphExec {
    ctx: CtxRef,
    raw: driver::GraphExec,
    uses: Vec<CapturedUse>,
}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphExec")
            .field("raw", &self.raw)
            .field("buffers", &self.uses.len())
            .finish()
    }
}

impl GraphExec {
    /// The raw handle, valid while the executable graph lives. Launch through
    /// [`GraphExec::launch`]: a raw launch is not a use of the graph's buffers.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let exec = s.begin_capture().unwrap().end().unwrap().instantiate().unwrap();
    /// assert!(!exec.raw().is_null());
    /// ```
    pub fn raw(&self) -> driver::GraphExec {
        self.raw
    }

    /// Launches the graph on a stream: a use of every buffer the graph uses (the stream is
    /// ordered after each one's last use, and becomes its last use).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::{kernels::Kernels, DeviceBuffer, Error};
    /// let k = Kernels::load(&ctx).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let x = DeviceBuffer::<u32>::zeroed(&s, 4).unwrap();
    /// let g = s.begin_capture().unwrap();
    /// k.add_u32(&s, &x, 2).unwrap();
    /// let exec = g.end().unwrap().instantiate().unwrap();
    /// for _ in 0..3 {
    ///     exec.launch(&s).unwrap();                  // each launch runs the kernel again
    /// }
    /// assert_eq!(x.to_vec(&s).unwrap(), vec![6; 4]);
    /// let _capture = s.begin_capture().unwrap();
    /// assert!(matches!(exec.launch(&s), Err(Error::CaptureInProgress(_))));
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream of another context;
    /// [`Error::CaptureInProgress`] when the stream is capturing (launching a graph into a
    /// capture is not supported); the errors of [`crate::DeviceBuffer::use_on`]; the driver's
    /// error.
    pub fn launch(&self, stream: &StreamRef<'_>) -> Result<()> {
        if !self.ctx.same(stream.ctx()) {
            return Err(Error::invalid(
                "graph and stream belong to different contexts",
            ));
        }
        stream.not_capturing("launching a graph")?;
        launch_with_uses(&self.uses, stream, || {
            // SAFETY: the exec is ours; the stream is held by the holder the reference borrows;
            // every buffer the graph uses is kept alive by `self.uses` and ordered before (and
            // after) this launch by `launch_with_uses`.
            unsafe {
                self.ctx
                    .inner
                    .driver
                    .graph_launch(self.raw, stream.slot().enqueue())
            }
        })
    }

    /// Uploads the graph's resources ahead of the first launch.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver, Context};
    /// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
    /// # let ctx = Context::primary(drv, 0).unwrap();
    /// use cuda_stream_pool::Error;
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// let exec = s.begin_capture().unwrap().end().unwrap().instantiate().unwrap();
    /// exec.upload(&s).unwrap();
    /// let elsewhere = Context::primary(ctx.driver().clone(), 0).unwrap();   // another state
    /// let other = elsewhere.owner();
    /// assert!(matches!(exec.upload(&other.stream().unwrap()), Err(Error::InvalidArgument(_))));
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a stream of another context; the driver's error.
    pub fn upload(&self, stream: &StreamRef<'_>) -> Result<()> {
        if !self.ctx.same(stream.ctx()) {
            return Err(Error::invalid(
                "graph and stream belong to different contexts",
            ));
        }
        // SAFETY: the exec is ours; the stream is held (live). An upload runs no node.
        unsafe {
            self.ctx
                .inner
                .driver
                .graph_upload(self.raw, stream.slot().enqueue())
        }
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let (ctx, raw, uses) = (self.ctx.clone(), self.raw, std::mem::take(&mut self.uses));
        off_host_fn_thread(move || {
            let d = &*ctx.inner.driver;
            // SAFETY: the exec is ours; a launch in flight completes (the driver frees it
            // then). The buffers are dropped after this, their frees ordered after the launches.
            crate::driver::tries(|| unsafe { d.graph_exec_destroy(raw) });
            drop(uses);
        });
    }
}
