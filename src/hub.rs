//! The completion hub of a context: slabs of host-mapped flags that the GPU writes
//! (`cuStreamWriteValue64`), one poller thread that reads them and wakes the futures of
//! [`crate::completion`], and pinned staging blocks for asynchronous copies to the host. Below
//! the context, which owns one hub (created on first use, torn down with the state); it knows
//! the driver, host functions' wake-ups and the shelf of page-locked memory, nothing of
//! streams, owners or buffers.
//!
//! Cancellation: a dropped future leaves its entry with the poller, which frees the slot once
//! the write has landed, and with the entry whatever host memory the GPU still writes into (the
//! staging block of a dropped host copy), so nothing is freed early and nothing waits.

use crate::driver::{
    event_flags, host_alloc_flags, stream_flags, DevicePtr, Driver, Event, Stream,
};
use crate::error::{Error, Result};
use crate::hostfn::TaskWaker;
use crate::pinned::{self, Block, Home};
use crate::sync::{Condvar, Mutex, MutexGuard};
use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

thread_local! {
    /// Set on the poller thread.
    static IN_POLLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Slots per host-mapped slab (one page of u64 flags).
const SLAB_SLOTS: usize = 512;
/// A slab's size and `cuMemHostAlloc` flags.
const SLAB_BYTES: usize = SLAB_SLOTS * 8;
const SLAB_FLAGS: u32 = host_alloc_flags::DEVICEMAP | host_alloc_flags::PORTABLE;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// One pending completion: which slot the GPU writes, and the value that means "done".
pub(crate) struct Entry {
    slot: usize,
    /// Host address of the slot's flag (in a slab that lives as long as the hub).
    flag: usize,
    seq: u64,
    /// Set by the entry's doorbell host function when it ran (the event it waits for is
    /// recorded just before the write, so the write lands at about that time, rarely just
    /// after); `None` when the entry has no doorbell (see [`Hub::completion`]).
    bell: Option<Arc<AtomicBool>>,
    state: Mutex<EntryState>,
}

#[derive(Default)]
struct EntryState {
    done: bool,
    /// Set when the entry was given up: the context died before the write landed.
    error: Option<Error>,
    waker: Option<TaskWaker>,
    /// Host memory the GPU may still write, kept until the write has landed (a dropped future's).
    keep: Option<Box<dyn Any + Send>>,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("slot", &self.slot)
            .field("seq", &self.seq)
            .finish()
    }
}

impl Entry {
    /// Whether the GPU's write has landed (a read of the flag, no driver call).
    pub(crate) fn landed(&self) -> bool {
        // SAFETY: the flag lies in a slab of the hub, which outlives every entry's use (the hub
        // frees its slabs only at the context's teardown, when no future holds the context and
        // every write has landed); the GPU writes it concurrently, so it is read atomically.
        unsafe { &*(self.flag as *const AtomicU64) }.load(Ordering::Acquire) >= self.seq
    }

    /// Whether the poller may stop reading this entry's flag and wait for its doorbell: it has
    /// one that has not rung yet (once rung, the flag is read until it lands).
    fn waits_for_bell(&self) -> bool {
        self.bell
            .as_ref()
            .is_some_and(|b| !b.load(Ordering::Acquire))
    }

    /// A future's poll: ready once the write has landed, else `waker` is stored for the poller.
    /// A waker's clone and drop are user code: the new waker is cloned before the lock, and the
    /// one it replaces dropped after it.
    pub(crate) fn poll(&self, waker: &Waker) -> Poll<Result<()>> {
        {
            let st = lock(&self.state);
            if self.landed() {
                return Poll::Ready(Ok(()));
            }
            if st.done {
                return Poll::Ready(st.outcome());
            }
            if st.waker.as_ref().is_some_and(|w| w.will_wake(waker)) {
                return Poll::Pending;
            }
        }
        let new = TaskWaker::new(waker);
        let replaced = {
            let mut st = lock(&self.state);
            if st.done {
                let r = st.outcome();
                drop(st);
                drop(new);
                return Poll::Ready(r);
            }
            st.waker.replace(new)
        };
        drop(replaced);
        // The flag may have landed (and the poller passed by) between the check and storing the
        // waker: check again, so that the wake-up cannot be lost.
        if self.landed() {
            return Poll::Ready(Ok(()));
        }
        Poll::Pending
    }

    /// Keeps `mem` (host memory the GPU may still write) until the write has landed; gives it
    /// back at once (`Some`) when it has. Dropped by the poller, outside every lock.
    pub(crate) fn keep_until_landed(
        &self,
        mem: Box<dyn Any + Send>,
    ) -> Option<Box<dyn Any + Send>> {
        let mut st = lock(&self.state);
        if st.done && st.error.is_some() {
            // Given up (see `finish`): kept for ever.
            std::mem::forget(mem);
            return None;
        }
        if st.done || self.landed() {
            return Some(mem);
        }
        st.keep = Some(mem);
        None
    }

