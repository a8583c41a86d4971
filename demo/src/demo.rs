//! The seed's two workloads, run with each stream strategy, as a table. "The seed" is CUDA.jl
//! PR #3317 (<https://github.com/JuliaGPU/CUDA.jl/pull/3317>), the stream pool of CUDA.jl that
//! this crate generalises; its workloads are the two below.
//!
//! * `short` (many short owners): each owner allocates 1,024 floats (zeroed), adds one with a
//!   kernel, sums them into a second buffer with another kernel, copies the sum back,
//!   synchronizes, checks that it is 1,024, and ends.
//! * `prodcons` (producer/consumer): each worker thread has a long-lived producer owner. In every
//!   iteration the producer allocates 1,024 floats on its stream and fills them (zero + add one);
//!   a short-lived consumer then uses the buffer on its own stream (ordered after the producer on
//!   the GPU, no CPU wait), adds one, sums, copies the sum back, checks that it is 2,048, frees the
//!   buffer and ends.
//!
//! Strategies for the short-lived owner's stream: `pool` (an explicit owner of this crate per
//! task), `pool-tls` (the worker thread's implicit owner), `floor` (one long-lived stream per
//! worker thread), `fresh` (a new stream per task, destroyed at its end), `deferred` (a new stream
//! per task, destroyed only at the end of the run, as a garbage collector would; stopped after
//! `--deferred-cap` seconds and reported as tasks done in that time), `cudarc` (a cudarc
//! `CudaContext::new_stream` per task, as cudarc users write it; feature `cudarc`, GPU only).
//! [`LEGEND`] says the same to the user, under the table and in `--help`.

use cuda_stream_pool::driver::Choice;
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Error, OwnedStream, Priority, Result, StreamRef};
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The most worker threads a row may ask for.
pub const MAX_THREADS: u64 = 1024;
/// The longest `--deferred-cap`, in seconds (a day).
pub const MAX_DEFERRED_CAP: f64 = 86_400.0;

/// Why the demo stopped early.
#[derive(Debug)]
pub enum Failure {
    /// An error of the crate or the driver.
    Cuda(Error),
    /// Anything else, as one line.
    Message(String),
    /// Standard output was closed (e.g. `| head -1`): not an error, the demo just stops.
    StdoutClosed,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Cuda(e)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Cuda(e) => write!(f, "{e}"),
            Failure::Message(m) => f.write_str(m),
            Failure::StdoutClosed => f.write_str("standard output closed"),
        }
    }
}

/// The demo's result type.
pub type DemoResult<T> = std::result::Result<T, Failure>;

/// Writes one line to standard output; a closed pipe becomes [`Failure::StdoutClosed`].
pub fn out(line: &str) -> DemoResult<()> {
    let mut o = std::io::stdout().lock();
    match writeln!(o, "{line}").and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Failure::StdoutClosed),
        Err(e) => Err(Failure::Message(format!(
            "cannot write to standard output: {e}"
        ))),
    }
}

/// Writes one line to standard error; never fails (a closed standard error loses the line).
pub fn note(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// Locks a mutex even if a thread panicked while holding it (the data are counters and streams
/// to drop, valid in any state).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Joins a row's worker threads; the first error (an earlier one in `first_err`, else a
/// worker's error or panic) is kept there.
pub(crate) fn join_workers<E: Into<Failure>>(
    workers: Vec<std::thread::JoinHandle<std::result::Result<(), E>>>,
    first_err: &mut Option<Failure>,
) {
    for h in workers {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                first_err.get_or_insert(e.into());
            }
            Err(_) => {
                first_err.get_or_insert(Failure::Message("a worker thread panicked".into()));
            }
        }
    }
}

/// `--deferred-cap`: a finite number of seconds in (0, [`MAX_DEFERRED_CAP`]].
fn parse_cap(s: &str) -> std::result::Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    if v.is_finite() && v > 0.0 && v <= MAX_DEFERRED_CAP {
        Ok(v)
    } else {
        Err(format!(
            "must be a number of seconds above 0 and at most {MAX_DEFERRED_CAP}"
        ))
    }
}

/// Spawns a named thread; failure to start one is an error, not a panic.
pub(crate) fn spawn<T: Send + 'static>(
    name: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> DemoResult<std::thread::JoinHandle<T>> {
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(f)
        .map_err(|e| Failure::Message(format!("cannot start thread {name}: {e}")))
}

