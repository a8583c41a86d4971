//! Streams, simulated time and happens-before.
//!
//! * Each stream is a FIFO queue of operations that start when they reach the head of the queue
//!   (and, for an event wait, when the awaited record has completed) and complete a fixed
//!   simulated duration later. The clock is advanced by hand in tests, or is real time under a
//!   latency model; waiting calls jump the manual clock to the next completion, as if the CPU had
//!   waited.
//! * Host functions (`cuLaunchHostFunc`) run on ONE worker thread per simulation, one at a time
//!   in the order they start, as the real driver runs all host functions of a context on a single
//!   driver thread: a host function that blocks delays every other one. A driver call made from
//!   inside a host function fails with `CUDA_ERROR_NOT_PERMITTED` and is recorded as misuse (the
//!   real driver returns that error or deadlocks).
//! * Happens-before is tracked with vector clocks ([`Vc`]): every stream has one, every enqueued
//!   operation keeps a copy, event records carry the recording stream's clock and event waits
//!   join it, and the host has one clock (per process, which is slightly more forgiving than the
//!   per-thread truth) that joins whatever a synchronizing call or a successful query observed
//!   complete; every operation enqueued later joins the host clock. The memory module uses these
//!   clocks to find unordered accesses (races), whatever the simulated durations are.
//!
//!   A `cuStreamWriteValue64` landing in host memory is a host observation when it lands: the
//!   host may read the word from then on, and reading it shows the work before the write
//!   complete (the write is fenced behind that work). Forgiving only for code that would act on
//!   the completion without reading the word.
//!
//!   Limits of the model: a host function's completion is not a host observation (code that
//!   learns of completion only through a callback is reported, where the real driver would have
//!   ordered it); the legacy default stream's implicit synchronization with blocking streams is
//!   not modelled (so work on it is reported as unordered, stricter than CUDA); the operations of
//!   one graph launch share the launch's clock, so races between unordered branches inside one
//!   graph are not found.

use super::*;
use std::cell::Cell;
use std::sync::mpsc;

/// A vector clock: stream id -> number of operations of that stream that are ordered before,
/// as a vector sorted by stream id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Vc(Vec<(u64, u64)>);

impl Vc {
    /// The component of stream `s`.
    pub(super) fn get(&self, s: u64) -> u64 {
        match self.0.binary_search_by_key(&s, |e| e.0) {
            Ok(i) => self.0[i].1,
            Err(_) => 0,
        }
    }
    /// Pointwise maximum; whether `self` changed.
    pub(super) fn join(&mut self, other: &Vc) -> bool {
        if other.0.is_empty() || self.0 == other.0 {
            return false;
        }
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::with_capacity(self.0.len().max(other.0.len()));
        let mut changed = false;
        while i < self.0.len() || j < other.0.len() {
            match (self.0.get(i), other.0.get(j)) {
                (Some(a), Some(b)) if a.0 == b.0 => {
                    changed |= b.1 > a.1;
                    out.push((a.0, a.1.max(b.1)));
                    i += 1;
                    j += 1;
                }
                (Some(a), Some(b)) if a.0 < b.0 => {
                    out.push(*a);
                    i += 1;
                }
                (Some(a), None) => {
                    out.push(*a);
                    i += 1;
                }
                (_, Some(b)) => {
                    changed = true;
                    out.push(*b);
                    j += 1;
                }
                (None, None) => unreachable!(),
            }
        }
        if changed {
            self.0 = out;
        }
        changed
    }
    /// Increments the component of stream `s`, returning the new value.
    pub(super) fn tick(&mut self, s: u64) -> u64 {
        match self.0.binary_search_by_key(&s, |e| e.0) {
            Ok(i) => {
                self.0[i].1 += 1;
                self.0[i].1
            }
            Err(i) => {
                self.0.insert(i, (s, 1));
                1
            }
        }
    }
}

/// How an effect executes: on which stream, with which clock, and whether as part of a graph.
pub(super) struct Exec<'a> {
    pub(super) stream: u64,
    pub(super) vc: &'a Vc,
    pub(super) graph: bool,
}

