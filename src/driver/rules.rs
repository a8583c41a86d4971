//! The device rules: what every driver call of a context obeys, applied in one place (the hook of
//! the [`Hooked`](super::Hooked) driver that wraps each context's driver), so that no call site
//! of the crate can forget one:
//!
//! * **Host functions**: on a thread running one of the crate's host functions every call is
//!   refused (`CUDA_ERROR_NOT_PERMITTED`) before anything is touched: the driver must not be
//!   called there.
//! * **Current context**: the context is made current for the call if it is not, and the
//!   caller's current context is restored afterwards (the current context is per thread, and
//!   code on the caller's thread may use another device or context). Calls whose handle names
//!   the context and that need no current one skip it (queries and synchronizations of streams
//!   and events, capture-state queries, `cuMemAllocAsync`, measured to succeed with no context
//!   current); a free makes it current only if the driver refuses it for want of one.
//! * **Capture mode**: every call of the H200's invalidation table (queries, synchronizations,
//!   allocations and frees, host allocations, pool creation and attributes, graph instantiation,
//!   module loads) runs in relaxed capture mode, and the caller's mode is restored: such a call
//!   made in global mode while another thread captures in global mode fails and ends that
//!   capture, and one made on a capturing thread ends its own capture.
//!
//! Both switches **nest**: an operation of the crate opens a [`Scope`]; the first call inside it
//! that needs the context current (or relaxed mode) makes the switch, later calls find it made,
//! and the outermost scope restores what it found when it ends (also on an error or a panic: it
//! is a guard). A call made with no scope open is its own scope. So one public operation makes at
//! most one `cuCtxGetCurrent`/`cuCtxSetCurrent` pair and one pair of mode exchanges, whatever it
//! calls. A scope never spans user code (a user's own [`super::CaptureModeGuard`] inside it
//! would be undone), and a call for another context (or driver) inside a scope is a scope of its
//! own for that call.

use super::on_host_fn_thread;
use super::{CaptureMode, Context, Driver};
use crate::error::{Error, ErrorCode, Result};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a call needs: the context current (`bind`), relaxed capture mode (`relax`); with
/// `on_demand`, the context is made current only when the call, made without, fails with
/// `CUDA_ERROR_INVALID_CONTEXT` (then it is made again).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Need {
    bind: bool,
    relax: bool,
    on_demand: bool,
}

fn need(call: &'static str) -> Need {
    let (bind, relax) = match call {
        // Calls that name no context, or name their context by the handle (a stream, an
        // event) and invalidate nothing.
        "cuInit"
        | "cuDriverGetVersion"
        | "cuDeviceGetCount"
        | "cuDeviceGet"
        | "cuDeviceGetName"
        | "cuDeviceGetAttribute"
        | "cuDevicePrimaryCtxRetain"
        | "cuDevicePrimaryCtxRelease_v2"
        | "cuDevicePrimaryCtxGetState"
        | "cuDeviceGetDefaultMemPool"
        | "cuCtxGetCurrent"
        | "cuCtxSetCurrent"
        | "cuThreadExchangeStreamCaptureMode"
        | "cuStreamGetCaptureInfo_v3"
        | "cuStreamGetPriority"
        | "cuStreamGetFlags" => (false, false),
        // The H200's invalidation table (docs/gpu.md) on a stream or event, which names the
        // context (measured for cuMemAllocAsync: it succeeds with no context current).
        "cuStreamQuery"
        | "cuStreamSynchronize"
        | "cuEventQuery"
        | "cuEventSynchronize"
        | "cuMemAllocAsync"
        | "cuMemAllocFromPoolAsync" => (false, true),
        // A free names its device by the stream too; the context is made current if the
        // driver asks for it.
        "cuMemFreeAsync" => {
            return Need {
                bind: false,
                relax: true,
                on_demand: true,
            }
        }
        // The rest of the table, plus the rest of a module load (lazy loading may load a
        // kernel at cuModuleGetFunction).
        "cuCtxSynchronize"
        | "cuMemHostAlloc"
        // Not measured on the H200; relaxed like the allocation (see the simulation's
        // `do_mem_free_host`).
        | "cuMemFreeHost"
        | "cuMemPoolCreate"
        | "cuMemPoolSetAttribute"
        | "cuGraphInstantiateWithFlags"
        | "cuModuleLoadData"
        | "cuModuleGetFunction" => (true, true),
        _ => (true, false),
    };
    Need {
        bind,
        relax,
        on_demand: false,
    }
}

