//! The stream pool of one context and one (priority, flags) key. The lowest layer above the
//! driver: it knows streams, generations and the driver, nothing of owners, memory or capture.
//!
//! Retired streams wait in small per-shard lists (`SmallVec`s behind `CachePadded` mutexes). A
//! thread releases into and acquires from its home shard, so threads that recycle their own
//! streams never touch the same cache line; when the home shard has nothing usable, the other
//! shards are searched (work stealing), so an idle stream is found wherever it sits. Nothing on
//! this path depends on the number of live owners: owners hold their streams outside the pool.
//!
//! A retired stream is handed to a new owner only when `cuStreamQuery` says its work has completed;
//! a busy one is skipped, never waited for, and one that a capture guard of the crate still
//! captures (a guard leaked with `mem::forget`) is never queried nor handed out. Every query runs
//! in relaxed capture mode, so that it can never invalidate a capture of any thread.

use crate::driver::{Driver, Stream};
use crate::error::Result;
use crate::hostfn::TaskWaker;
// Every lock, atomic and thread handle of the pool comes from the shim, so that a loom build
// (`cfg(loom)`) checks them all.
use crate::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use crate::sync::{thread, Mutex, MutexGuard};
use crossbeam_utils::CachePadded;
use smallvec::SmallVec;
use std::any::Any;
use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

/// Idle streams kept per (priority, flags) key (or the key's reserve, when larger: see
/// [`crate::Context::reserve`]).
///
/// Exactly what holds: each acquisition, release and statistics reading of a key
/// ([`crate::Context::stats`]), outside host functions, destroys idle retired streams of the key
/// until at most this many retired streams remain or none of the rest is idle. A stream still
/// busy at that moment is kept (retired, counted in [`PoolStats::retired_busy`]) and destroyed by
/// the next of these operations that finds it idle. So every statistics reading reports at most
/// this many idle streams per key (unless streams complete while it reads them), and after
/// the key's next acquisition or release at most this many retired streams are alive; in
/// between, the driver's count of live streams can exceed it by the streams that were busy at the
/// key's last operation (their work completed since, with no call of the crate to notice).
pub const MAX_IDLE: usize = 32;

/// A resource that a capture on this stream uses and that the resulting graph must keep alive
/// (the memory layer's buffers); opaque at this layer.
pub(crate) type CapturedUse = Arc<dyn Any + Send + Sync>;

/// A handle of a stream lent to another crate (cudarc's `Arc<CudaStream>`), opaque at this layer.
/// While anyone but the slot holds a clone of it, the stream is neither handed to another owner
/// nor destroyed (see [`Slot::loan_returned`]).
pub(crate) type Loan = Arc<dyn Any + Send + Sync>;

/// How often a waiter at a cap looks for loans that ended while their streams' owners were gone
/// (nothing tells the crate when another crate drops its last handle): only while such a loan of
/// the waiter's key is out.
const LOAN_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// How often the first waiter at a cap, once it waits for busy retired streams' GPU work (the
/// wake-up host functions it armed), asks whether the context died: a faulted context never runs
/// them (docs/gpu.md), and every waiter behind it would wait for ever. Only the first waiter
/// asks; one that finds the fault leaves the queue with the error and passes its turn on, and
/// the next one's attempt meets the error in its own driver calls.
const FAULT_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// A stream known to the crate: pooled, owned, or the disposal stream. Identified by this object,
/// never by its handle value (handles are reused after destroy).
///
/// Its handle is reached through methods that say what the caller does with it:
/// [`Slot::observe`] for calls that enqueue nothing (queries, synchronizations, capture
/// queries, destroy), [`Slot::enqueue`] for the crate's own enqueues, [`Slot::expose`] for a
/// handle that leaves the crate, and [`Slot::enqueue_free`] for the crate's frees of its own
/// memory. That lets the slot know when nothing was enqueued since it was last seen idle
/// ([`Slot::known_idle`]), or nothing but frees ([`Slot::settled`]): then a hand-over needs no
/// driver query.
#[derive(Debug)]
pub(crate) struct Slot {
    raw: Stream,
    pub(crate) priority: i32,
    pub(crate) flags: u32,
    state: Mutex<SlotState>,
    /// A copy of (generation, capturing, held, destroyed), written under the lock, read without
    /// it by [`Slot::is_current`] and [`Slot::is_capturing`].
    word: AtomicU64,
    /// The handle lent to another crate, if any (see [`Loan`]).
    loan: Mutex<Option<Loan>>,
    /// Whether `loan` is set, readable without its lock.
    lent: AtomicBool,
    /// Set while a loan's handle is being made (`Slot::lend`).
    lending: AtomicBool,
    /// The wake-up host function of the pool's gate on the (retired) stream: [`UNARMED`],
    /// [`ARMED`] (enqueued: one per stream, however many acquisitions wait) or [`RAN`].
    armed: AtomicU8,
    /// Enqueues through [`Slot::enqueue`] and [`Slot::enqueue_free`], and handles given out
    /// by [`Slot::expose`], so far (each raises it before the handle is used).
    enqueued: AtomicU64,
    /// The same, but frees: the work that a hand-over must see completed.
    work: AtomicU64,
    /// `n + 1` when everything enqueued up to the `n`th enqueue is known to have completed (0:
    /// nothing known): the stream is idle while `enqueued` is still `n`.
    quiet: AtomicU64,
    /// `w + 1` when everything counted in `work` up to its `w`th is known to have completed:
    /// the stream may be handed on (with frees still pending) while `work` is still `w`.
    quiet_but_frees: AtomicU64,
    /// The latest generation whose handle left the crate ([`Slot::expose`]): work may be
    /// enqueued through it unseen, so no completion seen in that generation makes the stream
    /// known idle (only a query does).
    exposed: AtomicU64,
}

/// How many enqueues of a stream were counted at some point: all of them, and those that are
/// work (not frees). See [`Slot::completed_through`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Mark {
    all: u64,
    work: u64,
}

/// No wake-up host function is pending on the stream.
const UNARMED: u8 = 0;
/// A wake-up host function is enqueued on the stream.
const ARMED: u8 = 1;
/// The wake-up host function has run: the work enqueued before it has completed, and the
/// stream is idle as soon as the function returns.
const RAN: u8 = 2;

fn word(st: &SlotState) -> u64 {
    (st.generation << 3)
        | (u64::from(st.capturing) << 2)
        | (u64::from(st.held) << 1)
        | u64::from(st.destroyed)
}

/// The locked state of a slot. Changes to the generation, `held`, `capturing` and `destroyed`
/// go through its methods, which keep the slot's lock-free copy in step.
pub(crate) struct SlotGuard<'a> {
    slot: &'a Slot,
    st: MutexGuard<'a, SlotState>,
}

impl std::ops::Deref for SlotGuard<'_> {
    type Target = SlotState;
    fn deref(&self) -> &SlotState {
        &self.st
    }
}

impl SlotGuard<'_> {
    fn publish(&self) {
        self.slot.word.store(word(&self.st), Ordering::Release);
    }

    /// Hands the stream to a new owner: bumps the generation; returns it.
    fn hand_over(&mut self) -> u64 {
        self.st.generation += 1;
        self.st.held = true;
        self.publish();
        self.st.generation
    }

    /// The owner is gone (the generation stays: its work may still be pending).
    fn retire(&mut self) {
        self.st.held = false;
        self.publish();
    }

    /// The stream is destroyed (or about to be): bumps the generation. Only for a stream whose
    /// work has completed: a buffer whose last use was on it then frees without ordering.
    pub(crate) fn destroy(&mut self) {
        self.st.generation += 1;
        self.st.destroyed = true;
        self.publish();
    }

    /// A capture guard of the crate begins capturing the stream. Returns what a capture that
    /// could not be ended cleanly left registered: the caller drops it after releasing the lock
    /// (dropping a buffer frees it, which takes this lock).
    #[must_use]
    pub(crate) fn begin_capture(&mut self) -> Vec<CapturedUse> {
        self.st.capturing = true;
        self.publish();
        std::mem::take(&mut self.st.captured)
    }

    /// The capture ended: returns what it used, for the graph to keep.
    pub(crate) fn end_capture(&mut self) -> Vec<CapturedUse> {
        self.st.capturing = false;
        self.publish();
        std::mem::take(&mut self.st.captured)
    }

    /// Records that the capture in progress uses `r` (once per object). Only a capture of the
    /// crate's (a `CaptureGuard`) collects uses: its end hands them to the graph. Outside one,
    /// nothing would ever take them back (a slot keeping a buffer that keeps the slot, through
    /// its last use and its context, is a cycle that leaks the whole context), so nothing is
    /// kept; callers refuse buffer work on a stream captured by someone else before this.
    pub(crate) fn add_captured(&mut self, r: CapturedUse) {
        if self.st.capturing && !self.st.captured.iter().any(|x| Arc::ptr_eq(x, &r)) {
            self.st.captured.push(r);
        }
    }

    /// Whether generation `gen` of the stream is live: not recycled, not destroyed. Work of a
    /// live generation may still be pending; work of an earlier one has completed.
    pub(crate) fn is_live(&self, gen: u64) -> bool {
        self.st.generation == gen && !self.st.destroyed
    }
}

