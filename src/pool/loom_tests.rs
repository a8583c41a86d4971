//! Loom's exhaustive checks of the pool's synchronisation (`cfg(loom)`: `scripts/loom.sh`).
//!
//! Every lock, atomic, park and unpark of [`Slot`] and [`Gate`] (and of the [`Pool`] paths that
//! drive them) comes from `crate::sync`, which under `cfg(loom)` is loom's: each model below is
//! run under every interleaving of those operations (up to `LOOM_MAX_PREEMPTIONS` preemptions
//! per run), and under every value that loom's memory model lets a load return. The streams come
//! from [`LoomDriver`], whose host functions run on loom threads of their own: the wake-up host
//! functions that a waiter arms on busy retired streams are interleaved like the rest.
//!
//! A waiter that parks and is never unparked is a deadlock to loom (every thread blocked): that
//! is how a lost wake-up fails these tests.

use super::loom_driver::LoomDriver;
use super::*;
use loom::thread as lthread;

fn driver() -> Arc<LoomDriver> {
    Arc::new(LoomDriver::default())
}

fn no_reclaim() {}

/// A context that never dies (the `fault` argument of an acquisition).
fn no_fault() -> Option<crate::Error> {
    None
}

/// (generation, capturing, held, destroyed) of a slot word.
fn decode(w: u64) -> (u64, bool, bool, bool) {
    (w >> 3, w & 0b100 != 0, w & 0b10 != 0, w & 1 != 0)
}

/// The slot word, read without the lock while the stream changes hands under it.
///
/// Thread 1 is the holder of generation 1: it ends its capture, records its last work (a
/// relaxed store, standing for what it enqueued and wrote), and retires the stream. Thread 2 is
/// a search of the pool: under the lock, once the stream is retired, it hands it to a new
/// owner (generation 2). Thread 3 reads the word without the lock (`is_current`,
/// `is_capturing`). What must hold for it:
/// - every word it reads is one that a lock holder published, in the order they published
///   them (one atomic word written under the lock: never the new generation with the old
///   owner's `held` or `capturing` bits, never a step back);
/// - a reader that sees generation 2 current sees that the capture ended and everything the
///   previous owner did before it retired the stream (the word is stored with `Release` and
///   read with `Acquire`: what a new owner's lock-free `is_capturing` checks rely on, and what
///   makes `is_current` a faithful diagnostic);
/// - once generation 2 is seen current, the lock shows generation 2 too.
#[test]
fn loom_slot_word_hand_over() {
    loom::model(|| {
        let slot = Arc::new(Slot::new(Stream(0x10), 0, 0));
        let _ = slot.lock().begin_capture();
        let work = Arc::new(AtomicU64::new(0));
        // The words published, in order: held and capturing; capture ended; retired; handed to
        // generation 2.
        let published = [
            (1, true, true, false),
            (1, false, true, false),
            (1, false, false, false),
            (2, false, true, false),
        ];

        let holder = {
            let (slot, work) = (slot.clone(), work.clone());
            lthread::spawn(move || {
                drop(slot.lock().end_capture());
                work.store(1, Ordering::Relaxed);
                slot.lock().retire();
            })
        };
        let search = {
            let slot = slot.clone();
            lthread::spawn(move || loop {
                let mut st = slot.lock();
                if !st.held {
                    assert_eq!(st.hand_over(), 2);
                    return;
                }
                drop(st);
                lthread::yield_now();
            })
        };
        let reader = {
            let (slot, work) = (slot.clone(), work.clone());
            lthread::spawn(move || {
                let mut last = 0;
                for _ in 0..2 {
                    let w = decode(slot.word.load(Ordering::Acquire));
                    let at = published
                        .iter()
                        .position(|p| *p == w)
                        .unwrap_or_else(|| panic!("a word nobody published: {w:?}"));
                    assert!(
                        at >= last,
                        "the word went back: {:?} after {:?}",
                        published[at],
                        published[last]
                    );
                    last = at;
                }
                if slot.is_current(2) {
                    assert!(
                        !slot.is_capturing(),
                        "generation 2 current, the capture not ended"
                    );
                    assert_eq!(
                        work.load(Ordering::Relaxed),
                        1,
                        "generation 2 current, the previous owner's work not visible"
                    );
                    assert!(!slot.is_current(1));
                    assert!(slot.lock().is_live(2));
                }
            })
        };
        holder.join().unwrap();
        search.join().unwrap();
        reader.join().unwrap();
        assert!(slot.is_current(2) && !slot.is_capturing());
    });
}

