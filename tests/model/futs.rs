//! The model's asynchronous operations and their invariants: completion futures
//! (`StreamRef::completed`), asynchronous copies to the host (`DeviceBuffer::to_vec_async`),
//! owners waiting at the cap on live streams (`Owner::ready`), owners attached to futures
//! (`Owner::attach`), reserves and blocking acquisitions at the cap.
//!
//! Every future is polled by the model's thread with a counting waker, at points the input
//! chooses, and may be dropped at any point. Checked after every step:
//!
//! - a completion (or host copy) resolves only after the work it covers: `ns` of simulated GPU
//!   work enqueued just before it (so not before the manual clock passed its end) and, with a
//!   marker, a host function enqueued before it (which must have run);
//! - a completion whose stream has nothing pending is complete, and a future polled `Pending`
//!   whose work has completed is woken (by the poller thread; a wake-up is declared missing only
//!   when no thread that could deliver it has anything left to do: `Model::await_quiet`);
//! - a host copy resolves with the contents the model expects;
//! - `Owner::ready` futures of one key are served first come, first served (in the order their
//!   first `Pending` poll queued them), and the first of them is woken whenever its key could
//!   serve it (a stream came back, or the key is below its cap);
//! - an attached future sees its owner's stream through `Context::stream`.
//!
//! At teardown, the simulation's counters (host-mapped memory included) must be back to zero.

use super::*;
use cuda_stream_pool::{Attached, Completion, HostCopy, OwnerReady};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context as TaskCx, Poll, Wake, Waker};
use std::time::{Duration, Instant};

/// How long the threads that wake futures may take to finish what they were given before the
/// model calls it a hang (never a verdict on a wake-up: see `Model::await_wake`).
pub(super) const HANG_LIMIT: Duration = Duration::from_secs(120);
/// At most this many futures at once.
const MAX_FUTS: usize = 16;
/// Simulated time that completes every piece of work the model enqueues.
pub(super) const LONG: u64 = 1_000_000_000;

/// A waker that counts its wake-ups.
#[derive(Default)]
pub(super) struct Count(AtomicUsize);

impl Wake for Count {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// `CSP_MODEL_POLL_PAUSE_US`: a pause after every poll that returns `Pending` (none without it).
fn poll_pause() -> Option<Duration> {
    static PAUSE: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *PAUSE.get_or_init(|| {
        std::env::var("CSP_MODEL_POLL_PAUSE_US")
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Duration::from_micros)
    })
}

/// What a completion must come after.
pub(super) struct Cover {
    /// The stream it was made on.
    raw: u64,
    /// The simulated time before which the covered work cannot have ended.
    not_before: u64,
    /// Set by a host function enqueued before the completion.
    marker: Option<Arc<AtomicBool>>,
}

impl Cover {
    fn check(&self, sim: &SimDriver, what: &str) {
        let now = sim.now();
        assert!(
            now >= self.not_before,
            "{what} resolved at {now} ns, before the work it covers could end ({} ns)",
            self.not_before
        );
        if let Some(m) = &self.marker {
            assert!(
                m.load(Ordering::Acquire),
                "{what} resolved before a host function enqueued earlier ran"
            );
        }
    }
}

/// A completion that resolved with success: after the work it covers, and complete.
fn check_done(sim: &SimDriver, c: &Completion, cover: &Cover, what: &str) {
    cover.check(sim, what);
    assert!(c.is_complete(), "{what}: resolved, but not complete");
}

/// A host copy that resolved with `v`: after the work it covers, of its length, with the
/// contents the model expects (if it knew them).
fn check_copy(sim: &SimDriver, v: &[u32], cover: &Cover, len: usize, expect: Option<&[u32]>) {
    cover.check(sim, "a host copy");
    assert_eq!(v.len(), len, "a host copy's length");
    if let Some(want) = expect {
        assert_eq!(v, want, "a host copy resolved with unexpected contents");
    }
}

/// The future of an attached owner: what `Context::stream` returned before and after awaiting.
type AttachFut = Pin<Box<dyn Future<Output = (Option<u64>, Option<u64>)>>>;