const STRATEGIES: [&str; 6] = ["pool", "pool-tls", "floor", "fresh", "deferred", "cudarc"];
const WORKLOADS: [&str; 2] = ["short", "prodcons"];

/// Which driver to run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DriverArg {
    /// The GPU when there is one, else the simulation.
    Auto,
    /// The GPU, or an error.
    Cuda,
    /// The simulation (H200 latency model).
    Sim,
}

/// Where the crate's buffers allocate from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MemPoolArg {
    /// A pool the crate creates for the context, keeping freed memory cached (the default).
    Own,
    /// The device's default pool as configured (its release threshold untouched, 0 by default:
    /// freed memory goes back to the device at every synchronization).
    Default,
    /// The device's default pool with its release threshold raised to keep all freed memory
    /// (what CUDA's C++ samples do; a change of the device's pool for the whole process).
    DefaultKept,
}

impl MemPoolArg {
    /// The context options for this choice.
    pub fn options(self) -> cuda_stream_pool::ContextOptions {
        let choice = match self {
            MemPoolArg::Own => cuda_stream_pool::MemPoolChoice::default(),
            MemPoolArg::Default | MemPoolArg::DefaultKept => {
                cuda_stream_pool::MemPoolChoice::DeviceDefault
            }
        };
        cuda_stream_pool::ContextOptions::default().mem_pool(choice)
    }

    /// The primary context of device 0 with this choice (and, for `DefaultKept`, the default
    /// pool's release threshold raised).
    pub fn context(self, d: Arc<dyn cuda_stream_pool::driver::Driver>) -> DemoResult<Context> {
        self.context_on(d, 0)
    }

    /// The primary context of device `ordinal` with this choice (see [`MemPoolArg::context`]).
    pub fn context_on(
        self,
        d: Arc<dyn cuda_stream_pool::driver::Driver>,
        ordinal: i32,
    ) -> DemoResult<Context> {
        let ctx = Context::primary_with(d, ordinal, self.options())?;
        if self == MemPoolArg::DefaultKept {
            ctx.set_release_threshold(u64::MAX)?;
        }
        Ok(ctx)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            MemPoolArg::Own => "own",
            MemPoolArg::Default => "default",
            MemPoolArg::DefaultKept => "default-kept",
        }
    }
}

/// What the table's strategies and columns mean; printed under the table and by `--help`.
pub const LEGEND: &str = "\
Workloads (\"the seed\" is CUDA.jl PR #3317, https://github.com/JuliaGPU/CUDA.jl/pull/3317,
the stream pool of CUDA.jl that this crate generalises; these are its two workloads):
  short     each task (owner) allocates 1,024 floats, adds one and sums them with two kernels,
            copies the sum back, synchronizes and checks it
  prodcons  a long-lived producer per thread fills a buffer; a short-lived consumer uses it on
            its own stream (ordered on the GPU), sums, checks and frees it
Strategies (where each task's stream comes from):
  floor     one long-lived stream per worker thread, reused by every task: no stream
            management at all, the baseline of x_floor
  pool      this crate: an Owner per task takes a recycled stream from the pool and gives it
            back when dropped (handed on only once its GPU work is done)
  pool-tls  this crate: the worker thread's implicit owner (Context::stream), no acquire per task
  fresh     cuStreamCreate per task, cuStreamDestroy at its end
  deferred  a new stream per task, destroyed only at the end of the run, as a garbage collector
            would (what the seed fixed); stopped after --deferred-cap seconds
  cudarc    cudarc's CudaContext::new_stream per task, as cudarc users write it today (build
            with --features cudarc; needs a GPU)
Columns: x_floor = time per owner / the same row's floor (- when floor did not run; with
  --repeat, of the median runs); x_spread = lowest-highest of run i / floor's run i (the
  strategies take turns);
  us/owner = wall time per task; streams = peak live streams (the pool's include its disposal
  stream); mem_MiB = peak device memory above the row's start; sync_ms = a final
  cuCtxSynchronize.";

