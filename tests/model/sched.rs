//! A deterministic scheduler for the model's concurrent steps, at driver-call granularity.
//!
//! The model's driver is a [`Hooked`] simulation whose hook is a [`Sched`]: a registered worker
//! thread that is about to make a driver call stops at the hook until the scheduler grants it
//! the call, so exactly one worker proceeds per step and the interleaving is chosen by the
//! input's bytes (the same bytes give the same interleaving). Unregistered threads (the model's
//! own thread, the simulation's host-function thread) pass straight through.
//!
//! A worker blocked on a lock of the crate (a buffer's use lock, a stream's lock) is not at a
//! driver call: after a short settle time the scheduler treats it as blocked and schedules the
//! others; when no worker is at a driver call and some are still running after
//! [`DEADLOCK_AFTER`], the step reports a deadlock.
#![allow(dead_code)]

#[path = "../common/hooked.rs"]
mod hooked;
pub use hooked::{Hook, Hooked};

use std::sync::{Condvar, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

/// How long the scheduler waits for running workers to reach a driver call before it treats
/// them as blocked.
const SETTLE: Duration = Duration::from_millis(2);
/// No worker at a driver call for this long, with some still running: a deadlock.
pub const DEADLOCK_AFTER: Duration = Duration::from_secs(3);
/// A worker never waits longer than this for its grant (a scheduler bug must not hang a test).
const GRANT_LIMIT: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum W {
    /// Not registered yet.
    Absent,
    Running,
    /// Was running at the end of a settle: taken as blocked on a lock of the crate until it
    /// shows up at a driver call (or finishes).
    Blocked,
    AtGate(&'static str),
    Done,
}

#[derive(Debug)]
struct S {
    workers: Vec<(Option<ThreadId>, W)>,
    grant: Option<ThreadId>,
    /// After a deadlock (or a grant that timed out), the hook stops blocking.
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
        self.gate(call);
        Ok(())
    }
}

impl Sched {
    fn gate(&self, call: &'static str) {
        let me = std::thread::current().id();
        let mut st = self.lock();
        let Some(i) = st.workers.iter().position(|w| w.0 == Some(me)) else {
            return;
        };
        if st.free_run || st.workers[i].1 == W::Done {
            return;
        }
        st.workers[i].1 = W::AtGate(call);
        self.cv.notify_all();
        let (mut st, r) = self
            .cv
            .wait_timeout_while(st, GRANT_LIMIT, |s| s.grant != Some(me) && !s.free_run)
            .unwrap_or_else(|p| p.into_inner());
        if r.timed_out() {
            st.free_run = true;
        }
        if st.grant == Some(me) {
            st.grant = None;
        }
        st.workers[i].1 = W::Running;
        self.cv.notify_all();
    }
}

impl Sched {
    fn lock(&self) -> std::sync::MutexGuard<'_, S> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prepares `n` worker slots (before the workers start).
    pub fn begin(&self, n: usize) {
        let mut st = self.lock();
        st.workers = vec![(None, W::Absent); n];
        st.grant = None;
        st.free_run = false;
    }

    /// Called by worker `i` on its own thread before its first driver call.
    pub fn register(&self, i: usize) {
        let mut st = self.lock();
        st.workers[i] = (Some(std::thread::current().id()), W::Running);
        self.cv.notify_all();
    }

    /// Called by a worker when it has finished.
    pub fn done(&self) {
        let me = std::thread::current().id();
        let mut st = self.lock();
        if let Some(w) = st.workers.iter_mut().find(|w| w.0 == Some(me)) {
            w.1 = W::Done;
        }
        self.cv.notify_all();
    }

    /// Runs the registered workers to completion, one driver call at a time, picking at each step
    /// among the workers waiting at a call with the next byte of `choices` (then always the
    /// first). Returns the number of calls scheduled, or a deadlock report.
    pub fn run(&self, choices: &[u8]) -> Result<usize, String> {
        let mut st = self.lock();
        let mut k = 0;
        loop {
            // Let running workers reach a driver call (or finish).
            st = self
                .cv
                .wait_timeout_while(st, SETTLE, |s| {
                    s.workers
                        .iter()
                        .any(|w| matches!(w.1, W::Running | W::Absent))
                })
                .unwrap_or_else(|p| p.into_inner())
                .0;
            if st.workers.iter().all(|w| w.1 == W::Done) {
                return Ok(k);
            }
            let gates: Vec<usize> = (0..st.workers.len())
                .filter(|&i| matches!(st.workers[i].1, W::AtGate(_)))
                .collect();
            for w in st.workers.iter_mut() {
                if w.1 == W::Running {
                    w.1 = W::Blocked;
                }
            }
            if gates.is_empty() {
                let since = Instant::now();
                st = self
                    .cv
                    .wait_timeout_while(st, DEADLOCK_AFTER, |s| {
                        !s.workers.iter().any(|w| matches!(w.1, W::AtGate(_)))
                            && !s.workers.iter().all(|w| w.1 == W::Done)
                    })
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                if since.elapsed() >= DEADLOCK_AFTER
                    && !st.workers.iter().any(|w| matches!(w.1, W::AtGate(_)))
                    && !st.workers.iter().all(|w| w.1 == W::Done)
                {
                    st.free_run = true;
                    self.cv.notify_all();
                    return Err(format!(
                        "deadlock: after {k} scheduled calls no worker reaches a driver call: {:?}",
                        st.workers.iter().map(|w| w.1).collect::<Vec<_>>()
                    ));
                }
                continue;
            }
            let pick = gates[choices.get(k).copied().unwrap_or(0) as usize % gates.len()];
            k += 1;
            let tid = st.workers[pick].0;
            st.grant = tid;
            self.cv.notify_all();
            // Wait until the worker has taken its grant.
            st = self
                .cv
                .wait_timeout_while(st, GRANT_LIMIT, |s| s.grant.is_some() && !s.free_run)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
