//! Measures the candidate mechanisms for waking a future when a stream's work has completed, on
//! the real driver (issue 15; results in BENCHMARKS.md, "Completion mechanisms"):
//!
//! * `hostfn`: `cuLaunchHostFunc` whose host function only wakes (the driver's own thread);
//! * `event-poller`: `cuEventRecord`, and one poller thread querying the pending events
//!   (`cuEventQuery`) with backoff;
//! * `flag-poller`: `cuStreamWriteValue64` of a sequence number into host-mapped memory, and one
//!   poller thread reading the flags (no driver call) with backoff.
//! * `blocking-event`: `cuEventRecord` of an event made with `CU_EVENT_BLOCKING_SYNC`, and one
//!   waiter thread that blocks in `cuEventSynchronize` on the pending events in order (the driver
//!   wakes it: no polling; a later completion waits behind an earlier one).
//! * `bell-event` and `bell-value`: the completion poller's doorbell, two ways: a host function
//!   that only wakes, on a second stream (the doorbell stream) that waits first for an event
//!   recorded on the work's stream (`cuStreamWaitEvent`), or for a word that the work's stream
//!   writes (`cuStreamWriteValue64` there, `cuStreamWaitValue32` on its low half here).
//!
//! For each mechanism, at 1 and 16 threads: the completion latency (the host releases a stream
//! held by `cuStreamWaitValue32` -> the waker is called; includes the GPU noticing the host
//! write, the same for all), the throughput (each thread keeps 32 streams busy with a one-word
//! memset plus a completion, and waits for all 32 before the next round), and the process's CPU
//! time per completion. Repeats are interleaved and medians reported; `--json` prints one JSON
//! object per line as well. `--idle-us 50,1000,20000` measures the latency after each of these
//! idle times (the stream is released this long after the completion was enqueued; default 50):
//! a mechanism whose thread sleeps deeper after a long idle wakes later.
//!
//! ```sh
//! cargo run --release --example completion_mechanisms -- [--reps 5] [--idle-us 50] [--json]
//! ```
//! Needs an NVIDIA GPU: on the simulated driver it returns an error (the mechanisms that do not
//! call the driver never see simulated work complete).

use cuda_stream_pool::driver::{
    self, host_alloc_flags, Choice, DevicePtr, Driver, Event, Stream, WaitValue,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Mech {
    HostFn,
    EventPoller,
    FlagPoller,
    BlockingEvent,
    BellEvent,
    BellValue,
}

impl Mech {
    fn name(self) -> &'static str {
        match self {
            Mech::HostFn => "hostfn",
            Mech::EventPoller => "event-poller",
            Mech::FlagPoller => "flag-poller",
            Mech::BlockingEvent => "blocking-event",
            Mech::BellEvent => "bell-event",
            Mech::BellValue => "bell-value",
        }
    }
}

/// What a completion wakes: records the time and unparks the waiting thread.
struct Wake {
    at_ns: AtomicU64,
    done: AtomicBool,
    count: Option<Arc<AtomicUsize>>,
    thread: std::thread::Thread,
}

