//! A `StreamRef` points at its holder's context and stream instead of counting references to
//! them (issue 22: an owner's `stream()` wrote the context's shared reference count twice). These
//! tests keep references alive across everything that changes the holder's storage or drops the
//! other handles, and use them after: the holder's streams spilling from the owner's inline list
//! to the heap, the user's last `Context` handle dropped, the thread's implicit owner ended, the
//! `Rc` of a shared owner dropped. Each reference must still name its own stream (priority,
//! generation, same-stream identity) and work on it, and nothing may be left behind at the end.

use cuda_stream_pool::driver::{Driver, SimDriver};
use cuda_stream_pool::{end_thread_owner, Context, DeviceBuffer, Priority};
use std::rc::Rc;
use std::sync::Arc;

fn sim() -> (Arc<SimDriver>, Context) {
    let sim = Arc::new(SimDriver::new());
    let d: Arc<dyn Driver> = sim.clone();
    (sim, Context::primary(d, 0).unwrap())
}

/// An owner keeps two streams inline; a third priority moves its list to the heap. References
/// taken before the move must still be valid and name their own streams (a reference that
/// pointed into the list, not at the stream, would read moved-out memory).
#[test]
fn references_survive_the_owners_list_of_streams_growing() {
    let (sim, ctx) = sim();
    let range = ctx.priority_range();
    let o = ctx.owner();
    let mut refs = Vec::new();
    for p in [
        range.least,
        range.least - 1,
        range.least - 2,
        range.greatest,
    ] {
        o.set_priority(Priority::Value(p)).unwrap();
        refs.push((p, o.stream().unwrap()));
    }
    assert_eq!(o.streams().len(), 4);
    for (i, (p, s)) in refs.iter().enumerate() {
        assert_eq!(s.priority(), *p);
        assert!(s.is_current());
        for (j, (_, t)) in refs.iter().enumerate() {
            assert_eq!(s.same_stream(t), i == j, "{i} against {j}");
        }
        // Work through the old reference lands on its stream.
        let b = DeviceBuffer::from_slice(s, &[i as u32; 16]).unwrap();
        assert_eq!(b.to_vec(s).unwrap(), vec![i as u32; 16]);
        s.synchronize().unwrap();
    }
    drop(refs);
    drop(o);
    drop(ctx);
    let st = sim.counters();
    assert_eq!((st.live_streams, st.live_allocs), (0, 0), "{st:?}");
}

/// A reference to the thread's implicit owner's stream outlives the user's last `Context`
/// handle and the end of the implicit owner: it keeps both alive, works, and everything is
/// torn down after it is dropped.
#[test]
fn a_thread_owners_reference_outlives_the_context_handle_and_the_owner() {
    let (sim, ctx) = sim();
    let s = ctx.stream().unwrap();
    let gen = s.generation();
    end_thread_owner(&ctx);
    drop(ctx);
    assert_eq!(s.generation(), gen);
    assert!(s.is_current());
    let b = DeviceBuffer::from_slice(&s, &[7u32; 8]).unwrap();
    assert_eq!(b.to_vec(&s).unwrap(), vec![7; 8]);
    assert_ne!(s.context().raw(), cuda_stream_pool::driver::Context::NULL);
    drop(b);
    assert!(
        sim.counters().live_contexts > 0,
        "the reference keeps the context"
    );
    drop(s);
    let st = sim.counters();
    assert_eq!(
        (st.live_streams, st.live_allocs, st.live_contexts),
        (0, 0, 0),
        "{st:?}"
    );
}

/// `stream_shared`'s reference (and its clones) keep a shared owner alive after the last `Rc`
/// and the context handle are dropped.
#[test]
fn a_shared_owners_reference_outlives_its_rc() {
    let (sim, ctx) = sim();
    let owner = Rc::new(ctx.owner());
    let s = owner.stream_shared().unwrap();
    let t = s.clone();
    drop(owner);
    drop(ctx);
    assert!(s.same_stream(&t));
    drop(s);
    t.synchronize().unwrap();
    assert!(t.is_current());
    drop(t);
    let st = sim.counters();
    assert_eq!((st.live_streams, st.live_contexts), (0, 0), "{st:?}");
}
