//! The call log and fault injection: every driver call is counted and logged (the most recent
//! [`DEFAULT_CALL_LOG`] by default, [`SimDriver::set_call_log_limit`]), and any call
//! (the n-th, or the next calls of one entry point) can be made to fail with a chosen
//! `CUresult`, as a real driver may fail any call (out of memory, launch failures, ...).
//! A call made from inside a host function fails with `CUDA_ERROR_NOT_PERMITTED` and is
//! recorded as misuse, as the real driver forbids it.

use super::*;

/// One logged driver call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The entry point, e.g. `cuMemFreeAsync`.
    pub name: &'static str,
    /// The stream it acted on, if any.
    pub stream: Option<Stream>,
    /// The event it acted on, if any.
    pub event: Option<Event>,
    /// The device pointer it acted on, if any.
    pub ptr: Option<DevicePtr>,
    /// Whether it succeeded.
    pub ok: bool,
}

/// How many calls a [`SimDriver`] keeps in its log unless told otherwise
/// ([`SimDriver::set_call_log_limit`]): the most recent 65,536 (about 4.5 MiB), enough for every
/// test that reads the log, bounded for a long run (a million allocations and frees make six
/// million calls).
pub const DEFAULT_CALL_LOG: usize = 1 << 16;

/// The call log: the most recent `limit` calls, oldest first.
pub(super) struct CallLog {
    calls: VecDeque<Call>,
    limit: usize,
    /// Calls that fell off the front since the log was last cleared.
    dropped: u64,
}

impl CallLog {
    pub(super) fn new(limit: usize) -> CallLog {
        CallLog {
            calls: VecDeque::new(),
            limit,
            dropped: 0,
        }
    }

    fn push(&mut self, c: Call) {
        if self.limit == 0 {
            self.dropped += 1;
            return;
        }
        if self.calls.len() >= self.limit {
            self.calls.pop_front();
            self.dropped += 1;
        }
        self.calls.push_back(c);
    }

    /// The last logged call, to complete its record (a pointer known only after the call).
    pub(super) fn last_mut(&mut self) -> Option<&mut Call> {
        self.calls.back_mut()
    }

    fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
        while self.calls.len() > limit {
            self.calls.pop_front();
            self.dropped += 1;
        }
        // Give back what a larger limit made the ring grow to.
        self.calls.shrink_to(limit);
    }

    fn clear(&mut self) {
        self.calls.clear();
        self.dropped = 0;
    }
}

pub(super) struct Fault {
    pub(super) name: Option<&'static str>,
    pub(super) nth: Option<u64>,
    pub(super) remaining: u64,
    pub(super) code: ErrorCode,
}

