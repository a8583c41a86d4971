//! What the completion poller's fault probe costs when nothing faults (issue 23; results in
//! BENCHMARKS.md, "Fault probe").
//!
//! While completions are pending and none has landed for 5 ms, the poller asks the driver
//! whether the context died (one `cuStreamQuery` of the disposal stream, at most every 5 ms):
//! a dead context never writes the flags it waits for. This measures, on the real driver:
//!
//! * the probes made per second while one completion stays pending (a stream held by
//!   `cuStreamWaitValue32` on host-mapped memory), counted by a hook on the driver, and the
//!   time of one probe-shaped call (a relaxed-mode `cuStreamQuery` with the context current);
//! * the process's CPU time per second over that window (the poller's whole loop: its reads,
//!   yields, sleeps and probes; the main thread sleeps);
//! * the completion latency (the host releases the held stream -> the future's waker runs) for
//!   completions released at once (the poller is still reading flags after the completion
//!   arrived), after 1 ms (the poller has gone quiet; no probe can have run: the probe starts
//!   after 5 ms without a landing) and after 20 ms (about three probes ran while it was
//!   pending), interleaved, medians and p99.
//!
//! ```sh
//! cargo run --release --example fault_probe_cost -- [--reps 40] [--driver sim]
//! ```
//! Needs an NVIDIA GPU, or `--driver sim`: the simulated driver on a real-time clock, for the
//! host side alone (the poller's CPU; its latencies are the simulation's, which moves on only
//! when the driver is called: not the GPU's).

