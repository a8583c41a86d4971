//! The seed's two workloads, run with each stream strategy, as a table.
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
//! `--deferred-cap` seconds and reported as tasks done in that time).

use cuda_stream_pool::driver::Choice;
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, DeviceBuffer, Error, OwnedStream, Priority, Result, StreamRef};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Options {
    pub driver: Choice,
    pub help: bool,
    pub tasks: usize,
    pub threads: Vec<usize>,
    pub strategies: Vec<String>,
    pub workloads: Vec<String>,
    pub json: bool,
    pub deferred_cap: f64,
}

const STRATEGIES: [&str; 5] = ["pool", "pool-tls", "floor", "fresh", "deferred"];
const WORKLOADS: [&str; 2] = ["short", "prodcons"];

fn list(v: Option<&String>, what: &str) -> std::result::Result<Vec<String>, String> {
    let v = v.ok_or(format!("{what} needs a value"))?;
    Ok(v.split(',').map(|s| s.trim().to_string()).collect())
}

impl Options {
    pub fn parse(args: &[String]) -> std::result::Result<Options, String> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut o = Options {
            driver: Choice::Auto,
            help: false,
            tasks: 20_000,
            threads: if cores > 1 { vec![1, cores] } else { vec![1] },
            strategies: STRATEGIES.iter().map(|s| s.to_string()).collect(),
            workloads: WORKLOADS.iter().map(|s| s.to_string()).collect(),
            json: false,
            deferred_cap: 10.0,
        };
        let mut it = args.iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "--driver" => {
                    o.driver = match it.next().map(|s| s.as_str()) {
                        Some("auto") => Choice::Auto,
                        Some("cuda") => Choice::Cuda,
                        Some("sim") => Choice::Sim,
                        other => {
                            return Err(format!("--driver takes auto, cuda or sim, not {other:?}"))
                        }
                    }
                }
                "--tasks" => {
                    o.tasks = it
                        .next()
                        .and_then(|s| s.replace('_', "").parse().ok())
                        .filter(|n| *n > 0)
                        .ok_or("--tasks takes a positive number")?
                }
                "--threads" => {
                    o.threads = list(it.next(), "--threads")?
                        .iter()
                        .map(|s| s.parse().ok().filter(|n| *n > 0))
                        .collect::<Option<Vec<usize>>>()
                        .ok_or("--threads takes positive numbers, e.g. 1,16")?
                }
                "--strategies" => {
                    o.strategies = list(it.next(), "--strategies")?;
                    if let Some(bad) = o
                        .strategies
                        .iter()
                        .find(|s| !STRATEGIES.contains(&s.as_str()))
                    {
                        return Err(format!(
                            "unknown strategy {bad}; known: {}",
                            STRATEGIES.join(",")
                        ));
                    }
                }
                "--workloads" => {
                    o.workloads = list(it.next(), "--workloads")?;
                    if let Some(bad) = o
                        .workloads
                        .iter()
                        .find(|s| !WORKLOADS.contains(&s.as_str()))
                    {
                        return Err(format!(
                            "unknown workload {bad}; known: {}",
                            WORKLOADS.join(",")
                        ));
                    }
                }
                "--deferred-cap" => {
                    o.deferred_cap = it
                        .next()
                        .and_then(|s| s.parse().ok())
                        .filter(|x: &f64| *x > 0.0)
                        .ok_or("--deferred-cap takes seconds")?
                }
                "--json" => o.json = true,
                "-h" | "--help" => o.help = true,
                other => return Err(format!("unknown argument {other}")),
            }
        }
        Ok(o)
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
fn short_task(k: &Kernels, s: &StreamRef) -> Result<()> {
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
fn produce(k: &Kernels, p: &StreamRef) -> Result<DeviceBuffer<f32>> {
    let x = DeviceBuffer::<f32>::zeroed(p, 1024)?;
    k.add_one(p, &x)?;
    Ok(x)
}

/// The consumer's half on its own stream; drops (frees) the buffer there.
fn consume(k: &Kernels, s: &StreamRef, x: DeviceBuffer<f32>) -> Result<()> {
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

fn run_one(
    ctx: &Context,
    k: &Arc<Kernels>,
    workload: &str,
    strategy: &str,
    threads: usize,
    tasks: usize,
    cap: f64,
) -> Result<Row> {
    ctx.synchronize()?;
    ctx.trim()?;
    let d = ctx.driver().clone();
    let (free0, total) = d.mem_get_info()?;
    let base_used = total - free0;
    OUTSIDE.store(0, Ordering::Relaxed);
    OUTSIDE_PEAK.store(0, Ordering::Relaxed);
    let peak_used = Arc::new(AtomicU64::new(base_used as u64));
    let pool_peak = Arc::new(AtomicU64::new(ctx.live_streams()));
    let stop = Arc::new(AtomicBool::new(false));
    // Device memory is sampled by a monitor thread.
    let monitor = {
        let (ctx, peak, stop) = (ctx.clone(), peak_used.clone(), stop.clone());
        std::thread::spawn(move || {
            let _ = ctx.bind();
            while !stop.load(Ordering::Relaxed) {
                if let Ok((free, total)) = ctx.driver().mem_get_info() {
                    peak.fetch_max((total - free) as u64, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs_f64(cap);
    let done = Arc::new(AtomicUsize::new(0));
    let kept: Arc<Mutex<Vec<Counted>>> = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|w| {
            let (ctx, k, done, kept, pool_peak) = (
                ctx.clone(),
                k.clone(),
                done.clone(),
                kept.clone(),
                pool_peak.clone(),
            );
            let (workload, strategy) = (workload.to_string(), strategy.to_string());
            let my_tasks = tasks / threads + usize::from(w < tasks % threads);
            std::thread::spawn(move || -> Result<()> {
                ctx.bind()?;
                let floor = if strategy == "floor" {
                    Some(Counted::new(&ctx)?)
                } else {
                    None
                };
                let producer = ctx.owner();
                for i in 0..my_tasks {
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
                        "floor" => work(&floor.as_ref().unwrap().0)?,
                        "fresh" => {
                            let s = Counted::new(&ctx)?;
                            work(&s.0)?;
                        }
                        "deferred" => {
                            let s = Counted::new(&ctx)?;
                            work(&s.0)?;
                            kept.lock().unwrap().push(s);
                        }
                        _ => unreachable!(),
                    }
                    if i % 64 == 0 {
                        pool_peak.fetch_max(ctx.live_streams(), Ordering::Relaxed);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
                cuda_stream_pool::end_thread_owner(&ctx);
                Ok(())
            })
        })
        .collect();
    let mut first_err = None;
    for h in workers {
        if let Err(e) = h.join().expect("worker panicked") {
            first_err.get_or_insert(e);
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    pool_peak.fetch_max(ctx.live_streams(), Ordering::Relaxed);
    let ts = Instant::now();
    ctx.synchronize()?;
    let final_sync = ts.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = monitor.join();
    if let Ok((free, total)) = d.mem_get_info() {
        peak_used.fetch_max((total - free) as u64, Ordering::Relaxed);
    }
    kept.lock().unwrap().clear();
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
        peak_streams: pool_peak.load(Ordering::Relaxed) + OUTSIDE_PEAK.load(Ordering::Relaxed),
        peak_mem: peak_used
            .load(Ordering::Relaxed)
            .saturating_sub(base_used as u64),
        final_sync,
        capped: n < tasks,
    })
}

pub fn run(ctx: &Context, opts: &Options) -> Result<()> {
    let k = Arc::new(Kernels::load(ctx)?);
    // Warm up: the first kernel launch JIT-compiles the PTX.
    short_task(&k, &ctx.owner().stream()?)?;
    let mut rows = Vec::new();
    if !opts.json {
        println!(
            "\n{:<9} {:<9} {:>7} {:>7} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9}",
            "workload",
            "strategy",
            "threads",
            "tasks",
            "wall_s",
            "x_floor",
            "us/owner",
            "streams",
            "mem_MiB",
            "sync_ms"
        );
    }
    for w in &opts.workloads {
        for &t in &opts.threads {
            let mut floor_wall = None;
            // The floor first, so that every other row has its ratio.
            let mut order: Vec<&String> =
                opts.strategies.iter().filter(|s| *s == "floor").collect();
            order.extend(opts.strategies.iter().filter(|s| *s != "floor"));
            for s in order {
                let r = run_one(ctx, &k, w, s, t, opts.tasks, opts.deferred_cap)?;
                let per = r.wall * 1e6 / r.tasks.max(1) as f64;
                if r.strategy == "floor" {
                    floor_wall = Some(per);
                }
                let ratio = floor_wall.map_or(f64::NAN, |f| per / f);
                if opts.json {
                    println!(
                        "{{\"workload\":\"{}\",\"strategy\":\"{}\",\"threads\":{},\"tasks\":{},\"wall_s\":{:.4},\"ratio_to_floor\":{:.3},\"us_per_owner\":{:.2},\"peak_streams\":{},\"peak_mem_bytes\":{},\"final_sync_s\":{:.5},\"capped\":{},\"driver\":\"{}\"}}",
                        r.workload, r.strategy, r.threads, r.tasks, r.wall, ratio, per, r.peak_streams, r.peak_mem, r.final_sync, r.capped, ctx.driver().kind()
                    );
                } else {
                    println!(
                        "{:<9} {:<9} {:>7} {:>7} {:>8.3} {:>8.2} {:>9.1} {:>8} {:>9.1} {:>9.2}{}",
                        r.workload,
                        r.strategy,
                        r.threads,
                        r.tasks,
                        r.wall,
                        ratio,
                        per,
                        r.peak_streams,
                        r.peak_mem as f64 / (1 << 20) as f64,
                        r.final_sync * 1e3,
                        if r.capped {
                            "  (time cap: tasks done in that time)"
                        } else {
                            ""
                        }
                    );
                }
                rows.push(r);
            }
        }
    }
    if !opts.json {
        println!(
            "\nx_floor: time per owner relative to one long-lived stream per thread; streams: peak live \
             streams (the pool's include its disposal stream); mem_MiB: peak device memory above \
             the start; sync_ms: a final cuCtxSynchronize."
        );
    }
    Ok(())
}