pub(super) enum OpKind {
    Effect(Effect),
    Record {
        event: u64,
        seq: u64,
    },
    Wait {
        event: u64,
        seq: u64,
    },
    Host {
        f: Option<HostFn>,
        done: Arc<AtomicBool>,
    },
    Graph(Arc<Vec<(Effect, u64)>>),
    /// `cuStreamWriteValue64`: stores `value` at the device address `addr` when it completes.
    WriteValue {
        addr: u64,
        value: u64,
    },
    /// `cuStreamWaitValue32`: starts once the word at `addr` satisfies the condition.
    WaitValue {
        addr: u64,
        value: u32,
        cond: WaitValue,
    },
}

pub(super) struct Op {
    pub(super) kind: OpKind,
    pub(super) dur: u64,
    pub(super) start: Option<u64>,
    pub(super) enq: u64,
    /// The stream's clock when the operation was enqueued.
    pub(super) vc: Arc<Vc>,
}

pub(super) struct SimStream {
    /// The context the stream was created in (0 for the legacy stream).
    pub(super) ctx: u64,
    pub(super) flags: u32,
    pub(super) priority: i32,
    pub(super) queue: VecDeque<Op>,
    pub(super) free_at: u64,
    /// The id of the capture the stream takes part in (as origin or pulled in by an event wait).
    pub(super) capture: Option<u64>,
    pub(super) used_pool: bool,
    /// The stream's vector clock (shared with the operations that snapshot it).
    pub(super) vc: Arc<Vc>,
    /// The version of the host's clock last joined into `vc`.
    pub(super) host_seen: u64,
}

impl SimStream {
    pub(super) fn new(ctx: u64, flags: u32, priority: i32) -> SimStream {
        SimStream {
            ctx,
            flags,
            priority,
            queue: VecDeque::new(),
            free_at: 0,
            capture: None,
            used_pool: false,
            vc: Arc::default(),
            host_seen: 0,
        }
    }
}

pub(super) enum Clock {
    Manual(AtomicU64),
    Real(Instant),
}

impl Clock {
    pub(super) fn now(&self) -> u64 {
        match self {
            Clock::Manual(t) => t.load(Ordering::Acquire),
            Clock::Real(start) => start.elapsed().as_nanos() as u64,
        }
    }
}

/// The host-function threads of every simulation of the process that have not returned:
/// counted before a thread starts, and by the thread as the last thing it does.
pub(super) static LIVE_HOST_THREADS: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(0);

thread_local! {
    /// Set while this thread runs a host function for the simulation.
    pub(super) static IN_HOST_FN: Cell<bool> = const { Cell::new(false) };
    /// The id of the simulation whose host function this thread runs (0: none).
    pub(super) static HOST_FN_OF: Cell<u64> = const { Cell::new(0) };
}

/// Runs `f` as a host function: with [`IN_HOST_FN`] set and panics caught.
pub(super) fn run_host_fn(f: HostFn) {
    IN_HOST_FN.with(|c| c.set(true));
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    IN_HOST_FN.with(|c| c.set(false));
}

/// Why `progress` visits a busy stream before the clock reaches `State::next_due`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Watch {
    /// At every visit: its first operation is new, waits for a host write, or is a host
    /// function running.
    Always,
    /// Its first operation waits for an event's record: only after a record has completed.
    Event,
}

/// The watched streams (`State::watch`), by why: `progress` visits the event-watched ones only
/// once a record has completed in the call, so it lists them only then (they can be many: in a
/// model whose clock stands still, every stream waiting for an unrecorded event).
#[derive(Default)]
pub(super) struct Watched {
    always: std::collections::BTreeSet<u64>,
    event: std::collections::BTreeSet<u64>,
}

impl Watched {
    pub(super) fn insert(&mut self, id: u64, why: Watch) {
        let (to, from) = match why {
            Watch::Always => (&mut self.always, &mut self.event),
            Watch::Event => (&mut self.event, &mut self.always),
        };
        from.remove(&id);
        to.insert(id);
    }