/// How many times a switch back to the caller's context or capture mode is tried.
const RESTORE_TRIES: usize = 3;

/// One open scope on this thread: for one context of one driver.
struct Frame {
    /// The raw driver (its address), whose thread state the switches change.
    driver: usize,
    /// The rules that opened the frame: a frame lives only while a [`Scope`] of them (which
    /// borrows them) is open on this thread, so the pointer is valid while the frame exists.
    rules: *const DeviceRules,
    ctx: u64,
    /// Open scopes of this frame (nested scopes of the same context share it).
    depth: u32,
    /// The context current before this frame made its context current, once it has.
    bound: Option<Context>,
    /// The capture mode before this frame switched to relaxed mode, once it has.
    relaxed: Option<CaptureMode>,
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// The hook of a context's driver (see the module docs).
pub(crate) struct DeviceRules {
    /// The driver that the rules' own switches go to: the context's driver as given.
    raw: Arc<dyn Driver>,
    /// The context made current for calls; 0 while none is known yet (before the retain) and
    /// after the context's teardown released it.
    ctx: AtomicU64,
    /// How many calls through these rules returned a sticky error ([`DeviceRules::sticky_seen`]).
    sticky: AtomicU64,
}

impl std::fmt::Debug for DeviceRules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRules")
            .field("ctx", &self.ctx.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl DeviceRules {
    pub(crate) fn new(raw: Arc<dyn Driver>) -> DeviceRules {
        DeviceRules {
            raw,
            ctx: AtomicU64::new(0),
            sticky: AtomicU64::new(0),
        }
    }

    /// How many calls through these rules returned a sticky error ([`ErrorCode::is_sticky`]: a
    /// kernel faulted a context). Every call goes through the rules, so none is missed; but a
    /// call may name another context than the rules' own (another device's, through a raw
    /// handle or a device-level call), so the context confirms with a call of its own before
    /// it takes itself for dead (`context.rs`, `Health`).
    pub(crate) fn sticky_seen(&self) -> u64 {
        self.sticky.load(Ordering::Acquire)
    }

    /// Sets the context that calls are made in (null: none, calls leave the current context as
    /// it is).
    pub(crate) fn set_context(&self, ctx: Context) {
        self.ctx.store(ctx.0, Ordering::Release);
    }

    fn key(&self) -> (usize, u64) {
        (
            Arc::as_ptr(&self.raw) as *const () as usize,
            self.ctx.load(Ordering::Acquire),
        )
    }

    /// Opens a scope (see the module docs): until it is dropped, the switches made for calls of
    /// this context on this thread are made once and restored at its end.
    pub(crate) fn scope(&self) -> Scope<'_> {
        let (driver, ctx) = self.key();
        let opened = FRAMES
            .try_with(|f| {
                let mut f = f.borrow_mut();
                match f.last_mut() {
                    Some(top) if top.driver == driver && top.ctx == ctx => top.depth += 1,
                    _ => f.push(Frame {
                        driver,
                        rules: self,
                        ctx,
                        depth: 1,
                        bound: None,
                        relaxed: None,
                    }),
                }
            })
            .is_ok();
        Scope {
            rules: self,
            opened,
            _thread: std::marker::PhantomData,
        }
    }

    /// Makes the switches that a call needing `need` still lacks, in the top frame (which is
    /// this context's).
    fn prepare(&self, need: Need) -> Result<()> {
        let (driver, ctx) = self.key();
        // The frame's state is read, then the driver called without the borrow (the raw driver
        // may be another hooked driver of the crate, whose rules use the same thread-local).
        let (bound, relaxed) = FRAMES
            .try_with(|f| {
                let f = f.borrow();
                let bound = f.last().is_some_and(|t| t.bound.is_some());
                let relaxed = f.iter().any(|t| t.driver == driver && t.relaxed.is_some());
                (bound, relaxed)
            })
            .unwrap_or((true, true));
        if need.bind && ctx != 0 && !bound {
            let prev = self.raw.ctx_get_current()?;
            if prev.0 != ctx {
                // SAFETY: the context is live while its state lives (retained, or kept alive by
                // `adopt`'s contract); it is forgotten (0) before its release.
                unsafe { self.raw.ctx_set_current(Context(ctx)) }?;
            }
            let _ = FRAMES.try_with(|f| {
                if let Some(t) = f.borrow_mut().last_mut() {
                    t.bound = Some(prev);
                }
            });
        }
        if need.relax && !relaxed {
            let prev = self
                .raw
                .thread_exchange_capture_mode(CaptureMode::Relaxed)?;
            let _ = FRAMES.try_with(|f| {
                if let Some(t) = f.borrow_mut().last_mut() {
                    t.relaxed = Some(prev);
                }
            });
        }
        Ok(())
    }

    /// Restores what a frame found. A switch back that the driver refuses is made again, up to
    /// [`RESTORE_TRIES`] times in all (a refusal has no effect, and a `Hook` or an injected fault
    /// may refuse any single call); if every try fails, the thread stays relaxed (which
    /// invalidates no capture) or keeps the context current, which nothing can report from
    /// here (the scope ends in a destructor).
    fn restore(&self, frame: Frame) {
        if let Some(mode) = frame.relaxed {
            for _ in 0..RESTORE_TRIES {
                if self.raw.thread_exchange_capture_mode(mode).is_ok() {
                    break;
                }
            }
        }
        if let Some(prev) = frame.bound {
            if prev.0 != frame.ctx {
                for _ in 0..RESTORE_TRIES {
                    // SAFETY: `prev` was current on this thread when the frame began; the
                    // caller keeps what it made current alive across the crate's call (as it
                    // must for its own calls).
                    if unsafe { self.raw.ctx_set_current(prev) }.is_ok() {
                        break;
                    }
                }
            }
        }
    }

    /// Ends one scope of the top frame; pops and restores it at its outermost end.
    fn close(&self) {
        let done = FRAMES
            .try_with(|f| {
                let mut f = f.borrow_mut();
                let top = f.last_mut()?;
                top.depth -= 1;
                if top.depth == 0 {
                    f.pop()
                } else {
                    None
                }
            })
            .ok()
            .flatten();
        if let Some(frame) = done {
            self.restore(frame);
        }
    }
}

/// Whether the calling thread can open scopes: false on a thread that is exiting and whose
/// thread-local state of the rules is already destroyed (a scope there cannot switch).
pub(crate) fn scopes_available() -> bool {
    FRAMES.try_with(|_| ()).is_ok()
}

/// Runs `f` (user code: a waker) with the thread's current context and capture mode as the
/// crate's caller left them: the open scopes' switches are undone first and made again, lazily,
/// by the next call after `f`. User code never runs in a scope's state (a user's own mode guard
/// or `cuCtxSetCurrent` in it would be undone, or would mislead the scope).
pub(crate) fn outside_scopes<R>(f: impl FnOnce() -> R) -> R {
    let mut frames = FRAMES
        .try_with(|fr| std::mem::take(&mut *fr.borrow_mut()))
        .unwrap_or_default();
    for frame in frames.iter_mut().rev() {
        let undone = Frame {
            driver: frame.driver,
            rules: frame.rules,
            ctx: frame.ctx,
            depth: 0,
            bound: frame.bound.take(),
            relaxed: frame.relaxed.take(),
        };
        // SAFETY: the frame exists, so the scope that opened it is open (see `Frame::rules`).
        unsafe { &*frame.rules }.restore(undone);
    }
    /// Puts the scopes back (also when `f` panics), to be switched again by the next call.
    struct Back(Vec<Frame>);
    impl Drop for Back {
        fn drop(&mut self) {
            let frames = std::mem::take(&mut self.0);
            let _ = FRAMES.try_with(|fr| {
                let mut fr = fr.borrow_mut();
                // Scopes opened by `f` have all ended: the stack is empty again.
                let mut inner = std::mem::replace(&mut *fr, frames);
                fr.append(&mut inner);
            });
        }
    }
    let _back = Back(frames);
    f()
}

/// An open scope of [`DeviceRules`]; restores what its calls switched when the outermost one of
/// its context ends. Not `Send`: it belongs to the thread whose state it switched.
#[must_use = "the scope ends when dropped"]
pub(crate) struct Scope<'r> {
    rules: &'r DeviceRules,
    opened: bool,
    _thread: std::marker::PhantomData<*const ()>,
}