pub(super) enum Kind {
    Done {
        f: Completion,
        cover: Cover,
    },
    Copy {
        f: HostCopy<u32>,
        cover: Cover,
        /// The buffer's contents when the copy was enqueued, if the model knew them.
        expect: Option<Vec<u32>>,
        len: usize,
    },
    Ready {
        f: OwnerReady,
        /// The priority the owner waits for.
        key: i32,
        /// Its place in the model's order of queued waiters (set by its first `Pending`).
        joined: Option<u64>,
    },
    Attach {
        f: Attached<AttachFut>,
        /// The owner's model id.
        id: u64,
    },
}

/// One of the model's futures.
pub(super) struct Fut {
    kind: Kind,
    wakes: Arc<Count>,
    waker: Waker,
    /// The wake count when its last poll that returned `Pending` began.
    pending_at: Option<usize>,
}

impl Fut {
    fn new(kind: Kind) -> Fut {
        let wakes = Arc::new(Count::default());
        Fut {
            kind,
            waker: Waker::from(wakes.clone()),
            wakes,
            pending_at: None,
        }
    }

    fn woken(&self) -> usize {
        self.wakes.0.load(Ordering::SeqCst)
    }

    fn what(&self) -> &'static str {
        match self.kind {
            Kind::Done { .. } => "a completion",
            Kind::Copy { .. } => "a host copy",
            Kind::Ready { .. } => "an owner waiting at the cap",
            Kind::Attach { .. } => "an attached future",
        }
    }
}

impl Model {
    /// The streams of owners attached to futures.
    pub(super) fn attached_pairs(&self, v: &mut Vec<(u64, u64)>) {
        for f in &self.futs {
            if let Kind::Attach { f, id } = &f.kind {
                if let Some(o) = f.owner() {
                    for (_, s) in o.streams() {
                        v.push((*id, s.model_handle().0));
                    }
                }
            }
        }
    }

    /// Whether an `Owner::ready` of the model is queued for key `p`.
    pub(super) fn queued(&self, p: i32) -> bool {
        self.first_waiter(p).is_some()
    }

    /// The queue position of the first queued `Owner::ready` of key `p`.
    fn first_waiter(&self, p: i32) -> Option<u64> {
        self.futs
            .iter()
            .filter_map(|f| match f.kind {
                Kind::Ready {
                    key,
                    joined: Some(j),
                    ..
                } if key == p => Some(j),
                _ => None,
            })
            .min()
    }

    /// Whether key `p` could serve its first waiter now: below its cap, or an idle retired
    /// stream.
    fn servable(&self, p: i32) -> bool {
        let Some(cap) = self.cap else { return true };
        let st = self
            .ctx()
            .stats_for(Priority::Value(p))
            .expect("a key in range");
        st.live < cap as u64 || st.idle > 0
    }

    /// Enqueues what a completion on `s` must come after: a marker host function and `ns` of
    /// work.
    fn cover(&self, s: &StreamRef, ns: u64, marker: bool) -> Cover {
        let marker = if marker {
            let m = Arc::new(AtomicBool::new(false));
            let set = m.clone();
            s.launch_host_func(move || set.store(true, Ordering::Release))
                .ok()
                .map(|_| m)
        } else {
            None
        };
        let t0 = self.sim.now();
        let not_before = if ns > 0 && self.sim.enqueue_work(s.raw(), ns).is_ok() {
            t0.saturating_add(ns)
        } else {
            t0
        };
        Cover {
            raw: s.model_handle().0,
            not_before,
            marker,
        }
    }

    pub(super) fn complete(&mut self, holder: usize, ns: u64, marker: bool) {
        if self.futs.len() >= MAX_FUTS {
            return;
        }
        let Some(h) = self.holder(holder) else { return };
        let Some(s) = h.stream() else { return };
        if self.capturing(&s) {
            refused_in_capture(&s.completed(), "a completion");
            return;
        }
        let cover = self.cover(&s, ns, marker);
        if let Ok(f) = s.completed() {
            self.futs.push(Fut::new(Kind::Done { f, cover }));
        }
    }