/// What the stream's lock guards. The generation is bumped on every hand-over and on destroy,
/// under this lock, so a free that checks the generation and enqueues while holding the lock
/// cannot race with a hand-over.
#[derive(Default)]
pub(crate) struct SlotState {
    pub(crate) generation: u64,
    pub(crate) destroyed: bool,
    /// Set while a capture guard of this crate captures the stream.
    pub(crate) capturing: bool,
    /// Whether an owner (or an `OwnedStream`) holds the stream.
    pub(crate) held: bool,
    /// What the capture in progress uses (see [`CapturedUse`]).
    captured: Vec<CapturedUse>,
}

impl std::fmt::Debug for SlotState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotState")
            .field("generation", &self.generation)
            .field("destroyed", &self.destroyed)
            .field("capturing", &self.capturing)
            .field("held", &self.held)
            .field("captured", &self.captured.len())
            .finish()
    }
}

impl Slot {
    /// A slot for a stream just created and held by its creator (generation 1).
    pub(crate) fn new(raw: Stream, priority: i32, flags: u32) -> Slot {
        let st = SlotState {
            generation: 1,
            held: true,
            ..SlotState::default()
        };
        Slot {
            raw,
            priority,
            flags,
            word: AtomicU64::new(word(&st)),
            state: Mutex::new(st),
            loan: Mutex::new(None),
            lent: AtomicBool::new(false),
            lending: AtomicBool::new(false),
            armed: AtomicU8::new(UNARMED),
            enqueued: AtomicU64::new(0),
            // Just created: idle.
            work: AtomicU64::new(0),
            quiet: AtomicU64::new(1),
            quiet_but_frees: AtomicU64::new(1),
            exposed: AtomicU64::new(0),
        }
    }

    /// The handle, for a driver call that enqueues nothing on the stream (a query, a
    /// synchronization, a capture query, the destroy).
    pub(crate) fn observe(&self) -> Stream {
        self.raw
    }

    /// The handle, for an enqueue by the crate (counted before it is made). A thread other
    /// than the holder's counts and makes its enqueue under the stream's lock (see
    /// [`Slot::enqueued_settled`]).
    pub(crate) fn enqueue(&self) -> Stream {
        self.enqueue_counted().0
    }

    /// [`Slot::enqueue`], with the counts that this enqueue completes (for
    /// [`Slot::completed_through`] once it is seen completed).
    pub(crate) fn enqueue_counted(&self) -> (Stream, Mark) {
        let work = self.work.fetch_add(1, Ordering::SeqCst) + 1;
        let all = self.enqueued.fetch_add(1, Ordering::SeqCst) + 1;
        (self.raw, Mark { all, work })
    }

    /// The handle, for the crate's free of memory of its own (`cuMemFreeAsync`) and nothing
    /// else (under the stream's lock, on a stream that can be handed over). Counted among all
    /// enqueues, not as work: a stream whose work was known complete stays so
    /// ([`Slot::settled`]). A pending free reads and writes no memory that anything uses, so
    /// the stream may be handed to a new owner before it runs (the new owner's work runs after
    /// it, in stream order), and a buffer last used in the old generation is still right to
    /// take that generation's work for completed. Only a destroy needs it to have run
    /// ([`Slot::known_idle`] counts it).
    pub(crate) fn enqueue_free(&self) -> Stream {
        self.enqueued.fetch_add(1, Ordering::SeqCst);
        self.raw
    }

    /// The handle, leaving the crate in generation `gen` (a `StreamRef::raw`, a loan): from
    /// now on only a query tells that generation's work completed.
    pub(crate) fn expose(&self, gen: u64) -> Stream {
        self.exposed.fetch_max(gen, Ordering::SeqCst);
        self.work.fetch_add(1, Ordering::SeqCst);
        self.enqueued.fetch_add(1, Ordering::SeqCst);
        self.raw
    }

    /// The enqueues and exposures counted so far (see [`Slot::enqueue`]), for a caller that
    /// holds the stream's lock.
    fn mark(&self) -> Mark {
        Mark {
            all: self.enqueued.load(Ordering::SeqCst),
            work: self.work.load(Ordering::SeqCst),
        }
    }

    /// [`Slot::mark`] under the stream's lock: other threads count and make their enqueues
    /// under it (frees, event records of a buffer's ordering), so every enqueue counted in the
    /// answer has reached the driver.
    pub(crate) fn mark_settled(&self) -> Mark {
        let _st = self.lock();
        self.mark()
    }

    /// Everything enqueued up to [`Slot::mark`]'s reading `m`, taken in generation `gen`, has
    /// completed (a synchronization that began after that reading returned, or a marker whose
    /// enqueue made `m` landed). Ignored if the handle left the crate in `gen`.
    pub(crate) fn completed_through(&self, gen: u64, m: Mark) {
        if self.exposed.load(Ordering::SeqCst) < gen {
            self.seen_complete(m);
        }
    }

    /// Everything counted in `m` has completed (a query, a synchronization).
    fn seen_complete(&self, m: Mark) {
        self.quiet.fetch_max(m.all + 1, Ordering::SeqCst);
        self.quiet_but_frees.fetch_max(m.work + 1, Ordering::SeqCst);
    }

    /// Whether the stream is known idle without asking the driver: nothing was enqueued or
    /// exposed since its work was last seen completed.
    fn known_idle(&self) -> bool {
        self.quiet.load(Ordering::SeqCst) == self.enqueued.load(Ordering::SeqCst) + 1
    }

    /// Whether the stream can be handed to a new owner without asking the driver: nothing but
    /// frees of the crate's memory ([`Slot::enqueue_free`]) was enqueued, and nothing exposed,
    /// since its work was last seen completed (frees enqueued before that seeing or after it
    /// alike).
    fn settled(&self) -> bool {
        self.quiet_but_frees.load(Ordering::SeqCst) == self.work.load(Ordering::SeqCst) + 1
    }

    /// The handle lent to another crate for this stream: the existing one, or `make()`'s,
    /// which is kept (the caller holds the stream, so only its thread lends it). `make` runs
    /// without the loan's lock; a `make` that lends the same stream again gets an error.
    pub(crate) fn lend(&self, make: impl FnOnce() -> Result<Loan>) -> Result<Loan> {
        {
            let l = self.loan.lock();
            if let Some(a) = l.as_ref() {
                return Ok(a.clone());
            }
            if self.lending.swap(true, Ordering::AcqRel) {
                return Err(crate::error::Error::invalid(
                    "the stream is being lent already (a wrap function lent it again)",
                ));
            }
        }
        struct Done<'a>(&'a AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _done = Done(&self.lending);
        let a = make()?;
        let mut l = self.loan.lock();
        *l = Some(a.clone());
        self.lent.store(true, Ordering::Release);
        Ok(a)
    }

    /// Whether the loan would be found returned by [`Slot::loan_returned`] (nobody but the slot
    /// holds its handle), without ending it. Never stale once true (see there).
    pub(crate) fn loan_ended(&self) -> bool {
        let l = self.loan.lock();
        l.as_ref()
            .is_none_or(|a| Arc::strong_count(a) == 1 && Arc::weak_count(a) == 0)
    }

    /// Whether a handle of this stream is (or may still be) held by another crate, which can
    /// enqueue work on it and begin or end captures of it behind the crate's back.
    pub(crate) fn is_lent(&self) -> bool {
        self.lent.load(Ordering::Acquire)
    }

    /// Whether nobody but this slot holds the lent handle any more (or none was lent). Then the
    /// slot drops its own clone (after its lock is released). `Arc::get_mut` succeeds only
    /// without other strong or weak references, and nobody can make one from nothing, so the
    /// answer cannot become stale. The stream stays marked lent ([`Slot::is_lent`]) until
    /// [`Slot::loan_settled`]: the borrower may have left it capturing, which only a query that
    /// succeeds can rule out.
    ///
    /// Returns the slot's last clone of the handle (`Some(None)` when there was none), for the
    /// caller to drop once the stream is back where it goes (the drop is user code, which may
    /// want that very stream); `None` while the loan is out.
    pub(crate) fn loan_returned(&self) -> Option<Option<Loan>> {
        let mut l = self.loan.lock();
        match l.as_mut().map(|a| Arc::get_mut(a).is_some()) {
            None => Some(None),
            Some(false) => None,
            Some(true) => Some(l.take()),
        }
    }

    /// The loan has ended and its stream was found not capturing: the crate's alone again.
    pub(crate) fn loan_settled(&self) {
        self.lent.store(false, Ordering::Release);
    }

    pub(crate) fn lock(&self) -> SlotGuard<'_> {
        SlotGuard {
            slot: self,
            st: self.state.lock(),
        }
    }

    /// Whether generation `gen` is still held (not retired, recycled or destroyed), without the
    /// lock: a diagnostic, never a safety check.
    pub(crate) fn is_current(&self, gen: u64) -> bool {
        self.word.load(Ordering::Acquire) & !0b100 == (gen << 3) | 0b10
    }

    /// Whether a capture guard of this crate captures the stream, without the lock. Exact for
    /// the thread that holds the stream (only it can begin or end a capture of it).
    pub(crate) fn is_capturing(&self) -> bool {
        self.word.load(Ordering::Acquire) & 0b100 != 0
    }
}

