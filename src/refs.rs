//! The crate's own references to a context's state, counted per shard, so that the objects a
//! thread makes and drops all the time (owners, buffers, completions) never write a cache line
//! that every thread writes.
//!
//! A state lives behind an `Arc`. The user's [`Context`](crate::Context) values each hold a
//! strong reference, as before, and are also counted in [`Refs::handles`]. The crate's objects
//! (`CtxRef`, in `ctx_ref.rs`) hold none of their own: each is counted in one shard's word
//! (`owners << 2 | CLOSING | HOLDS`), and a shard with owners holds one strong reference for all
//! of them (`HOLDS`). While user handles exist, a shard keeps that reference when its last owner
//! goes (the next owner on the shard then writes nothing shared). The last handle's drop marks
//! every shard `CLOSING` ([`Refs::handle_dropped`]), giving up the references of the shards
//! without owners; a `CLOSING` shard gives its reference up when its last owner goes
//! ([`Refs::exit`]). So the state's teardown (the `Arc`'s last drop) still comes once neither a
//! handle nor an object is left.
//!
//! **A handle made again** (from an owner's context, or a `Context::primary` that joins a state
//! only objects kept) clears every shard's `CLOSING` ([`Refs::handle_made`]): a shard with
//! owners then keeps its reference past its last owner, a shard that gave its reference up takes
//! one at its next entry. (Review 19: before, a state once without handles stayed `CLOSING` for
//! good, and every owner of it took and gave back the shared count.) Clearing is safe at any
//! moment, since the clearing thread holds a strong reference of its own; a marking still running
//! from the previous last drop may set `CLOSING` again after the clear, which costs speed only.
//! Every clear comes before that handle's own drop, so the next last drop marks after it.
//!
//! **No use after the last access.** An owner's exit is one compare-exchange of its shard's word
//! that both uncounts it and, when it was the last owner of a `CLOSING` shard, takes the shard's
//! reference for the caller to drop: after it the exit touches nothing of the state, which
//! another thread may free from then on. (Review 16 found the first version reading `handles`
//! after its decrement, when nothing kept the state alive any more.) The last handle's drop
//! marks the shards while its own reference keeps the state alive.
//!
//! **Never freed under an owner**: `HOLDS` is cleared only by a compare-exchange that sees no
//! owner (the last owner's exit, or the marking), and an owner is counted before the shard's
//! reference is taken. **No leak**: after the last handle's drop every shard is `CLOSING`
//! (cleared only by a handle made again, whose drop marks them again), so each gives its
//! reference up with its last owner. Checked under every
//! interleaving by loom (`scripts/loom.sh`; the tests below also fail on an access to the counts
//! after the state was freed).
use crate::sync::atomic::{AtomicUsize, Ordering};
use crossbeam_utils::CachePadded;

/// The shard holds a strong reference to the state.
const HOLDS: usize = 1;
/// The last user handle was dropped: the shard's last owner gives its reference up.
const CLOSING: usize = 2;
/// One owner counted in a shard's word.
const ONE: usize = 4;

/// The counts of one state (see the module docs).
pub(crate) struct Refs {
    /// User handles (`Context` values) alive.
    handles: CachePadded<AtomicUsize>,
    /// Per shard: `owners << 2 | CLOSING | HOLDS`.
    shards: Box<[CachePadded<AtomicUsize>]>,
    /// Set by the loom tests when the state they model is freed: every access checks it.
    #[cfg(loom)]
    freed: std::sync::atomic::AtomicBool,
}

