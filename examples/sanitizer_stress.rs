//! The issue-19 stress program for `compute-sanitizer --tool memcheck`: threads (16 by default)
//! mix, on one context with a small cap on live streams per key (so they wait on it):
//!
//! * buffers, the crate's kernels, memsets and copies on owners' streams (two priorities per
//!   owner), the data checked; a random share of the guards leaked with `mem::forget`: buffer
//!   uses (their work still runs, the buffer is freed after it and a buffer allocated next must
//!   not see it), cudarc uses, capture guards, `OwnerReady` futures (unpolled, and waiting at a
//!   cap), completion futures. A leak must leak, never free under the GPU;
//! * loans of pooled streams to cudarc (`StreamRef::cudarc_stream`; on the simulated driver a
//!   generic `StreamRef::lend`): cudarc allocations, copies, memsets and launches, cudarc
//!   launches on the crate's buffers (`CudarcUse`), cudarc slices that outlive their owner; on
//!   some loans the borrower captures the lent stream (cudarc's `begin_capture`/`end_capture`)
//!   and launches the graph, while the crate's work on that stream must be refused
//!   (`Error::CaptureInProgress`);
//! * async owners (`Owner::ready`) and completions (`StreamRef::completed`) polled by hand, with
//!   wakers that drop an `Owner`, a buffer, a `Context` clone or the last clone of a context (on
//!   the completion poller's thread); host functions that drop the same;
//! * the crate's own captures, graphs launched after their buffers are dropped.
//!
//! At the end every handle is dropped and the context's statistics are checked (every stream not
//! leaked came back, the cap held); on the simulated driver also its findings (no race, no use
//! after free, no call that could invalidate a capture outside relaxed mode) and its live
//! counters (only what was leaked is left). Any unexpected error exits non-zero.
//!
//!   cargo run --release --features cudarc,kernels --example sanitizer_stress      # GPU if any
//!   cargo run --release --features cudarc,kernels --example sanitizer_stress -- --sim --iters 200
//!
//! On the GPU machine, after `scripts/gpu-bundle.sh --features cudarc --example sanitizer_stress`:
//!
//!   compute-sanitizer --tool memcheck --report-api-errors no --leak-check full \
//!       .gpu/bin/sanitizer_stress --gpu --no-gates
//!
//! (`--no-gates` under memcheck, which serializes the device's work: a stream held busy by a
//! gate then stalls every thread that waits for the GPU, the gate's opener too.)
//!
//! What the leaks keep for ever, and so what `--leak-check full` may list (the summary line
//! counts them): the 256-byte buffers filled in leaked captures (their free is ordered on a
//! stream that never ends its capture), and each thread's leaky context (its streams, memory
//! pool and pinned completion slab). Anything else it reports is a defect.
//!
//! Arguments: `--threads N` (16), `--iters N` (iterations per thread: 150 on the GPU, 200 on
//! the simulation), `--cap N` (3), `--seed N`, `--sim` (the simulated driver even with a GPU),
//! `--gpu` (fail when there is no GPU instead of falling back to the simulation),
//! `--watchdog SECS` (0: off; after that long without a finished operation, print what every
//! worker does and exit with status 3; with `CSP_STRESS_STACKS=1` also every thread's stack),
//! `--prewarm N` (1,024: streams created and destroyed first on the GPU, see `prewarm`).
//! `tests/sanitizer_stress.rs` runs the same program on the simulated driver.

