//! While a `cuStreamCreate` is blocked behind a GPU-side wait (see `differential_stall.rs`), do
//! other threads' driver calls in the context wait for it too?
//!
//! This decides whether a thread that holds a stream behind a host-mapped word and then calls
//! the driver before it writes the word can deadlock the process: another thread's create
//! blocks behind the wait, and the first thread's call behind the create. Measured on the H200
//! (2026-12-02): every call listed waited, `cuCtxGetCurrent` included. The simulation blocks
//! only the creates (`SimConfig::create_stall_at`); it does not model the others' wait yet,
//! and its scenario only checks that the measurement runs. A binary of its own: the GPU
//! scenario must be the first in its process to create that many streams (the driver reuses
//! destroyed streams' resources).

mod common;

use common::stall::{with_watchdog, HostWord, Trigger};
use common::Env;
use cuda_stream_pool::driver::{stream_flags, Driver, Stream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// The calls made on a third thread while a create is blocked, by name.
const CALLS: [&str; 6] = [
    "cuLaunchHostFunc",
    "cuStreamQuery",
    "cuEventCreate+cuEventDestroy",
    "cuMemAllocAsync+cuMemFreeAsync",
    "cuStreamCreate (non-blocking, while the driver has no spare stream)",
    "cuCtxGetCurrent",
];

/// Makes call `i` of [`CALLS`] on `x` (a live stream of the current context).
fn call(d: &Arc<dyn Driver>, i: usize, x: Stream, made: &mut Vec<Stream>) {
    // SAFETY: `x` is live and not capturing; every handle made here is destroyed here, or
    // returned in `made` for the caller to destroy once the wait is released.
    unsafe {
        match i {
            0 => d.launch_host_func(x, Box::new(|| {})).unwrap(),
            1 => {
                d.stream_query(x).unwrap();
            }
            2 => {
                let e = d.event_create(0).unwrap();
                d.event_destroy(e).unwrap();
            }
            3 => {
                let p = d.mem_alloc_async(4096, x).unwrap();
                d.mem_free_async(p, x).unwrap();
            }
            4 => made.push(d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap()),
            _ => {
                d.ctx_get_current().unwrap();
            }
        }
    }
}

/// For each of [`CALLS`]: did it return only after the wait was released?
fn calls_behind_a_blocked_create(
    d: &Arc<dyn Driver>,
    trigger: Trigger,
) -> Vec<(&'static str, bool)> {
    const N: usize = 63;
    let e = Env::new(d);
    let word = HostWord::new(d);
    let w = e.stream();
    let x = e.stream();
    // SAFETY: `w` is live and not capturing; the watchdog sets the word before `w` is
    // synchronized and destroyed, and before the word is dropped.
    unsafe { word.hold(w, 1) };
    let (d2, ctx) = (d.clone(), e.ctx);
    let sim_trigger = match &trigger {
        Trigger::Sim(s) => Some(s.clone()),
        Trigger::After(_) => None,
    };
    let (results, creates) = with_watchdog(&word, 1, &trigger, move |released| {
        // The creator: fresh streams until one blocks behind the wait.
        let made = Arc::new(AtomicUsize::new(0));
        let creating = Arc::new(AtomicBool::new(true));
        let creator = {
            let (d, made, creating) = (d2.clone(), made.clone(), creating.clone());
            std::thread::spawn(move || {
                // SAFETY: the scenario's context, retained by `Env` until the scenario ends.
                unsafe { d.ctx_set_current(ctx) }.unwrap();
                let v: Vec<Stream> = (0..N)
                    .map(|_| {
                        let s = d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap();
                        made.fetch_add(1, Ordering::AcqRel);
                        s
                    })
                    .collect();
                creating.store(false, Ordering::Release);
                v
            })
        };
        // Wait until the creator is blocked: on the simulation its state says so; on the GPU
        // its count stops moving for 200 ms (the watchdog releases after seconds).
        match &sim_trigger {
            Some(sim) => {
                while sim.blocked_creates() == 0 && creating.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
            }
            None => loop {
                let n = made.load(Ordering::Acquire);
                std::thread::sleep(std::time::Duration::from_millis(200));
                if n == made.load(Ordering::Acquire) || !creating.load(Ordering::Acquire) {
                    break;
                }
            },
        }
        // On the simulation the release may already have let the creator finish: its count of
        // stalled creates says whether one blocked. On the GPU, the creator is still creating.
        let blocked = match &sim_trigger {
            Some(sim) => sim.counters().stalled_creates > 0,
            None => creating.load(Ordering::Acquire),
        };
        // SAFETY: as above.
        unsafe { d2.ctx_set_current(ctx) }.unwrap();
        let mut extra = Vec::new();
        let results: Vec<(&'static str, bool)> = (0..CALLS.len())
            .map(|i| {
                call(&d2, i, x, &mut extra);
                (CALLS[i], released.load(Ordering::Acquire))
            })
            .collect();
        let mut streams = creator.join().unwrap();
        streams.extend(extra);
        assert!(blocked, "no create blocked behind the wait");
        (results, streams)
    });
    // SAFETY: every stream is live; the wait was released.
    unsafe {
        d.stream_synchronize(w).unwrap();
        d.stream_synchronize(x).unwrap();
        for s in creates.into_iter().chain([w, x]) {
            d.stream_destroy(s).unwrap();
        }
    }
    for (c, late) in &results {
        eprintln!(
            "{c}: {}",
            if *late {
                "waited for the release"
            } else {
                "returned"
            }
        );
    }
    results
}

mod sim {
    use super::common::stall::Trigger;
    use cuda_stream_pool::driver::{Driver, SimConfig, SimDriver, H200_CREATE_STALL_AT};
    use std::sync::Arc;

    #[test]
    fn other_threads_calls_behind_a_blocked_create() {
        let sim = Arc::new(SimDriver::with_config(SimConfig {
            create_stall_at: Some(H200_CREATE_STALL_AT),
            ..SimConfig::default()
        }));
        let d: Arc<dyn Driver> = sim.clone();
        let r = super::calls_behind_a_blocked_create(&d, Trigger::Sim(sim.clone()));
        assert_eq!(r.len(), super::CALLS.len());
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

mod gpu {
    use super::common::stall::Trigger;
    use std::time::Duration;

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn other_threads_calls_behind_a_blocked_create() {
        let _serial = super::common::gpu_lock();
        let r = super::calls_behind_a_blocked_create(
            &super::common::cuda(),
            Trigger::After(Duration::from_secs(3)),
        );
        let returned: Vec<_> = r.iter().filter(|(_, late)| !late).collect();
        assert!(
            returned.is_empty(),
            "returned during a blocked create: {returned:?}"
        );
    }
}