    /// Marks the entry done (given up with `error`, if any) and wakes its waker; the kept
    /// memory is dropped after the lock.
    fn finish(&self, error: Option<Error>) {
        let given_up = error.is_some();
        let (waker, keep) = {
            let mut st = lock(&self.state);
            st.done = true;
            st.error = error;
            (st.waker.take(), st.keep.take())
        };
        if given_up {
            // Nothing is known of the write, nor of a copy into what the entry keeps: never
            // reused, never freed (a leak).
            std::mem::forget(keep);
        } else {
            drop(keep);
        }
        if let Some(w) = waker {
            // A panicking waker is contained: it must not stop the poller (whose entries keep
            // memory that copies still write).
            w.wake();
        }
    }
}

impl EntryState {
    /// What a finished entry resolves with.
    fn outcome(&self) -> Result<()> {
        match &self.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

struct Slab {
    host: *mut u8,
    dev: DevicePtr,
}

// SAFETY: the pointer is the address of driver-owned, page-locked memory that the hub frees
// once; it is shared only through atomic loads of its flags.
unsafe impl Send for Slab {}

struct HubState {
    slabs: Vec<Slab>,
    /// Free slots and the next sequence number of every slot.
    free: Vec<usize>,
    next_seq: Vec<u64>,
    /// Entries submitted since the poller last looked.
    incoming: Vec<Arc<Entry>>,
    /// Whether the poller is parked (waiting for `incoming`).
    parked: bool,
    /// Whether the poller naps with nothing pending before it goes cold (see [`COLD_AFTER`]):
    /// a new entry unparks it.
    napping: bool,
    /// Whether the poller is parked waiting for a doorbell (the one pending entry has one that
    /// has not rung), and the bell's count of rings when it parked.
    bell_parked: Option<u64>,
    /// Doorbells being enqueued whose entries are not submitted yet: the doorbell stream may
    /// hold a wait for such an entry's work ahead of the pending entry's doorbell, so the
    /// poller does not park for a doorbell while any is in the making.
    making: u64,
    /// Whether the poller is running user code (wakers, and the drops of what entries kept):
    /// set under this lock only while `stop` is unset (see [`Hub::stop`]).
    running: bool,
    /// Pinned staging blocks for copies to the host, by size class (power of two bytes).
    staging: Vec<(usize, Vec<usize>)>,
    /// Every staging block of the hub (shelved at teardown): (address, size class).
    staging_all: Vec<(usize, usize)>,
}

/// A context's completion machinery: the slabs of flags, the poller thread, staging memory.
pub(crate) struct Hub {
    driver: Arc<dyn Driver>,
    /// The CUDA context whose shelf of page-locked blocks the hub takes from and gives back
    /// to (see pinned.rs: the crate never frees them on its own).
    home: Home,
    state: Mutex<HubState>,
    cv: Condvar,
    stop: AtomicBool,
    thread: Mutex<Option<std::thread::JoinHandle<Vec<Arc<Entry>>>>>,
    /// Completions observed (by the poller or by a poll), for tests and statistics.
    pub(crate) completed: AtomicU64,
    /// The poller's passes over its pending entries (see [`Hub::poller_progress`]).
    passes: AtomicU64,
    /// The context's health (see [`Health`]).
    health: Health,
    /// Set once entries were given up for a fault: the hub's memory is then never freed nor
    /// shelved for reuse (nothing is known of the copies into it).
    faulted: AtomicBool,
    /// The doorbell that entries' host functions ring.
    bell: Arc<Bell>,
    /// The doorbell stream and the events that order it after completions' writes.
    bells: Mutex<Bells>,
    /// Whether the poller is cold (it had nothing to read for [`COLD_AFTER`]): new completions
    /// then get a doorbell, so that the poller can park instead of reading their flags.
    cold: AtomicBool,
    /// Completions made and not yet finished by the poller (a hint for the doorbell, never for
    /// correctness): a completion made while no other is pending gets a doorbell even when the
    /// poller is warm (it would otherwise be seen only by the poller's naps, up to a 32nd of its
    /// duration late); one made while others are pending (a server's) gets none.
    pending: AtomicUsize,
    /// The model's override of [`COLD_AFTER`], in nanoseconds (see [`Hub::cold_after`]).
    #[cfg(feature = "model-hooks")]
    cold_after_ns: AtomicU64,
}

/// The hub's doorbell stream (made on first use, never captured, synchronized and destroyed at
/// the hub's shutdown) and its free events.
#[derive(Default)]
struct Bells {
    stream: Option<Stream>,
    events: Vec<Event>,
}

/// A doorbell: rung by the host function that the doorbell stream runs once a completion's
/// stream reached its event (on the driver's host-function thread: it only stores and unparks,
/// never blocks nor calls the driver, and what it holds drops nothing of a user's).
struct Bell {
    /// The poller's thread, once it has started.
    poller: OnceLock<crate::sync::thread::Thread>,
    rings: AtomicU64,
}

impl Bell {
    fn ring(&self, rung: &AtomicBool) {
        rung.store(true, Ordering::Release);
        self.rings.fetch_add(1, Ordering::SeqCst);
        if let Some(t) = self.poller.get() {
            crate::sync::unpark(t);
        }
    }
}

/// The context's sticky error, if a call returned one (`false`: a read of what the device rules
/// recorded, no driver call), or after a cheap driver call that would reveal one (`true`). The
/// poller asks while completions are pending and no flag moves: a faulted context never writes
/// them, and would leave their futures pending for ever.
pub(crate) type Health = Box<dyn Fn(bool) -> Option<Error> + Send + Sync>;

/// How long the poller waits with no flag landing before it asks the driver about the
/// context's health, and how often it asks after that: one `cuStreamQuery` (and its pair of
/// capture-mode switches) per period, only while completions are pending and none lands.
const PROBE_EVERY: Duration = Duration::from_millis(5);

/// How long the poller reads the flags without pause after a flag landed, an entry arrived or
/// a doorbell rang (spinning, then yielding), before it parks (a single pending entry whose
/// doorbell has not rung) or sleeps between sweeps. (Completions get a doorbell once the poller
/// has gone cold, see [`COLD_AFTER`], or when no other is pending.)
const HOT: Duration = Duration::from_micros(50);

/// How long the poller must have had no reason to read without pause (no landing, no new
/// entry, no doorbell) before it goes cold and new completions get a doorbell. Under a steady
/// stream of completions (a server) it stays warm: no doorbell for a completion made while
/// others are pending (three driver calls, one of them a host function on the one doorbell
/// stream that every thread's completions would share); its naps see them land. A completion
/// made after a longer idle, or while no other is pending, gets one (it may wait long).
const COLD_AFTER: Duration = Duration::from_millis(1);

/// The longest nap between two sweeps (see [`nap`]): a long-pending completion costs ~1,000
/// sweeps/s (no driver call; the health probe aside).
const MAX_SLEEP: Duration = Duration::from_millis(1);

/// The shortest nap between two sweeps once the poller has cooled down.
const MIN_NAP: Duration = Duration::from_micros(20);

/// How long the poller naps between two sweeps, `since` after it last had reason to read without
/// pause: a 32nd of that, from [`MIN_NAP`] to [`MAX_SLEEP`]. A completion that lands after `t`
/// is seen about `t / 64` later on average (≤ `t / 32`) where no doorbell rings first, for
/// ~30 sweeps in its first 0.6 ms and ~22 per doubling of its age after that. (A doorbell
/// ends the nap at once: after a long idle the driver's host-function thread is slower than the
/// nap of a young completion, faster than that of an old one; measured in BENCHMARKS.md, "The
/// quiet poller on a GPU".)
fn nap(since: Duration) -> Duration {
    (since / 32).clamp(MIN_NAP, MAX_SLEEP)
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").finish_non_exhaustive()
    }
}

impl Hub {
    pub(crate) fn new(home: Home, health: Health) -> Arc<Hub> {
        Arc::new(Hub {
            driver: home.driver.clone(),
            home,
            state: Mutex::new(HubState {
                slabs: Vec::new(),
                free: Vec::new(),
                next_seq: Vec::new(),
                incoming: Vec::new(),
                parked: false,
                napping: false,
                bell_parked: None,
                making: 0,
                running: false,
                staging: Vec::new(),
                staging_all: Vec::new(),
            }),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
            thread: Mutex::new(None),
            completed: AtomicU64::new(0),
            passes: AtomicU64::new(0),
            health,
            faulted: AtomicBool::new(false),
            bell: Arc::new(Bell {
                poller: OnceLock::new(),
                rings: AtomicU64::new(0),
            }),
            cold: AtomicBool::new(true),
            pending: AtomicUsize::new(0),
            bells: Mutex::new(Bells::default()),
            #[cfg(feature = "model-hooks")]
            cold_after_ns: AtomicU64::new(COLD_AFTER.as_nanos() as u64),
        })
    }

