//! `--devices N` with N ≥ 2 (issue 24): the worker threads of each row spread over devices
//! 0..N (thread t on device t % N), one `Context::primary`, pool and [`Kernels`] per device, and
//! per-device rows for the strategies `floor`, `pool` and `pool-tls` (the floor measured in the
//! same run, on the same device). Checks, each a failure of the run (exit code 1) when broken:
//!
//! * every buffer is allocated on a stream of its thread's device and belongs to that device's
//!   context; its free goes on its last use's stream, which the crate keeps in the buffer's
//!   context (a use on another device's stream is refused: checked once per set of contexts, a
//!   buffer of device 0 on a stream of device 1, with `use_on` and with both devices' kernels);
//! * after every run, no stream of any device is in use or lent, no free or destroy is pending,
//!   and every floor stream is gone;
//! * a worker's current context is its device's after the run (it binds it first, as the
//!   one-device demo does), and the main thread's, which calls both devices' contexts without
//!   binding, is what it was before;
//! * on the simulated driver (a new simulation of N devices per run, as the one-device demo makes
//!   a new one per row): the simulation's misuse log (use after free, double free, destroyed
//!   handles, races, ...) is empty and, once the contexts are dropped, nothing is left alive in
//!   it (contexts, streams, events, allocations, host allocations).

use crate::demo::{
    self, lock, note, out, progress_bar, spawn, DemoResult, Failure, MemPoolArg, Options,
};
use cuda_stream_pool::driver::{self, DeviceAttr, Driver, SimConfig, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Error, OwnedStream, Priority, StreamRef};
use std::io::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The most devices `--devices` and `--sim-devices` accept.
pub const MAX_DEVICES: u32 = 64;

/// The strategies that `--devices` 2 or more runs.
const STRATEGIES: [&str; 3] = ["floor", "pool", "pool-tls"];

/// What `--help` says about `--devices`.
pub const HELP: &str = "\
Devices (--devices N, N >= 2; issue 24): the threads of each row spread over devices 0..N-1
  (thread t on device t % N; --threads must be at least N), one primary context, pool and
  set of kernels per device; strategies floor, pool and pool-tls only. One row per device
  and one for all (device `all`: the row's wall time, the sum of the devices' peak streams);
  threads and tasks are the device's; x_floor is over the floor's row of the same device and
  run; no mem_MiB column. Checked (a failure exits with code 1): every buffer belongs to its
  thread's device and is used and freed on that device's streams (a buffer of device 0 on a
  stream of device 1 must be refused); after each run no stream is in use or lent and
  nothing is pending on any device; the current context of every thread is unchanged; on the
  simulated driver, the simulation's misuse log is empty and nothing is left alive once the
  contexts are gone. With --json the rows add `device` (integer, null for all) and `devices`
  and have no peak_mem_bytes or capped. Fewer devices than N: an error (exit 1).";

/// A real-time simulation (the demo's latency model, as `SimDriver::realtime`) with `devices`
/// devices.
pub fn sim_driver(devices: u32) -> SimDriver {
    SimDriver::with_config(SimConfig {
        devices: devices.min(MAX_DEVICES) as i32,
        latency: Some(driver::sim::Latency::default()),
        ..SimConfig::default()
    })
}

fn fail(m: impl Into<String>) -> Failure {
    Failure::Message(m.into())
}

/// An error of device `d`'s work, with the device named.
fn on_dev(d: usize) -> impl Fn(Error) -> Failure {
    move |e| fail(format!("device {d}: {e}"))
}

/// The contexts and kernels of devices 0..N of one driver.
struct Devices {
    drv: Arc<dyn Driver>,
    sim: Option<Arc<SimDriver>>,
    ctxs: Vec<Context>,
    kernels: Vec<Arc<Kernels>>,
    /// The main thread's current context before the contexts were made.
    found: driver::Context,
}