/// Counters of one pool or of a whole context ([`crate::Context::stats`]).
///
/// `live`, `in_use`, `created`, `destroyed`, `handed` and `lent` come from counters; `idle` and
/// `retired_busy` from the pool's lists and a query of each retired stream (a reading first
/// destroys the idle streams beyond [`MAX_IDLE`], as releases do). At a quiescent point (no
/// thread in the crate) `live == in_use + idle + retired_busy + handed` (`lent` streams are part
/// of `in_use`), which checks the counters against the lists. Under concurrent use each figure is
/// a momentary reading that never underflows.
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let held = ctx.owner();
/// held.stream().unwrap();
/// let st = ctx.stats();
/// assert_eq!(st.live, st.in_use + st.idle + st.retired_busy + st.handed);
/// assert_eq!(st.in_use, 1);
/// ```
///
/// The type is `#[non_exhaustive]` so that a new counter is not a breaking change: read its
/// fields; values come from the crate ([`crate::Context::stats`], [`PoolStats::default`] for
/// zeros, `+` for sums), and a struct literal does not compile outside the crate:
///
/// ```compile_fail,E0639
/// let st = cuda_stream_pool::PoolStats { live: 0, ..Default::default() };
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// Streams alive: created minus destroyed.
    pub live: u64,
    /// Retired streams whose work has completed (ready for a new owner).
    pub idle: u64,
    /// Retired streams with work still pending (or still captured by a leaked guard).
    pub retired_busy: u64,
    /// Streams held by owners, or lent to another crate after their owner is gone (`lent`):
    /// acquisitions minus releases.
    pub in_use: u64,
    /// Streams created by the pool.
    pub created: u64,
    /// Streams destroyed by the pool (trimmed, or at teardown).
    pub destroyed: u64,
    /// Acquisitions served by a retired stream.
    pub hits: u64,
    /// Acquisitions that had to create a stream.
    pub misses: u64,
    /// Idle streams destroyed because more than [`MAX_IDLE`] (or the reserve, when larger) were
    /// retired.
    pub trimmed: u64,
    /// Streams created by [`crate::Context::reserve`] (counted in `created`, not in `misses`).
    pub reserved: u64,
    /// The most streams alive at once (for a sum over pools, the sum of each pool's peak: an
    /// upper bound of the context's peak).
    pub peak_live: u64,
    /// Acquisitions that waited because the key was at its cap
    /// ([`crate::ContextOptions::max_live_streams_per_key`]).
    pub waits: u64,
    /// Streams created beyond the cap, for owners that already held a stream of another key
    /// (they never wait: see [`crate::ContextOptions`]).
    pub over_cap: u64,
    /// Streams that a release handed to a waiting acquisition (at the cap) which has not taken
    /// it yet.
    pub handed: u64,
    /// Streams whose owner is gone while a handle lent to another crate ([`crate::StreamRef::lend`],
    /// cudarc's `Arc<CudaStream>`) is still out: counted in `in_use` and against the cap until
    /// they come back (see [`crate::StreamRef::lend`]).
    pub lent: u64,
}

impl std::ops::Add for PoolStats {
    type Output = PoolStats;
    fn add(self, o: PoolStats) -> PoolStats {
        PoolStats {
            live: self.live + o.live,
            idle: self.idle + o.idle,
            retired_busy: self.retired_busy + o.retired_busy,
            in_use: self.in_use + o.in_use,
            created: self.created + o.created,
            destroyed: self.destroyed + o.destroyed,
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            trimmed: self.trimmed + o.trimmed,
            reserved: self.reserved + o.reserved,
            peak_live: self.peak_live + o.peak_live,
            waits: self.waits + o.waits,
            over_cap: self.over_cap + o.over_cap,
            handed: self.handed + o.handed,
            lent: self.lent + o.lent,
        }
    }
}

/// One shard: its retired streams, and the counters of the threads whose home it is (counted
/// here rather than in shared atomics, so that threads never write a common line).
#[derive(Default)]
struct ShardData {
    list: Mutex<SmallVec<[Arc<Slot>; 8]>>,
    /// Acquisitions served from a waiter's mailbox by the threads whose home this is.
    hits: AtomicU64,
    misses: AtomicU64,
    /// Releases handed straight to a waiter by the threads whose home this is.
    releases: AtomicU64,
    /// Acquisitions served from this shard's list, and releases into it: written only under
    /// the list's lock ([`bump_locked`]: no read-modify-write on the hand-over's path).
    taken: AtomicU64,
    pushed: AtomicU64,
    /// Streams counted in the pool's `retired` beyond this shard's list (at most
    /// [`MAX_CREDIT`]): a stream taken from the list leaves its count here, and the next
    /// release into the list uses it, so that a thread that takes and releases its own
    /// streams never writes `retired`, which every thread shares. Written only under the
    /// list's lock.
    credit: AtomicUsize,
}

/// The most counts a shard keeps (see [`ShardData::credit`]): each is a stream that `retired`
/// counts but no list holds, so a reading of `retired` exceeds the streams retired by up to
/// this times the shards; a trim first folds them back ([`Pool::lock_all`]).
const MAX_CREDIT: usize = 2;

/// Takes one of a shard's counts (see [`ShardData::credit`]), under its list's lock.
fn use_credit_locked(c: &AtomicUsize) -> bool {
    let n = c.load(Ordering::Relaxed);
    if n == 0 {
        return false;
    }
    c.store(n - 1, Ordering::Relaxed);
    true
}

/// Adds one to a counter that is written only under one lock, which the caller holds: a load
/// and a store (exact, as no other writer can interleave) instead of a locked read-modify-write.
fn bump_locked(c: &AtomicU64) {
    c.store(c.load(Ordering::Relaxed) + 1, Ordering::Release);
}

type Shard = CachePadded<ShardData>;

#[derive(Default)]
struct Counters {
    destroyed: AtomicU64,
    trimmed: AtomicU64,
    reserved: AtomicU64,
}

/// The pool of one (priority, flags) key of one context.
pub(crate) struct Pool {
    pub(crate) priority: i32,
    pub(crate) flags: u32,
    shards: Box<[Shard]>,
    /// Retired streams, plus the shards' credits (see [`ShardData::credit`]): never below the
    /// streams in the lists, and exact while [`Pool::lock_all`]'s guards are held (it is
    /// written only under a shard's lock).
    retired: CachePadded<AtomicUsize>,
    counters: CachePadded<Counters>,
    /// The cap on live streams and its waiters.
    gate: Arc<Gate>,
    /// Retired streams kept beyond [`MAX_IDLE`]: the largest [`Pool::reserve`] so far.
    keep: AtomicUsize,
    /// Streams of the key whose owner is gone while their loan is out (parked by the context):
    /// still counted against the cap.
    lent: AtomicUsize,
}

/// Not a synchronisation (only which shard is a thread's home), so std's atomic under loom too:
/// loom's threads share the test's OS thread, hence one home for all of them.
static NEXT_THREAD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
thread_local! {
    static HOME: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// Forgets the calling thread's home shard: its next use picks one as a new thread's first use
/// would (for the model's reused threads, see `__model_hooks::fresh_thread`).
#[cfg(feature = "model-hooks")]
pub(crate) fn forget_home() {
    let _ = HOME.try_with(|h| h.set(usize::MAX));
}

pub(crate) fn home_index() -> usize {
    HOME.try_with(|h| {
        let mut v = h.get();
        if v == usize::MAX {
            v = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            h.set(v);
        }
        v
    })
    // A thread in its exit (thread-local destructors) has no home: any shard will do.
    .unwrap_or(0)
}

#[cfg(not(loom))]
pub(crate) fn shard_count() -> usize {
    // Asked once per process: `available_parallelism` reads the cgroup's quota from files (1.9 %
    // of the fuzzer's time, which makes a pool per input).
    static SHARDS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SHARDS.get_or_init(|| {
        let cpus = std::thread::available_parallelism().map_or(8, |n| n.get());
        (cpus * 2).clamp(4, 64).next_power_of_two()
    })
}

/// Two shards under loom: a search still steals from a shard other than the home one, with
/// fewer locks for loom to interleave.
#[cfg(loom)]
pub(crate) fn shard_count() -> usize {
    2
}

/// What a retired stream is found idle for ([`is_idle`]). A statistics reading counts a stream
/// idle by the destroy's rule ([`Pool::stats`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum For {
    /// A new owner: frees of the crate's memory may still be pending ([`Slot::enqueue_free`]).
    HandOver,
    /// Its destroy: nothing may be pending (a stream is never destroyed under its work).
    Destroy,
}

/// Whether a retired stream can be handed out or destroyed: not captured by a leaked guard, and
/// its work completed (for a hand-over, frees of the crate's memory excepted). A failed query (a
/// sticky error) counts as busy: never a guess.
fn is_idle(driver: &dyn Driver, slot: &Slot, st: &SlotState, why: For) -> bool {
    if st.capturing || st.destroyed {
        return false;
    }
    // Known idle: no driver call (nothing was enqueued or exposed since the crate saw the
    // stream's work complete; for a hand-over, nothing but frees).
    let known = match why {
        For::HandOver => slot.settled(),
        For::Destroy => slot.known_idle(),
    };
    if known {
        return true;
    }
    // Read before the query: what is enqueued after it is not covered by its answer.
    let n = slot.mark();
    // SAFETY: the slot's stream is not destroyed (`destroyed` is false under the lock we hold,
    // and streams are destroyed only under it).
    let idle = unsafe { driver.stream_query(slot.raw) }.unwrap_or(false);
    if idle {
        // Nobody holds the stream (it is retired, or being released): the crate's frees on it
        // take the lock we hold, and a handle given out is no longer valid.
        slot.seen_complete(n);
    }
    idle
}

