//! The operation model shared by the property tests (`tests/proptest_model.rs`) and the fuzzer
//! (`fuzz/fuzz_targets/pool_model.rs`): bytes are decoded (with `arbitrary::Unstructured`) into a
//! sequence of operations on the public API over the simulated driver, and after every step the
//! crate's invariants are checked. A violated invariant is a panic with a message; an error
//! returned by the API is fine (faults are injected on purpose), a panic from the API is not.
#![allow(dead_code)]

use arbitrary::Unstructured;
use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{
    CaptureGuard, Context, DeviceBuffer, Error, ErrorCode, Graph, Owner, Priority, StreamRef,
    MAX_IDLE,
};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;

/// One operation of the model. Indices pick among live objects (modulo their number).
#[derive(Debug, Clone)]
pub enum Op {
    NewOwner,
    DropOwner(usize),
    Work { owner: usize, ns: u64 },
    Advance(u64),
    SetPriority { owner: usize, p: i32 },
    Scoped { owner: usize, p: i32, ns: u64 },
    Alloc { owner: usize, len: usize },
    UseOn { buffer: usize, owner: usize },
    DropBuffer(usize),
    BeginCapture(usize),
    NestedBegin(usize),
    EndCapture { guard: usize, launch: bool },
    DropGuard(usize),
    Fault { nth: u64, code: u32 },
    Trim,
}

const CODES: [u32; 5] = [1, 2, 400, 700, 999];

/// Decodes operations until the bytes run out (at most `max` of them).
pub fn decode(bytes: &[u8], max: usize) -> Vec<Op> {
    let mut u = Unstructured::new(bytes);
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < max {
        let Ok(op) = decode_one(&mut u) else { break };
        ops.push(op);
    }
    ops
}

fn decode_one(u: &mut Unstructured<'_>) -> arbitrary::Result<Op> {
    let idx = |u: &mut Unstructured<'_>| u.int_in_range(0..=15usize);
    Ok(match u.int_in_range(0..=15u8)? {
        0 | 1 => Op::NewOwner,
        2 => Op::DropOwner(idx(u)?),
        3 => Op::Work {
            owner: idx(u)?,
            ns: u.int_in_range(0..=10_000u64)?,
        },
        4 => Op::Advance(u.int_in_range(0..=20_000u64)?),
        5 => Op::SetPriority {
            owner: idx(u)?,
            p: u.int_in_range(-7..=2i32)?,
        },
        6 => Op::Scoped {
            owner: idx(u)?,
            p: u.int_in_range(-7..=2i32)?,
            ns: u.int_in_range(0..=5_000u64)?,
        },
        7 | 8 => Op::Alloc {
            owner: idx(u)?,
            len: u.int_in_range(0..=64usize)?,
        },
        9 => Op::UseOn {
            buffer: idx(u)?,
            owner: idx(u)?,
        },
        10 => Op::DropBuffer(idx(u)?),
        11 => Op::BeginCapture(idx(u)?),
        12 => Op::NestedBegin(idx(u)?),
        13 => Op::EndCapture {
            guard: idx(u)?,
            launch: u.arbitrary()?,
        },
        14 => {
            if u.ratio(1u8, 4u8)? {
                Op::Fault {
                    nth: u.int_in_range(1..=6u64)?,
                    code: CODES[u.int_in_range(0..=CODES.len() - 1)?],
                }
            } else {
                Op::DropGuard(idx(u)?)
            }
        }
        _ => Op::Trim,
    })
}

struct Buf {
    b: DeviceBuffer<u32>,
    /// The model's own record of the last use: (raw stream, the model's hand-over count of that
    /// stream at the time).
    last: (u64, u64),
}

/// A capture in progress and the owner of the captured stream.
///
/// The owner is shared through an `Rc`, and the guard comes from `Owner::stream_shared`, so it
/// keeps the owner alive by itself (no borrow to keep beside it).
struct Capture {
    guard: Option<CaptureGuard<'static>>,
    owner: Rc<Owner>,
    /// The raw captured stream (the simulation never reuses handles).
    raw: u64,
}

