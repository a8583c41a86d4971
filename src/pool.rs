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

use crate::driver::{CaptureModeGuard, Driver, Stream};
use crate::error::Result;
use crossbeam_utils::CachePadded;
use smallvec::SmallVec;
use std::any::Any;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Idle streams kept per (priority, flags) key. A release that leaves more retired streams
/// than this destroys idle ones until at most this many remain; a stream still busy when it is
/// released is destroyed by the next release or acquire of its key once it is idle.
pub const MAX_IDLE: usize = 32;

/// A resource that a capture on this stream uses and that the resulting graph must keep alive
/// (the memory layer's buffers); opaque at this layer.
pub(crate) type CapturedUse = Arc<dyn Any + Send + Sync>;

/// A handle of a stream lent to another crate (cudarc's `Arc<CudaStream>`), opaque at this layer.
/// While anyone but the slot holds a clone of it, the stream is neither handed to another owner
/// nor destroyed (see [`Slot::loan_returned`]).
pub(crate) type Loan = Arc<dyn Any + Send + Sync>;

/// A stream known to the crate: pooled, owned, or the disposal stream. Identified by this object,
/// never by its handle value (handles are reused after destroy).
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) raw: Stream,
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
}

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

    /// Records that the capture in progress uses `r` (once per object).
    pub(crate) fn add_captured(&mut self, r: CapturedUse) {
        if !self.st.captured.iter().any(|x| Arc::ptr_eq(x, &r)) {
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
        }
    }

    /// The handle lent to another crate for this stream: the existing one, or `make()`'s,
    /// which is kept (the caller holds the stream).
    pub(crate) fn lend<E>(&self, make: impl FnOnce() -> Result<Loan, E>) -> Result<Loan, E> {
        let mut l = self.loan.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(a) = l.as_ref() {
            return Ok(a.clone());
        }
        let a = make()?;
        *l = Some(a.clone());
        self.lent.store(true, Ordering::Release);
        Ok(a)
    }

    /// Whether a handle of this stream is (or may still be) held by another crate, which can
    /// enqueue work on it and begin or end captures of it behind the crate's back.
    pub(crate) fn is_lent(&self) -> bool {
        self.lent.load(Ordering::Acquire)
    }

    /// Whether nobody but this slot holds the lent handle any more (or none was lent). Then the
    /// slot drops its own clone (after its lock is released) and the stream is the crate's
    /// alone again. `Arc::get_mut` succeeds only without other strong or weak references, and
    /// nobody can make one from nothing, so the answer cannot become stale.
    pub(crate) fn loan_returned(&self) -> bool {
        let taken = {
            let mut l = self.loan.lock().unwrap_or_else(|p| p.into_inner());
            match l.as_mut().map(|a| Arc::get_mut(a).is_some()) {
                None => return true,
                Some(false) => return false,
                Some(true) => {
                    self.lent.store(false, Ordering::Release);
                    l.take()
                }
            }
        };
        drop(taken);
        true
    }

    pub(crate) fn lock(&self) -> SlotGuard<'_> {
        SlotGuard {
            slot: self,
            st: self.state.lock().unwrap_or_else(|p| p.into_inner()),
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
/// `live`, `in_use`, `created` and `destroyed` come from counters; `idle` and `retired_busy`
/// from the pool's lists and a query of each retired stream. At a quiescent point (no thread in
/// the crate) `live == in_use + idle + retired_busy`, which checks the counters against the
/// lists. Under concurrent use each figure is a momentary reading that never underflows.
///
/// ```
/// # use cuda_stream_pool::{driver, Context};
/// # let (drv, _) = driver::load(driver::Choice::Sim).unwrap();
/// # let ctx = Context::primary(drv, 0).unwrap();
/// let held = ctx.owner();
/// held.stream().unwrap();
/// let st = ctx.stats();
/// assert_eq!(st.live, st.in_use + st.idle + st.retired_busy);
/// assert_eq!(st.in_use, 1);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Streams alive: created minus destroyed.
    pub live: u64,
    /// Retired streams whose work has completed (ready for a new owner).
    pub idle: u64,
    /// Retired streams with work still pending (or still captured by a leaked guard).
    pub retired_busy: u64,
    /// Streams held by owners: acquisitions minus releases.
    pub in_use: u64,
    /// Streams created by the pool.
    pub created: u64,
    /// Streams destroyed by the pool (trimmed, or at teardown).
    pub destroyed: u64,
    /// Acquisitions served by a retired stream.
    pub hits: u64,
    /// Acquisitions that had to create a stream.
    pub misses: u64,
    /// Idle streams destroyed because more than [`MAX_IDLE`] were retired.
    pub trimmed: u64,
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
        }
    }
}