    pub(super) fn copy_async(&mut self, buffer: usize, holder: usize, ns: u64, marker: bool) {
        if self.futs.len() >= MAX_FUTS {
            return;
        }
        let (Some(j), Some(h)) = (pick(&self.bufs, buffer), self.holder(holder)) else {
            return;
        };
        let Some(s) = h.stream() else { return };
        self.sync_holdings();
        let b = self.bufs[j].b.clone();
        if self.capturing(&s) {
            refused_in_capture(&b.to_vec_async(&s), "an asynchronous copy");
            return;
        }
        let cover = self.cover(&s, ns, marker);
        let raw = s.model_handle().0;
        match b.to_vec_async(&s) {
            Ok(f) => {
                let expect = self.bufs[j].val.clone();
                self.used(j, raw);
                let len = b.len();
                self.futs.push(Fut::new(Kind::Copy {
                    f,
                    cover,
                    expect,
                    len,
                }));
            }
            Err(_) => {
                // The use may or may not have been recorded.
                drop(s);
                self.resync_last();
            }
        }
    }

    pub(super) fn ready(&mut self, p: i32, poll: bool) {
        if self.futs.len() >= MAX_FUTS {
            return;
        }
        let o = self.ctx().owner();
        let _ = o.set_priority(Priority::Value(p));
        let key = o.priority();
        self.futs.push(Fut::new(Kind::Ready {
            f: o.ready(),
            key,
            joined: None,
        }));
        if poll {
            self.poll(self.futs.len() - 1, false);
        }
    }

    pub(super) fn attach(&mut self, i: usize, wait: bool) {
        if self.futs.len() >= MAX_FUTS {
            return;
        }
        // Its first poll takes its stream: only where that cannot wait at the cap.
        let Some(i) = self.pick_owner(i) else { return };
        let (id, o) = self.owners.swap_remove(i);
        let o = match Rc::try_unwrap(o) {
            Ok(o) => o,
            Err(o) => {
                // A capture shares it.
                self.owners.push((id, o));
                return;
            }
        };
        let c = self.ctx().clone();
        let body: AttachFut = Box::pin(async move {
            // Library code deep inside a task: the current owner's stream.
            let first = c.stream().map(|s| s.model_handle().0).ok();
            let done = if wait {
                c.stream().ok().and_then(|s| s.completed().ok())
            } else {
                None
            };
            if let Some(d) = done {
                let _ = d.await;
            }
            let second = c.stream().map(|s| s.model_handle().0).ok();
            (first, second)
        });
        self.futs.push(Fut::new(Kind::Attach {
            f: o.attach(body),
            id,
        }));
        self.poll(self.futs.len() - 1, false);
    }