impl Scope<'_> {
    /// Switches to relaxed mode now (if the scope has not yet): for an operation that must not
    /// start unless every call of it can run relaxed (the teardown).
    ///
    /// # Errors
    /// The driver's error from the switch.
    pub(crate) fn relax_now(&self) -> Result<()> {
        if !self.opened {
            return Err(Error::invalid("no thread-local state for a scope"));
        }
        self.rules.prepare(Need {
            bind: false,
            relax: true,
            on_demand: false,
        })
    }
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        if self.opened {
            self.rules.close();
        }
    }
}

// SAFETY: `call` refuses before calling `f`, or returns `f`'s result; it calls `f` a second time
// only after a first call failed with `CUDA_ERROR_INVALID_CONTEXT` (which had no effect); the
// switches of the thread's context and capture mode it makes are undone by its scope.
unsafe impl super::Hook for DeviceRules {
    fn before(&self, call: &'static str) -> Result<()> {
        if on_host_fn_thread() {
            return Err(Error::driver(ErrorCode::ERROR_NOT_PERMITTED, call));
        }
        Ok(())
    }

    fn call<R>(&self, call: &'static str, f: impl FnMut() -> Result<R>) -> Result<R> {
        let r = self.call_in_rules(call, f);
        if let Err(e) = &r {
            if e.is_sticky() {
                self.sticky.fetch_add(1, Ordering::AcqRel);
            }
        }
        r
    }
}

