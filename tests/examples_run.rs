//! The small examples run to completion (on the simulated driver without a GPU, on the GPU with
//! one): each checks its own results and returns an error otherwise. Nothing ran them before;
//! the async server, which has its own test (`tests/async_server.rs`), had failed at its first
//! driver call for days unnoticed.

#[path = "../examples/thread_owner.rs"]
#[allow(dead_code)]
mod thread_owner;

#[path = "../examples/thread_pool.rs"]
#[allow(dead_code)]
mod thread_pool;

#[path = "../examples/priorities.rs"]
#[allow(dead_code)]
mod priorities;

#[path = "../examples/graph_capture.rs"]
#[allow(dead_code)]
mod graph_capture;

/// One after the other, in one test: on a GPU every example's `Context::primary` joins the one
/// state of the device's primary context in this process, so examples running at once (as
/// separate tests did) saw each other's streams, and the two that check how many streams they
/// created failed on the H100 (`created <= 8`). Each example drops its context at its end, so
/// the next one starts a fresh state.
#[test]
fn the_small_examples_run_one_after_the_other() {
    thread_owner::main().unwrap_or_else(|e| panic!("thread_owner: {e}"));
    thread_pool::main().unwrap_or_else(|e| panic!("thread_pool: {e}"));
    priorities::main().unwrap_or_else(|e| panic!("priorities: {e}"));
    graph_capture::main().unwrap_or_else(|e| panic!("graph_capture: {e}"));
}