/// The `--json` schema, for `--help` (the same as [`JsonRow`]'s table).
const JSON_HELP: &str = "\
JSON (--json, --json-out): one object per line, fields (stable: added, never renamed or retyped):
  workload, strategy (strings), threads, tasks (integers; tasks done), wall_s (number),
  ratio_to_floor (number, or null when floor did not run), us_per_owner (number),
  peak_streams, peak_mem_bytes (integers), final_sync_s (number), capped (boolean),
  repeats (integer), ratio_min, ratio_max (numbers, or null when floor did not run: the
  lowest and highest of run i over floor's run i), driver (\"cuda\" or \"sim\"), mem_pool
  (\"own\" or \"default\").";

/// The seed's workloads (many short owners; producer/consumer) with each stream strategy.
#[derive(Debug, clap::Parser)]
#[command(
    name = "cuda-stream-pool",
    version,
    about = "The seed's workloads (CUDA.jl PR #3317) with each way of getting a stream for a short task: \
             this crate's pool against one stream per thread, a new stream per task, and more",
    after_help = "`--help` says what the strategies and columns mean.",
    after_long_help = format!("{LEGEND}\n\n{JSON_HELP}\n\n{}", crate::devices::HELP)
)]
pub struct Options {
    /// Driver to use.
    #[arg(long, value_enum, default_value = "auto")]
    pub driver: DriverArg,
    /// Owners (tasks) per row.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub tasks: u64,
    /// Worker threads, comma-separated, each 1 to 1024 (default: 1 and the machine's cores).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u64).range(1..=MAX_THREADS), allow_negative_numbers = true)]
    pub threads: Vec<u64>,
    /// Strategies, comma-separated (default: all that this build and driver support).
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(STRATEGIES))]
    pub strategies: Vec<String>,
    /// Workloads, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(WORKLOADS), default_values_t = WORKLOADS.map(String::from))]
    pub workloads: Vec<String>,
    /// Print JSON lines instead of a table (the schema: below, and in the README).
    #[arg(long)]
    pub json: bool,
    /// Memory pool of the crate's buffers: its own (cached) or the device's default as configured.
    #[arg(long, value_enum, default_value = "own")]
    pub mem_pool: MemPoolArg,
    /// Seconds after which the `deferred` strategy stops (reported as tasks done in that time);
    /// above 0, at most 86400.
    #[arg(long, default_value_t = 10.0, value_parser = parse_cap, allow_hyphen_values = true)]
    pub deferred_cap: f64,
    /// Runs of each row, taking turns between strategies; the median run is reported.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Also write the rows as JSON lines to this file (the schema of --json).
    #[arg(long)]
    pub json_out: Option<std::path::PathBuf>,
    /// Devices to spread the worker threads over (thread t on device t % N), one primary
    /// context, pool and kernels per device; with 2 or more, per-device rows of floor, pool and
    /// pool-tls, and checks that nothing crosses devices (see below). The simulated driver then
    /// has N devices.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=crate::devices::MAX_DEVICES as i64))]
    pub devices: u32,
    /// Devices of the simulated driver (default: --devices); fewer than --devices is an error,
    /// as on a machine with fewer GPUs. Simulated driver only.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=crate::devices::MAX_DEVICES as i64))]
    pub sim_devices: Option<u32>,
}

impl Options {
    /// The driver choice.
    pub fn choice(&self) -> Choice {
        match self.driver {
            DriverArg::Auto => Choice::Auto,
            DriverArg::Cuda => Choice::Cuda,
            DriverArg::Sim => Choice::Sim,
        }
    }

    fn thread_counts(&self) -> Vec<usize> {
        if self.threads.is_empty() {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            if cores > 1 {
                vec![1, cores]
            } else {
                vec![1]
            }
        } else {
            // At most MAX_THREADS (the parser's range).
            self.threads
                .iter()
                .map(|&t| t.min(MAX_THREADS) as usize)
                .collect()
        }
    }
}

/// One row of the table.
struct Row {
    workload: String,
    strategy: String,
    threads: usize,
    tasks: usize,
    wall: f64,
    peak_streams: u64,
    peak_mem: u64,
    final_sync: f64,
    capped: bool,
}

impl Row {
    fn per_owner(&self) -> f64 {
        self.wall * 1e6 / self.tasks.max(1) as f64
    }
}

