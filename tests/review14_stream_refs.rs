//! Review 14: `StreamRef` points at its holder's `Context` field and at the slot inside the
//! holder's `Arc` (commit d618eb9) instead of counting references. These tests keep references
//! alive while the holder's state changes around them (its `SmallVec` of held streams spills to
//! the heap, the owner moves in and out of an `Rc`, the thread's implicit owner is ended, the
//! caller's `Context` is dropped) and then use them. On the simulated driver; meant to be run
//! under Miri too (`cargo +nightly miri test --test review14_stream_refs`), whose borrow checks
//! catch a pointer that was invalidated even where a normal run reads the old bytes unchanged.
//!
//! Each would fail (wrong values, or a Miri error) if a reference pointed into the owner's
//! `SmallVec` of held streams instead of at the slot, or at a `Context` other than the one its
//! holder keeps in place.

#[path = "common/futures.rs"]
mod futures_util;

use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::{end_thread_owner, Context, DeviceBuffer, OwnedStream, Priority, StreamRef};
use futures_util::{poll, Noop, Yield};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};

fn sim_ctx() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    (sim, ctx)
}

fn noop() -> Waker {
    Waker::from(Arc::new(Noop))
}

/// What a reference says about its stream, read through its pointers.
fn seen(s: &StreamRef<'_>) -> (cuda_stream_pool::driver::Stream, i32, u64, bool) {
    (s.raw(), s.priority(), s.generation(), s.is_current())
}