/// A retired stream that reports busy although its wake-up host function has run: the work
/// before it has completed, and only the function's return is pending. Waits for that (the
/// function only notifies the gate: microseconds) and returns whether the stream is idle now.
/// Without it, a waiter woken by the function would find the stream busy and arm another one,
/// which could race the same way, again and again.
///
/// A failed synchronize or query is the caller's error (as in [`destroy_idle`]): counted as
/// busy, the waiter would arm the stream again, whose new function runs at once and notifies,
/// and so on for as long as the failure lasts (review 27); before the re-arm, it slept for ever
/// beside the idle stream (review 26).
fn finish_wake_up(driver: &dyn Driver, slot: &Slot, st: &SlotState) -> Result<bool> {
    if st.capturing || st.destroyed || slot.armed.load(Ordering::Acquire) != RAN {
        return Ok(false);
    }
    // SAFETY: the stream is live (not destroyed, under its lock we hold) and not captured.
    unsafe { driver.stream_synchronize(slot.raw) }?;
    if slot.settled() {
        return Ok(true);
    }
    // Read before the query: what is enqueued after it is not covered by its answer.
    let n = slot.mark();
    // SAFETY: as above.
    let idle = unsafe { driver.stream_query(slot.raw) }?;
    if idle {
        // As in `is_idle`: nobody holds the stream, and we hold its lock.
        slot.seen_complete(n);
    }
    Ok(idle)
}

/// Destroys a stream that nobody holds (retired, or an owned stream being dropped) if it is idle
/// and not captured; with `wait`, after waiting for its work. Returns whether it did. The
/// generation is bumped under the stream's lock, so a buffer last used on it then frees on the
/// disposal stream, unordered: correct only because the stream's work has completed. Its queries and
/// synchronizations run in relaxed capture mode (the context's device rules).
pub(crate) fn destroy_idle(driver: &dyn Driver, slot: &Slot, wait: bool) -> Result<bool> {
    let mut st = slot.lock();
    if st.destroyed {
        return Ok(false);
    }
    if wait && !st.capturing && !slot.known_idle() {
        // SAFETY: the stream is live (not destroyed, under the lock).
        unsafe { driver.stream_synchronize(slot.raw) }?;
        // A failed query is an error here, for the caller to retry (as `is_idle` it would count
        // as busy, and the stream would be left alive for good: a leak at teardown).
        let n = slot.mark();
        // SAFETY: as above.
        if !unsafe { driver.stream_query(slot.raw) }? {
            return Ok(false);
        }
        slot.seen_complete(n);
    }
    if !is_idle(driver, slot, &st, For::Destroy) {
        return Ok(false);
    }
    // SAFETY: the stream is live, held by nobody, idle and not captured; after the generation
    // bump below nothing enqueues on it (frees check `destroyed` under the lock).
    unsafe { driver.stream_destroy(slot.raw) }?;
    st.destroy();
    Ok(true)
}

/// How an acquisition may wait when its key is at the cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Wait (FIFO) for a stream to come back: an owner's first stream.
    Wait,
    /// Never wait; create beyond the cap if no retired stream is idle: an owner that already
    /// holds a stream of another key (waiting while holding could close a cycle).
    Bypass,
    /// Never wait; an error when the key is at its cap (a host-function thread, which must not
    /// block).
    Fail,
    /// Never wait and never pass a queued waiter: [`crate::Error::AtCap`] when the key is at its
    /// cap or a waiter is queued ([`crate::Owner::try_stream`]).
    Try,
}

/// What wakes a waiter: a parked thread or an async task.
enum Wake {
    Thread(thread::Thread),
    /// In an `Arc`, so that the queue can copy it under its lock without running the waker's
    /// clone (user code); a [`TaskWaker`], so that its clone, wake and drop keep the rules of
    /// user code wherever they happen.
    Task(Arc<TaskWaker>),
}

impl Wake {
    /// Wakes it; never under a lock of the pool (a waker is user code).
    fn wake(self) {
        match self {
            Wake::Thread(t) => crate::sync::unpark(&t),
            Wake::Task(w) => TaskWaker::wake_shared(w),
        }
    }
}

struct Waiter {
    id: u64,
    /// Notifications not yet acted on: something came back (a release, a completed retired
    /// stream, a destroy, a failed creation) while the waiter was first; 1 when it joins an
    /// empty queue.
    notified: u32,
    /// Notifications its current attempt acts on: when it is served, all but one are passed to
    /// the next waiter (each may stand for a stream that came back).
    consumed: u32,
    /// How to wake it: copied (a reference count, no user code) under the queue's lock by a
    /// notification, and woken after it.
    wake: Wake,
    /// A stream handed directly to this waiter by a release (idle, already handed over to it):
    /// taken at its next turn, or given back to the pool if it leaves without it.
    handed: Option<(Arc<Slot>, u64)>,
}

impl Waiter {
    /// The waiter's waker, to wake after the queue's lock. Only reference counts are raised: a
    /// task's `Waker` is shared in an `Arc`, since its own clone is user code (which may
    /// re-enter the gate).
    fn waker(&self) -> Wake {
        match &self.wake {
            Wake::Thread(t) => Wake::Thread(t.clone()),
            Wake::Task(k) => Wake::Task(Arc::clone(k)),
        }
    }
}

#[derive(Default)]
struct Queue {
    next_id: u64,
    /// In the order of the waiters' ids: a waiter joins at the back with the next id, and
    /// leaves from wherever it is, so the ids only grow from front to back ([`Queue::index_of`]).
    list: VecDeque<Waiter>,
}

impl Queue {
    /// The position of waiter `id`, by binary search: O(log n). A linear search made every
    /// waiter that joined a long queue (10,000 async tasks at a cap of 64) walk all the waiters
    /// before it, twice, under the queue's lock.
    fn index_of(&self, id: u64) -> Option<usize> {
        self.list.binary_search_by_key(&id, |w| w.id).ok()
    }
}

/// The cap on live streams of one key and the FIFO queue of acquisitions waiting under it.
///
/// Only the first waiter of the queue makes attempts; it is notified (a count raised and its
/// thread unparked or its task woken) by everything that can make an attempt succeed: a release,
/// a retired stream's work completing (a host function that the waiter enqueued on each busy
/// retired stream: no driver query in a loop), a destroy, a failed creation. A notification is
/// counted under the queue's lock, and a waiter parks only after checking the count under that
/// lock, so none is lost between a failed attempt and parking. A waiter leaving the queue while
/// first passes the notifications it did not use to the next one ([`Leaving`]: served by an
/// attempt, all but one; served from its mailbox, all it had not acted on; failed or dropped,
/// [`Ticket`]'s destructor, all), so none is lost for the others, and a waiter is woken only when
/// something came back while it was first.
pub(crate) struct Gate {
    /// The cap (`usize::MAX`: none).
    cap: usize,
    /// Streams of the key alive, or being created: created (or reserved for a creation in
    /// progress) minus destroyed.
    live: AtomicUsize,
    peak: AtomicUsize,
    /// Waiters in the queue, readable without its lock.
    waiting: AtomicUsize,
    waits: AtomicU64,
    over_cap: AtomicU64,
    queue: Mutex<Queue>,
    /// Streams handed to waiters that left without them: still handed over (held), put back
    /// into the pool (retired) by its next attempt or drain.
    returned: Mutex<Vec<Arc<Slot>>>,
    /// `returned.len()`, readable without its lock.
    returned_len: AtomicUsize,
    /// Streams in waiters' mailboxes or `returned` (handed over, held by no owner yet).
    handed: AtomicUsize,
    /// Wake-up host functions enqueued by [`Pool::arm`] that have not run yet. While any is
    /// out, a first waiter that leaves passes at least one notification on (see
    /// [`Gate::leave`]).
    wake_ups_out: AtomicUsize,
}

impl Gate {
    fn new(cap: Option<usize>) -> Gate {
        Gate {
            cap: cap.unwrap_or(usize::MAX),
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            waits: AtomicU64::new(0),
            over_cap: AtomicU64::new(0),
            queue: Mutex::new(Queue::default()),
            returned: Mutex::new(Vec::new()),
            returned_len: AtomicUsize::new(0),
            handed: AtomicUsize::new(0),
            wake_ups_out: AtomicUsize::new(0),
        }
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock()
    }