impl Refs {
    /// Counts for a state with no handle yet, with `shards` shards (a power of two).
    pub(crate) fn new(shards: usize) -> Refs {
        Refs {
            handles: CachePadded::new(AtomicUsize::new(0)),
            shards: (0..shards.max(1).next_power_of_two())
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect(),
            #[cfg(loom)]
            freed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The result of an access to the counts; under loom, fails if the state was freed when
    /// the access was made (loom runs other threads only at its atomic operations, so nothing
    /// ran between the access and this check).
    #[inline]
    fn at<T>(&self, v: T) -> T {
        #[cfg(loom)]
        assert!(
            !self.freed.load(std::sync::atomic::Ordering::SeqCst),
            "the state's counts were used after it was freed"
        );
        v
    }

    /// A user handle was made (the caller holds a strong reference of its own for it). The
    /// first handle after none clears every shard's `CLOSING`, so that its shards keep their
    /// references again (see the module docs).
    pub(crate) fn handle_made(&self) {
        if self.at(self.handles.fetch_add(1, Ordering::Relaxed)) == 0 {
            for s in self.shards.iter() {
                self.at(s.fetch_and(!CLOSING, Ordering::AcqRel));
            }
        }
    }

    /// A user handle is being dropped (its strong reference is still held, so the state is
    /// alive throughout): returns how many strong references the shards gave up, which the
    /// caller drops (before its own).
    pub(crate) fn handle_dropped(&self) -> usize {
        if self.at(self.handles.fetch_sub(1, Ordering::AcqRel)) != 1 {
            return 0;
        }
        let mut given_up = 0;
        for s in self.shards.iter() {
            let mut w = self.at(s.load(Ordering::Acquire));
            loop {
                let (next, give) = if w & !(HOLDS | CLOSING) == 0 && w & HOLDS != 0 {
                    (CLOSING, true)
                } else {
                    (w | CLOSING, false)
                };
                if next == w {
                    break;
                }
                match self.at(s.compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire))
                {
                    Ok(_) => {
                        given_up += usize::from(give);
                        break;
                    }
                    Err(now) => w = now,
                }
            }
        }
        given_up
    }

    /// Counts an owner in shard `shard` (any number: taken modulo the shards) and returns the
    /// shard to give to [`Refs::exit`]. `take` adds one strong reference and `give_back` drops
    /// one; the caller holds a strong reference (directly or through an owner counted here)
    /// throughout, so `give_back` never drops the last.
    pub(crate) fn enter(
        &self,
        shard: usize,
        take: impl FnOnce(),
        give_back: impl FnOnce(),
    ) -> usize {
        let i = shard & (self.shards.len() - 1);
        let s = &self.shards[i];
        if self.at(s.fetch_add(ONE, Ordering::AcqRel)) & HOLDS == 0 {
            // No reference yet (or one being taken by another owner's entry on this shard):
            // take one; if that other entry set `HOLDS` first, ours is one too many. Counted,
            // this owner keeps the state alive from here on.
            take();
            if self.at(s.fetch_or(HOLDS, Ordering::AcqRel)) & HOLDS != 0 {
                give_back();
            }
        }
        i
    }

    /// An owner of `shard` is gone: whether the caller must drop one strong reference (the
    /// shard's: it was the last owner of a `CLOSING` shard). One successful compare-exchange
    /// uncounts the owner and decides; nothing of the state is touched after it (see the
    /// module docs), so the caller must have taken what it needs (the `Arc`'s pointer) before.
    pub(crate) fn exit(&self, shard: usize) -> bool {
        let s = &self.shards[shard];
        let mut w = self.at(s.load(Ordering::Acquire));
        loop {
            let last = w == ONE | CLOSING | HOLDS;
            let next = if last { CLOSING } else { w - ONE };
            match self.at(s.compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)) {
                Ok(_) => return last,
                Err(now) => w = now,
            }
        }
    }

    /// Shards marked `CLOSING` (a reading), for the crate's tests.
    #[cfg(feature = "model-hooks")]
    pub(crate) fn closing_shards(&self) -> usize {
        self.shards
            .iter()
            .filter(|s| self.at(s.load(Ordering::Acquire)) & CLOSING != 0)
            .count()
    }