impl Devices {
    /// The primary context of each device 0..n with its kernels loaded and warmed up, and the
    /// cross-device refusal checked.
    fn open(
        drv: Arc<dyn Driver>,
        sim: Option<Arc<SimDriver>>,
        n: usize,
        mem_pool: MemPoolArg,
    ) -> DemoResult<Devices> {
        drv.init()?;
        let found = drv.ctx_get_current()?;
        let mut ctxs = Vec::with_capacity(n);
        let mut kernels = Vec::with_capacity(n);
        for d in 0..n {
            let ctx = mem_pool
                .context_on(drv.clone(), d as i32)
                .map_err(|e| fail(format!("device {d}: {e}")))?;
            let k = Arc::new(Kernels::load(&ctx).map_err(on_dev(d))?);
            // Warm up: the first kernel launch JIT-compiles the PTX.
            demo::short_task(&k, &ctx.owner().stream().map_err(on_dev(d))?).map_err(on_dev(d))?;
            ctxs.push(ctx);
            kernels.push(k);
        }
        let devs = Devices {
            drv,
            sim,
            ctxs,
            kernels,
            found,
        };
        devs.cross_device_refused()?;
        devs.current_unchanged("opening the devices")?;
        Ok(devs)
    }

    /// A buffer of device 0 used on a stream of device 1: refused by `use_on` and by both
    /// devices' kernels, and still correct on its own device, where its last use (its free's
    /// stream) stays.
    fn cross_device_refused(&self) -> DemoResult<()> {
        let (o0, o1) = (self.ctxs[0].owner(), self.ctxs[1].owner());
        let s0 = o0.stream().map_err(on_dev(0))?;
        let s1 = o1.stream().map_err(on_dev(1))?;
        let x = DeviceBuffer::<f32>::zeroed(&s0, 1024).map_err(on_dev(0))?;
        let what = "a buffer of device 0 on a stream of device 1";
        match x.use_on(&s1) {
            Err(Error::InvalidArgument(_)) => {}
            Ok(_) => return Err(fail(format!("{what}: accepted by use_on"))),
            Err(e) => {
                return Err(fail(format!(
                    "{what}: use_on failed with {e}, not a refusal"
                )))
            }
        }
        for (d, k) in self.kernels.iter().enumerate().take(2) {
            if k.add_one(&s1, &x).is_ok() {
                return Err(fail(format!(
                    "{what}: accepted by device {d}'s add_one kernel"
                )));
            }
        }
        let sum = DeviceBuffer::<f32>::zeroed(&s0, 1).map_err(on_dev(0))?;
        self.kernels[0].add_one(&s0, &x).map_err(on_dev(0))?;
        self.kernels[0].sum(&s0, &x, &sum).map_err(on_dev(0))?;
        let v = sum.to_vec(&s0).map_err(on_dev(0))?[0];
        if v != 1024.0 {
            return Err(fail(format!(
                "device 0: after {what} was refused, the buffer's sum is {v}, expected 1024"
            )));
        }
        match x.last_use() {
            Some((s, _, _)) if s == s0.raw() => Ok(()),
            other => Err(fail(format!(
                "device 0: after {what} was refused, the buffer's last use (where it is \
                 freed) is {other:?}, not its own stream {:?}",
                s0.raw()
            ))),
        }
    }

    /// The main thread's current context is the one found before the contexts were made.
    fn current_unchanged(&self, after: &str) -> DemoResult<()> {
        let now = self.drv.ctx_get_current()?;
        if now != self.found {
            return Err(fail(format!(
                "the main thread's current context changed after {after}: {:?}, was {:?}",
                now, self.found
            )));
        }
        Ok(())
    }

    /// After a run: no stream in use or lent, nothing pending, on any device; the simulation's
    /// misuse log empty.
    fn check_idle(&self, row: &str) -> DemoResult<()> {
        for (d, ctx) in self.ctxs.iter().enumerate() {
            let st = ctx.stats();
            if st.in_use != 0 || st.lent != 0 {
                return Err(fail(format!(
                    "device {d}: after {row}, {} stream(s) still in use and {} lent ({st:?})",
                    st.in_use, st.lent
                )));
            }
            // Retries the frees and destroys that could not be made yet; none should be left.
            ctx.trim().map_err(on_dev(d))?;
            let pending = ctx.pending();
            if pending != 0 {
                return Err(fail(format!(
                    "device {d}: after {row}, {pending} free(s) or destroy(s) still pending"
                )));
            }
        }
        self.sim_misuse(row)?;
        self.current_unchanged(row)
    }