    /// Polls future `i`; a resolved one is checked and removed (a resolved owner joins the
    /// model's owners).
    pub(super) fn poll(&mut self, i: usize, fresh: bool) {
        let Some(i) = pick(&self.futs, i) else { return };
        let mut f = self.futs.remove(i);
        if fresh {
            f.wakes = Arc::new(Count::default());
            f.waker = Waker::from(f.wakes.clone());
            f.pending_at = None;
        }
        let waker = f.waker.clone();
        let mut cx = TaskCx::from_waker(&waker);
        let mut earlier = Vec::new();
        // The wake count before the poll: a wake-up that lands during the poll or right after
        // it (the poller and the host-function thread run in real time) is one the executor
        // must act on, as the `Future` contract says, so it counts as a wake-up of this
        // `Pending`. (Read after the poll, the model once took such a wake-up for an earlier
        // one and waited for another that nothing owed it: "polled Pending was not woken",
        // about one corpus replay in five under load.)
        let before = f.woken();
        let pending = match &mut f.kind {
            Kind::Done { f: c, cover } => match Pin::new(&mut *c).poll(&mut cx) {
                Poll::Pending => true,
                Poll::Ready(r) => {
                    assert!(r.is_ok(), "a completion failed: {r:?}");
                    check_done(&self.sim, c, cover, "a completion");
                    false
                }
            },
            Kind::Copy {
                f: c,
                cover,
                expect,
                len,
            } => match Pin::new(&mut *c).poll(&mut cx) {
                Poll::Pending => true,
                Poll::Ready(r) => {
                    let v = r.expect("a host copy failed");
                    check_copy(&self.sim, &v, cover, *len, expect.as_deref());
                    false
                }
            },
            Kind::Ready { f: r, key, joined } => match Pin::new(&mut *r).poll(&mut cx) {
                Poll::Pending => {
                    if joined.is_none() {
                        *joined = Some(self.joins);
                        self.joins += 1;
                    }
                    true
                }
                Poll::Ready(r) => {
                    let (key, joined) = (*key, *joined);
                    // First come, first served. One that never queued is served only with
                    // nobody queued. A queued one may resolve while waiters queued before it
                    // are still pending only if each of those was served first: the crate
                    // hands a stream to the first waiter without one, which takes it at its
                    // next poll; so each of them, polled now, must resolve. (The model once
                    // took "not polled since" for "not served": under load the host-function
                    // thread lands several releases before the model's next poll.)
                    if let Some(first) = self.first_waiter(key) {
                        assert!(
                            joined.is_some(),
                            "an owner waiting for key {key} that never queued was served \
                             before the waiter queued {first}"
                        );
                    }
                    if let (Some(j), Ok(_)) = (joined, &r) {
                        earlier = self.waiters_before(key, j);
                    }
                    if let Ok(o) = r {
                        {
                            let s = o.streams();
                            let mine = s.iter().find(|(q, _)| *q == key);
                            let (_, s) = mine.expect("a ready owner holds its stream");
                            self.check_fresh(s);
                        }
                        if self.owners.len() < 48 {
                            self.owners.push((self.next_owner, Rc::new(o)));
                            self.next_owner += 1;
                        }
                    }
                    false
                }
            },
            Kind::Attach { f: a, id } => match Pin::new(&mut *a).poll(&mut cx) {
                Poll::Pending => true,
                Poll::Ready((first, second)) => {
                    let o = a.owner().expect("the owner is back after the poll");
                    // The owner goes with the future: what it took in this poll is counted now
                    // (the step's `sync_holdings` no longer sees it).
                    let pairs: Vec<(u64, u64)> = o
                        .streams()
                        .iter()
                        .map(|(_, s)| (*id, s.model_handle().0))
                        .collect();
                    self.sync_gone(*id, &pairs);
                    let mine = o
                        .streams()
                        .into_iter()
                        .find(|(q, _)| *q == o.priority())
                        .map(|(_, s)| s.model_handle().0);
                    for seen in [first, second].into_iter().flatten() {
                        assert_eq!(
                            Some(seen),
                            mine,
                            "Context::stream inside an attached future gave another stream \
                             than the attached owner's"
                        );
                    }
                    false
                }
            },
        };
        if pending {
            // `CSP_MODEL_POLL_PAUSE_US=N` pauses here (widening the window in which a wake-up
            // lands after the poll), to check that the wake-up checks hold whatever the timing.
            if let Some(pause) = poll_pause() {
                std::thread::sleep(pause);
            }
            f.pending_at = Some(before);
            self.futs.insert(i, f);
        }
        for j in earlier {
            let Some(k) = self
                .futs
                .iter()
                .position(|f| matches!(f.kind, Kind::Ready { joined: Some(q), .. } if q == j))
            else {
                continue; // resolved meanwhile (by the poll of an earlier one)
            };
            let before = self.futs.len();
            self.poll(k, false);
            assert!(
                self.futs.len() < before,
                "an owner waiting at the cap (queued {j}) is still waiting after one queued \
                 behind it was served"
            );
        }
    }

