#!/usr/bin/env bash
# The model tests (property test and corpus replay) and the thread-based tests, run with two busy
# threads per core beside them: the verdict must be the same as on an idle machine. CI runs it.
#   bash scripts/loaded-tests.sh            # CSP_PROPTEST_CASES defaults to 500 here
set -euo pipefail
cd "$(dirname "$0")/.."
n=$(( $(nproc) * 2 ))
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
# Build first, unloaded (the load is for the tests, not the compiler).
cargo test --no-run -q --test proptest_model --test fuzz_corpus --test backpressure \
  --test async_tasks --test stress_sim --test loans --test completion_doorbell \
  --test completion_doorbell_hostile --test teardown --test teardown_loans
for _ in $(seq "$n"); do
  # Each busy loop ends by itself after 30 minutes, whatever happens to this script.
  timeout 1800 sh -c 'while :; do :; done' &
  pids+=("$!")
done
echo "loaded-tests: $n busy loops on $(nproc) cores"
CSP_PROPTEST_CASES="${CSP_PROPTEST_CASES:-500}" cargo test -q --test proptest_model \
  --test fuzz_corpus --test backpressure --test async_tasks --test stress_sim --test loans \
  --test completion_doorbell --test completion_doorbell_hostile --test teardown --test teardown_loans