    /// How long the poller stays warm with nothing to read: [`COLD_AFTER`], or what a model
    /// test set (see [`Hub::set_cold_after`]).
    fn cold_after(&self) -> Duration {
        #[cfg(feature = "model-hooks")]
        return Duration::from_nanos(self.cold_after_ns.load(Ordering::Relaxed));
        #[cfg(not(feature = "model-hooks"))]
        COLD_AFTER
    }

    /// Sets how long the poller stays warm with nothing to read, for tests that need it warm
    /// (or cold) whatever the machine's load: whether it went cold would otherwise depend on
    /// how long the test's thread was descheduled. Takes effect at the poller's next look.
    #[cfg(feature = "model-hooks")]
    pub(crate) fn set_cold_after(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.cold_after_ns.store(ns, Ordering::Relaxed);
        if let Some(t) = self.bell.poller.get() {
            crate::sync::unpark(t);
        }
    }

    /// Ends the poller's nap now (as a doorbell does): its next sweep of the flags comes at once
    /// instead of at the nap's end. The poller takes it as a spurious wake-up, which a park with
    /// a timeout may have anyway, so nothing it does changes but when. For the model, which
    /// waits for the poller's passes after each step of simulated time and otherwise waited for
    /// its naps (up to [`MAX_SLEEP`] each) in real time.
    #[cfg(feature = "model-hooks")]
    pub(crate) fn nudge(&self) {
        if let Some(t) = self.bell.poller.get() {
            crate::sync::unpark(t);
        }
    }

