//! A driver wrapper that can stop a thread right before a chosen driver call, so that a test can
//! interleave two threads at a precise point (between a check and the call it guards, between
//! an enqueue and the bookkeeping after it, ...).
//!
//! [`PausingDriver`] implements [`Driver`] by delegating every method to an inner
//! `Arc<SimDriver>` (whose call log, clock, fault injection and misuse detection stay usable
//! through the `Arc<SimDriver>` it was made from). Before delegating, each method passes its entry-point name
//! (the same name the simulation logs, e.g. `"cuLaunchKernel"`, `"cuMemcpyHtoDAsync_v2"`,
//! `"cuStreamGetCaptureInfo_v3"` for both `stream_is_capturing` and `stream_capture_info`) to a
//! hook. When the wrapper is armed ([`Pauser::arm`]) for that name (optionally only for
//! one thread, and for the n-th matching call), the calling thread blocks there, *before* the
//! call reaches the simulation, until the test calls [`Pauser::release`].
//!
//! Typical use:
//!
//! ```ignore
//! let pd = new_driver(Arc::new(SimDriver::new()));
//! let ctx = Context::primary(pd.clone(), 0).unwrap();
//! std::thread::scope(|sc| {
//!     let a = sc.spawn(|| { pd.hook.arm_here("cuLaunchKernel", 1); k.add_one(&sa, &buf) });
//!     assert!(pd.hook.wait_paused(TIMEOUT));       // thread A is now stopped before its launch
//!     /* ... the other thread's part of the interleaving ... */
//!     pd.hook.release();                           // A makes its call
//!     a.join().unwrap().unwrap();
//! });
//! ```
//!
//! No test can hang on it: a paused thread continues on its own after [`PAUSE_LIMIT`] (and
//! [`Pauser::timed_out`] then says so), and [`Pauser::wait_paused`] takes a timeout.
//! One pause at a time: arming again replaces a pending arm.
#![allow(dead_code)]

#[path = "hooked.rs"]
mod hooked;
pub use hooked::{Hook, Hooked};

use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::Context;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

/// The longest a thread stays paused when the test never releases it.
pub const PAUSE_LIMIT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
struct Arm {
    name: &'static str,
    /// Matching calls still to let through before the one that pauses, plus one.
    remaining: u64,
    /// Only calls of this thread match (any thread when `None`).
    thread: Option<ThreadId>,
}

#[derive(Debug)]
enum Phase {
    Idle,
    Armed(Arm),
    Paused { thread: ThreadId },
    Released,
}

#[derive(Debug)]
struct Ctl {
    phase: Phase,
    timed_out: bool,
    /// Entry points that paused so far, in order (for diagnostics).
    history: Vec<&'static str>,
}

/// The pausing hook: at most one armed call.
pub struct Pauser {
    ctl: Mutex<Ctl>,
    cv: Condvar,
}

/// A [`Driver`] delegating to a [`SimDriver`], able to pause a thread before a chosen call.
pub type PausingDriver = Hooked<Pauser>;

/// Wraps `inner`; not armed. Control the pauses through the hook: `pd.hook.arm_here(..)`.
pub fn new_driver(inner: Arc<SimDriver>) -> Arc<PausingDriver> {
    Arc::new(Hooked {
        inner,
        hook: Pauser {
            ctl: Mutex::new(Ctl {
                phase: Phase::Idle,
                timed_out: false,
                history: Vec::new(),
            }),
            cv: Condvar::new(),
        },
    })
}

/// A simulated context behind the pausing driver: the wrapper, the simulation (its call log,
/// clock and faults), and the context.
pub fn pausing() -> (Arc<PausingDriver>, Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let pd = new_driver(sim.clone());
    let ctx = Context::primary(pd.clone(), 0).expect("primary context");
    (pd, sim, ctx)
}

impl Pauser {
    /// Arms the wrapper: the `nth` (1 = the next) call of the entry point `name`, made by
    /// `thread` (or by any thread when `None`), blocks before reaching the simulation until
    /// [`Pauser::release`].
    pub fn arm(&self, name: &'static str, nth: u64, thread: Option<ThreadId>) {
        assert!(nth >= 1, "nth counts from 1");
        let mut c = self.ctl();
        c.phase = Phase::Armed(Arm {
            name,
            remaining: nth,
            thread,
        });
    }

    /// [`Pauser::arm`] for calls of the calling thread only.
    pub fn arm_here(&self, name: &'static str, nth: u64) {
        self.arm(name, nth, Some(std::thread::current().id()));
    }

    /// Waits until a thread is paused at the armed call; false after `timeout` (the arm is then
    /// still pending).
    pub fn wait_paused(&self, timeout: Duration) -> bool {
        let c = self.ctl();
        let (c, _) = self
            .cv
            .wait_timeout_while(c, timeout, |c| !matches!(c.phase, Phase::Paused { .. }))
            .unwrap_or_else(|p| p.into_inner());
        matches!(c.phase, Phase::Paused { .. })
    }

    /// The thread paused now, if any.
    pub fn paused_thread(&self) -> Option<ThreadId> {
        match self.ctl().phase {
            Phase::Paused { thread } => Some(thread),
            _ => None,
        }
    }

    /// Lets the paused thread make its call (and disarms a pending arm that never matched).
    pub fn release(&self) {
        let mut c = self.ctl();
        match c.phase {
            Phase::Paused { .. } => c.phase = Phase::Released,
            Phase::Armed(_) => c.phase = Phase::Idle,
            _ => {}
        }
        self.cv.notify_all();
    }

    /// Whether a paused thread gave up waiting for [`Pauser::release`].
    pub fn timed_out(&self) -> bool {
        self.ctl().timed_out
    }

    /// The entry points that paused so far.
    pub fn history(&self) -> Vec<&'static str> {
        self.ctl().history.clone()
    }
}

impl Pauser {
    fn ctl(&self) -> std::sync::MutexGuard<'_, Ctl> {
        self.ctl.lock().unwrap_or_else(|p| p.into_inner())
    }
}

// SAFETY: `before` only pauses the thread; the default `call` calls the driver once.
unsafe impl Hook for Pauser {
    /// Called by every delegating method before the call reaches the simulation.
    fn before(&self, name: &'static str) -> cuda_stream_pool::Result<()> {
        self.pause(name);
        Ok(())
    }
}

impl Pauser {
    fn pause(&self, name: &'static str) {
        let me = std::thread::current().id();
        let mut c = self.ctl();
        let hit = match &mut c.phase {
            Phase::Armed(a) if a.name == name && a.thread.is_none_or(|t| t == me) => {
                a.remaining -= 1;
                a.remaining == 0
            }
            _ => false,
        };
        if !hit {
            return;
        }
        c.phase = Phase::Paused { thread: me };
        c.history.push(name);
        self.cv.notify_all();
        let (mut c, r) = self
            .cv
            .wait_timeout_while(c, PAUSE_LIMIT, |c| matches!(c.phase, Phase::Paused { .. }))
            .unwrap_or_else(|p| p.into_inner());
        if r.timed_out() {
            c.timed_out = true;
        }
        c.phase = Phase::Idle;
        self.cv.notify_all();
    }
}
