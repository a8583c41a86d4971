//! Graph capture with guards that leave the capture state as they found it.
//!
//! * [`StreamRef::begin_capture`] returns a [`CaptureGuard`]. If the begin fails (for instance a
//!   nested begin on a stream that is already capturing, which the driver rejects with
//!   `CUDA_ERROR_ILLEGAL_STATE`), the error is returned and the capture in progress is untouched:
//!   no guard exists that could end it.
//! * [`CaptureGuard::end`] returns the [`Graph`]. A guard dropped without `end` (early return,
//!   `?`, panic) ends the capture and destroys the partial graph, leaving the stream usable.
//! * [`CaptureModeGuard`] sets the thread's capture mode and restores the previous one on drop;
//!   the pool runs its queries under one in relaxed mode.
//!
//! The default mode of [`StreamRef::begin_capture`] is [`CaptureMode::ThreadLocal`]: calls that
//! are unsafe during capture are rejected on the capturing thread (where they are bugs), while
//! other threads, which may be churning owners through the pool, are not affected. Pass
//! [`CaptureMode::Global`] to [`StreamRef::begin_capture_with`] to get CUDA's default.

use crate::context::Context;
use crate::driver::{self, CaptureMode, CaptureStatus, Driver};
use crate::error::{Error, ErrorCode, Result};
use crate::stream::StreamRef;

/// Sets the calling thread's capture mode (`cuThreadExchangeStreamCaptureMode`) and restores the
/// previous mode when dropped.
///
/// ```
/// use cuda_stream_pool::{driver::{self, CaptureMode}, CaptureModeGuard};
/// let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// {
///     let g = CaptureModeGuard::new(&*drv, CaptureMode::Relaxed).unwrap();
///     assert_eq!(g.previous(), CaptureMode::Global);
/// }
/// assert_eq!(drv.thread_exchange_capture_mode(CaptureMode::Global).unwrap(), CaptureMode::Global);
/// ```
pub struct CaptureModeGuard<'d> {
    driver: &'d dyn Driver,
    previous: CaptureMode,
}

impl std::fmt::Debug for CaptureModeGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureModeGuard")
            .field("previous", &self.previous)
            .finish()
    }
}

impl<'d> CaptureModeGuard<'d> {
    /// Switches the calling thread to `mode`.
    pub fn new(driver: &'d dyn Driver, mode: CaptureMode) -> Result<Self> {
        let previous = driver.thread_exchange_capture_mode(mode)?;
        Ok(CaptureModeGuard { driver, previous })
    }

    /// The mode that will be restored.
    pub fn previous(&self) -> CaptureMode {
        self.previous
    }
}

impl Drop for CaptureModeGuard<'_> {
    fn drop(&mut self) {
        let _ = self.driver.thread_exchange_capture_mode(self.previous);
    }
}

/// An active capture of a stream (RAII around `cuStreamBeginCapture` / `cuStreamEndCapture`).
///
/// * Made by [`StreamRef::begin_capture`] (thread-local mode) or
///   [`StreamRef::begin_capture_with`]. If the begin fails (for instance a nested begin on a
///   stream that is already capturing, which the driver rejects with `CUDA_ERROR_ILLEGAL_STATE`),
///   the error is returned and the capture in progress is untouched: no guard exists that could
///   end it.
/// * [`CaptureGuard::end`] returns the [`Graph`]; an invalidated capture reports its error there.
/// * Dropped without `end` (early return, `?`, panic), the guard ends the capture and destroys the
///   partial graph, leaving the stream usable.
///
/// The default mode is thread-local: calls that are unsafe during capture are rejected on the
/// capturing thread (where they are bugs), while other threads, which may be churning owners
/// through the pool, are not affected.
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
pub struct CaptureGuard {
    stream: StreamRef,
    done: bool,
}

impl StreamRef {
    /// Begins capturing this stream in thread-local mode.
    pub fn begin_capture(&self) -> Result<CaptureGuard> {
        self.begin_capture_with(CaptureMode::ThreadLocal)
    }

    /// Begins capturing this stream in `mode`. On failure the stream's capture state, whatever
    /// it was, is unchanged.
    pub fn begin_capture_with(&self, mode: CaptureMode) -> Result<CaptureGuard> {
        self.check()?;
        let mut st = self.slot.lock();
        self.ctx
            .inner
            .driver
            .stream_begin_capture(self.slot.raw, mode)?;
        st.set_capturing(true);
        Ok(CaptureGuard {
            stream: self.clone(),
            done: false,
        })
    }
}