    /// The queue positions of the pending `Owner::ready` futures of key `p` queued before `j`.
    fn waiters_before(&self, p: i32, j: u64) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .futs
            .iter()
            .filter_map(|f| match f.kind {
                Kind::Ready {
                    key,
                    joined: Some(q),
                    ..
                } if key == p && q < j => Some(q),
                _ => None,
            })
            .collect();
        v.sort_unstable();
        v
    }

    pub(super) fn reserve(&mut self, p: i32, n: usize) {
        let r = self.ctx().reserve(Priority::Value(p), n);
        if let Some(cap) = self.cap {
            if n > cap {
                assert!(r.is_err(), "reserved {n} streams above the cap of {cap}");
            }
        }
        if r.is_ok() {
            let st = self.ctx().stats_for(Priority::Value(p)).expect("in range");
            assert!(
                st.live >= n as u64,
                "reserve({n}) returned with {} live: {st:?}",
                st.live
            );
        }
    }

    /// Another thread acquires a stream of owner `i`'s key while the model drops owner `i` (and
    /// lets simulated time pass): it must get through, with a stream nobody else holds.
    pub(super) fn blocked_acquire(&mut self, i: usize) {
        if self.cap.is_none() {
            return;
        }
        let Some(i) = pick(&self.owners, i) else {
            return;
        };
        let key = self.owners[i].1.priority();
        // Nobody queued before the thread (the model's waiters are polled by this thread), and
        // the owner gives a stream of the key back.
        let holds = self.owners[i].1.streams().iter().any(|(q, _)| *q == key);
        if self.queued(key) || !holds {
            return;
        }
        // A stream whose capture the crate could not end (three failed tries: see
        // `check_capture_ended`) stays out of circulation for good and keeps its place under the
        // cap: what such an owner gives back cannot serve the thread. Campaign 11's finding
        // `regression-stuck-capture-holds-its-cap-d0303a4b` before this.
        let gives_back_stuck =
            self.owners[i].1.streams().iter().any(|(q, s)| {
                *q == key && self.stuck.iter().any(|&(_, r)| r == s.model_handle().0)
            });
        if gives_back_stuck {
            return;
        }
        let (id, o) = self.owners.swap_remove(i);
        let o = match Rc::try_unwrap(o) {
            Ok(o) => o,
            Err(o) => {
                self.owners.push((id, o));
                return;
            }
        };
        let back = o
            .streams()
            .into_iter()
            .find(|(q, _)| *q == key)
            .map(|(_, s)| s.model_handle())
            .expect("checked above");

        let ctx = self.ctx().clone();
        let (sim, other) = (self.sim.clone(), self.other);
        let t = std::thread::spawn(move || {
            sim.set_thread_context(other);
            let r = (|| {
                let mine = ctx.owner();
                mine.set_priority(Priority::Value(key))?;
                let raw = mine.stream()?.model_handle().0;
                Ok::<u64, Error>(raw)
            })();
            let (ctx, mode) = sim.thread_state();
            (r, (ctx, mode, "a blocked acquisition"))
        });
        drop(o);
        // Simulated time passes until the stream given back is idle (its work may wait for
        // host functions, which run in real time; host functions enqueued meanwhile start at
        // the simulation's next step). The thread must then finish: "not yet" is told from
        // "never" by the thread being parked in the crate with nothing left to wake it.
        let served = self.await_quiet(
            &|| t.is_finished(),
            &|| cuda_stream_pool::__model_hooks::is_parked(t.thread().id()),
            &|| if self.sim.is_busy(back) { LONG } else { 0 },
        );
        assert!(
            served,
            "an acquisition waiting at the cap of key {key} was not served after a stream came \
             back and its work completed"
        );
        let (r, state) = t.join().expect("the acquiring thread panicked");
        self.thread_states.push(state);
        if let Ok(raw) = r {
            let held: HashSet<u64> = self.held_pairs().into_iter().map(|p| p.1).collect();
            assert!(
                !held.contains(&raw),
                "a stream held by an owner was handed to another"
            );
            *self.gens.entry(raw).or_insert(0) += 1;
        }
    }

    /// The futures' invariants (see the module's docs).
    pub(super) fn check_futs(&self) {
        for f in &self.futs {
            if let Kind::Done { f: c, cover } = &f.kind {
                // (Read in this order: the flag lands while the stream still reports busy.)
                let busy = self
                    .sim
                    .is_busy(cuda_stream_pool::driver::Stream(cover.raw));
                if c.is_complete() {
                    cover.check(&self.sim, "a completion");
                } else {
                    assert!(
                        busy,
                        "a completion is not complete, but its stream has nothing pending"
                    );
                }
            }
        }
        for f in &self.futs {
            let Some(w0) = f.pending_at else { continue };
            let idle = |raw: u64| !self.sim.is_busy(cuda_stream_pool::driver::Stream(raw));
            let due = match &f.kind {
                Kind::Done { cover, .. } | Kind::Copy { cover, .. } => idle(cover.raw),
                Kind::Attach { f: a, .. } => a
                    .owner()
                    .and_then(|o| {
                        o.streams()
                            .into_iter()
                            .find(|(q, _)| *q == o.priority())
                            .map(|(_, s)| s.model_handle().0)
                    })
                    .is_some_and(idle),
                Kind::Ready {
                    key,
                    joined: Some(j),
                    ..
                } => self.first_waiter(*key) == Some(*j) && self.servable(*key),
                Kind::Ready { joined: None, .. } => false,
            };
            if due && !self.await_wake(f, w0) {
                panic!(
                    "{} polled Pending was not woken although what it waits for happened \
                     (and every thread that could wake it had nothing left to do)",
                    f.what()
                );
            }
        }
    }
}

