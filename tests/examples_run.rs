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

#[test]
fn the_thread_owner_example_runs() {
    thread_owner::main().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_thread_pool_example_runs() {
    thread_pool::main().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_priorities_example_runs() {
    priorities::main().unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn the_graph_capture_example_runs() {
    graph_capture::main().unwrap_or_else(|e| panic!("{e}"));
}