impl Wake {
    fn new(count: Option<Arc<AtomicUsize>>) -> Arc<Wake> {
        Arc::new(Wake {
            at_ns: AtomicU64::new(0),
            done: AtomicBool::new(false),
            count,
            thread: std::thread::current(),
        })
    }
    fn wake(&self, base: Instant) {
        self.at_ns
            .store(base.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.done.store(true, Ordering::Release);
        if let Some(c) = &self.count {
            c.fetch_add(1, Ordering::AcqRel);
        }
        self.thread.unpark();
    }
}

enum Pending {
    Event(Event, Arc<Wake>),
    Flag(usize, u64, Arc<Wake>),
}

/// One poller thread with backoff: spins while completions arrive, then yields, then sleeps
/// (20 µs steps); parks on a condition variable when nothing is pending.
struct Poller {
    queue: Mutex<Vec<Pending>>,
    cv: Condvar,
    stop: AtomicBool,
    /// A driver call of the poller or waiter failed: the cell's figures are not to be trusted.
    failed: AtomicBool,
    /// Host-mapped flags (one u64 per slot).
    flags: usize,
}

/// A host-mapped slab: host and device addresses.
#[derive(Clone, Copy)]
struct Slab {
    host: usize,
    dev: u64,
}

fn poller_loop(p: &Poller, d: &dyn Driver, base: Instant, free_events: &Mutex<Vec<Event>>) {
    let mut mine: Vec<Pending> = Vec::new();
    let mut idle = 0u32;
    while !p.stop.load(Ordering::Acquire) {
        {
            let mut q = p.queue.lock().unwrap();
            if mine.is_empty() && q.is_empty() {
                q = p.cv.wait_timeout(q, Duration::from_millis(5)).unwrap().0;
            }
            mine.append(&mut q);
        }
        let before = mine.len();
        mine.retain(|x| match x {
            Pending::Event(e, w) => {
                // SAFETY: the event is live: it returns to the free list only here.
                match unsafe { d.event_query(*e) } {
                    Ok(false) => true,
                    r => {
                        if r.is_err() {
                            p.failed.store(true, Ordering::Release);
                        }
                        w.wake(base);
                        free_events.lock().unwrap().push(*e);
                        false
                    }
                }
            }
            Pending::Flag(slot, seq, w) => {
                // SAFETY: the slab outlives the poller; the GPU writes it, so it is read atomically.
                let f = unsafe { &*((p.flags + slot * 8) as *const AtomicU64) };
                if f.load(Ordering::Acquire) >= *seq {
                    w.wake(base);
                    false
                } else {
                    true
                }
            }
        });
        if mine.len() < before {
            idle = 0;
        } else {
            idle += 1;
            if idle < 2_000 {
                std::hint::spin_loop();
            } else if idle < 2_100 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// The `blocking-event` waiter: blocks in `cuEventSynchronize` on each pending event in turn
/// (the events are made with `CU_EVENT_BLOCKING_SYNC`: the thread sleeps until the driver wakes
/// it); parks on the condition variable when nothing is pending.
fn waiter_loop(p: &Poller, d: &dyn Driver, base: Instant, free_events: &Mutex<Vec<Event>>) {
    loop {
        let next = {
            let mut q = p.queue.lock().unwrap();
            loop {
                if !q.is_empty() {
                    break Some(q.remove(0));
                }
                if p.stop.load(Ordering::Acquire) {
                    break None;
                }
                q = p.cv.wait_timeout(q, Duration::from_millis(5)).unwrap().0;
            }
        };
        let Some(Pending::Event(e, w)) = next else {
            return;
        };
        // SAFETY: the event is live: it returns to the free list only here.
        if let Err(e) = unsafe { d.event_synchronize(e) } {
            // Woken all the same (its thread must not wait for ever); the run is reported bad.
            eprintln!("blocking-event: cuEventSynchronize failed: {e}");
            p.failed.store(true, Ordering::Release);
        }
        w.wake(base);
        free_events.lock().unwrap().push(e);
    }
}

fn cpu_seconds() -> f64 {
    // utime + stime of this process, in clock ticks (100 per second on Linux).
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let t = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (t(11) + t(12)) / 100.0
}

struct Setup {
    /// The doorbell stream of the `bell-*` mechanisms.
    bell: Stream,
    d: Arc<dyn Driver>,
    ctx: driver::Context,
    slab: Slab,
    base: Instant,
}

/// Per-thread state: streams, one go word, flag slots, a device word to memset.
struct Lane {
    streams: Vec<Stream>,
    go_slot: usize,
    flag_slots: Vec<usize>,
    seq: Vec<u64>,
    scratch: DevicePtr,
}

#[allow(clippy::too_many_arguments)] // a measurement helper: every input is a separate knob
fn enqueue_completion(
    m: Mech,
    su: &Setup,
    poller: &Poller,
    free_events: &Mutex<Vec<Event>>,
    s: Stream,
    slot: usize,
    seq: u64,
    w: Arc<Wake>,
) -> Res<()> {
    let d = &*su.d;
    match m {
        Mech::HostFn => {
            let base = su.base;
            // SAFETY: live stream, not capturing; the host function only wakes.
            unsafe { d.launch_host_func(s, Box::new(move || w.wake(base)))? };
        }
        Mech::EventPoller | Mech::BlockingEvent => {
            let flags = if m == Mech::BlockingEvent {
                driver::event_flags::DISABLE_TIMING | driver::event_flags::BLOCKING_SYNC
            } else {
                driver::event_flags::DISABLE_TIMING
            };
            let e = match free_events.lock().unwrap().pop() {
                Some(e) => e,
                None => d.event_create(flags)?,
            };
            // SAFETY: live event (owned by the free list / poller) and stream.
            unsafe { d.event_record(e, s)? };
            poller.queue.lock().unwrap().push(Pending::Event(e, w));
            poller.cv.notify_one();
        }
        Mech::BellEvent => {
            let e = match free_events.lock().unwrap().pop() {
                Some(e) => e,
                None => d.event_create(driver::event_flags::DISABLE_TIMING)?,
            };
            let base = su.base;
            // SAFETY: live event, streams; the host function only wakes. The event is reused
            // only after the host function ran (the doorbell stream has passed the wait).
            unsafe {
                d.event_record(e, s)?;
                d.stream_wait_event(su.bell, e)?;
                d.launch_host_func(
                    su.bell,
                    Box::new(move || {
                        w.wake(base);
                    }),
                )?;
            }
            free_events.lock().unwrap().push(e);
        }
        Mech::BellValue => {
            let base = su.base;
            let addr = DevicePtr(su.slab.dev + slot as u64 * 8);
            // SAFETY: live streams; the slot lies in the slab, which outlives the work; the
            // work's stream writes the value the doorbell stream waits for (the low half of the
            // 64-bit sequence number: little-endian, below 2^32 here).
            unsafe {
                d.stream_write_value64(s, addr, seq)?;
                d.stream_wait_value32(su.bell, addr, seq as u32, WaitValue::Geq)?;
                d.launch_host_func(su.bell, Box::new(move || w.wake(base)))?;
            }
        }
        Mech::FlagPoller => {
            // SAFETY: live stream; the slot lies in the slab, which outlives the work.
            unsafe { d.stream_write_value64(s, DevicePtr(su.slab.dev + slot as u64 * 8), seq)? };
            poller
                .queue
                .lock()
                .unwrap()
                .push(Pending::Flag(slot, seq, w));
            poller.cv.notify_one();
        }
    }
    Ok(())
}

struct Cell {
    lat_ns: Vec<u64>,
    per_s: f64,
    cpu_us_per: f64,
}

fn run_cell(
    su: &Setup,
    m: Mech,
    threads: usize,
    lanes: &mut [Lane],
    samples: usize,
    idle: Duration,
) -> Res<Cell> {
    let free_events = Mutex::new(Vec::new());
    let poller = Poller {
        queue: Mutex::new(Vec::new()),
        cv: Condvar::new(),
        stop: AtomicBool::new(false),
        failed: AtomicBool::new(false),
        flags: su.slab.host,
    };
    std::thread::scope(|sc| -> Res<Cell> {
        if !matches!(m, Mech::HostFn | Mech::BellEvent | Mech::BellValue) {
            let (p, fe, d, ctx) = (&poller, &free_events, su.d.clone(), su.ctx);
            sc.spawn(move || {
                // SAFETY: the context is live for the whole program.
                let _ = unsafe { d.ctx_set_current(ctx) };
                if m == Mech::BlockingEvent {
                    waiter_loop(p, &*d, su.base, fe)
                } else {
                    poller_loop(p, &*d, su.base, fe)
                }
            });
        }
        // Latency: each thread holds its stream on its go word, enqueues a completion, releases.
        let results: Vec<Res<(Vec<u64>, usize, Duration)>> = std::thread::scope(|ts| {
            let handles: Vec<_> = lanes[..threads]
                .iter_mut()
                .map(|lane| {
                    let (poller, fe) = (&poller, &free_events);
                    ts.spawn(move || -> Res<(Vec<u64>, usize, Duration)> {
                        let d = &*su.d;
                        // SAFETY: the context is live for the whole program.
                        unsafe { d.ctx_set_current(su.ctx)? };
                        let go =
                            unsafe { &*((su.slab.host + lane.go_slot * 8) as *const AtomicU32) };
                        let go_dev = DevicePtr(su.slab.dev + lane.go_slot as u64 * 8);
                        let s0 = lane.streams[0];
                        let mut lat = Vec::with_capacity(samples);
                        for _ in 0..samples {
                            let k = go.load(Ordering::Relaxed).wrapping_add(1);
                            // SAFETY: live stream; the go word lies in the slab; the host writes
                            // it just below.
                            unsafe { d.stream_wait_value32(s0, go_dev, k, WaitValue::Geq)? };
                            let slot = lane.flag_slots[0];
                            lane.seq[0] += 1;
                            let w = Wake::new(None);
                            enqueue_completion(
                                m,
                                su,
                                poller,
                                fe,
                                s0,
                                slot,
                                lane.seq[0],
                                w.clone(),
                            )?;
                            std::thread::sleep(idle);
                            let t0 = su.base.elapsed().as_nanos() as u64;
                            go.store(k, Ordering::Release);
                            while !w.done.load(Ordering::Acquire) {
                                std::thread::park_timeout(Duration::from_millis(100));
                            }
                            lat.push(w.at_ns.load(Ordering::Relaxed).saturating_sub(t0));
                        }
                        // Throughput: rounds over all streams of the lane.
                        let start = Instant::now();
                        let mut n = 0usize;
                        let count = Arc::new(AtomicUsize::new(0));
                        while start.elapsed() < Duration::from_millis(400) {
                            count.store(0, Ordering::Release);
                            for (i, &s) in lane.streams.iter().enumerate() {
                                // SAFETY: live stream and scratch allocation (one word per stream).
                                unsafe {
                                    d.memset_d32_async(
                                        DevicePtr(lane.scratch.0 + 4 * i as u64),
                                        i as u32,
                                        1,
                                        s,
                                    )?
                                };
                                lane.seq[i] += 1;
                                let w = Wake::new(Some(count.clone()));
                                enqueue_completion(
                                    m,
                                    su,
                                    poller,
                                    fe,
                                    s,
                                    lane.flag_slots[i],
                                    lane.seq[i],
                                    w,
                                )?;
                            }
                            while count.load(Ordering::Acquire) < lane.streams.len() {
                                std::thread::park_timeout(Duration::from_millis(100));
                            }
                            n += lane.streams.len();
                        }
                        Ok((lat, n, start.elapsed()))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
                .collect()
        });
        poller.stop.store(true, Ordering::Release);
        poller.cv.notify_all();
        if poller.failed.load(Ordering::Acquire) {
            return Err(format!("{}: a driver call of the poller failed", m.name()).into());
        }
        let mut lat = Vec::new();
        let mut n = 0;
        let mut wall = Duration::ZERO;
        for r in results {
            let (l, k, w) = r?;
            lat.extend(l);
            n += k;
            wall = wall.max(w);
        }
        Ok(Cell {
            lat_ns: lat,
            per_s: n as f64 / wall.as_secs_f64(),
            cpu_us_per: 0.0,
        })
    })
    .inspect(|_| {
        // Events handed back to the free list are destroyed by the caller's context teardown.
        for e in free_events.into_inner().unwrap() {
            // SAFETY: the event is idle (queried complete) and no longer referenced.
            let _ = unsafe { su.d.event_destroy(e) };
        }
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

fn pct(v: &mut [u64], p: f64) -> u64 {
    v.sort_unstable();
    if v.is_empty() {
        0
    } else {
        v[((v.len() - 1) as f64 * p) as usize]
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let reps: usize = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let idles: Vec<u64> = match args.iter().position(|a| a == "--idle-us") {
        Some(i) => args
            .get(i + 1)
            .map(|v| v.split(',').map(|x| x.trim().parse::<u64>()).collect())
            .unwrap_or(Ok(Vec::new()))
            .map_err(|e| format!("--idle-us takes a comma-separated list of microseconds: {e}"))?,
        None => vec![50],
    };
    if idles.is_empty() {
        return Err("--idle-us takes a comma-separated list of microseconds".into());
    }
    let (d, _) = driver::load(Choice::Cuda)
        .map_err(|e| format!("completion_mechanisms needs an NVIDIA GPU: {e}"))?;
    let dev = d.device_get(0)?;
    let ctx = d.primary_ctx_retain(dev)?;
    // SAFETY: retained just above, released at the end.
    unsafe { d.ctx_set_current(ctx)? };
    let threads_max = 16;
    let per_lane = 32;
    let slots = threads_max * (per_lane + 1);
    let host = d.mem_host_alloc(
        slots * 8,
        host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE,
    )?;
    // SAFETY: just allocated with DEVICEMAP.
    let dev_ptr = unsafe { d.mem_host_get_device_pointer(host)? };
    // SAFETY: the allocation is `slots * 8` bytes.
    unsafe { std::ptr::write_bytes(host, 0, slots * 8) };
    let su = Setup {
        bell: d.stream_create(driver::stream_flags::NON_BLOCKING, 0)?,
        d: d.clone(),
        ctx,
        slab: Slab {
            host: host as usize,
            dev: dev_ptr.0,
        },
        base: Instant::now(),
    };
    let mut lanes = Vec::new();
    for t in 0..threads_max {
        let mut streams = Vec::new();
        for _ in 0..per_lane {
            streams.push(d.stream_create(driver::stream_flags::NON_BLOCKING, 0)?);
        }
        // SAFETY: live stream; freed at the end after a synchronize.
        let scratch = unsafe { d.mem_alloc_async(per_lane * 4, streams[0])? };
        // SAFETY: live stream.
        unsafe { d.stream_synchronize(streams[0])? };
        lanes.push(Lane {
            streams,
            go_slot: t * (per_lane + 1),
            flag_slots: (0..per_lane).map(|i| t * (per_lane + 1) + 1 + i).collect(),
            seq: vec![0; per_lane],
            scratch,
        });
    }
    let device = d.device_name(dev)?;
    println!("completion mechanisms on {device}: {reps} interleaved repeats");
    let mechs = [
        Mech::HostFn,
        Mech::EventPoller,
        Mech::FlagPoller,
        Mech::BlockingEvent,
        Mech::BellEvent,
        Mech::BellValue,
    ];
    type Series = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);
    let mut agg: BTreeMap<(u64, usize, Mech), Series> = BTreeMap::new();
    for rep in 0..reps {
        for &idle_us in &idles {
            for &threads in &[1usize, 16] {
                for &m in &mechs {
                    // About two seconds of latency samples per cell, at most 300.
                    let samples = (2_000_000 / idle_us.max(1)).clamp(20, 300) as usize;
                    let c0 = cpu_seconds();
                    let idle = Duration::from_micros(idle_us);
                    let mut cell = run_cell(&su, m, threads, &mut lanes, samples, idle)?;
                    let cpu = cpu_seconds() - c0;
                    let done = cell.per_s * 0.4 + (samples * threads) as f64;
                    cell.cpu_us_per = cpu * 1e6 / done.max(1.0);
                    let (p50, p99) = (pct(&mut cell.lat_ns, 0.5), pct(&mut cell.lat_ns, 0.99));
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({"rep": rep, "mechanism": m.name(), "threads": threads,
                                "idle_us": idle_us, "latency_p50_ns": p50, "latency_p99_ns": p99,
                                "completions_per_s": cell.per_s,
                                "cpu_us_per_completion": cell.cpu_us_per})
                        );
                    }
                    let e = agg.entry((idle_us, threads, m)).or_default();
                    e.0.push(p50 as f64);
                    e.1.push(p99 as f64);
                    e.2.push(cell.per_s);
                    e.3.push(cell.cpu_us_per);
                }
            }
        }
    }
    println!("| idle before release (µs) | threads | mechanism | latency p50 (µs) | latency p99 (µs) | completions/s | CPU µs per completion | extra threads |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for ((idle_us, threads, m), (a, b, c, e)) in agg.iter_mut() {
        println!(
            "| {idle_us} | {threads} | {} | {:.1} | {:.1} | {:.0} | {:.2} | {} |",
            m.name(),
            median(a) / 1e3,
            median(b) / 1e3,
            median(c),
            median(e),
            match m {
                Mech::HostFn | Mech::BellEvent | Mech::BellValue => "0 (driver's)",
                Mech::BlockingEvent => "1 waiter",
                _ => "1 poller",
            }
        );
    }
    // Ratios within the run (medians): throughput and p50 latency against hostfn.
    for &idle_us in &idles {
        for threads in [1usize, 16] {
            let base = agg
                .get(&(idle_us, threads, Mech::HostFn))
                .map(|x| (x.0.clone(), x.2.clone()));
            if let Some((mut l0, mut t0)) = base {
                let (l0, t0) = (median(&mut l0), median(&mut t0));
                for m in [
                    Mech::EventPoller,
                    Mech::FlagPoller,
                    Mech::BlockingEvent,
                    Mech::BellEvent,
                    Mech::BellValue,
                ] {
                    if let Some(x) = agg.get(&(idle_us, threads, m)) {
                        let (mut l, mut t) = (x.0.clone(), x.2.clone());
                        println!(
                            "idle {idle_us} µs, {threads} threads: {} / hostfn: latency {:.2}x, throughput {:.2}x",
                            m.name(),
                            median(&mut l) / l0,
                            median(&mut t) / t0
                        );
                    }
                }
            }
        }
    }
    // SAFETY: everything is idle after the synchronize; handles are destroyed once.
    unsafe {
        d.ctx_synchronize()?;
        for lane in &lanes {
            d.mem_free_async(lane.scratch, lane.streams[0])?;
            d.stream_synchronize(lane.streams[0])?;
            for &s in &lane.streams {
                d.stream_destroy(s)?;
            }
        }
        d.stream_destroy(su.bell)?;
        d.mem_free_host(host)?;
        d.primary_ctx_release(dev)?;
    }
    Ok(())
}
