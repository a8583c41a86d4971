//! The operation model shared by the property tests (`tests/proptest_model.rs`) and the fuzzer
//! (`fuzz/fuzz_targets/pool_model.rs`): bytes are decoded (with `arbitrary::Unstructured`) into a
//! sequence of operations on the public API over the simulated driver, and after every step the
//! crate's invariants are checked. A violated invariant is a panic with a message; an error
//! returned by the API is fine (faults are injected on purpose), a panic from the API is not.
#![allow(dead_code)]

use arbitrary::Unstructured;
use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{
    CaptureGuard, Context, DeviceBuffer, ErrorCode, Owner, Priority, StreamRef, MAX_IDLE,
};
use std::collections::{HashMap, HashSet};
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
    /// Allocated while its stream was capturing (the allocation belongs to the graph).
    in_capture: bool,
    /// The model's own record of the last use: (raw stream, the model's hand-over count of that
    /// stream at the time).
    last: (u64, u64),
}

/// The model's state: the simulated driver, one context, and the live objects.
pub struct Model {
    pub sim: Arc<SimDriver>,
    ctx: Option<Context>,
    owners: Vec<Owner>,
    bufs: Vec<Buf>,
    guards: Vec<(CaptureGuard, StreamRef)>,
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
    fn stream_of(&mut self, i: usize) -> Option<StreamRef> {
        let s = self.owners[i].stream().ok();
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
        self.guards.iter().any(|(_, g)| g.same_stream(s))
    }

    /// Applies one operation, then checks the invariants.
    pub fn step(&mut self, op: &Op) {
        self.steps += 1;
        let mut acquired = false;
        match *op {
            Op::NewOwner => {
                if self.owners.len() < 48 {
                    self.owners.push(self.ctx().owner());
                    self.owner_ids.push(self.next_owner);
                    self.next_owner += 1;
                }
            }
            Op::DropOwner(i) => {
                if let Some(i) = pick(&self.owners, i) {
                    self.owners.swap_remove(i);
                    self.owner_ids.swap_remove(i);
                    self.sync_holdings();
                }
            }
            Op::Work { owner, ns } => {
                if let Some(i) = pick(&self.owners, owner) {
                    let before = self.owners[i].streams().len();
                    if let Some(s) = self.stream_of(i) {
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
                    if let Some(s) = self.stream_of(i) {
                        let in_capture = self.capturing(&s);
                        if let Ok(b) = DeviceBuffer::<u32>::alloc(&s, len) {
                            if self.bufs.len() < 64 {
                                let last = (s.raw().0, self.gen_of(s.raw().0));
                                self.bufs.push(Buf {
                                    b,
                                    in_capture,
                                    last,
                                });
                            }
                        }
                    }
                }
            }
            Op::UseOn { buffer, owner } => {
                if let (Some(j), Some(i)) = (pick(&self.bufs, buffer), pick(&self.owners, owner)) {
                    if let Some(s) = self.stream_of(i) {
                        if !self.capturing(&s) && !self.bufs[j].in_capture {
                            self.sim.clear_calls();
                            let r = self.bufs[j].b.use_on(&s);
                            let raw = s.raw().0;
                            self.check_buffer_calls(
                                self.bufs[j].last,
                                self.bufs[j].b.as_raw().0,
                                Some(raw),
                            );
                            if r.is_ok() {
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
                    let last_capturing =
                        current && self.guards.iter().any(|(_, g)| g.raw() == last);
                    self.sim.clear_calls();
                    drop(buf.b);
                    self.check_buffer_calls(buf.last, p.0, None);
                    if last_capturing && !buf.in_capture {
                        let freed = self.sim.calls().iter().any(|c| {
                            c.name == "cuMemFreeAsync" && c.ptr == Some(p) && c.stream == Some(last)
                        });
                        assert!(!freed, "a free entered a capture");
                    }
                }
            }
            Op::BeginCapture(i) => {
                if let Some(i) = pick(&self.owners, i) {
                    if let Some(s) = self.stream_of(i) {
                        if !self.capturing(&s) {
                            if let Ok(g) = s.begin_capture() {
                                self.guards.push((g, s));
                            }
                        }
                    }
                }
            }
            Op::NestedBegin(k) => {
                if let Some(k) = pick(&self.guards, k) {
                    let s = self.guards[k].1.clone();
                    let before = self.guards[k].0.info().ok();
                    let r = s.begin_capture();
                    assert!(r.is_err(), "a nested begin succeeded");
                    drop(r);
                    if let Some(before) = before {
                        // (An injected fault may hit this query itself: faults are one-shot.)
                        let g = &self.guards[k].0;
                        let after = g.info().or_else(|_| g.info()).ok();
                        assert_eq!(after, Some(before), "a failed begin changed the capture");
                    }
                }
            }
            Op::EndCapture { guard, launch } => {
                if let Some(k) = pick(&self.guards, guard) {
                    self.drop_captured_buffers(k);
                    let (g, s) = self.guards.swap_remove(k);
                    if let Ok(graph) = g.end() {
                        if launch {
                            if let Ok(exec) = graph.instantiate() {
                                let _ = exec.launch(&s);
                            }
                        }
                    }
                    if s.is_current() {
                        assert!(
                            !s.is_capturing().unwrap_or(false),
                            "end left the stream capturing"
                        );
                    }
                }
            }
            Op::DropGuard(k) => {
                if let Some(k) = pick(&self.guards, k) {
                    self.drop_captured_buffers(k);
                    let (g, s) = self.guards.swap_remove(k);
                    drop(g);
                    if s.is_current() {
                        assert!(
                            !s.is_capturing().unwrap_or(false),
                            "a dropped guard left the stream capturing"
                        );
                    }
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

    /// Buffers allocated inside guard `k`'s capture are dropped before it ends, so that their
    /// frees are nodes of the graph (the documented pattern; freeing graph memory before the graph
    /// ever ran is a driver error).
    fn drop_captured_buffers(&mut self, k: usize) {
        let raw = self.guards[k].1.raw().0;
        let (mine, rest): (Vec<Buf>, Vec<Buf>) = std::mem::take(&mut self.bufs)
            .into_iter()
            .partition(|b| b.in_capture && b.b.last_use().0 .0 == raw);
        self.bufs = rest;
        drop(mine);
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
        for k in 0..self.guards.len() {
            self.drop_captured_buffers(k);
        }
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