impl SimDriver {
    /// Enters a call: counts it, applies injected faults, logs it.
    pub(super) fn enter<'a>(
        &'a self,
        name: &'static str,
        stream: Option<Stream>,
        event: Option<Event>,
        ptr: Option<DevicePtr>,
    ) -> Result<MutexGuard<'a, State>> {
        if IN_HOST_FN.with(|c| c.get()) {
            // The real driver forbids driver calls from a host function (it returns
            // CUDA_ERROR_NOT_PERMITTED or deadlocks). A graph's host node runs under the state
            // lock, so this is recorded without taking it.
            self.host_calls
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("driver call from a host function: {name}"));
            return Err(err(ErrorCode::ERROR_NOT_PERMITTED, name));
        }
        let mut st = self.lock();
        st.calls += 1;
        let n = st.calls;
        let mut fail = None;
        for f in st.faults.iter_mut() {
            if f.remaining == 0 {
                continue;
            }
            let hit = match (f.nth, f.name) {
                (Some(k), _) => k == n,
                (None, Some(want)) => want == name,
                (None, None) => true,
            };
            if hit {
                f.remaining -= 1;
                fail = Some(f.code);
                break;
            }
        }
        st.faults.retain(|f| f.remaining > 0);
        if fail.is_none() && !st.dead.is_empty() {
            fail = self.sticky(&st, name, stream, event);
        }
        if let Some(log) = st.log.as_mut() {
            log.push(Call {
                name,
                stream,
                event,
                ptr,
                ok: fail.is_none(),
            });
        }
        match fail {
            Some(code) => {
                st.injected.push(name);
                Err(err(code, name))
            }
            None => Ok(st),
        }
    }

    /// The sticky error of a dead context that this call touches, as the H200 returns it
    /// (docs/gpu.md, "A kernel that faults its context"): every call in the context fails but
    /// the thread's context and capture-mode switches, the primary context's state queries,
    /// releases and resets, memory-pool creation, and calls that name no context.
    fn sticky(
        &self,
        st: &State,
        name: &'static str,
        stream: Option<Stream>,
        event: Option<Event>,
    ) -> Option<ErrorCode> {
        const STILL_WORK: &[&str] = &[
            "cuInit",
            "cuDriverGetVersion",
            "cuDeviceGet",
            "cuDeviceGetCount",
            "cuDeviceGetName",
            "cuDeviceGetAttribute",
            "cuDeviceGetDefaultMemPool",
            "cuDevicePrimaryCtxGetState",
            "cuDevicePrimaryCtxRelease_v2",
            "cuDevicePrimaryCtxReset_v2",
            "cuDevicePrimaryCtxRetain",
            "cuCtxGetCurrent",
            "cuCtxSetCurrent",
            "cuThreadExchangeStreamCaptureMode",
            "cuMemPoolCreate",
        ];
        if STILL_WORK.contains(&name) {
            // A retain of a dead primary context fails: in `primary_ctx_retain`.
            return None;
        }
        let ctx = stream
            .and_then(|s| st.streams.get(&s.0).map(|s| s.ctx))
            .or_else(|| {
                event.and_then(|e| {
                    st.events
                        .get(&e.0)
                        .or_else(|| st.retired_events.get(&e.0))
                        .map(|e| e.ctx)
                })
            })
            .unwrap_or_else(|| self.thread().ctx);
        st.dead.get(&ctx).copied()
    }

    /// Kills context `ctx` the way a kernel fault does on the real driver (a sticky error such
    /// as `CUDA_ERROR_ILLEGAL_ADDRESS`): from now on every call that touches the context fails
    /// with `code` (the calls that still work on an H200 excepted), work enqueued on its
    /// streams never completes (host functions never run), and the device's primary context
    /// cannot be retained again (the process must be restarted; measured: docs/gpu.md).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, ErrorCode};
    /// # use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// sim.kill_context(ctx.raw(), ErrorCode::ERROR_ILLEGAL_ADDRESS);
    /// let e = s.synchronize().unwrap_err();
    /// assert_eq!(e.code(), Some(ErrorCode::ERROR_ILLEGAL_ADDRESS));
    /// assert!(e.is_sticky());
    /// ```
    pub fn kill_context(&self, ctx: Context, code: ErrorCode) {
        self.lock().dead.insert(ctx.0, code);
    }

    /// The sticky error of context `ctx`, if it was killed ([`SimDriver::kill_context`]).
    pub fn context_error(&self, ctx: Context) -> Option<ErrorCode> {
        self.lock().dead.get(&ctx.0).copied()
    }

    pub(super) fn fail_last(st: &mut State) {
        if let Some(c) = st.log.as_mut().and_then(|l| l.last_mut()) {
            c.ok = false;
        }
    }

    pub(super) fn fail<T>(st: &mut State, code: ErrorCode, call: &'static str) -> Result<T> {
        Self::fail_last(st);
        Err(err(code, call))
    }

    /// Makes the `n`-th driver call from now (1 = the next one) fail with `code`.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// sim.fail_nth_call(2, ErrorCode::ERROR_UNKNOWN);
    /// assert!(sim.device_count().is_ok());
    /// assert_eq!(sim.device_count().unwrap_err().code(), Some(ErrorCode::ERROR_UNKNOWN));
    /// assert!(sim.device_count().is_ok());
    /// ```
    pub fn fail_nth_call(&self, n: u64, code: ErrorCode) {
        let mut st = self.lock();
        let at = st.calls + n;
        st.faults.push(Fault {
            name: None,
            nth: Some(at),
            remaining: 1,
            code,
        });
    }

    /// Makes the next `times` calls of the entry point `name` fail with `code`
    /// (`u64::MAX`: every call until [`SimDriver::clear_faults`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// sim.fail_calls("cuStreamCreateWithPriority", ErrorCode::ERROR_OUT_OF_MEMORY, 1);
    /// let next = ctx.owner();
    /// let e = next.stream().unwrap_err();
    /// assert_eq!(e.code(), Some(ErrorCode::ERROR_OUT_OF_MEMORY));
    /// assert!(next.stream().is_ok());                // only the next call failed
    /// ```
    pub fn fail_calls(&self, name: &'static str, code: ErrorCode, times: u64) {
        self.lock().faults.push(Fault {
            name: Some(name),
            nth: None,
            remaining: times,
            code,
        });
    }

    /// Removes every injected fault.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// sim.fail_calls("cuStreamQuery", ErrorCode::ERROR_UNKNOWN, u64::MAX);
    /// assert!(s.query().is_err());
    /// sim.clear_faults();
    /// assert!(s.query().unwrap());
    /// ```
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// The logged calls, oldest first: the most recent [`DEFAULT_CALL_LOG`] calls since the log
    /// was last cleared, or as many as [`SimDriver::set_call_log_limit`] says
    /// ([`SimDriver::calls_dropped`] counts those that fell off the front).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// sim.clear_calls();
    /// s.query().unwrap();
    /// let names: Vec<&str> = sim.calls().iter().map(|c| c.name).collect();
    /// assert!(names.contains(&"cuStreamQuery"));
    /// ```
    pub fn calls(&self) -> Vec<Call> {
        self.lock()
            .log
            .as_ref()
            .map(|l| l.calls.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// How many calls fell off the front of the log (it keeps the most recent ones only) since
    /// it was last cleared, turned on or given a limit.
    ///
    /// ```
    /// use cuda_stream_pool::driver::{Driver, SimDriver};
    /// let sim = SimDriver::new();
    /// sim.set_call_log_limit(2);
    /// for _ in 0..5 {
    ///     sim.device_count().unwrap();
    /// }
    /// assert_eq!(sim.calls().len(), 2);
    /// assert_eq!(sim.calls_dropped(), 3);
    /// assert_eq!(sim.call_count(), 5);         // every call is counted all the same
    /// ```
    pub fn calls_dropped(&self) -> u64 {
        self.lock().log.as_ref().map_or(0, |l| l.dropped)
    }

    /// Keeps only the most recent `limit` calls in the log (default [`DEFAULT_CALL_LOG`]), so
    /// that a long run's log stays bounded; `usize::MAX` keeps every call. Dropping to a smaller
    /// limit forgets the oldest calls at once. Applies to the log when it is off as well (it
    /// takes effect when [`SimDriver::set_logging`] turns it on).
    ///
    /// ```
    /// use cuda_stream_pool::driver::{Driver, SimDriver};
    /// let sim = SimDriver::new();
    /// sim.set_call_log_limit(1);
    /// sim.init().unwrap();
    /// sim.device_count().unwrap();
    /// let names: Vec<&str> = sim.calls().iter().map(|c| c.name).collect();
    /// assert_eq!(names, ["cuDeviceGetCount"]);
    /// ```
    pub fn set_call_log_limit(&self, limit: usize) {
        let mut st = self.lock();
        st.log_limit = limit;
        if let Some(l) = st.log.as_mut() {
            l.set_limit(limit);
            l.dropped = 0;
        }
    }

    /// Clears the call log (and the count of [`SimDriver::calls_dropped`]).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// assert!(!sim.calls().is_empty());
    /// sim.clear_calls();
    /// assert!(sim.calls().is_empty());
    /// ```
    pub fn clear_calls(&self) {
        if let Some(l) = self.lock().log.as_mut() {
            l.clear()
        }
    }

    /// Turns the call log on (empty, with the current [`SimDriver::set_call_log_limit`]) or off
    /// (the demo turns it off). Calls are counted either way.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// sim.set_logging(false);
    /// let before = sim.call_count();
    /// s.query().unwrap();
    /// assert!(sim.calls().is_empty());
    /// assert!(sim.call_count() > before);
    /// ```
    pub fn set_logging(&self, on: bool) {
        let mut st = self.lock();
        st.log = if on {
            Some(CallLog::new(st.log_limit))
        } else {
            None
        };
    }

    /// The entry points of the calls that injected faults failed so far, in order.
    ///
    /// ```
    /// # use cuda_stream_pool::driver::{Driver, SimDriver};
    /// # use cuda_stream_pool::ErrorCode;
    /// let sim = SimDriver::new();
    /// sim.fail_nth_call(1, ErrorCode::ERROR_UNKNOWN);
    /// assert!(sim.device_count().is_err());
    /// assert_eq!(sim.injected_failures(), vec!["cuDeviceGetCount"]);
    /// ```
    pub fn injected_failures(&self) -> Vec<&'static str> {
        self.lock().injected.clone()
    }

    /// The number of driver calls made so far.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let before = sim.call_count();
    /// sim.device_count().unwrap();
    /// assert_eq!(sim.call_count(), before + 1);
    /// ```
    pub fn call_count(&self) -> u64 {
        self.lock().calls
    }
}