    /// Counts a stream about to be created; below the cap only, unless `force`. The creation
    /// then either succeeds ([`Gate::created`]) or fails ([`Gate::gone`]).
    fn reserve(&self, force: bool) -> Option<Reserved> {
        let cap = self.cap;
        self.live
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |l| {
                (force || l < cap).then_some(l + 1)
            })
            .ok()
            .map(|prev| Reserved { nth: prev + 1 })
    }

    /// The stream reserved by [`Gate::reserve`] was created: it counts in the peak, and over the
    /// cap when it was reserved beyond it. (Counted only now: a failed creation made no stream.)
    fn created(&self, r: Reserved) {
        self.peak.fetch_max(r.nth, Ordering::AcqRel);
        if r.nth > self.cap {
            self.over_cap.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A stream of the key is gone (destroyed, or its creation failed): a waiter may create.
    /// Never under a lock of the pool: the notification runs the waiter's waker, which may poll
    /// its future inline (and search the pool).
    fn gone(&self) {
        self.uncount();
        self.notify();
    }

    /// [`Gate::gone`] without the notification, for a caller holding a lock of the pool: it
    /// calls [`Gate::notify`] (once per stream gone) after releasing it.
    fn uncount(&self) {
        self.live.fetch_sub(1, Ordering::AcqRel);
    }

    /// Notifies the first waiter, if any. Takes no lock but the queue's and calls no driver
    /// function: it runs in host functions.
    pub(crate) fn notify(&self) {
        // What the caller did before (a stream pushed and `retired` raised, `armed` set to RAN,
        // a stream uncounted) against a waiter that joins now: either this reads its `waiting`
        // or its next attempt sees what the caller did. Two SeqCst fences (here and in `join`)
        // order them; the SeqCst accesses of `waiting` alone do not, as the caller's writes and
        // the waiter's reads of them are not SeqCst (a lost wake-up that loom found: the waiter
        // read `retired` as 0 while this read `waiting` as 0).
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let wake = {
            let mut q = self.queue();
            q.list.front_mut().map(|w| {
                w.notified = w.notified.saturating_add(1);
                w.waker()
            })
        };
        if let Some(w) = wake {
            w.wake();
        }
    }

    /// Joins the queue. The first waiter attempts at once (what came back before it joined
    /// notified nobody); a later one attempts when the waiters before it pass notifications on.
    fn join(self: &Arc<Self>, wake: Wake) -> Ticket {
        let mut q = self.queue();
        q.next_id += 1;
        let id = q.next_id;
        let first = q.list.is_empty();
        q.list.push_back(Waiter {
            id,
            notified: u32::from(first),
            consumed: 0,
            wake,
            handed: None,
        });
        self.waiting.fetch_add(1, Ordering::SeqCst);
        // Pairs with the fence of `notify` (see there): the attempts that follow see what a
        // notifier did before a `waiting` it read as 0.
        fence(Ordering::SeqCst);
        self.waits.fetch_add(1, Ordering::Relaxed);
        Ticket {
            gate: self.clone(),
            id,
            leaving: Leaving::Unserved,
            armed: false,
        }
    }

    /// Hands `(slot, gen)` (idle, already handed over) to the first waiter that has none, and
    /// wakes it; gives it back when no waiter is left. Serves waiters in queue order without
    /// making them attempt one at a time: each release serves one.
    fn offer(&self, slot: Arc<Slot>, gen: u64) -> std::result::Result<(), Arc<Slot>> {
        let wake = {
            let mut q = self.queue();
            match q.list.iter_mut().find(|w| w.handed.is_none()) {
                Some(w) => {
                    w.handed = Some((slot, gen));
                    self.handed.fetch_add(1, Ordering::AcqRel);
                    w.waker()
                }
                None => return Err(slot),
            }
        };
        wake.wake();
        Ok(())
    }

    /// The stream handed to waiter `id`, if any.
    fn take_handed(&self, id: u64) -> Option<(Arc<Slot>, u64)> {
        let mut q = self.queue();
        let i = q.index_of(id)?;
        let h = q.list[i].handed.take();
        if h.is_some() {
            self.handed.fetch_sub(1, Ordering::AcqRel);
        }
        h
    }

    /// Streams handed to waiters that left without them.
    fn take_returned(&self) -> Vec<Arc<Slot>> {
        if self.returned_len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut r = self.returned.lock();
        self.returned_len.store(0, Ordering::Release);
        self.handed.fetch_sub(r.len(), Ordering::AcqRel);
        std::mem::take(&mut *r)
    }

    /// Whether waiter `id` should attempt now (it is first and was notified; the flag is
    /// cleared). Otherwise records `wake` as how to wake it, unless it has a waker that is
    /// `same`. `wake` is made by the caller before the lock (a waker's clone is user code, which
    /// may re-enter the gate); the waker it replaces, or `wake` when unused, is dropped after
    /// the lock (a drop is user code too).
    fn turn(&self, id: u64, wake: Wake, same: &dyn Fn(&Wake) -> bool) -> bool {
        let unused;
        let attempt = {
            let mut q = self.queue();
            match q.index_of(id) {
                None => {
                    unused = Some(wake);
                    true
                }
                Some(pos) => {
                    let w = &mut q.list[pos];
                    // A turn comes first or after a failed attempt: what that attempt acted on
                    // is used up (it found nothing), so it is not passed on if this waiter is
                    // then served from its mailbox or leaves.
                    w.consumed = 0;
                    if pos == 0 && w.notified > 0 {
                        w.consumed = std::mem::take(&mut w.notified);
                        unused = Some(wake);
                        true
                    } else if same(&w.wake) {
                        unused = Some(wake);
                        false
                    } else {
                        unused = Some(std::mem::replace(&mut w.wake, wake));
                        false
                    }
                }
            }
        };
        drop(unused);
        attempt
    }

    /// Leaves the queue (see [`Leaving`] for what is passed on). The leaving waiter's waker is
    /// dropped, and the others are woken, after the queue's lock.
    ///
    /// While wake-ups armed on busy streams are out (`wake_ups_out`), the first waiter passes
    /// at least one notification on, however it leaves: the next one attempts at once, arms in
    /// its turn and looks for a fault of its context now and then, as those wake-ups never run
    /// in a dead context. A waiter that became first without a notification waited for the
    /// wake-ups only, and slept for ever when the context died: the hang of CI at stop 36 (the
    /// first waiter, armed, was cancelled), and review 18's (it was served by its first attempt,
    /// never armed, while a wake-up armed before it was out). With none out, nothing but a
    /// release, a destroy or a loan's end can serve the next waiter, and each notifies it: it
    /// is not woken for nothing.
    fn leave(&self, id: u64, how: Leaving) {
        let mut wakes: SmallVec<[Wake; 2]> = SmallVec::new();
        let mut handed_to = None;
        let left;
        {
            let mut q = self.queue();
            let Some(pos) = q.index_of(id) else {
                return;
            };
            let Some(mut w) = q.list.remove(pos) else {
                return;
            };
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            let pass = match how {
                Leaving::Attempt => (w.notified + w.consumed).saturating_sub(1),
                Leaving::Mailbox => w.notified,
                Leaving::Unserved => w.notified + w.consumed,
                Leaving::Failed => (w.notified + w.consumed).max(1),
            };
            // At least one while wake-ups are out (see above).
            let pass = if self.wake_ups_out.load(Ordering::Acquire) > 0 {
                pass.max(1)
            } else {
                pass
            };
            let handed = w.handed.take();
            left = w;
            if let Some((slot, gen)) = handed {
                // Left without the stream handed to it (idle, and unused since): to the next
                // waiter without one, else back to the pool (and the first waiter notified).
                match q.list.iter_mut().find(|n| n.handed.is_none()) {
                    Some(n) => {
                        n.handed = Some((slot, gen));
                        handed_to = Some(n.id);
                        wakes.push(n.waker());
                    }
                    None => {
                        let mut r = self.returned.lock();
                        r.push(slot);
                        self.returned_len.store(r.len(), Ordering::Release);
                        // A stream came back to the pool: the first waiter is notified (and
                        // passes it on if it is served from its own mailbox). Without it a
                        // waiter that joined behind it slept while the stream lay in the pool
                        // (R7-2).
                        if let Some(n) = q.list.front_mut() {
                            n.notified = n.notified.saturating_add(1);
                            wakes.push(n.waker());
                        }
                    }
                }
            }
            // The first waiter leaves: the next one inherits what it did not use.
            if pos == 0 && pass > 0 {
                if let Some(n) = q.list.front_mut() {
                    n.notified = n.notified.saturating_add(pass);
                    if handed_to != Some(n.id) {
                        wakes.push(n.waker());
                    }
                }
            }
        }
        drop(left);
        for w in wakes {
            w.wake();
        }
    }
}

/// How a waiter leaves the gate's queue, which decides the notifications it passes on.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Leaving {
    /// Served by its attempt, which used one of the notifications it acted on.
    Attempt,
    /// Served by the stream a release put in its mailbox ([`Gate::offer`]): that used no
    /// notification. Those not acted on yet are passed on (each may stand for a stream in the
    /// pool); counting it as an attempt's once left the next waiter asleep while an idle stream
    /// lay in the pool (the fuzzer's finding `not-woken-at-cap-efdd1817`).
    Mailbox,
    /// Cancelled (dropped without a stream): everything, an attempt in progress included.
    Unserved,
    /// Failed with an error (the context died, a driver call failed): everything, and at least
    /// one, so that the next waiter attempts and meets the error itself (or succeeds) instead of
    /// sleeping on a queue that nothing will notify again.
    Failed,
}

/// A creation counted by [`Gate::reserve`]: the stream is the `nth` of the key alive (or being
/// created) when it was reserved.
#[must_use]
struct Reserved {
    nth: usize,
}

/// A place in a gate's queue; leaving it (dropped: served, failed or cancelled) passes the turn
/// on.
pub(crate) struct Ticket {
    gate: Arc<Gate>,
    id: u64,
    leaving: Leaving,
    /// Set once this waiter armed wake-ups on busy retired streams: it then waits for GPU work,
    /// which a faulted context never finishes (see [`FAULT_POLL`]).
    armed: bool,
}

impl Ticket {
    /// Leaves the queue with a stream found by an attempt.
    fn served(mut self) {
        self.leaving = Leaving::Attempt;
    }

    /// Leaves the queue with the stream a release handed to it.
    fn served_from_mailbox(mut self) {
        self.leaving = Leaving::Mailbox;
    }

    /// Leaves the queue with an error.
    pub(crate) fn failed(mut self) {
        self.leaving = Leaving::Failed;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.gate.leave(self.id, self.leaving);
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket").field("id", &self.id).finish()
    }
}

