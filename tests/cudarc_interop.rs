//! The cudarc interop example, as a GPU test.
#![cfg(feature = "cudarc")]

mod common;

#[path = "../examples/cudarc_interop.rs"]
mod example;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cudarc_launches_on_pooled_streams() {
    let _serial = common::gpu_lock();
    example::run().unwrap();
}
