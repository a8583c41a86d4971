//! Host functions: the crate's wrapper that marks the thread running one, and the rule that
//! follows. The driver must not be called there (the real driver refuses or deadlocks), waiting
//! for the GPU would wait for the running host function itself, and user code (a waker that
//! polls its future inline) must not be run there either. Just above the driver layer (whose
//! device rules read the thread's mark): used by the pool, the context and everything above.

use crate::driver;
use crate::sync::Mutex;
use std::sync::Arc;

pub(crate) use crate::driver::on_host_fn_thread;

thread_local! {
    static CRATE_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Marks the calling thread as one of the crate's own background threads (the completion
/// poller, the waker and loans threads, the threads that run teardowns and drops): no implicit
/// owner is made there, as on a host function's thread (such a thread outlives every context,
/// or never exits, so an owner made there would keep its context alive for ever).
pub(crate) fn mark_crate_thread() {
    let _ = CRATE_THREAD.try_with(|c| c.set(true));
}

/// Whether the calling thread is one of the crate's own background threads
/// ([`mark_crate_thread`]).
pub(crate) fn on_crate_thread() -> bool {
    CRATE_THREAD.try_with(|c| c.get()).unwrap_or(false)
}

/// Wraps a host function so that the crate's destructors know they run in one (the closure's
/// captures are dropped inside it).
pub(crate) fn host_fn(f: impl FnOnce() + Send + 'static) -> driver::HostFn {
    Box::new(move || driver::as_host_fn_thread(f))
}

/// Runs a destructor's driver work now, or, on a host-function thread, on a thread of its own
/// (if no thread can be started, the work is leaked: leaking is safe, calling the driver from a
/// host function is not).
pub(crate) fn off_host_fn_thread(f: impl FnOnce() + Send + 'static) {
    if !on_host_fn_thread() {
        return f();
    }
    on_thread_of_its_own(f)
}

/// Runs a destructor's work on a thread of its own, detached (if no thread can be started, the
/// work is leaked: leaking is safe, running it where it cannot complete is not).
///
/// Counted for the model while pending (`sync::background_queued`): its driver calls happen at
/// a time of the machine's choosing, so the model waits for it before its next step.
pub(crate) fn on_thread_of_its_own(f: impl FnOnce() + Send + 'static) {
    let job = Arc::new(Mutex::new(Some(f)));
    let run = job.clone();
    crate::sync::background_queued();
    let spawned = std::thread::Builder::new()
        .name("cuda-stream-pool-drop".into())
        .spawn(move || {
            mark_crate_thread();
            // Taken out first: the work runs without the job's lock.
            let f = run.lock().take();
            if let Some(f) = f {
                f()
            }
            crate::sync::background_ran();
        });
    if spawned.is_err() {
        let f = job.lock().take();
        std::mem::forget(f);
        crate::sync::background_ran();
    }
}

/// Wakes an async task, containing a panicking waker. On a host-function thread the waker is
/// not run there (a waker may poll its future inline, and that code may call the driver): it is
/// handed to one waker thread of the process ("cuda-stream-pool-wake", started on first need,
/// idle otherwise), which runs it.
pub(crate) fn wake_task(w: std::task::Waker) {
    fn run(w: std::task::Waker) {
        // A waker may poll its future inline: user code, run outside the device rules' scopes.
        driver::outside_scopes(|| {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wake()));
        });
    }
    if !on_host_fn_thread() {
        return run(w);
    }
    /// A waker handed to a background thread: counted for the model while pending (see
    /// `sync::background_queued`), and counted as run when run or dropped.
    struct Bg(Option<std::task::Waker>);
    impl Bg {
        fn run(mut self) {
            if let Some(w) = self.0.take() {
                run(w);
            }
        }
    }
    impl Drop for Bg {
        fn drop(&mut self) {
            crate::sync::background_ran();
        }
    }
    crate::sync::background_queued();
    let w = Bg(Some(w));
    static WAKER_THREAD: std::sync::OnceLock<Option<std::sync::mpsc::Sender<Bg>>> =
        std::sync::OnceLock::new();
    let tx = WAKER_THREAD.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Bg>();
        std::thread::Builder::new()
            .name("cuda-stream-pool-wake".into())
            .spawn(move || {
                mark_crate_thread();
                for w in rx {
                    w.run();
                }
            })
            .ok()
            .map(|_| tx)
    });
    /// Wakes from a thread of its own; else (no thread can be started: resources exhausted) the
    /// task is woken here, which is only wrong if its waker polls inline.
    fn on_own_thread(w: Bg) {
        let cell = Arc::new(Mutex::new(Some(w)));
        let c2 = cell.clone();
        let spawned = std::thread::Builder::new()
            .name("cuda-stream-pool-wake".into())
            .spawn(move || {
                mark_crate_thread();
                // Taken out first: the waker runs without the cell's lock.
                let w = c2.lock().take();
                if let Some(w) = w {
                    w.run()
                }
            });
        if spawned.is_err() {
            let w = cell.lock().take();
            if let Some(w) = w {
                w.run()
            }
        }
    }
    match tx {
        // The thread never exits while the sender lives; should the send fail all the same,
        // the waker is not lost.
        Some(tx) => {
            if let Err(e) = tx.send(w) {
                on_own_thread(e.0)
            }
        }
        None => on_own_thread(w),
    }
}