impl Capture {
    /// Begins capturing the owner's current stream.
    fn begin(owner: Rc<Owner>) -> Option<Capture> {
        let s = owner.stream_shared().ok()?;
        let raw = s.raw().0;
        let guard = s.begin_capture().ok()?;
        drop(s);
        Some(Capture {
            guard: Some(guard),
            owner,
            raw,
        })
    }

    fn guard(&self) -> &CaptureGuard<'static> {
        self.guard.as_ref().expect("a live capture has its guard")
    }

    /// Ends the capture; returns the graph and the owner.
    fn end(mut self) -> (cuda_stream_pool::Result<Graph>, Rc<Owner>) {
        let g = self.guard.take().expect("a live capture has its guard");
        (g.end(), self.owner.clone())
    }

    /// Drops the guard (ending the capture, discarding the graph); returns the owner.
    fn discard(mut self) -> Rc<Owner> {
        drop(self.guard.take());
        self.owner.clone()
    }
}

/// Asserts that the owner's stream `raw` (if it still holds it) is no longer capturing.
fn assert_not_capturing(owner: &Owner, raw: u64, what: &str) {
    for (_, s) in owner.streams() {
        if s.raw().0 == raw {
            assert!(!s.is_capturing().unwrap_or(false), "{what}");
        }
    }
}

/// The model's state: the simulated driver, one context, and the live objects.
pub struct Model {
    pub sim: Arc<SimDriver>,
    ctx: Option<Context>,
    /// Owners are shared with the captures of their streams (see [`Capture`]).
    owners: Vec<Rc<Owner>>,
    bufs: Vec<Buf>,
    guards: Vec<Capture>,
    steps: usize,
    /// A model id per owner (parallel to `owners`).
    owner_ids: Vec<u64>,
    next_owner: u64,
    /// (owner id, raw stream) pairs seen held; a new pair is a hand-over.
    held: HashSet<(u64, u64)>,
    /// The model's count of hand-overs per raw stream (the simulation never reuses handles).
    gens: HashMap<u64, u64>,
}

fn pick<T>(v: &[T], i: usize) -> Option<usize> {
    if v.is_empty() {
        None
    } else {
        Some(i % v.len())
    }
}

fn prio(p: i32) -> Priority {
    match p {
        1 => Priority::Low,
        2 => Priority::High,
        _ => Priority::Value(p),
    }
}

impl Model {
    pub fn new() -> Model {
        let sim = Arc::new(SimDriver::new());
        sim.set_logging(true);
        let d: Arc<dyn Driver> = sim.clone();
        let ctx = Context::primary(d, 0).expect("context");
        Model {
            sim,
            ctx: Some(ctx),
            owners: Vec::new(),
            bufs: Vec::new(),
            guards: Vec::new(),
            steps: 0,
            owner_ids: Vec::new(),
            next_owner: 0,
            held: HashSet::new(),
            gens: HashMap::new(),
        }
    }

    /// Records hand-overs: every (owner, stream) pair not seen before bumps the model's count.
    fn sync_holdings(&mut self) {
        let mut now = HashSet::new();
        for (o, id) in self.owners.iter().zip(&self.owner_ids) {
            for (_, s) in o.streams() {
                now.insert((*id, s.raw().0));
            }
        }
        for pair in now.difference(&self.held) {
            *self.gens.entry(pair.1).or_insert(0) += 1;
        }
        self.held = now;
    }

    fn gen_of(&self, raw: u64) -> u64 {
        self.gens.get(&raw).copied().unwrap_or(0)
    }

