//! A deterministic scheduler for the model's concurrent steps.
//!
//! The model's driver is a [`Hooked`] simulation whose hook is a [`Sched`]: a registered worker
//! thread that is about to make a driver call stops at the hook until the scheduler grants it
//! the call. The crate is built with its `model-hooks` feature, so a registered worker that
//! would block inside the crate (a lock held by another worker, a park at the cap, a
//! condition-variable wait) stops at the scheduler too, instead of blocking. So at every step
//! each worker is either stopped at the scheduler or finished, exactly one worker runs between
//! two steps, and the scheduler knows which: the interleaving is chosen by the input's bytes
//! alone (the same bytes give the same interleaving, idle or loaded; no settle time decides
//! whether a thread is blocked or slow). Unregistered threads (the model's own thread, the
//! simulation's host-function thread, the completion poller) pass straight through; a worker
//! waiting for one of them (a lock it holds, a host function that releases a stream) waits for
//! real, or yields until it has happened.
//!
//! A worker that re-enters a lock it holds panics in the crate (the hook reports it); when
//! every unfinished worker only waits (at a lock, a park or a condition variable) and none got
//! further for [`DEADLOCK_ROUNDS`] grants and [`DEADLOCK_AFTER`] of real time (the second only
//! so that a host function on a slow machine is not taken for a deadlock), the step reports a
//! deadlock.
#![allow(dead_code)]

#[path = "../common/hooked.rs"]
mod hooked;
pub use hooked::{Hook, Hooked};

use cuda_stream_pool::__model_hooks as hooks;
use std::cell::Cell;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{Thread, ThreadId};
use std::time::{Duration, Instant};