impl Model {
    /// After the context died ([`Op::Kill`]): every future resolves, each with success only
    /// where it could have succeeded (a completion or copy whose work ended before the fault,
    /// checked as after any poll; an owner served with a stream) and otherwise with the sticky
    /// error `code`. The futures are polled together, each again whenever any is woken, as an
    /// executor would; one that is never woken again is a hang (reported after [`HANG_LIMIT`]:
    /// a guard only, a live context's futures are not waited for). The caller dropped every
    /// owner first (a waiter at the cap waits for one, dead context or not). With
    /// `waiters_may_wait`, owners waiting at the cap are not waited for once they are all that
    /// is left (a leaked capture guard keeps its owner's stream, and its place under the cap,
    /// for ever).
    pub(super) fn resolve_dead(&mut self, code: ErrorCode, waiters_may_wait: bool) {
        let count = Arc::new(Count::default());
        let waker = Waker::from(count.clone());
        let mut cx = TaskCx::from_waker(&waker);
        let hang = Instant::now() + HANG_LIMIT;
        let sticky = |what: &str, e: &Error| {
            assert_eq!(
                e.code(),
                Some(code),
                "{what} of a dead context failed with another error than its sticky one: {e}"
            );
        };
        loop {
            let seen = count.0.load(Ordering::SeqCst);
            let mut i = 0;
            while i < self.futs.len() {
                let done = match &mut self.futs[i].kind {
                    Kind::Done { f: c, cover } => match Pin::new(&mut *c).poll(&mut cx) {
                        Poll::Pending => false,
                        Poll::Ready(Ok(())) => {
                            check_done(&self.sim, c, cover, "a completion of a dead context");
                            true
                        }
                        Poll::Ready(Err(e)) => {
                            sticky("a completion", &e);
                            true
                        }
                    },
                    Kind::Copy {
                        f: c,
                        cover,
                        expect,
                        len,
                    } => match Pin::new(&mut *c).poll(&mut cx) {
                        Poll::Pending => false,
                        Poll::Ready(Ok(v)) => {
                            check_copy(&self.sim, &v, cover, *len, expect.as_deref());
                            true
                        }
                        Poll::Ready(Err(e)) => {
                            sticky("a host copy", &e);
                            true
                        }
                    },
                    Kind::Ready { f: r, .. } => match Pin::new(&mut *r).poll(&mut cx) {
                        Poll::Pending => false,
                        Poll::Ready(Ok(_)) => true,
                        Poll::Ready(Err(e)) => {
                            sticky("an owner waiting at the cap", &e);
                            true
                        }
                    },
                    Kind::Attach { f: a, .. } => Pin::new(&mut *a).poll(&mut cx).is_ready(),
                };
                if done {
                    drop(self.futs.remove(i));
                } else {
                    i += 1;
                }
            }
            let waiters_only = self
                .futs
                .iter()
                .all(|f| matches!(f.kind, Kind::Ready { .. }));
            if self.futs.is_empty() || (waiters_may_wait && waiters_only) {
                self.futs.clear();
                return;
            }
            while count.0.load(Ordering::SeqCst) == seen {
                assert!(
                    Instant::now() < hang,
                    "a hang: {} future(s) of a dead context never woken again (first: {})",
                    self.futs.len(),
                    self.futs[0].what()
                );
                std::thread::yield_now();
            }
        }
    }
}

impl Model {
    /// What the threads that wake futures have done so far: host functions started and
    /// returned on the simulation's host-function thread, wake-ups handed to the crate's
    /// background threads and run there.
    fn wake_activity(&self) -> [u64; 4] {
        let (hs, hr) = self.sim.host_fn_progress();
        let (bq, br) = cuda_stream_pool::__model_hooks::background();
        [hs, hr, bq, br]
    }

    /// Waits until `f` is woken after its `w0`th wake-up; false when it is not although every
    /// thread that could wake it has nothing left to do (see [`Model::await_quiet`]).
    fn await_wake(&self, f: &Fut, w0: usize) -> bool {
        self.await_quiet(&|| f.woken() > w0, &|| true, &|| 0)
    }

