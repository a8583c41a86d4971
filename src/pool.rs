//! The stream pool of one context and one (priority, flags) key.
//!
//! Retired streams wait in small per-shard lists (`SmallVec`s behind `CachePadded` mutexes). A
//! thread releases into and acquires from its home shard, so threads that recycle their own
//! streams never touch the same cache line; when the home shard has nothing usable, the other
//! shards are searched (work stealing), so an idle stream is found wherever it sits. Nothing on
//! this path depends on the number of live owners: owners hold their streams outside the pool.
//!
//! A retired stream is handed to a new owner only when `cuStreamQuery` says its work has completed;
//! a busy one is skipped, never waited for. Queries run in relaxed capture mode so that they can
//! never invalidate a capture that another thread runs in global mode.

use crate::capture::CaptureModeGuard;
use crate::context::CtxInner;
use crate::driver::{CaptureMode, Driver, Stream};
use crate::error::Result;
use crossbeam_utils::CachePadded;
use smallvec::SmallVec;
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Idle streams kept per (priority, flags) key; idle streams beyond this are destroyed the next
/// time the pool is searched.
pub const MAX_IDLE: usize = 32;

/// A stream known to the crate: pooled, owned, or the disposal stream. Identified by this object,
/// never by its handle value (handles are reused after destroy).
#[derive(Debug)]
pub(crate) struct Slot {
    pub(crate) raw: Stream,
    pub(crate) priority: i32,
    pub(crate) flags: u32,
    state: Mutex<SlotState>,
    /// A copy of (generation, held, destroyed), written under the lock, read without it by
    /// [`Slot::is_current`] (the advisory check of stream handles on the hot path).
    word: AtomicU64,
}

fn word(st: &SlotState) -> u64 {
    (st.generation << 3)
        | (u64::from(st.capturing) << 2)
        | (u64::from(st.held) << 1)
        | u64::from(st.destroyed)
}

/// The locked state of a slot. Changes to the generation, `held` and `destroyed` go through its
/// methods, which keep the slot's lock-free copy in step.
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
    pub(crate) fn hand_over(&mut self) -> u64 {
        self.st.generation += 1;
        self.st.held = true;
        self.publish();
        self.st.generation
    }

    /// The owner is gone (the generation stays: its work may still be pending).
    pub(crate) fn retire(&mut self) {
        self.st.held = false;
        self.publish();
    }

    /// The stream is destroyed (or about to be): bumps the generation.
    pub(crate) fn destroy(&mut self) {
        self.st.generation += 1;
        self.st.destroyed = true;
        self.publish();
    }

    /// Whether a capture guard of this crate captures the stream.
    pub(crate) fn set_capturing(&mut self, on: bool) {
        self.st.capturing = on;
        self.publish();
    }
}

/// What the stream's lock guards: the generation and whether the stream still exists. The
/// generation is bumped on every hand-over and on destroy, under this lock, so a free that checks
/// the generation and enqueues while holding the lock cannot race with a hand-over.
#[derive(Debug, Default)]
pub(crate) struct SlotState {
    pub(crate) generation: u64,
    pub(crate) destroyed: bool,
    /// Set while a capture guard of this crate captures the stream.
    pub(crate) capturing: bool,
    /// Whether an owner (or an `OwnedStream`) holds the stream; cleared on release so that stale
    /// handles are noticed before the next hand-over.
    pub(crate) held: bool,
}

impl Slot {
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
        }
    }

    pub(crate) fn lock(&self) -> SlotGuard<'_> {
        SlotGuard {
            slot: self,
            st: self.state.lock().unwrap_or_else(|p| p.into_inner()),
        }
    }

    /// Whether generation `gen` is still held (not retired, recycled or destroyed), without the
    /// lock. Advisory: the answer can change right after.
    pub(crate) fn is_current(&self, gen: u64) -> bool {
        self.word.load(Ordering::Acquire) & !0b100 == (gen << 3) | 0b10
    }

    /// Whether a capture guard of this crate captures the stream, without the lock (advisory).
    pub(crate) fn is_capturing(&self) -> bool {
        self.word.load(Ordering::Acquire) & 0b100 != 0
    }
}

/// Counters of one pool or of a whole context ([`crate::Context::stats`]).
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
    /// Streams alive: held by owners plus retired.
    pub live: u64,
    /// Retired streams whose work has completed (ready for a new owner).
    pub idle: u64,
    /// Retired streams with work still pending.
    pub retired_busy: u64,
    /// Streams held by owners.
    pub in_use: u64,
    /// Streams created by the pool.
    pub created: u64,
    /// Streams destroyed by the pool (trimmed, or at teardown).
    pub destroyed: u64,
    /// Acquisitions served by a retired stream.
    pub hits: u64,
    /// Acquisitions that had to create a stream.
    pub misses: u64,
    /// Idle streams destroyed because more than [`MAX_IDLE`] were idle.
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

/// One shard: its retired streams, and the hit/miss counters of the threads whose home it is
/// (counted here rather than in shared atomics, so that threads never write a common line).
#[derive(Default)]
struct ShardData {
    list: Mutex<SmallVec<[Arc<Slot>; 8]>>,
    hits: AtomicU64,
    misses: AtomicU64,
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
    HOME.with(|h| {
        let mut v = h.get();
        if v == usize::MAX {
            v = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            h.set(v);
        }
        v
    })
}

