#!/usr/bin/env bash
# scripts/miri.sh: the tests of the crate's raw pointers under Miri (Stacked Borrows), on the
# simulated driver. `StreamRef` points at its holder's context and stream (src/stream.rs); a
# pointer that loses its provenance or outlives what it points at is undefined behaviour that a
# normal run does not show. Run by CI. Needs the nightly toolchain's `miri` component (installed
# here if missing).
#
#   scripts/miri.sh [TEST ...]      # default: the tests listed below
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^miri' \
  || rustup component add --toolchain nightly miri rust-src
tests=("$@")
((${#tests[@]})) || tests=(stream_ref_lifetimes review14_stream_refs review14_slot_arc handover ctx_refs)
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
# Isolation off: the simulation reads the clock. Permissive provenance: the simulation's device
# memory is addressed by integers (device pointers), which it turns back into host pointers.
# Leaks ignored: the crate's process-wide threads outlive the tests (the simulation counts
# leaked streams, memory and contexts itself).
MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation -Zmiri-permissive-provenance -Zmiri-ignore-leaks}" \
  CARGO_TARGET_DIR=target/miri cargo +nightly miri test "${args[@]}"
