//! The model's other threads (the workers of concurrent steps, the threads of `*Elsewhere`
//! steps), reused: starting a thread per step cost about as much as the step's work (0.1-0.7 ms
//! under AddressSanitizer, with the `mmap`/`munmap` of its stacks). A reused thread starts each
//! job as a new one would (see [`spawn`]).
//!
//! [`pin_to_current_cpu`] (the fuzz target's, per input) keeps the model's threads on one CPU:
//! exactly one of them runs at a time (the scheduler hands the turn from thread to thread at
//! every driver call of a concurrent step), and a hand-over to a thread on another CPU costs a
//! cross-CPU wake-up (an inter-processor interrupt, in a virtual machine an exit), several times
//! the cost of a switch on one CPU. It changes no decision: the scheduler picks by the input's
//! bytes alone.

use std::cell::Cell;
use std::sync::atomic::{AtomicI32, Ordering};
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
    let cpu = PIN.load(Ordering::Relaxed);
    let mut job: Job = Box::new(move || {
        follow_pin(cpu);
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

/// The CPU that [`pin_to_current_cpu`] keeps the model's threads on, -1 if none.
static PIN: AtomicI32 = AtomicI32::new(-1);

thread_local! {
    /// The CPU this thread is pinned to by [`follow_pin`], -1 if none.
    static PINNED: Cell<i32> = const { Cell::new(-1) };
}

/// The affinity mask of the process when the first pin was made (what an unpin restores).
static ALL_CPUS: Mutex<Option<libc::cpu_set_t>> = Mutex::new(None);

fn set_affinity(set: &libc::cpu_set_t) -> bool {
    // SAFETY: a valid mask of the size given, for the calling thread.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) == 0 }
}

fn one_cpu(cpu: i32) -> libc::cpu_set_t {
    // SAFETY: an all-zero mask is a valid (empty) `cpu_set_t`; `cpu` is a CPU number the
    // kernel gave (below `CPU_SETSIZE`).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        set
    }
}

/// A pool thread starting a job pins itself to the CPU its spawner was pinned to (`cpu`), or
/// unpins itself if that was none.
fn follow_pin(cpu: i32) {
    if PINNED.with(Cell::get) == cpu {
        return;
    }
    let set = if cpu >= 0 {
        Some(one_cpu(cpu))
    } else {
        *ALL_CPUS.lock().unwrap_or_else(|p| p.into_inner())
    };
    if let Some(set) = set {
        if set_affinity(&set) {
            PINNED.with(|p| p.set(cpu));
            batch(cpu >= 0);
        }
    }
}

/// A pinned model thread is `SCHED_BATCH` (see [`pin_to_current_cpu`]): on the one CPU, the
/// worker that a hand-over wakes does not preempt the worker that woke it, which parks at once
/// (one thread switch per hand-over, not two or three); and its timer slack is [`SLACK_NS`]. An
/// unpinned one is `SCHED_OTHER` again, with the kernel's default slack. The threads a pinned thread
/// starts inherit both. Only the OS's timing changes, as on a loaded machine: no verdict depends
/// on it.
fn batch(on: bool) {
    let policy = if on {
        libc::SCHED_BATCH
    } else {
        libc::SCHED_OTHER
    };
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: the calling thread (0), a valid policy and parameter; a failure leaves the
    // thread as it was (only its speed differs).
    unsafe { libc::sched_setscheduler(0, policy, &param) };
    let slack: libc::c_ulong = if on { SLACK_NS } else { DEFAULT_SLACK_NS };
    // SAFETY: a plain call for the calling thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, slack, 0, 0, 0) };
}

/// The timer slack of a pinned thread (`PR_SET_TIMERSLACK`; the kernel's default is 50 µs),
/// which the threads it starts inherit: the completion poller, started by the model's thread or
/// a worker, sleeps 50 µs at a time while a completion is pending (in the model, until the clock
/// moves), and with this slack it wakes up to 1 ms after the 50 µs instead of up to 50 µs after
/// (all thread switches over the corpus's initial pass: about 15 % fewer). Nothing waits for the
/// poller by time: `Model::await_quiet` counts its passes.
const SLACK_NS: libc::c_ulong = 1_000_000;

/// The kernel's default timer slack, which an unpinned thread gets back (0 would restore the
/// slack the thread was started with, which is [`SLACK_NS`] for one started while pinned).
const DEFAULT_SLACK_NS: libc::c_ulong = 50_000;

/// Keeps the calling thread, and the model threads and crate threads started or given a job
/// while the returned value lives, on the CPU the calling thread runs on now (see the module's
/// documentation); dropping it unpins the calling thread (the next pin may choose another CPU).
/// `None` if the affinity cannot be read or set.
pub fn pin_to_current_cpu() -> Option<Unpin> {
    // SAFETY: plain calls; the mask is of the size given.
    let (all, cpu) = unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut all) != 0 {
            return None;
        }
        (all, libc::sched_getcpu())
    };
    if cpu < 0 {
        return None;
    }
    ALL_CPUS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert(all);
    if !set_affinity(&one_cpu(cpu)) {
        return None;
    }
    PIN.store(cpu, Ordering::Relaxed);
    batch(true);
    Some(Unpin(all))
}

/// Restores the calling thread's affinity (see [`pin_to_current_cpu`]).
pub struct Unpin(libc::cpu_set_t);

impl Drop for Unpin {
    fn drop(&mut self) {
        PIN.store(-1, Ordering::Relaxed);
        set_affinity(&self.0);
        batch(false);
    }
}