    fn sim_misuse(&self, after: &str) -> DemoResult<()> {
        if let Some(sim) = &self.sim {
            let m = sim.misuse();
            if !m.is_empty() {
                return Err(fail(format!(
                    "the simulation logged misuse after {after}: {}",
                    m.join(" | ")
                )));
            }
        }
        Ok(())
    }

    /// Drops the contexts and kernels; on the simulation, waits for their teardown and checks
    /// that nothing is left alive and nothing was misused.
    fn close(self) -> DemoResult<()> {
        self.current_unchanged("the runs")?;
        let Devices {
            drv,
            sim,
            ctxs,
            kernels,
            found,
        } = self;
        drop(kernels);
        drop(ctxs);
        let now = drv.ctx_get_current()?;
        if now != found {
            return Err(fail(format!(
                "the main thread's current context changed when the contexts were dropped: \
                 {now:?}, was {found:?}"
            )));
        }
        let Some(sim) = sim else { return Ok(()) };
        // The teardowns keep page-locked memory (and the primary context's retain) for a next
        // state until it is released; a teardown handed to a thread of its own may still run
        // (a bound for a hang only, as tests/common's assert_clean).
        let t = Instant::now();
        while cuda_stream_pool::release_pinned_cache(&*sim).is_ok()
            && sim.counters().live_contexts > 0
            && t.elapsed() < Duration::from_secs(60)
        {
            std::thread::yield_now();
        }
        let c = sim.counters();
        if c.live_contexts + c.live_streams + c.live_events + c.live_allocs + c.live_host_allocs
            != 0
        {
            return Err(fail(format!(
                "the simulation has resources left after the contexts were dropped: {c:?}"
            )));
        }
        let m = sim.misuse();
        if !m.is_empty() {
            return Err(fail(format!(
                "the simulation logged misuse: {}",
                m.join(" | ")
            )));
        }
        Ok(())
    }
}

/// One device's share of a run (or, for `all`, the whole run).
#[derive(Clone, Debug, Default)]
struct DevRun {
    threads: usize,
    tasks: usize,
    wall: f64,
    peak_streams: u64,
    final_sync: f64,
}

impl DevRun {
    fn per_owner(&self) -> f64 {
        self.wall * 1e6 / self.tasks.max(1) as f64
    }
}

/// Per-device counters of the floor's streams (created outside the pool).
struct FloorCount {
    live: Vec<AtomicU64>,
    peak: Vec<AtomicU64>,
}

/// A floor stream of device `dev`, counted.
struct Floor<'a> {
    s: OwnedStream,
    count: &'a FloorCount,
    dev: usize,
}

impl<'a> Floor<'a> {
    fn new(ctx: &Context, count: &'a FloorCount, dev: usize) -> cuda_stream_pool::Result<Self> {
        let s = OwnedStream::new(ctx, Priority::Normal)?;
        let n = count.live[dev].fetch_add(1, Ordering::Relaxed) + 1;
        count.peak[dev].fetch_max(n, Ordering::Relaxed);
        Ok(Floor { s, count, dev })
    }
}

impl Drop for Floor<'_> {
    fn drop(&mut self) {
        self.count.live[self.dev].fetch_sub(1, Ordering::Relaxed);
    }
}

/// `s` and `bufs` belong to `ctx` (the thread's device).
fn same_device(
    ctx: &Context,
    s: &StreamRef<'_>,
    bufs: &[&DeviceBuffer<f32>],
) -> std::result::Result<(), String> {
    if s.context().raw() != ctx.raw() {
        return Err(format!(
            "a stream of context {:?} handed to a thread of context {:?}",
            s.context().raw(),
            ctx.raw()
        ));
    }
    for b in bufs {
        if b.context().raw() != ctx.raw() {
            return Err(format!(
                "a buffer of context {:?} allocated on a stream of context {:?}",
                b.context().raw(),
                ctx.raw()
            ));
        }
    }
    Ok(())
}