    /// Marks the state freed (loom tests): later accesses fail.
    #[cfg(all(test, loom))]
    fn mark_freed(&self) {
        self.freed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Owners counted over all shards (a reading: exact only when nothing moves), for tests.
    #[cfg(all(test, not(loom)))]
    fn owners(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.load(Ordering::Relaxed) >> 2)
            .sum()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// A strong count of the tests: `take` adds one, `drop_one` drops one.
    struct Strong(Cell<usize>);
    impl Strong {
        fn take(&self) {
            self.0.set(self.0.get() + 1)
        }
        fn drop_one(&self) {
            assert!(self.0.get() > 0, "a strong reference dropped twice");
            self.0.set(self.0.get() - 1)
        }
    }

    #[test]
    fn a_shard_keeps_its_reference_while_a_handle_lives_and_gives_it_up_after() {
        let r = Refs::new(4);
        let strong = Strong(Cell::new(1)); // the handle's
        r.handle_made();
        let a = r.enter(1, || strong.take(), || strong.drop_one());
        assert_eq!(
            strong.0.get(),
            2,
            "the shard took a reference for its first owner"
        );
        assert!(
            !r.exit(a),
            "a shard without owners keeps its reference while a handle lives"
        );
        let b = r.enter(1, || strong.take(), || strong.drop_one());
        assert_eq!(strong.0.get(), 2, "the next owner of the shard takes none");
        assert_eq!(r.owners(), 1);
        assert_eq!(
            r.handle_dropped(),
            0,
            "a shard with an owner keeps its reference"
        );
        strong.drop_one(); // the handle's own
        assert_eq!(strong.0.get(), 1);
        assert!(
            r.exit(b),
            "the last owner gives the shard's reference up once no handle lives"
        );
        strong.drop_one();
        assert_eq!(strong.0.get(), 0);
    }

    #[test]
    fn the_last_handle_gives_up_the_references_of_shards_without_owners() {
        let r = Refs::new(4);
        let strong = Strong(Cell::new(1));
        r.handle_made();
        for shard in [0, 1, 2, 5] {
            let i = r.enter(shard, || strong.take(), || strong.drop_one());
            assert!(!r.exit(i));
        }
        assert_eq!(
            strong.0.get(),
            4,
            "shards 0, 1, 2 (and 5 = 1) hold one each"
        );
        r.handle_made();
        assert_eq!(r.handle_dropped(), 0, "not the last handle");
        assert_eq!(r.handle_dropped(), 3);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Every interleaving of owners' entries and exits with the last handle's drop (and a
    //! handle made again from an owner): the state is never freed while an owner or a handle
    //! is counted, and it is freed once all are gone (no reference left behind).
    use super::*;
    use loom::sync::Arc;

    /// The state's strong count and what is alive, as the tests see them.
    struct State {
        refs: Refs,
        strong: AtomicUsize,
        /// Owners and handles alive (counted before they are made, uncounted after they go).
        alive: AtomicUsize,
    }

    impl State {
        fn new() -> Arc<State> {
            let st = State {
                refs: Refs::new(2),
                strong: AtomicUsize::new(1),
                alive: AtomicUsize::new(1),
            };
            st.refs.handle_made();
            Arc::new(st)
        }
        fn take(&self) {
            assert!(
                self.strong.fetch_add(1, Ordering::AcqRel) > 0,
                "a freed state revived"
            );
        }
        fn drop_one(&self) {
            let before = self.strong.fetch_sub(1, Ordering::AcqRel);
            assert!(before > 0, "a strong reference dropped twice");
            if before == 1 {
                assert_eq!(
                    self.alive.load(Ordering::Acquire),
                    0,
                    "the state was freed while an owner or a handle was alive"
                );
                self.refs.mark_freed();
            }
        }
        fn enter(&self, shard: usize) -> usize {
            self.alive.fetch_add(1, Ordering::AcqRel);
            self.refs.enter(shard, || self.take(), || self.drop_one())
        }
        fn exit(&self, i: usize) {
            self.alive.fetch_sub(1, Ordering::AcqRel);
            if self.refs.exit(i) {
                self.drop_one();
            }
        }
        fn drop_handle(&self) {
            self.alive.fetch_sub(1, Ordering::AcqRel);
            for _ in 0..self.refs.handle_dropped() {
                self.drop_one();
            }
            self.drop_one();
        }
        fn make_handle(&self) {
            self.alive.fetch_add(1, Ordering::AcqRel);
            self.take();
            self.refs.handle_made();
        }
        fn freed(&self) -> bool {
            self.strong.load(Ordering::Acquire) == 0
        }
    }

    /// Review 16: an owner's exit racing the last handle's drop. The first version read
    /// `handles` after its decrement uncounted the owner, while the handle's drop could free the
    /// state (the model's `exit` uncounts the owner first, so only an access to the freed
    /// counts, checked by `Refs::live`, can fail here).
    #[test]
    fn loom_refs_an_exit_racing_the_last_handle_uses_nothing_after_it() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let t = {
                let st = st.clone();
                loom::thread::spawn(move || st.exit(a))
            };
            st.drop_handle();
            t.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    #[test]
    fn loom_refs_last_handle_against_owners_exits() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let b = st.enter(1);
            let t1 = {
                let st = st.clone();
                loom::thread::spawn(move || st.exit(a))
            };
            let t2 = {
                let st = st.clone();
                loom::thread::spawn(move || st.exit(b))
            };
            st.drop_handle();
            t1.join().unwrap();
            t2.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    #[test]
    fn loom_refs_owners_entering_one_shard_while_the_last_handle_drops() {
        loom::model(|| {
            let st = State::new();
            // An owner that outlives the handle makes two more on one shard (its thread's).
            let a = st.enter(0);
            let t = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    let b = st.enter(1);
                    st.exit(a);
                    let c = st.enter(1);
                    st.exit(b);
                    st.exit(c);
                })
            };
            // A second handle, whose thread's first entry races with `t`'s on shard 1.
            st.make_handle();
            let u = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    let d = st.enter(1);
                    st.drop_handle();
                    st.exit(d);
                })
            };
            st.drop_handle();
            t.join().unwrap();
            u.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    /// Review 19: a handle made again from an owner clears `CLOSING` while another owner's
    /// exit races the clear: once both are done (and no last drop runs) no shard is `CLOSING`,
    /// and the handle's drop then frees the state.
    #[test]
    fn loom_refs_a_handle_made_again_clears_closing() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let c = st.enter(1);
            st.drop_handle();
            let t = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    st.make_handle();
                    st.exit(a);
                })
            };
            st.exit(c);
            t.join().unwrap();
            let closing = st
                .refs
                .shards
                .iter()
                .filter(|s| s.load(Ordering::SeqCst) & CLOSING != 0)
                .count();
            assert_eq!(closing, 0, "a shard still CLOSING while a handle lives");
            st.drop_handle();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    #[test]
    fn loom_refs_a_handle_made_again_from_an_owner() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let t = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    // `owner.context().clone()`, then an owner of it, then both dropped.
                    st.make_handle();
                    let b = st.enter(0);
                    st.exit(a);
                    st.drop_handle();
                    st.exit(b);
                })
            };
            st.drop_handle();
            t.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    /// Review 20: a handle made again (0 -> 1, clearing) while the previous last drop's marking
    /// still runs, then dropped again (a second marking), with an owner exiting throughout.
    #[test]
    fn loom_refs_review20_clear_races_a_marking_still_running() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let b = st.enter(1);
            let t1 = {
                let st = st.clone();
                loom::thread::spawn(move || st.drop_handle())
            };
            let t2 = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    // From `b`'s context: 0 -> 1 or 1 -> 2, whichever comes.
                    st.make_handle();
                    st.exit(b);
                    st.drop_handle();
                })
            };
            st.exit(a);
            t1.join().unwrap();
            t2.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    /// Review 20: a clear between an entry's `fetch_add(ONE)` and its `fetch_or(HOLDS)` on a
    /// shard that gave its reference up, and that handle's drop marking again.
    #[test]
    fn loom_refs_review20_clear_races_an_entry_taking_the_reference() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let c = st.enter(0);
            st.drop_handle(); // shard 0: 2*ONE|CLOSING|HOLDS, shard 1: CLOSING
            let t = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    st.make_handle(); // from `a`'s context
                    st.drop_handle();
                    st.exit(a);
                })
            };
            let b = st.enter(1); // from `c`'s context
            st.exit(b);
            st.exit(c);
            t.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    /// Review 20: a clear racing the last owner's exit that sees `ONE|CLOSING|HOLDS`, with the
    /// new handle's drop (a marking) racing it as well.
    #[test]
    fn loom_refs_review20_clear_and_drop_race_a_closing_exit() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let c = st.enter(0);
            st.drop_handle(); // shard 0: 2*ONE|CLOSING|HOLDS
            let t = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    st.make_handle(); // from `a`'s context
                    st.exit(a);
                    st.drop_handle();
                })
            };
            st.exit(c);
            t.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }

    /// Review 20: two threads each make a handle from their owner and drop it, twice: 0 -> 1
    /// and 1 -> 0 over and over, clears racing markings.
    #[test]
    fn loom_refs_review20_two_threads_make_and_drop_handles_repeatedly() {
        loom::model(|| {
            let st = State::new();
            let a = st.enter(0);
            let b = st.enter(1);
            st.drop_handle();
            let t = {
                let st = st.clone();
                loom::thread::spawn(move || {
                    for _ in 0..2 {
                        st.make_handle();
                        st.drop_handle();
                    }
                    st.exit(a);
                })
            };
            for _ in 0..2 {
                st.make_handle();
                st.drop_handle();
            }
            st.exit(b);
            t.join().unwrap();
            assert!(st.freed(), "a reference was left behind");
        });
    }
}
