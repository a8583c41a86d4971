//! An async GPU "server" on tokio's multi-thread runtime: N concurrent requests (default 10,000),
//! each a task with its own `Owner` (attached, so `Context::stream()` inside is the task's
//! stream) that allocates, launches a kernel, copies back asynchronously and awaits; every result
//! is verified. Runs on the simulated driver (real-time latency model) when there is no GPU.
//!
//! `--mode` compares the strategies of issue 15:
//! * `async` (default): the crate's async tasks (one pooled stream per task, completion futures);
//! * `blocking`: the same work in `spawn_blocking` with a pooled stream and `synchronize`;
//! * `shared`: one stream per worker thread (the thread's implicit owner), `synchronize`d in
//!   `spawn_blocking`-free code (blocks the worker).
//!
//! ```sh
//! cargo run --release --example async_server -- [--n 10000] [--mode async|blocking|shared] [--workers 16] [--cap 64] [--json] [--sim]
//! ```
//! `--sim` runs on the simulated driver even where there is a GPU.
//! `--cap N` caps live streams per key (`ContextOptions::max_live_streams_per_key`; 0, the
//! default, is no cap); async tasks then wait for a stream with `Owner::ready` (FIFO, no thread
//! blocked).
//!
//! Prints requests/s, p50/p99 latency, OS threads of the process, peak live streams and peak
//! device memory (from the driver's free-memory query), and where a request's time goes: on the
//! worker thread (getting the stream and enqueueing; for the blocking modes the whole request),
//! awaiting the copy (async), and how many requests were in flight at most.

use cuda_stream_pool::driver::{self, Choice, Driver, SimDriver};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{Context, ContextOptions, DeviceBuffer};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const LEN: usize = 256;

/// The value of `--name V`, or `default` when absent; a missing or unparsable value is an error.
fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> Res<T> {
    match args.iter().position(|a| a == name) {
        None => Ok(default),
        Some(i) => args
            .get(i + 1)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{name} needs a valid value").into()),
    }
}

fn os_threads() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Threads:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn check(v: &[u32], i: u32) -> Res<()> {
    if v.len() != LEN || v.iter().any(|&x| x != i + 1) {
        return Err(format!("request {i}: wrong result").into());
    }
    Ok(())
}

/// Where a request's time goes (sums over requests, nanoseconds), and how many were in flight
/// (begun, not finished) at most: names the cause of a slow mode.
#[derive(Default)]
struct Phases {
    /// On the worker thread: getting the stream and enqueueing (async), or the whole request
    /// (blocking, shared: they wait on the worker).
    enqueue_ns: AtomicU64,
    /// Awaiting the copy's completion (async only): the GPU's work and the poller's wake-up.
    await_ns: AtomicU64,
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
}