fn shard_count() -> usize {
    let cpus = std::thread::available_parallelism().map_or(8, |n| n.get());
    (cpus * 2).clamp(4, 64).next_power_of_two()
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
    /// generation; creates one (with the context made current) when none qualifies. Searches the
    /// calling thread's home shard first, then the others; never waits for a busy stream.
    pub(crate) fn acquire(&self, ctx: &CtxInner) -> Result<(Arc<Slot>, u64)> {
        let driver = &*ctx.driver;
        let home = home_index();
        if self.retired.load(Ordering::Acquire) > 0 {
            // Queries on behalf of the pool must never invalidate another thread's capture.
            let _relaxed = CaptureModeGuard::new(driver, CaptureMode::Relaxed)?;
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
                self.home(home).hits.fetch_add(1, Ordering::Relaxed);
                return Ok(found);
            }
        }
        // Only creating a stream needs the context to be current on this thread.
        ctx.bind()?;
        let raw = driver.stream_create(self.flags, self.priority)?;
        self.home(home).misses.fetch_add(1, Ordering::Relaxed);
        let slot = Arc::new(Slot::new(raw, self.priority, self.flags));
        Ok((slot, 1))
    }

    /// Searches one shard: takes the first retired stream whose work has completed, in the
    /// order they were retired (the oldest is the likeliest to be done).
    fn take_from(&self, driver: &dyn Driver, index: usize) -> Option<(Arc<Slot>, u64)> {
        let mut list = self.shard(index);
        for i in 0..list.len() {
            let slot = list[i].clone();
            let mut st = slot.lock();
            // A failed query (a stream left capturing by a dropped owner, a sticky error) counts
            // as busy: the stream is never handed out on a guess.
            if !driver.stream_query(slot.raw).unwrap_or(false) {
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

    /// Destroys retired streams whose work has completed until at most [`MAX_IDLE`] remain.
    fn trim_excess(&self, driver: &dyn Driver) {
        for i in 0..self.shards.len() {
            let mut list = self.shard(i);
            let mut j = 0;
            while j < list.len() && self.retired.load(Ordering::Acquire) > MAX_IDLE {
                let slot = list[j].clone();
                let mut st = slot.lock();
                if !driver.stream_query(slot.raw).unwrap_or(false) {
                    j += 1;
                    continue;
                }
                if driver.stream_destroy(slot.raw).is_err() {
                    // Keep it: a later search retries, and teardown waits and retries.
                    j += 1;
                    continue;
                }
                st.destroy();
                drop(st);
                list.remove(j);
                self.retired.fetch_sub(1, Ordering::AcqRel);
                self.counters.destroyed.fetch_add(1, Ordering::Relaxed);
                self.counters.trimmed.fetch_add(1, Ordering::Relaxed);
            }
            if self.retired.load(Ordering::Acquire) <= MAX_IDLE {
                return;
            }
        }
    }

    /// Takes back a stream from an owner that is gone, without waiting for its work.
    pub(crate) fn release(&self, slot: Arc<Slot>) {
        slot.lock().retire();
        self.shard(home_index()).push(slot);
        self.retired.fetch_add(1, Ordering::AcqRel);
    }

    /// Destroys every retired stream whose work has completed; with `wait`, first waits for
    /// the others. Returns how many were destroyed.
    pub(crate) fn drain(&self, driver: &dyn Driver, wait: bool) -> Result<usize> {
        let _relaxed = CaptureModeGuard::new(driver, CaptureMode::Relaxed)?;
        let mut n = 0;
        let mut first_err = None;
        for i in 0..self.shards.len() {
            let mut list = self.shard(i);
            let mut j = 0;
            while j < list.len() {
                let slot = list[j].clone();
                let mut st = slot.lock();
                let idle = if wait {
                    driver.stream_synchronize(slot.raw).is_ok()
                } else {
                    driver.stream_query(slot.raw).unwrap_or(false)
                };
                if !idle {
                    j += 1;
                    continue;
                }
                if let Err(e) = driver.stream_destroy(slot.raw) {
                    first_err.get_or_insert(e);
                    j += 1;
                    continue;
                }
                st.destroy();
                n += 1;
                self.counters.destroyed.fetch_add(1, Ordering::Relaxed);
                drop(st);
                list.remove(j);
                self.retired.fetch_sub(1, Ordering::AcqRel);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// Streams alive (held and retired), from the counters alone: no driver call.
    pub(crate) fn live(&self) -> u64 {
        let created: u64 = self
            .shards
            .iter()
            .map(|s| s.misses.load(Ordering::Relaxed))
            .sum();
        created - self.counters.destroyed.load(Ordering::Relaxed)
    }

    /// The pool's counters. Queries each retired stream (in relaxed capture mode) to tell idle
    /// from busy ones.
    pub(crate) fn stats(&self, driver: &dyn Driver) -> PoolStats {
        let _relaxed = CaptureModeGuard::new(driver, CaptureMode::Relaxed).ok();
        let (mut idle, mut busy) = (0, 0);
        for i in 0..self.shards.len() {
            for slot in self.shard(i).iter() {
                if driver.stream_query(slot.raw).unwrap_or(false) {
                    idle += 1;
                } else {
                    busy += 1;
                }
            }
        }
        let c = &self.counters;
        let sum = |f: fn(&ShardData) -> &AtomicU64| -> u64 {
            self.shards
                .iter()
                .map(|s| f(s).load(Ordering::Relaxed))
                .sum()
        };
        let (hits, misses) = (sum(|s| &s.hits), sum(|s| &s.misses));
        let created = misses;
        let destroyed = c.destroyed.load(Ordering::Relaxed);
        let live = created - destroyed;
        PoolStats {
            live,
            idle,
            retired_busy: busy,
            in_use: live.saturating_sub(idle + busy),
            created,
            destroyed,
            hits,
            misses,
            trimmed: c.trimmed.load(Ordering::Relaxed),
        }
    }
}
