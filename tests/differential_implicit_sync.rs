//! Which driver calls wait for another stream's work: each call is made on a thread of its own
//! while a stream of the context is held by a GPU-side wait (`cuStreamWaitValue32` on
//! host-mapped memory), which a watchdog releases; a call that returns only after the release
//! waited for that stream.
//!
//! Measured on the H200 (2026-12-02): `cuCtxSynchronize`, `cuMemFreeHost`, `cuModuleLoadData`
//! and `cuModuleUnload` wait; the other calls listed return. The simulation notes the four in
//! `SimDriver::device_waits` when a stream is busy, without waiting.
//!
//! Such a call is a deadlock waiting to happen in a process where a stream waits for the host
//! (a flag a thread writes after its next driver call, as NCCL's proxies and this crate's stress
//! program do): on the H200 the waiting call also holds a lock of the driver that every other
//! thread's call in the context needs (`differential_stall_others.rs` shows it for a blocked
//! create), so the thread that would release the wait cannot make its call. The crate must make
//! none of these calls where the user did not ask for a wait.

mod common;

use common::stall::{with_watchdog, HostWord, Trigger};
use common::Env;
use cuda_stream_pool::driver::{host_alloc_flags, stream_flags, Driver, Stream};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The calls measured, by name.
pub const CALLS: [&str; 12] = [
    "cuCtxSynchronize",
    "cuStreamQuery (of another stream)",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuStreamCreate (resources to spare)",
    "cuStreamDestroy (an idle stream)",
    "cuEventCreate+cuEventDestroy",
    "cuMemPoolCreate",
    "cuMemPoolDestroy (an unused pool)",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuMemAllocAsync+cuMemFreeAsync (another stream)",
];

/// The calls of [`CALLS`] that waited for the held stream on the H200.
pub const WAITING_ON_THE_H200: [&str; 4] = [
    "cuCtxSynchronize",
    "cuMemFreeHost",
    "cuModuleLoadData",
    "cuModuleUnload",
];

/// What a call needs, made before the wait.
struct Prepared {
    host: *mut u8,
    idle: Stream,
    other: Stream,
    pool: cuda_stream_pool::driver::MemPool,
    module: cuda_stream_pool::driver::Module,
}

// SAFETY: handles and a pointer; each call uses (or destroys) its own, once.
unsafe impl Send for Prepared {}
// SAFETY: as above.
unsafe impl Sync for Prepared {}

fn prepare(d: &Arc<dyn Driver>, dev: cuda_stream_pool::driver::Device) -> Prepared {
    let ptx =
        std::ffi::CStr::from_bytes_with_nul(cuda_stream_pool::kernels::PTX.as_bytes()).unwrap();
    Prepared {
        host: d
            .mem_host_alloc(
                4096,
                host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE,
            )
            .unwrap(),
        idle: d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap(),
        other: d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap(),
        pool: d.mem_pool_create(dev).unwrap(),
        module: d.module_load_data(ptx).unwrap(),
    }
}

/// Makes call `i` of [`CALLS`]; `p`'s handles are consumed by the calls that destroy them.
fn call(d: &Arc<dyn Driver>, i: usize, p: &Prepared, dev: cuda_stream_pool::driver::Device) {
    let ptx =
        std::ffi::CStr::from_bytes_with_nul(cuda_stream_pool::kernels::PTX.as_bytes()).unwrap();
    // SAFETY: every handle is live and used as its call allows; each destroyed one (the host
    // block, the idle stream, the pool, the module) is destroyed once, by its call here.
    unsafe {
        match i {
            0 => d.ctx_synchronize().unwrap(),
            1 => {
                d.stream_query(p.other).unwrap();
            }
            2 => {
                let h = d.mem_host_alloc(4096, host_alloc_flags::PORTABLE).unwrap();
                // Freed at the end of `measure`.
                LATER.lock().unwrap().push(h as usize);
            }
            3 => d.mem_free_host(p.host).unwrap(),
            4 => LATER_STREAMS
                .lock()
                .unwrap()
                .push(d.stream_create(stream_flags::NON_BLOCKING, 0).unwrap()),
            5 => d.stream_destroy(p.idle).unwrap(),
            6 => {
                let e = d.event_create(0).unwrap();
                d.event_destroy(e).unwrap();
            }
            7 => {
                let pool = d.mem_pool_create(dev).unwrap();
                LATER_POOLS.lock().unwrap().push(pool);
            }
            8 => d.mem_pool_destroy(p.pool).unwrap(),
            9 => {
                let m = d.module_load_data(ptx).unwrap();
                LATER_MODULES.lock().unwrap().push(m);
            }
            10 => d.module_unload(p.module).unwrap(),
            _ => {
                let ptr = d.mem_alloc_async(4096, p.other).unwrap();
                d.mem_free_async(ptr, p.other).unwrap();
            }
        }
    }
}

