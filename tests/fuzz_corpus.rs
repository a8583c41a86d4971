//! Replays every committed fuzz input (tests/corpus/pool_model, which the fuzz crate's
//! fuzz/corpus/pool_model links to) through the same model as the fuzzer, so that a past crash
//! never returns; then every committed input of the property test (tests/corpus/proptest_model:
//! its failing cases once understood and fixed, see tests/findings/README.md) through the property
//! test's view of the model (`run_with_leaks`: leaked captures included, which the fuzzer's view
//! decodes differently), after the fuzz inputs (a leaked capture leaks its whole context). One
//! test, so that no two models run at once (they share the crate's process-wide counters). The
//! corpus (some 5,000 files) is not in the published crate (Cargo.toml's `include`): there, and
//! only there, the test says so and passes; the model itself still runs there in
//! tests/proptest_model.rs. Every input is replayed and every failing one is reported (one failure
//! does not hide the others); an input that leaves a simulation's host-function thread behind
//! (a leaked simulation whose thread was not ended: one more parked thread per such input in a
//! fuzz campaign) fails too (counted by the simulations themselves, exactly:
//! `SimDriver::live_host_threads`). `CSP_CORPUS_FILTER=PREFIX` replays only the inputs whose file
//! name starts with PREFIX; `CSP_CORPUS_REPEAT=N` replays each N times.

mod model;

use cuda_stream_pool::driver::SimDriver;

/// Whether the simulations' host-function threads are back to `before`
/// ([`SimDriver::live_host_threads`]: the model ends the thread of every simulation it leaks, and
/// a simulation's drop ends its own; one that a host function itself ended returns on its own,
/// so it may take a moment: a hang guard of 60 s).
fn threads_back_to(before: usize) -> bool {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if SimDriver::live_host_threads() <= before {
            return true;
        }
        if std::time::Instant::now() > until {
            return false;
        }
        std::thread::yield_now();
    }
}

/// A corpus directory (relative to the repository root) and the model's view it is replayed
/// through.
type Corpus = (&'static str, fn(&[u8]));

#[test]
fn replay_fuzz_corpus() {
    // The source tree where the test was built, else the working directory (a test binary
    // carried to another machine runs from the repository root there).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // `cargo package` writes Cargo.toml.orig beside the normalized manifest: a packaged copy.
    if !root.join("tests/corpus/pool_model").is_dir() && root.join("Cargo.toml.orig").is_file() {
        eprintln!("the fuzz corpus is not shipped in the package: nothing to replay");
        return;
    }
    let filter = std::env::var("CSP_CORPUS_FILTER").unwrap_or_default();
    let repeat: usize = std::env::var("CSP_CORPUS_REPEAT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    let mut n = 0;
    let mut failed = Vec::new();
    let corpora: [Corpus; 2] = [
        ("tests/corpus/pool_model", model::run),
        ("tests/corpus/proptest_model", model::run_with_leaks),
    ];
    for (sub, run) in corpora {
        let built = root.join(sub);
        let dir = if built.is_dir() {
            built
        } else {
            std::path::PathBuf::from(sub)
        };
        let mut entries: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&filter))
            })
            .collect();
        entries.sort();
        for path in &entries {
            let bytes = std::fs::read(path).unwrap();
            for _ in 0..repeat {
                n += 1;
                let before = SimDriver::live_host_threads();
                if std::panic::catch_unwind(|| run(&bytes)).is_err() {
                    failed.push(path.display().to_string());
                } else if !threads_back_to(before) {
                    failed.push(format!(
                        "{}: a simulation's host-function thread is left behind",
                        path.display()
                    ));
                }
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {n} corpus replays fail:\n{}",
        failed.len(),
        failed.join("\n")
    );
    if filter.is_empty() {
        assert!(n >= 20, "expected at least 20 corpus inputs, found {n}");
    }
}