use cuda_stream_pool::driver::{self, stream_flags, CaptureMode, Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{
    CaptureModeGuard, Context, ContextOptions, DeviceBuffer, Error, OwnedStream, Owner, Priority,
    StreamRef,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::task::{Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// A hang guard: no wait of the program decides anything, but a deadlock must end the run.
const HANG: Duration = Duration::from_secs(120);

type R<T> = std::result::Result<T, String>;

/// What a worker does: its operation, and its last finished call (or the wait it is in).
type Phase = Arc<Mutex<[&'static str; 2]>>;

std::thread_local! {
    /// This worker thread's [`Phase`], which [`At::at`] keeps up to date.
    static PHASE: std::cell::RefCell<Option<Phase>> = const { std::cell::RefCell::new(None) };
}

/// Set by a worker's signal handler once it has printed its stack.
static DUMPED: AtomicBool = AtomicBool::new(false);

extern "C" fn print_stack(_: libc::c_int) {
    // Not async-signal-safe (it allocates): only for a hung run, whose workers wait in the
    // driver or on a lock, not in the allocator.
    let bt = std::backtrace::Backtrace::force_capture();
    eprintln!("--- {:?}\n{bt}", std::thread::current().name());
    DUMPED.store(true, Ordering::Release);
}

/// Prints the stack of every thread of the process but this one (`CSP_STRESS_STACKS=1`): the
/// workers, the crate's and the driver's threads, each sent SIGUSR1 in turn.
fn dump_stacks() {
    // SAFETY: installs a handler for SIGUSR1, which nothing else in the program uses.
    unsafe {
        libc::signal(
            libc::SIGUSR1,
            print_stack as extern "C" fn(libc::c_int) as libc::sighandler_t,
        )
    };
    // SAFETY: no preconditions.
    let (pid, me) = unsafe { (libc::getpid(), libc::gettid()) };
    let tasks = std::fs::read_dir("/proc/self/task").map(|d| {
        d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .collect::<Vec<_>>()
    });
    for tid in tasks.unwrap_or_default() {
        if tid == me {
            continue;
        }
        let comm =
            std::fs::read_to_string(format!("/proc/self/task/{tid}/comm")).unwrap_or_default();
        DUMPED.store(false, Ordering::Release);
        eprintln!("=== thread {tid} {}", comm.trim());
        // SAFETY: signals a thread of this process, whose SIGUSR1 handler is installed above.
        unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGUSR1) };
        let t0 = Instant::now();
        while !DUMPED.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn set_step(step: &'static str) {
    PHASE.with(|p| {
        if let Some(p) = &*p.borrow() {
            p.lock().unwrap_or_else(|e| e.into_inner())[1] = step;
        }
    });
}

/// Creates `n` streams in `ctx`'s CUDA context and destroys them, so that the driver has the
/// resources of `n` streams before any [`Gate`] holds a stream.
///
/// On the H200 a `cuStreamCreate` that needs new resources (about the 31st live stream) blocks
/// until every stream waiting on host-mapped memory is released, and while it is blocked the
/// other threads' driver calls in the context wait behind it (`tests/differential_stall*.rs`). A
/// worker that holds a gate and calls the driver before it opens the gate then deadlocks the
/// process, whatever the crate does. Created and destroyed streams are reused at once, so a
/// driver that already made `n` streams never blocks a create below `n` live ones.
fn prewarm(ctx: &Context, n: usize) -> R<()> {
    let d = ctx.driver();
    ctx.bind().at("bind")?;
    let streams = (0..n)
        .map(|_| d.stream_create(stream_flags::NON_BLOCKING, 0))
        .collect::<Result<Vec<_>, _>>()
        .at("cuStreamCreate")?;
    for s in streams {
        // SAFETY: made just above, never used.
        unsafe { d.stream_destroy(s) }.at("cuStreamDestroy")?;
    }
    Ok(())
}

/// Adds what failed to a crate error (and records the call as this worker's last).
trait At<T> {
    fn at(self, what: &'static str) -> R<T>;
}
impl<T, E: std::fmt::Display> At<T> for std::result::Result<T, E> {
    fn at(self, what: &'static str) -> R<T> {
        set_step(what);
        self.map_err(|e| format!("{what}: {e}"))
    }
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Config {
    /// Worker threads.
    pub threads: usize,
    /// Iterations per thread; `None`: the default of the driver.
    pub iters: Option<usize>,
    /// The cap on live streams per key of the shared context.
    pub cap: usize,
    /// The simulated driver even when a GPU is present.
    pub sim: bool,
    /// Fail instead of falling back to the simulation when there is no GPU.
    pub gpu: bool,
    /// The seed of the threads' random choices.
    pub seed: u64,
    /// Streams created and destroyed before the run on the real driver (see [`prewarm`]).
    pub prewarm: usize,
    /// Seconds without a finished operation after which the run prints what every worker
    /// does and exits with status 3 (0: never).
    pub watchdog_s: u64,
    /// Whether gates hold streams busy ([`Gate`]); off with `--no-gates`, for memcheck, which
    /// serializes the device's work (a closed gate then stalls every thread that waits for the
    /// GPU, and the thread that would open it behind them).
    pub gates: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            threads: 16,
            iters: None,
            cap: 3,
            sim: false,
            gpu: false,
            seed: 19,
            watchdog_s: 0,
            prewarm: 1024,
            gates: true,
        }
    }
}

impl Config {
    /// Parses `--threads N --iters N --cap N --seed N --sim`.
    pub fn from_args(args: impl IntoIterator<Item = String>) -> R<Config> {
        let mut c = Config::default();
        let mut it = args.into_iter();
        while let Some(a) = it.next() {
            let mut num = |name: &'static str| -> R<u64> {
                it.next()
                    .ok_or_else(|| format!("{name} needs a number"))?
                    .parse::<u64>()
                    .at(name)
            };
            match a.as_str() {
                "--threads" => c.threads = num("--threads")?.max(1) as usize,
                "--iters" => c.iters = Some(num("--iters")? as usize),
                "--cap" => c.cap = num("--cap")?.max(1) as usize,
                "--seed" => c.seed = num("--seed")?,
                "--watchdog" => c.watchdog_s = num("--watchdog")?,
                "--prewarm" => c.prewarm = num("--prewarm")? as usize,
                "--sim" => c.sim = true,
                "--gpu" => c.gpu = true,
                "--no-gates" => c.gates = false,
                "-h" | "--help" => {
                    return Err(
                        "usage: sanitizer_stress [--threads N] [--iters N] [--cap N] [--seed N] [--watchdog SECS] [--prewarm N] [--no-gates] [--sim | --gpu]"
                            .into(),
                    )
                }
                other => return Err(format!("unknown argument {other}")),
            }
        }
        Ok(c)
    }
}

/// Counters of what the run did, summed over the threads.
#[derive(Debug, Default)]
pub struct Summary {
    /// The driver's name (`cuda` or `sim`).
    pub driver: String,
    /// Operations (one per iteration of a thread).
    pub ops: u64,
    /// Guards and futures leaked with `mem::forget`.
    pub leaked: u64,
    /// Loans of pooled streams (cudarc's or generic).
    pub loans: u64,
    /// Loans whose borrower captured the lent stream and launched the graph.
    pub borrower_captures: u64,
    /// Crate operations refused in a borrower's capture (as they must be).
    pub refused: u64,
    /// The crate's own captures, launched after their buffers were dropped.
    pub captures: u64,
    /// Payloads (owners, buffers, contexts) dropped by a waker (its wake or its drop).
    pub waker_drops: u64,
    /// Payloads dropped in a host function.
    pub host_fn_drops: u64,
    /// Last clones of a context dropped by a waker or a host function.
    pub last_ctx_drops: u64,
    /// Acquisitions that waited at the cap.
    pub cap_waits: u64,
    /// Buffer contents checked.
    pub checks: u64,
    /// Device allocations kept for ever by leaked captures (what `--leak-check full` may list,
    /// with the pinned completion slabs of the leaky contexts: one per thread).
    pub leaked_allocs: u64,
    /// Seconds the threads ran.
    pub secs: f64,
    /// Threads (each leaks its leaky context).
    pub threads: usize,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sanitizer_stress ({} driver): {} ops, {} leaked guards, {} loans ({} captured by the \
             borrower, {} crate calls refused in them), {} crate captures, {} waker drops, {} \
             host-function drops ({} last contexts), {} waits at the cap, {} checks, {:.2} s; \
             leaked on purpose: {} allocations of 256 B in leaked captures, {} contexts OK",
            self.driver,
            self.ops,
            self.leaked,
            self.loans,
            self.borrower_captures,
            self.refused,
            self.captures,
            self.waker_drops,
            self.host_fn_drops,
            self.last_ctx_drops,
            self.cap_waits,
            self.checks,
            self.secs,
            self.leaked_allocs,
            self.threads
        )
    }
}

#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    leaked: AtomicU64,
    loans: AtomicU64,
    borrower_captures: AtomicU64,
    refused: AtomicU64,
    captures: AtomicU64,
    waker_drops: AtomicU64,
    host_fn_drops: AtomicU64,
    last_ctx_drops: AtomicU64,
    checks: AtomicU64,
    /// Allocations that a leaked capture keeps for ever (their free is ordered on a stream
    /// that never ends its capture).
    leaked_allocs: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// cudarc's side, on the real driver: its context and the crate's kernels loaded by cudarc.
#[cfg(feature = "cudarc")]
struct Cudarc {
    cu: Arc<cudarc::driver::CudaContext>,
    add_one: cudarc::driver::CudaFunction,
}

/// Another crate's handle of a lent stream, for the generic loans (what cudarc's `CudaStream`
/// is).
#[derive(Debug)]
struct Foreign(driver::Stream);

/// What every thread shares.
struct Env {
    drv: Arc<dyn Driver>,
    sim: Option<Arc<SimDriver>>,
    /// On the simulation, the leaky contexts live on a simulation of their own, so that the
    /// main one can be checked to have nothing left at the end.
    leak_sim: Option<Arc<SimDriver>>,
    ctx: Context,
    k: Kernels,
    #[cfg(feature = "cudarc")]
    cudarc: Option<Cudarc>,
    opts: ContextOptions,
    /// Elements per buffer.
    n: usize,
    c: Arc<Counters>,
    /// Gate words of `drv` (see [`Gate`]).
    gates: Arc<GateWords>,
    /// What each worker is doing (read by the watchdog when the run stops making progress).
    phases: Vec<Phase>,
}

impl Env {
    /// A state of its own of the same driver and device (adopted from cudarc's when cudarc is
    /// used, so that its streams can be lent to cudarc): isolated, so that what a worker leaks
    /// or holds in it never counts against the shared state's cap.
    fn new_context(&self, opts: ContextOptions) -> R<Context> {
        let opts = opts.isolated(true);
        #[cfg(feature = "cudarc")]
        if let Some(c) = &self.cudarc {
            return Context::from_cudarc_with(&c.cu, opts).at("Context::from_cudarc_with");
        }
        Context::primary_with(self.drv.clone(), 0, opts).at("Context::primary_with")
    }

    /// A leaky context (see [`Worker::leaky`]).
    fn new_leaky_context(&self) -> R<Context> {
        match &self.leak_sim {
            Some(ls) => Context::primary_with(ls.clone(), 0, self.opts.isolated(true))
                .at("Context::primary_with"),
            None => self.new_context(self.opts),
        }
    }
}

/// xorshift64*: the threads' choices, reproducible from the seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// True with probability `p` percent.
    fn pct(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

/// What a waker or a host function drops.
enum Payload {
    Owner(#[allow(dead_code)] Owner),
    Buffer(#[allow(dead_code)] DeviceBuffer<f32>),
    Context(#[allow(dead_code)] Context),
    /// The last clone of a context (nothing else holds it).
    LastContext(#[allow(dead_code)] Context),
}

/// A waker that drops its payload when woken (or when the last clone of it is dropped, if it
/// never is), and unparks the thread that waits for it.
struct Dropping {
    payload: Mutex<Option<Payload>>,
    thread: Thread,
    woken: AtomicBool,
    c: Arc<Counters>,
}

impl Dropping {
    fn new(env: &Arc<Env>, payload: Option<Payload>) -> Arc<Dropping> {
        Arc::new(Dropping {
            payload: Mutex::new(payload),
            thread: std::thread::current(),
            woken: AtomicBool::new(false),
            c: env.c.clone(),
        })
    }

    fn drop_payload(&self) {
        // Taken out under the mutex, dropped after it (the drop re-enters the crate).
        let p = self
            .payload
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(p) = p {
            if matches!(p, Payload::LastContext(_)) {
                bump(&self.c.last_ctx_drops);
            }
            drop(p);
            bump(&self.c.waker_drops);
        }
    }

    /// Waits (parked) until woken, or fails after [`HANG`].
    fn wait(&self, what: &'static str) -> R<()> {
        set_step(what);
        let t0 = Instant::now();
        while !self.woken.swap(false, Ordering::AcqRel) {
            ensure!(t0.elapsed() < HANG, "hang: {what} was never woken");
            std::thread::park_timeout(Duration::from_millis(50));
        }
        Ok(())
    }
}

impl Wake for Dropping {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.drop_payload();
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

impl Drop for Dropping {
    fn drop(&mut self) {
        self.drop_payload();
    }
}

/// Polls `f` to completion on this thread, parking between polls (a minimal executor).
fn block_on<F: Future>(f: F, w: &Arc<Dropping>, what: &'static str) -> R<F::Output> {
    set_step(what);
    let mut f = std::pin::pin!(f);
    let waker = Waker::from(w.clone());
    let mut cx = std::task::Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return Ok(v);
        }
        w.wait(what)?;
    }
}

/// Polls once.
fn poll_once<F: Future + ?Sized>(f: Pin<&mut F>, w: &Arc<Dropping>) -> Poll<F::Output> {
    let waker = Waker::from(w.clone());
    f.poll(&mut std::task::Context::from_waker(&waker))
}

/// A gate that a host function waits on, so that the work behind it (a completion, a drop)
/// stays pending until the thread opens it. Opened when dropped.
/// Host-mapped 32-bit words for [`Gate`]s: each gate takes a word of its own (never reused), so
/// no reset can race a wait that has not passed yet.
struct GateWords {
    drv: Arc<dyn Driver>,
    host: usize,
    dev: u64,
    next: std::sync::atomic::AtomicUsize,
    /// Whether gates wait (see [`Config::gates`]).
    on: bool,
}

impl GateWords {
    const WORDS: usize = 1 << 14;

    /// Allocates the words through `ctx`'s driver (its device rules make the context current).
    /// With `on` false, gates do not wait (see [`Config::gates`]).
    fn new(ctx: &Context, on: bool) -> R<Arc<GateWords>> {
        let drv = ctx.driver().clone();
        let bytes = Self::WORDS * 4;
        let host = drv
            .mem_host_alloc(
                bytes,
                driver::host_alloc_flags::DEVICEMAP | driver::host_alloc_flags::PORTABLE,
            )
            .at("cuMemHostAlloc")?;
        // SAFETY: just allocated with DEVICEMAP, `bytes` long; nothing uses it yet.
        let dev = unsafe {
            std::ptr::write_bytes(host, 0, bytes);
            drv.mem_host_get_device_pointer(host)
        }
        .at("cuMemHostGetDevicePointer")?;
        Ok(Arc::new(GateWords {
            drv,
            host: host as usize,
            dev: dev.0,
            next: std::sync::atomic::AtomicUsize::new(0),
            on,
        }))
    }

    /// Frees the words; only once every stream has passed its waits on them.
    fn free(&self) -> R<()> {
        // SAFETY: allocated by `new`, freed once; the caller waited for every gate's stream.
        unsafe { self.drv.mem_free_host(self.host as *mut u8) }.at("cuMemFreeHost")
    }
}

/// Holds a stream busy, the way the H200 allows: `cuStreamWaitValue32` on a host-mapped word
/// that the drop writes (a host function that blocks would stall the context's one
/// host-function thread, and stream creation behind it). `then` runs in a host function after
/// the gate opens.
struct Gate {
    words: Arc<GateWords>,
    i: usize,
}

impl Gate {
    fn on(
        words: &Arc<GateWords>,
        s: &StreamRef<'_>,
        then: impl FnOnce() + Send + 'static,
    ) -> R<Gate> {
        if !words.on {
            s.launch_host_func(then).at("launch_host_func")?;
            return Ok(Gate {
                words: words.clone(),
                i: usize::MAX,
            });
        }
        let i = words.next.fetch_add(1, Ordering::AcqRel);
        ensure!(i < GateWords::WORDS, "out of gate words");
        // SAFETY: `s` is held by its owner (live) and not capturing; the word is host-mapped
        // memory that lives until `GateWords::free`, after every gate has opened.
        unsafe {
            words.drv.stream_wait_value32(
                s.raw(),
                driver::DevicePtr(words.dev + 4 * i as u64),
                1,
                driver::WaitValue::Geq,
            )
        }
        .at("cuStreamWaitValue32")?;
        s.launch_host_func(then).at("launch_host_func")?;
        Ok(Gate {
            words: words.clone(),
            i,
        })
    }
}

impl Gate {
    /// Checks that `p`, a poll of a future behind this gate, is pending while the gate is
    /// closed (without gates, anything goes).
    fn pending<T>(&self, p: Poll<T>, what: &str) -> R<()> {
        ensure!(self.i == usize::MAX || p.is_pending(), "{what}");
        Ok(())
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if self.i == usize::MAX {
            return;
        }
        // SAFETY: word `i` of the live allocation, 4-byte aligned; the GPU only reads it.
        let w =
            unsafe { &*((self.words.host + 4 * self.i) as *const std::sync::atomic::AtomicU32) };
        w.store(1, Ordering::Release);
    }
}

fn refused<T>(what: &str, r: cuda_stream_pool::Result<T>, env: &Env) -> R<()> {
    match r {
        Err(Error::CaptureInProgress(_)) => {
            bump(&env.c.refused);
            Ok(())
        }
        Err(e) => Err(format!(
            "{what} in a borrower's capture: {e} (expected CaptureInProgress)"
        )),
        Ok(_) => Err(format!(
            "{what} in a borrower's capture was accepted (its graph would not keep the buffers)"
        )),
    }
}

fn all_eq<T: PartialEq + Copy + std::fmt::Debug>(what: &str, v: &[T], want: T) -> R<()> {
    match v.iter().position(|&e| e != want) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} is {:?}, expected {want:?}",
            v[i]
        )),
    }
}

struct Worker {
    env: Arc<Env>,
    /// This worker's index in `env.phases`.
    id: usize,
    rng: Rng,
    /// A context of this thread for the leaks that keep a context (or a stream of a capped key)
    /// for ever: forgotten futures and owners, leaked loans and captures. Never torn down.
    leaky: Context,
    /// Keys of `leaky` already starved by a forgotten waiting `OwnerReady`.
    starved: Vec<(i32, u32)>,
    /// Host functions not waited for yet: each sends once it has run.
    host_fns: Vec<mpsc::Receiver<()>>,
    /// Gate words for streams of `leaky` (its own simulation's, on the sim).
    leaky_gates: Arc<GateWords>,
}

impl Worker {
    fn ctx(&self) -> &Context {
        &self.env.ctx
    }

    /// Records the operation this worker runs next (`op`), or the step within it (`step`), for
    /// the watchdog.
    fn phase(&self, op: Option<&'static str>, step: &'static str) {
        if let Some(op) = op {
            self.env.phases[self.id]
                .lock()
                .unwrap_or_else(|e| e.into_inner())[0] = op;
        }
        set_step(step);
    }

    fn step(&self, step: &'static str) {
        set_step(step);
    }

    /// An owner holding its stream of the shared context, taken blocking or through its future
    /// (both wait at the cap).
    fn acquire(&mut self, flags: u32) -> R<Owner> {
        let o = Owner::with_flags(self.ctx(), flags);
        let o = if self.rng.pct(50) {
            self.step(if flags == stream_flags::DEFAULT {
                "acquire DEFAULT (blocking)"
            } else {
                "acquire NON_BLOCKING (blocking)"
            });
            o.stream().at("Owner::stream")?;
            o
        } else {
            self.step(if flags == stream_flags::DEFAULT {
                "acquire DEFAULT (OwnerReady)"
            } else {
                "acquire NON_BLOCKING (OwnerReady)"
            });
            let w = Dropping::new(&self.env, None);
            block_on(o.ready(), &w, "an OwnerReady")?.at("OwnerReady")?
        };
        self.step("acquired");
        Ok(o)
    }

    fn run(&mut self, iters: usize) -> R<()> {
        // Every leaky context is leaked for sure: a forgotten completion keeps it.
        self.leak_completion()?;
        for i in 0..iters {
            let op = self.rng.below(100);
            let name = match op {
                0..=24 => "buffers",
                25..=49 => "loan",
                50..=59 => "capture",
                60..=79 => "wakers",
                80..=91 => "host_fns",
                _ => "leak_futures",
            };
            self.phase(Some(name), "start");
            let r = match op {
                0..=24 => self.buffers(),
                25..=49 => self.loan(),
                50..=59 => self.capture(),
                60..=79 => self.wakers(),
                80..=91 => self.host_fns(),
                _ => self.leak_futures(),
            };
            self.step("done");
            r.map_err(|e| format!("iteration {i} (op {op}): {e}"))?;
            bump(&self.env.c.ops);
        }
        // (No `Context::synchronize` instead: it fails while any stream of the CUDA context is
        // capturing, and the leaked captures never end.)
        self.phase(Some("end"), "waiting for host functions");
        for rx in self.host_fns.drain(..) {
            {
                set_step("waiting for a host function");
                rx.recv_timeout(HANG)
            }
            .map_err(|_| "hang: a host function never ran".to_string())?;
        }
        Ok(())
    }

    /// Buffers, kernels and copies on an owner's two streams; a leaked buffer use.
    fn buffers(&mut self) -> R<()> {
        let env = self.env.clone();
        let (k, n) = (&env.k, env.n);
        let o = self.acquire(stream_flags::NON_BLOCKING)?;
        let s = o.stream().at("stream")?;
        let x = DeviceBuffer::<f32>::zeroed(&s, n).at("zeroed")?;
        let mut adds = 1 + self.rng.below(3) as usize;
        for _ in 0..adds {
            k.add_one(&s, &x).at("add_one")?;
        }
        if self.rng.pct(50) {
            // The owner's stream of another priority: never waits (it holds a stream), ordered
            // after the buffer's use on the first.
            o.with_priority(Priority::High, || -> R<()> {
                let h = o.stream().at("high stream")?;
                k.add_one(&h, &x).at("add_one (high)")
            })
            .at("with_priority")??;
            adds += 1;
        }
        let host: Vec<u32> = (0..n as u32).collect();
        let mut y = DeviceBuffer::<u32>::from_slice(&s, &host).at("from_slice")?;
        k.add_u32(&s, &y, 3).at("add_u32")?;
        if self.rng.pct(30) {
            all_eq("x after add_one", &x.to_vec(&s).at("to_vec")?, adds as f32)?;
            let v = y.to_vec(&s).at("to_vec")?;
            ensure!(
                v.iter().enumerate().all(|(i, &e)| e == i as u32 + 3),
                "y after add_u32 is wrong"
            );
            bump(&env.c.checks);
        }
        if self.rng.pct(30) {
            // A leaked use: its work (a memset through the raw pointer) must still come before
            // the free, and a buffer allocated after the free must not see it.
            let u = y.use_on(&s).at("use_on")?;
            // SAFETY: `u` keeps the allocation (n words) in use on `s`, which its owner holds;
            // the use is recorded, so the free is ordered after this memset even though the
            // guard is forgotten.
            unsafe {
                env.ctx
                    .driver()
                    .memset_d32_async(u.ptr(), 0xdead_beef, n, s.raw())
                    .at("memset_d32_async")?
            };
            std::mem::forget(u);
            bump(&env.c.leaked);
            // What the leak costs: this thread's later uses of the buffer are refused.
            ensure!(
                y.fill(&s, 1).is_err(),
                "a buffer whose use was leaked on this thread was used again"
            );
            drop(y);
            o.with_priority(Priority::High, || -> R<()> {
                let h = o.stream().at("high stream")?;
                let mut z = DeviceBuffer::<u32>::alloc(&h, n).at("alloc")?;
                z.fill(&h, 7).at("fill")?;
                all_eq(
                    "a buffer allocated after a leaked use's free",
                    &z.to_vec(&h).at("to_vec")?,
                    7,
                )
            })
            .at("with_priority")??;
            bump(&env.c.checks);
        } else {
            y.fill(&s, 5).at("fill")?;
        }
        Ok(())
    }

    /// A stream lent to the borrower (cudarc on the real driver), its work on it, sometimes
    /// its capture of it; sometimes a leaked loan.
    fn loan(&mut self) -> R<()> {
        let o = self.acquire(stream_flags::NON_BLOCKING)?;
        let capture = self.rng.pct(35);
        let keep_past_owner = self.rng.pct(40);
        #[cfg(feature = "cudarc")]
        if let Some(c) = &self.env.clone().cudarc {
            self.loan_cudarc(c, o, capture, keep_past_owner)?;
            if self.rng.pct(8) {
                self.leak_cudarc_use(c)?;
            }
            return Ok(());
        }
        self.loan_raw(o, capture, keep_past_owner)?;
        if self.rng.pct(8) {
            self.leak_raw_loan()?;
        }
        Ok(())
    }

    /// The crate's calls that the borrower's capture of `s` must refuse (`x` was last used on
    /// `s` before the capture).
    fn try_crate_work_in_borrowers_capture(
        &self,
        s: &StreamRef<'_>,
        x: &mut DeviceBuffer<f32>,
    ) -> R<()> {
        let env = &*self.env;
        refused("a memset", x.fill(s, 9.0), env)?;
        refused("a kernel", env.k.add_one(s, x), env)?;
        refused("a copy to the host", x.to_vec(s), env)?;
        refused("a buffer use", x.use_on(s).map(|_| ()), env)?;
        refused("a completion", s.completed().map(|_| ()), env)?;
        refused("a host function", s.launch_host_func(|| {}), env)?;
        Ok(())
    }

    #[cfg(feature = "cudarc")]
    fn loan_cudarc(&mut self, c: &Cudarc, o: Owner, capture: bool, keep: bool) -> R<()> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
        let env = self.env.clone();
        let n = env.n;
        let n32 = n as u32;
        let cfg = LaunchConfig {
            grid_dim: (n32.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let s = o.stream().at("stream")?;
        let mut x = DeviceBuffer::<f32>::zeroed(&s, n).at("zeroed")?;
        let cs = s.cudarc_stream().at("cudarc_stream")?;
        bump(&env.c.loans);
        // cudarc's own work on the lent stream: a = 1 (copy), b = a + 1 (copy, kernel).
        let ones = vec![1.0f32; n];
        let mut a = cs.alloc_zeros::<f32>(n).at("cudarc alloc_zeros")?;
        cs.memcpy_htod(&ones, &mut a).at("cudarc memcpy_htod")?;
        let mut b = cs.clone_dtod(&a).at("cudarc clone_dtod")?;
        // SAFETY: csp_add_one_f32(float *x, unsigned n) with a slice of n floats.
        unsafe {
            cs.launch_builder(&c.add_one)
                .arg(&mut b)
                .arg(&n32)
                .launch(cfg)
                .at("cudarc launch")?
        };
        cs.memset_zeros(&mut a).at("cudarc memset_zeros")?;
        // A cudarc launch on the crate's buffer: x += 1.
        {
            let u = x.cudarc_use(&s).at("cudarc_use")?;
            let (ptr, _record) = u.device_ptr(&cs);
            // SAFETY: csp_add_one_f32 on the n floats of `x`, in use on this stream while `u`
            // lives, i.e. past this launch.
            unsafe {
                cs.launch_builder(&c.add_one)
                    .arg(&ptr)
                    .arg(&n32)
                    .launch(cfg)
                    .at("cudarc launch on a crate buffer")?
            };
        }
        if capture {
            // The borrower captures the lent stream: a launch on a cudarc allocation (by its
            // address, so that cudarc waits on no event recorded outside the capture), while
            // the crate's work on the stream is refused.
            let g = cs.alloc_zeros::<f32>(n).at("cudarc alloc_zeros")?;
            let gptr = {
                let (p, _record) = g.device_ptr(&cs);
                p
            };
            cs.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .at("cudarc begin_capture")?;
            let tried = self
                .try_crate_work_in_borrowers_capture(&s, &mut x)
                .and_then(|_| refused("a cudarc use", x.cudarc_use(&s).map(|_| ()), &env));
            // SAFETY: csp_add_one_f32 on the n floats of `g`, which outlives the graph's
            // launches (it is dropped after the synchronizing copy below).
            let launched = unsafe {
                cs.launch_builder(&c.add_one)
                    .arg(&gptr)
                    .arg(&n32)
                    .launch(cfg)
            };
            let graph = cs.end_capture(CUgraphInstantiate_flags(0));
            tried?;
            launched.at("cudarc launch in its capture")?;
            let graph = graph
                .at("cudarc end_capture (the crate must leave the capture intact)")?
                .ok_or("cudarc's capture made no graph")?;
            graph.launch().at("cudarc graph launch")?;
            graph.launch().at("cudarc graph launch")?;
            all_eq(
                "the borrower's graph, launched twice",
                &cs.clone_dtoh(&g).at("cudarc clone_dtoh")?,
                2.0,
            )?;
            drop(graph);
            drop(g);
            bump(&env.c.borrower_captures);
            // The stream takes the crate's work again once the capture is over.
            env.k
                .add_one(&s, &x)
                .at("add_one after the borrower's capture")?;
            all_eq("x", &x.to_vec(&s).at("to_vec")?, 2.0)?;
        } else {
            all_eq("x after cudarc's launch", &x.to_vec(&s).at("to_vec")?, 1.0)?;
        }
        bump(&env.c.checks);
        if keep {
            // `b` outlives its owner: its stream stays lent (and out of the pool) until it is
            // dropped.
            drop(x);
            drop(cs);
            drop(s);
            drop(o);
            all_eq(
                "a cudarc slice read after its owner is gone",
                &b.stream().clone_dtoh(&b).at("cudarc clone_dtoh")?,
                2.0,
            )?;
        } else {
            all_eq("b", &cs.clone_dtoh(&b).at("cudarc clone_dtoh")?, 2.0)?;
        }
        drop((a, b));
        Ok(())
    }

    /// A forgotten `CudarcUse` after cudarc's memset through it (on an owned stream of the
    /// leaky context: the leak keeps the stream lent, and so that context, for ever).
    #[cfg(feature = "cudarc")]
    fn leak_cudarc_use(&mut self, _c: &Cudarc) -> R<()> {
        let env = self.env.clone();
        let os = OwnedStream::new(&self.leaky, Priority::Normal).at("OwnedStream::new")?;
        let s = os.stream();
        let x = DeviceBuffer::<u32>::zeroed(&s, env.n).at("zeroed")?;
        let cs = s.cudarc_stream().at("cudarc_stream")?;
        let mut u = x.cudarc_use(&s).at("cudarc_use")?;
        cs.memset_zeros(&mut u).at("cudarc memset_zeros")?;
        std::mem::forget(u);
        bump(&env.c.leaked);
        bump(&env.c.loans);
        drop(cs);
        drop(x); // freed after the memset, on the stream that stays lent
        drop(s);
        drop(os);
        Ok(())
    }

    /// The generic loan, the borrower driving the stream through raw driver calls (the
    /// simulation has no cudarc).
    fn loan_raw(&mut self, o: Owner, capture: bool, keep: bool) -> R<()> {
        let env = self.env.clone();
        let d = &env.drv;
        let s = o.stream().at("stream")?;
        let mut x = DeviceBuffer::<f32>::zeroed(&s, env.n).at("zeroed")?;
        let h = s
            .lend(|raw| Ok(Arc::new(Foreign(raw))))
            .at("StreamRef::lend")?;
        bump(&env.c.loans);
        if let Some(sim) = &env.sim {
            // The borrower's own GPU work on the lent stream.
            sim.enqueue_work(h.0, 0).at("enqueue_work")?;
        }
        env.k.add_one(&s, &x).at("add_one on a lent stream")?;
        if capture {
            // SAFETY: the loan keeps the stream alive; the capture is ended below on this
            // thread whatever happens in between.
            unsafe { d.stream_begin_capture(h.0, CaptureMode::ThreadLocal) }
                .at("the borrower's begin_capture")?;
            let tried = self.try_crate_work_in_borrowers_capture(&s, &mut x);
            // SAFETY: as above.
            let graph = unsafe { d.stream_end_capture(h.0) };
            tried?;
            let graph = graph.at("the borrower's end_capture (the crate must leave it intact)")?;
            // The borrower's raw calls, with the context current, relaxed (instantiation and
            // synchronization could otherwise invalidate another thread's capture).
            env.ctx.bind().at("bind")?;
            let _relaxed = CaptureModeGuard::relaxed(&**d).at("relaxed")?;
            // SAFETY: `graph` was just made by the end of the capture; the exec is made,
            // launched, waited for and destroyed here, on the live lent stream.
            unsafe {
                let e = d.graph_instantiate(graph).at("graph_instantiate")?;
                d.graph_launch(e, h.0).at("graph_launch")?;
                d.graph_launch(e, h.0).at("graph_launch")?;
                d.stream_synchronize(h.0).at("stream_synchronize")?;
                d.graph_exec_destroy(e).at("graph_exec_destroy")?;
                d.graph_destroy(graph).at("graph_destroy")?;
            }
            bump(&env.c.borrower_captures);
        }
        env.k.add_one(&s, &x).at("add_one after the loan's work")?;
        all_eq("x on a lent stream", &x.to_vec(&s).at("to_vec")?, 2.0)?;
        bump(&env.c.checks);
        if keep {
            // The handle outlives the owner: the stream stays lent until it is dropped.
            drop(x);
            drop(s);
            drop(o);
            if let Some(sim) = &env.sim {
                sim.enqueue_work(h.0, 0).at("enqueue_work")?;
            }
        }
        drop(h);
        Ok(())
    }

    /// A loan that never ends and a use forgotten on its stream (an owned stream of the leaky
    /// context).
    fn leak_raw_loan(&mut self) -> R<()> {
        let env = self.env.clone();
        let os = OwnedStream::new(&self.leaky, Priority::Normal).at("OwnedStream::new")?;
        let s = os.stream();
        let x = DeviceBuffer::<u32>::zeroed(&s, env.n).at("zeroed")?;
        let h = s
            .lend(|raw| Ok(Arc::new(Foreign(raw))))
            .at("StreamRef::lend")?;
        let u = x.use_on(&s).at("use_on")?;
        // SAFETY: `u` keeps the allocation (n words) in use on the owned stream, alive.
        unsafe {
            self.leaky
                .driver()
                .memset_d32_async(u.ptr(), 1, env.n, s.raw())
                .at("memset_d32_async")?
        };
        std::mem::forget(u);
        std::mem::forget(h);
        bump(&env.c.leaked);
        bump(&env.c.leaked);
        bump(&env.c.loans);
        drop(x);
        drop(s);
        drop(os);
        Ok(())
    }

    /// The crate's capture: a graph launched after its buffers are dropped; sometimes a leaked
    /// capture guard (on the leaky context).
    fn capture(&mut self) -> R<()> {
        let env = self.env.clone();
        let (k, n) = (&env.k, env.n);
        let o = self.acquire(stream_flags::NON_BLOCKING)?;
        let s = o.stream().at("stream")?;
        let y = DeviceBuffer::<f32>::zeroed(&s, n).at("zeroed")?;
        let kept = DeviceBuffer::<f32>::zeroed(&s, n).at("zeroed")?;
        let g = s.begin_capture().at("begin_capture")?;
        k.add_one(&s, &y).at("add_one in a capture")?;
        k.add_one(&s, &kept).at("add_one in a capture")?;
        ensure!(
            DeviceBuffer::<f32>::alloc(&s, 4).is_err(),
            "an allocation in a capture was accepted"
        );
        ensure!(
            s.completed().is_err(),
            "a completion in a capture was accepted"
        );
        let exec = g.end().at("end")?.instantiate().at("instantiate")?;
        drop(y); // the graph keeps it
        let launches = 1 + self.rng.below(3);
        for _ in 0..launches {
            exec.launch(&s).at("graph launch")?;
        }
        all_eq(
            "a buffer of a graph launched",
            &kept.to_vec(&s).at("to_vec")?,
            launches as f32,
        )?;
        bump(&env.c.checks);
        drop(kept);
        exec.launch(&s)
            .at("graph launch after its buffers were dropped")?;
        drop(exec);
        bump(&env.c.captures);
        if self.rng.pct(15) {
            // A forgotten capture guard (relaxed, so that the thread's later calls are not
            // restricted by a capture that never ends): the stream stays captured for ever, the
            // buffer filled in it is never freed.
            let os = OwnedStream::new(&self.leaky, Priority::Normal).at("OwnedStream::new")?;
            let s = os.stream();
            let mut z = DeviceBuffer::<u32>::zeroed(&s, 64).at("zeroed")?;
            let g = s
                .begin_capture_with(CaptureMode::Relaxed)
                .at("begin_capture_with")?;
            z.fill(&s, 3).at("fill in a capture")?;
            std::mem::forget(g);
            bump(&env.c.leaked);
            drop(z);
            bump(&env.c.leaked_allocs);
            drop(s);
            drop(os);
        }
        Ok(())
    }

    /// Wakers that drop an owner, a buffer, a context clone, or the last clone of a context.
    fn wakers(&mut self) -> R<()> {
        let env = self.env.clone();
        match self.rng.below(4) {
            0 | 1 => {
                // An acquisition at the cap whose waker holds an owner (of another key) or a
                // buffer: dropped when the gate wakes it, or when the gate drops the waker.
                let payload = if self.rng.pct(50) {
                    let p = self.acquire(stream_flags::DEFAULT)?;
                    Payload::Owner(p)
                } else {
                    let p = self.acquire(stream_flags::DEFAULT)?;
                    let s = p.stream().at("stream")?;
                    let b = DeviceBuffer::<f32>::zeroed(&s, env.n).at("zeroed")?;
                    env.k.add_one(&s, &b).at("add_one")?;
                    drop(s);
                    drop(p);
                    Payload::Buffer(b)
                };
                let w = Dropping::new(&env, Some(payload));
                let o = block_on(
                    Owner::new(self.ctx()).ready(),
                    &w,
                    "an OwnerReady with a dropping waker",
                )?
                .at("OwnerReady")?;
                drop(w);
                let s = o.stream().at("stream")?;
                let x = DeviceBuffer::<f32>::zeroed(&s, 16).at("zeroed")?;
                env.k.add_one(&s, &x).at("add_one")?;
            }
            2 => {
                // A completion whose waker (run by the poller) drops an owner, a buffer and a
                // context clone.
                // Keys in one order (DEFAULT, then NON_BLOCKING) whenever one is held while the
                // other is acquired: waits at the caps cannot form a cycle.
                let other = self.acquire(stream_flags::DEFAULT)?;
                let o = self.acquire(stream_flags::NON_BLOCKING)?;
                let s = o.stream().at("stream")?;
                let b = DeviceBuffer::<f32>::zeroed(&s, env.n).at("zeroed")?;
                env.k.add_one(&s, &b).at("add_one")?;
                let gate = Gate::on(&env.gates, &s, || {})?;
                let mut done = Box::pin(s.completed().at("completed")?);
                let w = Dropping::new(&env, Some(Payload::Owner(other)));
                let extra = Dropping::new(&env, Some(Payload::Buffer(b)));
                let ctxw = Dropping::new(&env, Some(Payload::Context(env.ctx.clone())));
                gate.pending(
                    poll_once(done.as_mut(), &extra),
                    "a completion behind a closed gate was ready",
                )?;
                // The crate holds the only clone of `extra` now; it drops it (and the buffer)
                // when a poll replaces it by `ctxw`, whose context clone the poller drops.
                drop(extra);
                gate.pending(poll_once(done.as_mut(), &ctxw), "ready early")?;
                drop(ctxw);
                let mut done2 = Box::pin(s.completed().at("completed")?);
                gate.pending(poll_once(done2.as_mut(), &w), "ready early")?;
                drop(gate);
                block_on(done.as_mut(), &w, "a completion")?.at("completion")?;
                block_on(done2.as_mut(), &w, "a completion")?.at("completion")?;
            }
            _ => {
                if self.rng.pct(30) {
                    self.last_context_from_poller()?;
                } else {
                    // An unpolled completion of the shared context, dropped.
                    let o = self.acquire(stream_flags::NON_BLOCKING)?;
                    let s = o.stream().at("stream")?;
                    drop(s.completed().at("completed")?);
                }
            }
        }
        Ok(())
    }

    /// The last clone of a context dropped by a waker that the completion poller runs: its
    /// teardown is handed to a thread where it can complete.
    fn last_context_from_poller(&mut self) -> R<()> {
        let env = self.env.clone();
        let t = env.new_context(env.opts)?;
        let o = t.owner();
        let s = o.stream().at("stream")?;
        let b = DeviceBuffer::<f32>::zeroed(&s, env.n).at("zeroed")?;
        let gate = Gate::on(&env.gates, &s, || {})?;
        let mut done = Box::pin(s.completed().at("completed")?);
        let second = s.completed().at("completed")?;
        let w = Dropping::new(&env, None);
        let first = poll_once(done.as_mut(), &w);
        let ready = first.is_ready();
        gate.pending(first, "a completion behind a closed gate was ready")?;
        drop(done); // the hub keeps the waker
        drop(second);
        drop(b);
        drop(s);
        drop(o);
        if ready {
            // Without gates (`--no-gates`) the work may be done already: no waker was kept.
            drop(t);
            drop(gate);
            return Ok(());
        }
        *w.payload.lock().unwrap_or_else(|e| e.into_inner()) = Some(Payload::LastContext(t));
        drop(gate);
        w.wait("a completion's waker holding the last context")?;
        Ok(())
    }

    /// Host functions that drop an owner, a buffer, a context clone, or the last clone of a
    /// context (their driver calls are refused or deferred; the teardown goes elsewhere).
    fn host_fns(&mut self) -> R<()> {
        let env = self.env.clone();
        let kind = self.rng.below(4);
        if kind == 3 {
            return self.last_context_from_host_fn();
        }
        // The DEFAULT key before the NON_BLOCKING one (see `wakers`).
        let other = if kind == 2 {
            Some(self.acquire(stream_flags::DEFAULT)?)
        } else {
            None
        };
        let o = self.acquire(stream_flags::NON_BLOCKING)?;
        let s = o.stream().at("stream")?;
        let b = DeviceBuffer::<f32>::zeroed(&s, env.n).at("zeroed")?;
        env.k.add_one(&s, &b).at("add_one")?;
        let (tx, rx) = mpsc::channel::<()>();
        let payload = match (kind, other) {
            (0, _) => Payload::Context(env.ctx.clone()),
            (_, Some(p)) => Payload::Owner(p),
            _ => Payload::Buffer(b),
        };
        let e = env.c.clone();
        s.launch_host_func(move || {
            drop(payload);
            bump(&e.host_fn_drops);
            let _ = tx.send(());
        })
        .at("launch_host_func")?;
        if self.rng.pct(50) {
            {
                set_step("waiting for a host function");
                rx.recv_timeout(HANG)
            }
            .map_err(|_| "hang: a host function never ran".to_string())?;
        } else {
            self.host_fns.push(rx);
        }
        Ok(())
    }

    fn last_context_from_host_fn(&mut self) -> R<()> {
        let env = self.env.clone();
        let t = env.new_context(env.opts)?;
        let o = t.owner();
        let s = o.stream().at("stream")?;
        let b = DeviceBuffer::<f32>::zeroed(&s, env.n).at("zeroed")?;
        let (tx, rx) = mpsc::channel::<()>();
        let e = env.c.clone();
        let tc = t.clone();
        let gate = Gate::on(&env.gates, &s, move || {
            drop(tc);
            bump(&e.host_fn_drops);
            bump(&e.last_ctx_drops);
            let _ = tx.send(());
        })?;
        drop(b);
        drop(s);
        drop(o);
        drop(t);
        drop(gate);
        {
            set_step("waiting for a host function");
            rx.recv_timeout(HANG)
        }
        .map_err(|_| "hang: a host function never ran".to_string())?;
        Ok(())
    }

    /// Forgotten futures and owners (on the leaky context: each keeps it alive).
    fn leak_futures(&mut self) -> R<()> {
        match self.rng.below(4) {
            0 => {
                // Never polled.
                std::mem::forget(Owner::new(&self.leaky).ready());
                bump(&self.env.c.leaked);
            }
            1 => self.leak_completion()?,
            2 => {
                // An owner holding a stream, forgotten: its key of the leaky context keeps one
                // stream fewer for ever (each key is used for one such leak at most).
                if let Some((p, f)) = self.fresh_leaky_key() {
                    let o = Owner::with_flags(&self.leaky, f);
                    o.set_priority(Priority::Value(p)).at("set_priority")?;
                    o.stream().at("stream")?;
                    std::mem::forget(o);
                    bump(&self.env.c.leaked);
                }
            }
            _ => self.leak_waiting_owner_ready()?,
        }
        Ok(())
    }

    /// A key of the leaky context that no leak has used yet (but the key of
    /// [`Worker::leak_completion`], which must never wait), marked used.
    fn fresh_leaky_key(&mut self) -> Option<(i32, u32)> {
        let range = self.leaky.priority_range();
        let normal = range.resolve(Priority::Normal).ok()?;
        let mut keys = Vec::new();
        for p in range.greatest..=range.least {
            for f in [stream_flags::NON_BLOCKING, stream_flags::DEFAULT] {
                if (p, f) != (normal, stream_flags::NON_BLOCKING) && !self.starved.contains(&(p, f))
                {
                    keys.push((p, f));
                }
            }
        }
        if keys.is_empty() {
            return None;
        }
        let key = keys[self.rng.below(keys.len() as u64) as usize];
        self.starved.push(key);
        Some(key)
    }

    /// A completion polled once (its waker registered), then forgotten.
    fn leak_completion(&mut self) -> R<()> {
        let o = self.leaky.owner();
        let s = o.stream().at("stream")?;
        let gate = Gate::on(&self.leaky_gates, &s, || {})?;
        let mut c = Box::pin(s.completed().at("completed")?);
        let w = Dropping::new(&self.env, None);
        gate.pending(poll_once(c.as_mut(), &w), "ready early")?;
        std::mem::forget(c);
        bump(&self.env.c.leaked);
        drop(gate);
        Ok(())
    }

    /// An `OwnerReady` forgotten while it waits at the cap of a key of the leaky context (that
    /// key keeps one stream fewer for ever; each key is starved at most once).
    fn leak_waiting_owner_ready(&mut self) -> R<()> {
        let Some((p, f)) = self.fresh_leaky_key() else {
            return Ok(());
        };
        let cap = self.env.opts.max_live_streams_per_key.unwrap_or(1);
        // Only this thread uses the leaky context: these never wait.
        let holders: Vec<Owner> = (0..cap)
            .map(|_| {
                let h = Owner::with_flags(&self.leaky, f);
                h.set_priority(Priority::Value(p))?;
                h.stream()?;
                Ok(h)
            })
            .collect::<cuda_stream_pool::Result<_>>()
            .at("holders of a key of the leaky context")?;
        let waiter = Owner::with_flags(&self.leaky, f);
        waiter.set_priority(Priority::Value(p)).at("set_priority")?;
        let mut fut = Box::pin(waiter.ready());
        let w = Dropping::new(&self.env, None);
        ensure!(
            poll_once(fut.as_mut(), &w).is_pending(),
            "an acquisition beyond the cap did not wait"
        );
        std::mem::forget(fut);
        bump(&self.env.c.leaked);
        drop(holders); // the first stream back is handed to the forgotten waiter
        Ok(())
    }
}

/// Runs the stress and checks what is left. The summary on success.
pub fn run(cfg: &Config) -> R<Summary> {
    let opts = ContextOptions::default().max_live_streams_per_key(Some(cfg.cap));
    let sim = if cfg.sim {
        Some(Arc::new(SimDriver::new()))
    } else {
        None
    };
    #[cfg(feature = "cudarc")]
    let (drv, ctx, cudarc) = match &sim {
        Some(s) => {
            let d: Arc<dyn Driver> = s.clone();
            let ctx = Context::primary_with(d.clone(), 0, opts).at("Context::primary_with")?;
            (d, ctx, None)
        }
        // cudarc panics when it cannot load libcuda: the crate's loader asks first.
        None => match driver::load(driver::Choice::Cuda)
            .map_err(|e| e.to_string())
            .and_then(|_| cudarc::driver::CudaContext::new(0).map_err(|e| e.to_string()))
        {
            Ok(cu) => {
                let ctx = Context::from_cudarc_with(&cu, opts).at("Context::from_cudarc_with")?;
                let src = cuda_stream_pool::kernels::PTX.trim_end_matches('\0');
                let module = cu
                    .load_module(cudarc::nvrtc::Ptx::from_src(src))
                    .at("cudarc load_module")?;
                let add_one = module
                    .load_function("csp_add_one_f32")
                    .at("cudarc load_function")?;
                (ctx.driver().clone(), ctx, Some(Cudarc { cu, add_one }))
            }
            Err(e) if cfg.gpu => return Err(format!("no GPU through cudarc: {e}")),
            Err(e) => {
                eprintln!("sanitizer_stress: no GPU through cudarc ({e}): the simulated driver");
                return run(&Config {
                    sim: true,
                    ..cfg.clone()
                });
            }
        },
    };
    #[cfg(not(feature = "cudarc"))]
    let (drv, ctx) = {
        let d: Arc<dyn Driver> = match &sim {
            Some(s) => s.clone(),
            None => match driver::load(driver::Choice::Cuda) {
                Ok((d, _)) => d,
                Err(e) if cfg.gpu => return Err(format!("no CUDA driver: {e}")),
                Err(e) => {
                    eprintln!("sanitizer_stress: no CUDA driver ({e}): the simulated driver");
                    return run(&Config {
                        sim: true,
                        ..cfg.clone()
                    });
                }
            },
        };
        let ctx = Context::primary_with(d.clone(), 0, opts).at("Context::primary_with")?;
        (d, ctx)
    };
    if let Some(s) = &sim {
        s.set_logging(false);
    }
    let real = sim.is_none();
    let iters = cfg.iters.unwrap_or(if real { 150 } else { 200 });
    if real {
        prewarm(&ctx, cfg.prewarm)?;
    }
    let k = Kernels::load(&ctx).at("Kernels::load")?;
    let gates = GateWords::new(&ctx, cfg.gates)?;
    let env = Arc::new(Env {
        drv: drv.clone(),
        sim: sim.clone(),
        leak_sim: sim.as_ref().map(|_| {
            let s = Arc::new(SimDriver::new());
            s.set_logging(false);
            s
        }),
        ctx,
        k,
        #[cfg(feature = "cudarc")]
        cudarc,
        opts,
        n: if real { 1 << 14 } else { 1024 },
        c: Arc::default(),
        gates,
        phases: (0..cfg.threads).map(|_| Phase::default()).collect(),
    });
    println!(
        "sanitizer_stress on the {} driver: {} threads x {iters} iterations, cap {} streams per key",
        drv.kind(),
        cfg.threads,
        cfg.cap
    );
    // The simulation moves a stream past a finished host function only at its next driver
    // call (a GPU needs no call): a thread waiting at a cap for a stream behind a host function
    // (the pool's notification is one) would wait for ever once every other thread waits too.
    // This thread plays the GPU's part.
    let stop = Arc::new(AtomicBool::new(false));
    let ticker = [env.sim.clone(), env.leak_sim.clone()]
        .into_iter()
        .flatten()
        .map(|sim| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    sim.advance(0);
                    std::thread::sleep(Duration::from_micros(100));
                }
            })
        })
        .collect::<Vec<_>>();
    let t0 = Instant::now();
    // Every worker makes its leaky context before any closes a gate: creates stall while a
    // gate holds a stream (see `prewarm`), and under compute-sanitizer the prewarmed streams
    // did not prevent it (one run: the workers' first contexts' creates stalled).
    let start = Arc::new(std::sync::Barrier::new(cfg.threads));
    let handles: Vec<_> = (0..cfg.threads)
        .map(|t| {
            let env = env.clone();
            let start = start.clone();
            let gated = cfg.gates;
            // splitmix64 of (seed, thread): distinct, non-zero xorshift states.
            let mut z = cfg
                .seed
                .wrapping_mul(0x1_0000_0001)
                .wrapping_add(t as u64 + 1)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let seed = (z ^ (z >> 31)) | 1;
            std::thread::spawn(move || -> R<()> {
                PHASE.with(|p| *p.borrow_mut() = Some(env.phases[t].clone()));
                let leaky = env.new_leaky_context();
                start.wait();
                let leaky = leaky?;
                let leaky_gates = match &env.leak_sim {
                    Some(_) => GateWords::new(&leaky, gated)?,
                    None => env.gates.clone(),
                };
                let mut w = Worker {
                    leaky_gates,
                    id: t,
                    env,
                    rng: Rng(seed),
                    leaky,
                    starved: Vec::new(),
                    host_fns: Vec::new(),
                };
                w.run(iters).map_err(|e| format!("thread {t}: {e}"))
            })
        })
        .collect();
    // A run that stops making progress prints what every worker does, and ends.
    let mut last = (Instant::now(), u64::MAX);
    while !handles.iter().all(|h| h.is_finished()) {
        std::thread::sleep(Duration::from_millis(100));
        let ops = env.c.ops.load(Ordering::Relaxed);
        if ops != last.1 {
            last = (Instant::now(), ops);
        } else if cfg.watchdog_s > 0 && last.0.elapsed() > Duration::from_secs(cfg.watchdog_s) {
            eprintln!(
                "sanitizer_stress: no progress for {} s after {ops} operations; the workers:",
                cfg.watchdog_s
            );
            for (t, (p, h)) in env.phases.iter().zip(&handles).enumerate() {
                let p = *p.lock().unwrap_or_else(|e| e.into_inner());
                let fin = if h.is_finished() { " (finished)" } else { "" };
                eprintln!(
                    "  thread {t}{fin}: in {}, last call or wait: {}",
                    p[0], p[1]
                );
            }
            eprintln!("  shared context: {:?}", env.ctx.stats());
            for f in [stream_flags::NON_BLOCKING, stream_flags::DEFAULT] {
                for p in [Priority::Normal, Priority::High] {
                    if let Ok(ks) = env.ctx.stats_for_key(p, f) {
                        eprintln!("  key ({p:?}, {f}): {ks:?}");
                    }
                }
            }
            eprintln!("  pending frees/destroys: {}", env.ctx.pending());
            if std::env::var_os("CSP_STRESS_STACKS").is_some() {
                dump_stacks();
            }
            // Time for a debugger to attach (`CSP_STRESS_HOLD=SECS`).
            if let Some(hold) = std::env::var("CSP_STRESS_HOLD")
                .ok()
                .and_then(|v| v.parse().ok())
            {
                std::thread::sleep(Duration::from_secs(hold));
            }
            std::process::exit(3);
        }
    }
    let mut errors = Vec::new();
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("a thread panicked".into()),
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Release);
    for t in ticker {
        let _ = t.join();
    }
    if !errors.is_empty() {
        return Err(errors.join("\n"));
    }
    let env = Arc::try_unwrap(env).map_err(|_| "the environment is still shared".to_string())?;
    let c = &env.c;
    let ctx = &env.ctx;
    // Wakers run by the completion poller (and the payloads they drop) may still be on their
    // way: wait for them (a hang guard).
    let t = Instant::now();
    let st = loop {
        ctx.trim().at("trim")?;
        let st = ctx.stats();
        if st.in_use == 0 && st.lent == 0 && st.handed == 0 {
            break st;
        }
        ensure!(
            t.elapsed() < HANG,
            "streams not back after every owner and loan ended: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    if t.elapsed() > Duration::from_millis(100) {
        eprintln!(
            "sanitizer_stress: the last streams came back {:.3} s after the threads ended",
            t.elapsed().as_secs_f64()
        );
    }
    ensure!(
        st.live == st.idle + st.retired_busy,
        "the pool's counters disagree with its lists: {st:?}"
    );
    ensure!(
        ctx.pending() == 0,
        "{} frees or destroys still pending on the shared context",
        ctx.pending()
    );
    for (p, f) in [
        (Priority::Normal, stream_flags::NON_BLOCKING),
        (Priority::Normal, stream_flags::DEFAULT),
    ] {
        let ks = ctx.stats_for_key(p, f).at("stats_for_key")?;
        ensure!(
            ks.peak_live <= cfg.cap as u64 + ks.over_cap,
            "key ({p:?}, {f}): {} streams alive at once over a cap of {}: {ks:?}",
            ks.peak_live,
            cfg.cap
        );
    }
    let mut s = Summary {
        driver: drv.kind().to_string(),
        ops: c.ops.load(Ordering::Relaxed),
        leaked: c.leaked.load(Ordering::Relaxed),
        loans: c.loans.load(Ordering::Relaxed),
        borrower_captures: c.borrower_captures.load(Ordering::Relaxed),
        refused: c.refused.load(Ordering::Relaxed),
        captures: c.captures.load(Ordering::Relaxed),
        waker_drops: c.waker_drops.load(Ordering::Relaxed),
        host_fn_drops: c.host_fn_drops.load(Ordering::Relaxed),
        last_ctx_drops: c.last_ctx_drops.load(Ordering::Relaxed),
        cap_waits: st.waits,
        checks: c.checks.load(Ordering::Relaxed),
        secs,
        leaked_allocs: 0,
        threads: cfg.threads,
    };
    let leaked_allocs = c.leaked_allocs.load(Ordering::Relaxed);
    s.leaked_allocs = leaked_allocs;
    let Env {
        drv,
        ctx,
        k,
        leak_sim,
        gates,
        ..
    } = env;
    // Every gate has opened (every thread has ended) and the shared context's streams have
    // passed their waits (nothing is in use, all idle or destroyed above).
    gates.free()?;
    drop(k);
    drop(ctx);
    if sim.is_none() {
        // The page-locked memory that the teardowns of the shared context and the short-lived
        // ones kept for later states (see `release_pinned_cache`): freed, so that memcheck's
        // leak report lists only what the leaks keep.
        cuda_stream_pool::release_pinned_cache(&*drv).at("release_pinned_cache")?;
    }
    if let (Some(sim), Some(leak_sim)) = (&sim, &leak_sim) {
        // Nothing of the shared context nor of the short-lived ones is left (some teardowns
        // run on a thread of their own, or at a later call: wait for them).
        let t = Instant::now();
        loop {
            // The page-locked memory that the teardowns kept for later states of the context
            // (they never free it: see `release_pinned_cache`).
            cuda_stream_pool::release_pinned_cache(&**sim).at("release_pinned_cache")?;
            let cn = sim.counters();
            let left = (
                cn.live_contexts,
                cn.live_streams,
                cn.live_allocs,
                cn.live_events,
                cn.live_host_allocs,
                cn.live_modules,
                cn.live_graphs,
                cn.live_graph_execs,
            );
            if left == (0, 0, 0, 0, 0, 0, 0, 0) {
                break;
            }
            ensure!(
                t.elapsed() < HANG,
                "left after every handle is gone (contexts, streams, allocations, events, host \
                 allocations, modules, graphs, execs): {left:?}; {cn:?}"
            );
            // Teardowns that wait for ended loans complete at a later call of the crate.
            let isolated = ContextOptions::default().isolated(true);
            drop(Context::primary_with(sim.clone(), 0, isolated).at("Context::primary_with")?);
            std::thread::sleep(Duration::from_millis(1));
        }
        // The leaky contexts' simulation: only the allocations filled in leaked captures are
        // still allocated (the rest was freed, after its work).
        let cn = leak_sim.counters();
        ensure!(
            cn.live_allocs == leaked_allocs,
            "{} allocations alive in the leaky contexts, {leaked_allocs} kept by leaked captures: \
             {cn:?}",
            cn.live_allocs
        );
        for (name, d) in [("shared", sim), ("leaky", leak_sim)] {
            let m = d.misuse();
            ensure!(m.is_empty(), "the {name} simulation found misuse: {m:#?}");
            let w = d.device_waits();
            ensure!(
                w.is_empty(),
                "calls that wait for every stream of the device, made while one was busy ({name}): \
                 {w:#?}"
            );
            let u = d.unrelaxed_calls();
            ensure!(
                u.is_empty(),
                "calls that could invalidate a capture made outside relaxed mode ({name}): {u:#?}"
            );
        }
    }
    s.secs = secs;
    Ok(s)
}

#[allow(dead_code)]
fn main() {
    let cfg = match Config::from_args(std::env::args().skip(1)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    match run(&cfg) {
        Ok(s) => println!("{s}"),
        Err(e) => {
            eprintln!("sanitizer_stress: FAILED\n{e}");
            std::process::exit(1);
        }
    }
}
