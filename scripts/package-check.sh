#!/usr/bin/env bash
# Packages the workspace (the demo too, which is not published), checks what the library's .crate
# holds (no fuzz corpus, CI or data files: a bound on its file count and size), runs the packaged
# library's tests as packaged (its sys dependency patched to the packaged sys crate, since neither
# is on crates.io yet), builds its documentation as docs.rs does, and dry-runs the publication of
# both published crates, in order. Used by .ci/run.
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
CARGO_TARGET_DIR="$top/target/package-verify" cargo package --workspace --allow-dirty
# The library's .crate: the README states its file count and size; more than these bounds means
# the corpus, data or scripts are shipped again (Cargo.toml's `include`).
crate=target/package-verify/package/cuda-stream-pool-0.1.0.crate
files=$(tar tzf "$crate" | grep -vc '/$')
bytes=$(stat -c %s "$crate")
echo "cuda-stream-pool-0.1.0.crate: $files files, $bytes bytes"
if tar tzf "$crate" | grep -E '/(tests/corpus|\.ci|scripts|fuzz)/'; then
  echo "error: the .crate ships the fuzz corpus, CI or scripts" >&2; exit 1
fi
if [ "$files" -gt 200 ] || [ "$bytes" -gt 1048576 ]; then
  echo "error: the .crate has grown past 200 files or 1 MiB; see Cargo.toml's include" >&2; exit 1
fi
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
# docs.rs: the command it runs (nightly, `--cfg docsrs`), with the features of
# [package.metadata.docs.rs], warnings denied, on the packaged crate as docs.rs gets it.
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
feats=$(cd "$tmp/cuda-stream-pool-0.1.0" && cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json,sys; p=json.load(sys.stdin)["packages"][0]; print(",".join(p["metadata"]["docs"]["rs"]["features"]))')
echo "docs.rs features: $feats"
(cd "$tmp/cuda-stream-pool-0.1.0" && CARGO_TARGET_DIR="$top/target/docsrs" \
  RUSTDOCFLAGS="--cfg docsrs -D warnings" cargo +nightly doc --no-deps --features "$feats")
CARGO_TARGET_DIR="$top/target/package-verify" cargo publish --workspace "${excl[@]}" --dry-run --allow-dirty
echo "package-check: OK"
