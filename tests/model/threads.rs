//! The model's other threads (the workers of concurrent steps, the threads of `*Elsewhere`
//! steps), reused: starting a thread per step cost about as much as the step's work (0.1-0.7 ms
//! under AddressSanitizer, with the `mmap`/`munmap` of its stacks). A reused thread starts each
//! job as a new one would (see [`spawn`]).

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;

type Job = Box<dyn FnOnce() + Send>;

/// Idle pool threads (process-wide: the fuzzer runs one input after the other, and the tests'
/// threads share them).
static IDLE: Mutex<Vec<Sender<Job>>> = Mutex::new(Vec::new());

fn idle() -> std::sync::MutexGuard<'static, Vec<Sender<Job>>> {
    IDLE.lock().unwrap_or_else(|p| p.into_inner())
}

/// A job's result, as [`std::thread::JoinHandle`] gives it.
pub struct Handle<T> {
    rx: Receiver<std::thread::Result<T>>,
    thread: Sender<Job>,
}

impl<T> Handle<T> {
    /// The job's result; its thread is idle again from then on. (Not before: the threads of
    /// one concurrent step are distinct, as the scheduler, which tells its workers apart by
    /// their thread, needs. A thread whose handle is dropped unjoined is not reused.)
    pub fn join(self) -> std::thread::Result<T> {
        let r = self.rx.recv().expect("a model thread died");
        idle().push(self.thread);
        r
    }
}

/// Runs `f` on an idle pool thread (a new one if none is idle), as `std::thread::spawn` would:
/// its panic is caught and returned by [`Handle::join`]. To the crate the thread is a new one
/// (`__model_hooks::fresh_thread`); the simulation's state of the thread is the caller's to set
/// (`SimDriver::forget_thread_state`).
pub fn spawn<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Handle<T> {
    let (tx, rx) = channel();
    let mut job: Job = Box::new(move || {
        cuda_stream_pool::__model_hooks::fresh_thread();
        let _ = tx.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
    });
    loop {
        let Some(thread) = idle().pop() else { break };
        match thread.send(job) {
            Ok(()) => return Handle { rx, thread },
            Err(e) => job = e.0,
        }
    }
    let (thread, jobs) = channel::<Job>();
    thread.send(job).unwrap();
    std::thread::Builder::new()
        .name("model-worker".into())
        .spawn(move || {
            for job in jobs {
                job();
            }
        })
        .expect("a model thread");
    Handle { rx, thread }
}
