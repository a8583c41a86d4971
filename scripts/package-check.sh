#!/usr/bin/env bash
# Packages both crates, runs the packaged library's tests as packaged (its sys dependency patched
# to the packaged sys crate, since neither is on crates.io yet), and dry-runs the publication of
# both, in order. Used by .ci/run.
#
#   bash scripts/package-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
top=$PWD
excl=()
if cargo metadata --no-deps --format-version 1 | grep -q '"name":"cuda-stream-pool-demo"'; then
  excl=(--exclude cuda-stream-pool-demo)
fi
# `cargo package` verifies the library against the packaged sys crate through a temporary local
# registry whose sources cargo unpacks into $CARGO_HOME/registry/src and never refreshes: a copy
# left by an earlier run of this script would be used instead of the current one. Remove those.
home=${CARGO_HOME:-$HOME/.cargo}
rm -rf "$home"/registry/src/*/cuda-stream-pool-sys-0.1.0 "$home"/registry/src/*/cuda-stream-pool-0.1.0 \
  "$home"/registry/cache/*/cuda-stream-pool-sys-0.1.0.crate "$home"/registry/cache/*/cuda-stream-pool-0.1.0.crate
# Likewise the build of that verification: registry crates are never rebuilt when their source
# changes (cargo treats published versions as immutable), so it runs in a target directory of
# its own, emptied first.
rm -rf target/package target/package-verify
CARGO_TARGET_DIR="$top/target/package-verify" cargo package --workspace "${excl[@]}" --allow-dirty
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf target/package-verify/package/cuda-stream-pool-sys-0.1.0.crate -C "$tmp"
tar xzf target/package-verify/package/cuda-stream-pool-0.1.0.crate -C "$tmp"
cat >> "$tmp/cuda-stream-pool-0.1.0/Cargo.toml" <<'TOML'

[patch.crates-io]
cuda-stream-pool-sys = { path = "../cuda-stream-pool-sys-0.1.0" }
TOML
# The packaged copies build in their own target directory (a fresh build, like a user's).
export CARGO_TARGET_DIR="$top/target/package-check"
(cd "$tmp/cuda-stream-pool-sys-0.1.0" && cargo test)
# The kernel-launching and half-precision tests need the `kernels` and `half` features, which the repository enables for them
# through a self dev-dependency that packaging strips.
(cd "$tmp/cuda-stream-pool-0.1.0" && cargo test --features kernels,model-hooks,half)
CARGO_TARGET_DIR="$top/target/package-verify" cargo publish --workspace "${excl[@]}" --dry-run --allow-dirty
echo "package-check: OK"