    /// A new pending completion: takes a slot, has `write` enqueue the GPU's write of the
    /// sequence number to the slot's device address, and hands the entry to the poller. On a
    /// failed `write` the slot is free again (nothing was enqueued). The context must be current
    /// and relaxed (the slab's host allocation): the caller's device rules.
    ///
    /// While the poller is cold, or no other completion is pending, `write` is also given an
    /// event, to record on its stream just before the write (it returns whether it did): the
    /// hub's doorbell stream waits for it and then runs a host function that rings the poller's
    /// doorbell, so that the poller can park instead of reading the flag, and the caller's
    /// stream gets no host function (which would hold its later work until the driver's
    /// host-function thread ran it). A doorbell the driver refuses only means that the poller
    /// reads this entry's flag until it lands.
    pub(crate) fn completion(
        self: &Arc<Self>,
        write: impl FnOnce(DevicePtr, u64, Option<Event>) -> Result<bool>,
    ) -> Result<Arc<Entry>> {
        let (slot, flag, dev, seq) = self.take_slot()?;
        let others = self.pending.fetch_add(1, Ordering::Relaxed);
        let event = if self.cold.load(Ordering::Acquire) || others == 0 {
            self.bell_event()
        } else {
            None
        };
        let recorded = match write(dev, seq, event) {
            Ok(r) => r,
            Err(e) => {
                self.pending.fetch_sub(1, Ordering::Relaxed);
                self.give_back_slot(slot);
                if let Some(ev) = event {
                    lock(&self.bells).events.push(ev);
                }
                return Err(e);
            }
        };
        let making = event.is_some() && recorded;
        if making {
            self.begin_doorbell();
        }
        let bell = match event {
            Some(ev) => {
                let rung = Arc::new(AtomicBool::new(false));
                let belled = making && self.ring_after(ev, &rung);
                // Reusable at once: a wait orders after the record made before it, whatever
                // is recorded into the event later.
                lock(&self.bells).events.push(ev);
                belled.then_some(rung)
            }
            None => None,
        };
        let entry = Arc::new(Entry {
            slot,
            flag,
            seq,
            bell,
            state: Mutex::new(EntryState::default()),
        });
        self.submit(entry.clone(), making)?;
        Ok(entry)
    }

    /// Counts a doorbell in the making (see [`HubState::making`]); a poller parked for another
    /// doorbell goes back to reading flags.
    fn begin_doorbell(&self) {
        let unpark = {
            let mut st = lock(&self.state);
            st.making += 1;
            st.bell_parked.is_some()
        };
        if unpark {
            if let Some(t) = self.bell.poller.get() {
                crate::sync::unpark(t);
            }
        }
    }

    /// The hub's own streams alive: the doorbell stream, once made.
    pub(crate) fn streams(&self) -> u64 {
        u64::from(lock(&self.bells).stream.is_some())
    }

    /// An event for a doorbell: one of the hub's, or a new one (`None` if the driver refuses).
    fn bell_event(&self) -> Option<Event> {
        if let Some(ev) = lock(&self.bells).events.pop() {
            return Some(ev);
        }
        self.driver.event_create(event_flags::DISABLE_TIMING).ok()
    }

    /// The doorbell stream: made on first use (by [`crate::Context::reserve`], so that a
    /// completion on a reserved stream never creates one: creating a stream can block behind
    /// another stream's GPU-side wait on the H200, or by the first completion that needs it).
    ///
    /// # Errors
    /// The driver's error from the stream's creation.
    pub(crate) fn doorbell_stream(&self) -> Result<Stream> {
        if let Some(s) = lock(&self.bells).stream {
            return Ok(s);
        }
        let s = self.driver.stream_create(stream_flags::NON_BLOCKING, 0)?;
        let mut b = lock(&self.bells);
        match b.stream {
            // Another thread made one meanwhile: this one goes.
            Some(other) => {
                drop(b);
                // SAFETY: the stream was just made here, has no work, and no one else knows it.
                crate::driver::tries(|| unsafe { self.driver.stream_destroy(s) });
                Ok(other)
            }
            None => Ok(*b.stream.insert(s)),
        }
    }

    /// Makes the doorbell stream wait for `event` (just recorded on a completion's stream, right
    /// before its write), then ring the doorbell, setting `rung`. Whether both were enqueued (a refusal leaves at
    /// most a wait on the doorbell stream, which orders nothing of anyone's). Counted as a
    /// doorbell in the making until the entry is submitted (see [`HubState::making`]).
    fn ring_after(&self, event: Event, rung: &Arc<AtomicBool>) -> bool {
        let Ok(stream) = self.doorbell_stream() else {
            return false;
        };
        // SAFETY: the doorbell stream lives until the hub's shutdown, which synchronizes it
        // first; it is never captured (its handle never leaves the hub); the event is live (the
        // hub's, destroyed at shutdown).
        if unsafe { self.driver.stream_wait_event(stream, event) }.is_err() {
            return false;
        }
        let (bell, r) = (self.bell.clone(), rung.clone());
        let f = crate::hostfn::host_fn(move || bell.ring(&r));
        // SAFETY: as above; the host function only stores and unparks (no driver call, no
        // blocking), and what it holds (the doorbell, the entry's flag) drops nothing of a
        // user's.
        unsafe { self.driver.launch_host_func(stream, f) }.is_ok()
    }