/// A released stream comes back while a waiter at the cap (1) fails its attempt and parks:
/// through the pool's lists (`trim` false: a host-function thread's release, which only pushes
/// and notifies) or handed directly to the waiter (`trim` true: its mailbox). The waiter is
/// always served (never parked for good: a deadlock to loom), with that stream in a new
/// generation, current and not capturing when it reads the word without the lock.
fn release_serves_waiter(trim: bool) {
    loom::model(move || {
        let d = driver();
        let pool = Arc::new(Pool::new(0, 0, Some(1)));
        let (slot, gen) = pool
            .acquire(&*d, &no_reclaim, &no_fault, Mode::Wait)
            .unwrap();
        assert_eq!(gen, 1);
        let waiter = {
            let (pool, d) = (pool.clone(), d.clone());
            lthread::spawn(move || {
                let (s, g) = pool
                    .acquire(&*d, &no_reclaim, &no_fault, Mode::Wait)
                    .unwrap();
                assert!(s.is_current(g) && !s.is_capturing());
                (s, g)
            })
        };
        let raw = slot.raw;
        pool.release(&*d, slot, trim);
        let (s, g) = waiter.join().unwrap();
        assert_eq!(
            (s.raw, g),
            (raw, 2),
            "the waiter got the released stream, handed over once"
        );
        assert_eq!(
            pool.gate.live.load(Ordering::Acquire),
            1,
            "no stream beyond the cap"
        );
        assert_eq!(pool.gate.waiting.load(Ordering::Acquire), 0);
        assert_eq!(pool.gate.handed.load(Ordering::Acquire), 0);
    });
}

#[test]
fn loom_gate_release_to_pool_wakes_waiter() {
    release_serves_waiter(false);
}

#[test]
fn loom_gate_release_hands_to_waiter() {
    release_serves_waiter(true);
}

/// Waits (yielding to loom) until `n` acquisitions wait at the gate.
fn until_waiting(pool: &Pool, n: usize) {
    while pool.gate.waiting.load(Ordering::SeqCst) != n {
        lthread::yield_now();
    }
}

/// Two waiters at the cap (1), queued in a known order; the holder releases once, and each
/// waiter releases what it got. They are served in queue order (FIFO), the stream is never held
/// by two of them at once, and each holding is a new generation.
fn waiters_fifo(trim: bool) {
    loom::model(move || {
        let d = driver();
        let pool = Arc::new(Pool::new(0, 0, Some(1)));
        let (slot, _) = pool
            .acquire(&*d, &no_reclaim, &no_fault, Mode::Wait)
            .unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let holders = Arc::new(AtomicUsize::new(0));
        let spawn = |name: char| {
            let (pool, d, order, holders) =
                (pool.clone(), d.clone(), order.clone(), holders.clone());
            lthread::spawn(move || {
                let (s, g) = pool
                    .acquire(&*d, &no_reclaim, &no_fault, Mode::Wait)
                    .unwrap();
                assert_eq!(
                    holders.fetch_add(1, Ordering::SeqCst),
                    0,
                    "a stream held by two waiters"
                );
                assert!(s.is_current(g));
                order.lock().push((name, g));
                holders.fetch_sub(1, Ordering::SeqCst);
                pool.release(&*d, s, trim);
            })
        };
        let first = spawn('a');
        until_waiting(&pool, 1);
        let second = spawn('b');
        until_waiting(&pool, 2);
        pool.release(&*d, slot, trim);
        first.join().unwrap();
        second.join().unwrap();
        assert_eq!(
            *order.lock(),
            [('a', 2), ('b', 3)],
            "served in queue order, one generation each"
        );
        assert_eq!(pool.gate.live.load(Ordering::Acquire), 1);
    });
}

#[test]
fn loom_gate_waiters_fifo_through_pool() {
    waiters_fifo(false);
}

#[test]
fn loom_gate_waiters_fifo_handed() {
    waiters_fifo(true);
}
