//! The simulated driver: a pure-Rust model of the parts of the CUDA driver the crate uses.
//!
//! * Streams are FIFO queues of operations; an operation starts when it reaches the head of its
//!   queue (and, for an event wait, when the event's record has completed) and completes a fixed
//!   simulated duration later. Host functions run on a real thread (one per simulation, as
//!   the driver's) and complete when they return, so a test can hold a stream busy on a channel,
//!   as on the GPU.
//! * Time comes from a clock that tests advance by hand ([`SimDriver::advance`]); waiting calls
//!   (`stream_synchronize`, ...) jump the clock to the next completion, as if the CPU had waited.
//!   With a [`Latency`] model the clock is real time instead and every API call costs the CPU time
//!   measured on an H200 (docs/gpu.md), so that the demo's strategies differ as they do on the GPU.
//! * Capture follows the driver's rules: a nested begin returns `CUDA_ERROR_ILLEGAL_STATE` and
//!   leaves the outer capture active; querying or synchronizing a capturing stream, or making an
//!   unsafe call while a conflicting capture is active, returns
//!   `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates the capture.
//! * Device memory holds real bytes, so results can be checked; use after free, double frees and
//!   operations on destroyed handles are recorded as misuse ([`SimDriver::misuse`]).
//! * Happens-before is tracked with vector clocks (streams.rs) and every device access is checked
//!   against the allocation's history (memory.rs): unordered accesses on different streams
//!   (races), use after free and uninitialised reads are reported whatever the simulated
//!   durations are ([`SimDriver::findings`]), so the simulation is at least as strict as the
//!   real driver: a missing dependency is found even when the work takes no simulated time.
//! * Capture follows the driver's rules as measured on an H200, fork/join, isolation and the
//!   table of calls that invalidate captures included (capture.rs).
//! * Host functions run one at a time on one worker thread, as on the real driver, and may not
//!   call the driver (streams.rs).
//! * Host-mapped memory and stream memory operations (`cuStreamWriteValue64`,
//!   `cuStreamWaitValue32`) act on real host memory (hostmem.rs).
//! * Every call is logged ([`SimDriver::calls`]: the most recent [`DEFAULT_CALL_LOG`] by
//!   default, so that a long run's memory stays bounded) and any call can be made to fail
//!   ([`SimDriver::fail_nth_call`], [`SimDriver::fail_calls`]).

use super::*;
use crate::error::{Error, ErrorCode};
use std::collections::{BTreeMap, VecDeque};
use std::ffi::CStr;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// The simulation's maps, keyed by its handles (small integers given out in order): hashed by
/// one multiplication instead of SipHash (the maps are read at every driver call; nothing here
/// needs protection from chosen keys), and iterated in the same order in every process.
type HashMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// See [`HashMap`]: FxHash's step (a rotation, an xor and a multiplication per word).
#[derive(Default, Clone, Copy)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

mod capture;
mod events;
mod faults;
mod hostmem;
mod latency;
mod memory;
mod streams;

use capture::*;
use events::*;
use faults::Fault;
use hostmem::*;
use memory::*;
use streams::*;

pub use faults::{Call, DEFAULT_CALL_LOG};
use latency::spin;
pub use latency::Latency;

/// Device memory the driver keeps per live stream, as measured on the H200.
pub const STREAM_BYTES: u64 = 560 * 1024;

/// Configuration of a [`SimDriver`].
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Name returned by `device_name`.
    pub device_name: String,
    /// Number of devices.
    pub devices: i32,
    /// (least, greatest) stream priority; the H200's is (0, -5).
    pub priority_range: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: u64,
    /// `cuDriverGetVersion`.
    pub driver_version: i32,
    /// `Some`: real-time clock and API costs (the demo); `None`: manual clock, no costs (tests).
    pub latency: Option<Latency>,
    /// `Some(n)`: `cuStreamCreate` blocks, as observed on the H200, while `n` or more streams are
    /// alive, the new stream needs resources the driver has never had (there are no more live
    /// streams than the most there ever were: the resources of streams created and destroyed
    /// earlier are reused without blocking), and some stream is held by an unsatisfied
    /// `cuStreamWaitValue32`; it returns once the wait is released. On the H200 creating the
    /// ~31st live stream blocked behind such a wait for as long as it lasted (5 s in the probe).
    /// A blocked create waits in real time (host writes are noticed in 1 ms steps), never moves
    /// the manual clock, and shows in [`SimDriver::blocked_creates`]. `None` (the default): never.
    pub create_stall_at: Option<u64>,
}

/// The live-stream count at which `cuStreamCreate` blocked behind a GPU-side wait on the H200
/// (the 31st live stream): the value to give [`SimConfig::create_stall_at`].
pub const H200_CREATE_STALL_AT: u64 = 30;

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            device_name: "Simulated H200".into(),
            devices: 1,
            priority_range: (0, -5),
            total_memory: 141 << 30,
            driver_version: 13000,
            latency: None,
            create_stall_at: None,
        }
    }
}

/// Counters of live and total resources (`#[non_exhaustive]`: read them; new counters are not a
/// breaking change).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SimCounters {
    /// Streams alive now (the legacy stream not counted).
    pub live_streams: u64,
    /// Most streams alive at once.
    pub peak_streams: u64,
    /// Streams created.
    pub streams_created: u64,
    /// Streams destroyed.
    pub streams_destroyed: u64,
    /// Events alive now.
    pub live_events: u64,
    /// Bytes of allocations alive now (not counting stream overhead).
    pub live_alloc_bytes: u64,
    /// Allocations alive now.
    pub live_allocs: u64,
    /// Most device memory in use at once, streams' share included.
    pub peak_device_bytes: u64,
    /// Graphs alive now.
    pub live_graphs: u64,
    /// Executable graphs alive now.
    pub live_graph_execs: u64,
    /// Modules loaded now.
    pub live_modules: u64,
    /// Contexts retained now.
    pub live_contexts: u64,
    /// Host-mapped allocations (`cuMemHostAlloc`) alive now.
    pub live_host_allocs: u64,
    /// Stream creations that blocked behind a GPU-side wait ([`SimConfig::create_stall_at`]).
    pub stalled_creates: u64,
}

