//! Streams and simulated time: each stream is a FIFO queue of operations that start when they
//! reach the head of the queue (and, for an event wait, when the awaited record has completed)
//! and complete a fixed simulated duration later; host functions run on a real thread. The clock
//! is advanced by hand in tests, or is real time under a latency model; waiting calls jump the
//! manual clock to the next completion, as if the CPU had waited.

use super::*;

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
}

pub(super) struct Op {
    pub(super) kind: OpKind,
    pub(super) dur: u64,
    pub(super) start: Option<u64>,
    pub(super) enq: u64,
}

pub(super) struct SimStream {
    /// The context the stream was created in (0 for the legacy stream).
    pub(super) ctx: u64,
    pub(super) flags: u32,
    pub(super) priority: i32,
    pub(super) queue: VecDeque<Op>,
    pub(super) free_at: u64,
    pub(super) capture: Option<Capture>,
    pub(super) used_pool: bool,
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
        let stream = st.streams.get_mut(&s.0).expect("checked by the caller");
        if let Some(c) = stream.capture.as_mut() {
            if c.invalidated {
                return Self::fail(st, ErrorCode::ERROR_STREAM_CAPTURE_INVALIDATED, call);
            }
            match kind {
                OpKind::Effect(e) => c.ops.push((e, dur)),
                OpKind::Host { f, .. } => c.ops.push((Effect::Host(Arc::new(Mutex::new(f))), dur)),
                // Records and waits inside a capture become graph edges; the model keeps the
                // graph's operations in stream order, which is what the edges guarantee here.
                OpKind::Record { .. } | OpKind::Wait { .. } => {}
                OpKind::Graph(ops) => {
                    for (e, d) in ops.iter() {
                        c.ops.push((Self::clone_effect(e), *d));
                    }
                }
            }
            return Ok(());
        }
        st.busy.insert(s.0);
        let stream = st.streams.get_mut(&s.0).expect("checked by the caller");
        stream.queue.push_back(Op {
            kind,
            dur,
            start: None,
            enq: now,
        });
        self.progress(st);
        Ok(())
    }

    /// Completes every operation whose time has come, in stream order, following event waits.
    pub(super) fn progress(&self, st: &mut State) {
        let now = self.clock.now();
        loop {
            let mut changed = false;
            let ids: Vec<u64> = st.busy.iter().copied().collect();
            for id in ids {
                loop {
                    let (events, streams) = (&st.events, &mut st.streams);
                    let s = streams.get_mut(&id).unwrap();
                    let free_at = s.free_at;
                    let Some(head) = s.queue.front_mut() else {
                        st.busy.remove(&id);
                        break;
                    };
                    if head.start.is_none() {
                        let eligible = match &head.kind {
                            OpKind::Wait { event, seq } => match events.get(event) {
                                Some(e) if e.is_done(*seq) => Some(e.done_at),
                                Some(_) => None,
                                None => Some(now),
                            },
                            _ => Some(free_at),
                        };
                        let Some(t) = eligible else { break };
                        head.start = Some(t.max(head.enq).max(free_at));
                    }
                    let start = head.start.unwrap();
                    if start > now {
                        break;
                    }
                    if let OpKind::Host { f, done } = &mut head.kind {
                        if let Some(f) = f.take() {
                            let done = done.clone();
                            std::thread::spawn(move || {
                                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
                                done.store(true, Ordering::Release);
                            });
                        }
                        if !done.load(Ordering::Acquire) {
                            break;
                        }
                        head.dur = now.saturating_sub(start);
                    }
                    let end = start + head.dur;
                    if end > now {
                        break;
                    }
                    let op = s.queue.pop_front().unwrap();
                    s.free_at = end;
                    changed = true;
                    match op.kind {
                        OpKind::Effect(e) => Self::apply(st, &e),
                        OpKind::Graph(ops) => {
                            for (e, _) in ops.iter() {
                                Self::apply(st, e);
                            }
                        }
                        OpKind::Record { event, seq } => {
                            if let Some(ev) = st.events.get_mut(&event) {
                                ev.pending.remove(&seq);
                                ev.done_at = ev.done_at.max(end);
                            }
                        }
                        OpKind::Wait { .. } | OpKind::Host { .. } => {}
                    }
                }
            }
            if !changed {
                break;
            }
        }
        self.cv.notify_all();
    }

    /// Waits (jumping the manual clock, or sleeping on the real one) until `done` holds.
    pub(super) fn wait_until<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        call: &'static str,
        done: impl Fn(&State) -> bool,
    ) -> Result<()> {
        loop {
            self.progress(&mut st);
            if done(&st) {
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
            for s in st.busy.iter().filter_map(|id| st.streams.get(id)) {
                if let Some(h) = s.queue.front() {
                    match (&h.kind, h.start) {
                        (OpKind::Host { .. }, Some(_)) => host_running = true,
                        (_, Some(t)) => {
                            let end = (t + h.dur).max(now);
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
                (None, _) if host_running => {
                    st = self
                        .cv
                        .wait_timeout(st, Duration::from_millis(1))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
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
    pub fn advance(&self, ns: u64) {
        if let Clock::Manual(c) = &self.clock {
            c.fetch_add(ns, Ordering::AcqRel);
        }
        let mut st = self.lock();
        self.progress(&mut st);
    }

    /// The simulated time in nanoseconds.
    pub fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Enqueues `ns` of GPU work on a stream (a stand-in for a kernel in tests).
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

    /// Whether a stream has pending work, without the capture rules of `cuStreamQuery` and
    /// without logging: the tests' view from outside.
    pub fn is_busy(&self, stream: Stream) -> bool {
        let mut st = self.lock();
        self.progress(&mut st);
        st.streams
            .get(&stream.0)
            .is_some_and(|s| !s.queue.is_empty())
    }

    /// Whether a stream exists (created and not destroyed).
    pub fn stream_exists(&self, stream: Stream) -> bool {
        self.lock().streams.contains_key(&stream.0)
    }
}
