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
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;
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
    /// Stopped where it would block in the crate (a lock, a park, a condition variable).
    Waiting(&'static str),
    Done,
}

#[derive(Debug)]
struct S {
    workers: Vec<(Option<ThreadId>, W)>,
    grant: Option<ThreadId>,
    /// After a deadlock (or a hang), the hook stops blocking.
    free_run: bool,
}

/// The scheduler hook.
#[derive(Debug)]
pub struct Sched {
    st: Mutex<S>,
    cv: Condvar,
}

impl Default for Sched {
    fn default() -> Self {
        Sched {
            st: Mutex::new(S {
                workers: Vec::new(),
                grant: None,
                free_run: false,
            }),
            cv: Condvar::new(),
        }
    }
}

impl Hook for Sched {
    fn before(&self, call: &'static str) -> cuda_stream_pool::Result<()> {
        self.stop(W::AtCall(call));
        Ok(())
    }
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
        let me = std::thread::current().id();
        let mut st = self.lock();
        let Some(i) = st.workers.iter().position(|w| w.0 == Some(me)) else {
            return;
        };
        if st.free_run || st.workers[i].1 == W::Done {
            return;
        }
        st.workers[i].1 = how;
        self.cv.notify_all();
        let mut st = self
            .cv
            .wait_while(st, |s| s.grant != Some(me) && !s.free_run)
            .unwrap_or_else(|p| p.into_inner());
        if st.grant == Some(me) {
            st.grant = None;
        }
        st.workers[i].1 = W::Running;
        self.cv.notify_all();
    }

    /// Prepares `n` worker slots (before the workers start).
    pub fn begin(&self, n: usize) {
        let mut st = self.lock();
        st.workers = vec![(None, W::Absent); n];
        st.grant = None;
        st.free_run = false;
    }

    fn register(&self, i: usize) {
        let mut st = self.lock();
        st.workers[i] = (Some(std::thread::current().id()), W::Running);
        self.cv.notify_all();
    }

    fn done(&self) {
        let me = std::thread::current().id();
        let mut st = self.lock();
        if let Some(w) = st.workers.iter_mut().find(|w| w.0 == Some(me)) {
            w.1 = W::Done;
        }
        self.cv.notify_all();
    }

    fn give_up(&self, mut st: std::sync::MutexGuard<'_, S>, why: String) -> Result<usize, String> {
        st.free_run = true;
        self.cv.notify_all();
        Err(format!(
            "{why}: {:?}",
            st.workers.iter().map(|w| w.1).collect::<Vec<_>>()
        ))
    }

    /// Runs the registered workers to completion, one step at a time, picking at each step
    /// among the stopped workers with the next byte of `choices` (then in turn).
    /// Returns the number of steps, or a deadlock report.
    pub fn run(&self, choices: &[u8]) -> Result<usize, String> {
        let mut st = self.lock();
        let mut k = 0;
        let mut waits = 0usize;
        let mut waits_since = Instant::now();
        loop {
            // Until every worker is stopped or done: exactly one runs at a time, so this is
            // the one that was granted the last step (or the workers starting).
            let (s, r) = self
                .cv
                .wait_timeout_while(st, HANG_AFTER, |s| {
                    s.workers
                        .iter()
                        .any(|w| matches!(w.1, W::Running | W::Absent))
                })
                .unwrap_or_else(|p| p.into_inner());
            st = s;
            if r.timed_out() {
                return self.give_up(
                    st,
                    format!(
                        "after {k} steps a worker neither stops at the scheduler nor finishes \
                         (blocked outside the crate's locks)"
                    ),
                );
            }
            if st.workers.iter().all(|w| w.1 == W::Done) {
                return Ok(k);
            }
            let stopped: Vec<usize> = (0..st.workers.len())
                .filter(|&i| matches!(st.workers[i].1, W::AtCall(_) | W::Waiting(_)))
                .collect();
            if stopped
                .iter()
                .all(|&i| matches!(st.workers[i].1, W::Waiting(_)))
            {
                if waits == 0 {
                    waits_since = Instant::now();
                }
                waits += 1;
                if waits > DEADLOCK_ROUNDS && waits_since.elapsed() > DEADLOCK_AFTER {
                    return self.give_up(
                        st,
                        format!("deadlock: after {k} steps every worker only waits"),
                    );
                }
            } else {
                waits = 0;
            }
            // While every worker only waits, they take turns and use no byte of the input (how
            // many turns pass before a host function lands depends on the machine's speed;
            // the input's choices must not).
            if std::env::var_os("CSP_SCHED_TRACE").is_some() {
                eprintln!(
                    "sched k={k} waits={waits} {:?}",
                    st.workers.iter().map(|w| w.1).collect::<Vec<_>>()
                );
            }
            let pick = if waits > 0 {
                stopped[waits % stopped.len()]
            } else {
                k += 1;
                // Past the input's choices, the workers take turns (always the first could
                // grant a worker waiting for a lock forever, never its holder).
                let c = choices.get(k - 1).map_or(k, |&c| usize::from(c));
                stopped[c % stopped.len()]
            };
            let tid = st.workers[pick].0;
            st.grant = tid;
            self.cv.notify_all();
            // Until the worker has taken its grant.
            st = self
                .cv
                .wait_while(st, |s| s.grant.is_some() && !s.free_run)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}