impl DeviceRules {
    /// [`Hook::call`](super::Hook::call) without the fault's bookkeeping.
    fn call_in_rules<R>(&self, call: &'static str, mut f: impl FnMut() -> Result<R>) -> Result<R> {
        super::Hook::before(self, call)?;
        let need = need(call);
        if !need.bind && !need.relax {
            return f();
        }
        // A scope for the call: nested in an open scope of this context (the switches are made
        // at most once there), else its own.
        let _scope = self.scope();
        if !_scope.opened {
            // No thread-local state (the thread is exiting): switch and restore around this
            // call alone.
            return self.call_unscoped(need, f);
        }
        self.prepare(need)?;
        match f() {
            Err(e) if need.on_demand && e.code() == Some(ErrorCode::ERROR_INVALID_CONTEXT) => {
                self.prepare(Need { bind: true, ..need })?;
                f()
            }
            r => r,
        }
    }
}

impl DeviceRules {
    /// [`Hook::call`](super::Hook::call) on a thread whose thread-locals are gone.
    fn call_unscoped<R>(&self, need: Need, mut f: impl FnMut() -> Result<R>) -> Result<R> {
        let ctx = self.ctx.load(Ordering::Acquire);
        let mut frame = Frame {
            driver: 0,
            rules: self,
            ctx,
            depth: 0,
            bound: None,
            relaxed: None,
        };
        let r = (|| {
            if (need.bind || need.on_demand) && ctx != 0 {
                let prev = self.raw.ctx_get_current()?;
                if prev.0 != ctx {
                    // SAFETY: as in `prepare`.
                    unsafe { self.raw.ctx_set_current(Context(ctx)) }?;
                }
                frame.bound = Some(prev);
            }
            if need.relax {
                frame.relaxed = Some(
                    self.raw
                        .thread_exchange_capture_mode(CaptureMode::Relaxed)?,
                );
            }
            f()
        })();
        self.restore(frame);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::{Hooked, SimDriver};

    /// A sim with two retained primary contexts; the rules of the first, the second current.
    fn setup() -> (Arc<SimDriver>, Hooked<DeviceRules>, Context, Context) {
        let sim = Arc::new(SimDriver::new());
        sim.init().unwrap();
        let dev = sim.device_get(0).unwrap();
        let a = sim.primary_ctx_retain(dev).unwrap();
        // A second context: an adopted one would do; the sim has one primary per device, so
        // the "other" context is null (none current), which the rules must restore too.
        let other = Context::NULL;
        let rules = Hooked {
            inner: sim.clone() as Arc<dyn Driver>,
            hook: DeviceRules::new(sim.clone()),
        };
        rules.hook.set_context(a);
        (sim, rules, a, other)
    }

    fn mode(sim: &SimDriver) -> CaptureMode {
        let m = sim
            .thread_exchange_capture_mode(CaptureMode::Global)
            .unwrap();
        sim.thread_exchange_capture_mode(m).unwrap();
        m
    }

    #[test]
    fn a_scope_switches_once_and_restores_at_its_end() {
        let (sim, rules, a, other) = setup();
        {
            let _outer = rules.hook.scope();
            rules.ctx_synchronize().unwrap();
            assert_eq!(sim.ctx_get_current().unwrap(), a);
            assert_eq!(mode(&sim), CaptureMode::Relaxed);
            sim.clear_calls();
            {
                let _inner = rules.hook.scope();
                rules.ctx_synchronize().unwrap();
            }
            rules.ctx_synchronize().unwrap();
            let names: Vec<&str> = sim.calls().iter().map(|c| c.name).collect();
            assert_eq!(names, ["cuCtxSynchronize", "cuCtxSynchronize"]);
        }
        assert_eq!(sim.ctx_get_current().unwrap(), other);
        assert_eq!(mode(&sim), CaptureMode::Global);
    }

    #[test]
    fn user_code_runs_in_the_callers_state_and_the_scope_switches_again_after() {
        let (sim, rules, a, other) = setup();
        let _scope = rules.hook.scope();
        rules.ctx_synchronize().unwrap();
        outside_scopes(|| {
            assert_eq!(sim.ctx_get_current().unwrap(), other);
            assert_eq!(mode(&sim), CaptureMode::Global);
        });
        rules.ctx_synchronize().unwrap();
        assert_eq!(sim.ctx_get_current().unwrap(), a);
        assert_eq!(mode(&sim), CaptureMode::Relaxed);
        drop(_scope);
        assert_eq!(sim.ctx_get_current().unwrap(), other);
        assert_eq!(mode(&sim), CaptureMode::Global);
    }

    #[test]
    fn calls_are_refused_on_a_host_function_thread_before_any_driver_call() {
        let (sim, rules, _, _) = setup();
        super::super::as_host_fn_thread(|| {
            let before = sim.call_count();
            let e = rules.ctx_synchronize().unwrap_err();
            assert_eq!(e.code(), Some(ErrorCode::ERROR_NOT_PERMITTED));
            assert_eq!(sim.call_count(), before);
        });
    }
}