/// One shard: its retired streams, and the counters of the threads whose home it is (counted
/// here rather than in shared atomics, so that threads never write a common line).
#[derive(Default)]
struct ShardData {
    list: Mutex<SmallVec<[Arc<Slot>; 8]>>,
    hits: AtomicU64,
    misses: AtomicU64,
    releases: AtomicU64,
}

type Shard = CachePadded<ShardData>;

#[derive(Default)]
struct Counters {
    destroyed: AtomicU64,
    trimmed: AtomicU64,
}

/// The pool of one (priority, flags) key of one context.
pub(crate) struct Pool {
    pub(crate) priority: i32,
    pub(crate) flags: u32,
    shards: Box<[Shard]>,
    retired: CachePadded<AtomicUsize>,
    counters: CachePadded<Counters>,
}

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);
thread_local! {
    static HOME: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn home_index() -> usize {
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

fn shard_count() -> usize {
    let cpus = std::thread::available_parallelism().map_or(8, |n| n.get());
    (cpus * 2).clamp(4, 64).next_power_of_two()
}

/// Whether a retired stream can be handed out or destroyed: not captured by a leaked guard, and
/// its work completed. A failed query (a sticky error) counts as busy: never a guess.
fn is_idle(driver: &dyn Driver, slot: &Slot, st: &SlotState) -> bool {
    // SAFETY: the slot's stream is not destroyed (`destroyed` is false under the lock we hold,
    // and streams are destroyed only under it).
    !st.capturing && !st.destroyed && unsafe { driver.stream_query(slot.raw) }.unwrap_or(false)
}

/// Destroys a stream that nobody holds (retired, or an owned stream being dropped) if it is idle
/// and not captured; with `wait`, after waiting for its work. Returns whether it did. The
/// generation is bumped under the stream's lock, so a buffer last used on it then frees on the
/// disposal stream, unordered: correct only because the stream's work has completed. The caller
/// runs it in relaxed capture mode.
pub(crate) fn destroy_idle(driver: &dyn Driver, slot: &Slot, wait: bool) -> Result<bool> {
    let mut st = slot.lock();
    if st.destroyed {
        return Ok(false);
    }
    if wait && !st.capturing {
        // SAFETY: the stream is live (not destroyed, under the lock).
        unsafe { driver.stream_synchronize(slot.raw) }?;
    }
    if !is_idle(driver, slot, &st) {
        return Ok(false);
    }
    // SAFETY: the stream is live, held by nobody, idle and not captured; after the generation
    // bump below nothing enqueues on it (frees check `destroyed` under the lock).
    unsafe { driver.stream_destroy(slot.raw) }?;
    st.destroy();
    Ok(true)
}

impl Pool {
    pub(crate) fn new(priority: i32, flags: u32) -> Pool {
        Pool {
            priority,
            flags,
            shards: (0..shard_count())
                .map(|_| CachePadded::new(ShardData::default()))
                .collect(),
            retired: CachePadded::new(AtomicUsize::new(0)),
            counters: CachePadded::new(Counters::default()),
        }
    }

    fn home(&self, home: usize) -> &ShardData {
        &self.shards[home & (self.shards.len() - 1)]
    }

    fn shard(&self, i: usize) -> MutexGuard<'_, SmallVec<[Arc<Slot>; 8]>> {
        self.shards[i & (self.shards.len() - 1)]
            .list
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Hands out a stream whose previous owner is gone and whose work has completed, bumping its
    /// generation; otherwise creates one, after `bind` (which makes the context current).
    /// Searches the calling thread's home shard first, then the others; never waits for a busy
    /// stream.
    pub(crate) fn acquire(
        &self,
        driver: &dyn Driver,
        bind: impl FnOnce() -> Result<()>,
    ) -> Result<(Arc<Slot>, u64)> {
        let home = home_index();
        if self.retired.load(Ordering::Acquire) > 0 {
            let _relaxed = CaptureModeGuard::relaxed(driver)?;
            let mut found = None;
            for i in 0..self.shards.len() {
                found = self.take_from(driver, home.wrapping_add(i));
                if found.is_some() || self.retired.load(Ordering::Acquire) == 0 {
                    break;
                }
            }
            if self.retired.load(Ordering::Acquire) > MAX_IDLE {
                self.trim_excess(driver);
            }
            if let Some(found) = found {
                self.home(home).hits.fetch_add(1, Ordering::Release);
                return Ok(found);
            }
        }
        bind()?;
        let raw = driver.stream_create(self.flags, self.priority)?;
        self.home(home).misses.fetch_add(1, Ordering::Release);
        Ok((Arc::new(Slot::new(raw, self.priority, self.flags)), 1))
    }

    /// Searches one shard: takes the first retired stream that is idle, in the order they were
    /// retired (the oldest is the likeliest to be done).
    fn take_from(&self, driver: &dyn Driver, index: usize) -> Option<(Arc<Slot>, u64)> {
        let mut list = self.shard(index);
        for i in 0..list.len() {
            let slot = list[i].clone();
            let mut st = slot.lock();
            if !is_idle(driver, &slot, &st) {
                continue;
            }
            let gen = st.hand_over();
            drop(st);
            list.remove(i);
            self.retired.fetch_sub(1, Ordering::AcqRel);
            return Some((slot, gen));
        }
        None
    }

    /// Destroys retired streams that are idle until at most [`MAX_IDLE`] remain. The caller runs
    /// it in relaxed capture mode.
    fn trim_excess(&self, driver: &dyn Driver) {
        for i in 0..self.shards.len() {
            if self.retired.load(Ordering::Acquire) <= MAX_IDLE {
                return;
            }
            let mut list = self.shard(i);
            let mut j = 0;
            while j < list.len() && self.retired.load(Ordering::Acquire) > MAX_IDLE {
                if self
                    .destroy_if_idle(driver, &list[j], false)
                    .unwrap_or(false)
                {
                    list.remove(j);
                    self.counters.trimmed.fetch_add(1, Ordering::Relaxed);
                } else {
                    j += 1;
                }
            }
        }
    }

    /// Destroys a retired stream if it is idle (with `wait`, after waiting for its work).
    /// Returns whether it did; the caller removes it from its list.
    fn destroy_if_idle(&self, driver: &dyn Driver, slot: &Arc<Slot>, wait: bool) -> Result<bool> {
        if !destroy_idle(driver, slot, wait)? {
            return Ok(false);
        }
        self.retired.fetch_sub(1, Ordering::AcqRel);
        self.counters.destroyed.fetch_add(1, Ordering::Release);
        Ok(true)
    }

    /// Takes back a stream from an owner that is gone, without waiting for its work; then, if
    /// more than [`MAX_IDLE`] streams are retired, destroys idle ones.
    pub(crate) fn release(&self, driver: &dyn Driver, slot: Arc<Slot>, trim: bool) {
        slot.lock().retire();
        let home = home_index();
        // Counted before it can be found, so that a search never takes an uncounted stream.
        let retired = self.retired.fetch_add(1, Ordering::AcqRel) + 1;
        self.shard(home).push(slot);
        self.home(home).releases.fetch_add(1, Ordering::Release);
        if trim && retired > MAX_IDLE {
            if let Ok(_relaxed) = CaptureModeGuard::relaxed(driver) {
                self.trim_excess(driver);
            }
        }
    }

    /// Destroys every retired stream that is idle; with `wait`, first waits for the others.
    /// Returns how many were destroyed. The caller runs it in relaxed capture mode.
    pub(crate) fn drain(&self, driver: &dyn Driver, wait: bool) -> Result<usize> {
        let mut n = 0;
        let mut first_err = None;
        for i in 0..self.shards.len() {
            let mut list = self.shard(i);
            let mut j = 0;
            while j < list.len() {
                match self.destroy_if_idle(driver, &list[j], wait) {
                    Ok(true) => {
                        list.remove(j);
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
        match first_err {
            Some(e) => Err(e),
            None => Ok(n),
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
        self.sum(|s| &s.misses).saturating_sub(destroyed)
    }

    /// The pool's counters. Queries each retired stream (in relaxed capture mode) to tell idle
    /// from busy ones.
    pub(crate) fn stats(&self, driver: &dyn Driver) -> PoolStats {
        // Without relaxed mode a query could invalidate a capture: then nothing is queried, and
        // every retired stream counts as busy.
        let relaxed = CaptureModeGuard::relaxed(driver).ok();
        let (mut idle, mut busy) = (0, 0);
        for i in 0..self.shards.len() {
            for slot in self.shard(i).iter() {
                if relaxed.is_some() && is_idle(driver, slot, &slot.lock()) {
                    idle += 1;
                } else {
                    busy += 1;
                }
            }
        }
        // Releases before acquisitions and destroys before creations: each later reading is at
        // least what the earlier one implies, so no difference underflows.
        let releases = self.sum(|s| &s.releases);
        let destroyed = self.counters.destroyed.load(Ordering::Acquire);
        let (hits, misses) = (self.sum(|s| &s.hits), self.sum(|s| &s.misses));
        PoolStats {
            live: misses.saturating_sub(destroyed),
            idle,
            retired_busy: busy,
            in_use: (hits + misses).saturating_sub(releases),
            created: misses,
            destroyed,
            hits,
            misses,
            trimmed: self.counters.trimmed.load(Ordering::Relaxed),
        }
    }
}
