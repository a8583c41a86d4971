//! Helpers shared by the test files: drivers, a raw context, and a gate that holds a stream busy.
#![allow(dead_code)]

pub mod stall;

use cuda_stream_pool::driver::{self, Choice, Driver, SimDriver, Stream};
use cuda_stream_pool::Context;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

/// A simulated driver with a manual clock.
pub fn sim() -> Arc<dyn Driver> {
    Arc::new(SimDriver::new())
}

/// A simulated driver of two devices, with a manual clock.
pub fn sim_two_devices() -> Arc<SimDriver> {
    Arc::new(SimDriver::with_config(driver::SimConfig {
        devices: 2,
        ..driver::SimConfig::default()
    }))
}

/// The real driver; panics (failing the GPU test) when there is none.
pub fn cuda() -> Arc<dyn Driver> {
    driver::load(Choice::Cuda)
        .unwrap_or_else(|e| panic!("GPU test without a usable CUDA driver: {e}"))
        .0
}

/// A context of the crate on device 0.
pub fn ctx(d: &Arc<dyn Driver>) -> Context {
    Context::primary(d.clone(), 0).expect("primary context")
}

/// The primary context retained and made current on this thread, for driver-level scenarios.
pub struct Env {
    pub d: Arc<dyn Driver>,
    pub dev: driver::Device,
    pub ctx: driver::Context,
}

impl Env {
    pub fn new(d: &Arc<dyn Driver>) -> Env {
        // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
        unsafe {
            d.init().unwrap();
            let dev = d.device_get(0).unwrap();
            let ctx = d.primary_ctx_retain(dev).unwrap();
            d.ctx_set_current(ctx).unwrap();
            Env {
                d: d.clone(),
                dev,
                ctx,
            }
        }
    }

    pub fn stream(&self) -> Stream {
        self.d
            .stream_create(driver::stream_flags::NON_BLOCKING, 0)
            .unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
        unsafe {
            let _ = self.d.primary_ctx_release(self.dev);
        }
    }
}

/// A capture in global mode running on another thread: begun when `new` returns, ended (and
/// its result returned) by `end`.
pub struct ForeignCapture {
    go: mpsc::Sender<()>,
    thread: std::thread::JoinHandle<cuda_stream_pool::Result<driver::Graph>>,
}

impl ForeignCapture {
    pub fn new(d: &Arc<dyn Driver>, ctx: driver::Context, s: Stream) -> ForeignCapture {
        // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
        unsafe {
            let (began, wait_begin) = mpsc::channel();
            let (go, wait_go) = mpsc::channel::<()>();
            let d = d.clone();
            let thread = std::thread::spawn(move || {
                d.ctx_set_current(ctx).unwrap();
                d.stream_begin_capture(s, driver::CaptureMode::Global)
                    .unwrap();
                began.send(()).unwrap();
                wait_go.recv().unwrap();
                d.stream_end_capture(s)
            });
            wait_begin.recv().unwrap();
            ForeignCapture { go, thread }
        }
    }

    pub fn end(self) -> cuda_stream_pool::Result<driver::Graph> {
        self.go.send(()).unwrap();
        self.thread.join().unwrap()
    }
}

/// Panics unless a capture (the caller's own, or another thread's) ended well: it survived
/// whatever the test did while it was live.
pub fn capture_survives<G>(r: cuda_stream_pool::Result<G>) {
    if let Err(e) = r {
        panic!("the capture must survive: {e}");
    }
}

/// Holds a stream busy with a host function that waits until the gate is opened (or 30 s pass,
/// so that a bug turns into a failure rather than a hang).
pub struct Gate {
    tx: Option<mpsc::Sender<()>>,
}

impl Gate {
    pub fn on(d: &dyn Driver, s: Stream) -> Gate {
        // SAFETY: a raw driver scenario: every handle below is made here and used only while live.
        unsafe {
            let (tx, rx) = mpsc::channel::<()>();
            d.launch_host_func(
                s,
                Box::new(move || {
                    let _ = rx.recv_timeout(Duration::from_secs(30));
                }),
            )
            .unwrap();
            Gate { tx: Some(tx) }
        }
    }

    pub fn open(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(());
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}

/// GPU tests share one process-wide driver: a capture in global mode on one test's thread makes
/// "unsafe" calls (synchronize, query) on every other thread in global mode fail and invalidates
/// the capture. Each GPU test holds this lock so that tests of one binary never overlap.
pub static GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes the GPU lock (a failed test poisons it; that does not matter here).
pub fn gpu_lock() -> std::sync::MutexGuard<'static, ()> {
    GPU.lock().unwrap_or_else(|p| p.into_inner())
}

/// Generates, for each scenario `fn name(d: &Arc<dyn Driver>)`, a test on the simulated driver
/// (module `sim`) and a GPU test (module `gpu`).
#[macro_export]
macro_rules! on_both_drivers {
    ($($name:ident),* $(,)?) => {
        mod sim {
            $(
                #[test]
                fn $name() {
                    super::$name(&super::common::sim());
                }
            )*
        }
        mod gpu {
            $(
                #[test]
                #[ignore = "needs an NVIDIA GPU"]
                fn $name() {
                    let _serial = super::common::gpu_lock();
                    super::$name(&super::common::cuda());
                }
            )*
        }
    };
}

