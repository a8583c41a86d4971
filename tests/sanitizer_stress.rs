//! The issue-19 sanitizer stress program (`examples/sanitizer_stress.rs`, run on the GPU under
//! `compute-sanitizer --tool memcheck`) on the simulated driver, short: 16 threads mixing
//! leaked guards, loans with borrower captures, wakers and host functions that drop owners,
//! buffers and contexts, under a cap. It fails on any unexpected error, on a finding of the
//! simulation (race, use after free, a capture-invalidating call outside relaxed mode), or when
//! anything but what was leaked on purpose is left after every handle is gone.

#[path = "../examples/sanitizer_stress.rs"]
#[allow(dead_code)]
mod stress;

fn run(threads: usize, iters: usize, cap: usize, seed: u64) -> stress::Summary {
    run_with(threads, iters, cap, seed, true)
}

fn run_with(threads: usize, iters: usize, cap: usize, seed: u64, gates: bool) -> stress::Summary {
    let cfg = stress::Config {
        threads,
        iters: Some(iters),
        cap,
        sim: true,
        gpu: false,
        seed,
        gates,
        ..stress::Config::default()
    };
    let s = stress::run(&cfg).unwrap_or_else(|e| panic!("{e}"));
    // What the random mix must have exercised (fixed by the seed).
    assert!(s.ops == (threads * iters) as u64, "{s}");
    assert!(
        s.leaked > 0 && s.loans > 0 && s.borrower_captures > 0,
        "{s}"
    );
    assert!(s.refused > 0 && s.captures > 0, "{s}");
    assert!(
        s.waker_drops > 0 && s.host_fn_drops > 0 && s.last_ctx_drops > 0,
        "{s}"
    );
    s
}

#[test]
fn the_sanitizer_stress_passes_on_the_simulation() {
    run(16, 40, 3, 19);
}

#[test]
fn the_sanitizer_stress_passes_with_a_cap_of_one() {
    run(8, 40, 1, 7);
}

// The mode memcheck runs in on the GPU (`--no-gates`: memcheck serializes the device's work, and
// a closed gate stalled every thread then): the same mix, nothing held busy.
#[test]
fn the_sanitizer_stress_passes_without_gates() {
    run_with(16, 40, 3, 7, false);
}