impl std::fmt::Debug for CaptureGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureGuard")
            .field("stream", &self.stream)
            .field("done", &self.done)
            .finish()
    }
}

impl CaptureGuard {
    /// The stream being captured.
    pub fn stream(&self) -> &StreamRef {
        &self.stream
    }

    /// The capture's status and unique id (`cuStreamGetCaptureInfo`).
    pub fn info(&self) -> Result<(CaptureStatus, u64)> {
        self.stream
            .ctx
            .inner
            .driver
            .stream_capture_info(self.stream.slot.raw)
    }

    fn finish(&mut self) -> Result<driver::Graph> {
        self.done = true;
        let ci = &self.stream.ctx.inner;
        let raw = self.stream.slot.raw;
        let status = || {
            ci.driver
                .stream_is_capturing(raw)
                .map(|s| s != CaptureStatus::None)
        };
        let mut r = ci.driver.stream_end_capture(raw);
        // A failed end that left the capture running (a transient failure) is retried, so that the
        // stream is not left capturing; the first error is the one reported.
        for _ in 0..2 {
            if r.is_ok() || status() == Ok(false) {
                break;
            }
            match ci.driver.stream_end_capture(raw) {
                Ok(g) => r = Ok(g),
                Err(e) if e.code() == Some(ErrorCode::ERROR_ILLEGAL_STATE) => break,
                Err(_) => {}
            }
        }
        let capturing = || status().unwrap_or(false);
        let still = capturing();
        if !still {
            self.stream.slot.lock().set_capturing(false);
            ci.flush_deferred(Some(&self.stream.slot));
        }
        r
    }

    /// Ends the capture and returns the graph. An invalidated capture reports its error here and
    /// leaves the stream not capturing.
    pub fn end(mut self) -> Result<Graph> {
        let raw = self.finish()?;
        Ok(Graph {
            ctx: self.stream.ctx.clone(),
            raw,
        })
    }
}

impl Drop for CaptureGuard {
    fn drop(&mut self) {
        if !self.done {
            if let Ok(g) = self.finish() {
                let _ = self.stream.ctx.inner.driver.graph_destroy(g);
            }
        }
    }
}

/// A captured graph; destroyed when dropped. See [`CaptureGuard`] for an example.
pub struct Graph {
    ctx: Context,
    raw: driver::Graph,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph").field("raw", &self.raw).finish()
    }
}

impl Graph {
    /// The raw handle.
    pub fn raw(&self) -> driver::Graph {
        self.raw
    }

    /// Number of nodes.
    pub fn node_count(&self) -> Result<usize> {
        self.ctx.inner.driver.graph_node_count(self.raw)
    }

    /// Instantiates the graph. The graph is destroyed either way (on failure too: nothing leaks).
    pub fn instantiate(self) -> Result<GraphExec> {
        self.ctx.inner.bind()?;
        let raw = self.ctx.inner.driver.graph_instantiate(self.raw)?;
        Ok(GraphExec {
            ctx: self.ctx.clone(),
            raw,
        })
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.inner.driver.graph_destroy(self.raw);
    }
}

/// An instantiated graph; destroyed when dropped.
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
/// exec.launch(&s).unwrap();
/// assert_eq!(x.to_vec(&s).unwrap(), vec![3; 8]);
/// ```
pub struct GraphExec {
    ctx: Context,
    raw: driver::GraphExec,
}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphExec").field("raw", &self.raw).finish()
    }
}

impl GraphExec {
    /// The raw handle.
    pub fn raw(&self) -> driver::GraphExec {
        self.raw
    }

    /// Launches the graph on a stream.
    pub fn launch(&self, stream: &StreamRef) -> Result<()> {
        stream.check()?;
        if !self.ctx.same(&stream.ctx) {
            return Err(Error::invalid(
                "graph and stream belong to different contexts",
            ));
        }
        self.ctx
            .inner
            .driver
            .graph_launch(self.raw, stream.slot.raw)
    }

    /// Uploads the graph's resources ahead of the first launch.
    pub fn upload(&self, stream: &StreamRef) -> Result<()> {
        stream.check()?;
        self.ctx
            .inner
            .driver
            .graph_upload(self.raw, stream.slot.raw)
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let _ = self.ctx.inner.driver.graph_exec_destroy(self.raw);
    }
}
