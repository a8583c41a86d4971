//! The operation model shared by the property tests (`tests/proptest_model.rs`) and the fuzzer
//! (`fuzz/fuzz_targets/pool_model.rs`): bytes are decoded (with `arbitrary::Unstructured`) into a
//! sequence of operations on the public API over the simulated driver, and after every step the
//! crate's invariants are checked. A violated invariant is a panic with a message; an error
//! returned by the API is fine (faults are injected on purpose), a panic from the API is not.
//!
//! The simulated driver is the oracle for memory: work in the model reads and writes buffer
//! memory (`SimDriver::enqueue_access` under a `BufferUse`, the crate's kernels, copies), and the
//! simulator reports every access or free that is not ordered after an earlier conflicting one
//! (a race), every access after a free, and every read of memory never written. Concurrent steps
//! ([`Op::Par`]) run two or three worker threads interleaved one driver call at a time by the
//! scheduler of `sched.rs`, with the interleaving drawn from the input.
#![allow(dead_code)]

mod foreign;
mod futs;
mod loans;
mod sched;
pub mod threads;

use arbitrary::Unstructured;
use cuda_stream_pool::driver::{
    CaptureMode, CaptureStatus, Driver, MemPoolAttr, SimConfig, SimDriver,
};
use cuda_stream_pool::kernels::Kernels;
use cuda_stream_pool::{
    CaptureGuard, Context, ContextOptions, DeviceBuffer, Error, ErrorCode, Graph, GraphExec,
    OwnedStream, Owner, Priority, StreamRef, MAX_IDLE,
};
use futs::Fut;
#[allow(unused_imports)]
pub use futs::{At, Reenter};
use sched::{Hooked, Sched};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;

/// One operation of the model. Indices pick among live objects (modulo their number); a
/// "holder" is an owner or an owned stream.
#[derive(Debug, Clone)]
pub enum Op {
    NewOwner,
    DropOwner(usize),
    /// Moves an owner to another thread and drops it there.
    DropOwnerElsewhere(usize),
    Work {
        owner: usize,
        ns: u64,
    },
    Advance(u64),
    SetPriority {
        owner: usize,
        p: i32,
    },
    Scoped {
        owner: usize,
        p: i32,
        ns: u64,
    },
    Alloc {
        holder: usize,
        len: usize,
    },
    UseOn {
        buffer: usize,
        owner: usize,
    },
    /// GPU work that reads or writes the buffer, enqueued under a `BufferUse` of it.
    Access {
        buffer: usize,
        holder: usize,
        write: bool,
        ns: u64,
    },
    /// The crate's `add_u32` kernel on the buffer.
    Kernel {
        buffer: usize,
        holder: usize,
    },
    /// A blocking copy of the buffer back to the host.
    ReadBack {
        buffer: usize,
        holder: usize,
    },
    DropBuffer(usize),
    /// Moves the model's reference to a buffer to another thread and drops it there.
    DropBufferElsewhere(usize),
    WaitFor {
        a: usize,
        b: usize,
    },
    /// A host function; with `take`, its closure owns one of the model's buffers (dropped on the
    /// host-function thread).
    HostFn {
        holder: usize,
        take: Option<usize>,
    },
    NewOwned {
        p: i32,
    },
    DropOwned(usize),
    BeginCapture(usize),
    NestedBegin(usize),
    EndCapture {
        guard: usize,
        keep: bool,
    },
    DropGuard(usize),
    /// Begins a capture of an owner's stream, leaks the guard (`mem::forget`) and drops the
    /// owner: the stream goes back to the pool still captured, and must never be handed out.
    LeakCapture(usize),
    LaunchExec {
        exec: usize,
        holder: usize,
    },
    DropExec(usize),
    Fault {
        nth: u64,
        code: u32,
    },
    Trim,
    /// A completion future of a holder's stream (`StreamRef::completed`), after `ns` of GPU
    /// work and, with `marker`, a host function: it may resolve only after both.
    Complete {
        holder: usize,
        ns: u64,
        marker: bool,
    },
    /// An asynchronous copy to the host (`DeviceBuffer::to_vec_async`), after `ns` of work and
    /// an optional marker host function on the holder's stream.
    CopyAsync {
        buffer: usize,
        holder: usize,
        ns: u64,
        marker: bool,
    },
    /// A new owner of priority `p` waiting for its first stream (`Owner::ready`); with `poll`,
    /// polled at once.
    Ready {
        p: i32,
        poll: bool,
    },
    /// Moves an owner into `Owner::attach` with a small future that calls `Context::stream`,
    /// (with `wait`) awaits the completion of that stream, and calls it again.
    Attach {
        owner: usize,
        wait: bool,
    },
    /// Polls one of the model's futures, with a new counting waker when `fresh`.
    Poll {
        fut: usize,
        fresh: bool,
    },
    /// Drops one of the model's futures (pending or resolved).
    DropFut(usize),
    /// `Context::reserve(p, n)`.
    Reserve {
        p: i32,
        n: usize,
    },
    /// At the cap: another thread blocks in `Owner::stream` for the key of owner `i`, which the
    /// model then drops; the blocked thread must get through.
    BlockedAcquire(usize),
    /// Worker threads, each with its own owner, running their steps at the same time,
    /// interleaved at driver-call granularity as `schedule` says.
    Par {
        workers: Vec<Vec<WOp>>,
        schedule: Vec<u8>,
    },
    /// Another thread (a foreign library) creates a raw stream in the crate's context and
    /// begins a capture of it in `mode`, through the raw driver; the capture stays live until
    /// [`Op::EndForeign`] (or the teardown). Every operation of the crate meanwhile must leave it
    /// valid, and make no call of the invalidation table outside relaxed mode.
    ForeignCapture {
        mode: CaptureMode,
    },
    /// Ends a foreign capture: the end must succeed.
    EndForeign(usize),
    /// GPU work on a buffer under a `BufferUse` that is then leaked (`mem::forget`); the model
    /// gives the buffer up (its use lock is taken for ever) and drops it now or at the end. The
    /// free must still order after the leaked use (the simulation reports a use after free).
    LeakUse {
        buffer: usize,
        holder: usize,
        write: bool,
        ns: u64,
        drop_now: bool,
    },
    /// More than `MAX_IDLE` owners of key `p` (`MAX_IDLE + extra`) take a stream each, do some
    /// work and are dropped; once the work has completed, a statistics reading reports at most
    /// `MAX_IDLE` retired streams of the key.
    ManyOwners {
        p: i32,
        extra: usize,
    },
    /// Lends owner `owner`'s stream (taking it first if it has none) as another crate's handle
    /// (`StreamRef::lend`); the model's borrower keeps it until [`Op::EndLoan`] or past the
    /// `Context` to the teardown (see `tests/model/loans.rs`). Only without a cap.
    Lend {
        owner: usize,
    },
    /// The borrower of loan `loan` enqueues `ns` of its own work on the lent stream.
    LoanWork {
        loan: usize,
        ns: u64,
    },
    /// The borrower drops its handle: the loan ends.
    EndLoan(usize),
    /// Polls one of the model's futures with a waker whose wake, clone or drop (`at`) re-enters
    /// the crate once (`Context::trim`, or drops a buffer given to it): a deadlock or a panic is
    /// a finding.
    ReentrantPoll {
        fut: usize,
        action: futs::Reenter,
        at: futs::At,
    },
    /// The FIFO race of issue 20's plant (r), as one step: owner `owner` works for `ns` and is
    /// dropped (its stream retires busy), two waiters of its key queue (`Owner::ready`, polled),
    /// the clock moves `ns` (the stream comes back idle while neither waiter has polled since),
    /// and a third waiter polls: it must not be served before the two queued before it.
    FifoRace {
        owner: usize,
        ns: u64,
    },
    /// A new owner of the key of owner `owner` (its current priority; Normal without owners)
    /// waits for its stream (`Owner::ready`, as [`Op::Ready`]), polled at once with a waker
    /// whose wake, clone or drop (`at`) makes another owner of the key poll its own
    /// `Owner::ready` once (`futs::Reenter::Acquire`): a waker the crate runs under its pool's
    /// or gate's lock locks it again, which panics under `model-hooks` (recorded by the model).
    ReentrantReady {
        owner: usize,
        at: futs::At,
    },
    /// The context dies (`SimDriver::kill_context` with a sticky error, as a faulting kernel
    /// kills it on the GPU): the input ends here. The owners are dropped; every future then
    /// resolves, with success only where it could have succeeded and otherwise with the sticky
    /// error (a hang is a finding); everything else is dropped; the teardown returns, the simulation saw no misuse, and the
    /// thread's current context is as it was. (No leak check: a dead context's resources go
    /// with it, and the process cannot use the device again.)
    Kill,
}

/// A step of a worker thread in [`Op::Par`]; it works on its own owner's stream.
#[derive(Debug, Clone)]
pub enum WOp {
    Access {
        buffer: usize,
        write: bool,
        ns: u64,
    },
    Kernel {
        buffer: usize,
    },
    ReadBack {
        buffer: usize,
    },
    LaunchExec {
        exec: usize,
    },
    /// Drops the worker's reference to a buffer (the last reference frees it, on this thread).
    DropBuffer {
        buffer: usize,
    },
    Alloc {
        len: usize,
    },
    /// Drops the worker's owner (its streams go back to the pool) and takes a new one.
    NewOwner,
    Capture {
        buffer: usize,
    },
}

/// The codes of injected one-call faults. No sticky code ([`ErrorCode::is_sticky`]): on the real
/// driver those never fail one call alone, they kill the context (every later call fails, and the
/// crate then gives its futures up with the error: `tests/device_faults.rs`). 701
/// (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`) took the place of 700, so inputs keep their shape.
const CODES: [u32; 5] = [1, 2, 400, 701, 999];

/// The sticky error of [`Op::Kill`] (`CUDA_ERROR_ILLEGAL_ADDRESS`, a faulting kernel's).
const KILL_CODE: ErrorCode = ErrorCode::ERROR_ILLEGAL_ADDRESS;

/// Decodes operations until the bytes run out (at most `max` of them). With `leaks`, the
/// operations include [`Op::LeakCapture`], which leaks the whole context by design (the fuzzer,
/// whose leak checker would report that, leaves it out).
///
/// The first byte chooses the context's cap on live streams per key (none, or 1 to 4).
pub fn decode(bytes: &[u8], max: usize, leaks: bool) -> (Option<usize>, Vec<Op>) {
    let mut u = Unstructured::new(bytes);
    let cap = match u.int_in_range(0..=9u8) {
        Ok(c @ 6..=9) => Some(usize::from(c) - 5),
        _ => None,
    };
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < max {
        let Ok(op) = decode_one(&mut u, leaks) else {
            break;
        };
        ops.push(op);
    }
    (cap, ops)
}