/// The `cuDevicePrimaryCtxRelease_v2` calls in `sim`'s log, made or refused: the last driver call
/// of a state's teardown.
pub fn primary_releases(sim: &SimDriver) -> usize {
    sim.calls()
        .iter()
        .filter(|c| c.name == "cuDevicePrimaryCtxRelease_v2")
        .count()
}

/// Returns once `sim` has logged more than `before` primary-context releases: the teardown of
/// a state dropped after `before` was read has completed. The last clone of a context may be
/// dropped while the completion poller still runs a waker of one of its futures; its teardown
/// is then handed to a thread of its own and completes after the drop returns. (Not for a test
/// that clears the call log.) A 60 s bound reports a hang only.
pub fn await_teardown(sim: &SimDriver, before: usize) {
    let hang = std::time::Instant::now() + Duration::from_secs(60);
    while primary_releases(sim) <= before {
        assert!(
            std::time::Instant::now() < hang,
            "a hang: the context's teardown never completed"
        );
        std::thread::yield_now();
    }
}

/// After the last context of `sim` is gone: waits (a 60 s bound reports a hang only) until its
/// teardown has released it (the page-locked memory that teardowns keep for a context's next
/// state, and the primary context's retain with it, count as released once released; a
/// context dropped by the completion poller's waker is torn down on a thread of its own), then
/// asserts that nothing is left (contexts, allocations, host allocations, streams, events) and
/// that the simulation saw no misuse.
pub fn assert_clean(sim: &SimDriver) {
    let t = std::time::Instant::now();
    while cuda_stream_pool::release_pinned_cache(sim).is_ok()
        && sim.counters().live_contexts > 0
        && t.elapsed() < Duration::from_secs(60)
    {
        std::thread::yield_now();
    }
    let c = sim.counters();
    assert_eq!(c.live_contexts, 0, "{c:?}");
    assert_eq!(c.live_allocs, 0, "{c:?}");
    assert_eq!(c.live_host_allocs, 0, "{c:?}");
    assert_eq!(c.live_streams, 0, "{c:?}");
    assert_eq!(c.live_events, 0, "{c:?}");
    assert!(sim.misuse().is_empty(), "{:?}", sim.misuse());
}

/// A waker that drops the `Context` it holds when woken (the last one, in the tests that use
/// it: the completion poller then runs a context's teardown from a waker), then says so on
/// `done`.
pub struct DropsContext {
    pub ctx: std::sync::Mutex<Option<Context>>,
    pub done: std::sync::Mutex<mpsc::Sender<()>>,
}

impl DropsContext {
    /// A waker of `ctx` that reports on `done`.
    pub fn waker(ctx: Context, done: mpsc::Sender<()>) -> std::task::Waker {
        std::task::Waker::from(Arc::new(DropsContext {
            ctx: std::sync::Mutex::new(Some(ctx)),
            done: std::sync::Mutex::new(done),
        }))
    }
}

impl std::task::Wake for DropsContext {
    fn wake(self: Arc<Self>) {
        let c = self.ctx.lock().unwrap().take();
        drop(c);
        let _ = self.done.lock().unwrap().send(());
    }
}

/// Polls `f` on this thread until it is ready, parking between wake-ups (each wake-up unparks).
#[allow(dead_code)]
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// Runs `f` on a thread of its own and returns its result (a panic in it continues here); a
/// hang guard only: reports "hung" when it has not finished after 60 s, never decides a pass.
#[allow(dead_code)]
pub fn finishes<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(Ok(v)) => v,
        Ok(Err(p)) => std::panic::resume_unwind(p),
        Err(_) => panic!("hung: {what} did not finish within 60 s"),
    }
}

/// A launcher of a kernel that faults the current context (`CUDA_ERROR_ILLEGAL_ADDRESS`): the
/// crate's `csp_add_u32` given address 0x10. Loads the module now (in the thread's current
/// context; on the H200 a module load waits for every stream of the device, so load it before
/// any stream is held busy); the returned function launches it on a live, non-capturing stream
/// of that context.
pub fn faulting_kernel(d: &Arc<dyn Driver>) -> impl Fn(Stream) {
    let ptx = std::ffi::CStr::from_bytes_with_nul(cuda_stream_pool::kernels::PTX.as_bytes())
        .expect("the PTX ends with a NUL");
    let m = d.module_load_data(ptx).expect("load the crate's kernels");
    // SAFETY: `m` was just loaded.
    let f = unsafe { d.module_get_function(m, c"csp_add_u32") }.expect("csp_add_u32");
    let d = d.clone();
    move |s| {
        let (mut x, mut n, mut v) = (0x10u64, 1u32 << 20, 1u32);
        let mut params = [
            &mut x as *mut u64 as *mut std::ffi::c_void,
            &mut n as *mut u32 as *mut std::ffi::c_void,
            &mut v as *mut u32 as *mut std::ffi::c_void,
        ];
        // SAFETY: `s` is a live, non-capturing stream of the context the module was loaded in
        // (the caller's contract); the parameters match the kernel's. The pointer is
        // deliberately invalid: the kernel faults the context (the point of the tests that use
        // it), which affects nothing outside this process's device.
        unsafe { d.launch_kernel(f, [4096, 1, 1], [256, 1, 1], 0, s, &mut params) }
            .expect("launch the faulting kernel");
    }
}