struct State {
    next_id: u64,
    next_ptr: u64,
    contexts: HashMap<u64, (u64, u64)>, // ctx -> (device, retains)
    primary: HashMap<u64, u64>,         // device -> ctx
    streams: HashMap<u64, SimStream>,
    events: HashMap<u64, SimEvent>,
    /// Destroyed events with records still pending, which enqueued waits still wait for.
    retired_events: HashMap<u64, SimEvent>,
    allocs: BTreeMap<u64, SimAlloc>,
    graphs: HashMap<u64, Arc<Vec<(Effect, u64)>>>,
    execs: HashMap<u64, Arc<Vec<(Effect, u64)>>>,
    modules: HashMap<u64, ()>,
    functions: HashMap<u64, Kernel>,
    /// Release threshold of each live pool: the default pool is `MemPool(1)`; pools made by
    /// `cuMemPoolCreate` get the next handles.
    pools: std::collections::BTreeMap<u64, u64>,
    next_pool: u64,
    log: Option<faults::CallLog>,
    /// The limit of the call log (kept while the log is off).
    log_limit: usize,
    faults: Vec<Fault>,
    calls: u64,
    misuse: Vec<String>,
    /// Calls of the invalidation table made outside relaxed mode while a capture was live.
    unrelaxed: Vec<String>,
    /// Calls that wait for every stream of the device, made while a stream had work pending.
    device_waits: Vec<String>,
    /// The calls that injected faults failed (`SimDriver::injected_failures`).
    injected: Vec<&'static str>,
    counters: SimCounters,
    capture_seq: u64,
    /// Live captures by id.
    captures: HashMap<u64, Capture>,
    /// What the host has observed complete (one clock per process; see streams.rs).
    host_vc: Vc,
    /// Bumped whenever `host_vc` grows (streams skip joining an unchanged host clock).
    host_version: u64,
    /// Freed ranges: base -> (bytes, the free's description).
    freed: BTreeMap<u64, (u64, String)>,
    /// The host-function worker, started on first use.
    host: Option<streams::HostWorker>,
    /// The last worker ended by [`SimDriver::end_host_thread`], until a new one starts: the new
    /// one waits for it to return (see `streams::host_worker`).
    host_ended: Option<std::sync::mpsc::Receiver<()>>,
    /// Set by [`SimDriver::end_host_thread`]: a worker started after it is ended as soon as it
    /// has been sent its host functions (it returns once it has run them).
    host_retired: bool,
    pool_streams: u64,
    /// Streams with a non-empty queue: `progress` visits only these.
    busy: std::collections::BTreeSet<u64>,
    /// The busy streams `progress` must visit even before `next_due`, and why: every other busy
    /// stream's first operation has started (or got its start time) and changes only with the
    /// clock, no earlier than `next_due`.
    watch: streams::Watched,
    /// The earliest time at which a busy stream outside `watch` can change.
    next_due: u64,
    /// Host-mapped memory (hostmem.rs).
    host_mem: HostMem,
    /// Stream creations blocked right now ([`SimConfig::create_stall_at`]).
    blocked_creates: u64,
    /// Contexts killed by a sticky error ([`SimDriver::kill_context`]), with the error.
    dead: HashMap<u64, ErrorCode>,
}

static NEXT_SIM: AtomicU64 = AtomicU64::new(1);

/// The simulated driver. Thread-safe; cheap to create.
///
/// ```
/// use cuda_stream_pool::driver::{Driver, SimDriver};
/// use cuda_stream_pool::{Context, ErrorCode};
/// use std::sync::Arc;
/// let sim = Arc::new(SimDriver::new());
/// let ctx = Context::primary(sim.clone(), 0).unwrap();
/// let owner = ctx.owner();
/// let s = owner.stream().unwrap();
/// sim.enqueue_work(s.raw(), 1_000).unwrap();       // 1 µs of GPU work
/// assert!(!s.query().unwrap());
/// sim.advance(1_000);                               // the test moves the clock
/// assert!(s.query().unwrap());
/// sim.fail_calls("cuStreamQuery", ErrorCode::ERROR_UNKNOWN, 1);   // fault injection
/// assert!(s.query().is_err());
/// assert!(sim.calls().iter().any(|c| c.name == "cuStreamQuery" && !c.ok));
/// assert!(sim.misuse().is_empty());
/// ```
pub struct SimDriver {
    id: u64,
    cfg: SimConfig,
    clock: Clock,
    state: Mutex<State>,
    cv: Arc<Condvar>,
    /// Host functions handed to the host-function thread, and those of them that returned
    /// (see [`SimDriver::host_fn_progress`]).
    host_jobs: Arc<(AtomicU64, AtomicU64)>,
    /// Driver calls made from host functions (recorded without the state lock, which a graph's
    /// host node runs under).
    host_calls: Mutex<Vec<String>>,
    /// GPU time of a copy under the manual clock ([`SimDriver::set_copy_time`]).
    copy_ns: AtomicU64,
    /// GPU time of a `cuMemFreeAsync` under the manual clock ([`SimDriver::set_free_time`]).
    free_ns: AtomicU64,
    /// Starts of a host-function thread still to fail ([`SimDriver::fail_host_thread_spawns`]).
    pub(super) host_spawn_failures: AtomicU64,
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        // Ends the host-function thread and waits for it (unless this is that thread: the last
        // reference dropped by a host function), so that no thread outlives the simulation.
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let worker = st.host.take();
        if let Some(w) = worker {
            drop(w.tx);
            if w.thread.thread().id() != std::thread::current().id() {
                let _ = w.thread.join();
            }
        }
        // And the ended workers (each waits for the one before it to return): unless this is
        // one of them (a host function of this simulation; another simulation's host function
        // waits: review 25).
        if let Some(gone) = st.host_ended.take() {
            if streams::HOST_FN_OF.with(|c| c.get()) != self.id {
                let _ = gone.recv();
            }
        }
        // Host memory last: a host function still running above may read it (review 25).
        st.host_mem.release_all();
    }
}

impl std::fmt::Debug for SimDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimDriver")
            .field("id", &self.id)
            .field("now", &self.clock.now())
            .finish()
    }
}

impl Default for SimDriver {
    fn default() -> Self {
        SimDriver::new()
    }
}

fn err(code: ErrorCode, call: &'static str) -> Error {
    Error::driver(code, call)
}

impl SimDriver {
    /// A simulation with a manual clock and the H200's properties.
    ///
    /// ```
    /// use cuda_stream_pool::driver::{Driver, SimDriver};
    /// let sim = SimDriver::new();
    /// sim.init().unwrap();
    /// assert_eq!(sim.device_name(sim.device_get(0).unwrap()).unwrap(), "Simulated H200");
    /// assert_eq!(sim.now(), 0);                      // time moves only when a test says so
    /// ```
    pub fn new() -> SimDriver {
        SimDriver::with_config(SimConfig::default())
    }

    /// A simulation with a real-time clock and the default [`Latency`] costs (the demo's model).
    ///
    /// ```
    /// use cuda_stream_pool::driver::SimDriver;
    /// let sim = SimDriver::realtime();
    /// let t0 = sim.now();
    /// std::thread::sleep(std::time::Duration::from_millis(1));
    /// assert!(sim.now() > t0);                       // the clock is real time
    /// ```
    pub fn realtime() -> SimDriver {
        SimDriver::with_config(SimConfig {
            latency: Some(Latency::default()),
            ..SimConfig::default()
        })
    }