    pub(super) fn remove(&mut self, id: &u64) {
        if !self.always.remove(id) {
            self.event.remove(id);
        }
    }

    /// Every watched stream above `after` (all with `None`), in ascending order, and why.
    fn list(&self, after: Option<u64>, out: &mut Vec<(u64, Watch)>) {
        let lo = after.map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
        let range = (lo, std::ops::Bound::Unbounded);
        let mut a = self.always.range(range).peekable();
        let mut e = self.event.range(range).peekable();
        loop {
            let next = match (a.peek(), e.peek()) {
                (Some(&&x), Some(&&y)) if x < y => (*a.next().unwrap(), Watch::Always),
                (Some(_), Some(_)) | (None, Some(_)) => (*e.next().unwrap(), Watch::Event),
                (Some(_), None) => (*a.next().unwrap(), Watch::Always),
                (None, None) => return,
            };
            out.push(next);
        }
    }
}

/// A job of the host-function worker thread.
pub(super) type HostJob = Box<dyn FnOnce() + Send + 'static>;

/// The single host-function worker thread: jobs run one at a time, in send order; the thread
/// ends when the sender is dropped, and the simulation's drop joins it.
pub(super) struct HostWorker {
    pub(super) tx: mpsc::Sender<HostJob>,
    pub(super) thread: std::thread::JoinHandle<()>,
    /// Disconnected when the thread has returned (its sender is dropped then): a worker started
    /// after this one was ended waits on it, so that host functions still run one at a time.
    pub(super) gone: mpsc::Receiver<()>,
}

/// Starts the worker; `Err` when no thread can be started (or `fail`, the simulation's
/// injected failure: [`SimDriver::fail_host_thread_spawns`]), with `after` given back (host
/// functions then run on the thread that completes them, once the ended worker has returned).
/// `after`: the `gone` of an ended worker that may still be running its last jobs; the new one
/// runs none before that one has returned.
pub(super) fn host_worker(
    after: Option<mpsc::Receiver<()>>,
    fail: bool,
) -> std::result::Result<HostWorker, Option<mpsc::Receiver<()>>> {
    if fail {
        return Err(after);
    }
    let (tx, rx) = mpsc::channel::<HostJob>();
    let (gone_tx, gone) = mpsc::channel::<()>();
    // Taken by the thread when it starts; taken back if it cannot start.
    let after = Arc::new(std::sync::Mutex::new(after));
    let theirs = after.clone();
    LIVE_HOST_THREADS.fetch_add(1, Ordering::SeqCst);
    let spawned = std::thread::Builder::new()
        .name("sim-host-fn".into())
        .spawn(move || {
            let gone = gone_tx;
            let after = theirs.lock().unwrap_or_else(|p| p.into_inner()).take();
            drop(theirs);
            if let Some(after) = after {
                // Returns `Err` once the ended worker's thread has returned.
                let _ = after.recv();
            }
            while let Ok(job) = rx.recv() {
                job();
            }
            // Counted out before its `gone` closes: whoever waits for that sees it counted out.
            LIVE_HOST_THREADS.fetch_sub(1, Ordering::SeqCst);
            drop(gone);
        });
    match spawned {
        Ok(thread) => Ok(HostWorker { tx, thread, gone }),
        Err(_) => {
            LIVE_HOST_THREADS.fetch_sub(1, Ordering::SeqCst);
            Err(after.lock().unwrap_or_else(|p| p.into_inner()).take())
        }
    }
}

impl SimDriver {
    pub(super) fn check_stream(st: &mut State, s: Stream, call: &'static str) -> Result<()> {
        if st.streams.contains_key(&s.0) {
            Ok(())
        } else {
            Self::note_misuse(
                st,
                format!("{call} on unknown or destroyed stream {:#x}", s.0),
            );
            Self::fail(st, ErrorCode::ERROR_INVALID_HANDLE, call)
        }
    }