// Probes review 14 (d618eb9): a reference must point at the slot, not into the owner's SmallVec.
#[test]
fn references_stay_valid_while_the_owner_takes_more_streams_and_its_held_list_spills() {
    let (sim, ctx) = sim_ctx();
    let owner = ctx.owner();
    let first = owner.stream().unwrap();
    owner.set_priority(Priority::Value(-1)).unwrap();
    let second = owner.stream().unwrap();
    // Two held streams: the `SmallVec<[Held; 2]>` is still inline. Every reference to them
    // (and their clones) is taken now.
    let listed = owner.streams();
    let before: Vec<_> = listed.iter().map(|(_, s)| seen(s)).collect();
    let (a, b) = (seen(&first), seen(&second));
    let first_clone = first.clone();
    // Four more priorities: the held list spills to the heap and grows twice, and the inline
    // area the first two lived in is overwritten by the heap pointer and length.
    for p in [-2, -3, -4, -5] {
        owner.set_priority(Priority::Value(p)).unwrap();
        sim.enqueue_work(owner.stream().unwrap().raw(), 10).unwrap();
    }
    owner
        .with_priority(Priority::Value(0), || {
            sim.enqueue_work(owner.stream().unwrap().raw(), 10).unwrap();
        })
        .unwrap();
    assert_eq!(owner.streams().len(), 6);
    assert_eq!(seen(&first), a);
    assert_eq!(seen(&second), b);
    assert_eq!(seen(&first_clone), a);
    let after: Vec<_> = listed.iter().map(|(_, s)| seen(s)).collect();
    assert_eq!(after, before);
    assert_eq!((a.1, b.1), (0, -1));
    // They still name the owner's streams of those priorities, and work on them.
    owner.set_priority(Priority::Value(0)).unwrap();
    assert!(first.same_stream(&owner.stream().unwrap()));
    assert!(!first.same_stream(&second));
    sim.enqueue_work(first.raw(), 1_000).unwrap();
    assert!(!first.query().unwrap());
    first.synchronize().unwrap();
    assert!(first.query().unwrap());
    second.synchronize().unwrap();
    assert_eq!(first.context().raw(), ctx.raw());
    drop((first, second, first_clone, listed));
    drop(owner);
    assert_eq!(ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): the implicit owner re-entered through the context while a
// reference borrowed from it lives (`with_thread_owner`'s `&Owner` and `Context::set_priority`
// reach the same owner).
#[test]
fn a_with_thread_owner_reference_survives_the_same_owner_growing_through_the_context() {
    let (_sim, ctx) = sim_ctx();
    let ok = ctx
        .with_thread_owner(|o| {
            let s = o.stream().unwrap();
            let before = seen(&s);
            for p in [-1, -2, -3, -4] {
                ctx.set_priority(Priority::Value(p)).unwrap();
                let other = ctx.stream().unwrap();
                assert!(!other.same_stream(&s));
                assert_eq!(other.priority(), p);
            }
            ctx.set_priority(Priority::Normal).unwrap();
            seen(&s) == before && s.same_stream(&ctx.stream().unwrap()) && s.query().unwrap()
        })
        .unwrap();
    assert!(ok);
    end_thread_owner(&ctx);
    assert_eq!(ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): `Context::stream()` must point at the implicit owner's own
// `Context`, not at the one the call was made on (the caller may drop it at once).
#[test]
fn a_thread_stream_outlives_the_context_value_it_was_taken_from() {
    let (sim, ctx) = sim_ctx();
    let keep = ctx.clone();
    // A heap-allocated `Context`, freed right after: a reference pointing at it would dangle.
    let boxed = Box::new(ctx.clone());
    let s = boxed.stream().unwrap();
    drop(boxed);
    drop(ctx);
    assert_eq!(s.context().raw(), keep.raw());
    sim.enqueue_work(s.raw(), 100).unwrap();
    s.synchronize().unwrap();
    end_thread_owner(&keep);
    // The reference keeps the ended owner (and its stream) alive.
    assert_eq!(keep.stats().in_use, 1);
    assert!(s.is_current());
    let next = keep.stream().unwrap();
    assert!(!next.same_stream(&s));
    drop(s);
    drop(next);
    end_thread_owner(&keep);
    assert_eq!(keep.stats().in_use, 0);
}

// Probes review 14 (d618eb9): a shared owner's reference (`StreamRef<'static>`) and its clones,
// after every `Rc` of the owner and every `Context` of the caller is gone.
#[test]
fn shared_references_and_their_clones_outlive_the_owner_rc_and_the_callers_context() {
    let (sim, ctx) = sim_ctx();
    let stats_ctx = Context::primary(sim.clone(), 0).unwrap();
    let owner = Rc::new(ctx.owner());
    let s = owner.stream_shared().unwrap();
    let raw = s.raw();
    let c1 = s.clone();
    drop(owner);
    drop(ctx);
    let c2 = c1.clone();
    drop(s);
    // The capture guard clones the reference (and its keep-alive).
    let g = c2.begin_capture().unwrap();
    drop(c2);
    assert_eq!(g.stream().raw(), raw);
    let graph = g.end().unwrap();
    drop(graph);
    sim.enqueue_work(c1.raw(), 50).unwrap();
    c1.synchronize().unwrap();
    assert_eq!(c1.context().raw(), stats_ctx.raw());
    assert_eq!(stats_ctx.stats().in_use, 1);
    drop(c1);
    assert_eq!(stats_ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): a capture guard of a shared owner outlives every reference and
// the owner's `Rc`.
#[test]
fn a_shared_capture_guard_keeps_its_owner_after_its_rc_and_reference_are_gone() {
    let (_sim, ctx) = sim_ctx();
    let owner = Rc::new(ctx.owner());
    let g = owner.stream_shared().unwrap().begin_capture().unwrap();
    drop(owner);
    assert!(g.stream().is_capturing().unwrap());
    assert_eq!(g.stream().context().raw(), ctx.raw());
    drop(g.end().unwrap());
    assert_eq!(ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): `mem::forget` of a shared reference (or of a guard holding one)
// leaks the owner rather than letting it go while the forgotten pointers exist.
#[test]
fn a_forgotten_shared_reference_leaks_its_owner_instead_of_freeing_it() {
    let (_sim, ctx) = sim_ctx();
    let owner = Rc::new(ctx.owner());
    let s = owner.stream_shared().unwrap();
    std::mem::forget(s.begin_capture().unwrap());
    assert!(s.is_capturing().unwrap());
    drop(s);
    drop(owner);
    // The forgotten clone's keep-alive is never dropped: the stream stays out of the pool.
    assert_eq!(ctx.stats().in_use, 1);
}

// Probes review 14 (d618eb9): `Attached`'s guard moves the owner out of its `Rc` after a poll
// (no reference left), and a later poll puts it in a new `Rc`; references taken in each poll
// see the same stream.
#[test]
fn an_attached_owner_moved_out_of_its_rc_between_polls_keeps_its_stream() {
    let (sim, ctx) = sim_ctx();
    let owner = ctx.owner();
    let mine = owner.stream().unwrap().raw();
    let c = ctx.clone();
    let seen_in_polls = Rc::new(RefCell::new(Vec::new()));
    let log = seen_in_polls.clone();
    let task = owner.attach(async move {
        for _ in 0..3 {
            let s = c.stream().unwrap();
            sim.enqueue_work(s.raw(), 10).unwrap();
            log.borrow_mut().push((s.raw(), s.generation()));
            drop(s);
            Yield(false).await;
        }
    });
    let mut task = Box::pin(task);
    let w = noop();
    let mut polls = 0;
    while poll(task.as_mut(), &w).is_pending() {
        polls += 1;
        // Between polls the owner is back in the future (moved out of the `Rc`).
        let o = task.as_ref().get_ref().owner().unwrap();
        assert_eq!(o.stream().unwrap().raw(), mine);
    }
    assert_eq!(polls, 3);
    let seen = seen_in_polls.borrow();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|&(r, g)| r == mine && g == seen[0].1));
    drop(seen);
    drop(task);
    assert_eq!(ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): a reference that escapes a poll keeps the owner it came from (in
// its `Rc`, never moved); the task goes on with a fresh owner; the escaped reference is used
// after the task is gone.
#[test]
fn a_reference_escaping_an_attached_poll_keeps_its_owner_after_the_task_is_dropped() {
    let (sim, ctx) = sim_ctx();
    let owner = ctx.owner();
    let mine = owner.stream().unwrap().raw();
    let c = ctx.clone();
    let escaped: Rc<RefCell<Vec<StreamRef<'static>>>> = Rc::default();
    let out = escaped.clone();
    let later = Rc::new(RefCell::new(None));
    let later_out = later.clone();
    let task = owner.attach(async move {
        let s = c.stream().unwrap();
        out.borrow_mut().push(s.clone());
        drop(s);
        Yield(false).await;
        // A fresh owner: another stream, ordered after the escaped one.
        *later_out.borrow_mut() = Some(c.stream().unwrap().raw());
    });
    let mut task = Box::pin(task);
    let w = noop();
    assert!(poll(task.as_mut(), &w).is_pending());
    assert!(matches!(poll(task.as_mut(), &w), Poll::Ready(())));
    drop(task);
    let s = escaped.borrow_mut().pop().unwrap();
    assert_eq!(s.raw(), mine);
    assert!(s.is_current());
    assert_ne!(later.borrow().unwrap(), mine);
    assert_eq!(s.context().raw(), ctx.raw());
    sim.enqueue_work(s.raw(), 10).unwrap();
    s.synchronize().unwrap();
    assert_eq!(ctx.stats().in_use, 1);
    drop(s);
    assert_eq!(ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): `Owner` and `OwnedStream` are `Send`: moved to another thread
// between references (never with one), their references there name the same stream.
#[test]
fn owners_and_owned_streams_moved_between_threads_between_references_keep_their_streams() {
    let (_sim, ctx) = sim_ctx();
    let owner = ctx.owner();
    let owned = OwnedStream::new(&ctx, Priority::High).unwrap();
    let (raw_o, gen_o) = {
        let s = owner.stream().unwrap();
        (s.raw(), s.generation())
    };
    let raw_s = owned.stream().raw();
    let (owner, owned) = std::thread::spawn(move || {
        {
            let s = owner.stream().unwrap();
            assert_eq!((s.raw(), s.generation()), (raw_o, gen_o));
            s.synchronize().unwrap();
            let t = owned.stream();
            assert_eq!(t.raw(), raw_s);
            t.wait_for(&s).unwrap();
        }
        (owner, owned)
    })
    .join()
    .unwrap();
    assert_eq!(owner.stream().unwrap().raw(), raw_o);
    assert_eq!(owned.stream().raw(), raw_s);
    drop((owner, owned));
    assert_eq!(ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): a buffer's last use taken through `slot_arc` keeps the stream's
// slot after its owner is gone, and re-using the buffer on the same stream and generation
// (registration skipped) keeps ordering after that stream.
#[test]
fn a_buffers_last_use_keeps_the_slot_of_a_stream_whose_owner_is_gone() {
    let (sim, ctx) = sim_ctx();
    let owner = ctx.owner();
    let s = owner.stream().unwrap();
    let mut b = DeviceBuffer::<u32>::zeroed(&s, 8).unwrap();
    b.fill(&s, 7).unwrap();
    b.fill(&s, 9).unwrap();
    let (raw, gen, _) = b.last_use().unwrap();
    assert_eq!((raw, gen), (s.raw(), s.generation()));
    sim.enqueue_work(s.raw(), 5_000).unwrap();
    drop(s);
    drop(owner);
    // The stream was retired busy; the buffer still names it.
    let (raw2, gen2, _) = b.last_use().unwrap();
    assert_eq!((raw2, gen2), (raw, gen));
    let other = ctx.owner();
    let t = other.stream().unwrap();
    assert_ne!(t.raw(), raw, "a busy retired stream is not handed out");
    assert_eq!(b.to_vec(&t).unwrap(), vec![9; 8]);
    drop(b);
    drop(t);
    drop(other);
    sim.advance(5_000);
    ctx.trim().unwrap();
    assert_eq!(ctx.stats().in_use, 0);
}

// Probes review 14 (d618eb9): a thread's implicit-owner reference kept in a thread-local whose
// destructor uses it while the thread exits (after or before the implicit owner's slot).
#[test]
fn a_thread_local_reference_used_during_thread_exit_teardown() {
    struct UseAtExit(RefCell<Option<StreamRef<'static>>>);
    impl Drop for UseAtExit {
        fn drop(&mut self) {
            if let Some(s) = self.0.borrow_mut().take() {
                s.synchronize().unwrap();
                let _ = s.context().raw();
            }
        }
    }
    thread_local! {
        static KEPT: UseAtExit = const { UseAtExit(RefCell::new(None)) };
    }
    let (_sim, ctx) = sim_ctx();
    let c = ctx.clone();
    std::thread::spawn(move || {
        let s = c.stream().unwrap();
        KEPT.with(|k| *k.0.borrow_mut() = Some(s));
        drop(c);
    })
    .join()
    .unwrap();
    ctx.trim().unwrap();
    assert_eq!(ctx.stats().in_use, 0);
}