impl Phases {
    fn begin(&self) -> Instant {
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak_in_flight.fetch_max(now, Ordering::Relaxed);
        Instant::now()
    }
    fn end(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
    fn add(field: &AtomicU64, since: Instant) {
        field.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
}

async fn request_async(ctx: Context, k: Arc<Kernels>, i: u32, ph: Arc<Phases>) -> Res<()> {
    // Nothing here blocks the worker thread: allocation, memset, launch and the copy back are
    // enqueued, and the copy is awaited.
    let t = ph.begin();
    let copy = {
        let s = ctx.stream()?; // the attached owner's stream
        let mut b = DeviceBuffer::<u32>::alloc(&s, LEN)?;
        b.fill(&s, i)?;
        k.add_u32(&s, &b, 1)?;
        b.to_vec_async(&s)?
    };
    Phases::add(&ph.enqueue_ns, t);
    let t = Instant::now();
    let v = copy.await;
    Phases::add(&ph.await_ns, t);
    ph.end();
    check(&v?, i)
}

fn request_blocking(ctx: &Context, k: &Kernels, i: u32) -> Res<()> {
    let owner = ctx.owner();
    let s = owner.stream()?;
    let b = DeviceBuffer::from_slice(&s, &[i; LEN])?;
    k.add_u32(&s, &b, 1)?;
    check(&b.to_vec(&s)?, i)
}

fn request_shared(ctx: &Context, k: &Kernels, i: u32) -> Res<()> {
    let s = ctx.stream()?; // the worker thread's implicit owner: shared by its tasks
    let b = DeviceBuffer::from_slice(&s, &[i; LEN])?;
    k.add_u32(&s, &b, 1)?;
    check(&b.to_vec(&s)?, i)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    run(&args)
}

/// The server with these command-line arguments (`args[0]` is the program's name).
pub fn run(args: &[String]) -> Res<()> {
    let args = args.to_vec();
    let n: u32 = arg(&args, "--n", 10_000)?;
    let workers: usize = arg(&args, "--workers", 16)?;
    let mode: String = arg(&args, "--mode", "async".to_string())?;
    let cap: usize = arg(&args, "--cap", 0)?; // 0: no cap
    let json = args.iter().any(|a| a == "--json");
    let sim = args.iter().any(|a| a == "--sim");
    if n == 0 || workers == 0 || !["async", "blocking", "shared"].contains(&mode.as_str()) {
        return Err("--n and --workers must be positive, --mode async|blocking|shared".into());
    }
    let opts = ContextOptions::default().max_live_streams_per_key((cap > 0).then_some(cap));
    let drv: Arc<dyn Driver> = match driver::load(Choice::Cuda) {
        Ok((d, _)) if !sim => d,
        Ok(_) => Arc::new(SimDriver::realtime()),
        Err(e) => {
            eprintln!("no GPU ({e}); running on the simulated driver");
            Arc::new(SimDriver::realtime())
        }
    };
    let ctx = Context::primary_with(drv.clone(), 0, opts)?;
    let k = Arc::new(Kernels::load(&ctx)?);
    // The crate leaves a thread's current context as it found it, so an operation on a thread
    // where another context (or none) is current makes it current and puts the old one back
    // (two `cuCtxSetCurrent` per copy, memset or launch). A server's threads serve this context
    // alone: make it current on each of them once (every mode alike).
    let bind = {
        let ctx = ctx.clone();
        move || {
            if let Err(e) = ctx.bind() {
                eprintln!("could not make the context current on a runtime thread: {e}");
            }
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .max_blocking_threads(workers)
        .on_thread_start(bind)
        .enable_all()
        .build()?;
    let peak_streams = Arc::new(AtomicU64::new(0));
    let phases = Arc::new(Phases::default());
    let peak_threads = Arc::new(AtomicU64::new(0));
    // The crate leaves the thread's current context as it found it: make it current here.
    ctx.bind()?;
    let (free0, _) = drv.mem_get_info()?;
    let min_free = Arc::new(AtomicU64::new(free0 as u64));
    let start = Instant::now();
    let lat: Vec<u64> = rt.block_on(async {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let sampler = {
            let (ctx, ps, pt, mf, stop, d) = (
                ctx.clone(),
                peak_streams.clone(),
                peak_threads.clone(),
                min_free.clone(),
                stop.clone(),
                drv.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    ps.fetch_max(ctx.live_streams(), Ordering::Relaxed);
                    pt.fetch_max(os_threads(), Ordering::Relaxed);
                    // SAFETY: the context is live (held by `ctx`).
                    let _ = unsafe { d.ctx_set_current(ctx.raw()) };
                    if let Ok((free, _)) = d.mem_get_info() {
                        mf.fetch_min(free as u64, Ordering::Relaxed);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
            })
        };
        let mut handles = Vec::with_capacity(n as usize);
        for i in 0..n {
            let (ctx, k, ph) = (ctx.clone(), k.clone(), phases.clone());
            let t0 = Instant::now();
            let h = match mode.as_str() {
                "blocking" => tokio::spawn(async move {
                    tokio::task::spawn_blocking(move || {
                        let t = ph.begin();
                        let r = request_blocking(&ctx, &k, i);
                        Phases::add(&ph.enqueue_ns, t);
                        ph.end();
                        r
                    })
                    .await
                    .map_err(|e| -> Box<dyn std::error::Error + Send + Sync> { e.into() })??;
                    Ok::<u64, Box<dyn std::error::Error + Send + Sync>>(
                        t0.elapsed().as_nanos() as u64
                    )
                }),
                "shared" => tokio::spawn(async move {
                    let t = ph.begin();
                    let r = request_shared(&ctx, &k, i);
                    Phases::add(&ph.enqueue_ns, t);
                    ph.end();
                    r?;
                    Ok(t0.elapsed().as_nanos() as u64)
                }),
                _ => tokio::spawn(async move {
                    // At the cap, wait for a stream without blocking the worker.
                    let owner = ctx.owner().ready().await?;
                    owner
                        .attach(async move {
                            request_async(ctx, k, i, ph).await?;
                            Ok(t0.elapsed().as_nanos() as u64)
                        })
                        .await
                }),
            };
            handles.push(h);
        }
        let mut lat = Vec::with_capacity(n as usize);
        let mut err: Option<String> = None;
        for h in handles {
            match h.await {
                Ok(Ok(l)) => lat.push(l),
                Ok(Err(e)) => err = err.or(Some(e.to_string())),
                Err(e) => err = err.or(Some(e.to_string())),
            }
        }
        stop.store(true, Ordering::Release);
        let _ = sampler.join();
        match err {
            Some(e) => Err(e),
            None => Ok(lat),
        }
    })?;
    let wall = start.elapsed();
    // The pool's own high-water mark (exact), besides the sampler's readings.
    peak_streams.fetch_max(ctx.stats().peak_live, Ordering::Relaxed);
    let mut lat = lat;
    lat.sort_unstable();
    let p = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize] as f64 / 1e3;
    let rps = n as f64 / wall.as_secs_f64();
    let dev_mib =
        (free0 as u64).saturating_sub(min_free.load(Ordering::Relaxed)) as f64 / 1048576.0;
    if json {
        println!(
            "{}",
            serde_json::json!({"mode": mode, "n": n, "workers": workers, "cap": cap, "driver": drv.kind(),
                "requests_per_s": rps, "p50_us": p(0.5), "p99_us": p(0.99),
                "peak_os_threads": peak_threads.load(Ordering::Relaxed),
                "peak_live_streams": peak_streams.load(Ordering::Relaxed),
                "peak_device_mib": dev_mib,
                "enqueue_us_mean": phases.enqueue_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e3,
                "await_us_mean": phases.await_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e3,
                "peak_in_flight": phases.peak_in_flight.load(Ordering::Relaxed)})
        );
    } else {
        println!(
            "{mode} on {}: {n} requests verified, {rps:.0} requests/s, p50 {:.1} µs, p99 {:.1} µs, \
             peak OS threads {}, peak live streams {}, peak device memory +{dev_mib:.1} MiB; \
             per request {:.1} µs on the worker, {:.1} µs awaited, at most {} in flight",
            drv.kind(),
            p(0.5),
            p(0.99),
            peak_threads.load(Ordering::Relaxed),
            peak_streams.load(Ordering::Relaxed),
            phases.enqueue_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e3,
            phases.await_ns.load(Ordering::Relaxed) as f64 / n as f64 / 1e3,
            phases.peak_in_flight.load(Ordering::Relaxed)
        );
    }
    Ok(())
}