    /// Advances stream `s`'s clock for a new operation: joins the host's clock, then ticks.
    pub(super) fn tick_stream(st: &mut State, s: u64) -> Arc<Vc> {
        let stream = st.streams.get_mut(&s).expect("checked by the caller");
        if stream.host_seen != st.host_version {
            stream.host_seen = st.host_version;
            Arc::make_mut(&mut stream.vc).join(&st.host_vc);
        }
        Arc::make_mut(&mut stream.vc).tick(s);
        stream.vc.clone()
    }

    /// A stream's clock joins `vc` (an event wait).
    pub(super) fn stream_joins(st: &mut State, s: u64, vc: &Vc) {
        if let Some(stream) = st.streams.get_mut(&s) {
            if !vc.0.is_empty() {
                Arc::make_mut(&mut stream.vc).join(vc);
            }
        }
    }

    /// The host has observed everything ordered before `vc` complete.
    pub(super) fn host_observes(st: &mut State, vc: &Vc) {
        if st.host_vc.join(vc) {
            st.host_version += 1;
        }
    }

    /// Enqueues an operation on a stream, or records it into the stream's capture.
    pub(super) fn enqueue(
        &self,
        st: &mut State,
        s: Stream,
        kind: OpKind,
        dur: u64,
        call: &'static str,
    ) -> Result<()> {
        let now = self.clock.now();
        let cap = st.streams.get(&s.0).expect("checked by the caller").capture;
        if let Some(id) = cap {
            let c = st.captures.get_mut(&id).expect("a stream's capture exists");
            if c.invalidated {
                return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED, call);
            }
            // Every captured node advances the stream's tip (see capture.rs: fork/join).
            *c.tips.entry(s.0).or_insert(0) += 1;
            match kind {
                OpKind::Effect(e) => c.ops.push((e, dur)),
                OpKind::Host { f, .. } => c.ops.push((Effect::Host(Arc::new(Mutex::new(f))), dur)),
                // Records and waits inside a capture become graph edges; the model keeps the
                // graph's operations in enqueue order, which respects every edge.
                OpKind::Record { .. } | OpKind::Wait { .. } => {}
                // Refused before they get here (hostmem.rs): never part of a capture.
                OpKind::WriteValue { .. } | OpKind::WaitValue { .. } => {}
                OpKind::Graph(ops) => {
                    for (e, d) in ops.iter() {
                        c.ops.push((Self::clone_effect(e), *d));
                    }
                }
            }
            return Ok(());
        }
        let vc = Self::tick_stream(st, s.0);
        st.busy.insert(s.0);
        // (Only a first operation matters to `progress`; watching a stream that has one
        // already costs a visit, nothing else.)
        st.watch.insert(s.0, Watch::Always);
        let stream = st.streams.get_mut(&s.0).expect("checked by the caller");
        stream.queue.push_back(Op {
            kind,
            dur,
            start: None,
            enq: now,
            vc,
        });
        self.progress(st);
        Ok(())
    }

    /// Completes every operation whose time has come, in stream order, following event waits.
    pub(super) fn progress(&self, st: &mut State) {
        let now = self.clock.now();
        // Before `next_due` only the watched streams can change (see `State::watch`), and one
        // whose first operation waits for an event only after a completion (an event's record
        // completes only here): the others are skipped, which completes the same operations in
        // the same order (a skipped stream would break at its first operation).
        let all = now >= st.next_due;
        if all {
            st.next_due = u64::MAX;
        }
        let mut completed = false;
        let mut any = false;
        loop {
            let mut changed = false;
            // The pass visits the streams listed at its start, in ascending order, the
            // event-watched ones only once a record has completed. Before that they are not
            // listed; if a record completes during the pass, those above the stream just visited
            // join it then (a visit changes only the visited stream's entry, so they are what
            // the list at the pass's start held).
            let mut events_left_out = false;
            let mut ids: Vec<(u64, Watch)> = Vec::new();
            if all {
                ids.extend(st.busy.iter().map(|&id| (id, Watch::Always)));
            } else if completed {
                st.watch.list(None, &mut ids);
            } else {
                ids.extend(st.watch.always.iter().map(|&id| (id, Watch::Always)));
                events_left_out = !st.watch.event.is_empty();
            }
            let (mut k, mut last) = (0, None);
            loop {
                if events_left_out && completed {
                    // The rest of the list, with the event-watched streams above the last one
                    // visited.
                    events_left_out = false;
                    ids.truncate(k);
                    st.watch.list(last, &mut ids);
                }
                let Some(&(id, why)) = ids.get(k) else { break };
                k += 1;
                last = Some(id);
                if why == Watch::Event && !completed {
                    continue;
                }
                loop {
                    let (events, retired, streams, host_mem) = (
                        &st.events,
                        &st.retired_events,
                        &mut st.streams,
                        &st.host_mem,
                    );
                    let Some(s) = streams.get_mut(&id) else {
                        // Destroyed (`busy` and `watch` lose it then).
                        st.busy.remove(&id);
                        st.watch.remove(&id);
                        break;
                    };
                    if st.dead.contains_key(&s.ctx) {
                        // A dead context's work never completes (`SimDriver::kill_context`).
                        break;
                    }
                    let free_at = s.free_at;
                    let Some(head) = s.queue.front_mut() else {
                        st.busy.remove(&id);
                        st.watch.remove(&id);
                        break;
                    };
                    if head.start.is_none() {
                        let (eligible, why) = match &head.kind {
                            OpKind::Wait { event, seq } => (
                                match events.get(event).or_else(|| retired.get(event)) {
                                    Some(e) if e.is_done(*seq) => Some(e.done_at),
                                    Some(_) => None,
                                    None => Some(now),
                                },
                                Watch::Event,
                            ),
                            OpKind::WaitValue { addr, value, cond } => (
                                Self::wait_passes(host_mem, *addr, *value, *cond)
                                    .then_some(free_at.max(now)),
                                Watch::Always,
                            ),
                            _ => (Some(free_at), Watch::Always),
                        };
                        let Some(t) = eligible else {
                            st.watch.insert(id, why);
                            break;
                        };
                        head.start = Some(t.max(head.enq).max(free_at));
                    }
                    let start = head.start.unwrap();
                    if start > now {
                        Self::settle(st, id, start);
                        break;
                    }
                    if let OpKind::Host { f, done } = &mut head.kind {
                        if f.is_some() && st.host.is_none() {
                            let after = st.host_ended.take();
                            let fail = self.host_spawn_failures.load(Ordering::SeqCst) > 0;
                            if fail {
                                self.host_spawn_failures.fetch_sub(1, Ordering::SeqCst);
                            }
                            match host_worker(after, fail) {
                                Ok(w) => st.host = Some(w),
                                Err(after) => st.host_ended = after,
                            }
                            // No thread: the host function runs here, but never beside an
                            // ended worker's last ones (review 25): while that one runs, it
                            // waits (a later pass starts a thread, or runs it here).
                            if st.host.is_none() {
                                let ended_runs = st.host_ended.as_ref().is_some_and(|g| {
                                    matches!(g.try_recv(), Err(mpsc::TryRecvError::Empty))
                                });
                                if ended_runs {
                                    st.watch.insert(id, Watch::Always);
                                    break;
                                }
                                st.host_ended = None;
                            }
                        }
                        if let Some(f) = f.take() {
                            any = true;
                            let done = done.clone();
                            let cv = self.cv.clone();
                            let jobs = self.host_jobs.clone();
                            jobs.0.fetch_add(1, Ordering::SeqCst);
                            let sim_id = self.id;
                            let job: HostJob = Box::new(move || {
                                let outer = HOST_FN_OF.with(|c| c.replace(sim_id));
                                run_host_fn(f);
                                HOST_FN_OF.with(|c| c.set(outer));
                                done.store(true, Ordering::Release);
                                jobs.1.fetch_add(1, Ordering::SeqCst);
                                cv.notify_all();
                            });
                            let unsent = match st.host.as_ref() {
                                Some(w) => w.tx.send(job).err().map(|e| e.0),
                                None => Some(job),
                            };
                            if let Some(job) = unsent {
                                job();
                            }
                            if st.host_retired {
                                // Ended (`SimDriver::end_host_thread`): the worker runs what it
                                // was sent and returns; the next one waits for it.
                                if let Some(w) = st.host.take() {
                                    st.host_ended = Some(w.gone);
                                    drop(w.tx);
                                }
                            }
                        }
                        if !done.load(Ordering::Acquire) {
                            // Running on the host-function thread: done at any time.
                            st.watch.insert(id, Watch::Always);
                            break;
                        }
                        head.dur = now.saturating_sub(start);
                    }
                    let end = start.saturating_add(head.dur);
                    if end > now {
                        Self::settle(st, id, end);
                        break;
                    }
                    let op = s.queue.pop_front().unwrap();
                    s.free_at = end;
                    changed = true;
                    completed = true;
                    Self::complete(st, id, op, end);
                }
            }
            if !changed {
                break;
            }
            any = true;
        }
        if any {
            self.cv.notify_all();
        }
    }

    /// A busy stream whose first operation has started, or got its start time (a host function
    /// is sent to its thread only then), and changes next at `due` (in the future).
    fn settle(st: &mut State, id: u64, due: u64) {
        st.watch.remove(&id);
        st.next_due = st.next_due.min(due);
    }

    /// Applies the effects of an operation that has completed (or that a destroyed stream
    /// completes behind the caller's back).
    pub(super) fn complete(st: &mut State, stream: u64, op: Op, end: u64) {
        match op.kind {
            OpKind::Effect(e) => {
                let ex = Exec {
                    stream,
                    vc: &op.vc,
                    graph: false,
                };
                Self::apply(st, &e, &ex)
            }
            OpKind::Graph(ops) => {
                let ex = Exec {
                    stream,
                    vc: &op.vc,
                    graph: true,
                };
                for (e, _) in ops.iter() {
                    Self::apply(st, e, &ex);
                }
            }
            OpKind::Record { event, seq } => {
                if let Some(ev) = st.events.get_mut(&event) {
                    ev.pending.remove(&seq);
                    ev.done_at = ev.done_at.max(end);
                } else if let Some(ev) = st.retired_events.get_mut(&event) {
                    ev.pending.remove(&seq);
                    ev.done_at = ev.done_at.max(end);
                    if ev.pending.is_empty() {
                        st.retired_events.remove(&event);
                    }
                }
            }
            OpKind::WriteValue { addr, value } => {
                Self::land_write(st, addr, value);
                // The host may read the word from now on, and a host that reads it has seen
                // everything before the write complete (the write is fenced behind it).
                Self::host_observes(st, &op.vc);
            }
            OpKind::WaitValue { addr, .. } => {
                if st.host_mem.host_addr(addr, 4).is_none() {
                    Self::note_misuse(
                        st,
                        format!("cuStreamWaitValue32_v2 on freed host memory at {addr:#x}"),
                    );
                }
            }
            OpKind::Wait { .. } | OpKind::Host { .. } => {}
        }
    }

    /// Waits (jumping the manual clock, or sleeping on the real one) until `done` holds, then
    /// lets `then` see the state (the host's observation of what completed).
    pub(super) fn wait_until<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        ctx: u64,
        call: &'static str,
        done: impl Fn(&State) -> bool,
        then: impl FnOnce(&mut State),
    ) -> Result<()> {
        let mut host_wait_since: Option<Instant> = None;
        loop {
            self.progress(&mut st);
            if let Some(&code) = st.dead.get(&ctx) {
                // The context died while this call waited (`SimDriver::kill_context`).
                return Self::fail(&mut st, code, call);
            }
            if done(&st) {
                then(&mut st);
                if let Some(l) = self.lat() {
                    drop(st);
                    spin(l.sync);
                }
                return Ok(());
            }
            // The next time something completes on its own.
            let now = self.clock.now();
            let mut next: Option<u64> = None;
            let mut host_running = false;
            let mut value_wait = false;
            for s in st.busy.iter().filter_map(|id| st.streams.get(id)) {
                if let Some(h) = s.queue.front() {
                    match (&h.kind, h.start) {
                        (OpKind::Host { .. }, Some(_)) => host_running = true,
                        (OpKind::WaitValue { .. }, None) => value_wait = true,
                        (_, Some(t)) => {
                            let end = t.saturating_add(h.dur).max(now);
                            next = Some(next.map_or(end, |n: u64| n.min(end)));
                        }
                        _ => {}
                    }
                }
            }
            match (next, &self.clock) {
                (Some(t), Clock::Manual(c)) => {
                    c.fetch_max(t, Ordering::AcqRel);
                }
                (Some(t), Clock::Real(_)) => {
                    drop(st);
                    let dt = t.saturating_sub(self.clock.now());
                    if dt > 50_000 {
                        std::thread::sleep(Duration::from_nanos(dt));
                    } else {
                        spin(dt);
                    }
                    st = self.lock();
                }
                // A stream waits for a host write, which another thread may make at any time
                // without a driver call: poll it, for at most 10 s.
                (None, _)
                    if value_wait
                        && !host_running
                        && host_wait_since.get_or_insert_with(Instant::now).elapsed()
                            < Duration::from_secs(10) =>
                {
                    st = self.pause(st);
                }
                (None, _) if host_running => {
                    st = self.pause(st);
                }
                (None, _) => {
                    Self::note_misuse(
                        &mut st,
                        format!("{call} would wait forever: nothing can complete"),
                    );
                    return Self::fail(&mut st, ErrorCode::ERROR_UNKNOWN, call);
                }
            }
        }
    }

    /// Advances the manual clock by `ns` and completes what is due. No effect on a real clock.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// sim.enqueue_work(s.raw(), 1_000).unwrap();
    /// sim.advance(999);
    /// assert!(sim.is_busy(s.raw()));
    /// sim.advance(1);
    /// assert!(!sim.is_busy(s.raw()));
    /// ```
    pub fn advance(&self, ns: u64) {
        if let Clock::Manual(c) = &self.clock {
            c.fetch_add(ns, Ordering::AcqRel);
        }
        let mut st = self.lock();
        self.progress(&mut st);
    }

    /// The simulated time in nanoseconds.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let t0 = sim.now();
    /// sim.enqueue_work(s.raw(), 2_000).unwrap();
    /// s.synchronize().unwrap();                      // the manual clock jumps to the end
    /// assert_eq!(sim.now(), t0 + 2_000);
    /// ```
    pub fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Enqueues `ns` of GPU work on a stream (a stand-in for a kernel in tests).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// sim.enqueue_work(s.raw(), 1_000).unwrap();
    /// assert!(!s.query().unwrap());
    /// sim.advance(1_000);
    /// assert!(s.query().unwrap());
    /// ```
    ///
    /// # Errors
    /// `CUDA_ERROR_INVALID_HANDLE` for a stream that does not exist (also recorded as misuse),
    /// `CUDA_ERROR_NOT_PERMITTED` from a host function, or an injected fault.
    ///
    /// Work that would end past the end of time (`ns = u64::MAX`) ends at `u64::MAX`.
    pub fn enqueue_work(&self, stream: Stream, ns: u64) -> Result<()> {
        let mut st = self.enter("sim:work", Some(stream), None, None)?;
        Self::check_stream(&mut st, stream, "sim:work")?;
        self.enqueue(
            &mut st,
            stream,
            OpKind::Effect(Effect::Work),
            ns,
            "sim:work",
        )
    }

    /// Enqueues `ns` of GPU work on a stream that reads (`write == false`) or writes
    /// (`write == true`) the `bytes` bytes at `ptr`: a stand-in for a kernel that touches buffer
    /// memory, so that tests and the property-test model can exercise the race detector. A write
    /// initialises the bytes (their values are left as they are).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let buf = DeviceBuffer::<u8>::alloc(&s, 16).unwrap();
    /// sim.enqueue_access(s.raw(), buf.as_raw(), 16, false, 10).unwrap();
    /// s.synchronize().unwrap();
    /// assert!(sim.findings()[0].starts_with("uninitialised read"));   // never written
    /// ```
    ///
    /// # Errors
    /// As [`SimDriver::enqueue_work`]; `CUDA_ERROR_INVALID_VALUE` when the range is not inside
    /// one live allocation (also recorded as misuse).
    ///
    /// A range that overflows the address space is out of bounds (an error, never a panic).
    pub fn enqueue_access(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        bytes: usize,
        write: bool,
        ns: u64,
    ) -> Result<()> {
        let mut st = self.enter("sim:access", Some(stream), None, Some(ptr))?;
        Self::check_stream(&mut st, stream, "sim:access")?;
        Self::check_range(&mut st, ptr.0, bytes, "sim:access")?;
        self.enqueue(
            &mut st,
            stream,
            OpKind::Effect(Effect::Access {
                ptr: ptr.0,
                bytes,
                write,
            }),
            ns,
            "sim:access",
        )
    }

    /// Whether a stream has pending work, without the capture rules of `cuStreamQuery` and
    /// without logging: the tests' view from outside.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let before = sim.call_count();
    /// sim.enqueue_work(s.raw(), 1_000).unwrap();
    /// assert!(sim.is_busy(s.raw()));
    /// assert_eq!(sim.call_count(), before + 1);      // the enqueue; `is_busy` is not a call
    /// ```
    pub fn is_busy(&self, stream: Stream) -> bool {
        let mut st = self.lock();
        self.progress(&mut st);
        st.streams
            .get(&stream.0)
            .is_some_and(|s| !s.queue.is_empty())
    }

    /// [`SimDriver::is_busy`], not counting frees (`cuMemFreeAsync`): whether work that may
    /// read or write memory is pending. The crate hands a stream to a new owner with its own
    /// frees still pending (their work touches no memory in use; the new owner's work runs
    /// after them), never with anything else.
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// let b = DeviceBuffer::<u32>::zeroed(&s, 16).unwrap();
    /// sim.enqueue_work(s.raw(), 1_000).unwrap();     // 1 µs of simulated work
    /// drop(b);                                        // a free, behind it
    /// assert!(sim.is_busy_but_frees(s.raw()));        // the work is pending
    /// sim.advance(1_000);
    /// assert!(!sim.is_busy_but_frees(s.raw()) && !sim.is_busy(s.raw()));
    /// ```
    pub fn is_busy_but_frees(&self, stream: Stream) -> bool {
        let mut st = self.lock();
        self.progress(&mut st);
        st.streams.get(&stream.0).is_some_and(|s| {
            s.queue
                .iter()
                .any(|op| !matches!(op.kind, OpKind::Effect(Effect::Free { .. })))
        })
    }

    /// Whether a stream exists (created and not destroyed).
    ///
    /// ```
    /// # use cuda_stream_pool::{driver::{Driver, SimDriver}, Context, DeviceBuffer, ErrorCode};
    /// # use std::sync::Arc;
    /// # let sim = Arc::new(SimDriver::new());
    /// # let ctx = Context::primary(sim.clone(), 0).unwrap();
    /// # let owner = ctx.owner();
    /// # let s = owner.stream().unwrap();
    /// use cuda_stream_pool::{OwnedStream, Priority};
    /// let owned = OwnedStream::new(&ctx, Priority::Normal).unwrap();
    /// let raw = owned.stream().raw();
    /// assert!(sim.stream_exists(raw));
    /// drop(owned);                                   // synchronized and destroyed
    /// assert!(!sim.stream_exists(raw));
    /// ```
    pub fn stream_exists(&self, stream: Stream) -> bool {
        self.lock().streams.contains_key(&stream.0)
    }
}
