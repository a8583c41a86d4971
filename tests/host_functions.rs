//! Host functions: crate calls made inside one are refused before they touch anything, and
//! leave nothing behind on the driver's host-function thread (which never exits).

use cuda_stream_pool::driver::SimDriver;
use cuda_stream_pool::{Context, Priority};
use std::sync::{mpsc, Arc};

// Regression: issue 19 defect 11 (Context::stream() inside a host function leaks the whole context)
#[test]
fn thread_owner_calls_in_a_host_function_are_refused_and_leak_nothing() {
    let sim = Arc::new(SimDriver::new());
    let ctx = Context::primary(sim.clone(), 0).unwrap();
    let (tx, rx) = mpsc::channel();
    {
        let o = ctx.owner();
        let s = o.stream().unwrap();
        let c2 = ctx.clone();
        s.launch_host_func(move || {
            let r = (
                c2.stream().map(|_| ()).is_err(),
                c2.with_thread_owner(|_| ()).is_err(),
                c2.set_priority(Priority::High).is_err(),
            );
            let _ = tx.send(r);
        })
        .unwrap();
        sim.advance(0);
        s.synchronize().unwrap();
    }
    let refused = rx.recv().unwrap();
    assert_eq!(
        refused,
        (true, true, true),
        "(stream, with_thread_owner, set_priority) in a host function"
    );
    drop(ctx);
    cuda_stream_pool::release_pinned_cache(&*sim).unwrap();
    let c = sim.counters();
    assert_eq!(
        c.live_contexts, 0,
        "the host-function thread's implicit owner keeps the context: {c:?}"
    );
    assert_eq!(c.live_streams, 0, "{c:?}");
}