/// One row of `--json` and `--json-out`: one JSON object per line (JSON Lines), in the table's
/// order. The schema is stable: fields may be added, none is renamed, removed or changes type.
///
/// | field | type | meaning |
/// | --- | --- | --- |
/// | `workload` | string | `short` or `prodcons` |
/// | `strategy` | string | `floor`, `pool`, `pool-tls`, `fresh`, `deferred` or `cudarc` |
/// | `threads` | integer | worker threads |
/// | `tasks` | integer | owners (tasks) completed; fewer than `--tasks` when `capped` |
/// | `wall_s` | number | seconds for the row |
/// | `ratio_to_floor` | number or `null` | `us_per_owner` over the same row's `floor`; `null` when `floor` did not run |
/// | `us_per_owner` | number | `wall_s` × 10⁶ / `tasks` |
/// | `peak_streams` | integer | most streams alive at once (the pool's disposal stream included) |
/// | `peak_mem_bytes` | integer | peak device memory above the row's start (`cuMemGetInfo`, sampled every 2 ms) |
/// | `final_sync_s` | number | seconds of the final `cuCtxSynchronize` |
/// | `capped` | boolean | `deferred` hit `--deferred-cap` |
/// | `repeats` | integer | runs of the row; the median one is reported |
/// | `ratio_min`, `ratio_max` | number or `null` | the spread of the ratio over the repeats: run *i* of the strategy over run *i* of `floor` (they take turns), lowest and highest; `null` when `floor` did not run |
/// | `driver` | string | `cuda` or `sim` |
#[derive(Debug, serde::Serialize)]
pub struct JsonRow {
    pub workload: String,
    pub strategy: String,
    pub threads: usize,
    pub tasks: usize,
    pub wall_s: f64,
    pub ratio_to_floor: Option<f64>,
    pub us_per_owner: f64,
    pub peak_streams: u64,
    pub peak_mem_bytes: u64,
    pub final_sync_s: f64,
    pub capped: bool,
    pub repeats: usize,
    pub ratio_min: Option<f64>,
    pub ratio_max: Option<f64>,
    pub driver: String,
    pub mem_pool: &'static str,
}

/// Counts streams created outside the pool (the non-pool strategies).
static OUTSIDE: AtomicU64 = AtomicU64::new(0);
static OUTSIDE_PEAK: AtomicU64 = AtomicU64::new(0);

struct Counted(OwnedStream);