    /// Waits until `done`; false when it is not done although every thread that could make it
    /// so has nothing left to do: two rounds in a row in which, after a step of the simulation
    /// (by `step()` ns), no host function started or returned, no wake-up was handed to or run
    /// by a background thread of the crate, the completion poller made a whole pass (or had
    /// nothing pending), and `stuck` held (the waiting thread, if any, is parked). No timing
    /// decides it: on a loaded machine the rounds only take longer. (A bound of [`HANG_LIMIT`]
    /// reports a thread that never finishes what it was given: a hang.)
    fn await_quiet(
        &self,
        done: &dyn Fn() -> bool,
        stuck: &dyn Fn() -> bool,
        step: &dyn Fn() -> u64,
    ) -> bool {
        let hang = Instant::now() + HANG_LIMIT;
        let mut quiet = 0;
        loop {
            if done() {
                return true;
            }
            let before = self.wake_activity();
            self.sim.advance(step());
            let p0 = self.ctx().model_poller_progress();
            loop {
                let [hs, hr, bq, br] = self.wake_activity();
                let poller = match (p0, self.ctx().model_poller_progress()) {
                    (_, None) => true,
                    (None, Some((_, idle))) => idle,
                    (Some((a, _)), Some((b, idle))) => idle || b >= a + 2,
                };
                if hs == hr && bq == br && poller && stuck() {
                    break;
                }
                if done() {
                    return true;
                }
                assert!(
                    Instant::now() < hang,
                    "a hang: a host function, a background wake-up, the completion poller or a \
                     waiting thread did not finish in {HANG_LIMIT:?}"
                );
                if !poller {
                    // Its next sweep now, not at its nap's end (up to 1 ms of real time away;
                    // a spurious wake-up to the poller, which decides nothing).
                    self.ctx().model_poller_nudge();
                }
                std::thread::yield_now();
            }
            if done() {
                return true;
            }
            if self.wake_activity() == before {
                quiet += 1;
                if quiet == 2 {
                    return false;
                }
            } else {
                quiet = 0;
            }
        }
    }
}

/// What a re-entrant waker does (once), and when.
#[derive(Debug, Clone, Copy)]
pub enum Reenter {
    /// `Context::trim`.
    Trim,
    /// Drops one of the model's buffers (given to the waker).
    DropBuffer(usize),
    /// A new owner of the future's key (`Priority::Normal` for a future that is not an
    /// `Owner::ready`) polls its own `Owner::ready` once and goes: it searches the pool or joins
    /// and leaves the key's queue, so a waker run under the pool's shard lock or the gate's
    /// queue lock locks it again (a re-entrant lock panics under `model-hooks`). Only on the
    /// model's thread (elsewhere the waker keeps it for a later wake, clone or drop there): a
    /// stream it holds for a moment on another thread would race the model's checks of the
    /// pool's counters. A stream it is handed counts as a hand-over (`Model::gen_of`).
    Acquire,
}

/// When a re-entrant waker runs its action: at a wake, at a clone, or at a drop of a clone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    Wake,
    Clone,
    Drop,
}

/// A waker that counts its wake-ups and runs user code that re-enters the crate once.
struct Reentrant {
    count: Arc<Count>,
    at: At,
    /// The only thread that runs the action, if any.
    only_on: Option<std::thread::ThreadId>,
    /// Where a panic of the action goes (the crate catches a waker's panic): the model's
    /// `waker_panics`, checked after every step.
    panics: Arc<std::sync::Mutex<Vec<String>>>,
    action: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// Re-entrant wakers' actions begun and ended, on any thread (the poller's, the crate's waker
/// thread, the model's).
pub(super) static ACTIONS: (std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64) = (
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
);

/// Counts an action as ended when dropped (after it returned or panicked).
struct Ran;

impl Drop for Ran {
    fn drop(&mut self) {
        ACTIONS.1.fetch_add(1, Ordering::SeqCst);
    }
}

impl Drop for Reentrant {
    fn drop(&mut self) {
        // An action that never fired is dropped with the last clone of the waker, wherever
        // that is (the poller's thread, when the crate lets go of a stored waker): a buffer it
        // holds is freed there. Counted as an action (CI's loaded run found such a free in a
        // window of checked calls).
        let f = self
            .action
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(f) = f {
            ACTIONS.0.fetch_add(1, Ordering::SeqCst);
            let _ran = Ran;
            drop(f);
        }
    }
}

impl Reentrant {
    fn fire(&self, now: At) {
        if now == self.at
            && self
                .only_on
                .is_none_or(|t| t == std::thread::current().id())
        {
            let f = self.action.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(f) = f {
                // Counted before it runs (its driver calls may land in a window of checked calls,
                // at a time of the machine's choosing: `Model::check_buffer_calls`) and after.
                ACTIONS.0.fetch_add(1, Ordering::SeqCst);
                let _ran = Ran;
                if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                    let msg = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    self.panics
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(msg);
                }
            }
        }
    }

