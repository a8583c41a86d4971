#!/usr/bin/env bash
# Checks the declared MSRV: the library (default features) with Rust 1.82, and with the `cudarc`
# feature with Rust 1.88 (cudarc 0.19 depends on libloading 0.9, which needs 1.88). Dependencies
# are resolved for those versions by cargo's MSRV-aware resolver, in a copy of the repository so
# that the committed lockfile is left alone. Installs the toolchains with rustup if needed.
#
#   bash scripts/msrv-check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git ls-files -z | xargs -0 -I{} cp --parents {} "$tmp" 2>/dev/null || true
cp -r cuda-sys "$tmp/" 2>/dev/null || true
cd "$tmp"
rustup toolchain list | grep -q '^1.82' || rustup toolchain install 1.82 --profile minimal
rustup toolchain list | grep -q '^1.88' || rustup toolchain install 1.88 --profile minimal
CARGO_RESOLVER_INCOMPATIBLE_RUST_VERSIONS=fallback cargo update --quiet
export CARGO_TARGET_DIR="$tmp/target"
cargo +1.82 check -p cuda-stream-pool-sys -p cuda-stream-pool --lib
CUDARC_CUDA_VERSION=12080 cargo +1.88 check -p cuda-stream-pool --lib --features cudarc,kernels
echo "msrv-check: OK (library 1.82; with cudarc 1.88)"