/// `demo::short_task`'s work with the device checks; its buffers are freed (dropped) at its end,
/// on their last use's stream, `s`.
fn short_task(ctx: &Context, k: &Kernels, s: &StreamRef<'_>) -> DemoResult<()> {
    let x = DeviceBuffer::<f32>::zeroed(s, 1024)?;
    let sum = DeviceBuffer::<f32>::zeroed(s, 1)?;
    same_device(ctx, s, &[&x, &sum]).map_err(fail)?;
    k.add_one(s, &x)?;
    k.sum(s, &x, &sum)?;
    let v = sum.to_vec(s)?[0];
    if v != 1024.0 {
        return Err(fail(format!("wrong sum {v}, expected 1024")));
    }
    Ok(())
}

/// `demo::consume`'s work with the device checks: `x` (the producer's, of this device) is used
/// and freed on `s`.
fn consume(ctx: &Context, k: &Kernels, s: &StreamRef<'_>, x: DeviceBuffer<f32>) -> DemoResult<()> {
    k.add_one(s, &x)?;
    let sum = DeviceBuffer::<f32>::zeroed(s, 1)?;
    same_device(ctx, s, &[&x, &sum]).map_err(fail)?;
    k.sum(s, &x, &sum)?;
    let v = sum.to_vec(s)?[0];
    if v != 2048.0 {
        return Err(fail(format!("wrong sum {v}, expected 2048")));
    }
    Ok(())
}