impl Pool {
    /// A held stream's owner is gone while another crate still holds a handle of it (a loan):
    /// the context parks it. It still counts against the cap (and in `in_use`): a waiter at the
    /// cap waits for it to come back, looking for the loan's end every [`LOAN_POLL`].
    pub(crate) fn park_lent(&self) {
        // SeqCst with the gate's `waiting`: a waiter that parked without a timeout (no loan was
        // parked then) is notified, and polls from then on.
        self.lent.fetch_add(1, Ordering::SeqCst);
        self.gate.notify();
    }

    /// A stream parked by [`Pool::park_lent`] comes back (its loan ended).
    pub(crate) fn unpark_lent(&self) {
        self.lent.fetch_sub(1, Ordering::SeqCst);
    }

    /// Streams of the key parked while lent.
    pub(crate) fn lent_out(&self) -> usize {
        self.lent.load(Ordering::SeqCst)
    }

    /// A held stream leaves the pool's accounting for good: its borrower returned it still
    /// capturing, so it is never used again (leaked). It no longer counts against the cap.
    pub(crate) fn forget_lent(&self) {
        self.gate.gone();
    }

    pub(crate) fn new(priority: i32, flags: u32, cap: Option<usize>) -> Pool {
        Pool {
            priority,
            flags,
            shards: (0..shard_count())
                .map(|_| CachePadded::new(ShardData::default()))
                .collect(),
            retired: CachePadded::new(AtomicUsize::new(0)),
            counters: CachePadded::new(Counters::default()),
            gate: Arc::new(Gate::new(cap)),
            keep: AtomicUsize::new(0),
            lent: AtomicUsize::new(0),
        }
    }

    fn home(&self, home: usize) -> &ShardData {
        &self.shards[home & (self.shards.len() - 1)]
    }