    /// A simulation with the given configuration.
    ///
    /// ```
    /// use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver};
    /// let sim = SimDriver::with_config(SimConfig {
    ///     devices: 2,
    ///     priority_range: (0, -1),
    ///     ..SimConfig::default()
    /// });
    /// sim.init().unwrap();
    /// assert_eq!(sim.device_count().unwrap(), 2);
    /// ```
    pub fn with_config(cfg: SimConfig) -> SimDriver {
        let clock = if cfg.latency.is_some() {
            Clock::Real(Instant::now())
        } else {
            Clock::Manual(AtomicU64::new(0))
        };
        let mut streams = HashMap::default();
        streams.insert(0, SimStream::new(0, 0, 0));
        SimDriver {
            id: NEXT_SIM.fetch_add(1, Ordering::Relaxed),
            cfg,
            clock,
            state: Mutex::new(State {
                next_id: 0x1000,
                next_ptr: 0x7f00_0000_0000,
                contexts: HashMap::default(),
                primary: HashMap::default(),
                streams,
                events: HashMap::default(),
                retired_events: HashMap::default(),
                allocs: BTreeMap::new(),
                graphs: HashMap::default(),
                execs: HashMap::default(),
                modules: HashMap::default(),
                functions: HashMap::default(),
                pools: [(1, 0)].into_iter().collect(),
                next_pool: 2,
                log: Some(faults::CallLog::new(DEFAULT_CALL_LOG)),
                log_limit: DEFAULT_CALL_LOG,
                faults: Vec::new(),
                calls: 0,
                misuse: Vec::new(),
                unrelaxed: Vec::new(),
                device_waits: Vec::new(),
                injected: Vec::new(),
                counters: SimCounters::default(),
                capture_seq: 0,
                captures: HashMap::default(),
                host_vc: Vc::default(),
                host_version: 0,
                freed: BTreeMap::new(),
                host: None,
                host_ended: None,
                host_retired: false,
                pool_streams: 0,
                busy: std::collections::BTreeSet::new(),
                watch: streams::Watched::default(),
                next_due: u64::MAX,
                host_mem: HostMem::default(),
                blocked_creates: 0,
                dead: HashMap::default(),
            }),
            cv: Arc::new(Condvar::new()),
            host_jobs: Arc::new((AtomicU64::new(0), AtomicU64::new(0))),
            host_calls: Mutex::new(Vec::new()),
            copy_ns: AtomicU64::new(0),
            free_ns: AtomicU64::new(0),
            host_spawn_failures: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock (only possible in a test's host function bookkeeping)
        // must not poison the simulation for everyone else.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits a little for another thread (a host function running, a host write): releases the
    /// state for up to 1 ms, or, on a thread of a test scheduler, lets it run the others.
    fn pause<'a>(&'a self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        if crate::sync::yields() {
            drop(st);
            crate::sync::yield_now("a simulated wait");
            return self.lock();
        }
        self.cv
            .wait_timeout(st, Duration::from_millis(1))
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    /// The calling thread's current context, or `CUDA_ERROR_INVALID_CONTEXT` when none is
    /// current or the current one is no longer retained (a released primary context).
    fn need_ctx(&self, st: &mut State, call: &'static str) -> Result<u64> {
        let ctx = self.thread().ctx;
        if ctx == 0 || st.contexts.get(&ctx).is_none_or(|c| c.1 == 0) {
            Self::fail_last(st);
            return Err(err(ErrorCode::ERROR_INVALID_CONTEXT, call));
        }
        Ok(ctx)
    }

    fn note_misuse(st: &mut State, what: String) {
        st.misuse.push(what);
    }

    fn new_id(st: &mut State) -> u64 {
        st.next_id += 0x10;
        st.next_id
    }

    // ---- test controls ----------------------------------------------------------------------

    /// Misuse detected so far: use after free, double free, destroyed handles, deadlocks,
    /// driver calls from host functions, and the memory-ordering [`SimDriver::findings`].
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let d = sim.clone();
    /// s.launch_host_func(move || {
    ///     let _ = d.device_count();                  // the real driver forbids this
    /// })
    /// .unwrap();
    /// s.synchronize().unwrap();
    /// assert!(sim.misuse().iter().any(|m| m.contains("driver call from a host function")));
    /// ```
    pub fn misuse(&self) -> Vec<String> {
        let mut m = self.lock().misuse.clone();
        m.extend(
            self.host_calls
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned(),
        );
        m
    }

    /// Calls of the H200's invalidation table (queries, synchronizations, allocations and frees
    /// on a stream that is not capturing, host allocations, pool creation and attributes, graph
    /// instantiation, module loads) made outside relaxed capture mode while some capture was live,
    /// on any thread and in any mode, whether or not the call invalidated it: the crate makes every
    /// such call in relaxed mode, so a note here from a crate operation is a bug.
    ///
    /// ```
    /// use cuda_stream_pool::driver::{CaptureMode, Driver, SimDriver};
    /// use cuda_stream_pool::Context;
    /// use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let (a, b) = (ctx.owner(), ctx.owner());
    /// let (s, t) = (a.stream().unwrap(), b.stream().unwrap());
    /// let g = s.begin_capture_with(CaptureMode::ThreadLocal).unwrap();
    /// t.query().unwrap();                           // the crate: relaxed
    /// assert!(sim.unrelaxed_calls().is_empty());
    /// // SAFETY: `t` is held by `b`: live.
    /// let _ = unsafe { sim.stream_query(t.raw()) };  // this thread is in global mode
    /// assert_eq!(sim.unrelaxed_calls().len(), 1);
    /// drop(g);
    /// ```
    pub fn unrelaxed_calls(&self) -> Vec<String> {
        self.lock().unrelaxed.clone()
    }

    /// Calls that wait for the work of every stream of the device, made while a stream had
    /// work that had not completed: `cuMemFreeHost`, `cuModuleLoadData`, `cuModuleUnload` and
    /// `cuCtxSynchronize` (measured on the H200, `tests/differential_implicit_sync.rs`). On a
    /// GPU such a call stalls for as long as any other work of the device runs, holding a lock
    /// of the driver that other threads' calls need: with a stream that waits for a flag the
    /// host writes after a driver call, the process deadlocks. The simulation does not wait; it
    /// notes the call here, and the crate must make none that its user did not ask for.
    ///
    /// ```
    /// use cuda_stream_pool::driver::{host_alloc_flags, stream_flags, Driver, SimDriver};
    /// let sim = SimDriver::new();
    /// sim.init().unwrap();
    /// let ctx = sim.primary_ctx_retain(sim.device_get(0).unwrap()).unwrap();
    /// // SAFETY: the context was just retained.
    /// unsafe { sim.ctx_set_current(ctx) }.unwrap();
    /// let s = sim.stream_create(stream_flags::NON_BLOCKING, 0).unwrap();
    /// let h = sim.mem_host_alloc(64, host_alloc_flags::PORTABLE).unwrap();
    /// sim.enqueue_work(s, 1_000).unwrap();       // 1 µs of work on `s`
    /// // SAFETY: `h` is a live host allocation that nothing uses.
    /// unsafe { sim.mem_free_host(h) }.unwrap();  // waits for `s` on a GPU
    /// assert_eq!(sim.device_waits().len(), 1);
    /// ```
    pub fn device_waits(&self) -> Vec<String> {
        self.lock().device_waits.clone()
    }

    /// Notes `call` in [`SimDriver::device_waits`] if a stream has work pending (after the
    /// clock's progress).
    fn note_device_wait(&self, st: &mut State, call: &'static str) {
        self.progress(st);
        let busy: Vec<u64> = st
            .streams
            .iter()
            .filter(|(_, s)| !s.queue.is_empty())
            .map(|(id, _)| *id)
            .collect();
        if !busy.is_empty() {
            let note = format!("{call} while stream(s) {busy:?} had work pending");
            st.device_waits.push(note);
        }
    }

    /// The calling thread's current context and capture mode, read without a driver call (a
    /// test control: it counts as no call and no injected fault hits it), for checking that an
    /// operation left the caller's thread state as it found it.
    ///
    /// ```
    /// use cuda_stream_pool::driver::{CaptureMode, Context, Driver, SimDriver};
    /// let sim = SimDriver::new();
    /// let before = sim.call_count();
    /// assert_eq!(sim.thread_state(), (Context(0), CaptureMode::Global));
    /// assert_eq!(sim.call_count(), before);
    /// ```
    pub fn thread_state(&self) -> (Context, CaptureMode) {
        let t = self.thread();
        (Context(t.ctx), t.mode)
    }

    /// Makes `ctx` current on the calling thread without a driver call (a test control, see
    /// [`SimDriver::thread_state`]); `ctx` must be a context of this simulation (or null).
    ///
    /// ```
    /// use cuda_stream_pool::driver::{Driver, SimDriver};
    /// let sim = SimDriver::new();
    /// sim.init().unwrap();
    /// let c = sim.primary_ctx_retain(sim.device_get(0).unwrap()).unwrap();
    /// sim.set_thread_context(c);
    /// assert_eq!(sim.ctx_get_current().unwrap(), c);
    /// ```
    pub fn set_thread_context(&self, ctx: Context) {
        self.set_thread(|t| t.ctx = ctx.0);
    }

    /// Forgets the calling thread's state in this simulation (a test control): its next call
    /// finds it as a fresh thread would, no context current and the global capture mode. For a
    /// test that reuses its threads (the state of each simulation a thread ever called is
    /// otherwise kept until the thread exits).
    pub fn forget_thread_state(&self) {
        let _ = capture::THREAD.try_with(|t| t.borrow_mut().remove(&self.id));
    }

    /// Sets the calling thread's current context and capture mode without a driver call (a test
    /// control, see [`SimDriver::thread_state`]).
    pub fn set_thread_state(&self, ctx: Context, mode: CaptureMode) {
        self.set_thread(|t| {
            t.ctx = ctx.0;
            t.mode = mode;
        });
    }

    /// A context of device `dev` that is not its primary one (what `cuCtxCreate` makes), alive
    /// until [`SimDriver::destroy_context`]. For tests of adopted contexts.
    ///
    /// ```
    /// # use cuda_stream_pool::driver::{Device, Driver, SimDriver};
    /// let sim = SimDriver::new();
    /// let c = sim.create_context(Device(0)).unwrap();
    /// assert_eq!(sim.counters().live_contexts, 1);
    /// assert_eq!(sim.primary_ctx_state(Device(0)).unwrap(), (0, false)); // not the primary
    /// sim.destroy_context(c).unwrap();
    /// assert_eq!(sim.counters().live_contexts, 0);
    /// ```
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_DEVICE` for a device the simulation does not have.
    pub fn create_context(&self, dev: Device) -> Result<Context> {
        let mut st = self.lock();
        if dev.0 >= self.cfg.devices as u64 {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_DEVICE,
                "sim:create_context",
            );
        }
        let c = Self::new_id(&mut st);
        st.contexts.insert(c, (dev.0, 1));
        st.counters.live_contexts += 1;
        Ok(Context(c))
    }

    /// Destroys a context made by [`SimDriver::create_context`].
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_CONTEXT` for anything else (recorded as misuse).
    pub fn destroy_context(&self, ctx: Context) -> Result<()> {
        let mut st = self.lock();
        let primary = st.primary.values().any(|c| *c == ctx.0);
        if primary || st.contexts.remove(&ctx.0).is_none() {
            Self::note_misuse(
                &mut st,
                format!("sim:destroy_context of {:#x}: not a created context", ctx.0),
            );
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_CONTEXT,
                "sim:destroy_context",
            );
        }
        st.counters.live_contexts -= 1;
        Ok(())
    }

    /// The memory-ordering findings among [`SimDriver::misuse`]: races (`"race: ..."`), use
    /// after free (`"use-after-free: ..."`), uninitialised reads (`"uninitialised read: ..."`)
    /// and accesses to graph-owned memory before the graph ran.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let other = ctx.owner();
    /// let t = other.stream().unwrap();
    /// let buf = DeviceBuffer::<u8>::zeroed(&s, 64).unwrap();
    /// s.synchronize().unwrap();
    /// // Two writes on two streams, nothing ordering them (the crate's `use_on` would):
    /// sim.enqueue_access(s.raw(), buf.as_raw(), 64, true, 10).unwrap();
    /// sim.enqueue_access(t.raw(), buf.as_raw(), 64, true, 10).unwrap();
    /// ctx.synchronize().unwrap();
    /// assert!(sim.findings().iter().any(|f| f.starts_with("race:")));
    /// ```
    pub fn findings(&self) -> Vec<String> {
        self.misuse()
            .into_iter()
            .filter(|m| is_finding(m))
            .collect()
    }

    /// Resource counters.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let c = sim.counters();
    /// assert_eq!(c.live_streams, 2);                 // the owner's and the disposal stream
    /// assert_eq!(c.live_contexts, 1);
    /// ```
    pub fn counters(&self) -> SimCounters {
        self.lock().counters.clone()
    }

    /// (started, returned): host functions of streams started on the simulation's
    /// host-function thread so far, and those of them that have returned. Equal when none is
    /// running; a host function that became due starts at the simulation's next step (any
    /// call, or [`SimDriver::advance`]). For tests that must tell "no host function will run"
    /// from "the host-function thread has not run yet" without timing.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::SimDriver, Context};
    /// # use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// s.launch_host_func(|| {}).unwrap();
    /// s.synchronize().unwrap();
    /// let (started, returned) = sim.host_fn_progress();
    /// assert_eq!((started, returned), (1, 1));
    /// ```
    pub fn host_fn_progress(&self) -> (u64, u64) {
        // Returned first: a reading never shows more returned than started.
        let returned = self.host_jobs.1.load(Ordering::SeqCst);
        (self.host_jobs.0.load(Ordering::SeqCst), returned)
    }

    /// Ends the simulation's host-function thread once the host functions already sent to it
    /// have run, as the simulation's drop does, and waits for it to return, unless called from
    /// a host function (then it does not wait). A host function that becomes due later, then or
    /// while the ended thread runs its last ones, starts another thread, which runs nothing
    /// before the ended one has returned (host functions still run one at a time, in order),
    /// and which returns once it has run what was due (no thread waits for more). For a
    /// simulation kept alive on purpose (a dead or leaked context's state holds its driver):
    /// without this its thread lives as long as the process. Returns whether a thread was
    /// ended. As with the simulation's drop, a caller that holds what a pending host function
    /// waits for never returns.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::SimDriver, Context};
    /// # use std::sync::Arc;
    /// let sim = Arc::new(SimDriver::new());
    /// let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// let owner = ctx.owner();
    /// let s = owner.stream().unwrap();
    /// s.launch_host_func(|| {}).unwrap();
    /// s.synchronize().unwrap();
    /// assert!(sim.end_host_thread());
    /// assert!(!sim.end_host_thread());                // none left
    /// s.launch_host_func(|| {}).unwrap();             // starts another
    /// s.synchronize().unwrap();
    /// assert_eq!(sim.host_fn_progress(), (2, 2));
    /// ```
    pub fn end_host_thread(&self) -> bool {
        let mut st = self.lock();
        st.host_retired = true;
        let Some(w) = st.host.take() else {
            return false;
        };
        // A later worker waits for this one (the last ended worker waited for the one before).
        st.host_ended = Some(w.gone);
        drop(st);
        // Outside the lock: its host functions may call the simulation.
        drop(w.tx);
        if streams::IN_HOST_FN.with(|c| c.get()) {
            // This thread may be the worker itself, or one that a host function of it waits
            // for: it returns on its own once its jobs have run.
            return true;
        }
        let _ = w.thread.join();
        true
    }

    /// The host-function threads of every simulation of the process that have not returned
    /// (counted before a thread starts, and by the thread as the last thing it does): for tests
    /// that check that no simulation leaves one behind.
    #[doc(hidden)]
    pub fn live_host_threads() -> usize {
        streams::LIVE_HOST_THREADS.load(Ordering::SeqCst)
    }

    /// Makes the next `n` starts of a host-function thread fail, as when the process is out of
    /// threads: a host function then runs on the thread that completes it, once the thread
    /// ended before it (see [`SimDriver::end_host_thread`]) has returned. For the simulation's
    /// own tests.
    #[doc(hidden)]
    pub fn fail_host_thread_spawns(&self, n: u64) {
        self.host_spawn_failures.store(n, Ordering::SeqCst);
    }

    /// Stream creations blocked right now behind a GPU-side wait ([`SimConfig::create_stall_at`]).
    pub fn blocked_creates(&self) -> u64 {
        let mut st = self.lock();
        self.progress(&mut st);
        st.blocked_creates
    }

    /// Whether a create now would stall ([`SimConfig::create_stall_at`]).
    fn create_stalls(&self, st: &State) -> bool {
        let Some(at) = self.cfg.create_stall_at else {
            return false;
        };
        let c = &st.counters;
        c.live_streams >= at
            && c.live_streams >= c.peak_streams
            && st.busy.iter().filter_map(|id| st.streams.get(id)).any(|s| {
                s.queue.front().is_some_and(|h| {
                    matches!(h.kind, OpKind::WaitValue { .. }) && h.start.is_none()
                })
            })
    }
}

// SAFETY: the simulation keeps the driver API's contract by construction: it hands out fresh
// handles, completes work in stream order on its clock, and records (in `misuse`) and refuses
// what the real driver would reject; the tests check its behaviour against the H200's.
unsafe impl Driver for SimDriver {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn init(&self) -> Result<()> {
        self.enter("cuInit", None, None, None).map(|_| ())
    }

    fn driver_version(&self) -> Result<i32> {
        drop(self.enter("cuDriverGetVersion", None, None, None)?);
        Ok(self.cfg.driver_version)
    }

    fn device_count(&self) -> Result<i32> {
        drop(self.enter("cuDeviceGetCount", None, None, None)?);
        Ok(self.cfg.devices)
    }

    fn device_get(&self, ordinal: i32) -> Result<Device> {
        let mut st = self.enter("cuDeviceGet", None, None, None)?;
        if ordinal < 0 || ordinal >= self.cfg.devices {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_DEVICE, "cuDeviceGet");
        }
        Ok(Device(ordinal as u64))
    }

    fn device_name(&self, dev: Device) -> Result<String> {
        let mut st = self.enter("cuDeviceGetName", None, None, None)?;
        if dev.0 >= self.cfg.devices as u64 {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_DEVICE, "cuDeviceGetName");
        }
        Ok(self.cfg.device_name.clone())
    }