    /// A free slot and its next sequence number; grows by a slab (the context must be current).
    /// The slab is allocated without the hub's lock (driver calls, whose hooks may block, are
    /// never made under it): two threads that find no free slot at once may both add one.
    fn take_slot(&self) -> Result<(usize, usize, DevicePtr, u64)> {
        let mut st = lock(&self.state);
        if st.free.is_empty() {
            drop(st);
            let (host, dev) = self.new_slab()?;
            st = lock(&self.state);
            let base = st.slabs.len() * SLAB_SLOTS;
            st.slabs.push(Slab { host, dev });
            st.next_seq.extend(std::iter::repeat_n(1, SLAB_SLOTS));
            st.free.extend((base..base + SLAB_SLOTS).rev());
        }
        let slot = st.free.pop().expect("refilled above");
        let seq = st.next_seq[slot];
        st.next_seq[slot] += 1;
        let slab = &st.slabs[slot / SLAB_SLOTS];
        let off = (slot % SLAB_SLOTS) * 8;
        Ok((
            slot,
            slab.host as usize + off,
            DevicePtr(slab.dev.0 + off as u64),
            seq,
        ))
    }

    /// A slab of flags, cleared: one of an earlier state of the context, or a new one.
    fn new_slab(&self) -> Result<(*mut u8, DevicePtr)> {
        let (bytes, flags) = (SLAB_BYTES, SLAB_FLAGS);
        let host = match pinned::take(&self.home, bytes, flags) {
            Some(b) => b.host as *mut u8,
            None => self.driver.mem_host_alloc(bytes, flags)?,
        };
        // SAFETY: `host` is a live allocation made with DEVICEMAP.
        let dev = match unsafe { self.driver.mem_host_get_device_pointer(host) } {
            Ok(d) => d,
            Err(e) => {
                let b = Block {
                    host: host as usize,
                    bytes,
                    flags,
                };
                // Back to the shelf (an adopted context's is freed: nothing uses it).
                for b in pinned::give(&self.home, vec![b]) {
                    // SAFETY: the block just taken or allocated, used by no one.
                    crate::driver::tries(|| unsafe { pinned::free(&*self.driver, b) });
                }
                return Err(e);
            }
        };
        // SAFETY: the slab is SLAB_SLOTS * 8 bytes; nothing uses it (a shelved one's writes
        // all landed before it was shelved): its old sequence numbers are cleared.
        unsafe { std::ptr::write_bytes(host, 0, bytes) };
        Ok((host, dev))
    }

    fn give_back_slot(&self, slot: usize) {
        lock(&self.state).free.push(slot);
    }

    /// Hands an entry to the poller (starting it on first use); `made` ends the count of its
    /// doorbell in the making.
    fn submit(self: &Arc<Self>, e: Arc<Entry>, made: bool) -> Result<()> {
        let mut st = lock(&self.state);
        st.incoming.push(e);
        if made {
            st.making -= 1;
        }
        let wake = st.parked;
        let unpark = st.bell_parked.is_some() || st.napping;
        drop(st);
        if unpark {
            if let Some(t) = self.bell.poller.get() {
                crate::sync::unpark(t);
            }
        }
        {
            let mut t = lock(&self.thread);
            if t.is_none() {
                let hub = self.clone();
                let h = std::thread::Builder::new()
                    .name("cuda-stream-pool-completions".into())
                    .spawn(move || hub.poll_loop())
                    .map_err(|e| {
                        Error::invalid(format!("cannot start the completion poller: {e}"))
                    })?;
                *t = Some(h);
            }
        }
        if wake {
            self.cv.notify_one();
        }
        Ok(())
    }