    /// The owner's stream, with the model's hand-over record brought up to date.
    fn stream_of<'o>(&mut self, o: &'o Owner) -> Option<StreamRef<'o>> {
        let s = o.stream().ok();
        self.sync_holdings();
        s
    }

    /// Checks the calls a buffer operation made: event records and frees may only touch the
    /// buffer's last stream while that stream has not been handed to anyone since (or the
    /// disposal stream); waits only the target stream.
    fn check_buffer_calls(&self, last: (u64, u64), ptr: u64, target: Option<u64>) {
        let disposal = self.ctx().disposal_stream().0;
        for c in self.sim.calls() {
            let st = c.stream.map(|s| s.0);
            match c.name {
                "cuEventRecord" => {
                    assert_eq!(
                        st,
                        Some(last.0),
                        "event recorded on another stream than the last use"
                    );
                    assert_eq!(
                        self.gen_of(last.0),
                        last.1,
                        "waited on a recycled stream's new owner"
                    );
                }
                "cuStreamWaitEvent" => {
                    assert!(
                        st == target || st == Some(disposal),
                        "wait on an unexpected stream: {c:?}"
                    );
                }
                "cuMemFreeAsync" if c.ptr.map(|p| p.0) == Some(ptr) => {
                    let ok = st == Some(disposal)
                        || (st == Some(last.0) && self.gen_of(last.0) == last.1);
                    assert!(ok, "freed into a recycled stream: {c:?}");
                }
                _ => {}
            }
        }
    }

    fn ctx(&self) -> &Context {
        self.ctx.as_ref().unwrap()
    }

    fn capturing(&self, s: &StreamRef) -> bool {
        self.guards.iter().any(|c| c.raw == s.raw().0)
    }

    /// The capture of stream `raw`, if the model has one.
    fn capture_of(&self, raw: u64) -> Option<&Capture> {
        self.guards.iter().find(|c| c.raw == raw)
    }

    /// Applies one operation, then checks the invariants.
    pub fn step(&mut self, op: &Op) {
        self.steps += 1;
        let mut acquired = false;
        match *op {
            Op::NewOwner => {
                if self.owners.len() < 48 {
                    self.owners.push(Rc::new(self.ctx().owner()));
                    self.owner_ids.push(self.next_owner);
                    self.next_owner += 1;
                }
            }
            Op::DropOwner(i) => {
                if let Some(i) = pick(&self.owners, i) {
                    // An owner cannot be dropped while a capture of its stream lives (a compile
                    // error): its captures are ended (guards dropped) first.
                    let o = self.owners.swap_remove(i);
                    self.owner_ids.swap_remove(i);
                    let (mine, rest): (Vec<Capture>, Vec<Capture>) =
                        std::mem::take(&mut self.guards)
                            .into_iter()
                            .partition(|c| Rc::ptr_eq(&c.owner, &o));
                    self.guards = rest;
                    for c in mine {
                        let raw = c.raw;
                        c.discard();
                        assert_not_capturing(&o, raw, "a dropped guard left the stream capturing");
                    }
                    assert_eq!(Rc::strong_count(&o), 1, "the owner is still shared");
                    drop(o);
                    self.sync_holdings();
                }
            }
            Op::Work { owner, ns } => {
                if let Some(i) = pick(&self.owners, owner) {
                    let before = self.owners[i].streams().len();
                    let o = self.owners[i].clone();
                    if let Some(s) = self.stream_of(&o) {
                        acquired = self.owners[i].streams().len() > before;
                        if acquired {
                            self.check_fresh(&s);
                        }
                        if !self.capturing(&s) {
                            let _ = self.sim.enqueue_work(s.raw(), ns);
                        }
                    }
                }
            }
            Op::Advance(ns) => self.sim.advance(ns),
            Op::SetPriority { owner, p } => {
                if let Some(i) = pick(&self.owners, owner) {
                    let before = self.owners[i].priority();
                    let cur = self.owners[i].streams();
                    let capturing = cur
                        .iter()
                        .find(|(q, _)| *q == before)
                        .is_some_and(|(_, s)| self.capturing(s));
                    let r = self.owners[i].set_priority(prio(p));
                    let in_range = (-5..=0).contains(&p) || p == 1 || p == 2;
                    let value = match p {
                        1 => 0,
                        2 => -5,
                        v => v,
                    };
                    if !in_range || (capturing && value != before) {
                        assert!(r.is_err(), "priority {p} accepted (capturing: {capturing})");
                        assert_eq!(
                            self.owners[i].priority(),
                            before,
                            "a rejected priority changed the selection"
                        );
                    }
                }
            }
            Op::Scoped { owner, p, ns } => {
                if let Some(i) = pick(&self.owners, owner) {
                    let before = self.owners[i].priority();
                    let sim = self.sim.clone();
                    let o = &self.owners[i];
                    let _ = o.with_priority(prio(p), || {
                        if let Ok(s) = o.stream() {
                            let _ = sim.enqueue_work(s.raw(), ns);
                        }
                    });
                    assert_eq!(
                        self.owners[i].priority(),
                        before,
                        "scoped priority not restored"
                    );
                }
            }
            Op::Alloc { owner, len } => {
                if let Some(i) = pick(&self.owners, owner) {
                    let o = self.owners[i].clone();
                    if let Some(s) = self.stream_of(&o) {
                        if let Some(c) = self.capture_of(s.raw().0) {
                            // Allocating on a capturing stream is refused (before any driver
                            // call), and the capture is left as it was. (Zero elements are
                            // refused first, as always.)
                            let g = c.guard();
                            let before = g.info().ok();
                            let r = DeviceBuffer::<u32>::alloc(&s, len);
                            assert!(
                                matches!(r, Err(Error::CaptureInProgress(_)))
                                    || (len == 0 && matches!(r, Err(Error::InvalidArgument(_)))),
                                "allocation in a capture: {r:?}"
                            );
                            if let Some(before) = before {
                                // (An injected fault may hit this query itself: faults are one-shot.)
                                let after = g.info().or_else(|_| g.info()).ok();
                                assert_eq!(
                                    after,
                                    Some(before),
                                    "a refused allocation changed the capture"
                                );
                            }
                        } else if let Ok(b) = DeviceBuffer::<u32>::alloc(&s, len) {
                            if self.bufs.len() < 64 {
                                let last = (s.raw().0, self.gen_of(s.raw().0));
                                self.bufs.push(Buf { b, last });
                            }
                        }
                    }
                }
            }
            Op::UseOn { buffer, owner } => {
                if let (Some(j), Some(i)) = (pick(&self.bufs, buffer), pick(&self.owners, owner)) {
                    let o = self.owners[i].clone();
                    if let Some(s) = self.stream_of(&o) {
                        if !self.capturing(&s) {
                            self.sim.clear_calls();
                            let r = self.bufs[j].b.use_on(&s);
                            let raw = s.raw().0;
                            self.check_buffer_calls(
                                self.bufs[j].last,
                                self.bufs[j].b.as_raw().0,
                                Some(raw),
                            );
                            // The use is recorded when its guard drops.
                            let ok = r.is_ok();
                            drop(r);
                            if ok {
                                self.bufs[j].last = (raw, self.gen_of(raw));
                            }
                        }
                    }
                }
            }
            Op::DropBuffer(j) => {
                if let Some(j) = pick(&self.bufs, j) {
                    let buf = self.bufs.swap_remove(j);
                    let p = buf.b.as_raw();
                    let (last, _, current) = buf.b.last_use();
                    let last_capturing = current && self.capture_of(last.0).is_some();
                    self.sim.clear_calls();
                    drop(buf.b);
                    self.check_buffer_calls(buf.last, p.0, None);
                    if last_capturing {
                        let freed = self.sim.calls().iter().any(|c| {
                            c.name == "cuMemFreeAsync" && c.ptr == Some(p) && c.stream == Some(last)
                        });
                        assert!(!freed, "a free entered a capture");
                    }
                }
            }
            Op::BeginCapture(i) => {
                if let Some(i) = pick(&self.owners, i) {
                    let o = self.owners[i].clone();
                    if let Some(s) = self.stream_of(&o) {
                        let capturing = self.capturing(&s);
                        drop(s);
                        if !capturing {
                            if let Some(c) = Capture::begin(o) {
                                self.guards.push(c);
                            }
                        }
                    }
                }
            }
            Op::NestedBegin(k) => {
                if let Some(k) = pick(&self.guards, k) {
                    let g = self.guards[k].guard();
                    let before = g.info().ok();
                    let r = g.stream().begin_capture();
                    assert!(r.is_err(), "a nested begin succeeded");
                    drop(r);
                    if let Some(before) = before {
                        // (An injected fault may hit this query itself: faults are one-shot.)
                        let after = g.info().or_else(|_| g.info()).ok();
                        assert_eq!(after, Some(before), "a failed begin changed the capture");
                    }
                }
            }
            Op::EndCapture { guard, launch } => {
                if let Some(k) = pick(&self.guards, guard) {
                    let c = self.guards.swap_remove(k);
                    let raw = c.raw;
                    let (graph, o) = c.end();
                    if let Ok(graph) = graph {
                        if launch {
                            if let Ok(exec) = graph.instantiate() {
                                if let Some((_, s)) =
                                    o.streams().into_iter().find(|(_, s)| s.raw().0 == raw)
                                {
                                    let _ = exec.launch(&s);
                                }
                            }
                        }
                    }
                    assert_not_capturing(&o, raw, "end left the stream capturing");
                }
            }
            Op::DropGuard(k) => {
                if let Some(k) = pick(&self.guards, k) {
                    let c = self.guards.swap_remove(k);
                    let raw = c.raw;
                    let o = c.discard();
                    assert_not_capturing(&o, raw, "a dropped guard left the stream capturing");
                }
            }
            Op::Fault { nth, code } => self.sim.fail_nth_call(nth, ErrorCode(code)),
            Op::Trim => {
                let _ = self.ctx().trim();
            }
        }
        self.sync_holdings();
        self.check(acquired);
    }

    /// A stream just handed to an owner has no pending work.
    fn check_fresh(&self, s: &StreamRef) {
        assert!(!self.sim.is_busy(s.raw()), "a busy stream was handed out");
    }

    /// The invariants that hold after every step.
    pub fn check(&self, after_search: bool) {
        // No two live owners share a stream.
        let mut seen = HashSet::new();
        for o in &self.owners {
            for (_, s) in o.streams() {
                assert!(
                    seen.insert(s.raw()),
                    "two owners share stream {:?}",
                    s.raw()
                );
            }
        }
        let st = self.ctx().stats();
        assert_eq!(st.live, st.in_use + st.idle + st.retired_busy, "{st:?}");
        assert_eq!(
            st.in_use as usize,
            seen.len(),
            "owners' streams vs in_use: {st:?}"
        );
        if after_search {
            assert!(
                st.idle <= MAX_IDLE as u64,
                "more than {MAX_IDLE} idle after a search: {st:?}"
            );
        }
        // live streams = owners' + idle + retired-busy + disposal
        assert_eq!(self.sim.counters().live_streams, st.live + 1, "{st:?}");
        let misuse = self.sim.misuse();
        assert!(misuse.is_empty(), "misuse: {misuse:?}");
    }

    /// Drops everything; every stream must be destroyed and every byte freed exactly once.
    pub fn teardown(mut self) {
        self.sim.clear_faults();
        self.guards.clear();
        self.bufs.clear();
        self.owners.clear();
        self.ctx = None;
        let c = self.sim.counters();
        assert_eq!(c.live_streams, 0, "streams leaked: {c:?}");
        assert_eq!(c.live_allocs, 0, "memory leaked: {c:?}");
        assert_eq!(c.live_events, 0, "events leaked: {c:?}");
        let misuse = self.sim.misuse();
        assert!(misuse.is_empty(), "misuse: {misuse:?}");
    }
}

impl Default for Model {
    fn default() -> Self {
        Model::new()
    }
}

/// Runs a whole input: decode, apply, teardown.
pub fn run(bytes: &[u8]) {
    let ops = decode(bytes, 400);
    let mut m = Model::new();
    for op in &ops {
        m.step(op);
    }
    m.teardown();
}