impl Counted {
    fn new(ctx: &Context) -> Result<Counted> {
        let s = OwnedStream::new(ctx, Priority::Normal)?;
        let n = OUTSIDE.fetch_add(1, Ordering::Relaxed) + 1;
        OUTSIDE_PEAK.fetch_max(n, Ordering::Relaxed);
        Ok(Counted(s))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        OUTSIDE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One unit of the `short` workload on stream `s`.
pub(crate) fn short_task(k: &Kernels, s: &StreamRef) -> Result<()> {
    let x = DeviceBuffer::<f32>::zeroed(s, 1024)?;
    let sum = DeviceBuffer::<f32>::zeroed(s, 1)?;
    k.add_one(s, &x)?;
    k.sum(s, &x, &sum)?;
    let v = sum.to_vec(s)?[0];
    if v != 1024.0 {
        return Err(Error::InvalidArgument(format!(
            "wrong sum {v}, expected 1024"
        )));
    }
    Ok(())
}

/// The producer's half of a `prodcons` iteration: a filled buffer on the producer's stream.
pub(crate) fn produce(k: &Kernels, p: &StreamRef) -> Result<DeviceBuffer<f32>> {
    let x = DeviceBuffer::<f32>::zeroed(p, 1024)?;
    k.add_one(p, &x)?;
    Ok(x)
}

/// The consumer's half on its own stream; drops (frees) the buffer there.
pub(crate) fn consume(k: &Kernels, s: &StreamRef, x: DeviceBuffer<f32>) -> Result<()> {
    k.add_one(s, &x)?;
    let sum = DeviceBuffer::<f32>::zeroed(s, 1)?;
    k.sum(s, &x, &sum)?;
    let v = sum.to_vec(s)?[0];
    if v != 2048.0 {
        return Err(Error::InvalidArgument(format!(
            "wrong sum {v}, expected 2048"
        )));
    }
    Ok(())
}

/// A row's progress bar (on standard error), or a hidden one.
pub(crate) fn progress_bar(progress: bool, tasks: usize, prefix: String) -> indicatif::ProgressBar {
    if !progress {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(tasks as u64);
    b.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} {per_sec}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b.set_prefix(prefix);
    b
}

#[allow(clippy::too_many_arguments)]
fn run_one(
    ctx: &Context,
    k: &Arc<Kernels>,
    cu: Option<&Arc<cudarc_strategy::Cudarc>>,
    workload: &str,
    strategy: &str,
    threads: usize,
    tasks: usize,
    cap: f64,
    progress: bool,
) -> DemoResult<Row> {
    ctx.synchronize()?;
    ctx.trim()?;
    let d = ctx.driver().clone();
    let (free0, total) = d.mem_get_info()?;
    let base_used = total - free0;
    OUTSIDE.store(0, Ordering::Relaxed);
    OUTSIDE_PEAK.store(0, Ordering::Relaxed);
    cudarc_strategy::reset_counts();
    let peak_used = Arc::new(AtomicU64::new(base_used as u64));
    let pool_peak = Arc::new(AtomicU64::new(ctx.live_streams()));
    let stop = Arc::new(AtomicBool::new(false));
    // Device memory is sampled by a monitor thread.
    let monitor = {
        let (ctx, peak, stop) = (ctx.clone(), peak_used.clone(), stop.clone());
        spawn("memory-monitor".into(), move || {
            let _ = ctx.bind();
            while !stop.load(Ordering::Relaxed) {
                if let Ok((free, total)) = ctx.driver().mem_get_info() {
                    peak.fetch_max((total - free) as u64, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })?
    };
    let deadline = Instant::now() + Duration::from_secs_f64(cap);
    let bar = progress_bar(progress, tasks, format!("{workload} {strategy} x{threads}"));
    let done = Arc::new(AtomicUsize::new(0));
    let kept: Arc<Mutex<Vec<Counted>>> = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let mut workers = Vec::with_capacity(threads);
    let mut first_err: Option<Failure> = None;
    for w in 0..threads {
        let worker = {
            let (ctx, k, done, kept, pool_peak, bar, cu) = (
                ctx.clone(),
                k.clone(),
                done.clone(),
                kept.clone(),
                pool_peak.clone(),
                bar.clone(),
                cu.cloned(),
            );
            let (workload, strategy) = (workload.to_string(), strategy.to_string());
            let my_tasks = tasks / threads + usize::from(w < tasks % threads);
            spawn(format!("worker-{w}"), move || -> Result<()> {
                ctx.bind()?;
                let floor = if strategy == "floor" {
                    Some(Counted::new(&ctx)?)
                } else {
                    None
                };
                let producer = ctx.owner();
                let cu_producer = match (&cu, strategy.as_str()) {
                    (Some(cu), "cudarc") => Some(cu.new_stream()?),
                    _ => None,
                };
                for i in 0..my_tasks {
                    if strategy == "cudarc" {
                        let cu = cu.as_ref().ok_or_else(|| {
                            Error::InvalidArgument("cudarc strategy without cudarc".into())
                        })?;
                        match cu_producer.as_ref().filter(|_| workload == "prodcons") {
                            Some(p) => cu.prodcons_task(p)?,
                            None => cu.short_task()?,
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                        bar.inc(1);
                        continue;
                    }
                    if strategy == "deferred" && i % 16 == 0 && Instant::now() > deadline {
                        break;
                    }
                    let input = if workload == "prodcons" {
                        Some(produce(&k, &producer.stream()?)?)
                    } else {
                        None
                    };
                    let work = |s: &StreamRef| -> Result<()> {
                        match input {
                            Some(x) => consume(&k, s, x),
                            None => short_task(&k, s),
                        }
                    };
                    match strategy.as_str() {
                        "pool" => {
                            let owner = ctx.owner();
                            work(&owner.stream()?)?;
                        }
                        "pool-tls" => work(&ctx.stream()?)?,
                        "floor" => match &floor {
                            Some(f) => work(&f.0.stream())?,
                            None => return Err(Error::InvalidArgument("no floor stream".into())),
                        },
                        "fresh" => {
                            let s = Counted::new(&ctx)?;
                            work(&s.0.stream())?;
                        }
                        "deferred" => {
                            let s = Counted::new(&ctx)?;
                            work(&s.0.stream())?;
                            lock(&kept).push(s);
                        }
                        other => {
                            return Err(Error::InvalidArgument(format!("unknown strategy {other}")))
                        }
                    }
                    if i % 64 == 0 {
                        pool_peak.fetch_max(ctx.live_streams(), Ordering::Relaxed);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    bar.inc(1);
                }
                cuda_stream_pool::end_thread_owner(&ctx);
                Ok(())
            })
        };
        match worker {
            Ok(h) => workers.push(h),
            Err(e) => {
                // The threads started so far finish their share; the row is an error.
                first_err = Some(e);
                break;
            }
        }
    }
    join_workers(workers, &mut first_err);
    let wall = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if std::env::var_os("CSP_DEMO_STATS").is_some() {
        note(&format!(
            "{workload} {strategy} x{threads}: {:?}",
            ctx.stats()
        ));
    }
    pool_peak.fetch_max(ctx.live_streams(), Ordering::Relaxed);
    let ts = Instant::now();
    ctx.synchronize()?;
    let final_sync = ts.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = monitor.join();
    if let Ok((free, total)) = d.mem_get_info() {
        peak_used.fetch_max((total - free) as u64, Ordering::Relaxed);
    }
    lock(&kept).clear();
    if let Some(e) = first_err {
        return Err(e);
    }
    let n = done.load(Ordering::Relaxed);
    Ok(Row {
        workload: workload.into(),
        strategy: strategy.into(),
        threads,
        tasks: n,
        wall,
        peak_streams: pool_peak.load(Ordering::Relaxed)
            + OUTSIDE_PEAK.load(Ordering::Relaxed)
            + cudarc_strategy::peak_streams(),
        peak_mem: peak_used
            .load(Ordering::Relaxed)
            .saturating_sub(base_used as u64),
        final_sync,
        capped: n < tasks,
    })
}

/// A new real-time simulated driver's primary context, with the kernels loaded and warmed up.
fn new_sim_context(mem_pool: MemPoolArg) -> DemoResult<(Context, Arc<Kernels>)> {
    let d: Arc<dyn cuda_stream_pool::driver::Driver> =
        Arc::new(cuda_stream_pool::driver::SimDriver::realtime());
    d.init()?;
    let ctx = mem_pool.context(d)?;
    let k = Arc::new(Kernels::load(&ctx)?);
    short_task(&k, &ctx.owner().stream()?)?;
    Ok((ctx, k))
}

/// The note printed instead of multi-thread rows on the simulation.
pub const SIM_THREADS_NOTE: &str = "note: on the simulated driver only 1-thread rows are run. \
The simulation's driver calls from several threads run in parallel, while the real driver \
serialises them (on the H200 a cuStreamQuery costs 0.2 us on one thread and 8.6 us on each of \
16), so its multi-thread rows would not be results. Run on a GPU for them.";

/// Runs every row and prints the table (or the JSON lines).
pub fn run(ctx: &Context, opts: &Options) -> DemoResult<()> {
    let k = Arc::new(Kernels::load(ctx)?);
    // Warm up: the first kernel launch JIT-compiles the PTX.
    short_task(&k, &ctx.owner().stream()?)?;
    let on_gpu = ctx.driver().kind() == "cuda";
    let mut strategies: Vec<String> = if opts.strategies.is_empty() {
        STRATEGIES.iter().map(|s| s.to_string()).collect()
    } else {
        opts.strategies.clone()
    };
    let cu = if strategies.iter().any(|s| s == "cudarc") {
        match cudarc_strategy::Cudarc::new(on_gpu) {
            Ok(c) => Some(Arc::new(c)),
            Err(why) => {
                if !opts.strategies.is_empty() {
                    return Err(Failure::Message(format!("strategy cudarc: {why}")));
                }
                note(&format!("note: the cudarc strategy is skipped: {why}"));
                strategies.retain(|s| s != "cudarc");
                None
            }
        }
    } else {
        None
    };
    let progress = !opts.json;
    let mut thread_counts = opts.thread_counts();
    if !on_gpu && thread_counts.iter().any(|&t| t > 1) {
        thread_counts.retain(|&t| t == 1);
        note(SIM_THREADS_NOTE);
        if thread_counts.is_empty() {
            return Err(Failure::Message(
                "no rows to run: the simulated driver runs only --threads 1".into(),
            ));
        }
    }
    let mut json_out = match &opts.json_out {
        Some(p) => Some((
            p,
            std::fs::File::create(p)
                .map_err(|e| Failure::Message(format!("--json-out {}: {e}", p.display())))?,
        )),
        None => None,
    };
    if !opts.json {
        out("")?;
        out(&format!(
            "{:<9} {:<9} {:>7} {:>7} {:>8} {:>8} {:>11} {:>9} {:>8} {:>9} {:>9}",
            "workload",
            "strategy",
            "threads",
            "tasks",
            "wall_s",
            "x_floor",
            "x_spread",
            "us/owner",
            "streams",
            "mem_MiB",
            "sync_ms"
        ))?;
    }
    for w in &opts.workloads {
        for t in thread_counts.iter().copied() {
            // The floor first, so that every other row has its ratio; with --repeat, the
            // strategies take turns and each reports its median run.
            let mut order: Vec<&String> = strategies.iter().filter(|s| *s == "floor").collect();
            order.extend(strategies.iter().filter(|s| *s != "floor"));
            let mut runs: Vec<Vec<Row>> = order.iter().map(|_| Vec::new()).collect();
            for _ in 0..opts.repeat {
                for (i, s) in order.iter().enumerate() {
                    // On the simulation every row gets a new simulated driver: the simulation's
                    // race detector keeps a vector clock entry for every stream ever created,
                    // so a row run after `fresh` or `deferred` would pay for their streams.
                    let fresh_sim = if on_gpu {
                        None
                    } else {
                        Some(new_sim_context(opts.mem_pool)?)
                    };
                    let (ctx, k) = match &fresh_sim {
                        Some((c, k)) => (c, k),
                        None => (ctx, &k),
                    };
                    runs[i].push(run_one(
                        ctx,
                        k,
                        cu.as_ref(),
                        w,
                        s,
                        t,
                        opts.tasks as usize,
                        opts.deferred_cap,
                        progress,
                    )?);
                }
            }
            let mut floor_per = None;
            // Run i of the floor, for the paired ratios (the strategies took turns).
            let floor_runs: Option<Vec<f64>> = order
                .iter()
                .position(|s| *s == "floor")
                .map(|i| runs[i].iter().map(Row::per_owner).collect());
            for mut group in runs {
                let paired: Vec<f64> = floor_runs.as_ref().map_or_else(Vec::new, |f| {
                    group
                        .iter()
                        .zip(f)
                        .map(|(r, f)| r.per_owner() / f)
                        .filter(|x| x.is_finite())
                        .collect()
                });
                let ratio_min = paired.iter().copied().reduce(f64::min);
                let ratio_max = paired.iter().copied().reduce(f64::max);
                group.sort_by(|a, b| a.per_owner().total_cmp(&b.per_owner()));
                let n = group.len();
                let r = group.swap_remove(n / 2);
                let per = r.per_owner();
                if r.strategy == "floor" {
                    floor_per = Some(per);
                }
                let ratio = floor_per.map(|f| per / f);
                let row = JsonRow {
                    workload: r.workload.clone(),
                    strategy: r.strategy.clone(),
                    threads: r.threads,
                    tasks: r.tasks,
                    wall_s: r.wall,
                    ratio_to_floor: ratio.filter(|x| x.is_finite()),
                    us_per_owner: per,
                    peak_streams: r.peak_streams,
                    peak_mem_bytes: r.peak_mem,
                    final_sync_s: r.final_sync,
                    capped: r.capped,
                    repeats: n,
                    ratio_min,
                    ratio_max,
                    driver: ctx.driver().kind().to_string(),
                    mem_pool: opts.mem_pool.name(),
                };
                let line = serde_json::to_string(&row)
                    .map_err(|e| Failure::Message(format!("JSON: {e}")))?;
                if let Some((p, f)) = json_out.as_mut() {
                    writeln!(f, "{line}").map_err(|e| {
                        Failure::Message(format!("--json-out {}: {e}", p.display()))
                    })?;
                }
                if opts.json {
                    out(&line)?;
                } else {
                    out(&format!(
                        "{:<9} {:<9} {:>7} {:>7} {:>8.3} {:>8} {:>11} {:>9.1} {:>8} {:>9.1} {:>9.2}{}",
                        r.workload,
                        r.strategy,
                        r.threads,
                        r.tasks,
                        r.wall,
                        ratio.map_or_else(|| "-".to_string(), |x| format!("{x:.2}")),
                        match (ratio_min, ratio_max) {
                            (Some(a), Some(b)) => format!("{a:.2}-{b:.2}"),
                            _ => "-".to_string(),
                        },
                        per,
                        r.peak_streams,
                        r.peak_mem as f64 / (1 << 20) as f64,
                        r.final_sync * 1e3,
                        if r.capped {
                            "  (time cap: tasks done in that time)"
                        } else {
                            ""
                        }
                    ))?;
                }
            }
        }
    }
    if !opts.json {
        out("")?;
        out(LEGEND)?;
    }
    Ok(())
}

/// The `cudarc` strategy: what a cudarc user writes today, a `new_stream` per owner.
#[cfg(feature = "cudarc")]
mod cudarc_strategy {
    use cuda_stream_pool::{Error, ErrorCode, Result};
    use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    static LIVE: AtomicU64 = AtomicU64::new(0);
    static PEAK: AtomicU64 = AtomicU64::new(0);

    pub fn reset_counts() {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    pub fn peak_streams() -> u64 {
        PEAK.load(Ordering::Relaxed)
    }

    fn err(e: cudarc::driver::DriverError) -> Error {
        Error::Driver {
            code: ErrorCode(e.0 as u32),
            name: "cudarc DriverError",
            call: "cudarc",
        }
    }

    /// A cudarc stream, counted.
    pub struct Counted(pub Arc<CudaStream>);

    impl Drop for Counted {
        fn drop(&mut self) {
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
    }

    pub struct Cudarc {
        ctx: Arc<CudaContext>,
        add_one: CudaFunction,
        sum: CudaFunction,
    }

    fn cfg(n: u32) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    impl Cudarc {
        pub fn new(on_gpu: bool) -> std::result::Result<Cudarc, String> {
            if !on_gpu {
                return Err("needs the real driver (cudarc has no simulation)".into());
            }
            let ctx = CudaContext::new(0).map_err(|e| e.to_string())?;
            let src = cuda_stream_pool::kernels::PTX.trim_end_matches('\0');
            let m = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(src))
                .map_err(|e| e.to_string())?;
            Ok(Cudarc {
                add_one: m
                    .load_function("csp_add_one_f32")
                    .map_err(|e| e.to_string())?,
                sum: m.load_function("csp_sum_f32").map_err(|e| e.to_string())?,
                ctx,
            })
        }

        pub fn new_stream(&self) -> Result<Counted> {
            let s = self.ctx.new_stream().map_err(err)?;
            let n = LIVE.fetch_add(1, Ordering::Relaxed) + 1;
            PEAK.fetch_max(n, Ordering::Relaxed);
            Ok(Counted(s))
        }

        fn add_sum_check(
            &self,
            s: &Arc<CudaStream>,
            x: &mut cudarc::driver::CudaSlice<f32>,
            want: f32,
        ) -> Result<()> {
            let n = 1024u32;
            let mut sum = s.alloc_zeros::<f32>(1).map_err(err)?;
            // SAFETY: csp_add_one_f32(float *x, unsigned n) and csp_sum_f32(const float *x,
            // float *out, unsigned n) with slices of n and 1 elements.
            unsafe {
                s.launch_builder(&self.add_one)
                    .arg(&mut *x)
                    .arg(&n)
                    .launch(cfg(n))
                    .map_err(err)?;
                s.launch_builder(&self.sum)
                    .arg(&*x)
                    .arg(&mut sum)
                    .arg(&n)
                    .launch(cfg(n))
                    .map_err(err)?;
            }
            let v = s.clone_dtoh(&sum).map_err(err)?[0];
            if v != want {
                return Err(Error::InvalidArgument(format!(
                    "wrong sum {v}, expected {want}"
                )));
            }
            Ok(())
        }

        /// `short`: a new stream, zeroed input, add one, sum, copy back, check.
        pub fn short_task(&self) -> Result<()> {
            let s = self.new_stream()?;
            let mut x = s.0.alloc_zeros::<f32>(1024).map_err(err)?;
            self.add_sum_check(&s.0, &mut x, 1024.0)
        }

        /// `prodcons`: the producer fills on its long-lived stream, the consumer (a new stream)
        /// adds one, sums and checks; cudarc's own events order the slice across the streams.
        pub fn prodcons_task(&self, producer: &Counted) -> Result<()> {
            let p = &producer.0;
            let mut x = p.alloc_zeros::<f32>(1024).map_err(err)?;
            let n = 1024u32;
            // SAFETY: as above.
            unsafe {
                p.launch_builder(&self.add_one)
                    .arg(&mut x)
                    .arg(&n)
                    .launch(cfg(n))
                    .map_err(err)?;
            }
            let s = self.new_stream()?;
            self.add_sum_check(&s.0, &mut x, 2048.0)
        }
    }
}

/// Stand-in when the crate is built without the `cudarc` feature.
#[cfg(not(feature = "cudarc"))]
mod cudarc_strategy {
    use cuda_stream_pool::Result;

    pub fn reset_counts() {}

    pub fn peak_streams() -> u64 {
        0
    }

    pub struct Counted;

    pub enum Cudarc {}

    impl Cudarc {
        pub fn new(_on_gpu: bool) -> std::result::Result<Cudarc, String> {
            Err("built without the `cudarc` feature (cargo run --release --features cudarc)".into())
        }
        pub fn new_stream(&self) -> Result<Counted> {
            match *self {}
        }
        pub fn short_task(&self) -> Result<()> {
            match *self {}
        }
        pub fn prodcons_task(&self, _p: &Counted) -> Result<()> {
            match *self {}
        }
    }
}
