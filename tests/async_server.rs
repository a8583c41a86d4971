//! The async server example (`examples/async_server.rs`, measured on the GPU in BENCHMARKS.md)
//! runs, short, on the simulated driver in every mode, with and without a cap, and verifies every
//! request's result.
//!
//! Regression: it failed at its first driver call with `CUDA_ERROR_INVALID_CONTEXT`
//! (`cuMemGetInfo_v2`) once the crate stopped leaving its context current on the caller's thread;
//! nothing ran it, and a GPU run of issue 22 measured nothing.

#[path = "../examples/async_server.rs"]
#[allow(dead_code)]
mod server;

fn run(mode: &str, cap: usize) {
    let args: Vec<String> = [
        "async_server",
        "--sim",
        "--n",
        "300",
        "--workers",
        "4",
        "--mode",
        mode,
        "--cap",
        &cap.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if let Err(e) = server::run(&args) {
        panic!("async_server --mode {mode} --cap {cap}: {e}");
    }
}

#[test]
fn the_async_server_serves_every_request_in_async_mode() {
    run("async", 0);
}

#[test]
fn the_async_server_serves_every_request_in_async_mode_under_a_cap() {
    run("async", 8);
}

#[test]
fn the_async_server_serves_every_request_with_spawn_blocking() {
    run("blocking", 0);
}

#[test]
fn the_async_server_serves_every_request_on_shared_thread_streams() {
    run("shared", 0);
}

#[test]
fn the_async_server_rejects_bad_arguments() {
    let args: Vec<String> = ["async_server", "--sim", "--mode", "nope"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert!(server::run(&args).is_err());
}