/// One run of a row: `threads` workers over the devices; per-device results, then the whole.
fn run_once(
    devs: &Devices,
    workload: &str,
    strategy: &str,
    threads: usize,
    tasks: usize,
    progress: bool,
) -> DemoResult<(Vec<DevRun>, DevRun)> {
    let n = devs.ctxs.len();
    for (d, ctx) in devs.ctxs.iter().enumerate() {
        ctx.synchronize().map_err(on_dev(d))?;
        ctx.trim().map_err(on_dev(d))?;
    }
    let floors = Arc::new(FloorCount {
        live: (0..n).map(|_| AtomicU64::new(0)).collect(),
        peak: (0..n).map(|_| AtomicU64::new(0)).collect(),
    });
    let pool_peak: Arc<Vec<AtomicU64>> = Arc::new(
        devs.ctxs
            .iter()
            .map(|c| AtomicU64::new(c.live_streams()))
            .collect(),
    );
    // When each device's last worker finished.
    let finished: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; n]));
    let bar = progress_bar(
        progress,
        tasks,
        format!("{workload} {strategy} x{threads} /{n}"),
    );
    let done = Arc::new(AtomicUsize::new(0));
    let mut per_dev = vec![DevRun::default(); n];
    let t0 = Instant::now();
    let mut workers = Vec::with_capacity(threads);
    let mut first_err: Option<Failure> = None;
    for w in 0..threads {
        let dev = w % n;
        let my_tasks = tasks / threads + usize::from(w < tasks % threads);
        per_dev[dev].threads += 1;
        per_dev[dev].tasks += my_tasks;
        let (drv, ctx, k) = (
            devs.drv.clone(),
            devs.ctxs[dev].clone(),
            devs.kernels[dev].clone(),
        );
        let (floors, pool_peak, finished, done, bar) = (
            floors.clone(),
            pool_peak.clone(),
            finished.clone(),
            done.clone(),
            bar.clone(),
        );
        let (workload, strategy) = (workload.to_string(), strategy.to_string());
        let worker = spawn(format!("worker-{w}-dev{dev}"), move || -> DemoResult<()> {
            let tag = |e: Failure| fail(format!("device {dev}, worker {w}: {e}"));
            let r = (|| -> DemoResult<()> {
                ctx.bind()?;
                if drv.ctx_get_current()? != ctx.raw() {
                    return Err(fail("bind did not make the device's context current"));
                }
                let floor = if strategy == "floor" {
                    Some(Floor::new(&ctx, &floors, dev)?)
                } else {
                    None
                };
                let producer = ctx.owner();
                for i in 0..my_tasks {
                    let input = if workload == "prodcons" {
                        let p = producer.stream()?;
                        let x = demo::produce(&k, &p)?;
                        same_device(&ctx, &p, &[&x]).map_err(fail)?;
                        Some(x)
                    } else {
                        None
                    };
                    let work = |s: &StreamRef<'_>| -> DemoResult<()> {
                        match input {
                            Some(x) => consume(&ctx, &k, s, x),
                            None => short_task(&ctx, &k, s),
                        }
                    };
                    match (strategy.as_str(), &floor) {
                        ("pool", _) => {
                            let owner = ctx.owner();
                            work(&owner.stream()?)?;
                        }
                        ("pool-tls", _) => work(&ctx.stream()?)?,
                        ("floor", Some(f)) => work(&f.s.stream())?,
                        (other, _) => return Err(fail(format!("unknown strategy {other}"))),
                    }
                    if i % 64 == 0 {
                        pool_peak[dev].fetch_max(ctx.live_streams(), Ordering::Relaxed);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                    bar.inc(1);
                }
                drop(producer);
                drop(floor);
                cuda_stream_pool::end_thread_owner(&ctx);
                let now = drv.ctx_get_current()?;
                if now != ctx.raw() {
                    return Err(fail(format!(
                        "the worker's current context changed during the run: {now:?}, was \
                         its device's {:?}",
                        ctx.raw()
                    )));
                }
                Ok(())
            })();
            let end = Instant::now();
            let mut f = lock(&finished);
            f[dev] = Some(f[dev].map_or(end, |t| t.max(end)));
            r.map_err(tag)
        });
        match worker {
            Ok(h) => workers.push(h),
            Err(e) => {
                // The threads started so far finish their share; the row is an error.
                first_err = Some(e);
                break;
            }
        }
    }
    demo::join_workers(workers, &mut first_err);
    let wall = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if let Some(e) = first_err {
        return Err(e);
    }
    let finished = lock(&finished).clone();
    let mut all = DevRun {
        threads,
        tasks: done.load(Ordering::Relaxed),
        wall,
        ..DevRun::default()
    };
    for (d, ctx) in devs.ctxs.iter().enumerate() {
        let r = &mut per_dev[d];
        r.wall = finished[d].map_or(wall, |t| (t - t0).as_secs_f64());
        pool_peak[d].fetch_max(ctx.live_streams(), Ordering::Relaxed);
        r.peak_streams =
            pool_peak[d].load(Ordering::Relaxed) + floors.peak[d].load(Ordering::Relaxed);
        let ts = Instant::now();
        ctx.synchronize().map_err(on_dev(d))?;
        r.final_sync = ts.elapsed().as_secs_f64();
        all.peak_streams += r.peak_streams;
        all.final_sync += r.final_sync;
        let live = floors.live[d].load(Ordering::Relaxed);
        if live != 0 {
            return Err(fail(format!(
                "device {d}: {live} floor stream(s) still alive after the run"
            )));
        }
    }
    if all.tasks != tasks {
        return Err(fail(format!("{} tasks done of {tasks}", all.tasks)));
    }
    Ok((per_dev, all))
}

/// One row of `--json` with `--devices` 2 or more (documented in [`HELP`] and the README).
#[derive(Debug, serde::Serialize)]
struct JsonRow {
    workload: String,
    strategy: String,
    /// The device; `None` (null) for the row of all devices.
    device: Option<usize>,
    devices: usize,
    threads: usize,
    tasks: usize,
    wall_s: f64,
    ratio_to_floor: Option<f64>,
    us_per_owner: f64,
    peak_streams: u64,
    final_sync_s: f64,
    repeats: usize,
    ratio_min: Option<f64>,
    ratio_max: Option<f64>,
    driver: String,
    mem_pool: &'static str,
}

/// The note printed for `--devices` on the simulated driver.
pub const SIM_NOTE: &str = "note: --devices on the simulated driver: the rows check that each \
device's streams and buffers stay on it; their timings are not results (the simulation's driver \
calls from several threads run in parallel, while the real driver serialises them). Run on GPUs \
for them.";