    fn waker(self: Arc<Self>) -> Waker {
        use std::task::{RawWaker, RawWakerVTable};
        unsafe fn clone(p: *const ()) -> RawWaker {
            // SAFETY: `p` is a reference count of an `Arc<Reentrant>` (made below or here).
            let a = unsafe { Arc::from_raw(p as *const Reentrant) };
            let b = a.clone();
            std::mem::forget(a);
            b.fire(At::Clone);
            RawWaker::new(Arc::into_raw(b) as *const (), &VTABLE)
        }
        unsafe fn wake(p: *const ()) {
            // SAFETY: as in `clone`; this consumes the waker's count.
            let a = unsafe { Arc::from_raw(p as *const Reentrant) };
            a.count.0.fetch_add(1, Ordering::SeqCst);
            a.fire(At::Wake);
            a.fire(At::Drop);
        }
        unsafe fn wake_by_ref(p: *const ()) {
            // SAFETY: as in `clone`; borrowed, not consumed.
            let a = unsafe { &*(p as *const Reentrant) };
            a.count.0.fetch_add(1, Ordering::SeqCst);
            a.fire(At::Wake);
        }
        unsafe fn drop_raw(p: *const ()) {
            // SAFETY: as in `clone`; this consumes the waker's count.
            let a = unsafe { Arc::from_raw(p as *const Reentrant) };
            a.fire(At::Drop);
        }
        static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, wake, wake_by_ref, drop_raw);
        let raw = RawWaker::new(Arc::into_raw(self) as *const (), &VTABLE);
        // SAFETY: the vtable's functions keep the contract of `RawWakerVTable`: each clone is a
        // new reference count of the `Arc`, wake and drop consume one, wake_by_ref none; the
        // data is `Send + Sync`.
        unsafe { Waker::from_raw(raw) }
    }
}

impl Model {
    /// Polls future `fut` with a waker whose wake, clone or drop re-enters the crate (once).
    pub(super) fn reentrant_poll(&mut self, fut: usize, action: Reenter, at: At) {
        let Some(i) = pick(&self.futs, fut) else {
            return;
        };
        let ctx = self.ctx().clone();
        let mut only_on = None;
        let f: Box<dyn FnOnce() + Send> = match action {
            Reenter::Trim => Box::new(move || {
                let _ = ctx.trim();
            }),
            Reenter::DropBuffer(j) => {
                let Some(j) = pick(&self.bufs, j) else {
                    return;
                };
                let b = self.bufs.swap_remove(j).b;
                Box::new(move || drop(b))
            }
            Reenter::Acquire => {
                let key = match &self.futs[i].kind {
                    Kind::Ready { key, .. } => *key,
                    _ => 0,
                };
                only_on = Some(std::thread::current().id());
                let handed = self.handed_unseen.clone();
                Box::new(move || {
                    let o = ctx.owner();
                    let _ = o.set_priority(Priority::Value(key));
                    let mut f = o.ready();
                    let w = Waker::from(Arc::new(Count::default()));
                    if let Poll::Ready(Ok(o)) = Pin::new(&mut f).poll(&mut TaskCx::from_waker(&w)) {
                        let mut h = handed.lock().unwrap_or_else(|p| p.into_inner());
                        for (_, s) in o.streams() {
                            *h.entry(s.model_handle().0).or_insert(0) += 1;
                        }
                    }
                })
            }
        };
        let count = Arc::new(Count::default());
        let r = Arc::new(Reentrant {
            count: count.clone(),
            at,
            only_on,
            panics: self.waker_panics.clone(),
            action: std::sync::Mutex::new(Some(f)),
        });
        let f = &mut self.futs[i];
        f.wakes = count;
        f.waker = r.waker();
        f.pending_at = None;
        self.poll(i, false);
    }
}