    fn shard(&self, i: usize) -> MutexGuard<'_, SmallVec<[Arc<Slot>; 8]>> {
        self.shards[i & (self.shards.len() - 1)].list.lock()
    }

    /// Retired streams kept: [`MAX_IDLE`], or the reserve when larger.
    fn idle_cap(&self) -> usize {
        self.keep.load(Ordering::Acquire).max(MAX_IDLE)
    }

    /// Hands out a stream whose previous owner is gone and whose work has completed, bumping its
    /// generation; otherwise creates one.
    /// Searches the calling thread's home shard first, then the others; never waits for a busy
    /// stream. When the key is at its cap, [`Mode::Wait`] parks the thread in the gate's FIFO
    /// queue until a stream comes back (a release, a retired stream's work completing, a
    /// destroy); the other modes never wait.
    ///
    /// While streams of the key are parked lent ([`Pool::park_lent`]), a waiting thread calls
    /// `reclaim` (the context's flush, which brings back those whose loan ended) every
    /// [`LOAN_POLL`].
    pub(crate) fn acquire(
        &self,
        driver: &dyn Driver,
        reclaim: &dyn Fn(),
        fault: &dyn Fn() -> Option<crate::Error>,
        mode: Mode,
    ) -> Result<(Arc<Slot>, u64)> {
        let g = &self.gate;
        let at_cap = || crate::Error::AtCap {
            priority: self.priority,
            cap: g.cap,
        };
        if mode == Mode::Try && g.waiting.load(Ordering::SeqCst) > 0 {
            // First come, first served: a waiter queued before this try is served first.
            return Err(at_cap());
        }
        if mode != Mode::Wait || g.waiting.load(Ordering::SeqCst) == 0 {
            if let Some(found) = self.attempt(driver, mode == Mode::Bypass)? {
                return Ok(found);
            }
            if mode == Mode::Try {
                return Err(at_cap());
            }
            if mode == Mode::Fail {
                return Err(crate::Error::invalid(format!(
                    "the pool of priority {} is at its cap of {} live streams, and this thread \
                     (a host function) must not wait",
                    self.priority, g.cap
                )));
            }
        }
        let mut ticket = g.join(Wake::Thread(thread::current()));
        let me = thread::current().id();
        loop {
            if let Some(found) = g.take_handed(ticket.id) {
                self.home(home_index()).hits.fetch_add(1, Ordering::Release);
                ticket.served_from_mailbox();
                return Ok(found);
            }
            let turn = g.turn(
                ticket.id,
                Wake::Thread(thread::current()),
                &|w| matches!(w, Wake::Thread(t) if t.id() == me),
            );
            if !turn {
                if ticket.armed {
                    if let Some(e) = fault() {
                        ticket.failed();
                        return Err(e);
                    }
                }
                if self.lent_out() > 0 {
                    // A loan ending tells nobody: look for it now and then. (A stream it brings
                    // back may be handed to this waiter, which unparks it.)
                    reclaim();
                    crate::sync::park_timeout(LOAN_POLL);
                } else if ticket.armed {
                    crate::sync::park_polling(FAULT_POLL);
                } else {
                    crate::sync::park();
                }
                continue;
            }
            match self.attempt(driver, false) {
                Ok(Some(found)) => {
                    ticket.served();
                    return Ok(found);
                }
                Ok(None) => {}
                Err(e) => {
                    ticket.failed();
                    return Err(e);
                }
            }
            // Waiting for GPU work from now on if a wake-up is armed on a busy stream.
            match self.arm(driver) {
                Ok(armed) => ticket.armed |= armed,
                Err(e) => {
                    ticket.failed();
                    return Err(e);
                }
            }
        }
    }

    /// [`Pool::acquire`] for an async task: `Ready` with a stream, or `Pending` with the task in
    /// the gate's queue (`ticket`), woken when a stream may have come back. Dropping the ticket
    /// leaves the queue and passes the turn on.
    pub(crate) fn poll_acquire(
        &self,
        driver: &dyn Driver,
        reclaim: &dyn Fn(),
        fault: &dyn Fn() -> Option<crate::Error>,
        ticket: &mut Option<Ticket>,
        cx: &mut TaskContext<'_>,
        waker: &Arc<TaskWaker>,
    ) -> Poll<Result<(Arc<Slot>, u64)>> {
        let g = &self.gate;
        if ticket.is_none() {
            if g.waiting.load(Ordering::SeqCst) == 0 {
                match self.attempt(driver, false) {
                    Ok(Some(found)) => return Poll::Ready(Ok(found)),
                    Err(e) => return Poll::Ready(Err(e)),
                    Ok(None) => {}
                }
            }
            *ticket = Some(g.join(Wake::Task(waker.clone())));
        }
        let Some(id) = ticket.as_ref().map(|t| t.id) else {
            return Poll::Pending;
        };
        loop {
            if let Some(found) = g.take_handed(id) {
                self.home(home_index()).hits.fetch_add(1, Ordering::Release);
                if let Some(t) = ticket.take() {
                    t.served_from_mailbox();
                }
                return Poll::Ready(Ok(found));
            }
            // The caller's clone (made before its scope: a clone is user code), shared; the
            // queue keeps its own waker when it is the same.
            let turn = g.turn(
                id,
                Wake::Task(waker.clone()),
                &|w| matches!(w, Wake::Task(k) if k.will_wake(cx.waker())),
            );
            if !turn {
                let armed = ticket.as_ref().is_some_and(|t| t.armed);
                if armed {
                    // As in `acquire`: a dead context never runs the armed wake-ups.
                    if let Some(e) = fault() {
                        if let Some(t) = ticket.take() {
                            t.failed();
                        }
                        return Poll::Ready(Err(e));
                    }
                }
                if self.lent_out() > 0 {
                    // As in `acquire`: look for ended loans now, and again after LOAN_POLL.
                    reclaim();
                    wake_after_poll(waker.clone(), true);
                } else if armed {
                    // Polled again after a while to ask once more (no driver call until then).
                    wake_after_poll(waker.clone(), false);
                }
                return Poll::Pending;
            }
            let r = self.attempt(driver, false).and_then(|found| match found {
                Some(found) => Ok(Some(found)),
                None => self.arm(driver).map(|armed| {
                    if let Some(t) = ticket.as_mut() {
                        t.armed |= armed;
                    }
                    None
                }),
            });
            match r {
                Ok(None) => continue,
                Ok(Some(found)) => {
                    if let Some(t) = ticket.take() {
                        t.served();
                    }
                    return Poll::Ready(Ok(found));
                }
                Err(e) => {
                    if let Some(t) = ticket.take() {
                        t.failed();
                    }
                    return Poll::Ready(Err(e));
                }
            }
        }
    }

    /// One attempt: an idle retired stream, else a new stream if the cap allows (or `force`).
    /// `Ok(None)`: the key is at its cap and no retired stream is idle.
    fn attempt(&self, driver: &dyn Driver, force: bool) -> Result<Option<(Arc<Slot>, u64)>> {
        let home = home_index();
        self.take_back_returned();
        if self.retired.load(Ordering::Acquire) > 0 {
            let mut found = None;
            for i in 0..self.shards.len() {
                found = self.take_from(driver, home.wrapping_add(i))?;
                if found.is_some() || self.retired.load(Ordering::Acquire) == 0 {
                    break;
                }
            }
            if self.retired.load(Ordering::Acquire) > self.idle_cap() {
                self.trim_excess(driver);
            }
            if let Some(found) = found {
                return Ok(Some(found));
            }
            // No idle stream anywhere: the credits are folded back, so that the next
            // acquisitions do not search every shard for streams that only credits count.
            self.fold_credits();
        }
        let Some(reserved) = self.gate.reserve(force) else {
            return Ok(None);
        };
        let raw = match driver.stream_create(self.flags, self.priority) {
            Ok(raw) => raw,
            Err(e) => {
                self.gate.gone();
                return Err(e);
            }
        };
        self.gate.created(reserved);
        self.home(home).misses.fetch_add(1, Ordering::Release);
        Ok(Some((
            Arc::new(Slot::new(raw, self.priority, self.flags)),
            1,
        )))
    }

    /// Before a waiter parks: enqueues, on each retired stream that is still busy, a host
    /// function that notifies the gate when the stream's work has completed (one per stream,
    /// however many wait; none on a stream a leaked capture guard captures, which never comes
    /// back). The host function calls no driver function.
    ///
    /// Returns whether a wake-up is armed on some busy stream (the waiter then waits for GPU
    /// work).
    ///
    /// # Errors
    /// The driver's error when a host function cannot be enqueued (the waiter would otherwise
    /// never learn that the stream completed).
    fn arm(&self, driver: &dyn Driver) -> Result<bool> {
        if self.retired.load(Ordering::Acquire) == 0 {
            return Ok(false);
        }
        let mut armed_any = false;
        let mut renotify = false;
        for i in 0..self.shards.len() {
            let list = self.shard(i);
            for slot in list.iter() {
                let st = slot.lock();
                if st.capturing || st.destroyed {
                    continue;
                }
                match slot.armed.compare_exchange(
                    UNARMED,
                    ARMED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => armed_any = true,
                    Err(ARMED) => {
                        armed_any = true;
                        continue;
                    }
                    Err(_) => {
                        // RAN, yet the attempt did not take the stream: it did not look at it
                        // (it was not counted as retired yet), or found it busy again after the
                        // function's return (work the crate enqueued on it since, as an event
                        // record of a buffer's ordering; a failed query is the attempt's error,
                        // see `finish_wake_up`). Nothing else will notify for it: the gate is
                        // notified (after the locks), and the waiter's next attempt looks again,
                        // waiting for the stream's work (review 26: a waiter slept for ever
                        // beside the idle stream). In a dead context that attempt gets the
                        // sticky error (R7-1).
                        armed_any = true;
                        renotify = true;
                        continue;
                    }
                }
                let (gate, armed) = (self.gate.clone(), slot.clone());
                self.gate.wake_ups_out.fetch_add(1, Ordering::AcqRel);
                let f = crate::hostfn::host_fn(move || {
                    armed.armed.store(RAN, Ordering::Release);
                    gate.wake_ups_out.fetch_sub(1, Ordering::AcqRel);
                    gate.notify();
                });
                // SAFETY: the stream is live (not destroyed, under its lock), held by nobody
                // (retired) and not captured by a guard of the crate; the function calls no
                // driver function.
                if let Err(e) = unsafe { driver.launch_host_func(slot.enqueue(), f) } {
                    slot.armed.store(UNARMED, Ordering::Release);
                    self.gate.wake_ups_out.fetch_sub(1, Ordering::AcqRel);
                    return Err(e);
                }
            }
        }
        if renotify {
            self.gate.notify();
        }
        Ok(armed_any)
    }

    /// Creates streams until `n` of this key are alive, keeps them retired (idle), and keeps up
    /// to `n` retired streams from now on (instead of [`MAX_IDLE`]). Returns how many it created.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] when `n` exceeds the cap; the driver's error (the streams
    /// created before it stay reserved).
    pub(crate) fn reserve(&self, driver: &dyn Driver, n: usize) -> Result<usize> {
        if n > self.gate.cap {
            return Err(crate::Error::invalid(format!(
                "cannot reserve {n} streams of priority {}: the cap is {} live streams per key",
                self.priority, self.gate.cap
            )));
        }
        self.keep.fetch_max(n, Ordering::AcqRel);
        let mut made = 0;
        while self.gate.live.load(Ordering::Acquire) < n {
            let Some(reserved) = self.gate.reserve(false) else {
                break;
            };
            let raw = match driver.stream_create(self.flags, self.priority) {
                Ok(raw) => raw,
                Err(e) => {
                    self.gate.gone();
                    return Err(e);
                }
            };
            self.gate.created(reserved);
            self.counters.reserved.fetch_add(1, Ordering::Release);
            let slot = Arc::new(Slot::new(raw, self.priority, self.flags));
            slot.lock().retire();
            // Spread over the shards, so that every thread's home shard has some.
            let mut list = self.shard(made);
            self.retired.fetch_add(1, Ordering::AcqRel);
            list.push(slot);
            drop(list);
            made += 1;
            self.gate.notify();
        }
        Ok(made)
    }

    /// Retired streams kept by [`Pool::reserve`].
    pub(crate) fn reserved_floor(&self) -> usize {
        self.keep.load(Ordering::Acquire)
    }

    /// Searches one shard: takes the first retired stream that is idle, in the order they were
    /// retired (the oldest is the likeliest to be done).
    fn take_from(&self, driver: &dyn Driver, index: usize) -> Result<Option<(Arc<Slot>, u64)>> {
        let shard = self.home(index);
        let mut list = shard.list.lock();
        for i in 0..list.len() {
            // Borrowed from the list (no reference count touched on the hot path); removed
            // from it below, under the shard's lock still.
            let slot = &list[i];
            let mut st = slot.lock();
            if !is_idle(driver, slot, &st, For::HandOver) && !finish_wake_up(driver, slot, &st)? {
                continue;
            }
            slot.armed.store(UNARMED, Ordering::Release);
            let gen = st.hand_over();
            drop(st);
            let slot = list.remove(i);
            // Its count stays as the shard's credit, up to MAX_CREDIT.
            let credit = shard.credit.load(Ordering::Relaxed);
            if credit < MAX_CREDIT {
                shard.credit.store(credit + 1, Ordering::Relaxed);
            } else {
                self.retired.fetch_sub(1, Ordering::AcqRel);
            }
            bump_locked(&shard.taken);
            return Ok(Some((slot, gen)));
        }
        Ok(None)
    }

    /// Folds a shard's credits back into `retired`; the caller holds the shard's lock (as for
    /// every write of `retired`).
    fn fold_locked(&self, shard: &ShardData) {
        let credits = shard.credit.swap(0, Ordering::Relaxed);
        if credits > 0 {
            self.retired.fetch_sub(credits, Ordering::AcqRel);
        }
    }

    /// Folds every shard's credits back into `retired`, one shard at a time.
    fn fold_credits(&self) {
        for shard in self.shards.iter() {
            if shard.credit.load(Ordering::Relaxed) > 0 {
                let _list = shard.list.lock();
                self.fold_locked(shard);
            }
        }
    }

    /// Locks every shard, in index order (no other path holds two shard locks), and folds their
    /// credits back into `retired`, which is then exact (the streams in the lists) until the
    /// guards are dropped: every write of `retired` is made under a shard's lock.
    fn lock_all(&self) -> Vec<MutexGuard<'_, SmallVec<[Arc<Slot>; 8]>>> {
        self.shards
            .iter()
            .map(|s| {
                let list = s.list.lock();
                self.fold_locked(s);
                list
            })
            .collect()
    }

    /// Destroys retired streams that are idle until at most [`MAX_IDLE`] (or the reserve) remain.
    /// Its queries run in relaxed capture mode (the context's device rules). Under every shard's
    /// lock ([`Pool::destroy_down_to`]): the count is exact, so a trim never goes below the
    /// reserve. A stream the driver refuses to query or destroy stays (the next trim retries).
    fn trim_excess(&self, driver: &dyn Driver) {
        let (n, _refused) = self.destroy_down_to(driver, false, self.idle_cap());
        self.counters.trimmed.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Destroys retired streams that are idle (with `wait`, after waiting for their work) until
    /// `keep` remain, under every shard's lock ([`Pool::lock_all`]: the count is exact), then
    /// notifies the gate once per stream destroyed. Returns how many it destroyed, and the first
    /// error of a query or destroy (that stream stays).
    fn destroy_down_to(
        &self,
        driver: &dyn Driver,
        wait: bool,
        keep: usize,
    ) -> (usize, Option<crate::Error>) {
        let mut n = 0;
        let mut first_err = None;
        // Destroyed slots are dropped after the shards' locks: a slot's drop may drop what it
        // keeps (a capture's uses, a loan's handle), which is user code.
        let mut dead: SmallVec<[Arc<Slot>; 4]> = SmallVec::new();
        {
            let mut lists = self.lock_all();
            'all: for list in lists.iter_mut() {
                let mut j = 0;
                while j < list.len() {
                    if self.retired.load(Ordering::Acquire) <= keep {
                        break 'all;
                    }
                    match self.destroy_if_idle(driver, &list[j], wait) {
                        Ok(true) => {
                            dead.push(list.remove(j));
                            n += 1;
                        }
                        Ok(false) => j += 1,
                        Err(e) => {
                            first_err.get_or_insert(e);
                            j += 1;
                        }
                    }
                }
            }
        }
        // The waiters are notified after the shards' locks (a waker may search the pool).
        drop(dead);
        for _ in 0..n {
            self.gate.notify();
        }
        (n, first_err)
    }

    /// Destroys a retired stream if it is idle (with `wait`, after waiting for its work).
    /// Returns whether it did; the caller removes it from its list and, after releasing the
    /// list's lock, notifies the gate ([`Gate::notify`]) once per stream destroyed.
    fn destroy_if_idle(&self, driver: &dyn Driver, slot: &Arc<Slot>, wait: bool) -> Result<bool> {
        if !destroy_idle(driver, slot, wait)? {
            return Ok(false);
        }
        self.retired.fetch_sub(1, Ordering::AcqRel);
        self.counters.destroyed.fetch_add(1, Ordering::Release);
        self.gate.uncount();
        Ok(true)
    }

    /// Takes back a stream from an owner that is gone, without waiting for its work, and
    /// notifies the first waiter of the gate; then, if more than [`MAX_IDLE`] (or the reserve)
    /// streams are retired, destroys idle ones. With `trim` false (a host-function thread) it
    /// calls no driver function.
    pub(crate) fn release(&self, driver: &dyn Driver, slot: Arc<Slot>, trim: bool) {
        // With waiters at the cap, an idle stream goes straight to the first of them (no
        // attempt, no queue turn: releases serve waiters in parallel). Not on a host-function
        // thread (no query there).
        let slot = if trim && self.gate.waiting.load(Ordering::SeqCst) > 0 {
            match self.hand_to_waiter(driver, slot) {
                Ok(()) => return,
                Err(slot) => slot,
            }
        } else {
            slot
        };
        slot.lock().retire();
        let home = home_index();
        let counted = {
            let shard = self.home(home);
            let mut list = shard.list.lock();
            // Counted before it can be found (before the lock's release), so that a search
            // never takes an uncounted stream: by a credit of the shard (no shared write), or
            // in `retired`.
            let counted = if use_credit_locked(&shard.credit) {
                None
            } else {
                Some(self.retired.fetch_add(1, Ordering::AcqRel) + 1)
            };
            list.push(slot);
            bump_locked(&shard.pushed);
            counted
        };
        // After the push (and its lock): a waiter that joined before it sees the stream in its
        // next attempt, or is notified here (`waiting` is read after the push and a SeqCst
        // fence, which pairs with the one after the waiter's join).
        self.gate.notify();
        // With a credit, `retired` did not grow, but it may be above the cap already (streams
        // released on host-function threads, which never trim): read, not written (review 17).
        if trim && counted.unwrap_or_else(|| self.retired.load(Ordering::Acquire)) > self.idle_cap()
        {
            self.trim_excess(driver);
        }
    }

    /// Hands a released stream to the gate's first waiter when its work has completed (a query
    /// in relaxed mode); gives it back otherwise.
    fn hand_to_waiter(
        &self,
        driver: &dyn Driver,
        slot: Arc<Slot>,
    ) -> std::result::Result<(), Arc<Slot>> {
        let gen = {
            let mut st = slot.lock();
            // The previous owner is gone and its work has completed: a new generation.
            is_idle(driver, &slot, &st, For::HandOver).then(|| st.hand_over())
        };
        let Some(gen) = gen else {
            return Err(slot);
        };
        match self.gate.offer(slot.clone(), gen) {
            Ok(()) => {
                // The old owner's release; the new owner's acquisition (a hit) is counted when
                // it takes the stream from its mailbox.
                self.home(home_index())
                    .releases
                    .fetch_add(1, Ordering::Release);
                Ok(())
            }
            Err(slot) => Err(slot),
        }
    }

    /// Puts streams handed to waiters that left without them back into the pool (retired).
    fn take_back_returned(&self) {
        for slot in self.gate.take_returned() {
            slot.lock().retire();
            let mut list = self.shard(home_index());
            self.retired.fetch_add(1, Ordering::AcqRel);
            list.push(slot);
        }
    }

    /// Destroys every retired stream that is idle, but `keep`; with `wait`, first waits for the
    /// others. Returns how many were destroyed. Relaxed capture mode: the context's device rules.
    /// Under every shard's lock, as [`Pool::trim_excess`] (`wait` only at the teardown, when
    /// nothing else uses the pool).
    pub(crate) fn drain(&self, driver: &dyn Driver, wait: bool, keep: usize) -> Result<usize> {
        self.take_back_returned();
        match self.destroy_down_to(driver, wait, keep) {
            (_, Some(e)) => Err(e),
            (n, None) => Ok(n),
        }
    }

    fn sum(&self, f: fn(&ShardData) -> &AtomicU64) -> u64 {
        self.shards
            .iter()
            .map(|s| f(s).load(Ordering::Acquire))
            .sum()
    }

    /// Streams alive (held and retired), from the counters alone: no driver call. `destroyed` is
    /// read first: a stream is counted as created before it can be destroyed, so the difference
    /// never underflows.
    pub(crate) fn live(&self) -> u64 {
        let destroyed = self.counters.destroyed.load(Ordering::Acquire);
        (self.sum(|s| &s.misses) + self.counters.reserved.load(Ordering::Acquire))
            .saturating_sub(destroyed)
    }

    /// The pool's counters. Queries each retired stream (in relaxed capture mode) to tell idle
    /// from busy ones.
    pub(crate) fn stats(&self, driver: &dyn Driver) -> PoolStats {
        self.take_back_returned();
        // Streams busy when released and idle now: the excess goes, as at a release (MAX_IDLE).
        // Not on a host-function thread (no driver call there).
        if !crate::hostfn::on_host_fn_thread()
            && self.retired.load(Ordering::Acquire) > self.idle_cap()
        {
            self.trim_excess(driver);
        }
        let (mut idle, mut busy) = (0, 0);
        for i in 0..self.shards.len() {
            for slot in self.shard(i).iter() {
                // Idle: its work has completed, frees included (`For::Destroy`): a stream with
                // only frees pending could be handed on, but no trim can destroy it yet, so
                // counting it idle would break `MAX_IDLE`'s bound on a reading and `trim`'s
                // count (review 15).
                if is_idle(driver, slot, &slot.lock(), For::Destroy) {
                    idle += 1;
                } else {
                    busy += 1;
                }
            }
        }
        // Releases before acquisitions and destroys before creations: each later reading is at
        // least what the earlier one implies, so no difference underflows.
        let releases = self.sum(|s| &s.releases) + self.sum(|s| &s.pushed);
        let destroyed = self.counters.destroyed.load(Ordering::Acquire);
        let hits = self.sum(|s| &s.hits) + self.sum(|s| &s.taken);
        let misses = self.sum(|s| &s.misses);
        let reserved = self.counters.reserved.load(Ordering::Acquire);
        PoolStats {
            live: (misses + reserved).saturating_sub(destroyed),
            idle,
            retired_busy: busy,
            in_use: (hits + misses).saturating_sub(releases),
            created: misses + reserved,
            destroyed,
            hits,
            misses,
            trimmed: self.counters.trimmed.load(Ordering::Relaxed),
            reserved,
            peak_live: self.gate.peak.load(Ordering::Acquire) as u64,
            waits: self.gate.waits.load(Ordering::Relaxed),
            over_cap: self.gate.over_cap.load(Ordering::Relaxed),
            handed: self.gate.handed.load(Ordering::Acquire) as u64,
            lent: self.lent.load(Ordering::Acquire) as u64,
        }
    }
}