static LATER: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
static LATER_STREAMS: std::sync::Mutex<Vec<Stream>> = std::sync::Mutex::new(Vec::new());
static LATER_POOLS: std::sync::Mutex<Vec<cuda_stream_pool::driver::MemPool>> =
    std::sync::Mutex::new(Vec::new());
static LATER_MODULES: std::sync::Mutex<Vec<cuda_stream_pool::driver::Module>> =
    std::sync::Mutex::new(Vec::new());

/// For each of [`CALLS`]: did it return only after the held stream was released?
pub fn measure(d: &Arc<dyn Driver>, trigger: impl Fn() -> Trigger) -> Vec<(&'static str, bool)> {
    let e = Env::new(d);
    let word = HostWord::new(d);
    let w = e.stream();
    let p = Arc::new(prepare(d, e.dev));
    let mut out = Vec::new();
    for (i, name) in CALLS.iter().enumerate() {
        let v = i as u32 + 1;
        // SAFETY: `w` is live and not capturing; the watchdog sets the word to `v` before `w`
        // is synchronized and destroyed, and before the word is dropped.
        unsafe { word.hold(w, v) };
        let (d2, ctx, p2, dev) = (d.clone(), e.ctx, p.clone(), e.dev);
        let late = with_watchdog(&word, v, &trigger(), move |released| {
            // SAFETY: the scenario's context, retained by `Env` until the scenario ends.
            unsafe { d2.ctx_set_current(ctx) }.unwrap();
            call(&d2, i, &p2, dev);
            released.load(Ordering::Acquire)
        });
        // SAFETY: released above.
        unsafe { d.stream_synchronize(w) }.unwrap();
        eprintln!(
            "{name}: {}",
            if late {
                "waited for the held stream"
            } else {
                "returned"
            }
        );
        out.push((*name, late));
    }
    // SAFETY: every handle below is live, nothing uses it any more, destroyed once.
    unsafe {
        for h in LATER.lock().unwrap().drain(..) {
            d.mem_free_host(h as *mut u8).unwrap();
        }
        for s in LATER_STREAMS.lock().unwrap().drain(..).chain([p.other, w]) {
            d.stream_destroy(s).unwrap();
        }
        for pool in LATER_POOLS.lock().unwrap().drain(..) {
            d.mem_pool_destroy(pool).unwrap();
        }
        for m in LATER_MODULES.lock().unwrap().drain(..) {
            d.module_unload(m).unwrap();
        }
    }
    out
}

mod sim {
    use super::common::stall::Trigger;
    use cuda_stream_pool::driver::{Driver, SimDriver};
    use std::sync::Arc;

    #[test]
    fn calls_that_wait_for_another_stream() {
        let sim = Arc::new(SimDriver::new());
        let d: Arc<dyn Driver> = sim.clone();
        let r = super::measure(&d, || Trigger::After(std::time::Duration::from_millis(50)));
        assert_eq!(r.len(), super::CALLS.len());
        // The simulation does not wait; it notes the calls that would.
        let noted: Vec<String> = sim.device_waits();
        assert_eq!(noted.len(), super::WAITING_ON_THE_H200.len(), "{noted:#?}");
        for (n, c) in noted.iter().zip(super::WAITING_ON_THE_H200) {
            assert!(n.starts_with(c), "{n} is not {c}");
        }
        assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
    }
}

mod gpu {
    use super::common::stall::Trigger;
    use std::time::Duration;

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn calls_that_wait_for_another_stream() {
        let _serial = super::common::gpu_lock();
        let r = super::measure(&super::common::cuda(), || {
            Trigger::After(Duration::from_secs(1))
        });
        let waited: Vec<&str> = r.iter().filter(|(_, l)| *l).map(|(c, _)| *c).collect();
        assert_eq!(waited, super::WAITING_ON_THE_H200);
    }
}