fn idx(u: &mut Unstructured<'_>) -> arbitrary::Result<usize> {
    u.int_in_range(0..=15usize)
}

fn decode_wop(u: &mut Unstructured<'_>) -> arbitrary::Result<WOp> {
    Ok(match u.int_in_range(0..=9u8)? {
        0..=2 => WOp::Access {
            buffer: idx(u)?,
            write: u.arbitrary()?,
            ns: u.int_in_range(0..=5_000u64)?,
        },
        3 => WOp::Kernel { buffer: idx(u)? },
        4 => WOp::ReadBack { buffer: idx(u)? },
        5 => WOp::LaunchExec { exec: idx(u)? },
        6 => WOp::DropBuffer { buffer: idx(u)? },
        7 => WOp::Alloc {
            len: u.int_in_range(1..=64usize)?,
        },
        8 => WOp::NewOwner,
        _ => WOp::Capture { buffer: idx(u)? },
    })
}

/// The operation byte that, followed by a byte in [`EXT_CODES`], escapes to [`decode_ext`] in the
/// fuzzer's view: 241 is one of the six bytes of code 31 (`241 % 42`), which decoded a concurrent
/// step, like 30, when the corpus was recorded. No committed corpus input has 241 followed by a
/// byte of `EXT_CODES` at an operation, so every committed input keeps its meaning (and its
/// coverage); the comparison with the recorded decoder showed the same operations for all.
const EXT_ESCAPE: u8 = 241;
/// The bytes after [`EXT_ESCAPE`] that make it an escape; the byte is also `decode_ext`'s code
/// (`224..=239 % 16` is `0..=15`), so an escape costs one byte more than an operation.
const EXT_CODES: std::ops::RangeInclusive<u8> = 224..=239;
/// The byte after [`EXT_ESCAPE`] that decodes [`Op::Kill`] (every code of [`EXT_CODES`] was
/// taken; no committed input has an escape followed by it: checked by decoding every one before
/// and after). In the property test's view the 16 bytes from it up decode it (one extended
/// operation in 16).
const KILL_BYTE: u8 = 240;

/// Whether operation byte `b` (of code 31) decodes one of [`decode_ext`]'s operations: in the
/// property test's view (`leaks`, whose cases are drawn afresh and keep no corpus) every byte of
/// code 31 does, so that drawn inputs reach them as often as other operations; in the fuzzer's
/// view only the escape ([`EXT_ESCAPE`] and a byte of [`EXT_CODES`]) does, and the other bytes
/// of code 31 decode a concurrent step as they always did.
fn is_ext(b: u8, u: &Unstructured<'_>, leaks: bool) -> bool {
    leaks
        || (b == EXT_ESCAPE
            && matches!(u.peek_bytes(1), Some([c]) if EXT_CODES.contains(c) || *c == KILL_BYTE))
}

/// The operations added after the corpus was recorded (see [`is_ext`]): new ones take free
/// codes, so that inputs keep their meaning.
fn decode_ext(u: &mut Unstructured<'_>) -> arbitrary::Result<Op> {
    // 16 codes from the start: codes 0 to 4 were assigned first and 5 to 12 repeat them
    // (`c % 5`); operations added later take codes from 15 down (the loans took 15 to 13, the
    // re-entrant acquisition 12 and 11, the FIFO race 10),
    // each with an arm of its own here, which changes the meaning of that code only (no
    // committed input has an escape of code 12 or 11: the re-entrant acquisition took both,
    // so that drawn inputs reach it more often).
    // (One byte, read whole: its code is `b % 16`, what `int_in_range(0..=15u8)` read from it.)
    let b = u.int_in_range(0..=255u8)?;
    if b >= KILL_BYTE {
        // (In the fuzzer's view only `KILL_BYTE` comes here, see `is_ext`; in the property
        // test's view every byte does, and one extended operation in 16 kills the context.)
        return Ok(Op::Kill);
    }
    Ok(match b % 16 {
        15 => Op::Lend { owner: idx(u)? },
        14 => Op::LoanWork {
            loan: idx(u)?,
            ns: u.int_in_range(0..=10_000u64)?,
        },
        13 => Op::EndLoan(idx(u)?),
        10 => Op::FifoRace {
            owner: idx(u)?,
            ns: u.int_in_range(0..=5_000u64)?,
        },
        12 | 11 => Op::ReentrantReady {
            owner: idx(u)?,
            at: [futs::At::Wake, futs::At::Clone, futs::At::Drop][u.int_in_range(0..=2usize)?],
        },
        c => decode_ext_first(c % 5, u)?,
    })
}

/// The first operations of [`decode_ext`] (codes 0 to 4, repeated up to 12).
fn decode_ext_first(c: u8, u: &mut Unstructured<'_>) -> arbitrary::Result<Op> {
    Ok(match c {
        0 => Op::ForeignCapture {
            mode: [
                CaptureMode::Global,
                CaptureMode::ThreadLocal,
                CaptureMode::Relaxed,
            ][u.int_in_range(0..=2usize)?],
        },
        1 => Op::EndForeign(idx(u)?),
        2 => Op::LeakUse {
            buffer: idx(u)?,
            holder: idx(u)?,
            write: u.arbitrary()?,
            ns: u.int_in_range(0..=10_000u64)?,
            drop_now: u.arbitrary()?,
        },
        3 => Op::ManyOwners {
            p: u.int_in_range(-5..=0i32)?,
            extra: u.int_in_range(1..=4usize)?,
        },
        _ => Op::ReentrantPoll {
            fut: idx(u)?,
            // (`Reenter::Trim` is left out for now: a trim run by the poller thread races the
            // model's checks of the pool's counters against its lists, which hold only at a
            // quiescent point.)
            action: futs::Reenter::DropBuffer(idx(u)?),
            at: [futs::At::Wake, futs::At::Clone, futs::At::Drop][u.int_in_range(0..=2usize)?],
        },
    })
}

fn decode_one(u: &mut Unstructured<'_>, leaks: bool) -> arbitrary::Result<Op> {
    // The operation byte, of which the code is `b % 42` (what `int_in_range(0..=41u8)` read
    // from it when the corpus was recorded: the same byte, the same code).
    let b = u.int_in_range(0..=255u8)?;
    if b % 42 == 31 && is_ext(b, u, leaks) {
        return decode_ext(u);
    }
    Ok(match b % 42 {
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
            holder: idx(u)?,
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
            keep: u.arbitrary()?,
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
        15 => Op::Trim,
        16..=18 => Op::Access {
            buffer: idx(u)?,
            holder: idx(u)?,
            write: u.arbitrary()?,
            ns: u.int_in_range(0..=10_000u64)?,
        },
        19 => Op::Kernel {
            buffer: idx(u)?,
            holder: idx(u)?,
        },
        20 => Op::ReadBack {
            buffer: idx(u)?,
            holder: idx(u)?,
        },
        21 => Op::WaitFor {
            a: idx(u)?,
            b: idx(u)?,
        },
        22 => Op::HostFn {
            holder: idx(u)?,
            take: if u.arbitrary()? { Some(idx(u)?) } else { None },
        },
        23 => Op::NewOwned {
            p: u.int_in_range(-5..=0i32)?,
        },
        24 => Op::DropOwned(idx(u)?),
        25 => Op::LaunchExec {
            exec: idx(u)?,
            holder: idx(u)?,
        },
        26 => Op::DropExec(idx(u)?),
        27 => Op::DropOwnerElsewhere(idx(u)?),
        28 => Op::DropBufferElsewhere(idx(u)?),
        29 if leaks && u.ratio(1u8, 16u8)? => Op::LeakCapture(idx(u)?),
        32 | 33 => Op::Complete {
            holder: idx(u)?,
            ns: u.int_in_range(0..=5_000u64)?,
            marker: u.arbitrary()?,
        },
        34 => Op::CopyAsync {
            buffer: idx(u)?,
            holder: idx(u)?,
            ns: u.int_in_range(0..=5_000u64)?,
            marker: u.arbitrary()?,
        },
        35 => Op::Ready {
            p: u.int_in_range(-5..=0i32)?,
            poll: u.arbitrary()?,
        },
        36 => Op::Attach {
            owner: idx(u)?,
            wait: u.arbitrary()?,
        },
        37..=39 => Op::Poll {
            fut: idx(u)?,
            fresh: u.ratio(1u8, 4u8)?,
        },
        40 => Op::DropFut(idx(u)?),
        41 => {
            if u.arbitrary()? {
                Op::Reserve {
                    p: u.int_in_range(-5..=0i32)?,
                    n: u.int_in_range(0..=5usize)?,
                }
            } else {
                Op::BlockedAcquire(idx(u)?)
            }
        }
        _ => {
            let n = u.int_in_range(2..=3usize)?;
            let mut workers = Vec::with_capacity(n);
            for _ in 0..n {
                let k = u.int_in_range(1..=4usize)?;
                let mut w = Vec::with_capacity(k);
                for _ in 0..k {
                    w.push(decode_wop(u)?);
                }
                workers.push(w);
            }
            let len = u.int_in_range(0..=48usize)?;
            let mut schedule = Vec::with_capacity(len);
            for _ in 0..len {
                schedule.push(u.arbitrary()?);
            }
            Op::Par { workers, schedule }
        }
    })
}

/// A buffer of the model. The model's reference is one of possibly several (graphs keep the
/// buffers they captured).
struct Buf {
    b: Arc<DeviceBuffer<u32>>,
    /// The model's own record of the last use: (raw stream, the model's hand-over count of that
    /// stream at the time).
    last: (u64, u64),
    /// The contents the buffer must have (in stream order after its last use), when the model
    /// knows them: zeroed, then `add_u32` kernels, directly or in graphs.
    val: Option<Vec<u32>>,
}

/// A holder of a stream: an owner (shared with the captures of its streams) or an owned stream.
#[derive(Clone)]
enum Holder {
    Owner(u64, Rc<Owner>),
    Owned(Rc<OwnedStream>),
}

impl Holder {
    fn stream(&self) -> Option<StreamRef<'_>> {
        match self {
            Holder::Owner(_, o) => o.stream().ok(),
            Holder::Owned(s) => Some(s.stream()),
        }
    }
}

/// A capture in progress. The guard comes from `Owner::stream_shared`, so it keeps the owner
/// alive by itself: the model may drop its own reference to the owner first.
struct Capture {
    guard: Option<CaptureGuard<'static>>,
    owner_id: u64,
    owner: Rc<Owner>,
    /// The raw captured stream (the simulation never reuses handles).
    raw: u64,
    /// Buffers (device addresses) that captured `add_u32` kernels add 1 to, once per entry, when
    /// the graph is launched.
    kernels: Vec<u64>,
}