use cuda_stream_pool::driver::{self, host_alloc_flags, Choice, Driver, Hook, Hooked, WaitValue};
use cuda_stream_pool::Context;
use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Counts `cuStreamQuery` calls made off the main thread (the poller's probes).
#[derive(Default)]
struct CountProbes(AtomicU64);

// SAFETY: `before` only counts; the default `call` makes the inner call once and returns its
// result.
unsafe impl Hook for CountProbes {
    fn before(&self, call: &'static str) -> cuda_stream_pool::Result<()> {
        if call == "cuStreamQuery" && std::thread::current().name() != Some("main") {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Records when it was woken.
struct Stamp(Mutex<Option<Instant>>);
impl Wake for Stamp {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.lock().unwrap().get_or_insert_with(Instant::now);
    }
}

fn cpu_time() -> Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the `rusage` it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    // SAFETY: zero-initialized and filled by getrusage.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() -> Res<()> {
    let reps: usize = std::env::args()
        .skip_while(|a| a != "--reps")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let sim = std::env::args().any(|a| a == "sim");
    let real: Arc<dyn Driver> = if sim {
        Arc::new(driver::SimDriver::realtime())
    } else {
        driver::load(Choice::Cuda)
            .map_err(|e| format!("fault_probe_cost needs an NVIDIA GPU (or --driver sim): {e}"))?
            .0
    };
    real.init()?;
    let hooked = Arc::new(Hooked {
        inner: real,
        hook: CountProbes::default(),
    });
    let d: Arc<dyn Driver> = hooked.clone();
    let ctx = Context::primary(d.clone(), 0)?;
    // Host-mapped words the held streams wait on (the context is current for the allocation).
    let host = {
        ctx.bind()?;
        d.mem_host_alloc(64, host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE)?
    };
    // SAFETY: just allocated with DEVICEMAP.
    let dev = unsafe { d.mem_host_get_device_pointer(host)? };
    // SAFETY: 64 bytes, 4-byte aligned (page-locked allocations are page aligned).
    let word = unsafe { &*(host as *const AtomicU32) };
    word.store(0, Ordering::SeqCst);

    let owner = ctx.owner();
    let s = owner.stream()?;
    // One probe-shaped call: a relaxed-mode query with the context current.
    let n = 20_000;
    let t = Instant::now();
    for _ in 0..n {
        s.query()?;
    }
    let query_ns = t.elapsed().as_nanos() as f64 / n as f64;

    // A completion pending for 2 s: probes per second and the process's CPU per second.
    let mut k = 1;
    // SAFETY: the stream is held by `owner`; `dev` is host-mapped memory that outlives the wait.
    unsafe { d.stream_wait_value32(s.raw(), dev, k, WaitValue::Geq)? };
    let pending = s.completed()?;
    std::thread::sleep(Duration::from_millis(20)); // the poller settles into its sleep loop
    let (p0, c0, t0) = (
        hooked.hook.0.load(Ordering::Relaxed),
        cpu_time(),
        Instant::now(),
    );
    std::thread::sleep(Duration::from_secs(2));
    let (p1, c1, dt) = (
        hooked.hook.0.load(Ordering::Relaxed),
        cpu_time(),
        t0.elapsed(),
    );
    word.store(k, Ordering::SeqCst);
    tokio::runtime::Builder::new_current_thread()
        .build()?
        .block_on(pending)?;
    let probes_per_s = (p1 - p0) as f64 / dt.as_secs_f64();
    let cpu_per_s = (c1 - c0).as_secs_f64() / dt.as_secs_f64();

    // Two completions pending for 2 s (on two streams): the process's CPU per second.
    k += 1;
    let other = ctx.owner();
    let s2 = other.stream()?;
    // SAFETY: as above (both streams held by their owners).
    unsafe { d.stream_wait_value32(s.raw(), dev, k, WaitValue::Geq)? };
    // SAFETY: as above.
    unsafe { d.stream_wait_value32(s2.raw(), dev, k, WaitValue::Geq)? };
    let both = (s.completed()?, s2.completed()?);
    std::thread::sleep(Duration::from_millis(20));
    let (c0, t0) = (cpu_time(), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let cpu2_per_s = (cpu_time() - c0).as_secs_f64() / t0.elapsed().as_secs_f64();
    word.store(k, Ordering::SeqCst);
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    rt.block_on(both.0)?;
    rt.block_on(both.1)?;
    drop(s2);
    drop(other);

    // Latency: released at once, after 1 ms (no probe yet) and after 20 ms (probes ran),
    // interleaved.
    const HOLDS_US: [u64; 3] = [0, 1_000, 20_000];
    let mut lat: [Vec<f64>; 3] = Default::default();
    let mut probes_during = [0u64; 3];
    for _ in 0..reps {
        for (i, hold) in HOLDS_US.into_iter().enumerate() {
            k += 1;
            // SAFETY: as above.
            unsafe { d.stream_wait_value32(s.raw(), dev, k, WaitValue::Geq)? };
            let mut c = Box::pin(s.completed()?);
            let stamp = Arc::new(Stamp(Mutex::new(None)));
            let waker = Waker::from(stamp.clone());
            let mut cx = std::task::Context::from_waker(&waker);
            assert!(c.as_mut().poll(&mut cx).is_pending());
            let p0 = hooked.hook.0.load(Ordering::Relaxed);
            if hold > 0 {
                std::thread::sleep(Duration::from_micros(hold));
            }
            let released = Instant::now();
            word.store(k, Ordering::SeqCst);
            let r = loop {
                if let Some(at) = *stamp.0.lock().unwrap() {
                    break at;
                }
                std::hint::spin_loop();
            };
            probes_during[i] += hooked.hook.0.load(Ordering::Relaxed) - p0;
            lat[i].push(r.saturating_duration_since(released).as_secs_f64() * 1e6);
            assert!(c.as_mut().poll(&mut cx).is_ready());
        }
    }
    println!(
        "fault probe cost ({}), {reps} interleaved repeats",
        if sim {
            "simulated driver, real-time clock"
        } else {
            "CUDA driver"
        }
    );
    println!("  one relaxed cuStreamQuery (a probe's shape): {query_ns:.0} ns");
    println!(
        "  one completion pending 2 s: {probes_per_s:.0} probes/s = {:.4} % of a core; process CPU {:.2} % of a core",
        probes_per_s * query_ns / 1e7,
        cpu_per_s * 100.0
    );
    println!(
        "  two completions pending 2 s: process CPU {:.2} % of a core",
        cpu2_per_s * 100.0
    );
    for (i, hold) in HOLDS_US.into_iter().enumerate() {
        let (p50, p99) = (pct(&mut lat[i], 0.5), pct(&mut lat[i], 0.99));
        let hold = hold as f64 / 1e3;
        println!(
            "  released after {hold:>2} ms: latency p50 {p50:.1} us, p99 {p99:.1} us, probes while pending {:.1} per completion",
            probes_during[i] as f64 / reps as f64
        );
    }
    drop(s);
    drop(owner);
    // SAFETY: allocated above; no wait on it is pending (every completion resolved).
    unsafe { d.mem_free_host(host)? };
    Ok(())
}