/// Runs `--devices N` (N ≥ 2) on `drv`, after the header's `driver:` line: checks that there are
/// N devices, prints one line per device, runs every row and prints the table (or JSON lines).
pub fn run(
    drv: Arc<dyn Driver>,
    opts: &Options,
    say: &dyn Fn(String) -> DemoResult<()>,
) -> DemoResult<()> {
    let n = opts.devices as usize;
    let simulated = drv.kind() == "sim";
    let have = drv.device_count()?;
    if have < n as i32 {
        return Err(fail(format!(
            "--devices {n}: the {} driver has only {have} device(s){}",
            if simulated { "simulated" } else { "CUDA" },
            if simulated {
                " (see --sim-devices)"
            } else {
                ""
            }
        )));
    }
    let strategies: Vec<String> = if opts.strategies.is_empty() {
        STRATEGIES.iter().map(|s| s.to_string()).collect()
    } else {
        opts.strategies.clone()
    };
    if let Some(s) = strategies
        .iter()
        .find(|s| !STRATEGIES.contains(&s.as_str()))
    {
        return Err(fail(format!(
            "--devices {n} runs the strategies floor, pool and pool-tls only, not {s}"
        )));
    }
    let thread_counts: Vec<usize> = if opts.threads.is_empty() {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        if cores > n {
            vec![n, cores]
        } else {
            vec![n]
        }
    } else {
        opts.threads.iter().map(|&t| t as usize).collect()
    };
    if let Some(t) = thread_counts.iter().find(|&&t| t < n) {
        return Err(fail(format!(
            "--devices {n} needs at least {n} threads per row (thread t runs on device t % {n}): \
             --threads {t} leaves a device without one"
        )));
    }
    let version = drv.driver_version()?;
    for d in 0..n {
        let dev = drv.device_get(d as i32)?;
        say(format!(
            "device {d}: {} (compute {}.{}, {} SMs)",
            drv.device_name(dev)?,
            drv.device_attribute(dev, DeviceAttr::ComputeCapabilityMajor)?,
            drv.device_attribute(dev, DeviceAttr::ComputeCapabilityMinor)?,
            drv.device_attribute(dev, DeviceAttr::MultiprocessorCount)?,
        ))?;
    }
    say(format!(
        "CUDA driver {}.{}, {n} devices, thread t on device t % {n}",
        version / 1000,
        (version % 1000) / 10
    ))?;
    if simulated {
        note(SIM_NOTE);
    }
    // On the GPU one set of contexts for every row; on the simulation a new simulation of n
    // devices per run (as the one-device demo: its race detector remembers every stream).
    let shared = if simulated {
        None
    } else {
        Some(Devices::open(drv.clone(), None, n, opts.mem_pool)?)
    };
    let sim_devices = have.max(0) as u32;
    let mut json_out = match &opts.json_out {
        Some(p) => Some((
            p,
            std::fs::File::create(p)
                .map_err(|e| fail(format!("--json-out {}: {e}", p.display())))?,
        )),
        None => None,
    };
    if !opts.json {
        out("")?;
        out(&format!(
            "{:<9} {:<9} {:>6} {:>7} {:>7} {:>8} {:>8} {:>11} {:>9} {:>8} {:>9}",
            "workload",
            "strategy",
            "device",
            "threads",
            "tasks",
            "wall_s",
            "x_floor",
            "x_spread",
            "us/owner",
            "streams",
            "sync_ms"
        ))?;
    }
    let mut checked_tasks = 0usize;
    for w in &opts.workloads {
        for t in thread_counts.iter().copied() {
            let mut order: Vec<&String> = strategies.iter().filter(|s| *s == "floor").collect();
            order.extend(strategies.iter().filter(|s| *s != "floor"));
            // runs[strategy][repeat] = (per device, all)
            let mut runs: Vec<Vec<(Vec<DevRun>, DevRun)>> =
                order.iter().map(|_| Vec::new()).collect();
            for _ in 0..opts.repeat {
                for (i, s) in order.iter().enumerate() {
                    let row = format!("{w} {s} x{t}");
                    let fresh = if simulated {
                        let sim = Arc::new(sim_driver(sim_devices));
                        Some(Devices::open(sim.clone(), Some(sim), n, opts.mem_pool)?)
                    } else {
                        None
                    };
                    let devs = match (&fresh, &shared) {
                        (Some(d), _) | (None, Some(d)) => d,
                        (None, None) => return Err(fail("no devices opened")),
                    };
                    let r = run_once(devs, w, s, t, opts.tasks as usize, !opts.json)
                        .map_err(|e| fail(format!("{row}: {e}")))?;
                    devs.check_idle(&row)?;
                    if let Some(f) = fresh {
                        f.close().map_err(|e| fail(format!("{row}: {e}")))?;
                    }
                    checked_tasks += r.1.tasks;
                    runs[i].push(r);
                }
            }
            let floor_i = order.iter().position(|s| *s == "floor");
            // Slot d < n: device d; slot n: all devices.
            let slot = |r: &(Vec<DevRun>, DevRun), d: usize| -> DevRun {
                if d < n {
                    r.0[d].clone()
                } else {
                    r.1.clone()
                }
            };
            for d in 0..=n {
                let floor_runs: Option<Vec<f64>> =
                    floor_i.map(|i| runs[i].iter().map(|r| slot(r, d).per_owner()).collect());
                let floor_median = floor_i
                    .map(|i| median(runs[i].iter().map(|r| slot(r, d)).collect()).per_owner());
                for (i, s) in order.iter().enumerate() {
                    let group: Vec<DevRun> = runs[i].iter().map(|r| slot(r, d)).collect();
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
                    let repeats = group.len();
                    let r = median(group);
                    let per = r.per_owner();
                    let ratio = floor_median.map(|f| per / f).filter(|x| x.is_finite());
                    let row = JsonRow {
                        workload: w.clone(),
                        strategy: s.to_string(),
                        device: (d < n).then_some(d),
                        devices: n,
                        threads: r.threads,
                        tasks: r.tasks,
                        wall_s: r.wall,
                        ratio_to_floor: ratio,
                        us_per_owner: per,
                        peak_streams: r.peak_streams,
                        final_sync_s: r.final_sync,
                        repeats,
                        ratio_min,
                        ratio_max,
                        driver: drv.kind().to_string(),
                        mem_pool: opts.mem_pool.name(),
                    };
                    let line =
                        serde_json::to_string(&row).map_err(|e| fail(format!("JSON: {e}")))?;
                    if let Some((p, f)) = json_out.as_mut() {
                        writeln!(f, "{line}")
                            .map_err(|e| fail(format!("--json-out {}: {e}", p.display())))?;
                    }
                    if opts.json {
                        out(&line)?;
                    } else {
                        out(&format!(
                            "{:<9} {:<9} {:>6} {:>7} {:>7} {:>8.3} {:>8} {:>11} {:>9.1} {:>8} {:>9.2}",
                            w,
                            s,
                            if d < n { d.to_string() } else { "all".into() },
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
                            r.final_sync * 1e3,
                        ))?;
                    }
                }
            }
        }
    }
    if let Some(devs) = shared {
        devs.close()?;
    }
    say(String::new())?;
    say(format!(
        "checks passed ({n} devices): {checked_tasks} tasks, each buffer of its thread's device \
         and used and freed on that device's streams; a buffer of device 0 refused on a stream \
         of device 1; after every run no stream in use, lent or pending on any device; the \
         threads' current contexts unchanged{}",
        if simulated {
            "; the simulation's misuse log empty and nothing left alive in it"
        } else {
            ""
        }
    ))?;
    if !opts.json {
        out("")?;
        out(demo::LEGEND)?;
        out("")?;
        out(HELP)?;
    }
    Ok(())
}

/// The median run (by time per owner).
fn median(mut group: Vec<DevRun>) -> DevRun {
    if group.is_empty() {
        return DevRun::default();
    }
    group.sort_by(|a, b| a.per_owner().total_cmp(&b.per_owner()));
    let n = group.len();
    group.swap_remove(n / 2)
}
