//! Fuzzes the pool state machine: the input is decoded (with `arbitrary`) into the same operation
//! sequence as the property test (`tests/model`), applied to the public API over the simulated
//! driver, with the same invariants checked after every step and at teardown.
//!
//!   cargo +nightly fuzz run pool_model                       # from the repository root
//!   cargo +nightly fuzz run pool_model -- -max_total_time=1800
//!
//! The committed corpus (fuzz/corpus/pool_model) is replayed by `cargo test` (tests/fuzz_corpus.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/model/mod.rs"]
mod model;

fuzz_target!(|data: &[u8]| {
    // The model's threads on one CPU for the input (`CSP_FUZZ_PIN=0`: not): see
    // `model::threads::pin_to_current_cpu`.
    let _pin = if std::env::var_os("CSP_FUZZ_PIN").is_some_and(|v| v == "0") {
        None
    } else {
        model::threads::pin_to_current_cpu()
    };
    model::run(data);
});
