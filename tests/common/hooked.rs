//! The tests' hooked drivers are the library's [`Hooked`] around a [`SimDriver`]: the pausing
//! wrapper (`pausing.rs`) stops one thread at one call; the model's scheduler
//! (`tests/model/sched.rs`) lets one thread at a time make a call.
#![allow(dead_code)]

pub use cuda_stream_pool::driver::{Hook, Hooked};