    /// The poller: reads the flags of pending entries (no driver call), finishes the landed
    /// ones. After a landing, a new entry or a doorbell it reads them without pause for [`HOT`]
    /// (spinning, then yielding); then it naps between sweeps (parked with a timeout, see
    /// [`nap`]; a doorbell or the teardown's stop ends the nap early, a new entry does not: it
    /// is taken at the nap's end, at most [`MAX_SLEEP`] later); with nothing pending it naps
    /// warm until [`COLD_AFTER`] (a new entry or the stop ends that nap), then parks cold
    /// (waiting for an entry). A parked poller
    /// wakes every [`PROBE_EVERY`] to ask after the context's health. Returns the entries still
    /// pending (or landed but not finished) when stopped.
    ///
    /// User code (the wakers of landed entries, the drops of what they kept) runs only between
    /// two checks of `stop` under the state lock, with `running` set, and with no lock held;
    /// once it has seen `stop` the poller reads no flag again and returns.
    fn poll_loop(&self) -> Vec<Arc<Entry>> {
        let _ = IN_POLLER.try_with(|p| p.set(true));
        crate::hostfn::mark_crate_thread();
        let _ = self.bell.poller.set(crate::sync::thread::current());
        let mut mine: Vec<Arc<Entry>> = Vec::new();
        // The last landing, and the last time the poller had reason to read without pause (a
        // landing, a new entry, a doorbell).
        let mut last = Instant::now();
        let mut hot_since = Instant::now();
        let mut last_probe = Instant::now();
        let mut spins = 0u32;
        loop {
            {
                let mut st = lock(&self.state);
                while mine.is_empty() && st.incoming.is_empty() {
                    if self.stop.load(Ordering::Acquire) {
                        return mine;
                    }
                    let warm_for = self.cold_after().saturating_sub(hot_since.elapsed());
                    if !warm_for.is_zero() {
                        // Warm: a nap that a new entry (or the teardown's stop) ends early;
                        // the poller goes cold after it if nothing came.
                        st.napping = true;
                        drop(st);
                        crate::sync::park_timeout(warm_for);
                        st = lock(&self.state);
                        st.napping = false;
                    } else {
                        self.cold.store(true, Ordering::Release);
                        st.parked = true;
                        st = self.cv.wait(st);
                        st.parked = false;
                    }
                    if !st.incoming.is_empty() {
                        hot_since = Instant::now();
                        spins = 0;
                    }
                }
                if !st.incoming.is_empty() {
                    hot_since = Instant::now();
                }
                mine.append(&mut st.incoming);
            }
            if self.stop.load(Ordering::Acquire) {
                return mine;
            }
            let mut landed = Vec::new();
            mine.retain(|e| {
                if e.landed() {
                    landed.push(e.clone());
                    false
                } else {
                    true
                }
            });
            if !landed.is_empty() {
                self.cold.store(false, Ordering::Release);
                {
                    let mut st = lock(&self.state);
                    if self.stop.load(Ordering::Acquire) {
                        // The teardown has begun: it finishes these (no user code here now).
                        mine.append(&mut landed);
                        return mine;
                    }
                    st.running = true;
                }
                for e in &landed {
                    e.finish(None);
                }
                let freed = landed.iter().map(|e| e.slot);
                self.completed
                    .fetch_add(landed.len() as u64, Ordering::Relaxed);
                self.pending.fetch_sub(landed.len(), Ordering::Relaxed);
                {
                    let mut st = lock(&self.state);
                    st.running = false;
                    st.free.extend(freed);
                }
                drop(landed);
                last = Instant::now();
                hot_since = last;
                spins = 0;
                self.passes.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            // A dead context never writes the pending flags: their futures resolve with its
            // error (a landed one above resolved with success: its work did complete).
            let probe = last.elapsed() >= PROBE_EVERY && last_probe.elapsed() >= PROBE_EVERY;
            if probe {
                last_probe = Instant::now();
            }
            if let Some(error) = (self.health)(probe) {
                {
                    let mut st = lock(&self.state);
                    if self.stop.load(Ordering::Acquire) {
                        return mine;
                    }
                    st.running = true;
                }
                // Their slots are not reused: nothing is known of the writes.
                self.faulted.store(true, Ordering::Release);
                let given_up = std::mem::take(&mut mine);
                self.pending.fetch_sub(given_up.len(), Ordering::Relaxed);
                for e in &given_up {
                    e.finish(Some(error.clone()));
                }
                lock(&self.state).running = false;
                drop(given_up);
                self.passes.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            self.passes.fetch_add(1, Ordering::SeqCst);
            if spins < 64 {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let since = hot_since.elapsed();
            if since < HOT {
                std::thread::yield_now();
                continue;
            }
            if since >= self.cold_after() {
                self.cold.store(true, Ordering::Release);
            }
            // Parked only for a single pending entry: the doorbells ring in the order they
            // were enqueued on the one doorbell stream, so a second entry's could wait behind
            // the first's work while its own has completed. Every earlier doorbell belongs to
            // an entry that has landed (its event completed), so nothing holds this one's.
            let nap = nap(hot_since.elapsed());
            if mine.len() == 1 && mine[0].waits_for_bell() {
                if self.park_for_bell(&mine, nap) {
                    hot_since = Instant::now();
                    spins = 0;
                }
            } else {
                // Parked, not asleep: the teardown's stop ends the nap (as a doorbell does, which
                // only makes the next sweep earlier), so a context's drop does not wait for it.
                crate::sync::park_timeout(nap);
            }
        }
    }

    /// Parks the poller until a doorbell rings, an entry arrives, another doorbell is being
    /// made, the teardown stops it, or `nap` has passed (the next sweep of the flags, which may
    /// see the entry land before its doorbell rings; a doorbell may wait behind another host
    /// function; the health probe). `mine` is one entry that waits for its doorbell. Returns
    /// whether it was woken (not timed out).
    fn park_for_bell(&self, mine: &[Arc<Entry>], nap: Duration) -> bool {
        let rings = self.bell.rings.load(Ordering::SeqCst);
        {
            let mut st = lock(&self.state);
            if !st.incoming.is_empty() || st.making > 0 || self.stop.load(Ordering::Acquire) {
                return true;
            }
            // A doorbell that rang before the count was read is seen here (its entry rung),
            // before the poller reports itself parked for it: a ring is stored before it is
            // counted, so a ring not seen here changes the count read above, and
            // `poller_progress` never reports the poller parked for a doorbell that has rung.
            // (It did, while the poller went from here to the lock below: a test that reads
            // that report failed once in CI on a loaded machine.)
            if !mine.iter().all(|e| e.waits_for_bell()) {
                return true;
            }
            st.bell_parked = Some(rings);
        }
        // A doorbell that rings from here on leaves its unpark's token (the park returns at
        // once). At most a nap: a young entry's flag is read sooner than a doorbell would ring
        // after a long idle, and all host functions of a context run on one driver thread, so a
        // doorbell can wait behind someone else's long host function.
        crate::sync::park_timeout(nap);
        lock(&self.state).bell_parked = None;
        self.bell.rings.load(Ordering::SeqCst) != rings
    }

    /// (passes, idle): the poller's passes over its pending entries so far (each reads every
    /// pending flag once and finishes, waking their wakers, the landed ones), and whether it is
    /// parked or napping warm with nothing pending (napping is set only then: an entry is never
    /// left pending behind an idle report), or parked for the one pending entry's doorbell. For a model that must tell "the poller has looked since
    /// this flag landed" from "it has not run yet", without timing: two more passes than when
    /// the flag was seen to land mean a whole pass began after it.
    #[cfg(feature = "model-hooks")]
    pub(crate) fn poller_progress(&self) -> (u64, bool) {
        let started = lock(&self.thread).is_some();
        let st = lock(&self.state);
        // Parked for a doorbell that has not rung: only a host function (which the model
        // watches), a new entry or doorbell, or the park's bound (a nap, at most 1 ms) can
        // wake it.
        let for_bell = st
            .bell_parked
            .is_some_and(|r| r == self.bell.rings.load(Ordering::SeqCst));
        let idle = (st.parked || st.napping || !started || for_bell) && st.incoming.is_empty();
        (self.passes.load(Ordering::SeqCst), idle)
    }

    /// Whether the poller is cold (new completions get a doorbell). For the model's tests.
    #[cfg(feature = "model-hooks")]
    pub(crate) fn poller_cold(&self) -> bool {
        self.cold.load(Ordering::Acquire)
    }

    /// A pinned staging block of at least `bytes` bytes (the context must be current).
    pub(crate) fn staging(&self, bytes: usize) -> Result<Staging> {
        let class = bytes.max(64).next_power_of_two();
        let mut st = lock(&self.state);
        if let Some(p) = st
            .staging
            .iter_mut()
            .find(|(c, _)| *c == class)
            .and_then(|(_, v)| v.pop())
        {
            return Ok(Staging { addr: p, class });
        }
        // Allocated without the hub's lock (no driver call under it).
        drop(st);
        let p = match pinned::take(&self.home, class, host_alloc_flags::PORTABLE) {
            Some(b) => b.host as *mut u8,
            None => self
                .driver
                .mem_host_alloc(class, host_alloc_flags::PORTABLE)?,
        };
        lock(&self.state).staging_all.push((p as usize, class));
        Ok(Staging {
            addr: p as usize,
            class,
        })
    }

    /// Takes a staging block out of the hub's care: a copy into it may still be pending after
    /// its wait failed. [`KeptStaging`] gives it back once that copy is known complete; until
    /// then the hub's teardown does not free it (nor ever, if that never happens).
    pub(crate) fn detach_staging(self: &Arc<Self>, s: Staging) -> KeptStaging {
        lock(&self.state).staging_all.retain(|&(p, _)| p != s.addr);
        KeptStaging {
            hub: self.clone(),
            staging: Some(s),
        }
    }

    /// Gives a staging block back once `entry`'s write (enqueued after a copy into the block)
    /// has landed: now, or by the poller (a dropped host copy's block).
    pub(crate) fn return_when_landed(self: &Arc<Self>, entry: &Entry, s: Staging) {
        /// Gives the block back when dropped (by the poller, after the write landed).
        struct Back(Option<Staging>, Arc<Hub>);
        impl Drop for Back {
            fn drop(&mut self) {
                if let Some(s) = self.0.take() {
                    self.1.return_staging(s);
                }
            }
        }
        // Given back at once (dropped here, no lock held) if the write has landed.
        drop(entry.keep_until_landed(Box::new(Back(Some(s), self.clone()))));
    }

    pub(crate) fn return_staging(&self, s: Staging) {
        let mut st = lock(&self.state);
        match st.staging.iter_mut().find(|(c, _)| *c == s.class) {
            Some((_, v)) => v.push(s.addr),
            None => st.staging.push((s.class, vec![s.addr])),
        }
    }

    /// Stops the poller, at the start of the context's teardown. Returns whether the calling
    /// thread may wait for the poller to exit ([`Hub::shutdown`]): the poller runs no user code
    /// from now on. Not so on the poller's own thread, nor while the poller runs user code
    /// (a waker), which may wait for the calling thread: then the teardown is run by a thread
    /// of its own, and the poller, which still reads the flags, exits before anything is freed.
    pub(crate) fn stop(&self) -> bool {
        let running = {
            // Under the state lock: the poller checks `stop` under it before it waits and before
            // it runs user code, so the notification below cannot fall between its check and
            // its wait (found by the fuzzer: a lost wake-up hung the teardown), and `running`
            // cannot be set after this.
            let st = lock(&self.state);
            self.stop.store(true, Ordering::Release);
            st.running
        };
        self.cv.notify_all();
        // Parked for a doorbell, or napping between sweeps (a park too): it sees `stop` at once.
        if let Some(t) = self.bell.poller.get() {
            crate::sync::unpark(t);
        }
        !running && !IN_POLLER.try_with(|p| p.get()).unwrap_or(true)
    }

    /// Whether the calling thread is the completion poller of any context.
    pub(crate) fn on_poller_thread() -> bool {
        IN_POLLER.try_with(|p| p.get()).unwrap_or(false)
    }

    /// Waits for the poller to exit (stopping it, if [`Hub::stop`] was not called) and frees the
    /// slabs and staging blocks, at the context's teardown (the context is current, the streams
    /// have been drained). Memory that a write may still target (an entry that has not landed)
    /// is leaked instead of freed. Never on the poller's thread, nor on a thread that a waker the
    /// poller runs may wait for (see [`Hub::stop`]).
    pub(crate) fn shutdown(&self) {
        self.stop();
        if Hub::on_poller_thread() {
            // Never waits for itself (the teardown is handed off the poller's thread before
            // this): leaked rather than freed under the poller.
            return;
        }
        let mut pending = match lock(&self.thread).take() {
            Some(h) => h.join().unwrap_or_default(),
            None => Vec::new(),
        };
        pending.append(&mut lock(&self.state).incoming);
        self.close_bells();
        let mut leak = false;
        for e in pending {
            if e.landed() {
                e.finish(None);
            } else {
                leak = true;
                // The GPU may still write what the entry keeps: never free it.
                std::mem::forget(lock(&e.state).keep.take());
            }
        }
        if leak || self.faulted.load(Ordering::Acquire) {
            return;
        }
        let blocks: Vec<Block> = {
            let mut guard = lock(&self.state);
            let st = &mut *guard;
            let slabs = st.slabs.drain(..).map(|s| Block {
                host: s.host as usize,
                bytes: SLAB_BYTES,
                flags: SLAB_FLAGS,
            });
            let staging = st.staging_all.drain(..).map(|(p, class)| Block {
                host: p,
                bytes: class,
                flags: host_alloc_flags::PORTABLE,
            });
            slabs.chain(staging).collect()
        };
        // Every write into the slabs has landed (no pending entry) and every copy into staging
        // memory has completed, and no future holds the context any more: the blocks go to the
        // context's shelf, for its next state (pinned.rs: a free would wait for every stream
        // of the device). An adopted context's are freed: it may be destroyed after this.
        for b in pinned::give(&self.home, blocks) {
            // SAFETY: as above, nothing uses the block; given back by the shelf, freed once.
            crate::driver::tries(|| unsafe { pinned::free(&*self.driver, b) });
        }
        lock(&self.state).staging.clear();
    }
}

impl Hub {
    /// Synchronizes and destroys the doorbell stream, and destroys the events (at shutdown). A
    /// stream whose synchronize fails (a dead context) is left as it is: its work may be
    /// pending, and only idle streams are destroyed.
    fn close_bells(&self) {
        let bells = std::mem::take(&mut *lock(&self.bells));
        if let Some(s) = bells.stream {
            // SAFETY: the hub's own stream (see `ring_after`), used by no one else now: the
            // poller has exited and no completion is being made (the context is torn down).
            if crate::driver::tries(|| unsafe { self.driver.stream_synchronize(s) }) {
                // SAFETY: as above, and idle.
                crate::driver::tries(|| unsafe { self.driver.stream_destroy(s) });
            }
        }
        for ev in bells.events {
            // SAFETY: the hub's event; the waits on it were made, and their stream is idle or
            // left alone above (destroying an event that a wait names is allowed).
            crate::driver::tries(|| unsafe { self.driver.event_destroy(ev) });
        }
    }
}

/// A staging block that a copy may still write, kept by the context (see
/// [`Hub::detach_staging`]): given back to the hub when dropped, i.e. once the copy is known
/// complete.
pub(crate) struct KeptStaging {
    hub: Arc<Hub>,
    staging: Option<Staging>,
}

impl Drop for KeptStaging {
    fn drop(&mut self) {
        if let Some(s) = self.staging.take() {
            lock(&self.hub.state).staging_all.push((s.addr, s.class));
            self.hub.return_staging(s);
        }
    }
}

/// A pinned staging block, returned to its hub's free list when done.
pub(crate) struct Staging {
    /// The block's host address.
    pub(crate) addr: usize,
    class: usize,
}
