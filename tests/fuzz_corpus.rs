//! Replays every committed fuzz input (tests/corpus/pool_model, which the fuzz crate's
//! fuzz/corpus/pool_model links to, so that the corpus ships with the package) through the same model as the
//! fuzzer, so that a past crash never returns.

mod model;

#[test]
fn replay_fuzz_corpus() {
    // The source tree where the test was built, else the working directory (a test binary
    // carried to another machine runs from the repository root there).
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/pool_model");
    let dir = if built.is_dir() {
        built
    } else {
        std::path::PathBuf::from("tests/corpus/pool_model")
    };
    let mut n = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let bytes = std::fs::read(&path).unwrap();
        let r = std::panic::catch_unwind(|| model::run(&bytes));
        assert!(r.is_ok(), "corpus input {} fails", path.display());
        n += 1;
    }
    assert!(n >= 20, "expected at least 20 corpus inputs, found {n}");
}