/// Grants in a row with every worker only waiting, before a deadlock is reported.
pub const DEADLOCK_ROUNDS: usize = 10_000;
/// ... and at least this much real time.
pub const DEADLOCK_AFTER: Duration = Duration::from_secs(5);
/// A worker that neither stops at the scheduler nor finishes for this long is blocked outside
/// the crate's primitives (a finding, reported; the guard only keeps a test from hanging).
const HANG_AFTER: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum W {
    /// Not registered yet.
    Absent,
    Running,
    /// Stopped before a driver call.
    AtCall(&'static str),
    /// Stopped where it would block in the crate (a park, a condition variable).
    Waiting(&'static str),
    /// Stopped at a lock of the crate held by another thread: the address of the lock's holder
    /// word (valid while the worker is stopped here), read at each pick.
    Lock(usize),
    Done,
}

thread_local! {
    /// The scheduler the thread is a worker of (its address), 0 if none: a filter before the
    /// lock (the worker's slot is still looked up by its thread id).
    static WORKER_OF: Cell<usize> = const { Cell::new(0) };
    /// Whether the worker's last driver call touched shared state and no stop has come after
    /// it (see [`Sched::before`]).
    static AFTER_CALL: Cell<bool> = const { Cell::new(false) };
}

/// The most workers of one run.
const MAX_WORKERS: usize = 8;

/// Past the input's choices, the steps a worker is granted in a row before the turn passes to
/// the next stopped worker (sooner if it stops where a grant cannot move it on, at a wait or a
/// held lock, or finishes). Every step past the choices was a turn of its own before
/// (2026-12-07): in a campaign 87 % of the grants came after the choices, and with two or three
/// workers nearly every one of them was a thread switch (45 % of a campaign's samples in the
/// kernel's `finish_task_switch`). With turns of 16 a campaign runs 1.2x the inputs a second
/// (docs/testing.md); the interleavings a fuzzer or a property test wants to try are chosen by
/// the input's bytes, which still pick every step they cover.
const QUANTUM: usize = 16;

#[derive(Debug)]
struct S {
    workers: Vec<(Option<ThreadId>, W)>,
    /// The workers' identifiers in the crate's holder words (`__model_hooks::thread_id`).
    hook_ids: Vec<u64>,
    /// The workers' threads (to unpark the one granted a step).
    threads: Vec<Option<Thread>>,
    /// The worker granted a step whose thread is still to be unparked (by the thread that
    /// granted it, once it has dropped the lock).
    wake: Option<usize>,
    /// The worker granted the next step, until it has taken it.
    grant: Option<usize>,
    /// After a deadlock (or a hang), the hook stops blocking.
    free_run: bool,
    /// Whether [`Sched::run`] is running (steps are granted only then).
    running: bool,
    choices: Vec<u8>,
    /// Steps granted on the input's choices.
    k: usize,
    /// The worker granted the last step past the input's choices, and how many steps in a row
    /// it has been granted there (see [`QUANTUM`]).
    turn: Option<(usize, usize)>,
    /// Grants in a row with every worker only waiting, and since when.
    waits: usize,
    waits_since: Instant,
    /// When the last step was granted (the hang guard).
    last_grant: Instant,
    trace: bool,
    /// How the run ended (for [`Sched::run`]).
    outcome: Option<Result<usize, String>>,
}

/// The scheduler hook.
///
/// Steps are handed over directly: the worker that stops (or finishes) picks the next one
/// and wakes only that one (it unparks the worker's thread after dropping the lock, so that the
/// woken worker does not find the lock held: one wake-up per hand-over), and keeps running
/// without a thread switch when it picks itself; the model's thread only waits for the end.
/// (A scheduler thread woken at every step, with one condition variable for all, cost several
/// thread switches per driver call; a condition variable per worker, notified under the lock,
/// two.)
#[derive(Debug)]
pub struct Sched {
    st: Mutex<S>,
    /// The model's thread, waiting in [`Sched::run`].
    main: Condvar,
}

impl Default for Sched {
    fn default() -> Self {
        let now = Instant::now();
        Sched {
            st: Mutex::new(S {
                workers: Vec::new(),
                hook_ids: Vec::new(),
                threads: Vec::new(),
                wake: None,
                grant: None,
                free_run: false,
                running: false,
                choices: Vec::new(),
                k: 0,
                turn: None,
                waits: 0,
                waits_since: now,
                last_grant: now,
                trace: false,
                outcome: None,
            }),
            main: Condvar::new(),
        }
    }
}

// SAFETY: `before` only blocks the thread until the schedule lets it go; the default `call`
// calls the driver once.
unsafe impl Hook for Sched {
    fn before(&self, call: &'static str) -> cuda_stream_pool::Result<()> {
        if !thread_local_call(call) {
            self.stop(W::AtCall(call));
            AFTER_CALL.with(|a| a.set(true));
        } else if AFTER_CALL.with(|a| a.replace(false)) {
            // The first thread-local call after a call that touches shared state (the device
            // rules' restore of the caller's capture mode or context, after a bound call): a
            // stop here is the only point between that call's return and what the crate does
            // with its result before its next driver call (its atomics, its uncontended
            // locks), which other workers must be able to interleave with.
            self.stop(W::AtCall(call));
        }
        Ok(())
    }
}

/// Calls that read or change only the calling thread's state (its current context, its capture
/// mode) are no scheduling points, but for the first one after a call that touches shared state
/// (see [`Sched::before`]): such a call commutes with every call of another thread, so an
/// interleaving that switches before it is the same as one that switches at the worker's next
/// stop (a partial-order reduction); the stops of the device rules' switches before a call
/// (`prepare`) were the larger part of the hand-overs of `Op::Par`.
fn thread_local_call(call: &str) -> bool {
    matches!(
        call,
        "cuCtxGetCurrent" | "cuCtxSetCurrent" | "cuThreadExchangeStreamCaptureMode"
    )
}

/// The crate's blocking points, for the driver `D` whose hook is the scheduler.
struct Yield<D: AsSched>(Arc<D>);

/// What holds a [`Sched`].
pub trait AsSched: Send + Sync + 'static {
    fn sched(&self) -> &Sched;
}

impl AsSched for Hooked<Sched> {
    fn sched(&self) -> &Sched {
        &self.hook
    }
}

impl<D: AsSched> hooks::Scheduler for Yield<D> {
    fn yield_now(&self, what: &'static str) {
        self.0.sched().stop(W::Waiting(what));
    }

    fn wait_for_lock(&self, holder: &std::sync::atomic::AtomicU64) {
        self.0.sched().stop(W::Lock(
            holder as *const std::sync::atomic::AtomicU64 as usize,
        ));
    }
}

/// A registered worker; dropping it marks the worker done.
pub struct Registered<D: AsSched> {
    drv: Arc<D>,
    _entered: hooks::Entered,
}

impl<D: AsSched> Drop for Registered<D> {
    fn drop(&mut self) {
        self.drv.sched().done();
    }
}

/// Registers the calling thread as worker `i` of `drv`'s scheduler, for the crate's blocking
/// points and the driver's calls, until the returned value is dropped.
pub fn register<D: AsSched>(drv: &Arc<D>, i: usize) -> Registered<D> {
    drv.sched().register(i);
    Registered {
        drv: drv.clone(),
        _entered: hooks::enter(Arc::new(Yield(drv.clone()))),
    }
}

impl Sched {
    fn lock(&self) -> std::sync::MutexGuard<'_, S> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The calling worker stops as `how` until it is granted a step.
    fn stop(&self, how: W) {
        if WORKER_OF.with(Cell::get) != self as *const Sched as usize {
            // Not a worker of this scheduler (the model's thread, the host-function thread,
            // the poller): it passes through without the lock.
            return;
        }
        AFTER_CALL.with(|a| a.set(false));
        let me = std::thread::current().id();
        let mut st = self.lock();
        let Some(i) = st.workers.iter().position(|w| w.0 == Some(me)) else {
            return;
        };
        if st.free_run || st.workers[i].1 == W::Done {
            return;
        }
        st.workers[i].1 = how;
        self.decide(&mut st);
        if st.wake == Some(i) {
            // Picked itself: runs on.
            st.wake = None;
        }
        while st.grant != Some(i) && !st.free_run {
            st = self.wake_and_park(st);
        }
        if st.grant == Some(i) {
            st.grant = None;
        }
        st.workers[i].1 = W::Running;
        if matches!(how, W::Waiting(_) | W::Lock(_)) && st.waits > 0 {
            // Every worker only waits (for a thread the scheduler does not stop): give the
            // processor to that thread (this decides nothing: the turns are the same).
            drop(st);
            std::thread::yield_now();
        }
    }

    /// Drops the lock, unparks the worker granted a step (if it is still to be woken), parks
    /// the calling thread (until it is unparked, or spuriously) and takes the lock again.
    fn wake_and_park<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, S>,
    ) -> std::sync::MutexGuard<'a, S> {
        let wake = st.wake.take().and_then(|j| st.threads[j].clone());
        drop(st);
        if let Some(t) = wake {
            t.unpark();
        }
        std::thread::park();
        self.lock()
    }

    /// Drops the lock and unparks the worker granted a step, if it is still to be woken.
    fn wake_granted(&self, mut st: std::sync::MutexGuard<'_, S>) {
        let wake = st.wake.take().and_then(|j| st.threads[j].clone());
        drop(st);
        if let Some(t) = wake {
            t.unpark();
        }
    }

    /// Prepares `n` worker slots (before the workers start).
    pub fn begin(&self, n: usize) {
        assert!(n <= MAX_WORKERS, "at most {MAX_WORKERS} workers");
        let mut st = self.lock();
        st.workers = vec![(None, W::Absent); n];
        st.hook_ids = vec![0; n];
        st.threads = vec![None; n];
        st.wake = None;
        st.grant = None;
        st.free_run = false;
        st.running = false;
        st.outcome = None;
    }

    fn register(&self, i: usize) {
        WORKER_OF.with(|w| w.set(self as *const Sched as usize));
        AFTER_CALL.with(|a| a.set(false));
        let mut st = self.lock();
        st.workers[i] = (Some(std::thread::current().id()), W::Running);
        st.hook_ids[i] = hooks::thread_id();
        st.threads[i] = Some(std::thread::current());
    }

    fn done(&self) {
        WORKER_OF.with(|w| w.set(0));
        let me = std::thread::current().id();
        let mut st = self.lock();
        if let Some(w) = st.workers.iter_mut().find(|w| w.0 == Some(me)) {
            w.1 = W::Done;
        }
        self.decide(&mut st);
        self.wake_granted(st);
    }

    fn give_up(&self, st: &mut S, why: String) {
        st.free_run = true;
        st.outcome = Some(Err(format!(
            "{why}: {:?}",
            st.workers.iter().map(|w| w.1).collect::<Vec<_>>()
        )));
        st.wake = None;
        for t in st.threads.iter().flatten() {
            t.unpark();
        }
        self.main.notify_all();
    }

    /// Once every worker is stopped or done (exactly one runs at a time, so this is called by
    /// the one that ran the last step, as it stops or finishes, or by [`Sched::run`] as it
    /// starts): grants the next step to a stopped worker picked with the next byte of the
    /// choices (then in turns of [`QUANTUM`] steps), or ends the run.
    fn decide(&self, st: &mut S) {
        if !st.running || st.free_run || st.outcome.is_some() || st.grant.is_some() {
            return;
        }
        if st
            .workers
            .iter()
            .any(|w| matches!(w.1, W::Running | W::Absent))
        {
            return;
        }
        if st.workers.iter().all(|w| w.1 == W::Done) {
            st.outcome = Some(Ok(st.k));
            self.main.notify_all();
            return;
        }
        // The stopped workers that a grant could move on: not one at a lock that another
        // stopped worker holds (it would only try and stop again; the holder must run first).
        // (On the stack: this runs at every driver call of a worker.)
        let mut stopped = [0usize; MAX_WORKERS];
        let mut n = 0;
        let mut at_held_lock = 0;
        for i in 0..st.workers.len() {
            match st.workers[i].1 {
                W::AtCall(_) | W::Waiting(_) => {}
                W::Lock(holder) if self.held_by_a_stopped_worker(st, holder) => {
                    at_held_lock += 1;
                    continue;
                }
                W::Lock(_) => {}
                _ => continue,
            }
            stopped[n] = i;
            n += 1;
        }
        let stopped = &stopped[..n];
        if stopped.is_empty() {
            // Every unfinished worker waits for a lock that another of them holds: a cycle.
            let k = st.k;
            self.give_up(
                st,
                format!("deadlock: after {k} steps {at_held_lock} workers wait for locks that they hold"),
            );
            return;
        }
        if stopped
            .iter()
            .all(|&i| matches!(st.workers[i].1, W::Waiting(_) | W::Lock(_)))
        {
            if st.waits == 0 {
                st.waits_since = Instant::now();
            }
            st.waits += 1;
            if st.waits > DEADLOCK_ROUNDS && st.waits_since.elapsed() > DEADLOCK_AFTER {
                let k = st.k;
                self.give_up(
                    st,
                    format!("deadlock: after {k} steps every worker only waits"),
                );
                return;
            }
        } else {
            st.waits = 0;
        }
        // While every worker only waits, they take turns and use no byte of the input (how
        // many turns pass before a host function lands depends on the machine's speed;
        // the input's choices must not).
        if st.trace {
            eprintln!(
                "sched k={} waits={} {:?}",
                st.k,
                st.waits,
                st.workers.iter().map(|w| w.1).collect::<Vec<_>>()
            );
        }
        let pick = if st.waits > 0 {
            stopped[st.waits % stopped.len()]
        } else {
            st.k += 1;
            let k = st.k;
            match st.choices.get(k - 1) {
                Some(&c) => stopped[usize::from(c) % stopped.len()],
                None => {
                    // Past the input's choices, the workers take turns of [`QUANTUM`] steps
                    // (always the same one could grant a worker waiting for a lock forever,
                    // never its holder; a worker stopped at a wait or a lock gives the turn
                    // up at once, being no longer at a call).
                    let (pick, run) = match st.turn {
                        Some((last, run))
                            if run < QUANTUM
                                && matches!(st.workers[last].1, W::AtCall(_))
                                && stopped.contains(&last) =>
                        {
                            (last, run + 1)
                        }
                        Some((last, _)) => (
                            stopped
                                .iter()
                                .copied()
                                .find(|&i| i > last)
                                .unwrap_or(stopped[0]),
                            1,
                        ),
                        None => (stopped[k % stopped.len()], 1),
                    };
                    st.turn = Some((pick, run));
                    pick
                }
            }
        };
        st.grant = Some(pick);
        st.wake = Some(pick);
        st.last_grant = Instant::now();
    }

    /// Whether the lock whose holder word is at `holder` is held by a worker stopped at the
    /// scheduler (which releases it only once granted a step).
    fn held_by_a_stopped_worker(&self, st: &S, holder: usize) -> bool {
        // SAFETY: `holder` is the holder word of a lock that a worker stopped in `W::Lock` is
        // waiting for inside the crate's `lock`, which borrows the lock until it returns, and
        // the worker does not return while stopped (this runs under the scheduler's lock, which
        // it needs to move on).
        let h = unsafe { &*(holder as *const std::sync::atomic::AtomicU64) }
            .load(std::sync::atomic::Ordering::Relaxed);
        h != 0
            && st
                .hook_ids
                .iter()
                .zip(&st.workers)
                .any(|(&id, w)| id == h && matches!(w.1, W::AtCall(_) | W::Waiting(_) | W::Lock(_)))
    }

    /// Runs the registered workers to completion, one step at a time, picking at each step
    /// among the stopped workers with the next byte of `choices` (then in turns of
    /// [`QUANTUM`] steps).
    /// Returns the number of steps, or a deadlock report.
    pub fn run(&self, choices: &[u8]) -> Result<usize, String> {
        let mut st = self.lock();
        st.choices = choices.to_vec();
        st.k = 0;
        st.turn = None;
        st.waits = 0;
        st.last_grant = Instant::now();
        st.trace = std::env::var_os("CSP_SCHED_TRACE").is_some();
        st.running = true;
        self.decide(&mut st);
        if st.wake.is_some() {
            self.wake_granted(st);
            st = self.lock();
        }
        loop {
            if let Some(outcome) = st.outcome.take() {
                st.running = false;
                return outcome;
            }
            // A worker that neither stops nor finishes: blocked outside the crate's locks.
            let left = HANG_AFTER.saturating_sub(st.last_grant.elapsed());
            if left.is_zero() {
                let k = st.k;
                self.give_up(
                    &mut st,
                    format!(
                        "after {k} steps a worker neither stops at the scheduler nor finishes \
                         (blocked outside the crate's locks)"
                    ),
                );
                continue;
            }
            st = self
                .main
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