    fn device_attribute(&self, dev: Device, attr: DeviceAttr) -> Result<i32> {
        let mut st = self.enter("cuDeviceGetAttribute", None, None, None)?;
        if dev.0 >= self.cfg.devices as u64 {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_DEVICE,
                "cuDeviceGetAttribute",
            );
        }
        Ok(match attr {
            DeviceAttr::MultiprocessorCount => 132,
            DeviceAttr::ComputeCapabilityMajor => 9,
            DeviceAttr::ComputeCapabilityMinor => 0,
            DeviceAttr::MemoryPoolsSupported => 1,
        })
    }

    fn primary_ctx_retain(&self, dev: Device) -> Result<Context> {
        let mut st = self.enter("cuDevicePrimaryCtxRetain", None, None, None)?;
        if dev.0 >= self.cfg.devices as u64 {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_DEVICE,
                "cuDevicePrimaryCtxRetain",
            );
        }
        let ctx = match st.primary.get(&dev.0) {
            Some(c) => *c,
            None => {
                let c = Self::new_id(&mut st);
                st.primary.insert(dev.0, c);
                st.contexts.insert(c, (dev.0, 0));
                c
            }
        };
        if let Some(&code) = st.dead.get(&ctx) {
            // H200: after a sticky error no retain succeeds (docs/gpu.md), reset or not.
            return Self::fail(&mut st, code, "cuDevicePrimaryCtxRetain");
        }
        let e = st.contexts.get_mut(&ctx).unwrap();
        e.1 += 1;
        if e.1 == 1 {
            st.counters.live_contexts += 1;
        }
        Ok(Context(ctx))
    }

    fn primary_ctx_state(&self, dev: Device) -> Result<(u32, bool)> {
        let mut st = self.enter("cuDevicePrimaryCtxGetState", None, None, None)?;
        if dev.0 >= self.cfg.devices as u64 {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_DEVICE,
                "cuDevicePrimaryCtxGetState",
            );
        }
        let active = st
            .primary
            .get(&dev.0)
            .and_then(|c| st.contexts.get(c))
            .is_some_and(|e| e.1 > 0);
        Ok((0, active))
    }

    unsafe fn primary_ctx_release(&self, dev: Device) -> Result<()> {
        let mut st = self.enter("cuDevicePrimaryCtxRelease_v2", None, None, None)?;
        let ctx = st.primary.get(&dev.0).copied();
        match ctx.and_then(|c| st.contexts.get_mut(&c)) {
            Some(e) if e.1 > 0 => {
                e.1 -= 1;
                if e.1 == 0 {
                    st.counters.live_contexts -= 1;
                }
                Ok(())
            }
            _ => Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_CONTEXT,
                "cuDevicePrimaryCtxRelease_v2",
            ),
        }
    }

    fn ctx_get_current(&self) -> Result<Context> {
        drop(self.enter("cuCtxGetCurrent", None, None, None)?);
        Ok(Context(self.thread().ctx))
    }

    unsafe fn ctx_set_current(&self, ctx: Context) -> Result<()> {
        let mut st = self.enter("cuCtxSetCurrent", None, None, None)?;
        if !ctx.is_null() && !st.contexts.contains_key(&ctx.0) {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_CONTEXT, "cuCtxSetCurrent");
        }
        self.set_thread(|t| t.ctx = ctx.0);
        Ok(())
    }

    fn ctx_get_device(&self) -> Result<Device> {
        let mut st = self.enter("cuCtxGetDevice", None, None, None)?;
        let ctx = self.need_ctx(&mut st, "cuCtxGetDevice")?;
        Ok(Device(st.contexts[&ctx].0))
    }

    fn ctx_synchronize(&self) -> Result<()> {
        let mut st = self.enter("cuCtxSynchronize", None, None, None)?;
        let ctx = self.need_ctx(&mut st, "cuCtxSynchronize")?;
        self.note_device_wait(&mut st, "cuCtxSynchronize");
        Self::no_capture_in_ctx(&mut st, ctx, "cuCtxSynchronize")?;
        self.unsafe_call(&mut st, "cuCtxSynchronize")?;
        if let Some(l) = self.lat() {
            // Synchronizing a context costs more with every live stream that has done work
            // (measured on the H200: 0.1 ms at 10, 2.6 ms at 1,000, 83 ms at 5,000, 319 ms at 12,000).
            let n = st.counters.live_streams;
            let per = (2_600 + 3_500 * n.saturating_sub(1_000) / 1_000).min(27_000);
            let ns = n * per.max(10_000 * n.min(10) / n.max(1));
            drop(st);
            spin(ns.min(l.sync * 200_000));
            st = self.lock();
        }
        let ctx = self.thread().ctx;
        self.wait_until(
            st,
            ctx,
            "cuCtxSynchronize",
            |st| st.busy.is_empty(),
            |st| {
                let all: Vec<Arc<Vc>> = st.streams.values().map(|s| s.vc.clone()).collect();
                for vc in &all {
                    Self::host_observes(st, vc);
                }
            },
        )
    }

    fn ctx_stream_priority_range(&self) -> Result<(i32, i32)> {
        drop(self.enter("cuCtxGetStreamPriorityRange", None, None, None)?);
        Ok(self.cfg.priority_range)
    }

    fn stream_create(&self, flags: u32, priority: i32) -> Result<Stream> {
        self.cost(|l| l.stream_create);
        let mut st = self.enter("cuStreamCreateWithPriority", None, None, None)?;
        self.need_ctx(&mut st, "cuStreamCreateWithPriority")?;
        if flags > stream_flags::NON_BLOCKING {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_VALUE,
                "cuStreamCreateWithPriority",
            );
        }
        if st.counters.live_streams * STREAM_BYTES + st.counters.live_alloc_bytes + STREAM_BYTES
            > self.cfg.total_memory
        {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_OUT_OF_MEMORY,
                "cuStreamCreateWithPriority",
            );
        }
        if self.cfg.create_stall_at.is_some() {
            self.progress(&mut st);
            if self.create_stalls(&st) {
                st.blocked_creates += 1;
                st.counters.stalled_creates += 1;
                while self.create_stalls(&st) {
                    st = self.pause(st);
                    self.progress(&mut st);
                }
                st.blocked_creates -= 1;
            }
        }
        let (least, greatest) = self.cfg.priority_range;
        let priority = priority.clamp(greatest, least);
        let id = Self::new_id(&mut st);
        let ctx = self.thread().ctx;
        st.streams.insert(id, SimStream::new(ctx, flags, priority));
        if let Some(c) = st.log.as_mut().and_then(|l| l.last_mut()) {
            c.stream = Some(Stream(id));
        }
        let c = &mut st.counters;
        c.live_streams += 1;
        c.streams_created += 1;
        c.peak_streams = c.peak_streams.max(c.live_streams);
        self.note_peak(&mut st);
        Ok(Stream(id))
    }

    unsafe fn stream_destroy(&self, stream: Stream) -> Result<()> {
        self.cost(|l| l.stream_destroy);
        let mut st = self.enter("cuStreamDestroy_v2", Some(stream), None, None)?;
        if stream.is_null() {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_HANDLE,
                "cuStreamDestroy_v2",
            );
        }
        Self::check_stream(&mut st, stream, "cuStreamDestroy_v2")?;
        self.progress(&mut st);
        let s = st.streams.remove(&stream.0).unwrap();
        st.busy.remove(&stream.0);
        st.watch.remove(&stream.0);
        if !s.queue.is_empty() {
            // The driver returns at once and finishes the work later; the crate must never do
            // this, so the simulation reports it (and completes the work's effects now).
            Self::note_misuse(
                &mut st,
                format!("stream {:#x} destroyed with pending work", stream.0),
            );
            let now = self.clock.now();
            for op in s.queue {
                if matches!(
                    op.kind,
                    OpKind::Effect(_) | OpKind::Graph(_) | OpKind::WriteValue { .. }
                ) {
                    Self::complete(&mut st, stream.0, op, now);
                }
            }
        }
        if let Some(id) = s.capture {
            Self::note_misuse(
                &mut st,
                format!("stream {:#x} destroyed while capturing", stream.0),
            );
            if st.captures.get(&id).is_some_and(|c| c.origin == stream.0) {
                Self::drop_capture(&mut st, id);
            } else if let Some(c) = st.captures.get_mut(&id) {
                c.forked.remove(&stream.0);
            }
        }
        if s.used_pool {
            st.pool_streams -= 1;
        }
        st.counters.live_streams -= 1;
        st.counters.streams_destroyed += 1;
        Ok(())
    }

    unsafe fn stream_query(&self, stream: Stream) -> Result<bool> {
        self.cost(|l| l.query);
        let mut st = self.enter("cuStreamQuery", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuStreamQuery")?;
        Self::not_capturing(&mut st, stream, "cuStreamQuery")?;
        self.unsafe_call(&mut st, "cuStreamQuery")?;
        self.progress(&mut st);
        let idle = st.streams[&stream.0].queue.is_empty();
        if idle {
            let vc = st.streams[&stream.0].vc.clone();
            Self::host_observes(&mut st, &vc);
        }
        Ok(idle)
    }

    unsafe fn probe_sticky(&self, stream: Stream) -> Result<()> {
        // A background question (see the trait): no cost, count, log, fault injection or
        // observation; only a dead context's error. On a real-time clock the simulated GPU
        // moves on here too, as a real one does by itself: work whose time has come completes
        // (its host-mapped writes land), so that the poller, which probes while completions
        // wait, sees them land with no other call of the program (on a manual clock only the
        // test moves time).
        let mut st = self.lock();
        if matches!(self.clock, Clock::Real(_)) {
            self.progress(&mut st);
        }
        let ctx = st.streams.get(&stream.0).map_or(0, |s| s.ctx);
        match st.dead.get(&ctx) {
            Some(&code) => Err(err(code, "cuStreamQuery")),
            None => Ok(()),
        }
    }

    unsafe fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        let mut st = self.enter("cuStreamSynchronize", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuStreamSynchronize")?;
        Self::not_capturing(&mut st, stream, "cuStreamSynchronize")?;
        self.unsafe_call(&mut st, "cuStreamSynchronize")?;
        let ctx = st.streams.get(&stream.0).map_or(0, |s| s.ctx);
        self.wait_until(
            st,
            ctx,
            "cuStreamSynchronize",
            |st| st.streams.get(&stream.0).is_none_or(|s| s.queue.is_empty()),
            |st| {
                if let Some(vc) = st.streams.get(&stream.0).map(|s| s.vc.clone()) {
                    Self::host_observes(st, &vc);
                }
            },
        )
    }

    unsafe fn stream_priority(&self, stream: Stream) -> Result<i32> {
        let mut st = self.enter("cuStreamGetPriority", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuStreamGetPriority")?;
        Ok(st.streams[&stream.0].priority)
    }

    unsafe fn stream_flags(&self, stream: Stream) -> Result<u32> {
        let mut st = self.enter("cuStreamGetFlags", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuStreamGetFlags")?;
        Ok(st.streams[&stream.0].flags)
    }

    unsafe fn stream_wait_event(&self, stream: Stream, event: Event) -> Result<()> {
        self.do_stream_wait_event(stream, event)
    }

    fn event_create(&self, flags: u32) -> Result<Event> {
        self.cost(|l| l.event);
        let mut st = self.enter("cuEventCreate", None, None, None)?;
        self.need_ctx(&mut st, "cuEventCreate")?;
        if flags > 0xf {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuEventCreate");
        }
        let id = Self::new_id(&mut st);
        let ctx = self.thread().ctx;
        st.events.insert(
            id,
            SimEvent {
                ctx,
                ..SimEvent::default()
            },
        );
        st.counters.live_events += 1;
        if let Some(c) = st.log.as_mut().and_then(|l| l.last_mut()) {
            c.event = Some(Event(id));
        }
        Ok(Event(id))
    }

    unsafe fn event_record(&self, event: Event, stream: Stream) -> Result<()> {
        self.do_event_record(event, stream)
    }

    unsafe fn event_query(&self, event: Event) -> Result<bool> {
        self.do_event_query(event)
    }

    unsafe fn event_synchronize(&self, event: Event) -> Result<()> {
        self.do_event_synchronize(event)
    }

    unsafe fn event_destroy(&self, event: Event) -> Result<()> {
        self.do_event_destroy(event)
    }

    unsafe fn mem_alloc_async(&self, bytes: usize, stream: Stream) -> Result<DevicePtr> {
        self.do_mem_alloc_async(bytes, stream, None)
    }

    unsafe fn mem_alloc_from_pool_async(
        &self,
        bytes: usize,
        pool: MemPool,
        stream: Stream,
    ) -> Result<DevicePtr> {
        self.do_mem_alloc_async(bytes, stream, Some(pool))
    }

    unsafe fn mem_free_async(&self, ptr: DevicePtr, stream: Stream) -> Result<()> {
        self.do_mem_free_async(ptr, stream)
    }

    fn device_default_mem_pool(&self, dev: Device) -> Result<MemPool> {
        let mut st = self.enter("cuDeviceGetDefaultMemPool", None, None, None)?;
        if dev.0 >= self.cfg.devices as u64 {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_DEVICE,
                "cuDeviceGetDefaultMemPool",
            );
        }
        Ok(MemPool(1))
    }

    fn mem_pool_create(&self, dev: Device) -> Result<MemPool> {
        let mut st = self.enter("cuMemPoolCreate", None, None, None)?;
        self.need_ctx(&mut st, "cuMemPoolCreate")?;
        self.unsafe_call(&mut st, "cuMemPoolCreate")?;
        if dev.0 >= self.cfg.devices as u64 {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuMemPoolCreate");
        }
        let h = st.next_pool;
        st.next_pool += 1;
        st.pools.insert(h, 0);
        Ok(MemPool(h))
    }

    unsafe fn mem_pool_destroy(&self, pool: MemPool) -> Result<()> {
        let mut st = self.enter("cuMemPoolDestroy", None, None, None)?;
        if pool.0 == 1 || st.pools.remove(&pool.0).is_none() {
            st.misuse.push(format!(
                "cuMemPoolDestroy of {pool:?}, which is not a live pool made by cuMemPoolCreate"
            ));
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuMemPoolDestroy");
        }
        Ok(())
    }

    unsafe fn mem_pool_set_attribute(
        &self,
        pool: MemPool,
        attr: MemPoolAttr,
        value: u64,
    ) -> Result<()> {
        let mut st = self.enter("cuMemPoolSetAttribute", None, None, None)?;
        self.unsafe_call(&mut st, "cuMemPoolSetAttribute")?;
        if !st.pools.contains_key(&pool.0) || attr != MemPoolAttr::ReleaseThreshold {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_VALUE,
                "cuMemPoolSetAttribute",
            );
        }
        st.pools.insert(pool.0, value);
        Ok(())
    }

    unsafe fn mem_pool_get_attribute(&self, pool: MemPool, attr: MemPoolAttr) -> Result<u64> {
        let mut st = self.enter("cuMemPoolGetAttribute", None, None, None)?;
        let Some(&threshold) = st.pools.get(&pool.0) else {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_VALUE,
                "cuMemPoolGetAttribute",
            );
        };
        Ok(match attr {
            MemPoolAttr::ReleaseThreshold => threshold,
            // Each pool counts its own live allocations only (the simulation caches no freed
            // memory, so what is reserved is what is used).
            MemPoolAttr::ReservedMemCurrent | MemPoolAttr::UsedMemCurrent => st
                .allocs
                .values()
                .filter(|a| a.pool == pool.0 && !a.graph_owned)
                .map(|a| a.data.len() as u64)
                .sum(),
        })
    }

    fn mem_get_info(&self) -> Result<(usize, usize)> {
        let mut st = self.enter("cuMemGetInfo_v2", None, None, None)?;
        self.need_ctx(&mut st, "cuMemGetInfo_v2")?;
        let used = self.device_bytes(&st);
        Ok((
            (self.cfg.total_memory - used) as usize,
            self.cfg.total_memory as usize,
        ))
    }

    unsafe fn memset_d32_async(
        &self,
        dst: DevicePtr,
        value: u32,
        count: usize,
        stream: Stream,
    ) -> Result<()> {
        self.do_memset_d32_async(dst, value, count, stream)
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.cost(|l| l.launch);
        let mut st = self.enter("cuMemcpyHtoDAsync_v2", Some(stream), None, Some(dst))?;
        Self::check_stream(&mut st, stream, "cuMemcpyHtoDAsync_v2")?;
        self.copy_context(&mut st, stream, "cuMemcpyHtoDAsync_v2")?;
        Self::check_range(&mut st, dst.0, bytes, "cuMemcpyHtoDAsync_v2")?;
        let dur = self.copy_time();
        // Page-locked memory of `cuMemHostAlloc` is read when the copy runs (as the GPU's DMA
        // does); any other source is copied at once, as the driver stages pageable memory.
        let effect = match st.host_mem.dev_addr(src as usize, bytes) {
            Some(host_dev) => Effect::HtoDPinned {
                dst: dst.0,
                host_dev,
                bytes,
            },
            None => {
                // SAFETY: the caller guarantees `src` is readable for `bytes`.
                let data = unsafe { std::slice::from_raw_parts(src, bytes) }.to_vec();
                Effect::HtoD { dst: dst.0, data }
            }
        };
        self.enqueue(
            &mut st,
            stream,
            OpKind::Effect(effect),
            dur,
            "cuMemcpyHtoDAsync_v2",
        )
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        self.cost(|l| l.launch);
        let mut st = self.enter("cuMemcpyDtoHAsync_v2", Some(stream), None, Some(src))?;
        Self::check_stream(&mut st, stream, "cuMemcpyDtoHAsync_v2")?;
        self.copy_context(&mut st, stream, "cuMemcpyDtoHAsync_v2")?;
        Self::check_range(&mut st, src.0, bytes, "cuMemcpyDtoHAsync_v2")?;
        let dur = self.copy_time();
        self.enqueue(
            &mut st,
            stream,
            OpKind::Effect(Effect::DtoH {
                dst: dst as usize,
                src: src.0,
                bytes,
            }),
            dur,
            "cuMemcpyDtoHAsync_v2",
        )
    }

    fn mem_host_alloc(&self, bytes: usize, flags: u32) -> Result<*mut u8> {
        self.do_mem_host_alloc(bytes, flags)
    }

    unsafe fn mem_host_get_device_pointer(&self, host: *mut u8) -> Result<DevicePtr> {
        self.do_mem_host_get_device_pointer(host)
    }

    unsafe fn mem_free_host(&self, host: *mut u8) -> Result<()> {
        self.do_mem_free_host(host)
    }

    unsafe fn stream_write_value64(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u64,
    ) -> Result<()> {
        self.do_stream_write_value64(stream, addr, value)
    }

    unsafe fn stream_wait_value32(
        &self,
        stream: Stream,
        addr: DevicePtr,
        value: u32,
        cond: WaitValue,
    ) -> Result<()> {
        self.do_stream_wait_value32(stream, addr, value, cond)
    }

    unsafe fn stream_begin_capture(&self, stream: Stream, mode: CaptureMode) -> Result<()> {
        let mut st = self.enter("cuStreamBeginCapture_v2", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuStreamBeginCapture_v2")?;
        Self::begin_capture(&mut st, stream, mode)
    }

    unsafe fn stream_end_capture(&self, stream: Stream) -> Result<Graph> {
        let mut st = self.enter("cuStreamEndCapture", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuStreamEndCapture")?;
        Self::end_capture(&mut st, stream)
    }

    unsafe fn stream_is_capturing(&self, stream: Stream) -> Result<CaptureStatus> {
        self.stream_capture_info(stream).map(|(s, _)| s)
    }

    unsafe fn stream_capture_info(&self, stream: Stream) -> Result<(CaptureStatus, u64)> {
        let mut st = self.enter("cuStreamGetCaptureInfo_v3", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuStreamGetCaptureInfo_v3")?;
        let cap = Self::capture_of(&st, stream.0).and_then(|id| st.captures.get(&id));
        Ok(match cap {
            None => (CaptureStatus::None, 0),
            Some(c) if c.invalidated => (CaptureStatus::Invalidated, c.id),
            Some(c) => (CaptureStatus::Active, c.id),
        })
    }

    fn thread_exchange_capture_mode(&self, mode: CaptureMode) -> Result<CaptureMode> {
        self.cost(|l| l.capture_mode_exchange);
        drop(self.enter("cuThreadExchangeStreamCaptureMode", None, None, None)?);
        let mut old = CaptureMode::Global;
        self.set_thread(|t| {
            old = t.mode;
            t.mode = mode;
        });
        Ok(old)
    }

    unsafe fn graph_instantiate(&self, graph: Graph) -> Result<GraphExec> {
        self.do_graph_instantiate(graph)
    }

    unsafe fn graph_launch(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        self.do_graph_launch(exec, stream)
    }

    unsafe fn graph_upload(&self, exec: GraphExec, stream: Stream) -> Result<()> {
        let mut st = self.enter("cuGraphUpload", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuGraphUpload")?;
        if !st.execs.contains_key(&exec.0) {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuGraphUpload");
        }
        Ok(())
    }

    unsafe fn graph_exec_destroy(&self, exec: GraphExec) -> Result<()> {
        let mut st = self.enter("cuGraphExecDestroy", None, None, None)?;
        if st.execs.remove(&exec.0).is_none() {
            Self::note_misuse(
                &mut st,
                format!("destroy of unknown graph exec {:#x}", exec.0),
            );
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_VALUE,
                "cuGraphExecDestroy",
            );
        }
        st.counters.live_graph_execs -= 1;
        Ok(())
    }

    unsafe fn graph_destroy(&self, graph: Graph) -> Result<()> {
        self.do_graph_destroy(graph)
    }

    unsafe fn graph_node_count(&self, graph: Graph) -> Result<usize> {
        let mut st = self.enter("cuGraphGetNodes", None, None, None)?;
        match st.graphs.get(&graph.0) {
            Some(g) => Ok(g.len()),
            None => Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuGraphGetNodes"),
        }
    }

    fn module_load_data(&self, image: &CStr) -> Result<Module> {
        let mut st = self.enter("cuModuleLoadData", None, None, None)?;
        self.need_ctx(&mut st, "cuModuleLoadData")?;
        self.note_device_wait(&mut st, "cuModuleLoadData");
        // Measured on the H200: the load succeeds, the conflicting captures are invalidated.
        self.unsafe_call_succeeds(&mut st, "cuModuleLoadData");
        if !image.to_bytes().windows(8).any(|w| w == b".version") {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_PTX, "cuModuleLoadData");
        }
        let id = Self::new_id(&mut st);
        st.modules.insert(id, ());
        st.counters.live_modules += 1;
        Ok(Module(id))
    }

    unsafe fn module_get_function(&self, module: Module, name: &CStr) -> Result<Function> {
        let mut st = self.enter("cuModuleGetFunction", None, None, None)?;
        if !st.modules.contains_key(&module.0) {
            return Self::fail(
                &mut st,
                ErrorCode::ERROR_INVALID_HANDLE,
                "cuModuleGetFunction",
            );
        }
        let Some(k) = name.to_str().ok().and_then(Kernel::by_name) else {
            return Self::fail(&mut st, ErrorCode::ERROR_NOT_FOUND, "cuModuleGetFunction");
        };
        let id = Self::new_id(&mut st);
        st.functions.insert(id, k);
        Ok(Function(id))
    }

    unsafe fn module_unload(&self, module: Module) -> Result<()> {
        let mut st = self.enter("cuModuleUnload", None, None, None)?;
        if st.modules.remove(&module.0).is_none() {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_HANDLE, "cuModuleUnload");
        }
        self.note_device_wait(&mut st, "cuModuleUnload");
        st.counters.live_modules -= 1;
        Ok(())
    }

    unsafe fn launch_kernel(
        &self,
        func: Function,
        _grid: [u32; 3],
        _block: [u32; 3],
        _shared_bytes: u32,
        stream: Stream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.cost(|l| l.launch);
        let mut st = self.enter("cuLaunchKernel", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuLaunchKernel")?;
        let Some(k) = st.functions.get(&func.0).copied() else {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_HANDLE, "cuLaunchKernel");
        };
        if params.len() != k.arity() {
            return Self::fail(&mut st, ErrorCode::ERROR_INVALID_VALUE, "cuLaunchKernel");
        }
        // SAFETY: the caller guarantees each parameter pointer points to a value of the kernel's
        // declared type: a 64-bit device pointer first (and second for the sum), then 32-bit
        // unsigned integers.
        let args: Vec<u64> = unsafe {
            match k {
                Kernel::AddOneF32 => vec![
                    *(params[0] as *const u64),
                    *(params[1] as *const u32) as u64,
                ],
                Kernel::SumF32 => vec![
                    *(params[0] as *const u64),
                    *(params[1] as *const u64),
                    *(params[2] as *const u32) as u64,
                ],
                Kernel::AddU32 => vec![
                    *(params[0] as *const u64),
                    *(params[1] as *const u32) as u64,
                    *(params[2] as *const u32) as u64,
                ],
            }
        };
        let n = if k == Kernel::SumF32 {
            args[2]
        } else {
            args[1]
        } as usize;
        Self::check_range(&mut st, args[0], n * 4, "cuLaunchKernel")?;
        if k == Kernel::SumF32 {
            Self::check_range(&mut st, args[1], 4, "cuLaunchKernel")?;
        }
        let dur = self.lat().map_or(0, |l| l.kernel_gpu);
        self.enqueue(
            &mut st,
            stream,
            OpKind::Effect(Effect::Kernel { k, args }),
            dur,
            "cuLaunchKernel",
        )
    }

    unsafe fn launch_host_func(&self, stream: Stream, f: HostFn) -> Result<()> {
        self.cost(|l| l.launch);
        let mut st = self.enter("cuLaunchHostFunc", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "cuLaunchHostFunc")?;
        self.enqueue(
            &mut st,
            stream,
            OpKind::Host {
                f: Some(f),
                done: Arc::new(AtomicBool::new(false)),
            },
            0,
            "cuLaunchHostFunc",
        )
    }
}