impl Capture {
    /// Begins capturing the owner's current stream.
    fn begin(owner_id: u64, owner: Rc<Owner>) -> Option<Capture> {
        let s = owner.stream_shared().ok()?;
        let raw = s.model_handle().0;
        let guard = s.begin_capture().ok()?;
        drop(s);
        Some(Capture {
            guard: Some(guard),
            owner_id,
            owner,
            raw,
            kernels: Vec::new(),
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

/// Whether the owner's stream `raw` (if it still holds it) is still capturing.
fn still_capturing(owner: &Owner, raw: u64) -> bool {
    owner
        .streams()
        .iter()
        .any(|(_, s)| s.model_handle().0 == raw && s.is_capturing().unwrap_or(false))
}

type Drv = Hooked<Sched>;
type RawCtx = cuda_stream_pool::driver::Context;

/// Asserts that the calling thread's current context is `ctx` and its capture mode global, as
/// the model left them before `what` (the crate restores the caller's thread state).
fn assert_thread_state(sim: &SimDriver, ctx: RawCtx, what: &str) {
    let (cur, mode) = sim.thread_state();
    assert_eq!(
        cur, ctx,
        "{what} left another context current on the calling thread"
    );
    assert_eq!(
        mode,
        CaptureMode::Global,
        "{what} left the calling thread in another capture mode"
    );
}

/// A thread's state after a step of the model (see [`Model::check_thread_states`]).
type ThreadState = (RawCtx, CaptureMode, &'static str);

/// Calls whose failure (injected) may leave a thread's state switched: the crate restores the
/// caller's context and capture mode with them, and documents that a restore cannot fail on a
/// live driver.
const THREAD_STATE_CALLS: [&str; 3] = [
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuThreadExchangeStreamCaptureMode",
];

impl Model {
    /// Runs `f` on a thread of its own with the model's other context current there, and
    /// records that thread's state after it for the step's check.
    fn elsewhere<T: Send + 'static>(
        &mut self,
        what: &'static str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let (sim, other) = (self.sim.clone(), self.other);
        let (r, state) = threads::spawn(move || {
            // (A reused thread: its state starts as a new thread's.)
            sim.forget_thread_state();
            sim.set_thread_context(other);
            let r = f();
            let (ctx, mode) = sim.thread_state();
            sim.forget_thread_state();
            (r, (ctx, mode, what))
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
        self.thread_states.push(state);
        r
    }

    /// After a capture's end (or its guard's drop): the owner's stream `raw` is no longer
    /// capturing, unless injected faults (since the `f0`th) failed each of the crate's three
    /// tries to end it (a fault on any call of a try fails it: the end, the status query, the
    /// current-context switch of the device rules around them). Then the crate keeps the stream
    /// flagged capturing, out of circulation for good, and the model checks it from then on as
    /// a stream that is never handed to another owner. Campaign 8's finding
    /// `regression-capture-end-gives-up-d5fd42c4` (three faults on `cuCtxGetCurrent`/`cuCtxSetCurrent` during a guard's
    /// drop) before this allowance.
    fn check_capture_ended(&mut self, id: u64, o: &Owner, raw: u64, f0: usize, what: &str) {
        if !still_capturing(o, raw) {
            return;
        }
        let injected = self.sim.injected_failures();
        let since = &injected[f0.min(injected.len())..];
        assert!(
            since.len() >= 3,
            "{what} (injected faults during it: {since:?})"
        );
        self.stuck.push((id, raw));
    }

    /// Checks the model thread's state and those the step's other threads recorded: the other
    /// context current, global capture mode. Unless an injected fault failed one of the
    /// calls that switch and restore them during the step: then the states are reset.
    fn check_thread_states(&mut self) {
        let (ctx, mode) = self.sim.thread_state();
        let mut states = std::mem::take(&mut self.thread_states);
        states.push((ctx, mode, "an operation"));
        let injected = self.sim.injected_failures();
        let faulted = injected[self.injected_seen.min(injected.len())..]
            .iter()
            .any(|c| THREAD_STATE_CALLS.contains(c));
        self.injected_seen = injected.len();
        if faulted {
            self.sim.set_thread_state(self.other, CaptureMode::Global);
            return;
        }
        for (ctx, mode, what) in states {
            assert_eq!(
                ctx, self.other,
                "{what} left another context current on the calling thread"
            );
            assert_eq!(
                mode,
                CaptureMode::Global,
                "{what} left the calling thread in another capture mode"
            );
        }
    }
}

/// What [`Model::open_window`] saw when a window of checked calls opened.
#[derive(Clone, Copy)]
struct Window {
    /// [`Model::open_window_counters`].
    counters: (u64, u64, u64),
    /// The context's work kept for a later attempt ([`Context::pending`]).
    pending: usize,
}

/// The model's state: the simulated driver, one context, and the live objects.
pub struct Model {
    pub sim: Arc<SimDriver>,
    drv: Arc<Drv>,
    /// Another context (device 1's primary context), current on every thread of the model
    /// while it calls the crate: the crate must restore it after each operation.
    other: RawCtx,
    ctx: Option<Context>,
    kernels: Option<Arc<Kernels>>,
    owners: Vec<(u64, Rc<Owner>)>,
    owned: Vec<Rc<OwnedStream>>,
    bufs: Vec<Buf>,
    guards: Vec<Capture>,
    execs: Vec<Arc<GraphExec>>,
    /// For each of `execs`, the buffers its graph's kernels add 1 to (see [`Capture::kernels`]).
    exec_kernels: Vec<Vec<u64>>,
    /// The model's futures (completions, host copies, waiting owners, attached owners).
    futs: Vec<Fut>,
    /// Live captures of raw streams by other threads.
    foreign: Vec<foreign::Foreign>,
    /// The states of the step's other threads after their work (see
    /// [`Model::check_thread_states`]).
    thread_states: Vec<ThreadState>,
    /// Injected failures already looked at.
    injected_seen: usize,
    /// Buffers whose use lock a leaked `BufferUse` took (given up by the model: only dropped).
    leaked_uses: Vec<Arc<DeviceBuffer<u32>>>,
    /// Whether a `BufferUse` was leaked (a graph may keep its buffer, locked for ever).
    use_leaked: bool,
    /// The borrower's live loans.
    loans: Vec<loans::Loan>,
    /// Streams lent and not yet seen back (held by another owner than their lender), with
    /// their lender's id.
    lent_ever: HashMap<u64, u64>,
    /// The context's cap on live streams per key.
    cap: Option<usize>,
    /// Join order of `Owner::ready` futures (first poll that returned `Pending`).
    joins: u64,
    /// Streams held per owner id at the last `sync_holdings` (sorted by id).
    nheld: Vec<(u64, usize)>,
    /// Acquisitions by owners that already held a stream (the only ones that may exceed the cap).
    bypass: u64,
    steps: usize,
    /// Raw streams left captured by leaked guards (kept by the pool, never handed out).
    leaked: Vec<u64>,
    /// (owner id, raw stream): streams whose capture the crate could not end (injected faults
    /// failed its every try): flagged capturing for good, never handed to another owner.
    stuck: Vec<(u64, u64)>,
    next_owner: u64,
    /// (owner id, raw stream) pairs seen held, sorted; a new pair is a hand-over.
    held: Vec<(u64, u64)>,
    /// The model's count of hand-overs per raw stream (the simulation never reuses handles).
    gens: HashMap<u64, u64>,
    /// Hand-overs to owners that re-entrant wakers made and dropped (`futs::Reenter::Acquire`),
    /// per raw stream: counted in [`Model::gen_of`].
    handed_unseen: Arc<std::sync::Mutex<HashMap<u64, u64>>>,
    /// Panics of re-entrant wakers' actions (`futs::Reentrant`), checked after every step.
    waker_panics: Arc<std::sync::Mutex<Vec<String>>>,
    /// The context was killed ([`Op::Kill`]).
    dead: bool,
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

fn refused_in_capture<T: std::fmt::Debug>(r: &cuda_stream_pool::Result<T>, what: &str) {
    assert!(
        matches!(r, Err(Error::CaptureInProgress(_))),
        "{what} on a capturing stream: {r:?}"
    );
}

/// After a successful switch of `o`'s selection from priority `from` to `to` (both streams
/// held): the stream of `to` is ordered after the work enqueued on the stream of `from` (the
/// crate records an event on the old stream and makes the new one wait for it), so while that
/// work is pending the new stream is busy. The new stream is read first: once it is idle its
/// wait has completed, and so has everything enqueued on the old stream before the switch (and
/// nothing enqueues more on it meanwhile), so no timing decides the verdict. `is_busy` is not a
/// driver call: injected faults stay where the input put them.
fn check_switch_ordered(sim: &SimDriver, o: &Owner, from: i32, to: i32, what: &str) {
    if from == to {
        return;
    }
    let streams = o.streams();
    let find = |p: i32| {
        streams
            .iter()
            .find(|(q, _)| *q == p)
            .map(|(_, s)| s.model_handle())
    };
    let (Some(prev), Some(next)) = (find(from), find(to)) else {
        return;
    };
    let next_busy = sim.is_busy(next);
    let prev_busy = sim.is_busy(prev);
    assert!(
        !prev_busy || next_busy,
        "{what} from priority {from} to {to}: the new stream {next:?} is idle while the \
         previous one {prev:?} still has work: the switch did not order it after that work"
    );
}

impl Model {
    pub fn new() -> Model {
        Model::with_cap(None)
    }

    /// A model whose context caps live streams per key at `cap`.
    pub fn with_cap(cap: Option<usize>) -> Model {
        let sim = Arc::new(SimDriver::with_config(SimConfig {
            devices: 2,
            ..SimConfig::default()
        }));
        sim.set_logging(true);
        // Copies take GPU time (the H200's figure of the latency model): a completion enqueued
        // just before a copy then lands before the copy's data does, not in the same step of the
        // simulation, so a completion enqueued too early is seen (plant (h), docs/testing.md).
        sim.set_copy_time(cuda_stream_pool::driver::sim::Latency::default().copy_gpu);
        // `CSP_MODEL_FREE_NS`: frees take GPU time too, so that a stream is handed on with its
        // previous owner's frees still pending (as on a real GPU; review 15). Off by default.
        if let Some(ns) = std::env::var("CSP_MODEL_FREE_NS")
            .ok()
            .and_then(|s| s.parse().ok())
        {
            sim.set_free_time(ns);
        }
        // The model's threads run with another context current (made current without a driver
        // call, so that the calls of the input's operations are those they always were).
        sim.init().expect("init");
        let other = sim
            .primary_ctx_retain(sim.device_get(1).expect("device 1"))
            .expect("device 1's primary context");
        sim.set_thread_context(other);
        let drv = Arc::new(Hooked {
            inner: sim.clone(),
            hook: Sched::default(),
        });
        let d: Arc<dyn Driver> = drv.clone();
        let opts = ContextOptions::default().max_live_streams_per_key(cap);
        let ctx = Context::primary_with(d, 0, opts).expect("context");
        let kernels = Kernels::load(&ctx).ok().map(Arc::new);
        assert_thread_state(&sim, other, "the context's creation");
        Model {
            sim,
            drv,
            other,
            ctx: Some(ctx),
            kernels,
            owners: Vec::new(),
            owned: Vec::new(),
            bufs: Vec::new(),
            guards: Vec::new(),
            execs: Vec::new(),
            exec_kernels: Vec::new(),
            futs: Vec::new(),
            foreign: Vec::new(),
            thread_states: Vec::new(),
            injected_seen: 0,
            stuck: Vec::new(),
            leaked_uses: Vec::new(),
            use_leaked: false,
            loans: Vec::new(),
            lent_ever: HashMap::new(),
            cap,
            joins: 0,
            nheld: Vec::new(),
            bypass: 0,
            steps: 0,
            leaked: Vec::new(),
            next_owner: 0,
            held: Vec::new(),
            gens: HashMap::new(),
            handed_unseen: Arc::default(),
            waker_panics: Arc::default(),
            dead: false,
        }
    }

    /// Every owner alive: the model's, and those only a capture keeps.
    fn all_owners(&self) -> Vec<(u64, Rc<Owner>)> {
        let mut v = self.owners.clone();
        for c in &self.guards {
            if !v.iter().any(|(id, _)| *id == c.owner_id) {
                v.push((c.owner_id, c.owner.clone()));
            }
        }
        v
    }

    /// Every (owner id, raw stream) pair held: the model's owners, those only a capture keeps,
    /// and those attached to futures.
    fn held_pairs(&self) -> Vec<(u64, u64)> {
        // (Sized for an owner's stream each, the usual case: this runs after every step.)
        let mut v = Vec::with_capacity(self.owners.len() + self.guards.len() + self.futs.len());
        let mut push = |id: u64, o: &Owner| {
            for (_, s) in o.streams() {
                v.push((id, s.model_handle().0));
            }
        };
        // The owners of `all_owners`, in its order, without cloning them (this runs after
        // every step).
        for (id, o) in &self.owners {
            push(*id, o);
        }
        for (k, c) in self.guards.iter().enumerate() {
            let listed = self.owners.iter().any(|(id, _)| *id == c.owner_id)
                || self.guards[..k].iter().any(|d| d.owner_id == c.owner_id);
            if !listed {
                push(c.owner_id, &c.owner);
            }
        }
        self.attached_pairs(&mut v);
        v
    }

    /// Records hand-overs: every (owner, stream) pair not seen before bumps the model's count.
    /// Counts acquisitions by owners that held a stream already.
    fn sync_holdings(&mut self) {
        let pairs = self.held_pairs();
        self.sync_holdings_with(&pairs);
    }

    /// [`Model::sync_holdings`] with the pairs held now (`held_pairs`). (Sorted vectors, not
    /// hash sets: this runs after every step.)
    fn sync_holdings_with(&mut self, pairs: &[(u64, u64)]) {
        let mut now = pairs.to_vec();
        now.sort_unstable();
        if now == self.held && self.nheld.iter().map(|e| e.1).sum::<usize>() == now.len() {
            // The same pairs as at the last reading (the usual case), none twice then or now:
            // no hand-over, and the same streams per owner (`nheld`), so no acquisition by an
            // owner holding a stream already. (What the rest would find, without its vectors.)
            return;
        }
        // Streams held per owner (pairs counted as given, as `per` counted them).
        let mut per: Vec<(u64, usize)> = Vec::new();
        for &(id, _) in &now {
            match per.last_mut() {
                Some((last, n)) if *last == id => *n += 1,
                _ => per.push((id, 1)),
            }
        }
        now.dedup();
        for pair in &now {
            if self.held.binary_search(pair).is_err() {
                *self.gens.entry(pair.1).or_insert(0) += 1;
            }
        }
        for &(id, n) in &per {
            let before = self.nheld_of(id);
            self.bypass += n.saturating_sub(before.max(1)) as u64;
        }
        self.nheld = per;
        self.held = now;
    }

    /// Streams held by owner `id` at the last `sync_holdings` (0 if none).
    fn nheld_of(&self, id: u64) -> usize {
        self.nheld
            .binary_search_by_key(&id, |e| e.0)
            .map_or(0, |k| self.nheld[k].1)
    }

    /// [`Model::sync_holdings`] for owner `id`, about to be dropped with the streams `pairs`
    /// (an attached owner whose future resolved): its hand-overs and acquisitions while holding
    /// a stream are counted, and it is forgotten.
    fn sync_gone(&mut self, id: u64, pairs: &[(u64, u64)]) {
        for pair in pairs {
            if self.held.binary_search(pair).is_err() {
                *self.gens.entry(pair.1).or_insert(0) += 1;
            }
        }
        let before = self.nheld_of(id);
        self.nheld.retain(|e| e.0 != id);
        self.bypass += pairs.len().saturating_sub(before.max(1)) as u64;
        self.held.retain(|p| p.0 != id);
    }

    /// Whether owner `o` may take its stream of priority `p` now without waiting at the cap
    /// (which, on the model's thread, could wait for itself): no cap, or it holds a stream
    /// already (it never waits then), or the key is below its cap with no waiter queued.
    fn may_acquire(&self, o: &Owner, p: i32) -> bool {
        let Some(cap) = self.cap else { return true };
        if !o.streams().is_empty() {
            return true;
        }
        self.room(p, cap) > 0
    }

    /// Streams that key `p` may still create without anyone waiting (0 while an `Owner::ready`
    /// of the model is queued for it).
    fn room(&self, p: i32, cap: usize) -> usize {
        if self.queued(p) {
            return 0;
        }
        let live = self
            .ctx()
            .stats_for(Priority::Value(p))
            .map_or(u64::MAX, |s| s.live);
        (cap as u64).saturating_sub(live) as usize
    }

    fn gen_of(&self, raw: u64) -> u64 {
        let unseen = self
            .handed_unseen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&raw)
            .copied()
            .unwrap_or(0);
        self.gens.get(&raw).copied().unwrap_or(0) + unseen
    }

    /// Holder `i` among the owners and the owned streams.
    fn holder(&self, i: usize) -> Option<Holder> {
        let n = self.owners.len() + self.owned.len();
        if n == 0 {
            return None;
        }
        let i = i % n;
        Some(if i < self.owners.len() {
            let o = &self.owners[i].1;
            if !self.may_acquire(o, o.priority()) {
                return None;
            }
            Holder::Owner(self.owners[i].0, self.owners[i].1.clone())
        } else {
            Holder::Owned(self.owned[i - self.owners.len()].clone())
        })
    }

    /// Checks the calls a buffer operation made: event records and frees may only touch the
    /// buffer's last stream while that stream has not been handed to anyone since (or the
    /// disposal stream); waits only the target stream.
    /// Clears the call log for a window of calls to check, and returns the counters of the
    /// threads outside the model's control (host functions started, background jobs queued,
    /// re-entrant wakers' actions begun), for [`Model::check_buffer_calls`].
    fn open_window(&self) -> Window {
        // Nothing in flight when the window opens: whatever runs in it was started in it. The
        // counters are the settled ones, read again after the clear: what began in between (the
        // completion poller can wake a re-entrant waker there) settles again (review 10,
        // finding 1).
        loop {
            let settled = self.settle();
            self.sim.clear_calls();
            if self.open_window_counters() == settled {
                return Window {
                    counters: settled,
                    pending: self.ctx().pending(),
                };
            }
        }
    }

    fn open_window_counters(&self) -> (u64, u64, u64) {
        (
            self.sim.host_fn_progress().0,
            cuda_stream_pool::__model_hooks::background().0,
            futs::ACTIONS.0.load(std::sync::atomic::Ordering::SeqCst),
        )
    }

    fn check_buffer_calls(&self, window: Window, last: (u64, u64), ptr: u64, target: Option<u64>) {
        // A host function that the window's calls started (counted when handed to the
        // simulation's thread, in the call), a job it handed to the crate's background threads
        // (a buffer's drop), or a re-entrant waker's action (run by the poller's thread) makes
        // calls of its own at a time of the machine's choosing,
        // which the log cannot tell from the window's: such a window is not checked. Whether a
        // host function starts is the simulation's (deterministic); only its calls' timing is
        // not, and skipping can only miss, never fail wrongly. The next step's settle point
        // waits for them.
        // The log first, then the counters: whatever made a call in the log had begun (and
        // been counted) before it, so before this reading (CI's loaded run found a re-entrant
        // waker's free, run on the poller's thread, in a window; input
        // `139305ccbf490cbe84b81bfc16cd340e264f6838` of the corpus).
        let calls = self.sim.calls();
        if self.open_window_counters() != window.counters {
            return;
        }
        // Work the context kept for a later attempt (a deferred free, a loan's stream) when the
        // window opened may be retried by this operation's flush: its orderings are other
        // buffers' (CI's loaded run found a deferred free's record in a buffer drop's window:
        // the corpus input `139305ccbf490cbe84b81bfc16cd340e264f6838`; what is kept depends on
        // when loans end, in real time). Then only this buffer's free is checked.
        let own_only = window.pending > 0;
        let disposal = self.ctx().disposal_stream().0;
        for c in calls {
            let st = c.stream.map(|s| s.0);
            match c.name {
                "cuEventRecord" | "cuStreamWaitEvent" if own_only => {}
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
        self.guards.iter().any(|c| c.raw == s.model_handle().0)
    }

    /// The capture of stream `raw`, if the model has one.
    fn capture_of(&self, raw: u64) -> Option<&Capture> {
        self.guards.iter().find(|c| c.raw == raw)
    }

    /// Records a use of buffer `j` on `s` in the model.
    fn used(&mut self, j: usize, raw: u64) {
        self.bufs[j].last = (raw, self.gen_of(raw));
    }

    /// After an operation on buffer `j` on stream `raw` failed: the use is recorded when the
    /// crate made it before the failure (a kernel launch or copy failing after `use_on`), which
    /// the crate's last use, changed since `before`, tells.
    fn used_if_recorded(
        &mut self,
        j: usize,
        raw: u64,
        before: Option<(cuda_stream_pool::driver::Stream, u64, bool)>,
    ) {
        let key =
            |u: Option<(cuda_stream_pool::driver::Stream, u64, bool)>| u.map(|u| (u.0 .0, u.1));
        let now = key(self.bufs[j].b.last_use());
        if now != key(before) {
            let s = now.map(|u| u.0);
            assert_eq!(s, Some(raw), "a failed use recorded on another stream");
            self.used(j, raw);
        }
    }

    /// Drops the model's reference to buffer `j`; checks the free when it was the last.
    fn drop_buffer(&mut self, j: usize) {
        let buf = self.bufs.swap_remove(j);
        let p = buf.b.as_raw();
        let (last, _, current) = buf.b.last_use().unwrap();
        let last_capturing = current && self.capture_of(last.0).is_some();
        let only = Arc::strong_count(&buf.b) == 1;
        let window = self.open_window();
        drop(buf.b);
        if only {
            self.check_buffer_calls(window, buf.last, p.0, None);
            if last_capturing {
                let freed = self.sim.calls().iter().any(|c| {
                    c.name == "cuMemFreeAsync" && c.ptr == Some(p) && c.stream == Some(last)
                });
                assert!(!freed, "a free entered a capture");
            }
        }
    }

    /// Waits until the threads outside the model's control have nothing in progress: no host
    /// function running on the simulation's thread, no job of the crate's background threads (a
    /// drop handed off a host-function thread, a wake-up) queued and not run, no re-entrant
    /// waker's action running (on the poller's thread, say). Their driver calls
    /// would otherwise land in a later step's window (its call checks, its injected faults) at a
    /// time that depends on the machine's load: campaign 10 (docs/testing.md) found a free of a
    /// buffer dropped by a host function checked as a read-back's call. No timing decides it (a
    /// bound of [`HANG_LIMIT`] reports a job that never ends).
    /// The capture's `info()`, retried for as long as each failure is an injected fault (they
    /// are one-shot, but a run of them can be due at consecutive calls: review 10, finding 4);
    /// `None` when a failure is not injected.
    fn info_past_faults(
        &self,
        g: &cuda_stream_pool::CaptureGuard<'_>,
    ) -> Option<(cuda_stream_pool::driver::CaptureStatus, u64)> {
        for _ in 0..256 {
            let faults = self.sim.injected_failures().len();
            match g.info() {
                Ok(v) => return Some(v),
                Err(_) if self.sim.injected_failures().len() > faults => continue,
                Err(_) => return None,
            }
        }
        None
    }

    fn settle(&self) -> (u64, u64, u64) {
        // (Read at the first reading that is not quiet: most are, and this runs twice a step.)
        let mut hang = None;
        let mut seen = None;
        loop {
            // A host function that became due starts at the simulation's next step: this one.
            self.sim.advance(0);
            let (hs, hr) = self.sim.host_fn_progress();
            let (bq, br) = cuda_stream_pool::__model_hooks::background();
            let ae = futs::ACTIONS.1.load(std::sync::atomic::Ordering::SeqCst);
            let ab = futs::ACTIONS.0.load(std::sync::atomic::Ordering::SeqCst);
            if hs == hr && bq == br && ab == ae {
                // Quiet, and nothing new started since the last quiet reading: settled.
                if seen == Some((hs, bq, ab)) {
                    return (hs, bq, ab);
                }
                seen = Some((hs, bq, ab));
                continue;
            }
            let hang = *hang.get_or_insert_with(|| std::time::Instant::now() + futs::HANG_LIMIT);
            assert!(
                std::time::Instant::now() < hang,
                "a hang: a host function or a job of the crate's background threads did not \
                 finish in {:?}",
                futs::HANG_LIMIT
            );
            std::thread::yield_now();
        }
    }

    /// Applies one operation, then checks the invariants.
    pub fn step(&mut self, op: &Op) {
        self.settle();
        self.steps += 1;
        let mut acquired = false;
        match op {
            Op::NewOwner => {
                if self.owners.len() < 48 {
                    self.owners
                        .push((self.next_owner, Rc::new(self.ctx().owner())));
                    self.next_owner += 1;
                }
            }
            &Op::DropOwner(i) => {
                if let Some(i) = pick(&self.owners, i) {
                    // A capture of one of its streams keeps the owner alive until it ends.
                    drop(self.owners.swap_remove(i));
                }
            }
            &Op::DropOwnerElsewhere(i) => {
                if let Some(i) = pick(&self.owners, i) {
                    let (_, o) = self.owners.swap_remove(i);
                    match Rc::try_unwrap(o) {
                        Ok(o) => self.elsewhere("an owner's drop", move || drop(o)),
                        Err(o) => drop(o), // a capture still shares it
                    }
                }
            }
            &Op::Work { owner, ns } => {
                if let Some(i) = self.pick_owner(owner) {
                    let o = self.owners[i].1.clone();
                    let before = o.streams().len();
                    if let Ok(s) = o.stream() {
                        acquired = o.streams().len() > before;
                        if acquired {
                            self.check_fresh(&s);
                        }
                        if !self.capturing(&s) {
                            let _ = self.sim.enqueue_work(s.raw(), ns);
                        }
                    }
                }
            }
            &Op::Advance(ns) => self.sim.advance(ns),
            &Op::SetPriority { owner, p } => {
                if let Some(i) = pick(&self.owners, owner) {
                    let o = self.owners[i].1.clone();
                    let before = o.priority();
                    let value = match p {
                        1 => 0,
                        2 => -5,
                        v => v,
                    };
                    let capturing = o
                        .streams()
                        .iter()
                        .any(|(q, s)| (*q == before || *q == value) && self.capturing(s));
                    let r = o.set_priority(prio(p));
                    if r.is_ok() {
                        check_switch_ordered(&self.sim, &o, before, value, "set_priority");
                    }
                    let in_range = (-5..=0).contains(&p) || p == 1 || p == 2;
                    if !in_range || (capturing && value != before) {
                        assert!(r.is_err(), "priority {p} accepted (capturing: {capturing})");
                        assert_eq!(
                            o.priority(),
                            before,
                            "a rejected priority changed the selection"
                        );
                    }
                }
            }
            &Op::Scoped { owner, p, ns } => {
                let range = self.ctx().priority_range();
                let ok = |o: &Owner| {
                    range
                        .resolve(prio(p))
                        .map_or(true, |v| self.may_acquire(o, v))
                };
                if let Some(i) = pick(&self.owners, owner).filter(|&i| ok(&self.owners[i].1)) {
                    let o = self.owners[i].1.clone();
                    let before = o.priority();
                    let sim = self.sim.clone();
                    let r = o.with_priority(prio(p), || {
                        let scoped = o.priority();
                        check_switch_ordered(&sim, &o, before, scoped, "with_priority's switch");
                        if let Ok(s) = o.stream() {
                            let _ = sim.enqueue_work(s.raw(), ns);
                        }
                        scoped
                    });
                    assert_eq!(o.priority(), before, "scoped priority not restored");
                    // (A failed restore selects the previous stream unordered, as documented.)
                    if let Ok(scoped) = r {
                        check_switch_ordered(&sim, &o, scoped, before, "with_priority's restore");
                    }
                }
            }
            &Op::Alloc { holder, len } => {
                if let Some(h) = self.holder(holder) {
                    if let Some(s) = h.stream() {
                        self.sync_holdings();
                        let raw = s.model_handle().0;
                        if let Some(c) = self.capture_of(raw) {
                            // Refused before any driver call; the capture is left as it was.
                            let g = c.guard();
                            let before = g.info().ok();
                            let r = DeviceBuffer::<u32>::zeroed(&s, len);
                            assert!(
                                matches!(r, Err(Error::CaptureInProgress(_)))
                                    || (len == 0 && matches!(r, Err(Error::InvalidArgument(_)))),
                                "allocation in a capture: {r:?}"
                            );
                            if let Some(before) = before {
                                // (Injected faults may hit this query itself: each is one-shot,
                                // but several may be pending, due at the same call.)
                                let after = self.info_past_faults(g);
                                assert_eq!(
                                    after,
                                    Some(before),
                                    "a refused allocation changed the capture"
                                );
                            }
                        } else if let Ok(b) = DeviceBuffer::<u32>::zeroed(&s, len) {
                            if self.bufs.len() < 64 {
                                let last = (raw, self.gen_of(raw));
                                let val = Some(vec![0; b.len()]);
                                self.bufs.push(Buf {
                                    b: Arc::new(b),
                                    last,
                                    val,
                                });
                            }
                        }
                    }
                }
            }
            &Op::UseOn { buffer, owner } => {
                if let (Some(j), Some(i)) = (pick(&self.bufs, buffer), self.pick_owner(owner)) {
                    let o = self.owners[i].1.clone();
                    if let Ok(s) = o.stream() {
                        self.sync_holdings();
                        if !self.capturing(&s) {
                            let window = self.open_window();
                            let b = self.bufs[j].b.clone();
                            let r = b.use_on(&s);
                            let raw = s.model_handle().0;
                            self.check_buffer_calls(
                                window,
                                self.bufs[j].last,
                                b.as_raw().0,
                                Some(raw),
                            );
                            // The use is recorded when its guard drops.
                            let ok = r.is_ok();
                            drop(r);
                            if ok {
                                self.used(j, raw);
                            }
                        }
                    }
                }
            }
            &Op::Access {
                buffer,
                holder,
                write,
                ns,
            } => {
                if let (Some(j), Some(h)) = (pick(&self.bufs, buffer), self.holder(holder)) {
                    if let Some(s) = h.stream() {
                        self.sync_holdings();
                        let b = self.bufs[j].b.clone();
                        let raw = s.model_handle().0;
                        let ok = access(&self.sim, &b, &s, write, ns);
                        if ok {
                            self.used(j, raw);
                        }
                    }
                }
            }
            &Op::Kernel { buffer, holder } => {
                if let (Some(j), Some(h), Some(k)) = (
                    pick(&self.bufs, buffer),
                    self.holder(holder),
                    self.kernels.clone(),
                ) {
                    if let Some(s) = h.stream() {
                        self.sync_holdings();
                        let b = self.bufs[j].b.clone();
                        let raw = s.model_handle().0;
                        let before = b.last_use();
                        let r = k.add_u32(&s, &b, 1);
                        let ptr = b.as_raw().0;
                        if let Some(c) = self.guards.iter_mut().find(|c| c.raw == raw) {
                            // Captured: runs when the graph is launched.
                            if r.is_ok() {
                                c.kernels.push(ptr);
                            }
                        } else if r.is_ok() {
                            if let Some(v) = self.bufs[j].val.as_mut() {
                                v.iter_mut().for_each(|x| *x = x.wrapping_add(1));
                            }
                        } else {
                            // Failed somewhere: launched or not.
                            self.bufs[j].val = None;
                        }
                        if r.is_ok() {
                            self.used(j, raw);
                        } else {
                            self.used_if_recorded(j, raw, before);
                        }
                    }
                }
            }
            &Op::ReadBack { buffer, holder } => {
                if let (Some(j), Some(h)) = (pick(&self.bufs, buffer), self.holder(holder)) {
                    if let Some(s) = h.stream() {
                        self.sync_holdings();
                        let b = self.bufs[j].b.clone();
                        let before = b.last_use();
                        let r = b.to_vec(&s);
                        if self.capturing(&s) {
                            refused_in_capture(&r, "a blocking copy");
                        } else if let Ok(v) = r {
                            if let Some(want) = &self.bufs[j].val {
                                assert_eq!(&v, want, "a blocking copy read unexpected contents");
                            }
                            self.used(j, s.model_handle().0);
                        } else {
                            self.used_if_recorded(j, s.model_handle().0, before);
                        }
                    }
                }
            }
            &Op::DropBuffer(j) => {
                if let Some(j) = pick(&self.bufs, j) {
                    self.drop_buffer(j);
                }
            }
            &Op::DropBufferElsewhere(j) => {
                if let Some(j) = pick(&self.bufs, j) {
                    let b = self.bufs.swap_remove(j).b;
                    self.elsewhere("a buffer's drop", move || drop(b));
                }
            }
            &Op::WaitFor { a, b } => {
                // (`b` is picked after `a` took its stream: with a cap, that may have used the
                // last room of the key.)
                let ha = self.holder(a);
                let sa = ha.as_ref().and_then(Holder::stream);
                let hb = sa.as_ref().and_then(|_| self.holder(b));
                if let (Some(sa), Some(hb)) = (sa, hb) {
                    if let Some(sb) = hb.stream() {
                        let r = sa.wait_for(&sb);
                        if self.capturing(&sa) || self.capturing(&sb) {
                            refused_in_capture(&r, "a wait");
                        }
                    }
                }
            }
            &Op::HostFn { holder, take } => {
                if let Some(h) = self.holder(holder) {
                    if let Some(s) = h.stream() {
                        let taken = take
                            .and_then(|j| pick(&self.bufs, j))
                            .map(|j| self.bufs.swap_remove(j).b);
                        let r = s.launch_host_func(move || drop(taken));
                        if self.capturing(&s) {
                            refused_in_capture(&r, "a host function");
                        }
                    }
                }
            }
            &Op::NewOwned { p } => {
                if self.owned.len() < 8 {
                    if let Ok(s) = OwnedStream::new(self.ctx(), Priority::Value(p)) {
                        self.owned.push(Rc::new(s));
                    }
                }
            }
            &Op::DropOwned(k) => {
                if let Some(k) = pick(&self.owned, k) {
                    drop(self.owned.swap_remove(k));
                }
            }
            &Op::BeginCapture(i) => {
                if let Some(i) = self.pick_owner(i) {
                    let (id, o) = self.owners[i].clone();
                    if let Ok(s) = o.stream() {
                        let capturing = self.capturing(&s);
                        drop(s);
                        if !capturing {
                            if let Some(c) = Capture::begin(id, o) {
                                self.guards.push(c);
                            }
                        }
                    }
                }
            }
            &Op::NestedBegin(k) => {
                if let Some(k) = pick(&self.guards, k) {
                    let g = self.guards[k].guard();
                    let before = g.info().ok();
                    let r = g.stream().begin_capture();
                    assert!(r.is_err(), "a nested begin succeeded");
                    drop(r);
                    if let Some(before) = before {
                        // (Injected faults may hit this query itself, several in a row: they
                        // are one-shot, and at most a few are pending; the fuzzer found two in
                        // a row, input `regression-stacked-faults-nested-begin-1369a3de`.)
                        let after = self.info_past_faults(g);
                        assert_eq!(after, Some(before), "a failed begin changed the capture");
                    }
                }
            }
            &Op::EndCapture { guard, keep } => {
                let f0 = self.sim.injected_failures().len();
                if let Some(k) = pick(&self.guards, guard) {
                    let c = self.guards.swap_remove(k);
                    let (raw, id) = (c.raw, c.owner_id);
                    let kernels = c.kernels.clone();
                    let (graph, o) = c.end();
                    if let Ok(graph) = graph {
                        if keep && self.execs.len() < 8 {
                            if let Ok(exec) = graph.instantiate() {
                                self.execs.push(Arc::new(exec));
                                self.exec_kernels.push(kernels);
                            }
                        }
                    }
                    self.check_capture_ended(id, &o, raw, f0, "end left the stream capturing");
                }
            }
            &Op::DropGuard(k) => {
                let f0 = self.sim.injected_failures().len();
                if let Some(k) = pick(&self.guards, k) {
                    let c = self.guards.swap_remove(k);
                    let (raw, id) = (c.raw, c.owner_id);
                    let o = c.discard();
                    self.check_capture_ended(
                        id,
                        &o,
                        raw,
                        f0,
                        "a dropped guard left the stream capturing",
                    );
                }
            }
            &Op::LeakCapture(i) => {
                if let Some(i) = self.pick_owner(i) {
                    let (id, o) = self.owners.swap_remove(i);
                    match Rc::try_unwrap(o) {
                        Ok(o) => {
                            if let Ok(s) = o.stream() {
                                let raw = s.model_handle().0;
                                if let Ok(g) = s.begin_capture() {
                                    std::mem::forget(g);
                                    self.leaked.push(raw);
                                }
                            }
                            drop(o);
                        }
                        Err(o) => self.owners.push((id, o)),
                    }
                }
            }
            &Op::LaunchExec { exec, holder } => {
                if let (Some(e), Some(h)) = (pick(&self.execs, exec), self.holder(holder)) {
                    if let Some(s) = h.stream() {
                        let r = self.execs[e].launch(&s);
                        if self.capturing(&s) {
                            refused_in_capture(&r, "a graph launch");
                        }
                        drop(s);
                        // Its kernels ran (or, after an error, may have).
                        for &ptr in &self.exec_kernels[e] {
                            for b in self.bufs.iter_mut().filter(|b| b.b.as_raw().0 == ptr) {
                                match (&r, b.val.as_mut()) {
                                    (Ok(()), Some(v)) => {
                                        v.iter_mut().for_each(|x| *x = x.wrapping_add(1))
                                    }
                                    _ => b.val = None,
                                }
                            }
                        }
                        // A launch is a use of every buffer the graph captured.
                        self.resync_last();
                    }
                }
            }
            &Op::DropExec(e) => {
                if let Some(e) = pick(&self.execs, e) {
                    drop(self.execs.swap_remove(e));
                    self.exec_kernels.swap_remove(e);
                }
            }
            &Op::Fault { nth, code } => self.sim.fail_nth_call(nth, ErrorCode(code)),
            Op::Trim => {
                let _ = self.ctx().trim();
            }
            Op::Par { workers, schedule } => {
                if self.par_fits(workers) {
                    self.par(workers, schedule)
                }
            }
            &Op::Complete { holder, ns, marker } => self.complete(holder, ns, marker),
            &Op::CopyAsync {
                buffer,
                holder,
                ns,
                marker,
            } => self.copy_async(buffer, holder, ns, marker),
            &Op::Ready { p, poll } => self.ready(p, poll),
            &Op::Attach { owner, wait } => self.attach(owner, wait),
            &Op::Poll { fut, fresh } => self.poll(fut, fresh),
            &Op::DropFut(i) => {
                if let Some(i) = pick(&self.futs, i) {
                    drop(self.futs.remove(i));
                }
            }
            &Op::Reserve { p, n } => self.reserve(p, n),
            &Op::BlockedAcquire(i) => self.blocked_acquire(i),
            &Op::ForeignCapture { mode } => self.foreign_capture(mode),
            &Op::EndForeign(k) => self.end_foreign(k),
            &Op::LeakUse {
                buffer,
                holder,
                write,
                ns,
                drop_now,
            } => self.leak_use(buffer, holder, write, ns, drop_now),
            &Op::ManyOwners { p, extra } => self.many_owners(p, extra),
            &Op::ReentrantPoll { fut, action, at } => self.reentrant_poll(fut, action, at),
            &Op::ReentrantReady { owner, at } => {
                let p = pick(&self.owners, owner).map_or(0, |i| self.owners[i].1.priority());
                let n = self.futs.len();
                self.ready(p, false);
                if self.futs.len() > n {
                    self.reentrant_poll(n, futs::Reenter::Acquire, at);
                }
            }
            &Op::FifoRace { owner, ns } => {
                if let Some(i) = pick(&self.owners, owner) {
                    let p = self.owners[i].1.priority();
                    // Each part a step of its own, checked as such.
                    for op in [
                        Op::Work { owner: i, ns },
                        Op::DropOwner(i),
                        Op::Ready { p, poll: true },
                        Op::Ready { p, poll: true },
                        Op::Advance(ns),
                        Op::Ready { p, poll: true },
                    ] {
                        self.step(&op);
                    }
                }
            }
            Op::Kill => {
                // The input ends here (see `run_ops`): nothing is checked against a live
                // context any more.
                self.sim.kill_context(self.ctx().raw(), KILL_CODE);
                self.dead = true;
                return;
            }
            &Op::Lend { owner } => acquired = self.lend(owner),
            &Op::LoanWork { loan, ns } => self.loan_work(loan, ns),
            &Op::EndLoan(k) => self.end_loan(k),
        }
        // What the step started outside the model's control (host functions, their drops)
        // finishes before the checks, whose statistics readings call the driver and can meet
        // injected faults (review 10, finding 3).
        self.settle();
        // The pairs held after the step, read once for the three (nothing between them changes
        // an owner's streams: the statistics readings of the checks only trim retired ones).
        let pairs = self.held_pairs();
        self.sync_holdings_with(&pairs);
        self.check_with(acquired, &pairs);
        self.loans_seen_back(&pairs);
        // (After the checks: their statistics readings call the driver too.)
        self.check_thread_states();
    }

    /// Runs the workers at the same time, one driver call at a time, as `schedule` says.
    fn par(&mut self, workers: &[Vec<WOp>], schedule: &[u8]) {
        let bufs: Vec<Arc<DeviceBuffer<u32>>> = self.bufs.iter().map(|b| b.b.clone()).collect();
        let shared = Arc::new(Shared {
            ctx: self.ctx().clone(),
            sim: self.sim.clone(),
            kernels: self.kernels.clone(),
            // A graph may use a buffer whose use lock a leaked guard holds: a launch on another
            // thread would wait for ever (documented), so the workers get no graphs then.
            execs: if !self.use_leaked {
                self.execs.clone()
            } else {
                Vec::new()
            },
        });
        // Buffers that a worker drops are handed over: the model forgets them, so that their
        // last reference goes on a worker thread (possibly while another worker uses them).
        let n = self.bufs.len();
        if n > 0 {
            let mut gone: Vec<usize> = workers
                .iter()
                .flatten()
                .filter_map(|w| match w {
                    WOp::DropBuffer { buffer } => Some(buffer % n),
                    _ => None,
                })
                .collect();
            gone.sort_unstable();
            gone.dedup();
            for j in gone.into_iter().rev() {
                self.bufs.remove(j);
            }
        }
        // Kernels and graph launches of the workers run in the schedule's order: the model
        // forgets the contents of every buffer.
        if workers
            .iter()
            .flatten()
            .any(|w| matches!(w, WOp::Kernel { .. } | WOp::LaunchExec { .. }))
        {
            self.bufs.iter_mut().for_each(|b| b.val = None);
        }
        self.drv.hook.begin(workers.len());
        // The workers hold the only references to the buffers handed over: this thread must
        // not drop one while they run (a last reference dropped here would lock a stream that
        // a worker stopped at the scheduler holds, outside the schedule).
        let mut per_worker: Vec<_> = (1..workers.len()).map(|_| bufs.clone()).collect();
        per_worker.push(bufs);
        let handles: Vec<_> = workers
            .iter()
            .zip(per_worker)
            .enumerate()
            .map(|(i, (w, bufs))| {
                let (shared, w, drv) = (shared.clone(), w.clone(), self.drv.clone());
                let (sim, other) = (self.sim.clone(), self.other);
                threads::spawn(move || {
                    sim.forget_thread_state();
                    sim.set_thread_context(other);
                    let registered = sched::register(&drv, i);
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        worker(&shared, bufs, &w)
                    }));
                    // Everything the worker holds goes under the schedule too.
                    drop(shared);
                    drop(registered);
                    let (ctx, mode) = sim.thread_state();
                    sim.forget_thread_state();
                    r.map(|out| (out, (ctx, mode, "a worker's steps")))
                })
            })
            .collect();
        if let Err(e) = self.drv.hook.run(schedule) {
            // The workers are left where they are (joining them would hang the test).
            panic!("{e}; steps: {workers:?}");
        }
        drop(shared);
        for h in handles {
            match h.join().expect("a worker thread failed") {
                Ok((out, state)) => {
                    self.thread_states.push(state);
                    for raw in out.held {
                        self.check_not_lent(raw);
                        *self.gens.entry(raw).or_insert(0) += 1;
                    }
                    for b in out.new_bufs {
                        if self.bufs.len() < 64 {
                            let raw = b.last_use().unwrap().0 .0;
                            let last = (raw, self.gen_of(raw));
                            let val = Some(vec![0; b.len()]);
                            self.bufs.push(Buf { b, last, val });
                        }
                    }
                    for e in out.new_execs {
                        if self.execs.len() < 8 {
                            // Worker captures hold accesses only, no kernels.
                            self.execs.push(e);
                            self.exec_kernels.push(Vec::new());
                        }
                    }
                }
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        // The workers' order is the schedule's.
        self.resync_last();
    }

    /// Takes the buffers' last uses as the crate recorded them (after steps whose order of uses
    /// the model does not follow itself: graph launches, concurrent steps).
    fn resync_last(&mut self) {
        self.sync_holdings();
        for j in 0..self.bufs.len() {
            let raw = self.bufs[j].b.last_use().unwrap().0 .0;
            self.used(j, raw);
        }
    }

    /// A stream just handed to an owner has no pending work but frees of the crate's memory
    /// (which the crate may leave pending: `Slot::enqueue_free`).
    fn check_fresh(&self, s: &StreamRef) {
        assert!(
            !self.sim.is_busy_but_frees(s.model_handle()),
            "a busy stream was handed out"
        );
    }

    /// The invariants that hold after every step.
    pub fn check(&self, after_search: bool) {
        self.check_with(after_search, &self.held_pairs());
    }

    /// [`Model::check`] with the pairs held now (`held_pairs`).
    fn check_with(&self, after_search: bool, pairs: &[(u64, u64)]) {
        // A re-entrant waker's action that panicked (the crate catches a waker's panic, so the
        // model records it): e.g. a lock of the crate taken again under itself.
        let panics =
            std::mem::take(&mut *self.waker_panics.lock().unwrap_or_else(|p| p.into_inner()));
        assert!(
            panics.is_empty(),
            "a re-entrant waker's action panicked: {panics:?}"
        );
        // No two live owners share a stream (attached owners included). (A sorted vector, not
        // a hash set: this runs after every step.)
        let mut seen: Vec<u64> = pairs.iter().map(|p| p.1).collect();
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            let s = cuda_stream_pool::driver::Stream(w[0]);
            panic!("two owners share stream {s:?}");
        }
        for &(id, raw) in pairs {
            assert!(
                !self.stuck.iter().any(|&(o, r)| r == raw && o != id),
                "a stream whose capture could not be ended was handed to another owner"
            );
        }
        for raw in &self.leaked {
            let s = cuda_stream_pool::driver::Stream(*raw);
            assert!(
                seen.binary_search(raw).is_err(),
                "a stream captured by a leaked guard was handed out"
            );
            // SAFETY: a stream captured by a leaked guard is never destroyed (the context is
            // leaked with the guard).
            let status = unsafe { self.drv.stream_is_capturing(s) };
            assert!(
                matches!(status, Ok(CaptureStatus::Active) | Err(_)),
                "the crate invalidated a capture of a leaked guard: {status:?}"
            );
        }
        let st = self.ctx().stats();
        assert_eq!(
            st.live,
            st.in_use + st.idle + st.retired_busy + st.handed,
            "{st:?}"
        );
        // (`in_use` counts lent streams whose owner is gone too.)
        assert_eq!(
            st.in_use as usize,
            seen.len() + st.lent as usize,
            "owners' streams vs in_use: {st:?}"
        );
        self.check_loans(&st, pairs);
        if after_search {
            // (Per key: the bound is the key's; `Op::ManyOwners` retires more than it of one.)
            for p in -5..=0 {
                let k = self.ctx().stats_for(Priority::Value(p)).expect("in range");
                assert!(
                    k.idle <= MAX_IDLE as u64,
                    "key {p}: more than {MAX_IDLE} idle after a search: {k:?}"
                );
            }
        }
        // live streams = owners' + idle + retired-busy + owned + kept (a dropped owned stream
        // whose destroy failed counts among the pending) + disposal + the poller's doorbell
        // stream once made (`Context::live_streams` counts both beside the pools')
        let live = self.sim.counters().live_streams;
        let own = self.ctx().live_streams() - st.live;
        assert!((1..=2).contains(&own), "the context's own streams: {own}");
        let expected = st.live + self.owned.len() as u64 + own + self.foreign_streams() as u64;
        assert!(
            live >= expected && live <= expected + self.ctx().pending() as u64,
            "{live} streams live, expected {expected} (+ up to {} kept): {st:?}",
            self.ctx().pending()
        );
        if let Some(cap) = self.cap {
            // At most `cap` live streams per key, but those created for owners that held a
            // stream of another key already (counted in `over_cap`, and by the model).
            let mut over = 0;
            for p in -5..=0 {
                let k = self.ctx().stats_for(Priority::Value(p)).expect("in range");
                let limit = cap as u64 + k.over_cap;
                assert!(
                    k.peak_live <= limit,
                    "key {p}: peak above the cap {cap}: {k:?}"
                );
                assert!(k.live <= limit, "key {p}: live above the cap {cap}: {k:?}");
                over += k.over_cap;
            }
            assert!(
                over <= self.bypass,
                "{over} streams over the cap, but only {} acquisitions by owners holding a stream",
                self.bypass
            );
        }
        self.check_futs();
        self.check_foreign();
        let misuse = self.sim.misuse();
        assert!(misuse.is_empty(), "misuse: {misuse:?}");
    }

    /// An owner index that may take its stream now (see [`Model::may_acquire`]).
    fn pick_owner(&self, i: usize) -> Option<usize> {
        let i = pick(&self.owners, i)?;
        let o = &self.owners[i].1;
        self.may_acquire(o, o.priority()).then_some(i)
    }

    /// With a cap, whether the workers' acquisitions (one stream at normal priority per owner
    /// they take) fit below it: a worker waiting at the cap would wait for the model's thread,
    /// which runs the scheduler.
    fn par_fits(&self, workers: &[Vec<WOp>]) -> bool {
        let Some(cap) = self.cap else { return true };
        let need: usize = workers
            .iter()
            .map(|w| 1 + w.iter().filter(|s| matches!(s, WOp::NewOwner)).count())
            .sum();
        self.room(0, cap) >= need
    }

    /// Drops everything; every stream must be destroyed and every byte freed exactly once.
    /// The crate's buffers come from its own memory pool (`MemPoolChoice::Own`, the model's
    /// context): none from the device's default pool, which other libraries use. Checked at
    /// teardown only, with the model's buffers still alive, after the faults were cleared and
    /// every capture ended (the pool attribute is a call of the invalidation table, and every
    /// driver call moves the injected faults).
    fn check_default_pool_unused(&self) {
        let dev = self.sim.device_get(0).expect("device 0");
        let pool = self.sim.device_default_mem_pool(dev).expect("default pool");
        // SAFETY: the device's default pool lives as long as the simulation.
        let used = unsafe {
            self.sim
                .mem_pool_get_attribute(pool, MemPoolAttr::UsedMemCurrent)
        };
        assert!(
            matches!(used, Ok(0)),
            "allocated from the device's default memory pool, not the context's own: {used:?} \
             bytes in use there"
        );
    }

    pub fn teardown(mut self) {
        self.sim.clear_faults();
        if self.dead {
            return self.teardown_dead();
        }
        // Foreign captures end first: they must have survived every operation.
        while !self.foreign.is_empty() {
            self.end_foreign(0);
        }
        // Pending futures first: dropping them frees nothing early (checked by the simulation:
        // a write into freed host memory is misuse).
        self.futs.clear();
        self.guards.clear();
        self.execs.clear();
        if self.leaked.is_empty() {
            self.check_default_pool_unused();
        }
        self.bufs.clear();
        self.leaked_uses.clear();
        self.owners.clear();
        self.owned.clear();
        self.kernels = None;
        let leaks = !self.leaked.is_empty() || !self.stuck.is_empty();
        let poller = self.ctx.as_ref().map(|c| c.model_poller_stopper());
        self.ctx = None;
        self.end_loans_after_the_context();
        assert_thread_state(&self.sim, self.other, "the teardown");
        // SAFETY: the model's retain of device 1's primary context, released once.
        unsafe {
            self.sim
                .primary_ctx_release(self.sim.device_get(1).expect("device 1"))
        }
        .expect("release device 1's primary context");
        if leaks {
            // A leaked capture guard holds a reference to the context: the whole state leaks
            // (never torn down, so never freed or destroyed under the capture). Only misuse is
            // checked, after the GPU's clock has run on (see `run_leaked_work`).
            self.run_leaked_work();
            let misuse = self.sim.misuse();
            assert!(misuse.is_empty(), "misuse: {misuse:?}");
            // The leaked state keeps the simulation: end its thread (see `teardown_dead`), and
            // its completion poller (see `model_poller_stopper`).
            self.sim.end_host_thread();
            if let Some(p) = poller {
                p.stop();
            }
            // Nothing reads the leaked simulation's call log again (up to 64 Ki calls).
            self.sim.set_logging(false);
            // What the ended thread's last host functions dropped may be torn down on a thread
            // of its own, and shelve its blocks: before the release, not after it.
            self.settle();
            self.release_shelves(false);
            return;
        }
        // Objects dropped inside host functions, and a last context dropped while the poller
        // runs a waker, are torn down on threads of their own: wait until they are (a hang
        // guard only: what is still alive after 60 s is a leak).
        // The GPU's clock runs on: work still pending (host functions holding buffers or
        // owners, which keep the context alive) completes, as it would on a real GPU.
        // (`CSP_MODEL_TEARDOWN_SECS` shortens the wait, for shrinking a leak by hand.)
        let secs = std::env::var("CSP_MODEL_TEARDOWN_SECS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60);
        let until = std::time::Instant::now() + std::time::Duration::from_secs(secs);
        while std::time::Instant::now() < until {
            self.sim.advance(1_000_000_000);
            // What the teardowns kept for the context's next state is released first (see
            // `release_pinned_cache`); only what is left after it is a leak.
            cuda_stream_pool::release_pinned_cache(&*self.drv).unwrap();
            let c = self.sim.counters();
            if c.live_streams == 0
                && c.live_allocs == 0
                && c.live_events == 0
                && c.live_host_allocs == 0
                && c.live_contexts == 0
            {
                break;
            }
            std::thread::yield_now();
        }
        let c = self.sim.counters();
        assert_eq!(c.live_streams, 0, "streams leaked: {c:?}");
        assert_eq!(c.live_allocs, 0, "memory leaked: {c:?}");
        assert_eq!(c.live_events, 0, "events leaked: {c:?}");
        assert_eq!(c.live_modules, 0, "modules leaked: {c:?}");
        assert_eq!(c.live_host_allocs, 0, "host memory leaked: {c:?}");
        let misuse = self.sim.misuse();
        assert!(misuse.is_empty(), "misuse: {misuse:?}");
    }
}

impl Model {
    /// Runs the GPU's clock on for a state that is leaked (a leaked capture, a dead context), as
    /// the real GPU would: the work not held by a capture runs, what it does wrong is misuse,
    /// and the completions it marks land, so the leaked state's completion poller stops
    /// reading them (it napped up to a millisecond at a time for the rest of the process:
    /// 1,434 pollers after 18 minutes of a campaign, which took most of both cores).
    fn run_leaked_work(&self) {
        self.sim.advance(3_600_000_000_000);
    }

    /// The teardown after [`Op::Kill`] (see there).
    fn teardown_dead(mut self) {
        // The owners go first (captures keep theirs): an owner waiting at the cap waits for one
        // of them, dead context or not.
        self.guards.clear();
        self.execs.clear();
        self.owners.clear();
        self.owned.clear();
        let leaks = !self.leaked.is_empty() || !self.stuck.is_empty();
        self.resolve_dead(KILL_CODE, leaks);
        // A foreign capture dies with the context: its end fails (not checked).
        for f in std::mem::take(&mut self.foreign) {
            let _ = f.end_ignoring_the_result();
        }
        self.bufs.clear();
        self.leaked_uses.clear();
        self.kernels = None;
        // (Taken whether or not the state leaks: it keeps nothing alive, and stopping the
        // poller of a state that the teardown has joined does nothing.)
        let poller = self.ctx.as_ref().map(|c| c.model_poller_stopper());
        self.ctx = None;
        // A loan keeps its stream past the `Context`; the borrower's work on it fails now.
        for l in std::mem::take(&mut self.loans) {
            let _ = self.sim.enqueue_work(l.h.0, 1_000);
            drop(l);
        }
        assert_thread_state(&self.sim, self.other, "the teardown of a dead context");
        // SAFETY: the model's retain of device 1's primary context, released once.
        unsafe {
            self.sim
                .primary_ctx_release(self.sim.device_get(1).expect("device 1"))
        }
        .expect("release device 1's primary context");
        self.run_leaked_work();
        let misuse = self.sim.misuse();
        assert!(misuse.is_empty(), "misuse: {misuse:?}");
        // The dead context's state, and with it the simulation, is leaked by design: its
        // host-function thread would live on for the rest of the process (thousands of them in
        // a campaign, which slowed every later input), and so would its completion poller.
        self.sim.end_host_thread();
        if let Some(p) = poller {
            p.stop();
        }
        self.sim.set_logging(false);
        self.settle();
        self.release_shelves(true);
    }

    /// Frees what the simulation's torn-down states left on the pinned cache's shelves, at the
    /// end of an input whose state leaks (a leaked capture guard, a `dead` context), and checks
    /// that nothing of the simulation is left there: the state that leaks keeps its own pinned
    /// memory, never shelved; what other states of the input shelved is nobody's. (The model
    /// released them only after a teardown without leaks: the shelves of the others stayed in
    /// the process with their simulations, 864 shelves after three minutes of a campaign, and
    /// every `take`, `give` and release scanned them.) A dead context's blocks cannot be freed
    /// (every call in it fails with its error): the release gives them up and returns the error
    /// (its first run, 2026-12-07, found that they stayed shelved for good: pinned by
    /// `tests/pinned_cache_dead_context.rs`).
    fn release_shelves(&self, dead: bool) {
        let r = cuda_stream_pool::release_pinned_cache(&*self.drv);
        let left = cuda_stream_pool::__model_hooks::model_shelved(&*self.drv);
        match &r {
            Err(e) if dead => assert_eq!(e.code(), Some(KILL_CODE), "{e}"),
            r => assert!(r.is_ok(), "the pinned cache's release: {r:?}"),
        }
        assert_eq!(
            left,
            (0, 0),
            "the pinned cache's (shelves, blocks) left of the simulation (dead: {dead}): {r:?}"
        );
        // What the release freed was in use by nobody (review 23: the misuse checks before it
        // could not see it).
        let misuse = self.sim.misuse();
        assert!(misuse.is_empty(), "misuse after the release: {misuse:?}");
    }
}

/// GPU work that reads or writes the whole buffer, on `s`, under a use of it. Returns whether
/// the use was made.
fn access(sim: &SimDriver, b: &DeviceBuffer<u32>, s: &StreamRef, write: bool, ns: u64) -> bool {
    match b.use_on(s) {
        Ok(u) => {
            let _ = sim.enqueue_access(s.raw(), u.ptr(), u.bytes(), write, ns);
            true
        }
        Err(_) => false,
    }
}

/// What the workers of a concurrent step share (references to the model's objects).
struct Shared {
    ctx: Context,
    sim: Arc<SimDriver>,
    kernels: Option<Arc<Kernels>>,
    execs: Vec<Arc<GraphExec>>,
}

/// What a worker hands back.
#[derive(Default)]
struct WorkerOut {
    /// Raw streams its owners held (hand-overs the model did not see).
    held: Vec<u64>,
    new_bufs: Vec<Arc<DeviceBuffer<u32>>>,
    new_execs: Vec<Arc<GraphExec>>,
}

/// One worker of a concurrent step: its own owner, the shared buffers and graphs.
fn worker(shared: &Shared, bufs: Vec<Arc<DeviceBuffer<u32>>>, steps: &[WOp]) -> WorkerOut {
    let mut out = WorkerOut::default();
    let mut bufs: Vec<Option<Arc<DeviceBuffer<u32>>>> = bufs.into_iter().map(Some).collect();
    let mut owner = shared.ctx.owner();
    let note = |o: &Owner, out: &mut WorkerOut| {
        for (_, s) in o.streams() {
            if !out.held.contains(&s.model_handle().0) {
                out.held.push(s.model_handle().0);
            }
        }
    };
    for step in steps {
        let buf = |i: usize| pick(&bufs, i).and_then(|i| bufs[i].clone());
        match *step {
            WOp::Access { buffer, write, ns } => {
                if let (Some(b), Ok(s)) = (buf(buffer), owner.stream()) {
                    access(&shared.sim, &b, &s, write, ns);
                }
            }
            WOp::Kernel { buffer } => {
                if let (Some(b), Ok(s), Some(k)) = (buf(buffer), owner.stream(), &shared.kernels) {
                    let _ = k.add_u32(&s, &b, 1);
                }
            }
            WOp::ReadBack { buffer } => {
                if let (Some(b), Ok(s)) = (buf(buffer), owner.stream()) {
                    let _ = b.to_vec(&s);
                }
            }
            WOp::LaunchExec { exec } => {
                if let (Some(e), Ok(s)) = (pick(&shared.execs, exec), owner.stream()) {
                    let _ = shared.execs[e].launch(&s);
                }
            }
            WOp::DropBuffer { buffer } => {
                if let Some(i) = pick(&bufs, buffer) {
                    bufs[i] = None;
                }
            }
            WOp::Alloc { len } => {
                if let Ok(s) = owner.stream() {
                    if let Ok(b) = DeviceBuffer::<u32>::zeroed(&s, len) {
                        out.new_bufs.push(Arc::new(b));
                    }
                }
            }
            WOp::NewOwner => {
                note(&owner, &mut out);
                owner = shared.ctx.owner();
            }
            WOp::Capture { buffer } => {
                if let (Some(b), Ok(s)) = (buf(buffer), owner.stream()) {
                    if let Ok(g) = s.begin_capture() {
                        access(&shared.sim, &b, &s, true, 100);
                        if let Ok(exec) = g.end().and_then(Graph::instantiate) {
                            out.new_execs.push(Arc::new(exec));
                        }
                    }
                }
            }
        }
    }
    note(&owner, &mut out);
    out
}

impl Default for Model {
    fn default() -> Self {
        Model::new()
    }
}

/// Runs a whole input: decode, apply, teardown (without leaked captures: the fuzzer's view).
pub fn run(bytes: &[u8]) {
    let (cap, ops) = decode(bytes, 400, false);
    run_ops(cap, &ops);
}

/// Runs a whole input with every operation, leaked captures included (the property test's view).
pub fn run_with_leaks(bytes: &[u8]) {
    let (cap, ops) = decode(bytes, 400, true);
    run_ops(cap, &ops);
}

pub fn run_ops(cap: Option<usize>, ops: &[Op]) {
    // `CSP_MODEL_TRACE=1` prints the decoded operations (to read a failing input).
    let trace = std::env::var_os("CSP_MODEL_TRACE").is_some();
    if trace {
        eprintln!("cap {cap:?}");
    }
    let mut m = Model::with_cap(cap);
    for (k, op) in ops.iter().enumerate() {
        if trace {
            eprintln!("step {k}: {op:?}");
        }
        m.step(op);
        if m.dead {
            break;
        }
    }
    m.teardown();
}