/// Wakes `w` after [`LOAN_POLL`], from one thread of the process ("cuda-stream-pool-loans",
/// started on first need, blocked while nobody waits): how an async waiter at a cap looks for
/// loans that ended, or (`counted: false`) whether its context died. If no thread can be
/// started, `w` is woken at once.
///
/// With `counted`, the wake-up is counted for the model while pending (see
/// `sync::background_queued`): it may be the one that serves the waiter. A fault poll's is not:
/// it can only find a fault, which the model does not make, and counting it would keep the
/// model from ever seeing the crate quiet.
fn wake_after_poll(w: Arc<TaskWaker>, counted: bool) {
    use std::sync::mpsc;
    /// A waker handed to the loans thread, counted as run when woken or dropped if it was
    /// counted when queued.
    struct Bg(Option<Arc<TaskWaker>>, bool);
    impl Bg {
        fn wake(mut self) {
            if let Some(w) = self.0.take() {
                TaskWaker::wake_shared(w);
            }
        }
    }
    impl Drop for Bg {
        fn drop(&mut self) {
            if self.1 {
                crate::sync::background_ran();
            }
        }
    }
    #[cfg(not(loom))]
    static POLLER: std::sync::OnceLock<Option<mpsc::Sender<Bg>>> = std::sync::OnceLock::new();
    if counted {
        crate::sync::background_queued();
    }
    let w = Bg(Some(w), counted);
    // No thread outside loom's model may touch its objects: under loom, woken at once (as when
    // no thread can be started), which the waiter takes as a spurious wake-up.
    #[cfg(loom)]
    let tx: &Option<mpsc::Sender<Bg>> = &None;
    #[cfg(not(loom))]
    let tx = POLLER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Bg>();
        std::thread::Builder::new()
            .name("cuda-stream-pool-loans".into())
            .spawn(move || {
                crate::hostfn::mark_crate_thread();
                while let Ok(first) = rx.recv() {
                    std::thread::sleep(LOAN_POLL);
                    for w in std::iter::once(first).chain(rx.try_iter()) {
                        w.wake();
                    }
                }
            })
            .ok()
            .map(|_| tx)
    });
    match tx {
        Some(tx) => {
            if let Err(mpsc::SendError(w)) = tx.send(w) {
                w.wake();
            }
        }
        None => w.wake(),
    }
}

#[cfg(all(test, loom))]
mod loom_driver;
#[cfg(all(test, loom))]
mod loom_tests;
