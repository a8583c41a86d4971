#!/usr/bin/env bash
# Loom's exhaustive checks of the pool's synchronisation (src/pool/loom_tests.rs: the slot word
# and the cap's gate) and of the per-shard references to a context's state (src/refs.rs), under
# every interleaving with at most LOOM_MAX_PREEMPTIONS preemptions (default 4: about 100 s of tests on 2 cores, after the build; 3 takes seconds). A build with
# `--cfg loom`, in a target directory of its own (it shares nothing with the normal build).
set -euo pipefail
cd "$(dirname "$0")/.."
export RUSTFLAGS="--cfg loom ${RUSTFLAGS:-}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/loom}"
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-4}"
# The loom tests only: the crate's other unit tests use std's threads, which cannot touch
# loom's objects.
exec cargo test --release -p cuda-stream-pool --lib loom -- --test-threads 1 "$@"
