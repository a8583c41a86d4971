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

/// A task's waker kept by the crate (a waiter of the pool's gate, a pending completion, a
/// wake-up after a poll). A waker's clone, wake and drop are user code, which may re-enter the
/// crate, change the thread's current context or capture mode, or poll its future inline; this
/// type is the one place that runs them, so that every call site keeps the rules:
///
/// * each runs outside the device rules' scopes (`driver::outside_scopes`): user code sees the
///   thread's context and capture mode as the crate's caller left them, and what it changes
///   there cannot mislead an open scope into skipping a switch (review 26);
/// * a wake or drop on a host-function thread runs on the waker thread instead (user code may
///   call the driver, which a host function must not);
/// * a panicking waker is contained;
/// * none runs under a lock of the crate: checked in every test build (`sync::locks_held`).
pub(crate) struct TaskWaker(Option<std::task::Waker>);

impl TaskWaker {
    /// A clone of `w`, made outside the scopes.
    pub(crate) fn new(w: &std::task::Waker) -> TaskWaker {
        no_lock_held("a waker's clone");
        TaskWaker(Some(driver::outside_scopes(|| w.clone())))
    }

    /// Whether waking this one would wake the task that `w` wakes (no user code).
    pub(crate) fn will_wake(&self, w: &std::task::Waker) -> bool {
        self.0.as_ref().is_some_and(|k| k.will_wake(w))
    }

    /// Wakes the task (see the type's rules).
    pub(crate) fn wake(mut self) {
        if let Some(w) = self.0.take() {
            run_user(Job::Wake(w));
        }
    }

    /// Wakes the task through a shared reference: the waker's own `wake` if this is the last
    /// reference, else `wake_by_ref` (no clone).
    pub(crate) fn wake_shared(this: Arc<TaskWaker>) {
        match Arc::try_unwrap(this) {
            Ok(w) => w.wake(),
            Err(shared) => run_user(Job::WakeShared(shared)),
        }
    }
}

impl Drop for TaskWaker {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            run_user(Job::Drop(w));
        }
    }
}

impl std::fmt::Debug for TaskWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskWaker").finish_non_exhaustive()
    }
}

/// Fails (in a test build) when the calling thread holds a lock of the crate: `what`, user
/// code, is about to run.
fn no_lock_held(what: &str) {
    let held = crate::sync::locks_held();
    assert!(
        held == 0,
        "{what} (user code) would run under {held} lock(s) of the crate"
    );
}

/// What [`run_user`] does with a waker.
enum Job {
    Wake(std::task::Waker),
    WakeShared(Arc<TaskWaker>),
    Drop(std::task::Waker),
}

impl Job {
    /// Runs it here, outside the scopes, containing a panic.
    fn run(self) {
        driver::outside_scopes(|| {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match self {
                Job::Wake(w) => w.wake(),
                Job::WakeShared(w) => {
                    if let Some(k) = &w.0 {
                        k.wake_by_ref();
                    }
                    // The last reference may go here: its drop is a `Job::Drop`, run inline
                    // (this thread is not a host function's).
                    drop(w);
                }
                Job::Drop(w) => drop(w),
            }));
        });
    }
}

/// Runs a waker's wake or drop: here, or, on a host-function thread, on one waker thread of the
/// process ("cuda-stream-pool-wake", started on first need, idle otherwise), which runs it (a
/// waker may poll its future inline, and that code may call the driver).
fn run_user(job: Job) {
    if !on_host_fn_thread() {
        // Run here: the caller's locks matter (on a host-function thread the job only goes to
        // the waker thread, whatever the caller holds: review 27).
        no_lock_held("a waker's wake or drop");
        return job.run();
    }
    /// A waker handed to a background thread: counted for the model while pending (see
    /// `sync::background_queued`), and counted as run when run or dropped.
    struct Bg(Option<Job>);
    impl Bg {
        fn run(mut self) {
            if let Some(j) = self.0.take() {
                j.run();
            }
        }
    }
    impl Drop for Bg {
        fn drop(&mut self) {
            crate::sync::background_ran();
        }
    }
    crate::sync::background_queued();
    let w = Bg(Some(job));
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
